"""Moving a running request to another decode engine, with the client's stream kept whole.

- **migration** (the migrator's decode-to-decode moves, :meth:`Moves.request`): between two tokens the
  request's flow stops forwarding, starts the request on the target from the tokens the client has
  (``resume.py``: a re-prefill through a prefill engine, or an engine_sim KV copy), and once the target's
  first token is in, aborts the source and forwards the target's stream. If the target fails first, it is
  aborted and the request goes on from the source, which never stopped: nothing lost, nothing repeated.
- **rescue** (:meth:`Moves.rescue`): a decode stream that breaks mid-answer (engine died, connection lost) is
  resumed the same way on another pair, up to ``max_rescues`` times, so the client sees one unbroken answer.

A move holds its engines in the in-flight ledger under its own id until it has taken over the request.
Legs given up (a moved request's source, a failed target) are aborted in the background, on the gateway's
own task set, which its shutdown waits for.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from services.gateway.legs import Attempt, LegFailed
from services.gateway.resume import NotResumable, resume_body
from shared.policies import Placement, RequestView
from shared.protocol import InstanceInfo

if TYPE_CHECKING:
    from services.gateway.flow import RequestFlow

log = logging.getLogger(__name__)

MECHANISMS = ("recompute", "kv-transfer")

Spawn = Callable[[Coroutine[Any, Any, None]], None]


@dataclass
class MoveResult:
    """How a migration (or rescue) of a running request ended."""

    ok: bool
    message: str
    mechanism: str | None = None
    source_id: str | None = None
    target_id: str | None = None
    stall_s: float | None = None  # the client's gap: from the last source token to the target's first


@dataclass
class PendingMove:
    target_id: str
    mechanism: str
    done: asyncio.Future[MoveResult] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class Moves:
    """One request's moves: the one asked for, the one under way, and how each is carried out."""

    def __init__(self, flow: RequestFlow, spawn: Spawn, max_rescues: int) -> None:
        self.flow = flow
        self.spawn = spawn
        self.max_rescues = max_rescues
        self.pending: PendingMove | None = None
        self.moving: tuple[str, str] | None = None  # (source, target) while a move is pending or under way

    def movable(self) -> str | None:
        """Why the request cannot be moved now (None: it can)."""
        flow = self.flow
        if not flow.leg_stream:
            return "non-streaming requests are answered whole by one engine (gateway move_non_streaming is off)"
        if flow.attempt is None or flow.outcome.first_token_at is None:
            return "the request has no token yet"
        if flow.finished_seen:
            return "the request already finished"
        if self.pending is not None:
            return "a move of this request is already pending"
        return None

    def request(self, target_id: str, mechanism: str) -> asyncio.Future[MoveResult]:
        """Ask the stream to move to ``target_id`` at its next token; the future tells how it went."""
        if mechanism not in MECHANISMS:
            raise ValueError(f"unknown migration mechanism {mechanism!r}; known: {', '.join(MECHANISMS)}")
        self.pending = PendingMove(target_id, mechanism)
        if self.flow.attempt is not None:
            self.moving = (self.flow.attempt.decode.instance_id, target_id)
        return self.pending.done

    async def carry_out_pending(self) -> None:
        """Between two tokens: the move asked for, if any (the flow's stream loop calls this)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        try:
            result = await self.move(pending.target_id, pending.mechanism) if not self.flow.finished_seen else \
                MoveResult(False, "the request already finished")
        finally:
            self.moving = None
        if not pending.done.done():
            pending.done.set_result(result)

    def settle(self) -> None:
        """The request ended: a move still asked for will not happen."""
        if self.pending is not None and not self.pending.done.done():
            self.pending.done.set_result(MoveResult(False, "the request ended before it could move"))
        self.pending = None
        self.moving = None

    async def rescue(self, failure: LegFailed) -> bool:
        """Resume the request on another pair after its decode stream broke; False when it cannot be."""
        flow = self.flow
        if flow.outcome.rescues >= self.max_rescues:
            return False
        failed = flow.attempt
        assert failed is not None
        log.warning("request %s: decode stream broke after %d tokens (%s); resuming it elsewhere",
                    flow.client_id, flow.delivered_tokens, failure)
        self.retire(failed)
        exclude = {failure.instance_id}
        for _ in range(flow.retries + 1):
            result = await self.move(None, "recompute", exclude=exclude)
            if result.ok:
                flow.outcome.rescues += 1
                flow.metrics.rescues.inc()
                return True
            log.warning("request %s: rescue failed: %s", flow.client_id, result.message)
            if result.target_id is None:
                return False
            exclude.add(result.target_id)
        return False

    def _target(self, target_id: str | None, mechanism: str,
                exclude: set[str] | None) -> MoveResult | tuple[InstanceInfo, InstanceInfo | None, str]:
        """Where a move goes: (decode target, prefill engine for a recompute's prompt or None, the mechanism
        it can use), or the failed :class:`MoveResult` saying why it cannot go anywhere."""
        flow = self.flow
        source = flow.attempt
        assert source is not None
        rescue = exclude is not None
        instances = flow.cluster.instances
        target = instances.get(target_id) if target_id is not None else None
        if target_id is not None and (target is None or target.role == "prefill"):
            return MoveResult(False, f"{target_id} is not a registered decode instance", mechanism, target_id=target_id)
        if target is not None and target.instance_id == source.decode.instance_id:
            return MoveResult(False, f"the request already runs on {target_id}", mechanism, target_id=target_id)
        if mechanism == "kv-transfer" and (rescue or source.decode.engine_kind != "sim"
                                           or (target is not None and target.engine_kind != "sim")):
            mechanism = "recompute"  # only engine_sim models a decode-to-decode KV copy
        if mechanism != "recompute":
            assert target is not None
            return target, None, mechanism
        decodes = {i for i, info in instances.items() if info.role != "prefill"}
        excluded = set(exclude or ()) | ({source.decode.instance_id} if not rescue else set())
        if target is not None:
            excluded |= decodes - {target.instance_id}
        n = flow.delivered_tokens
        request = RequestView(rid=flow.client_id, input_tokens=flow.parsed.input_tokens + n,
                              max_output_tokens=flow.parsed.remaining_tokens(n), priority=flow.parsed.priority)
        decision = flow.policy.place(request, flow.cluster.engines(flow.parsed.model), time.monotonic(),
                                     frozenset(excluded))
        if not isinstance(decision, Placement):
            return MoveResult(False, f"no pair to resume on: {decision.reason}", mechanism, target_id=target_id)
        target = instances.get(decision.decode_id)
        prefill = instances.get(decision.prefill_id) if decision.prefill_id else None
        if target is None or (decision.prefill_id and prefill is None):
            return MoveResult(False, "the placed engines deregistered", mechanism, target_id=decision.decode_id)
        return target, prefill, mechanism

    async def move(self, target_id: str | None, mechanism: str, *, exclude: set[str] | None = None) -> MoveResult:
        """Start the request on ``target_id`` (or a placed pair) from the tokens the client has; swap on success.

        The source is left alone until the target produced its first token, so a failed move costs the
        client only the wait. ``exclude`` (a rescue): engines not to resume on; the source is gone already."""
        flow = self.flow
        source = flow.attempt
        assert source is not None
        rescue = exclude is not None
        where = self._target(target_id, mechanism, exclude)
        if isinstance(where, MoveResult):
            return where
        target, prefill, mechanism = where
        n = flow.delivered_tokens
        kv_source = (source.decode.url, source.rid) if mechanism == "kv-transfer" else None
        try:
            body = resume_body(flow.parsed, target, generated_tokens=n, generated_text=flow.text(),
                               kv_source=kv_source)
        except NotResumable as exc:
            return MoveResult(False, str(exc), mechanism, target_id=target.instance_id)
        moves = flow.outcome.migrations + flow.outcome.rescues + 1
        attempt = Attempt(rid=f"{flow.client_id}-m{moves}", endpoint=flow.parsed.endpoint, prefill=prefill,
                          decode=target, http=flow.http, stream=True, slo=flow.request_slo, base_tokens=n,
                          predict_length=flow.predict_length)
        flow.cluster.ledger.dispatched(attempt.rid, target.instance_id, prefill.instance_id if prefill else None,
                                       flow.parsed.input_tokens + n, flow.parsed.max_tokens - n)
        started = time.monotonic()
        try:
            await attempt.start(body)
            await attempt.wait_first_token(flow.first_token_timeout_s)
        except (LegFailed, asyncio.CancelledError) as exc:
            flow.cluster.release(attempt.rid)
            self.retire(attempt)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return MoveResult(False, f"the target failed, the request stays where it was: {exc}", mechanism,
                              source_id=source.decode.instance_id, target_id=target.instance_id)
        flow.cluster.first_token(attempt.rid, target.instance_id, prefill.instance_id if prefill else None)
        if not rescue:
            self.retire(source)
        flow.cluster.release(flow.client_id)
        flow.cluster.ledger.rename(attempt.rid, flow.client_id)
        flow.attempt = attempt
        flow.outcome.prefill_id = prefill.instance_id if prefill is not None else flow.outcome.prefill_id
        flow.outcome.decode_id = target.instance_id
        if not rescue:
            flow.outcome.migrations += 1
            flow.metrics.migrations.labels(mechanism).inc()
        stall = time.monotonic() - (flow.outcome.last_token_at or started)
        log.info("request %s moved %s -> %s by %s after %d tokens (%.3f s without tokens)", flow.client_id,
                 source.decode.instance_id, target.instance_id, mechanism, n, stall)
        return MoveResult(True, "moved", mechanism, source_id=source.decode.instance_id,
                          target_id=target.instance_id, stall_s=stall)

    def retire(self, attempt: Attempt) -> None:
        """Abort and close a leg in the background (a moved request's source, a failed target)."""
        async def retire() -> None:
            with contextlib.suppress(Exception):
                await attempt.abort()
            with contextlib.suppress(Exception):
                await attempt.close()

        self.spawn(retire())
