"""Markdown tables (also what the console shows): measured points against the fitted curve, and the fitted
coefficients against the base profile's."""

from __future__ import annotations

from collections.abc import Sequence

from services.profiler.fit import DecodeFit, PrefillFit
from services.profiler.profile_doc import MEASURED_FIELDS
from services.profiler.samples import DecodeSample, PrefillSample
from shared.latency import LatencyProfile


def _pct(x: float) -> str:
    return f"{x * 100:+.2f}%"


def prefill_table(samples: Sequence[PrefillSample], fit: PrefillFit) -> list[str]:
    lines = [f"| prompt tokens | passes | measured {fit.statistic} (ms) | min..max (ms) | fitted (ms) | fit error |",
             "|---:|---:|---:|---:|---:|---:|"]
    for i, (s, err) in enumerate(zip(samples, fit.stats.rel_errors, strict=True)):
        left_out = " (left out: outlier)" if i in fit.outliers else ""
        lines.append(f"| {s.tokens} | {s.passes} | {s.value_s(fit.statistic) * 1e3:.3f} | {min(s.seconds) * 1e3:.3f}.."
                     f"{max(s.seconds) * 1e3:.3f} | {fit.predict_s(s.tokens, s.passes) * 1e3:.3f} | {_pct(err)}{left_out} |")
    return lines


def decode_table(samples: Sequence[DecodeSample], fit: DecodeFit) -> list[str]:
    lines = ["| batch | prompt tokens | batch context tokens | steps | measured step (ms) | fitted (ms) | fit error |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for i, (s, err) in enumerate(zip(samples, fit.stats.rel_errors, strict=True)):
        left_out = " (left out: outlier)" if i in fit.outliers else ""
        lines.append(f"| {s.batch} | {s.prompt_tokens} | {s.context_tokens:.0f} | {s.steps} | {s.step_s * 1e3:.3f} | "
                     f"{fit.predict_s(s.batch, s.context_tokens) * 1e3:.3f} | {_pct(err)}{left_out} |")
    return lines


SE_WARN = 0.025  # a coefficient whose standard error is above this share of it is "poorly determined"


def _std_errors(prefill: PrefillFit, decode: DecodeFit) -> dict[str, float]:
    return {**prefill.std_errors, **decode.std_errors}


def poorly_determined(profile: LatencyProfile, prefill: PrefillFit, decode: DecodeFit) -> list[str]:
    """Warnings for coefficients the data pin down to worse than ±SE_WARN (one standard error)."""
    out = []
    for f, se in _std_errors(prefill, decode).items():
        value = float(getattr(profile, f, 0.0) or 0.0)
        if f in MEASURED_FIELDS and value > 0 and se / value > SE_WARN:
            out.append(f"{f} is poorly determined (standard error {se / value:.1%}): measure more "
                       + ("prompt lengths or repetitions" if f.startswith("prefill") else
                          "batch sizes, longer contexts (--decode-context-tokens) or more steps"))
    return out


def coefficient_table(profile: LatencyProfile, base: LatencyProfile, prefill: PrefillFit,
                      decode: DecodeFit) -> list[str]:
    errors = _std_errors(prefill, decode)
    lines = [f"| field | fitted | standard error | base ({base.name}) | fitted vs base |", "|---|---:|---:|---:|---:|"]
    for f in MEASURED_FIELDS:
        mine, theirs = float(getattr(profile, f)), float(getattr(base, f))
        diff = _pct(mine / theirs - 1) if theirs else "n/a"
        se = f"±{errors[f] / mine:.2%}" if mine > 0 else "(clamped at 0)"
        lines.append(f"| `{f}` | {mine:.6g} | {se} | {theirs:.6g} | {diff} |")
    return lines


def markdown_report(*, title: str, command: str, notes: Sequence[str], profile: LatencyProfile,
                    base: LatencyProfile, prefill_samples: Sequence[PrefillSample], prefill_fit: PrefillFit,
                    decode_samples: Sequence[DecodeSample], decode_fit: DecodeFit) -> str:
    pf, df = prefill_fit, decode_fit
    out = [f"# {title}", "", f"`{command}`", ""]
    out += [f"- {n}" for n in notes]
    out += ["", "## Coefficients", "", *coefficient_table(profile, base, pf, df), ""]
    out += [f"## Prefill: TTFT vs prompt length (R² {pf.stats.r2:.6f}, RMSE {pf.stats.rmse_s * 1e3:.3f} ms, "
            f"max error {pf.stats.max_rel_error * 100:.2f}%)", ""]
    if pf.separated_request_overhead:
        out += [f"Per-request overhead outside forward passes (not a profile field): "
                f"{pf.request_overhead_s * 1e3:.3f} ms.", ""]
    out += [*prefill_table(prefill_samples, pf), ""]
    out += [f"## Decode: step time vs batch and context (R² {df.stats.r2:.6f}, RMSE {df.stats.rmse_s * 1e3:.4f} ms, "
            f"max error {df.stats.max_rel_error * 100:.2f}%)", "", *decode_table(decode_samples, df), ""]
    return "\n".join(out)
