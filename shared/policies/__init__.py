"""Scheduling policies: pure objects (snapshot in, decision out), one copy each.

Nothing in this package may import asyncio, nats, aetcd, httpx or fastapi (tests enforce it): the live
services and the simulator call the very same objects. Registries map a policy's name to its factory;
a policy's typed params and defaults live next to it. The interfaces, one module each:

- ``dispatch``: which prefill and decode engine a request goes to (gateway);
- ``pools``: which engines flip between prefill and decode (planner);
- ``scaling``: how many prefill and decode replicas run (planner, with a connector that starts/stops them);
- ``prefill_order``: what a prefill engine computes in its next forward pass (engine);
- ``decode_batch``: which running requests take the next decode step (engine);
- ``migration``: which decode requests move to another decode engine (migrator);
- ``length``: how many output tokens a running request has left (migrator, engines).

Implementations of the engine-side interfaces: ``kairos`` (urgency prefill order and slack decode batching),
``flowprefill`` (S-EDF with SLO-aware batching, and the D-EDF ablation), ``length_batching`` (DOPD's
length-aware P-side batching).
"""

from __future__ import annotations

from shared.policies.arrow import ArrowDispatch, ArrowParams, ArrowPools, max_running_tokens
from shared.policies.context import PolicyContext, lookup
from shared.policies.decode_batch import Continuous, DecodeBatchPolicy, DecodeItem
from shared.policies.dispatch import DispatchParams, DispatchPolicy, LeastLoad, Placement, Rejection, RoundRobin
from shared.policies.dopd import DopdParams, DopdPools, DopdScaling, optimal_split, split_of
from shared.policies.flowprefill import DEdf, FlowPrefill, FlowPrefillParams, Sedf
from shared.policies.kairos import KairosLiteralPrefill, KairosParams, KairosPrefill, KairosSlack, KairosSlackParams
from shared.policies.length import (
    LENGTH_PREDICTORS,
    HistoricalMean,
    LengthPredictor,
    MaxTokens,
    make_length_predictor,
)
from shared.policies.length_batching import LengthBatching, LengthBatchingParams
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
    PREEMPTION,
    Edf,
    Fcfs,
    Preemption,
    PrefillItem,
    PrefillPlan,
    PrefillPolicy,
    preempts,
)
from shared.policies.registry import (
    DECODE_BATCH_POLICIES,
    DISPATCH_POLICIES,
    POISE_LATE_BINDING_POLICY,
    POISE_PREFILL_POLICY,
    POOL_POLICIES,
    PREFILL_POLICIES,
    SCALING_POLICIES,
    make_decode_batch_policy,
    make_dispatch_policy,
    make_pool_policy,
    make_prefill_policy,
    make_scaling_policy,
    with_gateway_rules,
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
    "DEdf",
    "FlowPrefill",
    "FlowPrefillParams",
    "KairosLiteralPrefill",
    "KairosParams",
    "KairosPrefill",
    "KairosSlack",
    "KairosSlackParams",
    "LengthBatching",
    "LengthBatchingParams",
    "Sedf",
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
    "POISE_LATE_BINDING_POLICY",
    "POISE_PREFILL_POLICY",
    "PREFILL_POLICIES",
    "PREEMPTION",
    "Preemption",
    "PrefillPlan",
    "preempts",
    "Placement",
    "PoolDecision",
    "PoolPolicy",
    "PrefillItem",
    "PrefillPolicy",
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
    "make_prefill_policy",
    "make_scaling_policy",
    "with_gateway_rules",
]
