"""The migrator service: a leader-elected loop that asks a migration policy which decode requests to move.

Every ``tick_interval_s`` the leader fetches the monitor's :class:`ClusterSnapshot` and calls the configured
:class:`MigrationPolicy` (pure, ``shared.policies.migration``). Carrying a move out (recompute migration:
re-prefill on the target, abort the source, the gateway stitches the stream) is not built yet: decisions
are logged and counted, so a policy can already be watched in ``status``. The default ``none`` policy
never decides anything.

Admin (``Subjects.admin("migrator")``): ``status``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from services.migrator.config import MigratorSettings
from shared.bus import Bus, bus_from_settings
from shared.policies.migration import MigrationDecision, MigrationPolicy, make_migration_policy
from shared.protocol import Keys, ServiceStatus, Subjects
from shared.registry import LeaderElection, Registry
from shared.runtime import AdminEndpoint, LeaderTicker, StopOnce, Uptime, fetch_snapshot, replica_id

log = logging.getLogger(__name__)


class MigratorService:
    """See the module docstring."""

    name = "migrator"

    def __init__(self, settings: MigratorSettings, *, policy: MigrationPolicy | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.settings = settings
        self.policy = policy or make_migration_policy(settings.policy)
        self.subjects = Subjects(settings.namespace)
        self.keys = Keys(settings.namespace)
        self.replica_id = settings.replica_id or replica_id()
        self._clock = clock
        self._uptime = Uptime()
        self._bus: Bus | None = None
        self._registry: Registry | None = None
        self._election: LeaderElection | None = None
        self._ticker = LeaderTicker(self._tick, lambda: self.is_leader, settings.tick_interval_s, name="migrator-tick")
        self._admin: AdminEndpoint | None = None
        self.decisions_total = 0
        self.recent: deque[dict[str, Any]] = deque(maxlen=20)
        self._stop = StopOnce()

    async def __aenter__(self) -> MigratorService:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def is_leader(self) -> bool:
        return self._election is not None and self._election.is_leader

    async def start(self) -> None:
        s = self.settings
        self._bus = bus_from_settings(s, name=f"poise-migrator-{self.replica_id}")
        await self._bus.connect()
        self._registry = Registry(s.etcd_url, self.keys)
        await self._registry.connect()
        self._admin = AdminEndpoint(self._bus, self.subjects, self.name, self.service_status)
        await self._admin.start()
        self._election = LeaderElection(self._registry, self.name, self.replica_id, ttl_s=s.leader_ttl_s,
                                        on_change=lambda leader: log.info("migrator %s is %s", self.replica_id,
                                                                          "the leader" if leader else "a follower"))
        await self._election.start()
        self._ticker.start()
        log.info("migrator %s up with policy %s", self.replica_id, self.policy.name)

    async def stop(self) -> None:
        await self._stop.run(self._stop_once)

    async def _stop_once(self) -> None:
        await self._ticker.stop()
        if self._admin is not None:
            await self._admin.stop()
        if self._election is not None:
            await self._election.stop()
        if self._bus is not None:
            await self._bus.close()
        if self._registry is not None:
            with contextlib.suppress(Exception):
                await self._registry.close()

    async def _tick(self) -> float | None:
        assert self._bus is not None
        snapshot = await fetch_snapshot(self._bus, self.subjects, self.settings.snapshot_timeout_s, series_points=0)
        decisions = self.policy.select(snapshot, self._clock())
        for decision in decisions:
            self._record(decision)
        return None

    def _record(self, decision: MigrationDecision) -> None:
        self.decisions_total += 1
        log.warning("migration %s: %s -> %s (%s) not carried out: migration execution is not built yet",
                    decision.rid, decision.source_id, decision.target_id, decision.reason)
        self.recent.append({"rid": decision.rid, "source": decision.source_id, "target": decision.target_id,
                            "reason": decision.reason, "carried_out": False, "at_unix_s": time.time()})

    def service_status(self) -> ServiceStatus:
        return ServiceStatus(
            service=self.name, replica_id=self.replica_id, is_leader=self.is_leader, policy=self.policy.name,
            policy_note=self.policy.note, uptime_s=self._uptime(),
            details={
                "tick_interval_s": self.settings.tick_interval_s, "ticks": self._ticker.ticks,
                "tick_errors": self._ticker.errors, "last_error": self._ticker.last_error,
                "last_tick_unix_s": self._ticker.last_tick_unix_s, "decisions_total": self.decisions_total,
                "recent_decisions": list(self.recent),
            },
        )
