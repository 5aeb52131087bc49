"""Registries of the policies the live services build by name (the simulator's mixes build the same objects).

SLO-aware policies need the engines' latency model (their performance model) and a :class:`PolicyContext`;
the factories take both and the simple policies ignore them, so a service builds any policy the same way.
"""

from __future__ import annotations

from collections.abc import Callable

from shared.latency import LatencyModel
from shared.policies.admission import EarlyRejection, EarlyRejectionParams
from shared.policies.arrow import ArrowDispatch, ArrowPools
from shared.policies.cache_aware import CacheAware
from shared.policies.context import PolicyContext, lookup
from shared.policies.decode_batch import Continuous, DecodeBatchPolicy
from shared.policies.dispatch import DispatchParams, DispatchPolicy, LeastLoad, RoundRobin
from shared.policies.dopd import DopdPools, DopdScaling
from shared.policies.flowprefill import CAUTIOUS_LATE_COST, DEdf, FlowPrefill, FlowPrefillParams, Sedf
from shared.policies.kairos import KairosLiteralPrefill, KairosPrefill, KairosSlack, KairosSlackParams
from shared.policies.length_batching import LengthBatching
from shared.policies.local_prefill import LocalPrefill, LocalPrefillParams
from shared.policies.poise import PoisePools
from shared.policies.pools import PoolPolicy, StaticPools
from shared.policies.prefill_order import Edf, Fcfs, PrefillPolicy
from shared.policies.scaling import DynamoLoad, DynamoSla, ScalingPolicy

DispatchFactory = Callable[[LatencyModel, PolicyContext, DispatchParams | None], DispatchPolicy]
PoolFactory = Callable[[LatencyModel, PolicyContext], PoolPolicy]
ScalingFactory = Callable[[LatencyModel, PolicyContext], ScalingPolicy]

DISPATCH_POLICIES: dict[str, DispatchFactory] = {
    LeastLoad.name: lambda model, ctx, params: LeastLoad(params),
    RoundRobin.name: lambda model, ctx, params: RoundRobin(params),
    CacheAware.name: lambda model, ctx, params: CacheAware(params),
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


def with_gateway_rules(policy: DispatchPolicy, ttft_slo_s: float, local_prefill: LocalPrefillParams | None = None,
                       early_rejection: EarlyRejectionParams | None = None) -> DispatchPolicy:
    """``policy`` with the gateway's rules around it, as the gateway and the simulator both run it: DOPD's local
    prefill of short prompts, then early rejection (which judges the decode engine the rest chose)."""
    if local_prefill is not None:
        policy = LocalPrefill(policy, local_prefill)
    if early_rejection is not None:
        policy = EarlyRejection(policy, ttft_slo_s, early_rejection)
    return policy


def make_pool_policy(name: str, model: LatencyModel, ctx: PolicyContext) -> PoolPolicy:
    return lookup(POOL_POLICIES, name, "pool policy")(model, ctx)


#: Prefill scheduling inside an engine (prefill or colocated). One object per engine: some keep estimates.
PREFILL_POLICIES: dict[str, Callable[[LatencyModel], PrefillPolicy]] = {
    Fcfs.name: lambda model: Fcfs(),
    Edf.name: lambda model: Edf(),
    KairosPrefill.name: KairosPrefill,
    KairosLiteralPrefill.name: KairosLiteralPrefill,
    FlowPrefill.name: FlowPrefill,
    # FlowPrefill's priority ablation (Fig. 10): the same batching and events, ranked by D-EDF or EDF.
    "flowprefill-d-edf": lambda model: FlowPrefill(model, FlowPrefillParams(priority="d-edf")),
    "flowprefill-edf": lambda model: FlowPrefill(model, FlowPrefillParams(priority="edf")),
    # Poise's extension: the fewest prompts late when a burst outruns the engine (flowprefill.fewest_late).
    "flowprefill-fewest-late": lambda model: FlowPrefill(model, FlowPrefillParams(fewest_late=True)),
    "flowprefill-fewest-late-cautious": lambda model: FlowPrefill(
        model, FlowPrefillParams(fewest_late=True, late_cost=CAUTIOUS_LATE_COST)),
    Sedf.name: Sedf,
    DEdf.name: lambda model: DEdf(),
    LengthBatching.name: LengthBatching,
}

#: The prefill policy of Poise's own engines (the simulator's ``poise`` mix and ``poise up``'s engine_sim):
#: FlowPrefill, giving up the fewest prompts when a burst outruns the engine, each prompt counted at
#: ``CAUTIOUS_LATE_COST`` times its work alone where decode shares the engine's steps. Fewest-late held more
#: attainment than plain FlowPrefill at and below each tune-set trace's goodput and gained a goodput step on
#: stress-bursts and stress-mix-shift; the cautious count's factor comes from stress-bursts, and it keeps the
#: tune set level (tests/bench/results/adaptive_pd.md, tests/bench/results/provenance.md).
POISE_PREFILL_POLICY = "flowprefill-fewest-late-cautious"

#: The order in which Poise's gateway releases held prompts (late binding): the engines' rule, each prompt
#: counted at its work alone. The gateway does not share a step with any decode batch, and counting it
#: cautiously there too gave up more than it saved on Azure code (tests/bench/results/provenance.md).
POISE_LATE_BINDING_POLICY = "flowprefill-fewest-late"

#: Decode batch selection inside an engine (decode or colocated). One object per engine.
DECODE_BATCH_POLICIES: dict[str, Callable[[LatencyModel], DecodeBatchPolicy]] = {
    Continuous.name: lambda model: Continuous(),
    KairosSlack.name: KairosSlack,
    # Algorithm 3 as written: each slack reserves the request's solo step, and KV waiters are not considered.
    "kairos-slack-paper": lambda model: KairosSlack(model, KairosSlackParams(slack_reserve="solo",
                                                                             yield_to_kv_waiters=False)),
}


def make_prefill_policy(name: str, model: LatencyModel) -> PrefillPolicy:
    return lookup(PREFILL_POLICIES, name, "prefill policy")(model)


def make_decode_batch_policy(name: str, model: LatencyModel) -> DecodeBatchPolicy:
    return lookup(DECODE_BATCH_POLICIES, name, "decode batch policy")(model)
