"""Role flips under live traffic, and the planner's decision latency with the Poise policy.

Brings up the dev stack (NATS, etcd, gateway, monitor, planner with ``--planner-policy poise``, 2 prefill +
2 decode engine_sim) and replays two consecutive slices of the Azure conversation trace through the gateway:

1. **policy phase**: the Poise policy runs (DOPD forecast + Arrow flips); afterwards the planner's status
   gives its decision latency (every ``decide``, timed on the decider thread) and DOPD's own timing of its
   forecast decisions (ARIMA fits + ratio). Flips the policy makes are recorded from the planner's events.
2. **flip phase**: the planner is paused (``pause``: the policy makes no flips) and this script flips an
   instance every ``--every-s`` seconds with the admin ``flip`` verb, keeping at least one instance of each
   role: it flips one of the larger role (alternating on a tie), the one flipped least recently, so the
   split swings 2P2D -> 1P3D -> 2P2D -> 3P1D -> ... and every instance goes back and forth.

Per flip: command -> reply (the admin request; the sidecar answers after drain + ``/pd_role_switch`` +
re-register), command -> re-registered (the etcd watch shows the instance ``ready`` in its new role), the
drain (command -> ``switching``) and the planner's own ``duration_s`` from its ``flip_done`` event. Failed
requests are counted per phase (the bar: zero). Writes ``tests/bench/results/flip_latency.{md,json}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from loadgen.metrics import Summary
from loadgen.replay import replay
from loadgen.slo import slo_for
from loadgen.traces import load_trace
from services.cli.stack import Stack, StackSettings
from services.planner.decider import quantile
from shared.bus import Bus
from shared.protocol import AdminCommand, AdminReply, InstanceInfo, Keys, PlannerEvent, Subjects
from shared.registry import InstanceWatcher, Registry
from shared.settings import load_settings

OUT = Path("tests/bench/results")
TRACE = "azure-conv"


@dataclass
class Flip:
    instance_id: str
    from_role: str
    to_role: str
    at_s: float  # seconds into the flip phase's replay
    ok: bool = False
    message: str = ""
    reply_s: float | None = None  # command -> admin reply
    registered_s: float | None = None  # command -> etcd shows it ready in the new role
    drain_s: float | None = None  # command -> etcd shows it switching (the drain is over)
    planner_s: float | None = None  # the planner's flip_done duration_s


@dataclass
class Watch:
    """What the etcd watch saw, with this process's monotonic clock."""

    roles: dict[str, str] = field(default_factory=dict)
    seen: list[tuple[float, str, str, str]] = field(default_factory=list)  # (t, id, role, status)

    def on_change(self, instances: dict[str, InstanceInfo]) -> None:
        now = time.monotonic()
        for i in instances.values():
            if self.roles.get(i.instance_id) != f"{i.role}/{i.status}":
                self.roles[i.instance_id] = f"{i.role}/{i.status}"
                self.seen.append((now, i.instance_id, i.role, i.status))

    def first(self, instance_id: str, after: float, role: str | None, status: str) -> float | None:
        for t, i, r, st in self.seen:
            if t >= after and i == instance_id and st == status and (role is None or r == role):
                return t
        return None


def pick(roles: dict[str, str], last_flip: dict[str, float], turn: int) -> tuple[str, str, str]:
    """(instance, from, to): one instance of the larger role, the least recently flipped; >= 1 of each stays."""
    by_role: dict[str, list[str]] = {"prefill": [], "decode": []}
    for iid, role in roles.items():
        if role in by_role:
            by_role[role].append(iid)
    if len(by_role["prefill"]) != len(by_role["decode"]):
        source = max(by_role, key=lambda r: len(by_role[r]))
    else:
        source = ("prefill", "decode")[turn % 2]
    candidates = sorted(by_role[source], key=lambda i: (last_flip.get(i, -1.0), i))
    target = "decode" if source == "prefill" else "prefill"
    return candidates[0], source, target


async def ask(bus: Bus, subjects: Subjects, verb: str, timeout_s: float = 5.0, **args: str) -> AdminReply:
    return await bus.request(subjects.admin("planner"), AdminCommand(verb=verb, args=args), AdminReply, timeout_s=timeout_s)


