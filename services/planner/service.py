"""The planner service: a leader-elected loop that turns pool decisions into role switches.

Every ``tick_interval_s`` the leader asks the monitor for a :class:`ClusterSnapshot` (NATS request on
``Subjects.monitor_snapshot()``), calls the configured :class:`PoolPolicy` (pure, ``shared.policies``) on
the decider thread (:mod:`services.planner.decider`: DOPD's ARIMA fits must not block the event loop) and
sends a :class:`RoleCommand` to ``Subjects.worker_command(id)`` for each :class:`RoleChange`; the sidecar
drains, flips and re-registers. Commands run in the background (a drain takes up to a minute), at most one
per instance at a time. Followers only keep trying to become leader.

Every flip, policy-driven or admin, is published as :class:`PlannerEvent`\\ s on
``Subjects.planner_events()``: ``flip_requested`` when the command is sent, ``flip_done`` / ``flip_failed``
with its duration when the sidecar answers; also ``paused``, ``resumed`` and ``resize_requested`` (the
policy's target P:D split moved).

**Pause.** A paused planner neither fetches snapshots nor calls the policy, so it makes no flips of its own;
flips already running finish, and admin flips still work (pause, then flip by hand). The pause lives in
etcd (``Keys.planner_paused()``, no lease), not in one process: the admin command reaches whichever replica
the queue group picks, the leader reads the key on every tick, and a new leader after a failover stays
paused. A forecasting policy sees no data while paused; on resume it continues from the newest interval.

Admin (``Subjects.admin("planner")``): ``status``; ``set-role`` / ``flip instance=<id> role=<prefill|decode>``
(any replica may carry a flip out); ``pause [reason=<text>]``, ``resume``; ``pools`` (instances and the
policy's targets). A manual flip is not told to the policy: with an adaptive policy running, pause first or
the policy may flip the instance back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any, Literal

import msgspec

from services.planner.config import PlannerSettings
from services.planner.decider import Decider
from services.planner.resizer import Resizer, build_connector
from services.planner.views import policy_view, pool_rows
from shared.elected import ElectedService
from shared.errors import BusTimeout, PoiseError
from shared.policies import PoolDecision, PoolPolicy, RoleChange, make_pool_policy, make_scaling_policy
from shared.policies.evacuation import EVACUATE_AFTER_S
from shared.policies.flip import drained_by_migration
from shared.policies.report import PolicyReport
from shared.protocol import (
    AdminCommand,
    AdminReply,
    ClusterSnapshot,
    PlannerEvent,
    PlannerPause,
    RoleCommand,
    RoleCommandReply,
    ServiceStatus,
)
from shared.protocol.messages import PlannerEventKind, Role
from shared.registry import ETCD_ERRORS
from shared.runtime import AdminEndpoint, AdminHandler, cancel_and_wait, fetch_snapshot, require_arg

log = logging.getLogger(__name__)

_SWITCHABLE: tuple[Role, ...] = ("prefill", "decode")
_ADMIN_ROLES: tuple[Role, ...] = ("prefill", "decode", "null")  # null: colocated serving, a restart of the engine
Source = Literal["policy", "admin"]


class PlannerService(ElectedService):
    """See the module docstring."""

    name = "planner"
    settings: PlannerSettings

    def __init__(self, settings: PlannerSettings, *, policy: PoolPolicy | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        super().__init__(settings)
        self.policy = policy or make_pool_policy(settings.policy, settings.latency_model(), settings.pool_policy_context())
        self.decider = Decider(self.policy)
        self._clock = clock  # the snapshot's clock (unix seconds): what policies get as now_s
        self._inflight: dict[str, asyncio.Task[RoleCommandReply]] = {}  # instance -> running role command
        self.recent: deque[dict[str, Any]] = deque(maxlen=20)  # latest role-command outcomes, for status
        self.last_decision: PoolDecision | None = None
        self.last_snapshot_instances: int | None = None
        self.pause: PlannerPause | None = None  # this replica's latest reading of the etcd pause record
        self.report: PolicyReport = self.policy.report()  # the policy's newest, taken after each decision
        self.policy_state: dict[str, Any] = policy_view(self.policy, self.report)
        self._last_target: int | None = None
        self._last_split: object = None  # the DOPD evaluation last published as a forecast event
        self.resizer: Resizer | None = None  # built on the first tick (the connector needs the bus)
        self._known_ids: set[str] = set()

    @property
    def paused(self) -> bool:
        return self.pause is not None

    def policy_name(self) -> str:
        return self.policy.name

    def register_admin_verbs(self, admin: AdminEndpoint) -> None:
        flip_args = "instance=<id> role=prefill|decode [reason=<text>] [drain_timeout_s=<s>]"
        admin.register("set-role", self._flip_verb("admin set-role"), f"set-role {flip_args}")
        admin.register("flip", self._flip_verb("admin flip"), f"flip {flip_args} (same as set-role)")
        admin.register("pause", self._admin_pause, "pause [reason=<text>]: no policy flips until resume")
        admin.register("resume", self._admin_resume, "resume: the policy decides again")
        admin.register("pools", self._admin_pools, "pools: instances with their roles, and the policy's targets")

    async def before_stop(self) -> None:
        await cancel_and_wait(self._inflight.values())
        self.decider.close()
        if self.resizer is not None:
            await self.resizer.close()

    def _resizer(self) -> Resizer | None:
        s = self.settings
        if s.scaling_policy == "none":
            return None
        if self.resizer is None:
            policy = make_scaling_policy(s.scaling_policy, s.latency_model(), s.policy_context(s.max_instances))
            connector = build_connector(s, self.bus, lambda: set(self._known_ids))
            self.resizer = Resizer(policy, connector, drain_timeout_s=s.drain_timeout_s, publish=self.publish_event)
        return self.resizer

    # -- the loop ----------------------------------------------------------------------------------
    async def tick(self) -> float | None:
        # Read every tick: a pause taken by another replica (the admin queue group picks one) counts here too.
        self.pause = await self.registry.planner_pause()
        if self.paused:
            return None
        snapshot = await fetch_snapshot(self.bus, self.subjects, self.settings.snapshot_timeout_s)
        self.last_snapshot_instances = len(snapshot.instances)
        self._known_ids |= {i.info.instance_id for i in snapshot.instances}
        now_s = self._clock()
        resizer = self._resizer()
        if resizer is not None:  # replica counts first: a flip decided on a cluster about to resize is moot
            await resizer.step(snapshot, now_s)
        decision = await self.decider.decide(snapshot, now_s)
        self.last_decision = decision
        self.report = self.policy.report()  # safe: no decision is running now (only tick calls it)
        self.policy_state = policy_view(self.policy, self.report)
        await self._note_target(snapshot)
        # A policy that reacts on the second scale (Arrow: 0.5 s) is asked that often, not every tick_interval_s.
        policy_interval = self.policy.interval_s
        if decision is None:
            return policy_interval
        if self.paused:  # paused while the policy was deciding: the decision is dropped
            log.info("planner paused during a decision; dropping %d change(s)", len(decision.changes))
            return None
        roles = {i.info.instance_id: i.info.role for i in snapshot.instances}
        for change in decision.changes:
            self.apply(change, source="policy", from_role=roles.get(change.instance_id))
        return decision.next_decision_at_s - now_s if decision.next_decision_at_s is not None else policy_interval

    async def _note_target(self, snapshot: ClusterSnapshot) -> None:
        """Publish ``forecast`` when DOPD evaluated a new forecast, ``resize_requested`` when the policy's
        target prefill count moved."""
        # The pool policy's forecast, else an elastic DOPD scaler's: either is what engines batch by.
        split = self.report.forecast or (self.resizer.policy.report().forecast if self.resizer is not None else None)
        if split is not None and split is not self._last_split:
            self._last_split = split
            await self.publish_event("forecast", source="policy", forecast_rate_rps=split.rate_rps,
                                     forecast_isl=split.isl, forecast_osl=split.osl,
                                     forecast_concurrency=split.concurrency, forecast_ratio=split.ratio)
        target = self.report.target_prefill
        if target is None or target == self._last_target:
            return
        self._last_target = target
        total = sum(1 for i in snapshot.instances if i.info.role in _SWITCHABLE)
        await self.publish_event("resize_requested", source="policy", reason=self.report.reason,
                                 target_prefill=target, target_decode=max(total - target, 0))

    def apply(self, change: RoleChange, *, source: Source = "policy", from_role: Role | None = None,
              drain_timeout_s: float | None = None) -> asyncio.Task[RoleCommandReply] | None:
        """Start carrying out one role change in the background; ``None`` when one is already running there."""
        running = self._inflight.get(change.instance_id)
        if running is not None and not running.done():
            log.info("skipping %s -> %s: a role command is still running there", change.instance_id, change.new_role)
            return None
        task = asyncio.create_task(
            self.send_role_command(change.instance_id, change.new_role, reason=change.reason, source=source,
                                   from_role=from_role, drain_timeout_s=drain_timeout_s),
            name=f"role-{change.instance_id}",
        )
        self._inflight[change.instance_id] = task

        def forget(done: asyncio.Task[RoleCommandReply], instance_id: str = change.instance_id) -> None:
            if self._inflight.get(instance_id) is done:
                del self._inflight[instance_id]

        task.add_done_callback(forget)
        return task

    async def send_role_command(self, instance_id: str, new_role: Role, *, reason: str = "",
                                source: Source = "policy", from_role: Role | None = None,
                                drain_timeout_s: float | None = None) -> RoleCommandReply:
        """Send one :class:`RoleCommand` and wait for the sidecar's answer (a failed send becomes ok=false);
        publishes ``flip_requested`` before and ``flip_done`` / ``flip_failed`` after."""
        drain = drain_timeout_s if drain_timeout_s is not None else self.settings.drain_timeout_s
        command = RoleCommand(command_id=uuid.uuid4().hex, new_role=new_role, reason=reason, drain_timeout_s=drain)
        flip = {"instance_id": instance_id, "to_role": new_role, "source": source, "reason": reason,
                "command_id": command.command_id}
        log.info("role command %s: %s -> %s (%s)", command.command_id[:8], instance_id, new_role, reason or "no reason")
        await self.publish_event("flip_requested", from_role=from_role, **flip)
        t0 = time.monotonic()
        evacuation = None
        if drained_by_migration(self.settings.drain_by_migration, from_role, new_role):
            evacuation = asyncio.create_task(self._evacuate(instance_id, drain), name=f"evacuate-{instance_id}")
        try:
            reply = await self.bus.request(self.subjects.worker_command(instance_id), command, RoleCommandReply,
                                            timeout_s=max(self.settings.command_timeout_s, drain + 30.0))
            from_role = reply.old_role  # the sidecar knows its role for sure
        except (BusTimeout, PoiseError, ValueError) as exc:  # ValueError: not a valid instance id
            reply = RoleCommandReply(command_id=command.command_id, instance_id=instance_id, ok=False,
                                     message=f"no answer from the sidecar of {instance_id}: {exc}",
                                     old_role=from_role or new_role, new_role=from_role or new_role)
        took = time.monotonic() - t0
        if evacuation is not None:
            await cancel_and_wait([evacuation])
        (log.info if reply.ok else log.warning)("role command %s on %s: %s", command.command_id[:8], instance_id,
                                                reply.message)
        self.recent.append({"instance": instance_id, "new_role": new_role, "ok": reply.ok, "message": reply.message,
                            "reason": reason, "source": source, "duration_s": took, "at_unix_s": time.time()})
        await self.publish_event("flip_done" if reply.ok else "flip_failed", from_role=from_role,
                                 duration_s=took, message=reply.message, **flip)
        return reply

    async def _evacuate(self, instance_id: str, deadline_s: float) -> None:
        """Have the migrator move the running requests off a decode instance that is draining for a flip."""
        await asyncio.sleep(EVACUATE_AFTER_S)
        try:
            reply = await self.bus.request(self.subjects.control("migrator"), AdminCommand(
                verb="evacuate", args={"instance": instance_id, "deadline_s": f"{deadline_s:g}"}),
                AdminReply, timeout_s=deadline_s + 10.0)
        except (BusTimeout, PoiseError) as exc:
            log.info("no migrator moved the requests off %s (%s): the drain waits for them to finish", instance_id, exc)
            return
        log.info("drain of %s by migration: %s", instance_id, reply.message)

    async def publish_event(self, kind: PlannerEventKind, **fields: Any) -> None:
        """Publish one :class:`PlannerEvent`; a failed publish is logged, never raised (the flip goes on)."""
        event = PlannerEvent(kind=kind, ts_unix_s=time.time(), replica_id=self.replica_id, **fields)
        try:
            await self.bus.publish(self.subjects.planner_events(), event)
        except Exception as exc:  # nats-py raises its own errors while reconnecting
            log.warning("planner event %s not published: %s", kind, exc)

    # -- admin -------------------------------------------------------------------------------------
    def _flip_verb(self, default_reason: str) -> AdminHandler:
        async def handler(args: dict[str, str]) -> AdminReply:
            return await self._admin_flip(args, default_reason)

        return handler

    async def _admin_flip(self, args: dict[str, str], default_reason: str) -> AdminReply:
        instance = require_arg(args, "instance")
        role = require_arg(args, "role")
        if role not in _ADMIN_ROLES:
            raise ValueError(f"role must be one of {', '.join(_ADMIN_ROLES)}")
        drain = float(args["drain_timeout_s"]) if args.get("drain_timeout_s") else None
        from_role: Role | None = None
        with contextlib.suppress(*ETCD_ERRORS):  # etcd down: send anyway, the sidecar knows its role
            registered, _ = await self.registry.list_instances()
            if instance not in registered:  # a typo, or an instance gone: say so rather than wait on its subject
                known = ", ".join(sorted(registered)) or "none"
                return AdminReply(ok=False, message=f"no instance {instance!r} is registered (registered: {known}); "
                                                    "nothing was sent", status=self.service_status())
            from_role = registered[instance].role
        change = RoleChange(instance_id=instance, new_role=role, reason=args.get("reason") or default_reason)
        task = self.apply(change, source="admin", from_role=from_role, drain_timeout_s=drain)
        if task is None:
            return AdminReply(ok=False, message=f"a role command for {instance} is already running", status=self.service_status())
        reply = await asyncio.shield(task)  # an admin client that gives up does not cancel the switch
        return AdminReply(ok=reply.ok, message=f"{instance}: {reply.message}", status=self.service_status())

    async def _admin_pause(self, args: dict[str, str]) -> AdminReply:
        current = await self.registry.planner_pause()
        if current is not None:
            self.pause = current
            return AdminReply(ok=True, message=f"planner already paused ({current.reason or 'no reason'})",
                              status=self.service_status())
        pause = PlannerPause(reason=args.get("reason", "").strip() or "admin pause", replica_id=self.replica_id,
                             at_unix_s=time.time())
        await self.registry.set_planner_pause(pause)
        self.pause = pause
        await self.publish_event("paused", source="admin", reason=pause.reason)
        return AdminReply(ok=True, message="planner paused: no policy flips until resume (running flips finish; "
                                           "admin flips still work)", status=self.service_status())

    async def _admin_resume(self, args: dict[str, str]) -> AdminReply:
        if await self.registry.planner_pause() is None:
            self.pause = None
            return AdminReply(ok=True, message="planner was not paused", status=self.service_status())
        await self.registry.set_planner_pause(None)
        self.pause = None
        await self.publish_event("resumed", source="admin", reason=args.get("reason", "").strip())
        return AdminReply(ok=True, message=f"planner resumed: policy {self.policy.name} decides again",
                          status=self.service_status())

    async def refresh_status(self) -> None:
        self.pause = await self.registry.planner_pause()

    async def _admin_pools(self, args: dict[str, str]) -> AdminReply:
        await self.refresh_status()
        instances, _ = await self.registry.list_instances()
        rows = pool_rows(instances, {i for i, t in self._inflight.items() if not t.done()})
        count = {r: sum(1 for row in rows if row["role"] == r) for r in ("prefill", "decode", "null")}
        status = self.service_status()
        status = msgspec.structs.replace(status, details={**status.details, "pools": rows})
        summary = f"{count['prefill']} prefill, {count['decode']} decode" + \
            (f", {count['null']} colocated" if count["null"] else "") + \
            f"; policy {self.policy.name}{' (paused)' if self.paused else ''}"
        return AdminReply(ok=True, message=summary, status=status)

    def service_status(self) -> ServiceStatus:
        decision = self.last_decision
        pause = self.pause
        return ServiceStatus(
            service=self.name, replica_id=self.replica_id, is_leader=self.is_leader, policy=self.policy.name,
            policy_note=self.policy.note, uptime_s=self._uptime(),
            details={
                **self.loop_details(),
                "paused": pause is not None,
                "pause": msgspec.to_builtins(pause) if pause is not None else None,
                "decision_latency": self.decider.stats(),
                "policy_state": self.policy_state,
                "last_snapshot_instances": self.last_snapshot_instances,
                "last_decision_changes": len(decision.changes) if decision else 0,
                "commands_in_flight": sorted(i for i, t in self._inflight.items() if not t.done()),
                "recent_commands": list(self.recent),
                "scaling": self.resizer.status() if self.resizer is not None else None,
            },
        )
