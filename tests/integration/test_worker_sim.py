"""End to end: a worker spawns engine_sim, registers it, publishes its loads, flips its role, restarts it, moves it
into colocated serving and back (a restart each way)."""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import os
import signal
import uuid
from pathlib import Path

import pytest

from services.worker.config import WorkerSettings
from services.worker.sidecar import WorkerService
from shared.devservers import EtcdServer, NatsServer
from shared.protocol import RoleCommand, RoleCommandReply, Subjects
from shared.settings import load_settings
from tests.integration.observer import start_observer
from tests.integration.waiting import process_alive, until


def _engine_sim_missing() -> bool:
    try:
        return importlib.util.find_spec("services.engine_sim.__main__") is None
    except ImportError:
        return True


pytestmark = [
    pytest.mark.asyncio,
    pytest.mark.skipif(_engine_sim_missing(), reason="services.engine_sim has no __main__ yet (python -m services.engine_sim)"),
]


_until = functools.partial(until, timeout_s=15.0)


_alive = process_alive


async def test_worker_runs_engine_sim_end_to_end(nats_server: NatsServer, etcd_server: EtcdServer, tmp_path: Path) -> None:
    ns = f"t{uuid.uuid4().hex[:8]}"
    subjects = Subjects(ns)
    obs = await start_observer(nats_server.url, etcd_server.url, ns, "p0")
    registry, watcher, bus, reports = obs.registry, obs.watcher, obs.bus, obs.reports
    settings = load_settings(WorkerSettings, instance_id="p0", role="prefill", engine_kind="sim", model="sim-model",
                             time_scale=0.0, namespace=ns, nats_url=nats_server.url, etcd_url=etcd_server.url,
                             load_interval_s=0.1, lease_ttl_s=2, health_timeout_s=30, restart_backoff_s=0.2,
                             stop_timeout_s=5, log_dir=tmp_path)
    worker = WorkerService(settings)
    try:
        await worker.start()
        info = watcher.instances.get("p0") or (await registry.list_instances())[0]["p0"]
        assert (info.role, info.status, info.engine_kind, info.model) == ("prefill", "ready", "sim", "sim-model")
        assert info.url == f"http://127.0.0.1:{worker.settings.engine_port}"
        assert info.bootstrap_port == worker.settings.bootstrap_port and info.kv_capacity_tokens > 0
        await _until(lambda: any(r.healthy for r in reports))
        assert reports[-1].max_total_num_tokens == info.kv_capacity_tokens

        # An idle engine flips at once.
        reply = await bus.request(subjects.worker_command("p0"), RoleCommand(command_id="c1", new_role="decode",
                                                                              drain_timeout_s=5),
                                  RoleCommandReply, timeout_s=20)
        assert reply.ok, reply.message
        await _until(lambda: "p0" in watcher.instances and watcher.instances["p0"].role == "decode")

        # The engine dies: the sidecar deregisters, restarts it (in its current role) and registers again.
        pid = worker.engine_pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        await _until(lambda: "p0" not in watcher.instances)
        await _until(lambda: "p0" in watcher.instances, timeout_s=30)
        # The supervisor counts the restart once its registration call returns, which the watcher may see first.
        await _until(lambda: worker.restarts == 1)
        assert watcher.instances["p0"].role == "decode" and worker.engine_pid != pid

        # Into colocated serving and out again: SGLang takes its mode at launch, so each is a restart in the
        # other mode, and the supervisor watches the new engine (a crash restarts it as colocated).
        pid = worker.engine_pid
        reply = await bus.request(subjects.worker_command("p0"), RoleCommand(command_id="c2", new_role="null",
                                                                              drain_timeout_s=5),
                                  RoleCommandReply, timeout_s=40)
        assert reply.ok and "restarted" in reply.message, reply.message
        await _until(lambda: "p0" in watcher.instances and watcher.instances["p0"].role == "null")
        assert watcher.instances["p0"].bootstrap_port is None and worker.engine_pid not in (None, pid)
        pid = worker.engine_pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        await _until(lambda: worker.restarts == 2 and "p0" in watcher.instances, timeout_s=30)
        assert watcher.instances["p0"].role == "null" and not _alive(pid)
        reply = await bus.request(subjects.worker_command("p0"), RoleCommand(command_id="c3", new_role="prefill",
                                                                              drain_timeout_s=5),
                                  RoleCommandReply, timeout_s=40)
        assert reply.ok, reply.message
        await _until(lambda: "p0" in watcher.instances and watcher.instances["p0"].role == "prefill")
        assert watcher.instances["p0"].bootstrap_port == worker.settings.bootstrap_port
    finally:
        pid = worker.engine_pid
        await worker.stop()
    await _until(lambda: "p0" not in watcher.instances)
    assert pid is None or not _alive(pid)
    await obs.close()


