"""Poise's gateway side by side with sglang-router (the Rust PD router from PyPI ``sglang-router``).

Both routers sit in front of the same engine_sim engines (2 prefill + 2 decode, each with its Poise worker
sidecar, registered in etcd; sglang-router gets the same engines' URLs and bootstrap ports on its command line):

1. Added latency: engine_sim at time_scale 0 (no compute). The same small request (a 64-character text
   prompt, 16 tokens by engine_sim's count, 4 output tokens, non-streaming, ``/v1/completions``) is sent
   open-loop (Poisson) straight to the engines and through each router. "Direct" is a client that does the PD
   handoff itself, as a router does: it draws a bootstrap room and posts the body to a prefill and a decode
   engine at once (pairs in turn), and waits for both. Added = router percentile minus direct percentile
   (unpaired), as in ``tests/bench/run.py``. The prompt is text because sglang-router 0.3.2 refuses token-id
   prompts (422 "data did not match any variant of untagged enum StringOrArray").
2. Max sustainable rate: the same phases at rising Poisson rates; a router passes a rate while its added p99
   stays within ``--bound-ms`` (10 ms, as the gateway benchmark) with no errors. It leaves the ramp after two
   failed rates in a row (or one far past: errors over 1% or added p99 over 10x the bound).
3. SLO attainment: a slice of the Azure conversation trace replayed (``loadgen.replay``, streaming chat:
   sglang-router takes text prompts only) through Poise with each of its policies and through sglang-router
   with each of its policies, one after the other on the same fresh engines, against Arrow Table 1's SLO
   (TTFT 2 s, TPOT 0.15 s). Two settings by default (``--attainment``): the profiled H100 (time_scale 1) at 2x
   the trace's rate, and engines six times slower (time_scale 6) at 1.5x. At time_scale 1 a 2P2D cluster
   saturates near 10x the trace's rate (``poise sim goodput``), far more streamed tokens per second than two
   shared cores can carry through any router, so only slower engines let this machine load them to where
   dispatch decisions matter (attainment ~93% at 1.5x).

sglang-router is a bench-only dependency: ``pip install sglang-router`` (0.3.2 was measured). It runs with
``--log-level warn`` (at its default, info, it logs two lines per request); Poise's gateway runs as
``poise up`` starts it. Writes ``tests/bench/results/router_compare.{md,json,png}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from shared.devservers import EtcdServer, ManagedProcess, NatsServer, free_port
from shared.http1 import Http1Pool
from shared.latency import DEFAULT_PROFILE
from tests.bench.loadclient import Phase, open_loop, poisson_arrivals
from tests.bench.run import _stats

OUT = Path("tests/bench/results")
MODEL = "bench-model"
HOST = "127.0.0.1"
PROMPT = "word " * 12 + "word"  # 64 characters: 16 tokens for engine_sim (ceil(chars / 4)) and Poise's estimate
BODY: dict[str, Any] = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "ignore_eos": True}
POISE = "poise"
SGLANG = "sglang-router"
#: Attainment settings run by default: the profiled H100 at a rate this machine can drive, then engines six times
#: slower (time_scale 6) so that the same client load brings them near saturation, where dispatch matters.
DEFAULT_ATTAINMENT = ("1:2:least-load:cache_aware", "6:1.5:least-load+arrow:cache_aware+round_robin+power_of_two")


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# -- pure helpers (tests/unit/test_router_compare_helpers.py) ---------------------------------------------------

def sglang_router_command(python: str, prefills: Sequence[tuple[str, int]], decodes: Sequence[str], policy: str, *,
                          port: int, prometheus_port: int, host: str = HOST, log_level: str = "warn") -> list[str]:
    """``python -m sglang_router.launch_router`` in PD mode: ``--prefill URL BOOTSTRAP_PORT`` and ``--decode URL``
    once per engine (sglang-router 0.3.2's flags; ``--policy`` sets the prefill and the decode policy)."""
    cmd = [python, "-m", "sglang_router.launch_router", "--pd-disaggregation"]
    for url, bootstrap_port in prefills:
        cmd += ["--prefill", url, str(bootstrap_port)]
    for url in decodes:
        cmd += ["--decode", url]
    return cmd + ["--policy", policy, "--host", host, "--port", str(port), "--prometheus-host", host,
                  "--prometheus-port", str(prometheus_port), "--log-level", log_level]


def passes(row: dict[str, Any], bound_ms: float) -> bool:
    """A router's phase passes when nothing failed and its added p99 is within the bound."""
    return row["errors"] == 0 and row["added_p99_ms"] <= bound_ms


def max_sustainable(rows: Sequence[dict[str, Any]], name: str, bound_ms: float) -> float:
    """The highest offered rate at which router ``name`` passed (0 when it passed none), as tests/bench/run.py."""
    rates = [r["rate_rps"] for r in rows if name in r["routers"] and passes(r["routers"][name], bound_ms)]
    return max(rates, default=0.0)


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or b is 0."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def metric_total(text: str, name: str) -> float:
    """Sum of every sample of Prometheus metric ``name`` (all label sets) in exposition ``text``."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and len(line) > len(name) and line[len(name)] in "{ ":
            total += float(line.rsplit(" ", 1)[1])
    return total


def proc_cpu_s(stat_text: str, clock_ticks: int) -> float:
    """utime + stime, in seconds, from the text of ``/proc/<pid>/stat`` (all threads of the process)."""
    fields = stat_text.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / clock_ticks


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        return proc_cpu_s(f.read(), os.sysconf("SC_CLK_TCK"))


def parse_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


@dataclass(frozen=True)
class AttainmentSpec:
    """One attainment setting: engines' time scale, the replay's rate scale, and the policies run at it."""

    time_scale: float
    rate_scale: float
    poise_policies: tuple[str, ...]
    sglang_policies: tuple[str, ...]

    @property
    def label(self) -> str:
        return f"time_scale {self.time_scale:g}, {self.rate_scale:g}x trace rate"


def parse_attainment_spec(text: str) -> AttainmentSpec:
    """``TIME_SCALE:RATE_SCALE:POISE_POLICIES:SGLANG_POLICIES``, policies joined by ``+`` (either list may be
    empty), e.g. ``6:1.5:least-load+arrow:cache_aware+round_robin``."""
    parts = text.split(":")
    if len(parts) != 4:
        raise ValueError(f"attainment spec {text!r}: want TIME_SCALE:RATE_SCALE:POISE_POLICIES:SGLANG_POLICIES")
    try:
        time_scale, rate_scale = float(parts[0]), float(parts[1])
    except ValueError:
        raise ValueError(f"attainment spec {text!r}: time and rate scales must be numbers") from None
    if not time_scale >= 0 or not rate_scale > 0:
        raise ValueError(f"attainment spec {text!r}: time scale must be >= 0 and rate scale > 0")
    poise = tuple(p for p in parts[2].split("+") if p)
    sglang = tuple(p for p in parts[3].split("+") if p)
    if not poise and not sglang:
        raise ValueError(f"attainment spec {text!r}: no policy to run")
    return AttainmentSpec(time_scale, rate_scale, poise, sglang)


# -- the engines (shared by both routers) --------------------------------------------------------------------

@dataclass
class Engine:
    instance_id: str
    role: str
    port: int
    bootstrap_port: int | None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"


@dataclass
class Cluster:
    """NATS, etcd and one Poise worker sidecar per engine (each spawns its engine_sim and registers it)."""

    run_dir: Path
    prefill: int
    decode: int
    time_scale: float
    namespace: str = "rc"
    engines: list[Engine] = field(default_factory=list)
    processes: list[ManagedProcess] = field(default_factory=list)
    nats: NatsServer | None = None
    etcd: EtcdServer | None = None

    @property
    def prefills(self) -> list[Engine]:
        return [e for e in self.engines if e.role == "prefill"]

    @property
    def decodes(self) -> list[Engine]:
        return [e for e in self.engines if e.role == "decode"]

    def common(self) -> list[str]:
        assert self.nats is not None and self.etcd is not None
        return ["--namespace", self.namespace, "--nats-url", self.nats.url, "--etcd-url", self.etcd.url]

    def start(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.nats = NatsServer(self.run_dir, host=HOST)
        self.etcd = EtcdServer(self.run_dir, host=HOST)
        for role, count in (("prefill", self.prefill), ("decode", self.decode)):
            for i in range(count):
                engine = Engine(f"{role[0]}{i}", role, free_port(), free_port() if role == "prefill" else None)
                args = [*self.common(), "--instance-id", engine.instance_id, "--role", role, "--engine-kind", "sim",
                        "--engine-host", HOST, "--engine-port", str(engine.port), "--profile", DEFAULT_PROFILE,
                        "--model", MODEL, "--time-scale", str(self.time_scale), "--seed", str(len(self.engines)),
                        "--log-dir", str(self.run_dir / "logs")]
                if engine.bootstrap_port is not None:
                    args += ["--bootstrap-port", str(engine.bootstrap_port)]
                self.engines.append(engine)
                self.processes.append(ManagedProcess(f"worker-{engine.instance_id}",
                                                     [sys.executable, "-m", "services.worker", *args],
                                                     self.run_dir / "logs" / f"worker-{engine.instance_id}.log"))
        deadline = time.monotonic() + 90
        with httpx.Client(timeout=1.0, trust_env=False) as client:
            for engine in self.engines:
                while True:
                    self.check_alive()
                    try:
                        if client.get(engine.url + "/health").status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"engine {engine.instance_id} not healthy after 90 s ({self.run_dir})")
                    time.sleep(0.2)

    def check_alive(self) -> None:
        for proc in self.processes:
            if not proc.alive:
                raise RuntimeError(f"{proc.name} exited with {proc.proc.returncode}:\n{proc.tail()}")

    def wait_idle(self, timeout_s: float = 60.0) -> None:
        """Until no engine has a request (running or queued), so one run's leftovers do not load the next."""
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while time.monotonic() < deadline:
                busy = 0
                for engine in self.engines:
                    try:
                        for load in client.get(engine.url + "/v1/loads").json()["loads"]:
                            busy += load["num_running_reqs"] + load["num_waiting_reqs"]
                    except (httpx.HTTPError, ValueError, KeyError):
                        busy += 1
                if busy == 0:
                    return
                time.sleep(0.5)
        say(f"engines still busy after {timeout_s:.0f} s; going on")

    def counters(self) -> dict[str, dict[str, float]]:
        """Per engine: requests it processed, prompt tokens it prefilled and of those the ones its prefix cache
        served (SGLang's counters) so far."""
        out = {}
        with httpx.Client(timeout=5.0, trust_env=False) as client:
            for engine in self.engines:
                text = client.get(engine.url + "/metrics").text
                out[engine.instance_id] = {"requests": metric_total(text, "sglang:num_requests_total"),
                                           "prompt_tokens": metric_total(text, "sglang:prompt_tokens_total"),
                                           "cached_tokens": metric_total(text, "sglang:cached_tokens_total")}
        return out

    def flush_caches(self) -> None:
        """Empty every engine's prefix cache (SGLang's /flush_cache, idle engines only), so a run does not
        find the prompts an earlier run on the same engines left behind."""
        with httpx.Client(timeout=30.0, trust_env=False) as client:
            for engine in self.engines:
                r = client.post(engine.url + "/flush_cache", params={"timeout": 20})
                if r.status_code != 200:
                    say(f"flush_cache on {engine.instance_id}: {r.status_code} {r.text[:100]}")

    def stop(self) -> None:
        for proc in self.processes:
            if proc.alive:
                proc.proc.terminate()
        for proc in self.processes:
            proc.stop(timeout_s=15)
        self.processes.clear()
        for server in (self.etcd, self.nats):
            if server is not None:
                server.stop()
        self.etcd = self.nats = None


# -- the routers ------------------------------------------------------------------------------------------

@dataclass
class Router:
    name: str  # POISE or SGLANG
    policy: str
    url: str
    proc: ManagedProcess
    command: list[str]

    def stop(self) -> None:
        self.proc.stop(timeout_s=10)


def start_poise(cluster: Cluster, policy: str) -> Router:
    port = free_port()
    # The gateway's flags as `poise up` passes them (services/cli/stack.py): Arrow Table 1's Azure conversation SLO.
    cmd = [sys.executable, "-m", "services.gateway", *cluster.common(), "--profile", DEFAULT_PROFILE,
           "--slo-ttft-s", "2.0", "--slo-tpot-s", "0.15", "--dispatch-policy", policy, "--host", HOST,
           "--port", str(port)]
    proc = ManagedProcess(f"gateway-{policy}", cmd, cluster.run_dir / "logs" / f"gateway-{policy}.log")
    router = Router(POISE, policy, f"http://{HOST}:{port}", proc, cmd)
    deadline = time.monotonic() + 60
    with httpx.Client(timeout=1.0, trust_env=False) as client:
        while time.monotonic() < deadline:
            if not proc.alive:
                raise RuntimeError(f"the gateway exited with {proc.proc.returncode}:\n{proc.tail()}")
            try:
                if int(client.get(router.url + "/health").json().get("instances", 0)) >= len(cluster.engines):
                    return router
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.1)
    router.stop()
    raise RuntimeError(f"the gateway did not see {len(cluster.engines)} engines within 60 s; see {proc.log_path}")


