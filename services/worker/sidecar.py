"""The worker sidecar service: one per engine; it wires the engine's I/O to the bus and the registry.

- **start**: launch the engine (engine_sim or SGLang; launcher.py) or attach to one, wait for ``/health``,
  read ``/server_info``, register an :class:`InstanceInfo` in etcd under a lease (instance_record.py). For
  SGLang the engine environment's version is checked first, by running its interpreter.
- **load loop**: every ``load_interval_s`` publish a :class:`LoadReport` from ``/v1/loads`` on
  ``Subjects.load(id)`` (load_report.py; ``healthy=False`` with the error when the read fails or the
  snapshot stopped while the engine has work). An engine whose loads fail for ``unhealthy_after_s`` is out
  of the registry until it answers again.
- **role commands** on ``Subjects.worker_command(id)`` (role_switch.py, role_rules.py): drain the engine,
  ``POST /pd_role_switch`` (or restart it, to or from colocated), re-register in the new role.
- **supervision** (supervisor.py): a spawned engine that exits is deregistered and restarted with back-off;
  after ``restart_max_failures`` failures in a row ``fatal_error`` says why and the process exits with 1.
- **forecast relay** (forecast.py, engine_sim only): the planner's ISL forecast to the prefill policy.
- **retire** (the admin verb a connector's scale-in sends; role_switch.py): drain (bounded), deregister,
  answer, then stop the way SIGTERM does (``exit_requested``). **stop**: deregister first, then stop the engine.

Admin: ``Subjects.admin("worker-<id>")`` answers ``status``, ``set-role role=<prefill|decode|null>`` and
``retire [drain_timeout_s=<s>]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from typing import Any

import httpx

from services.worker.config import WorkerSettings
from services.worker.engine_waits import wait_healthy
from services.worker.forecast import ForecastHook, ForecastRelay, takes_forecast
from services.worker.instance_record import instance_info, registered_role
from services.worker.launcher import (
    EngineProcess,
    build_engine_command,
    check_sglang_version,
    engine_environment,
    installed_sglang_version,
    reclaim_ports,
    resolve_ports,
)
from services.worker.load_report import SampleCursor, hung_for
from services.worker.orphan import AdoptedEngine, pid_file, previous_engine, remove_pid_file, write_pid_file
from services.worker.role_switch import RoleSwitcher
from services.worker.supervisor import EngineSupervisor
from shared.bus import Bus, bus_from_settings
from shared.devservers import free_port, port_available
from shared.engine_client import EngineClient, EngineLoads, EngineServerInfo, engine_auth_headers
from shared.errors import ConfigError, EngineError, EngineTimeout, PoiseError
from shared.latency import LatencyProfile, load_profile
from shared.protocol import (
    InstanceInfo,
    Keys,
    LoadReport,
    RoleCommand,
    ServiceStatus,
    Subjects,
)
from shared.protocol.messages import InstanceStatus, PlannerEvent, Role
from shared.registry import ETCD_ERRORS, InstanceRegistration, Registry, registry_from_settings
from shared.runtime import (
    AdminEndpoint,
    AsyncServiceMixin,
    StopOnce,
    Uptime,
    cancel_and_wait,
    replica_id,
)

log = logging.getLogger(__name__)

ADOPT_HEALTH_TIMEOUT_S = 30.0  # a previous run's engine that is not healthy by then is replaced


def worker_admin_service(instance_id: str) -> str:
    """The admin service name of one sidecar (``Subjects.admin(...)`` takes it)."""
    return f"worker-{instance_id}"


def engine_url(settings: WorkerSettings) -> str:
    """Where the engine answers: the attached engine's URL, or the spawned one's port on ``public_host``."""
    if settings.engine_kind == "attach":
        return (settings.engine_url or "").rstrip("/")
    return f"http://{settings.public_host}:{settings.engine_port}"


class WorkerService(AsyncServiceMixin):
    """The sidecar of one engine (see the module docstring for what it does)."""

    name = "worker"

    def __init__(self, settings: WorkerSettings, *, exit_event: asyncio.Event | None = None) -> None:
        self._requested = settings  # as given: which ports are the operator's and which were picked here
        self.settings = resolve_ports(settings, free_port)
        s = self.settings
        self.instance_id = s.instance_id
        self.subjects = Subjects(s.namespace)
        self.keys = Keys(s.namespace)
        self.url = engine_url(s)
        self.role: Role | None = s.role
        self.status: InstanceStatus = "starting"
        self.sglang_version: str | None = None  # what the engine environment has (sglang kind)
        # Set when supervision gave up on the engine; the process then exits with status 1 (see __main__).
        self.fatal_error: str | None = None
        self.last_loads: EngineLoads | None = None
        self._samples = SampleCursor()  # each engine prefill sample is published once
        self.last_error: str | None = None
        self._replica_id = replica_id()
        self._uptime = Uptime()
        self._bus: Bus | None = None
        self._registry: Registry | None = None
        self._registration: InstanceRegistration | None = None
        self._http: httpx.AsyncClient | None = None
        self._client: EngineClient | None = None
        self._admin: AdminEndpoint | None = None
        self._control: AdminEndpoint | None = None
        self._command_sub: Any = None
        self._forecast_sub: Any = None
        self._forecast: ForecastHook | None = None  # engine_sim's: the planner's ISL forecast, relayed
        self._engine: EngineProcess | None = None  # an AdoptedEngine: one a previous run left running
        self._adopted = False  # the engine is one a previous run of this sidecar left running
        self._engine_info: EngineServerInfo | None = None
        self._profile: LatencyProfile | None = None
        self._registered = False
        self._supervision = EngineSupervisor(
            self.settings, engine=lambda: self._engine, stopping=lambda: self._stop.stopping,
            take_down=self._take_down, bring_up=self._bring_up, give_up=self._give_up, note_error=self._note_error)
        self._supervisor: asyncio.Task[None] | None = None  # runs the supervision of a spawned engine
        self._failing_since: float | None = None  # monotonic time loads started failing
        self._health_deregistered = False
        self._reg_lock = asyncio.Lock()
        self._tasks: list[asyncio.Task[None]] = []
        self._stop = StopOnce()
        # Set when the worker wants its process to end (after a retire): ``__main__`` hands it to run_service,
        # so a retire leaves through the same stop path as SIGTERM.
        self.exit_requested = exit_event or asyncio.Event()
        self.roles = RoleSwitcher(self)

    # -- lifecycle ---------------------------------------------------------------------------------
    @property
    def restarts(self) -> int:
        return self._supervision.restarts

    def _note_error(self, message: str) -> None:
        self.last_error = message

    @property
    def engine_pid(self) -> int | None:
        return self._engine.pid if self._engine is not None else None

    async def start(self) -> None:
        s = self.settings
        if s.engine_kind == "sglang":  # first: a wrong environment should fail before anything else happens
            python = s.sglang_python or sys.executable
            self.sglang_version = await installed_sglang_version(python, env=s.engine_env)
            check_sglang_version(self.sglang_version, python, allow_unpinned=s.sglang_allow_unpinned)
            log.info("worker %s: sglang %s at %s", self.instance_id, self.sglang_version, python)
        try:
            self._profile = load_profile(s.profile)
        except ConfigError as exc:
            if s.engine_kind == "sim":
                raise
            log.warning("no latency profile for capacity fallbacks: %s", exc)
        self._bus = bus_from_settings(s, name=f"poise-worker-{self.instance_id}")
        await self._bus.connect()
        self._registry = registry_from_settings(s, self.keys)
        await self._registry.connect()
        self._registration = InstanceRegistration(self._registry, ttl_s=s.lease_ttl_s)
        self._http = httpx.AsyncClient(timeout=s.engine_timeout_s, trust_env=False,  # no proxies to engines
                                       headers=engine_auth_headers(s.engine_api_key))
        self._client = EngineClient(self.url, self._http, engine_id=self.instance_id, timeout_s=s.engine_timeout_s)

        if s.engine_kind != "attach":
            await self._launch()
        await self._wait_healthy()
        await self._read_engine_info()
        async with self._reg_lock:
            await self._register("ready")

        self._command_sub = await self._bus.serve(
            self.subjects.worker_command(self.instance_id), RoleCommand, self.roles.on_command,
            error_reply=self.roles.command_error, concurrent=True,
        )
        self._admin = AdminEndpoint(self._bus, self.subjects, worker_admin_service(self.instance_id), self.service_status)
        self._admin.register("set-role", self.roles.admin_set_role, "set-role role=prefill|decode|null [drain_timeout_s=<s>] (null: colocated, a restart)")
        self._admin.register("retire", self.roles.admin_retire, "retire [drain_timeout_s=<s>]: drain, deregister, exit")
        await self._admin.start()
        # The planner's connector retires engines here: the admin subject is the operator's only.
        self._control = AdminEndpoint(self._bus, self.subjects, worker_admin_service(self.instance_id),
                                      self.service_status, subject=self.subjects.worker_control(self.instance_id))
        self._control.register("retire", self.roles.admin_retire, "retire [drain_timeout_s=<s>]: drain, deregister, exit")
        await self._control.start()
        self._tasks.append(asyncio.create_task(self._load_loop(), name=f"loads-{self.instance_id}"))
        if takes_forecast(s.engine_kind, self._engine_info.raw if self._engine_info is not None else {}):
            self._forecast = ForecastHook(ForecastRelay(ttl_s=s.forecast_ttl_s), self._http, lambda: self.url,
                                          timeout_s=s.engine_timeout_s, instance_id=self.instance_id)
            self._forecast_sub = await self._bus.subscribe(self.subjects.planner_events(), PlannerEvent,
                                                           self._on_planner_event)
        else:  # said once: an operator comparing engine kinds should see why dopd-length gets no forecast here
            log.info("worker %s: %s engine has no ISL forecast hook; the planner's forecasts are not relayed",
                     self.instance_id, s.engine_kind)
        if self._engine is not None:
            self._start_supervisor()
        log.info("worker %s: %s engine %s registered as %s", self.instance_id, s.engine_kind, self.url, self.role)

    async def stop(self) -> None:
        await self._stop.run(self._stop_once)

    async def _stop_once(self) -> None:
        await cancel_and_wait(self._tasks)
        self._tasks.clear()
        for endpoint in (self._admin, self._control):
            if endpoint is not None:
                await endpoint.stop()
        for sub in (self._command_sub, self._forecast_sub):
            if sub is not None:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
        if self._registration is not None:  # first, so gateways stop sending before the engine goes away
            async with self._reg_lock:  # a role command still running cannot re-register after this
                with contextlib.suppress(*ETCD_ERRORS):
                    await self._registration.deregister()
                self._registered = False
        if self._engine is not None:
            pid = self._engine.pid
            await self._engine.stop(self.settings.stop_timeout_s)
            remove_pid_file(pid_file(self.settings.log_dir, self.instance_id), pid)
        if self._http is not None:
            await self._http.aclose()
        if self._bus is not None:
            await self._bus.close()
        if self._registry is not None:
            await self._registry.close()

    # -- engine process ----------------------------------------------------------------------------
    async def _launch(self) -> None:
        """Start the engine, or adopt the one a previous run of this sidecar left running (services/worker/orphan.py)."""
        argv = build_engine_command(self.settings, role=self.role)
        assert argv is not None
        log_path = self.settings.log_dir / f"engine-{self.instance_id}.log"
        pids = pid_file(self.settings.log_dir, self.instance_id)
        previous = previous_engine(pids)
        if previous is not None:
            orphan = AdoptedEngine(*previous, log_path)
            if previous[1] == argv and await self._adopt(orphan):
                return
            log.warning("stopping engine pid %d that a previous run of %s left running", previous[0], self.instance_id)
            await orphan.stop(self.settings.stop_timeout_s)
        self._adopted = False
        argv = self._reclaim_ports() or argv
        engine = EngineProcess(argv, log_path, env=engine_environment(self.settings))
        self._engine = engine
        await engine.start()
        assert engine.pid is not None
        write_pid_file(pids, engine.pid, argv)

    def _reclaim_ports(self) -> list[str] | None:
        """Re-pick the picked ports another process took since (:func:`reclaim_ports`); the engine command for
        the new ones, or None when they are unchanged. The engine is not registered here, so the new URL is
        the one registered next."""
        settings = reclaim_ports(self._requested, self.settings, port_available, free_port)
        if settings is self.settings:
            return None
        log.warning("worker %s: a port picked for the engine was taken since (engine %s, bootstrap %s); launching "
                    "on engine %s, bootstrap %s", self.instance_id, self.settings.engine_port,
                    self.settings.bootstrap_port, settings.engine_port, settings.bootstrap_port)
        self.settings = settings
        self.url = engine_url(settings)
        if self._http is not None:
            self._client = EngineClient(self.url, self._http, engine_id=self.instance_id,
                                        timeout_s=settings.engine_timeout_s)
        argv = build_engine_command(settings, role=self.role)
        assert argv is not None
        return argv

    async def _adopt(self, orphan: AdoptedEngine) -> bool:
        """Take over a previous run's engine if it answers /health soon; its role is read from it (it may have flipped)."""
        log.warning("worker %s: adopting engine pid %s that a previous run left running", self.instance_id, orphan.pid)
        self._engine, self._adopted = orphan, True
        try:
            await self._wait_healthy(min(self.settings.health_timeout_s, ADOPT_HEALTH_TIMEOUT_S))
        except (EngineError, EngineTimeout) as exc:
            log.warning("worker %s: the previous engine is not healthy (%s); starting a new one", self.instance_id, exc)
            return False
        return True

    async def _wait_healthy(self, timeout_s: float | None = None) -> None:
        assert self._client is not None
        await wait_healthy(self._client, self._engine, instance_id=self.instance_id, url=self.url,
                           timeout_s=self.settings.health_timeout_s if timeout_s is None else timeout_s)

    async def _read_engine_info(self) -> None:
        assert self._client is not None
        try:
            self._engine_info = await self._client.server_info()
        except EngineError as exc:
            log.warning("cannot read /server_info (%s); capacity from /v1/loads or the profile", exc)
            self._engine_info = None
        with contextlib.suppress(EngineError):
            self.last_loads = await self._client.loads()
        self.role = registered_role(self.role, self.last_loads, self._engine_info, url=self.url,
                                    engine_decides=self.settings.engine_kind == "attach" or self._adopted)

    async def _take_down(self) -> None:
        """The engine exited: out of the registry until a new one is up."""
        async with self._reg_lock:
            await self._deregister()

    async def _bring_up(self) -> None:
        """A new engine: launched, healthy, read and registered; the load loop's failure count starts over."""
        await self._launch()
        await self._wait_healthy()
        await self._read_engine_info()
        async with self._reg_lock:
            await self._register("ready")
        self._failing_since = None
        self._health_deregistered = False

    def _give_up(self, failures: int) -> None:
        """Stop restarting: record why and ask the process to exit (``__main__`` then returns 1)."""
        engine = self._engine
        where = f"; last lines of {engine.log_path}:\n{engine.tail()}" if engine is not None else ""
        self.fatal_error = (f"engine of {self.instance_id} failed {failures} times in a row (restart_max_failures="
                            f"{self.settings.restart_max_failures}); giving up. Last error: {self.last_error}{where}")
        log.critical("%s", self.fatal_error)
        self.exit_requested.set()

    # -- registration ------------------------------------------------------------------------------
    def _instance_info(self, status: InstanceStatus) -> InstanceInfo:
        return instance_info(self.settings, url=self.url, role=self.role or "null", status=status,
                             sidecar=self._replica_id, info=self._engine_info, loads=self.last_loads,
                             profile=self._profile)

    async def _register(self, status: InstanceStatus) -> None:
        """(Re-)write the instance record; the caller holds ``_reg_lock``."""
        assert self._registration is not None
        await self._registration.register(self._instance_info(status))
        self.status = status
        self._registered = True

    async def _deregister(self) -> None:
        """Remove the instance record; the caller holds ``_reg_lock``."""
        assert self._registration is not None
        self.status = "starting"
        if self._registered:
            with contextlib.suppress(*ETCD_ERRORS):
                await self._registration.deregister()
            self._registered = False

    async def _set_status(self, status: InstanceStatus) -> None:
        async with self._reg_lock:
            if self._registered:
                await self._register(status)

    # -- load loop ---------------------------------------------------------------------------------
    async def _load_loop(self) -> None:
        s = self.settings
        assert self._client is not None and self._bus is not None
        while True:
            t0 = time.monotonic()
            try:
                loads = await self._client.loads()
                hung = hung_for(loads, time.time(), s.stalled_after_s)
                if hung is not None:
                    raise EngineError(self.instance_id, f"the engine's scheduler has published no load snapshot for "
                                      f"{hung:.0f}s while it has work (a hung step)")
            except EngineError as exc:
                self.last_error = str(exc)
                report = LoadReport(instance_id=self.instance_id, role=self.role or "null", status=self.status,
                                    ts_unix_s=time.time(), healthy=False, error=str(exc))
                await self._on_loads_failed(t0)
            else:
                self.last_loads = loads
                report = self._samples.report(self.instance_id, self.role or "null", self.status, loads, time.time())
                await self._on_loads_ok()
                if self._forecast is not None:
                    await self._forecast.expire()
            try:
                await self._bus.publish(self.subjects.load(self.instance_id), report)
            except PoiseError as exc:  # not connected; nats-py reconnects by itself
                log.debug("load report not published: %s", exc)
            except Exception as exc:  # nats-py raises its own errors while reconnecting
                log.warning("load report not published: %s", exc)
            await asyncio.sleep(max(0.0, s.load_interval_s - (time.monotonic() - t0)))

    async def _on_loads_failed(self, now: float) -> None:
        if self._failing_since is None:
            self._failing_since = now
        if (self._registered and not self._supervision.restarting and not self.roles.lock.locked()
                and now - self._failing_since >= self.settings.unhealthy_after_s):
            log.warning("engine of %s has not answered /v1/loads for %.1fs; deregistering until it does",
                        self.instance_id, now - self._failing_since)
            async with self._reg_lock:
                await self._deregister()
            self._health_deregistered = True

    async def _on_loads_ok(self) -> None:
        self._failing_since = None
        if self._health_deregistered and not self._supervision.restarting:
            try:
                async with self._reg_lock:
                    await self._register("ready")
                self._health_deregistered = False
                log.info("engine of %s answers again; registered", self.instance_id)
            except ETCD_ERRORS as exc:
                log.warning("re-registration failed: %s", exc)

    # -- planner forecast ---------------------------------------------------------------------------
    async def _on_planner_event(self, event: PlannerEvent, _subject: str) -> None:
        if self._forecast is not None:
            await self._forecast.on_event(event, self.role)

    def _start_supervisor(self) -> None:
        self._supervisor = asyncio.create_task(self._supervision.run(), name=f"supervise-{self.instance_id}")
        self._tasks.append(self._supervisor)

    async def _relaunch(self, new_role: Role) -> dict[str, Any]:
        """Restart the engine in ``new_role``: SGLang serves colocated or disaggregated as it was launched, so a
        move between the two is a restart (the engine is drained and deregistered-for-routing by then). The
        supervisor pauses meanwhile, and watches the new engine after; one that does not come up is its to
        restart, in the new role."""
        if self._supervisor is not None:
            await cancel_and_wait([self._supervisor])
            self._tasks.remove(self._supervisor)
            self._supervisor = None
        self.role = new_role
        try:
            engine = self._engine
            if engine is not None:
                pid = engine.pid
                await engine.stop(self.settings.stop_timeout_s)
                remove_pid_file(pid_file(self.settings.log_dir, self.instance_id), pid)
            await self._launch()
            await self._wait_healthy()
            await self._read_engine_info()
        finally:
            if self._engine is not None and not self._stop.stopping:
                self._start_supervisor()
        return {"message": f"engine restarted as {new_role}"}

    def service_status(self) -> ServiceStatus:
        loads = self.last_loads
        return ServiceStatus(
            service="worker", replica_id=self._replica_id, is_leader=False, policy=self.settings.engine_kind,
            policy_note=f"sidecar of {self.instance_id}: {self.settings.engine_kind} engine at {self.url}",
            uptime_s=self._uptime(),
            details={
                "instance_id": self.instance_id, "role": self.role, "status": self.status,
                "registered": self._registered, "url": self.url, "engine_pid": self.engine_pid,
                "restarts": self.restarts, "switching": self.roles.switching,
                "retiring": self.roles.retiring, "last_error": self.last_error, "fatal_error": self.fatal_error,
                "sglang_version": self.sglang_version,
                "running_reqs": loads.num_running_reqs if loads else None,
                "waiting_reqs": loads.num_waiting_reqs if loads else None,
                "token_usage": loads.token_usage if loads else None,
            },
        )
