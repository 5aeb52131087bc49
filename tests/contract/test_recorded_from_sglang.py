"""engine_sim against answers recorded from a running SGLang 0.5.23 (tests/contract/fixtures/sglang-0.5.23-cpu/,
written by tests/sglang/contract_probe.py on this CPU): the same requests to engine_sim's prefill/decode pair
give answers of the same shape, key for key, but for the documented Poise extensions and omissions
(tests/contract/extensions.py). The real-SGLang tier checks the other half: the real server against the same
fixtures."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.contract.conftest import Engines
from tests.contract.extensions import EXTENSIONS, METRIC_EAGER, OMISSIONS
from tests.sglang.contract_probe import Pair, probe

RECORDED = Path(__file__).resolve().parent / "fixtures" / "sglang-0.5.23-cpu"
# Keys of the recorded objects engine_sim may add or leave out, by where they are (extensions.py names them by
# the fixture's object names)
SERVER_INFO_OWN = EXTENSIONS["ServerInfo"] | OMISSIONS["ServerInfo"]


def _keys(value: Any, skip: frozenset[str] = frozenset()) -> Any:
    if isinstance(value, dict):
        return {k: _keys(v) for k, v in sorted(value.items()) if k not in skip}
    if isinstance(value, list):
        return [_keys(value[0], skip)] if value else []
    return "value"


def test_engine_sim_answers_the_probes_as_the_fixtures_allow(engines: Engines) -> None:
    results = probe(Pair(engines.prefill.url, engines.decode.url, engines.prefill.bootstrap_port),
                    extensions=EXTENSIONS, omissions=OMISSIONS)
    metrics = results.pop("metrics_decode")
    mismatches = {name: r["mismatches"] for name, r in results.items() if r["mismatches"]}
    assert not mismatches, json.dumps(mismatches, indent=1)
    # every sglang: sample engine_sim exports, the real decode engine exported too, but the eager families
    real_metrics = set(json.loads((RECORDED / "metrics_decode.json").read_text()))
    extra = {n for n in set(metrics["answer"]) - real_metrics
             if not any(n == f or n.startswith(f + "_") for f in METRIC_EAGER)}
    assert not extra, extra
    for name in ("completion", "chat", "error_empty_prompt", "role_switch_to_decode_without_graph_memory"):
        recorded, live = json.loads((RECORDED / f"{name}.json").read_text()), results[name]["answer"]
        for answer in (recorded, live):  # an object with --enable-cache-report (the recording's), else null
            (answer.get("usage") or {}).pop("prompt_tokens_details", None)
        assert _keys(live) == _keys(recorded), name
        assert results[name]["status"] == (400 if name.startswith(("error", "role_switch")) else 200), name
    real_info = json.loads((RECORDED / "server_info_decode.json").read_text())
    sim_info = results["server_info_decode"]["answer"]
    # engine_sim carries the keys the control plane reads; what SGLang has beyond them is listed, not assumed
    assert not (set(sim_info) - set(real_info) - SERVER_INFO_OWN), set(sim_info) - set(real_info)