def sglang_router_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("sglang-router")
    except Exception:
        return None


def start_sglang(cluster: Cluster, policy: str) -> Router:
    port, prom = free_port(), free_port()
    cmd = sglang_router_command(sys.executable, [(e.url, e.bootstrap_port or 0) for e in cluster.prefills],
                                [e.url for e in cluster.decodes], policy, port=port, prometheus_port=prom)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}  # it tries to fetch a tokenizer named after the model; none exists
    proc = ManagedProcess(f"sglang-router-{policy}", cmd, cluster.run_dir / "logs" / f"sglang-router-{policy}.log",
                          env=env)
    router = Router(SGLANG, policy, f"http://{HOST}:{port}", proc, cmd)
    deadline = time.monotonic() + 60
    body = orjson.dumps(BODY)
    with httpx.Client(timeout=5.0, trust_env=False) as client:
        # Ready once a request goes through: it registers workers asynchronously after it starts listening.
        while time.monotonic() < deadline:
            if not proc.alive:
                raise RuntimeError(f"sglang-router exited with {proc.proc.returncode}:\n{proc.tail()}")
            try:
                r = client.post(router.url + "/v1/completions", content=body,
                                headers={"content-type": "application/json"})
                if r.status_code == 200:
                    return router
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
    router.stop()
    raise RuntimeError(f"sglang-router did not serve a request within 60 s; see {proc.log_path}")


