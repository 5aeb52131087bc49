"""`poise run`'s split over time: the live split on the replay's clock, attainment per time bin, the simulated
comparison's mixes, and the figure + Markdown the report gets."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest

from loadgen.metrics import summarize
from loadgen.records import RequestRecord
from loadgen.replay import ReplayResult
from loadgen.report import write_report
from loadgen.slo import SLO, parse_slo_classes
from loadgen.split_compare import (
    FlipEvent,
    LiveSplit,
    SimRun,
    SplitSample,
    attainment_over_time,
    comparison_mixes,
    live_restart_s,
    simulate_comparison,
    write_split_comparison,
)
from loadgen.workload import TraceRequest, Workload
from services.cli.split_watch import count_split
from shared.latency import DEFAULT_PROFILE, LatencyModel, load_profile
from shared.policies import PolicyContext

SLO_ = SLO(ttft_s=1.0, tpot_s=0.1)


def _record(i: int, arrival: float, ttft: float | None, *, tpot: float = 0.01, status: str = "ok") -> RequestRecord:
    first = None if ttft is None else arrival + ttft
    return RequestRecord(index=i, rid=f"r{i}", arrival_s=arrival, sent_s=arrival, first_token_s=first,
                         finished_s=(first or arrival) + tpot * 9, input_tokens=100 + i, output_tokens_expected=10,
                         output_tokens_received=10 if first is not None else 0, status=status,  # type: ignore[arg-type]
                         error=None if status == "ok" else "boom")


def _live() -> ReplayResult:
    # 0-10 s: all meet the SLO; 10-20 s: half miss TTFT; one failure at 15.5 s counts as a miss.
    records = [_record(i, i * 0.5, 0.2) for i in range(20)]
    records += [_record(20 + i, 10 + i * 0.5, 0.2 if i % 2 else 3.0) for i in range(20)]
    records[31] = _record(31, 15.5, None, status="error")
    return ReplayResult(records=records, summary=summarize(records, SLO_, 25.0), wall_s=25.0,
                        started_at="2026-01-01T00:00:00+00:00", config={"trace": "test"})


def test_attainment_over_time_bins_by_arrival_and_counts_failures_as_misses() -> None:
    bins = attainment_over_time(_live().records, SLO_, 10.0)
    assert [(c, n) for c, _, n in bins] == [(5.0, 20), (15.0, 20)]
    assert bins[0][1] == 1.0
    assert bins[1][1] == pytest.approx(9 / 20)  # the 10 odd ones meet it, but one of them (index 31) failed
    # Classes judge each record by its class's SLO: a loose class lets the slow ones through.
    classes = parse_slo_classes(["loose=5:1"], SLO_)
    labelled = [msgspec.structs.replace(r, slo_class="loose") for r in _live().records]
    assert attainment_over_time(labelled, SLO_, 10.0, classes=classes)[1][1] == pytest.approx(19 / 20)


def test_live_split_on_the_replays_clock() -> None:
    t0 = 1_767_225_600.0  # 2026-01-01T00:00:00Z, the replay's started_at
    samples = [(t0 - 3, 2, 2, 0), (t0 - 1, 2, 2, 0), (t0 + 1, 2, 2, 0), (t0 + 40, 2, 1, 1), (t0 + 41, 2, 1, 1),
               (t0 + 47, 3, 1, 0)]
    events = [{"kind": "flip_requested", "ts_unix_s": t0 + 39.5, "instance_id": "d1", "from_role": "decode",
               "to_role": "prefill", "source": "policy", "reason": "poise: ..."},
              {"kind": "flip_done", "ts_unix_s": t0 + 46.8, "instance_id": "d1", "from_role": "decode",
               "to_role": "prefill", "source": "policy"},
              {"kind": "paused", "ts_unix_s": t0 + 50}]
    live = LiveSplit.from_unix(samples, events, "2026-01-01T00:00:00+00:00")
    assert live.samples[0] == SplitSample(0.0, 2, 2, 0)  # the newest sample before the start stands for t=0
    assert [(s.t_s, s.prefill, s.decode, s.flipping) for s in live.steps()] == [
        (0.0, 2, 2, 0), (40.0, 2, 1, 1), (47.0, 3, 1, 0)]
    # Samples that count colocated engines too: a move into colocated serving is a step of its own.
    colocated = LiveSplit.from_unix([(t0, 2, 2, 0, 0), (t0 + 5, 2, 1, 1, 0), (t0 + 40, 2, 1, 0, 1)], [],
                                    "2026-01-01T00:00:00+00:00")
    assert [(s.t_s, s.colocated) for s in colocated.steps()] == [(0.0, 0), (5.0, 0), (40.0, 1)]
    assert [f.kind for f in live.flips] == ["flip_requested", "flip_done"]  # pauses are not flips
    assert [(f.instance_id, f.t_s) for f in live.done_flips()] == [("d1", pytest.approx(46.8))]


def test_count_split_counts_ready_roles_and_flipping_instances() -> None:
    def inst(role: str, status: str) -> SimpleNamespace:
        return SimpleNamespace(info=SimpleNamespace(role=role, status=status))

    instances = [inst("prefill", "ready"), inst("prefill", "ready"), inst("decode", "draining"),
                 inst("decode", "ready"), inst("null", "ready"), inst("prefill", "starting")]
    assert count_split(instances) == (2, 1, 1, 1)


def test_the_fixed_mix_is_the_poise_mix_without_its_controller() -> None:
    mixes = {key: (label, build) for key, label, build in comparison_mixes(4, "2P2D", local_prefill_tokens=512)}
    assert list(mixes) == ["poise", "fixed", "static"]
    assert all("simulated" in label for label, _ in mixes.values())
    model, ctx = LatencyModel(load_profile(DEFAULT_PROFILE)), PolicyContext(ttft_slo_s=2.0, tpot_slo_s=0.15,
                                                                            max_instances=4)
    poise, fixed, static = (mixes[k][1]().bound(model, ctx) for k in ("poise", "fixed", "static"))
    assert poise.pools is not None and fixed.pools is None and static.pools is None
    assert fixed.dispatch.name == poise.dispatch.name == "arrow" and static.dispatch.name == "least-load"
    assert fixed.engine == poise.engine and fixed.local_prefill == poise.local_prefill is not None
    assert static.engine.prefill_policy == "fcfs" and static.local_prefill is None
    assert fixed.roles == poise.roles == static.roles == ["prefill", "prefill", "decode", "decode"]


def test_the_report_gets_the_figure_and_a_line_with_both_attainments(tmp_path: Path) -> None:
    workload = Workload(name="tiny", requests=[TraceRequest(index=i, arrival_s=i * 0.2, input_tokens=300 + 40 * i,
                                                            output_tokens=20) for i in range(40)])
    sims = simulate_comparison(workload, comparison_mixes(4, "2P2D"), profile=DEFAULT_PROFILE, slo=SLO_,
                               rate_scale=2.0)
    assert [s.key for s in sims] == ["poise", "fixed", "static"]
    assert all(s.result.config["rate_mode"] == "compress" and s.result.config["rate_scale"] == 2.0 for s in sims)
    live = _live()
    split = LiveSplit(samples=[SplitSample(0.0, 2, 2), SplitSample(12.0, 2, 1, 1), SplitSample(14.0, 3, 1)],
                      flips=[FlipEvent(12.0, "flip_requested", "d1", "decode", "prefill"),
                             FlipEvent(14.0, "flip_done", "d1", "decode", "prefill")],
                      decision_latency={"decisions": 7, "window": 7, "p50_ms": 0.31, "p99_ms": 0.52, "max_ms": 0.55,
                                        "last_ms": 0.3, "cpu_p50_ms": 0.3, "cpu_p99_ms": 0.5, "cpu_max_ms": 0.5})
    markdown = write_split_comparison(tmp_path, live, split, sims, SLO_, title="t", rate_scale=2.0)
    png = tmp_path / "split.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    doc = msgspec.json.decode((tmp_path / "split.json").read_bytes())
    assert [s["key"] for s in doc["simulated"]] == ["poise", "fixed", "static"]
    assert doc["live"]["flips"][1]["kind"] == "flip_done"
    assert doc["live"]["decision_latency"]["p99_ms"] == 0.52
    # One line for the live run, one for the simulated ones, each with its attainment; labelled as such.
    live_line = next(line for line in markdown.splitlines() if line.startswith("**Live**"))
    assert f"{live.summary.slo_attainment:.1%}" in live_line and "d1 decode -> prefill at 14 s" in live_line
    sim_line = next(line for line in markdown.splitlines() if line.startswith("**Simulated**"))
    for s in sims:
        assert f"{s.result.summary.slo_attainment:.1%}" in sim_line
    assert "![" in markdown and "(split.png)" in markdown
    # The controller's decision time over the run, against its p99 target.
    assert "**Planner decisions**: 7; over the latest 7 p50 0.31 ms, p99 0.52 ms" in markdown
    # write_report puts it right after the table.
    files = write_report(live, tmp_path, title="run", slo=SLO_, extra_markdown=markdown)
    text = files.md.read_text()
    assert text.index("SLO attainment (TTFT") < text.index("## The P:D split over time") < text.index("(report.png)")


def test_without_a_recorded_split_the_report_says_so(tmp_path: Path) -> None:
    live = _live()
    markdown = write_split_comparison(tmp_path, live, None, [], SLO_, title="t", rate_scale=1.0)
    assert "not recorded" in markdown and (tmp_path / "split.png").exists()
    assert isinstance(SimRun("k", "l", live).flips, int)


def test_the_comparison_charges_restarts_what_the_live_ones_took() -> None:
    events = [{"kind": "flip_done", "from_role": "decode", "to_role": "null", "duration_s": 2.5},
              {"kind": "flip_done", "from_role": "prefill", "to_role": "null", "duration_s": 3.5},
              {"kind": "flip_done", "from_role": "null", "to_role": "prefill", "duration_s": 2.0},
              {"kind": "flip_done", "from_role": "decode", "to_role": "prefill", "duration_s": 0.4},  # no restart
              {"kind": "flip_requested", "from_role": "decode", "to_role": "null"}]
    assert live_restart_s(events) == 2.5
    assert live_restart_s(events[3:]) is None
