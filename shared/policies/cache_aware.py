"""Prefix-cache-aware dispatch: where a prompt's prefix is cached, and what that is worth.

A dispatcher cannot ask the engines what they cache on every request; like sglang-router / SMG it keeps an
approximate copy: per engine, a radix tree of the prefix blocks it sent there (:class:`RoutedPrefixes`,
bounded by the engine's KV capacity, least recently used blocks forgotten first, as the engine evicts).

Two policies use it:

- :class:`CacheAware` is SMG's ``cache_aware`` (anchors §7, the baseline every peer ships): while the load is
  balanced, the engine with the longest prefix match when the matched share of the prompt is over
  ``cache_threshold`` (0.3), else the engine whose tree is smallest (most room to cache); when the load is
  imbalanced (in-flight requests: max - min > ``balance_abs_threshold`` 64 and max > ``balance_rel_threshold``
  1.5 x min), the engine with the fewest in flight. Decode engines are picked as :class:`LeastLoad` does
  (SMG pairs ``cache_aware`` prefill with a load-based decode policy).
- Poise's dispatch (:class:`shared.policies.arrow.ArrowDispatch`) prices the match instead of thresholding
  it: the prefill engine with the least predicted TTFT, its queue plus this prompt's *uncached* part
  (:meth:`RoutedPrefixes.uncached_tokens`), so a long cached prefix wins over a short queue only when it
  saves more time than the queue costs.
"""

from __future__ import annotations

import msgspec

from shared.engine import PrefixCache
from shared.policies.dispatch import DispatchParams, LeastLoad
from shared.policies.views import EngineView, RequestView


class RoutedPrefixes:
    """Per engine, the prefix blocks this dispatcher sent there (an approximation of the engine's cache)."""

    def __init__(self) -> None:
        self._trees: dict[str, tuple[str, PrefixCache]] = {}  # engine id -> (its role when sent, tree)

    def _tree(self, engine: EngineView) -> PrefixCache | None:
        """The engine's tree; forgotten when the engine changed role since (SGLang resets its cache then)."""
        entry = self._trees.get(engine.instance_id)
        if entry is None:
            return None
        if entry[0] != engine.role:
            del self._trees[engine.instance_id]
            return None
        return entry[1]

    def cached_tokens(self, engine: EngineView, request: RequestView) -> int:
        """Prompt tokens of ``request`` that ``engine`` likely has cached."""
        if not request.prefix_blocks:
            return 0
        tree = self._tree(engine)
        return tree.would_cache(request.prefix_blocks, request.input_tokens) if tree is not None else 0

    def uncached_tokens(self, engine: EngineView, request: RequestView) -> int:
        return request.input_tokens - self.cached_tokens(engine, request)

    def tree_tokens(self, engine: EngineView) -> int:
        tree = self._tree(engine)
        return tree.tokens if tree is not None else 0

    def record(self, engine: EngineView, request: RequestView, now_s: float) -> None:
        """``request`` goes to ``engine``: its blocks join that engine's tree, which forgets its least recently
        used blocks past the engine's KV capacity."""
        if not request.prefix_blocks:
            return
        tree = self._tree(engine)
        if tree is None:
            tree = PrefixCache()
            self._trees[engine.instance_id] = (engine.role, tree)
        tree.record(request.prefix_blocks, request.input_tokens, now_s)
        over = tree.tokens - engine.kv_capacity_tokens
        if over > 0:
            tree.evict(over)


class CacheAwareParams(msgspec.Struct, frozen=True, kw_only=True):
    cache_threshold: float = 0.3  # matched share of the prompt above which the best match wins (SMG default)
    balance_abs_threshold: int = 64  # imbalanced when max - min in-flight requests exceeds this ...
    balance_rel_threshold: float = 1.5  # ... and max exceeds this times min (SMG defaults)


class CacheAware(LeastLoad):
    """SMG's ``cache_aware`` prefill policy (and for colocated engines), least-load decode (module doc)."""

    name = "cache-aware"

    def __init__(self, params: DispatchParams | None = None, cache: CacheAwareParams | None = None) -> None:
        super().__init__(params)
        self.cache_params = cache or CacheAwareParams()
        self.prefixes = RoutedPrefixes()

    def _pick_for(self, request: RequestView, candidates: list[EngineView], phase: str, now_s: float) -> EngineView:
        if phase == "decode":  # decode engines keep no prefix cache: least load
            return self._pick(candidates, phase)
        chosen = self._by_cache(request, candidates)
        self.prefixes.record(chosen, request, now_s)
        return chosen

    def _by_cache(self, request: RequestView, candidates: list[EngineView]) -> EngineView:
        p = self.cache_params
        loads = [e.inflight_reqs for e in candidates]
        lo, hi = min(loads), max(loads)
        if hi - lo > p.balance_abs_threshold and hi > p.balance_rel_threshold * lo:
            return min(candidates, key=lambda e: (e.inflight_reqs, e.instance_id))
        best = max(candidates, key=lambda e: (self.prefixes.cached_tokens(e, request), -e.inflight_reqs,
                                              _desc(e.instance_id)))
        share = self.prefixes.cached_tokens(best, request) / request.input_tokens if request.input_tokens else 0.0
        if share > p.cache_threshold:
            return best
        return min(candidates, key=lambda e: (self.prefixes.tree_tokens(e), e.inflight_reqs,
                                              e.instance_id))


def _desc(instance_id: str) -> tuple[int, ...]:
    """A key that makes ``max`` prefer the lowest instance id among ties (deterministic, like ``min``)."""
    return tuple(-ord(c) for c in instance_id)
