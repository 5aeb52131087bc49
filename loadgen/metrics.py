"""Benchmark metrics: percentiles and the run summary computed from request records.

Owns `percentile`, `Summary`, `ClassSummary` and `summarize`. The summary is a
pure function of the records, the SLO (and SLO classes, if any) and the wall time,
so tests (and anyone auditing a report) can recompute every number from
``report.json``'s records alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import msgspec

from loadgen.records import RequestRecord
from loadgen.slo import SLO, SLOClasses
from shared.protocol.refusal import REFUSAL_STATUSES


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


class ClassSummary(msgspec.Struct, frozen=True):
    """Attainment of one SLO class: its requests judged against its own SLO.

    ``ok`` counts the class's successful requests. Shares are over all the
    class's requests (failures are misses), 0.0 for a class with no requests;
    percentiles cover its successful requests (None when there are none).
    """

    requests: int
    ok: int
    attainment: float
    ttft_attainment: float
    tpot_attainment: float
    ttft_p90_s: float | None
    tpot_p90_s: float | None
    slo_ttft_s: float
    slo_tpot_s: float


class Summary(msgspec.Struct, frozen=True):
    """Aggregate results of one replay.

    Latency percentiles cover successful requests only (None when there are
    none). Attainment shares are over ALL requests: a failed request counts as a
    miss, so errors cannot inflate attainment. Throughput counts successful
    requests and their received output tokens per second of wall time.
    ``token_mismatches`` counts successful requests whose received token count
    differs from the trace's expected count (a server ignoring ``ignore_eos`` or
    ``max_tokens`` would otherwise go unnoticed). ``slo_ttft_s``/``slo_tpot_s``
    are the run's own SLO; with SLO classes the attainment shares judge each
    request against its class's SLO, and ``per_class`` breaks them down by class
    (empty without classes).
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
    per_class: dict[str, ClassSummary] = {}
    # The work view (see `work_view`): what a request count hides when the misses are the longest requests.
    token_attainment: float = 0.0
    refused_share: float = 0.0
    refused_token_share: float = 0.0
    late_share: float = 0.0
    quartile_attainment: list[float] = []
    retries: int = 0  # requests sent again after a refusal (a request refused three times counts two)


def refused(record: RequestRecord) -> bool:
    """The service turned the request away (429/503), as opposed to failing it."""
    return not record.ok and record.http_status in REFUSAL_STATUSES


def work_tokens(record: RequestRecord) -> int:
    """The work a request asks for: its prompt and the output it should get."""
    return record.input_tokens + record.output_tokens_expected


class WorkView(msgspec.Struct, frozen=True):
    """Attainment weighted by work, the refusals, the late answers and attainment per prompt-length quartile.

    ``token_attainment`` is the prompt + expected output tokens of the requests served within their SLO over
    those of every request; ``refused_*`` are the refused requests' shares of requests and of tokens;
    ``late_share`` the requests served but outside their SLO; ``quartile_attainment`` the attainment of each
    quarter of the requests ranked by prompt length, shortest first (ties by arrival; empty without requests).
    """

    token_attainment: float
    refused_share: float
    refused_token_share: float
    late_share: float
    quartile_attainment: list[float]


