"""The planner's side of ``poise admin``: flip, pools, planner pause|resume, events.

Each command is one NATS request to ``Subjects.admin("planner")`` (or, for ``events``, a subscription to
``Subjects.planner_events()``); what it prints is rendered here from the reply.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

import msgspec

from shared.bus import Bus
from shared.errors import BusTimeout, PoiseError
from shared.protocol import AdminCommand, AdminReply, PlannerEvent, Subjects


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=False)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=False)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)])


async def ask_planner(bus: Bus, subjects: Subjects, verb: str, args: dict[str, str], timeout_s: float) -> AdminReply:
    """One admin verb to the planner; no answer becomes a :class:`PoiseError` that says where it asked."""
    try:
        return await bus.request(subjects.admin("planner"), AdminCommand(verb=verb, args=args), AdminReply,
                                 timeout_s=timeout_s)
    except BusTimeout as exc:
        raise PoiseError(f"the planner did not answer `{verb}` ({exc}); is the stack up, and is --nats-url / "
                         f"--namespace right?") from None


def _ms(value: Any) -> str:
    return f"{value:.1f} ms" if isinstance(value, int | float) else "-"


def render_pools(reply: AdminReply) -> str:
    status = reply.status
    if status is None:
        return reply.message
    d = status.details
    pause = d.get("pause") or {}
    out = [f"planner {status.replica_id} ({'leader' if status.is_leader else 'follower: its policy state may lag'}), "
           f"policy {status.policy}, "
           + (f"PAUSED since {time.strftime('%H:%M:%S', time.localtime(pause.get('at_unix_s', 0)))} "
              f"({pause.get('reason') or 'no reason'})" if d.get("paused") else "running")]
    state = d.get("policy_state") or {}
    dopd = state.get("dopd")
    if state.get("splits") is not None or status.policy == "poise":
        target = (dopd or {}).get("target_prefill")
        out.append(f"  poise target: {target} prefill  ({state.get('split_reason')})" if target is not None
                   else "  poise target: none yet (nothing completed to score the splits on)")
    elif dopd is not None:
        target = dopd.get("target_prefill")
        line = f"  dopd target: {target} prefill" if target is not None else "  dopd target: none yet (no forecast)"
        split = dopd.get("last_split")
        if split:
            line += (f"  (forecast ISL {split['isl']:.0f}, OSL {split['osl']:.0f}, concurrency "
                     f"{split['concurrency']:.1f} -> R* {split['ratio']:.2f}, N_d {split['n_d']})")
        out.append(line)
    arrow = state.get("arrow")
    if arrow is not None:
        bounds = arrow.get("bounds")
        out.append(f"  arrow: prefill count bounds {bounds[0]}..{bounds[1]}" if bounds else "  arrow: no bounds")
    lat = d.get("decision_latency") or {}
    out.append(f"  decisions: {lat.get('decisions', 0)}  (latest {lat.get('window', 0)}: p50 {_ms(lat.get('p50_ms'))}, "
               f"p99 {_ms(lat.get('p99_ms'))}, max {_ms(lat.get('max_ms'))}; off the event loop)")
    rows = [[r["instance_id"], r["role"], r["status"], "yes" if r["flipping"] else "", r["url"]] for r in d.get("pools", [])]
    out += ["", f"instances: {reply.message}", table(rows, ["id", "role", "status", "flipping", "url"])]
    return "\n".join(out)


def render_event(event: PlannerEvent) -> str:
    stamp = time.strftime("%H:%M:%S", time.localtime(event.ts_unix_s)) + f".{int(event.ts_unix_s * 1000) % 1000:03d}"
    parts = [stamp, f"{event.kind:<16}"]
    if event.instance_id is not None:
        parts.append(f"{event.instance_id} {event.from_role or '?'} -> {event.to_role or '?'}")
    if event.target_prefill is not None:
        parts.append(f"target {event.target_prefill}P{event.target_decode}D")
    if event.duration_s is not None:
        parts.append(f"in {event.duration_s:.2f}s")
    if event.source:
        parts.append(f"[{event.source}]")
    if event.reason:
        parts.append(event.reason)
    if event.kind == "flip_failed" and event.message:
        parts.append(f"({event.message})")
    return "  ".join(parts)


async def flip(bus: Bus, subjects: Subjects, instance: str, role: str, *, verb: str = "flip", reason: str | None = None,
               drain_timeout_s: float | None = None, wait_s: float = 200.0) -> int:
    args = {"instance": instance, "role": role}
    if reason:
        args["reason"] = reason
    if drain_timeout_s is not None:
        args["drain_timeout_s"] = str(drain_timeout_s)
    t0 = time.monotonic()
    reply = await ask_planner(bus, subjects, verb, args, wait_s)
    if reply.ok:
        print(f"{reply.message}  (command to reply {time.monotonic() - t0:.2f}s)")
        return 0
    print(f"flip failed: {reply.message}", file=sys.stderr)
    return 1


async def pools(bus: Bus, subjects: Subjects, timeout_s: float, as_json: bool) -> int:
    reply = await ask_planner(bus, subjects, "pools", {}, timeout_s)
    if not reply.ok:
        print(f"pools: {reply.message}", file=sys.stderr)
        return 1
    print(json.dumps(msgspec.to_builtins(reply), indent=2) if as_json else render_pools(reply))
    return 0


async def pause_resume(bus: Bus, subjects: Subjects, action: str, reason: str | None, timeout_s: float) -> int:
    reply = await ask_planner(bus, subjects, action, {"reason": reason} if reason else {}, timeout_s)
    print(reply.message, file=sys.stdout if reply.ok else sys.stderr)
    return 0 if reply.ok else 1


async def events(bus: Bus, subjects: Subjects, count: int | None, max_wait_s: float | None, as_json: bool) -> int:
    """Print planner events as they come, until Ctrl-C, ``count`` events, or ``max_wait_s`` (then exit 1)."""
    done = asyncio.Event()
    seen = 0

    async def on_event(event: PlannerEvent, subject: str) -> None:
        nonlocal seen
        seen += 1
        print(msgspec.json.encode(event).decode() if as_json else render_event(event), flush=True)
        if count is not None and seen >= count:
            done.set()

    sub = await bus.subscribe(subjects.planner_events(), PlannerEvent, on_event)
    await bus.nc.flush()  # the subscription is registered with the server before we say we listen
    print(f"listening on {subjects.planner_events()} (Ctrl-C stops)", file=sys.stderr, flush=True)
    try:
        await asyncio.wait_for(done.wait(), timeout=max_wait_s)
    except TimeoutError:
        if count is None:
            return 0
        print(f"events: {seen} of {count} events within {max_wait_s:g}s", file=sys.stderr)
        return 1
    finally:
        await sub.unsubscribe()
    return 0
