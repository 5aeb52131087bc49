"""A small continuous-batching decode loop for transformers causal LMs on CPU, tapping the hidden state.

Why not ``generate()``: we need the tensor the LM head reads (``model.model(...).last_hidden_state``: after the
final norm, `model.TAP_POINT`) at chosen steps, and a fixed batch would spend most of its steps on a few
long requests. Here finished rows leave the batch and its KV cache, and new prompts join it: they are
prefilled on their own and merged in, every row left-padded so all rows end at the newest column (the
layout ``generate()`` uses for a padded batch), with each row's position ids kept explicitly. Columns no row
uses any more are trimmed off the left.

For each request the prefill pass (generated = 0) and the forward passes at generated = k, 2k, ... are
recorded: the hidden state of the pass and how many tokens the request had generated when it ran.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from services.predictor.prompts import Prompt

if TYPE_CHECKING:
    from services.predictor.serving import EnginePredictor


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.7
    top_k: int = 50  # top-p runs inside the 50 likeliest tokens: sorting the whole 49k vocabulary cost ~15% of a step
    top_p: float = 0.9
    repetition_penalty: float = 1.1  # on tokens this request already generated (1.0 = off)

    def pick(self, logits: torch.Tensor, seen: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Next token per row of ``logits`` [B, V]; ``seen`` [B, V] marks each row's generated tokens."""
        if self.repetition_penalty != 1.0:
            penalised = torch.where(logits > 0, logits / self.repetition_penalty, logits * self.repetition_penalty)
            logits = torch.where(seen, penalised, logits)
        if self.temperature <= 0:
            return logits.argmax(-1)
        top, index = logits.topk(min(self.top_k, logits.shape[-1]), dim=-1)  # sorted, largest first
        probs = torch.softmax(top / self.temperature, dim=-1)
        outside = probs.cumsum(-1) - probs > self.top_p  # keeps the token that crosses top_p
        choice = torch.multinomial(probs.masked_fill(outside, 0.0), 1, generator=generator)
        return index.gather(-1, choice).squeeze(-1)


@dataclass
class Generated:
    """One request's generation and its recorded samples."""

    prompt: Prompt
    tokens: list[int] = field(default_factory=list)
    hit_cap: bool = False
    positions: list[int] = field(default_factory=list)  # tokens generated when each hidden state was computed
    hidden: list[np.ndarray] = field(default_factory=list)
    # With an online predictor, after every forward pass: (generated, estimated tokens still to come, whether
    # the MLP predicted it in this pass rather than counting down)
    estimates: list[tuple[int, float, bool]] = field(default_factory=list)


def chat_inputs(tokenizer: Any, prompts: Sequence[Prompt]) -> dict[str, torch.Tensor]:
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p.text}], add_generation_prompt=True,
                                           tokenize=False) for p in prompts]
    # The chat template already holds the special tokens; left padding keeps every row's last token last.
    tokenizer.padding_side = "left"
    return dict(tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False))


