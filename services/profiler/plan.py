"""What to measure: prompt lengths for prefill, (batch, prompt length) experiments for decode.

Defaults follow the papers' start-up profiling (spec-arrow-dopd.md A3/B7.1 and the [REC] in A10 item 5: lengths
doubling from 128, 3 repetitions each) plus what the latency model needs to be identifiable:

- prefill: a short prompt (the intercept), doubling lengths up to ``max_prefill_tokens`` (default: 4 chunks),
  and prompts on and just past chunk boundaries (the per-pass overhead shows as a jump there);
- decode: batch sizes 1, 4, 16, 64, ... up to ``max_running_requests`` (at most 256), each with short prompts
  (step time vs batch) and long ones (step time vs context): ``decode_context_tokens`` in the whole batch,
  at most ``decode_max_prompt`` per request (and shrunk to fit the KV pool), so context does not grow with
  batch size alone.

Everything is capped by what the engine reports: context length, KV capacity (a batch must fit whole, or
the engine would retract requests mid-window), max running requests.
"""

from __future__ import annotations

import msgspec

from services.profiler.fit import passes
from services.profiler.target import EngineTarget

KV_HEADROOM = 0.9  # plan batches to at most this share of the KV pool


class DecodeExperiment(msgspec.Struct, frozen=True, kw_only=True):
    batch: int
    prompt_tokens: int
    probe_tokens: int  # max_new_tokens of the streamed probe request
    filler_tokens: int  # max_new_tokens of the other batch - 1 requests (they outlive the probe's window)


class ProfilePlan(msgspec.Struct, frozen=True, kw_only=True):
    prefill_lengths: list[int]
    prefill_repeats: int
    decode: list[DecodeExperiment]
    decode_steps: int  # step intervals measured per experiment, once the whole batch runs
    decode_segments: int  # the window is split in this many samples (context grows along it)
    skipped: list[str]  # what the engine's limits ruled out, for the report


STRADDLE = 64  # tokens past a chunk boundary: one more pass for almost no more work
MAX_STRADDLES = 4  # chunk boundaries to straddle


def default_prefill_lengths(chunk: int | None, max_tokens: int) -> list[int]:
    """16 tokens (the intercept), 128 doubling to ``max_tokens``, and pairs (k x chunk, k x chunk + 64) for the
    first few boundaries: the pair differs by one pass and 64 tokens of work, which pins the per-pass overhead
    down apart from the per-request one (fit.py)."""
    lengths = {16, max_tokens}
    n = 128
    while n < max_tokens:
        lengths.add(n)
        n *= 2
    if chunk is not None and chunk > 2 * STRADDLE:
        for k in range(1, MAX_STRADDLES + 1):
            if k * chunk + STRADDLE <= max_tokens:
                lengths.update((k * chunk, k * chunk + STRADDLE))
    return sorted(x for x in lengths if 1 <= x <= max_tokens)


def default_batch_sizes(max_batch: int) -> list[int]:
    sizes = {1, max_batch}
    b = 4
    while b < max_batch:
        sizes.add(b)
        b *= 4
    return sorted(sizes)


def _prefill_limit(target: EngineTarget, max_prefill_tokens: int | None) -> int:
    cap = max_prefill_tokens or 4 * (target.chunked_prefill_size or 8192)
    if target.context_length is not None:
        cap = min(cap, target.context_length - 2)  # room for the one output token
    return max(1, min(cap, int(target.kv_capacity_tokens * KV_HEADROOM)))


def plan_profile(target: EngineTarget, *, prefill_lengths: list[int] | None = None, prefill_repeats: int = 5,
                 max_prefill_tokens: int | None = None, batch_sizes: list[int] | None = None,
                 max_batch: int = 256, decode_short_prompt: int = 32, decode_context_tokens: int = 65536,
                 decode_max_prompt: int = 8192, decode_steps: int = 48, decode_segments: int = 4) -> ProfilePlan:
    if prefill_repeats < 1 or decode_steps < 8 or decode_segments < 1 or decode_steps < 2 * decode_segments:
        raise ValueError("need prefill_repeats >= 1, decode_steps >= 8 and >= 2 per segment")
    skipped: list[str] = []
    limit = _prefill_limit(target, max_prefill_tokens)
    if prefill_lengths:
        lengths = sorted({n for n in prefill_lengths if 1 <= n <= limit})
        skipped += [f"prefill {n} tokens: beyond the engine's limit {limit}" for n in sorted(set(prefill_lengths))
                    if n > limit]
    else:
        lengths = default_prefill_lengths(target.chunked_prefill_size, limit)
    top = min(max_batch, target.max_running_requests)
    batches = sorted({b for b in (batch_sizes or default_batch_sizes(top)) if b >= 1})
    experiments: list[DecodeExperiment] = []
    chunk = target.chunked_prefill_size or 16384  # SGLang's max_prefill_tokens default when not chunking
    for b in batches:
        if b > target.max_running_requests:
            skipped.append(f"decode batch {b}: above max_running_requests {target.max_running_requests}")
            continue
        long_prompt = min(decode_max_prompt, decode_context_tokens // b)
        for p in sorted({decode_short_prompt, max(decode_short_prompt, long_prompt)}):
            # Prefill passes before the batch is whole; the probe may be among the first prefilled.
            ramp = passes(b * p, chunk) + 4
            probe = decode_steps + ramp + 4
            filler = probe + ramp + 8
            fit_kv = int(target.kv_capacity_tokens * KV_HEADROOM) // b - filler
            fit_ctx = target.context_length - filler - 1 if target.context_length is not None else p
            if p > decode_short_prompt and min(fit_kv, fit_ctx) < p:  # a long run shrinks to what fits
                p = max(decode_short_prompt, min(fit_kv, fit_ctx))
            if p + filler >= (target.context_length or p + filler + 1):
                skipped.append(f"decode batch {b} x {p}: prompt + output beyond context length")
                continue
            if b * (p + filler) > target.kv_capacity_tokens * KV_HEADROOM:
                skipped.append(f"decode batch {b} x {p}: {b * (p + filler)} KV tokens do not fit "
                               f"{target.kv_capacity_tokens} x {KV_HEADROOM}")
                continue
            if any(e.batch == b and e.prompt_tokens == p for e in experiments):
                continue
            experiments.append(DecodeExperiment(batch=b, prompt_tokens=p, probe_tokens=probe, filler_tokens=filler))
    return ProfilePlan(prefill_lengths=lengths, prefill_repeats=prefill_repeats, decode=experiments,
                       decode_steps=decode_steps, decode_segments=decode_segments, skipped=skipped)


def describe(plan: ProfilePlan) -> str:
    reqs = sum(e.batch for e in plan.decode)
    return (f"prefill: {len(plan.prefill_lengths)} lengths x {plan.prefill_repeats} "
            f"({plan.prefill_lengths[0]}..{plan.prefill_lengths[-1]} tokens); decode: {len(plan.decode)} experiments "
            f"(batches {sorted({e.batch for e in plan.decode})}, {reqs} requests), {plan.decode_steps} steps each")

