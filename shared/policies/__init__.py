"""Scheduling policies: pure objects (snapshot in, decision out), one copy each.

Nothing in this package may import asyncio, nats, aetcd, httpx or fastapi (tests enforce it): the live
services and the simulator call the very same objects. Registries map a policy's name to its factory;
a policy's typed params and defaults live next to it.
"""

from __future__ import annotations

from collections.abc import Callable

from shared.policies.dispatch import DispatchParams, DispatchPolicy, LeastLoad, Placement, Rejection, RoundRobin
from shared.policies.migration import (
    MIGRATION_POLICIES,
    MigrationDecision,
    MigrationPolicy,
    NoMigration,
    make_migration_policy,
)
from shared.policies.pools import POOL_POLICIES, PoolDecision, PoolPolicy, RoleChange, StaticPools, make_pool_policy
from shared.policies.views import EngineView, RequestView

DISPATCH_POLICIES: dict[str, Callable[[DispatchParams | None], DispatchPolicy]] = {
    LeastLoad.name: LeastLoad,
    RoundRobin.name: RoundRobin,
}


def make_dispatch_policy(name: str, params: DispatchParams | None = None) -> DispatchPolicy:
    try:
        factory = DISPATCH_POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown dispatch policy {name!r}; known: {', '.join(sorted(DISPATCH_POLICIES))}") from None
    return factory(params)


__all__ = [
    "DISPATCH_POLICIES",
    "MIGRATION_POLICIES",
    "POOL_POLICIES",
    "MigrationDecision",
    "MigrationPolicy",
    "NoMigration",
    "PoolDecision",
    "PoolPolicy",
    "RoleChange",
    "StaticPools",
    "make_migration_policy",
    "make_pool_policy",
    "DispatchParams",
    "DispatchPolicy",
    "EngineView",
    "LeastLoad",
    "Placement",
    "Rejection",
    "RequestView",
    "RoundRobin",
    "make_dispatch_policy",
]
