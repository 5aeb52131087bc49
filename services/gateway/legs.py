"""The two HTTP legs of a disaggregated request, as SGLang's router sends them.

The same body, with ``bootstrap_host/port/room`` and ``rid`` added, goes to the prefill engine (which
answers once the prompt is prefilled and its KV is handed off) and to the decode engine (which streams the
tokens). The decode leg streams for streaming clients, so the gateway can time the first token, count tokens
and notice a dead leg before the client does; for non-streaming clients it answers with one JSON body (fewer
wake-ups), unless the gateway's ``move_non_streaming`` asks for a stream, which the gateway assembles, so
that the request can be moved or rescued mid-answer.

Engines registered as ``engine_kind`` ``sim`` (engine_sim) also get the request's resolved SLO as
``poise_slo`` (shared/protocol/request_slo.py). Stock SGLang does not get it: in SGLang 0.5.23 the OpenAI
routes' CompletionRequest / ChatCompletionRequest are pydantic models with pydantic's default
``extra="ignore"`` and /generate's contract (sglang/api/v1 GenerateRequest) ignores unknown keys too, so the
field would be accepted and dropped, i.e. useless; it is left out so SGLang's bodies stay exactly the client's.
``priority`` is SGLang's own field and goes to every engine as the client sent it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from shared.http1 import Http1Pool, Response
from shared.protocol import InstanceInfo
from shared.protocol.length_prediction import PREDICT_FIELD
from shared.protocol.local_prefill import LOCAL_PREFILL_FIELD
from shared.protocol.request_slo import SLO_FIELD, RequestSlo

log = logging.getLogger(__name__)

ENGINE_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


#: Engine answers in 4xx that say nothing about the request itself: the engine was busy or slow.
_TRANSIENT_4XX = frozenset({408, 409, 425, 429})


class LegFailed(Exception):
    """A leg failed before the first token: the request may be retried on another pair, unless ``final``."""

    def __init__(self, instance_id: str, message: str, status: int | None = None) -> None:
        super().__init__(f"{instance_id}: {message}")
        self.instance_id = instance_id
        self.status = status

    @property
    def final(self) -> bool:
        """The engine refused the request (a 4xx such as a prompt past its context length): any engine would."""
        return self.status is not None and 400 <= self.status < 500 and self.status not in _TRANSIENT_4XX


def _error_message(content: bytes) -> str:
    try:
        body = orjson.loads(content)
    except orjson.JSONDecodeError:
        return content[:200].decode(errors="replace")
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            return str(err.get("message") or err)
        return str(body.get("message") or err)
    return str(body)


def _error_status(body: dict[str, Any]) -> int | None:
    """The HTTP status an engine put in a streamed error chunk (SGLang's create_streaming_error_response:
    ``{"error": {..., "code": 429}}``): a stream that already answered 200 carries the failure's status there."""
    err = body.get("error")
    code = err.get("code") if isinstance(err, dict) else None
    return code if isinstance(code, int) and 400 <= code < 600 else None


def new_bootstrap_room() -> int:
    # SGLang's router draws rooms the same way (random 63-bit); collisions are negligible.
    return random.getrandbits(63)


@dataclass
class Event:
    """One decoded SSE event of the decode stream."""

    data: dict[str, Any]
    at: float  # monotonic arrival time
    text: str  # the content it carries ("" for role/usage/empty chunks)
    finish_reason: str | None


def _parse_event(line: bytes, endpoint: str) -> Event:
    payload = orjson.loads(line)
    choices = payload.get("choices") or []
    text = ""
    finish = None
    if choices:
        c = choices[0]
        if endpoint == "chat":
            text = (c.get("delta") or {}).get("content") or ""
        else:
            text = c.get("text") or ""
        finish = c.get("finish_reason")
    return Event(data=payload, at=time.monotonic(), text=text, finish_reason=finish)


