"""One profiling run against one engine: check it is idle, warm it up, measure prefill, then decode.

Everything here is asynchronous I/O on one event loop; the fitting and writing happen after it returns.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import httpx
import msgspec

from services.profiler.decode import run_experiment, wait_idle
from services.profiler.plan import ProfilePlan
from services.profiler.prefill import PrefillTiming, measure_prefill, one_prefill
from services.profiler.samples import DecodeSample
from services.profiler.target import EngineTarget
from shared.engine_client import EngineClient, engine_auth_headers
from shared.errors import EngineError, PoiseError
from shared.http1 import Http1Pool


class Measurements(msgspec.Struct, kw_only=True):
    prefill: PrefillTiming
    decode: list[DecodeSample]
    decode_summaries: list[str]
    has_loads: bool


async def _check_idle(client: EngineClient) -> bool:
    """Whether ``/v1/loads`` answers; refuses an engine that is serving requests (they would skew every point)."""
    try:
        loads = await client.loads()
    except EngineError as exc:
        if exc.status is None:  # no HTTP answer, or one that is not SGLang's /v1/loads shape
            raise PoiseError(f"GET /v1/loads: {exc}") from exc
        return False  # an HTTP error status: this engine has no /v1/loads
    if loads.num_running_reqs or loads.num_waiting_reqs:
        raise PoiseError(f"the engine is busy ({loads.num_running_reqs} running, {loads.num_waiting_reqs} waiting); "
                         "profile an engine that serves nothing else")
    return True


async def measure(target: EngineTarget, plan: ProfilePlan, *, seed: int, progress: Callable[[str], None],
                  timeout_s: float = 30.0, api_key: str | None = None) -> Measurements:
    rng = random.Random(seed)
    headers = engine_auth_headers(api_key)
    pool = Http1Pool(headers=headers)
    async with httpx.AsyncClient(trust_env=False, timeout=timeout_s, headers=headers) as http:
        client = EngineClient(target.url, http, engine_id=target.url, timeout_s=timeout_s)
        try:
            has_loads = await _check_idle(client)
            if not has_loads:
                progress("note: no /v1/loads here; decode windows start after the planned ramp and context is "
                         "estimated from prompt lengths")
            # Warm-up (not recorded): first requests pay one-off costs on a real engine (allocations, JIT).
            for n in (16, 512):
                await one_prefill(pool, target, rng, n)
            progress(f"prefill: {len(plan.prefill_lengths)} lengths x {plan.prefill_repeats} repetitions, "
                     f"one request at a time (times in engine seconds, wall / {target.time_scale:g})")
            prefill = await measure_prefill(pool, target, plan.prefill_lengths, plan.prefill_repeats, rng, progress)
            progress(f"decode: {len(plan.decode)} experiments, {plan.decode_steps} steps each")
            samples: list[DecodeSample] = []
            summaries: list[str] = []
            for i, exp in enumerate(plan.decode, 1):
                await wait_idle(client)
                got, summary = await run_experiment(pool, client, target, exp, steps=plan.decode_steps,
                                                    segments=plan.decode_segments, rng=rng, has_loads=has_loads)
                samples += got
                summaries.append(summary)
                progress(f"decode [{i:2d}/{len(plan.decode)}] {summary}")
            await wait_idle(client)
        finally:
            await pool.aclose()
    return Measurements(prefill=prefill, decode=samples, decode_summaries=summaries, has_loads=has_loads)
