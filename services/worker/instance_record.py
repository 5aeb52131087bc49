"""The instance record a sidecar registers for its engine, from what the engine says about itself.

Each field comes from the engine where it says (``/server_info``, then ``/v1/loads``) and from the
configuration or the latency profile where it does not; an attached engine's role and bootstrap port are its
own, not the configuration's.
"""

from __future__ import annotations

import logging
import time
from typing import cast

import httpx

from services.worker.config import SGLANG_DEFAULT_BOOTSTRAP_PORT, WorkerSettings
from shared.engine_client import EngineLoads, EngineServerInfo
from shared.latency import LatencyProfile
from shared.protocol import InstanceInfo
from shared.protocol.messages import InstanceStatus, Role

log = logging.getLogger(__name__)


def instance_info(s: WorkerSettings, *, url: str, role: Role, status: InstanceStatus, sidecar: str,
                  info: EngineServerInfo | None, loads: EngineLoads | None,
                  profile: LatencyProfile | None) -> InstanceInfo:
    capacity = (info.max_total_num_tokens if info else None) or (loads.max_total_num_tokens if loads else 0) \
        or (profile.kv_capacity_tokens if profile else 0)
    max_running = (info.max_running_requests if info else None) or (loads.max_running_requests if loads else 0) \
        or (profile.max_running_requests if profile else 0)
    bootstrap_port: int | None
    if s.engine_kind == "attach":
        bootstrap_port = (info.disaggregation_bootstrap_port if info else None) or s.bootstrap_port \
            or SGLANG_DEFAULT_BOOTSTRAP_PORT
        host = httpx.URL(url).host or s.public_host
    else:
        bootstrap_port, host = s.bootstrap_port, s.public_host
    model = s.model or (info.served_model_name if info else None) or s.model_path \
        or (profile.model if profile else "default")
    return InstanceInfo(
        instance_id=s.instance_id, role=role, status=status, engine_kind=s.engine_kind, url=url,
        bootstrap_host=host, bootstrap_port=bootstrap_port if role != "null" else None, model=model,
        profile=s.profile, kv_capacity_tokens=int(capacity), max_running_requests=int(max_running),
        sidecar=sidecar, registered_at_unix_s=time.time(),
        applies_seed=info.deterministic if info is not None else s.engine_kind == "sim",
    )


def live_mode(loads: EngineLoads | None, info: EngineServerInfo | None) -> str | None:
    """The engine's current PD role: ``/v1/loads`` ``disaggregation.mode`` (the scheduler's own), else
    ``/server_info`` ``internal_states[].disaggregation_mode``, else its top-level field. In SGLang 0.5.23
    the top level is the startup config and does not follow a role switch; internal_states carries the
    runtime overrides (sglang/srt/runtime_context.py:1164-1171, resolved_server_args_dict)."""
    if loads is not None and loads.mode is not None:
        return loads.mode
    if info is None:
        return None
    for state in info.raw.get("internal_states") or []:
        if isinstance(state, dict) and isinstance(state.get("disaggregation_mode"), str):
            return str(state["disaggregation_mode"])
    return info.disaggregation_mode


ROLES: tuple[Role, ...] = ("prefill", "decode", "null")


def registered_role(configured: Role | None, loads: EngineLoads | None, info: EngineServerInfo | None, *,
                    engine_decides: bool, url: str) -> Role | None:
    """The role to register: the configured one, or for an engine this sidecar did not start in it (attached,
    or adopted from a previous run, which may have flipped it since) the engine's own live mode."""
    reported = live_mode(loads, info)
    if reported is not None and reported not in ROLES:
        log.warning("engine reports unknown disaggregation mode %r", reported)
        reported = None
    if not engine_decides:
        return configured
    if configured is not None and reported is not None and reported != configured:
        log.warning("engine at %s runs as %s, not %s as configured; registering %s", url, reported, configured,
                    reported)
    return cast("Role | None", reported) or configured or "null"
