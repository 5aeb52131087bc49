"""Decode measurement: step time at a known batch size and context, from one streamed request's token times.

An experiment sends ``batch - 1`` "filler" requests (non-streaming, so they cost the engine nothing per token)
and one streamed "probe", all with ``ignore_eos`` and fresh prompts of ``prompt_tokens`` ids. Once the whole
batch runs, every decode step gives the probe one token, so the gaps between the probe's tokens are the
engine's step times; nothing else is in the batch. The steady window starts when ``/v1/loads`` shows the
whole batch running with nothing waiting (its ``num_used_tokens``, KV in use, is then the batch's context)
and lasts ``steps`` probe tokens; ``/v1/loads`` polled through the window checks the batch stayed whole and
gives how fast the context grew. Then every request of the experiment is aborted.

A load report is placed on the probe's token clock by its own ``timestamp``, not by when its answer came:
SGLang answers ``/v1/loads`` from a snapshot its scheduler publishes every 15 decode steps (about a second on a
CPU core), so the answer can describe the batch as it was many tokens ago. The window's last report is the
newest one taken inside it; a report that shows the probe or a filler gone would describe the window's end.

Each window is cut into a few segments (context grows by ``batch`` tokens a step); a segment's step time is
the mean of its token gaps, i.e. (last token's time - first's) / steps. Not the median: single gaps are
quantized by the engine's event-loop timer (1 ms under uvloop), so their median sticks to whole milliseconds,
while the span of many steps is exact to a millisecond over all of them (a GPU's steps and engine_sim's chained
deadlines do not drift). A stall of a shared machine can still stretch one segment; the decode fit drops such
outliers (fit.py). Without ``/v1/loads`` the context is estimated from prompt lengths and the probe's token
count (requests prefilled earlier are a few tokens ahead of the probe: the estimate is a little low).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import orjson

from services.profiler.plan import DecodeExperiment
from services.profiler.prompts import generate_body, token_prompt
from services.profiler.samples import DecodeSample
from services.profiler.target import EngineTarget
from shared.engine_client import EngineClient, EngineLoads
from shared.errors import EngineError, PoiseError
from shared.http1 import Http1Pool

POLL_S = 0.005  # between /v1/loads polls while waiting for the batch to be whole (wall seconds)
WINDOW_POLL_S = 0.1  # between polls inside the measured window: seldom enough not to slow a one-core engine


@dataclass
class ProbeStream:
    """The probe's token arrivals: (tokens so far, perf_counter seconds) per stream event."""

    events: list[tuple[int, float]] = field(default_factory=list)
    ended: bool = False
    error: str | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def count(self) -> int:
        return self.events[-1][0] if self.events else 0

    def count_at(self, perf_s: float) -> int:
        """Tokens received by ``perf_s`` (perf_counter seconds)."""
        return next((n for n, t in reversed(self.events) if t <= perf_s), 0)

    async def wait_for(self, tokens: int) -> None:
        while self.count < tokens and not self.ended:
            self.changed.clear()
            await self.changed.wait()


@dataclass(frozen=True)
class Snapshot:
    tokens: int  # probe tokens received when the engine took the report (the engine was between that token and the next)
    used_tokens: int  # num_used_tokens: KV in use = the running batch's context tokens
    running: int
    waiting: int
    taken_unix_s: float | None  # the report's own time (None: the engine gives none; it is then current)


def token_gaps(events: list[tuple[int, float]], after: int, upto: int) -> list[tuple[int, float]]:
    """(token index, seconds since the previous token) for tokens ``after < j <= upto``.

    An event carrying several tokens (the reader fell behind) spreads its gap evenly over them.
    """
    gaps: list[tuple[int, float]] = []
    for (c0, t0), (c1, t1) in zip(events, events[1:], strict=False):
        if c1 <= c0:
            continue
        each = (t1 - t0) / (c1 - c0)
        gaps.extend((j, each) for j in range(c0 + 1, c1 + 1) if after < j <= upto)
    return gaps


def window_samples(gaps: list[tuple[int, float]], *, batch: int, prompt_tokens: int, segments: int,
                   context_at: Callable[[float], float], time_scale: float, source: str) -> list[DecodeSample]:
    """Cut the window's gaps into ``segments`` runs of consecutive tokens: one sample each (mean gap, context
    at the run's mean token)."""
    out: list[DecodeSample] = []
    size = len(gaps) / segments
    for i in range(segments):
        part = gaps[round(i * size):round((i + 1) * size)]
        if len(part) < 2:
            continue
        mid = statistics.fmean(j for j, _ in part)
        out.append(DecodeSample(batch=batch, prompt_tokens=prompt_tokens, context_tokens=context_at(mid),
                                step_s=statistics.fmean(g for _, g in part) / time_scale, steps=len(part),
                                context_source=source))
    return out


