"""Serving through Poise's gateway on real SGLang engines (one prefill, one decode, KV over mooncake_tcp), with
the official ``openai`` client: what a user sends and gets, what the sidecars read from SGLang's ``/v1/loads``
and what the engines export on ``/metrics``; and the contract fixtures against the real thing: the requests the
contract suite sends engine_sim, sent to the same pair directly (tests/sglang/contract_probe.py), every answer
checked against the fixture's shape with no Poise extension or omission allowed, and against the answers recorded
from SGLang 0.5.23 on this CPU (tests/contract/fixtures/sglang-0.5.23-cpu/).

One stack for the module (an engine takes a minute to start here); test_lifecycle, which changes roles and
kills engines, starts its own after this one is gone."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from services.cli.stack import Stack
from shared.engine_client import parse_loads
from tests.sglang.contract_probe import Pair, probe
from tests.sglang.realstack import (
    MODEL,
    Streamed,
    client,
    engine_busy,
    engine_get,
    engine_loads,
    greedy,
    instances,
    real_stack,
    until,
)

pytestmark = pytest.mark.sglang
RECORDED = Path(__file__).resolve().parents[1] / "contract" / "fixtures" / "sglang-0.5.23-cpu"

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
# ~330 tokens: long enough that a second request hits SGLang's radix cache for most of it
LONG_PROMPT = "Here is a list of facts about rivers, mountains and cities. " * 30 + "Now summarise them:"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with real_stack(tmp_path_factory.mktemp("sglang-serving"), prefill=1, decode=1) as s:
        yield s


def test_chat_through_the_gateway_streamed_and_not_gives_the_same_greedy_answer(stack: Stack) -> None:
    c = client(stack)
    whole = c.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0)
    assert whole.object == "chat.completion" and whole.model == MODEL
    answer = whole.choices[0].message.content
    assert answer and "Paris" in answer, answer
    assert whole.choices[0].finish_reason in ("stop", "length")
    usage = whole.usage
    assert usage is not None and usage.prompt_tokens > 0 and 0 < usage.completion_tokens <= 24
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens

    chunks = list(c.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == answer  # greedy through the same PD pair: the same tokens
    assert len({ch.id for ch in chunks}) == 1
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == usage.completion_tokens
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == \
        [whole.choices[0].finish_reason]


def test_completions_streamed_and_not(stack: Stack) -> None:
    c = client(stack)
    whole = c.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0)
    assert whole.object == "text_completion" and whole.choices[0].text.strip()
    assert whole.usage is not None and whole.usage.completion_tokens <= 12
    parts = list(c.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0,
                                      stream=True))
    assert "".join(p.choices[0].text for p in parts if p.choices) == whole.choices[0].text


def test_a_repeated_prompt_reports_cached_tokens(stack: Stack) -> None:
    c = client(stack)
    first = c.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=4, temperature=0)
    second = c.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=4, temperature=0)
    assert first.usage is not None and second.usage is not None
    assert first.usage.prompt_tokens == second.usage.prompt_tokens > 300
    details = second.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens is not None
    # SGLang's radix cache on the prefill engine: all but the last prompt token come from the cache
    assert details.cached_tokens >= second.usage.prompt_tokens - 16, second.usage


def test_a_stop_string_ends_the_answer_before_it(stack: Stack) -> None:
    prompt = "Write the numbers from one to twenty in words, separated by commas:"
    free = greedy(stack, prompt, 40)
    middle = len(free) // 2
    stop = free[middle:middle + 3]
    assert len(free) > 20 and stop.strip(), free
    cut = client(stack).completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stop=[stop],
                                           extra_body={"ignore_eos": True})
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == free[: free.index(stop)], (free, stop)


def test_logprobs_come_back_through_the_pd_pair_for_every_token(stack: Stack) -> None:
    c = client(stack)
    whole = c.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, temperature=0, logprobs=True,
                                      top_logprobs=2)
    lp = whole.choices[0].logprobs
    assert whole.usage is not None and lp is not None and lp.content is not None
    assert len(lp.content) == whole.usage.completion_tokens
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in lp.content)
    chunks = list(c.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, temperature=0,
                                            logprobs=True, top_logprobs=2, stream=True))
    streamed = [e.token for ch in chunks if ch.choices and ch.choices[0].logprobs
                for e in ch.choices[0].logprobs.content or []]
    # SGLang's stream sends no chunk for the end-of-turn token alone, so its log-probability is only in the
    # whole answer
    whole_tokens = [e.token for e in lp.content]
    assert streamed == whole_tokens[:len(streamed)] and len(whole_tokens) - len(streamed) <= 1, (streamed, whole_tokens)
    text = c.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0,
                                logprobs=1)
    tlp = text.choices[0].logprobs
    assert tlp is not None and tlp.tokens is not None and text.usage is not None
    assert len(tlp.tokens) == text.usage.completion_tokens


def test_a_seed_the_engines_would_drop_is_refused_naming_it(stack: Stack) -> None:
    # SGLang 0.5.23 samples with a request's seed only under --enable-deterministic-inference, which needs a GPU
    # attention backend; without it two seeded answers differ, so the gateway refuses the field.
    info = engine_get(stack, next(iter(stack.engines)), "/server_info").json()
    assert info["enable_deterministic_inference"] is False
    with pytest.raises(openai.BadRequestError) as err:
        client(stack).completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4, temperature=1.0,
                                         seed=1234)
    assert err.value.param == "seed", err.value.body


def test_a_json_object_response_format_gives_json(stack: Stack) -> None:
    answer = client(stack).chat.completions.create(
        model=MODEL, max_tokens=48, temperature=0, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Give the capital of France as JSON with the key capital."}])
    content = answer.choices[0].message.content
    assert content is not None
    if answer.choices[0].finish_reason == "stop":
        json.loads(content)
    else:  # cut at max_tokens: still the start of a JSON object
        assert content.lstrip().startswith("{"), content


def test_the_request_id_names_the_request_to_the_client_and_on_the_engine(stack: Stack) -> None:
    """Every chunk carries the gateway's id (x-request-id), and the engines know the request as ``<id>-<attempt>``:
    SGLang's own /abort_request on the decode engine, given that rid, ends the answer."""
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    assert stack.credentials is not None
    engine_key = {"Authorization": f"Bearer {stack.credentials.engine_api_key}"}
    with httpx.Client(timeout=120, trust_env=False, headers={"Authorization": f"Bearer {stack.api_key}"}) as h, \
            h.stream("POST", stack.gateway_url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        rid = r.headers["x-request-id"]
        events = []
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
                if len(events) == 3:
                    aborted = h.post(stack.engines["d0"] + "/abort_request", json={"rid": f"{rid}-0"},
                                     headers=engine_key)
                    assert aborted.status_code == 200, aborted.text
    assert {e["id"] for e in events} == {rid}
    assert len(events) < 1000, "the engine did not abort the request it knows by that rid"


def test_a_client_that_hangs_up_aborts_both_legs(stack: Stack) -> None:
    c = client(stack)
    stream = c.completions.create(model=MODEL, prompt="Tell me a very long story about a dragon.", max_tokens=3000,
                                  temperature=0, stream=True, extra_body={"ignore_eos": True})
    got = 0
    for part in stream:
        got += len(part.choices)
        if got >= 5:
            break
    assert engine_busy(stack, "d0"), "the decode engine is not running the request"
    stream.close()  # the client goes away mid-answer
    until(lambda: not engine_busy(stack, "d0") and not engine_busy(stack, "p0"), 30,
          "both engines idle after the client hung up (3000 tokens would take minutes)")


def test_load_reports_carry_what_sglang_reports(stack: Stack) -> None:
    """While a long answer runs, the sidecar's LoadReport (as the monitor holds it) has the decode engine's
    running request and KV in use, and the KV capacity SGLang sized (--max-total-tokens)."""
    answer = Streamed(stack, 150)
    until(lambda: engine_loads(stack, "d0")["num_running_reqs"] == 1, 60, "the request running on d0")
    raw = parse_loads(engine_get(stack, "d0", "/v1/loads?include=core,disagg").json())

    def reported() -> bool:
        load = instances(stack)["d0"]["load"]
        return bool(load and load["num_running_reqs"] == 1 and load["num_used_tokens"] > 0)

    until(reported, 30, "d0's load report with the running request")
    seen, seen_at = instances(stack), time.time()
    assert answer.result().usage is not None
    d0, p0 = seen["d0"]["load"], seen["p0"]["load"]
    assert raw.mode == "decode" and raw.max_total_num_tokens > 0
    assert d0["role"] == "decode" and d0["healthy"] and d0["status"] == "ready"
    assert d0["max_total_num_tokens"] == raw.max_total_num_tokens
    assert 0 < d0["token_usage"] < 1 and d0["gen_throughput_tps"] >= 0
    assert d0["num_running_tokens"] is None  # an engine_sim extension SGLang does not report
    assert p0["role"] == "prefill" and p0["max_total_num_tokens"] > 0 and p0["num_running_reqs"] == 0
    assert seen_at - d0["ts_unix_s"] < 30  # the monitor holds a fresh sample (the sidecar reads every 0.25 s)
    info = seen["d0"]["info"]
    assert info["engine_kind"] == "sglang" and info["kv_capacity_tokens"] == raw.max_total_num_tokens


def test_engines_export_the_metric_names_poise_reads(stack: Stack) -> None:
    for instance_id in ("p0", "d0"):
        text = engine_get(stack, instance_id, "/metrics").text
        names = {line.split("{", 1)[0].split(" ", 1)[0] for line in text.splitlines() if line.startswith("sglang:")}
        # the dashboard's per-engine throughput (deploy/grafana) and the queue gauges the docs name
        for name in ("sglang:gen_throughput", "sglang:num_running_reqs", "sglang:num_queue_reqs",
                     "sglang:token_usage"):
            assert name in names, f"{instance_id} /metrics has no {name}"




def _keys(value: object) -> object:
    """The key structure of a JSON value (values dropped), to compare a live answer with a recorded one."""
    if isinstance(value, dict):
        return {k: _keys(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [_keys(value[0])] if value else []
    return type(value).__name__ if value is not None else "null"


def test_real_answers_match_the_fixtures_and_the_recording(stack: Stack) -> None:
    assert stack.credentials is not None
    results = probe(Pair(stack.engines["p0"], stack.engines["d0"], stack.bootstrap_ports["p0"],
                         stack.credentials.engine_api_key))
    mismatches = {name: r["mismatches"] for name, r in results.items() if r["mismatches"]}
    assert not mismatches, json.dumps(mismatches, indent=1)
    for name in ("completion", "chat", "v1_loads_decode", "server_info_decode", "error_empty_prompt",
                 "role_switch_to_decode_without_graph_memory"):
        recorded = json.loads((RECORDED / f"{name}.json").read_text())
        live = results[name]["answer"]
        if name.startswith("server_info"):  # paths, ports and times are this run's; the keys are SGLang's
            assert set(live) == set(recorded), set(live) ^ set(recorded)
        else:
            assert _keys(live) == _keys(recorded), name
    assert results["role_switch_to_decode_without_graph_memory"]["status"] == 400
