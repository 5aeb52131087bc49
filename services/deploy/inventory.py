"""The inventory: one YAML file that describes a GPU deployment (``deploy/inventory.example.yaml``).

:func:`load_inventory` reads and checks it; every problem found is reported at once in one
:class:`InventoryError`, one line each, naming the field (``nodes[1].gpus: ...``): first the structure and
types (pydantic), then the cross-field checks of :func:`check_inventory` (GPUs against TP and the split, the
transfer backend, ports per node). What the services themselves would refuse (policies, extra flags) is
checked by the renderer with their own parsers (services/deploy/render.py).
"""

from __future__ import annotations

import ipaddress
import re
from collections import Counter
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from services.worker import config as worker_config
from shared.errors import ConfigError
from shared.policies.poise_mix import POISE_MIX
from shared.settings import fill_unset

# What the worker accepts (WorkerSettings.transfer_backend) and which of those can flip roles.
TRANSFER_BACKENDS: tuple[str, ...] = get_args(worker_config.WorkerSettings.model_fields["transfer_backend"].annotation)
ROLE_SWITCH_BACKENDS: tuple[str, ...] = getattr(worker_config, "ROLE_SWITCH_BACKENDS", ("mooncake",))
_NAME = re.compile(r"^[a-z0-9][a-z0-9-]*$")  # compose project / node names: lowercase, digits, dashes

# WorkerSettings fields the renderer sets per engine (services/deploy/render.py): worker_settings may not.
PLACED_WORKER_FIELDS = frozenset({
    "namespace", "nats_url", "etcd_url", "instance_id", "role", "engine_kind", "engine_host", "advertise_host",
    "engine_port", "bootstrap_port", "model_path", "model", "tp", "transfer_backend", "ib_device",
    "mem_fraction_static", "profile", "extra_args", "log_dir"})

# RFC 5737 documentation ranges: the example inventory uses them so that it can never be applied by mistake.
DOCUMENTATION_NETWORKS = tuple(ipaddress.ip_network(n) for n in ("192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24"))


class InventoryError(ConfigError):
    """The inventory is invalid; ``problems`` lists every problem found, one per line of the message."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.problems = problems
        super().__init__(f"invalid inventory {source}:\n" + "\n".join(f"  - {p}" for p in problems))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Node(_Strict):
    name: str = Field(description="Node name (lowercase letters, digits, dashes); names its rendered directory.")
    address: str = Field(description="Address the other nodes reach this one at (IP or DNS name).")
    gpus: int = Field(ge=0, description="GPUs on the node that Poise may use (0 for a CPU-only control-plane node).")
    ssh: str | None = Field(None, description="ssh destination (user@host); default: address.")

    @property
    def ssh_target(self) -> str:
        return self.ssh or self.address


class Model(_Strict):
    path: str = Field(description="SGLang --model-path: a Hugging Face id or a directory on every GPU node.")
    name: str | None = Field(None, description="Served model name (SGLang --served-model-name); default: path.")
    tp: int = Field(1, ge=1, description="Tensor-parallel size of every engine (GPUs per engine).")
    mem_fraction_static: float | None = Field(None, gt=0.0, lt=1.0, description="SGLang --mem-fraction-static.")
    engine_args: list[str] = Field(default_factory=list, description="Extra SGLang flags for every engine.")
    cache_dir: str = Field("/data/huggingface", description="Host directory mounted as the engines' Hugging Face cache.")
    profile: str = Field("llama-3.1-8b-h100", description="Latency profile the planner and gateway plan with; the engines run its request cap (--max-running-requests, unless engine_args or worker_settings.max_running_requests say otherwise).")


class PD(_Strict):
    prefill: int = Field(ge=1, description="Initial number of prefill engines.")
    decode: int = Field(ge=1, description="Initial number of decode engines.")


class Transfer(_Strict):
    backend: str = Field("mooncake", description="KV transfer backend (the worker's transfer_backend: mooncake, mooncake_tcp, nixl).")
    ib_device: str | None = Field(None, description="RDMA device for the KV transfer (e.g. mlx5_0); unset = backend's choice.")


class ControlPlane(_Strict):
    node: str = Field(description="Name of the node that runs NATS, etcd, monitor, planner, migrator, gateway.")
    planner_policy: str = Field("static", description="Planner pool policy (static, arrow, dopd, poise).")
    dispatch_policy: str = Field(None, validate_default=False, description="Gateway dispatch policy (least-load, round-robin, arrow); unset = the Poise mix's (arrow) with planner_policy poise, else least-load.")  # type: ignore[assignment]  # always set by _planner_policy_implies
    slo_ttft_s: float = Field(2.0, gt=0.0, description="TTFT SLO the planner and gateway plan for (s).")
    slo_tpot_s: float = Field(0.15, gt=0.0, description="TPOT SLO the planner and gateway plan for (s).")
    migration_policy: str = Field("none", description="Migrator policy.")
    migration_mechanism: str = Field("recompute", description="Migrator mechanism (SGLang: recompute).")
    gateway_args: list[str] = Field(default_factory=list, description="Extra gateway flags.")
    planner_args: list[str] = Field(default_factory=list, description="Extra planner flags.")
    monitoring: bool = Field(True, description="Run Prometheus and Grafana on the control-plane node.")
    gateway_replicas: int = Field(2, ge=1, le=16, description="Gateways behind nginx on ports.gateway (1: one gateway "
                                  "on ports.gateway, no nginx). A gateway's death loses the requests it holds; the "
                                  "others keep serving. Each gets its share of an engine's late-binding depth.")

    @model_validator(mode="before")
    @classmethod
    def _planner_policy_implies(cls, data: Any) -> Any:
        """The poise planner brings the Poise mix's dispatch, as `poise up` does, unless one is given."""
        poise = isinstance(data, dict) and data.get("planner_policy", "static") == "poise"
        return fill_unset(data, {"dispatch_policy": POISE_MIX.dispatch_policy if poise else "least-load"})


