"""The gateway's SLO classes: where a request's targets come from, in which order, and what is refused."""

from __future__ import annotations

from typing import Any

import pytest

from services.gateway.config import GatewaySettings
from services.gateway.errors import APIError
from services.gateway.legs import Attempt
from services.gateway.slo import ResolvedSlo, SloTable, Targets
from shared.errors import ConfigError
from shared.protocol import InstanceInfo
from shared.protocol.request_slo import SLO_FIELD, RequestSlo, parse_request_slo
from shared.settings import load_settings, parse_settings

TABLE = SloTable.build(
    specs=["interactive=0.5:0.05", "batch=10:0.3", "plain=:"], default_slo=Targets(2.0, 0.15),
    priority=["0=batch,9=interactive"], model=["big-model=batch"], route=["chat=interactive"], default_class="plain",
)


def resolve(body: dict[str, Any], *, model: str = "m", endpoint: str = "completions",
            table: SloTable = TABLE) -> ResolvedSlo | None:
    return table.resolve(body, model=model, endpoint=endpoint, priority=body.get("priority"))


def test_specs_take_empty_targets_from_the_gateways_slo() -> None:
    assert TABLE.classes == {"interactive": Targets(0.5, 0.05), "batch": Targets(10.0, 0.3), "plain": Targets(2.0, 0.15)}


def test_precedence_explicit_then_class_then_priority_then_model_then_route_then_default() -> None:
    full = {"slo": {"ttft_s": 0.1, "tpot_s": 0.01}, "slo_class": "batch", "priority": 9}
    assert resolve(dict(full)) == ResolvedSlo(slo_class="batch", ttft_s=0.1, tpot_s=0.01, source="slo")
    # An explicit target overrides only its own field; the other comes from the class picked below it.
    assert resolve({"slo": {"ttft_s": 0.1}, "slo_class": "batch"}) == \
        ResolvedSlo(slo_class="batch", ttft_s=0.1, tpot_s=0.3, source="slo")
    assert resolve({"slo_class": "batch", "priority": 9}) == \
        ResolvedSlo(slo_class="batch", ttft_s=10.0, tpot_s=0.3, source="slo_class")
    assert resolve({"priority": 9}, model="big-model", endpoint="chat") == \
        ResolvedSlo(slo_class="interactive", ttft_s=0.5, tpot_s=0.05, source="priority")
    # A priority the map does not name falls through to the defaults.
    assert resolve({"priority": 5}, model="big-model", endpoint="chat").source == "model"  # type: ignore[union-attr]
    assert resolve({}, endpoint="chat") == ResolvedSlo(slo_class="interactive", ttft_s=0.5, tpot_s=0.05, source="route")
    assert resolve({}) == ResolvedSlo(slo_class="plain", ttft_s=2.0, tpot_s=0.15, source="default")


def test_no_rule_means_no_targets_and_a_label_alone_is_kept() -> None:
    empty = SloTable()
    assert resolve({}, table=empty) is None
    assert resolve({"priority": 3}, table=empty) is None
    assert resolve({"slo": {"name": "gold"}}, table=empty) == ResolvedSlo(slo_class="gold", source="slo")
    assert resolve({"slo": {"ttft_s": 1, "name": "gold"}}, table=empty) == \
        ResolvedSlo(slo_class="gold", ttft_s=1.0, source="slo")


def test_an_unclassified_request_gets_the_gateways_own_slo_unless_the_fallback_is_off() -> None:
    on = SloTable.build(default_slo=Targets(2.0, 0.15), fallback=True)
    assert resolve({}, table=on) == ResolvedSlo(ttft_s=2.0, tpot_s=0.15, source="gateway")
    assert resolve({"slo": {"ttft_s": 0.5}}, table=on) == ResolvedSlo(ttft_s=0.5, tpot_s=0.15, source="slo")
    off = SloTable.build(default_slo=Targets(2.0, 0.15), fallback=False)
    assert resolve({}, table=off) is None
    # A configured default class still comes first.
    assert resolve({}) == ResolvedSlo(slo_class="plain", ttft_s=2.0, tpot_s=0.15, source="default")
    # From the settings: on by default, with the SLO the gateway plans for.
    table = SloTable.from_settings(parse_settings(GatewaySettings, ["--slo-ttft-s", "3", "--slo-tpot-s", "0.1"]))
    assert resolve({}, table=table) == ResolvedSlo(ttft_s=3.0, tpot_s=0.1, source="gateway")
    no = SloTable.from_settings(parse_settings(GatewaySettings, ["--no-slo-fallback"]))
    assert resolve({}, table=no) is None


