"""Connectors on real NATS and etcd: LocalConnector starts and retires worker processes, the sidecar's ``retire``
verb drains (or refuses during a role switch), and KubernetesConnector's requests are checked against a local
HTTP server that answers like the API server (no real cluster here, and no mocked HTTP)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.util
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from services.planner.connectors import (
    DELETION_COST_ANNOTATION,
    ConnectorError,
    KubernetesConnector,
    KubernetesConnectorSettings,
    LocalConnector,
    LocalConnectorSettings,
    Workload,
    next_instance_id,
)
from services.worker.config import WorkerSettings
from services.worker.sidecar import WorkerService, worker_admin_service
from shared.bus import Bus
from shared.devservers import EtcdServer, NatsServer
from shared.errors import BusTimeout
from shared.policies.scaling import pick_retiree
from shared.protocol import (
    AdminCommand,
    AdminReply,
    ClusterSnapshot,
    InstanceInfo,
    InstanceLoad,
    LoadReport,
    RoleCommand,
    RoleCommandReply,
    Subjects,
)
from shared.protocol.messages import InstanceStatus, Role
from shared.runtime import EmbeddedHttpServer
from shared.settings import load_settings
from tests.integration.observer import start_observer
from tests.integration.waiting import process_alive, until


def _engine_sim_missing() -> bool:
    try:
        return importlib.util.find_spec("services.engine_sim.__main__") is None
    except ImportError:
        return True


needs_engine_sim = pytest.mark.skipif(_engine_sim_missing(), reason="services.engine_sim has no __main__")


_alive = process_alive


_until = functools.partial(until, timeout_s=20.0)


def test_next_instance_id_continues_after_the_highest() -> None:
    assert next_instance_id("decode", []) == "d0"
    assert next_instance_id("decode", ["p0", "p1", "d0", "d1"]) == "d2"
    assert next_instance_id("decode", ["d3", "d10", "p42", "dx", "d", "worker-d99", "d007"]) == "d11"
    assert next_instance_id("prefill", ["p0", "d7"]) == "p1"
    assert next_instance_id("null", ["p0"]) == "c0"


def _inst(instance_id: str, role: Role, status: InstanceStatus, running: int | None, used: int = 0) -> InstanceLoad:
    info = InstanceInfo(instance_id=instance_id, role=role, status=status, engine_kind="sim", url="http://x",
                        bootstrap_host="x", bootstrap_port=1, model="m", profile="p", kv_capacity_tokens=100,
                        max_running_requests=8, sidecar="h:1", registered_at_unix_s=0.0)
    load = None if running is None else LoadReport(instance_id=instance_id, role=role, status=status, ts_unix_s=0.0,
                                                   num_running_reqs=running, num_used_tokens=used)
    return InstanceLoad(info=info, load=load, load_age_s=None if load is None else 0.1)


def test_pick_retiree_takes_the_least_loaded_serving_instance() -> None:
    snapshot = ClusterSnapshot(ts_unix_s=0.0, series=[], instances=[
        _inst("d0", "decode", "ready", 5), _inst("d1", "decode", "ready", 2, used=900),
        _inst("d2", "decode", "ready", 2, used=100), _inst("d3", "decode", "draining", 0),
        _inst("p0", "prefill", "ready", 0)])
    assert pick_retiree(snapshot, "decode") == "d2"  # fewest requests, then fewest KV tokens; d3 is leaving
    fresh = ClusterSnapshot(ts_unix_s=0.0, series=[], instances=[*snapshot.instances, _inst("d9", "decode", "starting", None)])
    assert pick_retiree(fresh, "decode") == "d9"  # no load sample yet: nothing to drain
    assert pick_retiree(snapshot, "null") is None


# -- LocalConnector + retire verb ---------------------------------------------------------------------


@needs_engine_sim
@pytest.mark.asyncio
async def test_local_connector_starts_and_retires_a_decode_worker(nats_server: NatsServer, etcd_server: EtcdServer,
                                                                  tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="services.planner.connectors")
    ns = f"t{uuid.uuid4().hex[:8]}"
    obs = await start_observer(nats_server.url, etcd_server.url, ns, "none")
    settings = LocalConnectorSettings(namespace=ns, nats_url=nats_server.url, etcd_url=etcd_server.url,
                                      time_scale=0.0, log_dir=tmp_path, worker_args=["--load-interval-s", "0.1"])
    # "d4" stands for an engine someone else (poise up) runs: new ids continue after it.
    connector = LocalConnector(settings, existing_ids=lambda: {*obs.watcher.instances, "d4", "p9"})
    try:
        instance_id = await connector.start("decode")
        assert instance_id == "d5"
        await _until(lambda: instance_id in obs.watcher.instances)
        info = obs.watcher.instances[instance_id]
        assert (info.role, info.status, info.engine_kind) == ("decode", "ready", "sim")
        assert connector.running() == {"d5": "decode"}
        async with httpx.AsyncClient(timeout=2, trust_env=False) as http:
            assert (await http.get(info.url + "/health")).status_code == 200

            t0 = time.monotonic()
            await connector.retire(instance_id, drain_timeout_s=5)
            assert time.monotonic() - t0 < 25
            worker = connector.workers[instance_id]
            # The sidecar answered (after its drain) before it exited, and exited by itself: no SIGTERM needed.
            assert any(r.getMessage().startswith("retire of d5: drained in") for r in caplog.records)
            assert not any("SIGTERM" in r.getMessage() for r in caplog.records)
            assert worker.returncode == 0  # the clean stop path (as on SIGTERM), not a kill
            assert instance_id not in obs.watcher.instances  # deregistered before the reply, not by lease expiry
            assert connector.running() == {}
            with pytest.raises(httpx.ConnectError):  # the engine went with its sidecar
                await http.get(info.url + "/health")
        log_text = worker.log_path.read_text()
        assert "retire of d5: drained in" in log_text

        # A retired id is never handed out again, even though it left the registry.
        assert next_instance_id("decode", {*obs.watcher.instances, "d4", *connector.workers}) == "d6"
        with pytest.raises(ConnectorError, match="no sidecar of d77 answered"):
            await connector.retire("d77", drain_timeout_s=0.5)
    finally:
        await connector.close()
        await obs.close()
    assert all(w.returncode is not None for w in connector.workers.values())


@needs_engine_sim
@pytest.mark.asyncio
async def test_local_connector_close_stops_its_workers(nats_server: NatsServer, etcd_server: EtcdServer,
                                                       tmp_path: Path) -> None:
    ns = f"t{uuid.uuid4().hex[:8]}"
    obs = await start_observer(nats_server.url, etcd_server.url, ns, "none")
    connector = LocalConnector(LocalConnectorSettings(namespace=ns, nats_url=nats_server.url, etcd_url=etcd_server.url,
                                                      time_scale=0.0, log_dir=tmp_path))
    try:
        ids = [await connector.start("prefill"), await connector.start("decode")]
        assert ids == ["p0", "d0"]
        await _until(lambda: set(ids) <= set(obs.watcher.instances))
        await connector.close()
        assert all(w.returncode == 0 for w in connector.workers.values())
        await _until(lambda: not set(ids) & set(obs.watcher.instances), timeout_s=5)
        with pytest.raises(ConnectorError, match="closed"):
            await connector.start("decode")
    finally:
        await connector.close()
        await obs.close()


@needs_engine_sim
@pytest.mark.asyncio
async def test_retire_refused_during_a_role_switch_and_bounded_by_its_drain_timeout(
        nats_server: NatsServer, etcd_server: EtcdServer, tmp_path: Path) -> None:
    ns = f"t{uuid.uuid4().hex[:8]}"
    subjects = Subjects(ns)
    obs = await start_observer(nats_server.url, etcd_server.url, ns, "p0")
    worker = WorkerService(load_settings(
        WorkerSettings, instance_id="p0", role="prefill", engine_kind="sim", model="sim-model", time_scale=0.0,
        namespace=ns, nats_url=nats_server.url, etcd_url=etcd_server.url, load_interval_s=0.1, lease_ttl_s=2,
        health_timeout_s=30, stop_timeout_s=5, log_dir=tmp_path))

    async def admin(verb: str, timeout_s: float = 10.0, **args: str) -> AdminReply:
        return await obs.bus.request(subjects.admin(worker_admin_service("p0")), AdminCommand(verb=verb, args=args),
                                     AdminReply, timeout_s=timeout_s)

    http = httpx.AsyncClient(timeout=60, trust_env=False)
    pending: asyncio.Task[httpx.Response] | None = None
    try:
        await worker.start()
        # A prefill request whose decode peer never comes keeps the engine busy (up to its bootstrap timeout).
        body = {"model": "sim-model", "prompt": "hello " * 50, "max_tokens": 4, "bootstrap_host": "127.0.0.1",
                "bootstrap_port": worker.settings.bootstrap_port, "bootstrap_room": 4242, "rid": "held"}
        pending = asyncio.create_task(http.post(worker.url + "/v1/completions", json=body))
        await _until(lambda: worker.last_loads is not None and not worker.last_loads.idle)

        switch = asyncio.create_task(obs.bus.request(
            subjects.worker_command("p0"), RoleCommand(command_id="c1", new_role="decode", drain_timeout_s=3),
            RoleCommandReply, timeout_s=20))
        await _until(lambda: obs.watcher.instances.get("p0") is not None
                     and obs.watcher.instances["p0"].status == "draining")
        refused = await admin("retire", drain_timeout_s="5")
        assert not refused.ok and "role switch" in refused.message and "in progress" in refused.message
        switched = await switch
        assert not switched.ok and "not idle" in switched.message  # the drain timed out; still a prefill
        await _until(lambda: obs.watcher.instances.get("p0") is not None
                     and obs.watcher.instances["p0"].status == "ready")

        # Still busy: the retire waits its drain timeout, says so, and goes anyway.
        t0 = time.monotonic()
        retired = await admin("retire", drain_timeout_s="1")
        took = time.monotonic() - t0
        assert retired.ok, retired.message
        assert "drain timed out" in retired.message and "deregistered" in retired.message
        assert 1.0 <= took < 5.0
        assert "p0" not in obs.watcher.instances or (await obs.registry.get_instance("p0")) is None
        engine_pid = worker.engine_pid
        await asyncio.wait_for(worker.exit_requested.wait(), 10)  # what run_service waits on in the process
        await asyncio.wait_for(worker.stop(), 20)  # joins the stop the retire started
        assert engine_pid is not None and not _alive(engine_pid)
        with pytest.raises(BusTimeout):  # its admin subject is gone with it
            await admin("status", timeout_s=1.0)
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                await pending
        await http.aclose()
        await worker.stop()
        await obs.close()


# -- KubernetesConnector against a local API server ---------------------------------------------------


@dataclass
class _Workload:
    kind: str
    name: str
    pods: list[str]
    selector: str


@dataclass
class FakeApiServer:
    """Answers the few API-server routes the connector uses, keeps replicas and pods, records every request.

    Scale-down deletes like the controllers do: a ReplicaSet the pod with the lowest deletion cost, a
    StatefulSet its highest ordinal.
    """

    namespace: str
    workloads: dict[tuple[str, str], _Workload]
    requests: list[dict[str, Any]] = field(default_factory=list)
    annotations: dict[str, dict[str, str]] = field(default_factory=dict)
    _hashes: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    def app(self) -> FastAPI:
        app = FastAPI()
        ns = self.namespace

        async def record(request: Request) -> Any:
            body = await request.json() if request.method == "PATCH" else None
            self.requests.append({"method": request.method, "path": request.url.path,
                                  "query": dict(request.query_params), "auth": request.headers.get("authorization"),
                                  "content_type": request.headers.get("content-type"), "body": body})
            return body

        @app.api_route("/apis/apps/v1/namespaces/{namespace}/{kind}/{name}/scale", methods=["GET", "PATCH"])
        async def scale(namespace: str, kind: str, name: str, request: Request) -> JSONResponse:
            body = await record(request)
            wl = self.workloads.get((kind, name))
            if namespace != ns or wl is None:
                return JSONResponse({"kind": "Status", "code": 404}, status_code=404)
            if body is not None:
                self._resize(wl, int(body["spec"]["replicas"]))
            n = len(wl.pods)
            return JSONResponse({"kind": "Scale", "apiVersion": "autoscaling/v1",
                                 "metadata": {"name": name, "namespace": ns},
                                 "spec": {"replicas": n}, "status": {"replicas": n, "selector": wl.selector}})

        @app.get("/api/v1/namespaces/{namespace}/pods")
        async def pods(namespace: str, request: Request) -> JSONResponse:
            await record(request)
            selector = request.query_params.get("labelSelector")
            items = [{"metadata": {"name": p}} for wl in self.workloads.values() if wl.selector == selector
                     for p in wl.pods]
            return JSONResponse({"kind": "PodList", "items": items})

        @app.api_route("/api/v1/namespaces/{namespace}/pods/{pod}", methods=["GET", "PATCH"])
        async def pod(namespace: str, pod: str, request: Request) -> JSONResponse:
            body = await record(request)
            owner = next((wl for wl in self.workloads.values() if pod in wl.pods), None)
            if owner is None:
                return JSONResponse({"kind": "Status", "code": 404}, status_code=404)
            if body is not None:
                self.annotations.setdefault(pod, {}).update(body["metadata"]["annotations"])
            ref = ({"kind": "StatefulSet", "name": owner.name} if owner.kind == "statefulsets"
                   else {"kind": "ReplicaSet", "name": f"{owner.name}-5d4f8"})
            return JSONResponse({"kind": "Pod", "metadata": {"name": pod, "ownerReferences": [ref],
                                                             "annotations": self.annotations.get(pod, {})}})

        @app.get("/apis/apps/v1/namespaces/{namespace}/replicasets/{name}")
        async def replicaset(namespace: str, name: str, request: Request) -> JSONResponse:
            await record(request)
            return JSONResponse({"kind": "ReplicaSet", "metadata": {
                "name": name, "ownerReferences": [{"kind": "Deployment", "name": name.rsplit("-", 1)[0]}]}})

        return app

    def _resize(self, wl: _Workload, replicas: int) -> None:
        while len(wl.pods) < replicas:
            wl.pods.append(f"{wl.name}-{len(wl.pods)}" if wl.kind == "statefulsets"
                           else f"{wl.name}-5d4f8-x{next(self._hashes)}")
        while len(wl.pods) > replicas:
            if wl.kind == "statefulsets":
                wl.pods.pop()
            else:
                cost = {p: int(self.annotations.get(p, {}).get(DELETION_COST_ANNOTATION, "0")) for p in wl.pods}
                wl.pods.remove(min(wl.pods, key=lambda p: (cost[p], wl.pods.index(p))))

    def writes(self) -> list[dict[str, Any]]:
        return [r for r in self.requests if r["method"] == "PATCH"]


@pytest_asyncio.fixture
async def k8s(tmp_path: Path) -> AsyncIterator[tuple[FakeApiServer, EmbeddedHttpServer, Path]]:
    fake = FakeApiServer("serving", {
        ("deployments", "poise-prefill"): _Workload("deployments", "poise-prefill",
                                                   ["poise-prefill-5d4f8-a", "poise-prefill-5d4f8-b"],
                                                   "app=poise,role=prefill"),
        ("statefulsets", "poise-decode"): _Workload("statefulsets", "poise-decode", ["poise-decode-0", "poise-decode-1"],
                                                    "app=poise,role=decode"),
    })
    server = EmbeddedHttpServer(fake.app(), "127.0.0.1", 0, name="fake-k8s")
    await server.start()
    token = tmp_path / "token"
    token.write_text("sekret-1\n")
    yield fake, server, token
    await server.stop()


def _k8s_settings(server: EmbeddedHttpServer, token: Path, ns: str, nats_url: str) -> KubernetesConnectorSettings:
    return KubernetesConnectorSettings(
        namespace=ns, nats_url=nats_url, api_server=f"http://127.0.0.1:{server.port}", k8s_namespace="serving",
        token_path=token, ca_path=None, pod_wait_s=5,
        workloads={"prefill": Workload(kind="deployments", name="poise-prefill"),
                   "decode": Workload(kind="statefulsets", name="poise-decode")})


async def _fake_sidecars(bus: Bus, ns: str, ids: list[str], refuse: set[str] | None = None) -> list[tuple[str, AdminCommand]]:
    """Answer the retire verb on the given sidecars' control subjects (real NATS), recording what came."""
    seen: list[tuple[str, AdminCommand]] = []
    for instance_id in ids:
        async def handler(cmd: AdminCommand, instance_id: str = instance_id) -> AdminReply:
            seen.append((instance_id, cmd))
            if refuse and instance_id in refuse:
                return AdminReply(ok=False, message="retire refused: a role switch is in progress")
            return AdminReply(ok=True, message="drained in 0.01s; deregistered; stopping")

        await bus.serve(Subjects(ns).worker_control(instance_id), AdminCommand, handler,
                        error_reply=lambda m: AdminReply(ok=False, message=m))
    return seen


