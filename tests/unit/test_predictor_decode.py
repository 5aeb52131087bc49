"""The collection's decode loop on a tiny random Llama: continuous batching changes nothing a request sees,
and the recorded state is the LM head's input (transformers' ``hidden_states[-1]``).

Needs transformers (the ``predictor-llm`` extra); skipped without it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from services.predictor.decode import Decoder, Sampling  # noqa: E402
from services.predictor.prompts import Prompt  # noqa: E402

VOCAB, STOP = 64, 2


class CharTokenizer:
    """Just enough of a tokenizer for `decode.chat_inputs`: one id per character, left padding with 0."""

    padding_side = "left"

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool, tokenize: bool) -> str:
        return "<" + messages[0]["content"] + ">"

    def __call__(self, texts: list[str], return_tensors: str, padding: bool,
                 add_special_tokens: bool) -> dict[str, Any]:
        ids = [[3 + ord(c) % (VOCAB - 3) for c in t] for t in texts]
        width = max(map(len, ids))
        return {"input_ids": torch.tensor([[0] * (width - len(r)) + r for r in ids]),
                "attention_mask": torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in ids])}


@pytest.fixture(scope="module")
def tiny_llama() -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      eos_token_id=STOP, pad_token_id=0)
    return transformers.LlamaForCausalLM(config).eval()


PROMPTS = [Prompt(f"p{i}", "t", text) for i, text in
           enumerate(["hello there", "a", "list five things please", "why?", "xyz xyz", "tell me a long story"])]


def run(model: Any, batch_size: int, stops: set[int] | None = None) -> dict[str, Any]:
    decoder = Decoder(model, CharTokenizer(), stop_ids=stops or {STOP}, max_new_tokens=30, k=5,
                      sampling=Sampling(temperature=0), seed=0, batch_size=batch_size, refill_at=1)
    return {r.prompt.pid: r for r in decoder.run(PROMPTS)}


def test_continuous_batching_matches_one_request_at_a_time(tiny_llama: Any) -> None:
    # A random model rarely says STOP: stop instead at a token the first request greedily says third, so that
    # requests end at different steps and new prompts join a running batch.
    stops = {run(tiny_llama, batch_size=1)["p0"].tokens[2]}
    alone = run(tiny_llama, batch_size=1, stops=stops)
    merged = run(tiny_llama, batch_size=3, stops=stops)
    assert set(alone) == set(merged) == {p.pid for p in PROMPTS}
    assert len({len(r.tokens) for r in alone.values()}) >= 3
    for pid, a in alone.items():
        b = merged[pid]
        assert a.tokens == b.tokens and a.hit_cap == b.hit_cap
        assert a.positions == b.positions == list(range(0, len(a.tokens), 5))
        for x, y in zip(a.hidden, b.hidden, strict=True):
            np.testing.assert_allclose(x, y, atol=1e-4)
        assert len(a.tokens) == 30 if a.hit_cap else a.tokens[-1] in stops


def test_the_recorded_state_is_the_lm_heads_input(tiny_llama: Any) -> None:
    record = run(tiny_llama, batch_size=2)["p0"]
    ids = CharTokenizer()(["<hello there>"], "pt", True, False)["input_ids"]
    sequence = torch.cat([ids, torch.tensor([record.tokens[:5]])], dim=1)  # prompt + 5 generated: g = 5
    with torch.no_grad():
        out = tiny_llama(input_ids=sequence, output_hidden_states=True)
    last = out.hidden_states[-1][0, -1]
    np.testing.assert_allclose(record.hidden[1], last.numpy(), atol=1e-4)  # sample at generated = 5
    logits = tiny_llama.lm_head(last)  # post final norm: the head's input reproduces the logits
    np.testing.assert_allclose(logits.detach().numpy(), out.logits[0, -1].detach().numpy(), atol=1e-4)


def test_the_loop_serves_a_checkpoint_online(tiny_llama: Any, tmp_path: Any) -> None:
    from services.predictor.model import LengthMLP, PredictorMeta, save_checkpoint
    from services.predictor.serving import EnginePredictor

    mlp = LengthMLP(32)
    save_checkpoint(mlp, PredictorMeta(model_name="tiny", hidden_size=32, widths=mlp.widths, k=3,
                                       data_sha256="00" * 32), tmp_path)
    predictor = EnginePredictor.load(tmp_path, hidden_size=tiny_llama.config.hidden_size, model_name="tiny")
    decoder = Decoder(tiny_llama, CharTokenizer(), stop_ids={STOP}, max_new_tokens=12, k=0,
                      sampling=Sampling(temperature=0), seed=0, batch_size=3, refill_at=1, predictor=predictor)
    records = {r.prompt.pid: r for r in decoder.run(PROMPTS)}
    assert set(records) == {p.pid for p in PROMPTS}
    for r in records.values():
        assert not r.hidden  # k = 0: nothing collected
        assert [g for g, _, _ in r.estimates] == list(range(len(r.tokens)))  # after every pass
        assert r.estimates[0][2]  # predicted from the prefill pass's state
        assert all(1 <= e <= 12 - g for g, e, _ in r.estimates)
        assert sum(fresh for _, _, fresh in r.estimates) >= 1 + (len(r.tokens) - 1) // 3 - 1
    assert not predictor.online.estimates()  # every request was released when it finished
    assert predictor.online.calls > 0 and 0 < predictor.seconds < decoder.step_seconds
