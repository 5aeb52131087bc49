"""The migrator service: a leader-elected loop that asks a migration policy which decode requests to move.

Every ``tick_interval_s`` the leader fetches the monitor's :class:`ClusterSnapshot` and calls the configured
:class:`MigrationPolicy` (pure, ``shared.policies.migration``). Carrying a move out (recompute migration:
re-prefill on the target, abort the source, the gateway stitches the stream) is not built yet: decisions
are logged and counted, so a policy can already be watched in ``status``. The default ``none`` policy
never decides anything.

Admin (``Subjects.admin("migrator")``): ``status``.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from services.migrator.config import MigratorSettings
from shared.elected import ElectedService
from shared.policies.migration import MigrationDecision, MigrationPolicy, make_migration_policy
from shared.protocol import ServiceStatus
from shared.runtime import fetch_snapshot

log = logging.getLogger(__name__)


class MigratorService(ElectedService):
    """See the module docstring."""

    name = "migrator"
    settings: MigratorSettings

    def __init__(self, settings: MigratorSettings, *, policy: MigrationPolicy | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        super().__init__(settings)
        self.policy = policy or make_migration_policy(settings.policy)
        self._clock = clock
        self.decisions_total = 0
        self.recent: deque[dict[str, Any]] = deque(maxlen=20)

    def policy_name(self) -> str:
        return self.policy.name

    async def tick(self) -> float | None:
        snapshot = await fetch_snapshot(self.bus, self.subjects, self.settings.snapshot_timeout_s, series_points=0)
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
            details={**self.loop_details(), "decisions_total": self.decisions_total,
                     "recent_decisions": list(self.recent)},
        )
