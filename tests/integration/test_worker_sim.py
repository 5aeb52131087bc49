"""End to end: a worker spawns engine_sim, registers it, publishes its loads, flips its role, restarts it, moves it
into colocated serving and back (a restart each way)."""

from __future__ import annotations

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
        assert watcher.instances["p0"].role == "decode" and worker.restarts == 1 and worker.engine_pid != pid

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