# -- 1 + 2: added latency and the rate ramp ---------------------------------------------------------------

async def open_loop_pd(pairs: list[tuple[Engine, Engine]], body: dict[str, Any], *, rate_rps: float,
                       duration_s: float, seed: int = 0, warmup: int = 20, grace_s: float = 10.0) -> Phase:
    """``loadclient.open_loop`` for the direct PD baseline: each request is the body with a fresh bootstrap room
    posted to a prefill and a decode engine at once (pairs in turn), done when both answered."""
    phase = Phase(target="direct", rate_rps=rate_rps)
    rng = random.Random(seed)  # the same arrival times as open_loop with the same seed
    client = Http1Pool()
    n = 0

    async def send() -> bool:
        nonlocal n
        prefill, decode = pairs[n % len(pairs)]
        n += 1
        payload = orjson.dumps({**body, "bootstrap_host": HOST, "bootstrap_port": prefill.bootstrap_port,
                                "bootstrap_room": random.getrandbits(63)})
        try:
            (ps, _), (ds, _) = await asyncio.wait_for(asyncio.gather(
                client.post_json(prefill.url + "/v1/completions", payload),
                client.post_json(decode.url + "/v1/completions", payload)), 30.0)
        except OSError:
            return False
        return ps == 200 and ds == 200

    try:
        for _ in range(warmup):
            await send()

        async def one(at: float) -> None:
            phase.late_s.append(time.monotonic() - at)
            t0 = time.monotonic()
            if await send():
                phase.latencies_s.append(time.monotonic() - t0)
            else:
                phase.errors += 1

        await poisson_arrivals(one, phase, rate_rps=rate_rps, duration_s=duration_s, grace_s=grace_s, rng=rng)
    finally:
        await client.aclose()
    return phase


