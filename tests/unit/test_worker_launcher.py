"""The worker's engine command lines and settings rules (pure, no processes)."""

from __future__ import annotations

import pytest

from services.worker.config import WorkerSettings
from services.worker.launcher import build_engine_command, resolve_ports
from shared.errors import ConfigError
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
                   "--time-scale", "0.5", "--seed", "7", "--instance-id", "p0", "--enable-pd-role-switch"]


def test_sim_colocated_has_no_bootstrap_and_keeps_extra_args() -> None:
    cmd = build_engine_command(_settings(role="null", extra_args=["--kv-capacity-tokens", "1000"]), python="py")
    assert cmd is not None
    assert "--bootstrap-port" not in cmd and "--served-model-name" not in cmd
    assert cmd[cmd.index("--mode") + 1] == "null"
    assert cmd[-2:] == ["--kv-capacity-tokens", "1000"]


def test_role_override_relaunches_in_the_current_role() -> None:
    cmd = build_engine_command(_settings(role="prefill"), python="py", role="decode")
    assert cmd is not None and cmd[cmd.index("--mode") + 1] == "decode"


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_sglang_pd_command(role: str) -> None:
    s = _settings(engine_kind="sglang", role=role, model_path="/models/llama", model="llama", tp=2,
                  transfer_backend="nixl", ib_device="mlx5_0", mem_fraction_static=0.85, extra_args=["--log-level", "info"])
    cmd = build_engine_command(s, python="py")
    assert cmd == ["py", "-m", "sglang.launch_server", "--model-path", "/models/llama", "--served-model-name", "llama",
                   "--host", "127.0.0.1", "--port", "31000", "--tp", "2", "--mem-fraction-static", "0.85",
                   "--disaggregation-mode", role, "--disaggregation-bootstrap-port", "9000",
                   "--disaggregation-transfer-backend", "nixl", "--disaggregation-ib-device", "mlx5_0",
                   "--enable-pd-role-switch", "--enable-metrics", "--log-level", "info"]


def test_sglang_colocated_has_no_disaggregation_flags() -> None:
    cmd = build_engine_command(_settings(engine_kind="sglang", role="null", model_path="m"), python="py")
    assert cmd is not None
    assert not [a for a in cmd if a.startswith("--disaggregation")] and "--enable-pd-role-switch" not in cmd
    assert "--enable-metrics" in cmd and "--mem-fraction-static" not in cmd and "--served-model-name" not in cmd


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


@pytest.mark.parametrize(("overrides", "message"), [
    ({"engine_kind": "attach", "role": None}, "engine_url"),
    ({"role": None}, "needs a role"),
    ({"engine_kind": "sglang"}, "model_path"),
    ({"engine_url": "http://x:1"}, "only for engine_kind=attach"),
    ({"instance_id": "p.0"}, "subject token"),
    ({"restart_backoff_s": 5.0, "restart_backoff_max_s": 1.0}, "restart_backoff_max_s"),
])
def test_settings_rules(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _settings(**overrides)


def test_flags_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POISE_WORKER_LOAD_INTERVAL_S", "0.5")
    s = parse_settings(WorkerSettings, ["--instance-id", "d1", "--role", "decode", "--engine-port", "1234",
                                        "--extra-args", '["--a", "b"]', "--namespace", "ns1"])
    assert (s.instance_id, s.role, s.engine_port, s.load_interval_s, s.extra_args, s.namespace) == \
        ("d1", "decode", 1234, 0.5, ["--a", "b"], "ns1")
