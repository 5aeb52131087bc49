"""Which role changes an engine can make, as the sidecar judges a role command before draining anything."""

from __future__ import annotations

from services.worker.config import WorkerSettings
from shared.policies.flip import is_restart
from shared.protocol.messages import Role


def switch_refusal(old: Role, new: Role, s: WorkerSettings, *, serving: bool) -> str | None:
    """Why ``old -> new`` cannot be done on this engine now, or None."""
    if is_restart(old, new) and s.engine_kind == "attach":
        return (f"cannot switch {old} -> {new}: colocated and PD serving differ at launch, and this worker "
                "attached to an engine it cannot restart")
    if not is_restart(old, new) and s.engine_kind == "sglang" and not s.sglang_role_switch:
        return (f"cannot switch {old} -> {new}: the engine was launched without --enable-pd-role-switch "
                f"(transfer_backend={s.transfer_backend})")
    if not serving:
        return "the engine is not serving (restarting, unhealthy or stopping)"
    return None
