"""Per-request SLO classes: assignment, parsing, per-class summaries, reports and the CLI flags."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from loadgen.metrics import summarize
from loadgen.records import RequestRecord
from loadgen.replay import ReplayResult, replay
from loadgen.report import format_class_table, format_table, write_report
from loadgen.slo import (
    PRESETS,
    SLO,
    SLOClass,
    SLOClasses,
    _splitmix64,
    index_fraction,
    parse_slo_classes,
    preset_classes,
)
from loadgen.workload import TraceRequest, Workload
from services.cli.main import BenchSettings, GoodputSettings, SimSettings, cmd_sim
from shared.settings import parse_settings
from tests.unit.test_loadgen_replay import SSEServer

BATCH = SLO(ttft_s=2.0, tpot_s=0.15)
INTERACTIVE = SLO(ttft_s=1.0, tpot_s=0.075)
TWO = SLOClasses((SLOClass("interactive", INTERACTIVE, 0.3), SLOClass("batch", BATCH, 0.7)))


def _workload(n: int) -> Workload:
    return Workload("test", [TraceRequest(i, 0.1 * i, 100 + i, 10, (i, i + 1)) for i in range(n)])


# --- assignment -----------------------------------------------------------------------------------------------


def test_hash_is_splitmix64() -> None:
    # SplitMix64's published first outputs for seed 0 and 1: the assignment must not drift with a refactor.
    assert _splitmix64(0) == 0xE220A8397B1DCDAF
    assert _splitmix64(1) == 0x910A2DEC89025CC1
    assert all(0 <= index_fraction(i) < 1 for i in range(1000))


def test_assignment_is_deterministic_and_order_based() -> None:
    first = [TWO.class_for(i) for i in range(2000)]
    again = SLOClasses((SLOClass("interactive", INTERACTIVE, 0.3), SLOClass("batch", BATCH, 0.7)))
    assert [again.class_for(i) for i in range(2000)] == first
    # A request's class is fixed by where its hash falls, so the interactive ones are the low 30%.
    assert all((index_fraction(i) < 0.3) == (name == "interactive") for i, name in enumerate(first))


def test_assignment_is_stable_across_processes() -> None:
    # Python's hash() is salted per process; the assignment must not be.
    code = "from loadgen.slo import preset_classes, SLO; c = preset_classes('interactive-batch', SLO(2, 0.15));" \
           "print(''.join(n[0] for n in map(c.class_for, range(300))))"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    here = "".join(TWO.class_for(i)[0] for i in range(300))
    assert out.strip() == here


@pytest.mark.parametrize("shares", [(0.3, 0.7), (0.2, 0.5, 0.3), (0.05, 0.95), (1.0,)])
def test_assignment_matches_shares(shares: tuple[float, ...]) -> None:
    classes = SLOClasses(tuple(SLOClass(f"c{k}", BATCH, share) for k, share in enumerate(shares)))
    n = 10_000
    counts = dict.fromkeys(classes.names, 0)
    for i in range(n):
        counts[classes.class_for(i)] += 1
    for k, share in enumerate(shares):
        assert counts[f"c{k}"] / n == pytest.approx(share, abs=0.02)


def test_assign_labels_a_copy_and_transforms_keep_the_label() -> None:
    workload = _workload(50)
    labelled = TWO.assign(workload)
    assert all(r.slo_class is None for r in workload)  # the original is untouched
    assert [r.slo_class for r in labelled] == [TWO.class_for(r.index) for r in workload]
    assert {r.slo_class for r in labelled} == {"interactive", "batch"}
    assert [(r.index, r.input_tokens, r.hash_ids) for r in labelled] == [
        (r.index, r.input_tokens, r.hash_ids) for r in workload]
    for derived in (labelled.slice(1.0, 2.0), labelled.scale_rate(3.0), labelled.cap_lengths(120, 5)):
        assert derived.requests and all(r.slo_class == TWO.class_for(r.index) for r in derived)


def test_slo_of() -> None:
    assert TWO.slo_of("batch") == BATCH and TWO.slo_of("interactive") == INTERACTIVE
    with pytest.raises(ValueError, match="unknown SLO class 'bulk'.*interactive, batch"):
        TWO.slo_of("bulk")


@pytest.mark.parametrize(
    ("classes", "message"),
    [
        ((), "at least one class"),
        ((SLOClass("a", BATCH, 0.5), SLOClass("a", BATCH, 0.5)), "duplicate class name"),
        ((SLOClass("a", BATCH, 0.5), SLOClass("b", BATCH, 0.4)), "sum to 1, got 0.9"),
    ],
)
def test_bad_class_sets(classes: tuple[SLOClass, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SLOClasses(classes)


@pytest.mark.parametrize(("name", "share"), [("", 0.5), ("a b", 0.5), ("a=b", 0.5), ("a", 0.0), ("a", 1.5)])
def test_bad_class(name: str, share: float) -> None:
    with pytest.raises(ValueError):
        SLOClass(name, BATCH, share)


# --- parsing and presets --------------------------------------------------------------------------------------


def test_parse_full_specs_and_round_trip() -> None:
    parsed = parse_slo_classes(["interactive=1:0.075:0.3", "batch=2:0.15:0.7"], SLO(9, 9))
    assert parsed == TWO
    assert parse_slo_classes(TWO.specs, SLO(9, 9)) == TWO
    assert parse_slo_classes([], BATCH) is None


def test_parse_defaults_and_remainder() -> None:
    # Empty targets take the default (the trace's SLO); the class without a share takes the rest.
    parsed = parse_slo_classes(["fast=0.5::0.25", "rest=:"], BATCH)
    assert parsed is not None
    assert parsed.classes == (SLOClass("fast", SLO(0.5, 0.15), 0.25), SLOClass("rest", BATCH, 0.75))
    only = parse_slo_classes(["tight=1:0.05"], BATCH)
    assert only is not None and only.classes == (SLOClass("tight", SLO(1.0, 0.05), 1.0),)


@pytest.mark.parametrize(
    ("specs", "message"),
    [
        (["interactive"], "expected NAME=TTFT_S:TPOT_S"),
        (["=1:1"], "expected NAME=TTFT_S:TPOT_S"),
        (["a=1"], "expected NAME=TTFT_S:TPOT_S"),
        (["a=1:2:0.5:9"], "expected NAME=TTFT_S:TPOT_S"),
        (["a=soon:1"], "TTFT must be a number"),
        (["a=1:x"], "TPOT must be a number"),
        (["a=1:1:half"], "SHARE must be a number"),
        (["a=0:1"], "'a=0:1': TTFT must be a positive number of seconds"),
        (["a=1:1:0.5", "b=1:1:0.4"], "sum to 1"),
        (["a=1:1", "b=1:1"], "only one class may leave out its share"),
        (["a=1:1:1", "b=1:1"], "leave nothing for 'b'"),
        (["a=1:1:0.5", "a=2:2"], "duplicate"),
        (["a b=1:1"], "class name"),
    ],
)
def test_parse_errors(specs: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_slo_classes(specs, BATCH)


def test_interactive_batch_preset_follows_the_trace_slo() -> None:
    assert "interactive-batch" in PRESETS
    assert preset_classes("interactive-batch", BATCH) == TWO
    other = preset_classes("interactive-batch", SLO(30.0, 0.1))
    assert other.slo_of("interactive") == SLO(15.0, 0.05) and other.slo_of("batch") == SLO(30.0, 0.1)
    with pytest.raises(ValueError, match="unknown SLO-class preset 'nope'; presets: interactive-batch"):
        preset_classes("nope", BATCH)


# --- summaries and reports ------------------------------------------------------------------------------------


def _rec(index: int, slo_class: str | None, ttft: float, tpot: float, status: str = "ok") -> RequestRecord:
    ok = status == "ok"
    sent = float(index)
    return RequestRecord(
        index=index, rid=f"r{index}", arrival_s=sent, sent_s=sent,
        first_token_s=sent + ttft if ok else None, finished_s=sent + ttft + 10 * tpot,
        input_tokens=100, output_tokens_expected=11, output_tokens_received=11 if ok else 0,
        status=status,  # type: ignore[arg-type]
        error=None if ok else "HTTP 500: boom", slo_class=slo_class,
    )


RECORDS = [
    _rec(0, "interactive", ttft=1.5, tpot=0.05),  # meets the batch SLO, not the interactive one
    _rec(1, "batch", ttft=1.5, tpot=0.05),  # the same latencies: meets its (batch) SLO
    _rec(2, "interactive", ttft=0.5, tpot=0.05),  # meets the interactive SLO
    _rec(3, "batch", ttft=0.5, tpot=0.05, status="error"),  # failed: a miss
    _rec(4, None, ttft=1.5, tpot=0.1),  # no class: judged against the run's SLO (batch's here)
    _rec(5, "interactive", ttft=0.5, tpot=0.1),  # TTFT met, TPOT missed
]


def test_summarize_judges_each_request_against_its_class() -> None:
    plain = summarize(RECORDS, BATCH, 10.0)
    assert plain.per_class == {}
    assert plain.slo_attainment == pytest.approx(5 / 6)  # everything ok meets the batch SLO
    assert summarize(RECORDS, BATCH, 10.0, None) == plain

    s = summarize(RECORDS, BATCH, 10.0, TWO)
    assert s.slo_attainment == pytest.approx(3 / 6)  # records 1, 2 and 4
    assert s.ttft_attainment == pytest.approx(4 / 6) and s.tpot_attainment == pytest.approx(4 / 6)
    assert (s.slo_ttft_s, s.slo_tpot_s) == (BATCH.ttft_s, BATCH.tpot_s)
    assert list(s.per_class) == ["interactive", "batch"]
    inter, batch = s.per_class["interactive"], s.per_class["batch"]
    assert (inter.requests, inter.ok) == (3, 3) and (batch.requests, batch.ok) == (2, 1)
    assert inter.attainment == pytest.approx(1 / 3) and batch.attainment == pytest.approx(1 / 2)
    assert inter.ttft_attainment == pytest.approx(2 / 3) and inter.tpot_attainment == pytest.approx(2 / 3)
    assert (inter.slo_ttft_s, inter.slo_tpot_s) == (1.0, 0.075) and (batch.slo_ttft_s, batch.slo_tpot_s) == (2.0, 0.15)
    assert inter.ttft_p90_s == pytest.approx(1.3) and batch.ttft_p90_s == pytest.approx(1.5)
    # Everything but attainment (and what weighs or splits it: tokens, late, quartiles) is as without classes.
    same = {"per_class", "slo_attainment", "ttft_attainment", "tpot_attainment", "token_attainment", "late_share",
            "quartile_attainment"}
    assert {k: v for k, v in msgspec.structs.asdict(s).items() if k not in same} == {
        k: v for k, v in msgspec.structs.asdict(plain).items() if k not in same}


def test_summarize_lists_empty_classes_and_rejects_unknown_ones() -> None:
    s = summarize([_rec(0, None, 0.1, 0.01)], BATCH, 1.0, TWO)
    assert s.per_class["batch"].requests == 0 and s.per_class["batch"].attainment == 0.0
    assert s.per_class["batch"].ttft_p90_s is None
    with pytest.raises(ValueError, match="unknown SLO class.*bulk"):
        summarize([_rec(0, "bulk", 0.1, 0.01)], BATCH, 1.0, TWO)


def _result(classes: SLOClasses | None) -> ReplayResult:
    return ReplayResult(records=list(RECORDS), summary=summarize(RECORDS, BATCH, 10.0, classes), wall_s=10.0,
                        started_at="2025-01-01T00:00:00+00:00", config={"workload": "test"})


def test_table_shows_classes_only_when_there_are_some() -> None:
    plain = format_table(_result(None).summary, BATCH)
    assert "SLO attainment (TTFT <= 2000 ms and TPOT <= 150 ms)" in plain and "SLO class" not in plain
    assert format_class_table(_result(None).summary) == ""

    table = format_table(_result(TWO).summary, BATCH)
    assert "SLO attainment (each request against its class's SLO) | 50.0 %" in table
    lines = table.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| SLO class"))
    inter, batch = lines[header + 2], lines[header + 3]
    assert inter.split("|")[1].strip() == "interactive" and "33.3 %" in inter and "1000 / 75" in inter
    assert batch.split("|")[1].strip() == "batch" and "50.0 %" in batch and "2000 / 150" in batch


def test_report_files_carry_the_classes(tmp_path: Path) -> None:
    plain = write_report(_result(None), tmp_path / "plain", title="t")
    doc = msgspec.json.decode(plain.json.read_bytes())
    assert "slo_classes" not in doc and doc["summary"]["per_class"] == {}
    assert "SLO class" not in plain.md.read_text()

    files = write_report(_result(None), tmp_path / "classes", title="t", slo=BATCH, classes=TWO)
    doc = msgspec.json.decode(files.json.read_bytes())
    assert msgspec.convert(doc["slo_classes"], SLOClasses) == TWO
    assert doc["summary"]["per_class"]["interactive"]["attainment"] == pytest.approx(1 / 3)
    assert [r["slo_class"] for r in doc["records"]] == [r.slo_class for r in RECORDS]
    # The summary can be recomputed from the JSON alone.
    records = msgspec.convert(doc["records"], list[RequestRecord])
    assert msgspec.to_builtins(summarize(records, BATCH, doc["wall_s"], TWO)) == doc["summary"]
    assert "| SLO class" in files.md.read_text()


# --- live replay and the CLI ----------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_replay_copies_the_class_into_records() -> None:
    workload = TWO.assign(Workload("test", [TraceRequest(i, 0.005 * i, 20, 3) for i in range(12)]))
    async with SSEServer() as server:
        result = await replay(workload, server.base_url, model="m", slo=BATCH, slo_classes=TWO)
    assert [r.slo_class for r in result.records] == [r.slo_class for r in workload]
    assert sum(c.requests for c in result.summary.per_class.values()) == 12
    assert result.config["slo_classes"] == TWO.specs


def test_slo_class_flag_is_repeatable_and_takes_json(monkeypatch: pytest.MonkeyPatch) -> None:
    flags = ["--slo-class", "interactive=1:0.075:0.3", "--slo-class", "batch=::0.7"]
    assert parse_settings(SimSettings, flags).slo_class == ["interactive=1:0.075:0.3", "batch=::0.7"]
    assert parse_settings(BenchSettings, ["--slo-class", '["a=1:1", "b=2:2:0.5"]']).slo_class == ["a=1:1", "b=2:2:0.5"]
    monkeypatch.setenv("POISE_SIM_SLO_CLASS", '["x=1:1"]')
    assert parse_settings(SimSettings, []).slo_class == ["x=1:1"]
    assert parse_settings(SimSettings, ["--slo-preset", "interactive-batch"]).slo_preset == "interactive-batch"
    assert "slo_class" not in GoodputSettings.model_fields  # the goodput search has one SLO


def _tiny_trace(directory: Path) -> None:
    rows = [f"2023-11-16 18:{i // 60:02d}:{i % 60:02d}.0,{200 + 7 * i},{5 + i % 20}" for i in range(120)]
    (directory / "AzureLLMInferenceTrace_conv.csv").write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                                                              + "\n".join(rows) + "\n")


def test_poise_sim_with_classes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                capsys: pytest.CaptureFixture[str]) -> None:
    from loadgen.traces import TRACE_FILES

    assert TRACE_FILES["azure-conv"] == "AzureLLMInferenceTrace_conv.csv"
    _tiny_trace(tmp_path)
    monkeypatch.setenv("POISE_TRACES_DIR", str(tmp_path))
    args = ["--trace", "azure-conv", "--instances", "2", "--duration-s", "1000"]
    # An impossible interactive TTFT, so the classes must differ in attainment.
    assert cmd_sim([*args, "--slo-class", "interactive=0.000001::0.4", "--slo-class", "batch=::",
                    "--out-dir", str(tmp_path / "out"), "--json", str(tmp_path / "sim.json")]) == 0
    assert "| SLO class" in capsys.readouterr().out
    doc = json.loads((tmp_path / "out" / "report.json").read_text())
    per_class = doc["summary"]["per_class"]
    assert per_class["interactive"]["requests"] + per_class["batch"]["requests"] == 120
    assert per_class["interactive"]["attainment"] == 0.0 and per_class["batch"]["attainment"] == 1.0
    assert [r["slo_class"] for r in doc["records"]] == [
        ("interactive" if index_fraction(r["index"]) < 0.4 else "batch") for r in doc["records"]]
    assert json.loads((tmp_path / "sim.json").read_text())["summary"]["per_class"] == per_class

    assert cmd_sim([*args, "--out-dir", str(tmp_path / "plain")]) == 0
    plain = json.loads((tmp_path / "plain" / "report.json").read_text())
    assert plain["summary"]["per_class"] == {} and "slo_classes" not in plain
    assert plain["summary"]["slo_attainment"] == 1.0
