"""Goodput search on the simulator: brackets the 90% point, static-best beats the even split, files written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loadgen.sim.baselines import make_mix
from loadgen.sim.goodput import search_goodput, static_best
from loadgen.sim.run import simulate
from loadgen.slo import slo_for
from loadgen.traces import load_trace
from shared.latency import LatencyModel, load_profile

MODEL = LatencyModel(load_profile())


@pytest.fixture(scope="module")
def code_slice():  # type: ignore[no-untyped-def]
    return load_trace("azure-conv").slice(0.0, 120.0)


def test_goodput_brackets_the_target(code_slice) -> None:  # type: ignore[no-untyped-def]
    slo = slo_for("azure-conv")
    result = search_goodput(code_slice, lambda: make_mix("static-minload", 4), MODEL, slo)
    assert result.goodput_scale > 0
    passing = [p for p in result.points if p.attainment >= 0.9]
    failing = [p for p in result.points if p.attainment < 0.9]
    assert max(p.rate_scale for p in passing) == pytest.approx(result.goodput_scale)
    assert failing and min(p.rate_scale for p in failing) > result.goodput_scale
    # Re-simulating at the goodput scale reproduces a passing attainment (determinism).
    again = simulate(code_slice, make_mix("static-minload", 4), MODEL, slo, rate_scale=result.goodput_scale)
    assert again.summary.slo_attainment >= 0.9


def test_static_best_is_at_least_every_split(code_slice) -> None:  # type: ignore[no-untyped-def]
    slo = slo_for("azure-conv")
    best = static_best(code_slice, 4, MODEL, slo, bisections=3)
    even = search_goodput(code_slice, lambda: make_mix("static-minload", 4, "2P2D"), MODEL, slo, bisections=3)
    assert best.policy == "static-best" and best.goodput_scale >= even.goodput_scale


def test_goodput_command_writes_table_json_and_plot(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "sim", "goodput", "--trace", "azure-conv", "--duration-s", "60",
         "--instances", "4", "--policies", '["colocated", "static-minload"]', "--out-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "| static-minload |" in proc.stdout and "| colocated |" in proc.stdout
    doc = json.loads((tmp_path / "goodput.json").read_text())
    assert {r["policy"] for r in doc["results"]} == {"colocated", "static-minload"}
    assert (tmp_path / "goodput.png").stat().st_size > 20_000


def test_a_light_trace_reports_a_lower_bound() -> None:
    sparse = load_trace("azure-code").slice(0.0, 180.0)  # 63 requests: no rate breaks the SLO
    result = search_goodput(sparse, lambda: make_mix("static-minload", 4), MODEL, slo_for("azure-code"), max_scale=16)
    assert result.capped and result.goodput_scale == 16
