"""One client request from dispatch to the last token: pick a pair, run the legs, retry, account.

Retry rule: a leg that fails before the first token (engine unreachable, error status, KV handoff
failure, no token in time) is aborted on both engines and the request is placed again, excluding the
failed engine, up to ``retries`` times. Not retried: a request the engine refused for itself (a 4xx other
than the busy ones), and, with ``refuse_late`` (the gateway's early rejection), a request already past its
TTFT target (a colocated engine that gave it up, for one): the gateway refuses a request it holds that
long, and another pair would only serve it late in the place of one with time left.

After the first token the stream belongs to the client, and the gateway keeps it whole across engines: a
move to another decode engine (the migrator's) or a rescue of a broken stream is carried out between two
tokens (``moving.py``).

Token positions come from the usage the engines put on every chunk (``continuous_usage_stats``); usage
sent to the client counts the whole answer, whichever engines produced it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson

from services.gateway.admission import Admission, Ticket
from services.gateway.cluster import ClusterView
from services.gateway.errors import APIError
from services.gateway.legs import Attempt, Event, LegFailed
from services.gateway.metrics import GatewayMetrics
from services.gateway.moving import Moves, Spawn
from services.gateway.responses import whole_response
from services.gateway.validation import ParsedRequest
from shared.engine import prompt_blocks
from shared.http1 import Http1Pool
from shared.policies import DispatchPolicy, Placement, RequestView
from shared.policies.length import counted_down
from shared.protocol.length_prediction import PREDICTION_FIELD
from shared.protocol.refusal import retry_after_header
from shared.protocol.request_slo import RequestSlo

log = logging.getLogger(__name__)


def _next_id() -> str:
    # 128 random bits: the id reaches the client (x-request-id) and names the request on the engines, whose
    # /abort_request takes it, so it must not be guessable from another client's id.
    return secrets.token_hex(16)


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
    cached_tokens: int = 0  # prompt tokens the (first) engine served from its prefix cache, when it reports them
    content_chunks: int = 0
    migrations: int = 0
    rescues: int = 0


class RequestFlow:
    def __init__(self, parsed: ParsedRequest, *, cluster: ClusterView, admission: Admission, http: Http1Pool,
                 metrics: GatewayMetrics, retries: int, first_token_timeout_s: float, spawn: Spawn,
                 max_rescues: int = 2,
                 predict_length: bool = False, stream_legs: bool = False, refuse_late: bool = False,
                 arrived: float | None = None) -> None:
        self.parsed = parsed
        # The decode leg streams for streaming clients, and for the others too when ``stream_legs``: then a
        # non-streaming answer is assembled here from the stream, and can be moved or rescued mid-answer
        # like a stream; otherwise it arrives whole, and a failure restarts it.
        self.leg_stream = parsed.stream or stream_legs
        self.cluster = cluster
        self.admission = admission
        self.policy: DispatchPolicy = admission.model.policy  # a move's target is placed by the same policy
        self.http = http
        self.metrics = metrics
        self.retries = retries
        self.refuse_late = refuse_late  # no retry past the TTFT target (module doc)
        self.first_token_timeout_s = first_token_timeout_s
        self.client_id = ("chatcmpl-" if parsed.endpoint == "chat" else "cmpl-") + _next_id()
        self.created = int(time.time())
        # When the request reached the gateway (``arrived``, monotonic: before its body was read), from which
        # its TTFT and its SLO's deadline count, as the client counts them.
        now = time.monotonic()
        self.arrived = now if arrived is None else arrived
        self.arrived_unix = time.time() - (now - self.arrived)
        self.outcome = Outcome()
        self.attempt: Attempt | None = None
        self.delivered_tokens = 0  # tokens the client has (where a moved request resumes)
        self._text: list[str] = []  # ...and their text (what a stock-SGLang resume re-prefills)
        self._prompt_tokens: int | None = None  # as the first engine counted them
        self.finished_seen = False  # a finish_reason reached the client: nothing left to move
        self.moves = Moves(self, spawn, max_rescues)
        self.predict_length = predict_length
        # The decode engine's latest remaining-length prediction and the token count it was made at.
        self._prediction: tuple[float, int] | None = None
        options = parsed.body.get("stream_options")
        self._client_continuous_usage = isinstance(options, dict) and bool(options.get("continuous_usage_stats"))

    # -- dispatch ----------------------------------------------------------------------------------
    def _prefix_blocks(self) -> tuple[int, ...]:
        """The prompt's prefix identity, for a dispatch policy that routes by what engines cache (the same
        blocks engine_sim's radix cache matches: shared/engine/prefix_blocks.py); empty for the others."""
        if getattr(self.policy, "prefixes", None) is None:
            return ()
        body = self.parsed.body
        prompt = body.get("messages") if self.parsed.endpoint == "chat" else body.get("prompt")
        return prompt_blocks(prompt) if prompt else ()

    def _ticket(self) -> Ticket:
        p = self.parsed
        slo = p.slo
        request = RequestView(rid=self.client_id, input_tokens=p.input_tokens, max_output_tokens=p.max_tokens,
                              priority=p.priority, slo_ttft_s=slo.ttft_s if slo else None,
                              slo_tpot_s=slo.tpot_s if slo else None, prefix_blocks=self._prefix_blocks())
        ttft = slo.ttft_s if slo is not None and slo.ttft_s is not None else float("inf")
        return Ticket(request=request, model=p.model, arrival_s=self.arrived, slo_ttft_s=ttft, retries=p.retries)

    def request_slo(self) -> RequestSlo:
        """What sim engines get as ``poise_slo``: the resolved SLO, and how long the request has been here."""
        waited = time.monotonic() - self.arrived
        if self.parsed.slo is None:
            return RequestSlo(waited_s=max(0.0, waited))
        return self.parsed.slo.request_slo(waited)

    def _release(self, finished_on: str | None = None) -> None:
        self.cluster.release(self.client_id, finished_on=finished_on)

    def _past_ttft_target(self) -> bool:
        slo = self.parsed.slo
        return slo is not None and slo.ttft_s is not None and time.monotonic() - self.arrived > slo.ttft_s

    def _prefill_leg_done(self, placement: Placement, task: asyncio.Task[None]) -> None:
        """The prefill leg answered: the prefill engine's part is over (its queue is shorter)."""
        if not task.cancelled() and task.exception() is None and self.attempt is not None \
                and self.attempt.prefill_task is task and placement.prefill_id is not None:
            self.cluster.release(self.client_id, placement.prefill_id)

    async def start(self) -> None:
        """Dispatch and wait for the first token, retrying on another pair; raises :class:`APIError`."""
        exclude: set[str] = set()
        last_error: LegFailed | None = None
        ticket = self._ticket()
        for attempt_no in range(self.retries + 1):
            try:
                if attempt_no == 0:
                    # With late binding, waits in the gateway until a prefill engine has room and it is this
                    # request's turn; retries go straight out (the request already waited its turn).
                    placement = await self.admission.admit(ticket)
                else:
                    placement = self.admission.place(ticket, frozenset(exclude))
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
                decode=instances[placement.decode_id], http=self.http, stream=self.leg_stream,
                slo=self.request_slo, predict_length=self.predict_length,
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
                # An answer that arrives whole gets the request's deadline (enforced around start() by the
                # caller), not the first-token one.
                await attempt.wait_first_token(self.first_token_timeout_s if self.leg_stream else float("inf"))
                self.cluster.first_token(self.client_id, placement.decode_id, placement.prefill_id)
                return
            except LegFailed as exc:
                last_error = exc
                log.warning("request %s attempt %d failed before the first token: %s", self.client_id, attempt_no, exc)
                await attempt.abort()
                await attempt.close()
                self._release()
                self.attempt = None
                exclude.add(exc.instance_id)
                if exc.final:
                    break  # the engine refused the request itself: another pair would refuse it too
                if self.refuse_late and self._past_ttft_target():
                    break  # late already: refused as the gateway refuses a request it held this long
                if attempt_no < self.retries:
                    self.metrics.retries.inc()
        assert last_error is not None
        status = last_error.status if last_error.status and 400 <= last_error.status < 500 else 502
        if status == 429:  # the engine was busy or gave the request up: the client may come back
            raise APIError(429, f"engine error: {last_error}", type_="rate_limit_error", code="engine_error",
                           headers=retry_after_header())
        raise APIError(status, f"engine error: {last_error}", type_="server_error" if status >= 500 else "invalid_request_error",
                       code="engine_error")

    # -- streaming ---------------------------------------------------------------------------------
    async def events(self) -> AsyncIterator[Event]:
        """Decode events after :meth:`start`, with timing and token accounting, across moves and rescues."""
        while True:
            attempt = self.attempt
            assert attempt is not None
            if self.moves.pending is not None:
                await self.moves.carry_out_pending()
                continue
            try:
                event = await attempt.next_event()
            except LegFailed as exc:
                if self.finished_seen:  # the answer is whole; only its tail (usage, [DONE]) was lost
                    attempt.finished = True
                    return
                if not await self.moves.rescue(exc):
                    raise
                continue
            if event is None:
                attempt.finished = True
                return
            if self._account(attempt, event):
                yield event

    def _account(self, attempt: Attempt, event: Event) -> bool:
        """Count the event's tokens and time; False for an event the client must not see."""
        usage = event.data.get("usage")
        if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
            total = attempt.base_tokens + int(usage["completion_tokens"])
            if self._prompt_tokens is None and not attempt.base_tokens:
                self._prompt_tokens = usage.get("prompt_tokens")
            if not attempt.base_tokens:
                self._note_cached(usage)
            if attempt.base_tokens:  # a resumed engine counts from its own start: report the whole answer
                prompt = self._prompt_tokens if self._prompt_tokens is not None else self.parsed.input_tokens
                usage.update(prompt_tokens=prompt, completion_tokens=total, total_tokens=prompt + total)
            self.outcome.output_tokens = total
            self.delivered_tokens = total
        elif event.text:
            self.delivered_tokens += 1  # an engine without per-chunk usage: one token per chunk, at best
        prediction = event.data.pop(PREDICTION_FIELD, None)
        if prediction is not None:
            self._prediction = (float(prediction), self.delivered_tokens)
        if attempt.base_tokens and not event.text and not event.finish_reason and event.data.get("choices"):
            return False  # a resumed chat stream opens with its own role chunk: the client has one already
        if event.text:
            if self.outcome.first_token_at is None:
                self.outcome.first_token_at = event.at
            self.outcome.last_token_at = event.at
            self.outcome.content_chunks += 1
            self._text.append(event.text)
        if event.finish_reason:
            self.finished_seen = True
        return True

    def text(self) -> str:
        """The answer's text the client has (what a stock-SGLang resume re-prefills)."""
        return "".join(self._text)

    def predicted_remaining(self) -> float | None:
        """The decode engine's last remaining-length prediction, less what was generated since (ARES' rule
        between two predictions, spec §1.2.6); None when the engine gives none."""
        if self._prediction is None:
            return None
        value, at = self._prediction
        return counted_down(value, at, self.delivered_tokens)

    def _note_cached(self, usage: dict[str, Any]) -> None:
        """The engine's cached prompt tokens, from a usage that reports them (SGLang --enable-cache-report puts
        them in the final usage only, not on per-chunk usage)."""
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            self.outcome.cached_tokens = details["cached_tokens"]

    def sse_chunk(self, event: Event) -> bytes | None:
        """Re-id an engine chunk as the client's; drop the usage chunk the client did not ask for."""
        data = event.data
        if not data.get("choices") and data.get("usage") is not None and not self.parsed.include_usage:
            return None
        data["id"] = self.client_id
        if data.get("choices") and not (self.parsed.include_usage and self._client_continuous_usage):
            data.pop("usage", None)  # per-chunk usage is the gateway's own (continuous_usage_stats)
        return b"data: " + orjson.dumps(data) + b"\n\n"

    async def collect(self) -> dict[str, Any]:
        """The non-streaming OpenAI response: the decode leg's own, re-id'd (or assembled from a stream)."""
        if self.attempt is not None and self.attempt.result is not None:
            body = self.attempt.result
            body["id"] = self.client_id
            reported = body.get("usage")
            if isinstance(reported, dict) and reported.get("completion_tokens") is not None:
                self.outcome.output_tokens = int(reported["completion_tokens"])
                self._note_cached(reported)
            return body
        events = [event async for event in self.events()]
        n, p = self.outcome.content_chunks, self.parsed
        return whole_response(events, endpoint=p.endpoint, client_id=self.client_id, created=self.created,
                              model=p.model, usage={"prompt_tokens": p.input_tokens, "completion_tokens": n,
                                                    "total_tokens": p.input_tokens + n})

    # -- ending ------------------------------------------------------------------------------------
    def conclude(self, *, status: str = "ok", error: str | None = None) -> Attempt | None:
        """Settle the outcome and release the engines' slots; returns the attempt still to clean up.

        Synchronous on purpose: it runs in ``finally`` blocks of cancelled tasks (a client that hung up),
        where any ``await`` would be cancelled again before it could do anything.
        """
        if self.outcome.status == "ok":
            self.outcome.status, self.outcome.error = status, error
        self.moves.settle()
        attempt, self.attempt = self.attempt, None
        if attempt is not None and not attempt.finished and self.outcome.status == "ok":
            self.outcome.status = "aborted"
        self._release(finished_on=attempt.decode.instance_id if attempt is not None and attempt.finished else None)
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


