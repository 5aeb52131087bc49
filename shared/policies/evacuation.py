"""Emptying one decode instance by migration: where each of its running requests should go.

The planner flips a decode instance to prefill only once it is idle; waiting for its longest answer to end
can take minutes. Moving the requests instead (the migrator carries the moves out through the gateways)
empties it in about one re-prefill. Pure: snapshot in, moves out.

Imports nothing from asyncio, nats, aetcd, httpx or fastapi.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from shared.policies.migration import MigrationDecision
from shared.protocol.messages import ClusterSnapshot, InstanceLoad

# The sidecar marks its instance draining when the role command arrives; the gateways see it through an etcd
# watch. Evacuating only after that keeps new requests from landing there behind the migrator's back.
EVACUATE_AFTER_S = 0.5  # after the role command
EVACUATE_EVERY_S = 0.2  # between rounds: a request dispatched just before the drain shows up in a later one
RESERVED_DECODE_TOKENS = 512  # SGLang's num_reserved_decode_tokens: KV a decode engine holds for a request's next tokens


def evacuation_moves(snapshot: ClusterSnapshot, source_id: str, *, skip: frozenset[str] = frozenset(),
                     reserved_decode_tokens: int = RESERVED_DECODE_TOKENS) -> list[MigrationDecision]:
    """Each request on ``source_id`` (but those in ``skip``) to the ready decode instance with the least token
    load, counting what this plan already sends there; longest contexts first, so they spread evenly.

    A request goes only where its KV fits: its context plus what the target reserves for its next tokens
    (SGLang reserves ``reserved_decode_tokens``), against the free KV the target reports, less what this plan
    already sends there. One that fits nowhere stays for a later round (room frees as answers end); a target
    that reports no capacity is not limited."""
    load: dict[str, int] = {}
    free: dict[str, float] = {}
    for i in snapshot.instances:
        if i.info.role == "decode" and i.info.status == "ready" and i.info.instance_id != source_id:
            load[i.info.instance_id] = 0
            room = free_kv_tokens(i)
            free[i.info.instance_id] = math.inf if room is None else room
    if not load:
        return []
    leaving = []
    for r in snapshot.decode_requests:
        tokens = r.input_tokens + r.generated_tokens
        if r.instance_id in load:
            load[r.instance_id] += tokens
        elif r.instance_id == source_id and r.rid not in skip and not r.migrating:
            remaining = max(0, r.max_output_tokens - r.generated_tokens)
            need = tokens + (max(1, min(remaining, reserved_decode_tokens)) if remaining else 0)
            leaving.append((tokens, need, r.rid))
    moves = []
    for tokens, need, rid in sorted(leaving, reverse=True):
        fits = [i for i in load if free[i] >= need]
        if not fits:
            continue
        target = min(fits, key=lambda i: (load[i], i))
        load[target] += tokens
        free[target] -= need
        moves.append(MigrationDecision(rid=rid, source_id=source_id, target_id=target,
                                       reason=f"evacuate {source_id} before its flip"))
    return moves


def free_kv_tokens(inst: InstanceLoad) -> float | None:
    """KV tokens ``inst`` reports free (capacity less what is in use), or None when it reports no capacity."""
    report = inst.load
    if report is None or report.max_total_num_tokens <= 0:
        return None
    return float(max(0, report.max_total_num_tokens - report.num_used_tokens))


def evacuation_done(snapshot: ClusterSnapshot, source_id: str, moves: list[MigrationDecision], *,
                    skip: frozenset[str] = frozenset()) -> bool:
    """Whether the evacuation of ``source_id`` can stop: nothing to move now, no request of it left that a later
    round could move (one that fit nowhere yet), and nothing queued there that will run on it later (requests
    waiting for their KV start on it once moves free room, and are moved then)."""
    if moves:
        return False
    if any(r.instance_id == source_id and r.rid not in skip and not r.migrating for r in snapshot.decode_requests):
        return False
    source = next((i for i in snapshot.instances if i.info.instance_id == source_id), None)
    return source is None or source.load is None or source.load.num_waiting_reqs == 0


@dataclass
class Evacuation:
    """One decode instance's evacuation for a flip: rounds of moves, ``EVACUATE_EVERY_S`` apart, until it is
    empty or its drain's deadline passed. The migrator runs it live, the simulator on its clock."""

    source_id: str
    deadline_s: float  # on the caller's clock
    refused: set[str] = field(default_factory=set)  # a move that failed once stays put: the drain waits for it

    def round(self, snapshot: ClusterSnapshot, now_s: float) -> list[MigrationDecision] | None:
        """This round's moves (maybe none: what is left fits nowhere yet); None: the evacuation is over."""
        if now_s >= self.deadline_s:
            return None
        skip = frozenset(self.refused)
        moves = evacuation_moves(snapshot, self.source_id, skip=skip)
        return None if evacuation_done(snapshot, self.source_id, moves, skip=skip) else moves

    def failed(self, rid: str) -> None:
        """The move of ``rid`` failed: later rounds leave it where it is."""
        self.refused.add(rid)
