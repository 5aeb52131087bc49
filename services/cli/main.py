"""``poise``: the command-line entry point.

    poise up      bring the dev stack up and keep it running (Ctrl-C stops it cleanly)
    poise run     bring the stack up, replay a trace slice, print the report, shut down
    poise bench   replay a trace against any running gateway
    poise admin   talk to the services over NATS (status, pools, flip, planner pause|resume, events)
    poise sim     replay a trace against a policy mix in virtual time (no processes, seconds of wall time)
    poise sim goodput   compare the goodput of policy mixes on a trace (table + plots)
    poise predictor collect|train   ARES length predictor: record SmolLM2 hidden states, train the MLP
    poise profile --engine URL   measure a running engine (TTFT vs input length, decode step vs batch and
                  context) and fit a latency profile

Every subcommand takes ``--help``; flags mirror the ``POISE_*`` environment variables.
"""

from __future__ import annotations

import functools
import shlex
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, Literal

import httpx
import msgspec
from pydantic import Field

from loadgen.replay import ReplayResult
from loadgen.slo import PRESETS, SLO, SLOClasses, parse_slo_classes, preset_classes
from services.cli.replay_job import ReplaySettings, TraceSliceSettings, run_replay
from services.cli.stack import Stack, StackSettings, read_current_stack
from services.cli.supervise import Supervisor
from shared.errors import PoiseError
from shared.latency import DEFAULT_PROFILE
from shared.policies.flip import DRAIN_TIMEOUT_S
from shared.settings import ServiceSettings, parse_settings, settings_config

if TYPE_CHECKING:
    from loadgen.sim.baselines import PolicyMix
    from loadgen.sim.goodput import Yardstick
    from services.cli.run_job import MainJobSettings


class SLOClassSettings(ServiceSettings):
    """Per-request SLO classes (see `loadgen.slo.SLOClasses`): which targets each request is judged against."""

    slo_class: list[str] = Field(
        default_factory=list,
        description="SLO class NAME=TTFT_S:TPOT_S[:SHARE], e.g. interactive=0.5:0.05:0.3; repeat for more classes "
                    "(JSON list in env). Empty TTFT/TPOT = the trace's; one class may omit SHARE (gets the rest).")
    slo_preset: str | None = Field(
        None, description=f"SLO-class preset built on the trace's SLO: {', '.join(sorted(PRESETS))} (not with --slo-class).")


def check_slo_classes(settings: SLOClassSettings) -> None:
    """Reject bad ``--slo-class`` / ``--slo-preset`` values before anything slow starts.

    The specs' validity does not depend on the trace's SLO (it only fills empty fields), so any SLO will do.
    """
    if settings.slo_class or settings.slo_preset:
        slo_classes(settings, SLO(ttft_s=1.0, tpot_s=1.0))


def slo_classes(settings: SLOClassSettings, trace_slo: SLO) -> SLOClasses | None:
    """The classes ``--slo-class`` / ``--slo-preset`` ask for (None: every request gets the trace's SLO)."""
    if settings.slo_class and settings.slo_preset:
        raise PoiseError("pass either --slo-class or --slo-preset, not both")
    try:
        if settings.slo_preset:
            return preset_classes(settings.slo_preset, trace_slo)
        return parse_slo_classes(settings.slo_class, trace_slo)
    except ValueError as exc:
        raise PoiseError(str(exc)) from None


class RunSettings(SLOClassSettings, StackSettings, ReplaySettings):
    """Bring the dev stack up, replay a slice of a real trace through it, report, and shut down."""

    model_config = settings_config("POISE_RUN_")

    def slo_trace(self) -> str:
        return self.trace  # the policies plan for the SLO the replay is judged by


class BenchSettings(SLOClassSettings, ReplaySettings):
    """Replay a trace against a running gateway (default: the one ``poise up`` started here)."""

    model_config = settings_config("POISE_BENCH_")

    gateway_url: str | None = Field(None, description="Gateway base URL (default: the stack `poise up` started here).")
    model: str | None = Field(None, description="Model name to request (default: the running stack's model).")


