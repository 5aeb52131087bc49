"""Collect length-predictor data: generate with the LLM and record (hidden state, remaining length) every k tokens.

Prompts come from the project's prompt set (`prompts.prompt_set`), in its seeded order (task types mixed);
`decode.Decoder` generates them with continuous batching and taps the hidden state at the end of prefill and
every k generated tokens. ``remaining = output_len - generated``: a request ends at its stop token
(``<|im_end|>``, counted in ``output_len``) or at ``max_new_tokens``; requests cut off are kept (their true
remaining length is what the cap leaves, as a server with that ``max_tokens`` would see) and flagged.

Sampling (temperature 0.7, top-k 50, top-p 0.9, a repetition penalty of 1.1 on generated tokens, since
SmolLM2 greedy loops easily) draws from one seeded generator, so the same arguments give the same data.
The collection also times one decode step at batch 1 and 10, so the training report can put the predictor's
cost next to the LLM's on the same machine.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from services.predictor.data import LengthData, task_summary
from services.predictor.decode import Decoder, Generated, Sampling, time_decode_step
from services.predictor.llm import LoadedLLM
from services.predictor.model import TAP_POINT
from services.predictor.prompts import prompt_set


def stop_ids(llm: LoadedLLM) -> set[int]:
    ids = {llm.tokenizer.eos_token_id}
    configured = llm.model.generation_config.eos_token_id
    ids.update(configured if isinstance(configured, list) else [configured])
    return {int(i) for i in ids if i is not None}


def _eta(seconds: float) -> str:
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


def collect(llm: LoadedLLM, *, requests: int, max_new_tokens: int = 256, k: int = 20, seed: int = 0,
            batch_size: int = 32, sampling: Sampling | None = None, progress_every: int = 32,
            progress: Callable[[str], None] = print) -> LengthData:
    """Run ``requests`` prompts of the project's prompt set and return the recorded samples."""
    sampling = sampling or Sampling()
    prompts = prompt_set(requests, seed=seed)
    decoder = Decoder(llm.model, llm.tokenizer, stop_ids=stop_ids(llm), max_new_tokens=max_new_tokens, k=k,
                      sampling=sampling, seed=seed, batch_size=batch_size)
    load_before = os.getloadavg()[0]
    finished: dict[str, Generated] = {}
    t0 = time.monotonic()
    tokens = 0
    for record in decoder.run(prompts):
        finished[record.prompt.pid] = record
        tokens += len(record.tokens)
        if len(finished) % progress_every == 0 or len(finished) == len(prompts):
            elapsed = time.monotonic() - t0
            eta = elapsed / len(finished) * (len(prompts) - len(finished))
            progress(f"{len(finished)}/{len(prompts)} requests, {tokens} tokens in {elapsed:.0f}s "
                     f"({tokens / elapsed:.0f} tok/s, {decoder.steps} decode steps), ETA {_eta(eta)}")
    wall = time.monotonic() - t0
    records = [finished[p.pid] for p in prompts]  # back in prompt order, so the data does not depend on timing
    rid, position, remaining, hidden = [], [], [], []
    for i, r in enumerate(records):
        for g, h in zip(r.positions, r.hidden, strict=True):
            rid.append(i)
            position.append(g)
            remaining.append(len(r.tokens) - g)
            hidden.append(h)
    progress("timing one decode step at batch 1 and 10 ...")
    step_ms = {str(b): statistics.median(time_decode_step(llm.model, llm.tokenizer, b)) * 1000 for b in (1, 10)}
    import transformers

    meta: dict[str, Any] = {
        "model": llm.name, "hidden_size": llm.hidden_size, "source": llm.source, "k": k, "seed": seed,
        "requests": requests, "max_new_tokens": max_new_tokens, "batch_size": batch_size,
        "sampling": asdict(sampling), "tap_point": TAP_POINT, "threads": torch.get_num_threads(),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "generated_tokens": tokens, "decode_steps": decoder.steps, "wall_s": round(wall, 1),
        "tokens_per_s": round(tokens / wall, 1), "decode_step_ms": step_ms,
        # other work on the machine slows generation and the timings: say how busy it was
        "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    decode = llm.tokenizer.decode
    return LengthData(
        hidden=np.stack(hidden).astype(np.float32), rid=np.array(rid), position=np.array(position),
        remaining=np.array(remaining), tasks=[r.prompt.task for r in records],
        prompts=[r.prompt.text for r in records], output_len=np.array([len(r.tokens) for r in records]),
        hit_cap=np.array([r.hit_cap for r in records]), outputs=[decode(r.tokens) for r in records], meta=meta)


def write_collection(data: LengthData, out_dir: Path) -> Path:
    """``samples.npz`` plus ``collect.json`` (metadata, content hash, per-task lengths) in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "samples.npz"
    data.save(path)
    summary = {**data.meta, "samples": int(data.hidden.shape[0]), "content_sha256": data.content_sha256(),
               "tasks": task_summary(data)}
    (out_dir / "collect.json").write_text(json.dumps(summary, indent=2) + "\n")
    return path
