"""Trace readers on the real traces (read-only in the shared traces dir) and workload transforms."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from loadgen.traces import TRACE_FILES, default_traces_dir, load_trace, read_azure_csv, read_mooncake_jsonl
from loadgen.workload import TraceRequest, Workload

TRACES = default_traces_dir()
needs_traces = pytest.mark.skipif(
    not all((TRACES / f).is_file() for f in TRACE_FILES.values()), reason=f"traces not found in {TRACES}"
)


@needs_traces
def test_azure_conv_rows_and_first_values() -> None:
    start = time.perf_counter()
    w = load_trace("azure-conv")
    assert time.perf_counter() - start < 1.0
    assert w.name == "azure-conv" and len(w) == 19366
    assert w[0] == TraceRequest(index=0, arrival_s=0.0, input_tokens=374, output_tokens=44)
    # 18:15:50.9951690 - 18:15:46.6805900
    assert w[1].arrival_s == pytest.approx(4.314579, abs=1e-7)
    assert w[1].input_tokens == 396 and w[1].output_tokens == 109
    assert w.duration_s == pytest.approx(3501.7219, abs=1e-3)
    assert w.mean_rate_rps == pytest.approx(5.53, abs=0.01)
    assert [r.index for r in w] == list(range(len(w)))


@needs_traces
def test_azure_code_rows_and_first_values() -> None:
    w = read_azure_csv(TRACES / TRACE_FILES["azure-code"])
    assert w.name == "azure-code" and len(w) == 8819
    assert (w[0].input_tokens, w[0].output_tokens) == (4808, 10)
    assert w[1].arrival_s == pytest.approx(0.052, abs=1e-7)
    assert w[-1].arrival_s == pytest.approx(3435.948056, abs=1e-6)


@needs_traces
def test_mooncake_traces() -> None:
    conv = load_trace("mooncake-conv")
    assert len(conv) == 12031
    first = conv[0]
    assert (first.arrival_s, first.input_tokens, first.output_tokens) == (0.0, 6758, 500)
    assert first.hash_ids == tuple(range(14))
    assert conv.duration_s == pytest.approx(3536.999)
    synthetic = read_mooncake_jsonl(TRACES / TRACE_FILES["mooncake-synthetic"])
    assert synthetic.name == "mooncake-synthetic" and len(synthetic) == 3993
    assert all(len(r.hash_ids) == -(-r.input_tokens // 512) for r in synthetic)


@needs_traces
def test_load_trace_by_path_keeps_short_name() -> None:
    assert load_trace(TRACES / TRACE_FILES["azure-code"]).name == "azure-code"
    assert load_trace(str(TRACES / TRACE_FILES["mooncake-synthetic"])).name == "mooncake-synthetic"


@needs_traces
def test_slice_and_scale_on_real_trace() -> None:
    w = load_trace("azure-conv")
    window = w.slice(600, duration_s=60)
    originals = [r for r in w if 600 <= r.arrival_s < 660]
    assert len(window) == len(originals) > 100
    assert window[0].arrival_s == 0.0
    assert [r.index for r in window] == [r.index for r in originals]
    assert window[-1].arrival_s == pytest.approx(originals[-1].arrival_s - originals[0].arrival_s)
    assert window.name == "azure-conv"
    fast = window.scale_rate(2.0)
    assert fast.duration_s == pytest.approx(window.duration_s / 2)
    assert fast.mean_rate_rps == pytest.approx(window.mean_rate_rps * 2)
    assert [r.input_tokens for r in fast] == [r.input_tokens for r in window]
    assert len(w.slice(0, max_requests=10)) == 10


def test_workload_transforms_on_small_workload() -> None:
    reqs = [TraceRequest(i, float(i), 1000 + i, 10 * i + 1, tuple(range(2))) for i in range(5)]
    w = Workload("tiny", reqs)
    assert w.duration_s == 4.0 and w.mean_rate_rps == pytest.approx(5 / 4)
    s = w.slice(1.5, duration_s=2.0)
    assert [r.index for r in s] == [2, 3] and [r.arrival_s for r in s] == [0.0, 1.0]
    assert len(w.slice(10)) == 0 and w.slice(10).duration_s == 0.0
    slow = w.scale_rate(0.5)
    assert [r.arrival_s for r in slow] == [0.0, 2.0, 4.0, 6.0, 8.0]
    capped = w.cap_lengths(max_input=500, max_output=20)
    assert [r.input_tokens for r in capped] == [500] * 5
    assert [r.output_tokens for r in capped] == [1, 11, 20, 20, 20]
    assert all(r.hash_ids == (0,) for r in capped)  # 500 tokens fit in one 512-token block
    assert w.cap_lengths() == w
    with pytest.raises(ValueError):
        w.scale_rate(0)
    with pytest.raises(ValueError, match="ordered"):
        Workload("bad", [TraceRequest(0, 1.0, 1, 1), TraceRequest(1, 0.5, 1, 1)])


def test_reader_errors_name_file_and_line(tmp_path: Path) -> None:
    bad_csv = tmp_path / "bad.csv"
    bad_csv.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,10,2\n2023-11-16 18:17:04.0000000,ten,2\n"
    )
    with pytest.raises(ValueError, match=r"bad\.csv:3"):
        read_azure_csv(bad_csv)
    no_header = tmp_path / "nohdr.csv"
    no_header.write_text("a,b,c\n1,2,3\n")
    with pytest.raises(ValueError, match=r"nohdr\.csv:1: not an Azure trace"):
        read_azure_csv(no_header)
    bad_jsonl = tmp_path / "bad.jsonl"
    bad_jsonl.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}\n{"timestamp": 5}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        read_mooncake_jsonl(bad_jsonl)
    with pytest.raises(FileNotFoundError, match="missing.csv"):
        load_trace(tmp_path / "missing.csv")
    with pytest.raises(FileNotFoundError, match="azure-conv"):
        load_trace("azure-conv", traces_dir=tmp_path)
    other = tmp_path / "trace.txt"
    other.write_text("x\n")
    with pytest.raises(ValueError, match="unsupported"):
        load_trace(other)


def test_small_files_and_env_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / TRACE_FILES["azure-code"]).write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.5,10,2\n2023-11-16 18:17:05,20,3\n\n"
    )
    monkeypatch.setenv("POISE_TRACES_DIR", str(tmp_path))
    assert default_traces_dir() == tmp_path
    w = load_trace("azure-code")
    assert [r.arrival_s for r in w] == [0.0, 1.5] and w.name == "azure-code"
    jsonl = tmp_path / "unsorted.jsonl"
    jsonl.write_text(
        '{"timestamp": 2000, "input_length": 5, "output_length": 1, "hash_ids": []}\n'
        '{"timestamp": 1000, "input_length": 6, "output_length": 2, "hash_ids": [3]}\n'
    )
    u = load_trace(jsonl)
    assert u.name == "unsorted" and [r.index for r in u] == [1, 0] and [r.arrival_s for r in u] == [0.0, 1.0]
