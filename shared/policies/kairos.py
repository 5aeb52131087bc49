"""Kairos (arXiv 2605.02329): urgency-based prefill priority and slack-guided adaptive decode batching.

Two pure objects, one per engine side (../shared/spec/spec-ares-kairos-flowprefill.md, section 2):

- :class:`KairosPrefill` / :class:`KairosLiteralPrefill` (Algorithms 1-2): before every chunk step, predict
  each queued prompt's finish time under FCFS from one throughput estimate ``mu_prefill`` (tokens/s, EWMA),
  turn it into a length-normalised urgency, and fill the chunk in urgency order.
- :class:`KairosSlack` (Algorithm 3): before every decode step, compute every request's slack against its
  cumulative per-token deadline and, when the smallest slack leaves room, decode only a prefix of the
  shortest requests that raises tokens/s; otherwise decode everything.

Both are seeded from the engines' :class:`LatencyModel` (Kairos profiles its engine offline) and refined
online through ``observe``. Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from shared.latency import LatencyModel
from shared.policies.decode_batch import DecodeItem
from shared.policies.decode_batch import T as T_D
from shared.policies.prefill_order import PrefillItem, PrefillPlan, T, fill, remaining

# -- prefill: Algorithms 1-2 --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KairosParams:
    """Kairos' prefill knobs (spec 2.8)."""

    # EWMA weight of one pass's observed throughput in mu_prefill. The paper says only "running average";
    # alpha = 0.1 is the spec's recommendation (2.5).
    alpha: float = 0.1
    # mu_prefill's starting value in tokens/s; None = one chunk of the profile's chunked_prefill_size over
    # its modelled prefill time (Kairos seeds from an offline profile).
    mu_prefill_tps: float | None = None


@dataclass(frozen=True, slots=True)
class Urgency:
    """One prompt's Algorithm 2 estimate and the scores derived from it (exposed for tests and traces)."""

    finish_s: float  # predicted prefill finish time under FCFS
    slack_s: float  # SLO_TTFT - (finish - arrival); inf without a target
    urgency: float  # (slack / SLO) / input_len (Algorithm 1 line 8); nan-free: 0 without a target


class KairosPrefill:
    """Kairos' prefill scheduler, least-normalised-slack-first ordering (the spec's ``kairos_lsf``).

    Why this, and not the literal descending-urgency sort, is ``kairos``: the paper's own motivating example
    (a 128K-token prompt needing ~8.8 s against an 8 s TTFT SLO, followed by an 8K prompt) says the short
    prompt's "urgency score is amplified ... selected first". With both FCFS slacks negative, the literal
    rule (:class:`KairosLiteralPrefill`) divides a negative slack by the length, so the 8K prompt gets the
    *more* negative score and the 128K prompt keeps the engine, which is the head-of-line blocking Kairos
    sets out to remove (spec 2.11 #1, erratum 8). This ordering does what the prose says in both regimes:

    - feasible prompts (slack >= 0) first, by ascending (slack / SLO) * input_len: less normalised slack and
      shorter prompts first (the spec's ``len/len_ref`` factor; a constant ``len_ref`` does not change the
      order, so it is left out);
    - infeasible prompts (slack < 0) after them, fewest remaining tokens first (they miss anyway; finishing
      the short ones first keeps the number of misses down, and a partly done long prompt whose rest is
      short is finished rather than left half done);
    - prompts without a TTFT target last, in arrival order.

    Ties keep arrival order. The chunk is then filled in that order (Algorithm 1 lines 11-18 with the
    spec's fixes: remaining tokens in the fit test, "fill the chunk, then stop").
    """

    name = "kairos"
    event_driven = False  # Kairos re-ranks at every chunk step

    def __init__(self, model: LatencyModel, params: KairosParams | None = None) -> None:
        self.params = params or KairosParams()
        if self.params.mu_prefill_tps is not None:
            self.mu_prefill = self.params.mu_prefill_tps
        else:
            chunk = model.profile.chunked_prefill_size
            seconds = model.prefill_time_s(chunk)
            self.mu_prefill = chunk / seconds if seconds > 0 else math.inf  # time_scale 0: compute is free

    def urgencies(self, queue: Sequence[PrefillItem], now_s: float) -> list[Urgency]:
        """Algorithm 2 for every prompt in ``queue`` (arrival order), in O(n).

        Algorithm 2 walks the FCFS order up to each prompt with ``cursor = max(cursor, arrival) + n/mu``; the
        cursor after prompt k is exactly prompt k's finish time, so one pass gives them all (the spec's
        prefix-sum form). Remaining tokens are used, so earlier chunks and prefix-cache hits count.
        """
        out: list[Urgency] = []
        cursor = now_s
        for item in queue:
            cursor = max(cursor, item.arrival_s) + remaining(item) / self.mu_prefill
            slo = item.slo_ttft_s
            if math.isinf(slo):
                out.append(Urgency(cursor, math.inf, 0.0))
                continue
            slack = slo - (cursor - item.arrival_s)
            out.append(Urgency(cursor, slack, (slack / slo) / max(item.input_tokens, 1)))
        return out

    def _key(self, item: PrefillItem, u: Urgency, index: int) -> tuple[int, float, int]:
        if math.isinf(u.slack_s):
            return (2, 0.0, index)
        if u.slack_s >= 0:
            return (0, (u.slack_s / item.slo_ttft_s) * item.input_tokens, index)
        return (1, float(remaining(item)), index)

    def plan(self, queue: Sequence[T], budget: int, now_s: float) -> PrefillPlan[T]:
        fcfs = sorted(queue, key=lambda r: r.arrival_s)  # Algorithm 1 line 4 (stable: the engine's order on ties)
        scores = self.urgencies(fcfs, now_s)
        order = sorted(range(len(fcfs)), key=lambda i: self._key(fcfs[i], scores[i], i))
        return PrefillPlan(fill([fcfs[i] for i in order], budget))

    def observe(self, tokens: int, seconds: float) -> None:
        """Algorithm 1 line 22: fold one pass's throughput into mu_prefill (EWMA)."""
        if tokens <= 0 or not seconds > 0:
            return  # nothing computed, or free compute (time_scale 0): no throughput to learn
        tps = tokens / seconds
        if math.isinf(self.mu_prefill):
            self.mu_prefill = tps
        else:
            self.mu_prefill = (1 - self.params.alpha) * self.mu_prefill + self.params.alpha * tps