def _print(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def replay_with_classes(settings: RunSettings | BenchSettings, *, gateway_url: str, model: str, title: str,
                        label: str) -> ReplayResult:
    """`run_replay` with the SLO classes ``--slo-class`` / ``--slo-preset`` ask for; without them `poise run`
    judges by the SLO its stack plans for, `poise bench` by the trace's."""
    slo = SLO(*settings.planning_slo()) if isinstance(settings, RunSettings) else None
    return run_replay(settings, gateway_url=gateway_url, model=model, title=title, label=label,
                      classes=lambda trace_slo: slo_classes(settings, trace_slo), slo=slo)[0]


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def first_token_probe(gateway_url: str, model: str, timeout_s: float = 30.0, api_key: str | None = None) -> float:
    """Send one small streaming request and return seconds until its first token."""
    body = {"model": model, "prompt": "Hello", "max_tokens": 4, "stream": True}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    t0 = time.monotonic()
    with httpx.Client(timeout=timeout_s, trust_env=False, headers=headers) as client, \
            client.stream("POST", gateway_url + "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise PoiseError(f"probe request failed: {resp.status_code} {resp.read()[:200]!r}")
        for line in resp.iter_lines():
            if line.startswith("data:") and '"text"' in line:
                return time.monotonic() - t0
    raise PoiseError("probe request got no token")


def start_stack(settings: StackSettings) -> Stack:
    """Bring the stack up and serve one token through it; SIGTERM then unwinds like Ctrl-C (clean stop).

    The caller owns the stack and must ``stop()`` it, also when this raises.
    """
    t0 = time.monotonic()
    signal.signal(signal.SIGTERM, _raise_interrupt)
    stack = Stack(settings, progress=_print)
    stack.start()
    try:
        probe = first_token_probe(stack.gateway_url, settings.model, api_key=stack.api_key)
    except BaseException:
        stack.stop()
        raise
    _print(f"first token served {time.monotonic() - t0:.1f}s after start (probe TTFT {probe * 1000:.0f} ms)")
    return stack


def cmd_up(argv: list[str]) -> int:
    settings = parse_settings(StackSettings, argv, prog="poise up")
    try:
        stack = start_stack(settings)
    except KeyboardInterrupt:
        return 130
    try:
        # The key itself is not printed (terminal scrollback and CI logs keep it): it is in current.json, 0600.
        current = settings.state_dir / "current.json"
        auth = f"-H \"authorization: Bearer $(jq -r .api_key {current})\" " if stack.api_key else ""
        _print(f"try: curl -s {stack.gateway_url}/v1/completions -H 'content-type: application/json' {auth}"
               f"-d '{{\"model\": \"{settings.model}\", \"prompt\": \"Hello\", \"max_tokens\": 8}}'")
        _print("     poise admin status      (Ctrl-C stops the stack)")
        if settings.planner_policy != "static":
            _print(f"     poise admin events      (the {settings.planner_policy} planner's flips as they happen)")
            _print("     poise bench --trace stress-mix-shift --start-s 720 --duration-s 1080 --rate-scale 6   "
                   "(load whose best split moves)")
        supervisor = Supervisor(stack.supervised, say=_print)
        while True:
            time.sleep(1.0)
            reason = supervisor.poll()
            if reason is not None:
                _print(f"giving up: {reason}\nstopping (logs in {stack.run_dir / 'logs'})")
                return 1
    except KeyboardInterrupt:
        _print("stopping")
        return 0
    finally:
        stack.stop()


def cmd_run(argv: list[str]) -> int:
    # The main job's defaults (a slice whose load shifts) and its split-over-time comparison: services/cli/run_job.py.
    from services.cli.headroom import verdict
    from services.cli.replay_job import select_workload
    from services.cli.run_job import MainJobSettings, run_main_job

    settings = parse_settings(MainJobSettings, argv, prog="poise run")
    check_slo_classes(settings)
    select_workload(settings)  # a bad trace or slice is refused before the stack comes up
    if settings.pace:
        settings = _paced(settings)
    try:
        stack = start_stack(settings)
    except KeyboardInterrupt:
        return 130
    try:
        title = (f"poise run: {settings.trace}, {settings.prefill}P{settings.decode}D "
                 f"{'SGLang on this CPU' if settings.engines == 'sglang-cpu' else 'engine_sim'} ({settings.profile}), "
                 f"planner {settings.planner_policy}, dispatch {settings.dispatch_policy}")
        result = run_main_job(settings, stack, title)
        dead = stack.check_alive()
        if dead:
            _print(f"warning: process(es) died during the run: {', '.join(dead)}")
            return 1
        found = verdict(result.records, result.summary.lateness_p99_s, rate=settings.rate_scale)
        if found.line:
            _print(found.line)
        if found.failed:
            _print(f"{found.poise_failures} requests failed with an error (see the report's records)")
        return 2 if found.failed else 0
    except KeyboardInterrupt:
        _print("interrupted")
        return 130
    finally:
        stack.stop()


def _paced(settings: MainJobSettings) -> MainJobSettings:
    """``settings`` with the replay rate this machine can keep up with now (services/cli/headroom.py)."""
    from services.cli.headroom import paced_rate, sample_headroom

    headroom = sample_headroom()
    rate = round(paced_rate(settings.rate_scale, headroom), 2)
    if rate == settings.rate_scale:
        return settings
    _print(f"this machine is busy ({headroom.busy:.1f} other tasks want its {headroom.cores} cores): replaying at "
           f"{rate:g}x instead of {settings.rate_scale:g}x so the stand-in engines keep up (--no-pace: {settings.rate_scale:g}x)")
    return settings.model_copy(update={"rate_scale": rate})


def cmd_bench(argv: list[str]) -> int:
    settings = parse_settings(BenchSettings, argv, prog="poise bench")
    check_slo_classes(settings)
    current = read_current_stack() or {}
    gateway_url = settings.gateway_url or current.get("gateway_url")
    model = settings.model or current.get("model")
    if not gateway_url or not model:
        raise PoiseError("no gateway: pass --gateway-url and --model (or start one with `poise up`)")
    replay_with_classes(settings, gateway_url=gateway_url, model=model,
                        title=f"poise bench: {settings.trace} against {gateway_url}", label="bench")
    return 0


class _SimFields(TraceSliceSettings):
    """The fields `SimSettings` and `GoodputSettings` share."""

    duration_s: float | None = Field(None, gt=0.0, description="Length of the slice in trace seconds (unset = the whole trace).")
    rate_scale: float = Field(1.0, gt=0.0, description="Request-rate multiplier; how it raises the load is --rate-mode's (default natural: this many times the trace's rate curve at the trace's clock).")
    policy: str = Field("static-minload", description="Policy mix (loadgen/sim/baselines.py MIXES): poise, poise-sglang (the same control plane on stock SGLang engines), colocated, static-minload, static-rr, static-cache-aware, static-arrow, arrow, dopd, dopd-ratio, dynamo-load or dynamo-sla.")
    instances: int = Field(8, description="Number of instances (the GPU budget of the scaling mixes).")
    split: str | None = Field(None, description="P:D split of the disaggregated mixes, like 4P4D (default: even); the scaling mixes start from it.")
    profile: str = Field(DEFAULT_PROFILE, description="Latency profile (name or JSON path).")
    json_out: Path | None = Field(None, description="Also write the summary and config as JSON here (flag: --json).")
    prefill_policy: str | None = Field(None, description="Override the engines' prefill policy (shared.policies PREFILL_POLICIES: fcfs, edf, kairos, flowprefill, ...).")
    preemption: str | None = Field(None, description="Override the prefill engines' preemption granularity: chunk or operator.")
    chunk: int | None = Field(None, description="Override the prefill chunk size in tokens (0 or -1: no chunking).")
    decode_policy: str | None = Field(None, description="Override the engines' decode batch policy: continuous or kairos-slack.")
    late_binding: str | None = Field(None, description="Hold prompts in the gateway and release them in this prefill policy's order (or none).")
    late_binding_depth: int = Field(2, ge=1, description="Late binding: prompts a prefill engine may hold unprefilled.")
    migration: str | None = Field(None, description="Override the mix's migration policy: none, kv-balance, llumnix-like, ares or ares-oracle.")
    length_predictor: str | None = Field(None, description="Override the mix's length predictor: max-tokens, historical-mean, oracle or ares-noise.")
    migration_mechanism: str | None = Field(None, description="How the simulator moves a migrated request: kv-transfer (KV copy at 25 Gbit/s, default) or recompute.")
    kv_report: str | None = Field(None, description="What simulated engines report as KV use: current (KV written, prompt + generated: SGLang's, and ARES' baseline; default) or reserved (each request's whole reservation, an oracle no engine reports).")
    decode_kv: str | None = Field(None, description="How simulated decode and colocated engines admit KV: grow (default; SGLang's and engine_sim's: prompt + 512 reserved, growing per token, requests retracted in SGLang's order when a step does not fit) or whole (prompt + whole output reserved up front, never out of memory: an oracle that knows each output's length).")
    prefix_cache: bool | None = Field(None, description="Give simulated prefill and colocated engines SGLang's radix prefix cache, keyed by the trace's prefix blocks (Mooncake hash_ids; LRU eviction in the shared KV pool). Unset: the mix's default (off).")
    give_up_late: bool | None = Field(None, description="Simulated colocated engines refuse prompts still waiting, unstarted, past their TTFT target (a retryable 429; shared/engine/model.py); unset = the mix's default (on in poise, off elsewhere).")
    local_prefill_max_tokens: int | None = Field(None, ge=0, description="DOPD's local prefill: prompts up to this many tokens are prefilled on their decode instance, with no KV transfer (0 = never; unset = the mix's default).")
    early_rejection: bool | None = Field(None, description="Refuse requests the decode side cannot start within their TTFT target (shared/policies/admission.py); unset = the mix's default (on in poise, off elsewhere).")
    drain_by_migration: bool | None = Field(None, description="A decode instance draining for a flip has its requests moved to the other decode instances by --migration-mechanism (shared/policies/evacuation.py, as the live planner and migrator do); unset = the mix's default (on in poise, off elsewhere).")
    replica_start_s: float = Field(30.0, ge=0.0, description="Seconds a replica the scaling mixes start takes to become ready; also what an engine restart into or out of colocated serving costs.")
    drain_timeout_s: float = Field(DRAIN_TIMEOUT_S, gt=0.0, description="A flip's drain is called off after this many seconds (the planner's drain_timeout_s).")
    rate_mode: Literal["natural", "compress"] = Field("natural", description="How --rate-scale raises the load: natural (s x the trace's own rate curve at the trace's clock; an hour stays an hour) or compress (timestamps divided by the scale: Arrow's method, to compare with the papers).")
    criterion: Literal["work", "requests"] | None = Field(None, description="What goodput counts: work (requests and tokens in time both >= the target, no prompt-length quartile below 80 percent) or requests (the papers' request count alone); unset = work with --rate-mode natural, requests with compress.")
    client_retries: int | None = Field(None, ge=0, description="Times a client sends a refused request (429/503) again, after the gateway's Retry-After, its TTFT counted from the first send (the openai client's max_retries); unset = 2 with --rate-mode natural, 0 with compress.")
    warmup_s: float | None = Field(None, ge=0.0, description="Requests arriving in the first this-many simulated seconds are served but not counted (unset: 0 for one `poise sim` run; for `poise sim goodput` 120 s with --rate-mode natural, at most a fifth of the run, and 0 with compress).")
    seed: int = Field(0, description="Seed of the natural rate mode's added arrivals.")
    slo_ttft_s: float | None = Field(None, gt=0.0, description="TTFT SLO in seconds (unset: the trace's, Arrow Table 1; required for a trace of your own).")
    slo_tpot_s: float | None = Field(None, gt=0.0, description="TPOT SLO in seconds (unset: the trace's; required for a trace of your own).")

    def yardstick(self) -> Yardstick:
        from loadgen.sim.goodput import COMPRESSED, Yardstick

        base = COMPRESSED if self.rate_mode == "compress" else Yardstick()
        warm = base.warmup_s if self.warmup_s is None else self.warmup_s
        return Yardstick(rate_mode=self.rate_mode, warmup_s=warm, seed=self.seed,
                         criterion=self.criterion or base.criterion,
                         client_retries=base.client_retries if self.client_retries is None else self.client_retries)

    def slo_of(self, workload_name: str) -> SLO:
        """--slo-ttft-s/--slo-tpot-s, each falling back to the trace's own SLO; a PoiseError when neither has one."""
        from loadgen.slo import TRACE_SLOS

        known = TRACE_SLOS.get(workload_name)
        ttft = self.slo_ttft_s if self.slo_ttft_s is not None else (known.ttft_s if known else None)
        tpot = self.slo_tpot_s if self.slo_tpot_s is not None else (known.tpot_s if known else None)
        if ttft is None or tpot is None:
            raise PoiseError(f"no SLO known for workload {workload_name!r}: pass --slo-ttft-s and --slo-tpot-s")
        return SLO(ttft_s=ttft, tpot_s=tpot)

    def mix_builder(self, name: str) -> Callable[[], PolicyMix]:
        """A factory of fresh mixes (policies keep state between runs); a bad name or override is a PoiseError."""
        from loadgen.sim.baselines import make_mix

        build = functools.partial(make_mix, name, self.instances, self.split, prefill_policy=self.prefill_policy,
                                  preemption=self.preemption, chunk_tokens=self.chunk, decode_policy=self.decode_policy,
                                  late_binding=self.late_binding, late_binding_depth=self.late_binding_depth,
                                  migration=self.migration, length_predictor=self.length_predictor,
                                  migration_mechanism=self.migration_mechanism, kv_report=self.kv_report,
                                  local_prefill_tokens=self.local_prefill_max_tokens, decode_kv=self.decode_kv,
                                  prefix_cache=self.prefix_cache, early_rejection=self.early_rejection,
                                  drain_by_migration=self.drain_by_migration, give_up_late=self.give_up_late)
        try:
            build()
        except ValueError as exc:
            raise PoiseError(str(exc)) from None
        return build


class SimSettings(SLOClassSettings, _SimFields):
    """Replay a trace against a policy mix in virtual time, with the live system's latency model and policies."""

    model_config = settings_config("POISE_SIM_")


# Not SLO classes (yet): the goodput search in loadgen/sim judges attainment against the trace's one SLO.
class GoodputSettings(_SimFields):
    """Search the goodput (highest rate at which SLO attainment, and attainment at every lower rate tried, is
    >= the target) of several policy mixes on one trace, on the sustained yardstick (loadgen/sim/goodput.py)."""

    model_config = settings_config("POISE_GOODPUT_")

    duration_s: float | None = Field(None, gt=0.0, description="Length of the slice in trace seconds (unset = the whole trace, the yardstick; Arrow used 10 minutes of Mooncake).")
    bisections: int = Field(5, ge=0, description="Bisections between the last passing and the first failing scale (each halves the bracket).")
    probe_above: int = Field(1, ge=0, description="Scales tried past the first failure (x1.25 apart): a pass there flags the curve non-monotone.")
    policies: list[str] = Field(default_factory=lambda: ["colocated", "static-rr", "static-minload", "static-best",
                                                         "dynamo-load", "dynamo-sla"],
                                description="Policy mixes to compare (repeat the flag or give a JSON list); static-best tries every split.")
    target: float = Field(0.9, description="SLO attainment that defines goodput (of requests and, with --criterion work, of tokens).")


def cmd_sim_goodput(argv: list[str]) -> int:
    from loadgen.sim.cluster import SimCosts
    from loadgen.sim.goodput import CurvePoint, search_goodput, static_best
    from loadgen.sim.goodput_report import goodput_table, write_goodput_report
    from services.cli.replay_job import select_workload
    from shared.latency import LatencyModel, load_profile

    settings = parse_settings(GoodputSettings, argv, prog="poise sim goodput")
    workload = select_workload(settings)
    slo = settings.slo_of(workload.name)
    model = LatencyModel(load_profile(settings.profile))
    yardstick = settings.yardstick()
    _print(f"{workload.name}: {len(workload)} requests over {workload.duration_s:.0f} s; {yardstick.describe()}")
    results = []
    for name in settings.policies:
        t0 = time.monotonic()
        costs = SimCosts(start_s=settings.replica_start_s, drain_timeout_s=settings.drain_timeout_s)

        def progress(p: CurvePoint, name: str = name) -> None:
            _print(f"  {name} at {p.rate_scale:.3g}x: {p.attainment:.1%} attainment")

        search: dict[str, Any] = dict(target=settings.target, costs=costs, yardstick=yardstick,
                                      bisections=settings.bisections, probe_above=settings.probe_above,
                                      progress=progress)
        if name == "static-best":
            result = static_best(workload, settings.instances, model, slo, **search)
        else:
            result = search_goodput(workload, settings.mix_builder(name), model, slo, **search)
        _print(f"{name}: goodput {result.goodput_scale:.2f}x ({result.goodput_rps:.2f} req/s), "
               f"{len(result.points)} runs in {time.monotonic() - t0:.1f}s"
               + ("; the curve is not monotone" if result.non_monotone else ""))
        results.append(result)
    out = settings.out_dir or Path(".poise") / "results" / f"goodput-{time.strftime('%Y%m%d-%H%M%S')}"
    command = shlex.join(["poise", "sim", "goodput", *argv])
    paths = write_goodput_report(results, out, trace=workload.name, slo=slo, trace_rps=workload.mean_rate_rps,
                                 command=command)
    print(goodput_table(results, workload.name, slo, workload.mean_rate_rps))
    print(f"report: {paths['md']}  {paths['json']}  {paths['png']}")
    if settings.json_out is not None:
        settings.json_out.parent.mkdir(parents=True, exist_ok=True)
        settings.json_out.write_bytes(paths["json"].read_bytes())
    return 0


def cmd_sim(argv: list[str]) -> int:
    if argv[:1] == ["goodput"]:
        return cmd_sim_goodput(argv[1:])
    from loadgen.report import format_table, write_report
    from loadgen.sim.cluster import SimCosts
    from loadgen.sim.run import simulate
    from services.cli.replay_job import select_workload
    from shared.latency import LatencyModel, load_profile

    # The documented flag is --json; the settings field is json_out (``json`` is taken by pydantic).
    argv = ["--json-out" if a == "--json" else a for a in argv]
    settings = parse_settings(SimSettings, argv, prog="poise sim")
    mix = settings.mix_builder(settings.policy)()
    check_slo_classes(settings)
    workload = select_workload(settings)
    slo = settings.slo_of(workload.name)
    classes = slo_classes(settings, slo)
    if classes is not None:
        workload = classes.assign(workload)
        _print(f"SLO classes: {classes.describe()}")
    yardstick = settings.yardstick()
    result = simulate(workload, mix, LatencyModel(load_profile(settings.profile)), slo, rate_scale=settings.rate_scale,
                      slo_classes=classes, costs=SimCosts(start_s=settings.replica_start_s,
                                                          drain_timeout_s=settings.drain_timeout_s),
                      rate_mode=yardstick.rate_mode, seed=yardstick.seed, client_retries=yardstick.client_retries,
                      warmup_s=0.0 if settings.warmup_s is None else yardstick.warmup_for(workload, settings.rate_scale))
    out = settings.out_dir or Path(".poise") / "results" / f"sim-{time.strftime('%Y%m%d-%H%M%S')}"
    title = f"poise sim: {workload.name}, {mix.description}"
    files = write_report(result, out, title=title, command=shlex.join(["poise", "sim", *argv]), slo=slo,
                         classes=classes)
    print(format_table(result.summary, slo))
    c = result.config
    print(f"\nsimulated {c['requests']} requests ({c['events']} events) in {c['sim_wall_s']:.2f}s wall "
          f"({c['sim_seconds_per_wall_second']:.0f} simulated s per wall s)")
    if c["prefix_cache"] is not None:
        pc = c["prefix_cache"]
        print(f"prefix cache: {pc['hit_rate']:.1%} of {pc['prompt_tokens']:,} prompt tokens served from it")
    if c["retractions"]:
        print(f"decode KV ran out: {c['retractions']} retractions (requests parked until their KV fit again)")
    if c["early_rejections"]:
        print(f"early rejection: {c['early_rejections']} requests refused with a 429 (a backlog would have made "
              f"them late, or they waited out their TTFT target in the gateway or on a colocated engine; counted "
              f"as misses)")
    if mix.controlled:
        lc = c["lifecycle"]
        print(f"control: {lc['flips']} flips, {lc['starts']} starts, {lc['stops']} stops, {lc['migrations']} migrations; "
              f"{lc['gpu_seconds']:.0f} GPU-seconds (budget {len(mix.roles)} x {result.wall_s:.0f} s)")
        from loadgen.sim.timeline_plot import write_timeline_plot

        print(f"provisioning over time: {write_timeline_plot(result, out / 'timeline.png')}")
    print(f"report: {files.md}  {files.json}  {files.png}")
    if settings.json_out is not None:
        settings.json_out.parent.mkdir(parents=True, exist_ok=True)
        document: dict[str, object] = {"summary": result.summary, "config": c, "slo": slo}
        if classes is not None:
            document["slo_classes"] = classes
        settings.json_out.write_bytes(msgspec.json.encode(document))
    return 0


def cmd_admin(argv: list[str]) -> int:
    from services.cli.admin import main as admin_main

    return admin_main(argv)


def cmd_predictor(argv: list[str]) -> int:
    from services.predictor.cli import main as predictor_main

    return predictor_main(argv)


def cmd_profile(argv: list[str]) -> int:
    from services.profiler.cli import cmd_profile as profile_main

    return profile_main(argv)


COMMANDS = {"up": cmd_up, "run": cmd_run, "bench": cmd_bench, "admin": cmd_admin, "sim": cmd_sim,
            "predictor": cmd_predictor, "profile": cmd_profile}


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help") or args[0] not in COMMANDS:
        print(__doc__)
        sys.exit(0 if args and args[0] in ("-h", "--help") else 2)
    try:
        sys.exit(COMMANDS[args[0]](args[1:]))
    except PoiseError as exc:
        print(f"poise: {exc}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
