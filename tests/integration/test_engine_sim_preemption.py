"""Operator-level prefill preemption in engine_sim processes: a PD pair over HTTP, a long prompt with a loose TTFT
target (poise_slo), then an urgent short one. With ``preemption=operator`` the prefill engine cuts the long pass
at an operator boundary and the short request's first token comes long before the long one's; with
``preemption=chunk`` and FCFS (unchunked prefill, SGLang's behaviour) the short request waits the pass out."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from shared.latency import LatencyModel, load_profile
from shared.policies import PREFILL_POLICIES
from tests.integration.engine_procs import Engine, start_engine, stop, wait_healthy
from tests.integration.waiting import until_equal

TIME_SCALE = 0.5  # the 60K prompt's prefill takes ~1.9 s: far above HTTP and scheduling noise, still quick
LONG, SHORT = 60000, 500
LONG_PREFILL_S = LatencyModel(load_profile(), TIME_SCALE).prefill_time_s(LONG)
SLO_POLICY = "flowprefill" if "flowprefill" in PREFILL_POLICIES else "edf"
_rooms = itertools.count(5000)


@pytest.fixture
def pd_pair(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[Engine, Engine]]:
    prefill_args: tuple[str, ...] = request.param
    engines = [start_engine(tmp_path, "prefill", *prefill_args, time_scale=TIME_SCALE, name="preempt", bootstrap_timeout_s=10),
               start_engine(tmp_path, "decode", time_scale=TIME_SCALE, name="preempt", bootstrap_timeout_s=10)]
    try:
        wait_healthy(engines)
        yield engines[0], engines[1]
    finally:
        stop(engines)


@dataclass
class Outcome:
    sent_s: float
    first_token_s: float  # when the decode engine's first streamed output reached the client
    tokens: int
    prefill_finish: dict[str, Any]


async def pd_generate(client: httpx.AsyncClient, prefill: Engine, decode: Engine, prompt: int, ttft_s: float,
                      rid: str) -> Outcome:
    """One PD request as SGLang's router sends it: the same body (with bootstrap room) to both engines."""
    body: dict[str, Any] = {
        "input_ids": [1 + i % 1000 for i in range(prompt)], "rid": rid,
        "sampling_params": {"max_new_tokens": 8, "ignore_eos": True},
        "bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.bootstrap_port, "bootstrap_room": next(_rooms),
        "poise_slo": {"slo_class": rid, "ttft_s": ttft_s, "tpot_s": 0.5, "waited_s": 0.0},
    }
    sent = time.monotonic()
    prefill_task = asyncio.create_task(client.post(prefill.url + "/generate", json=body))
    first: float | None = None
    last: dict[str, Any] = {}
    async with client.stream("POST", decode.url + "/generate", json={**body, "stream": True}) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if first is None:
                first = time.monotonic()
            last = orjson.loads(line[len("data: "):])
    prefill_resp = await prefill_task
    assert prefill_resp.status_code == 200, prefill_resp.text
    assert first is not None
    return Outcome(sent, first, len(last["output_ids"]), prefill_resp.json()["meta_info"]["finish_reason"])


async def long_then_short(prefill: Engine, decode: Engine) -> tuple[Outcome, Outcome]:
    async with httpx.AsyncClient(timeout=30) as client:
        long_task = asyncio.create_task(pd_generate(client, prefill, decode, LONG, 60.0, "long"))
        await until_equal(lambda: prefilling(client, prefill), 1, timeout_s=10.0, poll_s=0.02)  # its pass runs
        short = await pd_generate(client, prefill, decode, SHORT, 0.3, "short")
        long = await long_task
    return long, short


async def prefilling(client: httpx.AsyncClient, engine: Engine) -> int:
    """The prompts the prefill engine is prefilling now (``num_running_reqs`` of its /v1/loads)."""
    resp = await client.get(engine.url + "/v1/loads")
    return int(resp.json()["loads"][0]["num_running_reqs"])


async def preemptions(engine: Engine) -> tuple[float, float]:
    """(poise:prefill_preemptions_total, poise:prefill_preemption_blocking_seconds_sum) from /metrics."""
    values: dict[str, float] = {}
    async with httpx.AsyncClient(timeout=10) as client:
        text = (await client.get(engine.url + "/metrics")).text
    for line in text.splitlines():
        for name in ("poise:prefill_preemptions_total", "poise:prefill_preemption_blocking_seconds_sum"):
            if line.startswith(name + "{"):
                values[name] = float(line.rsplit(" ", 1)[1])
    return values["poise:prefill_preemptions_total"], values["poise:prefill_preemption_blocking_seconds_sum"]


OPERATOR = ("--preemption", "operator", "--chunked-prefill-size", "-1", "--prefill-policy", SLO_POLICY)
CHUNK_FCFS = ("--preemption", "chunk", "--chunked-prefill-size", "-1", "--prefill-policy", "fcfs")


@pytest.mark.asyncio
@pytest.mark.parametrize("pd_pair", [OPERATOR], indirect=True, ids=[f"operator-{SLO_POLICY}"])
async def test_operator_preemption_serves_the_urgent_prompt_first(pd_pair: tuple[Engine, Engine]) -> None:
    prefill, decode = pd_pair
    async with httpx.AsyncClient(timeout=10) as client:
        info = (await client.get(prefill.url + "/server_info")).json()
    assert (info["preemption"], info["prefill_policy"], info["chunked_prefill_size"]) == ("operator", SLO_POLICY, -1)
    long, short = await long_then_short(prefill, decode)
    short_ttft = short.first_token_s - short.sent_s
    # The short prompt waited at most an operator (~12 ms here) for the long pass, not the rest of it (~1.3 s).
    assert short_ttft < 0.25 * LONG_PREFILL_S, short_ttft
    assert short.first_token_s < long.first_token_s - 0.5 * LONG_PREFILL_S
    # The long request still completes, with all its tokens; its prefill resumed from where it was cut.
    assert long.tokens == 8 and short.tokens == 8
    assert long.prefill_finish == short.prefill_finish == {"type": "length", "length": 0}
    assert long.first_token_s - long.sent_s >= LONG_PREFILL_S
    count, blocking = await preemptions(prefill)
    assert count >= 1
    assert 0 <= blocking < 0.05 * count  # at most one operator each (1/160 of a 1.9 s pass)
    await malformed_poise_slo_is_a_schema_error(prefill)


async def malformed_poise_slo_is_a_schema_error(engine: Engine) -> None:
    async with httpx.AsyncClient(timeout=10) as client:
        for path, body in (("/generate", {"input_ids": [1, 2]}), ("/v1/completions", {"prompt": "hi"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            resp = await client.post(engine.url + path, json={**body, "poise_slo": {"ttft_s": -1}})
            assert resp.status_code == 400
            err = resp.json()
            assert (err["object"], err["type"], err["param"], err["code"]) == ("error", "Bad Request", "poise_slo", 400)
            assert "ttft_s" in err["message"]


@pytest.mark.asyncio
@pytest.mark.parametrize("pd_pair", [CHUNK_FCFS], indirect=True, ids=["chunk-fcfs"])
async def test_chunk_preemption_makes_the_urgent_prompt_wait(pd_pair: tuple[Engine, Engine]) -> None:
    prefill, decode = pd_pair
    long, short = await long_then_short(prefill, decode)
    short_ttft = short.first_token_s - short.sent_s
    # The unchunked 60K pass cannot be cut: the short prompt waits for the rest of it.
    assert short_ttft > 0.5 * LONG_PREFILL_S, short_ttft
    assert long.tokens == 8 and short.tokens == 8
    assert await preemptions(prefill) == (0.0, 0.0)
