"""Prefill measurement: prompts of exact lengths, one at a time on an idle engine, one output token each.

With ``max_new_tokens=1`` a colocated engine's request ends with its prefill, so the request's latency is its
TTFT. Two clocks are recorded per request:

- ``engine``: ``meta_info.e2e_latency`` from the response, the engine's own time from receiving the request
  to finishing it (SGLang's tokenizer manager and engine_sim both report it): no HTTP, no JSON of the prompt;
- ``client``: wall time around the HTTP request here; the fit's intercept absorbs the constant part.

Repetitions are interleaved (every length once, in a new random order, then again) so that a slow spell of a
shared machine spreads over lengths instead of bending the curve; the fit takes each length's fastest
repetition (or its median: fit.py).
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable
from typing import Any, Literal

import orjson

from services.profiler.fit import passes
from services.profiler.prompts import generate_body, token_prompt
from services.profiler.samples import PrefillSample
from services.profiler.target import EngineTarget
from shared.errors import PoiseError
from shared.http1 import Http1Pool

Timing = Literal["auto", "engine", "client"]


class PrefillTiming:
    """Both clocks of every request, in engine seconds, by prompt length."""

    def __init__(self) -> None:
        self.client: dict[int, list[float]] = {}
        self.engine: dict[int, list[float]] = {}
        self.engine_missing = 0

    def samples(self, timing: Timing, chunk: int | None) -> tuple[list[PrefillSample], str]:
        """The samples on the clock ``timing`` asks for (auto: the engine's when every response had it)."""
        use_engine = timing == "engine" or (timing == "auto" and self.engine_missing == 0)
        if use_engine and self.engine_missing:
            raise PoiseError(f"--timing engine: {self.engine_missing} responses had no meta_info.e2e_latency")
        source = self.engine if use_engine else self.client
        label = "engine (meta_info.e2e_latency)" if use_engine else "client (HTTP round trip)"
        return [PrefillSample(tokens=n, passes=passes(n, chunk), seconds=s) for n, s in sorted(source.items())], label


def _check_response(status: int, raw: bytes, tokens: int) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        body = None
    if status != 200 or not isinstance(body, dict):
        raise PoiseError(f"/generate with {tokens} prompt tokens answered HTTP {status}: {raw[:300]!r}")
    meta = body.get("meta_info")
    if not isinstance(meta, dict):
        raise PoiseError("/generate answered without meta_info: not an SGLang /generate response")
    reported = meta.get("prompt_tokens")
    if isinstance(reported, int) and reported != tokens:
        raise PoiseError(f"the engine counted {reported} prompt tokens for {tokens} token ids")
    return meta


async def one_prefill(pool: Http1Pool, target: EngineTarget, rng: random.Random, tokens: int) -> tuple[float, float | None]:
    """One prompt of ``tokens`` ids, one output token: (client seconds, engine seconds or None), wall clock."""
    body = generate_body(token_prompt(rng, tokens), 1, rid=f"poise-profile-{uuid.uuid4().hex}")
    t0 = time.perf_counter()
    try:
        status, raw = await pool.post_json(target.url + "/generate", body)
    except OSError as exc:
        raise PoiseError(f"/generate at {target.url} failed: {exc}") from exc
    client_s = time.perf_counter() - t0
    meta = _check_response(status, raw, tokens)
    e2e = meta.get("e2e_latency")
    return client_s, float(e2e) if isinstance(e2e, int | float) and e2e > 0 else None


async def measure_prefill(pool: Http1Pool, target: EngineTarget, lengths: list[int], repeats: int,
                          rng: random.Random, progress: Callable[[str], None]) -> PrefillTiming:
    timing = PrefillTiming()
    total = len(lengths) * repeats
    done = 0
    scale = target.time_scale
    for rep in range(repeats):
        order = list(lengths)
        rng.shuffle(order)
        for n in order:
            client_s, engine_s = await one_prefill(pool, target, rng, n)
            timing.client.setdefault(n, []).append(client_s / scale)
            if engine_s is None:
                timing.engine_missing += 1
            else:
                timing.engine.setdefault(n, []).append(engine_s / scale)
            done += 1
            shown = f"engine {engine_s / scale * 1e3:9.2f} ms, " if engine_s is not None else ""
            progress(f"prefill [{done:3d}/{total}] rep {rep + 1}/{repeats} {n:6d} tokens "
                     f"({passes(n, target.chunked_prefill_size)} pass): {shown}client {client_s / scale * 1e3:9.2f} ms")
    return timing
