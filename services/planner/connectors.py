"""Connectors: where the planner starts and stops engines when a scaling policy moves the replica counts.

Like Dynamo's planner connectors (../shared/anchors.md §2.3), a :class:`Connector` only executes: the
policy decides how many engines of each role should run, the planner turns the difference into
``start(role)`` / ``retire(instance_id)`` calls (scale-in picks the least-loaded instance,
:func:`shared.policies.scaling.pick_retiree`), and the registry (etcd) stays the one truth about what runs: a started engine
counts once its sidecar has registered it, a retired one is gone once its key is.

- :class:`LocalConnector` spawns ``python -m services.worker`` processes (each spawns its engine_sim), as
  ``poise up`` does, and retires them through the sidecar's ``retire`` admin verb (drain, deregister,
  exit), reaping the process afterwards.
- :class:`KubernetesConnector` PATCHes the ``scale`` subresource of one Deployment or StatefulSet per role
  (Dynamo's KubernetesConnector patches its DynamoGraphDeployment instead). Not run against a real cluster
  here: its tests check the requests it sends against a local HTTP server that answers like the API server.

Retiring always goes through the sidecar first, so the engine finishes its requests before it disappears.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import signal
import ssl
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal, Protocol

import httpx
from pydantic import BaseModel, ConfigDict, Field

from shared.bus import Bus
from shared.devservers import free_port
from shared.errors import BusTimeout, PoiseError
from shared.latency import DEFAULT_PROFILE
from shared.protocol import AdminCommand, AdminReply, Subjects
from shared.protocol.messages import Role
from shared.protocol.permissions import worker_user
from shared.security import Credentials, without_secrets

log = logging.getLogger(__name__)

ROLE_PREFIX: dict[Role, str] = {"prefill": "p", "decode": "d", "null": "c"}
"""Instance id prefix per role, as ``poise up`` names its engines (p0, d1, c0)."""

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
"""Where Kubernetes mounts a pod's service-account token, CA bundle and namespace."""

DELETION_COST_ANNOTATION = "controller.kubernetes.io/pod-deletion-cost"
MERGE_PATCH = "application/merge-patch+json"


class ConnectorError(PoiseError):
    """A start or retire could not be carried out (refused by the sidecar, or the platform said no)."""


class Connector(Protocol):
    """Starts and retires engines (engine + worker sidecar) of one role; what the planner's scaling calls."""

    name: str

    async def start(self, role: Role) -> str:
        """Start one engine of ``role``; return its instance id. It registers itself in etcd once ready."""
        ...

    async def retire(self, instance_id: str, drain_timeout_s: float) -> None:
        """Drain the instance (at most ``drain_timeout_s``), deregister it and stop it; raise ConnectorError."""
        ...

    async def close(self) -> None:
        """Release what the connector holds (LocalConnector: stops every process it started)."""
        ...


# -- shared helpers ------------------------------------------------------------------------------


def next_instance_id(role: Role, taken: Iterable[str]) -> str:
    """``<prefix><N>`` with N one above the highest number already taken for that prefix (0 when none).

    Continuing after the highest rather than filling gaps keeps a retired id from being reused while other
    services may still hold its old records (load series, events).
    """
    prefix = ROLE_PREFIX[role]
    pattern = re.compile(rf"^{re.escape(prefix)}(\d+)$")
    numbers = [int(m.group(1)) for m in map(pattern.match, taken) if m is not None]
    return f"{prefix}{max(numbers) + 1 if numbers else 0}"


async def request_retire(bus: Bus, subjects: Subjects, instance_id: str, drain_timeout_s: float,
                         reply_margin_s: float) -> AdminReply | None:
    """Send the sidecar's ``retire`` verb and wait for its answer; ``None`` when no sidecar answers.

    Raises :class:`ConnectorError` when the sidecar refuses (a role switch in progress, already retiring).
    The wait covers the whole drain: the sidecar answers only once it is idle (or the drain timed out).
    """
    command = AdminCommand(verb="retire", args={"drain_timeout_s": f"{drain_timeout_s:g}"})
    try:
        reply = await bus.request(subjects.worker_control(instance_id), command, AdminReply,
                                  timeout_s=drain_timeout_s + reply_margin_s)
    except BusTimeout as exc:
        log.warning("retire of %s: %s", instance_id, exc)
        return None
    if not reply.ok:
        raise ConnectorError(f"{instance_id} refused to retire: {reply.message}")
    log.info("retire of %s: %s", instance_id, reply.message)
    return reply