def _fmt(s: dict[str, Any]) -> str:
    return f"p50/p99 {s['p50_ms']:.2f}/{s['p99_ms']:.2f} ms, errors {s['errors']}/{s['sent']}"


def ramp(cluster: Cluster, routers: list[Router], rates: list[float], duration_s: float,
         bound_ms: float) -> list[dict[str, Any]]:
    pairs = [(p, d) for p in cluster.prefills for d in cluster.decodes]
    active = {r.name: r for r in routers}
    failed_in_a_row = {r.name: 0 for r in routers}
    rows: list[dict[str, Any]] = []
    for i, rate in enumerate(rates):
        if not active:
            break
        say(f"rate {rate:g} req/s ({duration_s:g} s per phase; load average {loadavg()[0]})")
        direct = _stats(asyncio.run(open_loop_pd(pairs, BODY, rate_rps=rate, duration_s=duration_s)))
        say(f"  direct        {_fmt(direct)}")
        row: dict[str, Any] = {"rate_rps": rate, "direct": direct, "routers": {}, "loadavg": loadavg()}
        order = sorted(active) if i % 2 == 0 else sorted(active, reverse=True)  # alternate who goes first
        for name in order:
            router = active[name]
            cpu0 = cpu_seconds(router.proc.proc.pid)
            s = _stats(asyncio.run(open_loop(router.url + "/v1/completions", BODY, rate_rps=rate,
                                             duration_s=duration_s, target=name)))
            # The router's own CPU (all its threads) per request, warm-up requests included.
            s["cpu_ms_per_req"] = (cpu_seconds(router.proc.proc.pid) - cpu0) * 1e3 / (s["sent"] + 20)
            s["added_p50_ms"] = s["p50_ms"] - direct["p50_ms"]
            s["added_p99_ms"] = s["p99_ms"] - direct["p99_ms"]
            row["routers"][name] = s
            ok = passes(s, bound_ms)
            failed_in_a_row[name] = 0 if ok else failed_in_a_row[name] + 1
            say(f"  {name:<13} {_fmt(s)}, added p50/p99 {s['added_p50_ms']:.2f}/{s['added_p99_ms']:.2f} ms "
                f"({'within' if ok else 'over'} {bound_ms:g} ms), router CPU {s['cpu_ms_per_req']:.3f} ms/req")
            far = s["errors"] > 0.01 * max(1, s["sent"]) or s["added_p99_ms"] > 10 * bound_ms
            if failed_in_a_row[name] >= 2 or far:
                say(f"  {name} leaves the ramp")
                del active[name]
        rows.append(row)
    return rows


# -- 3: SLO attainment on a trace slice -------------------------------------------------------------------

