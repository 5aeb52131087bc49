"""What serving ARES' length predictor costs a decode loop on a GPU: ``services/predictor/serving.py`` in the loop.

``ares_overhead.py`` timed the MLP alone. This times the component an engine runs (``EnginePredictor``: the
schedule's per-request bookkeeping every iteration, the MLP on the states where they are every k iterations,
B numbers back to the host, and the stream fields of the requests just predicted) inside a decode
loop of Llama-3.1-8B-shaped steps (``llama_forward.Llama``, random bf16 weights, replayed from a CUDA graph,
the sampled ids copied to the host each step as an engine does). The same loop runs without the predictor,
with it at k = 20 and at k = 1, interleaved in rounds so drift hits all three alike; the overhead is the
difference of the median iteration times.

    PYTHONPATH=. python tests/bench/gpu/serving_overhead.py --out serving_overhead.json          # GPU machine
    PYTHONPATH=. python tests/bench/gpu/serving_overhead.py --tiny --out serving_overhead.json   # CPU smoke run

Needs torch, numpy and msgspec (the project's ``shared`` package imports it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict
from typing import Any

import numpy as np
import torch

from services.predictor.model import Y_SCALE, LengthMLP, PredictorMeta
from services.predictor.serving import EnginePredictor
from tests.bench.gpu.llama_forward import TINY, Clock, Llama, Shape, capture


def loop(step: Any, ids: torch.Tensor, states: torch.Tensor, predictor: EnginePredictor | None, iterations: int,
         start: int) -> list[float]:
    """Seconds of each iteration: the step, its ids to the host, then the predictor's share."""
    batch = states.shape[0]
    rids = [f"r{i}" for i in range(batch)]
    out = []
    for it in range(iterations):
        t0 = time.perf_counter()
        step()
        ids.cpu()  # the engine reads the sampled tokens: one sync per step, with or without the predictor
        if predictor is not None:
            generated = [start + it] * batch
            predictor.step(rids, generated, lambda: states)
            for _rid, _field in predictor.stream_fields().items():  # merged into those requests' chunks
                pass
        out.append(time.perf_counter() - t0)
    return out


def graphed(mlp: LengthMLP, states: torch.Tensor) -> Any:
    """The MLP on the static ``states`` buffer, replayed from a CUDA graph (as an engine would run it inside
    its own decode graph): one launch instead of one per operator, then B numbers to the host."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            mlp(states)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mlp(states)

    def predict(_states: Any) -> np.ndarray:  # the states are the buffer the graph reads
        graph.replay()
        return np.maximum(out.cpu().numpy().astype(np.float64), 0.0) * Y_SCALE

    return predict


def measure(model: Llama, clock: Clock, hidden: int, batch: int, context: int, iterations: int,
            rounds: int) -> dict[str, Any]:
    eager = model.decode_step_fn(batch, context)
    ids = eager()  # the step's static output buffer: a graph replay writes the sampled ids there
    step = capture(clock, eager)
    states = torch.randn(batch, hidden, device=model.device, dtype=model.dtype)  # the last-token states
    mlp = LengthMLP(hidden).to(model.device).eval()
    meta = PredictorMeta(model_name="random", hidden_size=hidden, widths=mlp.widths, k=20, data_sha256="0" * 64)
    sync = torch.cuda.synchronize if model.device.type == "cuda" else None
    # "none2" repeats "none" at the end of each round: their difference is the measurement's own noise
    variants: dict[str, Any] = {"none": None, "k20": 20, "k1": 1, "none2": None}
    if clock.cuda:  # k = 20 with the MLP replayed from a CUDA graph
        variants = {"none": None, "k20": 20, "k20-graph": 20, "k1": 1, "none2": None}
    times: dict[str, list[float]] = {name: [] for name in variants}
    predictors: dict[str, EnginePredictor] = {}
    for name, k in variants.items():
        if k is not None:
            predict = graphed(mlp, states) if name.endswith("-graph") else None
            predictors[name] = p = EnginePredictor(mlp, meta, k=k, sync=sync, predict=predict)
            p.admit_batch([f"r{i}" for i in range(batch)], [1 << 20] * batch, states)  # also warms the MLP up
    base = {name: (p.seconds, p.online.calls) for name, p in predictors.items()}
    loop(step, ids, states, None, 5, 0)  # warm-up
    for r in range(rounds):
        for name in variants:
            times[name] += loop(step, ids, states, predictors.get(name), iterations, r * iterations)
    med = {name: statistics.median(t) for name, t in times.items()}
    mean = {name: statistics.fmean(t) for name, t in times.items()}
    times["none"] += times.pop("none2")
    noise = {"median": med.pop("none2") / med["none"] - 1, "mean": mean.pop("none2") / mean["none"] - 1}
    med["none"], mean["none"] = statistics.median(times["none"]), statistics.fmean(times["none"])
    return {"batch": batch, "context": context, "hidden": hidden, "iterations": iterations * rounds,
            "median_s": med, "mean_s": mean,
            # all iterations, the predicting ones included (1 in k): what the predictor costs the loop
            "overhead_k20": mean["k20"] / mean["none"] - 1, "overhead_k1": mean["k1"] / mean["none"] - 1,
            # a typical iteration at k = 20 predicts nothing: the schedule's bookkeeping and the stream fields
            "bookkeeping_k20": med["k20"] / med["none"] - 1,
            **({"overhead_k20_graph": mean["k20-graph"] / mean["none"] - 1} if "k20-graph" in mean else {}),
            "noise_none_vs_none": noise,  # the same loop twice: how far apart two runs of it land
            "mlp_s_per_call": {name: (p.seconds - base[name][0]) / max(1, p.online.calls - base[name][1])
                               for name, p in predictors.items()}}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiny", action="store_true", help="a tiny model on the CPU (checks the script)")
    ap.add_argument("--iterations", type=int, default=100, help="iterations per variant and round")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.tiny
    if not cuda and not args.tiny:
        print("no GPU: use --tiny for a smoke run", file=sys.stderr)
        return 2
    shape = TINY if args.tiny else Shape()
    device = torch.device("cuda" if cuda else "cpu")
    model = Llama(shape, device, torch.bfloat16 if cuda else torch.float32)
    clock = Clock(device)
    batches = (4, 16) if args.tiny else (32, 128, 256)
    context = 64 if args.tiny else 1024
    rows = []
    with torch.inference_mode():
        for batch in batches:
            row = measure(model, clock, shape.hidden, batch, context, args.iterations, args.rounds)
            rows.append(row)
            print(f"batch {batch:>3}: step {row['median_s']['none'] * 1e3:.2f} ms, {row['overhead_k20']:+.2%} at "
                  f"k = 20 ({row['bookkeeping_k20']:+.2%} typical iteration), {row['overhead_k1']:+.2%} at k = 1; "
                  f"none vs none {row['noise_none_vs_none']['mean']:+.2%}"
                  + (f"; k = 20, graphed MLP {row['overhead_k20_graph']:+.2%}" if "overhead_k20_graph" in row else ""),
                  flush=True)
    result = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
              "shape": asdict(shape), "rows": rows,
              "command": " ".join(["python", "tests/bench/gpu/serving_overhead.py", *argv])}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