async def test_an_engine_whose_scheduler_hangs_leaves_the_registry_and_returns(
        nats_server: NatsServer, etcd_server: EtcdServer, tmp_path: Path) -> None:
    """A hung step (SIGUSR1 freezes engine_sim's scheduler; its HTTP server keeps answering /v1/loads) shows
    only as a load snapshot that stops advancing while the engine has work: the sidecar reports the engine
    unhealthy and deregisters it, and registers it again once it steps again."""
    import httpx

    ns = f"t{uuid.uuid4().hex[:8]}"
    obs = await start_observer(nats_server.url, etcd_server.url, ns, "c0")
    watcher, reports = obs.watcher, obs.reports
    settings = load_settings(WorkerSettings, instance_id="c0", role="null", engine_kind="sim", model="sim-model",
                             time_scale=0.05, namespace=ns, nats_url=nats_server.url, etcd_url=etcd_server.url,
                             load_interval_s=0.1, lease_ttl_s=2, health_timeout_s=30, stalled_after_s=0.5,
                             unhealthy_after_s=0.3, stop_timeout_s=5, log_dir=tmp_path)
    async with WorkerService(settings) as worker, httpx.AsyncClient(timeout=60) as client:
        await _until(lambda: "c0" in watcher.instances)
        url = f"http://127.0.0.1:{worker.settings.engine_port}"
        body = {"input_ids": list(range(50)), "rid": "long",
                "sampling_params": {"max_new_tokens": 100_000, "ignore_eos": True}}
        request = asyncio.create_task(client.post(url + "/generate", json=body))
        await _until(lambda: bool(reports) and reports[-1].healthy and reports[-1].num_running_reqs == 1)
        pid = worker.engine_pid
        assert pid is not None
        os.kill(pid, signal.SIGUSR1)
        await _until(lambda: not reports[-1].healthy)
        assert reports[-1].error is not None and "hung" in reports[-1].error
        assert (await client.get(url + "/v1/loads")).status_code == 200  # its HTTP server still answers
        await _until(lambda: "c0" not in watcher.instances)
        os.kill(pid, signal.SIGUSR2)
        await _until(lambda: "c0" in watcher.instances)
        assert watcher.instances["c0"].status == "ready" and worker.restarts == 0
        await client.post(url + "/abort_request", json={"rid": "long"})
        assert (await request).status_code == 200
    await _until(lambda: "c0" not in watcher.instances)
    await obs.close()


async def test_a_picked_port_taken_before_the_launch_is_picked_again(
        nats_server: NatsServer, etcd_server: EtcdServer, tmp_path: Path) -> None:
    """A worker picks its engine's port when it is built and binds it when it launches; a process that takes the
    port in between (an outbound connection's local end, most often) makes it pick another, not restart an
    engine that cannot bind until it gives up."""
    import socket

    ns = f"t{uuid.uuid4().hex[:8]}"
    obs = await start_observer(nats_server.url, etcd_server.url, ns, "d0")
    settings = load_settings(WorkerSettings, instance_id="d0", role="decode", engine_kind="sim", model="sim-model",
                             time_scale=0.0, namespace=ns, nats_url=nats_server.url, etcd_url=etcd_server.url,
                             load_interval_s=0.1, lease_ttl_s=2, health_timeout_s=30, restart_max_failures=2,
                             restart_backoff_s=0.2, stop_timeout_s=5, log_dir=tmp_path)
    worker = WorkerService(settings)
    picked = worker.settings.engine_port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as squatter:
        squatter.bind(("127.0.0.1", picked))
        squatter.listen(1)
        async with worker:
            await _until(lambda: "d0" in obs.watcher.instances)
            assert worker.settings.engine_port != picked and worker.restarts == 0
            assert obs.watcher.instances["d0"].url == f"http://127.0.0.1:{worker.settings.engine_port}" == worker.url
            await _until(lambda: bool(obs.reports) and obs.reports[-1].healthy)
    await obs.close()
