"""The sidecar's role changes: role commands (a flip), ``set-role`` and ``retire``, one at a time.

A role command marks the instance ``draining``, waits until the engine is idle (within the drain deadline,
shared/policies/flip.py), ``POST``s ``/pd_role_switch`` (or restarts the engine, to or from colocated serving)
and re-registers in the new role; any failure re-registers the old role as ``ready`` and answers ``ok=false``
with why. ``retire`` drains (bounded), deregisters, answers, then stops the worker the way SIGTERM does
(``exit_requested``). They share one lock: a command arriving while another runs is refused, not queued (the
planner decides again on its next tick).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from typing import TYPE_CHECKING, Any

from services.worker.engine_waits import DrainTimeout, wait_idle
from services.worker.instance_record import ROLES
from services.worker.role_rules import switch_refusal
from services.worker.supervisor import RESTART_ERRORS
from shared.policies.flip import Flip, drain_deadline_s
from shared.protocol import AdminReply, RoleCommand, RoleCommandReply
from shared.protocol.messages import Role
from shared.registry import ETCD_ERRORS
from shared.runtime import require_arg

if TYPE_CHECKING:
    from services.worker.sidecar import WorkerService

log = logging.getLogger(__name__)


class RoleSwitcher:
    """One worker's role changes (module doc); reads and writes the worker's registration and engine."""

    def __init__(self, worker: WorkerService) -> None:
        self.worker = worker
        self.lock = asyncio.Lock()  # held by the role switch or retire under way
        self.retiring = False
        self.retire_exit: asyncio.Task[None] | None = None

    @property
    def switching(self) -> bool:
        return self.lock.locked() and not self.retiring

    def command_error(self, message: str) -> RoleCommandReply:
        w = self.worker
        role = w.role or "null"
        return RoleCommandReply(command_id="", instance_id=w.instance_id, ok=False, message=message,
                                old_role=role, new_role=role)

    async def on_command(self, cmd: RoleCommand) -> RoleCommandReply:
        w = self.worker
        old: Role = w.role or "null"

        def reply(ok: bool, message: str) -> RoleCommandReply:
            return RoleCommandReply(command_id=cmd.command_id, instance_id=w.instance_id, ok=ok, message=message,
                                    old_role=old, new_role=w.role or "null")

        if self.retiring:
            return reply(False, "the instance is retiring")
        if self.lock.locked():
            return reply(False, "another role switch is in progress")
        async with self.lock:
            old = w.role or "null"
            if cmd.new_role == old:
                return reply(True, f"already {old}")
            serving = w._registered and not w._supervision.restarting and not w._stop.stopping
            refusal = switch_refusal(old, cmd.new_role, w.settings, serving=serving)
            if refusal is not None:
                return reply(False, refusal)
            flip = Flip(old, cmd.new_role, time.monotonic(),
                        drain_deadline_s(cmd.drain_timeout_s, w.settings.drain_timeout_s))
            log.info("role switch %s -> %s (%s): draining up to %.1fs", old, cmd.new_role, cmd.reason or "no reason",
                     flip.drain_s)
            try:
                await w._set_status(flip.stage)
                await self._wait_idle(flip.drain_s)
                flip.drained()
                await w._set_status(flip.stage)
                assert w._client is not None
                if flip.restart:
                    result = await w._relaunch(cmd.new_role)
                else:
                    result = await w._client.pd_role_switch(
                        cmd.new_role, decode_cuda_graph_memory_gb=w.settings.decode_cuda_graph_memory_gb)
            except RESTART_ERRORS as exc:  # a relaunch can fail to spawn (OSError)
                # The drain wait judged the deadline itself (on a clock started a moment after the flip's).
                if not (isinstance(exc, DrainTimeout) and flip.expire(max(time.monotonic(), flip.deadline_s))):
                    flip.failed()
                log.warning("role switch of %s to %s %s: %s", w.instance_id, cmd.new_role,
                            flip.outcome.replace("_", " "), exc)
                try:
                    await w._set_status(flip.stage)
                except ETCD_ERRORS as restore_exc:
                    log.error("could not restore %s to ready: %s", w.instance_id, restore_exc)
                return reply(False, f"role switch {old} -> {cmd.new_role} failed: {exc}")
            w.role = flip.switched()
            await w._set_status(flip.stage)
            took = time.monotonic() - flip.started_s
            log.info("role switch of %s: %s -> %s in %.2fs", w.instance_id, old, cmd.new_role, took)
            return reply(True, f"{old} -> {cmd.new_role} in {took:.2f}s: {result.get('message', '') or 'ok'}")

    async def _wait_idle(self, timeout_s: float) -> None:
        w = self.worker
        assert w._client is not None
        await wait_idle(w._client, timeout_s, min(w.settings.load_interval_s, 0.1))

    async def switch_role(self, new_role: Role, *, reason: str = "", drain_timeout_s: float | None = None) -> RoleCommandReply:
        """In-process equivalent of a :class:`RoleCommand` (what the NATS handler and ``set-role`` run)."""
        w = self.worker
        return await self.on_command(RoleCommand(
            command_id=uuid.uuid4().hex, new_role=new_role, reason=reason,
            drain_timeout_s=drain_timeout_s if drain_timeout_s is not None else w.settings.drain_timeout_s,
        ))

    # -- retire --------------------------------------------------------------------------------------
    async def retire(self, drain_timeout_s: float | None = None, *,
                     reply_task: asyncio.Task[Any] | None = None) -> AdminReply:
        """Drain (bounded), deregister, then schedule the stop of this worker; the reply comes first.

        ``reply_task`` is the task that will send the reply (the admin handler's): the stop waits for it to
        end. Holds the switch lock for the drain, so role commands arriving meanwhile are refused, and refuses
        itself while a role switch runs (the flip may be what the planner wants instead; it can retry).
        """
        w = self.worker
        timeout_s = w.settings.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        if not (timeout_s > 0 and math.isfinite(timeout_s)):  # a NaN deadline would never pass
            raise ValueError("drain_timeout_s must be a positive number of seconds")
        if self.retiring or w._stop.stopping:
            return AdminReply(ok=False, message=f"{w.instance_id} is already retiring or stopping",
                              status=w.service_status())
        if self.lock.locked():
            return AdminReply(ok=False, message=f"retire refused: a role switch of {w.instance_id} is in progress; "
                                                "retry once it has finished", status=w.service_status())
        async with self.lock:
            self.retiring = True
            t0 = time.monotonic()
            if not w._registered or w._supervision.restarting:
                drain = "not serving (unregistered or restarting), so no drain"
            else:
                try:
                    await w._set_status("draining")  # gateways stop sending new work
                    await self._wait_idle(timeout_s)
                    drain = f"drained in {time.monotonic() - t0:.2f}s"
                except DrainTimeout as exc:
                    drain = f"drain timed out after {time.monotonic() - t0:.2f}s ({exc}); retiring anyway"
                except ETCD_ERRORS as exc:  # cannot mark it draining: still go, the lease ends it anyway
                    drain = f"could not mark draining ({exc}); retiring without a drain"
            async with w._reg_lock:
                await w._deregister()
        log.info("retire of %s: %s; deregistered, stopping", w.instance_id, drain)
        self.retire_exit = asyncio.create_task(self._exit_after(reply_task), name=f"retire-exit-{w.instance_id}")
        return AdminReply(ok=True, message=f"{drain}; deregistered; stopping", status=w.service_status())

    async def _exit_after(self, handler: asyncio.Task[Any] | None) -> None:
        """Stop once ``handler`` (the task answering the retire request) has sent its reply.

        Closing the bus cancels request handlers still in flight, so stopping any earlier could lose the reply;
        the bound keeps a stuck handler from keeping the process alive.
        """
        w = self.worker
        if handler is not None:
            await asyncio.wait({handler}, timeout=5.0)
        w.exit_requested.set()
        await w.stop()

    # -- admin verbs ---------------------------------------------------------------------------------
    async def admin_retire(self, args: dict[str, str]) -> AdminReply:
        timeout = float(args["drain_timeout_s"]) if "drain_timeout_s" in args else None
        # This runs inside the bus's per-request task, which sends the reply after we return.
        return await self.retire(timeout, reply_task=asyncio.current_task())

    async def admin_set_role(self, args: dict[str, str]) -> AdminReply:
        w = self.worker
        role = require_arg(args, "role")
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}")
        timeout = float(args["drain_timeout_s"]) if "drain_timeout_s" in args else None
        result = await self.switch_role(role, reason=args.get("reason", "admin set-role"),
                                        drain_timeout_s=timeout)
        return AdminReply(ok=result.ok, message=result.message, status=w.service_status())

