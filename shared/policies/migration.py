"""Migration policies: which running decode requests to move to another decode instance (ARES, later).

A policy is pure: ``select(snapshot, now_s)`` reads a :class:`ClusterSnapshot` and returns the moves to make
now (an empty list: none). The migrator carries them out (recompute migration on SGLang: re-prefill the
prompt plus the generated tokens on the target, then abort the source; the gateway stitches the stream).

Imports nothing from asyncio, nats, aetcd, httpx or fastapi.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import msgspec

from shared.protocol.messages import ClusterSnapshot


class MigrationDecision(msgspec.Struct, frozen=True, kw_only=True):
    """Move request ``rid`` from decode instance ``source_id`` to ``target_id``."""

    rid: str
    source_id: str
    target_id: str
    reason: str  # human-readable, for logs and ``poise admin status``


class MigrationPolicy(Protocol):
    """Chooses decode-to-decode moves from a cluster snapshot."""

    name: str  # the registry key
    note: str  # one line for ``poise admin status``: what this policy does

    def select(self, snapshot: ClusterSnapshot, now_s: float) -> list[MigrationDecision]: ...


class NoMigration:
    """Never moves anything."""

    name = "none"
    note = "none: no decode-to-decode migration yet (ARES comes later)"

    def select(self, snapshot: ClusterSnapshot, now_s: float) -> list[MigrationDecision]:
        return []


MIGRATION_POLICIES: dict[str, Callable[[], MigrationPolicy]] = {
    NoMigration.name: NoMigration,
}


def make_migration_policy(name: str) -> MigrationPolicy:
    try:
        factory = MIGRATION_POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown migration policy {name!r}; known: {', '.join(sorted(MIGRATION_POLICIES))}") from None
    return factory()
