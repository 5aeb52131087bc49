"""A role flip's rules (``shared.policies.flip``), which the sidecar, the planner and the simulator share."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from shared.policies.flip import Flip, drain_deadline_s, drained_by_migration, is_restart

REPO = Path(__file__).resolve().parents[2]


def test_only_a_move_into_or_out_of_colocated_serving_restarts_the_engine() -> None:
    assert not is_restart("prefill", "decode") and not is_restart("decode", "prefill")
    assert is_restart("null", "prefill") and is_restart("decode", "null")


def test_a_commands_drain_bound_never_passes_the_sidecars_own() -> None:
    assert drain_deadline_s(10.0, 60.0) == 10.0
    assert drain_deadline_s(600.0, 60.0) == 60.0
    assert drain_deadline_s(0.0, 60.0) == 60.0  # the command gave none


def test_only_a_decode_instance_is_emptied_by_migration() -> None:
    assert drained_by_migration(True, "decode", "prefill") and drained_by_migration(True, "decode", "null")
    assert not drained_by_migration(True, "prefill", "decode") and not drained_by_migration(True, "null", "decode")
    assert drained_by_migration(True, None, "prefill")  # its role unknown: only a decode instance becomes prefill
    assert not drained_by_migration(True, None, "decode") and not drained_by_migration(False, "decode", "prefill")


def test_a_flip_drains_then_switches_and_serves_in_the_new_role() -> None:
    flip = Flip("decode", "prefill", 100.0, 30.0)
    assert (flip.stage, flip.role, flip.deadline_s, flip.restart) == ("draining", "decode", 130.0, False)
    assert not flip.expire(129.9)  # drained in time: the deadline does nothing
    flip.drained()
    assert (flip.stage, flip.role) == ("switching", "decode")
    assert not flip.expire(131.0), "a switch under way is past the drain: its deadline no longer applies"
    assert flip.switched() == "prefill" and (flip.stage, flip.outcome, flip.role) == ("ready", "switched", "prefill")
    assert Flip("null", "decode", 0.0).restart and Flip("null", "decode", 0.0).deadline_s == 60.0


def test_a_drain_past_its_deadline_calls_the_flip_off_and_a_failure_keeps_the_old_role() -> None:
    flip = Flip("prefill", "decode", 0.0, 10.0)
    assert flip.expire(10.0) and (flip.stage, flip.outcome, flip.role) == ("ready", "called_off", "prefill")
    with pytest.raises(RuntimeError, match="called_off"):
        flip.drained()  # the instance went idle after the flip was called off: nothing to switch
    failed = Flip("prefill", "null", 0.0, 10.0)
    failed.drained()
    assert failed.failed() == "prefill" and (failed.stage, failed.outcome) == ("ready", "failed")
    with pytest.raises(RuntimeError):
        failed.switched()
    with pytest.raises(ValueError):
        Flip("decode", "decode", 0.0)
    with pytest.raises(ValueError):
        Flip("decode", "prefill", 0.0, 0.0)


def test_the_sidecar_the_planner_and_the_simulator_take_the_rules_from_one_module() -> None:
    for rel, needed in (("services/worker/role_switch.py", {"Flip", "drain_deadline_s"}),
                        ("services/planner/service.py", {"drained_by_migration"}),
                        ("services/migrator/service.py", {"Evacuation"}),
                        ("loadgen/sim/cluster.py", {"Flip", "drained_by_migration", "Evacuation"})):
        tree = ast.parse((REPO / rel).read_text())
        called = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
        assert needed <= called, f"{rel} does not call {sorted(needed - called)}"
    twins = []
    for path in (REPO / d for d in ("services", "loadgen", "shared")):
        for py in path.rglob("*.py"):
            rel = py.relative_to(REPO).as_posix()
            for node in ast.walk(ast.parse(py.read_text())):
                # The restart rule spelt out again: "null" tested against a pair of roles.
                if (isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant) and node.left.value == "null"
                        and isinstance(node.ops[0], ast.In) and isinstance(node.comparators[0], ast.Tuple)
                        and rel != "shared/policies/flip.py"):
                    twins.append(f"{rel}:{node.lineno}")
                if isinstance(node, ast.FunctionDef) and node.name in ("is_restart", "drained_by_migration") \
                        and rel != "shared/policies/flip.py":
                    twins.append(f"{rel}:{node.lineno}: def {node.name}")
    assert not twins, f"a flip rule written outside shared/policies/flip.py: {twins}"
