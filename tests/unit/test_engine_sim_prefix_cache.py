"""engine_sim's radix prefix cache, driven in-process: a shared prefix is not prefilled again, the tree shares
the KV pool and every request's own KV comes back, --disable-radix-cache and role switches reset it."""

from __future__ import annotations

import pytest

from services.engine_sim.engine import SimEngine
from services.engine_sim.reports import load
from shared.engine import token_blocks
from tests.unit.test_engine_sim_core import VIRTUAL_TIME, finish, make_engine, running

pytestmark = VIRTUAL_TIME


def blocks(*ids: int) -> tuple[int, ...]:
    """Prefix blocks of a prompt made of 512-token blocks with these contents."""
    return token_blocks([i for b in ids for i in [b] * 512])


async def serve(engine: SimEngine, rid: str, prefix: tuple[int, ...], tokens: int) -> int:
    req = engine.submit(prompt_tokens=tokens, max_new_tokens=4, ignore_eos=True, rid=rid, prefix_blocks=prefix)
    await finish(engine, req)
    return req.cached_tokens


@pytest.mark.asyncio
async def test_a_colocated_engine_reuses_a_shared_prefix_and_gets_all_its_own_kv_back() -> None:
    engine = make_engine(mode="null")
    async with running(engine):
        assert await serve(engine, "a", blocks(1, 2, 3, 4), 2048) == 0
        # Same first three blocks: 1536 tokens cached, the fourth computed.
        assert await serve(engine, "b", blocks(1, 2, 3, 9), 2048) == 1536
        # The whole prompt again: all but its last token.
        assert await serve(engine, "c", blocks(1, 2, 3, 4), 2048) == 2047
        cache = engine.core.cache
        assert cache is not None and cache.tokens == 5 * 512 and cache.locked_tokens == 0
        assert engine.core.used_kv == 0 and load(engine).used_tokens == 0
        assert cache.hit_rate == pytest.approx((1536 + 2047) / (3 * 2048))


@pytest.mark.asyncio
async def test_the_tree_gives_its_room_to_new_prompts() -> None:
    # A pool of 3000 tokens: the second 2048-token prompt (and its 4 output tokens) evicts as much of the first
    # prompt's unlocked blocks as it needs, leaves first: three of four go, the first block stays.
    engine = make_engine(mode="null", kv_capacity_tokens=3000)
    async with running(engine):
        await serve(engine, "a", blocks(1, 2, 3, 4), 2048)
        await serve(engine, "b", blocks(5, 6, 7, 8), 2048)
        assert engine.core.cache is not None and engine.core.cache.tokens <= 3000
        assert await serve(engine, "c", blocks(1, 2, 3, 4), 2048) == 512


@pytest.mark.asyncio
async def test_disable_radix_cache_and_decode_engines_keep_no_cache() -> None:
    for engine in (make_engine(mode="null", disable_radix_cache=True), make_engine(mode="decode")):
        assert engine.core.cache is None
    engine = make_engine(mode="null", disable_radix_cache=True)
    async with running(engine):
        await serve(engine, "a", blocks(1, 2), 1024)
        assert await serve(engine, "b", blocks(1, 2), 1024) == 0


@pytest.mark.asyncio
async def test_a_role_switch_starts_an_empty_tree() -> None:
    engine = make_engine(mode="prefill", bootstrap_port=0)
    async with running(engine):
        assert engine.core.cache is not None
        engine.core.cache.record(blocks(1, 2), 1024, 0.0)
        assert (await engine.pd_role_switch("decode", decode_cuda_graph_memory_gb=0.0)).success and engine.core.cache is None
        assert (await engine.pd_role_switch("prefill")).success
        assert engine.core.cache is not None and engine.core.cache.tokens == 0


@pytest.mark.asyncio
async def test_flush_cache_empties_the_tree_of_an_idle_engine() -> None:
    engine = make_engine(mode="null")
    async with running(engine):
        await serve(engine, "a", blocks(1, 2), 1024)
        assert await engine.flush_cache()
        assert engine.core.cache is not None and engine.core.cache.tokens == 0
        assert await serve(engine, "b", blocks(1, 2), 1024) == 0