@pytest.mark.asyncio
async def test_kubernetes_start_patches_the_scale_subresource(k8s: Any, nats_server: NatsServer) -> None:
    fake, server, token = k8s
    connector = KubernetesConnector(_k8s_settings(server, token, "k8sns", nats_server.url))
    try:
        new_pod = await connector.start("prefill")
        assert new_pod == "poise-prefill-5d4f8-x1"  # the pod that appeared under the scale's selector
        scale = "/apis/apps/v1/namespaces/serving/deployments/poise-prefill/scale"
        assert [(r["method"], r["path"]) for r in fake.requests] == [
            ("GET", scale), ("GET", "/api/v1/namespaces/serving/pods"), ("PATCH", scale),
            ("GET", "/api/v1/namespaces/serving/pods")]
        patch = fake.writes()[0]
        assert patch["body"] == {"spec": {"replicas": 3}}
        assert patch["content_type"] == "application/merge-patch+json"
        assert all(r["auth"] == "Bearer sekret-1" for r in fake.requests)
        assert fake.requests[1]["query"] == {"labelSelector": "app=poise,role=prefill"}

        token.write_text("sekret-2")  # projected tokens rotate: each request reads the file again
        assert await connector.start("decode") == "poise-decode-2"  # a StatefulSet's next ordinal
        last = fake.writes()[-1]
        assert last["path"] == "/apis/apps/v1/namespaces/serving/statefulsets/poise-decode/scale"
        assert last["body"] == {"spec": {"replicas": 3}} and last["auth"] == "Bearer sekret-2"
        with pytest.raises(ConnectorError, match="no workload"):
            await connector.start("null")
    finally:
        await connector.close()


