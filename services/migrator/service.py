"""The migrator service: a leader-elected loop that moves running requests between decode instances.

Every ``tick_interval_s`` (or the policy's own interval) the leader fetches the monitor's
:class:`ClusterSnapshot`, adds the requests the gateways are streaming (``decode_requests``: only the
gateways know them one by one), asks the configured :class:`MigrationPolicy` (pure,
``shared.policies.migration``) and has the gateway owning each chosen request carry the move out
(``executor.py``; the gateway keeps the client's stream whole, see services/gateway/flow.py).

Admin (``Subjects.admin("migrator")``): ``status``, ``migrate rid=<id> to=<instance> [mechanism=...]``, and
``evacuate instance=<id>`` (move everything off a decode instance: what the planner asks before flipping it,
so the flip waits for one re-prefill rather than for the instance's longest answer).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec

from services.migrator.config import MigratorSettings
from services.migrator.executor import MoveExecutor, MoveOutcome
from shared.elected import ElectedService
from shared.policies.evacuation import EVACUATE_EVERY_S, Evacuation
from shared.policies.migration import MigrationDecision, MigrationPolicy, make_migration_policy
from shared.policies.migration_cost import make_migration_mechanism
from shared.protocol import AdminReply, ServiceStatus
from shared.runtime import AdminEndpoint, fetch_snapshot, require_arg

log = logging.getLogger(__name__)


class MigratorService(ElectedService):
    """See the module docstring."""

    name = "migrator"
    settings: MigratorSettings

    def __init__(self, settings: MigratorSettings, *, policy: MigrationPolicy | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        super().__init__(settings)
        if policy is None:
            model = settings.latency_model()
            policy = make_migration_policy(settings.policy, model, make_migration_mechanism(settings.mechanism, model))
        self.policy = policy
        self._clock = clock
        self._executor: MoveExecutor | None = None
        self._moves: set[asyncio.Task[Any]] = set()
        self.decisions_total = 0
        self.moved_total = 0
        self.recent: deque[dict[str, Any]] = deque(maxlen=20)

    def policy_name(self) -> str:
        return self.policy.name

    @property
    def executor(self) -> MoveExecutor:
        if self._executor is None:
            s = self.settings
            self._executor = MoveExecutor(self.bus, self.subjects, mechanism=s.mechanism,
                                          gather_timeout_s=s.gather_timeout_s, move_timeout_s=s.move_timeout_s)
        return self._executor

    def register_admin_verbs(self, admin: AdminEndpoint) -> None:
        admin.register("migrate", self._admin_migrate,
                       "migrate rid=<request id> to=<decode instance> [mechanism=recompute|kv-transfer]")
        admin.register("evacuate", self._admin_evacuate,
                       "evacuate instance=<decode instance> [deadline_s=<s>]: move all its running requests away")

    def register_control_verbs(self, control: AdminEndpoint) -> None:
        # The planner's drain by migration (services/planner/service.py) asks here, not on the admin subject.
        control.register("evacuate", self._admin_evacuate,
                         "evacuate instance=<decode instance> [deadline_s=<s>]: move all its running requests away")

    async def before_stop(self) -> None:
        for task in list(self._moves):
            task.cancel()
        if self._moves:
            await asyncio.wait(list(self._moves), timeout=5)

    async def tick(self) -> float | None:
        if self.policy.name == "none":
            return None
        snapshot = await fetch_snapshot(self.bus, self.subjects, self.settings.snapshot_timeout_s, series_points=0)
        if self.policy.needs_requests:
            snapshot = msgspec.structs.replace(snapshot, decode_requests=await self.executor.requests())
        for decision in self.policy.select(snapshot, self._clock()):
            self.decisions_total += 1
            task = asyncio.create_task(self._carry_out(decision), name=f"move:{decision.rid}")
            self._moves.add(task)
            task.add_done_callback(self._moves.discard)
        return self.policy.interval_s

    async def _carry_out(self, decision: MigrationDecision, mechanism: str | None = None) -> MoveOutcome:
        outcome = await self.executor.move(decision, mechanism)
        reply = outcome.reply
        if reply.ok:
            self.moved_total += 1
            log.info("moved %s %s -> %s by %s (%s; client gap %.3fs)", decision.rid, reply.source_id,
                     reply.target_id, reply.mechanism, decision.reason, reply.stall_s or 0.0)
        else:
            log.warning("move of %s to %s failed: %s", decision.rid, decision.target_id, reply.message)
        self.recent.append({"rid": decision.rid, "source": decision.source_id, "target": decision.target_id,
                            "reason": decision.reason, "carried_out": reply.ok, "mechanism": reply.mechanism,
                            "message": reply.message, "stall_s": reply.stall_s, "took_s": round(outcome.took_s, 3),
                            "at_unix_s": time.time()})
        return outcome

    async def _admin_migrate(self, args: dict[str, str]) -> AdminReply:
        rid, target = require_arg(args, "rid"), require_arg(args, "to")
        mechanism = args.get("mechanism") or self.settings.mechanism
        if mechanism not in ("recompute", "kv-transfer"):
            raise ValueError(f"unknown mechanism {mechanism!r}")
        source = next((r.instance_id for r in await self.executor.requests() if r.rid == rid), "")
        decision = MigrationDecision(rid=rid, source_id=source, target_id=target, reason="admin migrate")
        outcome = await self._carry_out(decision, mechanism)
        r = outcome.reply
        message = (f"moved {rid} {r.source_id} -> {r.target_id} by {r.mechanism} (client gap {r.stall_s or 0:.3f}s)"
                   if r.ok else f"not moved: {r.message}")
        return AdminReply(ok=r.ok, message=message, status=self.service_status())

    async def evacuate(self, instance_id: str, deadline_s: float) -> tuple[int, int]:
        """Move every request off ``instance_id`` until none is left there or ``deadline_s`` passed; returns
        (moved, failed). Rounds repeat: a request the gateway dispatched just before the instance was marked
        draining shows up in the next round."""
        evacuation = Evacuation(instance_id, time.monotonic() + deadline_s)
        moved = failed = 0
        while time.monotonic() < evacuation.deadline_s:
            snapshot = await fetch_snapshot(self.bus, self.subjects, self.settings.snapshot_timeout_s, series_points=0)
            snapshot = msgspec.structs.replace(snapshot, decode_requests=await self.executor.requests())
            moves = evacuation.round(snapshot, time.monotonic())
            if moves is None:
                break
            outcomes = await asyncio.gather(*(self._carry_out(m) for m in moves))
            for outcome in outcomes:
                if outcome.reply.ok:
                    moved += 1
                else:
                    failed += 1
                    evacuation.failed(outcome.decision.rid)
            await asyncio.sleep(EVACUATE_EVERY_S)
        return moved, failed

    async def _admin_evacuate(self, args: dict[str, str]) -> AdminReply:
        instance_id = require_arg(args, "instance")
        deadline_s = float(args.get("deadline_s") or 60.0)
        moved, failed = await self.evacuate(instance_id, deadline_s)
        return AdminReply(ok=failed == 0, message=f"evacuated {instance_id}: {moved} moved, {failed} failed",
                          status=self.service_status())

    def service_status(self) -> ServiceStatus:
        return ServiceStatus(
            service=self.name, replica_id=self.replica_id, is_leader=self.is_leader, policy=self.policy.name,
            policy_note=self.policy.note, uptime_s=self._uptime(),
            details={**self.loop_details(), "mechanism": self.settings.mechanism,
                     "decisions_total": self.decisions_total, "moved_total": self.moved_total,
                     "moves_in_flight": len(self._moves), "recent_decisions": list(self.recent)},
        )
