"""The GPU timing script (tests/bench/gpu/llama_forward.py) computes what it claims to time.

It runs only on a lent GPU machine for real; here its toy shapes run on the CPU, so a broken pass, a wrong
mask in chunked prefill or a decode step that ignores its cache shows up before GPU time is spent on it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from tests.bench.gpu import llama_forward as lf  # noqa: E402


@pytest.fixture(scope="module")
def model() -> lf.Llama:
    return lf.Llama(lf.TINY, torch.device("cpu"), torch.float32)


def test_chunked_prefill_matches_one_pass(model: lf.Llama) -> None:
    ids = lf.tokens(model, 1, 48)
    whole = model.prefill(ids)
    for chunk in (7, 16, 48):
        torch.testing.assert_close(model.prefill_chunked(ids, chunk), whole, rtol=1e-4, atol=1e-4)


def test_packed_prompts_match_prompts_alone(model: lf.Llama) -> None:
    ids = lf.tokens(model, 3, 20)
    packed = model.prefill(ids)
    for i in range(3):
        torch.testing.assert_close(packed[i:i + 1], model.prefill(ids[i:i + 1]), rtol=1e-4, atol=1e-4)


def test_operators_are_the_pass_in_order(model: lf.Llama) -> None:
    ops = model.prefill_ops(lf.tokens(model, 1, 8))
    assert len(ops) == lf.TINY.layers * len(lf.OPERATORS) + 1
    assert [op.__name__ for op in ops[:5]] == list(lf.OPERATORS)


def test_a_set_flag_stops_the_pass_at_the_next_operator(model: lf.Llama) -> None:
    flag = lf.threading.Event()
    flag.set()
    stopped, _ = lf.preemptible_prefill(model, lf.Clock(torch.device("cpu")), lf.tokens(model, 1, 8), flag)
    assert stopped


def test_tiny_run_writes_every_section(tmp_path: Path) -> None:
    out = tmp_path / "raw.json"
    assert lf.main(["--tiny", "--out", str(out)]) == 0
    raw = json.loads(out.read_text())
    for section in ("prefill", "prefill_graph", "chunking", "operators", "preemption", "packing", "decode"):
        assert raw[section], section
    assert raw["tiny"] is True


def test_latency_check_fits_the_committed_h100_run(tmp_path: Path) -> None:
    from services.profiler.fit import fit_decode
    from shared.latency import LatencyModel, load_profile
    from tests.bench import gpu_latency_check as check

    profile_path = tmp_path / "fitted.json"
    assert check.main(["--out", str(tmp_path), "--profile-out", str(profile_path)]) == 0
    fitted = LatencyModel(load_profile(profile_path))
    raw = json.loads(check.RAW.read_text())
    for r in raw["decode"]:  # the fitted decode line follows the graph-replayed steps it was fitted to
        assert abs(fitted.decode_step_time_s(r["batch"], r["batch"] * r["context"]) / r["graph_step_s"] - 1) < 0.1
    assert fit_decode(check.decode_samples(raw)).stats.r2 > 0.99
    assert "## Packing" in (tmp_path / "latency_check.md").read_text()
    assert (tmp_path / "latency_check.png").stat().st_size > 10_000


def test_ares_overhead_script_runs(tmp_path: Path) -> None:
    from tests.bench.gpu import ares_overhead

    out = tmp_path / "ares.json"
    assert ares_overhead.main(["--cpu", "--runs", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["hidden"], r["batch"]) for r in rows} == {(h, b) for h in ares_overhead.HIDDEN_SIZES
                                                         for b in ares_overhead.BATCHES}
    assert all(r["median_s"] > 0 for r in rows)


def test_serving_overhead_script_runs(tmp_path: Path) -> None:
    from tests.bench.gpu import serving_overhead

    out = tmp_path / "serving.json"
    assert serving_overhead.main(["--tiny", "--iterations", "25", "--rounds", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in rows] == [4, 16]
    for r in rows:
        assert set(r["median_s"]) == {"none", "k20", "k1"} and r["iterations"] == 25
        assert r["mlp_s_per_call"]["k1"] > 0 and r["mlp_s_per_call"]["k20"] > 0  # k = 20 predicted once in 25
    from tests.bench import gpu_latency_check as check

    assert "served in a decode loop" in check.serving_section(json.loads(out.read_text()))
