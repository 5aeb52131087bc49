"""A colocated engine_sim with ``--give-up-late-prompts``: a prompt that waits, unstarted, past its TTFT target
(poise_slo) is refused with a 429 and SGLang's OpenAI-style error body, while the request ahead of it and one without
a target are served in full. Without the flag the late prompt is served late."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.integration.engine_procs import Engine, start_engine, stop, wait_healthy

BLOCKER_TOKENS = 300  # the request holding the engine's one running slot decodes this many tokens (~2 s)


@pytest.fixture
def colocated(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Engine]:
    flags: tuple[str, ...] = request.param
    engine = start_engine(tmp_path, "null", "--max-running-requests", "1", "--prefill-policy", "fcfs", *flags,
                          name="give-up")
    try:
        wait_healthy([engine])
        yield engine
    finally:
        stop([engine])


def _body(rid: str, max_new_tokens: int, ttft_s: float | None) -> dict[str, Any]:
    body: dict[str, Any] = {"input_ids": [1 + i % 1000 for i in range(500)], "rid": rid,
                            "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True}}
    if ttft_s is not None:
        body["poise_slo"] = {"slo_class": "test", "ttft_s": ttft_s, "tpot_s": 1.0, "waited_s": 0.0}
    return body


async def _queued_behind_a_blocker(engine: Engine) -> tuple[httpx.Response, httpx.Response, httpx.Response]:
    """A blocker takes the only slot; once it streams, a prompt with a 0.2-s TTFT target and one without any
    queue behind it."""
    async with httpx.AsyncClient(timeout=60) as client:
        started = asyncio.Event()
        out: dict[str, Any] = {}

        async def blocker() -> None:
            async with client.stream("POST", engine.url + "/generate",
                                     json={**_body("blocker", BLOCKER_TOKENS, 30.0), "stream": True}) as resp:
                assert resp.status_code == 200
                async for line in resp.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        started.set()
                        out["last"] = orjson.loads(line[len("data: "):])

        task = asyncio.create_task(blocker())
        await asyncio.wait_for(started.wait(), 30)
        tight, loose = await asyncio.gather(client.post(engine.url + "/generate", json=_body("tight", 4, 0.2)),
                                            client.post(engine.url + "/generate", json=_body("loose", 4, None)))
        await task
        whole = httpx.Response(200, json=out["last"])
        return whole, tight, loose


@pytest.mark.asyncio
@pytest.mark.parametrize("colocated", [("--give-up-late-prompts",)], indirect=True)
async def test_a_prompt_waiting_past_its_target_is_refused_and_the_rest_served(colocated: Engine) -> None:
    blocker, tight, loose = await _queued_behind_a_blocker(colocated)
    assert tight.status_code == 429, tight.text
    error = tight.json()  # SGLang's ErrorResponse
    assert error["object"] == "error" and error["code"] == 429 and "past its TTFT target of 0.2 s" in error["message"]
    assert loose.status_code == 200 and len(loose.json()["output_ids"]) == 4  # no target: never given up
    assert len(blocker.json()["output_ids"]) == BLOCKER_TOKENS  # the request ahead loses nothing


@pytest.mark.asyncio
@pytest.mark.parametrize("colocated", [()], indirect=True)
async def test_without_the_flag_the_late_prompt_is_served_late(colocated: Engine) -> None:
    _, tight, loose = await _queued_behind_a_blocker(colocated)
    assert tight.status_code == 200 and len(tight.json()["output_ids"]) == 4
    assert loose.status_code == 200
