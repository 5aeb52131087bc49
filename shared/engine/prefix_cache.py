"""SGLang's radix prefix cache, at the granularity of prompt blocks.

SGLang keeps the KV of every prompt it computed in a radix tree keyed by token ids. A new prompt walks the
tree; the KV of the longest cached prefix is reused and only the rest is prefilled. The tree shares the KV
pool with the running requests: a node some request still uses is locked, an unlocked one stays as cache
until the pool needs the room, and then the least recently used leaves go first (``RadixCache.evict``).

Here a prompt is a sequence of block ids (the Mooncake traces' ``hash_ids``: one id per 512-token block,
equal ids at equal positions meaning an equal prefix). A node is one block; its tokens are the block's (the
prompt's last block may be shorter). The tree is pure bookkeeping, with no clock: callers pass ``now`` so
the simulator and engine_sim can run it on virtual or wall time alike.

The life of one prompt, as the engine drives it:

1. ``acquire(blocks, input_tokens, now)`` at admission: the cached prefix is locked and its tokens are the
   request's ``cached`` tokens (SGLang always computes the prompt's last token, so at most ``input - 1``).
   The engine allocates KV only for the rest, calling ``evict`` first when the pool is short.
2. ``insert(hold, now)`` when the prompt is computed: its blocks join the tree (locked by the same hold); the
   tokens returned moved from the request's own KV into the tree's.
3. ``release(hold, now)`` when the request lets go of its KV (a prefill engine after the KV transfer, a
   colocated one at the end of decoding): the nodes are unlocked and become evictable.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

BLOCK_TOKENS = 512  # the Mooncake traces' block size


@dataclass(eq=False, slots=True)
class _Node:
    block: int
    tokens: int
    parent: _Node | None
    children: dict[int, _Node] = field(default_factory=dict)
    refs: int = 0
    last_used: float = 0.0


@dataclass(eq=False, slots=True)
class CacheHold:
    """One request's claim on the tree: the nodes it locked and how many of its prompt tokens were cached.

    ``matched_tokens`` is the KV the request found in the tree (no allocation needed); ``cached_tokens`` the
    prefill it skips, one token less when the whole prompt matched (the last token is always computed)."""

    blocks: tuple[int, ...]
    input_tokens: int
    cached_tokens: int
    matched_tokens: int
    nodes: list[_Node]
    released: bool = False

    @property
    def tree_tokens(self) -> int:
        """Tokens of the request's prompt the tree holds for it (its matched prefix, and after ``insert`` the
        rest): the engine frees its own copy of ``tree_tokens - matched_tokens`` at the insert."""
        return sum(n.tokens for n in self.nodes)


class PrefixCache:
    """A radix tree of prompt blocks with locks and LRU eviction of unlocked leaves (see the module doc)."""

    def __init__(self, block_tokens: int = BLOCK_TOKENS) -> None:
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.block_tokens = block_tokens
        self._root = _Node(block=-1, tokens=0, parent=None)
        self.tokens = 0  # tokens the tree holds, locked or not
        self.locked_tokens = 0  # ... of which some request still uses
        self.prompt_tokens = 0  # prompts acquired so far, their tokens ...
        self.cached_tokens = 0  # ... and how many of those came from the tree
        self._lru: list[tuple[float, int, _Node]] = []  # candidate leaves; stale entries are skipped on pop
        self._seq = itertools.count()

    @property
    def evictable_tokens(self) -> int:
        """Tokens the pool can get back by eviction (every unlocked node goes once its children have)."""
        return self.tokens - self.locked_tokens

    @property
    def hit_rate(self) -> float:
        """Cached share of every prompt token acquired so far (SGLang's ``cache_hit_rate``)."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def block_sizes(self, blocks: Sequence[int], input_tokens: int) -> list[int]:
        """Tokens of each block of a prompt: full blocks, the last one what remains."""
        sizes = [self.block_tokens] * len(blocks)
        if sizes:
            sizes[-1] = max(1, input_tokens - self.block_tokens * (len(blocks) - 1))
        return sizes

    def match(self, blocks: Sequence[int]) -> int:
        """How many leading blocks of ``blocks`` the tree holds (no side effects: a router's estimate)."""
        node, n = self._root, 0
        for block in blocks:
            child = node.children.get(block)
            if child is None:
                break
            node, n = child, n + 1
        return n

    def would_cache(self, blocks: Sequence[int], input_tokens: int) -> int:
        """Prompt tokens a request would find cached (at most ``input_tokens - 1``)."""
        n = self.match(blocks)
        return min(sum(self.block_sizes(blocks, input_tokens)[:n]), max(0, input_tokens - 1))

    def acquire(self, blocks: Sequence[int], input_tokens: int, now: float) -> CacheHold:
        """Lock the cached prefix of a prompt being admitted; its tokens are the request's cached tokens."""
        nodes: list[_Node] = []
        node = self._root
        for block in blocks:
            child = node.children.get(block)
            if child is None:
                break
            nodes.append(child)
            node = child
        for n in nodes:
            self._lock(n, now)
        matched = sum(n.tokens for n in nodes)
        cached = min(matched, max(0, input_tokens - 1))
        self.prompt_tokens += input_tokens
        self.cached_tokens += cached
        return CacheHold(blocks=tuple(blocks), input_tokens=input_tokens, cached_tokens=cached,
                         matched_tokens=matched, nodes=nodes)

    def make_room(self, tokens: int, room: int) -> bool:
        """Whether ``tokens`` more fit in a pool that has ``room`` tokens besides the requests' own KV (the tree
        lives in that room), evicting unlocked blocks for them when that is what it takes."""
        short = tokens - (room - self.tokens)
        if short > 0:
            self.evict(short)
        return tokens <= room - self.tokens

    def claim(self, blocks: Sequence[int], input_tokens: int, need: int, room: int, now: float) -> CacheHold | None:
        """An admission with the cache, as both engine models do it: lock the prompt's cached prefix (that KV
        is there already) and make room for the rest of the ``need`` KV tokens; None, with the lock given back,
        when the rest does not fit."""
        hold = self.acquire(blocks, input_tokens, now)
        if not self.make_room(need - hold.matched_tokens, room):
            self.cancel(hold)
            return None
        return hold

    def insert(self, hold: CacheHold, now: float) -> int:
        """Add the computed prompt's blocks past its cached prefix (locked for ``hold``); the tokens added,
        which leave the request's own KV for the tree's. Blocks another request inserted meanwhile are
        shared, not added twice."""
        if hold.released:
            raise ValueError("insert after release")
        sizes = self.block_sizes(hold.blocks, hold.input_tokens)
        node = hold.nodes[-1] if hold.nodes else self._root
        added = 0
        for i in range(len(hold.nodes), len(hold.blocks)):
            block = hold.blocks[i]
            child = node.children.get(block)
            if child is None:
                child = _Node(block=block, tokens=sizes[i], parent=node)
                node.children[block] = child
                self.tokens += child.tokens
                added += child.tokens
            self._lock(child, now)
            hold.nodes.append(child)
            node = child
        return added

    def record(self, blocks: Sequence[int], input_tokens: int, now: float) -> None:
        """A prompt's blocks, unlocked and most recently used (a router's copy of what it sent an engine:
        nothing is locked, hit counts are left alone)."""
        sizes = self.block_sizes(blocks, input_tokens)
        node = self._root
        for block, size in zip(blocks, sizes, strict=True):
            child = node.children.get(block)
            if child is None:
                child = _Node(block=block, tokens=size, parent=node)
                node.children[block] = child
                self.tokens += size
            child.last_used = now
            node = child
        if node is not self._root and not node.children:
            self._push(node)

    def release(self, hold: CacheHold, now: float) -> None:
        """The request lets go of its KV: its nodes are unlocked and, once unused, evictable (LRU)."""
        if hold.released:
            return
        hold.released = True
        for node in hold.nodes:
            node.refs -= 1
            node.last_used = now
            if node.refs == 0:
                self.locked_tokens -= node.tokens
                if not node.children:
                    self._push(node)

    def cancel(self, hold: CacheHold) -> None:
        """Undo an ``acquire`` whose prompt could not be admitted after all (it is counted again when it is)."""
        if hold.released:
            return
        hold.released = True
        self.prompt_tokens -= hold.input_tokens
        self.cached_tokens -= hold.cached_tokens
        for node in hold.nodes:
            node.refs -= 1
            if node.refs == 0:
                self.locked_tokens -= node.tokens
                if not node.children:
                    self._push(node)

    def evict(self, tokens: int) -> int:
        """Free at least ``tokens`` (or all that can go): unlocked leaves, least recently used first; a parent
        left childless and unlocked becomes a leaf in turn. Returns the tokens freed."""
        freed = 0
        while freed < tokens and self._lru:
            last_used, _, node = heapq.heappop(self._lru)
            if node.refs or node.children or node.parent is None or last_used != node.last_used:
                continue  # stale: locked again, grew a child, already evicted, or touched since
            parent = node.parent
            del parent.children[node.block]
            node.parent = None
            self.tokens -= node.tokens
            freed += node.tokens
            if parent is not self._root and not parent.children and parent.refs == 0:
                self._push(parent)
        return freed

    def _lock(self, node: _Node, now: float) -> None:
        if node.refs == 0:
            self.locked_tokens += node.tokens
        node.refs += 1
        node.last_used = now

    def _push(self, node: _Node) -> None:
        heapq.heappush(self._lru, (node.last_used, next(self._seq), node))


def reuse_bound(prompts: Sequence[tuple[Sequence[int], int]]) -> float:
    """The share of prompt tokens an unbounded cache would serve, in arrival order: the trace's own reuse,
    the ceiling of any cache's hit rate on it (``prompts``: (blocks, input tokens) each)."""
    cache = PrefixCache()
    for blocks, input_tokens in prompts:
        hold = cache.acquire(blocks, input_tokens, 0.0)
        cache.insert(hold, 0.0)
    return cache.hit_rate
