"""Prefill scheduling policies: what a prefill engine computes in its next forward pass.

A policy is pure (queue in, plan out): ``plan(queue, budget, now_s)`` gets every prompt on the engine that
still has tokens to prefill, in arrival order, and returns the parts of the next forward pass, highest
priority first: ``(prompt, tokens to compute now)``, at most ``budget`` tokens in all unless a policy says
otherwise (a chunk size, or effectively unlimited when the engine does not chunk). Items are read through
:class:`PrefillItem`, so the simulator's and engine_sim's requests are passed as they are.

When the engine asks is the engine's preemption granularity (see ``PREEMPTION`` below), not the policy's:

- ``chunk``: the pass is one chunk (SGLang's chunked prefill); the engine asks again at every chunk boundary,
  so a new plan can switch prompts there. Small chunks switch sooner and pay a launch per chunk.
- ``operator``: the pass runs the planned prompts to the end; when a prompt arrives the engine asks again and,
  if the new plan's head is not in the running pass, preempts it at the next operator boundary (FlowPrefill's
  cooperative preemption, :meth:`LatencyModel.operator_boundary_s`). Work done is kept: the cut prompts
  resume later from where they stopped.

A policy whose ``event_driven`` is True (FlowPrefill) is asked only when a prompt arrived or the running
pass completed; between those events the engine keeps computing the prompts of its last plan. Others are
asked before every pass (Kairos re-ranks at every chunk step). ``observe`` feeds back each finished pass.

Imports nothing from asyncio, nats, aetcd, httpx or fastapi.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, Literal, Protocol, TypeVar, runtime_checkable

#: Where a prefill engine can stop a forward pass for a more urgent prompt.
Preemption = Literal["chunk", "operator"]
PREEMPTION: tuple[Preemption, ...] = ("chunk", "operator")


class PrefillItem(Protocol):
    """What a prefill policy may read about a prompt."""

    @property
    def rid(self) -> str: ...
    @property
    def arrival_s(self) -> float: ...  # when the request reached the serving system, on the engine's clock
    @property
    def input_tokens(self) -> int: ...
    @property
    def prefilled(self) -> int: ...  # prompt tokens already computed (chunked or preempted prefill)
    @property
    def slo_ttft_s(self) -> float: ...  # inf when the request carries no TTFT target


T = TypeVar("T", bound=PrefillItem)


@dataclass(slots=True)
class PrefillPlan(Generic[T]):
    """The next forward pass: ``parts`` in priority order (may be empty). ``retry_at_s``: the queue is not
    empty but the policy chose to wait (a batching timeout); the engine asks again then, or at the next
    arrival, whichever comes first."""

    parts: list[tuple[T, int]] = field(default_factory=list)
    retry_at_s: float | None = None


class PrefillPolicy(Protocol):
    name: str
    event_driven: bool  # True: ask only on arrivals and completions; False: before every forward pass

    def plan(self, queue: Sequence[T], budget: int, now_s: float) -> PrefillPlan[T]: ...

    def observe(self, tokens: int, seconds: float) -> None:
        """A forward pass computed ``tokens`` prompt tokens in ``seconds`` (for online throughput estimates)."""
        ...


@runtime_checkable
class PlansForServers(Protocol):
    """A policy whose order depends on how many engines serve the queue: the gateway's held queue (late
    binding) feeds every prefill engine of a model, so a plan that adds up the prompts' prefill times must
    spread them over the engines, or it sees a one-engine backlog and gives up prompts the cluster has time
    for."""

    def plan_for(self, queue: Sequence[T], budget: int, now_s: float, servers: int) -> PrefillPlan[T]: ...


def remaining(item: PrefillItem) -> int:
    return item.input_tokens - item.prefilled


def deadline_s(item: PrefillItem) -> float:
    """The TTFT deadline on the engine's clock (inf without a target)."""
    return item.arrival_s + item.slo_ttft_s


def fill(ranked: Sequence[T], budget: int) -> list[tuple[T, int]]:
    """Chunk filling: whole remaining prompts in ``ranked`` order while they fit; the first one that does not
    fit gets the rest of the budget (a partial chunk) and the pass is full (Kairos Algorithm 1 lines 11-18,
    and how SGLang fills a chunk in arrival order)."""
    parts: list[tuple[T, int]] = []
    for item in ranked:
        if budget <= 0:
            break
        n = min(remaining(item), budget)
        if n <= 0:
            continue
        parts.append((item, n))
        budget -= n
    return parts


def preempts(plan: PrefillPlan[T], running: Sequence[tuple[T, int]]) -> bool:
    """Whether ``plan`` should take the engine from the pass that is running ``running``: its head is not
    one of the running prompts. Used by engines with ``operator`` preemption when a prompt arrives."""
    if not plan.parts:
        return False
    head = plan.parts[0][0]
    return all(item is not head for item, _ in running)


class Fcfs:
    """Arrival order, chunks filled in that order (SGLang's ``fcfs`` schedule policy without a prefix cache)."""

    name = "fcfs"
    event_driven = False

    def plan(self, queue: Sequence[T], budget: int, now_s: float) -> PrefillPlan[T]:
        return PrefillPlan(fill(queue, budget))

    def observe(self, tokens: int, seconds: float) -> None:
        return None


class Edf:
    """Earliest TTFT deadline first (arrival + the request's TTFT SLO); ties by arrival, then rid.

    FlowPrefill's EDF ablation, and its chunked baselines (DistServe-CP2K/CP8K are chunked prefill + EDF).
    Requests without a target go last, in arrival order.
    """

    name = "edf"
    event_driven = False

    def plan(self, queue: Sequence[T], budget: int, now_s: float) -> PrefillPlan[T]:
        return PrefillPlan(fill(sorted(queue, key=lambda r: (deadline_s(r), r.arrival_s, r.rid)), budget))

    def observe(self, tokens: int, seconds: float) -> None:
        return None


#: SGLang's ``--max-prefill-tokens`` default: the most prompt tokens one prefill batch packs when prompts are
#: not chunked (a longer prompt still runs, alone).
MAX_PREFILL_TOKENS = 16384


def whole_prompts(parts: Sequence[tuple[T, int]], budget: int = MAX_PREFILL_TOKENS) -> list[tuple[T, int]]:
    """A plan for an engine that does not chunk: every planned prompt runs to its end in this pass; prompts
    join in plan order while the pass stays within ``budget`` tokens (the first always runs, however long)."""
    out: list[tuple[T, int]] = []
    total = 0
    for item, _ in parts:
        n = remaining(item)
        if out and total + n > budget:
            break
        out.append((item, n))
        total += n
    return out
