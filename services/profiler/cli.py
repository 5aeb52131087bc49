"""``poise profile --engine URL``: measure a running engine and write a fitted latency profile.

    poise profile --engine http://gpu1:30000 [--out profile.json] [--base-profile NAME|PATH] [--name N]
                  [--gpu G] [--time-scale-hint S] [--timing auto|engine|client] [--prefill-lengths '[...]']
                  [--prefill-repeats 3] [--batch-sizes '[...]'] [--decode-steps 48] ...

Writes ``<out>.json`` (the profile, loadable with ``--profile <out>.json`` by engine_sim, the planner, the
gateway and ``poise sim``), ``<out>.md`` (measured vs fitted tables) and ``<out>.png``. See
services/profiler/README.md for what is measured and how.
"""

from __future__ import annotations

import asyncio
import re
import shlex
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import msgspec
from pydantic import Field

from services.profiler.fit import DecodeFit, PrefillFit, fit_decode, fit_prefill
from services.profiler.plan import ProfilePlan, describe, plan_profile
from services.profiler.plot import write_plot
from services.profiler.profile_doc import MEASURED_FIELDS, base_profile, build_profile, write_profile
from services.profiler.report import markdown_report, poorly_determined
from services.profiler.samples import DecodeSample, PrefillSample
from services.profiler.session import Measurements, measure
from services.profiler.target import EngineTarget, connect
from shared.errors import PoiseError
from shared.latency import LatencyProfile
from shared.settings import ServiceSettings, parse_settings, settings_config


class ProfileSettings(ServiceSettings):
    """Measure a running SGLang-API engine and fit a latency profile (TTFT vs input length, decode step vs batch).

    Only a colocated engine can be profiled alone; see services/profiler/README.md.
    """

    model_config = settings_config("POISE_PROFILE_")

    engine: str | None = Field(None, description="Base URL of the engine to profile (a colocated SGLang server, "
                                                 "--disaggregation-mode null, or engine_sim --mode null).")
    out: Path | None = Field(None, description="Profile JSON to write; the .md table and .png plot go next to it "
                                               "(default .poise/profiles/<name>-<time>.json).")
    name: str | None = Field(None, description="The profile's name (default: <model>-<gpu>-profiled).")
    base_profile: str | None = Field(None, description="Profile (name or JSON path) to copy the fields that cannot be "
                                                       "measured from (default: the profile an engine_sim emulates, "
                                                       "else the default profile).")
    model: str | None = Field(None, description="Model name for the profile (default: the engine's served model).")
    gpu: str | None = Field(None, description="GPU name for the profile (default: engine_sim's, else the base's).")
    time_scale_hint: float | None = Field(None, gt=0, description="The engine's time scale, for an engine_sim that "
                                          "does not report it (measured times are divided by it); a real engine: 1.")
    timing: Literal["auto", "engine", "client"] = Field(
        "auto", description="Prefill clock: engine (meta_info.e2e_latency), client (HTTP round trip), or auto "
                            "(engine when every response has it).")
    prefill_lengths: list[int] = Field(default_factory=list, description="Prompt lengths to prefill (JSON list; "
                                       "default: 16, 128 doubling to --max-prefill-tokens, and past chunk boundaries).")
    max_prefill_tokens: int | None = Field(None, gt=0, description="Longest default prompt (default: 4 chunks, "
                                                                   "capped by context length and KV capacity).")
    prefill_repeats: int = Field(5, ge=1, description="Repetitions per prompt length.")
    prefill_statistic: Literal["min", "median"] = Field(
        "min", description="Which repetition of each length the fit takes: min (the fastest: noise only adds time) "
                           "or median.")
    batch_sizes: list[int] = Field(default_factory=list, description="Decode batch sizes (JSON list; default 1, 4, 16, "
                                   "64, ... up to --max-batch).")
    max_batch: int = Field(256, ge=1, description="Largest default decode batch (also capped by max_running_requests).")
    decode_short_prompt: int = Field(32, ge=1, description="Prompt tokens per request of the short-context runs.")
    decode_context_tokens: int = Field(65536, ge=1, description="Context tokens of a whole batch in the long-context "
                                                                "runs (per request at most --decode-max-prompt).")
    decode_max_prompt: int = Field(8192, ge=1, description="Longest prompt per request in the long-context runs.")
    decode_steps: int = Field(48, ge=8, description="Decode steps measured per experiment once the batch is whole.")
    decode_segments: int = Field(4, ge=1, description="Samples per experiment (context grows along the window).")
    seed: int = Field(0, description="Seed of the random prompt token ids and orders.")
    timeout_s: float = Field(30.0, gt=0, description="Timeout of control requests (/server_info, /v1/loads, aborts).")
    api_key: str | None = Field(None, description="The engine's --api-key, sent as a bearer token on every request "
                                                  "(POISE_PROFILE_API_KEY keeps it out of the process list).")
    plot: bool = Field(True, description="Write the PNG plot.")


