"""Inventory → deployment: the plan (every container of every node) and the files that carry it out.

Everything here is pure: :func:`build_plan` and :func:`render` read nothing but their arguments (no
environment variables, no files), so the same inventory always gives the same files. The deployment is one
docker-compose project per node, every container on the host network:

- the control-plane node runs nats-server (JetStream; its users from ``nats/nats-server.conf``), etcd, the
  one-shot ``etcd-auth`` (turns etcd's auth on), monitor, planner, migrator, gateway and, unless
  ``control_plane.monitoring`` is off, Prometheus and Grafana;
- every GPU node runs one container per engine: the worker sidecar (``python -m services.worker
  --engine-kind sglang``), which launches SGLang inside the same container on the GPUs the container is given.

Every container connects as its own NATS user (and etcd's ``poise`` user); the secrets are compose variables
(``${VAR:?...}``) read from each node's ``.env`` (:mod:`services.deploy.secrets`), so the files themselves
hold none. Each Poise command line is checked by the settings parser of the service that will read it, and the SGLang
command shown in the plan is :func:`services.worker.launcher.build_engine_command` applied to the worker's own
settings: the flags live in one place, the launcher.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

from services.deploy import secrets
from services.deploy.inventory import Inventory, InventoryError, Node, engine_ids, engine_slots
from services.gateway.config import GatewaySettings
from services.migrator.config import MigratorSettings
from services.monitor.config import MonitorSettings
from services.planner.config import PlannerSettings
from services.worker.config import WorkerSettings
from services.worker.launcher import build_engine_command
from shared.policies.late_binding import replica_depth
from shared.policies.poise_mix import POISE_MIX
from shared.settings import parse_settings

ENGINE_PYTHON = "python3"  # the interpreter in the engine image (deploy/Dockerfile.sglang)
POISE_PYTHON = "python"  # the interpreter in the Poise image (deploy/Dockerfile)
LOG_DIR = "/var/log/poise"
HF_CACHE = "/root/.cache/huggingface"
NGINX_CONF = "/etc/nginx/conf.d/default.conf"
DATASOURCE_UID = "poise-prometheus"  # deploy/grafana/dashboards/poise.json refers to it


@dataclass(frozen=True)
class Container:
    """One container of the plan (a compose service)."""

    name: str
    image: str
    command: tuple[str, ...]
    ports: tuple[tuple[str, int], ...] = ()  # (what, port) on the node: every container uses the host network
    gpus: tuple[int, ...] = ()  # host GPU indices given to the container
    env: tuple[tuple[str, str], ...] = ()
    volumes: tuple[str, ...] = ()
    role: str | None = None  # engines: prefill or decode (the role it starts in)
    engine_command: tuple[str, ...] | None = None  # engines: the SGLang command the sidecar launches inside
    healthcheck: tuple[str, ...] | None = None
    depends_on: tuple[str, ...] = ()  # healthy-before-start, same node
    one_shot: bool = False  # runs once to completion (etcd-auth): never restarted


@dataclass(frozen=True)
class NodePlan:
    node: Node
    containers: tuple[Container, ...]
    control_plane: bool

    @property
    def engines(self) -> tuple[Container, ...]:
        return tuple(c for c in self.containers if c.engine_command is not None)


@dataclass(frozen=True)
class Plan:
    inventory: Inventory
    nodes: tuple[NodePlan, ...]  # control-plane node first (apply order), then the others in inventory order

    @property
    def engines(self) -> list[Container]:
        return [c for n in self.nodes for c in n.engines]

    def remote_dir(self) -> str:
        return f"{self.inventory.remote_dir.rstrip('/')}/{self.inventory.name}"


@dataclass(frozen=True)
class Assets:
    """Files copied to the control-plane node as they are (read from ``deploy/`` by the CLI)."""

    dashboard_json: str
    dashboard_provider_yaml: str


@dataclass(frozen=True)
class Rendering:
    plan: Plan
    files: dict[str, str] = field(default_factory=dict)  # path relative to the output directory -> content


# -- settings checks (the services' own parsers, without reading the environment) ---------------------------
def _init_settings_only(cls: type[BaseSettings], settings_cls: type[BaseSettings],
                        init_settings: PydanticBaseSettingsSource, env_settings: PydanticBaseSettingsSource,
                        dotenv_settings: PydanticBaseSettingsSource,
                        file_secret_settings: PydanticBaseSettingsSource) -> tuple[PydanticBaseSettingsSource, ...]:
    return (init_settings,)


@functools.cache
def _env_free(cls: type[BaseSettings]) -> type[BaseSettings]:
    """``cls`` reading only its arguments: the plan must not depend on the POISE_* variables of this shell."""
    return type(cls.__name__, (cls,), {"settings_customise_sources": classmethod(_init_settings_only),
                                       "__module__": cls.__module__})


def parse_flags(cls: type[BaseSettings], argv: Sequence[str], prog: str = "") -> BaseSettings:
    """``argv`` through the service's own flag parser (:func:`shared.settings.parse_settings`).

    Raises ``ValueError`` with the parser's message instead of exiting.
    """
    err = io.StringIO()
    prog = prog or cls.__name__
    try:
        with contextlib.redirect_stderr(err):
            return parse_settings(_env_free(cls), list(argv), prog=prog)  # type: ignore[type-var]
    except SystemExit:
        text = err.getvalue()
        text = text.split(f"{prog}: error:", 1)[-1]  # argparse: usage lines, then "<prog>: error: <message>"
        text = re.sub(r"\s*\[type=[^\]]*\]|\s*For further information visit \S+", "", text)  # pydantic's trailers
        raise ValueError(" ".join(text.split()) or "invalid flags") from None


def flags(fields: dict[str, Any]) -> list[str]:
    """``{"engine_port": 30000}`` → ``["--engine-port", "30000"]`` (the form :func:`parse_settings` reads)."""
    out: list[str] = []
    for name, value in fields.items():
        flag = "--" + name.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list | dict):
            out += [flag, json.dumps(value)]
        else:
            out += [flag, str(value)]
    return out


# -- the plan ----------------------------------------------------------------------------------------------
def build_plan(inv: Inventory, source: str = "inventory") -> Plan:
    """Place the engines and write every container's command; raises :class:`InventoryError` for values the
    services would refuse (unknown policy, bad extra flags, ...)."""
    problems: list[str] = []
    ctrl = inv.control_node
    common = {"namespace": inv.namespace, "nats_url": f"nats://{ctrl.address}:{inv.ports.nats}",
              "etcd_url": f"http://{ctrl.address}:{inv.ports.etcd_client}"}
    control = _control_containers(inv, common, problems)
    engines = _engine_containers(inv, common, problems)
    if problems:
        raise InventoryError(f"{source} (as the services read it)", problems)
    nodes = [NodePlan(node=ctrl, containers=tuple(control + engines[ctrl.name]), control_plane=True)]
    nodes += [NodePlan(node=n, containers=tuple(engines[n.name]), control_plane=False)
              for n in inv.nodes if n.name != ctrl.name]
    return Plan(inventory=inv, nodes=tuple(nodes))


def _poise_services(inv: Inventory, common: dict[str, str]
                    ) -> dict[str, tuple[type[BaseSettings], list[str], tuple[tuple[str, int], ...]]]:
    """Each Poise service container's settings class, command-line flags and published ports."""
    cp = inv.control_plane
    plan_fields = {"profile": inv.model.profile, "slo_ttft_s": cp.slo_ttft_s, "slo_tpot_s": cp.slo_tpot_s}
    services: dict[str, tuple[type[BaseSettings], list[str], tuple[tuple[str, int], ...]]] = {
        "monitor": (MonitorSettings, flags({**common, "http_host": "0.0.0.0", "http_port": inv.ports.monitor}),
                    (("metrics", inv.ports.monitor),)),
        "planner": (PlannerSettings, flags({**common, **plan_fields, "policy": cp.planner_policy}) + cp.planner_args, ()),
        "migrator": (MigratorSettings, flags({**common, "policy": cp.migration_policy,
                                              "mechanism": cp.migration_mechanism}), ()),
    }
    for name, port in gateway_ports(inv).items():
        # Behind nginx a replica listens on the loopback only: clients meet nginx's header and body timeouts.
        host = "0.0.0.0" if cp.gateway_replicas == 1 else "127.0.0.1"
        services[name] = (GatewaySettings, flags({**common, **plan_fields, "dispatch_policy": cp.dispatch_policy,
                                                  "host": host, "port": port,
                                                  # as poise up: a migrator may move non-streaming requests too,
                                                  # and the poise planner brings early rejection and late
                                                  # binding in FlowPrefill's order
                                                  "move_non_streaming": cp.migration_policy != "none" or None,
                                                  # the replicas share each engine's late-binding depth
                                                  "late_binding_depth": (replica_depth(POISE_MIX.late_binding_depth,
                                                                                       cp.gateway_replicas)
                                                                         if cp.gateway_replicas > 1 else None),
                                                  **(POISE_MIX.gateway_rules() if cp.planner_policy == "poise" else {})})
                          + cp.gateway_args, (("HTTP API + metrics", port),))
    return services