def attainment_run(cluster: Cluster, router: Router, args: argparse.Namespace, rate_scale: float) -> dict[str, Any]:
    from loadgen.progress import format_progress
    from loadgen.replay import replay
    from loadgen.slo import slo_for
    from loadgen.traces import load_trace

    workload = load_trace(args.trace).slice(args.trace_start_s, args.trace_duration_s)
    slo = slo_for("azure-conv") if args.trace == "azure-conv" else slo_for(workload.name)
    cluster.flush_caches()
    before = loadavg()
    counters0 = cluster.counters()
    cpu0 = cpu_seconds(router.proc.proc.pid)
    result = asyncio.run(replay(workload, router.url, model=MODEL, endpoint="chat", rate_scale=rate_scale,
                                slo=slo, timeout_s=120.0, keep_token_times=False,
                                progress=lambda p: say(f"  {format_progress(p)}") if p.final or
                                int(p.elapsed_s) % 15 == 0 else None))
    cpu_s = cpu_seconds(router.proc.proc.pid) - cpu0
    counters1 = cluster.counters()
    s = result.summary
    # Where the work went: each prefill engine's share of the prompt tokens, each decode engine's of the requests.
    split = {}
    for engine in cluster.engines:
        key = "prompt_tokens" if engine.role == "prefill" else "requests"
        split[engine.instance_id] = counters1[engine.instance_id][key] - counters0[engine.instance_id][key]
    shares = {}
    for role in ("prefill", "decode"):
        ids = [e.instance_id for e in cluster.engines if e.role == role]
        total = sum(split[i] for i in ids) or 1.0
        shares[role] = {i: split[i] / total for i in ids}
    prefill_ids = [e.instance_id for e in cluster.engines if e.role == "prefill"]
    prompt = sum(counters1[i]["prompt_tokens"] - counters0[i]["prompt_tokens"] for i in prefill_ids)
    cached = sum(counters1[i]["cached_tokens"] - counters0[i]["cached_tokens"] for i in prefill_ids)
    errors = sorted({r.error for r in result.records if r.error})[:3]
    row = {"router": router.name, "policy": router.policy, "requests": s.requests_total, "ok": s.requests_ok,
           "failed": s.requests_failed, "attainment": s.slo_attainment, "ttft_attainment": s.ttft_attainment,
           "tpot_attainment": s.tpot_attainment, "ttft_p50_s": s.ttft_p50_s, "ttft_p90_s": s.ttft_p90_s,
           "ttft_p99_s": s.ttft_p99_s, "tpot_p50_s": s.tpot_p50_s, "tpot_p90_s": s.tpot_p90_s,
           "tpot_p99_s": s.tpot_p99_s, "e2e_p50_s": s.e2e_p50_s, "lateness_p99_s": s.lateness_p99_s,
           "wall_s": result.wall_s, "loadavg_before": before, "loadavg_after": loadavg(), "errors_sample": errors,
           "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s}, "shares": shares,
           "router_cpu_ms_per_req": cpu_s * 1e3 / max(1, s.requests_total),
           "prefix_hit_rate": cached / prompt if prompt else 0.0}
    say(f"  {router.name} {router.policy}: attainment {s.slo_attainment:.1%} (TTFT {s.ttft_attainment:.1%}, TPOT "
        f"{s.tpot_attainment:.1%}), TTFT p50/p90/p99 {_ms(s.ttft_p50_s)}/{_ms(s.ttft_p90_s)}/{_ms(s.ttft_p99_s)} ms, "
        f"failed {s.requests_failed}/{s.requests_total}; prefill token split {_split(shares['prefill'])}, decode "
        f"request split {_split(shares['decode'])}")
    return row


def _cpu(stats: dict[str, Any] | None) -> str:
    return "-" if stats is None else f"{stats['cpu_ms_per_req']:.3f}"


def _split(shares: dict[str, float]) -> str:
    return " / ".join(f"{share:.0%}" for share in shares.values())


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f}"


# -- report -----------------------------------------------------------------------------------------------

def _r(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}x"


def summarize(result: dict[str, Any], bound_ms: float) -> dict[str, Any]:
    rows = result.get("ramp", [])
    out: dict[str, Any] = {}
    if rows:
        first = rows[0]
        p, g = first["routers"].get(POISE), first["routers"].get(SGLANG)
        out["lowest_rate"] = first["rate_rps"]
        if p and g:
            out["added_p50_ratio"] = ratio(p["added_p50_ms"], g["added_p50_ms"])
            out["added_p99_ratio"] = ratio(p["added_p99_ms"], g["added_p99_ms"])
        out["max_rate"] = {name: max_sustainable(rows, name, bound_ms) for name in (POISE, SGLANG)}
        out["max_rate_ratio"] = ratio(out["max_rate"][POISE], out["max_rate"][SGLANG])
        # Router CPU per request, median over the rates both routers passed (saturated phases excluded).
        both = [r for r in rows if all(n in r["routers"] and passes(r["routers"][n], bound_ms) for n in (POISE, SGLANG))]
        if both:
            cpu = {n: statistics.median(r["routers"][n]["cpu_ms_per_req"] for r in both) for n in (POISE, SGLANG)}
            out["cpu_ms_per_req"] = cpu
            out["cpu_ratio"] = ratio(cpu[POISE], cpu[SGLANG])
            out["req_per_core_s"] = {n: 1e3 / c if c > 0 else None for n, c in cpu.items()}
        out["direct_over_bound_from"] = min((r["rate_rps"] for r in rows if r["direct"]["p99_ms"] > bound_ms
                                             or r["direct"]["errors"]), default=None)
    out["attainment"] = []
    for block in result.get("attainment", []):
        best = {}
        for name in (POISE, SGLANG):
            runs = [a for a in block["runs"] if a["router"] == name]
            if runs:
                best[name] = max(runs, key=lambda a: a["attainment"])
        entry: dict[str, Any] = {"setting": block["setting"],
                                 "best": {k: {"policy": v["policy"], "attainment": v["attainment"]}
                                          for k, v in best.items()}}
        if len(best) == 2:
            entry["ratio"] = ratio(best[POISE]["attainment"], best[SGLANG]["attainment"])
        out["attainment"].append(entry)
    return out


