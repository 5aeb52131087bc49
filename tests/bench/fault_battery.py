"""The fault battery: the dev stack under steady streaming load while its processes are killed and stalled.

Brings up the stack `poise up` runs (2 prefill + 2 decode engine_sim, auth on, the static planner so that
only the faults move things) with `poise up`'s supervision (``services/cli/supervise.py``), and sends
``--rate`` streaming requests per second, each checked exactly: ``max_tokens`` tokens of text (engine_sim
renders each token as `` tok<id>``; a chunk may carry several), a usage of ``max_tokens`` completion tokens
and ``[DONE]``. Then one fault per phase, each followed by a recovery
window, in this order:

- ``kill -9`` of a worker sidecar (its engine keeps serving; the restarted sidecar adopts it),
- ``kill -9`` of a decode engine (the sidecar restarts it; its streams are rescued on the other pair),
- ``SIGSTOP`` of a decode engine for ``--stall-s`` (its streams are given up after the gateway's stall
  timeout and resumed elsewhere), then ``SIGCONT``,
- ``kill -9`` of the planner, the monitor, the migrator, nats-server and etcd in turn (restarted),
- ``kill -9`` of the gateway (the one fault that loses the requests it was serving).

Per phase: requests that ended in it (completed exactly or failed), the restarts `poise up` made (a sidecar
restarts its own engine), and how long after the fault a request started after it completed. Writes
``tests/bench/results/fault_battery.{md,json}`` with the command.

``--soak-s N`` runs the same load for N seconds with no fault instead (the soak): every request checked
exactly, and each process's resident memory sampled every 30 s, so a leak shows as growth over the run.
Writes ``tests/bench/results/soak.{md,json}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import orjson

from services.cli.stack import Stack, StackSettings
from services.cli.supervise import Supervisor
from shared.devservers import ManagedProcess
from shared.settings import load_settings

OUT = Path("tests/bench/results")
MODEL = "meta-llama/Llama-3.1-8B-Instruct"


@dataclass
class Phase:
    name: str
    started: int = 0  # requests that ended in this phase
    ok: int = 0
    failed: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    restarts: int = 0
    serving_again_s: float | None = None  # fault -> the first request started after it that completed


def _process(stack: Stack, name: str) -> ManagedProcess:
    return next(p for p in stack.supervised if p.name == name)


def _engine_pid(stack: Stack, instance_id: str) -> int:
    return int(json.loads((stack.run_dir / "logs" / f"engine-{instance_id}.pid").read_text())["pid"])


class Load:
    """Streaming requests at a steady rate, each checked exactly, tallied into the current phase."""

    def __init__(self, stack: Stack, rate: float, max_tokens: int) -> None:
        self.stack, self.rate, self.max_tokens = stack, rate, max_tokens
        self.phase = Phase("warm-up")
        self.phases: list[Phase] = []
        self.fault_at: float | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def next_phase(self, name: str) -> Phase:
        self.phases.append(self.phase)
        self.phase = Phase(name)
        self.fault_at = time.monotonic()
        return self.phase

    async def run(self, stop: asyncio.Event) -> None:
        headers = {"Authorization": f"Bearer {self.stack.api_key}"}
        async with httpx.AsyncClient(timeout=120, trust_env=False, headers=headers,
                                     limits=httpx.Limits(max_connections=500)) as client:
            k = 0
            t0 = time.monotonic()
            while not stop.is_set():
                k += 1
                task = asyncio.create_task(self._one(client, k))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
                await asyncio.sleep(max(0.0, t0 + k / self.rate - time.monotonic()))
            if self._tasks:
                await asyncio.wait(self._tasks, timeout=150)
        self.phases.append(self.phase)

    async def _one(self, client: httpx.AsyncClient, k: int) -> None:
        started = time.monotonic()
        body = {"model": MODEL, "prompt": list(range(100 + k % 400)), "max_tokens": self.max_tokens,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        chunks, usage, done, error = 0, None, False, None
        try:
            async with client.stream("POST", self.stack.gateway_url + "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    error = f"HTTP {r.status_code}"
                else:
                    async for line in r.aiter_lines():
                        if line == "data: [DONE]":
                            done = True
                        elif line.startswith("data: {"):
                            event = orjson.loads(line[6:])
                            if "error" in event:
                                error = "stream error: " + str(event["error"].get("message", ""))[:60]
                            for choice in event.get("choices") or []:
                                # engine_sim renders every token as " tok<id>"; a chunk may carry several
                                chunks += str(choice.get("text") or "").count(" tok")
                            usage = event.get("usage") or usage
        except httpx.HTTPError as exc:
            error = type(exc).__name__
        if error is None and not (done and chunks == self.max_tokens and usage
                                  and usage.get("completion_tokens") == self.max_tokens):
            error = f"inexact: {chunks} tokens of text, usage {usage and usage.get('completion_tokens')}, done {done}"
        # Counted in the phase it ended in: a request the gateway's death cut off belongs to that fault.
        phase = self.phase
        phase.started += 1
        if error is None:
            phase.ok += 1
            if phase.serving_again_s is None and self.fault_at is not None and started >= self.fault_at:
                phase.serving_again_s = time.monotonic() - self.fault_at
        else:
            phase.failed += 1
            phase.errors[error] = phase.errors.get(error, 0) + 1


def _supervise(stack: Stack, sup: Supervisor, stop: threading.Event) -> None:
    while not stop.is_set():
        reason = sup.poll()
        if reason is not None:
            print(f"supervisor gave up: {reason}", file=sys.stderr)
            return
        stop.wait(0.2)


async def battery(stack: Stack, args: argparse.Namespace) -> list[Phase]:
    load = Load(stack, args.rate, args.max_tokens)
    stop = asyncio.Event()
    runner = asyncio.create_task(load.run(stop))
    sup = Supervisor(stack.supervised, say=lambda line: print(line, file=sys.stderr))
    halt = threading.Event()
    watcher = threading.Thread(target=_supervise, args=(stack, sup, halt), daemon=True)
    watcher.start()
    try:
        await asyncio.sleep(args.recover_s)
        kills = [("kill -9 worker sidecar (worker-d0)", lambda: _process(stack, "worker-d0").proc.pid),
                 ("kill -9 decode engine (d1)", lambda: _engine_pid(stack, "d1"))]
        for name, pid in kills:
            restarts = sup.restarts
            load.next_phase(name)
            os.kill(pid(), signal.SIGKILL)
            await asyncio.sleep(args.recover_s)
            load.phase.restarts = sup.restarts - restarts
        load.next_phase(f"SIGSTOP decode engine (d0) for {args.stall_s:.0f} s")
        stopped = _engine_pid(stack, "d0")
        os.kill(stopped, signal.SIGSTOP)
        await asyncio.sleep(args.stall_s)
        os.kill(stopped, signal.SIGCONT)
        await asyncio.sleep(args.recover_s)
        for name in ("planner", "monitor", "migrator", "nats-server", "etcd", "gateway"):
            restarts = sup.restarts
            load.next_phase(f"kill -9 {name}")
            os.kill(_process(stack, name).proc.pid, signal.SIGKILL)
            await asyncio.sleep(args.recover_s)
            load.phase.restarts = sup.restarts - restarts
    finally:
        stop.set()
        await runner
        halt.set()
    return load.phases


def _rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


async def soak(stack: Stack, args: argparse.Namespace) -> tuple[list[Phase], list[dict[str, float | None]]]:
    """The load alone for ``--soak-s``; every process's RSS every 30 s (MB), the first after the warm-up."""
    load = Load(stack, args.rate, args.max_tokens)
    stop = asyncio.Event()
    runner = asyncio.create_task(load.run(stop))
    samples: list[dict[str, float | None]] = []
    try:
        await asyncio.sleep(args.recover_s)
        load.next_phase(f"soak, {args.soak_s:.0f} s")
        t0 = time.monotonic()
        while True:
            engines = {f"engine-{i}": _rss_mb(_engine_pid(stack, i)) for i in ("p0", "p1", "d0", "d1")}
            samples.append({"t_s": round(time.monotonic() - t0, 1),
                            **{p.name: _rss_mb(p.proc.pid) for p in stack.supervised}, **engines})
            if time.monotonic() - t0 >= args.soak_s:
                break
            await asyncio.sleep(min(30.0, args.soak_s - (time.monotonic() - t0)))
    finally:
        stop.set()
        await runner
    return load.phases, samples


