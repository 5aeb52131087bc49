"""The worker's engine command lines and settings rules (pure, no processes)."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import msgspec
import pytest

from services.worker.config import WorkerSettings
from services.worker.launcher import (
    SglangVersionError,
    build_engine_command,
    check_sglang_version,
    reclaim_ports,
    resolve_ports,
)
from shared.devservers import port_available
from shared.errors import ConfigError
from shared.latency import load_profile, save_profile
from shared.runtime import restart_delay
from shared.settings import load_settings, parse_settings


def _settings(**kw: object) -> WorkerSettings:
    base: dict[str, object] = {"instance_id": "p0", "role": "prefill", "engine_kind": "sim", "engine_port": 31000,
                               "bootstrap_port": 9000}
    base.update(kw)
    return load_settings(WorkerSettings, **base)


def test_sim_prefill_command() -> None:
    cmd = build_engine_command(_settings(model="m", time_scale=0.5, seed=7), python="py")
    assert cmd == ["py", "-m", "services.engine_sim", "--host", "127.0.0.1", "--port", "31000", "--mode", "prefill",
                   "--bootstrap-port", "9000", "--served-model-name", "m", "--profile", "llama-3.1-8b-h100",
                   "--time-scale", "0.5", "--seed", "7", "--instance-id", "p0", "--enable-pd-role-switch", "--enable-cache-report"]


def test_sim_colocated_has_no_bootstrap_and_keeps_extra_args() -> None:
    cmd = build_engine_command(_settings(role="null", extra_args=["--kv-capacity-tokens", "1000"]), python="py")
    assert cmd is not None
    assert "--bootstrap-port" not in cmd and "--served-model-name" not in cmd
    assert cmd[cmd.index("--mode") + 1] == "null"
    assert cmd[-2:] == ["--kv-capacity-tokens", "1000"]


def test_a_colocated_engine_keeps_its_chunk_where_prefill_engines_run_unchunked() -> None:
    extra = ["--prefill-policy", "flowprefill", "--chunked-prefill-size", "-1", "--preemption", "operator"]
    prefill = build_engine_command(_settings(extra_args=extra), python="py")
    assert prefill is not None and prefill[-6:] == extra
    for kind in ("sim", "sglang"):
        fields: dict[str, object] = {"model_path": "m"} if kind == "sglang" else {}
        for args in (extra, ["--chunked-prefill-size=0", "--preemption", "operator"]):
            cmd = build_engine_command(_settings(role="null", engine_kind=kind, extra_args=args, **fields), python="py")
            assert cmd is not None and not any(a.startswith("--chunked-prefill-size") for a in cmd)
            assert cmd[-2:] == ["--preemption", "operator"]
    chunked = build_engine_command(_settings(role="null", extra_args=["--chunked-prefill-size", "4096"]), python="py")
    assert chunked is not None and chunked[-2:] == ["--chunked-prefill-size", "4096"]


def test_role_override_relaunches_in_the_current_role() -> None:
    cmd = build_engine_command(_settings(role="prefill"), python="py", role="decode")
    assert cmd is not None and cmd[cmd.index("--mode") + 1] == "decode"


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_sglang_pd_command(role: str) -> None:
    s = _settings(engine_kind="sglang", role=role, model_path="/models/llama", model="llama", tp=2,
                  transfer_backend="mooncake", ib_device="mlx5_0", mem_fraction_static=0.85,
                  extra_args=["--log-level", "info"])
    cmd = build_engine_command(s, python="py")
    assert cmd == ["py", "-m", "sglang.launch_server", "--model-path", "/models/llama", "--served-model-name", "llama",
                   "--host", "127.0.0.1", "--port", "31000", "--tp-size", "2", "--mem-fraction-static", "0.85",
                   "--max-running-requests", "256", "--disaggregation-mode", role, "--disaggregation-bootstrap-port", "9000",
                   "--disaggregation-transfer-backend", "mooncake", "--disaggregation-ib-device", "mlx5_0",
                   "--enable-pd-role-switch", "--enable-metrics", "--enable-cache-report", "--log-level", "info"]


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("role", ["prefill", "decode", "null"])
@pytest.mark.parametrize("backend", ["mooncake", "mooncake_tcp", "nixl"])
def test_sglang_command_per_role_backend_and_tp(role: str, backend: str, tp: int) -> None:
    cmd = build_engine_command(_settings(engine_kind="sglang", role=role, model_path="m", tp=tp,
                                         transfer_backend=backend), python="py")
    assert cmd is not None
    assert cmd[:5] == ["py", "-m", "sglang.launch_server", "--model-path", "m"]
    assert cmd[cmd.index("--tp-size") + 1] == str(tp) and "--tp" not in cmd
    assert cmd[-2:] == ["--enable-metrics", "--enable-cache-report"]
    if role == "null":  # colocated: SGLang's default mode, no disaggregation options at all
        assert not [a for a in cmd if a.startswith("--disaggregation")] and "--enable-pd-role-switch" not in cmd
        return
    assert cmd[cmd.index("--disaggregation-mode") + 1] == role
    assert cmd[cmd.index("--disaggregation-transfer-backend") + 1] == backend
    assert cmd[cmd.index("--disaggregation-bootstrap-port") + 1] == "9000"
    # Runtime role switch only where SGLang 0.5.23 supports it (Mooncake's KV manager).
    assert ("--enable-pd-role-switch" in cmd) == (backend != "nixl")


def test_sglang_runs_the_profiles_request_cap_unless_told_otherwise(tmp_path: Path) -> None:
    """SGLang 0.5.23 sizes its cap from the KV pool (2048 on the default profile's) where the profile, and so
    the planner, the gateway and every simulated table, assume 256: a spawned engine gets the profile's."""
    base = {"engine_kind": "sglang", "role": "decode", "model_path": "m"}

    def cap(**fields: Any) -> list[str]:
        cmd = build_engine_command(_settings(**base, **fields), python="py")
        assert cmd is not None
        return [cmd[i + 1] if a == "--max-running-requests" else a.partition("=")[2]
                for i, a in enumerate(cmd) if a.partition("=")[0] == "--max-running-requests"]

    assert cap() == ["256"]
    profile = load_profile()
    custom = tmp_path / "custom.json"
    save_profile(msgspec.structs.replace(profile, max_running_requests=1024), custom)
    assert cap(profile=str(custom)) == ["1024"]
    assert cap(max_running_requests=512) == ["512"]
    assert cap(max_running_requests=0) == []  # SGLang's own
    assert cap(extra_args=["--max-running-requests", "64"]) == ["64"]  # the operator's flag, once
    assert cap(extra_args=["--max-running-requests=64"]) == ["64"]
    with pytest.raises(ValueError, match="latency profile"):
        _settings(**base, profile=str(tmp_path / "missing.json"))
    _settings(**base, profile=str(tmp_path / "missing.json"), max_running_requests=0)  # not read then


def test_sglang_python_and_hidden_states() -> None:
    base = {"engine_kind": "sglang", "role": "decode", "model_path": "m"}
    cmd = build_engine_command(_settings(**base, sglang_python="/opt/sglang/bin/python"), python="py")
    assert cmd is not None and cmd[0] == "/opt/sglang/bin/python"
    assert "--enable-return-hidden-states" not in cmd and "--return-hidden-states-mode" not in cmd
    cmd = build_engine_command(_settings(**base, return_hidden_states="full"), python="py")
    assert cmd is not None and "--enable-return-hidden-states" in cmd and "--return-hidden-states-mode" not in cmd
    cmd = build_engine_command(_settings(**base, return_hidden_states="last"), python="py")
    assert cmd is not None and cmd[cmd.index("--return-hidden-states-mode") + 1] == "last"
    assert "--enable-return-hidden-states" not in cmd


def test_role_switch_can_be_turned_off_but_not_forced_on_nixl() -> None:
    cmd = build_engine_command(_settings(engine_kind="sglang", model_path="m", enable_pd_role_switch=False),
                               python="py")
    assert cmd is not None and "--enable-pd-role-switch" not in cmd
    with pytest.raises(ConfigError, match="enable_pd_role_switch needs transfer_backend"):
        _settings(engine_kind="sglang", model_path="m", transfer_backend="nixl", enable_pd_role_switch=True)
    with pytest.raises(ConfigError, match="mooncake_tcp"):
        _settings(engine_kind="sglang", model_path="m", transfer_backend="mooncake_tcp", ib_device="mlx5_0")


def test_sglang_colocated_has_no_disaggregation_flags() -> None:
    cmd = build_engine_command(_settings(engine_kind="sglang", role="null", model_path="m"), python="py")
    assert cmd is not None
    assert not [a for a in cmd if a.startswith("--disaggregation")] and "--enable-pd-role-switch" not in cmd
    assert "--enable-metrics" in cmd and "--mem-fraction-static" not in cmd and "--served-model-name" not in cmd


def test_sglang_version_pin() -> None:
    check_sglang_version("0.5.23", "py")
    check_sglang_version("0.5.23+cu130", "py")  # a local build tag does not change the source
    with pytest.raises(SglangVersionError, match=r"py has sglang 0\.5\.22, but this worker supports sglang 0\.5\.23"):
        check_sglang_version("0.5.22", "py")
    check_sglang_version("0.6.0", "py", allow_unpinned=True)  # only a warning


def test_restart_delay_doubles_up_to_the_cap() -> None:
    assert [restart_delay(n, 1.0, 30.0) for n in range(1, 8)] == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert restart_delay(1, 0.2, 0.5) == 0.2 and restart_delay(3, 0.2, 0.5) == 0.5


def test_attach_launches_nothing() -> None:
    s = _settings(engine_kind="attach", role=None, engine_url="http://10.0.0.5:30000")
    assert build_engine_command(s) is None
    assert resolve_ports(s, lambda host: 1) is s


def test_ports_must_be_resolved_first() -> None:
    with pytest.raises(ValueError, match="resolve ports"):
        build_engine_command(_settings(engine_port=0))


def test_resolve_ports() -> None:
    ports = iter([40001, 40002])
    s = resolve_ports(_settings(engine_port=0, bootstrap_port=None), lambda host: next(ports))
    assert (s.engine_port, s.bootstrap_port) == (40001, 40002)
    s = resolve_ports(_settings(engine_kind="sglang", model_path="m", bootstrap_port=None), lambda host: 1)
    assert s.bootstrap_port == 8998  # SGLang's default
    s = resolve_ports(_settings(bootstrap_port=0), lambda host: 5)
    assert s.bootstrap_port == 5


def test_reclaim_ports_re_picks_only_picked_ports_that_were_taken() -> None:
    requested = _settings(engine_port=0, bootstrap_port=None)
    picked = requested.model_copy(update={"engine_port": 40001, "bootstrap_port": 40002})

    def reclaim(taken: set[int]) -> WorkerSettings:
        free = iter([41001, 41002])
        return reclaim_ports(requested, picked, lambda host, port: port not in taken, lambda host: next(free))

    assert reclaim(set()) is picked
    assert (reclaim({40001}).engine_port, reclaim({40001}).bootstrap_port) == (41001, 40002)
    assert (reclaim({40002}).engine_port, reclaim({40002}).bootstrap_port) == (40001, 41001)
    assert (reclaim({40001, 40002}).engine_port, reclaim({40001, 40002}).bootstrap_port) == (41001, 41002)
    # The operator's ports stay, taken or not: the clash is theirs to see in the engine log.
    fixed = _settings(engine_port=31000, bootstrap_port=9000)
    assert reclaim_ports(fixed, fixed, lambda host, port: False, lambda host: 1) is fixed
    attach = _settings(engine_kind="attach", role=None, engine_url="http://10.0.0.5:30000")
    assert reclaim_ports(attach, attach, lambda host, port: False, lambda host: 1) is attach


def test_port_available_sees_a_listener() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        assert not port_available("127.0.0.1", port)
    assert port_available("127.0.0.1", port)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"engine_kind": "attach", "role": None}, "engine_url"),
    ({"role": None}, "needs a role"),
    ({"engine_kind": "sglang"}, "model_path"),
    ({"engine_url": "http://x:1"}, "only for engine_kind=attach"),
    ({"instance_id": "p.0"}, "subject token"),
    ({"restart_backoff_s": 5.0, "restart_backoff_max_s": 1.0}, "restart_backoff_max_s"),
    ({"restart_max_failures": -1}, "restart_max_failures"),
])
def test_settings_rules(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _settings(**overrides)


def test_flags_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POISE_WORKER_LOAD_INTERVAL_S", "0.5")
    s = parse_settings(WorkerSettings, ["--instance-id", "d1", "--role", "decode", "--engine-port", "1234",
                                        "--extra-args", '["--a", "b"]', "--namespace", "ns1",
                                        "--engine-env", '{"CUDA_VISIBLE_DEVICES": "2,3"}', "--no-enable-pd-role-switch"])
    assert (s.instance_id, s.role, s.engine_port, s.load_interval_s, s.extra_args, s.namespace) == \
        ("d1", "decode", 1234, 0.5, ["--a", "b"], "ns1")
    assert s.engine_env == {"CUDA_VISIBLE_DEVICES": "2,3"} and s.enable_pd_role_switch is False


def test_the_sglang_cpu_preset_fills_what_is_unset_and_the_operator_wins() -> None:
    from services.worker.presets import SGLANG_CPU_MODEL, sglang_cpu_venv

    s = _settings(engine_kind=None, engine_preset="sglang-cpu", engine_env={"SGLANG_CPU_OMP_THREADS_BIND": "1"},
                  advertise_host="10.1.2.3")
    assert s.engine_kind == "sglang" and s.model == SGLANG_CPU_MODEL and s.transfer_backend == "mooncake_tcp"
    assert s.sglang_python == str(sglang_cpu_venv() / "bin" / "python") and s.decode_cuda_graph_memory_gb == 0.0
    assert s.engine_env == {"SGLANG_USE_CPU_ENGINE": "1", "SGLANG_HOST_IP": "10.1.2.3",
                            "SGLANG_CPU_OMP_THREADS_BIND": "1"}
    cmd = build_engine_command(s)
    assert cmd is not None
    for flag, value in (("--device", "cpu"), ("--attention-backend", "torch_native"), ("--max-total-tokens", "16384"),
                        ("--disaggregation-decode-retraction-backup", "none"),
                        ("--disaggregation-transfer-backend", "mooncake_tcp")):
        assert cmd[cmd.index(flag) + 1] == value, flag
    assert "--disable-overlap-schedule" in cmd and "--sleep-on-idle" in cmd
    colocated = build_engine_command(_settings(engine_kind=None, engine_preset="sglang-cpu", role="null"))
    assert colocated is not None and "--disaggregation-decode-retraction-backup" not in colocated
    own = _settings(engine_kind=None, engine_preset="sglang-cpu", max_total_tokens=4096, model_path="/m",
                    engine_env={"SGLANG_HOST_IP": "127.0.0.2"})
    assert own.max_total_tokens == 4096 and own.model_path == "/m" and own.engine_env["SGLANG_HOST_IP"] == "127.0.0.2"
    with pytest.raises(ConfigError, match="unknown engine preset 'tpu'; known: sglang-cpu"):
        _settings(engine_preset="tpu")


def test_an_engine_api_key_that_starts_with_a_dash_stays_the_flags_value() -> None:
    cmd = build_engine_command(_settings(engine_kind="sglang", model_path="m", engine_api_key="-abc"))
    assert cmd is not None and "--api-key=-abc" in cmd and "--api-key" not in cmd