def _control_containers(inv: Inventory, common: dict[str, str], problems: list[str]) -> list[Container]:
    """NATS, etcd and the Poise services (and nginx, monitoring), on the control node; every service's flags
    are parsed as it would parse them, and what it would refuse goes to ``problems``."""
    worker_ids = [i for i, _ in zip(engine_ids(inv), engine_slots(inv), strict=False)]
    control: list[Container] = [_nats(inv, worker_ids), _etcd(inv, inv.control_node), _etcd_auth(inv, worker_ids)]
    for name, (cls, argv, ports) in _poise_services(inv, common).items():
        try:
            parse_flags(cls, argv)
        except ValueError as exc:
            problems.append(f"control_plane ({name}): {exc}")
        service = "gateway" if name.startswith("gateway") else name
        env = {"PYTHONUNBUFFERED": "1", **secrets.service_env(f"POISE_{service.upper()}_", service)}
        if service == "gateway":
            env |= secrets.gateway_api_keys_env()
        control.append(Container(
            name=name, image=inv.images.poise, command=(POISE_PYTHON, "-m", f"services.{service}", *argv), ports=ports,
            env=tuple(env.items()), depends_on=("nats-server", "etcd", "etcd-auth")))
    if inv.control_plane.gateway_replicas > 1:
        control.append(_gateway_lb(inv))
    if inv.control_plane.monitoring:
        control += _monitoring(inv)
    return control


