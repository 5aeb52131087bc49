"""Provisioned instances against the request rate over a simulated run (DOPD's Fig. 10 view).

Written next to the report by ``poise sim`` when the mix changes the cluster (scaling, flips, migrations).
"""

from __future__ import annotations

from pathlib import Path

from loadgen.replay import ReplayResult


def write_timeline_plot(result: ReplayResult, path: Path, *, bin_s: float = 10.0) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lifecycle = result.config["lifecycle"]
    end = max(result.wall_s, bin_s)
    bins = int(end // bin_s) + 1
    counts = [0] * bins
    for r in result.records:
        counts[min(int(r.arrival_s // bin_s), bins - 1)] += 1
    times = [i * bin_s for i in range(bins)]
    steps = [(t, p, d) for t, p, d in lifecycle["timeline"]] + [(end, *lifecycle["timeline"][-1][1:])]

    fig, ax = plt.subplots(figsize=(10, 4))
    ax.step([s[0] for s in steps], [s[1] for s in steps], where="post", label="prefill instances")
    ax.step([s[0] for s in steps], [s[2] for s in steps], where="post", label="decode instances")
    ax.step([s[0] for s in steps], [s[1] + s[2] for s in steps], where="post", color="black", lw=1, label="total")
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("instances provisioned")
    ax.grid(alpha=0.3)
    rate_ax = ax.twinx()
    rate_ax.plot(times, [c / bin_s for c in counts], color="gray", alpha=0.6, lw=1, label=f"arrivals (req/s, {bin_s:g} s bins)")
    rate_ax.set_ylabel("request rate (req/s)")
    handles = ax.get_legend_handles_labels()[0] + rate_ax.get_legend_handles_labels()[0]
    labels = ax.get_legend_handles_labels()[1] + rate_ax.get_legend_handles_labels()[1]
    ax.legend(handles, labels, loc="upper left", fontsize=8)
    c = result.config
    ax.set_title(f"{c['policy']} on {c['trace']} at {c['rate_scale']:g}x: {lifecycle['gpu_seconds']:.0f} GPU-seconds, "
                 f"attainment {result.summary.slo_attainment:.1%}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