class KairosLiteralPrefill(KairosPrefill):
    """Kairos' Algorithm 1 as printed: descending normalised urgency ``(slack/SLO)/input_len``.

    Kept for fidelity (the spec asks to report it). With positive slacks it favours short prompts as the
    paper intends; with negative slacks it favours the *long* one (see :class:`KairosPrefill`). Prompts
    without a target rank last, in arrival order; ties keep arrival order.
    """

    name = "kairos-literal"

    def _key(self, item: PrefillItem, u: Urgency, index: int) -> tuple[int, float, int]:
        if math.isinf(u.slack_s):
            return (1, 0.0, index)
        return (0, -u.urgency, index)


# -- decode: Algorithm 3 -----------------------------------------------------------------------------

LutMode = Literal["max_len", "total_tokens"]
SlackReserve = Literal["solo", "full_batch"]


@dataclass(frozen=True, slots=True)
class KairosSlackParams:
    """Kairos' decode knobs (spec 2.6-2.8)."""

    # What the LUT's second key is. "max_len" (the paper): the batch's longest context, seeded with the
    # worst case that every member is that long (b*L tokens). "total_tokens" (spec 2.7 [REC]): the batch's
    # summed context, seeded with the latency model's linear step time, which is exact for our engines.
    lut_mode: LutMode = "max_len"
    # Weight of the seeded (profiled) value in an entry's running mean: the paper's mean of 100 profiling runs.
    prior_count: int = 100
    # Step time each request's slack reserves for its own next token. "solo" (Algorithm 3 line 5):
    # LUT[1][its length]. "full_batch" (spec 2.6 [REC]): the decode-all step LUT[|D|][longest], which closes
    # the gap where a fallback step overruns a long request's deadline. Our default: with "solo", delayed
    # requests ride their deadline and the decode-all steps push 6-14% of them over the TPOT SLO on Mooncake
    # (tests/bench/results/kairos.md); the issue asks that delayed tokens still arrive within the SLO.
    slack_reserve: SlackReserve = "full_batch"
    # Decode everything while requests wait for KV on this engine: a delayed request keeps its KV, so holding
    # it back also holds back the admissions waiting for that KV (decode is KV-bound at load). Ours; the paper
    # does not discuss admission. Without it E2E attainment on Mooncake at 2x fell from 67% to 18-20%.
    yield_to_kv_waiters: bool = True


def _bucket(x: int) -> int:
    """The power of two at or above ``x`` (at least 1)."""
    return 1 << max(0, x - 1).bit_length()