async def _read_probe(pool: Http1Pool, url: str, body: bytes, probe: ProbeStream) -> None:
    try:
        response = await pool.request("POST", url + "/generate", body)
        try:
            if response.status != 200:
                probe.error = f"HTTP {response.status}: {(await response.read())[:300]!r}"
                return
            async for line in response.aiter_lines():
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                event = orjson.loads(data)
                if "error" in event:
                    probe.error = str(event["error"])[:300]
                    break
                meta = event.get("meta_info") or {}
                count = meta.get("completion_tokens", len(event.get("output_ids") or []))
                probe.events.append((int(count), time.perf_counter()))
                probe.changed.set()
        finally:
            response.close()
    except (OSError, orjson.JSONDecodeError) as exc:
        probe.error = f"{type(exc).__name__}: {exc}"
    finally:
        probe.ended = True
        probe.changed.set()


async def _filler(pool: Http1Pool, url: str, body: bytes) -> str | None:
    """A non-streaming batch member; returns an error message, or None (finished or aborted)."""
    try:
        status, raw = await pool.post_json(url + "/generate", body)
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None if status == 200 else f"HTTP {status}: {raw[:300]!r}"


async def _snapshot(client: EngineClient, probe: ProbeStream) -> Snapshot:
    loads: EngineLoads = await client.loads()
    tokens = probe.count
    if loads.snapshot_unix_s is not None:  # the report may be older than its answer: count tokens up to its time
        tokens = min(tokens, probe.count_at(loads.snapshot_unix_s - (time.time() - time.perf_counter())))
    return Snapshot(tokens=tokens, used_tokens=loads.num_used_tokens, running=loads.num_running_reqs,
                    waiting=loads.num_waiting_reqs, taken_unix_s=loads.snapshot_unix_s)


async def _window_reports(client: EngineClient, probe: ProbeStream, upto: int, seen: list[Snapshot]) -> None:
    """Poll ``/v1/loads`` into ``seen`` until the probe has ``upto`` tokens (or ends)."""
    while probe.count < upto and not probe.ended:
        seen.append(await _snapshot(client, probe))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(probe.wait_for(upto), WINDOW_POLL_S)
    seen.append(await _snapshot(client, probe))


def _window_end(start: Snapshot, seen: list[Snapshot], upto: int) -> Snapshot | None:
    """The newest report of the window (after ``start``, at most ``upto`` probe tokens), preferring one that
    still shows the whole batch; None when no report newer than ``start`` was taken in it."""
    newer = [s for s in seen if start.tokens < s.tokens <= upto
             and (s.taken_unix_s is None or start.taken_unix_s is None or s.taken_unix_s > start.taken_unix_s)]
    whole = [s for s in newer if s.running >= start.running]
    chosen = whole or newer
    return chosen[-1] if chosen else None


def _filler_failure(fillers: list[asyncio.Task[str | None]]) -> str | None:
    for task in fillers:
        if task.done() and not task.cancelled() and task.result() is not None:
            return task.result()
    return None


async def _whole_batch(client: EngineClient, probe: ProbeStream, exp: DecodeExperiment,
                       fillers: list[asyncio.Task[str | None]]) -> Snapshot:
    """Poll /v1/loads from the probe's first token until the whole batch runs and nothing waits."""
    await probe.wait_for(1)
    while True:
        if probe.error or probe.ended:
            raise PoiseError(f"decode batch {exp.batch}: the probe ended before the batch was whole "
                             f"({probe.error or 'finished'})")
        failure = _filler_failure(fillers)
        if failure:
            raise PoiseError(f"decode batch {exp.batch}: a batch request failed: {failure}")
        snap = await _snapshot(client, probe)
        if snap.running >= exp.batch and snap.waiting == 0:
            return snap
        await asyncio.sleep(POLL_S)


async def _abort_all(client: EngineClient, rids: list[str]) -> None:
    for rid in rids:
        with contextlib.suppress(EngineError):
            await client.abort(rid)


