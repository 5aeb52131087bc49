"""Time a Llama-3.1-8B-shaped forward pass on a GPU: the raw numbers behind the latency model's shapes.

Standalone on purpose (torch and the standard library only): it runs on a lent GPU machine where the
project's own dependencies are not installed. ``tests/bench/gpu_latency_check.py`` reads what it writes,
fits the latency model (shared/latency) to it and compares with the shipped profile.

Weights are random bf16 of the real shapes (hidden 4096, 32 layers, 32 query / 8 KV heads of 128, MLP
14336, vocab 128256): the time of dense kernels does not depend on the values. What it measures:

- ``prefill``: one prompt of L tokens alone, a whole forward pass (logits for the last token only, as
  SGLang computes them), for L from 128 to 32K;
- ``operators``: the five operators of every layer (qkv_proj with the norm and RoPE, attention, o_proj,
  gate_up_proj with the norm, down_proj with the activation), timed with CUDA events inside one pass:
  the longest one bounds how long an operator-level preemption (FlowPrefill) blocks;
- ``preemption``: a prefill that checks a flag between operators and synchronises after each, with the
  flag set at a random moment by another thread: the measured blocking, and what the checks cost;
- ``packing``: k prompts of s tokens prefilled one pass each versus packed into one pass (DOPD's
  length-aware batching relies on the packed pass being cheaper than the latency model's one launch),
  launched eagerly and replayed from CUDA graphs (the GPU's time alone, without Python's launch gaps);
- ``chunking``: one prompt prefilled in chunks of C tokens (each chunk a pass whose attention reads the
  KV of the chunks before it, as SGLang's chunked prefill), the cost of small chunks;
- ``prefill_graph``: short prompts' passes replayed from CUDA graphs, for the same reason;
- ``decode``: one decode step over B sequences of C context tokens each, replayed from a CUDA graph
  (SGLang captures its decode steps in graphs) and, for comparison, launched eagerly.
- ``mixed``: a colocated engine's mixed step (SGLang's mixed chunk): one pass carrying a decode batch of B
  sequences of C context tokens each and a prefill chunk of K new tokens after D already prefilled, the
  B + K rows together through the matrix products, attention per part (decode rows over their own KV,
  the chunk's rows causal over D + K). Timed next to the decode step alone and the chunk alone, the three
  replayed from CUDA graphs in interleaved rounds (the GPU's time), and the mixed pass eagerly as well
  (SGLang runs mixed steps without a graph).

Attention is torch's scaled_dot_product_attention (flash on Hopper where it accepts the shapes), not
SGLang's FlashInfer/FA3 kernels, and the KV cache is dense, not paged; the report says so.

    python tests/bench/gpu/llama_forward.py --out raw.json            # on the GPU machine
    python tests/bench/gpu/llama_forward.py --tiny --out raw.json     # a seconds-long CPU smoke run
    python tests/bench/gpu/llama_forward.py --sections mixed --out mixed.json   # some sections only
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import math
import os
import platform
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

OPERATORS = ("qkv_proj", "attn", "o_proj", "gate_up_proj", "down_proj")
SECTIONS = ("prefill", "chunking", "operators", "preemption", "packing", "prefill_graph", "decode", "mixed")


@dataclass(frozen=True)
class Shape:
    hidden: int = 4096
    layers: int = 32
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    ffn: int = 14336
    vocab: int = 128256
    rope_theta: float = 500000.0


TINY = Shape(hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, ffn=512, vocab=1000)


class Clock:
    """CUDA events on a GPU (no host sync inside a pass), perf_counter on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def seconds(self, a: Any, b: Any) -> float:
        if self.cuda:
            b.synchronize()
            return float(a.elapsed_time(b)) / 1e3
        return float(b - a)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def runs(self, fn: Callable[[], Any], repeats: int) -> list[float]:
        """Seconds of ``repeats`` runs of ``fn``, each started on an idle device."""
        out = []
        for _ in range(repeats):
            self.sync()
            a = self.mark()
            fn()
            out.append(self.seconds(a, self.mark()))
        return out