class KairosSlack:
    """Kairos' slack-guided decode batching (Algorithm 3) over a step-time LUT.

    LUT: ``(batch bucket, length bucket) -> step seconds``, both buckets powers of two (spec 2.7 [REC]). A
    lookup rounds both keys *up* to their bucket rather than interpolating: step time grows with both, so
    the bucket's upper corner never under-predicts a step and a slack test that passes on it passes for
    real. Entries are seeded lazily from the latency model at the bucket's upper corner and then kept as a
    running mean of observed steps, the seed counting ``prior_count`` observations (the paper's "historical
    mean", keyed by the step's batch size and longest context; with ``lut_mode="total_tokens"`` by its total
    context). Batch buckets stop being useful at ``max_running_requests``; nothing larger is ever observed.

    Deadlines: a request's first token comes from prefill at ``first_token_s``; with the TPOT SLO judged on
    the mean inter-token time, its k-th token is due at ``first_token_s + (k-1)*SLO``. The paper's N counts
    the tokens the decode side generated after that first one, so its "(N+1)-th token" deadline
    ``t_first + (N+1)*SLO`` is, with our ``generated`` (which counts the first token too, N = generated-1),
    ``first_token_s + generated*SLO``. Slack (Eq. 2, Algorithm 3 line 5):
    ``SLO*generated - (now - first_token_s) - LUT[1][seq_len]``, seq_len = input_tokens + generated.

    Requests without a TPOT target never set the smallest slack; when none has a target there is nothing to
    bank slack against and every request steps, as with continuous batching. A request without a first
    token time yet counts as having just received it.
    """

    name = "kairos-slack"
    selects_all = False

    def __init__(self, model: LatencyModel, params: KairosSlackParams | None = None) -> None:
        self.model = model
        self.params = params or KairosSlackParams()
        self._lut: dict[tuple[int, int], tuple[float, int]] = {}  # (b bucket, tokens bucket) -> (mean s, count)

    # -- the LUT ------------------------------------------------------------------------------------
    def _seed(self, batch: int, tokens: int) -> float:
        if self.params.lut_mode == "max_len":
            return self.model.decode_step_time_s(batch, batch * tokens)  # every member as long as the longest
        return self.model.decode_step_time_s(batch, tokens)

    def _entry(self, batch: int, tokens: int) -> tuple[tuple[int, int], tuple[float, int]]:
        key = (_bucket(batch), _bucket(tokens))
        entry = self._lut.get(key)
        if entry is None:
            entry = self._lut[key] = (self._seed(*key), self.params.prior_count)
        return key, entry

    def lut(self, batch: int, tokens: int) -> float:
        """Predicted step seconds for ``batch`` requests whose longest (or total, per ``lut_mode``) context is
        ``tokens``, rounded up to the bucket."""
        return self._entry(batch, tokens)[1][0]

    def observe(self, batch_size: int, max_context: int, total_context: int, seconds: float) -> None:
        """Algorithm 3 line 24: fold a measured step into its entry's running mean."""
        if batch_size <= 0 or not seconds >= 0:
            return
        tokens = max_context if self.params.lut_mode == "max_len" else total_context
        key, (mean, count) = self._entry(batch_size, tokens)
        self._lut[key] = (mean + (seconds - mean) / (count + 1), count + 1)

    # -- Algorithm 3 --------------------------------------------------------------------------------
    @staticmethod
    def seq_len(item: DecodeItem) -> int:
        return item.input_tokens + item.generated

    def slack(self, item: DecodeItem, now_s: float, reserve_s: float | None = None) -> float:
        """Time to spare before the request's next token is due (inf without a TPOT target)."""
        slo = item.slo_tpot_s
        if math.isinf(slo):
            return math.inf
        elapsed = 0.0 if item.first_token_s is None else now_s - item.first_token_s
        reserve = self.lut(1, self.seq_len(item)) if reserve_s is None else reserve_s
        return slo * max(item.generated, 1) - elapsed - reserve

    def select(self, running: Sequence[T_D], max_batch: int, now_s: float, kv_waiting: int = 0) -> Sequence[T_D]:
        if not running:
            return []
        everyone = list(running[:max_batch])
        if kv_waiting and self.params.yield_to_kv_waiters:
            return everyone
        reserve: float | None = None
        if self.params.slack_reserve == "full_batch":
            longest = max(self.seq_len(r) for r in everyone)
            reserve = self.lut(len(everyone), longest if self.params.lut_mode == "max_len" else
                               sum(self.seq_len(r) for r in everyone))
        s_min = min(self.slack(r, now_s, reserve) for r in running)
        if math.isinf(s_min):
            return everyone  # no request has a deadline to bank slack against
        chosen: list[T_D] = []
        t_cur = 0.0
        total = 0
        for r in sorted(running, key=self.seq_len):  # ascending length (stable: arrival order on ties)
            if len(chosen) >= max_batch:
                break
            length = self.seq_len(r)
            t_step = self.lut(len(chosen) + 1, length if self.params.lut_mode == "max_len" else total + length)
            # Line 13: the enlarged step fits the tightest slack *and* raises tokens/s, i.e.
            # (n+1)/t_step > n/t_cur, cross-multiplied so that free compute (time_scale 0) divides nothing.
            n = len(chosen)
            if t_step <= s_min and (n == 0 or t_step <= 0 or (n + 1) * t_cur > n * t_step):
                chosen.append(r)
                t_cur = t_step
                total += length
            # else: delayed this step (line 16; no break, as in the paper)
        if not chosen:
            return everyone  # lines 19-20: no slack to exploit, decode all
        picked = {id(r) for r in chosen}
        return [r for r in running if id(r) in picked]  # the engine's order