async def flipper(bus: Bus, subjects: Subjects, watch: Watch, events: list[tuple[float, PlannerEvent]],
                  start: float, until: float, every_s: float, first_at_s: float) -> list[Flip]:
    flips: list[Flip] = []
    last_flip: dict[str, float] = {}
    next_at = start + first_at_s
    turn = 0
    while True:
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        if time.monotonic() >= until:
            return flips
        roles = {iid: rs.split("/")[0] for iid, rs in watch.roles.items()}
        instance, src, dst = pick(roles, last_flip, turn)
        turn += 1
        t0 = time.monotonic()
        flip = Flip(instance_id=instance, from_role=src, to_role=dst, at_s=t0 - start)
        reply = await ask(bus, subjects, "flip", timeout_s=200.0, instance=instance, role=dst,
                          reason="bench flip_latency")
        flip.reply_s = time.monotonic() - t0
        flip.ok, flip.message = reply.ok, reply.message
        for _ in range(50):  # the watch event may trail the reply by a few ms
            flip.registered_s = _since(watch.first(instance, t0, dst, "ready"), t0)
            if flip.registered_s is not None or not reply.ok:
                break
            await asyncio.sleep(0.02)
        flip.drain_s = _since(watch.first(instance, t0, src, "switching"), t0)
        done = [e for t, e in events if t >= t0 and e.kind in ("flip_done", "flip_failed") and e.instance_id == instance]
        flip.planner_s = done[0].duration_s if done else None
        last_flip[instance] = time.monotonic()
        flips.append(flip)
        print(f"flip {len(flips)}: {instance} {src} -> {dst}: reply {flip.reply_s:.2f}s, re-registered "
              f"{_fmt(flip.registered_s)}s, drain {_fmt(flip.drain_s)}s ({'ok' if flip.ok else flip.message})",
              file=sys.stderr)
        next_at = max(t0 + every_s, time.monotonic())


def _since(t: float | None, t0: float) -> float | None:
    return None if t is None else t - t0


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _stats(values: list[float]) -> dict[str, float | None]:
    v = sorted(values)
    if not v:
        return {"n": 0, "p50": None, "p90": None, "max": None, "mean": None}
    return {"n": len(v), "p50": quantile(v, 0.5), "p90": quantile(v, 0.9), "max": v[-1], "mean": sum(v) / len(v)}


def summary_row(s: Summary) -> dict[str, Any]:
    return {"requests": s.requests_total, "ok": s.requests_ok, "failed": s.requests_failed,
            "token_mismatches": s.token_mismatches, "ttft_p50_ms": (s.ttft_p50_s or 0) * 1e3,
            "ttft_p99_ms": (s.ttft_p99_s or 0) * 1e3, "tpot_p50_ms": (s.tpot_p50_s or 0) * 1e3,
            "slo_attainment": s.slo_attainment}


