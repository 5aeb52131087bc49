"""What SLO-aware policies are configured with: the SLO they plan for and the GPUs they may use.

Policies that need it (Dynamo's planners, Arrow, DOPD) are built with a :class:`PolicyContext` and the
engines' :class:`shared.latency.LatencyModel` (their performance model); the others ignore both.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

import msgspec

T = TypeVar("T")


class PolicyContext(msgspec.Struct, frozen=True, kw_only=True):
    ttft_slo_s: float
    tpot_slo_s: float
    max_instances: int  # the GPU budget: prefill + decode replicas never exceed it
    min_per_role: int = 1  # never fewer prefill (or decode) instances than this (Dynamo's min_endpoint)
    # How a decode instance draining for a flip is emptied: the migration mechanism that moves its requests to
    # the other decode instances (shared.policies.migration_cost), or None when the drain waits for them to end
    drain_migration: str | None = None


def lookup(registry: Mapping[str, T], name: str, kind: str) -> T:
    """``registry[name]``, or a ValueError that names the known entries (what a CLI or settings error shows)."""
    try:
        return registry[name]
    except KeyError:
        raise ValueError(f"unknown {kind} {name!r}; known: {', '.join(sorted(registry))}") from None
