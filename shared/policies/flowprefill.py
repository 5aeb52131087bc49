"""FlowPrefill (Hsieh et al.): S-EDF priority and SLO-aware batching for operator-preemptible prefill.

Pure objects (../shared/spec/spec-ares-kairos-flowprefill.md, section 3):

- :class:`FlowPrefill` (``flowprefill``): event-driven (Algorithm 2: asked only when a prompt arrives or a
  pass completes); ranks the queue by S-EDF (Eq. 3), takes the top prompt H and batches lower-priority
  prompts with it while the batch still meets H's deadline and stays under G tokens (Algorithm 1). The
  engine's operator-level preemption (``preempts`` in :mod:`shared.policies.prefill_order`) cuts the running
  pass when the new plan's head is not in it.
- ``flowprefill-fewest-late``: the same, but when the feasible prompts cannot all meet their deadlines one
  after another, it gives up the fewest (:func:`fewest_late`, Moore and Hodgson's rule) instead of letting
  the deadline order make every later one late. A Poise extension, not in the paper.
- ``flowprefill-fewest-late-cautious``: the same rule with every prompt's prefill counted at
  ``CAUTIOUS_LATE_COST`` times its time alone (``FlowPrefillParams.late_cost``) on an engine whose prefill
  shares its steps with decode, so a colocated engine gives up more of a burst, and earlier. Poise's engines'
  order (docs/engine-scheduling.md).
- :class:`Sedf` (``sedf``) and :class:`DEdf` (``d-edf``): the priority functions alone, chunks filled in
  that order and re-ranked before every pass, like :class:`shared.policies.prefill_order.Edf` (the paper's
  ablation baselines, and S-EDF for chunked engines).

TTFT_hat is the latency model's prefill time for a prompt's *remaining* tokens after those already done
(the spec's degree-2 polynomial, 3.5; for a partly done prompt the spec's 3.10 #3 "remaining" reading).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from shared.latency import LatencyModel
from shared.policies.prefill_order import PrefillItem, PrefillPlan, T, deadline_s, fill, remaining

_INF = math.inf

Priority = Literal["sedf", "d-edf", "edf"]
SortKey = tuple[int, float, float, str]


def ttft_hat(model: LatencyModel, item: PrefillItem) -> float:
    """Predicted prefill time of what is left of ``item``, run alone."""
    return model.prefill_time_s(remaining(item), item.prefilled)


def sedf_key(model: LatencyModel, item: PrefillItem, now_s: float) -> SortKey:
    """S-EDF (Eq. 3, priority = sgn(slack)/deadline) as an ascending sort key (the spec's form, no 1/d):
    feasible prompts (slack >= 0) first, earliest deadline first; infeasible ones after, *latest* deadline
    first (they miss anyway; the one with most time left may still be the least late); prompts without a
    target last, in arrival order."""
    return _sedf_key_and_work(model, item, now_s)[0]


def _sedf_key_and_work(model: LatencyModel, item: PrefillItem, now_s: float) -> tuple[SortKey, float]:
    """:func:`sedf_key`, and the prompt's remaining prefill work it was computed from (0 without a target):
    :func:`fewest_late` needs both, once per prompt per ranking."""
    # Once per queued prompt per ranking, the simulator's hottest policy code: deadline_s, remaining and
    # prefill_pass_s spelled out here, with the same arithmetic.
    arrival = item.arrival_s
    deadline = arrival + item.slo_ttft_s
    if deadline == _INF:
        return (2, arrival, 0.0, item.rid), 0.0
    done = item.prefilled
    n = item.input_tokens - done
    work = model.prefill_work_s(n, done)
    # ttft_hat: the prompt's pass run alone (prefill_pass_s: an empty pass takes no time)
    ttft = (0.0 if work == 0.0 and model.time_scale > 0 else model.pass_overhead_s + work) if n > 0 else 0.0
    if deadline - now_s - ttft >= 0:
        return (0, deadline, arrival, item.rid), work
    return (1, -deadline, arrival, item.rid), work


def dedf_key(item: PrefillItem, now_s: float) -> SortKey:
    """D-EDF (priority = sgn(deadline - now)/deadline): like S-EDF, but only prompts whose deadline has
    already *passed* are demoted; one that cannot make it any more but is not yet late still ranks by EDF."""
    deadline = deadline_s(item)
    if math.isinf(deadline):
        return (2, item.arrival_s, 0.0, item.rid)
    if deadline >= now_s:
        return (0, deadline, item.arrival_s, item.rid)
    return (1, -deadline, item.arrival_s, item.rid)


def edf_key(item: PrefillItem, now_s: float) -> SortKey:
    """EDF (priority = 1/deadline); prompts without a target last, in arrival order."""
    deadline = deadline_s(item)
    if math.isinf(deadline):
        return (1, item.arrival_s, 0.0, item.rid)
    return (0, deadline, item.arrival_s, item.rid)


#: ``flowprefill-fewest-late-cautious``'s cost factor, on engines whose prefill shares each step with a decode
#: batch (colocated ones): there a prompt's prefill waits on the decode work of every step, and the arrivals
#: behind it keep coming, so it ends later than its work alone says. A prefill engine's steps are its own;
#: counted cautiously there too, the Mooncake synthetic trace lost a goodput step. The factor was
#: tried at 1.5, 2.5, 4 and 8 on stress-bursts' first burst, 2.5 held the most (tests/bench/results/provenance.md).
CAUTIOUS_LATE_COST = 2.5


def fewest_late(model: LatencyModel, queue: Sequence[T], now_s: float, batch_tokens: int,
                cost_factor: float = 1.0, servers: int = 1) -> list[T]:
    """Rank ``queue`` by S-EDF, reordered so that the fewest prompts miss their deadlines.

    S-EDF serves the feasible prompts by deadline. In a burst that outruns the engine, the sum of their prefill
    times passes one deadline after another, and every prompt from there on is late: deadline order is
    optimal when everything fits and poor when it does not. Moore and Hodgson's rule (the optimal schedule for
    the number of late jobs on one machine) walks the feasible prompts in deadline order, adding up their
    prefill times; whenever one would finish past its deadline, the longest prompt taken so far is given up.
    The kept prompts run first, in deadline order, then the given-up ones (they may still make it where the
    estimate is pessimistic), then S-EDF's already infeasible ones and prompts without a target.

    A prompt's time is its own work plus its token share of a pass's launch overhead (passes of
    ``batch_tokens``), since batched prompts share one launch. When every feasible prompt fits, the order is
    S-EDF's unchanged.

    ``cost_factor`` multiplies every prompt's time in that walk (1: its work alone; more gives up more).
    ``servers``: the engines the queue feeds (a gateway's held queue feeds all of a model's prefill engines);
    the walk's clock advances by each prompt's time over their number, as a fluid list schedule would, plus
    one prompt's own time for the last (its pass cannot be split across engines).
    """
    # The simulator asks this on every arrival and completion of every engine, over queues of hundreds past
    # capacity: each prompt's work is computed once and serves both its S-EDF key and its cost below.
    overhead = model.pass_overhead_s
    keyed: list[tuple[SortKey, T, float]] = []
    for r in queue:
        key, work = _sedf_key_and_work(model, r, now_s)
        keyed.append((key, r, work))
    keyed.sort(key=_first)
    finish = now_s
    share = 1.0 / max(1, servers)
    taken: list[tuple[float, int]] = []  # (-time, index): a max-heap on prefill time
    given_up: set[int] = set()
    feasible = 0
    for i, (key, item, work) in enumerate(keyed):
        if key[0] != 0:
            break
        feasible = i + 1
        n = item.input_tokens - item.prefilled
        launch = overhead * (n / batch_tokens) if n < batch_tokens else overhead  # min(1, n / G) of it
        cost = (work + launch) * cost_factor
        finish += cost * share
        if finish + cost * (1.0 - share) > key[1]:  # past capacity: push and pop the longest in one go
            longest, j = heapq.heappushpop(taken, (-cost, i))
            finish += longest * share
            given_up.add(j)
        else:
            heapq.heappush(taken, (-cost, i))
    ranked = [r for _, r, _ in keyed]
    if not given_up:
        return ranked
    kept = [r for i, r in enumerate(ranked[:feasible]) if i not in given_up]
    late = [ranked[i] for i in sorted(given_up)]
    return kept + late + ranked[feasible:]


def _first(entry: tuple[SortKey, object, float]) -> SortKey:
    return entry[0]


def rank(model: LatencyModel, priority: Priority, queue: Sequence[T], now_s: float) -> list[T]:
    if priority == "sedf":
        return sorted(queue, key=lambda r: sedf_key(model, r, now_s))
    if priority == "d-edf":
        return sorted(queue, key=lambda r: dedf_key(r, now_s))
    return sorted(queue, key=lambda r: edf_key(r, now_s))


@dataclass(frozen=True, slots=True)
class FlowPrefillParams:
    """FlowPrefill's knobs (spec 3.7)."""

    # G, the batch token budget. The paper never states its default; 4096 is the spec's recommendation
    # (Fig. 11: "little difference" in throughput between 4K and 8K, and less SLO risk). The top prompt runs
    # even when it alone is longer.
    batch_tokens: int = 4096
    # The priority function ranking the queue: S-EDF (the paper's), or its ablations D-EDF and EDF (Fig. 10).
    priority: Priority = "sedf"
    # Give up the fewest prompts when the feasible ones cannot all make their deadlines (fewest_late); S-EDF only.
    fewest_late: bool = False
    # fewest_late counts each prompt's prefill as this many times its work alone (1: as the latency model says)
    # on an engine whose prefill shares its steps with a decode batch; a prefill engine counts the work alone.
    late_cost: float = 1.0

    def __post_init__(self) -> None:
        if self.fewest_late and self.priority != "sedf":
            raise ValueError("fewest_late reorders an S-EDF ranking; it needs priority 'sedf'")
        if self.late_cost < 1.0:
            raise ValueError(f"late_cost must be >= 1 (a prompt takes at least its own work), got {self.late_cost}")


