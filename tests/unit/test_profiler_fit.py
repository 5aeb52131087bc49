"""The profiler's least-squares fits: synthetic points from a known profile give its coefficients back."""

from __future__ import annotations

import random

import pytest

from services.profiler.fit import fit_decode, fit_prefill, nonnegative_lstsq, passes
from services.profiler.plan import default_prefill_lengths
from services.profiler.samples import DecodeSample, PrefillSample
from shared.latency import DEFAULT_PROFILE, LatencyModel, LatencyProfile, load_profile

CHUNK = 8192


@pytest.fixture
def profile() -> LatencyProfile:
    return load_profile(DEFAULT_PROFILE)


def prefill_points(model: LatencyModel, lengths: list[int], chunk: int | None, *, request_s: float = 0.0,
                   noise_s: float = 0.0, repeats: int = 1, seed: int = 0) -> list[PrefillSample]:
    """What an idle colocated engine_sim answers: one pass per chunk, each with the launch overhead."""
    rng = random.Random(seed)
    out = []
    for n in lengths:
        size = chunk if chunk else n
        true = request_s + sum(model.prefill_time_s(min(size, n - done), done) for done in range(0, n, size))
        out.append(PrefillSample(tokens=n, passes=passes(n, chunk),
                                 seconds=[true + rng.uniform(0, noise_s) for _ in range(repeats)]))
    return out


def decode_points(model: LatencyModel, *, noise_s: float = 0.0, seed: int = 0) -> list[DecodeSample]:
    rng = random.Random(seed)
    out = []
    for batch, prompt in [(1, 32), (1, 8192), (4, 32), (4, 8192), (16, 32), (16, 2048), (64, 32), (64, 512),
                          (256, 32), (256, 128)]:
        for seg in range(4):
            ctx = batch * (prompt + 6 + 12 * seg)
            out.append(DecodeSample(batch=batch, prompt_tokens=prompt, context_tokens=ctx, steps=12,
                                    step_s=model.decode_step_time_s(batch, ctx) + rng.uniform(-noise_s, noise_s),
                                    context_source="num_used_tokens"))
    return out


def assert_within(got: float, want: float, rel: float) -> None:
    assert abs(got / want - 1) <= rel, f"{got} vs {want}: {got / want - 1:+.3%}"


def test_prefill_coefficients_come_back_exactly(profile: LatencyProfile) -> None:
    samples = prefill_points(LatencyModel(profile), default_prefill_lengths(CHUNK, 4 * CHUNK), CHUNK)
    fit = fit_prefill(samples)
    assert fit.separated_request_overhead
    assert_within(fit.overhead_s, profile.prefill_overhead_s, 1e-6)
    assert_within(fit.s_per_token, profile.prefill_s_per_token, 1e-6)
    assert_within(fit.s_per_token2, profile.prefill_s_per_token2, 1e-6)
    assert abs(fit.request_overhead_s) < 1e-9
    assert fit.stats.r2 > 0.999999 and fit.stats.max_rel_error < 1e-6
    assert fit.outliers == [] and fit.clamped == []


def test_prefill_request_overhead_is_kept_apart_from_the_per_pass_one(profile: LatencyProfile) -> None:
    """A constant per-request cost (HTTP, tokenizer, the timer) lands in c0, not in the profile's overhead."""
    samples = prefill_points(LatencyModel(profile), default_prefill_lengths(CHUNK, 4 * CHUNK), CHUNK,
                             request_s=0.0015)
    fit = fit_prefill(samples)
    assert_within(fit.request_overhead_s, 0.0015, 1e-4)
    assert_within(fit.overhead_s, profile.prefill_overhead_s, 1e-4)


def test_prefill_with_one_sided_noise_within_one_percent(profile: LatencyProfile) -> None:
    """Timer-like noise (0-0.2 ms, only ever added) on 5 repetitions: the fastest of each is within 1%."""
    samples = prefill_points(LatencyModel(profile), default_prefill_lengths(CHUNK, 4 * CHUNK), CHUNK,
                             noise_s=2e-4, repeats=5)
    fit = fit_prefill(samples)
    assert_within(fit.overhead_s, profile.prefill_overhead_s, 0.01)
    assert_within(fit.s_per_token, profile.prefill_s_per_token, 0.01)
    assert_within(fit.s_per_token2, profile.prefill_s_per_token2, 0.01)
    assert fit.statistic == "min"
    median = fit_prefill(samples, "median")
    assert median.statistic == "median" and median.request_overhead_s > fit.request_overhead_s


def test_prefill_stalled_length_is_left_out(profile: LatencyProfile) -> None:
    """Every repetition of one straddle prompt stalled by 5 ms: dropped, and o stays right."""
    samples = prefill_points(LatencyModel(profile), default_prefill_lengths(CHUNK, 4 * CHUNK), CHUNK)
    bad = next(i for i, s in enumerate(samples) if s.tokens == CHUNK + 64)
    samples[bad] = PrefillSample(tokens=samples[bad].tokens, passes=samples[bad].passes,
                                 seconds=[x + 0.005 for x in samples[bad].seconds])
    fit = fit_prefill(samples)
    assert fit.outliers == [bad]
    assert_within(fit.overhead_s, profile.prefill_overhead_s, 1e-4)