@pytest.mark.asyncio
async def test_kubernetes_retire_drains_marks_the_pod_and_scales_down(k8s: Any, nats_server: NatsServer) -> None:
    fake, server, token = k8s
    ns = f"t{uuid.uuid4().hex[:8]}"
    bus = Bus(nats_server.url, name="test-sidecars")
    await bus.connect()
    seen = await _fake_sidecars(bus, ns, ["poise-prefill-5d4f8-a", "poise-decode-0", "poise-decode-1"],
                                refuse={"poise-decode-1"})
    connector = KubernetesConnector(_k8s_settings(server, token, ns, nats_server.url), bus=bus)
    try:
        await connector.retire("poise-prefill-5d4f8-a", drain_timeout_s=7)
        assert [(i, c.verb, c.args) for i, c in seen] == [("poise-prefill-5d4f8-a", "retire", {"drain_timeout_s": "7"})]
        pod_path = "/api/v1/namespaces/serving/pods/poise-prefill-5d4f8-a"
        scale = "/apis/apps/v1/namespaces/serving/deployments/poise-prefill/scale"
        assert [(r["method"], r["path"]) for r in fake.requests] == [
            ("GET", pod_path), ("GET", "/apis/apps/v1/namespaces/serving/replicasets/poise-prefill-5d4f8"),
            ("GET", scale), ("PATCH", pod_path), ("GET", scale), ("PATCH", scale)]
        mark, down = fake.writes()
        assert mark["body"] == {"metadata": {"annotations": {DELETION_COST_ANNOTATION: "-1000000"}}}
        assert mark["content_type"] == down["content_type"] == "application/merge-patch+json"
        assert down["body"] == {"spec": {"replicas": 1}}
        # The deletion cost made the (emulated) ReplicaSet delete the retired pod, not its sibling.
        assert fake.workloads[("deployments", "poise-prefill")].pods == ["poise-prefill-5d4f8-b"]

        # A StatefulSet deletes its highest ordinal: retiring another pod is refused before any change.
        fake.requests.clear()
        with pytest.raises(ConnectorError, match="highest ordinal"):
            await connector.retire("poise-decode-0", drain_timeout_s=1)
        assert fake.writes() == [] and len(seen) == 1
        # A sidecar that refuses (a role switch is running) stops the retire before the scale-down.
        with pytest.raises(ConnectorError, match="refused to retire"):
            await connector.retire("poise-decode-1", drain_timeout_s=1)
        assert fake.writes() == [] and fake.workloads[("statefulsets", "poise-decode")].pods == [
            "poise-decode-0", "poise-decode-1"]
        with pytest.raises(ConnectorError, match="HTTP 404"):
            await connector.retire("no-such-pod", drain_timeout_s=1)
    finally:
        await connector.close()
        await bus.close()
