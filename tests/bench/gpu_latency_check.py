"""The latency model against an H100 or H200: fit it to tests/bench/gpu/llama_forward.py's timings and compare.

The shipped profile (shared/latency/profiles/llama-3.1-8b-h100.json) comes from the H100's datasheet.
This reads what the GPU script measured on a Llama-3.1-8B-shaped forward pass, fits the latency model's
prefill and decode shapes with the profiler's own least squares (services/profiler/fit.py), writes the
fitted profile as ``llama-3.1-8b-<gpu>-torch`` and a report that puts the shipped profile's predictions next
to the measurements: prefill, decode steps, packing short prompts into one pass (DOPD's length-aware batching),
chunked prefill, the length of one operator and the blocking of an operator-level preemption (FlowPrefill),
and (from ``llama_forward.py --sections mixed``) a colocated engine's mixed step against ``mixed_step_time_s``.

    python tests/bench/gpu/llama_forward.py --out tests/bench/results/gpu/llama_forward_h100.json   # on the GPU
    python -m tests.bench.gpu_latency_check                                                       # here

``--gpu h200`` reads ``llama_forward_h200.json`` and ``mixed_h200.json`` instead and writes
``llama-3.1-8b-h200-torch`` and ``latency_check_h200.{md,png}``. There is no H200 datasheet profile, so that
report compares against the H100's: its errors are the H200's speed-up and the model's shape together.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from services.profiler.fit import DecodeFit, PrefillFit, fit_decode, fit_prefill
from services.profiler.plot import write_plot
from services.profiler.samples import DecodeSample, PrefillSample
from shared.latency import LatencyModel, LatencyProfile, load_profile, save_profile
from shared.latency.model import PROFILES_DIR

RESULTS = Path(__file__).with_name("results") / "gpu"


@dataclass(frozen=True)
class Gpu:
    """A card the GPU scripts ran on: where its raw timings lie and what the report says about it."""

    key: str
    label: str
    bandwidth: str  # HBM bandwidth, what a short pass's floor (one read of the 16 GB of weights) comes from
    weight_read: str  # 16 GB at that bandwidth

    def raw(self, script: str) -> Path:
        """``llama_forward``, ``mixed`` (llama_forward.py --sections mixed), ``ares_overhead`` or
        ``serving_overhead``: what that script in tests/bench/gpu/ wrote on this card."""
        return RESULTS / f"{script}_{self.key}.json"

    @property
    def fitted_name(self) -> str:
        return f"llama-3.1-8b-{self.key}-torch"

    @property
    def report_stem(self) -> str:
        # the H100 report keeps the name the docs link to
        return "latency_check" if self.key == "h100" else f"latency_check_{self.key}"


GPUS = {g.key: g for g in (Gpu("h100", "H100", "3.35 TB/s", "~5 ms"), Gpu("h200", "H200", "4.8 TB/s", "~3.3 ms"))}
H100 = GPUS["h100"]
# the card the shipped datasheet profile describes: on any other, its errors include the cards' difference
SHIPPED_GPU = H100
RAW = H100.raw("llama_forward")
# the command of a mixed JSON that records none (the committed mixed_h100.json has no `argv` field)
MIXED_ARGV = ["--sections", "mixed", "--parts", "mixed_parts.jsonl", "--out", "mixed_h100.json"]
OPERATORS = ("qkv_proj", "attn", "o_proj", "gate_up_proj", "down_proj")
GRAPH_UP_TO = 8192  # prompts this short are read from the CUDA-graph replays (no Python launch gaps)


def prefill_samples(raw: dict[str, Any]) -> list[PrefillSample]:
    graph = {r["tokens"]: r["seconds"] for r in raw["prefill_graph"]}
    eager = {r["tokens"]: r["seconds"] for r in raw["prefill"]}
    picked = {n: s for n, s in graph.items() if n <= GRAPH_UP_TO}
    picked |= {n: s for n, s in eager.items() if n > GRAPH_UP_TO}
    return [PrefillSample(tokens=n, passes=1, seconds=s) for n, s in sorted(picked.items())]


def decode_samples(raw: dict[str, Any]) -> list[DecodeSample]:
    return [DecodeSample(batch=r["batch"], prompt_tokens=r["context"], context_tokens=float(r["batch"] * r["context"]),
                         step_s=r["graph_step_s"], steps=30, context_source="estimate") for r in raw["decode"]]


@dataclass(frozen=True)
class EagerFit:
    """An eager decode step as ``max(factor x the graphed step, floor_s)`` (the profile's ``eager_decode_*``)."""

    factor: float
    floor_s: float
    max_rel_error: float


def fit_eager(raw: dict[str, Any]) -> EagerFit:
    """The (factor, floor) that best predict each eager step from the graphed step of the same shape, by least
    squares of the relative error over a grid (factor in steps of 0.005, floor in steps of 0.1 ms): a small
    step is bound by the kernel launches the graph saves, a GPU-bound one runs them beside its kernels."""
    pairs = [(r["graph_step_s"], r["eager_step_s"]) for r in raw["decode"]]

    def errors(factor: float, floor_s: float) -> list[float]:
        return [max(factor * g, floor_s) / e - 1 for g, e in pairs]

    grid = [(1 + i * 0.005, j * 1e-4) for i in range(101) for j in range(int(max(e for _, e in pairs) / 1e-4) + 1)]
    factor, floor_s = min(grid, key=lambda c: sum(x * x for x in errors(*c)))
    return EagerFit(factor, floor_s, max(abs(x) for x in errors(factor, floor_s)))


def fitted_profile(base: LatencyProfile, prefill: PrefillFit, decode: DecodeFit, raw: dict[str, Any],
                   gpu: Gpu = H100) -> LatencyProfile:
    eager = fit_eager(raw)
    copied = f"Every other field is copied from {base.name} (KV capacity, transfer, role switch)."
    if gpu != SHIPPED_GPU:
        copied += f" They are the {SHIPPED_GPU.label}'s: an {gpu.label}'s larger memory holds more KV than this says."
    return msgspec.structs.replace(
        base, name=gpu.fitted_name, gpu=raw["device"],
        prefill_overhead_s=prefill.overhead_s, prefill_s_per_token=prefill.s_per_token,
        prefill_s_per_token2=prefill.s_per_token2, decode_overhead_s=decode.overhead_s,
        decode_s_per_seq=decode.s_per_seq, decode_s_per_context_token=decode.s_per_context_token,
        eager_decode_factor=round(eager.factor, 3), eager_decode_floor_s=round(eager.floor_s, 4),
        provenance=[
            f"Fitted by tests/bench/gpu_latency_check.py to tests/bench/results/gpu/llama_forward_{gpu.key}.json: a "
            f"Llama-3.1-8B-shaped forward pass with random bf16 weights in eager torch {raw['torch']} on one "
            f"{raw['device']} (attention: torch SDPA, {raw['sdpa_path']}; dense KV cache).",
            f"Prefill: one prompt alone, CUDA-graph replays up to {GRAPH_UP_TO} tokens (the GPU's time without "
            "Python's launch gaps), eager passes above; the intercept is the memory-bound floor of a short "
            "pass (reading 16 GB of weights), not a scheduler's overhead, which this measurement has none of.",
            "Decode: one step over B sequences of C context tokens each, replayed from a CUDA graph; past "
            "cuda_graph_max_batch (copied) a step costs max(eager_decode_factor x that, eager_decode_floor_s), "
            "fitted to the same shapes run eagerly (fit_eager).",
            copied,
            "SGLang's kernels (FlashInfer/FA3, fused norms, paged KV) and scheduler differ: this is a measured "
            "reference for the model's shapes, not a profile of an SGLang server (use `poise profile` for that).",
        ],
    )


def ms(x: float) -> str:
    return f"{x * 1e3:.2f}"


def pct(measured: float, predicted: float) -> str:
    return f"{(predicted - measured) / measured * 100:+.0f}%"


def report(raw: dict[str, Any], shipped: LatencyProfile, fitted: LatencyProfile, pf: PrefillFit,
           df: DecodeFit, command: str, gpu: Gpu = H100) -> str:
    ship, fit = LatencyModel(shipped), LatencyModel(fitted)
    lines = [
        f"# The latency model against an {gpu.label}",
        "",
        f"Command: `{command}` (timings: `python tests/bench/gpu/llama_forward.py`, on one {raw['device']}, "
        f"torch {raw['torch']}, attention {raw['sdpa_path']}; raw numbers in `gpu/llama_forward_{gpu.key}.json`).",
        "",
        "A Llama-3.1-8B-shaped forward pass with random bf16 weights in eager torch, not an SGLang server: "
        "SGLang's fused kernels and FlashInfer/FA3 attention are faster in places, and its scheduler adds "
        "host time that this has none of. It checks the shapes and magnitudes the simulator and engine_sim "
        "rely on.",
        "",
    ]
    if gpu != SHIPPED_GPU:
        lines += [f"The shipped profile is `{shipped.name}`, derived from the {SHIPPED_GPU.label}'s datasheet; there "
                  f"is none for the {gpu.label}. Every comparison with it below is against that {SHIPPED_GPU.label} "
                  f"profile, so its errors and ratios show how much faster the {gpu.label} is as well as the "
                  "model's shape errors.", ""]
    lines += [
        "## Coefficients",
        "",
        f"| field | shipped (datasheet) | fitted to the {gpu.label} | fitted / shipped |",
        "|---|---|---|---|",
    ]
    for f in ("prefill_overhead_s", "prefill_s_per_token", "prefill_s_per_token2", "decode_overhead_s",
              "decode_s_per_seq", "decode_s_per_context_token"):
        a, b = getattr(shipped, f), getattr(fitted, f)
        lines.append(f"| {f} | {a:.4g} | {b:.4g} | {b / a:.2f} |" if a else f"| {f} | {a:.4g} | {b:.4g} | - |")
    worst = max(range(len(pf.stats.rel_errors)), key=lambda i: abs(pf.stats.rel_errors[i]))
    lines += ["", f"Prefill fit R² {pf.stats.r2:.5f} (max error {pf.stats.max_rel_error * 100:.1f}%, at "
              f"{prefill_samples(raw)[worst].tokens} tokens); decode fit R² {df.stats.r2:.5f} (max error "
              f"{df.stats.max_rel_error * 100:.1f}%). A straight line plus an intercept cannot follow a short "
              "pass's floor (the weights are read once per pass, whatever the prompt), so the fit's intercept "
              "is low and its short prompts come out fast; the shipped profile's larger per-pass overhead "
              "stands in for that floor.", "",
              "## Prefill, one prompt alone", "",
              "| tokens | measured ms | shipped profile ms | shipped error | eager torch ms |", "|---|---|---|---|---|"]
    eager = {r["tokens"]: min(r["seconds"]) for r in raw["prefill"]}
    for s in prefill_samples(raw):
        m = min(s.seconds)
        lines.append(f"| {s.tokens} | {ms(m)} | {ms(ship.prefill_time_s(s.tokens))} | "
                     f"{pct(m, ship.prefill_time_s(s.tokens))} | {ms(eager.get(s.tokens, float('nan')))} |")
    lines += ["", "## Decode step (CUDA graph)", "",
              "| batch | context each | measured ms | shipped profile ms | shipped error | eager ms |",
              "|---|---|---|---|---|---|"]
    for r in raw["decode"]:
        p = ship.decode_step_time_s(r["batch"], r["batch"] * r["context"])
        lines.append(f"| {r['batch']} | {r['context']} | {ms(r['graph_step_s'])} | {ms(p)} | "
                     f"{pct(r['graph_step_s'], p)} | {ms(r['eager_step_s'])} |")
    eager_fit = fit_eager(raw)
    lines += ["", f"Eager against graphed (SGLang runs a decode batch above its largest captured graph eagerly): "
              f"max({eager_fit.factor:.3f} x the graphed step, {ms(eager_fit.floor_s)} ms) predicts every eager "
              f"step above within {eager_fit.max_rel_error * 100:.0f}% (`fit_eager`; the profiles' `eager_decode_factor` and "
              "`eager_decode_floor_s`). This eager torch launches more kernels than SGLang's fused ones, so its "
              "floor likely overstates SGLang's."]
    lines += ["", "## Packing short prompts into one pass (DOPD's length-aware batching)", "",
              "k prompts of s tokens: k passes of one prompt against one pass of all k. The model charges one "
              "launch overhead per pass and the same work either way.", "",
              "| k x s | GPU time apart / packed | eager apart / packed | shipped model | fitted model |",
              "|---|---|---|---|---|"]
    for r in raw["packing"]:
        k, s = r["prompts"], r["tokens"]

        def model_ratio(m: LatencyModel, k: int = k, s: int = s) -> float:
            return k * m.prefill_time_s(s) / m.prefill_batch_time_s([(s, 0)] * k)

        gpu = k * min(r["one_graph_s"]) / min(r["packed_graph_s"])
        eag = k * min(r["one_s"]) / min(r["packed_s"])
        lines.append(f"| {k} x {s} | {gpu:.2f}x | {eag:.2f}x | {model_ratio(ship):.2f}x | {model_ratio(fit):.2f}x |")
    lines += ["", "## Chunked prefill", "",
              "One prompt in chunks of C tokens (eager). The model adds one launch overhead per chunk.", "",
              "| tokens | chunk | measured ms | vs the 16K/8K-chunk run | shipped model ms |", "|---|---|---|---|---|"]
    for total in sorted({r["tokens"] for r in raw["chunking"]}):
        rows = sorted((r for r in raw["chunking"] if r["tokens"] == total), key=lambda r: r["chunk"])
        chunked = [r for r in rows if r["chunk"] < total]
        ref = min(chunked[-1]["seconds"]) if chunked else None
        for r in rows:
            m, c = min(r["seconds"]), r["chunk"]
            parts = [(min(c, total - i), i) for i in range(0, total, c)]
            model_s = sum(ship.prefill_time_s(n, d) for n, d in parts)
            rel = f"{(m / ref - 1) * 100:+.1f}%" if ref and c < total else "(one pass)"
            lines.append(f"| {total} | {c} | {ms(m)} | {rel} | {ms(model_s)} |")
    lines += ["", "## Operators and operator-level preemption (FlowPrefill)", "",
              "A cooperative preemption blocks for at most one operator. The model's layers take equal time; within "
              "one, the operators were equal at first, and now attention takes the pass's quadratic share and the "
              "matrix products split the rest by their weight sizes (`operator_weights`). Longest operator of a "
              "pass of one prompt, on the shipped profile:", "",
              "| tokens | pass ms | equal operators ms | weighted operators ms | longest measured ms (which) | "
              "mean per layer: " + " / ".join(OPERATORS) + " ms |", "|---|---|---|---|---|---|"]
    for r in raw["operators"]:
        ops = r["op_s"][:-1]
        longest = max(range(len(ops)), key=lambda i: ops[i])
        means = " / ".join(f"{statistics.mean(ops[i::5]) * 1e3:.2f}" for i in range(5))
        n = r["tokens"]
        layer_s = ship.prefill_time_s(n) / shipped.num_layers
        equal = max(ship.operator_durations_s(layer_s))
        weighted = max(ship.operator_durations_s(layer_s, ship.attention_share([(n, 0)])))
        lines.append(f"| {n} | {ms(sum(r['op_s']))} | {ms(equal)} | {ms(weighted)} | "
                     f"{ms(ops[longest])} ({OPERATORS[longest % 5]}) | {means} |")
    lines += ["", "A prefill that checks a flag between operators and waits for each (the flag set by another "
              "thread at a random point of the pass):", "",
              "| tokens | cuts | blocking p50 ms | blocking max ms | pass plain ms | pass with checks ms | cost |",
              "|---|---|---|---|---|---|---|"]
    for r in raw["preemption"]:
        b = sorted(r["blocking_s"])
        plain, checked = min(r["plain_pass_s"]), min(r["checked_pass_s"])
        lines.append(f"| {r['tokens']} | {len(b)} | {ms(statistics.median(b))} | {ms(max(b))} | {ms(plain)} | "
                     f"{ms(checked)} | {(checked / plain - 1) * 100:+.1f}% |")
    return "\n".join(lines) + "\n"


def versus_section(raw: dict[str, Any], other_raw: dict[str, Any], gpu: Gpu, other: Gpu) -> str:
    """The same prefill and decode shapes timed on another card: the cards' difference, apart from the model's."""
    mine = {s.tokens: min(s.seconds) for s in prefill_samples(raw)}
    theirs = {s.tokens: min(s.seconds) for s in prefill_samples(other_raw)}
    tokens = sorted(mine.keys() & theirs.keys())
    steps = {(r["batch"], r["context"]): r["graph_step_s"] for r in other_raw["decode"]}
    decode = [(r, steps[(r["batch"], r["context"])]) for r in raw["decode"] if (r["batch"], r["context"]) in steps]
    ratios = [r["graph_step_s"] / o for r, o in decode]
    lines = ["", f"## Against the {other.label} measurement", "",
             f"The same shapes timed on one {other_raw['device']} (torch {other_raw['torch']}, raw numbers in "
             f"`gpu/llama_forward_{other.key}.json`): {gpu.label} / {other.label} is "
             f"{min(mine[n] / theirs[n] for n in tokens):.2f} to {max(mine[n] / theirs[n] for n in tokens):.2f} "
             f"for prefill and {min(ratios):.2f} to {max(ratios):.2f} (median {statistics.median(ratios):.2f}) for "
             "decode steps.", "",
             f"| tokens | {other.label} ms | {gpu.label} ms | {gpu.label} / {other.label} |", "|---|---|---|---|"]
    lines += [f"| {n} | {ms(theirs[n])} | {ms(mine[n])} | {mine[n] / theirs[n]:.3f} |" for n in tokens]
    lines += ["", f"| batch | context each | {other.label} step ms | {gpu.label} step ms | "
              f"{gpu.label} / {other.label} |", "|---|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r['context']} | {ms(o)} | {ms(r['graph_step_s'])} | {r['graph_step_s'] / o:.3f} |"
              for r, o in decode]
    return "\n".join(lines) + "\n"


def ares_section(ares: dict[str, Any], raw: dict[str, Any]) -> str:
    """ARES' predictor next to the decode step it rides on: its share of decode time at k = 1 and 20."""
    lines = ["", "## ARES' length predictor next to a decode step", "",
             f"`tests/bench/gpu/ares_overhead.py` on one {ares['device']}: the MLP (services/predictor/model.py, "
             "widths from the hidden size) on B bf16 hidden states on the GPU, results copied to the host, "
             f"median of {ares['runs']} runs; decode step: the shortest context timed at that batch above. ARES "
             "reports 0.38% of decode time at k = 20.", "",
             "| hidden size | batch | predictor us | decode step ms | share at k = 1 | share at k = 20 |",
             "|---|---|---|---|---|---|"]
    for r in ares["rows"]:
        contexts = [d for d in raw["decode"] if d["batch"] == r["batch"]]
        if not contexts:
            continue
        step = min(contexts, key=lambda d: d["context"])
        share = r["median_s"] / step["graph_step_s"]
        lines.append(f"| {r['hidden']} | {r['batch']} | {r['median_s'] * 1e6:.0f} | {ms(step['graph_step_s'])} | "
                     f"{share * 100:.2f}% | {share / 20 * 100:.3f}% |")
    return "\n".join(lines) + "\n"


def serving_section(serving: dict[str, Any]) -> str:
    """The predictor as an engine serves it (services/predictor/serving.py), inside a decode loop."""
    lines = ["", "## ARES' length predictor served in a decode loop", "",
             f"`{serving['command']}` on one {serving['device']}: Llama-3.1-8B-shaped decode steps replayed from "
             "a CUDA graph, the sampled ids read back each step, and `EnginePredictor` after each (the schedule's "
             "bookkeeping, the MLP on the GPU every k iterations, B numbers back, the stream fields of the requests "
             f"just predicted); {serving['rows'][0]['iterations']} iterations per variant, interleaved. ARES reports "
             "0.38% at k = 20 and 7.7% at k = 1.", "",
             "| batch | context | step ms | k = 20: all iterations | k = 20: typical iteration | k = 20, MLP "
             "replayed from a CUDA graph | k = 1 | MLP call ms (k = 20; graphed) | no predictor vs itself |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in serving["rows"]:
        graph = r.get("overhead_k20_graph")
        graph_call = r["mlp_s_per_call"].get("k20-graph")
        lines.append(f"| {r['batch']} | {r['context']} | {ms(r['median_s']['none'])} | {r['overhead_k20']:+.2%} | "
                     f"{r['bookkeeping_k20']:+.2%} | {'-' if graph is None else f'{graph:+.2%}'} | "
                     f"{r['overhead_k1']:+.2%} | {r['mlp_s_per_call']['k20'] * 1e3:.2f}"
                     f"{'' if graph_call is None else f'; {graph_call * 1e3:.2f}'} | "
                     + (f"{r['noise_none_vs_none']['mean']:+.2%} |" if "noise_none_vs_none" in r else "- |"))
    return "\n".join(lines) + "\n"


def mixed_section(mixed: dict[str, Any], raw: dict[str, Any], shipped: LatencyProfile,
                  fitted: LatencyProfile | None = None, gpu: Gpu = H100) -> str:
    """A colocated engine's mixed step against the latency model's ``mixed_step_time_s`` (the decode step plus
    the chunk's prefill work, its launch overhead paid once), and against the decode step and the chunk alone."""
    model = LatencyModel(shipped)
    refit = LatencyModel(fitted) if fitted is not None else None
    rows = []
    for r in mixed["mixed"]:
        b, c, k, d = r["batch"], r["context"], r["chunk"], r["done"]
        mx, dec, chk = (statistics.median(r[f]) for f in ("mixed_s", "decode_s", "chunk_s"))
        row = {"b": b, "c": c, "k": k, "d": d, "mixed": mx, "decode": dec, "chunk": chk,
               "eager": statistics.median(r["mixed_eager_s"]) if r["mixed_eager_s"] else float("nan"),
               "model": model.mixed_step_time_s(b, b * c, [(k, d)]),
               "model_decode": model.decode_step_time_s(b, b * c), "model_chunk": model.prefill_time_s(k, d)}
        row |= {"ratio": row["model"] / mx, "vs_sum": mx / (dec + chk), "saving": dec + chk - mx,
                "fitted": refit.mixed_step_time_s(b, b * c, [(k, d)]) / mx if refit else float("nan")}
        rows.append(row)
    if not rows:
        return ""

    def span(xs: list[float], fmt: str = "{:.2f}") -> str:
        lo, hi = fmt.format(min(xs)), fmt.format(max(xs))
        return lo if lo == hi else f"{lo} to {hi}"

    def ms_span(rs: list[dict[str, Any]], field: str) -> str:
        return span([r[field] * 1e3 for r in rs], "{:.1f}")

    argv = mixed.get("argv") or MIXED_ARGV
    ratios = [r["ratio"] for r in rows]
    overhead_ms = shipped.prefill_overhead_s * 1e3
    decode_section = {(r["batch"], r["context"]): r["graph_step_s"] for r in raw["decode"]}
    same = [r["decode"] / decode_section[(r["b"], r["c"])] - 1 for r in rows if (r["b"], r["c"]) in decode_section]
    short = [r for r in rows if r["k"] <= 512]
    longest = max(r["k"] for r in rows)
    big = [r for r in rows if r["k"] == longest and r["b"] >= 32]
    under = [r for r in rows if r["fitted"] < 1]
    where = ""
    if under and all(r["d"] > 0 for r in under):
        long_ones = sum(r["k"] >= 2048 for r in under) >= 0.9 * len(under)
        where = (", the long chunks after a prefix" if long_ones else
                 f", chunks of {min(r['k'] for r in under)} to {max(r['k'] for r in under)} tokens after a prefix")
    lines = ["", "## Mixed steps (colocated)", "",
             f"`python3 tests/bench/gpu/llama_forward.py {' '.join(argv)}` on one {mixed['device']} (torch "
             f"{mixed['torch']}, attention {mixed['sdpa_path']}, chunks after a prefix {mixed['chunk_path']}; "
             f"raw numbers in `gpu/mixed_{gpu.key}.json`, the run's output in `gpu/mixed_{gpu.key}.log`). A mixed "
             "step is SGLang's mixed chunk: one forward pass carrying a decode batch of B sequences of C context "
             "tokens each and a prefill chunk of K new tokens after D already prefilled; the B + K rows go through "
             "the matrix products together, attention runs per part (the decode rows over their own KV, the chunk's "
             "rows causal over D + K). The mixed pass, the decode step alone and the chunk alone are replayed from "
             f"CUDA graphs in interleaved rounds (medians of {len(mixed['mixed'][0]['mixed_s'])} replays each: the "
             "GPU's time). "
             "The mixed pass is also timed eagerly: SGLang runs mixed steps without a graph, but this eager torch "
             "pays Python launch gaps that SGLang's fused kernels mostly do not, so that column is an upper bound, "
             "not SGLang's eager cost. Model: the shipped profile's `mixed_step_time_s(B, B*C, [(K, D)])`, the "
             f"decode step plus the chunk's prefill work, its launch overhead ({overhead_ms:.1f} ms) paid once.", ""]
    if mixed.get("mixed_errors"):
        missing = ", ".join("B={batch} C={context} K={chunk} D={done}".format(**e) for e in mixed["mixed_errors"])
        lines += [f"Not measured: {missing} (see the JSON's `mixed_errors`).", ""]
    lines += [
        f"- **The model over-prices the colocated step**: model / measured is {span(ratios)} (median "
        f"{statistics.median(ratios):.2f}); "
        + ("it never under-prices one. " if min(ratios) >= 1 else
           f"it under-prices {sum(x < 1 for x in ratios)} of {len(ratios)} shapes. ")
        + "Most of that is the shipped prefill coefficients rather than how the step is composed: the chunk alone "
        f"is over-priced {span([r['model_chunk'] / r['chunk'] for r in rows])}x (as one prompt alone is in the "
        "prefill table above), the decode step alone priced "
        f"{span([r['model_decode'] / r['decode'] for r in rows])}x.",
        "- **A mixed pass costs less than the decode step and the chunk apart while the chunk is short**: mixed / "
        f"(decode + chunk) is {span([r['vs_sum'] for r in short])} for K <= 512, "
        f"{ms_span(short, 'saving')} ms saved, about what reading the 16 GB of weights once takes ({gpu.weight_read} "
        f"at the {gpu.label}'s {gpu.bandwidth}) plus the pass's small kernels. The saving fades as the chunk grows: at "
        f"K = {longest} with B >= 32 the mixed pass costs {span([r['vs_sum'] for r in big])}x the two apart "
        f"(decode + chunk - mixed: {ms_span(big, 'saving')} ms). The chunk's rows already make the matrix products "
        "compute-bound, so the decode rows add their compute and their attention, and the decode step's floor "
        "(its weight read) is no longer what they cost.",
        f"- **The composition is close for short chunks and generous for long ones**: the model saves a constant "
        f"{overhead_ms:.1f} ms (the chunk adds its work only) where the pass saves {ms_span(rows, 'saving')} ms, "
        f"so the composition alone prices a step up to {max(overhead_ms - r['saving'] * 1e3 for r in rows):.1f} ms "
        "too cheap (a 4K chunk next to a large batch); the over-priced prefill coefficients more than make up for "
        "it on the shipped profile."
        + (f" On the profile fitted to the {gpu.label} above (`{fitted.name}`, whose prefill line is close and whose "
           f"launch overhead is {fitted.prefill_overhead_s * 1e3:.1f} ms), model / measured is "
           f"{span([r['fitted'] for r in rows])}, under 1 for {len(under)} of {len(rows)} shapes{where}."
           if fitted is not None else ""),
    ]
    if same:
        lines.append(f"- The decode step alone in this run matches the decode table above (another run, the same "
                     f"card model) within {span([x * 100 for x in same], '{:+.1f}')}% at the shapes both timed.")
    lines += ["", "By chunk, over the batches and contexts:", "",
              "| K | D | model / measured | mixed / (decode + chunk) | decode + chunk - mixed ms | chunk alone: model / "
              "measured | fitted profile: model / measured |", "|---|---|---|---|---|---|---|"]
    for k, d in sorted({(r["k"], r["d"]) for r in rows}, key=lambda kd: (kd[1], kd[0])):
        rs = [r for r in rows if (r["k"], r["d"]) == (k, d)]
        lines.append(f"| {k} | {d} | {span([r['ratio'] for r in rs])} | {span([r['vs_sum'] for r in rs])} | "
                     f"{ms_span(rs, 'saving')} | {span([r['model_chunk'] / r['chunk'] for r in rs])} | "
                     f"{span([r['fitted'] for r in rs])} |")
    lines += ["", "Every shape:", "",
              "| B | C | K | D | mixed ms | eager mixed ms | model ms | model / measured | decode alone ms | "
              "chunk alone ms | mixed / (decode + chunk) | decode + chunk - mixed ms |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['b']} | {r['c']} | {r['k']} | {r['d']} | {ms(r['mixed'])} | {ms(r['eager'])} | "
                     f"{ms(r['model'])} | {r['ratio']:.2f} | {ms(r['decode'])} | {ms(r['chunk'])} | "
                     f"{r['vs_sum']:.2f} | {ms(r['saving'])} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpu", choices=sorted(GPUS), default=H100.key,
                    help="the card whose raw timings to read; picks the defaults of the paths below")
    ap.add_argument("--raw", type=Path)
    ap.add_argument("--ares-raw", type=Path)
    ap.add_argument("--serving-raw", type=Path)
    ap.add_argument("--mixed-raw", type=Path)
    ap.add_argument("--out", type=Path, default=RESULTS, help="folder for the report (.md, .png)")
    ap.add_argument("--profile-out", type=Path)
    args = ap.parse_args(argv)
    gpu = GPUS[args.gpu]
    raw = json.loads((args.raw or gpu.raw("llama_forward")).read_text())
    profile_out = args.profile_out or PROFILES_DIR / f"{gpu.fitted_name}.json"
    shipped = load_profile()
    ps, ds = prefill_samples(raw), decode_samples(raw)
    pf, df = fit_prefill(ps), fit_decode(ds)
    fitted = fitted_profile(shipped, pf, df, raw, gpu)
    save_profile(fitted, profile_out)
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python -m tests.bench.gpu_latency_check " + " ".join(argv)
    text = report(raw, shipped, fitted, pf, df, command.strip(), gpu)
    if gpu != SHIPPED_GPU and SHIPPED_GPU.raw("llama_forward").is_file():
        text += versus_section(raw, json.loads(SHIPPED_GPU.raw("llama_forward").read_text()), gpu, SHIPPED_GPU)
    # the overhead runs exist for some cards only; a section without its raw file is left out
    ares_raw = args.ares_raw or gpu.raw("ares_overhead")
    serving_raw = args.serving_raw or gpu.raw("serving_overhead")
    mixed_raw = args.mixed_raw or gpu.raw("mixed")
    if ares_raw.is_file():
        text += ares_section(json.loads(ares_raw.read_text()), raw)
    if serving_raw.is_file():
        text += serving_section(json.loads(serving_raw.read_text()))
    if mixed_raw.is_file():
        text += mixed_section(json.loads(mixed_raw.read_text()), raw, shipped, fitted, gpu)
    missing = [p.name for p in (ares_raw, serving_raw, mixed_raw) if not p.is_file()]
    md, png = args.out / f"{gpu.report_stem}.md", args.out / f"{gpu.report_stem}.png"
    md.write_text(text)
    write_plot(png, title=f"Llama-3.1-8B shapes on one {raw['device']} (eager torch)",
               prefill_samples=ps, prefill_fit=pf, chunk=None, decode_samples=ds, decode_fit=df)
    print(f"wrote {profile_out}, {md} and .png" + (f" (no {', '.join(missing)}: left out)" if missing else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
