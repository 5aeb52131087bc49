"""Migration policies: which running decode requests to move to another decode instance.

A policy is pure: ``select(snapshot, now_s)`` reads a :class:`ClusterSnapshot` and returns the moves to make
now (an empty list: none). The migrator carries them out (recompute migration on SGLang: re-prefill the
prompt plus the generated tokens on the target, then abort the source; the gateway stitches the stream);
what a move costs is ``shared.policies.migration_cost``. Policies: ``none``, ``kv-balance`` (below), and
ARES with its ablations ``ares``, ``ares-oracle``, ``llumnix-like`` (``shared.policies.ares``).

Imports nothing from asyncio, nats, aetcd, httpx or fastapi.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import msgspec

from shared.latency import LatencyModel
from shared.policies.ares import AresMigration, AresMode, AresParams
from shared.policies.context import lookup
from shared.policies.migration_cost import MigrationMechanism
from shared.policies.migration_decision import MigrationDecision
from shared.protocol.messages import ClusterSnapshot

__all__ = ["MIGRATION_POLICIES", "KvBalance", "MigrationDecision", "MigrationPolicy", "NoMigration",
           "make_migration_policy"]


class MigrationPolicy(Protocol):
    """Chooses decode-to-decode moves from a cluster snapshot."""

    name: str  # the registry key
    note: str  # one line for ``poise admin status``: what this policy does
    interval_s: float  # how often the executor asks
    needs_requests: bool  # True: the snapshot must carry ``decode_requests`` (costly to build live)

    def select(self, snapshot: ClusterSnapshot, now_s: float) -> list[MigrationDecision]: ...


class NoMigration:
    """Never moves anything."""

    name = "none"
    note = "none: no decode-to-decode migration"
    interval_s = 1.0
    needs_requests = False

    def select(self, snapshot: ClusterSnapshot, now_s: float) -> list[MigrationDecision]:
        return []


class KvBalanceParams(msgspec.Struct, frozen=True, kw_only=True):
    interval_s: float = 1.0
    high_usage: float = 0.85  # a decode instance above this KV use sheds requests...
    min_gap: float = 0.25  # ...to the least-used one, if that one is this much lower
    max_moves: int = 4  # per decision: migrations cost a KV copy each


class KvBalance:
    """Llumnix-style load balancing: move the cheapest requests off a decode instance whose KV is nearly full.

    The donor is the decode instance with the highest KV use above ``high_usage``; the receiver the one
    with the lowest, at least ``min_gap`` lower. It moves the requests with the smallest context first
    (the cheapest copies) while the receiver stays under the donor's use. It knows nothing about
    remaining lengths: that is what ARES adds.
    """

    name = "kv-balance"
    note = ("kv-balance: move the smallest requests off a decode instance over 85% KV to the least used one "
            "(needs per-request snapshots: the simulator has them, the live monitor not yet)")
    needs_requests = True

    def __init__(self, params: KvBalanceParams | None = None) -> None:
        self.params = params or KvBalanceParams()
        self.interval_s = self.params.interval_s

    def select(self, snapshot: ClusterSnapshot, now_s: float) -> list[MigrationDecision]:
        usage: dict[str, tuple[int, int]] = {}  # instance -> (used, capacity)
        for inst in snapshot.instances:
            if inst.info.role == "decode" and inst.info.status == "ready" and inst.load is not None:
                usage[inst.info.instance_id] = (inst.load.num_used_tokens, max(inst.info.kv_capacity_tokens, 1))
        if len(usage) < 2:
            return []
        donor = max(usage, key=lambda i: (usage[i][0] / usage[i][1], i))
        receiver = min(usage, key=lambda i: (usage[i][0] / usage[i][1], i))
        d_used, d_cap = usage[donor]
        r_used, r_cap = usage[receiver]
        if d_used / d_cap < self.params.high_usage or d_used / d_cap - r_used / r_cap < self.params.min_gap:
            return []
        candidates = sorted((r for r in snapshot.decode_requests if r.instance_id == donor),
                            key=lambda r: (r.input_tokens + r.max_output_tokens, r.rid))
        moves: list[MigrationDecision] = []
        for req in candidates:
            # The executor reserves KV for the whole output, as at dispatch.
            tokens = req.input_tokens + req.max_output_tokens
            if len(moves) >= self.params.max_moves or (r_used + tokens) / r_cap > (d_used - tokens) / d_cap:
                break
            moves.append(MigrationDecision(rid=req.rid, source_id=donor, target_id=receiver,
                                           reason=f"kv-balance: {donor} at {d_used / d_cap:.0%}"))
            d_used -= tokens
            r_used += tokens
        return moves


MigrationFactory = Callable[[LatencyModel | None, MigrationMechanism | None], MigrationPolicy]
"""Builds a policy from the engines' latency model and the migration mechanism, where the caller has them
(the simulator does; the live migrator passes neither and ARES then reads each instance's profile)."""


def _plain(cls: Callable[[], MigrationPolicy]) -> MigrationFactory:
    def build(model: LatencyModel | None, mechanism: MigrationMechanism | None) -> MigrationPolicy:
        return cls()
    return build


def _ares(mode: AresMode) -> MigrationFactory:
    def build(model: LatencyModel | None, mechanism: MigrationMechanism | None) -> MigrationPolicy:
        return AresMigration(AresParams(mode=mode), model, mechanism)
    return build


MIGRATION_POLICIES: dict[str, MigrationFactory] = {
    NoMigration.name: _plain(NoMigration),
    KvBalance.name: _plain(KvBalance),
    "ares": _ares("predicted"),
    "ares-oracle": _ares("oracle"),
    "llumnix-like": _ares("current_only"),
}


def make_migration_policy(name: str, model: LatencyModel | None = None,
                          mechanism: MigrationMechanism | None = None) -> MigrationPolicy:
    return lookup(MIGRATION_POLICIES, name, "migration policy")(model, mechanism)
