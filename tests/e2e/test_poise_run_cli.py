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
    assert "SLO attainment" in proc.stdout  # the report table
    doc = json.loads((out / "report.json").read_text())
    assert doc["summary"]["requests_failed"] == 0 and doc["summary"]["requests_total"] > 0
    assert doc["command"].startswith("poise run")
    assert (out / "report.png").stat().st_size > 10_000 and (out / "report.md").exists()
    # Nothing of the stack is left running: every process logged to the run dir and is gone.
    leftovers = subprocess.run(["pgrep", "-f", str(tmp_path / "run")], capture_output=True, text=True).stdout
    assert leftovers.strip() == ""
