"""deploy/docker-compose.yml stays in sync with `poise up` (services/cli/stack.py).

The reference is the process list `poise up` builds, captured from its own code without starting anything
(services/deploy/devstack.py). For every process the compose file must have a service with the same entry
point; both command lines (with the compose service's environment) go through the service's own settings
parser, and the resulting settings must be equal except where a container needs another address, port or
path. Every POISE_* variable must be a field of that service's settings; Prometheus must scrape every
/metrics endpoint on the port the service listens on; the file must parse as a compose-spec document.
Security is `poise up`'s too: the same NATS and etcd users (their passwords differ: compose reads them from
deploy/.env), nats-server's users are the permission matrix's, and etcd's auth is turned on before any
service starts.
Nothing here needs docker (there is no docker engine on these machines).
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from compose_spec import ComposeSpecification
from compose_spec.compose_spec import PyOptions
from pydantic_settings import BaseSettings

from services.cli.stack import StackSettings
from services.deploy.devstack import StackProcess, clean_env, environment, poise_up_processes
from services.deploy.secrets import (
    all_variables,
    etcd_password_var,
    nats_password_var,
    nats_server_config,
    nats_users,
    referenced,
)
from services.gateway.config import GatewaySettings
from services.migrator.config import MigratorSettings
from services.monitor.config import MonitorSettings
from services.planner.config import PlannerSettings
from services.worker.config import WorkerSettings
from shared.policies.late_binding import replica_depth
from shared.settings import parse_settings

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"
PROMETHEUS = DEPLOY / "prometheus" / "prometheus.yml"

SETTINGS: dict[str, type[BaseSettings]] = {
    "services.monitor": MonitorSettings, "services.planner": PlannerSettings, "services.migrator": MigratorSettings,
    "services.gateway": GatewaySettings, "services.worker": WorkerSettings,
}
# Settings that name an address, a port or a path: a container has its own; everything else must be equal.
WHERE = {"nats_url", "etcd_url", "host", "port", "http_host", "http_port", "engine_host", "engine_port",
         "bootstrap_port", "advertise_host", "log_dir"}
# ...of which these only a container needs: poise up's processes share one host and are reached at engine_host.
CONTAINER_ONLY = {"advertise_host"}
# Secrets: poise up makes them per run, compose reads them from deploy/.env; set on both sides or neither.
SECRETS = {"nats_password", "etcd_password", "api_keys", "engine_api_key"}
COMPOSE_ONLY_SERVICES = {"prometheus", "grafana", "etcd-auth", "gateway-2", "gateway-lb"}
GATEWAY_REPLICAS = 2  # gateway and gateway-2, behind gateway-lb
# nats-server / etcd flags whose values are addresses or paths (their presence still has to match).
SERVER_WHERE = {"-a", "-p", "-sd", "-c", "--data-dir", "--listen-client-urls", "--advertise-client-urls",
                "--listen-peer-urls", "--initial-advertise-peer-urls", "--initial-cluster"}
SERVER_EXTRA_FLAGS = {"nats-server": {"-m"}}  # the monitoring port the compose healthcheck reads


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())  # PyYAML resolves the x-poise anchor and << merge keys
    assert isinstance(data, dict)
    return data


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]


@pytest.fixture(scope="module")
def stack() -> dict[str, StackProcess]:
    with environment(clean_env()):  # `poise up` with its defaults, no POISE_STACK_*
        processes = poise_up_processes(StackSettings())
    return {p.name: p for p in processes}


def _env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {str(k): str(v) for k, v in env.items()}


def _parse(cls: type[BaseSettings], args: list[str], env: dict[str, str]) -> BaseSettings:
    with environment({**clean_env(), **env}):
        return parse_settings(cls, args)


def _flag_map(args: tuple[str, ...] | list[str]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    i = 0
    while i < len(args):
        flag = args[i]
        assert flag.startswith("-"), f"positional argument {flag!r} in {args}"
        if i + 1 < len(args) and not args[i + 1].startswith("-"):
            out[flag] = args[i + 1]
            i += 2
        else:
            out[flag] = None
            i += 1
    return out


# -- structure ---------------------------------------------------------------------------------------------------
def test_compose_file_is_a_valid_compose_spec_document() -> None:
    text = COMPOSE.read_text()
    parsed = PyOptions(apply_merge=True).from_yaml(text)  # compose_spec (Rust): unknown keys and bad values fail
    parsed.validate()  # every named volume / network a service uses is declared
    ComposeSpecification.model_validate(yaml.safe_load(text))  # the compose-spec JSON schema's types


def test_every_service_is_runnable_and_depends_only_on_services_that_exist(services: dict[str, dict[str, Any]]) -> None:
    for name, svc in services.items():
        assert svc.get("image"), f"{name}: no image"
        assert isinstance(svc.get("command", []), list), f"{name}: command must be an exec-form list"
        deps = svc.get("depends_on", {})
        for dep in deps if isinstance(deps, list) else deps.keys():
            assert dep in services, f"{name} depends on unknown service {dep}"
        if isinstance(deps, dict):
            for dep, cond in deps.items():
                if cond.get("condition") == "service_healthy":
                    assert "healthcheck" in services[dep], f"{name} waits for {dep} to be healthy; it has no healthcheck"


def test_services_are_what_poise_up_starts(services: dict[str, dict[str, Any]], stack: dict[str, StackProcess]) -> None:
    assert set(services) - COMPOSE_ONLY_SERVICES == set(stack)
    workers = sorted(n for n in stack if n.startswith("worker-"))
    assert workers == ["worker-d0", "worker-d1", "worker-p0", "worker-p1"]  # poise up's default 2P + 2D


# -- commands ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["monitor", "planner", "migrator", "gateway",
                                  "worker-p0", "worker-p1", "worker-d0", "worker-d1"])
def test_poise_service_matches_poise_up(name: str, services: dict[str, dict[str, Any]],
                                        stack: dict[str, StackProcess]) -> None:
    svc, proc = services[name], stack[name]
    command = [str(a) for a in svc["command"]]
    assert command[:2] == ["python", "-m"], f"{name}: {command[:3]}"
    assert command[2] == proc.module, f"{name} runs {command[2]}, poise up runs {proc.module}"
    cls = SETTINGS[command[2]]
    env = _env(svc)
    prefix = str(cls.model_config.get("env_prefix", ""))
    for var in env:
        if var.startswith("POISE_"):
            assert var.startswith(prefix), f"{name}: {var} does not have {cls.__name__}'s prefix {prefix}"
            assert var[len(prefix):].lower() in cls.model_fields, f"{name}: {var} is not a field of {cls.__name__}"
    ours = _parse(cls, command[3:], env).model_dump()
    theirs = _parse(cls, list(proc.args), dict(proc.env)).model_dump()
    if name == "gateway":  # one of two replicas: each holds its share of an engine's late-binding depth
        theirs["late_binding_depth"] = replica_depth(theirs["late_binding_depth"], GATEWAY_REPLICAS)
    same = {k for k in ours if k not in WHERE | SECRETS}
    assert {k: ours[k] for k in same} == {k: theirs[k] for k in same}
    for key in (WHERE - CONTAINER_ONLY) & ours.keys():  # a port/address may differ, but not be set on one side only
        assert (ours[key] is None) == (theirs[key] is None), f"{name}: {key} is {ours[key]!r} here, {theirs[key]!r} in poise up"
    for key in SECRETS & ours.keys():
        assert bool(ours[key]) == bool(theirs[key]), f"{name}: {key} set {bool(ours[key])} here, {bool(theirs[key])} in poise up"
    assert ours["nats_user"], f"{name}: no NATS user"
    if ours["nats_password"]:  # the password variable of its own user, nobody else's
        assert ours["nats_password"].startswith("${" + nats_password_var(ours["nats_user"]) + ":?")


def test_control_plane_urls_point_at_the_compose_servers(services: dict[str, dict[str, Any]]) -> None:
    nats_port = _flag_map(services["nats-server"]["command"][1:])["-p"]
    etcd_client = _flag_map(services["etcd"]["command"][1:])["--listen-client-urls"]
    assert etcd_client is not None
    for name, cls in (("monitor", MonitorSettings), ("planner", PlannerSettings), ("migrator", MigratorSettings),
                      ("gateway", GatewaySettings), ("worker-p0", WorkerSettings)):
        settings = _parse(cls, [str(a) for a in services[name]["command"][3:]], _env(services[name]))
        assert settings.nats_url == f"nats://nats-server:{nats_port}"  # type: ignore[attr-defined]
        assert settings.etcd_url == f"http://etcd:{etcd_client.rsplit(':', 1)[1]}"  # type: ignore[attr-defined]


def test_workers_advertise_their_own_service_name(services: dict[str, dict[str, Any]]) -> None:
    for name, svc in services.items():
        if name.startswith("worker-"):
            settings = _parse(WorkerSettings, [str(a) for a in svc["command"][3:]], _env(svc))
            assert isinstance(settings, WorkerSettings)
            assert settings.advertise_host == name  # other containers reach the engine by the service name
            assert settings.engine_host == "0.0.0.0" and settings.engine_kind == "sim"
            assert settings.instance_id == name.removeprefix("worker-")


@pytest.mark.parametrize("server", ["nats-server", "etcd"])
def test_nats_and_etcd_match_poise_up(server: str, services: dict[str, dict[str, Any]],
                                      stack: dict[str, StackProcess]) -> None:
    command = [str(a) for a in services[server]["command"]]
    assert Path(command[0]).name == Path(stack[server].argv[0]).name
    ours, theirs = _flag_map(command[1:]), _flag_map(stack[server].args)
    assert set(ours) == set(theirs) | SERVER_EXTRA_FLAGS.get(server, set())
    for flag, value in theirs.items():
        if flag not in SERVER_WHERE:
            assert ours[flag] == value, f"{server} {flag}: {ours[flag]!r} here, {value!r} in poise up"
    if server == "nats-server":
        assert "-js" in ours  # JetStream, as poise up's NatsServer


# -- security ----------------------------------------------------------------------------------------------------
def test_nats_users_are_the_permission_matrix(services: dict[str, dict[str, Any]], stack: dict[str, StackProcess]) -> None:
    mounts = services["nats-server"]["volumes"]
    conf = _flag_map(services["nats-server"]["command"][1:])["-c"]
    local = next(m.split(":")[0] for m in mounts if m.split(":")[1] == conf)
    workers = [n.removeprefix("worker-") for n in stack if n.startswith("worker-")]
    assert (COMPOSE.parent / local).read_text() == nats_server_config("default", workers), (
        "deploy/nats/nats-server.conf is stale: regenerate it with services.deploy.secrets.nats_server_config")
    env = _env(services["nats-server"])
    assert set(env) == {nats_password_var(u.user) for u in nats_users("default", workers)}


def test_every_secret_comes_from_the_env_file_and_etcd_auth_runs_first(services: dict[str, dict[str, Any]]) -> None:
    known = set(all_variables("default", ["p0", "p1", "d0", "d1"]))
    assert set(referenced(COMPOSE.read_text())) == known  # `services.deploy secrets` writes exactly these
    auth = services["etcd-auth"]
    assert auth["command"][:3] == ["python", "-m", "services.deploy.etcd_auth"] and auth["restart"] == "no"
    workers = ["p0", "p1", "d0", "d1"]  # one etcd user per sidecar, each with its password variable
    assert set(_env(auth)) == {"POISE_ETCD_ROOT_PASSWORD", "POISE_ETCD_PASSWORD", *map(etcd_password_var, workers)}
    assert [a for a in auth["command"] if a != "--worker"][-4:] == workers
    for name, svc in services.items():
        if str(svc.get("command", [""])[0]) == "python" and name != "etcd-auth":
            assert svc["depends_on"]["etcd-auth"]["condition"] == "service_completed_successfully", name


# -- ports and Prometheus --------------------------------------------------------------------------------------
def _listen_port(name: str, svc: dict[str, Any]) -> int:
    args = [str(a) for a in svc["command"][3:]]
    settings = _parse(SETTINGS[svc["command"][2]], args, _env(svc))
    return int(getattr(settings, {"monitor": "http_port", "gateway": "port", "gateway-2": "port"}.get(name, "engine_port")))


def test_prometheus_scrapes_every_metrics_endpoint_on_its_port(services: dict[str, dict[str, Any]]) -> None:
    config = yaml.safe_load(PROMETHEUS.read_text())
    targets = {t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    expected = {f"{name}:{_listen_port(name, svc)}" for name, svc in services.items()
                if name in ("gateway", "gateway-2", "monitor") or name.startswith("worker-")}
    assert targets == expected
    prom_mounts = services["prometheus"]["volumes"]
    assert any(v.startswith("./prometheus/prometheus.yml:") for v in prom_mounts)
    monitor_job = next(j for j in config["scrape_configs"] if j["job_name"] == "poise-monitor")
    assert monitor_job.get("honor_labels") is True  # the monitor's `instance` label is the Poise instance id


def test_published_ports_are_poise_up_defaults(services: dict[str, dict[str, Any]]) -> None:
    defaults = StackSettings.model_fields
    published = {name: {str(p) for p in svc.get("ports", [])} for name, svc in services.items()}
    # the gateways' port is published by their load balancer, on poise up's gateway port
    assert published["gateway-lb"] == {f"{defaults['gateway_port'].default}:8000"} and not published["gateway"]
    assert f"{defaults['monitor_port'].default}:{_listen_port('monitor', services['monitor'])}" in published["monitor"]
    nats_port = _flag_map(services["nats-server"]["command"][1:])["-p"]
    assert f"4222:{nats_port}" in published["nats-server"]  # `poise admin --nats-url nats://127.0.0.1:4222`


def test_grafana_mounts_the_provisioned_dashboard(services: dict[str, dict[str, Any]]) -> None:
    mounts = services["grafana"]["volumes"]
    for local in ("./grafana/provisioning", "./grafana/dashboards"):
        assert any(m.startswith(local + ":") for m in mounts)
        assert (DEPLOY / local).is_dir()
    assert (DEPLOY / "grafana" / "dashboards" / "poise.json").is_file()


# -- the image ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.sglang"])
def test_images_install_every_package_of_the_project(dockerfile: str, services: dict[str, dict[str, Any]]) -> None:
    project = tomllib.loads((DEPLOY.parent / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    lines = (DEPLOY / dockerfile).read_text().splitlines()
    copied = {line.split()[1] for line in lines if line.startswith("COPY ")}
    assert packages | {"pyproject.toml", project["project"]["readme"]} <= copied | {
        f for line in lines if line.startswith("COPY ") for f in line.split()[1:-1]}
    assert any("pip install ." in line for line in lines)
    assert (DEPLOY / f"{dockerfile}.dockerignore").is_file()
    if dockerfile == "Dockerfile":
        assert lines[[i for i, line in enumerate(lines) if line.startswith("FROM ")][0]] == "FROM python:3.11-slim"
        build = services["gateway"]["build"]
        assert (COMPOSE.parent / build["context"] / build["dockerfile"]).resolve() == (DEPLOY / dockerfile).resolve()


def test_two_gateway_replicas_behind_a_load_balancer(services: dict[str, dict[str, Any]]) -> None:
    """A gateway's death loses only its own requests: compose runs two, identical, behind nginx."""
    one, two = services["gateway"], services["gateway-2"]
    assert one["command"] == two["command"] and one["environment"] == two["environment"]
    conf = (DEPLOY / "nginx" / "gateway-lb.conf").read_text()
    port = _listen_port("gateway", one)
    assert f"server gateway:{port} " in conf and f"server gateway-2:{port} " in conf
    assert "proxy_buffering off" in conf and "non_idempotent" not in conf  # streams pass; no double generation
    lb = services["gateway-lb"]
    assert any(v.startswith("./nginx/gateway-lb.conf:") for v in lb["volumes"])
    assert set(lb["depends_on"]) == {"gateway", "gateway-2"}
