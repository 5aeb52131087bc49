"""The dev stack's policy and SLO flags: validated up front, and the SLO follows the trace `poise run` replays."""

from __future__ import annotations

import pytest

from services.cli.main import RunSettings
from services.cli.stack import StackSettings
from shared.errors import ConfigError
from shared.settings import load_settings, parse_settings


def test_up_plans_for_arrow_table1_azure_conv_by_default() -> None:
    s = load_settings(StackSettings)
    assert (s.planner_policy, s.dispatch_policy) == ("static", "least-load")
    assert s.planning_slo() == (2.0, 0.15)


def test_run_plans_for_the_traces_slo_unless_told_otherwise() -> None:
    assert parse_settings(RunSettings, ["--trace", "azure-code"]).planning_slo() == (3.0, 0.1)
    assert parse_settings(RunSettings, ["--trace", "azure-code", "--slo-tpot-s", "0.05"]).planning_slo() == (3.0, 0.05)
    assert parse_settings(RunSettings, ["--trace", "some/file.jsonl"]).planning_slo() == (2.0, 0.15)
    s = parse_settings(RunSettings, ["--planner-policy", "poise", "--dispatch-policy", "arrow"])
    assert (s.planner_policy, s.dispatch_policy) == ("poise", "arrow")


@pytest.mark.parametrize("field", ["planner_policy", "dispatch_policy"])
def test_unknown_policies_fail_before_anything_starts(field: str) -> None:
    with pytest.raises(ConfigError, match="unknown"):
        load_settings(StackSettings, **{field: "nope"})
