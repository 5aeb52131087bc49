"""Request validation: every bad input gets a 400 naming the parameter."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from services.gateway.errors import APIError
from services.gateway.slo import ResolvedSlo, SloTable
from services.gateway.validation import json_depth, parse_request
from shared.tokens import EstimatingCounter, count_chat

COUNTER = EstimatingCounter()


def parse(body: Any, endpoint: str = "completions") -> Any:
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    return parse_request(raw, endpoint, counter=COUNTER, default_max_tokens=256, max_tokens_limit=4096)  # type: ignore[arg-type]


def test_token_id_prompt_is_counted_exactly() -> None:
    p = parse({"model": "m", "prompt": list(range(700)), "max_tokens": 9, "stream": True, "stream_options": {"include_usage": True}})
    assert (p.input_tokens, p.max_tokens, p.stream, p.include_usage) == (700, 9, True, True)


def test_text_prompt_uses_the_documented_estimate() -> None:
    assert parse({"model": "m", "prompt": "x" * 401}).input_tokens == 101


def test_defaults_and_chat_max_completion_tokens() -> None:
    p = parse({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 7}, "chat")
    assert p.max_tokens == 7 and p.body["max_tokens"] == 7 and "max_completion_tokens" not in p.body
    assert p.input_tokens == count_chat(COUNTER, [{"role": "user", "content": "hi"}])
    # Without a limit a chat answer runs to its end (the engines get none; the gateway plans with its default),
    # and a completion gets the OpenAI API's 16, as from SGLang.
    unlimited = parse({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, "chat")
    assert (unlimited.limited, unlimited.max_tokens, "max_tokens" in unlimited.body) == (False, 256, False)
    assert unlimited.remaining_tokens(1000) == 1 and p.remaining_tokens(3) == 4
    completion = parse({"model": "m", "prompt": "a"})
    assert (completion.limited, completion.max_tokens, completion.body["max_tokens"]) == (True, 16, 16)


def test_a_whole_number_float_max_tokens_is_an_integer() -> None:
    p = parse({"model": "m", "prompt": "a", "max_tokens": 10.0})  # JSON Schema's integer; SGLang takes it too
    assert p.max_tokens == 10 and isinstance(p.body["max_tokens"], int)


def test_unknown_fields_pass_through() -> None:
    p = parse({"model": "m", "prompt": "a", "ignore_eos": True, "return_hidden_states": True, "custom": 1})
    assert p.body["custom"] == 1 and p.body["return_hidden_states"] is True


@pytest.mark.parametrize("body, param", [
    (b"{not json", None),
    (b"[1, 2]", None),
    ({"prompt": "a"}, "model"),
    ({"model": 3, "prompt": "a"}, "model"),
    ({"model": "m"}, "prompt"),
    ({"model": "m", "prompt": ""}, "prompt"),
    ({"model": "m", "prompt": ["a", "b"]}, "prompt"),
    ({"model": "m", "prompt": [1, -2]}, "prompt"),
    ({"model": "m", "prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"model": "m", "prompt": "a", "max_tokens": "9"}, "max_tokens"),
    ({"model": "m", "prompt": "a", "max_tokens": 9.5}, "max_tokens"),
    ({"model": "m", "prompt": "a", "logprobs": 6}, "logprobs"),
    ({"model": "m", "prompt": "a", "seed": "7"}, "seed"),
    ({"model": "m", "prompt": "a", "seed": 1.5}, "seed"),
    ({"model": "m", "prompt": "a", "user": 42}, "user"),
    ({"model": "m", "prompt": "a", "logprobs": True}, "logprobs"),
    ({"model": "m", "prompt": "a", "max_tokens": 0.0}, "max_tokens"),
    ({"model": "m", "prompt": "a", "max_tokens": 5000}, "max_tokens"),
    ({"model": "m", "prompt": "a", "temperature": 3}, "temperature"),
    ({"model": "m", "prompt": "a", "temperature": True}, "temperature"),
    ({"model": "m", "prompt": "a", "top_p": -0.1}, "top_p"),
    ({"model": "m", "prompt": "a", "stream": "yes"}, "stream"),
    ({"model": "m", "prompt": "a", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"model": "m", "prompt": "a", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"model": "m", "prompt": "a", "stop": 5}, "stop"),
    ({"model": "m", "prompt": "a", "n": 2}, "n"),
    ({"model": "m", "prompt": "a", "priority": "high"}, "priority"),
    ({"model": "m", "prompt": "a", "slo_class": "gold"}, "slo_class"),  # the gateway has no classes here
    ({"model": "m", "prompt": "a", "slo": {"ttft_s": 0}}, "slo.ttft_s"),
    ({"model": "m", "prompt": "a", "slo": "fast"}, "slo"),
])
def test_bad_completion_requests(body: Any, param: str | None) -> None:
    with pytest.raises(APIError) as info:
        parse(body)
    err = info.value
    assert err.status == 400 and err.param == param
    assert err.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("messages, param", [
    (None, "messages"),
    ([], "messages"),
    (["hi"], "messages.[0]"),
    ([{"role": "robot", "content": "x"}], "messages.[0].role"),
    ([{"role": "user", "content": 5}], "messages.[0].content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], "messages.[0].content"),
])
def test_bad_chat_requests(messages: Any, param: str) -> None:
    body = {"model": "m"}
    if messages is not None:
        body["messages"] = messages
    with pytest.raises(APIError) as info:
        parse(body, "chat")
    assert info.value.status == 400 and info.value.param == param


def test_slo_extension_is_resolved_and_stripped_priority_passes_through() -> None:
    table = SloTable.build(specs=["text=0.25:0.1", "file=6:0.1"], priority=["0=file"], route=["chat=text"])
    raw = orjson.dumps({"model": "m", "prompt": "a", "priority": 0, "slo": {"tpot_s": 0.05}})
    p = parse_request(raw, "completions", counter=COUNTER, default_max_tokens=8, max_tokens_limit=64, slo_table=table)
    assert p.slo == ResolvedSlo(slo_class="file", ttft_s=6.0, tpot_s=0.05, source="slo")
    assert p.priority == 0 and p.body["priority"] == 0 and "slo" not in p.body and "slo_class" not in p.body
    raw = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    p = parse_request(raw, "chat", counter=COUNTER, default_max_tokens=8, max_tokens_limit=64, slo_table=table)
    assert p.slo == ResolvedSlo(slo_class="text", ttft_s=0.25, tpot_s=0.1, source="route")
    assert parse({"model": "m", "prompt": "a"}).slo is None
    assert parse({"model": "m", "prompt": "a", "slo": {"ttft_s": 1}}).slo == ResolvedSlo(ttft_s=1.0, source="slo")


def test_nesting_depth_is_counted_without_recursion() -> None:
    assert [json_depth(v) for v in ("x", [], {"a": 1}, {"a": [1, {"b": []}]})] == [0, 1, 1, 4]
    deep: Any = 1
    for _ in range(100_000):  # far past Python's recursion limit
        deep = [deep]
    assert json_depth(deep) == 100_000
    with pytest.raises(APIError, match="nests 5 levels"):
        parse_request(orjson.dumps({"model": "m", "prompt": "a", "x": [[[[1]]]]}), "completions", counter=COUNTER,
                      default_max_tokens=8, max_tokens_limit=64, max_depth=4)


@pytest.mark.parametrize("role", [{}, [], 1, None, True])
def test_a_role_of_any_type_is_a_400(role: Any) -> None:
    with pytest.raises(APIError) as err:
        parse({"model": "m", "messages": [{"role": role, "content": "x"}]}, "chat")
    assert err.value.status == 400 and err.value.param == "messages.[0].role"


def test_log_probability_counts_within_the_openai_bounds() -> None:
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert parse({**chat, "logprobs": True, "top_logprobs": 20}, "chat").body["top_logprobs"] == 20
    assert parse({"model": "m", "prompt": "a", "logprobs": 5}).body["logprobs"] == 5
    for bad, param in (({"top_logprobs": 21}, "top_logprobs"), ({"top_logprobs": 2.5}, "top_logprobs"),
                       ({"logprobs": "yes"}, "logprobs")):
        with pytest.raises(APIError) as err:
            parse({**chat, **bad}, "chat")
        assert err.value.status == 400 and err.value.param == param


def test_seed_and_user_of_the_right_types_pass_to_the_engines() -> None:
    p = parse({"model": "m", "prompt": "a", "seed": -3, "user": "alice"})
    assert (p.body["seed"], p.body["user"]) == (-3, "alice")


def test_an_slo_no_engine_can_meet_is_a_400_not_a_429_to_retry() -> None:
    table = SloTable(min_ttft_s=0.008)
    raw = orjson.dumps({"model": "m", "prompt": "a", "slo": {"ttft_s": 0.001}})
    with pytest.raises(APIError) as err:
        parse_request(raw, "completions", counter=COUNTER, default_max_tokens=256, max_tokens_limit=4096,
                      slo_table=table)
    assert err.value.status == 400 and err.value.param == "slo.ttft_s" and "0.008" in str(err.value)
    ok = parse_request(orjson.dumps({"model": "m", "prompt": "a", "slo": {"ttft_s": 0.5}}), "completions",
                       counter=COUNTER, default_max_tokens=256, max_tokens_limit=4096, slo_table=table)
    assert ok.slo is not None and ok.slo.ttft_s == 0.5


@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": {"type": "nonsense"}}, "response_format"),
    ({"response_format": "json_object"}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": []}}},
     "response_format.json_schema"),
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools.[0]"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": "sometimes", "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "g"}},
      "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
    ({"tool_choice": {"type": "function"}, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
    ({"top_logprobs": 3}, "top_logprobs"),
])
def test_structured_output_tools_and_logprobs_are_checked(body: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as err:
        parse({"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}, "chat")
    assert err.value.status == 400 and err.value.param == param, err.value


@pytest.mark.parametrize("body", [
    {"response_format": {"type": "text"}},
    {"response_format": {"type": "json_object"}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}},
    {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"},
    {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function",
                                                                                 "function": {"name": "f"}}},
    {"tool_choice": "none"},
    {"logprobs": True, "top_logprobs": 20},
])
def test_valid_structured_output_tools_and_logprobs_go_to_the_engines_unchanged(body: dict[str, Any]) -> None:
    p = parse({"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}, "chat")
    assert all(p.body[k] == v for k, v in body.items())