class _BusSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    namespace: str = Field(default="default", description="Poise namespace (NATS subjects of the sidecars).")
    nats_url: str = Field(default="nats://127.0.0.1:4222", description="NATS URL; used when no Bus is handed in.")
    nats_user: str | None = Field(default=None, description="NATS user, when the server requires auth.")
    nats_password: str | None = Field(default=None, description="NATS password for nats_user.")
    retire_reply_margin_s: float = Field(
        default=10.0, gt=0.0,
        description="How long past the drain timeout to wait for the sidecar's retire reply (deregistration and "
                    "the reply itself).")


class _OwnBus:
    """A Bus handed in by the caller (the planner's), or one connected on first use and closed by close()."""

    def __init__(self, settings: _BusSettings, bus: Bus | None, name: str) -> None:
        self._settings = settings
        self._bus = bus
        self._owned = bus is None
        self._name = name
        self._lock = asyncio.Lock()

    async def get(self) -> Bus:
        async with self._lock:
            if self._bus is None:
                s = self._settings
                bus = Bus(s.nats_url, name=self._name, user=s.nats_user, password=s.nats_password)
                await bus.connect()
                self._bus = bus
            return self._bus

    async def close(self) -> None:
        bus, self._bus = self._bus, None
        if bus is not None and self._owned:
            await bus.close()


# -- local processes -----------------------------------------------------------------------------


class LocalConnectorSettings(_BusSettings):
    """How :class:`LocalConnector` launches workers: the flags ``poise up`` gives its engine_sim workers."""

    etcd_url: str = Field(default="http://127.0.0.1:2379", description="etcd URL the workers register in.")
    etcd_user: str | None = Field(default=None, description="etcd user the workers log in as (without worker_credentials_file).")
    etcd_password: str | None = Field(default=None, description="etcd password for etcd_user.")
    worker_credentials_file: Path | None = Field(
        default=None,
        description="JSON credentials (shared.security.Credentials) with one NATS user per worker id this connector "
                    "may start (worker-<id>) and the etcd user; `poise up` writes one. Unset = the workers get the "
                    "connector's own NATS and etcd credentials.")
    profile: str = Field(default=DEFAULT_PROFILE, description="Latency profile of the simulated engines (name/path).")
    model: str = Field(default="meta-llama/Llama-3.1-8B-Instruct", description="Served model name.")
    time_scale: float = Field(default=1.0, ge=0.0, description="engine_sim compute time multiplier (0 = free compute).")
    seed: int = Field(default=0, description="Seed of the first started engine; each later one gets the next seed.")
    host: str = Field(default="127.0.0.1", description="Address the engines bind to and advertise.")
    log_dir: Path = Field(default=Path(".poise/connector-logs"),
                          description="Where worker-<id>.log and engine-<id>.log go.")
    worker_args: list[str] = Field(default_factory=list, description="Extra flags for every worker, e.g. "
                                   "[\"--load-interval-s\", \"0.1\"].")
    exit_timeout_s: float = Field(default=30.0, gt=0.0,
                                  description="After the retire reply, how long the worker may take to stop its engine "
                                              "and exit before it gets SIGTERM.")
    stop_timeout_s: float = Field(default=20.0, gt=0.0,
                                  description="Seconds between SIGTERM and SIGKILL (also in close()).")


@dataclass
class LocalWorker:
    """One worker process this connector started."""

    instance_id: str
    role: Role
    proc: asyncio.subprocess.Process
    log_path: Path
    log_file: IO[bytes] = field(repr=False)
    retiring: bool = False
    engine_pid: int | None = None  # from the sidecar's status, for the SIGKILL fallback (own session)

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode


