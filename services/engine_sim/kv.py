"""KV cache accounting in tokens.

Two numbers per request: ``kv_used`` (tokens actually filled: prompt + generated) and ``kv_reserved`` (what
admission set aside, e.g. prompt + ``num_reserved_decode_tokens`` on a decode engine, like SGLang's
prealloc). The pool admits a request only if its reservation fits next to everyone else's, and a request
that outgrows its reservation takes one token at a time from what is left; the scheduler retracts a request
when that runs out, so ``used`` and ``reserved`` never exceed ``capacity``.
"""

from __future__ import annotations

from services.engine_sim.requests import SimRequest


class KvPool:
    __slots__ = ("capacity", "used", "reserved")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0  # sum of kv_used: what /v1/loads reports as num_used_tokens
        self.reserved = 0  # sum of max(kv_reserved, kv_used): what admission checks against

    @property
    def free(self) -> int:
        return self.capacity - self.reserved

    def fits(self, tokens: int) -> bool:
        return tokens <= self.free

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

    def release(self, req: SimRequest) -> None:
        self.used -= req.kv_used
        self.reserved -= req.kv_reserved
        req.kv_used = 0
        req.kv_reserved = 0

    @property
    def usage(self) -> float:
        return self.used / self.capacity if self.capacity else 0.0