async def run(stack: Stack, args: argparse.Namespace) -> dict[str, Any]:
    assert stack.nats is not None and stack.etcd is not None
    ns = stack.settings.namespace
    subjects = Subjects(ns)
    bus = Bus(stack.nats.url, name="bench-flip")
    await bus.connect()
    events: list[tuple[float, PlannerEvent]] = []

    async def on_event(event: PlannerEvent, subject: str) -> None:
        events.append((time.monotonic(), event))

    await bus.subscribe(subjects.planner_events(), PlannerEvent, on_event)
    registry = Registry(stack.etcd.url, Keys(ns))
    await registry.connect()
    watch = Watch()
    watcher = InstanceWatcher(registry, on_change=watch.on_change)
    await watcher.start()
    trace = load_trace(TRACE)
    slo = slo_for(TRACE)
    model = stack.settings.model
    try:
        # Phase 1: the Poise policy decides; its decision latency comes from the planner's status afterwards.
        w1 = trace.slice(args.start_s, args.policy_s)
        print(f"policy phase: {len(w1.requests)} requests, planner policy {stack.settings.planner_policy}", file=sys.stderr)
        t1 = time.monotonic()
        r1 = await replay(w1, stack.gateway_url, model=model, slo=slo, keep_token_times=False, api_key=stack.api_key)
        status = (await ask(bus, subjects, "status")).status
        assert status is not None
        policy_flips = [e for t, e in events if t >= t1 and e.kind in ("flip_done", "flip_failed") and e.source == "policy"]

        # Phase 2: pause the policy, flip by hand every few seconds under traffic.
        paused = await ask(bus, subjects, "pause", reason="bench flip_latency")
        assert paused.ok, paused.message
        await asyncio.sleep(2.5)  # a decision that began before the pause has ended
        w2 = trace.slice(args.start_s + args.policy_s, args.flip_s)
        print(f"flip phase: {len(w2.requests)} requests, a flip every {args.every_s:g}s", file=sys.stderr)
        start = time.monotonic()
        r2, flips = await asyncio.gather(
            replay(w2, stack.gateway_url, model=model, slo=slo, keep_token_times=False, api_key=stack.api_key),
            flipper(bus, subjects, watch, events, start, start + args.flip_s - 2.0, args.every_s, args.first_at_s))
        await ask(bus, subjects, "resume")
    finally:
        await watcher.stop()
        await registry.close()
        await bus.close()
    details = status.details
    return {
        "policy_phase": {"slice_s": [args.start_s, args.start_s + args.policy_s], **summary_row(r1.summary),
                         "decision_latency": details["decision_latency"],
                         "dopd_forecasts": (details["policy_state"].get("dopd") or {}).get("forecasts"),
                         "dopd_target_prefill": (details["policy_state"].get("dopd") or {}).get("target_prefill"),
                         "planner_ticks": details["ticks"], "tick_interval_s": details["tick_interval_s"],
                         "policy_flips": [{"instance": e.instance_id, "from": e.from_role, "to": e.to_role,
                                           "ok": e.kind == "flip_done", "duration_s": e.duration_s, "reason": e.reason}
                                          for e in policy_flips]},
        "flip_phase": {"slice_s": [args.start_s + args.policy_s, args.start_s + args.policy_s + args.flip_s],
                       **summary_row(r2.summary), "every_s": args.every_s, "flips": [asdict(f) for f in flips],
                       "reply_s": _stats([f.reply_s for f in flips if f.ok and f.reply_s is not None]),
                       "registered_s": _stats([f.registered_s for f in flips if f.ok and f.registered_s is not None]),
                       "drain_s": _stats([f.drain_s for f in flips if f.ok and f.drain_s is not None]),
                       "flips_failed": sum(1 for f in flips if not f.ok)},
    }


def _ms(v: Any) -> str:
    return "-" if v is None else f"{v:.1f}"


