"""The skeleton every leader-elected control loop shares (planner, migrator, and later ones).

:class:`ElectedService` owns the plumbing: one NATS connection, one etcd client, the admin endpoint, leader
election and a :class:`~shared.runtime.LeaderTicker` that calls :meth:`ElectedService.tick` only while this
replica leads. A subclass supplies the loop's body (``tick``), its status and any admin verbs; its policy
stays a pure object in ``shared.policies``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable
from typing import Any

from pydantic import Field

from shared.bus import Bus, bus_from_settings
from shared.protocol import Keys, ServiceStatus, Subjects
from shared.registry import LeaderElection, Registry, registry_from_settings
from shared.runtime import AdminEndpoint, AsyncServiceMixin, LeaderTicker, StopOnce, Uptime, replica_id
from shared.settings import ControlPlaneSettings

log = logging.getLogger(__name__)

#: Each step of a shutdown gets this long: a NATS drain or an etcd call that never answers must not keep the
#: process (or a test) from ending. The step's own timeouts are shorter; this is the backstop.
STOP_STEP_TIMEOUT_S = 15.0


async def _bounded(step: Awaitable[None], what: str) -> None:
    try:
        await asyncio.wait_for(step, STOP_STEP_TIMEOUT_S)
    except TimeoutError:
        log.warning("shutdown: %s took over %.0f s; going on without it", what, STOP_STEP_TIMEOUT_S)


class ElectedServiceSettings(ControlPlaneSettings):
    """Fields of every leader-elected loop."""

    tick_interval_s: float = Field(2.0, gt=0.0, description="Seconds between policy decisions (while this replica leads).")
    leader_ttl_s: int = Field(5, ge=1, description="Leader-election lease TTL in seconds: a dead leader is replaced within about this long.")
    snapshot_timeout_s: float = Field(2.0, gt=0.0, description="Seconds to wait for the monitor's cluster snapshot.")
    replica_id: str | None = Field(None, description="Name of this replica in leader election and status; unset = hostname:pid.")


class ElectedService(AsyncServiceMixin):
    """Lifecycle of a leader-elected loop; subclasses implement :meth:`tick` and :meth:`service_status`."""

    name = "elected"

    def __init__(self, settings: ElectedServiceSettings) -> None:
        self.settings = settings
        self.subjects = Subjects(settings.namespace)
        self.keys = Keys(settings.namespace)
        self.replica_id = settings.replica_id or replica_id()
        self._uptime = Uptime()
        self._bus: Bus | None = None
        self._registry: Registry | None = None
        self._election: LeaderElection | None = None
        self._ticker = LeaderTicker(self.tick, lambda: self.is_leader, settings.tick_interval_s, name=f"{self.name}-tick")
        self._admin: AdminEndpoint | None = None
        self._control: AdminEndpoint | None = None
        self._stop = StopOnce()

    @property
    def is_leader(self) -> bool:
        return self._election is not None and self._election.is_leader

    @property
    def bus(self) -> Bus:
        assert self._bus is not None, f"{self.name} is not started"
        return self._bus

    @property
    def registry(self) -> Registry:
        assert self._registry is not None, f"{self.name} is not started"
        return self._registry

    async def start(self) -> None:
        s = self.settings
        self._bus = bus_from_settings(s, name=f"poise-{self.name}-{self.replica_id}")
        await self._bus.connect()
        self._registry = registry_from_settings(s, self.keys)
        await self._registry.connect()
        self._admin = AdminEndpoint(self._bus, self.subjects, self.name, self.service_status,
                                    refresh=self.refresh_status)
        self.register_admin_verbs(self._admin)
        await self._admin.start()
        control = AdminEndpoint(self._bus, self.subjects, self.name, self.service_status,
                                subject=self.subjects.control(self.name))
        self.register_control_verbs(control)
        if set(control.verbs) - {"status", "help"}:  # served only by services other services command
            self._control = control
            await control.start()
        self._election = LeaderElection(self._registry, self.name, self.replica_id, ttl_s=s.leader_ttl_s,
                                        on_change=self._on_leadership)
        await self._election.start()
        self._ticker.start()
        log.info("%s %s up with policy %s", self.name, self.replica_id, self.policy_name())

    async def stop(self) -> None:
        await self._stop.run(self._stop_once)

    async def _stop_once(self) -> None:
        await _bounded(self._ticker.stop(), "the ticker")
        await _bounded(self.before_stop(), "the service's own tasks")
        if self._admin is not None:
            await _bounded(self._admin.stop(), "the admin endpoint")
        if self._control is not None:
            await _bounded(self._control.stop(), "the control endpoint")
        if self._election is not None:
            # revokes the lease: a follower takes over at once
            await _bounded(self._election.stop(), "leaving the leader election")
        if self._bus is not None:
            await _bounded(self._bus.close(), "closing NATS")
        if self._registry is not None:
            with contextlib.suppress(Exception):  # etcd may already be gone at shutdown
                await _bounded(self._registry.close(), "closing etcd")

    def _on_leadership(self, leader: bool) -> None:
        log.info("%s %s is %s", self.name, self.replica_id, "the leader" if leader else "a follower")

    def loop_details(self) -> dict[str, Any]:
        """The ticker's counters and the leader election's rounds run (won or lost), for :meth:`service_status`."""
        t = self._ticker
        return {"tick_interval_s": self.settings.tick_interval_s, "ticks": t.ticks, "tick_errors": t.errors,
                "last_error": t.last_error, "last_tick_unix_s": t.last_tick_unix_s,
                "election_rounds": self._election.rounds if self._election is not None else 0}

    # -- what subclasses provide -------------------------------------------------------------------
    def policy_name(self) -> str:
        return "-"

    def register_admin_verbs(self, admin: AdminEndpoint) -> None:
        """Add service-specific admin verbs (``status`` and ``help`` are always there)."""

    def register_control_verbs(self, control: AdminEndpoint) -> None:
        """Add the verbs other services may send (``Subjects.control(name)``; the admin subject is the operator's)."""

    async def before_stop(self) -> None:
        """Cancel the subclass's own background work; runs after the ticker stopped, before the bus closes."""

    async def tick(self) -> float | None:
        """One round of the loop, leader only; returns seconds until the next round (None = the interval)."""
        raise NotImplementedError

    async def refresh_status(self) -> None:
        """Re-read shared state before ``status`` answers (a follower does not tick, so it does not read it)."""

    def service_status(self) -> ServiceStatus:
        raise NotImplementedError
