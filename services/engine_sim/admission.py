"""What engine_sim checks before it queues a request, and the answer it will give, drawn up front.

The checks are SGLang's tokenizer manager's (the context length, a negative ``max_new_tokens``, the KV pool's
cap on output: ``init_req_max_new_tokens``). The answer is a pure function of the request: its token ids and
its length come from the prompt's digest and a seed (:mod:`services.engine_sim.tokens`), and the stop strings
cut it where one first appears (:mod:`services.engine_sim.stops`).
"""

from __future__ import annotations

from dataclasses import dataclass

from services.engine_sim.stops import StopMatch, cut_at_stop
from services.engine_sim.tokens import TokenSource, draw_output_length


class EngineRequestError(ValueError):
    """A request the engine refuses before queueing it (SGLang raises ValueError in its tokenizer manager).

    ``status`` is the HTTP answer: 400 for the request itself (no engine would take it), 409 when this
    engine's role does not fit it (it flipped since the caller looked) and 503 while shutting down; a caller
    may retry the last two elsewhere.
    """

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def output_limit(prompt_tokens: int, max_new_tokens: int | None, *, context_length: int, capacity: int) -> int:
    """The most output tokens the request may get (``None``: up to the context), or the tokenizer manager's
    refusal."""
    ctx = context_length
    if prompt_tokens >= ctx:
        raise EngineRequestError(
            f"The input ({prompt_tokens} tokens) is longer than the model's context length ({ctx} tokens).")
    if max_new_tokens is None:
        max_new_tokens = ctx - prompt_tokens - 1  # SGLang: unlimited, then capped by the context
    elif max_new_tokens < 0:
        raise EngineRequestError(f"max_new_tokens must be at least 0, got {max_new_tokens}.")
    elif prompt_tokens + max_new_tokens > ctx:
        raise EngineRequestError(
            f"Requested token count exceeds the model's maximum context length of {ctx} tokens. You requested "
            f"a total of {prompt_tokens + max_new_tokens} tokens: {prompt_tokens} tokens from the input messages "
            f"and {max_new_tokens} tokens for the completion. Please reduce the number of tokens in the input "
            "messages or the completion to fit within the limit.")
    # Like SGLang's init_req_max_new_tokens: never more output than the KV pool could ever hold.
    return max(0, min(max_new_tokens, capacity - prompt_tokens))


@dataclass(frozen=True, slots=True)
class Answer:
    key: str  # what the ids and the length are drawn from
    tokens: TokenSource  # the ids, positioned after those another engine already produced
    output_tokens: int  # where it stops: the length draw, the limit, or a stop string
    uncut_tokens: int  # where it would stop without the stop strings
    stop_match: StopMatch | None


def draw_answer(key: str, *, engine_seed: int, seed: int | None, generated: int, max_new_tokens: int,
                ignore_eos: bool, mean_output_tokens: float, stops: tuple[str, ...]) -> Answer:
    """The answer to a request keyed ``key`` that another engine started ``generated`` tokens into. A request's
    own ``seed`` replaces the engine's, so its answer is the same on every engine, as a seeded sampler's is."""
    if seed is not None:
        engine_seed, key = 0, f"seed={seed}:{key}"
    uncut = max_new_tokens if ignore_eos else min(max_new_tokens, max(1, draw_output_length(
        engine_seed, key, mean_output_tokens) - generated))
    tokens = TokenSource(engine_seed, key)
    tokens.skip(generated)
    output_tokens, match = cut_at_stop(tokens.clone(), stops, uncut, max_new_tokens)
    return Answer(key=key, tokens=tokens, output_tokens=output_tokens, uncut_tokens=uncut, stop_match=match)