def _engine_containers(inv: Inventory, common: dict[str, str], problems: list[str]) -> dict[str, list[Container]]:
    """One worker container per engine, by node; the same mistake on every engine is one problem line."""
    engines: dict[str, list[Container]] = {n.name: [] for n in inv.nodes}
    worker_problems: dict[str, list[str]] = {}  # message -> engines
    for instance_id, (node, gpus) in zip(engine_ids(inv), engine_slots(inv), strict=False):
        role = "prefill" if instance_id.startswith("p") else "decode"
        k = len(engines[node.name])
        fields = {**common, "instance_id": instance_id, "role": role, "engine_kind": "sglang",
                  "engine_host": "0.0.0.0", "advertise_host": node.address,
                  "engine_port": inv.ports.engine_base + k, "bootstrap_port": inv.ports.bootstrap_base + k,
                  "model_path": inv.model.path, "model": inv.served_model, "tp": inv.model.tp,
                  "transfer_backend": inv.transfer.backend, "ib_device": inv.transfer.ib_device,
                  "mem_fraction_static": inv.model.mem_fraction_static, "profile": inv.model.profile,
                  "extra_args": inv.model.engine_args or None, "log_dir": LOG_DIR, **inv.worker_settings}
        argv = flags(fields)
        try:
            settings = parse_flags(WorkerSettings, argv)
        except ValueError as exc:
            worker_problems.setdefault(str(exc), []).append(instance_id)
            settings = None
        engine_cmd = build_engine_command(settings, python=ENGINE_PYTHON) if isinstance(settings, WorkerSettings) else None
        engines[node.name].append(Container(
            name=f"worker-{instance_id}", image=inv.images.engine,
            command=(ENGINE_PYTHON, "-m", "services.worker", *argv),
            ports=(("engine HTTP + metrics", inv.ports.engine_base + k), ("KV bootstrap", inv.ports.bootstrap_base + k)),
            gpus=gpus, role=role, engine_command=tuple(engine_cmd or ()),
            env=(("PYTHONUNBUFFERED", "1"), ("HF_TOKEN", "${HF_TOKEN:-}"), *secrets.worker_env(instance_id).items()),
            volumes=(f"{inv.model.cache_dir}:{HF_CACHE}", f"{LOG_DIR}/{inv.name}:{LOG_DIR}")))
    problems += [f"engines {', '.join(ids)} (worker settings): {msg}" for msg, ids in worker_problems.items()]
    return engines


