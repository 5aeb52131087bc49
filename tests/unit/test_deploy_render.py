"""Rendering the example inventory: placement, command lines (SGLang's from the worker's launcher), files,
the printed plan, `make deploy`'s wiring and apply's steps (with a recording runner: nothing is run)."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import subprocess
import tarfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from compose_spec.compose_spec import PyCompose

from services.deploy.__main__ import load_assets, main
from services.deploy.apply import ApplyError, Step, apply, apply_steps, preflight
from services.deploy.devstack import clean_env, environment
from services.deploy.inventory import PLACED_WORKER_FIELDS, Inventory, InventoryError, load_inventory, parse_inventory
from services.deploy.render import Plan, build_plan, render
from services.deploy.secrets import (
    all_variables,
    etcd_password_var,
    nats_password_var,
    nats_server_config,
    read_env_file,
)
from services.worker.config import WorkerSettings
from services.worker.launcher import build_engine_command
from shared.settings import parse_settings

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "deploy" / "inventory.example.yaml"
# SGLang 0.5.23's launch_server options, extracted from the wheel's source (tests/contract/fixtures/).
SGLANG_OPTIONS = ROOT / "tests" / "contract" / "fixtures" / "sglang-0.5.23" / "cli_flags.json"
CONTROL = ["nats-server", "etcd", "etcd-auth", "monitor", "planner", "migrator", "gateway", "gateway-2", "gateway-lb",
           "prometheus", "grafana"]


@pytest.fixture(scope="module")
def inventory() -> Inventory:
    return load_inventory(EXAMPLE)


@pytest.fixture(scope="module")
def plan(inventory: Inventory) -> Plan:
    return build_plan(inventory)


def _real_inventory() -> Inventory:
    """The example with addresses that are not placeholders (never contacted: the runner records)."""
    data = yaml.safe_load(EXAMPLE.read_text())
    for node in data["nodes"]:
        node["address"] = f"{node['name']}.internal"
        node["ssh"] = f"ops@{node['name']}.internal"
    return parse_inventory(data)


def _worker_settings(command: tuple[str, ...]) -> WorkerSettings:
    assert command[:3] == ("python3", "-m", "services.worker")
    with environment(clean_env()):
        return parse_settings(WorkerSettings, list(command[3:]))


def _value(cmd: tuple[str, ...], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


# -- placement ---------------------------------------------------------------------------------------------------
def test_control_plane_runs_on_its_node_only(plan: Plan) -> None:
    assert [n.node.name for n in plan.nodes] == ["ctrl", "gpu-a", "gpu-b"]  # control plane first: apply order
    ctrl = plan.nodes[0]
    assert ctrl.control_plane and [c.name for c in ctrl.containers] == CONTROL
    assert not ctrl.engines
    for node in plan.nodes[1:]:
        assert not node.control_plane
        assert all(c.name.startswith("worker-") for c in node.containers)


def test_gpu_assignment_packs_whole_tp_groups_in_order(plan: Plan) -> None:
    placed = {c.name: (node.node.name, c.gpus, c.role) for node in plan.nodes for c in node.engines}
    assert placed == {
        "worker-p0": ("gpu-a", (0, 1), "prefill"), "worker-p1": ("gpu-a", (2, 3), "prefill"),
        "worker-p2": ("gpu-a", (4, 5), "prefill"), "worker-d0": ("gpu-a", (6, 7), "decode"),
        "worker-d1": ("gpu-b", (0, 1), "decode"), "worker-d2": ("gpu-b", (2, 3), "decode"),
        "worker-d3": ("gpu-b", (4, 5), "decode"), "worker-d4": ("gpu-b", (6, 7), "decode"),
    }
    for node in plan.nodes:  # no GPU given twice on a node
        gpus = [g for c in node.containers for g in c.gpus]
        assert len(gpus) == len(set(gpus)) and all(0 <= g < node.node.gpus for g in gpus)


def test_spare_gpus_are_left_free(inventory: Inventory) -> None:
    small = inventory.model_copy(update={"pd": inventory.pd.model_copy(update={"prefill": 1, "decode": 1})})
    plan = build_plan(small)
    assert [len(n.engines) for n in plan.nodes] == [0, 2, 0]
    assert "gpu-b/docker-compose.yml" not in render(small, load_assets()).files  # nothing to run there


# -- command lines -----------------------------------------------------------------------------------------------
def test_engine_commands_come_from_the_workers_launcher(plan: Plan, inventory: Inventory) -> None:
    for node in plan.nodes:
        for c in node.engines:
            settings = _worker_settings(c.command)  # what the sidecar in the container will read
            assert settings.engine_kind == "sglang" and settings.role == c.role
            assert settings.advertise_host == node.node.address and settings.engine_host == "0.0.0.0"
            assert settings.nats_url == f"nats://{inventory.control_node.address}:4222"
            assert settings.etcd_url == f"http://{inventory.control_node.address}:2379"
            expected = build_engine_command(settings, python="python3")
            assert expected is not None and c.engine_command == tuple(expected)


def test_engine_commands_carry_the_inventorys_sglang_flags(plan: Plan) -> None:
    for node in plan.nodes:
        for k, c in enumerate(node.engines):
            cmd = c.engine_command
            assert cmd is not None and cmd[1:3] == ("-m", "sglang.launch_server")
            assert _value(cmd, "--model-path") == "meta-llama/Llama-3.1-8B-Instruct"
            tp_flag = "--tp-size" if "--tp-size" in cmd else "--tp"  # whichever the launcher emits
            assert _value(cmd, tp_flag) == "2"
            assert _value(cmd, "--port") == str(30000 + k)
            assert _value(cmd, "--disaggregation-mode") == c.role
            assert _value(cmd, "--disaggregation-bootstrap-port") == str(8998 + k)
            assert _value(cmd, "--disaggregation-transfer-backend") == "mooncake"
            assert _value(cmd, "--disaggregation-ib-device") == "mlx5_0"
            assert _value(cmd, "--mem-fraction-static") == "0.85"
            # the profile's cap, the one the planner and the simulated tables assume (SGLang's own is 2048 here)
            assert _value(cmd, "--max-running-requests") == "256"
            assert "--enable-pd-role-switch" in cmd and "--enable-metrics" in cmd
            assert cmd[-2:] == ("--chunked-prefill-size", "8192")  # the inventory's engine_args, last
            assert dict(c.ports) == {"engine HTTP + metrics": 30000 + k, "KV bootstrap": 8998 + k}


def test_engine_commands_use_only_options_sglang_has(plan: Plan) -> None:
    options = json.loads(SGLANG_OPTIONS.read_text())["options"]
    for c in plan.engines:
        assert c.engine_command is not None
        used = {a for a in c.engine_command if a.startswith("--")}  # the inventory's engine_args included
        assert used - set(options) == set(), c.name


def test_worker_fields_the_deployment_sets_are_the_ones_worker_settings_may_not(plan: Plan) -> None:
    for c in plan.engines:
        set_here = {a[2:].replace("-", "_") for a in c.command[3:] if a.startswith("--")}
        assert set_here == PLACED_WORKER_FIELDS  # the example sets every optional one too


def test_control_plane_commands(plan: Plan) -> None:
    ctrl = {c.name: c for c in plan.nodes[0].containers}
    assert ctrl["gateway"].command[:3] == ("python", "-m", "services.gateway")
    assert _value(ctrl["gateway"].command, "--dispatch-policy") == "arrow"
    # Two replicas behind nginx on the gateway port, each on the loopback (clients meet nginx's timeouts).
    assert [_value(ctrl[g].command, "--port") for g in ("gateway", "gateway-2")] == ["18000", "18001"]
    assert {_value(ctrl[g].command, "--host") for g in ("gateway", "gateway-2")} == {"127.0.0.1"}
    assert dict(ctrl["gateway-lb"].ports) == {"HTTP API (load balancer)": 8000}
    assert _value(ctrl["planner"].command, "--policy") == "poise"
    assert "-js" in ctrl["nats-server"].command  # JetStream
    assert "--advertise-client-urls" in ctrl["etcd"].command
    assert _value(ctrl["etcd"].command, "--advertise-client-urls") == "http://192.0.2.10:2379"
    assert "--move-non-streaming" not in ctrl["gateway"].command  # no migrator policy in the example
    gateway = ctrl["gateway"].command  # the poise planner brings early rejection and late binding, as poise up
    assert "--early-rejection" in gateway and "--late-binding" in gateway
    assert gateway[gateway.index("--late-binding-policy") + 1] == "flowprefill-fewest-late"
    # a replica counts only the prompts it sent: the two share each engine's depth of 2
    assert {_value(ctrl[g].command, "--late-binding-depth") for g in ("gateway", "gateway-2")} == {"1"}


def test_a_migration_policy_lets_the_gateway_move_non_streaming_requests() -> None:
    data = yaml.safe_load(EXAMPLE.read_text())
    data["control_plane"]["migration_policy"] = "ares"
    gateway = next(c for c in build_plan(parse_inventory(data)).nodes[0].containers if c.name == "gateway")
    assert "--move-non-streaming" in gateway.command


def test_the_plan_ignores_poise_variables_of_the_shell(inventory: Inventory, plan: Plan) -> None:
    with environment({**os.environ, "POISE_WORKER_TP": "8", "POISE_GATEWAY_PORT": "1"}):
        again = build_plan(inventory)
    assert again == plan


# -- files -------------------------------------------------------------------------------------------------------
def test_rendered_files(inventory: Inventory) -> None:
    rendering = render(inventory, load_assets())
    assert rendering == render(inventory, load_assets())  # deterministic
    assert set(rendering.files) == {
        "ctrl/docker-compose.yml", "gpu-a/docker-compose.yml", "gpu-b/docker-compose.yml",
        "ctrl/nats/nats-server.conf", "ctrl/nginx/gateway-lb.conf", "ctrl/prometheus/prometheus.yml", "ctrl/grafana/provisioning/datasources/prometheus.yml",
        "ctrl/grafana/provisioning/dashboards/poise.yml", "ctrl/grafana/dashboards/poise.json"}
    for node in rendering.plan.nodes:
        text = rendering.files[f"{node.node.name}/docker-compose.yml"]
        parsed = PyCompose.from_yaml(text)  # strict compose-spec parser
        parsed.validate()
        doc = yaml.safe_load(text)
        assert list(doc["services"]) == [c.name for c in node.containers]
        for c in node.containers:
            svc = doc["services"][c.name]
            assert svc["network_mode"] == "host"
            assert tuple(svc.get("command", ())) == c.command
            if c.gpus:
                (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
                assert device["device_ids"] == [str(g) for g in c.gpus] and device["capabilities"] == ["gpu"]
                assert svc["devices"] == ["/dev/infiniband:/dev/infiniband"] and svc["cap_add"] == ["IPC_LOCK"]


def test_prometheus_scrapes_gateway_monitor_and_every_engine(inventory: Inventory) -> None:
    rendering = render(inventory, load_assets())
    config = yaml.safe_load(rendering.files["ctrl/prometheus/prometheus.yml"])
    targets = {t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    engines = {f"{n.node.address}:{dict(c.ports)['engine HTTP + metrics']}" for n in rendering.plan.nodes for c in n.engines}
    assert targets == {"127.0.0.1:18000", "127.0.0.1:18001", "192.0.2.10:9100"} | engines
    assert len(engines) == 8


def test_the_gateways_load_balancer_has_their_limits_and_one_gateway_needs_none() -> None:
    data = yaml.safe_load(EXAMPLE.read_text())
    data["control_plane"]["gateway_replicas"] = 3
    data["control_plane"]["gateway_args"] = ["--max-body-bytes", "1048576", "--body-timeout-s", "12"]
    conf = render(parse_inventory(data), load_assets()).files["ctrl/nginx/gateway-lb.conf"]
    assert [line.split()[1] for line in conf.splitlines() if line.strip().startswith("server 127")] == [
        "127.0.0.1:18000", "127.0.0.1:18001", "127.0.0.1:18002"]
    assert "listen 8000;" in conf and "client_max_body_size 1024k;" in conf and "client_body_timeout 12s;" in conf
    assert "proxy_buffering off;" in conf and "proxy_next_upstream error timeout;" in conf
    data["control_plane"]["gateway_replicas"] = 1
    one = render(parse_inventory(data), load_assets())
    ctrl = {c.name: c for c in one.plan.nodes[0].containers}
    assert "gateway-lb" not in ctrl and "gateway-2" not in ctrl and "ctrl/nginx/gateway-lb.conf" not in one.files
    assert _value(ctrl["gateway"].command, "--port") == "8000"
    assert "--late-binding-depth" not in ctrl["gateway"].command  # one gateway: its default, the whole depth
    # A replica port that collides with another service's is refused up front.
    data["control_plane"]["gateway_replicas"] = 2
    data["ports"]["gateway_replica_base"] = 9099  # the second replica would take the monitor's 9100
    with pytest.raises(InventoryError, match="9100"):
        parse_inventory(data)


# -- the CLI and make --------------------------------------------------------------------------------------------
def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()


def test_plan_prints_every_node_and_container_and_writes_the_files(tmp_path: Path, plan: Plan) -> None:
    rc, out, _ = _cli("plan", "--inventory", str(EXAMPLE), "--out", str(tmp_path))
    assert rc == 0
    for node in plan.nodes:
        assert f"node {node.node.name}  address {node.node.address}" in out
        for c in node.containers:
            assert f"- {c.name}" in out
        for c in node.engines:
            assert c.engine_command is not None and " ".join(c.engine_command) in out
            assert f"GPUs: {','.join(map(str, c.gpus))}" in out
    assert "apply runs, in this order:" in out and "nothing applied" in out
    assert (tmp_path / "gpu-b" / "docker-compose.yml").is_file()
    assert (tmp_path / "plan.txt").read_text() in out


def test_render_writes_without_printing_the_plan(tmp_path: Path) -> None:
    rc, out, _ = _cli("render", "--inventory", str(EXAMPLE), "--out", str(tmp_path))
    assert rc == 0 and "nothing applied" in out and "node ctrl" not in out
    assert (tmp_path / "ctrl" / "grafana" / "dashboards" / "poise.json").is_file()


def test_bad_inventory_exits_2_with_the_problems(tmp_path: Path) -> None:
    data = yaml.safe_load(EXAMPLE.read_text())
    data["model"]["tp"] = 3
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    rc, out, err = _cli("plan", "--inventory", str(bad), "--out", str(tmp_path / "out"))
    assert rc == 2 and out == ""
    assert f"invalid inventory {bad}" in err and "not a multiple of model.tp=3" in err
    assert not (tmp_path / "out").exists()


def test_apply_refuses_the_example_before_touching_any_node(tmp_path: Path) -> None:
    rc, _, err = _cli("apply", "--inventory", str(EXAMPLE), "--out", str(tmp_path))
    assert rc == 1
    assert "refusing to apply; nothing was changed on any node" in err
    assert "node ctrl: 192.0.2.10 is a documentation placeholder" in err


def test_make_deploy_runs_plan_with_dry_run_and_apply_without(tmp_path: Path) -> None:
    def recipe(*variables: str) -> str:
        done = subprocess.run(["make", "-n", "-C", str(ROOT), "deploy", *variables], capture_output=True, text=True,
                              timeout=30, check=True)
        return next(line for line in done.stdout.splitlines() if "-m services.deploy" in line)

    dry = recipe("DRY_RUN=1", "INVENTORY=my.yaml", f"DEPLOY_OUT={tmp_path}")
    assert dry.endswith(f"-m services.deploy plan --inventory my.yaml --out {tmp_path}")
    assert "-m services.deploy apply --inventory deploy/inventory.example.yaml" in recipe()


# -- apply (recorded, never run) ---------------------------------------------------------------------------------
def test_apply_steps_go_control_plane_first(tmp_path: Path) -> None:
    inv = _real_inventory()
    rendering = render(inv, load_assets())
    for rel, text in rendering.files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    calls: list[tuple[Step, bytes | None]] = []
    apply(rendering.plan, tmp_path, runner=lambda step, data: calls.append((step, data)) or 0,
          which=lambda name: f"/usr/bin/{name}", echo=lambda line: None)
    assert [s.node for s, _ in calls] == ["ctrl"] * 3 + ["gpu-a"] * 3 + ["gpu-b"] * 3
    upload, data = calls[0]
    assert upload.argv[:-1] == ("ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "ops@ctrl.internal")
    assert upload.argv[-1] == "mkdir -p /opt/poise/poise && tar -xzf - -C /opt/poise/poise"
    assert data is not None
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        names = set(tar.getnames())
    assert {"docker-compose.yml", "prometheus/prometheus.yml", "grafana/dashboards/poise.json"} <= names
    assert calls[2][0].argv[-1] == "docker compose -p poise -f /opt/poise/poise/docker-compose.yml up -d --remove-orphans"
    assert all(d is None for s, d in calls if "tar -xzf" not in s.argv[-1])


def test_apply_stops_at_the_first_failing_step(tmp_path: Path) -> None:
    inv = _real_inventory()
    plan = build_plan(inv)
    for node in plan.nodes:
        (tmp_path / node.node.name).mkdir()
    calls: list[Step] = []

    def runner(step: Step, data: bytes | None) -> int:
        calls.append(step)
        return 255 if step.node == "gpu-a" and step.argv[-1].endswith("pull") else 0

    with pytest.raises(ApplyError, match=r"\[gpu-a\] exited 255: .* pull"):
        apply(plan, tmp_path, runner=runner, which=lambda name: "/usr/bin/ssh", echo=lambda line: None)
    assert [s.node for s in calls] == ["ctrl"] * 3 + ["gpu-a"] * 2


def test_preflight_needs_ssh(tmp_path: Path) -> None:
    plan = build_plan(_real_inventory())
    assert preflight(plan, which=lambda name: "/usr/bin/ssh") == []
    assert any("ssh is not on PATH" in p for p in preflight(plan, which=lambda name: None))
    assert len(apply_steps(plan, tmp_path)) == 9


def test_rendering_reads_nothing_but_its_arguments(inventory: Inventory, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    assets = load_assets()
    monkeypatch.chdir(tmp_path)  # no relative file reads
    data: dict[str, Any] = copy.deepcopy(inventory.model_dump())
    assert render(parse_inventory(data), assets).files == render(inventory, assets).files


# -- security ----------------------------------------------------------------------------------------------------
def test_every_container_gets_its_own_credentials_and_no_secret_is_in_the_files(inventory: Inventory) -> None:
    rendering = render(inventory, load_assets())
    plan = rendering.plan
    conf = rendering.files["ctrl/nats/nats-server.conf"]
    assert conf == nats_server_config("default", [c.name.removeprefix("worker-") for c in plan.engines])
    ctrl = {c.name: c for c in plan.nodes[0].containers}
    assert _value(ctrl["nats-server"].command, "-c") == "/etc/nats/nats-server.conf"
    assert "./nats/nats-server.conf:/etc/nats/nats-server.conf:ro" in ctrl["nats-server"].volumes
    assert ctrl["etcd-auth"].one_shot and ctrl["etcd-auth"].command[2] == "services.deploy.etcd_auth"
    for name in ("monitor", "planner", "migrator", "gateway"):
        env = dict(ctrl[name].env)
        prefix = f"POISE_{name.upper()}_"
        assert env[prefix + "NATS_USER"] == name and env[prefix + "ETCD_USER"] == "poise"
        assert env[prefix + "NATS_PASSWORD"].startswith("${" + nats_password_var(name) + ":?")
        assert set(ctrl[name].depends_on) == {"nats-server", "etcd", "etcd-auth"}
    assert "POISE_API_KEY" in dict(ctrl["gateway"].env)["POISE_GATEWAY_API_KEYS"]
    for c in plan.engines:
        env = dict(c.env)
        assert env["POISE_WORKER_NATS_USER"] == c.name  # worker-<id>: publishes only its own load
        assert env["POISE_WORKER_NATS_PASSWORD"].startswith("${" + nats_password_var(c.name) + ":?")
    doc = yaml.safe_load(rendering.files["ctrl/docker-compose.yml"])
    assert doc["services"]["etcd-auth"]["restart"] == "no"
    assert doc["services"]["gateway"]["depends_on"]["etcd-auth"] == {"condition": "service_completed_successfully"}
    assert not any(name.endswith(".env") for name in rendering.files)  # no secrets without secret_values


def test_each_node_env_file_has_only_the_secrets_its_containers_use(inventory: Inventory, tmp_path: Path) -> None:
    rc, _, _ = _cli("render", "--inventory", str(EXAMPLE), "--out", str(tmp_path))
    assert rc == 0
    values = read_env_file(tmp_path / "secrets.env")
    assert (tmp_path / "secrets.env").stat().st_mode & 0o777 == 0o600
    gpu_a = read_env_file(tmp_path / "gpu-a" / ".env")
    assert (tmp_path / "gpu-a" / ".env").stat().st_mode & 0o777 == 0o600
    assert set(gpu_a) == {"POISE_ENGINE_API_KEY"} | {nats_password_var(f"worker-{i}") for i in ("p0", "p1", "p2", "d0")} \
        | {etcd_password_var(i) for i in ("p0", "p1", "p2", "d0")}  # each sidecar's own etcd user
    assert all(values[k] == v for k, v in gpu_a.items())
    ctrl = read_env_file(tmp_path / "ctrl" / ".env")
    assert {"POISE_ETCD_ROOT_PASSWORD", "POISE_API_KEY", "POISE_ENGINE_API_KEY"} <= set(ctrl)
    # A second render keeps the secrets (re-applying must not change passwords under running services).
    assert _cli("render", "--inventory", str(EXAMPLE), "--out", str(tmp_path))[0] == 0
    assert read_env_file(tmp_path / "secrets.env") == values


def test_secrets_command_writes_the_compose_env_file(tmp_path: Path) -> None:
    out = tmp_path / ".env"
    rc, text, _ = _cli("secrets", "--out", str(out))
    assert rc == 0 and "secrets added" in text
    values = read_env_file(out)
    assert set(values) == set(all_variables("default", ["p0", "p1", "d0", "d1"]))
    assert out.stat().st_mode & 0o777 == 0o600 and len(set(values.values())) == len(values)
    assert _cli("secrets", "--out", str(out))[0] == 0 and read_env_file(out) == values  # kept
