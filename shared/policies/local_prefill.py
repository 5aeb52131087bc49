"""DOPD's local prefill of ultra-short prompts ("PD aggregation"): which requests skip the prefill instances.

For a very short prompt the KV transfer and the extra hop cost more than the prefill itself, so DOPD
prefills it on the decode instance, merged with that instance's decode steps (spec-arrow-dopd.md B4,
errata 9). The rule is Dynamo's conditional disaggregation, which DOPD's repository uses: prefill remotely
iff ``prompt_len * (1 - prefix_hit) > max_local_prefill_tokens`` and the prefill queue is shorter than
``max_prefill_queue``. Poise has no prefix cache in its picture, so the hit rate is 0; the queue rule is off
unless set (Dynamo's default is 2 queued prompts; DOPD's 70B config 16).

:class:`LocalPrefill` wraps any dispatch policy: the inner policy picks the pair as usual (so its decode
choice is the one a remote prefill would have used), and a request the rule keeps local goes to that decode
instance alone, as a ``Placement`` with no prefill instance. Only decode engines that can prefill
(``EngineView.local_prefill``: engine_sim and the simulator, not SGLang's PD decode mode) are eligible.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from shared.policies.dispatch import DispatchPolicy, Placement, Rejection
from shared.policies.views import EngineView, RequestView

DEFAULT_MAX_LOCAL_PREFILL_TOKENS = 512  # the spec's L_us; DOPD's 70B config: 511, Dynamo's default: 1000


class LocalPrefillParams(msgspec.Struct, frozen=True, kw_only=True):
    max_local_prefill_tokens: int = DEFAULT_MAX_LOCAL_PREFILL_TOKENS  # prompts up to this long stay local
    max_prefill_queue: int | None = None  # also local when the chosen prefill engine queues this many; None: off

    def __post_init__(self) -> None:
        if self.max_local_prefill_tokens < 0:
            raise ValueError("max_local_prefill_tokens must be >= 0")
        if self.max_prefill_queue is not None and self.max_prefill_queue < 1:
            raise ValueError("max_prefill_queue must be >= 1 (or None for no queue rule)")


def stays_local(params: LocalPrefillParams, input_tokens: int, prefill: EngineView | None) -> bool:
    """Dynamo's rule, inverted: local unless the prompt is long enough and the prefill side keeps up."""
    if input_tokens <= params.max_local_prefill_tokens:
        return True
    if params.max_prefill_queue is None or prefill is None:
        return False
    return prefill.waiting_reqs + prefill.queue_reqs + prefill.inflight_reqs >= params.max_prefill_queue


class LocalPrefill:
    """A dispatch policy whose short requests are prefilled on their decode instance (see the module doc)."""

    def __init__(self, inner: DispatchPolicy, params: LocalPrefillParams | None = None) -> None:
        self.inner = inner
        self.params = params or LocalPrefillParams()
        self.name = f"{inner.name}+local-prefill"

    def __getattr__(self, name: str) -> object:
        # The inner policy's extras (Arrow's observe_prefill, its predictors) stay reachable through the wrapper.
        return getattr(self.inner, name)

    def place(self, request: RequestView, engines: Sequence[EngineView], now_s: float,
              exclude: frozenset[str] = frozenset()) -> Placement | Rejection:
        decision = self.inner.place(request, engines, now_s, exclude)
        if not isinstance(decision, Placement) or decision.prefill_id is None:
            return decision
        by_id = {e.instance_id: e for e in engines}
        decode = by_id.get(decision.decode_id)
        if decode is None or not decode.local_prefill:
            return decision
        if not stays_local(self.params, request.input_tokens, by_id.get(decision.prefill_id)):
            return decision
        return Placement(prefill_id=None, decode_id=decision.decode_id, stages=(*decision.stages, "local-prefill"))
