"""The worker sidecar in ``attach`` mode against a fake SGLang engine, with the real nats-server and etcd.

The fake engine is a tiny FastAPI app in this file that answers SGLang's control endpoints with SGLang's
shapes (``/health``, ``/server_info``, ``/v1/loads``, ``/pd_role_switch``), and refuses a role switch while
``busy`` is set, as SGLang does when the instance is not idle.
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from services.worker.config import WorkerSettings
from services.worker.sidecar import WorkerService, worker_admin_service
from shared.devservers import EtcdServer, NatsServer
from shared.protocol import (
    AdminCommand,
    AdminReply,
    InstanceInfo,
    RoleCommand,
    RoleCommandReply,
    Subjects,
)
from shared.runtime import EmbeddedHttpServer
from shared.settings import load_settings
from tests.integration.observer import start_observer
from tests.integration.waiting import until

pytestmark = pytest.mark.asyncio


class FakeSglang:
    """SGLang's control-plane surface, with knobs: ``busy`` (one running request), ``broken`` (loads fail)."""

    def __init__(self, role: str = "prefill") -> None:
        self.role = role
        self.busy = False
        self.broken = False
        self.switches: list[str] = []
        self.app = FastAPI()
        app = self.app

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=200)

        @app.get("/server_info")
        async def server_info() -> dict[str, Any]:
            return {"served_model_name": "fake-model", "disaggregation_mode": self.role,
                    "disaggregation_bootstrap_port": 8999, "max_running_requests": 48,
                    "max_total_num_tokens": 12345, "internal_states": [{"last_gen_throughput": 0.0}],
                    "version": "0.5.23"}

        @app.get("/v1/loads")
        async def loads() -> Response:
            if self.broken:
                return JSONResponse({"error": {"message": "scheduler is gone"}}, status_code=500)
            running = 1 if self.busy else 0
            rank = {"timestamp": time.time(), "dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": 0,
                    "num_waiting_uncached_tokens": 0, "num_used_tokens": 100 * running, "num_total_tokens": 0,
                    "num_active_tokens": 0, "num_prealloc_ready_tokens": 0, "max_total_num_tokens": 12345,
                    "max_running_requests": 48, "token_usage": 100 * running / 12345, "gen_throughput": 42.0,
                    "cache_hit_rate": 0.0, "utilization": 0.0, "total_prefill_uncached_tokens": 0,
                    "total_prefill_busy_us": 0, "decode_moments": None,
                    "disaggregation": {"mode": self.role, "prefill_bootstrap_queue_reqs": 0,
                                       "prefill_inflight_queue_reqs": 0, "decode_prealloc_queue_reqs": 0,
                                       "decode_transfer_queue_reqs": 0, "decode_retracted_queue_reqs": 0,
                                       "kv_transfer_speed_gb_s": 0.0, "kv_transfer_latency_ms": 0.0}}
            return JSONResponse({"timestamp": "2026-01-01T00:00:00+00:00", "version": "0.5.23", "accelerator": None,
                                 "num_accelerators": 1, "loads": [rank]})

        @app.post("/pd_role_switch")
        async def pd_role_switch(body: dict[str, Any]) -> Response:
            new_role = body.get("new_role", "")
            old = self.role
            if self.busy:
                return JSONResponse({"success": False, "message": "Instance is not idle; drain all requests before switching",
                                     "old_role": old, "new_role": new_role, "safe_to_restore": True}, status_code=400)
            self.role = new_role
            self.switches.append(new_role)
            return JSONResponse({"success": True, "message": f"switched {old} -> {new_role}", "old_role": old,
                                 "new_role": new_role, "safe_to_restore": True})


_until = functools.partial(until, timeout_s=10.0)


@pytest_asyncio.fixture
async def fake_engine() -> AsyncIterator[tuple[FakeSglang, str]]:
    engine = FakeSglang("prefill")
    server = EmbeddedHttpServer(engine.app, "127.0.0.1", 0, name="fake-sglang")
    await server.start()
    yield engine, f"http://127.0.0.1:{server.port}"
    await server.stop()


def _worker_settings(nats: NatsServer, etcd: EtcdServer, ns: str, url: str, tmp: Path, **kw: Any) -> WorkerSettings:
    return load_settings(WorkerSettings, instance_id="p0", engine_kind="attach", engine_url=url, namespace=ns,
                         nats_url=nats.url, etcd_url=etcd.url, load_interval_s=0.1, lease_ttl_s=2,
                         log_dir=tmp, **kw)


