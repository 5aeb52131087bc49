"""POST /pd_role_switch: flip a PD engine between prefill and decode, with SGLang's preconditions.

The switch itself is short (stop or start the bootstrap server, change ``mode``); what matters for Poise's
control plane is that the checks and messages come in SGLang's order and that a failure leaves the
instance unhealthy, as a failed teardown/rebuild would.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Protocol

from services.engine_sim.config import EngineSimSettings, Mode
from shared.latency import LatencyModel

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RoleSwitchResult:
    """PdRoleSwitchReqOutput (sglang/srt/managers/io_struct.py); HTTP 200 on success, 400 otherwise."""

    success: bool
    message: str
    old_role: str
    new_role: str
    safe_to_restore: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"success": self.success, "message": self.message, "old_role": self.old_role,
                "new_role": self.new_role, "safe_to_restore": self.safe_to_restore}


class Switchable(Protocol):
    """What a role switch reads and changes on an engine (``SimEngine``)."""

    mode: Mode
    switching: bool  # a switch is under way: the scheduler takes no steps
    unhealthy: bool  # a switch failed: restart required
    decode_graphs: bool  # decode CUDA graphs captured (launched as decode, or switched to it once)

    @property
    def settings(self) -> EngineSimSettings: ...

    @property
    def latency(self) -> LatencyModel: ...

    def is_idle(self) -> bool: ...

    def kick(self) -> None: ...

    def reset_pacing(self) -> None: ...

    async def start_bootstrap(self) -> None: ...

    async def stop_bootstrap(self) -> None: ...


async def pd_role_switch(eng: Switchable, new_role: str | None, prepare_only: bool = False,
                         decode_cuda_graph_memory_gb: float | None = None) -> RoleSwitchResult:
    """Preconditions and messages in SGLang's order (tokenizer_control_mixin.pd_role_switch, then
    role_switch._reject_reason and handle_pd_role_switch)."""
    old = eng.mode
    requested = new_role or ""
    if not eng.settings.enable_pd_role_switch:
        return RoleSwitchResult(False, "--enable-pd-role-switch is not set on this server", old, requested, True)
    role = requested.lower()

    def fail(message: str, safe: bool) -> RoleSwitchResult:
        log.warning("PD role switch rejected (%s -> %s): %s", old, role, message)
        return RoleSwitchResult(False, message, old, requested, safe)

    if eng.unhealthy:
        return fail("instance is unhealthy after a failed role switch; restart required", False)
    if eng.switching:
        return fail("another role switch is already in progress", False)
    if role not in ("prefill", "decode"):
        return fail(f"invalid new_role={role!r}", True)
    if old == "null":
        return fail("instance is not running in PD disaggregation mode", True)
    if role == old:
        return RoleSwitchResult(True, "ready" if prepare_only else "ok", old, requested, False)
    if not eng.is_idle():
        return fail("instance is not idle; drain all requests before switching", True)
    if role == "decode" and not eng.decode_graphs:  # role_switch.py: checked after idleness, before prepare_only
        if decode_cuda_graph_memory_gb is None:
            return fail("decode_cuda_graph_memory_gb is required before capturing decode graphs", True)
        if decode_cuda_graph_memory_gb < 0:
            return fail("decode_cuda_graph_memory_gb must be non-negative", True)
    if prepare_only:
        return RoleSwitchResult(True, "ready", old, requested, True)
    eng.switching = True  # the scheduler loop takes no steps meanwhile
    try:
        await asyncio.sleep(eng.latency.role_switch_time_s())  # teardown, rebuild, graph capture
        if role == "decode":
            await eng.stop_bootstrap()
        else:
            await eng.start_bootstrap()
        eng.mode = "decode" if role == "decode" else "prefill"  # with an empty radix cache, as SGLang resets it
        eng.decode_graphs = eng.decode_graphs or role == "decode"
        eng.reset_pacing()
    except Exception as exc:
        eng.unhealthy = True
        log.critical("PD role switch (%s -> %s) failed; instance unhealthy: %r", old, role, exc)
        return fail(f"role switch failed; instance unhealthy, restart required: {exc}", False)
    finally:
        eng.switching = False
        eng.kick()
    log.info("PD role switch succeeded: %s -> %s", old, role)
    return RoleSwitchResult(True, "ok", old, requested, False)