def markdown(result: dict[str, Any]) -> str:
    bound = result["bound_ms"]
    summ = result["summary"]
    lines = ["# Poise gateway vs sglang-router (PD mode), same engines", "",
             f"Command: `{result['command']}`", "",
             f"Date: {result['when']}. Machine: {os.cpu_count()} cores, shared with other benchmarks; load average "
             f"(1/5/15 min) at start {result['loadavg_start']}, at end {result.get('loadavg_end')}. "
             f"sglang-router {result['sglang_router_version']} (Rust router, `--pd-disaggregation`), launched as "
             f"`{result.get('sglang_command_example', '')}`.", "",
             f"Engines: {result['engines']} engine_sim (profile {DEFAULT_PROFILE}), each with its Poise worker sidecar "
             "(load reports every 0.25 s on NATS, registration in etcd); client, routers, engines, sidecars, NATS and "
             "etcd share the cores. Ratios are Poise / sglang-router.", ""]
    rows = result.get("ramp", [])
    if rows:
        lines += ["## 1. Added latency (engine_sim time_scale 0)", "",
                  "The same request (64-character text prompt = 16 tokens, 4 output tokens, non-streaming "
                  "`/v1/completions`), open-loop Poisson, "
                  f"{result['phase_s']:g} s per phase; direct = the client does the PD handoff itself (bootstrap room, "
                  "prefill and decode posts at once). Added = router percentile - direct percentile. `late p99` is how "
                  "late the client sent (a busy client shows here).", "",
                  "| offered req/s | direct p50 / p99 ms | Poise p50 / p99 ms | sglang-router p50 / p99 ms | "
                  "Poise added p50 / p99 ms | sglang-router added p50 / p99 ms | added p50 / p99 ratio | errors "
                  "direct / Poise / sglang | router CPU ms/req Poise / sglang | client late p99 ms (direct / Poise / "
                  "sglang) | load avg |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            d = r["direct"]
            p, g = r["routers"].get(POISE), r["routers"].get(SGLANG)

            def cell(s: dict[str, Any] | None, a: str, b: str) -> str:
                return "-" if s is None else f"{s[a]:.2f} / {s[b]:.2f}"

            rp50 = ratio(p["added_p50_ms"], g["added_p50_ms"]) if p and g else None
            rp99 = ratio(p["added_p99_ms"], g["added_p99_ms"]) if p and g else None
            lines.append(
                f"| {r['rate_rps']:g} | {d['p50_ms']:.2f} / {d['p99_ms']:.2f} | {cell(p, 'p50_ms', 'p99_ms')} | "
                f"{cell(g, 'p50_ms', 'p99_ms')} | {cell(p, 'added_p50_ms', 'added_p99_ms')} | "
                f"{cell(g, 'added_p50_ms', 'added_p99_ms')} | {_r(rp50)} / {_r(rp99)} | {d['errors']} / "
                f"{p['errors'] if p else '-'} / {g['errors'] if g else '-'} | {_cpu(p)} / {_cpu(g)} | "
                f"{d['late_p99_ms']:.1f} / "
                f"{p['late_p99_ms'] if p is None else round(p['late_p99_ms'], 1)} / "
                f"{g['late_p99_ms'] if g is None else round(g['late_p99_ms'], 1)} | {r['loadavg'][0]} |")
        mr = summ["max_rate"]
        lines += ["", "## 2. Max sustainable request rate", "",
                  f"Highest offered rate with added p99 <= {bound:g} ms and no errors (same phases as above; a router "
                  "leaves the ramp after two failed rates in a row).", "",
                  "| | Poise gateway | sglang-router | ratio Poise / sglang-router |", "|---|---|---|---|",
                  f"| max sustainable rate | {mr[POISE]:g} req/s | {mr[SGLANG]:g} req/s | "
                  f"**{_r(summ.get('max_rate_ratio'))}** |",
                  f"| added p50 / p99 at {summ['lowest_rate']:g} req/s | "
                  f"{rows[0]['routers'][POISE]['added_p50_ms']:.2f} / {rows[0]['routers'][POISE]['added_p99_ms']:.2f} ms | "
                  f"{rows[0]['routers'][SGLANG]['added_p50_ms']:.2f} / {rows[0]['routers'][SGLANG]['added_p99_ms']:.2f} ms"
                  f" | {_r(summ.get('added_p50_ratio'))} / {_r(summ.get('added_p99_ratio'))} |"]
        if "cpu_ms_per_req" in summ:
            cpu, per_core = summ["cpu_ms_per_req"], summ["req_per_core_s"]
            lines += [f"| router CPU per request (median over the rates both passed) | {cpu[POISE]:.3f} ms | "
                      f"{cpu[SGLANG]:.3f} ms | {_r(summ['cpu_ratio'])} |",
                      f"| requests per CPU-core-second (1000 / CPU ms) | {per_core[POISE]:,.0f} | "
                      f"{per_core[SGLANG]:,.0f} | {_r(ratio(per_core[POISE], per_core[SGLANG]))} |"]
        if summ.get("direct_over_bound_from") is not None:
            lines += ["", f"The direct baseline itself has p99 over {bound:g} ms (or errors) from "
                          f"{summ['direct_over_bound_from']:g} req/s: from there the engines, sidecars and client "
                          "saturate the cores, and the verdicts above that rate say more about the machine than the "
                          "routers. The router CPU per request (all of the process's threads, from /proc) is the "
                          "measure of routing cost that does not depend on that: Poise's gateway is one event loop "
                          "(at most one core), sglang-router runs a multi-threaded tokio runtime (it can use every core)."]

    blocks = result.get("attainment", [])
    if blocks:
        a0 = result["attainment_setup"]
        first = blocks[0]["runs"][0] if blocks[0]["runs"] else None
        lines += ["", "## 3. SLO attainment", "",
                  f"{a0['trace']} seconds {a0['start_s']:g}-{a0['start_s'] + a0['duration_s']:g} of the trace"
                  + (f" ({first['requests']} requests)" if first else "")
                  + ", replayed open-loop as streaming chat requests; SLO (Arrow Table 1): "
                  + (f"TTFT <= {first['slo']['ttft_s']:g} s and TPOT <= {first['slo']['tpot_s']:g} s. " if first else "")
                  + "Each setting starts fresh engines; its runs go one after the other on them (idle in between, their "
                  "prefix caches flushed). "
                  "time_scale multiplies every modelled GPU time (1 = the H100 profile, 6 = a GPU six times slower).",
                  "", "| setting | router | policy | attainment | TTFT att. | TPOT att. | TTFT p50 / p90 / p99 ms | "
                  "TPOT p50 / p90 ms | failed | prefill token split | decode request split | prefix cache hit rate | "
                  "router CPU ms/req | client late p99 ms | load avg before / after |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for block in blocks:
            for a in block["runs"]:
                lines.append(
                    f"| {block['setting']['label']} | {a['router']} | {a['policy']} | {a['attainment']:.1%} | "
                    f"{a['ttft_attainment']:.1%} | {a['tpot_attainment']:.1%} | {_ms(a['ttft_p50_s'])} / "
                    f"{_ms(a['ttft_p90_s'])} / {_ms(a['ttft_p99_s'])} | {_ms(a['tpot_p50_s'])} / {_ms(a['tpot_p90_s'])} | "
                    f"{a['failed']}/{a['requests']} | {_split(a['shares']['prefill'])} | "
                    f"{_split(a['shares']['decode'])} | {a.get('prefix_hit_rate', 0.0):.1%} | "
                    f"{a['router_cpu_ms_per_req']:.2f} | {_ms(a['lateness_p99_s'])} | "
                    f"{a['loadavg_before'][0]} / {a['loadavg_after'][0]} |")
        lines += ["", "| setting | best Poise | best sglang-router | attainment ratio Poise / sglang-router |",
                  "|---|---|---|---|"]
        for entry in summ.get("attainment", []):
            best = entry["best"]
            if len(best) == 2:
                lines.append(f"| {entry['setting']['label']} | `{best[POISE]['policy']}` "
                             f"{best[POISE]['attainment']:.1%} | `{best[SGLANG]['policy']}` "
                             f"{best[SGLANG]['attainment']:.1%} | **{_r(entry.get('ratio'), 3)}** |")
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result.get("ramp", [])
    att = [(block["setting"], a) for block in result.get("attainment", []) for a in block["runs"]]
    fig, axes = plt.subplots(1, 2 if att else 1, figsize=(13 if att else 7, 4.4), squeeze=False)
    ax = axes[0][0]
    for name, color in ((POISE, "tab:blue"), (SGLANG, "tab:orange")):
        pts = [(r["rate_rps"], r["routers"][name]) for r in rows if name in r["routers"]]
        if pts:
            ax.plot([p[0] for p in pts], [p[1]["added_p50_ms"] for p in pts], "o--", color=color,
                    label=f"{name} added p50")
            ax.plot([p[0] for p in pts], [p[1]["added_p99_ms"] for p in pts], "s-", color=color,
                    label=f"{name} added p99")
    ax.axhline(result["bound_ms"], color="gray", ls=":", label=f"{result['bound_ms']:g} ms bound")
    ax.set_yscale("symlog", linthresh=1.0)
    ax.set_xlabel("offered load (req/s)")
    ax.set_ylabel("latency added over direct PD (ms)")
    ax.set_title("Added latency, 2P2D engine_sim, no compute")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if att:
        ax = axes[0][1]
        labels = [f"ts {st['time_scale']:g} x{st['rate_scale']:g}\n{'Poise' if a['router'] == POISE else 'sglang'}\n"
                  f"{a['policy']}" for st, a in att]
        colors = ["tab:blue" if a["router"] == POISE else "tab:orange" for _, a in att]
        ax.bar(range(len(att)), [a["attainment"] * 100 for _, a in att], color=colors)
        for i, (_, a) in enumerate(att):
            ax.text(i, a["attainment"] * 100 + 0.3, f"{a['attainment']:.1%}", ha="center", fontsize=7)
        ax.set_xticks(range(len(att)), labels, fontsize=7)
        ax.set_ylabel("SLO attainment (%)")
        lo = min(a["attainment"] for _, a in att) * 100
        ax.set_ylim(max(0.0, lo - 10), 101.5)
        ax.set_title(f"SLO attainment, {result['attainment_setup']['trace']} (blue Poise, orange sglang-router)")
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # so the finally blocks stop every process started


def main() -> None:
    signal.signal(signal.SIGTERM, _interrupt)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefill", type=int, default=2)
    parser.add_argument("--decode", type=int, default=2)
    parser.add_argument("--phase-s", type=float, default=10.0, help="seconds per (target, rate) phase")
    parser.add_argument("--rates", default="100,200,300,400,500,600,800", help="ramp rates, req/s")
    parser.add_argument("--bound-ms", type=float, default=10.0, help="added p99 bound of a sustainable rate")
    parser.add_argument("--poise-policy", default="least-load", help="Poise dispatch policy for 1 and 2")
    parser.add_argument("--sglang-policy", default="cache_aware", help="sglang-router policy for 1 and 2 (its default)")
    parser.add_argument("--trace", default="azure-conv")
    parser.add_argument("--trace-start-s", type=float, default=0.0)
    parser.add_argument("--trace-duration-s", type=float, default=150.0, help="slice length in trace seconds")
    parser.add_argument("--attainment", action="append", type=parse_attainment_spec, metavar="SPEC",
                        help="TIME_SCALE:RATE_SCALE:POISE_POLICIES:SGLANG_POLICIES (policies joined by +); repeatable; "
                             f"default {' and '.join(DEFAULT_ATTAINMENT)}")
    parser.add_argument("--skip-latency", action="store_true", help="skip 1 and 2")
    parser.add_argument("--skip-attainment", action="store_true", help="skip 3")
    parser.add_argument("--out", default=str(OUT / "router_compare"), help="output path without suffix")
    args = parser.parse_args()

    version = sglang_router_version()
    if version is None:
        sys.exit("sglang-router is not installed: `.venv/bin/pip install sglang-router` (a bench-only dependency; "
                 "0.3.2 was measured)")
    command = shlex.join([Path(sys.executable).name, "-m", "tests.bench.router_compare", *sys.argv[1:]])
    run_dir = Path(".poise/bench") / f"router_compare-{time.strftime('%Y%m%d-%H%M%S')}"
    result: dict[str, Any] = {"command": command, "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                              "loadavg_start": loadavg(), "sglang_router_version": version, "bound_ms": args.bound_ms,
                              "phase_s": args.phase_s, "engines": f"{args.prefill}P{args.decode}D",
                              "run_dir": str(run_dir)}
    say(f"router comparison: sglang-router {version}, {args.prefill}P{args.decode}D engine_sim, load average "
        f"{result['loadavg_start']}; logs in {run_dir}")
    t0 = time.monotonic()
    if not args.skip_latency:
        cluster = Cluster(run_dir / "ts0", args.prefill, args.decode, time_scale=0.0)
        routers: list[Router] = []
        try:
            say("1+2: starting engines at time_scale 0, Poise gateway and sglang-router ...")
            cluster.start()
            routers = [start_poise(cluster, args.poise_policy), start_sglang(cluster, args.sglang_policy)]
            result["sglang_command_example"] = shlex.join(["python", *routers[1].command[1:]])
            result["poise_command_example"] = shlex.join(["python", *routers[0].command[1:]])
            result["ramp_policies"] = {POISE: args.poise_policy, SGLANG: args.sglang_policy}
            result["ramp"] = ramp(cluster, routers, [float(r) for r in parse_list(args.rates)], args.phase_s,
                                  args.bound_ms)
        finally:
            for router in routers:
                router.stop()
            cluster.stop()
    if not args.skip_attainment:
        result["attainment_setup"] = {"trace": args.trace, "start_s": args.trace_start_s,
                                      "duration_s": args.trace_duration_s}
        result["attainment"] = []
        for n, spec in enumerate(args.attainment or [parse_attainment_spec(t) for t in DEFAULT_ATTAINMENT]):
            block: dict[str, Any] = {"setting": {"time_scale": spec.time_scale, "rate_scale": spec.rate_scale,
                                                 "label": spec.label}, "runs": []}
            result["attainment"].append(block)
            cluster = Cluster(run_dir / f"att{n}-ts{spec.time_scale:g}", args.prefill, args.decode,
                              time_scale=spec.time_scale)
            try:
                say(f"3: starting engines at time_scale {spec.time_scale:g} ...")
                cluster.start()
                plan = [(POISE, p) for p in spec.poise_policies] + [(SGLANG, p) for p in spec.sglang_policies]
                for name, policy in plan:
                    say(f"3: {name} {policy}: replaying {args.trace} {args.trace_start_s:g}+{args.trace_duration_s:g} s "
                        f"at {spec.rate_scale:g}x, engines at time_scale {spec.time_scale:g} (load average {loadavg()[0]})")
                    router = start_poise(cluster, policy) if name == POISE else start_sglang(cluster, policy)
                    if name == SGLANG:
                        result["sglang_command_example"] = shlex.join(["python", *router.command[1:]])
                    try:
                        block["runs"].append(attainment_run(cluster, router, args, spec.rate_scale))
                    finally:
                        router.stop()
                    cluster.wait_idle()
            finally:
                cluster.stop()
    result["loadavg_end"] = loadavg()
    result["wall_s"] = time.monotonic() - t0
    result["summary"] = summarize(result, args.bound_ms)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    out.with_suffix(".md").write_text(markdown(result))
    plot(result, out.with_suffix(".png"))
    say(f"done in {result['wall_s']:.0f} s; wrote {out}.md/.json/.png")
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