def work_view(records: Sequence[RequestRecord], hit: Callable[[RequestRecord], bool]) -> WorkView:
    """The `WorkView` of ``records``, ``hit(r)`` saying whether a request met its SLO."""
    total = len(records)
    tokens = sum(work_tokens(r) for r in records)
    hits = [hit(r) for r in records]
    ranked = sorted(range(total), key=lambda i: (records[i].input_tokens, records[i].index))
    quartiles: list[list[bool]] = [[], [], [], []]
    for rank, i in enumerate(ranked):
        quartiles[rank * 4 // total].append(hits[i])
    return WorkView(
        token_attainment=sum(work_tokens(r) for r, h in zip(records, hits, strict=True) if h) / tokens if tokens else 0.0,
        refused_share=sum(refused(r) for r in records) / total if total else 0.0,
        refused_token_share=sum(work_tokens(r) for r in records if refused(r)) / tokens if tokens else 0.0,
        late_share=sum(r.ok and not h for r, h in zip(records, hits, strict=True)) / total if total else 0.0,
        quartile_attainment=[sum(q) / len(q) for q in quartiles if q],
    )


def slo_hit(record: RequestRecord, slo: SLO) -> tuple[bool, bool]:
    """(TTFT met, TPOT met) for one request; a failed one meets neither."""
    if not record.ok:
        return False, False
    return record.ttft_s is not None and record.ttft_s <= slo.ttft_s, record.tpot_s <= slo.tpot_s


def slo_hits(records: Sequence[RequestRecord], slo_of: Callable[[RequestRecord], SLO]) -> tuple[int, int, int]:
    """(TTFT hits, TPOT hits, both) among successful ``records``, each judged against ``slo_of(record)``."""
    ttft_hits = tpot_hits = both_hits = 0
    for r in records:
        ttft_hit, tpot_hit = slo_hit(r, slo_of(r))
        ttft_hits += ttft_hit
        tpot_hits += tpot_hit
        both_hits += ttft_hit and tpot_hit
    return ttft_hits, tpot_hits, both_hits


def _class_summary(records: Sequence[RequestRecord], slo: SLO) -> ClassSummary:
    ok = [r for r in records if r.ok]
    ttfts = [t for t in (r.ttft_s for r in ok) if t is not None]
    tpots = [r.tpot_s for r in ok]
    ttft_hits, tpot_hits, both_hits = slo_hits(records, lambda _: slo)
    total = len(records)
    return ClassSummary(
        requests=total,
        ok=len(ok),
        attainment=both_hits / total if total else 0.0,
        ttft_attainment=ttft_hits / total if total else 0.0,
        tpot_attainment=tpot_hits / total if total else 0.0,
        ttft_p90_s=percentile(ttfts, 90) if ttfts else None,
        tpot_p90_s=percentile(tpots, 90) if tpots else None,
        slo_ttft_s=slo.ttft_s,
        slo_tpot_s=slo.tpot_s,
    )


def _per_class(records: Sequence[RequestRecord], classes: SLOClasses) -> dict[str, ClassSummary]:
    # Every class gets an entry, also an empty one: a class with 0 requests in the table shows that the
    # workload was not assigned (or the shares are too small for the slice), instead of hiding it.
    by_class: dict[str, list[RequestRecord]] = {name: [] for name in classes.names}
    for r in records:
        if r.slo_class is not None:
            by_class[r.slo_class].append(r)
    return {name: _class_summary(members, classes.slo_of(name)) for name, members in by_class.items()}


def summarize(
    records: Sequence[RequestRecord], slo: SLO, wall_s: float, classes: SLOClasses | None = None
) -> Summary:
    """Compute the `Summary` of a replay from its records.

    A request meets the SLO when it succeeded, produced a first token, and has
    ``ttft <= slo.ttft_s`` and ``tpot <= slo.tpot_s``; the TTFT-only and
    TPOT-only shares apply one condition each (still requiring success).
    With ``classes``, a record whose ``slo_class`` is set is judged against that
    class's SLO instead (records without one still use ``slo``; an unknown class
    name is a ValueError), and ``per_class`` holds one `ClassSummary` per class.
    Attainments are 0.0 for an empty run; throughputs are 0.0 when ``wall_s`` is 0.
    """
    if classes is not None:
        known = set(classes.names)
        unknown = sorted({r.slo_class for r in records if r.slo_class is not None and r.slo_class not in known})
        if unknown:
            raise ValueError(f"records name unknown SLO class(es) {', '.join(unknown)}; classes: {', '.join(classes.names)}")
    total = len(records)
    ok = [r for r in records if r.ok]
    ttfts = [t for t in (r.ttft_s for r in ok) if t is not None]
    tpots = [r.tpot_s for r in ok]
    e2es = [r.e2e_s for r in ok]
    if classes is None:
        def slo_of(r: RequestRecord) -> SLO:
            return slo
    else:
        class_slos = {c.name: c.slo for c in classes.classes}

        def slo_of(r: RequestRecord) -> SLO:
            return slo if r.slo_class is None else class_slos[r.slo_class]
    ttft_hits, tpot_hits, both_hits = slo_hits(records, slo_of)
    work = work_view(records, lambda r: all(slo_hit(r, slo_of(r))))
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
        per_class={} if classes is None else _per_class(records, classes),
        token_attainment=work.token_attainment,
        refused_share=work.refused_share,
        refused_token_share=work.refused_token_share,
        late_share=work.late_share,
        quartile_attainment=work.quartile_attainment,
        retries=sum(r.attempts - 1 for r in records),
    )
