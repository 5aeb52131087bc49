"""Report files (json/md/png) and the terminal table."""

from __future__ import annotations

from pathlib import Path

import msgspec

from loadgen.metrics import summarize
from loadgen.records import RequestRecord
from loadgen.replay import ReplayResult
from loadgen.report import format_table, write_report
from loadgen.slo import SLO


def _result() -> ReplayResult:
    records = []
    for i in range(40):
        sent = i * 0.1
        records.append(
            RequestRecord(
                index=i,
                rid=f"r{i}",
                arrival_s=sent,
                sent_s=sent + 0.001,
                first_token_s=None if i == 7 else sent + 0.05 + 0.01 * i,
                finished_s=sent + 0.5,
                input_tokens=100,
                output_tokens_expected=10,
                output_tokens_received=0 if i == 7 else 10,
                status="error" if i == 7 else "ok",
                error="HTTP 400: too long | really" if i == 7 else None,
                http_status=400 if i == 7 else 200,
                token_times_s=[] if i == 7 else [sent + 0.05 + 0.01 * i + 0.04 * k for k in range(10)],
            )
        )
    slo = SLO(ttft_s=0.3, tpot_s=0.05)
    return ReplayResult(
        records=records,
        summary=summarize(records, slo, wall_s=4.5),
        wall_s=4.5,
        started_at="2025-01-01T00:00:00+00:00",
        config={"workload": "test", "rate_scale": 1.0},
    )


def test_write_report_files(tmp_path: Path) -> None:
    result = _result()
    files = write_report(result, tmp_path / "out", title="Test run", command=["poise", "bench", "--rate", "2"])
    assert files.json.is_file() and files.md.is_file() and files.png.is_file()
    assert files.png.stat().st_size > 10_000
    assert files.png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    doc = msgspec.json.decode(files.json.read_bytes())
    assert doc["title"] == "Test run" and doc["command"] == "poise bench --rate 2"
    assert len(doc["records"]) == 40 and doc["records"][7]["status"] == "error"
    assert doc["summary"]["requests_failed"] == 1
    assert doc["config"]["workload"] == "test"
    # The summary can be recomputed from the JSON records alone.
    records = msgspec.json.decode(msgspec.json.encode(doc["records"]), type=list[RequestRecord])
    assert msgspec.to_builtins(summarize(records, SLO(0.3, 0.05), doc["wall_s"])) == doc["summary"]
    md = files.md.read_text()
    assert md.startswith("# Test run") and "| Requests" in md and "report.png" in md
    assert "too long \\| really" in md and "poise bench --rate 2" in md


def test_write_report_with_other_slo_and_no_records(tmp_path: Path) -> None:
    result = _result()
    files = write_report(result, tmp_path, title="t", slo=SLO(ttft_s=10.0, tpot_s=1.0))
    doc = msgspec.json.decode(files.json.read_bytes())
    assert doc["summary"]["slo_attainment"] == 39 / 40 and doc["slo"] == {"ttft_s": 10.0, "tpot_s": 1.0}
    empty = ReplayResult(records=[], summary=summarize([], SLO(1, 1), 0.0), wall_s=0.0, started_at="x")
    files = write_report(empty, tmp_path / "empty", title="empty")
    assert files.png.stat().st_size > 0


def test_a_summary_judged_against_another_slo_leaves_the_warm_up_out_as_the_run_did(tmp_path: Path) -> None:
    # A simulated run with a 1-s warm-up counts requests 10-39 only; the report, which poise sim writes with
    # the trace's SLO, must say what the terminal table (the run's own summary) says.
    result = _result()
    slo = SLO(ttft_s=0.3, tpot_s=0.05)
    result.config["warmup_s"] = 1.0
    result.summary = summarize([r for r in result.records if r.arrival_s >= 1.0], slo, wall_s=3.5)
    files = write_report(result, tmp_path, title="t", slo=slo)
    doc = msgspec.json.decode(files.json.read_bytes())
    assert doc["summary"] == msgspec.to_builtins(result.summary)
    assert doc["summary"]["requests_total"] == 30 and len(doc["records"]) == 40  # every record is still kept


def test_format_table() -> None:
    result = _result()
    table = format_table(result.summary, SLO(0.3, 0.05))
    lines = table.splitlines()
    assert lines[0].startswith("| Metric") and set(lines[1]) <= {"|", "-"}
    assert len({len(line) for line in lines}) == 1  # aligned columns
    assert "| OK / failed" in table and "39 / 1" in table
    assert "TTFT <= 300 ms and TPOT <= 50 ms" in table
    assert f"{result.summary.slo_attainment * 100:.1f} %" in table
    assert "TTFT P50 / P90 / P99 (ms)" in table and "Throughput (req/s)" in table