def write(doc: dict[str, Any]) -> str:
    p, f = doc["policy_phase"], doc["flip_phase"]
    lat, fc = p["decision_latency"], p["dopd_forecasts"] or {}
    lines = [
        "# Role flips under traffic, and planner decision latency", "", f"Command: `{doc['command']}`", "",
        f"{doc['when']}, {doc['cores']} cores, load average {doc['load_before']:.1f} before and "
        f"{doc['load_after']:.1f} after. Dev stack: 2 prefill + 2 decode engine_sim (llama-3.1-8b-h100), gateway "
        f"dispatch least-load, planner policy poise, {TRACE} at the trace's own rate.", "",
        "## Planner decision latency (policy phase, poise)", "",
        f"Slice {p['slice_s'][0]:g}-{p['slice_s'][1]:g} s: {p['requests']} requests, {p['failed']} failed. "
        f"Planner tick every {p['tick_interval_s']:g} s. Every `decide` runs on the planner's decider thread, off "
        "the event loop.", "",
        "| decisions | wall p50 ms | wall p99 ms | wall max ms | CPU p50 ms | CPU p99 ms | CPU max ms | target |",
        "|---|---|---|---|---|---|---|---|",
        f"| all `decide` calls ({lat['decisions']}) | {_ms(lat['p50_ms'])} | {_ms(lat['p99_ms'])} | {_ms(lat['max_ms'])} | "
        f"{_ms(lat.get('cpu_p50_ms'))} | {_ms(lat.get('cpu_p99_ms'))} | {_ms(lat.get('cpu_max_ms'))} | |",
        f"| DOPD forecast decisions: ARIMA fits + ratio ({fc.get('count', 0)}) | {_ms(fc.get('p50_ms'))} | "
        f"{_ms(fc.get('p99_ms'))} | {_ms(fc.get('max_ms'))} | | | | p99 < 200 ms |", "",
        "Wall time is what the planner waits for a decision (on its decider thread); CPU time is that thread's own "
        "CPU, so wall minus CPU is time the thread waited for a core on this shared machine. DOPD times only its "
        "forecast decisions (wall); the first 5 of them use the last value (too few samples for ARIMA). Most "
        "`decide` calls are Arrow's checks alone, so the p99 and max over all calls are forecast decisions.", "",
        f"DOPD target at the end: {p['dopd_target_prefill']} prefill. Flips the policy made: "
        + (", ".join(f"{x['instance']} {x['from']}->{x['to']} ({_fmt(x['duration_s'])} s, {'ok' if x['ok'] else 'failed'})"
                     for x in p["policy_flips"]) or "none") + ".", "",
        "## Flips under traffic (flip phase, admin flip, planner paused)", "",
        f"Slice {f['slice_s'][0]:g}-{f['slice_s'][1]:g} s: {f['requests']} requests, **{f['failed']} failed**, "
        f"{f['token_mismatches']} token mismatches; {len(f['flips'])} flips ({f['flips_failed']} failed), one every "
        f"~{f['every_s']:g} s. TTFT p50 / p99 {f['ttft_p50_ms']:.0f} / {f['ttft_p99_ms']:.0f} ms, "
        f"SLO attainment {f['slo_attainment'] * 100:.1f}%.", "",
        "| | n | p50 s | p90 s | max s |", "|---|---|---|---|---|",
    ]
    for key, label in (("reply_s", "command -> reply (drain + switch + re-register)"),
                       ("registered_s", "command -> re-registered in etcd (new role, ready)"),
                       ("drain_s", "command -> drained (status switching)")):
        st = f[key]
        lines.append(f"| {label} | {st['n']} | {_fmt(st['p50'])} | {_fmt(st['p90'])} | {_fmt(st['max'])} |")
    lines += ["", "| # | at s | instance | from -> to | reply s | re-registered s | drained s | planner s | ok |",
              "|---|---|---|---|---|---|---|---|---|"]
    for n, x in enumerate(f["flips"], 1):
        lines.append(f"| {n} | {x['at_s']:.1f} | {x['instance_id']} | {x['from_role']} -> {x['to_role']} | "
                     f"{_fmt(x['reply_s'])} | {_fmt(x['registered_s'])} | {_fmt(x['drain_s'])} | {_fmt(x['planner_s'])} | "
                     f"{'yes' if x['ok'] else x['message']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--start-s", type=float, default=0.0, help="where the replayed trace slice starts")
    parser.add_argument("--policy-s", type=float, default=120.0, help="trace seconds of the policy phase")
    parser.add_argument("--flip-s", type=float, default=90.0, help="trace seconds of the flip phase")
    parser.add_argument("--every-s", type=float, default=8.0, help="seconds between flip starts")
    parser.add_argument("--first-at-s", type=float, default=4.0, help="first flip this long into the flip phase")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    command = shlex.join([Path(sys.executable).name, "-m", "tests.bench.flip_latency", *sys.argv[1:]])
    load_before = os.getloadavg()[0]
    settings = load_settings(StackSettings, gateway_port=0, monitor_port=0, planner_policy="poise",
                             run_dir=(run := Path(".poise/bench") / f"flip-{time.strftime('%H%M%S')}"),
                             state_dir=run)  # its own lock and state: it may run beside `poise up`
    stack = Stack(settings, progress=lambda line: print(line, file=sys.stderr))
    stack.start()
    try:
        doc = asyncio.run(run(stack, args))
        dead = stack.check_alive()
    finally:
        stack.stop()
    doc = {"command": command, "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
           "cores": os.cpu_count(), "load_before": load_before, "load_after": os.getloadavg()[0],
           "dead_processes": dead, **doc}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "flip_latency.json").write_text(json.dumps(doc, indent=2))
    text = write(doc)
    (args.out / "flip_latency.md").write_text(text)
    print(text)
    if doc["flip_phase"]["failed"] or doc["policy_phase"]["failed"] or dead:
        sys.exit(1)


if __name__ == "__main__":
    main()