class Ports(_Strict):
    gateway: int = Field(8000, ge=1, le=65535)
    gateway_replica_base: int = Field(18000, ge=1, le=65535, description="With gateway_replicas > 1: the first "
                                      "replica's port (nginx serves ports.gateway); the next get +1, +2, ...")
    monitor: int = Field(9100, ge=1, le=65535)
    nats: int = Field(4222, ge=1, le=65535)
    nats_monitor: int = Field(8222, ge=1, le=65535)
    etcd_client: int = Field(2379, ge=1, le=65535)
    etcd_peer: int = Field(2380, ge=1, le=65535)
    prometheus: int = Field(9090, ge=1, le=65535)
    grafana: int = Field(3000, ge=1, le=65535)
    engine_base: int = Field(30000, ge=1, le=65535, description="HTTP port of a node's first engine; the next get +1, +2, ...")
    bootstrap_base: int = Field(8998, ge=1, le=65535, description="KV bootstrap port of a node's first engine; +1, +2, ...")


class Images(_Strict):
    poise: str = Field(description="Control-plane image (deploy/Dockerfile).")
    engine: str = Field(description="Engine image: SGLang with Poise installed (deploy/Dockerfile.sglang).")
    nats: str = Field("nats:2.11-alpine")
    etcd: str = Field("quay.io/coreos/etcd:v3.5.21")
    prometheus: str = Field("prom/prometheus:v3.5.0")
    grafana: str = Field("grafana/grafana:12.1.0")
    nginx: str = Field("nginx:1.27-alpine")


class Inventory(_Strict):
    name: str = Field(description="Deployment name: the compose project on every node.")
    namespace: str = Field("default", description="Poise namespace (etcd keys, NATS subjects).")
    remote_dir: str = Field("/opt/poise", description="Directory on every node that holds <name>/docker-compose.yml.")
    images: Images
    model: Model
    pd: PD
    transfer: Transfer = Field(default_factory=lambda: Transfer.model_validate({}))
    control_plane: ControlPlane
    worker_settings: dict[str, Any] = Field(default_factory=dict, description="More WorkerSettings fields for every "
                                            "engine's sidecar, e.g. {return_hidden_states: last, drain_timeout_s: 120}.")
    ports: Ports = Field(default_factory=lambda: Ports.model_validate({}))
    nodes: list[Node] = Field(min_length=1)

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    @property
    def control_node(self) -> Node:
        return self.node(self.control_plane.node)

    @property
    def served_model(self) -> str:
        return self.model.name or self.model.path


def _loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def parse_inventory(data: Any, source: str = "<inventory>") -> Inventory:
    """Validate the inventory's structure and values, then :func:`check_inventory`; raises :class:`InventoryError`."""
    if not isinstance(data, dict):
        raise InventoryError(source, ["the file must be a YAML mapping (name:, images:, model:, pd:, control_plane:, nodes:)"])
    try:
        inventory = Inventory.model_validate(data)
    except ValidationError as exc:
        raise InventoryError(source, [f"{_loc(e['loc'])}: {e['msg']}" for e in exc.errors()]) from None
    problems = check_inventory(inventory)
    if problems:
        raise InventoryError(source, problems)
    return inventory


def load_inventory(path: str | Path) -> Inventory:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise InventoryError(str(path), [f"cannot read it: {exc.strerror or exc}"]) from None
    except yaml.YAMLError as exc:
        raise InventoryError(str(path), [f"not valid YAML: {exc}"]) from None
    return parse_inventory(data, str(path))


