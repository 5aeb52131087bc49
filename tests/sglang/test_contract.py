"""The contract fixtures against the real thing: the requests the contract suite sends engine_sim, sent to the
real prefill/decode pair of the shared stack (tests/sglang/contract_probe.py), every answer checked against the
fixture's shape with no Poise extension or omission allowed, and against the answers recorded from SGLang 0.5.23
on this CPU (tests/contract/fixtures/sglang-0.5.23-cpu/)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.cli.stack import Stack
from tests.sglang.contract_probe import Pair, probe

pytestmark = pytest.mark.sglang
RECORDED = Path(__file__).resolve().parents[1] / "contract" / "fixtures" / "sglang-0.5.23-cpu"


def _keys(value: object) -> object:
    """The key structure of a JSON value (values dropped), to compare a live answer with a recorded one."""
    if isinstance(value, dict):
        return {k: _keys(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [_keys(value[0])] if value else []
    return type(value).__name__ if value is not None else "null"


def test_real_answers_match_the_fixtures_and_the_recording(pd_stack: Stack) -> None:
    assert pd_stack.credentials is not None
    results = probe(Pair(pd_stack.engines["p0"], pd_stack.engines["d0"], pd_stack.bootstrap_ports["p0"],
                         pd_stack.credentials.engine_api_key))
    mismatches = {name: r["mismatches"] for name, r in results.items() if r["mismatches"]}
    assert not mismatches, json.dumps(mismatches, indent=1)
    for name in ("completion", "chat", "v1_loads_decode", "server_info_decode", "error_empty_prompt",
                 "role_switch_to_decode_without_graph_memory"):
        recorded = json.loads((RECORDED / f"{name}.json").read_text())
        live = results[name]["answer"]
        if name.startswith("server_info"):  # paths, ports and times are this run's; the keys are SGLang's
            assert set(live) == set(recorded), set(live) ^ set(recorded)
        else:
            assert _keys(live) == _keys(recorded), name
    assert results["role_switch_to_decode_without_graph_memory"]["status"] == 400
