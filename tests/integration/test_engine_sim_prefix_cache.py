"""engine_sim's prefix cache over HTTP, reported the way SGLang reports it: meta_info.cached_tokens, the
usage's prompt_tokens_details (--enable-cache-report), sglang:cached_tokens_total and cache_hit_rate."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from loadgen.prompts import prompt_token_ids
from tests.integration.engine_procs import Engine, start_engine, stop, wait_healthy


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    started = start_engine(tmp_path_factory.mktemp("prefix_cache"), "null", "--enable-cache-report", time_scale=0.05)
    try:
        wait_healthy([started])
        yield started
    finally:
        stop([started])


@pytest.mark.asyncio
async def test_a_shared_prefix_is_reported_cached_in_usage_metrics_and_loads(engine: Engine) -> None:
    # Two prompts of 2048 token ids whose first three 512-token blocks are equal (as a Mooncake replay sends
    # them: equal hash_ids, equal blocks).
    first = prompt_token_ids(1, 2048, [7, 8, 9, 10])
    second = prompt_token_ids(2, 2048, [7, 8, 9, 11])
    async with httpx.AsyncClient(timeout=30) as client:
        a = (await client.post(engine.url + "/generate", json={
            "input_ids": first, "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}})).json()
        assert a["meta_info"]["cached_tokens"] == 0
        b = (await client.post(engine.url + "/v1/completions", json={
            "model": "m", "prompt": second, "max_tokens": 4, "ignore_eos": True})).json()
        assert b["usage"]["prompt_tokens_details"] == {"cached_tokens": 3 * 512}
        metrics = (await client.get(engine.url + "/metrics")).text
        line = next(ln for ln in metrics.splitlines() if ln.startswith("sglang:cached_tokens_total{"))
        assert 'cache_source="device"' in line and float(line.rsplit(" ", 1)[1]) == 3 * 512
        load = (await client.get(engine.url + "/v1/loads")).json()["loads"][0]
        assert load["cache_hit_rate"] == pytest.approx(3 * 512 / (2 * 2048))