def _open_log(path: Path, argv: list[str]) -> IO[bytes]:
    path.parent.mkdir(parents=True, exist_ok=True)
    log_file = open(path, "ab")  # noqa: SIM115 - closed when the process has exited
    log_file.write(f"--- starting: {' '.join(argv)}\n".encode())
    log_file.flush()
    return log_file


class LocalConnector:
    """Starts engine_sim workers as local processes; retires them through the sidecar's ``retire`` verb.

    ``existing_ids`` returns the ids already in use (the registry's instances, e.g. ``lambda:
    watcher.instances``), so new ids continue after ``poise up``'s p0/d1; ids this connector handed out are
    never reused. It can retire any worker on the bus, but reaps only the processes it started.
    """

    name = "local"

    def __init__(self, settings: LocalConnectorSettings, *, bus: Bus | None = None,
                 existing_ids: Callable[[], Iterable[str]] | None = None) -> None:
        self.settings = settings
        self.subjects = Subjects(settings.namespace)
        self._bus = _OwnBus(settings, bus, "poise-local-connector")
        self._existing_ids = existing_ids or (lambda: ())
        self._issued: set[str] = set()
        self._given_ports: set[int] = set()
        self.workers: dict[str, LocalWorker] = {}
        self._watchers: set[asyncio.Task[None]] = set()
        self._closing = False

    def running(self) -> dict[str, Role]:
        """Instance id -> role of the started processes that have not exited."""
        return {w.instance_id: w.role for w in self.workers.values() if w.returncode is None}

    def _free_port(self) -> int:
        # Handed out before the worker binds it: remember it so two starts in a row never get the same one.
        while True:
            port = free_port(self.settings.host)
            if port not in self._given_ports:
                self._given_ports.add(port)
                return port

    def _argv(self, instance_id: str, role: Role) -> list[str]:
        s = self.settings
        argv = [sys.executable, "-m", "services.worker", "--namespace", s.namespace, "--nats-url", s.nats_url,
                "--etcd-url", s.etcd_url, "--instance-id", instance_id, "--role", role, "--engine-kind", "sim",
                "--engine-host", s.host, "--engine-port", str(self._free_port()), "--profile", s.profile,
                "--model", s.model, "--time-scale", str(s.time_scale), "--seed", str(s.seed + len(self._issued)),
                "--log-dir", str(s.log_dir)]
        if role != "null":  # decode engines get one too: a flip to prefill needs it
            argv += ["--bootstrap-port", str(self._free_port())]
        return argv + list(s.worker_args)

    def _env(self, instance_id: str) -> dict[str, str]:
        """The worker's environment: ours without secrets, plus its own credentials (env, not flags: ps shows flags)."""
        s = self.settings
        env = {**without_secrets(dict(os.environ)), "PYTHONUNBUFFERED": "1"}
        nats_user, nats_password, etcd_user, etcd_password = s.nats_user, s.nats_password, s.etcd_user, s.etcd_password
        engine_key = None
        if s.worker_credentials_file is not None:
            creds = Credentials.read(s.worker_credentials_file)
            nats_user = worker_user(instance_id)
            if nats_user not in creds.nats:
                raise ConnectorError(f"{s.worker_credentials_file} has no NATS user for worker {instance_id} "
                                     f"({nats_user}); `poise up` makes users for --spare-worker-ids more engines per role")
            nats_password = creds.nats[nats_user]
            etcd_user, etcd_password = creds.etcd_login(instance_id)
            engine_key = creds.engine_api_key
        for name, value in (("NATS_USER", nats_user), ("NATS_PASSWORD", nats_password), ("ETCD_USER", etcd_user),
                            ("ETCD_PASSWORD", etcd_password), ("ENGINE_API_KEY", engine_key)):
            if value:
                env[f"POISE_WORKER_{name}"] = value
        return env

    async def start(self, role: Role) -> str:
        if self._closing:
            raise ConnectorError("the connector is closed")
        # Pick and reserve the id before the first await, so concurrent starts never pick the same one.
        instance_id = next_instance_id(role, {*self._existing_ids(), *self._issued})
        self._issued.add(instance_id)
        argv = self._argv(instance_id, role)
        env = self._env(instance_id)
        log_path = self.settings.log_dir / f"worker-{instance_id}.log"
        log_file = await asyncio.to_thread(_open_log, log_path, argv)
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=log_file, stderr=asyncio.subprocess.STDOUT,
                env=env,
                start_new_session=True,  # a Ctrl-C in the planner's terminal must not skip the worker's drain
            )
        except OSError as exc:
            log_file.close()
            raise ConnectorError(f"cannot start worker {instance_id}: {exc}") from exc
        worker = LocalWorker(instance_id, role, proc, log_path, log_file)
        self.workers[instance_id] = worker
        task = asyncio.create_task(self._watch(worker), name=f"connector-watch-{instance_id}")
        self._watchers.add(task)
        task.add_done_callback(self._watchers.discard)
        log.info("started %s worker %s (pid %d), log %s", role, instance_id, proc.pid, log_path)
        return instance_id

    async def _watch(self, worker: LocalWorker) -> None:
        code = await worker.proc.wait()
        worker.log_file.close()
        if worker.retiring or self._closing:
            log.info("worker %s exited with code %s", worker.instance_id, code)
        else:  # the registry loses it through the lease; the planner sees a replica short and starts another
            log.warning("worker %s exited unexpectedly with code %s; see %s", worker.instance_id, code, worker.log_path)

    async def retire(self, instance_id: str, drain_timeout_s: float) -> None:
        worker = self.workers.get(instance_id)
        if worker is not None:
            if worker.returncode is not None:
                return  # already gone; its lease takes the registration with it
            worker.retiring = True
        try:
            reply = await request_retire(await self._bus.get(), self.subjects, instance_id, drain_timeout_s,
                                         self.settings.retire_reply_margin_s)
        except ConnectorError:
            if worker is not None:
                worker.retiring = False
            raise
        if worker is None:
            if reply is None:
                raise ConnectorError(f"no sidecar of {instance_id} answered, and this connector did not start it")
            return  # someone else's process (e.g. poise up's): it exits by itself; not ours to reap
        if reply is not None and reply.status is not None:
            pid = reply.status.details.get("engine_pid")
            worker.engine_pid = pid if isinstance(pid, int) else None
        grace = self.settings.exit_timeout_s if reply is not None else 0.0
        if reply is None:
            log.warning("worker %s did not answer the retire; stopping it with SIGTERM (no drain)", instance_id)
        await self._reap(worker, grace)

    async def _reap(self, worker: LocalWorker, grace_s: float) -> None:
        """Wait ``grace_s`` for the worker to exit by itself, then SIGTERM, then SIGKILL."""
        proc = worker.proc
        if grace_s > 0 and await _exited(proc, grace_s):
            return
        if proc.returncode is not None:
            return
        if grace_s > 0:
            log.warning("worker %s still running %.0fs after retiring; sending SIGTERM", worker.instance_id, grace_s)
        _signal(proc.pid, signal.SIGTERM, group=False)  # the worker's own handler: deregister, stop its engine
        if await _exited(proc, self.settings.stop_timeout_s):
            return
        log.error("worker %s ignored SIGTERM for %.0fs; killing it", worker.instance_id, self.settings.stop_timeout_s)
        _signal(proc.pid, signal.SIGKILL, group=True)
        if worker.engine_pid is not None:  # the engine runs in its own session: SIGKILL of the worker misses it
            _signal(worker.engine_pid, signal.SIGKILL, group=True)
        await _exited(proc, 5.0)

    async def close(self) -> None:
        """Stop every process this connector started (SIGTERM: deregister and stop, no drain)."""
        self._closing = True
        alive = [w for w in self.workers.values() if w.returncode is None]
        await asyncio.gather(*(self._reap(w, 0.0) for w in alive))
        for task in list(self._watchers):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(task, 1.0)
        await self._bus.close()


