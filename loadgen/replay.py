"""Timed, streaming replay of a workload against an OpenAI-compatible server.

Owns the open-loop client: each request is sent at its (rate-scaled) arrival
time regardless of how earlier requests fare, exactly as production traffic
would arrive, and its streamed response is timed token by token. One failing
request is recorded as an error and never stops the run. The HTTP client is a
single shared `httpx.AsyncClient` (HTTP/1.1, a large connection pool) so the
client itself does not become the bottleneck it is measuring.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Literal

import httpx
import msgspec
import orjson

from loadgen.metrics import Summary, percentile, summarize
from loadgen.progress import ReplayProgress, print_progress
from loadgen.prompts import DEFAULT_VOCAB_SIZE, prompt_text, prompt_token_ids
from loadgen.records import RequestRecord, Status
from loadgen.slo import SLO, SLOClasses, slo_for
from loadgen.sse import StreamAccumulator, error_message
from loadgen.workload import TraceRequest, Workload
from shared.protocol.refusal import REFUSAL_STATUSES, RETRY_COUNT_HEADER, client_wait_s

__all__ = [
    "Endpoint",
    "ReplayProgress",
    "ReplayResult",
    "build_request_body",
    "endpoint_url",
    "print_progress",
    "replay",
]

Endpoint = Literal["completions", "chat"]


class ReplayResult(msgspec.Struct):
    """Everything a replay measured: per-request records, their summary and the run config.

    ``started_at`` is the wall-clock start (ISO 8601, UTC); record times are
    seconds relative to that start. ``wall_s`` runs from the start to the last
    response's end.
    """

    records: list[RequestRecord]
    summary: Summary
    wall_s: float
    started_at: str
    config: dict[str, Any] = {}

    def counted(self) -> tuple[list[RequestRecord], float]:
        """The records the summary counts and the span it spreads them over (see :func:`after_warmup`)."""
        return after_warmup(self.records, self.wall_s, float(self.config.get("warmup_s") or 0.0))


def after_warmup(records: list[RequestRecord], wall_s: float, warmup_s: float) -> tuple[list[RequestRecord], float]:
    """Requests arriving in the first ``warmup_s`` seconds are served but not counted (the simulator's warm-up,
    docs/evaluation.md); the rates are over the rest of the run."""
    if warmup_s <= 0:
        return records, wall_s
    return [r for r in records if r.arrival_s >= warmup_s], wall_s - min(warmup_s, wall_s)


def endpoint_url(base_url: str, endpoint: Endpoint) -> str:
    """Full URL of the endpoint; ``base_url`` may or may not already end in ``/v1``."""
    base = base_url.rstrip("/")
    if not base.endswith("/v1"):
        base += "/v1"
    if endpoint == "completions":
        return base + "/completions"
    if endpoint == "chat":
        return base + "/chat/completions"
    raise ValueError(f"endpoint must be 'completions' or 'chat', got {endpoint!r}")


def build_request_body(
    request: TraceRequest,
    *,
    model: str,
    endpoint: Endpoint,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    slo: SLO | None = None,
) -> bytes:
    """JSON body asking for exactly the trace's lengths.

    ``completions`` sends the prompt as token ids (exact input length) with
    ``ignore_eos`` and ``max_tokens`` (exact output length). ``chat`` sends
    approximate-length text (~4 chars/token) and is meant for demos. With
    ``slo`` (the request's SLO class targets) the body carries Poise's ``slo``
    extension field, ``{"name": <the request's slo_class>, "ttft_s", "tpot_s"}``:
    the Poise gateway hands the targets to the engines' schedulers (see
    services/gateway/slo.py); other OpenAI servers ignore or reject unknown
    fields, so it is only sent when asked for.
    """
    common: dict[str, Any] = {
        "model": model,
        "max_tokens": request.output_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
    }
    if endpoint == "completions":
        prompt: dict[str, Any] = {
            "prompt": prompt_token_ids(request.index, request.input_tokens, request.hash_ids, vocab_size)
        }
    elif endpoint == "chat":
        text = prompt_text(request.index, request.input_tokens, request.hash_ids)
        prompt = {"messages": [{"role": "user", "content": text}]}
    else:
        raise ValueError(f"endpoint must be 'completions' or 'chat', got {endpoint!r}")
    if slo is not None:
        target: dict[str, Any] = {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s}
        if request.slo_class is not None:
            target["name"] = request.slo_class
        common["slo"] = target
    return orjson.dumps({"model": model, **prompt, **common})


def _http_error_text(raw: bytes) -> str:
    try:
        message = error_message(orjson.loads(raw))
    except orjson.JSONDecodeError:
        message = None
    if message:
        return message
    text = raw.decode("utf-8", "replace").strip()
    return text[:500] or "(empty body)"


class _Run:
    """State shared by the request tasks of one replay."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        url: str,
        headers: dict[str, str],
        *,
        model: str,
        endpoint: Endpoint,
        vocab_size: int,
        timeout_s: float,
        keep_token_times: bool,
        concurrency_limit: int | None,
        slo_classes: SLOClasses | None = None,
        client_retries: int = 0,
    ) -> None:
        self.client = client
        self.client_retries = client_retries
        self.url = url
        self.headers = headers
        self.model = model
        self.endpoint: Endpoint = endpoint
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self.keep_token_times = keep_token_times
        self.semaphore = asyncio.Semaphore(concurrency_limit) if concurrency_limit else None
        self.slo_classes = slo_classes
        self.run_id = secrets.token_hex(3)
        self.t0 = time.perf_counter()
        self.sent = 0
        self.done = 0
        self.failed = 0
        self.ttfts: list[float] = []

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def send(self, request: TraceRequest) -> RequestRecord:
        if self.semaphore is None:
            return await self._send(request)
        async with self.semaphore:
            return await self._send(request)

    async def _send(self, request: TraceRequest) -> RequestRecord:
        rid = f"lg-{self.run_id}-{request.index}"
        error: str | None = None
        http_status: int | None = None
        stream = StreamAccumulator(self.keep_token_times)
        finished: float | None = None
        try:
            target = None
            if self.slo_classes is not None and request.slo_class is not None:
                target = self.slo_classes.slo_of(request.slo_class)
            body = build_request_body(request, model=self.model, endpoint=self.endpoint, vocab_size=self.vocab_size,
                                      slo=target)
        except Exception as exc:  # a bad request must not abort the run
            body = b""
            error = f"could not build request: {type(exc).__name__}: {exc}"
        headers = {**self.headers, "X-Request-Id": rid}
        self.sent += 1
        sent = self.now()
        attempts = 0
        while error is None:
            # As the openai client does: each send says how many came before it.
            headers[RETRY_COUNT_HEADER] = str(attempts)
            attempts += 1
            http_status, error, stream, finished, retry_after = await self._attempt(body, headers)
            if http_status not in REFUSAL_STATUSES or attempts > self.client_retries:
                break
            await asyncio.sleep(client_wait_s(retry_after, attempts))
            error = None
        if finished is None or error is not None:
            finished = self.now()
        self.done += 1
        status: Status
        if error is None:
            status = "ok"
            if stream.first_token_s is not None:
                self.ttfts.append(stream.first_token_s - sent)
        else:
            status = "error"
            self.failed += 1
        return RequestRecord(
            index=request.index,
            rid=rid,
            arrival_s=request.arrival_s,
            sent_s=sent,
            first_token_s=stream.first_token_s,
            finished_s=finished,
            input_tokens=request.input_tokens,
            output_tokens_expected=request.output_tokens,
            output_tokens_received=stream.tokens_received,
            status=status,
            error=error,
            http_status=http_status,
            token_times_s=stream.token_times_s,
            slo_class=request.slo_class,
            attempts=max(attempts, 1),
        )

    async def _attempt(self, body: bytes, headers: dict[str, str]
                       ) -> tuple[int | None, str | None, StreamAccumulator, float | None, float | None]:
        """One send of a request: (HTTP status, error, what streamed, when it finished, Retry-After seconds)."""
        http_status: int | None = None
        error: str | None = None
        retry_after: float | None = None
        stream = StreamAccumulator(self.keep_token_times)
        finished: float | None = None
        try:
            async with asyncio.timeout(self.timeout_s):
                async with self.client.stream("POST", self.url, content=body, headers=headers) as response:
                    http_status = response.status_code
                    if not 200 <= http_status < 300:
                        raw = await response.aread()
                        error = f"HTTP {http_status}: {_http_error_text(raw)}"
                        with contextlib.suppress(TypeError, ValueError):
                            retry_after = float(response.headers.get("retry-after"))
                    else:
                        # Drain to EOF (not just [DONE]) so the connection can be reused.
                        async for line in response.aiter_lines():
                            was_done = stream.done
                            if stream.feed_line(line, self.now()) and not was_done:
                                finished = self.now()
                        if stream.error is not None:
                            error = f"stream error: {stream.error}"
        except TimeoutError:
            error = f"timeout: no complete response within {self.timeout_s:g} s"
        except httpx.TimeoutException as exc:
            error = f"timeout: {type(exc).__name__}: {exc}"
        except Exception as exc:  # one failure must not abort the replay
            error = f"{type(exc).__name__}: {exc}"
        return http_status, error, stream, finished, retry_after

    def snapshot(self, total: int, final: bool = False) -> ReplayProgress:
        return ReplayProgress(
            total=total,
            sent=self.sent,
            done=self.done,
            failed=self.failed,
            in_flight=self.sent - self.done,
            elapsed_s=self.now(),
            ttft_p50_s=percentile(self.ttfts, 50) if self.ttfts else None,
            final=final,
        )