def write_soak(phases: list[Phase], samples: list[dict[str, float | None]], args: argparse.Namespace,
               command: str) -> None:
    soaked = phases[-1]
    first, last = samples[0], samples[-1]
    names = [k for k in first if k != "t_s"]
    lines = ["# Soak: the dev stack under steady load, no faults", "", f"Command: `{command}`", "",
             f"2P2D engine_sim, auth on, static planner, `poise up`'s supervision; {args.rate:g} streaming requests/s "
             f"of {args.max_tokens} tokens, each checked exactly, for {args.soak_s:.0f} s after a "
             f"{args.recover_s:g}-s warm-up. Load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} "
             "cores.", "",
             f"Requests that ended in the soak: {soaked.started}; completed exactly: {soaked.ok}; failed: "
             f"{soaked.failed}" + (f" ({'; '.join(f'{k} x{v}' for k, v in soaked.errors.items())})" if soaked.errors
                                   else "") + ".", "",
             "| process | RSS after warm-up (MB) | RSS at the end (MB) | growth (MB) |", "|---|---|---|---|"]
    for name in names:
        a, b = first[name], last[name]
        growth = f"{b - a:+.1f}" if a is not None and b is not None else "-"
        lines.append(f"| {name} | {'-' if a is None else f'{a:.1f}'} | {'-' if b is None else f'{b:.1f}'} | {growth} |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.md").write_text("\n".join(lines) + "\n")
    (args.out / "soak.json").write_text(json.dumps({"command": command, "phases": [asdict(p) for p in phases],
                                                    "rss_mb": samples}, indent=1))
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=8.0, help="streaming requests per second")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--recover-s", type=float, default=25.0, help="load after each fault before the next")
    parser.add_argument("--stall-s", type=float, default=30.0)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--soak-s", type=float, default=0.0, help="no faults: this long a soak under the load")
    args = parser.parse_args()
    command = shlex.join([Path(sys.executable).name, "-m", "tests.bench.fault_battery", *sys.argv[1:]])
    run = Path(".poise/bench") / f"faults-{time.strftime('%H%M%S')}"
    settings = load_settings(StackSettings, gateway_port=0, monitor_port=0, planner_policy="static", run_dir=run,
                             state_dir=run)
    stack = Stack(settings, progress=lambda line: print(line, file=sys.stderr))
    stack.start()
    try:
        if args.soak_s > 0:
            phases, samples = asyncio.run(soak(stack, args))
        else:
            phases = asyncio.run(battery(stack, args))
    finally:
        stack.stop()
    if args.soak_s > 0:
        write_soak(phases, samples, args, command)
        return
    rows = [asdict(p) for p in phases]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fault_battery.json").write_text(json.dumps({"command": command, "phases": rows}, indent=1))
    lines = ["# Fault battery: the dev stack under load while its processes die", "", f"Command: `{command}`", "",
             f"2P2D engine_sim, auth on, static planner, `poise up`'s supervision; {args.rate:g} streaming requests/s "
             f"of {args.max_tokens} tokens, each checked exactly; {args.recover_s:g} s of load after each fault. "
             f"Load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores.", "",
             "Requests are counted in the phase they ended in.", "",
             "| phase | requests | completed exactly | failed | restarts by poise up | serving again after | failures |",
             "|---|---|---|---|---|---|---|"]
    for p in phases:
        again = f"{p.serving_again_s:.1f} s" if p.serving_again_s is not None else "-"
        errors = "; ".join(f"{k} x{v}" for k, v in sorted(p.errors.items(), key=lambda kv: -kv[1])) or "-"
        lines.append(f"| {p.name} | {p.started} | {p.ok} | {p.failed} | {p.restarts} | {again} | {errors} |")
    (args.out / "fault_battery.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
