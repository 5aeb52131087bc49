"""Carries out a scaling policy live: target replica counts in, engines started and retired through a connector.

Each planner tick (while leading and not paused) the scaling policy (``dopd``, ``dynamo-load``,
``dynamo-sla``; pure, ``shared.policies``) decides on the decider thread. The resizer compares its target with
the replicas that count (``ready`` or ``starting`` in the snapshot, plus starts the connector has begun but
that have not registered yet) and:

- starts the missing ones (``Connector.start``: a new engine + sidecar that registers when healthy);
- retires the surplus, least loaded first (``Connector.retire``: drain, deregister, exit), never two of the
  same instance at once, and never below one replica per role (the policy's own minimum);
- publishes a ``resize_requested`` planner event for every target it acts on.

Starts and retires run as background tasks: a drain lasts as long as the engine's longest request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from services.planner.config import PlannerSettings
from services.planner.connectors import (
    Connector,
    ConnectorError,
    KubernetesConnector,
    KubernetesConnectorSettings,
    LocalConnector,
    LocalConnectorSettings,
)
from services.planner.decider import Decider
from shared.bus import Bus
from shared.policies import ScalingPolicy, ScalingTarget
from shared.policies.scaling import active, pick_retiree
from shared.protocol import ClusterSnapshot
from shared.protocol.messages import Role
from shared.runtime import cancel_and_wait

log = logging.getLogger(__name__)



class Resizer:
    def __init__(self, policy: ScalingPolicy, connector: Connector, *, drain_timeout_s: float,
                 publish: Callable[..., Awaitable[None]], start_grace_s: float = 600.0) -> None:
        self.policy = policy
        self.connector = connector
        self.decider: Decider[ScalingTarget] = Decider(policy)
        self.drain_timeout_s = drain_timeout_s
        self.start_grace_s = start_grace_s  # a start that never registers stops counting after this long
        self._publish = publish
        self._pending: dict[str, tuple[Role, float]] = {}  # started, not registered yet: id -> (role, when)
        self._retiring: set[str] = set()
        self._launching: dict[Role, int] = {"prefill": 0, "decode": 0}  # start() called, no id back yet
        self._tasks: set[asyncio.Task[None]] = set()
        self.last_target: ScalingTarget | None = None
        self.actions: list[dict[str, Any]] = []  # the latest starts and retires, for status

    async def step(self, snapshot: ClusterSnapshot, now_s: float) -> ScalingTarget | None:
        registered = {i.info.instance_id for i in snapshot.instances}
        deadline = time.monotonic() - self.start_grace_s
        self._pending = {i: (r, t) for i, (r, t) in self._pending.items() if i not in registered and t > deadline}
        target = await self.decider.decide(snapshot, now_s)
        if target is None:
            return None
        self.last_target = target
        acted = False
        wanted: dict[Role, int] = {"prefill": target.prefill, "decode": target.decode}
        for role, want in wanted.items():
            have = [i.info.instance_id for i in active(snapshot, role) if i.info.instance_id not in self._retiring]
            pending = sum(1 for r, _ in self._pending.values() if r == role) + self._launching[role]
            if want > len(have) + pending:
                for _ in range(want - len(have) - pending):
                    self._spawn(self._start(role))
                acted = True
            elif want < len(have) and pending == 0:
                for _ in range(len(have) - max(want, 1)):
                    victim = pick_retiree(snapshot, role, exclude=self._retiring)
                    if victim is None:
                        break
                    self._retiring.add(victim)
                    self._spawn(self._retire(victim))
                    acted = True
        if acted:
            await self._publish("resize_requested", source="policy", reason=target.reason,
                                target_prefill=target.prefill, target_decode=target.decode)
        return target

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _start(self, role: Role) -> Awaitable[None]:
        self._launching[role] += 1  # counted now, so the next tick does not start it again
        return self._started(role)

    async def _started(self, role: Role) -> None:
        try:
            instance_id = await self.connector.start(role)
        except (ConnectorError, OSError) as exc:
            log.warning("could not start a %s engine: %s", role, exc)
            self._note("start", role, None, ok=False, message=str(exc))
            return
        finally:
            self._launching[role] -= 1
        self._pending[instance_id] = (role, time.monotonic())
        self._note("start", role, instance_id, ok=True, message="started; registers when healthy")

    async def _retire(self, instance_id: str) -> None:
        try:
            await self.connector.retire(instance_id, self.drain_timeout_s)
            self._note("retire", None, instance_id, ok=True, message="drained and stopped")
        except (ConnectorError, OSError) as exc:
            log.warning("could not retire %s: %s", instance_id, exc)
            self._note("retire", None, instance_id, ok=False, message=str(exc))
        finally:
            self._retiring.discard(instance_id)

    def _note(self, action: str, role: Role | None, instance_id: str | None, *, ok: bool, message: str) -> None:
        self.actions.append({"action": action, "role": role, "instance": instance_id, "ok": ok, "message": message,
                             "at_unix_s": time.time()})
        del self.actions[:-20]

    def status(self) -> dict[str, Any]:
        t = self.last_target
        return {"scaling_policy": self.policy.name, "connector": self.connector.name,
                "target": None if t is None else {"prefill": t.prefill, "decode": t.decode, "reason": t.reason},
                "pending_starts": sorted(self._pending), "retiring": sorted(self._retiring),
                "recent_actions": list(self.actions), "decision_latency": self.decider.stats()}

    async def close(self) -> None:
        await cancel_and_wait(list(self._tasks))
        self.decider.close()
        await self.connector.close()


def build_connector(settings: PlannerSettings, bus: Bus, existing_ids: Callable[[], Any]) -> Connector:
    """The connector ``settings.connector`` names, on the planner's namespace, NATS and etcd."""
    common: dict[str, Any] = {"namespace": settings.namespace, "nats_url": settings.nats_url,
                              "nats_user": settings.nats_user, "nats_password": settings.nats_password}
    if settings.connector == "local":
        local = LocalConnectorSettings(**{"profile": settings.profile, **common, "etcd_url": settings.etcd_url,
                                          "etcd_user": settings.etcd_user, "etcd_password": settings.etcd_password,
                                          "worker_credentials_file": settings.worker_credentials_file,
                                          **settings.connector_settings})
        return LocalConnector(local, bus=bus, existing_ids=existing_ids)
    if settings.connector == "kubernetes":
        return KubernetesConnector(KubernetesConnectorSettings(**{**common, **settings.connector_settings}), bus=bus)
    raise ValueError(f"connector {settings.connector!r} cannot start engines")
