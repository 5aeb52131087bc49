"""Worker sidecar settings (env prefix ``POISE_WORKER_``, or the matching ``--flags``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from shared.latency import DEFAULT_PROFILE, load_profile
from shared.policies.flip import DRAIN_TIMEOUT_S
from shared.protocol import Subjects
from shared.protocol.messages import EngineKind, Role
from shared.settings import ControlPlaneSettings, settings_config

SGLANG_DEFAULT_BOOTSTRAP_PORT = 8998  # sglang/srt/arg_groups/fields/disagg.py:81 (0.5.23)
# Backends whose KV manager can be rebuilt in the other role: sglang/srt/disaggregation/mooncake/conn.py:258
# (supports_role_switch = True; mori/conn.py:375 too, not offered here); mooncake_tcp is rewritten to mooncake
# (arg_groups/pd_disaggregation_hook.py:30).
ROLE_SWITCH_BACKENDS = ("mooncake", "mooncake_tcp")


class WorkerSettings(ControlPlaneSettings):
    """The sidecar next to one engine: launch or attach, register, report load, carry out role switches."""

    model_config = settings_config("POISE_WORKER_")

    instance_id: str = Field(description="This engine's id in the cluster (letters, digits, _ and -); names its etcd key and NATS subjects.")
    role: Role | None = Field(None, description="PD role to launch the engine with: prefill, decode or null (colocated). Required for sim/sglang; unset with attach = read it from the engine's /server_info.")
    engine_kind: EngineKind = Field("sim", description="sim = spawn engine_sim; sglang = spawn python -m sglang.launch_server; attach = use a running engine at engine_url.")
    engine_host: str = Field("127.0.0.1", description="Address the spawned engine binds to.")
    engine_port: int = Field(0, ge=0, le=65535, description="HTTP port of the spawned engine; 0 = pick a free port (picked again at each launch if another process took it since).")
    advertise_host: str | None = Field(None, description="Host that other processes use to reach the engine (its URL and the bootstrap_host decode engines pull KV from); unset = engine_host.")
    bootstrap_port: int | None = Field(None, ge=0, le=65535, description="KV bootstrap server port of a PD-mode engine (prefill, and decode after a switch to prefill); 0 = pick a free port (picked again at launch if taken since); unset = SGLang's default 8998 for sglang, a free port for sim (many engines share a host), the engine's own for attach.")
    engine_url: str | None = Field(None, description="Base URL of the running engine (attach only), e.g. http://10.0.0.5:30000.")
    model: str | None = Field(None, description="Served model name clients ask for; unset = the profile's model (sim), model_path (sglang) or what the engine reports (attach).")
    profile: str = Field(DEFAULT_PROFILE, description="Latency profile name or .json path: engine_sim's timing, and the capacity fallback when the engine does not report it.")
    time_scale: float = Field(1.0, ge=0.0, description="engine_sim only: multiplies every modelled duration (1.0 = the profiled GPU).")
    seed: int = Field(0, description="engine_sim only: random seed.")
    load_interval_s: float = Field(0.25, gt=0.0, description="Seconds between /v1/loads reads, each published as a LoadReport.")
    lease_ttl_s: int = Field(5, ge=1, description="etcd lease TTL in seconds: the instance key disappears this long after the sidecar dies.")
    drain_timeout_s: float = Field(DRAIN_TIMEOUT_S, gt=0.0, description="Longest wait, in seconds, for the engine to go idle before a role switch (a command's own shorter timeout wins).")
    health_timeout_s: float = Field(600.0, gt=0.0, description="Seconds to wait for the engine's /health after (re)start (SGLang loads weights and captures CUDA graphs first).")
    stalled_after_s: float = Field(20.0, gt=0.0, description="Seconds the engine's load snapshot may stop advancing while it has work before the engine counts as hung (a step that never ends) and, after unhealthy_after_s more, leaves the registry. Above the engine's longest step; compares the engine's clock with this host's.")
    unhealthy_after_s: float = Field(5.0, gt=0.0, description="Seconds of failing /v1/loads after which a running engine is taken out of the registry (it returns when it answers again).")
    restart_backoff_s: float = Field(1.0, gt=0.0, description="First delay, in seconds, before restarting an engine that exited; doubles per consecutive failure.")
    restart_backoff_max_s: float = Field(30.0, gt=0.0, description="Upper bound of the restart delay, in seconds; an engine that ran this long before exiting starts the back-off (and the failure count) over.")
    restart_max_failures: int = Field(5, ge=0, description="Consecutive engine failures (an exit, or a restart that never became healthy) after which the worker gives up: it deregisters, logs why with the engine log's tail, and exits with status 1. 0 = restart forever.")
    forecast_ttl_s: float = Field(35.0, gt=0.0, description="engine_sim prefill engines: seconds a relayed planner ISL forecast (DOPD, for the dopd-length prefill policy) stays in force without a newer one; then the sidecar withdraws it and the policy uses its own running mean. Default: three of DOPD's 10 s intervals and some slack.")
    engine_timeout_s: float = Field(5.0, gt=0.0, description="HTTP timeout, in seconds, of each health/load call to the engine.")
    stop_timeout_s: float = Field(15.0, gt=0.0, description="Seconds between SIGTERM and SIGKILL when stopping the engine.")
    log_dir: Path = Field(Path("logs"), description="Directory of the engine's log file (engine-<instance_id>.log).")
    # -- sglang only ---------------------------------------------------------------------------------
    model_path: str | None = Field(None, description="sglang only: --model-path (Hugging Face id or local directory).")
    tp: int = Field(1, ge=1, description="sglang only: tensor-parallel size (--tp-size).")
    transfer_backend: Literal["mooncake", "mooncake_tcp", "nixl"] = Field("mooncake", description="sglang only: --disaggregation-transfer-backend. mooncake_tcp is SGLang's Mooncake over TCP (no RDMA, ib_device unused). Runtime role switch needs mooncake or mooncake_tcp.")
    ib_device: str | None = Field(None, description="sglang only: --disaggregation-ib-device, e.g. mlx5_0 (a comma list or SGLang's per-GPU JSON map also work).")
    mem_fraction_static: float | None = Field(None, gt=0.0, lt=1.0, description="sglang only: --mem-fraction-static (share of GPU memory for weights and KV).")
    max_running_requests: int | None = Field(None, ge=0, description="sglang only: --max-running-requests, the most requests the engine runs at once. Unset = the latency profile's cap (max_running_requests of profile), so the engine runs the requests the planner, the gateway and every simulated table assume; 0 = no flag, SGLang sizes it from its KV pool (2048 on the default profile's). A --max-running-requests in extra_args wins.")
    enable_pd_role_switch: bool | None = Field(None, description="sglang only: pass --enable-pd-role-switch to prefill/decode engines, so the planner can flip them. Unset = on for mooncake/mooncake_tcp, off for nixl (SGLang 0.5.23 refuses role switches on nixl).")
    return_hidden_states: Literal["off", "last", "full"] = Field("off", description="sglang only: let requests ask for hidden states (the ARES length predictor reads the last token's). last = --return-hidden-states-mode last; full = --enable-return-hidden-states (every position); off = neither.")
    sglang_python: str | None = Field(None, description="sglang only: Python interpreter of the SGLang environment; runs `-m sglang.launch_server` and the version check. Unset = the worker's own interpreter.")
    sglang_allow_unpinned: bool = Field(False, description="sglang only: launch even when the engine environment's sglang is not a version this worker was checked against (only a warning then).")
    device: str | None = Field(None, description="sglang only: --device (cpu, cuda, ...); unset = SGLang's auto-detection.")
    attention_backend: str | None = Field(None, description="sglang only: --attention-backend; unset = SGLang's choice for the device.")
    max_total_tokens: int | None = Field(None, ge=1, description="sglang only: --max-total-tokens, the KV pool's size in tokens; unset = SGLang sizes it from mem_fraction_static.")
    sleep_on_idle: bool = Field(False, description="sglang only: --sleep-on-idle: a fully idle scheduler waits on its sockets instead of polling (SGLang's loop otherwise keeps one core busy per engine, which on a host that runs several engines and the control plane starves the others).")
    disable_overlap_schedule: bool = Field(False, description="sglang only: --disable-overlap-schedule (every role: a decode engine may be switched to prefill).")
    decode_retraction_backup: Literal["none", "cpu_tensor", "host_pool"] | None = Field(None, description="sglang only: --disaggregation-decode-retraction-backup of PD engines; unset = SGLang's host_pool, which needs CUDA.")
    decode_cuda_graph_memory_gb: float | None = Field(None, ge=0.0, description="sglang only: decode_cuda_graph_memory_gb sent with a switch to decode (SGLang 0.5.23 refuses a switch to decode without it when the engine has no decode CUDA graphs yet, as one launched as prefill has); unset = not sent (engine_sim: 0). On a GPU node, the memory SGLang may use for the decode graphs of a prefill engine that becomes decode.")
    engine_preset: str | None = Field(None, description="Defaults for the engine fields from a named preset (services/worker/presets.py): sglang-cpu = SGLang 0.5.23 on this CPU with SmolLM2-135M-Instruct, from make sglang-setup. A field set here wins; engine_env is merged.")
    engine_api_key: str | None = Field(None, description="The engine's API key (SGLang --api-key): a spawned engine is started with it (engine_sim through its environment, SGLang with the flag) and the sidecar sends it; with attach, the running engine's key. Prefer the env var POISE_WORKER_ENGINE_API_KEY to the flag.")
    engine_env: dict[str, str] = Field(default_factory=dict, description="Extra environment variables of the spawned engine (JSON object), e.g. {\"CUDA_VISIBLE_DEVICES\": \"2,3\", \"MOONCAKE_PROTOCOL\": \"tcp\"}.")
    extra_args: list[str] = Field(default_factory=list, description="Extra engine command-line arguments, appended as given (JSON list).")
    # The profile's request cap, read once when the settings are made: the sidecar builds the engine's command
    # on its event loop, at every (re)launch.
    _profile_cap: int | None = PrivateAttr(None)

    @model_validator(mode="before")
    @classmethod
    def _preset_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("engine_preset"):
            from services.worker.presets import engine_preset

            return engine_preset(data["engine_preset"]).apply(data)
        return data

    @field_validator("instance_id")
    @classmethod
    def _valid_id(cls, value: str) -> str:
        Subjects().load(value)  # raises ValueError for ids that are not NATS subject tokens
        return value

    @model_validator(mode="after")
    def _consistent(self) -> WorkerSettings:
        if self.engine_kind == "attach":
            if not self.engine_url:
                raise ValueError("engine_kind=attach needs engine_url")
        else:
            if self.role is None:
                raise ValueError(f"engine_kind={self.engine_kind} needs a role (prefill, decode or null)")
            if self.engine_url:
                raise ValueError("engine_url is only for engine_kind=attach (spawned engines use engine_host/engine_port)")
        if self.engine_kind == "sglang" and not self.model_path:
            raise ValueError("engine_kind=sglang needs model_path")
        if self.enable_pd_role_switch and self.transfer_backend not in ROLE_SWITCH_BACKENDS:
            raise ValueError(f"enable_pd_role_switch needs transfer_backend {' or '.join(ROLE_SWITCH_BACKENDS)}: SGLang "
                             f"0.5.23 refuses role switches on {self.transfer_backend} (only Mooncake's KV manager sets "
                             "supports_role_switch)")
        if self.ib_device and self.transfer_backend == "mooncake_tcp":
            raise ValueError("ib_device has no effect with transfer_backend=mooncake_tcp (SGLang clears it: TCP, no RDMA)")
        if self.engine_kind == "sglang" and self.max_running_requests is None:
            # a profile that does not load fails here, not at the engine's first launch
            self._profile_cap = load_profile(self.profile).max_running_requests
        if self.engine_kind == "sim" and self.decode_cuda_graph_memory_gb is None:
            self.decode_cuda_graph_memory_gb = 0.0  # engine_sim captures no graphs, but asks as SGLang does
        if self.restart_backoff_max_s < self.restart_backoff_s:
            raise ValueError("restart_backoff_max_s must be >= restart_backoff_s")
        return self

    @property
    def public_host(self) -> str:
        return self.advertise_host or self.engine_host

    @property
    def sglang_request_cap(self) -> int | None:
        """The ``--max-running-requests`` a spawned SGLang engine gets (``None``: none, SGLang's own)."""
        if self.max_running_requests is None:
            return self._profile_cap
        return self.max_running_requests or None

    @property
    def sglang_role_switch(self) -> bool:
        """Whether a spawned SGLang engine gets ``--enable-pd-role-switch`` (in a PD role)."""
        if self.enable_pd_role_switch is None:
            return self.transfer_backend in ROLE_SWITCH_BACKENDS
        return self.enable_pd_role_switch