def test_unchunked_engine_fits_the_intercept_as_overhead(profile: LatencyProfile) -> None:
    """Without chunking every prompt is one pass: c0 and o cannot be told apart, so o takes the intercept."""
    samples = prefill_points(LatencyModel(profile), [16, 128, 512, 1024, 2048, 4096, 8192, 16384], None)
    fit = fit_prefill(samples)
    assert not fit.separated_request_overhead and fit.request_overhead_s == 0.0
    assert_within(fit.overhead_s, profile.prefill_overhead_s, 1e-6)
    assert_within(fit.s_per_token2, profile.prefill_s_per_token2, 1e-6)


def test_negative_coefficient_is_clamped_to_zero() -> None:
    """A linear engine (no attention term) must not get a negative b, which LatencyProfile refuses."""
    samples = [PrefillSample(tokens=n, passes=1, seconds=[0.01 + 3e-5 * n - 1e-13 * n * n]) for n in
               (16, 256, 1024, 4096, 8192)]
    fit = fit_prefill(samples)
    assert fit.clamped == ["per_token2"] and fit.s_per_token2 == 0.0
    assert fit.overhead_s > 0 and fit.s_per_token > 0


def test_nonnegative_lstsq_scales_columns() -> None:
    """Columns of 1 and n^2 ~ 1e9 side by side keep the small coefficient's digits."""
    import numpy as np

    n = np.array([16.0, 1024.0, 8192.0, 32768.0])
    coef, clamped = nonnegative_lstsq({"one": np.ones(4), "n2": n * n}, 0.008 + 5.3e-10 * n * n)
    assert clamped == []
    assert coef["one"] == pytest.approx(0.008, rel=1e-9) and coef["n2"] == pytest.approx(5.3e-10, rel=1e-9)


def test_decode_coefficients_come_back(profile: LatencyProfile) -> None:
    fit = fit_decode(decode_points(LatencyModel(profile)))
    assert_within(fit.overhead_s, profile.decode_overhead_s, 1e-6)
    assert_within(fit.s_per_seq, profile.decode_s_per_seq, 1e-6)
    assert_within(fit.s_per_context_token, profile.decode_s_per_context_token, 1e-6)
    assert fit.outliers == []


def test_decode_with_noise_within_one_percent(profile: LatencyProfile) -> None:
    """±20 us per segment (what 12-step means see at time scale 2 here) on top of the model."""
    fit = fit_decode(decode_points(LatencyModel(profile), noise_s=2e-5))
    assert_within(fit.overhead_s, profile.decode_overhead_s, 0.01)
    assert_within(fit.s_per_seq, profile.decode_s_per_seq, 0.01)
    assert_within(fit.s_per_context_token, profile.decode_s_per_context_token, 0.01)


def test_decode_stalled_segment_is_left_out(profile: LatencyProfile) -> None:
    samples = decode_points(LatencyModel(profile))
    s = samples[5]
    samples[5] = DecodeSample(batch=s.batch, prompt_tokens=s.prompt_tokens, context_tokens=s.context_tokens,
                              step_s=s.step_s * 1.2, steps=s.steps, context_source=s.context_source)
    fit = fit_decode(samples)
    assert fit.outliers == [5]
    assert_within(fit.s_per_context_token, profile.decode_s_per_context_token, 1e-6)
    assert fit.stats.max_rel_error == pytest.approx(1 - 1 / 1.2, rel=1e-6)  # stats cover the left-out one too


def test_fits_refuse_too_little_data() -> None:
    with pytest.raises(ValueError):
        fit_prefill([PrefillSample(tokens=n, passes=1, seconds=[0.01]) for n in (16, 32)])
    with pytest.raises(ValueError):
        fit_decode([DecodeSample(batch=4, prompt_tokens=32, context_tokens=c, step_s=0.01, steps=12,
                                 context_source="estimate") for c in (100, 200, 300)])


def test_passes_counts_chunks() -> None:
    assert [passes(n, 2048) for n in (1, 2048, 2049, 4096, 4160)] == [1, 1, 2, 2, 3]
    assert passes(100_000, None) == 1 and passes(100_000, -1) == 1


def test_standard_errors_say_how_well_each_coefficient_is_pinned(profile: LatencyProfile) -> None:
    model = LatencyModel(profile)
    good = fit_decode(decode_points(model, noise_s=2e-5))
    assert all(se / getattr(profile, f) < 0.01 for f, se in good.std_errors.items())
    # Short contexts only: the per-context-token term is barely visible under the same noise.
    short = [s for s in decode_points(model, noise_s=2e-5) if s.prompt_tokens == 32]
    poor = fit_decode(short)
    assert poor.std_errors["decode_s_per_context_token"] > 5 * good.std_errors["decode_s_per_context_token"]
    exact = fit_prefill(prefill_points(model, default_prefill_lengths(CHUNK, 4 * CHUNK), CHUNK))
    assert exact.std_errors["prefill_s_per_token2"] < 1e-6 * profile.prefill_s_per_token2
