"""What a test watches a sidecar through: the etcd instance mirror and the sidecar's load reports on NATS."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from shared.bus import Bus
from shared.protocol import InstanceInfo, Keys, LoadReport, Subjects
from shared.registry import InstanceWatcher, Registry


@dataclass
class Observer:
    registry: Registry
    watcher: InstanceWatcher
    bus: Bus
    reports: list[LoadReport] = field(default_factory=list)

    async def close(self) -> None:
        await self.watcher.stop()
        await self.bus.close()
        await self.registry.close()


async def start_observer(nats_url: str, etcd_url: str, namespace: str, instance_id: str,
                         on_change: Callable[[dict[str, InstanceInfo]], None] | None = None) -> Observer:
    registry = Registry(etcd_url, Keys(namespace))
    await registry.connect()
    watcher = InstanceWatcher(registry, on_change=on_change)
    await watcher.start()
    bus = Bus(nats_url, name="test-observer")
    await bus.connect()
    observer = Observer(registry, watcher, bus)

    async def on_load(report: LoadReport, subject: str) -> None:
        observer.reports.append(report)

    await bus.subscribe(Subjects(namespace).load(instance_id), LoadReport, on_load)
    return observer