def gateway_ports(inv: Inventory) -> dict[str, int]:
    """The gateway containers and their ports: ``gateway`` on ports.gateway alone, or ``gateway``,
    ``gateway-2``, ... from ports.gateway_replica_base behind nginx."""
    n = inv.control_plane.gateway_replicas
    if n == 1:
        return {"gateway": inv.ports.gateway}
    return {("gateway" if k == 0 else f"gateway-{k + 1}"): inv.ports.gateway_replica_base + k for k in range(n)}


def _gateway_lb(inv: Inventory) -> Container:
    return Container(name="gateway-lb", image=inv.images.nginx, command=(),
                     ports=(("HTTP API (load balancer)", inv.ports.gateway),),
                     volumes=(f"./nginx/gateway-lb.conf:{NGINX_CONF}:ro",),
                     depends_on=tuple(gateway_ports(inv)))


def gateway_lb_config(inv: Inventory) -> str:
    """nginx in front of the gateway replicas (host network: they listen on the loopback ports of
    :func:`gateway_ports`). Its limits are the gateways' own (their flags in the inventory), so a request nginx passes is one a
    gateway would take, and a client trickling its headers is cut after 10 s (uvicorn has no header timeout).
    A request is sent to another gateway only when nothing reached the first (error or connect timeout), never
    a second generation of one request; streams pass unbuffered."""
    g = parse_flags(GatewaySettings, list(inv.control_plane.gateway_args))
    assert isinstance(g, GatewaySettings)
    max_body_kib = max(1, -(-g.max_body_bytes // 1024))
    servers = "\n".join(f"    server 127.0.0.1:{port} max_fails=1 fail_timeout=5s;" for port in gateway_ports(inv).values())
    return f"""# Rendered by python -m services.deploy: the gateways' load balancer (see gateway_lb_config).
upstream poise_gateways {{
{servers}
    keepalive 64;
}}

server {{
    listen {inv.ports.gateway};
    client_max_body_size {max_body_kib}k;
    client_header_timeout 10s;
    client_body_timeout {g.body_timeout_s:g}s;

    location / {{
        proxy_pass http://poise_gateways;
        proxy_http_version 1.1;
        proxy_set_header Connection "";
        proxy_set_header Host $host;
        proxy_buffering off;
        proxy_read_timeout {g.request_timeout_s:g}s;
        proxy_next_upstream error timeout;
        proxy_next_upstream_tries 2;
    }}
}}
"""


def _nats(inv: Inventory, worker_ids: list[str]) -> Container:
    p = inv.ports
    return Container(
        name="nats-server", image=inv.images.nats,
        command=("nats-server", "-a", "0.0.0.0", "-p", str(p.nats), "-m", str(p.nats_monitor),
                 "-js", "-sd", "/data/jetstream", "-c", secrets.NATS_CONFIG_PATH),
        ports=(("client", p.nats), ("monitoring", p.nats_monitor)),
        env=tuple(secrets.nats_server_env(inv.namespace, worker_ids).items()),
        volumes=("nats-data:/data", f"./nats/nats-server.conf:{secrets.NATS_CONFIG_PATH}:ro"),
        healthcheck=("CMD", "wget", "-q", "-O", "/dev/null", f"http://127.0.0.1:{p.nats_monitor}/healthz"))


def _etcd_auth(inv: Inventory, worker_ids: list[str]) -> Container:
    """Turns etcd's authentication on once etcd is healthy (services/deploy/etcd_auth.py), then exits."""
    workers = tuple(arg for i in worker_ids for arg in ("--worker", i))
    return Container(
        name="etcd-auth", image=inv.images.poise,
        command=(POISE_PYTHON, "-m", "services.deploy.etcd_auth", "--endpoint", f"127.0.0.1:{inv.ports.etcd_client}",
                 "--namespace", inv.namespace, *workers),
        env=tuple(secrets.etcd_auth_env(worker_ids).items()), depends_on=("etcd",), one_shot=True)


def _etcd(inv: Inventory, ctrl: Node) -> Container:
    p = inv.ports
    peer = f"http://{ctrl.address}:{p.etcd_peer}"
    return Container(
        name="etcd", image=inv.images.etcd,
        command=("/usr/local/bin/etcd", "--name", inv.name, "--data-dir", "/etcd-data",
                 "--listen-client-urls", f"http://0.0.0.0:{p.etcd_client}",
                 "--advertise-client-urls", f"http://{ctrl.address}:{p.etcd_client}",
                 "--listen-peer-urls", f"http://0.0.0.0:{p.etcd_peer}", "--initial-advertise-peer-urls", peer,
                 "--initial-cluster", f"{inv.name}={peer}", "--log-level", "warn"),
        ports=(("client", p.etcd_client), ("peer", p.etcd_peer)), volumes=("etcd-data:/etcd-data",),
        # `endpoint status`, not `health`: with auth on, health needs a user; status answers anyone.
        healthcheck=("CMD", "/usr/local/bin/etcdctl", f"--endpoints=http://127.0.0.1:{p.etcd_client}",
                     "endpoint", "status"))


def _monitoring(inv: Inventory) -> list[Container]:
    p = inv.ports
    return [
        Container(name="prometheus", image=inv.images.prometheus,
                  command=("--config.file=/etc/prometheus/prometheus.yml", f"--web.listen-address=:{p.prometheus}",
                           "--storage.tsdb.path=/prometheus"),
                  ports=(("web", p.prometheus),),
                  volumes=("./prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro", "prometheus-data:/prometheus")),
        Container(name="grafana", image=inv.images.grafana, command=(), ports=(("web", p.grafana),),
                  env=(("GF_SERVER_HTTP_PORT", str(p.grafana)), ("GF_AUTH_ANONYMOUS_ENABLED", "true"),
                       ("GF_AUTH_ANONYMOUS_ORG_ROLE", "Viewer"),
                       ("GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH", "/var/lib/grafana/dashboards/poise.json")),
                  volumes=("./grafana/provisioning:/etc/grafana/provisioning:ro",
                           "./grafana/dashboards:/var/lib/grafana/dashboards:ro", "grafana-data:/var/lib/grafana"),
                  depends_on=("prometheus",)),
    ]


# -- files ---------------------------------------------------------------------------------------------------
class _Flow(list[Any]):
    """A list written in YAML flow style (one line per command where it fits)."""


class _Dumper(yaml.SafeDumper):
    pass


_Dumper.add_representer(_Flow, lambda d, v: d.represent_sequence("tag:yaml.org,2002:seq", v, flow_style=True))


def _yaml(data: Any) -> str:
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120)


def compose_service(c: Container, *, gpu_node_rdma: bool) -> dict[str, Any]:
    """The compose-spec service for one container (host network; GPUs by device id)."""
    svc: dict[str, Any] = {"image": c.image}
    if c.command:
        svc["command"] = _Flow(c.command)
    svc["network_mode"] = "host"
    svc["restart"] = "no" if c.one_shot else "unless-stopped"
    if c.env:
        svc["environment"] = dict(c.env)
    if c.volumes:
        svc["volumes"] = list(c.volumes)
    if c.healthcheck:
        svc["healthcheck"] = {"test": _Flow(c.healthcheck), "interval": "5s", "timeout": "3s", "retries": 12}
    if c.depends_on:
        svc["depends_on"] = {d: {"condition": _CONDITIONS.get(d, "service_started")} for d in c.depends_on}
    if c.engine_command is not None:
        svc["init"] = True  # tini reaps SGLang's children; SIGTERM still reaches the sidecar, which stops the engine
        svc["ipc"] = "host"  # SGLang's shared memory (and NCCL)
        svc["stop_grace_period"] = "60s"  # the sidecar drains nothing on stop, but SGLang takes a while to exit
        svc["ulimits"] = {"memlock": -1, "stack": 67108864}
        if gpu_node_rdma:
            svc["cap_add"] = ["IPC_LOCK"]
            svc["devices"] = ["/dev/infiniband:/dev/infiniband"]
        svc["deploy"] = {"resources": {"reservations": {"devices": [
            {"driver": "nvidia", "device_ids": [str(g) for g in c.gpus], "capabilities": ["gpu"]}]}}}
    return svc


_CONDITIONS = {"nats-server": "service_healthy", "etcd": "service_healthy",
               "etcd-auth": "service_completed_successfully"}


def compose_file(plan: Plan, node: NodePlan, source: str) -> str:
    rdma = plan.inventory.transfer.ib_device is not None
    services = {c.name: compose_service(c, gpu_node_rdma=rdma) for c in node.containers}
    volumes = sorted({v.split(":", 1)[0] for c in node.containers for v in c.volumes
                      if not v.startswith(("/", "./"))})
    doc: dict[str, Any] = {"name": plan.inventory.name, "services": services}
    if volumes:
        doc["volumes"] = {v: {} for v in volumes}
    header = (f"# Node {node.node.name} ({node.node.address}) of the Poise deployment {plan.inventory.name!r}.\n"
              f"# Rendered by `python -m services.deploy render --inventory {source}`: edit the inventory, not this file.\n")
    return header + _yaml(doc)


def prometheus_config(plan: Plan) -> str:
    inv = plan.inventory
    ctrl = inv.control_node
    engines = []
    for node in plan.nodes:
        for c in node.engines:
            port = dict(c.ports)["engine HTTP + metrics"]
            engines.append({"targets": [f"{node.node.address}:{port}"],
                            "labels": {"engine_id": c.name.removeprefix("worker-"), "node": node.node.name}})
    doc = {
        "global": {"scrape_interval": "5s", "evaluation_interval": "5s"},
        "scrape_configs": [
            # Prometheus runs on the control-plane node: replicas behind nginx listen on its loopback.
            {"job_name": "poise-gateway", "static_configs": [
                {"targets": [f"{ctrl.address if inv.control_plane.gateway_replicas == 1 else '127.0.0.1'}:{port}"
                             for port in gateway_ports(inv).values()]}]},
            # The monitor's per-engine series carry their own `instance` label (the Poise instance id): keep it.
            {"job_name": "poise-monitor", "honor_labels": True,
             "static_configs": [{"targets": [f"{ctrl.address}:{inv.ports.monitor}"]}]},
            {"job_name": "poise-engines", "static_configs": engines},
        ],
    }
    return "# Rendered by python -m services.deploy: every Poise /metrics endpoint of the deployment.\n" + _yaml(doc)


def grafana_datasource(plan: Plan) -> str:
    doc = {"apiVersion": 1, "datasources": [{
        "name": "Prometheus", "uid": DATASOURCE_UID, "type": "prometheus", "access": "proxy",
        "url": f"http://127.0.0.1:{plan.inventory.ports.prometheus}", "isDefault": True}]}
    return _yaml(doc)


def render(inv: Inventory, assets: Assets, *, source: str = "inventory.yaml",
           secret_values: dict[str, str] | None = None) -> Rendering:
    """The plan and every file of the deployment, by path relative to the output directory.

    With ``secret_values`` (:func:`services.deploy.secrets.ensure_secrets`), every node also gets the ``.env``
    file its compose file reads: only the variables that node's containers name.
    """
    plan = build_plan(inv, source)
    files: dict[str, str] = {}
    for node in plan.nodes:
        if node.containers:  # a node with no engine placed on it gets nothing
            text = files[f"{node.node.name}/docker-compose.yml"] = compose_file(plan, node, source)
            if secret_values is not None:
                files[f"{node.node.name}/.env"] = secrets.env_file_text(
                    {v: secret_values[v] for v in secrets.referenced(text)})
    files[f"{inv.control_node.name}/nats/nats-server.conf"] = secrets.nats_server_config(
        inv.namespace, [c.name.removeprefix("worker-") for c in plan.engines])
    if inv.control_plane.gateway_replicas > 1:
        files[f"{inv.control_node.name}/nginx/gateway-lb.conf"] = gateway_lb_config(inv)
    if inv.control_plane.monitoring:
        ctrl = inv.control_node.name
        files[f"{ctrl}/prometheus/prometheus.yml"] = prometheus_config(plan)
        files[f"{ctrl}/grafana/provisioning/datasources/prometheus.yml"] = grafana_datasource(plan)
        files[f"{ctrl}/grafana/provisioning/dashboards/poise.yml"] = assets.dashboard_provider_yaml
        files[f"{ctrl}/grafana/dashboards/poise.json"] = assets.dashboard_json
    return Rendering(plan=plan, files=files)


# -- the printed plan ------------------------------------------------------------------------------------------
def format_plan(plan: Plan, apply_commands: Sequence[str] = ()) -> str:
    inv = plan.inventory
    ctrl = inv.control_node
    used = sum(len(c.gpus) for c in plan.engines)
    lines = [
        f"Poise deployment {inv.name!r} (namespace {inv.namespace}): compose project per node, host networking",
        f"  model {inv.model.path} (served as {inv.served_model}), TP {inv.model.tp}; "
        f"{inv.pd.prefill} prefill + {inv.pd.decode} decode engines on {used} of {sum(n.gpus for n in inv.nodes)} GPUs",
        f"  KV transfer {inv.transfer.backend}" + (f" over {inv.transfer.ib_device}" if inv.transfer.ib_device else ""),
        f"  control plane on {ctrl.name} ({ctrl.address}): gateway http://{ctrl.address}:{inv.ports.gateway}, "
        f"NATS nats://{ctrl.address}:{inv.ports.nats}, etcd http://{ctrl.address}:{inv.ports.etcd_client}"
        + (f", Grafana http://{ctrl.address}:{inv.ports.grafana}" if inv.control_plane.monitoring else ""),
        f"  policies: planner {inv.control_plane.planner_policy}, dispatch {inv.control_plane.dispatch_policy}, "
        f"migration {inv.control_plane.migration_policy}; SLO TTFT {inv.control_plane.slo_ttft_s:g} s, "
        f"TPOT {inv.control_plane.slo_tpot_s:g} s",
    ]
    for node in plan.nodes:
        n = node.node
        gpu_use = sum(len(c.gpus) for c in node.containers)
        lines += ["", f"node {n.name}  address {n.address}  ssh {n.ssh_target}  GPUs {gpu_use}/{n.gpus} used"
                      + ("  [control plane]" if node.control_plane else ""),
                  f"  compose file {plan.remote_dir()}/docker-compose.yml ({len(node.containers)} containers)"
                  if node.containers else "  no containers: no engine is placed here (spare GPUs)"]
        for c in node.containers:
            head = f"  - {c.name}"
            if c.role:
                head += f"  [{c.role}]"
            head += f"  image {c.image}"
            lines.append(head)
            if c.gpus:
                lines.append(f"      GPUs: {','.join(map(str, c.gpus))} (host indices; the container sees 0..{len(c.gpus) - 1})")
            if c.ports:
                lines.append("      ports: " + ", ".join(f"{port} ({what})" for what, port in c.ports))
            if c.env:
                lines.append("      env: " + " ".join(f"{k}={v}" for k, v in c.env))
            if c.volumes:
                lines.append("      volumes: " + " ".join(c.volumes))
            lines.append(f"      command: {shlex.join(c.command) if c.command else '(image default)'}")
            if c.engine_command:
                lines.append(f"      engine (launched by the sidecar): {shlex.join(c.engine_command)}")
    if apply_commands:
        lines += ["", "apply runs, in this order:"] + [f"  $ {cmd}" for cmd in apply_commands]
    return "\n".join(lines) + "\n"
