"""A gateway in-process (uvicorn on a free port) in front of engine_sim processes registered in etcd directly
(the sidecar's job, tested elsewhere), for the gateway's integration tests."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import uvicorn

from services.gateway.app import create_app
from services.gateway.config import GatewaySettings
from services.gateway.service import GatewayService
from shared.devservers import EtcdServer, ManagedProcess, NatsServer, free_port, wait_for_port
from shared.errors import PoiseError
from shared.protocol import InstanceInfo, Keys
from shared.registry import InstanceRegistration, Registry


def engine_info(instance_id: str, role: str, url: str, bootstrap_port: int | None, model: str) -> InstanceInfo:
    return InstanceInfo(instance_id=instance_id, role=role, engine_kind="sim", url=url,  # type: ignore[arg-type]
                        bootstrap_host="127.0.0.1", bootstrap_port=bootstrap_port, model=model, profile="test",
                        kv_capacity_tokens=380_000, max_running_requests=256, sidecar="test",
                        registered_at_unix_s=time.time(), applies_seed=True)


def streamed_tokens(sse: str) -> int:
    """The tokens in a completions stream: engine_sim writes one placeholder word per token, and an SSE event
    may carry several of them (it coalesces when the reader falls behind, as SGLang does), so the words are
    counted, not the events."""
    texts = [choice["text"] for line in sse.splitlines() if line.startswith("data: {")
             for choice in orjson.loads(line[6:]).get("choices", [])]
    return len("".join(texts).split())


class SimEngine:
    """An engine_sim process serving ``model`` in ``mode``."""

    def __init__(self, tmp: Path, mode: str, model: str, time_scale: float, bootstrap_timeout_s: float = 5.0,
                 extra_args: tuple[str, ...] = ()) -> None:
        self._config = (tmp, mode, model, time_scale, bootstrap_timeout_s, extra_args)
        self.port, self.bootstrap_port = free_port(), free_port()
        self.mode = mode
        self.model = model
        self.proc = ManagedProcess(f"engine-{mode}", [
            sys.executable, "-m", "services.engine_sim", "--mode", mode, "--port", str(self.port),
            "--bootstrap-port", str(self.bootstrap_port), "--time-scale", str(time_scale),
            "--served-model-name", model, "--bootstrap-timeout-s", str(bootstrap_timeout_s), *extra_args,
        ], tmp / f"engine-{mode}-{self.port}.log")

    def respawn(self) -> SimEngine:
        """The same engine on new free ports (the old ones may have been taken between picking and binding)."""
        self.proc.stop()
        return SimEngine(*self._config)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def info(self, instance_id: str) -> InstanceInfo:
        return engine_info(instance_id, self.mode, self.url, self.bootstrap_port, self.model)


@contextlib.asynccontextmanager
async def run_gateway(nats_server: NatsServer, etcd_server: EtcdServer, namespace: str,
                      **overrides: object) -> AsyncIterator[tuple[str, GatewayService]]:
    port = free_port()
    settings = GatewaySettings(namespace=namespace, nats_url=nats_server.url, etcd_url=etcd_server.url, port=port,
                               **overrides)  # type: ignore[arg-type]
    service = GatewayService(settings)
    server = uvicorn.Server(uvicorn.Config(create_app(service), host="127.0.0.1", port=port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    while not server.started:  # noqa: ASYNC110 - uvicorn offers no event to wait on
        await asyncio.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", service
    finally:
        server.should_exit = True
        await task


async def register(registry: Registry, *infos: InstanceInfo) -> list[InstanceRegistration]:
    regs = []
    for info in infos:
        reg = InstanceRegistration(registry, ttl_s=5)
        await reg.register(info)
        regs.append(reg)
    return regs


def serving(engines: dict[str, SimEngine]) -> Iterator[dict[str, SimEngine]]:
    """A fixture's body: wait until every engine listens, hand them over, stop them afterwards."""
    try:
        for name in list(engines):
            for attempt in range(3):
                e = engines[name]
                try:
                    wait_for_port("127.0.0.1", e.port, 30, e.proc.proc)
                    break
                except PoiseError:  # it exited: on a busy box another process can take a port picked free
                    if e.proc.alive or attempt == 2:
                        raise
                    engines[name] = e.respawn()
        yield engines
    finally:
        for e in engines.values():
            e.proc.stop()


@contextlib.asynccontextmanager
async def fresh_registry(etcd_server: EtcdServer) -> AsyncIterator[Registry]:
    """A registry client on a namespace of its own (tests sharing one etcd never see each other's instances)."""
    reg = Registry(etcd_server.url, Keys(f"t{uuid.uuid4().hex[:8]}"))
    await reg.connect()
    try:
        yield reg
    finally:
        await reg.close()


async def completion_chunks(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                            headers: dict[str, str] | None = None) -> AsyncIterator[dict[str, Any]]:
    """The data chunks of one streamed ``/v1/completions`` through the gateway (none may be an error)."""
    async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = orjson.loads(line[5:])
            assert "error" not in chunk, chunk
            yield chunk


def counted(service: GatewayService, name: str, **labels: str) -> float:
    """A gateway counter's value (``name`` as exposed, ``_total`` included), by prometheus_client's public
    registry lookup; 0 before its first increment."""
    return service.metrics.registry.get_sample_value(name, labels) or 0.0
