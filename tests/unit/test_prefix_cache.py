"""The radix prefix cache: reuse, locks, LRU eviction of leaves, and the traces' own reuse bound."""

from __future__ import annotations

import pytest

from loadgen.traces import load_trace
from shared.engine import PrefixCache, reuse_bound


def served(cache: PrefixCache, blocks: list[int], input_tokens: int, now: float) -> int:
    """Admit, compute and finish one prompt; its cached tokens."""
    hold = cache.acquire(blocks, input_tokens, now)
    cache.insert(hold, now)
    cache.release(hold, now)
    return hold.cached_tokens


def test_a_shared_prefix_is_served_from_the_tree_and_the_last_token_is_always_computed() -> None:
    cache = PrefixCache(block_tokens=4)
    assert served(cache, [1, 2, 3], 10, 0.0) == 0
    assert cache.tokens == 10  # 4 + 4 + the last block's 2
    # Same first two blocks, another third: 8 tokens cached.
    assert served(cache, [1, 2, 9], 11, 1.0) == 8
    # The same prompt again: all of it is in the tree, but its last token is computed.
    hold = cache.acquire([1, 2, 3], 10, 2.0)
    assert hold.matched_tokens == 10 and hold.cached_tokens == 9
    assert cache.prompt_tokens == 31 and cache.cached_tokens == 17
    assert cache.hit_rate == pytest.approx(17 / 31)
    # A prefix match stops at the first block that differs, even if later ids agree.
    assert cache.match([7, 2, 3]) == 0 and cache.match([1, 5, 3]) == 1


def test_locked_nodes_are_never_evicted_and_unlocked_leaves_go_least_recently_used_first() -> None:
    cache = PrefixCache(block_tokens=4)
    served(cache, [1, 2], 8, 0.0)  # used at t=0
    served(cache, [3, 4], 8, 5.0)  # used at t=5
    held = cache.acquire([1, 2], 8, 6.0)  # locks 1-2 again (now the newest)
    assert cache.evictable_tokens == 8 and cache.locked_tokens == 8
    # Needs 4: the oldest unlocked leaf is 4 (of 3-4); 1-2 are locked.
    assert cache.evict(4) == 4 and cache.match([3, 4]) == 1 and cache.match([1, 2]) == 2
    # Everything evictable: 3 (a leaf now), never the locked path.
    assert cache.evict(100) == 4 and cache.match([3]) == 0 and cache.tokens == 8
    cache.release(held, 7.0)
    assert cache.evict(100) == 8 and cache.tokens == 0 and cache.evictable_tokens == 0


def test_a_node_touched_again_moves_to_the_back_of_the_eviction_order() -> None:
    cache = PrefixCache(block_tokens=4)
    served(cache, [1], 4, 0.0)
    served(cache, [2], 4, 1.0)
    served(cache, [1], 4, 2.0)  # 1 is now newer than 2
    assert cache.evict(4) == 4 and cache.match([2]) == 0 and cache.match([1]) == 1


def test_blocks_another_request_inserted_meanwhile_are_shared_not_added_twice() -> None:
    cache = PrefixCache(block_tokens=4)
    a = cache.acquire([1, 2], 8, 0.0)
    b = cache.acquire([1, 2], 8, 0.0)  # admitted before a finished: nothing cached yet
    assert a.cached_tokens == b.cached_tokens == 0
    assert cache.insert(a, 1.0) == 8
    assert cache.insert(b, 1.0) == 0 and cache.tokens == 8
    # b's own copy of the prompt is freed at its insert: the tree holds it now.
    assert b.tree_tokens - b.matched_tokens == 8
    cache.release(a, 2.0)
    assert cache.evict(100) == 0  # b still holds the path
    cache.release(b, 3.0)
    assert cache.evict(100) == 8


def test_the_traces_reuse_bound_is_the_share_of_prompt_tokens_an_earlier_request_sent() -> None:
    assert reuse_bound([([1, 2], 1024), ([1, 3], 1024)]) == pytest.approx(512 / 2048)
    # The Mooncake traces' own figures (issue: 37% conversation, 65% synthetic).
    conv = load_trace("mooncake-conv")
    assert reuse_bound([(r.hash_ids, r.input_tokens) for r in conv.requests]) == pytest.approx(0.374, abs=0.005)


def test_bad_block_size_is_refused() -> None:
    with pytest.raises(ValueError, match="block_tokens"):
        PrefixCache(block_tokens=0)
