"""Benchmark reports: the files a replay leaves behind for people and for audits.

Owns `write_report` (``report.json`` with every record, ``report.md`` with the
headline table, ``report.png`` with latency CDFs and load over time) and
`format_table` (the same headline table for a terminal). The JSON holds the raw
records so every number in the table can be recomputed from it. With SLO
classes, both also show a per-class attainment table.
"""

from __future__ import annotations

import math
import shlex
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from loadgen.metrics import Summary, summarize
from loadgen.slo import SLO, SLOClasses

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from loadgen.replay import ReplayResult


@dataclass(frozen=True, slots=True)
class ReportFiles:
    """Paths of the three report files."""

    json: Path
    md: Path
    png: Path


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def _pct(value: float) -> str:
    return f"{value * 100:.1f} %"


def _markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Rows padded to their columns' widths, so the Markdown also reads as a plain-text table."""
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows, strict=True)]
    lines = [
        "| " + " | ".join(cell.ljust(width) for cell, width in zip(header, widths, strict=True)) + " |",
        "|" + "|".join("-" * (width + 2) for width in widths) + "|",
    ]
    lines += ["| " + " | ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)) + " |" for row in rows]
    return lines


def format_class_table(summary: Summary) -> str:
    """Attainment per SLO class as a Markdown table; empty string when the run had no classes."""
    if not summary.per_class:
        return ""
    header = ("SLO class", "Requests", "OK", "TTFT / TPOT SLO (ms)", "SLO attainment", "TTFT-only / TPOT-only",
              "TTFT P90 (ms)", "TPOT P90 (ms)")
    rows = [
        (
            name,
            f"{c.requests}",
            f"{c.ok}",
            f"{c.slo_ttft_s * 1000:g} / {c.slo_tpot_s * 1000:g}",
            _pct(c.attainment) if c.requests else "-",  # no requests: no attainment, not 0%
            f"{_pct(c.ttft_attainment)} / {_pct(c.tpot_attainment)}" if c.requests else "-",
            _ms(c.ttft_p90_s),
            _ms(c.tpot_p90_s),
        )
        for name, c in summary.per_class.items()
    ]
    return "\n".join(_markdown_table(header, rows))


def format_table(summary: Summary, slo: SLO | None = None) -> str:
    """The headline results as a Markdown table (readable as plain text too).

    ``slo`` only labels the attainment row; the numbers come from ``summary``,
    which already carries the SLO it was computed with (the default label).
    With SLO classes the attainment row says each request was judged against
    its class, and the per-class table (`format_class_table`) follows.
    """
    slo = slo or SLO(ttft_s=summary.slo_ttft_s, tpot_s=summary.slo_tpot_s)
    s = summary
    attainment_label = f"SLO attainment (TTFT <= {slo.ttft_s * 1000:g} ms and TPOT <= {slo.tpot_s * 1000:g} ms)"
    if s.per_class:
        attainment_label = "SLO attainment (each request against its class's SLO)"
    rows = [
        ("Requests", f"{s.requests_total}"),
        ("OK / failed", f"{s.requests_ok} / {s.requests_failed}"),
        ("TTFT P50 / P90 / P99 (ms)", f"{_ms(s.ttft_p50_s)} / {_ms(s.ttft_p90_s)} / {_ms(s.ttft_p99_s)}"),
        ("TPOT P50 / P90 / P99 (ms)", f"{_ms(s.tpot_p50_s)} / {_ms(s.tpot_p90_s)} / {_ms(s.tpot_p99_s)}"),
        ("E2E P50 / P90 / P99 (ms)", f"{_ms(s.e2e_p50_s)} / {_ms(s.e2e_p90_s)} / {_ms(s.e2e_p99_s)}"),
        (attainment_label, _pct(s.slo_attainment)),
        ("TTFT-only / TPOT-only attainment", f"{_pct(s.ttft_attainment)} / {_pct(s.tpot_attainment)}"),
        ("Tokens in SLO (prompt + output)", _pct(s.token_attainment)),
        ("Refused (429/503): requests / tokens", f"{_pct(s.refused_share)} / {_pct(s.refused_token_share)}"),
        ("Served late", _pct(s.late_share)),
        ("In SLO by prompt-length quartile", " / ".join(_pct(q) for q in s.quartile_attainment) or "-"),
        ("Throughput (req/s)", f"{s.throughput_rps:.2f}"),
        ("Output throughput (tok/s)", f"{s.output_tokens_per_s:.1f}"),
        ("Input / output tokens", f"{s.input_tokens_total} / {s.output_tokens_total}"),
        ("Output-length mismatches", f"{s.token_mismatches}"),
        ("Send lateness P99 / max (ms)", f"{_ms(s.lateness_p99_s)} / {_ms(s.lateness_max_s)}"),
        ("Wall time (s)", f"{s.wall_s:.1f}"),
    ]
    width = max(len(name) for name, _ in rows)
    value_width = max(len(value) for _, value in rows)
    lines = [
        f"| {'Metric'.ljust(width)} | {'Value'.ljust(value_width)} |",
        f"|{'-' * (width + 2)}|{'-' * (value_width + 2)}|",
    ]
    lines += [f"| {name.ljust(width)} | {value.ljust(value_width)} |" for name, value in rows]
    if s.per_class:
        lines += ["", format_class_table(s)]
    return "\n".join(lines)


def _command_text(command: str | Sequence[str] | None) -> str | None:
    if command is None or isinstance(command, str):
        return command
    return shlex.join(command)


def _markdown(result: ReplayResult, summary: Summary, slo: SLO, title: str, command: str | None,
              extra: str | None = None) -> str:
    config = result.config
    lines = [f"# {title}", ""]
    lines.append(f"Started {result.started_at}, wall time {result.wall_s:.1f} s.")
    if config:
        lines.append("")
        lines += [f"- {key}: `{value}`" for key, value in config.items()]
    if command:
        lines += ["", "```", command, "```"]
    lines += ["", format_table(summary, slo), ""]
    if extra:
        lines += [extra.rstrip("\n"), ""]
    errors = Counter(r.error or "?" for r in result.records if not r.ok)
    if errors:
        lines += ["## Errors", "", "| Count | Error |", "|---|---|"]
        for message, count in errors.most_common(10):
            text = message.replace("|", "\\|").replace("\n", " ")[:300]
            lines.append(f"| {count} | {text} |")
        lines.append("")
    lines += ["![latency and load](report.png)", ""]
    return "\n".join(lines)


def _cdf(ax: Axes, values: list[float], limit_s: float, label: str) -> None:
    ax.set_xlabel(f"{label} (ms)")
    ax.set_ylabel("fraction of OK requests")
    ax.set_title(f"{label} CDF")
    if values:
        ordered = sorted(v * 1000 for v in values)
        n = len(ordered)
        ax.step(ordered, [(i + 1) / n for i in range(n)], where="post", label=f"n={n}")
    else:
        ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center")
    ax.axvline(limit_s * 1000, color="red", linestyle="--", label=f"SLO {limit_s * 1000:g} ms")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")


def _rates(times: list[float], start: float, width: float, bins: int) -> list[float]:
    counts = [0] * bins
    for t in times:
        counts[min(bins - 1, max(0, int((t - start) / width)))] += 1
    return [c / width for c in counts]


def _plot(result: ReplayResult, slo: SLO, title: str, path: Path) -> None:
    """Render the 2x2 figure without pyplot, so no global backend state is touched."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    records = result.records
    ok = [r for r in records if r.ok]
    fig = Figure(figsize=(13, 9), layout="constrained")
    FigureCanvasAgg(fig)
    (ttft_ax, tpot_ax), (time_ax, rate_ax) = fig.subplots(2, 2)
    _cdf(ttft_ax, [t for t in (r.ttft_s for r in ok) if t is not None], slo.ttft_s, "TTFT")
    _cdf(tpot_ax, [r.tpot_s for r in ok if r.output_tokens_received >= 2], slo.tpot_s, "TPOT")

    with_ttft = [r for r in ok if r.ttft_s is not None]
    time_ax.scatter([r.arrival_s for r in with_ttft], [(r.ttft_s or 0.0) * 1000 for r in with_ttft], s=4, label="OK")
    failed = [r for r in records if not r.ok]
    if failed:
        top = max([(r.ttft_s or 0.0) * 1000 for r in with_ttft] + [slo.ttft_s * 1000])
        time_ax.scatter(
            [r.arrival_s for r in failed], [top] * len(failed), s=12, marker="x", color="black", label="failed"
        )
    time_ax.axhline(slo.ttft_s * 1000, color="red", linestyle="--", label="TTFT SLO")
    time_ax.set_xlabel("scheduled arrival (s)")
    time_ax.set_ylabel("TTFT (ms)")
    time_ax.set_title("TTFT per request over the run")
    time_ax.grid(alpha=0.3)
    time_ax.legend(loc="best")

    if records:
        end = max(max(r.finished_s for r in records), max(r.sent_s for r in records))
        span = max(end, 1e-3)
        bins = max(1, min(120, math.ceil(span)))
        width = span / bins
        centers = [(i + 0.5) * width for i in range(bins)]
        rate_ax.plot(centers, _rates([r.sent_s for r in records], 0.0, width, bins), label="sent")
        rate_ax.plot(centers, _rates([r.finished_s for r in ok], 0.0, width, bins), label="completed OK")
        if failed:
            rate_ax.plot(centers, _rates([r.finished_s for r in failed], 0.0, width, bins), label="failed")
        rate_ax.set_title(f"Requests/s ({width:.3g} s bins)")
        rate_ax.legend(loc="upper left")
    else:
        rate_ax.text(0.5, 0.5, "no data", transform=rate_ax.transAxes, ha="center")
        rate_ax.set_title("Requests/s")
    rate_ax.set_xlabel("time since start (s)")
    rate_ax.set_ylabel("requests/s")
    rate_ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.savefig(path, dpi=110)


def write_report(
    result: ReplayResult,
    out_dir: str | Path,
    *,
    title: str,
    command: str | Sequence[str] | None = None,
    slo: SLO | None = None,
    classes: SLOClasses | None = None,
    extra_markdown: str | None = None,
) -> ReportFiles:
    """Write ``report.json``, ``report.md`` and ``report.png`` into ``out_dir`` (created).

    With ``slo`` or ``classes`` given the summary is recomputed against them
    (over the records it counted: a simulated warm-up stays out), so one run can
    be judged under another workload's targets or another class set; otherwise
    the run's own summary is used. ``classes`` judges each record by its
    ``slo_class`` and adds the per-class table (and the classes, under
    ``slo_classes``, to the JSON). ``command`` (a string or
    argv list) is recorded so the run can be reproduced. ``extra_markdown`` goes into ``report.md`` right
    after the table (``poise run``'s split over time, `loadgen.split_compare`).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if slo is None and classes is None:
        summary = result.summary
        slo = SLO(ttft_s=summary.slo_ttft_s, tpot_s=summary.slo_tpot_s)
    else:
        slo = slo or SLO(ttft_s=result.summary.slo_ttft_s, tpot_s=result.summary.slo_tpot_s)
        counted, span = result.counted()
        summary = summarize(counted, slo, span, classes)
    command_text = _command_text(command)
    files = ReportFiles(json=out / "report.json", md=out / "report.md", png=out / "report.png")
    document: dict[str, Any] = {
        "title": title,
        "command": command_text,
        "started_at": result.started_at,
        "wall_s": result.wall_s,
        "config": result.config,
        "slo": slo,
    }
    if classes is not None:  # only then, so a run without classes writes the same keys as before
        document["slo_classes"] = classes
    document["summary"] = summary
    document["records"] = result.records
    files.json.write_bytes(msgspec.json.encode(document))
    files.md.write_text(_markdown(result, summary, slo, title, command_text, extra_markdown), encoding="utf-8")
    _plot(result, slo, title, files.png)
    return files
