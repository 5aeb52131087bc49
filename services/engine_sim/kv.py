"""KV cache accounting in tokens.

Two numbers per request: ``kv_used`` (tokens actually filled: prompt + generated) and ``kv_reserved`` (what
admission set aside, e.g. prompt + ``num_reserved_decode_tokens`` on a decode engine, like SGLang's
prealloc). The pool admits a request only if its reservation fits next to everyone else's, and a request
that outgrows its reservation takes one token at a time from what is left; the scheduler retracts a request
when that runs out, so ``used`` and ``reserved`` never exceed ``capacity``.

With SGLang's radix prefix cache (``cache``, on unless ``--disable-radix-cache``; prefill and colocated
engines) the pool also holds the tree's blocks (``shared.engine.prefix_cache``): a request's matched prefix is
the tree's, not its own; a computed prompt's blocks move from the request into the tree
(:meth:`into_tree`); the tree's unlocked blocks are evicted, least recently used first, when an admission
needs their room (:meth:`fits`).
"""

from __future__ import annotations

from services.engine_sim.requests import SimRequest
from shared.engine import PrefixCache


class KvPool:
    __slots__ = ("capacity", "used", "reserved", "cache")

    def __init__(self, capacity: int, cache: PrefixCache | None = None) -> None:
        self.capacity = capacity
        self.used = 0  # sum of kv_used: the requests' own KV
        self.reserved = 0  # sum of max(kv_reserved, kv_used): what admission checks against
        self.cache = cache

    @property
    def tree_tokens(self) -> int:
        return self.cache.tokens if self.cache is not None else 0

    @property
    def in_use(self) -> int:
        """What /v1/loads reports as num_used_tokens: the requests' KV and the tree blocks they lock (SGLang
        counts evictable cache as available)."""
        return self.used + (self.cache.locked_tokens if self.cache is not None else 0)

    @property
    def free(self) -> int:
        return self.capacity - self.reserved - self.tree_tokens

    def fits(self, tokens: int) -> bool:
        """Whether ``tokens`` fit, evicting unlocked cache for them when that is what it takes."""
        if self.cache is not None:
            return self.cache.make_room(tokens, self.capacity - self.reserved)
        return tokens <= self.free

    def into_tree(self, req: SimRequest, now: float) -> None:
        """The request's computed prompt joins the tree (locked by it): that KV is the tree's from now on."""
        hold = req.cache_hold
        if hold is None or self.cache is None:
            return
        self.cache.insert(hold, now)
        moved = hold.tree_tokens - hold.matched_tokens
        req.kv_used -= moved
        req.kv_reserved -= moved
        self.used -= moved
        self.reserved -= moved

    def admit(self, req: SimRequest, used: int, reserve: int) -> None:
        """Allocate ``used`` tokens now and hold ``reserve`` (>= used) for the request."""
        reserve = max(reserve, used)
        assert reserve <= self.free, "admit() without fits()"
        req.kv_used = used
        req.kv_reserved = reserve
        self.used += used
        self.reserved += reserve

    def needs_growth(self, req: SimRequest, tokens: int = 1) -> bool:
        return req.kv_used + tokens > req.kv_reserved

    def grow(self, req: SimRequest, tokens: int = 1) -> None:
        """Fill ``tokens`` more slots; beyond the reservation they come out of the free pool."""
        new_used = req.kv_used + tokens
        if new_used > req.kv_reserved:
            extra = new_used - req.kv_reserved
            assert extra <= self.free, "grow() beyond capacity"
            self.reserved += extra
            req.kv_reserved = new_used
        self.used += tokens
        req.kv_used = new_used

    def release(self, req: SimRequest, now: float = 0.0) -> None:
        self.used -= req.kv_used
        self.reserved -= req.kv_reserved
        req.kv_used = 0
        req.kv_reserved = 0
        if req.cache_hold is not None and self.cache is not None:
            self.cache.release(req.cache_hold, now)
        req.cache_hold = None

    @property
    def usage(self) -> float:
        return self.in_use / self.capacity if self.capacity else 0.0