async def _exited(proc: asyncio.subprocess.Process, timeout_s: float) -> bool:
    """Whether ``proc`` exits within ``timeout_s`` (the wait is shielded: the watcher task waits on it too)."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.shield(proc.wait()), timeout_s)
    return proc.returncode is not None


def _signal(pid: int, sig: signal.Signals, *, group: bool) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if group:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)


# -- Kubernetes ----------------------------------------------------------------------------------


class Workload(BaseModel):
    """The Deployment or StatefulSet whose replicas are one role's engines (one engine + sidecar per pod)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["deployments", "statefulsets"] = Field(default="deployments",
                                                         description="Resource (plural) of the workload.")
    name: str = Field(description="Name of the Deployment/StatefulSet.")


class KubernetesConnectorSettings(_BusSettings):
    """Where the API server is, how to authenticate, and which workload holds each role.

    Defaults are the in-cluster ones: the planner's pod runs under a service account allowed to get/patch
    ``deployments/scale`` (or ``statefulsets/scale``), get ``replicasets`` and get/list/patch ``pods``.
    """

    api_server: str = Field(default="https://kubernetes.default.svc", description="API server base URL.")
    k8s_namespace: str | None = Field(default=None,
                                      description="Namespace of the workloads; unset = the service account's (the "
                                                  "namespace file next to its token).")
    token_path: Path | None = Field(default=SA_DIR / "token",
                                    description="Bearer token file, re-read on every request (projected tokens "
                                                "rotate); unset = no Authorization header (kubectl proxy).")
    ca_path: Path | None = Field(default=SA_DIR / "ca.crt",
                                 description="CA bundle of the API server (https only); unset = system CAs.")
    workloads: dict[Role, Workload] = Field(description="The workload of each role, e.g. {\"prefill\": {\"name\": "
                                            "\"poise-prefill\"}, \"decode\": {\"name\": \"poise-decode\"}}.")
    sidecar_drain: bool = Field(default=True,
                                description="Send the sidecar's retire verb (drain, deregister) before scaling down; "
                                            "off = rely on the pod's own SIGTERM handling.")
    deletion_cost: int = Field(default=-1_000_000, ge=-(2**31), lt=2**31,
                               description=f"{DELETION_COST_ANNOTATION} set on the retiring pod: below the others' "
                                           "(default 0), so its ReplicaSet deletes it first.")
    pod_wait_s: float = Field(default=30.0, gt=0.0,
                              description="How long start() waits for a Deployment's new pod to appear (its name is "
                                          "the instance id).")
    request_timeout_s: float = Field(default=10.0, gt=0.0, description="Timeout of each API request.")


