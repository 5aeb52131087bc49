"""The planner service: a leader-elected loop that turns pool decisions into role switches.

Every ``tick_interval_s`` the leader asks the monitor for a :class:`ClusterSnapshot` (NATS request on
``Subjects.monitor_snapshot()``), calls the configured :class:`PoolPolicy` (pure, ``shared.policies.pools``)
and sends a :class:`RoleCommand` to ``Subjects.worker_command(id)`` for each :class:`RoleChange`; the
sidecar drains, flips and re-registers. Commands run in the background (a drain takes up to a minute), at
most one per instance at a time. Followers only keep trying to become leader.

Admin (``Subjects.admin("planner")``): ``status`` and ``set-role instance=<id> role=<prefill|decode>``
(what ``poise admin set-role`` uses; any replica may carry it out).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any

from services.planner.config import PlannerSettings
from shared.bus import Bus, bus_from_settings
from shared.errors import BusTimeout, PoiseError
from shared.policies.pools import PoolDecision, PoolPolicy, RoleChange, make_pool_policy
from shared.protocol import (
    AdminReply,
    Keys,
    RoleCommand,
    RoleCommandReply,
    ServiceStatus,
    Subjects,
)
from shared.protocol.messages import Role
from shared.registry import LeaderElection, Registry
from shared.runtime import AdminEndpoint, LeaderTicker, StopOnce, Uptime, fetch_snapshot, replica_id, require_arg

log = logging.getLogger(__name__)

_SWITCHABLE: tuple[Role, ...] = ("prefill", "decode")


class PlannerService:
    """See the module docstring."""

    name = "planner"

    def __init__(self, settings: PlannerSettings, *, policy: PoolPolicy | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.settings = settings
        self.policy = policy or make_pool_policy(settings.policy)
        self.subjects = Subjects(settings.namespace)
        self.keys = Keys(settings.namespace)
        self.replica_id = settings.replica_id or replica_id()
        self._clock = clock  # the snapshot's clock (unix seconds): what policies get as now_s
        self._uptime = Uptime()
        self._bus: Bus | None = None
        self._registry: Registry | None = None
        self._election: LeaderElection | None = None
        self._ticker = LeaderTicker(self._tick, lambda: self.is_leader, settings.tick_interval_s, name="planner-tick")
        self._admin: AdminEndpoint | None = None
        self._inflight: dict[str, asyncio.Task[RoleCommandReply]] = {}  # instance -> running role command
        self.recent: deque[dict[str, Any]] = deque(maxlen=20)  # latest role-command outcomes, for status
        self.last_decision: PoolDecision | None = None
        self.last_snapshot_instances: int | None = None
        self._stop = StopOnce()

    async def __aenter__(self) -> PlannerService:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def is_leader(self) -> bool:
        return self._election is not None and self._election.is_leader

    async def start(self) -> None:
        s = self.settings
        self._bus = bus_from_settings(s, name=f"poise-planner-{self.replica_id}")
        await self._bus.connect()
        self._registry = Registry(s.etcd_url, self.keys)
        await self._registry.connect()
        self._admin = AdminEndpoint(self._bus, self.subjects, self.name, self.service_status)
        self._admin.register("set-role", self._admin_set_role,
                             "set-role instance=<id> role=prefill|decode [reason=<text>] [drain_timeout_s=<s>]")
        await self._admin.start()
        self._election = LeaderElection(self._registry, self.name, self.replica_id, ttl_s=s.leader_ttl_s,
                                        on_change=self._on_leadership)
        await self._election.start()
        self._ticker.start()
        log.info("planner %s up with policy %s", self.replica_id, self.policy.name)

    async def stop(self) -> None:
        await self._stop.run(self._stop_once)

    async def _stop_once(self) -> None:
        await self._ticker.stop()
        for task in list(self._inflight.values()):
            task.cancel()
        for task in list(self._inflight.values()):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._admin is not None:
            await self._admin.stop()
        if self._election is not None:
            await self._election.stop()  # revokes the lease: a follower takes over at once
        if self._bus is not None:
            await self._bus.close()
        if self._registry is not None:
            await self._registry.close()

    def _on_leadership(self, leader: bool) -> None:
        log.info("planner %s is %s", self.replica_id, "the leader" if leader else "a follower")

    # -- the loop ----------------------------------------------------------------------------------
    async def _tick(self) -> float | None:
        assert self._bus is not None
        snapshot = await fetch_snapshot(self._bus, self.subjects, self.settings.snapshot_timeout_s)
        self.last_snapshot_instances = len(snapshot.instances)
        now_s = self._clock()
        decision = self.policy.decide(snapshot, now_s)
        self.last_decision = decision
        if decision is None:
            return None
        for change in decision.changes:
            self.apply(change)
        return decision.next_decision_at_s - now_s if decision.next_decision_at_s is not None else None

    def apply(self, change: RoleChange, *, drain_timeout_s: float | None = None) -> asyncio.Task[RoleCommandReply] | None:
        """Start carrying out one role change in the background; ``None`` when one is already running there."""
        running = self._inflight.get(change.instance_id)
        if running is not None and not running.done():
            log.info("skipping %s -> %s: a role command is still running there", change.instance_id, change.new_role)
            return None
        task = asyncio.create_task(
            self.send_role_command(change.instance_id, change.new_role, reason=change.reason, drain_timeout_s=drain_timeout_s),
            name=f"role-{change.instance_id}",
        )
        self._inflight[change.instance_id] = task

        def forget(done: asyncio.Task[RoleCommandReply], instance_id: str = change.instance_id) -> None:
            if self._inflight.get(instance_id) is done:
                del self._inflight[instance_id]

        task.add_done_callback(forget)
        return task

    async def send_role_command(self, instance_id: str, new_role: Role, *, reason: str = "",
                                drain_timeout_s: float | None = None) -> RoleCommandReply:
        """Send one :class:`RoleCommand` and wait for the sidecar's answer (a failed send becomes ok=false)."""
        assert self._bus is not None
        drain = drain_timeout_s if drain_timeout_s is not None else self.settings.drain_timeout_s
        command = RoleCommand(command_id=uuid.uuid4().hex, new_role=new_role, reason=reason, drain_timeout_s=drain)
        log.info("role command %s: %s -> %s (%s)", command.command_id[:8], instance_id, new_role, reason or "no reason")
        try:
            reply = await self._bus.request(self.subjects.worker_command(instance_id), command, RoleCommandReply,
                                            timeout_s=max(self.settings.command_timeout_s, drain + 30.0))
        except (BusTimeout, PoiseError, ValueError) as exc:  # ValueError: not a valid instance id
            reply = RoleCommandReply(command_id=command.command_id, instance_id=instance_id, ok=False,
                                     message=f"no answer from the sidecar of {instance_id}: {exc}",
                                     old_role=new_role, new_role=new_role)
        (log.info if reply.ok else log.warning)("role command %s on %s: %s", command.command_id[:8], instance_id,
                                                reply.message)
        self.recent.append({"instance": instance_id, "new_role": new_role, "ok": reply.ok, "message": reply.message,
                            "reason": reason, "at_unix_s": time.time()})
        return reply

    # -- admin -------------------------------------------------------------------------------------
    async def _admin_set_role(self, args: dict[str, str]) -> AdminReply:
        instance = require_arg(args, "instance")
        role = require_arg(args, "role")
        if role not in _SWITCHABLE:
            raise ValueError(f"role must be one of {', '.join(_SWITCHABLE)}")
        drain = float(args["drain_timeout_s"]) if args.get("drain_timeout_s") else None
        change = RoleChange(instance_id=instance, new_role=role, reason=args.get("reason") or "admin set-role")
        task = self.apply(change, drain_timeout_s=drain)
        if task is None:
            return AdminReply(ok=False, message=f"a role command for {instance} is already running", status=self.service_status())
        reply = await asyncio.shield(task)  # an admin client that gives up does not cancel the switch
        return AdminReply(ok=reply.ok, message=f"{instance}: {reply.message}", status=self.service_status())

    def service_status(self) -> ServiceStatus:
        decision = self.last_decision
        return ServiceStatus(
            service=self.name, replica_id=self.replica_id, is_leader=self.is_leader, policy=self.policy.name,
            policy_note=self.policy.note, uptime_s=self._uptime(),
            details={
                "tick_interval_s": self.settings.tick_interval_s, "ticks": self._ticker.ticks,
                "tick_errors": self._ticker.errors, "last_error": self._ticker.last_error,
                "last_tick_unix_s": self._ticker.last_tick_unix_s,
                "last_snapshot_instances": self.last_snapshot_instances,
                "last_decision_changes": len(decision.changes) if decision else 0,
                "commands_in_flight": sorted(i for i, t in self._inflight.items() if not t.done()),
                "recent_commands": list(self.recent),
            },
        )