def check_inventory(inv: Inventory) -> list[str]:
    """Cross-field checks: names, GPUs against TP and the P:D split, transfer backend, ports."""
    problems: list[str] = []
    if not _NAME.match(inv.name):
        problems.append(f"name: {inv.name!r} must be lowercase letters, digits and dashes (a compose project name)")
    for i, node in enumerate(inv.nodes):
        if not _NAME.match(node.name):
            problems.append(f"nodes[{i}].name: {node.name!r} must be lowercase letters, digits and dashes")
    for field, counts in (("name", Counter(n.name for n in inv.nodes)), ("address", Counter(n.address for n in inv.nodes))):
        problems += [f"nodes: duplicate {field} {value!r}" for value, n in counts.items() if n > 1]
    if inv.control_plane.node not in {n.name for n in inv.nodes}:
        problems.append(f"control_plane.node: {inv.control_plane.node!r} is not one of the nodes "
                        f"({', '.join(n.name for n in inv.nodes)})")

    tp = inv.model.tp
    for i, node in enumerate(inv.nodes):
        if node.gpus and node.gpus % tp:
            problems.append(f"nodes[{i}] ({node.name}): {node.gpus} GPUs is not a multiple of model.tp={tp} "
                            f"(an engine's tensor-parallel group stays on one node)")
    slots = sum(n.gpus // tp for n in inv.nodes)
    wanted = inv.pd.prefill + inv.pd.decode
    if wanted > slots:
        gpus = sum(n.gpus for n in inv.nodes)
        problems.append(f"pd: {inv.pd.prefill} prefill + {inv.pd.decode} decode engines at tp={tp} need {wanted * tp} "
                        f"GPUs ({wanted} whole TP groups); the nodes have {gpus} GPUs, room for {slots} engines")

    backend = inv.transfer.backend
    if backend not in TRANSFER_BACKENDS:
        problems.append(f"transfer.backend: unknown backend {backend!r}; known: {', '.join(TRANSFER_BACKENDS)}")
    elif backend not in ROLE_SWITCH_BACKENDS and inv.control_plane.planner_policy != "static":
        problems.append(f"control_plane.planner_policy: {inv.control_plane.planner_policy!r} flips roles, which SGLang "
                        f"supports only with the {' or '.join(ROLE_SWITCH_BACKENDS)} backend; use static with {backend}")
    for key in sorted(inv.worker_settings.keys() & PLACED_WORKER_FIELDS):
        problems.append(f"worker_settings.{key}: set by the deployment for each engine (placement, model, transfer, "
                        f"control-plane URLs); change it through the inventory's own keys")
    if inv.control_plane.migration_mechanism == "kv-transfer":
        problems.append("control_plane.migration_mechanism: kv-transfer exists only in engine_sim; SGLang engines need recompute")

    problems += _port_problems(inv)
    return problems


def engine_slots(inv: Inventory) -> list[tuple[Node, tuple[int, ...]]]:
    """Every place an engine can go: (node, its GPU indices), nodes in inventory order, contiguous TP groups."""
    tp = inv.model.tp
    return [(node, tuple(range(k * tp, (k + 1) * tp))) for node in inv.nodes for k in range(node.gpus // tp)]


def control_ports(inv: Inventory) -> dict[str, int]:
    p = inv.ports
    ports = {"nats": p.nats, "nats monitoring": p.nats_monitor, "etcd client": p.etcd_client, "etcd peer": p.etcd_peer,
             "gateway": p.gateway, "monitor": p.monitor}
    if inv.control_plane.monitoring:
        ports |= {"prometheus": p.prometheus, "grafana": p.grafana}
    replicas = inv.control_plane.gateway_replicas
    if replicas > 1:
        ports |= {f"gateway replica {k + 1}": p.gateway_replica_base + k for k in range(replicas)}
    return ports


def engine_ids(inv: Inventory) -> list[str]:
    """Instance ids in placement order: p0, p1, ... then d0, d1, ... (the same order as :func:`engine_slots`)."""
    return [f"p{i}" for i in range(inv.pd.prefill)] + [f"d{i}" for i in range(inv.pd.decode)]


def _port_problems(inv: Inventory) -> list[str]:
    """Every container runs with host networking, so every port on one node must be distinct."""
    problems: list[str] = []
    on_node: dict[str, list[str]] = {n.name: [] for n in inv.nodes}
    for instance_id, (node, _gpus) in zip(engine_ids(inv), engine_slots(inv), strict=False):
        on_node[node.name].append(instance_id)
    for node_name, ids in on_node.items():
        used: dict[int, list[str]] = {}
        if node_name == inv.control_plane.node:
            for what, port in control_ports(inv).items():
                used.setdefault(port, []).append(what)
        for k, instance_id in enumerate(ids):
            used.setdefault(inv.ports.engine_base + k, []).append(f"engine {instance_id} HTTP")
            used.setdefault(inv.ports.bootstrap_base + k, []).append(f"engine {instance_id} bootstrap")
        for port, whats in sorted(used.items()):
            if port > 65535:
                problems.append(f"ports: node {node_name}: {', '.join(whats)} would be port {port} (> 65535)")
            elif len(whats) > 1:
                problems.append(f"ports: node {node_name}: port {port} is used twice ({' and '.join(whats)})")
    return problems


def is_placeholder_address(address: str) -> bool:
    """An RFC 5737 documentation address or an ``.example`` name: the example inventory, never a real node."""
    if address.endswith(".example") or address.endswith(".invalid"):
        return True
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return any(ip in net for net in DOCUMENTATION_NETWORKS)

