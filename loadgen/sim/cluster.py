"""The simulated cluster: instances driven by the live system's dispatch policy, plus the operations the
planner and migrator carry out live: role flips, starting and stopping replicas, and migrations.

Costs of those operations (see :class:`SimCosts`):

- a **role flip** follows SGLang's rule, as the live sidecar does: the instance stops taking requests,
  drains what it has, then pays ``role_switch_s`` of the profile (``/pd_role_switch`` rebuilds the
  scheduler) before it serves in the new role; a move into or out of colocated serving is a restart in the
  other mode and pays ``start_s``;
- a **start** takes ``start_s`` (process start, weights load, CUDA graphs) before the instance is ready;
  a **stop** drains first. GPU-seconds count from the start decision to the moment the instance stopped;
- a **migration** pauses the request for the migration mechanism's time for its context (a KV copy at
  25 Gbps by default, or a recompute; ``shared.policies.migration_cost``); a move the target has no room
  for is refused and the request stays where it is;
- with ``drain_by_migration`` a decode instance draining for a flip is emptied as the live planner
  and migrator empty it (``shared.policies.evacuation``): from ``EVACUATE_AFTER_S`` after the flip, rounds
  every ``EVACUATE_EVERY_S`` move its running requests to the other decode instances where their KV fits
  (a request once refused staying put), until it is empty or its drain deadline passes.

Requests are admitted by the gateway model the live gateway runs (``shared.gateway.model``: placement by the
dispatch policy, the in-flight ledger and, with ``late_binding``, the held queue: arrivals held and released, in
the prefill policy's order, to prefill instances holding fewer than ``depth`` prompts not yet prefilled); the
cluster is its event-queue adapter (the model's :class:`Port`).

Instance ids follow ``poise up``'s: ``p0``, ``p1``... for prefill, ``d0``... for decode, ``c0``... for
colocated; a replica started later gets the next free number of its role.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec

from loadgen.sim.events import PRIORITY_ARRIVAL, PRIORITY_STEP_END, EventQueue
from loadgen.sim.instance import EngineSpec, SimInstance, SimRequest
from loadgen.sim.prediction import PredictionCadence
from shared.gateway.model import GatewayModel, Refusal
from shared.latency import LatencyModel
from shared.policies import DispatchPolicy, EngineView, MigrationDecision, Placement, RequestView
from shared.policies.evacuation import EVACUATE_AFTER_S, EVACUATE_EVERY_S, Evacuation
from shared.policies.flip import DRAIN_TIMEOUT_S, Flip, drained_by_migration
from shared.policies.inflight import InflightLedger
from shared.policies.late_binding import LateBinding
from shared.policies.migration_cost import KvTransfer, MigrationMechanism
from shared.policies.scaling import pick_retiree
from shared.protocol.messages import (
    ClusterSnapshot,
    DecodeRequestInfo,
    InstanceInfo,
    InstanceLoad,
    Role,
)
from shared.protocol.refusal import REFUSAL_STATUSES, client_wait_s, retry_after_s

_ID_PREFIX = {"prefill": "p", "decode": "d", "null": "c"}
_MODEL = "sim"  # the one model every simulated instance serves (the gateway model queues by model)


@dataclass(frozen=True)
class SimCosts:
    start_s: float = 30.0  # ours: SGLang with an 8B model starts in tens of seconds (weights, CUDA graphs)
    # A flip's drain ends by this deadline or is called off, the instance back to work in its old role (the
    # live planner's and sidecar's drain timeout: shared/policies/flip.py).
    drain_timeout_s: float = DRAIN_TIMEOUT_S


@dataclass
class Lifecycle:
    """What the cluster did to its instances, for reports (GPU-seconds, the provisioning timeline)."""

    timeline: list[tuple[float, int, int]] = field(default_factory=list)  # (t, prefill, decode) provisioned
    events: list[tuple[float, str, str]] = field(default_factory=list)  # (t, instance, what happened)
    flips: int = 0
    flips_called_off: int = 0  # drains past SimCosts.drain_timeout_s: the flip was abandoned
    starts: int = 0
    stops: int = 0
    migrations: int = 0
    migrations_refused: int = 0
    gpu_seconds: float = 0.0


class SimCluster:
    """Instances plus the dispatch policy the live gateway uses, fed exact snapshots."""

    def __init__(self, roles: list[Role], model: LatencyModel, policy: DispatchPolicy, queue: EventQueue,
                 first_token_delay: Callable[[int], float] = lambda i: 0.0, *,
                 engine: EngineSpec | None = None, late_binding: LateBinding | None = None,
                 costs: SimCosts | None = None, max_instances: int | None = None, handshake_s: float = 0.0,
                 mechanism: MigrationMechanism | None = None, drain_by_migration: bool = False,
                 client_retries: int = 0) -> None:
        self.queue = queue
        # Clients send a refused request (429/503) again after the gateway's Retry-After, this many times
        # (shared/protocol/refusal.py); only the last attempt is a finished request.
        self.client_retries = client_retries
        self.retries = 0
        # A decode instance draining for a flip has its running requests moved to the other decode instances
        # by ``mechanism`` (live: the planner's ``drain_by_migration`` with a migrator running).
        self.drain_by_migration = drain_by_migration
        self.mechanism = mechanism or KvTransfer(model)
        self.model = model
        self.first_token_delay = first_token_delay
        self.handshake_s = handshake_s
        self.engine = engine or EngineSpec()
        # The gateway's admission, as the live gateway runs it, with its in-flight ledger.
        self.gateway: GatewayModel[SimRequest] = GatewayModel(policy, late_binding, ledger=InflightLedger())
        self.ledger = self.gateway.ledger
        self.given_up = 0  # late binding: held requests refused past their TTFT target (LateBinding.guard_decode)
        # What the dispatch decided beyond a plain placement, as the gateway's metrics count it: placement stages
        # (Placement.stages) and retryable refusals (Rejection.code).
        self.decisions: collections.Counter[str] = collections.Counter()
        self._release_at: float | None = None
        self._pumping = False  # inside _release (see there)
        self._pump_again = False
        self.costs = costs or SimCosts()
        self.max_instances = max_instances if max_instances is not None else len(roles)
        self.finished: list[SimRequest] = []
        self.on_finish: Callable[[SimRequest], None] | None = None  # the control loop listens here
        self.requests: dict[str, SimRequest] = {}  # dispatched and not finished, by rid
        self.instances: dict[str, SimInstance] = {}  # every instance ever, stopped ones included
        self.live: list[SimInstance] = []  # not stopped, in creation order
        self.lifecycle = Lifecycle()
        self._started_at: dict[str, float] = {}
        self._held: list[tuple[float, float]] = []  # (start, stop) of every instance stopped so far
        self._flips: dict[str, Flip] = {}  # flips under way, by instance: a draining instance with none is stopping
        self._backlog: list[Role] = []  # starts waiting for a GPU that a draining replica will free
        self._prefill_hook: Callable[[SimInstance, list[tuple[SimRequest, int]], float], None] | None = None
        self._next_number = {"prefill": 0, "decode": 0, "null": 0}
        for role in roles:
            self._add(role, "ready")
        self._record_timeline()

    # -- requests ----------------------------------------------------------------------------------
    def submit(self, req: SimRequest) -> None:
        if self.gateway.late_binding is None:
            self.gateway.admit(req, _MODEL, self.queue.now_s, self)  # placed or refused at once
            return
        self.gateway.hold(req, _MODEL)
        self._release()

    def _release(self) -> None:
        """Late binding: the held queue's pump (the gateway's), on exact views of the instances. Not
        re-entrant: a placement that fails at once can bring a client's retry back into the queue, and that
        arrival pumps again once this pump is done (the gateway's pump runs once per loop turn the same way)."""
        if self._pumping:
            self._pump_again = True
            return
        self._pumping = True
        try:
            self._pump_again = True
            while self._pump_again:
                self._pump_again = False
                self._wake(self.gateway.pump(_MODEL, self.queue.now_s, self))
        finally:
            self._pumping = False

    def _wake(self, at_s: float) -> None:
        """Pump again at ``at_s`` (the model's wake-up: a policy that chose to wait, the next give-up)."""
        if not self.gateway.held_count() or math.isinf(at_s) or (self._release_at is not None and at_s >= self._release_at):
            return
        self._release_at = at_s

        def wake() -> None:
            self._release_at = None
            self._release()

        self.queue.at(max(at_s, self.queue.now_s), PRIORITY_STEP_END, wake)

    def _prefill_done(self, inst: SimInstance) -> None:
        if self.gateway.held_count():
            self._release()

    # -- the gateway model's port ----------------------------------------------------------------------
    def engines(self, model: str, role: Role | None = None) -> Sequence[EngineView]:
        return [i.view() for i in self.live if role is None or i.role == role]

    def accepting(self, model: str, role: Role) -> Sequence[str]:
        return [i.instance_id for i in self.live if i.role == role and i.status == "ready"]

    def request(self, item: SimRequest) -> RequestView:
        return RequestView(rid=item.ledger_key, input_tokens=item.input_tokens, max_output_tokens=item.output_tokens,
                           slo_ttft_s=item.slo_ttft_s, slo_tpot_s=item.slo_tpot_s,
                           # Engines without a prefix cache: no prefix is worth routing by.
                           prefix_blocks=item.blocks if self.engine.prefix_cache else ())

    def placed(self, req: SimRequest, placement: Placement) -> bool:
        self.decisions.update(placement.stages)
        decode = self.instances[placement.decode_id]
        if req.kv_tokens > decode.kv_capacity or req.input_tokens > decode.kv_capacity:
            self._fail(req, f"400: request needs {req.kv_tokens} KV tokens, above the engine's {decode.kv_capacity}")
            return False
        self.requests[req.rid] = req
        req.decode = decode
        decode.assigned += 1
        if placement.prefill_id is None:  # colocated, or DOPD's local prefill on a decode instance
            decode.enqueue_prefill(req)
            return True
        prefill = self.instances[placement.prefill_id]
        req.prefill = prefill
        prefill.assigned += 1
        prefill.bootstrapping += 1
        decode.enqueue_reserve(req)
        return True

    def refused(self, item: SimRequest, refusal: Refusal) -> None:
        if refusal.given_up:
            self.given_up += 1
        elif refusal.status == 429:
            self.decisions[refusal.code] += 1
        self._fail(item, f"{refusal.status}: {refusal.reason}")

    def _finished(self, req: SimRequest) -> None:
        self.requests.pop(req.rid, None)
        self.ledger.release(req.ledger_key)
        retry = req.attempts <= self.client_retries and req.http_status in REFUSAL_STATUSES
        if not retry:
            self.finished.append(req)
        if self.on_finish is not None:
            self.on_finish(req)  # a refused attempt too: the live monitor sees each attempt as a request
        if retry:
            self._send_again(req)
        if req.error is None and self.gateway.held_count() and self.gateway.late_binding is not None \
                and self.gateway.late_binding.guard_decode:
            self._release()  # its decode engine has room again

    def _send_again(self, req: SimRequest) -> None:
        """The client comes back after its wait (Retry-After on a 429) with the same request, a new arrival to
        the gateway."""
        first = req.arrival_s if math.isnan(req.first_arrival_s) else req.first_arrival_s
        status = req.http_status or 503
        wait = client_wait_s(retry_after_s(status), req.attempts)
        again = SimRequest(index=req.index, rid=req.rid, arrival_s=self.queue.now_s + wait,
                           input_tokens=req.prompt_tokens, output_tokens=req.output_tokens, slo_ttft_s=req.slo_ttft_s,
                           slo_tpot_s=req.slo_tpot_s, slo_class=req.slo_class, blocks=req.blocks,
                           first_arrival_s=first, attempts=req.attempts + 1)
        for f in dataclasses.fields(SimRequest):  # the same object: the run's list of requests holds it
            setattr(req, f.name, getattr(again, f.name))
        self.retries += 1
        self.queue.at(req.arrival_s, PRIORITY_ARRIVAL, functools.partial(self.submit, req))

    def _fail(self, req: SimRequest, error: str) -> None:
        req.error = error
        req.finished_s = self.queue.now_s
        self._finished(req)

    def observe_prefill(self, observe: Callable[[str, int, float], None]) -> None:
        """Feed ``observe(instance, prompt tokens, seconds)`` with every prefill step that ran one whole prompt
        alone: the clean samples an online TTFT predictor refits from (Arrow)."""
        def hook(inst: SimInstance, plan: list[tuple[SimRequest, int]], seconds: float) -> None:
            if len(plan) == 1 and plan[0][1] == plan[0][0].input_tokens:
                observe(inst.instance_id, plan[0][1], seconds)

        self._prefill_hook = hook
        for inst in self.instances.values():
            inst.on_prefill_step = hook

    # -- instance lifecycle --------------------------------------------------------------------------
    def _add(self, role: Role, status: str) -> SimInstance:
        number = self._next_number[role]
        self._next_number[role] += 1
        inst = SimInstance(f"{_ID_PREFIX[role]}{number}", role, self.model, self.queue, self._finished,
                           self.first_token_delay, engine=self.engine, on_prefill_done=self._prefill_done,
                           on_drained=self._drained, status="ready" if status == "ready" else "starting",
                           handshake_s=self.handshake_s, migration_s=self.mechanism.seconds, ledger=self.ledger)
        inst.on_prefill_step = self._prefill_hook
        self.instances[inst.instance_id] = inst
        self.live.append(inst)
        self._started_at[inst.instance_id] = self.queue.now_s
        return inst

    def start(self, role: Role) -> SimInstance | None:
        """Start a replica of ``role``; ready after ``costs.start_s``. None when the GPU budget is spent."""
        if len(self.live) >= self.max_instances:
            return None
        inst = self._add(role, "starting")
        self.lifecycle.starts += 1
        self._log(inst, f"start ({role})")

        def up() -> None:
            if inst.status == "starting":
                inst.status = "ready"
                self._log(inst, "ready")
                inst.kick()
                self._release()  # late binding: a new prefill instance has room

        self.queue.at(self.queue.now_s + self.costs.start_s, PRIORITY_STEP_END, up)
        self._record_timeline()
        return inst

    def scale_to(self, role: Role, want: int) -> bool:
        """Start or stop replicas of ``role`` until ``want`` are ready or starting; True if anything changed.

        Starts beyond the GPU budget wait for a draining replica to free its GPU (as a pending pod would).
        Stops take replicas still starting first, then the least loaded.
        """
        have = [i for i in self.live if i.role == role and i.status in ("ready", "starting")]
        self._backlog = [r for r in self._backlog if r != role]
        if want > len(have):
            for _ in range(want - len(have)):
                if self.start(role) is None:
                    self._backlog.append(role)
            return True
        if want < len(have):
            # The live resizer's rule (shared.policies.scaling.pick_retiree), on the monitor's view.
            snapshot = ClusterSnapshot(ts_unix_s=self.queue.now_s, instances=self.instance_loads(self.model.profile.name),
                                       series=[])
            chosen: list[str] = []
            for _ in range(len(have) - want):
                victim = pick_retiree(snapshot, role, exclude=chosen)
                if victim is None:
                    break
                chosen.append(victim)
                self.stop(self.instances[victim])
            return True
        return False

    def stop(self, inst: SimInstance) -> None:
        """Drain ``inst`` and stop it; it frees its GPU when its last request is gone."""
        if inst.status in ("stopped", "draining"):
            return
        inst.status = "draining"
        self._flips.pop(inst.instance_id, None)
        self._log(inst, "drain to stop")
        self._check_drained(inst)

    def flip(self, inst: SimInstance, new_role: Role) -> bool:
        """Drain ``inst``, switch it to ``new_role``, put it back to work. Between prefill and decode the switch
        costs the profile's ``role_switch_s`` (``/pd_role_switch``); into or out of colocated serving it is a
        restart of the engine in the other mode (SGLang switches modes only at launch), ``start_s``."""
        if inst.status != "ready" or inst.role == new_role:
            return False
        flip = self._flips[inst.instance_id] = Flip(inst.role, new_role, self.queue.now_s, self.costs.drain_timeout_s)
        inst.status = flip.stage
        self._log(inst, f"drain to flip to {new_role}")
        self._check_drained(inst)
        if flip.stage == "draining":
            self.queue.at(flip.deadline_s, PRIORITY_STEP_END, lambda: self._drain_deadline(inst, flip))
            if drained_by_migration(self.drain_by_migration, flip.old, new_role):
                evacuation = Evacuation(inst.instance_id, flip.deadline_s)
                self.queue.at(flip.started_s + EVACUATE_AFTER_S, PRIORITY_STEP_END,
                              lambda: self._evacuate(inst, flip, evacuation))
        return True

    def _evacuate(self, inst: SimInstance, flip: Flip, evacuation: Evacuation) -> None:
        """One round of the migrator's evacuation of a draining decode instance, and the next one
        ``EVACUATE_EVERY_S`` later until the evacuation is over."""
        if self._flips.get(inst.instance_id) is not flip or flip.stage != "draining":
            return  # drained, called off, stopped, or a later flip with its own rounds
        snapshot = ClusterSnapshot(ts_unix_s=self.queue.now_s, instances=self.instance_loads(""), series=[],
                                   decode_requests=self.decode_requests(None))
        moves = evacuation.round(snapshot, self.queue.now_s)
        if moves is None:
            return
        for move in moves:
            if not self.migrate(move):
                evacuation.failed(move.rid)
        self.queue.at(self.queue.now_s + EVACUATE_EVERY_S, PRIORITY_STEP_END,
                      lambda: self._evacuate(inst, flip, evacuation))

    def _drain_deadline(self, inst: SimInstance, flip: Flip) -> None:
        """Call off a flip whose drain outlived the deadline: the instance serves on in its old role."""
        if self._flips.get(inst.instance_id) is not flip or not flip.expire(self.queue.now_s):
            return  # drained, stopped, or a later flip of the same instance with its own deadline
        del self._flips[inst.instance_id]
        inst.status = flip.stage
        self.lifecycle.flips_called_off += 1
        self._log(inst, f"drain past {self.costs.drain_timeout_s:g} s: flip called off, ready as {inst.role}")
        inst.kick()
        self._release()

    def _check_drained(self, inst: SimInstance) -> None:
        if inst.status == "draining" and inst.empty:
            self._drained(inst)

    def _drained(self, inst: SimInstance) -> None:
        flip = self._flips.get(inst.instance_id)
        if flip is None:
            inst.status = "stopped"
            self._log(inst, "stopped")
            self.live.remove(inst)
            self.lifecycle.stops += 1
            self._held.append((self._started_at.pop(inst.instance_id), self.queue.now_s))
            self._record_timeline()
            if self._backlog:
                self.start(self._backlog.pop(0))
            return
        flip.drained()
        inst.status = flip.stage
        self.lifecycle.flips += 1
        self._log(inst, "switching")

        def switched() -> None:
            if self._flips.get(inst.instance_id) is not flip:
                return  # stopped while it switched
            del self._flips[inst.instance_id]
            inst.role = flip.switched()
            inst.reset_cache()
            inst.status = flip.stage
            self._log(inst, f"ready as {inst.role}")
            self._record_timeline()
            inst.kick()
            self._release()

        took = self.costs.start_s if flip.restart else self.model.role_switch_time_s()
        self.queue.at(self.queue.now_s + took, PRIORITY_STEP_END, switched)

    def _log(self, inst: SimInstance, what: str) -> None:
        self.lifecycle.events.append((self.queue.now_s, inst.instance_id, what))

    def provisioned(self) -> tuple[int, int]:
        """(prefill, decode) replicas holding a GPU; colocated instances count as decode."""
        prefill = sum(1 for i in self.live if i.role == "prefill")
        return prefill, len(self.live) - prefill

    def _record_timeline(self) -> None:
        point = (self.queue.now_s, *self.provisioned())
        if self.lifecycle.timeline and self.lifecycle.timeline[-1][0] == point[0]:
            self.lifecycle.timeline[-1] = point
        else:
            self.lifecycle.timeline.append(point)

    def close(self, until_s: float) -> None:
        """At the end of the run: charge the GPU-seconds every instance held, up to ``until_s`` (the last
        answer). Events can run on past it (a restart still under way, a replica stopped late), and GPU time
        there serves no request of the run, so a mean over the run would count more instances than the budget."""
        spans = self._held + [(started, self.queue.now_s) for started in self._started_at.values()]
        self.lifecycle.gpu_seconds = sum(max(0.0, min(stop, until_s) - start) for start, stop in spans)
        self._started_at.clear()

    # -- migrations ----------------------------------------------------------------------------------
    def migrate(self, decision: MigrationDecision) -> bool:
        req = self.requests.get(decision.rid)
        source = self.instances.get(decision.source_id)
        target = self.instances.get(decision.target_id)
        moved = (req is not None and source is not None and target is not None and target is not source
                 and source.migrate_out(req, target))
        if moved:
            self.lifecycle.migrations += 1
        else:
            self.lifecycle.migrations_refused += 1
        return moved

    # -- what the monitor would see ------------------------------------------------------------------
    def instance_loads(self, profile_name: str) -> list[InstanceLoad]:
        out = []
        for inst in self.live:
            status = "ready" if inst.status == "ready" else inst.status
            info = InstanceInfo(instance_id=inst.instance_id, role=inst.role, status=status,  # type: ignore[arg-type]
                                engine_kind="sim", url=f"sim://{inst.instance_id}", bootstrap_host="",
                                bootstrap_port=None, model="sim", profile=profile_name,
                                kv_capacity_tokens=inst.kv_capacity, max_running_requests=inst.max_running,
                                sidecar="sim", registered_at_unix_s=self._started_at.get(inst.instance_id, 0.0))
            if inst.status == "starting":  # live, an engine reports no load before it is up
                out.append(InstanceLoad(info=info, load=None, load_age_s=None))
            else:
                out.append(InstanceLoad(info=info, load=inst.load_report(), load_age_s=0.0))
        return out

    def decode_requests(self, cadence: PredictionCadence | None) -> list[DecodeRequestInfo]:
        """Running decode requests with their predicted remaining tokens (none without a ``cadence``); a
        migrating one is listed once, on its target, marked ``migrating``."""
        out = []
        for inst in self.live:
            if inst.role != "decode":
                continue
            for req in inst.running:
                if req.migrate_to is None:
                    out.append(self._request_info(req, inst, cadence))
            for req in inst.incoming:
                out.append(self._request_info(req, inst, cadence))
        return out

    def _request_info(self, req: SimRequest, inst: SimInstance, cadence: PredictionCadence | None) -> DecodeRequestInfo:
        source = req.migrate_from
        return DecodeRequestInfo(
            rid=req.rid, instance_id=inst.instance_id, input_tokens=req.input_tokens,
            generated_tokens=req.generated, max_output_tokens=req.output_tokens, arrived_unix_s=req.arrival_s,
            slo_tpot_s=req.slo_tpot_s if req.slo_tpot_s != float("inf") else None,
            predicted_remaining_tokens=cadence.remaining(req) if cadence is not None else None,
            migrating=source is not None,
            migration_source_id=source.instance_id if source is not None else None)


def lifecycle_json(lifecycle: Lifecycle) -> dict[str, object]:
    return msgspec.to_builtins({
        "flips": lifecycle.flips, "flips_called_off": lifecycle.flips_called_off, "starts": lifecycle.starts, "stops": lifecycle.stops,
        "migrations": lifecycle.migrations, "migrations_refused": lifecycle.migrations_refused,
        "gpu_seconds": lifecycle.gpu_seconds, "timeline": [list(p) for p in lifecycle.timeline], "events": [list(e) for e in lifecycle.events],
    })
