"""Benchmark metrics: percentiles and the run summary computed from request records.

Owns `percentile`, `Summary` and `summarize`. The summary is a pure function of
the records, the SLO and the wall time, so tests (and anyone auditing a report)
can recompute every number from ``report.json``'s records alone.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import msgspec

from loadgen.records import RequestRecord
from loadgen.slo import SLO


def percentile(values: Iterable[float], p: float) -> float:
    """The ``p``-th percentile (0-100) by linear interpolation between order statistics.

    Same definition as numpy's default (``method="linear"``): rank
    ``(n - 1) * p / 100``. Raises ValueError on empty input, since any number
    returned would be invented.
    """
    if not 0 <= p <= 100:
        raise ValueError(f"percentile p must be in [0, 100], got {p}")
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile of an empty sequence")
    rank = (len(ordered) - 1) * p / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    weight = rank - low
    return ordered[low] + (ordered[high] - ordered[low]) * weight


def _percentiles(values: Sequence[float]) -> tuple[float | None, float | None, float | None]:
    if not values:
        return None, None, None
    return percentile(values, 50), percentile(values, 90), percentile(values, 99)


class Summary(msgspec.Struct, frozen=True):
    """Aggregate results of one replay.

    Latency percentiles cover successful requests only (None when there are
    none). Attainment shares are over ALL requests: a failed request counts as a
    miss, so errors cannot inflate attainment. Throughput counts successful
    requests and their received output tokens per second of wall time.
    ``token_mismatches`` counts successful requests whose received token count
    differs from the trace's expected count (a server ignoring ``ignore_eos`` or
    ``max_tokens`` would otherwise go unnoticed).
    """

    requests_total: int
    requests_ok: int
    requests_failed: int
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    tpot_p50_s: float | None
    tpot_p90_s: float | None
    tpot_p99_s: float | None
    e2e_p50_s: float | None
    e2e_p90_s: float | None
    e2e_p99_s: float | None
    slo_ttft_s: float
    slo_tpot_s: float
    slo_attainment: float
    ttft_attainment: float
    tpot_attainment: float
    wall_s: float
    throughput_rps: float
    output_tokens_per_s: float
    input_tokens_total: int
    output_tokens_total: int
    output_tokens_expected_total: int
    token_mismatches: int
    lateness_p99_s: float | None
    lateness_max_s: float | None


def summarize(records: Sequence[RequestRecord], slo: SLO, wall_s: float) -> Summary:
    """Compute the `Summary` of a replay from its records.

    A request meets the SLO when it succeeded, produced a first token, and has
    ``ttft <= slo.ttft_s`` and ``tpot <= slo.tpot_s``; the TTFT-only and
    TPOT-only shares apply one condition each (still requiring success).
    Attainments are 0.0 for an empty run; throughputs are 0.0 when ``wall_s`` is 0.
    """
    total = len(records)
    ok = [r for r in records if r.ok]
    ttfts = [t for t in (r.ttft_s for r in ok) if t is not None]
    tpots = [r.tpot_s for r in ok]
    e2es = [r.e2e_s for r in ok]
    ttft_hits = tpot_hits = both_hits = 0
    for r in ok:
        ttft = r.ttft_s
        ttft_hit = ttft is not None and ttft <= slo.ttft_s
        tpot_hit = r.tpot_s <= slo.tpot_s
        ttft_hits += ttft_hit
        tpot_hits += tpot_hit
        both_hits += ttft_hit and tpot_hit
    output_tokens = sum(r.output_tokens_received for r in ok)
    lateness = [r.lateness_s for r in records]

    def share(hits: int) -> float:
        return hits / total if total else 0.0

    def per_second(amount: float) -> float:
        return amount / wall_s if wall_s > 0 else 0.0

    ttft_p = _percentiles(ttfts)
    tpot_p = _percentiles(tpots)
    e2e_p = _percentiles(e2es)
    return Summary(
        requests_total=total,
        requests_ok=len(ok),
        requests_failed=total - len(ok),
        ttft_p50_s=ttft_p[0],
        ttft_p90_s=ttft_p[1],
        ttft_p99_s=ttft_p[2],
        tpot_p50_s=tpot_p[0],
        tpot_p90_s=tpot_p[1],
        tpot_p99_s=tpot_p[2],
        e2e_p50_s=e2e_p[0],
        e2e_p90_s=e2e_p[1],
        e2e_p99_s=e2e_p[2],
        slo_ttft_s=slo.ttft_s,
        slo_tpot_s=slo.tpot_s,
        slo_attainment=share(both_hits),
        ttft_attainment=share(ttft_hits),
        tpot_attainment=share(tpot_hits),
        wall_s=wall_s,
        throughput_rps=per_second(len(ok)),
        output_tokens_per_s=per_second(output_tokens),
        input_tokens_total=sum(r.input_tokens for r in ok),
        output_tokens_total=output_tokens,
        output_tokens_expected_total=sum(r.output_tokens_expected for r in records),
        token_mismatches=sum(1 for r in ok if r.output_tokens_received != r.output_tokens_expected),
        lateness_p99_s=percentile(lateness, 99) if lateness else None,
        lateness_max_s=max(lateness) if lateness else None,
    )
