"""The worker's ``sglang`` engine kind with a stand-in for SGLang's interpreter (tests/integration/sglang_standin.py).

Real processes throughout: the worker launches the stand-in as ``<sglang_python> -m sglang.launch_server ...``,
talks HTTP to it, registers it in a real etcd and reports on a real NATS. The stand-in serves SGLang's shapes
for a while and then crashes, or crashes at once, so these tests show the version pin, restart with
exponential back-off, recovery, and giving up after ``restart_max_failures`` with a clear error and exit 1.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import re
import stat
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from services.worker.config import WorkerSettings
from services.worker.launcher import SglangVersionError
from services.worker.sidecar import WorkerService
from shared.devservers import EtcdServer, NatsServer
from shared.settings import load_settings
from tests.integration.observer import start_observer
from tests.integration.waiting import until

pytestmark = pytest.mark.asyncio

REPO = Path(__file__).resolve().parents[2]
STANDIN = Path(__file__).resolve().parent / "sglang_standin.py"
_until = functools.partial(until, timeout_s=15.0)


def _interpreter(tmp: Path) -> Path:
    """An executable that plays the SGLang environment's ``python``."""
    path = tmp / "sglang-python"
    path.write_text(f"#!/bin/sh\nexec {sys.executable} {STANDIN} \"$@\"\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def _launches(tmp: Path) -> list[dict[str, Any]]:
    path = tmp / "standin" / "launches.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _settings(nats: NatsServer, etcd: EtcdServer, ns: str, tmp: Path, plan: str, **kw: Any) -> WorkerSettings:
    env = {"STANDIN_PLAN": plan, "STANDIN_DIR": str(tmp / "standin"), **kw.pop("env", {})}
    base: dict[str, Any] = dict(
        instance_id="p0", role="prefill", engine_kind="sglang", model_path="standin", sglang_python=str(_interpreter(tmp)),
        engine_env=env, namespace=ns, nats_url=nats.url, etcd_url=etcd.url, load_interval_s=0.1, lease_ttl_s=2,
        health_timeout_s=10, restart_backoff_s=0.2, restart_backoff_max_s=0.5, stop_timeout_s=3, log_dir=tmp)
    base.update(kw)
    return load_settings(WorkerSettings, **base)


@pytest.mark.parametrize(("version", "message"), [
    ("0.5.22", r"has sglang 0\.5\.22, but this worker supports sglang 0\.5\.23 only"),
    ("missing", r"sglang is not importable with .*sglang-python \(exit 1\): ModuleNotFoundError"),
])
async def test_wrong_sglang_version_fails_before_anything_starts(nats_server: NatsServer, etcd_server: EtcdServer,
                                                                  tmp_path: Path, version: str, message: str) -> None:
    settings = _settings(nats_server, etcd_server, "unused", tmp_path, "serve:inf", env={"STANDIN_SGLANG_VERSION": version})
    worker = WorkerService(settings)
    with pytest.raises(SglangVersionError, match=message):
        await worker.start()
    await worker.stop()
    assert _launches(tmp_path) == []  # nothing was launched


async def test_crashing_engine_is_restarted_with_backoff_then_given_up(
        nats_server: NatsServer, etcd_server: EtcdServer, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ns = f"t{uuid.uuid4().hex[:8]}"
    obs = await start_observer(nats_server.url, etcd_server.url, ns, "p0")
    # Launch 1 serves for 0.8 s and crashes; every later launch crashes at once (e.g. CUDA OOM at start-up).
    settings = _settings(nats_server, etcd_server, ns, tmp_path, "serve:0.8,crash", restart_max_failures=4)
    worker = WorkerService(settings)
    caplog.set_level(logging.INFO, logger="services.worker")
    try:
        await worker.start()
        assert worker.sglang_version == "0.5.23"
        await _until(lambda: "p0" in obs.watcher.instances)
        info = obs.watcher.instances["p0"]
        assert (info.engine_kind, info.role, info.kv_capacity_tokens, info.max_running_requests) == \
            ("sglang", "prefill", 4096, 16)
        await _until(lambda: worker.exit_requested.is_set(), timeout_s=20)
    finally:
        await worker.stop()
    launches = _launches(tmp_path)
    assert len(launches) == 4  # the first run, then three restarts: failures 1 (the crash), 2, 3, 4 -> give up
    argv = launches[0]["argv"]
    assert argv[:4] == ["-m", "sglang.launch_server", "--model-path", "standin"] and "--enable-pd-role-switch" in argv
    # Exponential back-off capped at restart_backoff_max_s, as the supervisor announced it ...
    delays = [float(d) for d in re.findall(r"restarting the engine of p0 in ([0-9.]+)s", caplog.text)]
    assert delays == [0.2, 0.4, 0.5]
    # ... and as the launches happened (each gap also holds the failed run and its detection).
    gaps = [b["t"] - a["t"] for a, b in zip(launches, launches[1:], strict=False)]
    assert gaps[0] >= 0.8 + 0.2 and gaps[1] >= 0.4 and gaps[2] >= 0.5, gaps
    # Giving up: a clear error with the engine log's tail, out of the registry, process asked to exit.
    assert worker.fatal_error is not None
    assert "engine of p0 failed 4 times in a row (restart_max_failures=4); giving up" in worker.fatal_error
    assert "CUDA out of memory while capturing graphs (simulated)" in worker.fatal_error
    assert worker.restarts == 0 and "p0" not in obs.watcher.instances
    assert worker.service_status().details["fatal_error"] == worker.fatal_error
    await obs.close()


async def test_engine_that_crashes_once_comes_back(nats_server: NatsServer, etcd_server: EtcdServer,
                                                    tmp_path: Path) -> None:
    ns = f"t{uuid.uuid4().hex[:8]}"
    seen: list[bool] = []
    obs = await start_observer(nats_server.url, etcd_server.url, ns, "p0",
                               on_change=lambda instances: seen.append("p0" in instances))
    settings = _settings(nats_server, etcd_server, ns, tmp_path, "serve:0.6,serve:inf", restart_max_failures=2)
    worker = WorkerService(settings)
    try:
        await worker.start()
        await _until(lambda: worker.restarts == 1)
        await _until(lambda: "p0" in obs.watcher.instances)
        assert worker.fatal_error is None and not worker.exit_requested.is_set()
        assert seen[-3:] == [True, False, True]  # registered, deregistered while down, registered again
        assert len(_launches(tmp_path)) == 2
    finally:
        await worker.stop()
    await _until(lambda: "p0" not in obs.watcher.instances)
    await obs.close()


async def test_worker_process_exits_1_when_it_gives_up(nats_server: NatsServer, etcd_server: EtcdServer,
                                                       tmp_path: Path) -> None:
    """The real ``python -m services.worker`` process: its supervisor (systemd, Kubernetes, poise up) must see
    a failure, not a clean exit."""
    interpreter = _interpreter(tmp_path)
    env = json.dumps({"STANDIN_PLAN": "serve:0.5,crash", "STANDIN_DIR": str(tmp_path / "standin")})
    cmd = [sys.executable, "-m", "services.worker", "--instance-id", "p9", "--role", "decode", "--engine-kind", "sglang",
           "--model-path", "standin", "--sglang-python", str(interpreter), "--engine-env", env,
           "--namespace", f"t{uuid.uuid4().hex[:8]}", "--nats-url", nats_server.url, "--etcd-url", etcd_server.url,
           "--restart-backoff-s", "0.1", "--restart-backoff-max-s", "0.2", "--restart-max-failures", "2",
           "--health-timeout-s", "10", "--log-dir", str(tmp_path)]
    proc = await asyncio.create_subprocess_exec(*cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), 30)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    text = out.decode(errors="replace")
    assert proc.returncode == 1, text
    assert "worker p9: engine of p9 failed 2 times in a row (restart_max_failures=2); giving up" in text
    assert len(_launches(tmp_path)) == 2


async def test_flips_are_refused_when_the_engine_cannot_switch(tmp_path: Path) -> None:
    """SGLang 0.5.23 refuses role switches on nixl, so the worker does not pass --enable-pd-role-switch there and
    answers a flip itself, before draining anything."""
    settings = load_settings(WorkerSettings, instance_id="p0", role="prefill", engine_kind="sglang", model_path="m",
                             transfer_backend="nixl", log_dir=tmp_path)
    reply = await WorkerService(settings).roles.switch_role("decode", reason="test")
    assert not reply.ok and "launched without --enable-pd-role-switch (transfer_backend=nixl)" in reply.message