class Llama:
    """The decoder's arithmetic over random weights; no module machinery, so operators are easy to cut."""

    def __init__(self, shape: Shape, device: torch.device, dtype: torch.dtype) -> None:
        self.s, self.device, self.dtype = shape, device, dtype
        g = torch.Generator(device=device).manual_seed(0)

        def w(*dims: int) -> torch.Tensor:
            return torch.randn(*dims, generator=g, device=device, dtype=dtype) * (1.0 / math.sqrt(dims[-1]))

        q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
        self.embed = w(shape.vocab, shape.hidden)
        self.layers = [
            {"norm1": torch.ones(shape.hidden, device=device, dtype=dtype),
             "qkv": w(q + 2 * kv, shape.hidden), "o": w(shape.hidden, q),
             "norm2": torch.ones(shape.hidden, device=device, dtype=dtype),
             "gate_up": w(2 * shape.ffn, shape.hidden), "down": w(shape.hidden, shape.ffn)}
            for _ in range(shape.layers)
        ]
        self.norm = torch.ones(shape.hidden, device=device, dtype=dtype)
        self.lm_head = w(shape.vocab, shape.hidden)
        inv = 1.0 / (shape.rope_theta ** (torch.arange(0, shape.head_dim, 2, device=device).float() / shape.head_dim))
        self.inv_freq = inv
        self.sdpa_path = self._probe_sdpa()
        self.chunk_path = ""  # how chunked prefill's prefix attention ran, set on first use

    # -- pieces -------------------------------------------------------------------------------------
    @staticmethod
    def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + 1e-5)).to(x.dtype) * weight

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def _probe_sdpa(self) -> str:
        """Whether SDPA takes grouped KV heads directly (enable_gqa) or needs them repeated."""
        q = torch.zeros(1, self.s.heads, 4, self.s.head_dim, device=self.device, dtype=self.dtype)
        k = torch.zeros(1, self.s.kv_heads, 4, self.s.head_dim, device=self.device, dtype=self.dtype)
        try:
            F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)
            return "sdpa-gqa"
        except (TypeError, RuntimeError):
            return "sdpa-repeat-kv"

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
        if self.sdpa_path == "sdpa-gqa":
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        rep = self.s.heads // self.s.kv_heads
        return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                              is_causal=causal)

    # -- prefill, operator by operator --------------------------------------------------------------
    def prefill_ops(self, ids: torch.Tensor) -> list[Callable[[], None]]:
        """The pass over ``ids`` (k prompts x s tokens) as a list of closures, one per operator, in order,
        plus a last one for the final norm and the last tokens' logits. Running them in order is the pass."""
        s = self.s
        k_prompts, seq = ids.shape
        cos, sin = self.rope(torch.arange(seq, device=self.device))
        state: dict[str, torch.Tensor] = {"x": self.embed[ids.reshape(-1)]}
        q_dim, kv_dim = s.heads * s.head_dim, s.kv_heads * s.head_dim

        def heads(t: torch.Tensor, n: int) -> torch.Tensor:
            return t.view(k_prompts, seq, n, s.head_dim).transpose(1, 2)

        ops: list[Callable[[], None]] = []
        for layer in self.layers:
            def qkv_proj(layer: dict[str, torch.Tensor] = layer) -> None:
                qkv = self.rms(state["x"], layer["norm1"]) @ layer["qkv"].T
                q, k, v = qkv.split([q_dim, kv_dim, kv_dim], dim=-1)
                state["q"] = self.rotate(heads(q, s.heads), cos, sin)
                state["k"] = self.rotate(heads(k, s.kv_heads), cos, sin)
                state["v"] = heads(v, s.kv_heads)

            def attn() -> None:
                out = self.attention(state["q"], state["k"], state["v"], causal=True)
                state["a"] = out.transpose(1, 2).reshape(k_prompts * seq, q_dim)

            def o_proj(layer: dict[str, torch.Tensor] = layer) -> None:
                state["x"] = state["x"] + state["a"] @ layer["o"].T

            def gate_up_proj(layer: dict[str, torch.Tensor] = layer) -> None:
                state["gu"] = self.rms(state["x"], layer["norm2"]) @ layer["gate_up"].T

            def down_proj(layer: dict[str, torch.Tensor] = layer) -> None:
                gate, up = state["gu"].chunk(2, dim=-1)
                state["x"] = state["x"] + (F.silu(gate) * up) @ layer["down"].T

            ops += [qkv_proj, attn, o_proj, gate_up_proj, down_proj]

        def logits() -> None:
            last = state["x"].view(k_prompts, seq, s.hidden)[:, -1]
            state["logits"] = self.rms(last, self.norm) @ self.lm_head.T
            state["next"] = state["logits"].argmax(-1)

        ops.append(logits)
        self._last_state = state
        return ops

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """The pass; returns the last tokens' logits."""
        for op in self.prefill_ops(ids):
            op()
        return self._last_state["logits"]

    def prefill_chunked(self, ids: torch.Tensor, chunk: int) -> torch.Tensor:
        """Chunked prefill of one prompt: each chunk a whole pass whose attention reads the KV of the chunks
        before it (SGLang's chunked prefill; one pass per chunk, logits only after the last)."""
        s = self.s
        seq = ids.shape[1]
        q_dim, kv_dim = s.heads * s.head_dim, s.kv_heads * s.head_dim
        kc = torch.empty(s.layers, 1, s.kv_heads, seq, s.head_dim, device=self.device, dtype=self.dtype)
        vc = torch.empty_like(kc)
        x = self.embed[ids[0, :0]]
        for start in range(0, seq, chunk):
            end = min(seq, start + chunk)
            n = end - start
            cos, sin = self.rope(torch.arange(start, end, device=self.device))
            x = self.embed[ids[0, start:end]]
            for i, layer in enumerate(self.layers):
                qkv = self.rms(x, layer["norm1"]) @ layer["qkv"].T
                q, k, v = qkv.split([q_dim, kv_dim, kv_dim], dim=-1)
                q = self.rotate(q.view(1, n, s.heads, s.head_dim).transpose(1, 2), cos, sin)
                kc[i, :, :, start:end] = self.rotate(k.view(1, n, s.kv_heads, s.head_dim).transpose(1, 2), cos, sin)
                vc[i, :, :, start:end] = v.view(1, n, s.kv_heads, s.head_dim).transpose(1, 2)
                a = self.attention_prefix(q, kc[i, :, :, :end], vc[i, :, :, :end])
                x = x + a.transpose(1, 2).reshape(n, q_dim) @ layer["o"].T
                gate, up = (self.rms(x, layer["norm2"]) @ layer["gate_up"].T).chunk(2, dim=-1)
                x = x + (F.silu(gate) * up) @ layer["down"].T
        return self.rms(x[-1:], self.norm) @ self.lm_head.T

    def attention_prefix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of a chunk's queries over the prefix and itself (masks aligned bottom-right)."""
        n, total = q.shape[2], k.shape[2]
        if n == total:
            return self.attention(q, k, v, causal=True)
        from torch.nn.attention.bias import causal_lower_right

        mask = causal_lower_right(n, total)
        if self.chunk_path in ("", "lower-right-gqa"):
            try:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
                self.chunk_path = "lower-right-gqa"
                return out
            except (TypeError, RuntimeError, NotImplementedError):
                self.chunk_path = "lower-right-repeat-kv"
        rep = self.s.heads // self.s.kv_heads
        return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                              attn_mask=mask)

    # -- decode -------------------------------------------------------------------------------------
    def decode_step_fn(self, batch: int, context: int) -> Callable[[], torch.Tensor]:
        """One decode step over ``batch`` sequences whose caches hold ``context`` tokens (the new one at
        the last slot). Static shapes and buffers only, so the step can be captured in a CUDA graph."""
        s = self.s
        q_dim, kv_dim = s.heads * s.head_dim, s.kv_heads * s.head_dim
        kc = torch.zeros(s.layers, batch, s.kv_heads, context, s.head_dim, device=self.device, dtype=self.dtype)
        vc = torch.zeros_like(kc)
        ids = torch.zeros(batch, dtype=torch.long, device=self.device)
        cos, sin = self.rope(torch.tensor([context - 1], device=self.device))

        def step() -> torch.Tensor:
            x = self.embed[ids]
            for i, layer in enumerate(self.layers):
                qkv = self.rms(x, layer["norm1"]) @ layer["qkv"].T
                q, k, v = qkv.split([q_dim, kv_dim, kv_dim], dim=-1)
                q = self.rotate(q.view(batch, s.heads, 1, s.head_dim), cos, sin)
                kc[i, :, :, context - 1] = self.rotate(k.view(batch, s.kv_heads, 1, s.head_dim), cos, sin)[:, :, 0]
                vc[i, :, :, context - 1] = v.view(batch, s.kv_heads, s.head_dim)
                a = self.attention(q, kc[i], vc[i], causal=False).reshape(batch, q_dim)
                x = x + a @ layer["o"].T
                gate, up = (self.rms(x, layer["norm2"]) @ layer["gate_up"].T).chunk(2, dim=-1)
                x = x + (F.silu(gate) * up) @ layer["down"].T
            ids.copy_((self.rms(x, self.norm) @ self.lm_head.T).argmax(-1))
            return ids

        return step

    # -- mixed (colocated) step ------------------------------------------------------------------------
    def kv_cache(self, batch: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense K and V caches for ``batch`` sequences of ``tokens`` slots, every layer."""
        s = self.s
        kc = torch.zeros(s.layers, batch, s.kv_heads, tokens, s.head_dim, device=self.device, dtype=self.dtype)
        return kc, torch.zeros_like(kc)

    def mixed_step_fn(self, batch: int, context: int, chunk: int, done: int,
                      decode_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                      chunk_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                      ids: torch.Tensor | None = None) -> Callable[[], torch.Tensor]:
        """One forward pass carrying a decode batch and a prefill chunk (SGLang's mixed chunk).

        Decode rows: ``batch`` sequences whose caches (``decode_kv``, [layers, batch, kv_heads, >= context,
        head_dim]) hold ``context`` tokens, the new one at slot ``context - 1``, as :meth:`decode_step_fn`.
        Chunk rows: ``chunk`` new tokens of one prompt after ``done`` already prefilled, their KV written at
        ``done:done + chunk`` of ``chunk_kv`` ([layers, 1, kv_heads, >= done + chunk, head_dim]) and their
        attention causal over the ``done + chunk`` tokens. ``ids`` holds the batch + chunk input tokens (zeros
        by default). The qkv, o, gate_up and down products run once over all batch + chunk rows; attention
        runs per part. ``batch = 0`` is the chunk alone, ``chunk = 0`` the decode step alone.

        The step returns the logits of the decode rows and of the chunk's last token (batch + 1 rows, or
        batch, or 1) and samples them greedily, as a decode step does. Static shapes and buffers only, so
        it can be captured in a CUDA graph.
        """
        s = self.s
        if batch <= 0 and chunk <= 0:
            raise ValueError("a mixed step needs decode rows or chunk rows")
        q_dim, kv_dim = s.heads * s.head_dim, s.kv_heads * s.head_dim
        end = done + chunk
        dk, dv = decode_kv if decode_kv is not None else self.kv_cache(batch, context) if batch else (None, None)
        ck, cv = chunk_kv if chunk_kv is not None else self.kv_cache(1, end) if chunk else (None, None)
        if ids is None:
            ids = torch.zeros(batch + chunk, dtype=torch.long, device=self.device)
        if ids.shape != (batch + chunk,):
            raise ValueError(f"ids must hold {batch + chunk} tokens, got {tuple(ids.shape)}")
        dcos, dsin = self.rope(torch.tensor([max(context - 1, 0)], device=self.device))
        ccos, csin = self.rope(torch.arange(done, end, device=self.device))
        out_rows = torch.tensor(list(range(batch)) + ([batch + chunk - 1] if chunk else []), device=self.device)
        sampled = torch.zeros(len(out_rows), dtype=torch.long, device=self.device)

        def step() -> torch.Tensor:
            x = self.embed[ids]
            for i, layer in enumerate(self.layers):
                qkv = self.rms(x, layer["norm1"]) @ layer["qkv"].T
                q, k, v = qkv.split([q_dim, kv_dim, kv_dim], dim=-1)
                parts = []
                if batch:
                    qd = self.rotate(q[:batch].view(batch, s.heads, 1, s.head_dim), dcos, dsin)
                    dk[i, :, :, context - 1] = self.rotate(k[:batch].view(batch, s.kv_heads, 1, s.head_dim),
                                                           dcos, dsin)[:, :, 0]
                    dv[i, :, :, context - 1] = v[:batch].view(batch, s.kv_heads, s.head_dim)
                    parts.append(self.attention(qd, dk[i, :, :, :context], dv[i, :, :, :context],
                                                causal=False).reshape(batch, q_dim))
                if chunk:
                    qc = self.rotate(q[batch:].view(1, chunk, s.heads, s.head_dim).transpose(1, 2), ccos, csin)
                    ck[i, :, :, done:end] = self.rotate(
                        k[batch:].view(1, chunk, s.kv_heads, s.head_dim).transpose(1, 2), ccos, csin)
                    cv[i, :, :, done:end] = v[batch:].view(1, chunk, s.kv_heads, s.head_dim).transpose(1, 2)
                    a = self.attention_prefix(qc, ck[i, :, :, :end], cv[i, :, :, :end])
                    parts.append(a.transpose(1, 2).reshape(chunk, q_dim))
                x = x + (parts[0] if len(parts) == 1 else torch.cat(parts)) @ layer["o"].T
                gate, up = (self.rms(x, layer["norm2"]) @ layer["gate_up"].T).chunk(2, dim=-1)
                x = x + (F.silu(gate) * up) @ layer["down"].T
            last = x if not chunk else x[out_rows]
            logits = self.rms(last, self.norm) @ self.lm_head.T
            sampled.copy_(logits.argmax(-1))
            return logits

        return step


# -- measurements ---------------------------------------------------------------------------------------
def tokens(model: Llama, k: int, seq: int) -> torch.Tensor:
    return torch.randint(0, model.s.vocab, (k, seq), device=model.device)


def time_prefill(model: Llama, clock: Clock, k: int, seq: int, repeats: int) -> list[float]:
    ids = tokens(model, k, seq)
    model.prefill(ids)  # warm-up: kernels chosen, allocator primed
    return clock.runs(lambda: model.prefill(ids), repeats)


def capture(clock: Clock, fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` replayed from a CUDA graph (on a GPU): its kernels' time without the host's launch gaps."""
    if not clock.cuda:
        return fn
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def time_chunked(model: Llama, clock: Clock, seq: int, chunk: int, repeats: int) -> list[float]:
    ids = tokens(model, 1, seq)
    model.prefill_chunked(ids, chunk)
    return clock.runs(lambda: model.prefill_chunked(ids, chunk), repeats)


def time_prefill_graph(model: Llama, clock: Clock, k: int, seq: int, repeats: int) -> list[float]:
    """A pass's GPU time alone: eager torch launches ~20 small kernels per layer from Python, and for short
    prompts the GPU waits on the host (SGLang's fused kernels wait far less), so the eager time of a short
    prompt is mostly launch gaps."""
    ids = tokens(model, k, seq)
    run = capture(clock, lambda: model.prefill(ids))
    return clock.runs(run, repeats)


def time_operators(model: Llama, clock: Clock, seq: int) -> list[float]:
    """Per-operator times of one pass (warm), in pass order: layers x 5, then the logits."""
    ids = tokens(model, 1, seq)
    model.prefill(ids)
    clock.sync()
    ops = model.prefill_ops(ids)
    marks = [clock.mark()]
    for op in ops:
        op()
        marks.append(clock.mark())
    clock.sync()
    return [clock.seconds(a, b) for a, b in zip(marks, marks[1:], strict=False)]


def preemptible_prefill(model: Llama, clock: Clock, ids: torch.Tensor, flag: threading.Event) -> tuple[bool, float]:
    """FlowPrefill's cooperative preemption: run operator by operator, wait for each, stop at the first
    boundary after the flag is set. Returns (stopped early, perf_counter time the GPU went idle)."""
    for op in model.prefill_ops(ids):
        if flag.is_set():
            return True, time.perf_counter()
        op()
        clock.sync()
    return False, time.perf_counter()


def measure_preemption(model: Llama, clock: Clock, seq: int, trials: int, rng: random.Random) -> dict[str, Any]:
    ids = tokens(model, 1, seq)
    model.prefill(ids)
    clock.sync()
    plain = []
    for _ in range(3):
        t0 = time.perf_counter()
        model.prefill(ids)
        clock.sync()
        plain.append(time.perf_counter() - t0)
    checked = []
    for _ in range(3):
        t0 = time.perf_counter()
        preemptible_prefill(model, clock, ids, threading.Event())
        checked.append(time.perf_counter() - t0)
    pass_s = min(plain)
    blocking = []
    for _ in range(trials):
        flag = threading.Event()
        fire = rng.uniform(0.05, 0.95) * pass_s
        fired: list[float] = []

        def trigger(flag: threading.Event = flag, fire: float = fire, fired: list[float] = fired) -> None:
            time.sleep(fire)
            fired.append(time.perf_counter())
            flag.set()

        thread = threading.Thread(target=trigger)
        thread.start()
        stopped, idle_at = preemptible_prefill(model, clock, ids, flag)
        thread.join()
        if stopped and fired:
            blocking.append(idle_at - fired[0])
    return {"tokens": seq, "plain_pass_s": plain, "checked_pass_s": checked, "blocking_s": blocking,
            "trials": trials}


def time_decode(model: Llama, clock: Clock, batch: int, context: int, steps: int, graph: bool) -> float:
    step = model.decode_step_fn(batch, context)
    run = capture(clock, step) if graph else step
    for _ in range(3):
        run()
    clock.sync()
    a = clock.mark()
    for _ in range(steps):
        run()
    return clock.seconds(a, clock.mark()) / steps


def mixed_key(r: dict[str, Any]) -> tuple[int, int, int, int]:
    return (r["batch"], r["context"], r["chunk"], r["done"])


class MixedLog:
    """The mixed section's progress as JSON lines (with ``--parts``), so that a process that dies mid-run (a
    crash inside a CUDA graph, say) is resumed by the next one: the configurations measured are kept, the one
    that was running when it died is reported as failed and skipped. Without a path it lives in memory."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.records: dict[tuple[int, ...], dict[str, Any]] = {}
        self.failed: dict[tuple[int, ...], str] = {}
        self.current: tuple[int, ...] | None = None
        started: set[tuple[int, ...]] = set()
        if path and os.path.exists(path):
            with open(path) as f:
                for line in f:
                    try:
                        event = json.loads(line)
                    except json.JSONDecodeError:
                        continue  # a line the crash cut short
                    if "start" in event:
                        started.add(tuple(event["start"]))
                    elif "record" in event:
                        self.records[mixed_key(event["record"])] = event["record"]
                    elif "failed" in event:
                        self.failed[tuple(event["failed"])] = event["error"]
        for key in started - set(self.records) - set(self.failed):
            self.fail(key, "the process died while this ran (a crash: see the log)")

    def _write(self, event: dict[str, Any]) -> None:
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(event) + "\n")
                f.flush()
                os.fsync(f.fileno())

    def pending(self, key: tuple[int, ...]) -> bool:
        return key not in self.records and key not in self.failed

    def start(self, key: tuple[int, ...]) -> None:
        self.current = key
        self._write({"start": list(key)})

    def record(self, rec: dict[str, Any]) -> None:
        self.records[mixed_key(rec)] = rec
        self.current = None
        self._write({"record": rec})

    def fail(self, key: tuple[int, ...], error: str) -> None:
        self.failed[key] = error
        self._write({"failed": list(key), "error": error})


def measure_mixed(model: Llama, clock: Clock, batch: int, context: int, shapes: list[tuple[int, int]], rounds: int,
                  eager_runs: int, progress: Callable[[str], None], log: MixedLog) -> None:
    """Mixed steps of a decode batch of ``batch`` x ``context`` with each (chunk, done) of ``shapes``, next to
    the decode step alone and the chunk alone. The three share their caches and are replayed from CUDA graphs
    (on a GPU) in ``rounds`` interleaved rounds, each replay timed with its own events; the mixed pass is then
    also run eagerly ``eager_runs`` times after one warm-up. Each shape's graphs are freed before the next's.

    A graph replays the buffers its step closed over (input ids, RoPE tables, outputs) without holding them:
    every step is kept in a variable for as long as its graph is replayed."""
    log.start((batch, context, *shapes[0]))
    decode_kv = model.kv_cache(batch, context)
    chunk_kv = model.kv_cache(1, max(c + d for c, d in shapes))
    decode_step = model.mixed_step_fn(batch, context, 0, 0, decode_kv=decode_kv)
    decode = capture(clock, decode_step)
    for chunk, done in shapes:
        log.start((batch, context, chunk, done))
        alone_step = model.mixed_step_fn(0, 0, chunk, done, chunk_kv=chunk_kv)
        alone = capture(clock, alone_step)
        mixed_step = model.mixed_step_fn(batch, context, chunk, done, decode_kv=decode_kv, chunk_kv=chunk_kv)
        mixed = capture(clock, mixed_step)
        runs = {"decode_s": decode, "chunk_s": alone, "mixed_s": mixed}
        times: dict[str, list[float]] = {k: [] for k in runs}
        for _ in range(2):  # warm-up replays
            for fn in runs.values():
                fn()
        for _ in range(rounds):
            clock.sync()
            for name, fn in runs.items():
                a = clock.mark()
                fn()
                times[name].append(clock.seconds(a, clock.mark()))
        mixed_step()  # eager warm-up
        eager = clock.runs(mixed_step, eager_runs)
        clock.sync()
        del runs, fn, alone, mixed  # the graphs go before the steps whose buffers they replay
        del alone_step, mixed_step
        if clock.cuda:
            torch.cuda.empty_cache()
        log.record({"batch": batch, "context": context, "chunk": chunk, "done": done, **times,
                    "mixed_eager_s": eager})
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        progress(f"mixed B={batch:>3} C={context:>5} + chunk K={chunk:>5} after D={done:>5}: mixed {med['mixed_s']:.2f} ms"
                 f" (eager {statistics.median(eager) * 1e3:.2f}), decode {med['decode_s']:.2f} + chunk "
                 f"{med['chunk_s']:.2f} = {med['decode_s'] + med['chunk_s']:.2f} ms apart")
    clock.sync()
    del decode
    del decode_step


# -- the run --------------------------------------------------------------------------------------------
def plan(tiny: bool) -> dict[str, Any]:
    if tiny:
        return {"prefill": [16, 32, 64, 128], "operators": [64], "preemption": [128], "packing": [(4, 16), (2, 32)],
                "decode": [(1, 32), (4, 32), (4, 64), (8, 16)],
                "prefill_graph": [16, 64], "chunking": [(64, 16), (64, 64)], "repeats": 2, "trials": 3, "steps": 3,
                "mixed": {"decode": [(2, 16), (4, 32)], "chunks": [(8, 0), (16, 0), (8, 24)], "rounds": 2, "eager": 1}}
    return {
        "prefill": [128, 256, 512, 1024, 2048, 3072, 4096, 6144, 8192, 12288, 16384, 24576, 32768],
        "operators": [512, 2048, 8192, 32768],
        "preemption": [2048, 8192, 32768],
        "packing": [(64, 32), (16, 128), (8, 256), (4, 512), (2, 1024), (16, 512)],
        # (batch, context per sequence); batch x context stays within an H100's KV for this model
        "prefill_graph": [128, 256, 512, 1024, 2048, 4096, 8192],
        "chunking": [(8192, c) for c in (1024, 2048, 4096, 8192)]
                    + [(32768, c) for c in (1024, 2048, 4096, 8192, 16384, 32768)],
        "decode": [(1, 512), (1, 4096), (1, 16384), (8, 1024), (8, 8192), (32, 512), (32, 2048), (32, 8192),
                   (64, 512), (64, 1024), (64, 2048), (64, 4096), (128, 256), (128, 1024), (128, 2048),
                   (256, 256), (256, 512), (256, 1024)],
        # decode batch (B, context each) x prefill chunk (K new tokens, D done before it): B x C + D + K stays
        # within an H100's memory next to the weights (B = 128 x 2048 is 32 GiB of KV)
        "mixed": {"decode": [(b, c) for b in (8, 32, 64, 128) for c in (512, 2048)],
                  "chunks": [(k, d) for d in (0, 4096) for k in (256, 512, 1024, 2048, 4096)],
                  "rounds": 7, "eager": 2},
        "repeats": 5, "trials": 25, "steps": 30,
    }


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiny", action="store_true", help="toy shapes on the CPU: checks the script, measures nothing")
    ap.add_argument("--parts", help="the mixed section's progress file (JSON lines): a rerun resumes from it, "
                    "skipping what is measured and what was running when a process died")
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help=f"comma-separated sections to run (default all: {','.join(SECTIONS)})")
    args = ap.parse_args(argv)
    sections = [x.strip() for x in args.sections.split(",") if x.strip()]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown or not sections:
        print(f"unknown sections {unknown or '(none given)'}; choose from {','.join(SECTIONS)}", file=sys.stderr)
        return 2
    faulthandler.enable()  # a crash in native code says where
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu" and not args.tiny:
        print("no GPU: use --tiny for a smoke run", file=sys.stderr)
        return 2
    shape = TINY if args.tiny else Shape()
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    p = plan(args.tiny)
    rng = random.Random(0)
    clock = Clock(device)
    result: dict[str, Any] = {
        "shape": asdict(shape), "dtype": str(dtype), "torch": torch.__version__, "python": platform.python_version(),
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu", "tiny": args.tiny, "argv": argv,
        "sections": sections, **{name: [] for name in SECTIONS},
    }
    t_start = time.perf_counter()

    def progress(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", flush=True)

    with torch.inference_mode():
        model = Llama(shape, device, dtype)
        result["sdpa_path"] = model.sdpa_path
        progress(f"model ready on {result['device']} ({model.sdpa_path})")
        for seq in (p["prefill"] if "prefill" in sections else []):
            secs = time_prefill(model, clock, 1, seq, p["repeats"])
            result["prefill"].append({"tokens": seq, "seconds": secs})
            progress(f"prefill {seq:>6} tokens: {statistics.median(secs) * 1e3:8.2f} ms")
        for seq, chunk in (p["chunking"] if "chunking" in sections else []):
            secs = time_chunked(model, clock, seq, chunk, p["repeats"])
            result["chunking"].append({"tokens": seq, "chunk": chunk, "seconds": secs})
            progress(f"chunked prefill {seq:>6} in {chunk:>6}-token chunks: {min(secs) * 1e3:8.2f} ms "
                     f"({model.chunk_path or 'one pass'})")
        for seq in (p["operators"] if "operators" in sections else []):
            op_s = time_operators(model, clock, seq)
            result["operators"].append({"tokens": seq, "op_s": op_s})
            progress(f"operators {seq:>6}: longest {max(op_s[:-1]) * 1e3:.3f} ms of {sum(op_s) * 1e3:.1f} ms")
        for seq in (p["preemption"] if "preemption" in sections else []):
            rec = measure_preemption(model, clock, seq, p["trials"], rng)
            result["preemption"].append(rec)
            b = rec["blocking_s"]
            progress(f"preemption {seq:>6}: blocking max {max(b, default=0) * 1e3:.3f} ms over {len(b)} cuts")
        for k, seq in (p["packing"] if "packing" in sections else []):
            one = time_prefill(model, clock, 1, seq, p["repeats"])
            packed = time_prefill(model, clock, k, seq, p["repeats"])
            one_g = time_prefill_graph(model, clock, 1, seq, p["repeats"])
            packed_g = time_prefill_graph(model, clock, k, seq, p["repeats"])
            result["packing"].append({"prompts": k, "tokens": seq, "one_s": one, "packed_s": packed,
                                      "one_graph_s": one_g, "packed_graph_s": packed_g})
            progress(f"packing {k} x {seq}: {k * min(one) * 1e3:.2f} ms apart, {min(packed) * 1e3:.2f} ms packed; "
                     f"GPU time {k * min(one_g) * 1e3:.2f} vs {min(packed_g) * 1e3:.2f} ms")
            clock.sync()
        for seq in (p["prefill_graph"] if "prefill_graph" in sections else []):
            secs = time_prefill_graph(model, clock, 1, seq, p["repeats"])
            result["prefill_graph"].append({"tokens": seq, "seconds": secs})
            progress(f"prefill {seq:>6} tokens, GPU time: {statistics.median(secs) * 1e3:8.2f} ms")
        for batch, ctx in (p["decode"] if "decode" in sections else []):
            rec = {"batch": batch, "context": ctx,
                   "graph_step_s": time_decode(model, clock, batch, ctx, p["steps"], graph=True),
                   "eager_step_s": time_decode(model, clock, batch, ctx, p["steps"], graph=False)}
            result["decode"].append(rec)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            progress(f"decode B={batch:>3} C={ctx:>5}: graph {rec['graph_step_s'] * 1e3:.2f} ms, "
                     f"eager {rec['eager_step_s'] * 1e3:.2f} ms")
        if "mixed" in sections:
            m = p["mixed"]
            log = MixedLog(args.parts)
            result["mixed_timing"] = ("CUDA-graph replays, interleaved rounds; mixed_eager_s eager" if clock.cuda
                                      else "eager (no GPU)")
            order = [(b, c, k, d) for b, c in m["decode"] for k, d in m["chunks"]]

            def finish_mixed() -> None:
                result["mixed"] = [log.records[key] for key in order if key in log.records]
                result["mixed_errors"] = [{"batch": b, "context": c, "chunk": k, "done": d, "error": log.failed[key]}
                                          for key in order if key in log.failed for b, c, k, d in [key]]
                with open(args.out, "w") as f:  # what is measured so far survives a later crash
                    json.dump(result, f, indent=1)

            for batch, ctx in m["decode"]:
                shapes = [(k, d) for k, d in m["chunks"] if log.pending((batch, ctx, k, d))]
                if not shapes:
                    continue
                try:
                    measure_mixed(model, clock, batch, ctx, shapes, m["rounds"], m["eager"], progress, log)
                except torch.cuda.OutOfMemoryError as exc:  # too big for the GPU: the other batches go on
                    for k, d in shapes:
                        if log.pending((batch, ctx, k, d)):
                            log.fail((batch, ctx, k, d), f"out of memory: {exc!r}"[:500])
                    progress(f"mixed B={batch} C={ctx}: out of memory")
                except RuntimeError as exc:  # a CUDA error leaves the context unusable: a fresh process resumes
                    if log.current is not None:
                        log.fail(log.current, repr(exc)[:500])
                    finish_mixed()
                    progress(f"mixed B={batch} C={ctx} failed: {exc!r}"[:300])
                    return 3
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                finish_mixed()
            finish_mixed()
        result["chunk_path"] = model.chunk_path
    result["wall_s"] = time.perf_counter() - t_start
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    progress(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
