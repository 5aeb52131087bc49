"""One client request from dispatch to the last token: pick a pair, run the legs, retry, account.

Retry rule: a leg that fails before the first token (engine unreachable, error status, KV handoff
failure, no token in time) is aborted on both engines and the request is placed again, excluding the
failed engine, up to ``retries`` times. After the first token the stream belongs to the client; a failure
then ends it with an error event (resuming mid-answer is the recompute-migration path of a later issue).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson

from services.gateway.cluster import ClusterView
from services.gateway.errors import APIError
from services.gateway.late_binding import HeldRequest, LateBindingQueue
from services.gateway.legs import Attempt, Event, LegFailed
from services.gateway.metrics import GatewayMetrics
from services.gateway.validation import ParsedRequest
from shared.http1 import Http1Pool
from shared.policies import DispatchPolicy, Placement, RequestView
from shared.protocol.request_slo import RequestSlo

log = logging.getLogger(__name__)


_ID_PREFIX = uuid.uuid4().hex[:16]
_ID_COUNTER = itertools.count()


def _next_id() -> str:
    # Unique per gateway process without a uuid4 (an os.urandom call) per request.
    return f"{_ID_PREFIX}{next(_ID_COUNTER):08x}"


@dataclass
class Outcome:
    """What happened to a request, for metrics and the monitor's events."""

    status: str = "ok"  # ok | error | aborted
    error: str | None = None
    prefill_id: str | None = None
    decode_id: str | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    output_tokens: int = 0
    content_chunks: int = 0