class FlowPrefill:
    """S-EDF + SLO-aware batching (Algorithms 1-2).

    ``plan`` ranks every prompt with tokens left, takes the top one as H and walks the rest in priority
    order, adding prompt r while ``T_remain > predict_latency(batch + r)`` and ``N + r < G`` (strict, as in
    Algorithm 1 line 9), first-fit without a break; ``T_remain = deadline(H) - now``. Only H's deadline is
    checked: the members rank lower, so their deadlines are later or already lost.

    Judgement calls, written down:

    - ``predict_latency`` is the latency model's cost of the whole pass, one launch overhead plus each
      part's own work (:meth:`LatencyModel.prefill_batch_time_s`), not the polynomial of the summed token
      count. Attention is per sequence; the summed-count polynomial charges a batch of short prompts the
      quadratic term of one long prompt and so under-batches exactly the prompts the paper batches (short
      ones, which batch almost for free, §3.2).
    - Candidates are all other prompts, partly prefilled ones included. The paper restricts them to waiting
      requests (spec 3.10 #4) because its Execution Pool keeps a preempted task's activations as one unit;
      our engines keep each prompt's KV, so a cut prompt can join any later pass.
    - No online correction of TTFT_hat: the paper refits its polynomial offline, and ``observe`` sees only
      (tokens, seconds) of a pass, too little to attribute an error to a prompt.

    The parts are H's and then the members' remaining tokens, cut by ``fill`` so the pass respects ``budget``
    (between events the engine keeps computing this plan's prompts, chunk after chunk).
    """

    name = "flowprefill"
    event_driven = True  # Algorithm 2: re-rank on arrivals and completions only

    def __init__(self, model: LatencyModel, params: FlowPrefillParams | None = None) -> None:
        self.model = model
        self.params = params or FlowPrefillParams()
        self._late_cost = self.params.late_cost

    def set_decode_sharing(self, shares: bool) -> None:
        """Whether this engine's prefill shares its steps with a decode batch (colocated, or a decode engine
        prefilling short prompts locally): ``late_cost`` applies only there. The engine calls it on each role."""
        self._late_cost = self.params.late_cost if shares else 1.0

    def batch(self, ranked: Sequence[T], now_s: float) -> list[T]:
        """Algorithm 1: H (``ranked[0]``) and the prompts batched with it, in priority order."""
        if not ranked:
            return []
        model = self.model
        head = ranked[0]
        t_remain = deadline_s(head) - now_s
        chosen = [head]
        tokens = remaining(head)
        # The pass's work summed as prefill_batch_time_s sums it (part by part, in this order), kept as a
        # running total: the candidates are the whole queue.
        work = model.prefill_work_s(tokens, head.prefilled) if tokens > 0 else 0.0
        budget = self.params.batch_tokens
        for r in ranked[1:]:
            left = r.input_tokens - r.prefilled
            n = tokens + left
            if n >= budget:
                continue
            with_r = work + model.prefill_work_s(left, r.prefilled) if left > 0 else work
            if t_remain > model.prefill_pass_s(with_r):
                chosen.append(r)
                work = with_r
                tokens = n
        return chosen

    def plan(self, queue: Sequence[T], budget: int, now_s: float) -> PrefillPlan[T]:
        return self.plan_for(queue, budget, now_s, 1)

    def plan_for(self, queue: Sequence[T], budget: int, now_s: float, servers: int) -> PrefillPlan[T]:
        """:meth:`plan` for a queue that ``servers`` engines serve (prefill_order.PlansForServers)."""
        waiting = [r for r in queue if r.input_tokens > r.prefilled]
        if self.params.fewest_late:
            ranked = fewest_late(self.model, waiting, now_s, self.params.batch_tokens, self._late_cost, servers)
        else:
            ranked = rank(self.model, self.params.priority, waiting, now_s)
        return PrefillPlan(fill(self.batch(ranked, now_s), budget))

    def observe(self, tokens: int, seconds: float) -> None:
        return None  # TTFT_hat comes from the profiled model (see the class docstring)


