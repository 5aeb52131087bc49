"""The worker's ``sglang.launch_server`` command lines against SGLang 0.5.23's options (cli_flags.json, generated
from the wheel's ``ServerArgs`` source): every option exists under its full name, takes a value exactly when
SGLang's parser expects one, and the value has the right type or is one of the choices."""

from __future__ import annotations

import argparse
import itertools
from typing import Any

import pytest

from services.worker.config import WorkerSettings
from services.worker.launcher import SGLANG_OPTIONS, build_engine_command
from shared.settings import load_settings
from tests.contract.shapes import fixture

OPTIONS: dict[str, dict[str, Any]] = fixture("cli_flags")["options"]

CASES = [
    dict(role=role, transfer_backend=backend, tp=tp, return_hidden_states=hidden, **more)
    for (role, backend, tp, hidden), more in itertools.product(
        itertools.product(["prefill", "decode", "null"], ["mooncake", "mooncake_tcp", "nixl"], [1, 8],
                          ["off", "last", "full"]),
        [{}, {"model": "llama-8b", "mem_fraction_static": 0.85}],
    )
] + [dict(role="prefill", transfer_backend="nixl", ib_device="mlx5_0,mlx5_1", tp=4),
     dict(role="decode", transfer_backend="mooncake", ib_device='{"0": "mlx5_0", "1": "mlx5_2"}', tp=2),
     dict(role="decode", transfer_backend="mooncake", enable_pd_role_switch=False),
     # a random key may start with "-", which argparse would read as an option given as a separate token
     dict(role="prefill", transfer_backend="mooncake", engine_api_key="-k3y_with-dash"),
     # the sglang-cpu preset's CPU options, in each role
     *(dict(role=role, engine_preset="sglang-cpu") for role in ("prefill", "decode", "null"))]


def _argv(case: dict[str, Any]) -> list[str]:
    settings = load_settings(WorkerSettings, instance_id="w0", engine_kind="sglang", model_path="/models/llama",
                             engine_port=30000, bootstrap_port=8998, **case)
    cmd = build_engine_command(settings, python="python")
    assert cmd is not None and cmd[1:3] == ["-m", "sglang.launch_server"]
    assert cmd[0] == (settings.sglang_python or "python")
    return cmd[3:]


def _parser() -> argparse.ArgumentParser:
    """SGLang's options as argparse sees them, without abbreviations (full names only)."""
    parser = argparse.ArgumentParser(allow_abbrev=False, add_help=False)
    by_canonical: dict[str, list[str]] = {}
    for name, spec in OPTIONS.items():
        by_canonical.setdefault(spec["canonical"] + "|" + str(spec["field"]), []).append(name)
    for names in by_canonical.values():
        spec = OPTIONS[names[0]]
        kw: dict[str, Any] = {"dest": spec["field"] or names[0].lstrip("-").replace("-", "_")}
        if spec["kind"] == "flag":
            kw["action"] = "store_true"
        elif spec["kind"] == "list":
            kw["nargs"] = spec.get("nargs", "+")
        elif spec["kind"] == "value":
            kw["type"] = {"int": int, "float": float}.get(spec.get("type", "str"), str)
            if spec.get("choices"):
                kw["choices"] = spec["choices"]
            if spec.get("nargs"):
                kw["nargs"] = spec["nargs"]
        else:  # a custom action (LoRA paths): takes values
            kw["nargs"] = "*"
        parser.add_argument(*names, **kw)
    return parser


def test_every_option_the_launcher_can_emit_is_cited_with_sglangs_own_source() -> None:
    for option, cited in SGLANG_OPTIONS.items():
        assert option in OPTIONS, f"{option} is not an option of sglang 0.5.23"
        assert OPTIONS[option]["canonical"] == option, f"{option} is an alias of {OPTIONS[option]['canonical']}"
        assert OPTIONS[option]["source"].startswith(cited + " "), f"{option}: cited {cited}, fixture says " \
                                                                  f"{OPTIONS[option]['source']}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{v}" for v in c.values()))
def test_command_line_parses_as_sglang_would(case: dict[str, Any]) -> None:
    argv = _argv(case)
    i = 0
    seen: set[str] = set()
    while i < len(argv):
        option, inline, inline_value = argv[i].partition("=")
        assert option.startswith("--") and option in SGLANG_OPTIONS, f"unexpected token {option!r} in {argv}"
        assert option in OPTIONS and option not in seen, option
        seen.add(option)
        spec = OPTIONS[option]
        has_value = bool(inline) or (i + 1 < len(argv) and not argv[i + 1].startswith("-"))
        if spec["kind"] == "flag":
            assert not has_value, f"{option} takes no value ({spec['source']})"
            i += 1
            continue
        assert spec["kind"] == "value" and has_value, f"{option} needs a value ({spec['source']})"
        value = inline_value if inline else argv[i + 1]
        # raises on a wrong type; SGLang's human_readable_int also takes "16k", the launcher writes digits
        {"int": int, "float": float, "str": str, "custom:human_readable_int": int}[spec["type"]](value)
        if spec.get("choices"):
            assert value in spec["choices"], f"{option} {value!r} not in {spec['choices']}"
        i += 1 if inline else 2
    # And argparse, given every 0.5.23 option (full names only), accepts the whole line.
    parsed = _parser().parse_args(argv)
    assert parsed.model_path == "/models/llama" and parsed.tp_size == case.get("tp", 1)
    if "engine_api_key" in case:
        assert parsed.api_key == case["engine_api_key"]
    assert parsed.enable_metrics is True
    if case["role"] != "null":
        assert parsed.disaggregation_mode == case["role"]
        assert parsed.disaggregation_bootstrap_port == 8998
        assert parsed.disaggregation_transfer_backend == case.get("transfer_backend", "mooncake_tcp")


def test_abbreviations_are_not_relied_on() -> None:
    """``--tp`` parses in 0.5.23 only because argparse expands an unambiguous prefix (to ``--tp-size``); the
    launcher must never depend on that."""
    assert "--tp" not in OPTIONS and [o for o in OPTIONS if o.startswith("--tp")] == ["--tp-size"]
    for case in CASES:
        assert all(tok.partition("=")[0] in OPTIONS for tok in _argv(case) if tok.startswith("--"))
