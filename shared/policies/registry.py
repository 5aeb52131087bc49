"""Registries of the policies the live services build by name (the simulator's mixes build the same objects).

SLO-aware policies need the engines' latency model (their performance model) and a :class:`PolicyContext`;
the factories take both and the simple policies ignore them, so a service builds any policy the same way.
"""

from __future__ import annotations

from collections.abc import Callable

from shared.latency import LatencyModel
from shared.policies.arrow import ArrowDispatch, ArrowPools
from shared.policies.context import PolicyContext, lookup
from shared.policies.dispatch import DispatchParams, DispatchPolicy, LeastLoad, RoundRobin
from shared.policies.dopd import DopdPools, DopdScaling
from shared.policies.poise import PoisePools
from shared.policies.pools import PoolPolicy, StaticPools
from shared.policies.scaling import DynamoLoad, DynamoSla, ScalingPolicy

DispatchFactory = Callable[[LatencyModel, PolicyContext, DispatchParams | None], DispatchPolicy]
PoolFactory = Callable[[LatencyModel, PolicyContext], PoolPolicy]
ScalingFactory = Callable[[LatencyModel, PolicyContext], ScalingPolicy]

DISPATCH_POLICIES: dict[str, DispatchFactory] = {
    LeastLoad.name: lambda model, ctx, params: LeastLoad(params),
    RoundRobin.name: lambda model, ctx, params: RoundRobin(params),
    ArrowDispatch.name: lambda model, ctx, params: ArrowDispatch(model, ctx, dispatch=params),
}

POOL_POLICIES: dict[str, PoolFactory] = {
    StaticPools.name: lambda model, ctx: StaticPools(),
    ArrowPools.name: ArrowPools,
    DopdPools.name: DopdPools,
    PoisePools.name: PoisePools,
}


SCALING_POLICIES: dict[str, ScalingFactory] = {
    DynamoLoad.name: DynamoLoad,
    DynamoSla.name: DynamoSla,
    DopdScaling.name: DopdScaling,
}


def make_scaling_policy(name: str, model: LatencyModel, ctx: PolicyContext) -> ScalingPolicy:
    return lookup(SCALING_POLICIES, name, "scaling policy")(model, ctx)


def make_dispatch_policy(name: str, model: LatencyModel, ctx: PolicyContext,
                         params: DispatchParams | None = None) -> DispatchPolicy:
    return lookup(DISPATCH_POLICIES, name, "dispatch policy")(model, ctx, params)


def make_pool_policy(name: str, model: LatencyModel, ctx: PolicyContext) -> PoolPolicy:
    return lookup(POOL_POLICIES, name, "pool policy")(model, ctx)