class Sedf:
    """S-EDF ordering alone: re-ranked before every pass, the pass filled in that order (no batch budget G).

    For chunked engines (Kairos-style per-chunk re-ranking with FlowPrefill's priority), and as the
    "no batching" ablation of :class:`FlowPrefill`.
    """

    name = "sedf"
    event_driven = False

    def __init__(self, model: LatencyModel) -> None:
        self.model = model

    def plan(self, queue: Sequence[T], budget: int, now_s: float) -> PrefillPlan[T]:
        return PrefillPlan(fill(rank(self.model, "sedf", queue, now_s), budget))

    def observe(self, tokens: int, seconds: float) -> None:
        return None


class DEdf:
    """D-EDF ordering (FlowPrefill's ablation, §6.3): EDF, except prompts already past their deadline go
    after the others, latest deadline first. Unlike S-EDF it keeps serving a prompt that can no longer make
    its deadline until the deadline has actually passed ("may waste resources on requests that are destined
    to violate")."""

    name = "d-edf"
    event_driven = False

    def plan(self, queue: Sequence[T], budget: int, now_s: float) -> PrefillPlan[T]:
        return PrefillPlan(fill(sorted(queue, key=lambda r: dedf_key(r, now_s)), budget))

    def observe(self, tokens: int, seconds: float) -> None:
        return None
