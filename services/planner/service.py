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
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any

from services.planner.config import PlannerSettings
from shared.elected import ElectedService
from shared.errors import BusTimeout, PoiseError
from shared.policies import PoolDecision, PoolPolicy, RoleChange, make_pool_policy
from shared.protocol import AdminReply, RoleCommand, RoleCommandReply, ServiceStatus
from shared.protocol.messages import Role
from shared.runtime import AdminEndpoint, cancel_and_wait, fetch_snapshot, require_arg

log = logging.getLogger(__name__)

_SWITCHABLE: tuple[Role, ...] = ("prefill", "decode")


class PlannerService(ElectedService):
    """See the module docstring."""

    name = "planner"
    settings: PlannerSettings

    def __init__(self, settings: PlannerSettings, *, policy: PoolPolicy | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        super().__init__(settings)
        self.policy = policy or make_pool_policy(settings.policy, settings.latency_model(), settings.policy_context())
        self._clock = clock  # the snapshot's clock (unix seconds): what policies get as now_s
        self._inflight: dict[str, asyncio.Task[RoleCommandReply]] = {}  # instance -> running role command
        self.recent: deque[dict[str, Any]] = deque(maxlen=20)  # latest role-command outcomes, for status
        self.last_decision: PoolDecision | None = None
        self.last_snapshot_instances: int | None = None

    def policy_name(self) -> str:
        return self.policy.name

    def register_admin_verbs(self, admin: AdminEndpoint) -> None:
        admin.register("set-role", self._admin_set_role,
                       "set-role instance=<id> role=prefill|decode [reason=<text>] [drain_timeout_s=<s>]")

    async def before_stop(self) -> None:
        await cancel_and_wait(self._inflight.values())

    # -- the loop ----------------------------------------------------------------------------------
    async def tick(self) -> float | None:
        snapshot = await fetch_snapshot(self.bus, self.subjects, self.settings.snapshot_timeout_s)
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
        drain = drain_timeout_s if drain_timeout_s is not None else self.settings.drain_timeout_s
        command = RoleCommand(command_id=uuid.uuid4().hex, new_role=new_role, reason=reason, drain_timeout_s=drain)
        log.info("role command %s: %s -> %s (%s)", command.command_id[:8], instance_id, new_role, reason or "no reason")
        try:
            reply = await self.bus.request(self.subjects.worker_command(instance_id), command, RoleCommandReply,
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
                **self.loop_details(),
                "last_snapshot_instances": self.last_snapshot_instances,
                "last_decision_changes": len(decision.changes) if decision else 0,
                "commands_in_flight": sorted(i for i, t in self._inflight.items() if not t.done()),
                "recent_commands": list(self.recent),
            },
        )
