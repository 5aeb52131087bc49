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


def test_mixed_pass_rows_match_the_decode_step_and_the_chunk_alone(model: lf.Llama) -> None:
    batch, context, chunk, done = 3, 12, 5, 7
    decode_kv = model.kv_cache(batch, context)
    for cache in decode_kv:  # earlier tokens' KV: random, so the decode rows depend on their own cache
        cache.copy_(torch.randn_like(cache))
    chunk_kv = model.kv_cache(1, done + chunk)
    prompt = lf.tokens(model, 1, done + chunk)[0]
    decode_ids = lf.tokens(model, 1, batch)[0]
    model.mixed_step_fn(0, 0, done, 0, chunk_kv=chunk_kv, ids=prompt[:done])()  # the prompt's first chunk
    mixed = model.mixed_step_fn(batch, context, chunk, done, decode_kv, chunk_kv, torch.cat([decode_ids, prompt[done:]]))()
    assert mixed.shape == (batch + 1, lf.TINY.vocab)  # the decode rows and the chunk's last token
    decode = model.mixed_step_fn(batch, context, 0, 0, decode_kv=decode_kv, ids=decode_ids)()
    alone = model.mixed_step_fn(0, 0, chunk, done, chunk_kv=chunk_kv, ids=prompt[done:])()
    assert decode.shape == (batch, lf.TINY.vocab) and alone.shape == (1, lf.TINY.vocab)
    torch.testing.assert_close(mixed[:batch], decode, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(mixed[batch:], alone, rtol=1e-4, atol=1e-4)
    # the chunk after its prefix is the whole prompt's pass; the decode rows read their caches
    torch.testing.assert_close(alone, model.prefill(prompt[None]), rtol=1e-4, atol=1e-4)
    fresh = model.mixed_step_fn(batch, context, 0, 0, ids=decode_ids)()  # zero caches instead
    assert not torch.allclose(fresh, decode, rtol=1e-3, atol=1e-3)


def test_mixed_decode_rows_alone_are_the_decode_sections_step(model: lf.Llama) -> None:
    for batch, context in ((1, 8), (4, 16)):
        sampled = model.mixed_step_fn(batch, context, 0, 0)().argmax(-1)
        assert torch.equal(sampled, model.decode_step_fn(batch, context)())


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
    for section in lf.SECTIONS:
        assert raw[section], section
    assert raw["tiny"] is True
    mixed = raw["mixed"]
    assert {(r["batch"], r["context"], r["chunk"], r["done"]) for r in mixed} == {
        (b, c, k, d) for b, c in lf.plan(True)["mixed"]["decode"] for k, d in lf.plan(True)["mixed"]["chunks"]}
    for r in mixed:
        assert all(len(r[k]) == 2 and min(r[k]) > 0 for k in ("mixed_s", "decode_s", "chunk_s")), r


def test_mixed_section_resumes_after_a_crash(tmp_path: Path) -> None:
    """With --parts, a rerun keeps what a dead process measured and skips (and reports) what it died on."""
    mixed = lf.plan(True)["mixed"]
    (b, c), (k, d), (k2, d2) = mixed["decode"][0], mixed["chunks"][0], mixed["chunks"][1]
    kept = {"batch": b, "context": c, "chunk": k, "done": d, "mixed_s": [1.0], "decode_s": [1.0], "chunk_s": [1.0],
            "mixed_eager_s": [1.0]}
    parts = tmp_path / "parts.jsonl"
    parts.write_text(json.dumps({"start": [b, c, k, d]}) + "\n" + json.dumps({"record": kept}) + "\n"
                     + json.dumps({"start": [b, c, k2, d2]}) + "\n" + '{"sta')  # died mid-line
    out = tmp_path / "raw.json"
    assert lf.main(["--tiny", "--sections", "mixed", "--parts", str(parts), "--out", str(out)]) == 0
    raw = json.loads(out.read_text())
    keys = [lf.mixed_key(r) for r in raw["mixed"]]
    assert raw["mixed"][0] == kept  # not measured again
    assert [lf.mixed_key(e) for e in raw["mixed_errors"]] == [(b, c, k2, d2)]
    assert len(keys) == len(set(keys)) == len(mixed["decode"]) * len(mixed["chunks"]) - 1
    assert lf.main(["--tiny", "--sections", "mixed", "--parts", str(parts), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["mixed"] == raw["mixed"]  # all done: a third run measures nothing


def test_sections_flag_runs_only_the_chosen_sections(tmp_path: Path) -> None:
    out = tmp_path / "raw.json"
    assert lf.main(["--tiny", "--sections", "mixed,decode", "--out", str(out)]) == 0
    raw = json.loads(out.read_text())
    assert raw["sections"] == ["mixed", "decode"]
    assert raw["mixed"] and raw["decode"] and not raw["prefill"] and not raw["packing"]
    assert lf.main(["--tiny", "--sections", "mixd", "--out", str(out)]) == 2


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
    report = (tmp_path / "latency_check.md").read_text()
    assert "## Packing" in report and "## ARES' length predictor served" in report
    assert "## Against" not in report  # the shipped profile is this card's own
    assert "## Mixed steps (colocated)" in report and report.count("\n| 128 | 2048 | 4096 | 4096 |") == 1
    assert (tmp_path / "latency_check.png").stat().st_size > 10_000


def test_latency_check_fits_the_committed_h200_run(tmp_path: Path) -> None:
    from shared.latency import LatencyModel, available_profiles, load_profile
    from tests.bench import gpu_latency_check as check

    h200 = check.GPUS["h200"]
    profile_path = tmp_path / "fitted.json"
    assert check.main(["--gpu", "h200", "--out", str(tmp_path), "--profile-out", str(profile_path)]) == 0
    profile = load_profile(profile_path)
    assert (profile.name, profile.gpu) == ("llama-3.1-8b-h200-torch", "NVIDIA H200")
    fitted = LatencyModel(profile)
    raw = json.loads(h200.raw("llama_forward").read_text())
    for r in raw["decode"]:
        assert abs(fitted.decode_step_time_s(r["batch"], r["batch"] * r["context"]) / r["graph_step_s"] - 1) < 0.1
    for s in check.prefill_samples(raw):
        if s.tokens >= 2048:  # shorter passes sit on the weight-read floor, which the fitted line undercuts
            assert abs(fitted.prefill_time_s(s.tokens) / min(s.seconds) - 1) < 0.03
    # the committed profile is the fit to the committed raw timings, and loads by name
    assert h200.fitted_name in available_profiles()
    committed = load_profile(h200.fitted_name)
    for f in ("prefill_overhead_s", "prefill_s_per_token", "prefill_s_per_token2", "decode_overhead_s",
              "decode_s_per_seq", "decode_s_per_context_token"):
        assert getattr(committed, f) == pytest.approx(getattr(profile, f), rel=1e-9)
    assert committed.decode_overhead_s < load_profile(check.H100.fitted_name).decode_overhead_s
    report = (tmp_path / "latency_check_h200.md").read_text()
    assert report.startswith("# The latency model against an H200\n")
    assert "derived from the H100's datasheet" in report and "## Against the H100 measurement" in report
    assert "4.8 TB/s" in report and "H100's 3.35" not in report
    assert "## ARES" not in report  # no overhead runs on this card: their sections are left out
    assert "## Mixed steps (colocated)" in report and report.count("\n| 128 | 2048 | 4096 | 4096 |") == 1
    assert not (tmp_path / "latency_check.md").exists()
    assert (tmp_path / "latency_check_h200.png").stat().st_size > 10_000


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