async def _report_progress(
    run: _Run, total: int, callback: Callable[[ReplayProgress], None], interval_s: float
) -> None:
    while True:
        await asyncio.sleep(interval_s)
        callback(run.snapshot(total))


async def replay(
    workload: Workload,
    base_url: str,
    *,
    model: str,
    endpoint: Endpoint = "completions",
    rate_scale: float = 1.0,
    slo: SLO | None = None,
    slo_classes: SLOClasses | None = None,
    concurrency_limit: int | None = None,
    timeout_s: float = 600.0,
    api_key: str | None = None,
    progress: Callable[[ReplayProgress], None] | None = None,
    progress_interval_s: float = 1.0,
    keep_token_times: bool = True,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    max_connections: int = 2000,
    client: httpx.AsyncClient | None = None,
    send_slo: bool = True,
    client_retries: int = 0,
) -> ReplayResult:
    """Replay ``workload`` open-loop against ``base_url`` and measure every request.

    Request ``i`` is sent at ``arrival_s / rate_scale`` seconds after the start
    (``rate_scale=2`` doubles the request rate, as `Workload.scale_rate`).
    ``concurrency_limit`` optionally caps requests in flight (later ones then
    wait, which shows up as lateness: ``sent_s - arrival_s``). ``timeout_s``
    bounds each request's total time. ``slo`` defaults to the trace's Arrow
    Table 1 SLO (`slo_for`). Each record keeps its request's ``slo_class``;
    with ``slo_classes`` the summary judges a request against its class's SLO
    and breaks attainment down per class (label the workload first with
    `SLOClasses.assign`); each request then also tells the gateway its
    class's targets (the ``slo`` body field, see `build_request_body`) unless
    ``send_slo`` is False. ``progress`` is called about every
    ``progress_interval_s`` and once more at the end (``final=True``); pass
    `print_progress` for a status line. ``client`` lets a caller supply its own
    `httpx.AsyncClient` (it is then not closed here); otherwise one is created
    with HTTP/2 off, ``max_connections`` pooled connections and proxies from the
    environment ignored (a benchmark should reach the server directly).
    ``client_retries``: a refused request (429/503) is sent again up to this
    many times, as the ``openai`` client does (after ``Retry-After``, else a
    backoff); its times stay its first send's and ``attempts`` counts the sends.
    """
    if concurrency_limit is not None and concurrency_limit < 1:
        raise ValueError(f"concurrency_limit must be >= 1, got {concurrency_limit}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    slo = slo if slo is not None else slo_for(workload.name)
    url = endpoint_url(base_url, endpoint)
    scheduled = workload.scale_rate(rate_scale)
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    own_client = client is None
    if client is None:
        client = httpx.AsyncClient(
            http1=True,
            http2=False,
            timeout=httpx.Timeout(timeout_s),
            limits=httpx.Limits(
                max_connections=max(max_connections, concurrency_limit or 0),
                max_keepalive_connections=max(max_connections, concurrency_limit or 0),
            ),
            trust_env=False,
        )
    started_at = datetime.now(UTC).isoformat()
    run = _Run(
        client,
        url,
        headers,
        model=model,
        endpoint=endpoint,
        vocab_size=vocab_size,
        timeout_s=timeout_s,
        keep_token_times=keep_token_times,
        concurrency_limit=concurrency_limit,
        slo_classes=slo_classes if send_slo else None,
        client_retries=client_retries,
    )
    total = len(scheduled)
    reporter = (
        asyncio.create_task(_report_progress(run, total, progress, progress_interval_s))
        if progress is not None
        else None
    )
    try:
        tasks: list[asyncio.Task[RequestRecord]] = []
        for request in scheduled:
            delay = request.arrival_s - run.now()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(run.send(request)))
        records = list(await asyncio.gather(*tasks))
        wall_s = run.now()
    finally:
        if reporter is not None:
            reporter.cancel()
        if own_client:
            await client.aclose()
    if progress is not None:
        progress(run.snapshot(total, final=True))
    config: dict[str, Any] = {
        "workload": workload.name,
        "requests": total,
        "trace_duration_s": workload.duration_s,
        "base_url": base_url,
        "url": url,
        "model": model,
        "endpoint": endpoint,
        "rate_scale": rate_scale,
        "concurrency_limit": concurrency_limit,
        "timeout_s": timeout_s,
        "keep_token_times": keep_token_times,
        "vocab_size": vocab_size,
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s},
    }
    if slo_classes is not None:  # only then, so a run without classes records the same config as before
        config["slo_classes"] = slo_classes.specs
        config["send_slo"] = send_slo
    return ReplayResult(
        records=records,
        summary=summarize(records, slo, wall_s, slo_classes),
        wall_s=wall_s,
        started_at=started_at,
        config=config,
    )