async def run_experiment(pool: Http1Pool, client: EngineClient, target: EngineTarget, exp: DecodeExperiment,
                         *, steps: int, segments: int, rng: random.Random, has_loads: bool = True,
                         ) -> tuple[list[DecodeSample], str]:
    """One (batch, prompt length) experiment: its samples and a one-line summary.

    ``has_loads``: whether the engine answers ``/v1/loads`` (else the window starts after the planned ramp and
    the context is estimated).
    """
    tag = uuid.uuid4().hex[:12]
    rids = [f"poise-profile-{tag}-{i:04d}" for i in range(exp.batch)]  # fixed width: no rid prefixes another
    probe = ProbeStream()
    fillers = [asyncio.create_task(_filler(pool, target.url, generate_body(
        token_prompt(rng, exp.prompt_tokens), exp.filler_tokens, rid=rid))) for rid in rids[1:]]
    await asyncio.sleep(0)  # the fillers' requests go out first, so the probe tends to be prefilled last
    probe_body = generate_body(token_prompt(rng, exp.prompt_tokens), exp.probe_tokens, rid=rids[0], stream=True)
    reader = asyncio.create_task(_read_probe(pool, target.url, probe_body, probe))
    start: Snapshot | None = None
    end: Snapshot | None = None
    try:
        if has_loads:
            start = await _whole_batch(client, probe, exp, fillers)
            first = start.tokens
        else:
            first = exp.probe_tokens - steps - 4  # past the planned ramp (plan.py)
        if has_loads:
            assert start is not None
            seen: list[Snapshot] = []
            await _window_reports(client, probe, first + steps, seen)
            end = _window_end(start, seen, first + steps)
            if end is None:
                raise PoiseError(f"decode batch {exp.batch}: the engine's load report did not change within "
                                 f"{steps} steps (SGLang publishes it every --load-snapshot-publish-interval "
                                 "decode steps, 15 by default); measure more --decode-steps")
        else:
            await probe.wait_for(first + steps)
    finally:
        await _abort_all(client, rids)
        _, pending = await asyncio.wait([reader, *fillers], timeout=30.0)
        for task in pending:  # an engine that ignores aborts: stop waiting for it
            task.cancel()
    if probe.error:
        raise PoiseError(f"decode batch {exp.batch}: the probe stream failed: {probe.error}")
    last = min(probe.count, first + steps)
    slope = float(exp.batch)
    if start is not None and end is not None:
        if end.running < exp.batch:
            raise PoiseError(f"decode batch {exp.batch}: only {end.running} requests ran at the window's end "
                             "(finished or retracted early); lower the batch or the steps")
        slope = (end.used_tokens - start.used_tokens) / max(1, end.tokens - start.tokens)
        used0, m0 = float(start.used_tokens), start.tokens
        source = "num_used_tokens"
    else:
        used0, m0 = float(exp.batch * exp.prompt_tokens), 0
        source = "estimate"

    def context_at(j: float) -> float:  # the step that makes token j runs over the state after j - 1 tokens
        return used0 + slope * (j - 1 - m0)

    gaps = token_gaps(probe.events, first, last)
    if len(gaps) < max(4, steps // 2):
        raise PoiseError(f"decode batch {exp.batch}: only {len(gaps)} steps measured in the steady window")
    samples = window_samples(gaps, batch=exp.batch, prompt_tokens=exp.prompt_tokens, segments=segments,
                             context_at=context_at, time_scale=target.time_scale, source=source)
    step_ms = statistics.fmean(g for _, g in gaps) / target.time_scale * 1e3
    summary = (f"batch {exp.batch:4d} x {exp.prompt_tokens:5d} prompt tokens: step {step_ms:8.3f} ms (mean of "
               f"{len(gaps)}), context {context_at(first + 1) / 1e3:.1f}K..{context_at(last) / 1e3:.1f}K "
               f"({source}, +{slope:.1f}/step)")
    return samples, summary


async def wait_idle(client: EngineClient, timeout_s: float = 60.0) -> None:
    """Until nothing runs or waits (aborted requests leave between steps)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            loads = await client.loads()
        except EngineError:
            return  # no /v1/loads: nothing to wait on
        if loads.num_running_reqs == 0 and loads.num_waiting_reqs == 0:
            return
        if time.monotonic() > deadline:
            raise PoiseError(f"the engine is still busy after {timeout_s:g}s ({loads.num_running_reqs} running, "
                             f"{loads.num_waiting_reqs} waiting): is something else sending it requests?")
        await asyncio.sleep(0.02)
