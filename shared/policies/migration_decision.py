"""The decision a migration policy returns (its own module so that policies in other modules, ARES, can build
it while ``migration`` registers them; ``shared.policies.migration`` re-exports it)."""

from __future__ import annotations

import msgspec


class MigrationDecision(msgspec.Struct, frozen=True, kw_only=True):
    """Move request ``rid`` from decode instance ``source_id`` to ``target_id``."""

    rid: str
    source_id: str
    target_id: str
    reason: str  # human-readable, for logs and ``poise admin status``
