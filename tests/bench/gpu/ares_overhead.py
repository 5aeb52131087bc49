"""Time ARES' length predictor (services/predictor/model.py's MLP) on a GPU, next to a decode step.

The predictor runs in the decode worker on the batch's last-token hidden states, which are on the GPU
already: the cost is the MLP's forward pass plus bringing B numbers back to the host. ARES reports 0.38% of
decode time at k = 20 (spec §1.2.6). This times it for Llama-3.1-8B's hidden size (4096) and ARES' own
(3584, R1-Distill-Qwen-7B) at the batch sizes ``llama_forward.py`` timed decode steps at;
``tests/bench/gpu_latency_check.py`` puts the two side by side.

    PYTHONPATH=. python tests/bench/gpu/ares_overhead.py --out ares_overhead.json        # GPU machine
    PYTHONPATH=. python tests/bench/gpu/ares_overhead.py --cpu --out ares_overhead.json  # smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch

from services.predictor.model import LengthMLP

HIDDEN_SIZES = (4096, 3584)
BATCHES = (1, 8, 32, 64, 128, 256)


def time_predictor(hidden: int, batch: int, device: torch.device, runs: int) -> list[float]:
    """Wall seconds per prediction: bf16 states on the device in, float64 tokens on the host out."""
    model = LengthMLP(hidden).to(device).eval()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    states = torch.randn(batch, hidden, device=device, dtype=dtype)
    out = []
    warm = min(20, runs)
    with torch.inference_mode():
        for i in range(runs + warm):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            model(states).clamp_min(0.0).double().cpu()  # .cpu() waits for the GPU: the whole cost
            if i >= warm:
                out.append(time.perf_counter() - t0)
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cpu", action="store_true", help="run on the CPU (checks the script)")
    ap.add_argument("--runs", type=int, default=200)
    args = ap.parse_args(argv)
    device = torch.device("cpu" if args.cpu or not torch.cuda.is_available() else "cuda")
    rows: list[dict[str, Any]] = []
    for hidden in HIDDEN_SIZES:
        for batch in BATCHES:
            secs = time_predictor(hidden, batch, device, args.runs)
            rows.append({"hidden": hidden, "batch": batch, "median_s": statistics.median(secs),
                         "p99_s": sorted(secs)[int(0.99 * (len(secs) - 1))]})
            print(f"hidden {hidden} batch {batch:>3}: median {rows[-1]['median_s'] * 1e6:.0f} us", flush=True)
    result = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "runs": args.runs, "rows": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
