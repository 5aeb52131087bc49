"""The non-streaming body the gateway assembles from a streamed answer (a request that moved between engines):
text, finish, usage, and the log-probabilities of every engine's pieces, joined in order."""

from __future__ import annotations

from typing import Any

from services.gateway.legs import Event
from services.gateway.responses import whole_response


def event(choice: dict[str, Any] | None, text: str = "", finish: str | None = None,
          usage: dict[str, Any] | None = None) -> Event:
    data: dict[str, Any] = {"choices": [choice] if choice is not None else []}
    if usage is not None:
        data["usage"] = usage
    return Event(data=data, at=0.0, text=text, finish_reason=finish)


def test_chat_logprobs_from_two_engines_join_in_order() -> None:
    a = {"token": " a", "bytes": [32, 97], "logprob": -0.1, "top_logprobs": []}
    b = {"token": " b", "bytes": [32, 98], "logprob": -0.2, "top_logprobs": []}
    events = [event({"delta": {"content": " a"}, "logprobs": {"content": [a]}}, " a"),
              event({"delta": {"content": " b"}, "logprobs": {"content": [b]}}, " b", "stop"),
              event(None, usage={"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5})]
    body = whole_response(events, endpoint="chat", client_id="chatcmpl-1", created=1, model="m", usage={})
    choice = body["choices"][0]
    assert choice["message"]["content"] == " a b" and choice["finish_reason"] == "stop"
    assert choice["logprobs"] == {"content": [a, b]}
    assert body["usage"]["completion_tokens"] == 2 and body["object"] == "chat.completion"


def test_completion_logprobs_count_offsets_from_the_answers_start() -> None:
    # each engine counts text_offset from its own first token
    events = [event({"text": " x", "logprobs": {"tokens": [" x"], "token_logprobs": [-1.0],
                                                "top_logprobs": [{" x": -1.0}], "text_offset": [0]}}, " x"),
              event({"text": " yy", "logprobs": {"tokens": [" yy"], "token_logprobs": [-2.0],
                                                 "top_logprobs": [{" yy": -2.0}], "text_offset": [0]}}, " yy",
                    "length")]
    fallback = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
    body = whole_response(events, endpoint="completions", client_id="cmpl-1", created=1, model="m", usage=fallback)
    lp = body["choices"][0]["logprobs"]
    assert lp == {"tokens": [" x", " yy"], "token_logprobs": [-1.0, -2.0],
                  "top_logprobs": [{" x": -1.0}, {" yy": -2.0}], "text_offset": [0, 2]}
    assert body["usage"] == fallback and body["choices"][0]["text"] == " x yy"


def test_no_logprobs_asked_none_given() -> None:
    body = whole_response([event({"text": "hi"}, "hi", "stop")], endpoint="completions", client_id="c", created=1,
                          model="m", usage={})
    assert body["choices"][0]["logprobs"] is None
