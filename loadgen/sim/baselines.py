"""Named policy mixes: what ``poise sim --policy`` accepts.

A mix is one choice per policy interface in ``shared.policies``: the instances' initial roles, dispatch,
and optionally a scaling policy (replica counts), a pool policy (role flips), a migration policy, how the
engines schedule inside themselves (:class:`EngineSpec`: prefill policy, preemption granularity, chunk size,
decode batch policy), the gateway's late-binding prefill queue, a length predictor and how migrations
move a request (``migration_mechanism``). The baselines here are the systems the papers compare against.
``--prefill-policy``, ``--preemption``, ``--chunk``, ``--decode-policy``, ``--late-binding``,
``--migration``, ``--migration-mechanism`` and ``--length-predictor`` override one part of any mix. A
migration policy that prefers a length predictor (ARES: ``ares-noise``; ARES-Oracle: ``oracle``) gets it
unless ``--length-predictor`` names another.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from loadgen.sim.instance import EngineSpec
from shared.latency import LatencyModel
from shared.policies import (
    DECODE_BATCH_POLICIES,
    DISPATCH_POLICIES,
    POOL_POLICIES,
    PREEMPTION,
    PREFILL_POLICIES,
    ArrowDispatch,
    ArrowPools,
    DispatchPolicy,
    DopdPools,
    DopdScaling,
    DynamoLoad,
    DynamoSla,
    LeastLoad,
    LengthPredictor,
    MaxTokens,
    MigrationPolicy,
    PolicyContext,
    PoolPolicy,
    RoundRobin,
    ScalingPolicy,
    lookup,
    make_length_predictor,
    make_migration_policy,
)
from shared.policies.admission import EarlyRejectionParams
from shared.policies.cache_aware import CacheAware
from shared.policies.local_prefill import LocalPrefillParams
from shared.policies.migration_cost import DEFAULT_MECHANISM, MIGRATION_MECHANISMS, make_migration_mechanism
from shared.policies.poise_mix import POISE_MIX, POISE_ON_SGLANG, PoiseMix
from shared.protocol.messages import Role


@dataclass(frozen=True)
class PolicyMix:
    name: str
    roles: list[Role]
    dispatch: DispatchPolicy
    description: str
    scaling: ScalingPolicy | None = None
    pools: PoolPolicy | None = None
    migration: MigrationPolicy | None = None
    engine: EngineSpec = field(default_factory=EngineSpec)
    late_binding: tuple[str, int] | None = None  # the gateway's late-binding queue: (prefill policy, depth)
    length: LengthPredictor = field(default_factory=MaxTokens)
    migration_mechanism: str = DEFAULT_MECHANISM  # shared.policies.migration_cost: how a migrated request moves
    max_instances: int | None = None  # the GPU budget; None = len(roles)
    # DOPD's local prefill of ultra-short prompts on the decode instances (shared.policies.local_prefill)
    local_prefill: LocalPrefillParams | None = None
    # Refuse requests the decode side cannot start within their TTFT target (shared.policies.admission)
    early_rejection: EarlyRejectionParams | None = None
    # A decode instance draining for a flip has its requests moved away by ``migration_mechanism``
    # (shared.policies.evacuation; live: the planner's ``drain_by_migration``), the controller told so
    drain_by_migration: bool = False
    # SLO-aware policies need the engines' latency model and the SLO, which the simulator knows: it calls
    # ``bind(model, ctx)`` and replaces the fields it returns (e.g. ``{"dispatch": ArrowDispatch(...)}``).
    bind: Callable[[LatencyModel, PolicyContext], dict[str, Any]] | None = None

    @property
    def controlled(self) -> bool:
        """True when something changes the cluster while it runs (the simulator then runs the control loop)."""
        return (self.scaling is not None or self.pools is not None or self.migration is not None
                or self.bind is not None)

    def bound(self, model: LatencyModel, ctx: PolicyContext) -> PolicyMix:
        """This mix with its SLO-aware policies built for ``model`` and ``ctx`` (itself when it has none)."""
        if self.bind is None:
            return self
        return dataclasses.replace(self, bind=None, **self.bind(model, ctx))


def parse_split(split: str | None, instances: int, *, within_budget: bool = False) -> tuple[int, int]:
    """``"4P4D"`` or ``"4:4"`` → (4, 4); None → an even split (prefill gets the odd one).

    ``within_budget``: ``instances`` is a GPU budget the split may stay under (elastic mixes start small).
    """
    if split is None:
        decode = instances // 2
        return instances - decode, decode
    m = re.fullmatch(r"\s*(\d+)\s*[Pp:]\s*(\d+)\s*[Dd]?\s*", split)
    if not m:
        raise ValueError(f"split {split!r} is not like 4P4D or 4:4")
    p, d = int(m.group(1)), int(m.group(2))
    if p < 1 or d < 1:
        raise ValueError("a disaggregated split needs at least one prefill and one decode instance")
    if p + d != instances and not (within_budget and p + d < instances):
        raise ValueError(f"split {split} has {p + d} instances, but --instances is {instances}")
    return p, d


def _roles(instances: int, split: str | None, within_budget: bool = False) -> tuple[list[Role], str]:
    p, d = parse_split(split, instances, within_budget=within_budget)
    prefill: list[Role] = ["prefill"]
    decode: list[Role] = ["decode"]
    return prefill * p + decode * d, f"{p}P{d}D"


def _static(name: str, policy: Callable[[], DispatchPolicy], what: str) -> Callable[[int, str | None], PolicyMix]:
    def build(instances: int, split: str | None) -> PolicyMix:
        roles, layout = _roles(instances, split)
        return PolicyMix(name, roles, policy(), f"{layout}, fixed roles, {what} dispatch (sglang-router / DistServe-like)")
    return build


def _colocated(instances: int, split: str | None) -> PolicyMix:
    if split is not None:
        raise ValueError("colocated has no P:D split")
    return PolicyMix("colocated", ["null"] * instances, LeastLoad(),
                     f"{instances} colocated instances, chunked prefill, decode-prioritised (vLLM-like)")


def _elastic(name: str, policy: Callable[[LatencyModel, PolicyContext], ScalingPolicy], what: str,
             who: str, local_prefill: LocalPrefillParams | None = None) -> Callable[[int, str | None], PolicyMix]:
    def build(instances: int, split: str | None) -> PolicyMix:
        if instances < 2:
            raise ValueError(f"{name} needs at least 2 instances (one prefill, one decode)")
        roles, layout = _roles(instances, split, within_budget=True)
        return PolicyMix(name, roles, LeastLoad(), f"starts {layout} on a budget of {instances} GPUs; {what}; "
                         f"replicas start and stop, roles never flip ({who})",
                         bind=lambda model, ctx: {"scaling": policy(model, ctx)}, max_instances=instances,
                         local_prefill=local_prefill)
    return build


def _arrow(instances: int, split: str | None) -> PolicyMix:
    if instances < 2:
        raise ValueError("arrow needs at least 2 instances (one prefill, one decode)")
    roles, layout = _roles(instances, split)
    return PolicyMix("arrow", roles, LeastLoad(),
                     f"starts {layout}; SLO-aware dispatch (Alg. 1-2) and drain-then-switch flips (Alg. 3-4)",
                     bind=lambda model, ctx: {"dispatch": ArrowDispatch(model, ctx), "pools": ArrowPools(model, ctx)})


def _static_arrow(instances: int, split: str | None) -> PolicyMix:
    roles, layout = _roles(instances, split)
    return PolicyMix("static-arrow", roles, LeastLoad(),
                     f"{layout}, fixed roles, Arrow's SLO-aware dispatch as Poise runs it (least predicted TTFT, "
                     f"a cached prefix priced by the prefill it saves)",
                     bind=lambda model, ctx: {"dispatch": ArrowDispatch(model, ctx)})


#: DOPD prefills ultra-short prompts on the decode instances (its "PD aggregation"); the DOPD-based mixes on a
#: fixed GPU count do too. It never lost goodput there and gained up to 16% where a quarter of the prompts
#: are short; Dynamo's queue rule stays off, it cost up to two thirds of the goodput on Azure code
#: (tests/bench/results/local_prefill.md).
DOPD_LOCAL_PREFILL = LocalPrefillParams()


def _dopd_ratio(instances: int, split: str | None) -> PolicyMix:
    roles, layout = _roles(instances, split)
    return PolicyMix("dopd-ratio", roles, LeastLoad(),
                     f"starts {layout}; DOPD's forecast ratio (Eq. 14) on a fixed GPU count, reached by flips; "
                     f"prompts <= {DOPD_LOCAL_PREFILL.max_local_prefill_tokens} tokens prefilled on decode",
                     bind=lambda model, ctx: {"pools": DopdPools(model, ctx)}, local_prefill=DOPD_LOCAL_PREFILL)


#: The Poise mix (shared/policies/poise_mix.py, which says why each rule is in it) as the simulator runs it:
#: the engines' scheduling, and the gateway's late-binding queue as (release order, depth).
def _poise_engine(mix: PoiseMix) -> EngineSpec:
    chunk = mix.chunked_prefill_size
    return EngineSpec(prefill_policy=mix.prefill_policy, decode_policy=mix.decode_policy,
                      preemption=mix.preemption,  # type: ignore[arg-type]  # PoiseMix checks it against PREEMPTION
                      chunk_tokens=None if chunk is None else max(chunk, 0), give_up_late=mix.give_up_late_prompts)


def _poise_late_binding(mix: PoiseMix) -> tuple[str, int] | None:
    return (mix.late_binding_policy, mix.late_binding_depth) if mix.late_binding else None


POISE_ENGINE = _poise_engine(POISE_MIX)
POISE_LATE_BINDING = _poise_late_binding(POISE_MIX)


def _poise(instances: int, split: str | None) -> PolicyMix:
    return _poise_of(POISE_MIX, "poise", instances, split)


def _poise_on_sglang(instances: int, split: str | None) -> PolicyMix:
    return _poise_of(POISE_ON_SGLANG, "poise-sglang", instances, split)


def _poise_of(mix: PoiseMix, name: str, instances: int, split: str | None) -> PolicyMix:
    engine = _poise_engine(mix)
    roles, layout = _roles(instances, split)
    local = LocalPrefillParams(max_local_prefill_tokens=mix.local_prefill_max_tokens)
    return PolicyMix(name, roles, LeastLoad(),
                     f"starts {layout}; scores every split and colocated serving on the served mix (latency model), "
                     f"flips one at a time towards a clearly better split or restarts the cluster into colocated "
                     f"serving; Arrow's SLO-aware dispatch; "
                     + (f"prompts <= {local.max_local_prefill_tokens} tokens prefilled on decode; "
                        if local.max_local_prefill_tokens > 0 else "") +
                     f"prompts held in the gateway until a prefill engine has room (late binding, depth "
                     f"{mix.late_binding_depth}), so decode KV is reserved only for prompts about to be prefilled; "
                     f"early rejection when the decode side cannot start a request in time; "
                     f"decode drains by migration ({mix.migration_mechanism}); "
                     f"engines: {engine.describe()}", engine=engine,
                     local_prefill=local if local.max_local_prefill_tokens > 0 else None,
                     early_rejection=EarlyRejectionParams() if mix.early_rejection else None,
                     drain_by_migration=mix.drain_by_migration, late_binding=_poise_late_binding(mix),
                     migration_mechanism=mix.migration_mechanism,
                     bind=lambda model, ctx: {"dispatch": DISPATCH_POLICIES[mix.dispatch_policy](model, ctx, None),
                                              "pools": POOL_POLICIES[mix.planner_policy](model, ctx)})


MIXES: dict[str, Callable[[int, str | None], PolicyMix]] = {
    "colocated": _colocated,
    "static-rr": _static("static-rr", RoundRobin, "round-robin"),
    "static-minload": _static("static-minload", LeastLoad, "least-load"),
    "static-cache-aware": _static("static-cache-aware", CacheAware, "SMG's cache_aware prefill, least-load decode"),
    DynamoLoad.name: _elastic(DynamoLoad.name, DynamoLoad, "±1 replica per role every 5 s when all engines' "
                              "estimated TTFT/ITL cross the SLO", "NVIDIA Dynamo's load planner"),
    DynamoSla.name: _elastic(DynamoSla.name, DynamoSla, "replica counts every 180 s from the last interval's rate, "
                             "ISL and OSL and the profile's per-engine capacity", "NVIDIA Dynamo's SLA planner"),
    "arrow": _arrow,
    "static-arrow": _static_arrow,
    # No local prefill in the elastic mix: it provisions decode tightly for the forecast concurrency, and
    # prompts prefilled there cost TTFT (day-shaped Azure conversation: 92.8% attainment with it, 99.6%
    # without; tests/bench/local_prefill.py on the load of tests/bench/dopd_vs_dynamo.py).
    DopdScaling.name: _elastic(DopdScaling.name, DopdScaling, "ARIMA forecast of ISL/OSL/concurrency every 10 s "
                               "-> optimal P:D counts (Eq. 11-14), burst fast path", "DOPD"),
    "dopd-ratio": _dopd_ratio,
    "poise": _poise,
    "poise-sglang": _poise_on_sglang,
}


def _bind_migration(bind: Callable[[LatencyModel, PolicyContext], dict[str, Any]] | None, migration: str,
                    mechanism: str) -> Callable[[LatencyModel, PolicyContext], dict[str, Any]]:
    """The mix's own binding, plus the migration policy built for the engines' model and the mechanism the
    simulator moves requests with (ARES' cost filter must price what the simulator charges)."""
    def bound(model: LatencyModel, ctx: PolicyContext) -> dict[str, Any]:
        out = bind(model, ctx) if bind is not None else {}
        out["migration"] = make_migration_policy(migration, model, make_migration_mechanism(mechanism, model))
        return out
    return bound


def make_mix(name: str, instances: int, split: str | None = None, *, prefill_policy: str | None = None,
             preemption: str | None = None, chunk_tokens: int | None = None, decode_policy: str | None = None,
             late_binding: str | None = None, late_binding_depth: int = 2, migration: str | None = None,
             length_predictor: str | None = None, migration_mechanism: str | None = None,
             kv_report: str | None = None, local_prefill_tokens: int | None = None,
             decode_kv: str | None = None, prefix_cache: bool | None = None,
             early_rejection: bool | None = None, drain_by_migration: bool | None = None,
             give_up_late: bool | None = None) -> PolicyMix:
    """Build the mix ``name``; the keyword arguments replace one policy of it by its registry name
    (``late_binding``: a prefill policy name for the gateway's queue, or ``"none"``; ``kv_report``: what decode
    engines report as KV use, ``reserved`` or ``current``, and ``decode_kv`` how they admit it, ``whole`` or
    ``grow`` (with retraction), see ``loadgen.sim.instance``;
    ``local_prefill_tokens``: prompts up to this long are prefilled on their decode instance, 0 = never;
    ``prefix_cache``: prefill and colocated engines keep SGLang's radix cache, see ``loadgen.sim.instance``;
    ``give_up_late``: colocated engines refuse prompts waiting past their TTFT target, ``shared.engine.model``;
    ``early_rejection``: refuse requests the decode side cannot start in time, ``shared.policies.admission``;
    ``drain_by_migration``: a decode instance draining for a flip has its requests moved away,
    ``shared.policies.evacuation``)."""
    if instances < 1:
        raise ValueError("--instances must be at least 1")
    try:
        build = MIXES[name]
    except KeyError:
        raise ValueError(f"unknown policy mix {name!r}; known: {', '.join(sorted(MIXES))}") from None
    mix = build(instances, split)
    changes: dict[str, object] = {}
    notes: list[str] = []
    engine = mix.engine
    if prefill_policy is not None:
        lookup(PREFILL_POLICIES, prefill_policy, "prefill policy")
        engine = dataclasses.replace(engine, prefill_policy=prefill_policy)
    if decode_policy is not None:
        lookup(DECODE_BATCH_POLICIES, decode_policy, "decode batch policy")
        engine = dataclasses.replace(engine, decode_policy=decode_policy)
    if preemption is not None:
        if preemption not in PREEMPTION:
            raise ValueError(f"unknown preemption {preemption!r}; known: {', '.join(PREEMPTION)}")
        engine = dataclasses.replace(engine, preemption=preemption)  # type: ignore[arg-type]
    if chunk_tokens is not None:
        engine = dataclasses.replace(engine, chunk_tokens=chunk_tokens)
    if kv_report is not None:
        if kv_report not in ("reserved", "current"):
            raise ValueError(f"unknown kv report {kv_report!r}; known: current, reserved")
        engine = dataclasses.replace(engine, kv_report=kv_report)  # type: ignore[arg-type]
    if decode_kv is not None:
        if decode_kv not in ("whole", "grow"):
            raise ValueError(f"unknown decode KV model {decode_kv!r}; known: grow, whole")
        engine = dataclasses.replace(engine, decode_kv=decode_kv)  # type: ignore[arg-type]
    if prefix_cache is not None:
        engine = dataclasses.replace(engine, prefix_cache=prefix_cache)
    if give_up_late is not None:
        engine = dataclasses.replace(engine, give_up_late=give_up_late)
    description = mix.description
    if engine != mix.engine:
        changes["engine"] = engine
        if mix.engine.describe() in description:  # a mix that names its own engines: say what replaced them
            description = description.replace(mix.engine.describe(), engine.describe())
        else:
            notes.append(engine.describe())
    if late_binding is not None:
        if late_binding != "none":
            lookup(PREFILL_POLICIES, late_binding, "prefill policy")
            if late_binding_depth < 1:
                raise ValueError("--late-binding-depth must be at least 1")
        changes["late_binding"] = None if late_binding == "none" else (late_binding, late_binding_depth)
        notes.append(f"late binding {late_binding}" + ("" if late_binding == "none" else f" (depth {late_binding_depth})"))
    if migration_mechanism is not None:
        lookup(MIGRATION_MECHANISMS, migration_mechanism, "migration mechanism")
        changes["migration_mechanism"] = migration_mechanism
        notes.append(f"migration mechanism {migration_mechanism}")
    if migration is not None:
        changes["migration"] = None if migration == "none" else make_migration_policy(migration)
        if migration != "none":
            changes["bind"] = _bind_migration(mix.bind, migration,
                                              migration_mechanism or mix.migration_mechanism)
            preferred = getattr(changes["migration"], "preferred_length_predictor", None)
            if length_predictor is None and preferred is not None:
                length_predictor = preferred
    if length_predictor is not None:
        changes["length"] = make_length_predictor(length_predictor)
    if local_prefill_tokens is not None:
        changes["local_prefill"] = (LocalPrefillParams(max_local_prefill_tokens=local_prefill_tokens)
                                    if local_prefill_tokens > 0 else None)
        notes.append(f"local prefill up to {local_prefill_tokens} tokens" if local_prefill_tokens > 0
                     else "no local prefill")
    if early_rejection is not None and early_rejection != (mix.early_rejection is not None):
        changes["early_rejection"] = EarlyRejectionParams() if early_rejection else None
        notes.append("no early rejection" if not early_rejection else "early rejection" if not engine.give_up_late
                     else "early rejection of decode engines (colocated ones give up late prompts themselves)")
    # Colocated engines that give up late prompts themselves are not judged (EarlyRejectionParams.colocated),
    # whatever the mix's engines became above: as poise up runs its gateway beside such engines.
    rejection = changes.get("early_rejection", mix.early_rejection)
    if isinstance(rejection, EarlyRejectionParams) and rejection.colocated == engine.give_up_late:
        changes["early_rejection"] = msgspec.structs.replace(rejection, colocated=not engine.give_up_late)
    if drain_by_migration is not None and drain_by_migration != mix.drain_by_migration:
        changes["drain_by_migration"] = drain_by_migration
        notes.append("decode drains by migration" if drain_by_migration else "decode drains wait for their answers")
    for key in ("migration", "length"):
        if key in changes:
            notes.append(f"{key} {getattr(changes[key], 'name', 'none')}")
    if not changes:
        return mix
    if notes:
        description = f"{description}; {', '.join(notes)}"
    return dataclasses.replace(mix, description=description, **changes)  # type: ignore[arg-type]

