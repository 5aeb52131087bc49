"""Scheduling policies: pure objects (snapshot in, decision out), one copy each.

Nothing in this package may import asyncio, nats, aetcd, httpx or fastapi (tests enforce it): the live
services and the simulator call the very same objects. Registries map a policy's name to its factory;
a policy's typed params and defaults live next to it. The interfaces, one module each:

- ``dispatch``: which prefill and decode engine a request goes to (gateway);
- ``pools``: which engines flip between prefill and decode (planner);
- ``scaling``: how many prefill and decode replicas run (planner, with a connector that starts/stops them);
- ``prefill_order``: which waiting prompt a prefill engine admits next (engine);
- ``decode_batch``: which running requests take the next decode step (engine);
- ``migration``: which decode requests move to another decode engine (migrator);
- ``length``: how many output tokens a running request has left (migrator, engines).
"""

from __future__ import annotations

from shared.policies.arrow import ArrowDispatch, ArrowParams, ArrowPools, max_running_tokens
from shared.policies.context import PolicyContext, lookup
from shared.policies.decode_batch import (
    DECODE_BATCH_POLICIES,
    Continuous,
    DecodeBatchPolicy,
    DecodeItem,
    make_decode_batch_policy,
)
from shared.policies.dispatch import DispatchParams, DispatchPolicy, LeastLoad, Placement, Rejection, RoundRobin
from shared.policies.dopd import DopdParams, DopdPools, DopdScaling, optimal_split, split_of
from shared.policies.length import (
    LENGTH_PREDICTORS,
    HistoricalMean,
    LengthPredictor,
    MaxTokens,
    make_length_predictor,
)
from shared.policies.migration import (
    MIGRATION_POLICIES,
    KvBalance,
    MigrationDecision,
    MigrationPolicy,
    NoMigration,
    make_migration_policy,
)
from shared.policies.poise import PoiseParams, PoisePools
from shared.policies.pools import PoolDecision, PoolPolicy, RoleChange, StaticPools
from shared.policies.prefill_order import (
    PREFILL_ORDER_POLICIES,
    Edf,
    Fcfs,
    PrefillItem,
    PrefillOrderPolicy,
    make_prefill_order_policy,
)
from shared.policies.registry import (
    DISPATCH_POLICIES,
    POOL_POLICIES,
    SCALING_POLICIES,
    make_dispatch_policy,
    make_pool_policy,
    make_scaling_policy,
)
from shared.policies.scaling import (
    DynamoLoad,
    DynamoSla,
    ScalingPolicy,
    ScalingTarget,
)
from shared.policies.views import EngineView, RequestView

__all__ = [
    "lookup",
    "DopdParams",
    "DopdPools",
    "DopdScaling",
    "optimal_split",
    "split_of",
    "PoiseParams",
    "PoisePools",
    "ArrowDispatch",
    "ArrowParams",
    "ArrowPools",
    "max_running_tokens",
    "Continuous",
    "DECODE_BATCH_POLICIES",
    "DISPATCH_POLICIES",
    "DecodeBatchPolicy",
    "DecodeItem",
    "DispatchParams",
    "DispatchPolicy",
    "DynamoLoad",
    "DynamoSla",
    "Edf",
    "EngineView",
    "Fcfs",
    "HistoricalMean",
    "KvBalance",
    "LENGTH_PREDICTORS",
    "LeastLoad",
    "LengthPredictor",
    "MIGRATION_POLICIES",
    "MaxTokens",
    "MigrationDecision",
    "MigrationPolicy",
    "NoMigration",
    "POOL_POLICIES",
    "PREFILL_ORDER_POLICIES",
    "Placement",
    "PoolDecision",
    "PoolPolicy",
    "PrefillItem",
    "PrefillOrderPolicy",
    "Rejection",
    "RequestView",
    "RoleChange",
    "RoundRobin",
    "SCALING_POLICIES",
    "PolicyContext",
    "ScalingPolicy",
    "ScalingTarget",
    "StaticPools",
    "make_decode_batch_policy",
    "make_dispatch_policy",
    "make_length_predictor",
    "make_migration_policy",
    "make_pool_policy",
    "make_prefill_order_policy",
    "make_scaling_policy",
]
