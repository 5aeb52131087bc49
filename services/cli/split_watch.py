"""Record the live stack's P:D split while ``poise run`` replays: what its report draws over time.

A background thread with its own event loop and NATS connection (as the stack's admin user, like
``poise admin``) asks the monitor for a cluster snapshot every ``interval_s`` (the registry's instances: role
and status) and listens to the planner's events (flips requested, done, failed); when it stops it asks the
planner for its decision latency, so the report can hold the controller to its p99 target over the run. It
never touches the replay's event loop; a snapshot the monitor does not answer is skipped.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import msgspec

from services.cli.admin_planner import ask_planner
from shared.bus import Bus
from shared.errors import BusTimeout, PoiseError
from shared.protocol import PlannerEvent, SnapshotReply, SnapshotRequest, Subjects

if TYPE_CHECKING:
    from services.cli.stack import Stack

log = logging.getLogger(__name__)

Sample = tuple[float, int, int, int, int]  # (unix s, ready prefill, ready decode, draining or switching, ready colocated)


def count_split(instances: Any) -> tuple[int, int, int, int]:
    """(ready prefill, ready decode, flipping, ready colocated) of a snapshot's instances."""
    prefill = decode = flipping = colocated = 0
    for inst in instances:
        info = inst.info
        if info.status in ("draining", "switching"):
            flipping += 1
        elif info.status == "ready" and info.role == "prefill":
            prefill += 1
        elif info.status == "ready" and info.role == "decode":
            decode += 1
        elif info.status == "ready" and info.role == "null":
            colocated += 1
    return prefill, decode, flipping, colocated


class SplitWatcher:
    """Samples the split and collects the planner's flip events until `stop`."""

    def __init__(self, nats_url: str, namespace: str, *, user: str | None = None, password: str | None = None,
                 interval_s: float = 1.0) -> None:
        self.nats_url, self.namespace = nats_url, namespace
        self.user, self.password = user, password
        self.interval_s = interval_s
        self.samples: list[Sample] = []
        self.events: list[dict[str, Any]] = []
        # The planner's ``decision_latency`` (services/planner/decider.py ``stats``) when the watcher stopped.
        self.decision_latency: dict[str, Any] | None = None
        self.error: str | None = None
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def for_stack(cls, stack: Stack, interval_s: float = 1.0) -> SplitWatcher:
        assert stack.nats is not None
        creds = stack.credentials
        return cls(stack.nats.plain_url, stack.settings.namespace, interval_s=interval_s,
                   user="admin" if creds is not None else None,
                   password=creds.nats_password("admin") if creds is not None else None)

    def start(self, wait_s: float = 10.0) -> None:
        """Start the thread; returns once it listens (or failed to connect: `error` says why)."""
        self._thread = threading.Thread(target=self._run, name="split-watch", daemon=True)
        self._thread.start()
        self._ready.wait(wait_s)

    def stop(self, wait_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(wait_s)

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except Exception as exc:  # the run goes on without the split; the report says it was not recorded
            self.error = f"{type(exc).__name__}: {exc}"
            log.warning("split watcher stopped: %s", self.error)
        finally:
            self._ready.set()

    async def _main(self) -> None:
        bus = Bus(self.nats_url, name="poise-run-split-watch", user=self.user, password=self.password,
                  connect_timeout_s=5)
        await bus.connect()
        subjects = Subjects(self.namespace)

        async def on_event(event: PlannerEvent, subject: str) -> None:
            self.events.append(msgspec.to_builtins(event))

        try:
            await bus.subscribe(subjects.planner_events(), PlannerEvent, on_event)
            await bus.nc.flush()
            self._ready.set()
            while not self._stop.is_set():
                t = time.time()
                try:
                    reply = await bus.request(subjects.monitor_snapshot(), SnapshotRequest(series_points=0),
                                              SnapshotReply, timeout_s=2.0)
                except BusTimeout:
                    reply = None
                if reply is not None and reply.snapshot is not None:
                    self.samples.append((t, *count_split(reply.snapshot.instances)))
                await asyncio.sleep(max(0.0, self.interval_s - (time.time() - t)))
            self.decision_latency = await self._decision_latency(bus, subjects)
        finally:
            await bus.close()

    @staticmethod
    async def _decision_latency(bus: Bus, subjects: Subjects) -> dict[str, Any] | None:
        try:
            reply = await ask_planner(bus, subjects, "pools", {}, timeout_s=5.0)
        except PoiseError as exc:
            log.warning("no decision latency in the report: %s", exc)
            return None
        if reply.status is None:
            return None
        latency = reply.status.details.get("decision_latency")
        return latency if isinstance(latency, dict) else None
