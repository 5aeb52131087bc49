"""The P:D split over a live run, next to what the simulator says a fixed split would have done.

``poise run`` records the live stack's split while it replays (``services/cli/split_watch.py`` polls the
registry through the monitor and listens to the planner's events), then replays the same slice, at the same
rate scale (``compress``: timestamps divided, as the live replay does), through the simulator for a few
policy mixes (`comparison_mixes`). `write_split_comparison` draws them in one PNG, SLO attainment over time
above the split over time, and returns the Markdown line the report gets. Live curves are solid and say
"live"; simulated ones are dashed and say "simulated": the simulator is the same latency model and policy
objects, not the stack, so the two differ by whatever the stack adds (processes, the network, this machine).

The time axis is seconds since the replay started: the live replay sends request ``i`` at its rate-scaled
arrival time, and the simulator's clock starts at the same scaled arrival times, so both share it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from loadgen.records import RequestRecord
from loadgen.replay import ReplayResult
from loadgen.slo import SLO, SLOClasses
from shared.policies.flip import is_restart

if TYPE_CHECKING:  # the simulator is imported only when a comparison runs
    from loadgen.sim.baselines import PolicyMix


@dataclass(frozen=True)
class SplitSample:
    """The live stack's instances at one moment: ready prefill, ready decode, flipping (draining or
    switching) and ready colocated instances."""

    t_s: float
    prefill: int
    decode: int
    flipping: int = 0
    colocated: int = 0


@dataclass(frozen=True)
class FlipEvent:
    """One of the planner's flip events (``PlannerEvent`` kinds flip_requested, flip_done, flip_failed)."""

    t_s: float
    kind: str
    instance_id: str
    from_role: str | None
    to_role: str | None
    source: str | None = None
    reason: str = ""


@dataclass
class LiveSplit:
    """What the live stack's split did during the replay, in seconds since the replay started."""

    samples: list[SplitSample]
    flips: list[FlipEvent]
    # The planner's decision latency at the end of the run (services/planner/decider.py ``stats``), if it answered.
    decision_latency: dict[str, Any] | None = None

    @classmethod
    def from_unix(cls, samples: Sequence[tuple[float, ...]], events: Sequence[dict[str, Any]],
                  started_at: str, decision_latency: dict[str, Any] | None = None) -> LiveSplit:
        """Samples ``(unix_s, prefill, decode, flipping[, colocated])`` and planner events (``PlannerEvent`` as dicts) on
        the replay's clock (``ReplayResult.started_at``, ISO 8601). Earlier samples clamp to 0: the split the
        replay started with."""
        t0 = datetime.fromisoformat(started_at).timestamp()
        out = [SplitSample(max(0.0, ts - t0), *(int(n) for n in counts)) for ts, *counts in sorted(samples)]
        # Only the newest sample at or before the start describes the split at 0.
        before = [s for s in out if s.t_s == 0.0]
        out = before[-1:] + [s for s in out if s.t_s > 0.0]
        flips = [FlipEvent(t_s=e["ts_unix_s"] - t0, kind=e["kind"], instance_id=e.get("instance_id") or "?",
                           from_role=e.get("from_role"), to_role=e.get("to_role"), source=e.get("source"),
                           reason=e.get("reason") or "")
                 for e in events if str(e.get("kind", "")).startswith("flip_")]
        return cls(samples=out, flips=sorted(flips, key=lambda f: f.t_s), decision_latency=decision_latency)

    def steps(self) -> list[SplitSample]:
        """The samples where the split changed (and the first one)."""
        out: list[SplitSample] = []
        for s in self.samples:
            if not out or (s.prefill, s.decode, s.flipping, s.colocated) != \
                    (out[-1].prefill, out[-1].decode, out[-1].flipping, out[-1].colocated):
                out.append(s)
        return out

    def done_flips(self) -> list[FlipEvent]:
        return [f for f in self.flips if f.kind == "flip_done" and f.t_s >= 0.0]


@dataclass(frozen=True)
class SimRun:
    """One simulated run of the comparison: its key, its plot label and the result."""

    key: str
    label: str
    result: ReplayResult

    @property
    def flips(self) -> int:
        return int(self.result.config.get("lifecycle", {}).get("flips", 0))

    def flip_times(self) -> list[float]:
        """When the simulated split changed (the lifecycle timeline's steps after the first)."""
        timeline = self.result.config.get("lifecycle", {}).get("timeline", [])
        return [float(t) for t, *_ in timeline[1:]]


# --- Attainment over time ----------------------------------------------------------------------------------------


def meets_slo(record: RequestRecord, slo: SLO, classes: SLOClasses | None = None) -> bool:
    """The summary's rule (`loadgen.metrics.summarize`): succeeded, TTFT and TPOT within the request's SLO."""
    if not record.ok or record.ttft_s is None:
        return False
    target = classes.slo_of(record.slo_class) if classes is not None and record.slo_class is not None else slo
    return record.ttft_s <= target.ttft_s and record.tpot_s <= target.tpot_s