class RequestFlow:
    def __init__(self, parsed: ParsedRequest, *, cluster: ClusterView, policy: DispatchPolicy, http: Http1Pool,
                 metrics: GatewayMetrics, retries: int, first_token_timeout_s: float,
                 late_binding: LateBindingQueue | None = None) -> None:
        self.parsed = parsed
        self.cluster = cluster
        self.policy = policy
        self.http = http
        self.metrics = metrics
        self.retries = retries
        self.first_token_timeout_s = first_token_timeout_s
        self.late_binding = late_binding
        self.client_id = ("chatcmpl-" if parsed.endpoint == "chat" else "cmpl-") + _next_id()
        self.created = int(time.time())
        self.arrived = time.monotonic()
        self.arrived_unix = time.time()
        self.outcome = Outcome()
        self.attempt: Attempt | None = None
        self._placement: Placement | None = None
        self._held: list[tuple[str, int]] = []

    # -- dispatch ----------------------------------------------------------------------------------
    def _place(self, exclude: frozenset[str]) -> Placement:
        p = self.parsed
        slo = p.slo
        request = RequestView(rid=self.client_id, input_tokens=p.input_tokens, max_output_tokens=p.max_tokens,
                              priority=p.priority, slo_ttft_s=slo.ttft_s if slo else None,
                              slo_tpot_s=slo.tpot_s if slo else None)
        decision = self.policy.place(request, self.cluster.engines(p.model), time.monotonic(), exclude)
        if isinstance(decision, Placement):
            return decision
        self.metrics.rejections.labels("overloaded" if decision.retryable else "no_capacity").inc()
        if decision.retryable:
            raise APIError(429, decision.reason, type_="rate_limit_error", code="overloaded", headers={"retry-after": "1"})
        raise APIError(503, decision.reason, type_="service_unavailable", code="no_capacity")

    def _place_and_hold(self, exclude: frozenset[str]) -> Placement:
        """Place the request and take its engines' slots, in one synchronous step (the late-binding queue
        relies on the counts being updated before it decides the next request)."""
        placement = self._place(exclude)
        self._hold(placement)
        return placement

    def _held_request(self) -> HeldRequest:
        p = self.parsed
        ttft = p.slo.ttft_s if p.slo is not None and p.slo.ttft_s is not None else float("inf")
        return HeldRequest(rid=self.client_id, model=p.model, arrival_s=self.arrived, input_tokens=p.input_tokens,
                           slo_ttft_s=ttft)

    def request_slo(self) -> RequestSlo:
        """What sim engines get as ``poise_slo``: the resolved SLO, and how long the request has been here."""
        waited = time.monotonic() - self.arrived
        if self.parsed.slo is None:
            return RequestSlo(waited_s=max(0.0, waited))
        return self.parsed.slo.request_slo(waited)

    def _hold(self, placement: Placement) -> None:
        p = self.parsed
        if placement.prefill_id is not None:
            self._held.append((placement.prefill_id, p.input_tokens))
        self._held.append((placement.decode_id, p.input_tokens + p.max_tokens))
        for instance_id, tokens in self._held:
            self.cluster.acquire(instance_id, tokens)

    def _release(self) -> None:
        for instance_id, tokens in self._held:
            self.cluster.release(instance_id, tokens)
        self._held.clear()

    def _prefill_done(self, placement: Placement) -> None:
        """The first token reached the decode side: the prefill engine's part is over (its queue is shorter)."""
        if placement.prefill_id is None:
            return
        entry = (placement.prefill_id, self.parsed.input_tokens)
        if entry in self._held:
            self._held.remove(entry)
            self.cluster.release(*entry)

    def _prefill_leg_done(self, placement: Placement, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is None and self.attempt is not None \
                and self.attempt.prefill_task is task:
            self._prefill_done(placement)

    async def start(self) -> None:
        """Dispatch and wait for the first token, retrying on another pair; raises :class:`APIError`."""
        exclude: set[str] = set()
        last_error: LegFailed | None = None
        for attempt_no in range(self.retries + 1):
            try:
                if attempt_no == 0 and self.late_binding is not None:
                    # Waits in the gateway until a prefill engine has room and it is this request's turn;
                    # retries go straight out (the request already waited its turn).
                    placement = await self.late_binding.admit(self._held_request(), self._place_and_hold)
                else:
                    placement = self._place_and_hold(frozenset(exclude))
            except APIError:
                if last_error is None:
                    raise
                break  # nothing left to retry on: report the leg failure below
            instances = self.cluster.instances
            if placement.decode_id not in instances or (placement.prefill_id and placement.prefill_id not in instances):
                self._release()
                exclude.update(i for i in (placement.prefill_id, placement.decode_id) if i)
                continue  # deregistered between snapshot and now
            attempt = Attempt(
                rid=f"{self.client_id}-{attempt_no}", endpoint=self.parsed.endpoint,
                prefill=instances[placement.prefill_id] if placement.prefill_id else None,
                decode=instances[placement.decode_id], http=self.http, stream=self.parsed.stream,
                slo=self.request_slo,
            )
            self.attempt = attempt
            self.outcome.prefill_id, self.outcome.decode_id = placement.prefill_id, placement.decode_id
            try:
                await attempt.start(self.parsed.body)
                if attempt.prefill_task is not None:
                    # The prompt is prefilled (and its KV handed off) when the prefill leg answers: its engine's
                    # queue is shorter from then on, whatever the decode side does (a non-streaming client's
                    # first token is only seen at the end).
                    attempt.prefill_task.add_done_callback(functools.partial(self._prefill_leg_done, placement))
                # A non-streaming answer arrives whole, so it gets the request's deadline (enforced around
                # start() by the caller), not the first-token one.
                await attempt.wait_first_token(self.first_token_timeout_s if self.parsed.stream else float("inf"))
                self._prefill_done(placement)
                return
            except LegFailed as exc:
                last_error = exc
                log.warning("request %s attempt %d failed before the first token: %s", self.client_id, attempt_no, exc)
                await attempt.abort()
                await attempt.close()
                self._release()
                self.attempt = None
                exclude.add(exc.instance_id)
                if attempt_no < self.retries:
                    self.metrics.retries.inc()
        assert last_error is not None
        status = last_error.status if last_error.status and 400 <= last_error.status < 500 else 502
        raise APIError(status, f"engine error: {last_error}", type_="server_error" if status >= 500 else "invalid_request_error",
                       code="engine_error")

    # -- streaming ---------------------------------------------------------------------------------
    async def events(self) -> AsyncIterator[Event]:
        """Decode events after :meth:`start`, with timing and token accounting."""
        assert self.attempt is not None
        attempt = self.attempt
        while True:
            event = await attempt.next_event()
            if event is None:
                attempt.finished = True
                return
            if event.text:
                if self.outcome.first_token_at is None:
                    self.outcome.first_token_at = event.at
                self.outcome.last_token_at = event.at
                self.outcome.content_chunks += 1
            usage = event.data.get("usage")
            if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
                self.outcome.output_tokens = int(usage["completion_tokens"])
            yield event

    def sse_chunk(self, event: Event) -> bytes | None:
        """Re-id an engine chunk as the client's; drop the usage chunk the client did not ask for."""
        data = event.data
        if not data.get("choices") and data.get("usage") is not None and not self.parsed.include_usage:
            return None
        data["id"] = self.client_id
        if not self.parsed.include_usage and data.get("choices"):
            data.pop("usage", None)
        return b"data: " + orjson.dumps(data) + b"\n\n"

    async def collect(self) -> dict[str, Any]:
        """The non-streaming OpenAI response: the decode leg's own, re-id'd (or assembled from a stream)."""
        if self.attempt is not None and self.attempt.result is not None:
            body = self.attempt.result
            body["id"] = self.client_id
            reported = body.get("usage")
            if isinstance(reported, dict) and reported.get("completion_tokens") is not None:
                self.outcome.output_tokens = int(reported["completion_tokens"])
            return body
        parts: list[str] = []
        finish: str | None = None
        usage: dict[str, Any] | None = None
        async for event in self.events():
            parts.append(event.text)
            finish = event.finish_reason or finish
            if isinstance(event.data.get("usage"), dict):
                usage = event.data["usage"]
        text = "".join(parts)
        if self.parsed.endpoint == "chat":
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                      "logprobs": None, "finish_reason": finish}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            obj = "text_completion"
        if usage is None:
            usage = {"prompt_tokens": self.parsed.input_tokens, "completion_tokens": self.outcome.content_chunks,
                     "total_tokens": self.parsed.input_tokens + self.outcome.content_chunks}
        return {"id": self.client_id, "object": obj, "created": self.created, "model": self.parsed.model,
                "choices": [choice], "usage": usage}

    # -- ending ------------------------------------------------------------------------------------
    def conclude(self, *, status: str = "ok", error: str | None = None) -> Attempt | None:
        """Settle the outcome and release the engines' slots; returns the attempt still to clean up.

        Synchronous on purpose: it runs in ``finally`` blocks of cancelled tasks (a client that hung up),
        where any ``await`` would be cancelled again before it could do anything.
        """
        if self.outcome.status == "ok":
            self.outcome.status, self.outcome.error = status, error
        attempt, self.attempt = self.attempt, None
        if attempt is not None and not attempt.finished and self.outcome.status == "ok":
            self.outcome.status = "aborted"
        self._release()
        if not self.outcome.output_tokens:
            self.outcome.output_tokens = self.outcome.content_chunks
        return attempt

    @staticmethod
    async def cleanup(attempt: Attempt) -> None:
        """Abort both legs unless the decode stream ran to its end, and close the connections."""
        if not attempt.finished:
            await attempt.abort()
        await attempt.close()

    def ttft_s(self) -> float | None:
        return None if self.outcome.first_token_at is None else self.outcome.first_token_at - self.arrived

    def tpot_s(self) -> float | None:
        o = self.outcome
        if o.first_token_at is None or o.last_token_at is None or o.output_tokens < 2:
            return None
        return (o.last_token_at - o.first_token_at) / (o.output_tokens - 1)
