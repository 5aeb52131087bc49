"""Carrying migration decisions out: the gateways own the streams, so the migrator asks them.

``requests()`` gathers every gateway's movable requests (the live ``decode_requests`` of a snapshot, with
the replica that owns each); ``move()`` sends one :class:`MoveCommand` to the owner and waits for its
:class:`MoveReply`. A request with a move in flight is not offered to the policy again until it is over.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from shared.bus import Bus
from shared.errors import BusTimeout
from shared.policies.migration import MigrationDecision
from shared.protocol import DecodeRequestInfo, Subjects
from shared.protocol.moves import GatewayRequests, GatewayRequestsQuery, MoveCommand, MoveReply

log = logging.getLogger(__name__)


@dataclass
class MoveOutcome:
    decision: MigrationDecision
    reply: MoveReply
    took_s: float


class MoveExecutor:
    def __init__(self, bus: Bus, subjects: Subjects, *, mechanism: str, gather_timeout_s: float,
                 move_timeout_s: float) -> None:
        self.bus = bus
        self.subjects = subjects
        self.mechanism = mechanism
        self.gather_timeout_s = gather_timeout_s
        self.move_timeout_s = move_timeout_s
        self.owner: dict[str, str] = {}  # rid -> the gateway replica streaming it (as of the last gather)
        self.in_flight: set[str] = set()

    async def requests(self) -> list[DecodeRequestInfo]:
        tables = await self.bus.gather(self.subjects.gateway_requests(), GatewayRequestsQuery(), GatewayRequests,
                                       timeout_s=self.gather_timeout_s)
        self.owner = {r.rid: t.gateway for t in tables for r in t.requests}
        return [r for t in tables for r in t.requests if r.rid not in self.in_flight]

    async def move(self, decision: MigrationDecision, mechanism: str | None = None) -> MoveOutcome:
        started = time.monotonic()
        gateway = self.owner.get(decision.rid)
        if gateway is None:
            await self.requests()
            gateway = self.owner.get(decision.rid)
        if gateway is None:
            return MoveOutcome(decision, MoveReply(ok=False, rid=decision.rid,
                                                   message="no gateway streams this request (finished?)"), 0.0)
        self.in_flight.add(decision.rid)
        cmd = MoveCommand(rid=decision.rid, target_id=decision.target_id, mechanism=mechanism or self.mechanism,  # type: ignore[arg-type]
                          reason=decision.reason)
        try:
            reply = await self.bus.request(self.subjects.gateway_move(gateway), cmd, MoveReply,
                                           timeout_s=self.move_timeout_s)
        except BusTimeout as exc:
            reply = MoveReply(ok=False, rid=decision.rid, message=str(exc))
        finally:
            self.in_flight.discard(decision.rid)
        return MoveOutcome(decision, reply, time.monotonic() - started)
