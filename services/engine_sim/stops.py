"""Stop strings on engine_sim's placeholder text, as SGLang applies them.

SGLang's scheduler ends a request once its decoded output contains one of the request's ``stop`` strings
(``FINISH_MATCHED_STR``: finish_reason "stop", ``matched_stop`` the string) and the detokenizer cuts the text
before it. engine_sim's output ids are a pure function of the request and the position
(:class:`~services.engine_sim.tokens.TokenSource`), so where a stop string first appears is known when the
request is submitted: the request's output length becomes that position, and the engine model, which only
counts tokens, needs no rule of its own for it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from services.engine_sim.tokens import token_text


@dataclass(frozen=True, slots=True)
class StopMatch:
    tokens: int  # output tokens up to and including the one that completes the stop string
    stop: str  # the matched string (finish_reason.matched)
    text_chars: int  # characters of the output text before the stop string: what the client gets


def find_stop(ids: Iterable[int], stops: Sequence[str], limit: int) -> StopMatch | None:
    """The first stop string in the text of ``ids`` (at most ``limit`` of them), earliest start first."""
    if not stops or limit <= 0:
        return None
    longest = max(len(s) for s in stops)
    tail, tail_start = "", 0  # the last few characters of the text, from offset tail_start
    for n, token in enumerate(ids, 1):
        tail += token_text(token)
        hits = [(i, s) for s in stops if (i := tail.find(s)) >= 0]
        if hits:
            i, stop = min(hits)
            return StopMatch(tokens=n, stop=stop, text_chars=tail_start + i)
        if n >= limit:
            return None
        # keep only what a stop string still to come could start in
        keep = max(0, len(tail) - longest + 1)
        tail, tail_start = tail[keep:], tail_start + keep
    return None


def cut_at_stop(ids: Iterable[int], stops: Sequence[str], length: int,
                max_new_tokens: int) -> tuple[int, StopMatch | None]:
    """The output length once the stop strings are applied to a request that would stop at ``length``, and the
    match. A match on the ``max_new_tokens``-th token is a "length" finish, as SGLang checks the limit first."""
    match = find_stop(ids, stops, length)
    if match is None or match.tokens >= max_new_tokens:
        return length, None
    return match.tokens, match


def visible_text(text: str, match: StopMatch | None) -> str:
    """A whole output's text as the client gets it: cut before the matched stop string."""
    return text if match is None else text[:match.text_chars]


class TextCut:
    """A streamed output's text as the client gets it, piece by piece: nothing from the matched stop string on.

    The match is passed with each piece because a PD decode engine only knows it once its prefill peer's first
    token arrives."""

    __slots__ = ("_chars",)

    def __init__(self) -> None:
        self._chars = 0  # characters of uncut text consumed so far

    def piece(self, text: str, match: StopMatch | None) -> str:
        """The part of the next ``text`` that goes out."""
        start = self._chars
        self._chars += len(text)
        return text if match is None else text[:max(0, match.text_chars - start)]
