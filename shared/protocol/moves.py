"""Messages that move running requests between decode engines (ARES' decode-to-decode migration).

The gateway owns every client stream, so it is the one that carries a move out (services/gateway/flow.py);
the migrator decides. Two exchanges, both request/reply on NATS:

- ``Subjects.gateway_requests()``: the migrator asks every gateway for the requests it is streaming
  (:class:`GatewayRequestsQuery` → one :class:`GatewayRequests` per gateway, gathered until a timeout);
- ``Subjects.gateway_move(replica)``: the migrator tells the gateway that owns a request to move it
  (:class:`MoveCommand` → :class:`MoveReply`, once the target streams or the move failed).
"""

from __future__ import annotations

from typing import Literal

import msgspec

from shared.protocol.messages import DecodeRequestInfo

Mechanism = Literal["recompute", "kv-transfer"]


class GatewayRequestsQuery(msgspec.Struct, frozen=True, kw_only=True):
    schema: Literal["poise.v1.gateway_requests_query"] = "poise.v1.gateway_requests_query"


class GatewayRequests(msgspec.Struct, frozen=True, kw_only=True):
    """The streaming requests of one gateway replica that have their first token (what can be moved)."""

    schema: Literal["poise.v1.gateway_requests"] = "poise.v1.gateway_requests"
    gateway: str  # the replica id: where a MoveCommand for these requests goes
    requests: list[DecodeRequestInfo]


class MoveCommand(msgspec.Struct, frozen=True, kw_only=True):
    schema: Literal["poise.v1.move_command"] = "poise.v1.move_command"
    rid: str  # the gateway's request id (the id the client sees)
    target_id: str  # a decode instance
    mechanism: Mechanism = "recompute"
    reason: str = ""  # for logs


class MoveReply(msgspec.Struct, frozen=True, kw_only=True):
    schema: Literal["poise.v1.move_reply"] = "poise.v1.move_reply"
    ok: bool
    message: str = ""
    rid: str = ""
    mechanism: str | None = None  # the one used (kv-transfer falls back to recompute off engine_sim)
    source_id: str | None = None
    target_id: str | None = None
    stall_s: float | None = None  # the client's gap between the last source token and the target's first
