"""Inventory checks: every bad inventory fails before anything is rendered, with a message naming the field."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.deploy.inventory import (
    TRANSFER_BACKENDS,
    InventoryError,
    is_placeholder_address,
    load_inventory,
    parse_inventory,
)
from services.deploy.render import build_plan

EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "inventory.example.yaml"


@pytest.fixture()
def data() -> dict[str, Any]:
    return copy.deepcopy(yaml.safe_load(EXAMPLE.read_text()))


def _problems(data: dict[str, Any]) -> list[str]:
    with pytest.raises(InventoryError) as info:
        build_plan(parse_inventory(data, "test.yaml"), "test.yaml")
    assert str(info.value).startswith("invalid inventory test.yaml")
    return info.value.problems


def test_example_inventory_is_valid() -> None:
    inv = load_inventory(EXAMPLE)
    assert inv.model.tp == 2 and (inv.pd.prefill, inv.pd.decode) == (3, 5)
    assert inv.control_node.name == "ctrl"


def test_gpus_not_divisible_by_tp(data: dict[str, Any]) -> None:
    data["nodes"][1]["gpus"] = 7
    problems = _problems(data)
    assert any("nodes[1] (gpu-a): 7 GPUs is not a multiple of model.tp=2" in p for p in problems)


def test_pd_exceeding_gpus(data: dict[str, Any]) -> None:
    data["pd"] = {"prefill": 4, "decode": 5}
    problems = _problems(data)
    assert any(p.startswith("pd: 4 prefill + 5 decode engines at tp=2 need 18 GPUs") and "room for 8 engines" in p
               for p in problems)


def test_tp_larger_than_any_node(data: dict[str, Any]) -> None:
    data["model"]["tp"] = 16  # 8-GPU nodes: tensor parallelism does not span nodes here
    problems = _problems(data)
    assert any("not a multiple of model.tp=16" in p for p in problems)
    assert any(p.startswith("pd:") and "room for 0 engines" in p for p in problems)


def test_unknown_transfer_backend(data: dict[str, Any]) -> None:
    data["transfer"]["backend"] = "tcp"
    assert f"transfer.backend: unknown backend 'tcp'; known: {', '.join(TRANSFER_BACKENDS)}" in _problems(data)
    assert "mooncake" in TRANSFER_BACKENDS and "nixl" in TRANSFER_BACKENDS  # read from WorkerSettings


def test_nixl_cannot_flip_roles(data: dict[str, Any]) -> None:
    data["transfer"]["backend"] = "nixl"
    problems = _problems(data)
    assert any(p.startswith("control_plane.planner_policy: 'poise' flips roles") for p in problems)
    data["control_plane"]["planner_policy"] = "static"
    build_plan(parse_inventory(data))  # static + nixl is fine


def test_duplicate_ports_on_the_control_plane_node(data: dict[str, Any]) -> None:
    data["ports"]["grafana"] = 8000
    assert "ports: node ctrl: port 8000 is used twice (gateway and grafana)" in _problems(data)


def test_engine_ports_collide_with_control_plane_on_a_shared_node(data: dict[str, Any]) -> None:
    data["control_plane"]["node"] = "gpu-a"  # control plane next to engines p0..d0 (30000-30003, 8998-9001)
    data["ports"]["gateway"] = 30002
    problems = _problems(data)
    assert "ports: node gpu-a: port 30002 is used twice (gateway and engine p2 HTTP)" in problems


def test_bootstrap_range_overlapping_engine_range(data: dict[str, Any]) -> None:
    data["ports"]["bootstrap_base"] = 30002
    problems = _problems(data)
    assert "ports: node gpu-a: port 30002 is used twice (engine p0 bootstrap and engine p2 HTTP)" in problems
    assert "ports: node gpu-b: port 30003 is used twice (engine d2 bootstrap and engine d4 HTTP)" in problems


def test_structure_errors_name_the_field(data: dict[str, Any]) -> None:
    data["nodes"][2]["gpus"] = -1
    data["model"]["tp"] = 0
    data["pd"]["prefil"] = 3
    del data["images"]
    problems = _problems(data)
    assert "nodes[2].gpus: Input should be greater than or equal to 0" in problems
    assert "model.tp: Input should be greater than or equal to 1" in problems
    assert "pd.prefil: Extra inputs are not permitted" in problems
    assert "images: Field required" in problems


def test_duplicate_nodes_and_unknown_control_plane_node(data: dict[str, Any]) -> None:
    data["nodes"][2]["name"] = "gpu-a"
    data["nodes"][2]["address"] = data["nodes"][1]["address"]
    data["control_plane"]["node"] = "head"
    problems = _problems(data)
    assert "nodes: duplicate name 'gpu-a'" in problems
    assert "nodes: duplicate address '192.0.2.11'" in problems
    assert any(p.startswith("control_plane.node: 'head' is not one of the nodes") for p in problems)


def test_values_the_services_refuse_are_reported(data: dict[str, Any]) -> None:
    data["control_plane"]["planner_policy"] = "magic"
    data["control_plane"]["gateway_args"] = ["--no-such-flag", "1"]
    problems = _problems(data)
    assert any(p.startswith("control_plane (planner):") and "unknown pool policy 'magic'" in p for p in problems)
    assert "control_plane (gateway): unrecognized arguments: --no-such-flag 1" in problems


def test_worker_settings_are_checked_by_the_worker_once_for_all_engines(data: dict[str, Any]) -> None:
    data["worker_settings"] = {"return_hidden_states": "some"}
    problems = _problems(data)
    assert len(problems) == 1
    assert problems[0].startswith("engines p0, p1, p2, d0, d1, d2, d3, d4 (worker settings):")
    assert "return_hidden_states" in problems[0]


def test_kv_transfer_migration_is_engine_sim_only(data: dict[str, Any]) -> None:
    data["control_plane"]["migration_mechanism"] = "kv-transfer"
    assert any("kv-transfer exists only in engine_sim" in p for p in _problems(data))


def test_unreadable_and_non_mapping_files(tmp_path: Path) -> None:
    with pytest.raises(InventoryError, match="cannot read it"):
        load_inventory(tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(InventoryError, match="must be a YAML mapping"):
        load_inventory(tmp_path / "list.yaml")
    (tmp_path / "bad.yaml").write_text("name: [unclosed\n")
    with pytest.raises(InventoryError, match="not valid YAML"):
        load_inventory(tmp_path / "bad.yaml")


@pytest.mark.parametrize(("address", "placeholder"), [
    ("192.0.2.10", True), ("198.51.100.7", True), ("203.0.113.1", True), ("gpu.example", True),
    ("10.0.0.5", False), ("gpu-a.internal", False), ("2001:db8::1", False),
])
def test_placeholder_addresses(address: str, placeholder: bool) -> None:
    assert is_placeholder_address(address) is placeholder


def test_worker_settings_cannot_override_placement(data: dict[str, Any]) -> None:
    data["worker_settings"] = {"engine_port": 1, "tp": 4, "drain_timeout_s": 120}
    problems = _problems(data)
    assert [p.split(":")[0] for p in problems] == ["worker_settings.engine_port", "worker_settings.tp"]