def _left_pad(x: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    pad = length - x.shape[dim]
    if pad <= 0:
        return x
    shape = list(x.shape)
    shape[dim] = pad
    return torch.cat([x.new_zeros(shape), x], dim=dim)


class _Batch:
    """The live rows: KV cache, attention mask, next positions, last tokens, and which tokens each generated."""

    def __init__(self, cache: Any, mask: torch.Tensor, position: torch.Tensor, token: torch.Tensor,
                 seen: torch.Tensor, records: list[Generated]) -> None:
        self.cache, self.mask, self.position, self.token, self.seen = cache, mask, position, token, seen
        self.records = records

    def __len__(self) -> int:
        return len(self.records)

    def keep(self, rows: list[int]) -> None:
        index = torch.tensor(rows, dtype=torch.long)
        self.cache.batch_select_indices(index)
        self.mask, self.position = self.mask[index], self.position[index]
        self.token, self.seen = self.token[index], self.seen[index]
        self.records = [self.records[r] for r in rows]
        used = (self.mask.sum(0) > 0).nonzero()
        first = int(used[0]) if len(used) else 0
        if first > 0:  # columns only finished rows used: drop them
            self.mask = self.mask[:, first:]
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[..., first:, :], layer.values[..., first:, :]

    def merge(self, other: _Batch) -> None:
        length = max(self.mask.shape[1], other.mask.shape[1])
        self.mask = torch.cat([_left_pad(self.mask, length, 1), _left_pad(other.mask, length, 1)])
        for mine, theirs in zip(self.cache.layers, other.cache.layers, strict=True):
            mine.keys = torch.cat([_left_pad(mine.keys, length, 2), _left_pad(theirs.keys, length, 2)])
            mine.values = torch.cat([_left_pad(mine.values, length, 2), _left_pad(theirs.values, length, 2)])
        self.position = torch.cat([self.position, other.position])
        self.token = torch.cat([self.token, other.token])
        self.seen = torch.cat([self.seen, other.seen])
        self.records += other.records


class Decoder:
    """Generates prompts with at most ``batch_size`` in flight, recording hidden states every ``k`` tokens.

    With ``predictor`` the loop is also a decode engine running ARES online: the checkpoint predicts each
    request's remaining length at prefill and every ``predictor.k`` iterations, and every request's estimate is
    recorded after each pass (``Generated.estimates``). ``k=0`` records no hidden states.
    """

    def __init__(self, model: Any, tokenizer: Any, *, stop_ids: set[int], max_new_tokens: int, k: int,
                 sampling: Sampling, seed: int, batch_size: int = 32, refill_at: int | None = None,
                 predictor: EnginePredictor | None = None) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.stops = torch.tensor(sorted(stop_ids))
        self.max_new_tokens, self.k, self.sampling, self.batch_size = max_new_tokens, k, sampling, batch_size
        # Prefill joins when this many slots are free (a prefill of one prompt costs about a decode step).
        self.refill_at = refill_at or max(1, batch_size // 4)
        self.generator = torch.Generator().manual_seed(seed)
        self.vocab = model.lm_head.out_features
        self.steps = 0  # decode iterations run
        self.predictor = predictor
        self.step_seconds = 0.0  # wall time of the decode iterations, the predictor's share included

    @torch.inference_mode()
    def run(self, prompts: Sequence[Prompt]) -> Iterator[Generated]:
        """Yield each request as it finishes (not in prompt order)."""
        pending = list(prompts)[::-1]
        batch: _Batch | None = None
        while pending or batch is not None:
            free = self.batch_size - (len(batch) if batch is not None else 0)
            if pending and (batch is None or free >= min(self.refill_at, len(pending))):
                fresh = self._prefill([pending.pop() for _ in range(min(free, len(pending)))])
                yield from self._retire(fresh)
                if len(fresh) and batch is None:
                    batch = fresh
                elif len(fresh) and batch is not None:
                    batch.merge(fresh)
            elif batch is not None:
                self._decode(batch)
                yield from self._retire(batch)
                if not len(batch):
                    batch = None

    def _retire(self, batch: _Batch) -> list[Generated]:
        """Append each row's new token; take finished requests out of ``batch`` and return them."""
        done, keep = self._advance(batch)
        if self.predictor is not None:
            for record in done:
                self.predictor.release(record.prompt.pid)
        if len(keep) < len(batch):
            if keep:
                batch.keep(keep)
            else:
                batch.records = []
        return done

    def _prefill(self, prompts: list[Prompt]) -> _Batch:
        from transformers import DynamicCache

        enc = chat_inputs(self.tokenizer, prompts)
        mask = enc["attention_mask"]
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        cache = DynamicCache(config=self.model.config)
        out = self.model.model(input_ids=enc["input_ids"], attention_mask=mask, position_ids=positions,
                               past_key_values=cache, use_cache=True)
        batch = _Batch(cache, mask, positions[:, -1:], torch.zeros(len(prompts), dtype=torch.long),
                       torch.zeros(len(prompts), self.vocab, dtype=torch.bool), [Generated(prompt=p) for p in prompts])
        self._sample(batch, out.last_hidden_state[:, -1, :], prefill=True)
        return batch

    def _decode(self, batch: _Batch) -> None:
        t0 = time.perf_counter()
        batch.mask = torch.cat([batch.mask, torch.ones(len(batch), 1, dtype=batch.mask.dtype)], dim=-1)
        batch.position = batch.position + 1
        out = self.model.model(input_ids=batch.token.unsqueeze(-1), attention_mask=batch.mask,
                               position_ids=batch.position, past_key_values=batch.cache, use_cache=True)
        self.steps += 1
        self._sample(batch, out.last_hidden_state[:, -1, :])
        self.step_seconds += time.perf_counter() - t0

    def _sample(self, batch: _Batch, hidden: torch.Tensor, prefill: bool = False) -> None:
        """Record the rows whose generated count is a multiple of k, then pick every row's next token."""
        if self.predictor is not None:
            self._predict(batch, hidden, prefill)
        states: np.ndarray | None = None
        for row, record in enumerate(batch.records):
            generated = len(record.tokens)
            if self.k and generated % self.k == 0:
                if states is None:
                    states = hidden.float().numpy()
                record.positions.append(generated)
                record.hidden.append(states[row].copy())
        batch.token = self.sampling.pick(self.model.lm_head(hidden).float(), batch.seen, self.generator)
        batch.seen[torch.arange(len(batch)), batch.token] = True

    def _predict(self, batch: _Batch, hidden: torch.Tensor, prefill: bool) -> None:
        assert self.predictor is not None
        rids = [r.prompt.pid for r in batch.records]
        generated = [len(r.tokens) for r in batch.records]
        if prefill:
            self.predictor.admit_batch(rids, [self.max_new_tokens] * len(rids), hidden)
        else:
            self.predictor.step(rids, generated, hidden)
        for rid, g, record in zip(rids, generated, batch.records, strict=True):
            fresh = self.predictor.online.predicted_at(rid) == g
            record.estimates.append((g, self.predictor.remaining(rid, g), fresh))

    def _advance(self, batch: _Batch) -> tuple[list[Generated], list[int]]:
        """Append each row's new token; finished requests out, the rows that go on in."""
        done, keep = [], []
        stopped = torch.isin(batch.token, self.stops).tolist()
        for row, (record, token) in enumerate(zip(batch.records, batch.token.tolist(), strict=True)):
            record.tokens.append(int(token))
            if stopped[row]:
                done.append(record)
            elif len(record.tokens) >= self.max_new_tokens:
                record.hit_cap = True
                done.append(record)
            else:
                keep.append(row)
        return done, keep


def time_decode_step(model: Any, tokenizer: Any, batch_size: int, *, steps: int = 30, warmup: int = 5,
                     clock: Callable[[], float] | None = None) -> list[float]:
    """Seconds of each of ``steps`` decode iterations (body + LM head + argmax) at ``batch_size``, ~60 tokens of
    context, after ``warmup`` untimed ones."""
    from transformers import DynamicCache

    now = clock or time.perf_counter
    prompt = Prompt("timing", "explain", "Explain how photosynthesis works.")
    enc = chat_inputs(tokenizer, [prompt] * batch_size)
    times = []
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        out = model(**enc, past_key_values=cache, use_cache=True)
        mask = enc["attention_mask"]
        for step in range(warmup + steps):
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones(batch_size, 1, dtype=mask.dtype)], dim=-1)
            t0 = now()
            out = model(input_ids=token, attention_mask=mask, past_key_values=cache, use_cache=True)
            out.logits[:, -1].argmax(-1)
            if step >= warmup:
                times.append(now() - t0)
    return times