def test_extension_fields_are_stripped_and_priority_kept() -> None:
    body = {"slo": {"ttft_s": 1.0}, "slo_class": "batch", "priority": 2, "other": 1}
    resolve(body)
    assert body == {"priority": 2, "other": 1}


@pytest.mark.parametrize(("body", "param"), [
    ({"slo_class": "nope"}, "slo_class"),
    ({"slo_class": 3}, "slo_class"),
    ({"slo_class": ""}, "slo_class"),
    ({"slo": [1]}, "slo"),
    ({"slo": {"ttft_s": 0}}, "slo.ttft_s"),
    ({"slo": {"ttft_s": -1.0}}, "slo.ttft_s"),
    ({"slo": {"tpot_s": "fast"}}, "slo.tpot_s"),
    ({"slo": {"tpot_s": True}}, "slo.tpot_s"),
    ({"slo": {"ttft_s": float("inf")}}, "slo.ttft_s"),
    ({"slo": {"deadline": 3}}, "slo.deadline"),
    ({"slo": {"name": "has space"}}, "slo.name"),
])
def test_bad_slo_input_is_a_400_naming_the_parameter(body: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as info:
        resolve(body)
    assert info.value.status == 400 and info.value.param == param
    assert info.value.type == "invalid_request_error"


def test_unknown_class_lists_the_known_ones() -> None:
    with pytest.raises(APIError, match="unknown SLO class 'nope'; classes: batch, interactive, plain") as info:
        resolve({"slo_class": "nope"})
    assert info.value.code == "unknown_slo_class"
    with pytest.raises(APIError, match="no SLO classes are configured"):
        resolve({"slo_class": "x"}, table=SloTable())


def test_flowprefill_preset_is_table_2_on_the_gateways_tpot() -> None:
    s = load_settings(GatewaySettings, slo_preset="tasks-flowprefill", slo_tpot_s=0.1,
                      slo_priority_class=["0=file", "1=search", "2=image", "3=text"])
    table = SloTable.from_settings(s)
    assert {n: t.ttft_s for n, t in table.classes.items()} == {"text": 0.25, "image": 0.5, "search": 4.0, "file": 6.0}
    assert {t.tpot_s for t in table.classes.values()} == {0.1}
    assert resolve({"priority": 3}, table=table) == ResolvedSlo(slo_class="text", ttft_s=0.25, tpot_s=0.1,
                                                                 source="priority")
    # Specs add to (or replace) the preset's classes.
    table = SloTable.build(preset="tasks-flowprefill", specs=["text=0.3:0.05", "video=1:0.1:0.2"],
                           default_slo=Targets(2.0, 0.15))
    assert table.classes["text"] == Targets(0.3, 0.05) and table.classes["video"] == Targets(1.0, 0.1)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"slo_class": ["x"]}, "expected NAME=TTFT_S:TPOT_S"),
    ({"slo_class": ["x=fast:1"]}, "TTFT must be a number"),
    ({"slo_class": ["x=0:1"]}, "TTFT must be a positive number"),
    ({"slo_class": ["x y=1:1"]}, "class name"),
    ({"slo_preset": "nope"}, "unknown SLO-class preset 'nope'"),
    ({"slo_class": ["a=1:1"], "slo_priority_class": ["high=a"]}, "priority must be an integer"),
    ({"slo_class": ["a=1:1"], "slo_priority_class": ["1=b"]}, "unknown class 'b'"),
    ({"slo_class": ["a=1:1"], "slo_route_class": ["generate=a"]}, "routes are completions"),
    ({"slo_class": ["a=1:1"], "slo_model_class": ["m"]}, "expected KEY=CLASS"),
    ({"slo_default_class": "a"}, "no SLO classes are configured"),
    ({"late_binding_policy": "nope"}, "unknown prefill policy 'nope'"),
    ({"late_binding_depth": 0}, "greater than or equal to 1"),
])
def test_bad_gateway_settings_fail_at_start(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_settings(GatewaySettings, **overrides)


def test_gateway_flags() -> None:
    s = parse_settings(GatewaySettings, ["--slo-class", "a=1:0.1", "--slo-class", "b=2:0.2", "--slo-route-class",
                                         "/v1/chat/completions=a", "--late-binding", "--late-binding-depth", "1"])
    assert s.slo_class == ["a=1:0.1", "b=2:0.2"] and s.late_binding and s.late_binding_depth == 1
    assert SloTable.from_settings(s).by_route == {"chat": "a"}


def _instance(kind: str, role: str) -> InstanceInfo:
    return InstanceInfo(instance_id=f"{role}-{kind}", role=role, engine_kind=kind, url="http://127.0.0.1:1",  # type: ignore[arg-type]
                        bootstrap_host="127.0.0.1", bootstrap_port=2, model="m", profile="p", kv_capacity_tokens=1000,
                        max_running_requests=8, sidecar="t", registered_at_unix_s=0.0)


@pytest.mark.parametrize(("prefill_kind", "decode_kind"), [("sim", "sim"), ("sglang", "sim"), ("sim", "attach")])
def test_poise_slo_goes_to_sim_engines_only_and_priority_to_all(prefill_kind: str, decode_kind: str) -> None:
    slo = RequestSlo(slo_class="text", ttft_s=0.25, tpot_s=0.1, waited_s=0.5)
    attempt = Attempt(rid="r-0", endpoint="completions", prefill=_instance(prefill_kind, "prefill"),
                      decode=_instance(decode_kind, "decode"), http=None, slo=lambda: slo)  # type: ignore[arg-type]
    # A client's own poise_slo is never forwarded: only the gateway's.
    prefill, decode = attempt.bodies({"model": "m", "prompt": "hi", "priority": 3, SLO_FIELD: {"ttft_s": 9}})
    assert prefill is not None
    for body, kind in ((prefill, prefill_kind), (decode, decode_kind)):
        assert body["priority"] == 3
        if kind == "sim":
            assert parse_request_slo(body[SLO_FIELD]) == slo
        else:
            assert SLO_FIELD not in body


def test_stack_flags_reach_the_gateway_and_every_engine() -> None:
    from services.cli.main import RunSettings
    from services.cli.stack import StackSettings
    from services.engine_sim.config import EngineSimSettings
    from services.worker.config import WorkerSettings
    from services.worker.launcher import build_engine_command

    s = parse_settings(StackSettings, [
        "--prefill-policy", "edf", "--decode-policy", "continuous", "--preemption", "operator",
        "--chunked-prefill-size", "-1", "--late-binding", "--late-binding-policy", "fcfs", "--late-binding-depth", "1",
        "--gateway-slo-class", "text=0.25:0.1", "--gateway-slo-class", "file=6:", "--gateway-slo-preset", "interactive-batch",
    ])
    gw = parse_settings(GatewaySettings, s.gateway_policy_args())
    assert (gw.late_binding, gw.late_binding_policy, gw.late_binding_depth) == (True, "fcfs", 1)
    assert gw.slo_class == ["text=0.25:0.1", "file=6:"] and gw.slo_preset == "interactive-batch"
    assert set(SloTable.from_settings(gw).classes) == {"interactive", "batch", "text", "file"}
    # The worker passes the engine flags on to engine_sim, which must accept them.
    import json

    worker = parse_settings(WorkerSettings, ["--instance-id", "p0", "--role", "prefill", "--engine-port", "1",
                                             "--bootstrap-port", "2", "--extra-args", json.dumps(s.engine_args())])
    cmd = build_engine_command(worker, python="python")
    assert cmd is not None
    engine = parse_settings(EngineSimSettings, cmd[3:])
    assert (engine.prefill_policy, engine.decode_policy, engine.preemption, engine.chunked_prefill_size) == \
        ("edf", "continuous", "operator", -1)
    assert parse_settings(RunSettings, ["--late-binding"]).late_binding
    static = load_settings(StackSettings, planner_policy="static")  # nothing set: stock engines, a plain gateway
    assert static.engine_args() == [] and static.gateway_policy_args() == []


@pytest.mark.parametrize(("overrides", "message"), [
    ({"prefill_policy": "nope"}, "unknown prefill policy"),
    ({"late_binding_policy": "nope"}, "unknown prefill policy"),
    ({"decode_policy": "nope"}, "unknown decode batch policy"),
    ({"preemption": "layer"}, "unknown preemption"),
    ({"chunked_prefill_size": 0}, "positive, or -1"),
    ({"gateway_slo_class": ["text"]}, "expected NAME=TTFT_S:TPOT_S"),
    ({"gateway_slo_preset": "nope"}, "unknown SLO-class preset"),
])
def test_bad_stack_flags_fail_before_anything_starts(overrides: dict[str, Any], message: str) -> None:
    from services.cli.stack import StackSettings

    with pytest.raises(ConfigError, match=message):
        load_settings(StackSettings, **overrides)
