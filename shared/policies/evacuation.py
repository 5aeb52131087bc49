"""Emptying one decode instance by migration: where each of its running requests should go.

The planner flips a decode instance to prefill only once it is idle; waiting for its longest answer to end
can take minutes. Moving the requests instead (the migrator carries the moves out through the gateways)
empties it in about one re-prefill. Pure: snapshot in, moves out.

Imports nothing from asyncio, nats, aetcd, httpx or fastapi.
"""

from __future__ import annotations

from shared.policies.migration import MigrationDecision
from shared.protocol.messages import ClusterSnapshot


def evacuation_moves(snapshot: ClusterSnapshot, source_id: str, *, skip: frozenset[str] = frozenset()) -> list[MigrationDecision]:
    """Each request on ``source_id`` (but those in ``skip``) to the ready decode instance with the least token
    load, counting what this plan already sends there; longest contexts first, so they spread evenly."""
    load: dict[str, int] = {
        i.info.instance_id: 0 for i in snapshot.instances
        if i.info.role == "decode" and i.info.status == "ready" and i.info.instance_id != source_id
    }
    if not load:
        return []
    leaving = []
    for r in snapshot.decode_requests:
        tokens = r.input_tokens + r.generated_tokens
        if r.instance_id in load:
            load[r.instance_id] += tokens
        elif r.instance_id == source_id and r.rid not in skip:
            leaving.append((tokens, r.rid))
    moves = []
    for tokens, rid in sorted(leaving, reverse=True):
        target = min(load, key=lambda i: (load[i], i))
        load[target] += tokens
        moves.append(MigrationDecision(rid=rid, source_id=source_id, target_id=target,
                                       reason=f"evacuate {source_id} before its flip"))
    return moves
