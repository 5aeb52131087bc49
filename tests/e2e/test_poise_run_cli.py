"""``poise run`` as a user runs it: one command brings the stack up, replays, reports and shuts down."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e


def test_poise_run_replays_and_cleans_up(tmp_path: Path) -> None:
    out = tmp_path / "report"
    cmd = [sys.executable, "-m", "services.cli", "run", "--trace", "azure-code", "--duration-s", "20",
           "--rate-scale", "2", "--gateway-port", "0", "--monitor-port", "0", "--run-dir", str(tmp_path / "run"),
           "--out-dir", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "first token served" in proc.stderr and "stack stopped" in proc.stderr
    assert "planner policy poise, dispatch arrow" in proc.stderr  # the default: the P:D controller's mix
    assert "SLO attainment" in proc.stdout  # the report table
    doc = json.loads((out / "report.json").read_text())
    assert doc["summary"]["requests_failed"] == 0 and doc["summary"]["requests_total"] > 0
    assert doc["command"].startswith("poise run")
    assert (out / "report.png").stat().st_size > 10_000 and (out / "report.md").exists()
    # The split over time: recorded live (as the admin user, auth on) and simulated for the same slice.
    split = json.loads((out / "split.json").read_text())
    assert split["live"]["samples"][0]["prefill"] == 2 and split["live"]["samples"][0]["decode"] == 2
    assert [s["key"] for s in split["simulated"]] == ["poise", "fixed", "static"]
    assert split["live"]["decision_latency"]["decisions"] >= 1  # asked of the planner when the watcher stopped
    assert (out / "split.png").stat().st_size > 10_000
    report = (out / "report.md").read_text()
    assert "**Live** (this run): SLO attainment" in report and "**Simulated**" in report
    assert "**Live** (this run)" in proc.stdout and "(split.png)" in report
    assert "**Planner decisions**" in report
    # Nothing of the stack is left running: every process logged to the run dir and is gone.
    leftovers = subprocess.run(["pgrep", "-f", str(tmp_path / "run")], capture_output=True, text=True).stdout
    assert leftovers.strip() == ""


def test_poise_run_beside_a_cpu_bound_job_paces_itself_and_passes(tmp_path: Path) -> None:
    # A user's laptop with other work running: one core spinning for the whole run.
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        out = tmp_path / "report"
        cmd = [sys.executable, "-m", "services.cli", "run", "--trace", "azure-code", "--duration-s", "30",
               "--rate-scale", "2", "--gateway-port", "0", "--monitor-port", "0", "--run-dir", str(tmp_path / "run"),
               "--out-dir", str(out), "--no-compare"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                              env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    finally:
        burner.kill()
        burner.wait()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "this machine is busy" in proc.stderr, proc.stderr[-3000:]
    doc = json.loads((out / "report.json").read_text())
    assert doc["summary"]["requests_total"] > 0
    assert doc["config"]["rate_scale"] < 2, doc["config"]
