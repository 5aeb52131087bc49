"""What the profiler plans to measure, within the engine's limits."""

from __future__ import annotations

from typing import Any

from services.profiler.plan import default_batch_sizes, default_prefill_lengths, plan_profile
from services.profiler.target import EngineTarget


def target(**overrides: Any) -> EngineTarget:
    values: dict[str, Any] = {"url": "http://e:1", "server_info": {}, "is_engine_sim": False, "time_scale": 1.0,
                              "time_scale_source": "1", "chunked_prefill_size": 8192, "context_length": 131072,
                              "kv_capacity_tokens": 380000, "max_running_requests": 256, "tp": 1, "model": "m",
                              "gpu_profile": None}
    values.update(overrides)
    return EngineTarget(**values)


def test_prefill_lengths_double_and_straddle_chunk_boundaries() -> None:
    lengths = default_prefill_lengths(8192, 32768)
    assert lengths[:3] == [16, 128, 256] and lengths[-1] == 32768
    for k in (1, 2, 3):  # each boundary: on it and 64 tokens past it (one more pass, almost no more work)
        assert k * 8192 in lengths and k * 8192 + 64 in lengths
    assert default_prefill_lengths(None, 4096) == [16, 128, 256, 512, 1024, 2048, 4096]


def test_plan_respects_the_engines_limits() -> None:
    plan = plan_profile(target(context_length=8192, kv_capacity_tokens=50000, max_running_requests=64))
    assert max(plan.prefill_lengths) <= 8190
    assert max(e.batch for e in plan.decode) == 64
    for e in plan.decode:
        assert e.batch * (e.prompt_tokens + e.filler_tokens) <= 50000 * 0.9
        assert e.prompt_tokens + e.filler_tokens < 8192
        assert e.filler_tokens > e.probe_tokens > 48  # fillers outlive the probe's window


def test_plan_decode_grid_separates_batch_from_context() -> None:
    plan = plan_profile(target(), decode_context_tokens=65536)
    assert default_batch_sizes(256) == [1, 4, 16, 64, 256]
    by_batch = {(e.batch, e.prompt_tokens) for e in plan.decode}
    assert (1, 32) in by_batch and (1, 8192) in by_batch  # short and long context at batch 1
    assert (256, 32) in by_batch and (256, 256) in by_batch


def test_explicit_lengths_beyond_the_limit_are_reported() -> None:
    plan = plan_profile(target(context_length=4096), prefill_lengths=[100, 1000, 10000], batch_sizes=[1, 512])
    assert plan.prefill_lengths == [100, 1000]
    assert any("10000" in s for s in plan.skipped) and any("batch 512" in s for s in plan.skipped)