_ORDINAL = re.compile(r"^(?P<base>.+)-(?P<ordinal>\d+)$")


class KubernetesConnector:
    """Scales one Deployment/StatefulSet per role through its ``scale`` subresource.

    Assumes each pod runs one engine and its sidecar with ``--instance-id`` = the pod's name (downward API:
    ``POISE_WORKER_INSTANCE_ID`` from ``metadata.name``), so an instance id names its pod.

    - ``start(role)``: read the scale, PATCH ``spec.replicas`` + 1 (``application/merge-patch+json``).
      The new pod's name is the instance id: ``<name>-<N>`` for a StatefulSet; for a Deployment the pod
      that appears under the scale's label selector (polled up to ``pod_wait_s``).
    - ``retire(id)``: find the pod's workload (owner references), ask its sidecar to retire (drain,
      deregister, exit), set ``controller.kubernetes.io/pod-deletion-cost`` low on that pod, then PATCH
      ``spec.replicas`` - 1. Kubernetes picks which pod a scale-down deletes: a ReplicaSet prefers the
      lowest deletion cost (best effort, beta since 1.22), a StatefulSet always deletes its highest ordinal,
      so on a StatefulSet only that pod can be retired (anything else is refused before any change).
    - Between the sidecar's exit and the scale-down the kubelet restarts the container (restartPolicy
      Always); the new sidecar registers only once its engine is healthy, which for SGLang takes far longer
      than the scale-down, but a fast engine may show up again for a moment.
    - Start and retire of one role are serialised (read-modify-write of the count); a change made by someone
      else between the read and the PATCH is overwritten.
    """

    name = "kubernetes"

    def __init__(self, settings: KubernetesConnectorSettings, *, bus: Bus | None = None) -> None:
        self.settings = settings
        self.subjects = Subjects(settings.namespace)
        self._bus = _OwnBus(settings, bus, "poise-k8s-connector")
        self._http: httpx.AsyncClient | None = None
        self._k8s_ns: str | None = settings.k8s_namespace
        self._locks: dict[str, asyncio.Lock] = {}
        self._client_lock = asyncio.Lock()

    # -- API plumbing ------------------------------------------------------------------------------
    async def _client(self) -> httpx.AsyncClient:
        async with self._client_lock:
            if self._http is None:
                s = self.settings
                verify: ssl.SSLContext | bool = True
                if s.ca_path is not None and s.api_server.startswith("https"):
                    verify = await asyncio.to_thread(ssl.create_default_context, cafile=str(s.ca_path))
                self._http = httpx.AsyncClient(base_url=s.api_server.rstrip("/"), verify=verify,
                                               timeout=s.request_timeout_s, trust_env=False)
            return self._http

    async def _namespace(self) -> str:
        if self._k8s_ns is None:
            path = SA_DIR / "namespace"
            try:
                self._k8s_ns = (await asyncio.to_thread(path.read_text)).strip()
            except OSError as exc:
                raise ConnectorError(f"k8s_namespace is unset and {path} is unreadable: {exc}") from exc
        return self._k8s_ns

    async def _headers(self, content_type: str | None = None) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if content_type:
            headers["Content-Type"] = content_type
        token_path = self.settings.token_path
        if token_path is not None:
            try:
                token = (await asyncio.to_thread(token_path.read_text)).strip()
            except OSError as exc:
                raise ConnectorError(f"cannot read the service-account token {token_path}: {exc}") from exc
            headers["Authorization"] = f"Bearer {token}"
        return headers

    async def _call(self, method: str, path: str, *, body: dict[str, Any] | None = None,
                    params: dict[str, str] | None = None) -> dict[str, Any]:
        client = await self._client()
        headers = await self._headers(MERGE_PATCH if body is not None else None)
        try:
            resp = await client.request(method, path, json=body, params=params, headers=headers)
        except httpx.HTTPError as exc:
            raise ConnectorError(f"{method} {path}: {exc}") from exc
        if resp.status_code >= 400:
            raise ConnectorError(f"{method} {path}: HTTP {resp.status_code}: {resp.text[:300]}")
        data = resp.json()
        if not isinstance(data, dict):
            raise ConnectorError(f"{method} {path}: expected a JSON object")
        return data

    async def _scale_path(self, workload: Workload) -> str:
        return f"/apis/apps/v1/namespaces/{await self._namespace()}/{workload.kind}/{workload.name}/scale"

    async def _replicas(self, workload: Workload) -> tuple[int, str]:
        scale = await self._call("GET", await self._scale_path(workload))
        return int(scale.get("spec", {}).get("replicas") or 0), str(scale.get("status", {}).get("selector") or "")

    async def _set_replicas(self, workload: Workload, replicas: int) -> None:
        await self._call("PATCH", await self._scale_path(workload), body={"spec": {"replicas": replicas}})

    async def _pod_names(self, selector: str) -> set[str]:
        pods = await self._call("GET", f"/api/v1/namespaces/{await self._namespace()}/pods",
                                params={"labelSelector": selector})
        return {str(p["metadata"]["name"]) for p in pods.get("items", [])}

    def _lock(self, workload: Workload) -> asyncio.Lock:
        return self._locks.setdefault(f"{workload.kind}/{workload.name}", asyncio.Lock())

    def _workload(self, role: Role) -> Workload:
        workload = self.settings.workloads.get(role)
        if workload is None:
            raise ConnectorError(f"no workload is configured for role {role}")
        return workload

    # -- Connector ---------------------------------------------------------------------------------
    async def start(self, role: Role) -> str:
        workload = self._workload(role)
        async with self._lock(workload):
            replicas, selector = await self._replicas(workload)
            before = await self._pod_names(selector) if workload.kind == "deployments" and selector else set()
            await self._set_replicas(workload, replicas + 1)
            log.info("scaled %s/%s to %d replicas (%s +1)", workload.kind, workload.name, replicas + 1, role)
            if workload.kind == "statefulsets":
                return f"{workload.name}-{replicas}"  # StatefulSets add the next ordinal
            if not selector:
                raise ConnectorError(f"{workload.name}'s scale has no status.selector: cannot tell its new pod")
            deadline = time.monotonic() + self.settings.pod_wait_s
            while True:
                new = sorted(await self._pod_names(selector) - before)
                if new:
                    return new[0]
                if time.monotonic() >= deadline:
                    raise ConnectorError(f"{workload.name} scaled to {replicas + 1}, but no new pod appeared within "
                                         f"{self.settings.pod_wait_s:.0f}s")
                await asyncio.sleep(0.5)

    async def _owner(self, pod_name: str) -> Workload:
        """The Deployment/StatefulSet that owns the pod (through its ReplicaSet for a Deployment)."""
        ns = await self._namespace()
        pod = await self._call("GET", f"/api/v1/namespaces/{ns}/pods/{pod_name}")
        for ref in pod.get("metadata", {}).get("ownerReferences", []):
            if ref.get("kind") == "StatefulSet":
                return Workload(kind="statefulsets", name=str(ref["name"]))
            if ref.get("kind") == "ReplicaSet":
                rs = await self._call("GET", f"/apis/apps/v1/namespaces/{ns}/replicasets/{ref['name']}")
                for rs_ref in rs.get("metadata", {}).get("ownerReferences", []):
                    if rs_ref.get("kind") == "Deployment":
                        return Workload(kind="deployments", name=str(rs_ref["name"]))
        raise ConnectorError(f"pod {pod_name} belongs to no Deployment or StatefulSet")

    async def retire(self, instance_id: str, drain_timeout_s: float) -> None:
        workload = await self._owner(instance_id)
        if workload not in self.settings.workloads.values():
            raise ConnectorError(f"pod {instance_id} belongs to {workload.kind}/{workload.name}, which no role uses")
        async with self._lock(workload):
            replicas, _ = await self._replicas(workload)
            if workload.kind == "statefulsets":
                m = _ORDINAL.match(instance_id)
                if m is None or m["base"] != workload.name or int(m["ordinal"]) != replicas - 1:
                    raise ConnectorError(f"a StatefulSet scales down from its highest ordinal "
                                         f"({workload.name}-{replicas - 1}); retiring {instance_id} would delete "
                                         "another pod")
            if self.settings.sidecar_drain:
                reply = await request_retire(await self._bus.get(), self.subjects, instance_id, drain_timeout_s,
                                             self.settings.retire_reply_margin_s)
                if reply is None:
                    log.warning("no sidecar of %s answered the retire; scaling down without a drain", instance_id)
            if workload.kind == "deployments":
                ns = await self._namespace()
                await self._call("PATCH", f"/api/v1/namespaces/{ns}/pods/{instance_id}", body={
                    "metadata": {"annotations": {DELETION_COST_ANNOTATION: str(self.settings.deletion_cost)}}})
            # Re-read: the drain can take a minute, and someone else (kubectl, an HPA) may have scaled meanwhile.
            replicas, _ = await self._replicas(workload)
            await self._set_replicas(workload, max(replicas - 1, 0))
            log.info("scaled %s/%s to %d replicas (retired %s)", workload.kind, workload.name, max(replicas - 1, 0),
                     instance_id)

    async def close(self) -> None:
        http, self._http = self._http, None
        if http is not None:
            await http.aclose()
        await self._bus.close()