async def test_attach_registers_reports_and_switches_roles(
    nats_server: NatsServer, etcd_server: EtcdServer, fake_engine: tuple[FakeSglang, str], tmp_path: Path,
) -> None:
    engine, url = fake_engine
    ns = f"t{uuid.uuid4().hex[:8]}"
    subjects = Subjects(ns)
    statuses: list[tuple[str, str]] = []

    def on_change(instances: dict[str, InstanceInfo]) -> None:
        if "p0" in instances:
            statuses.append((instances["p0"].role, instances["p0"].status))

    obs = await start_observer(nats_server.url, etcd_server.url, ns, "p0", on_change)
    registry, watcher, bus, reports = obs.registry, obs.watcher, obs.bus, obs.reports

    worker = WorkerService(_worker_settings(nats_server, etcd_server, ns, url, tmp_path))
    await worker.start()
    try:
        # Registered with what the engine reports about itself.
        instances, _ = await registry.list_instances()
        info = instances["p0"]
        assert (info.role, info.status, info.engine_kind, info.url) == ("prefill", "ready", "attach", url)
        assert (info.bootstrap_host, info.bootstrap_port) == ("127.0.0.1", 8999)
        assert (info.model, info.kv_capacity_tokens, info.max_running_requests) == ("fake-model", 12345, 48)

        # Load reports flow, with the engine's numbers.
        engine.busy = True
        await _until(lambda: any(r.num_running_reqs == 1 for r in reports))
        busy_report = next(r for r in reports if r.num_running_reqs == 1)
        assert busy_report.healthy and busy_report.role == "prefill" and busy_report.max_total_num_tokens == 12345
        assert busy_report.gen_throughput_tps == 42.0

        # While busy: the sidecar drains (status draining), times out, and restores the old role as ready.
        cmd = RoleCommand(command_id="c1", new_role="decode", reason="test", drain_timeout_s=0.6)
        first = asyncio.create_task(bus.request(subjects.worker_command("p0"), cmd, RoleCommandReply, timeout_s=10))
        await _until(lambda: ("prefill", "draining") in statuses)
        # A second command while one runs is refused at once.
        second = await bus.request(subjects.worker_command("p0"), RoleCommand(command_id="c2", new_role="decode"),
                                   RoleCommandReply, timeout_s=5)
        assert not second.ok and "in progress" in second.message
        reply = await first
        assert not reply.ok and reply.command_id == "c1" and "not idle" in reply.message
        assert (reply.old_role, reply.new_role) == ("prefill", "prefill")
        await _until(lambda: statuses[-1] == ("prefill", "ready"))
        assert engine.switches == []

        # Idle: the switch goes through and etcd shows the new role.
        engine.busy = False
        cmd = RoleCommand(command_id="c3", new_role="decode", reason="test", drain_timeout_s=5)
        reply = await bus.request(subjects.worker_command("p0"), cmd, RoleCommandReply, timeout_s=10)
        assert reply.ok, reply.message
        assert (reply.old_role, reply.new_role) == ("prefill", "decode")
        assert engine.switches == ["decode"] and engine.role == "decode"
        instances, _ = await registry.list_instances()
        assert (instances["p0"].role, instances["p0"].status) == ("decode", "ready")
        assert ("decode", "switching") not in statuses and ("prefill", "switching") in statuses
        await _until(lambda: reports[-1].role == "decode")

        # Same role: nothing to do; colocated is not a runtime target.
        same = await bus.request(subjects.worker_command("p0"), RoleCommand(command_id="c4", new_role="decode"),
                                 RoleCommandReply, timeout_s=5)
        assert same.ok and "already decode" in same.message
        null = await bus.request(subjects.worker_command("p0"), RoleCommand(command_id="c5", new_role="null"),
                                 RoleCommandReply, timeout_s=5)
        assert not null.ok and engine.switches == ["decode"]

        # Admin status and set-role on the worker's own admin subject.
        status = await bus.request(subjects.admin(worker_admin_service("p0")), AdminCommand(verb="status"), AdminReply)
        assert status.ok and status.status is not None
        assert status.status.details["role"] == "decode" and status.status.details["registered"] is True
        back = await bus.request(subjects.admin(worker_admin_service("p0")),
                                 AdminCommand(verb="set-role", args={"role": "prefill"}), AdminReply, timeout_s=10)
        assert back.ok and engine.role == "prefill"
    finally:
        await worker.stop()
        await worker.stop()  # idempotent
    await _until(lambda: "p0" not in watcher.instances)
    instances, _ = await registry.list_instances()
    assert "p0" not in instances
    await obs.close()


async def test_unhealthy_engine_leaves_the_registry_and_returns(
    nats_server: NatsServer, etcd_server: EtcdServer, fake_engine: tuple[FakeSglang, str], tmp_path: Path,
) -> None:
    engine, url = fake_engine
    ns = f"t{uuid.uuid4().hex[:8]}"
    obs = await start_observer(nats_server.url, etcd_server.url, ns, "p0")
    watcher, reports = obs.watcher, obs.reports
    async with WorkerService(_worker_settings(nats_server, etcd_server, ns, url, tmp_path, unhealthy_after_s=0.4)):
        await _until(lambda: "p0" in watcher.instances)
        engine.broken = True
        await _until(lambda: any(not r.healthy for r in reports))
        bad = next(r for r in reports if not r.healthy)
        assert bad.error is not None and "scheduler is gone" in bad.error
        await _until(lambda: "p0" not in watcher.instances)
        engine.broken = False
        await _until(lambda: "p0" in watcher.instances)
        assert watcher.instances["p0"].status == "ready"
    await _until(lambda: "p0" not in watcher.instances)
    await obs.close()


async def test_attach_fails_clearly_when_nothing_answers(
    nats_server: NatsServer, etcd_server: EtcdServer, tmp_path: Path,
) -> None:
    from shared.devservers import free_port
    from shared.errors import EngineTimeout

    url = f"http://127.0.0.1:{free_port()}"
    worker = WorkerService(_worker_settings(nats_server, etcd_server, f"t{uuid.uuid4().hex[:8]}", url, tmp_path,
                                            health_timeout_s=0.5))
    with pytest.raises(EngineTimeout, match="health not OK after"):
        await worker.start()
    await worker.stop()