def auto_bin_s(span_s: float) -> float:
    """About 20 bins over the run, in whole 5-s steps (at least 5 s)."""
    return max(5.0, 5.0 * math.ceil(span_s / 20.0 / 5.0))


def attainment_over_time(records: Sequence[RequestRecord], slo: SLO, bin_s: float, *,
                         classes: SLOClasses | None = None) -> list[tuple[float, float, int]]:
    """``(bin centre s, attainment, requests)`` per ``bin_s`` of scheduled arrival; empty bins are left out.
    Failed requests count as misses, as in the summary."""
    bins: dict[int, list[int]] = {}
    for r in records:
        hit_total = bins.setdefault(int(r.arrival_s // bin_s), [0, 0])
        hit_total[0] += meets_slo(r, slo, classes)
        hit_total[1] += 1
    return [((i + 0.5) * bin_s, hits / total, total) for i, (hits, total) in sorted(bins.items())]


def mean_input_over_time(records: Sequence[RequestRecord], bin_s: float) -> list[tuple[float, float]]:
    """``(bin centre s, mean prompt tokens)`` per bin: what moves the best split on a mix-shift workload."""
    bins: dict[int, list[int]] = {}
    for r in records:
        acc = bins.setdefault(int(r.arrival_s // bin_s), [0, 0])
        acc[0] += r.input_tokens
        acc[1] += 1
    return [((i + 0.5) * bin_s, tokens / n) for i, (tokens, n) in sorted(bins.items())]


# --- The simulated comparison ------------------------------------------------------------------------------------


def without_pools(mix: PolicyMix, *, name: str, description: str) -> PolicyMix:
    """``mix`` with its pool policy left out: the same engines, dispatch and local prefill at a fixed split."""
    bind = mix.bind

    def bound(model: Any, ctx: Any) -> dict[str, Any]:
        return {k: v for k, v in (bind(model, ctx) if bind is not None else {}).items() if k != "pools"}

    return dataclasses.replace(mix, name=name, description=description, pools=None,
                               bind=bound if bind is not None else None)


def comparison_mixes(instances: int, split: str, *, engine: dict[str, Any] | None = None,
                     local_prefill_tokens: int | None = None) -> list[tuple[str, str, Callable[[], PolicyMix]]]:
    """``(key, label, build)`` of the simulated runs next to a live run that started at ``split``:

    - ``poise``: the controller (the ``poise`` mix, with ``engine`` overrides: make_mix's prefill_policy,
      preemption, chunk_tokens, decode_policy, migration, migration_mechanism, early_rejection, late_binding
      (+ late_binding_depth); and
      ``local_prefill_tokens``, as
      the live stack ran it);
    - ``fixed``: the same mix with the controller off, so the split stays ``split``: what the controller bought;
    - ``static``: ``static-minload`` at ``split``, least-load dispatch and stock FCFS engines: what
      ``poise run --planner-policy static`` runs.
    """
    from loadgen.sim.baselines import make_mix

    overrides = dict(engine or {})

    def poise() -> PolicyMix:
        return make_mix("poise", instances, split, local_prefill_tokens=local_prefill_tokens, **overrides)

    def fixed() -> PolicyMix:
        mix = poise()
        return without_pools(mix, name="poise-fixed", description=f"{split} fixed: the poise mix's engines, dispatch, "
                                                                  f"gateway rules and local prefill, no flips")

    def static() -> PolicyMix:
        return make_mix("static-minload", instances, split)

    return [("poise", "poise (simulated)", poise),
            ("fixed", f"{split} fixed, poise's engines and dispatch (simulated)", fixed),
            ("static", f"static-minload {split}, --planner-policy static (simulated)", static)]


def simulate_comparison(workload: Any, mixes: Sequence[tuple[str, str, Callable[[], PolicyMix]]], *, profile: str,
                        slo: SLO, rate_scale: float, classes: SLOClasses | None = None,
                        restart_s: float | None = None, client_retries: int = 0) -> list[SimRun]:
    """Run ``workload`` through every mix in virtual time, timestamps divided by ``rate_scale`` as the live
    replay divides them (``rate_mode="compress"``), judged by the live run's SLO (and classes). ``restart_s``:
    what an engine restart costs (a move into or out of colocated serving), as the live stack's took; None:
    the simulator's default, an SGLang engine's. ``client_retries``: as the live replay's clients retried."""
    from loadgen.sim.cluster import SimCosts
    from loadgen.sim.run import simulate
    from shared.latency import LatencyModel, load_profile

    model = LatencyModel(load_profile(profile))
    costs = SimCosts(start_s=restart_s) if restart_s is not None else None
    return [SimRun(key, label, simulate(workload, build(), model, slo, rate_scale=rate_scale, rate_mode="compress",
                                        slo_classes=classes, costs=costs, client_retries=client_retries))
            for key, label, build in mixes]


def live_restart_s(events: Sequence[dict[str, Any]]) -> float | None:
    """The median command-to-done time of the live planner's moves into or out of colocated serving (engine
    restarts), from its events; None when there were none."""
    took = sorted(float(e["duration_s"]) for e in events
                  if e.get("kind") == "flip_done" and e.get("duration_s") is not None
                  and e.get("from_role") and e.get("to_role") and is_restart(e["from_role"], e["to_role"]))
    return took[len(took) // 2] if took else None


# --- The figure and the report's line ----------------------------------------------------------------------------


def _fmt_flip(f: FlipEvent) -> str:
    return f"{f.instance_id} {f.from_role or '?'} -> {f.to_role or '?'} at {f.t_s:.0f} s"


def comparison_markdown(live: ReplayResult, live_split: LiveSplit | None, sims: Sequence[SimRun], *,
                        rate_scale: float, png_name: str = "split.png") -> str:
    """The report's section: both attainments in one line each, the flips, and the figure."""
    attainment = live.summary.slo_attainment
    lines = ["## The P:D split over time", ""]
    if live_split is not None:
        done = live_split.done_flips()
        failed = [f for f in live_split.flips if f.kind == "flip_failed"]
        start = live_split.samples[0] if live_split.samples else None
        begun = f"started {start.prefill}P{start.decode}D, " if start is not None else ""
        flips = (f"{len(done)} flip(s): {'; '.join(_fmt_flip(f) for f in done)}" if done
                 else "no flips")
        if failed:
            flips += f"; {len(failed)} failed"
        lines.append(f"**Live** (this run): SLO attainment {attainment:.1%}; {begun}{flips}.")
        if live_split.decision_latency is not None:
            lines += ["", _decisions_line(live_split.decision_latency)]
    else:
        lines.append(f"**Live** (this run): SLO attainment {attainment:.1%}; the split was not recorded.")
    if sims:
        parts = []
        for s in sims:
            what = f"{s.result.summary.slo_attainment:.1%}"
            if s.flips:
                what += f" ({s.flips} flip(s), at {', '.join(f'{t:.0f}' for t in s.flip_times())} s)"
            parts.append(f"{s.label.removesuffix(' (simulated)')} {what}")
        lines += ["", f"**Simulated** (same slice at {rate_scale:g}x, timestamps divided as live; same latency model "
                      f"and policies, not the stack): " + "; ".join(parts) + "."]
    lines += ["", f"![split over time, live and simulated]({png_name})", ""]
    return "\n".join(lines)


def _decisions_line(lat: dict[str, Any]) -> str:
    if not lat.get("window"):
        return f"**Planner decisions**: {lat.get('decisions', 0)}, none timed."
    return (f"**Planner decisions**: {lat['decisions']}; over the latest {lat['window']} p50 {lat['p50_ms']:.2f} ms, "
            f"p99 {lat['p99_ms']:.2f} ms, max {lat['max_ms']:.2f} ms (wall time on the planner's decider thread; "
            f"CPU p99 {lat['cpu_p99_ms']:.2f} ms).")


def plot_split_comparison(live: ReplayResult, live_split: LiveSplit | None, sims: Sequence[SimRun], slo: SLO,
                          path: Path, *, title: str, classes: SLOClasses | None = None,
                          bin_s: float | None = None) -> Path:
    """Attainment per time bin (live solid, simulated dashed) above the prefill/decode counts over time (live
    from the registry, the simulated controller's from its lifecycle), with the mean prompt length behind."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    span = max([live.wall_s, *(s.result.wall_s for s in sims), 1.0])
    width = bin_s or auto_bin_s(span)
    fig = Figure(figsize=(12, 8), layout="constrained")
    FigureCanvasAgg(fig)
    att_ax, split_ax = fig.subplots(2, 1, sharex=True, height_ratios=[3, 2])

    series = attainment_over_time(live.records, slo, width, classes=classes)
    att_ax.plot([c for c, _, _ in series], [a * 100 for _, a, _ in series], color="black", lw=2.2, marker="o", ms=3,
                label=f"live (this run): {live.summary.slo_attainment:.1%}")
    styles = {"poise": ("tab:blue", "--"), "fixed": ("tab:orange", "--"), "static": ("tab:red", ":")}
    for s in sims:
        color, style = styles.get(s.key, ("tab:gray", "--"))
        points = attainment_over_time(s.result.records, slo, width, classes=classes)
        att_ax.plot([c for c, _, _ in points], [a * 100 for _, a, _ in points], color=color, ls=style, lw=1.6,
                    label=f"{s.label}: {s.result.summary.slo_attainment:.1%}")
    att_ax.set_ylabel(f"SLO attainment per {width:g} s (%)")
    att_ax.set_ylim(-2, 102)
    att_ax.grid(alpha=0.3)
    att_ax.legend(loc="lower left", fontsize=8)
    att_ax.set_title(f"SLO attainment by arrival time (TTFT <= {slo.ttft_s:g} s and TPOT <= {slo.tpot_s:g} s)")

    if live_split is not None and live_split.samples:
        steps = live_split.steps()
        xs = [s.t_s for s in steps] + [span]
        # Prefill wider, under decode: equal counts (2P2D) stay visible as two lines.
        split_ax.step(xs, [s.prefill for s in steps] + [steps[-1].prefill], where="post", color="tab:green", lw=4.5,
                      alpha=0.8, label="prefill, live (ready)")
        split_ax.step(xs, [s.decode for s in steps] + [steps[-1].decode], where="post", color="tab:purple", lw=1.8,
                      label="decode, live (ready)")
        if any(s.colocated for s in steps):
            split_ax.step(xs, [s.colocated for s in steps] + [steps[-1].colocated], where="post", color="tab:orange",
                          lw=1.8, label="colocated, live (ready)")
        for f in live_split.flips:
            if f.kind == "flip_requested":
                split_ax.axvline(f.t_s, color="gray", ls=":", lw=1)
            elif f.kind == "flip_done":
                split_ax.axvline(f.t_s, color="gray", ls="-", lw=1)
                split_ax.annotate(f"{f.instance_id} -> {f.to_role}", (f.t_s, 0.2), fontsize=8, rotation=90,
                                  va="bottom", ha="right")
    poise = next((s for s in sims if s.key == "poise"), None)
    if poise is not None:
        timeline = poise.result.config.get("lifecycle", {}).get("timeline", [])
        if timeline:
            xs = [float(t) for t, _, _ in timeline] + [span]
            split_ax.step(xs, [p for _, p, _ in timeline] + [timeline[-1][1]], where="post", color="tab:green",
                          ls="--", lw=1.3, label="prefill, poise (simulated)")
            split_ax.step(xs, [d for _, _, d in timeline] + [timeline[-1][2]], where="post", color="tab:purple",
                          ls="--", lw=1.3, label="decode (+ colocated), poise (simulated)")
    split_ax.set_ylabel("instances")
    split_ax.set_xlabel("seconds since the replay started (live wall clock = simulated clock)")
    split_ax.grid(alpha=0.3)
    split_ax.set_ylim(bottom=0)
    split_ax.yaxis.get_major_locator().set_params(integer=True)
    prompt_ax = split_ax.twinx()
    mean_in = mean_input_over_time(live.records, width)
    prompt_ax.plot([c for c, _ in mean_in], [m for _, m in mean_in], color="gray", alpha=0.5, lw=1,
                   label="mean prompt tokens (right)")
    prompt_ax.set_ylabel("mean prompt tokens")
    handles, labels = split_ax.get_legend_handles_labels()
    more_h, more_l = prompt_ax.get_legend_handles_labels()
    split_ax.legend(handles + more_h, labels + more_l, loc="upper left", fontsize=8)
    split_ax.set_title("P:D split over time: live (solid; vertical lines: flips requested dotted, done solid) "
                       "and the simulated controller (dashed)", fontsize=10)
    fig.suptitle(title)
    fig.savefig(path, dpi=110)
    return path


def split_document(live_split: LiveSplit | None, sims: Sequence[SimRun]) -> dict[str, Any]:
    """What ``split.json`` holds: the live split and flips, and each simulated run's summary and timeline."""
    return {
        "live": None if live_split is None else {
            "samples": [dataclasses.asdict(s) for s in live_split.samples],
            "flips": [dataclasses.asdict(f) for f in live_split.flips],
            "decision_latency": live_split.decision_latency},
        "simulated": [{"key": s.key, "label": s.label, "policy": s.result.config.get("policy"),
                       "description": s.result.config.get("description"), "summary": s.result.summary,
                       "lifecycle": s.result.config.get("lifecycle")} for s in sims],
    }


def write_split_comparison(out_dir: Path, live: ReplayResult, live_split: LiveSplit | None, sims: Sequence[SimRun],
                           slo: SLO, *, title: str, rate_scale: float, classes: SLOClasses | None = None) -> str:
    """Write ``split.png`` and ``split.json`` into ``out_dir``; return the report's Markdown section."""
    out_dir.mkdir(parents=True, exist_ok=True)
    plot_split_comparison(live, live_split, sims, slo, out_dir / "split.png", title=title, classes=classes)
    (out_dir / "split.json").write_bytes(msgspec.json.encode(split_document(live_split, sims)))
    return comparison_markdown(live, live_split, sims, rate_scale=rate_scale)