@dataclass
class Attempt:
    """One try of a request on one (prefill, decode) pair."""

    rid: str
    endpoint: str
    prefill: InstanceInfo | None
    decode: InstanceInfo
    http: Http1Pool
    prefill_task: asyncio.Task[None] | None = None
    _response: Response | None = None
    _lines: AsyncIterator[bytes] | None = None
    buffered: list[Event] = field(default_factory=list)
    finished: bool = False
    stream: bool = True  # False: the decode leg answers with one JSON body (non-streaming clients)
    result: dict[str, Any] | None = None  # that body, once it arrived
    _decode_task: asyncio.Task[None] | None = None
    slo: Callable[[], RequestSlo] | None = None  # the request's poise_slo as of now (sim engines only)
    # A resumed attempt (migration, rescue) continues after this many tokens the client already has: its
    # engine counts its own tokens from zero, the client's stream does not.
    base_tokens: int = 0
    predict_length: bool = False  # ask a sim decode engine for remaining-length predictions on the stream
    done_seen: bool = False  # the decode stream ended with [DONE] (not with a broken connection)
    last_event_at: float = field(default_factory=time.monotonic)  # the decode stream's last event (or wait start)
    reading: bool = False  # the gateway is waiting for the decode stream's next event
    stalled: str | None = None  # why the gateway gave up on the decode stream (no progress), if it did
    gone: str | None = None  # an engine of the pair that stopped working before the first token (engine_gone)
    gone_why: str = ""  # ... how the gateway knows
    _gone_waiter: asyncio.Future[None] | None = None  # set by engine_gone: a wait for the first token ends
    _first_token_timeout: asyncio.Timeout | None = None  # the common case's wait for it, rescheduled to end it

    def engine_gone(self, instance_id: str, why: str) -> None:
        """One of the pair's engines stopped working (it left the registry, or has not answered a probe) while
        the request waits for its first token: the wait ends now with :class:`LegFailed`, so the request is
        tried on another pair instead of waiting out the first-token timeout."""
        if self.gone is not None:
            return
        self.gone, self.gone_why = instance_id, why
        if self._first_token_timeout is not None:
            self._first_token_timeout.reschedule(asyncio.get_running_loop().time())
        if self._gone_waiter is not None and not self._gone_waiter.done():
            self._gone_waiter.set_result(None)

    def _gone_failure(self) -> LegFailed:
        return LegFailed(self.gone or self.decode.instance_id, f"engine {self.gone} {self.gone_why} before the first token")

    def _gone_future(self) -> asyncio.Future[None]:
        waiter = self._gone_waiter = asyncio.get_running_loop().create_future()
        if self.gone is not None:
            waiter.set_result(None)
        return waiter

    def bodies(self, body: dict[str, Any]) -> tuple[dict[str, Any] | None, dict[str, Any]]:
        decode_body = dict(body)
        decode_body.pop(SLO_FIELD, None)  # only the gateway sets it
        poise_slo = self.slo().to_body() if self.slo is not None else None
        if poise_slo is not None and self.decode.engine_kind == "sim":
            decode_body[SLO_FIELD] = poise_slo
        if self.predict_length and self.decode.engine_kind == "sim":
            decode_body[PREDICT_FIELD] = True
        decode_body["rid"] = self.rid
        decode_body["stream"] = self.stream
        if self.stream:
            # Usage on every chunk (SGLang: StreamOptions.continuous_usage_stats) tells exactly how many tokens
            # the client has, which is where a migrated or rescued request resumes.
            decode_body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        else:
            decode_body.pop("stream_options", None)
        if self.prefill is None:
            if self.decode.role == "decode":  # DOPD's local prefill: the decode engine prefills it itself
                decode_body[LOCAL_PREFILL_FIELD] = True
            return None, decode_body
        room = new_bootstrap_room()
        decode_body["bootstrap_host"] = self.prefill.bootstrap_host
        decode_body["bootstrap_port"] = self.prefill.bootstrap_port
        decode_body["bootstrap_room"] = room
        prefill_body = dict(decode_body)
        prefill_body["stream"] = False
        prefill_body.pop("stream_options", None)
        prefill_body.pop(SLO_FIELD, None)
        prefill_body.pop(PREDICT_FIELD, None)
        if poise_slo is not None and self.prefill.engine_kind == "sim":
            prefill_body[SLO_FIELD] = poise_slo
        return prefill_body, decode_body

    async def start(self, body: dict[str, Any]) -> None:
        prefill_body, decode_body = self.bodies(body)
        path = ENGINE_PATHS[self.endpoint]
        if self.prefill is not None and prefill_body is not None:
            self.prefill_task = asyncio.create_task(self._run_prefill(self.prefill.url + path, prefill_body))
        if not self.stream:
            # One response, no per-token events: fewer wake-ups on both sides of the gateway.
            self._decode_task = asyncio.create_task(self._run_decode_whole(self.decode.url + path, decode_body))
            return
        try:
            self._response = await self.http.request("POST", self.decode.url + path, orjson.dumps(decode_body))
            if self._response.status != 200:
                content = await self._response.read()
                self._response.close()
                raise LegFailed(self.decode.instance_id, _error_message(content), self._response.status)
        except OSError as exc:  # includes TimeoutError
            raise LegFailed(self.decode.instance_id, f"cannot reach decode engine: {exc!r}") from exc
        self._lines = self._response.aiter_lines().__aiter__()

    async def _run_decode_whole(self, url: str, body: dict[str, Any]) -> None:
        try:
            status, content = await self.http.post_json(url, orjson.dumps(body))
        except OSError as exc:
            raise LegFailed(self.decode.instance_id, f"cannot reach decode engine: {exc!r}") from exc
        if status != 200:
            raise LegFailed(self.decode.instance_id, _error_message(content), status)
        try:
            result = orjson.loads(content)
        except orjson.JSONDecodeError as exc:
            raise LegFailed(self.decode.instance_id, f"malformed response: {content[:100]!r}") from exc
        if not isinstance(result, dict) or not result.get("choices"):
            raise LegFailed(self.decode.instance_id, _error_message(content))
        self.result = result
        self.finished = True

    async def _run_prefill(self, url: str, body: dict[str, Any]) -> None:
        assert self.prefill is not None
        try:
            status, content = await self.http.post_json(url, orjson.dumps(body))
        except OSError as exc:
            raise LegFailed(self.prefill.instance_id, f"cannot reach prefill engine: {exc!r}") from exc
        if status != 200:
            raise LegFailed(self.prefill.instance_id, _error_message(content), status)

    async def next_event(self) -> Event | None:
        """The next decode event, or None at ``[DONE]`` / end of stream."""
        if self.buffered:
            return self.buffered.pop(0)
        return await self._read_event()

    async def _read_event(self) -> Event | None:
        assert self._lines is not None
        # Progress is judged only while the gateway waits on the engine: a client reading slowly holds the
        # stream up at the gateway's side, and that is no stall of the engine.
        self.last_event_at = time.monotonic()
        self.reading = True
        try:
            return await self._next_decode_event()
        finally:
            self.reading = False

    async def _next_decode_event(self) -> Event | None:
        assert self._lines is not None
        while True:
            try:
                line = await self._lines.__anext__()
            except StopAsyncIteration:
                raise LegFailed(self.decode.instance_id, self.stalled or "the decode stream ended without [DONE]") from None
            except (OSError, EOFError, ValueError) as exc:  # EOFError: asyncio.IncompleteReadError, a cut chunk
                raise LegFailed(self.decode.instance_id, self.stalled or f"the decode stream broke: {exc!r}") from exc
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                self.done_seen = True
                # Read the body's end too, so the connection goes back to the pool instead of being closed.
                with contextlib.suppress(OSError):
                    async for _ in self._lines:
                        pass
                return None
            self.last_event_at = time.monotonic()
            try:
                event = _parse_event(data, self.endpoint)
            except orjson.JSONDecodeError:
                log.warning("decode engine %s sent a malformed event: %.100r", self.decode.instance_id, data)
                continue
            if "error" in event.data and not event.data.get("choices"):
                raise LegFailed(self.decode.instance_id, _error_message(data), _error_status(event.data))
            return event

    def give_up_stalled(self, reason: str) -> None:
        """End the decode stream: its engine made no progress. The read waiting on it fails with ``reason``
        (a :class:`LegFailed`), which the request's flow rescues like any broken stream."""
        if self._response is not None and not self.finished:
            self.stalled = reason
            self._response.abort()

    async def wait_first_token(self, timeout_s: float) -> None:
        """Read until the first content token, watching the prefill leg meanwhile.

        Raises :class:`LegFailed` when either leg fails first, or on timeout; the events read are kept in
        ``buffered`` and replayed by :meth:`next_event`.
        """
        if self._decode_task is not None:
            await self._wait_whole(timeout_s)
            return
        deadline = time.monotonic() + timeout_s
        reader: asyncio.Future[Event | None] | None = None
        while self.prefill_task is None or self.prefill_task.done():
            # Common case (colocated engine, or the prefill leg already answered): no race to watch, so read
            # without the task and wait() machinery.
            if self.prefill_task is not None and self.prefill_task.exception() is not None:
                raise self.prefill_task.exception()  # type: ignore[misc]
            if self.gone is not None:
                raise self._gone_failure()
            try:
                async with asyncio.timeout_at(asyncio.get_running_loop().time() + max(0.0, deadline - time.monotonic())) as cm:
                    self._first_token_timeout = cm  # engine_gone ends it early
                    event = await self._read_event()
            except TimeoutError:
                if self.gone is not None:
                    raise self._gone_failure() from None
                raise LegFailed(self.decode.instance_id, f"no first token within {timeout_s:.0f}s") from None
            finally:
                self._first_token_timeout = None
            if event is None:
                raise LegFailed(self.decode.instance_id, "decode stream ended before the first token")
            self.buffered.append(event)
            if event.text or event.finish_reason:
                return
        gone = self._gone_future()
        while True:
            if reader is None:
                reader = asyncio.ensure_future(self._read_event())
            waiting: set[asyncio.Future[Any]] = {reader, gone}
            if self.prefill_task is not None and not self.prefill_task.done():
                waiting.add(self.prefill_task)
            done, _ = await asyncio.wait(waiting, timeout=max(0.0, deadline - time.monotonic()),
                                         return_when=asyncio.FIRST_COMPLETED)
            if not done:
                reader.cancel()
                raise LegFailed(self.decode.instance_id, f"no first token within {timeout_s:.0f}s")
            if gone in done:
                reader.cancel()
                raise self._gone_failure()
            prefill_error = self.prefill_task.exception() if self.prefill_task in done else None  # type: ignore[union-attr]
            if prefill_error is not None:
                reader.cancel()
                raise prefill_error
            if reader not in done:
                continue  # the prefill leg finished fine; keep waiting for the decode side
            event, reader = reader.result(), None
            if event is None:
                raise LegFailed(self.decode.instance_id, "decode stream ended before the first token")
            self.buffered.append(event)
            if event.text or event.finish_reason:
                return

    async def _wait_whole(self, timeout_s: float) -> None:
        """Non-streaming decode leg: wait for its whole answer, failing early if the prefill leg fails."""
        assert self._decode_task is not None
        gone = self._gone_future()
        waiting: set[asyncio.Future[Any]] = {self._decode_task, gone}
        if self.prefill_task is not None:
            waiting.add(self.prefill_task)
        deadline = time.monotonic() + timeout_s
        while not self._decode_task.done():
            done, _ = await asyncio.wait(waiting, timeout=max(0.0, deadline - time.monotonic()),
                                         return_when=asyncio.FIRST_COMPLETED)
            if not done:
                raise LegFailed(self.decode.instance_id, f"no answer within {timeout_s:.0f}s")
            if gone in done:
                raise self._gone_failure()
            if self.prefill_task in done:
                waiting.discard(self.prefill_task)
                if self.prefill_task.exception() is not None:  # type: ignore[union-attr]
                    raise self.prefill_task.exception()  # type: ignore[misc, union-attr]
        self._decode_task.result()  # raises the decode leg's LegFailed

    async def close(self) -> None:
        if self._decode_task is not None and not self._decode_task.done():
            self._decode_task.cancel()
        if self._decode_task is not None:
            with contextlib.suppress(BaseException):
                await self._decode_task
        if self._response is not None:
            self._response.close()
        if self.prefill_task is not None and not self.prefill_task.done():
            self.prefill_task.cancel()
        if self.prefill_task is not None:
            with contextlib.suppress(BaseException):
                await self.prefill_task

    async def abort(self) -> None:
        """Tell both engines to drop the request (best effort; they may have finished already)."""
        targets = [i for i in (self.prefill, self.decode) if i is not None]
        await asyncio.gather(*(self._abort_one(i) for i in targets), return_exceptions=True)

    async def _abort_one(self, info: InstanceInfo) -> None:
        with contextlib.suppress(OSError):
            await asyncio.wait_for(self.http.post_json(info.url + "/abort_request", orjson.dumps({"rid": self.rid})), 2.0)
