"""Pool policies: which engines should change PD role (the planner's decision, Arrow Alg. 3-4 / DOPD later).

A policy is pure: ``decide(snapshot, now_s)`` reads a :class:`ClusterSnapshot` (every registered instance
with its latest load and the monitor's rolling series) and returns a :class:`PoolDecision`. ``None`` or a
decision with no changes means "keep every role as it is". The planner carries changes out by sending a
``RoleCommand`` to each instance's sidecar (drain, ``/pd_role_switch``, re-register); the simulator applies
them to its own engines. A policy never talks to anything.

Imports nothing from asyncio, nats, aetcd, httpx or fastapi.
"""

from __future__ import annotations

from typing import Protocol

import msgspec

from shared.policies.report import PolicyReport
from shared.protocol.messages import ClusterSnapshot, Role


class RoleChange(msgspec.Struct, frozen=True, kw_only=True):
    """Move one instance to ``new_role``. Between prefill and decode SGLang flips at runtime
    (``/pd_role_switch``); into or out of colocated serving (``null``) the sidecar restarts the engine."""

    instance_id: str
    new_role: Role
    reason: str  # human-readable, ends up in the sidecar's log and the planner's status


class PoolDecision(msgspec.Struct, frozen=True, kw_only=True):
    """What a pool policy wants now. An empty ``changes`` list means no change."""

    changes: list[RoleChange] = msgspec.field(default_factory=list)
    next_decision_at_s: float | None = None  # when to ask again (same clock as now_s); None = the planner's interval


class PoolPolicy(Protocol):
    """Decides PD roles from a cluster snapshot. ``decide`` returns ``None`` when it has no opinion (no change)."""

    name: str  # the registry key
    note: str  # one line for ``poise admin status``: what this policy does
    interval_s: float  # how often the executor asks when the last decision named no time

    def decide(self, snapshot: ClusterSnapshot, now_s: float) -> PoolDecision | None: ...

    def report(self) -> PolicyReport:
        """What it last decided and why (the planner reads it between decisions)."""
        ...


class StaticPools:
    """Keeps the registered roles: the P:D split is whatever the operator launched."""

    name = "static"
    note = "static: keeps the registered roles (the split the engines were launched with; poise adapts it)"
    interval_s = 5.0

    def decide(self, snapshot: ClusterSnapshot, now_s: float) -> PoolDecision | None:
        return PoolDecision()

    def report(self) -> PolicyReport:
        return PolicyReport()