def _print(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", text.lower().rsplit("/", 1)[-1]).strip("-") or "engine"


def _without_secret(value: Any, secret: str | None) -> Any:
    """``value`` with ``secret`` masked in every string: the profile records its command line and SGLang's
    /server_info (its server args, the API key among them), and the profile is a file people share."""
    if not secret:
        return value
    if isinstance(value, str):
        return value.replace(secret, "***")
    if isinstance(value, dict):
        return {k: _without_secret(v, secret) for k, v in value.items()}
    if isinstance(value, list):
        return [_without_secret(v, secret) for v in value]
    return value


def _labels(settings: ProfileSettings, target: EngineTarget) -> dict[str, tuple[str, str]]:
    """The profile's model and GPU names, each with where it came from (absent: keep the base profile's)."""
    out: dict[str, tuple[str, str]] = {}
    if settings.model:
        out["model"] = (settings.model, "--model")
    elif target.model:
        out["model"] = (target.model, "engine served_model_name")
    engine_gpu = (target.gpu_profile or {}).get("gpu")
    if settings.gpu:
        out["gpu"] = (settings.gpu, "--gpu")
    elif isinstance(engine_gpu, str) and engine_gpu:
        out["gpu"] = (engine_gpu, "engine gpu_profile")
    return out


def _fit(measured: Measurements, settings: ProfileSettings,
         target: EngineTarget) -> tuple[list[PrefillSample], PrefillFit, str, DecodeFit]:
    prefill_samples, clock = measured.prefill.samples(settings.timing, target.chunked_prefill_size)
    try:
        return (prefill_samples, fit_prefill(prefill_samples, settings.prefill_statistic), clock,
                fit_decode(measured.decode))
    except ValueError as exc:
        raise PoiseError(f"cannot fit: {exc}") from exc


def _provenance(*, target: EngineTarget, command: str, when: str, plan: ProfilePlan, clock: str, pf: PrefillFit,
                df: DecodeFit, decode: list[DecodeSample], base: LatencyProfile, base_why: str,
                sources: dict[str, str]) -> list[str]:
    copied = sorted(f for f, s in sources.items() if s.startswith("base:"))
    ctx_sources = sorted({s.context_source for s in decode})
    lines = [
        f"Measured by `{command}` against {target.url} on {when}"
        + (f" (engine_sim emulating {target.gpu_profile.get('name')})" if target.is_engine_sim and target.gpu_profile
           else "") + ".",
        f"prefill_*: TTFT of fresh token-id prompts of {len(plan.prefill_lengths)} lengths "
        f"({plan.prefill_lengths[0]}..{plan.prefill_lengths[-1]}), each alone on the idle colocated engine with "
        f"max_new_tokens=1, {plan.prefill_repeats} repetitions ({pf.statistic} fitted), {clock} clock; least squares "
        + ("c0 + o*passes + a*n + b*n^2" if pf.separated_request_overhead else "o + a*n + b*n^2")
        + f" (R^2 {pf.stats.r2:.5f}, max error {pf.stats.max_rel_error * 100:.2f}%"
        + (f", {len(pf.outliers)} of {pf.stats.points} lengths left out as outliers" if pf.outliers else "") + ").",
        f"decode_*: step time = mean gap between one streamed request's tokens while the whole batch ran, "
        f"batches {sorted({s.batch for s in decode})}, context from {', '.join(ctx_sources)}; least squares "
        f"d0 + d1*batch + d2*context (R^2 {df.stats.r2:.5f}, max error {df.stats.max_rel_error * 100:.2f}%"
        f"{f', {len(df.outliers)} of {len(decode)} samples left out as outliers' if df.outliers else ''}).",
        f"Times are divided by the engine's time scale {target.time_scale:g} ({target.time_scale_source}).",
    ]
    if pf.separated_request_overhead:
        lines.append(f"Per-request overhead outside forward passes, {pf.request_overhead_s * 1e3:.3f} ms, is not "
                     "in the profile (the latency model has no field for it).")
    lines.append("From the engine's /server_info: " + ", ".join(
        sorted(f for f, s in sources.items() if s == "server_info")) + ".")
    lines.append(f"Copied from base profile {base.name} ({base_why}), not measurable over HTTP on one colocated "
                 f"engine: {', '.join(copied)}.")
    return lines


def _plan(target: EngineTarget, settings: ProfileSettings) -> ProfilePlan:
    """The experiments to run on ``target`` (the settings' lengths and batch sizes, within what it can take)."""
    try:
        return plan_profile(
            target, prefill_lengths=settings.prefill_lengths or None, prefill_repeats=settings.prefill_repeats,
            max_prefill_tokens=settings.max_prefill_tokens, batch_sizes=settings.batch_sizes or None,
            max_batch=settings.max_batch, decode_short_prompt=settings.decode_short_prompt,
            decode_context_tokens=settings.decode_context_tokens, decode_max_prompt=settings.decode_max_prompt,
            decode_steps=settings.decode_steps, decode_segments=settings.decode_segments)
    except ValueError as exc:
        raise PoiseError(str(exc)) from exc


def _name_and_path(settings: ProfileSettings, labels: dict[str, tuple[str, str]],
                   base: LatencyProfile) -> tuple[str, Path]:
    """The profile's name (given, or model-gpu-profiled) and the JSON file it goes to."""
    model = labels["model"][0] if "model" in labels else base.model
    gpu = labels["gpu"][0] if "gpu" in labels else base.gpu
    name = settings.name or f"{_slug(model)}-{_slug(gpu)}-profiled"
    out = settings.out or Path(".poise") / "profiles" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    return name, out if out.suffix == ".json" else out.with_suffix(".json")


def cmd_profile(argv: list[str]) -> int:
    """The ``poise profile`` subcommand (services/cli/main.py's COMMANDS calls it); raises PoiseError."""
    settings = parse_settings(ProfileSettings, argv, prog="poise profile")
    if not settings.engine:
        raise PoiseError("pass --engine URL (the HTTP address of a colocated SGLang server or engine_sim)")
    command = shlex.join(["poise", "profile", *_without_secret(argv, settings.api_key)])
    target = connect(settings.engine, time_scale_hint=settings.time_scale_hint, timeout_s=settings.timeout_s,
                     api_key=settings.api_key)
    base, base_why = base_profile(target, settings.base_profile)
    plan = _plan(target, settings)
    kind = "engine_sim" if target.is_engine_sim else "SGLang"
    _print(f"profiling {target.url} ({kind}, model {target.model}, KV {target.kv_capacity_tokens} tokens, "
           f"chunk {target.chunked_prefill_size or 'none'}, time scale {target.time_scale:g} from "
           f"{target.time_scale_source})")
    _print(f"plan: {describe(plan)}")
    for line in plan.skipped:
        _print(f"skipped: {line}")
    t0 = time.monotonic()
    measured = asyncio.run(measure(target, plan, seed=settings.seed, progress=_print, timeout_s=settings.timeout_s,
                                   api_key=settings.api_key))
    elapsed = time.monotonic() - t0
    prefill_samples, pf, clock, df = _fit(measured, settings, target)

    when = datetime.now(UTC).replace(microsecond=0).isoformat()
    labels = _labels(settings, target)
    name, out = _name_and_path(settings, labels, base)
    provisional, sources = build_profile(base, pf, df, target, name=name, labels=labels, provenance=[])
    provenance = _provenance(target=target, command=command, when=when, plan=plan, clock=clock, pf=pf, df=df,
                             decode=measured.decode, base=base, base_why=base_why, sources=sources)
    profile = msgspec.structs.replace(provisional, provenance=provenance)
    profiling: dict[str, Any] = {
        "schema": "poise.v1.profiling",
        "engine_url": target.url,
        "measured_at": when,
        "command": command,
        "wall_s": round(elapsed, 1),
        "time_scale": target.time_scale,
        "time_scale_source": target.time_scale_source,
        "prefill_clock": clock,
        "base_profile": base.name,
        "base_profile_chosen_by": base_why,
        "fields": sources,
        "measured_fields": list(MEASURED_FIELDS),
        "prefill": {"fit": msgspec.to_builtins(pf), "samples": msgspec.to_builtins(prefill_samples),
                    "repeats": plan.prefill_repeats},
        "decode": {"fit": msgspec.to_builtins(df), "samples": msgspec.to_builtins(measured.decode),
                   "experiments": measured.decode_summaries, "steps": plan.decode_steps},
        "skipped": plan.skipped,
        "server_info": _without_secret(target.server_info, settings.api_key),
    }
    clamped = [name for name in pf.clamped + df.clamped if name != "request"]  # c0 is not a profile field
    warnings = poorly_determined(profile, pf, df) + [f"{name} came out negative and was fixed at 0" for name in clamped]
    profiling["warnings"] = warnings
    write_profile(profile, profiling, out)
    for line in warnings:
        _print(f"warning: {line}")
    notes = [*(f"**warning:** {w}" for w in warnings),f"engine {target.url} ({kind}), measured {when} in {elapsed:.0f} s",
             f"times divided by time scale {target.time_scale:g} ({target.time_scale_source}); prefill clock: {clock}",
             f"base profile for unmeasured fields: {base.name} ({base_why})"]
    report = markdown_report(title=f"Latency profile {name}", command=command, notes=notes, profile=profile, base=base,
                             prefill_samples=prefill_samples, prefill_fit=pf, decode_samples=measured.decode,
                             decode_fit=df)
    md = out.with_suffix(".md")
    md.write_text(report + "\n")
    files = [str(out), str(md)]
    if settings.plot:
        files.append(str(write_plot(out.with_suffix(".png"), title=f"{name} ({target.url})",
                                    prefill_samples=prefill_samples, prefill_fit=pf,
                                    chunk=target.chunked_prefill_size, decode_samples=measured.decode,
                                    decode_fit=df)))
    print(report)
    print(f"profile: {'  '.join(files)}")
    print(f"use it: --profile {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m services.profiler``: cmd_profile with errors printed as one line."""
    try:
        return cmd_profile(sys.argv[1:] if argv is None else argv)
    except PoiseError as exc:
        print(f"poise profile: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
