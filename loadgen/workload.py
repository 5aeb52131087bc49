"""Workload model: the ordered list of requests a benchmark replays.

This module owns `TraceRequest` (one request: when it arrives and how many tokens
go in and come out) and `Workload` (a named, time-ordered sequence of them) plus
the pure transformations benchmarks need: slicing a window out of a long trace,
scaling its arrival rate and capping request lengths. Nothing here does I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import msgspec

#: Tokens per prefix block in the Mooncake traces' ``hash_ids``.
HASH_BLOCK_TOKENS = 512


class TraceRequest(msgspec.Struct, frozen=True):
    """One request of a workload.

    ``index`` is the request's position in its source trace (0-based). It is kept
    by every `Workload` transformation so that the synthetic prompt derived from
    it is the same whichever slice or rate the request is replayed at.
    ``arrival_s`` is relative to the start of the workload. ``hash_ids`` are the
    Mooncake prefix-block ids (one per 512-token block; equal ids mean a
    shareable prefix); empty when the trace has none. ``slo_class`` names the
    request's SLO class (`loadgen.slo.SLOClasses.assign` sets it); None means
    the workload's own SLO applies.
    """

    index: int
    arrival_s: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()
    slo_class: str | None = None


class Workload(msgspec.Struct, frozen=True):
    """A named, arrival-ordered sequence of requests.

    The name identifies the source (``azure-conv``, ``mooncake-conv``...) and is
    kept by the transformations below so `loadgen.slo.slo_for` still finds the
    trace's SLO for a slice or a rate-scaled copy.
    """

    name: str
    requests: list[TraceRequest]

    def __post_init__(self) -> None:
        previous = -math.inf
        for request in self.requests:
            if request.arrival_s < previous:
                raise ValueError(
                    f"workload {self.name!r}: requests must be ordered by arrival_s "
                    f"(request index {request.index} arrives at {request.arrival_s} "
                    f"after {previous})"
                )
            previous = request.arrival_s

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[TraceRequest]:
        return iter(self.requests)

    def __getitem__(self, position: int) -> TraceRequest:
        return self.requests[position]

    @property
    def duration_s(self) -> float:
        """Span from the first to the last arrival (0.0 for fewer than 2 requests)."""
        if len(self.requests) < 2:
            return 0.0
        return self.requests[-1].arrival_s - self.requests[0].arrival_s

    @property
    def mean_rate_rps(self) -> float:
        """Requests per second over `duration_s` (0.0 when the span is zero).

        Uses ``len / duration`` like the trace statistics in SOURCES.md, so the
        full Azure conv trace reports 19,366 / 3,502 s = 5.53 rps.
        """
        duration = self.duration_s
        return len(self.requests) / duration if duration > 0 else 0.0

    @property
    def input_tokens_total(self) -> int:
        return sum(r.input_tokens for r in self.requests)

    @property
    def output_tokens_total(self) -> int:
        return sum(r.output_tokens for r in self.requests)

    def slice(
        self,
        start_s: float,
        duration_s: float | None = None,
        max_requests: int | None = None,
    ) -> Workload:
        """Requests arriving in ``[start_s, start_s + duration_s)``, re-based so the
        first selected request arrives at 0.

        Re-basing on the first selected request (not on ``start_s``) means a
        replay never idles before its first send. At most ``max_requests`` are
        kept (the earliest ones). ``start_s`` is relative to this workload's first
        arrival, the same clock its ``arrival_s`` values use.
        """
        if start_s < 0:
            raise ValueError(f"start_s must be >= 0, got {start_s}")
        if duration_s is not None and duration_s <= 0:
            raise ValueError(f"duration_s must be > 0, got {duration_s}")
        if max_requests is not None and max_requests < 0:
            raise ValueError(f"max_requests must be >= 0, got {max_requests}")
        end_s = math.inf if duration_s is None else start_s + duration_s
        chosen = [r for r in self.requests if start_s <= r.arrival_s < end_s]
        if max_requests is not None:
            chosen = chosen[:max_requests]
        base = chosen[0].arrival_s if chosen else 0.0
        rebased = [msgspec.structs.replace(r, arrival_s=r.arrival_s - base) for r in chosen]
        return Workload(name=self.name, requests=rebased)

    def scale_rate(self, factor: float) -> Workload:
        """Multiply the arrival rate by ``factor`` (2.0 = twice as many requests/s).

        Done as Arrow does, by multiplying every timestamp by ``1 / factor``: the
        burst structure is kept, only compressed or stretched in time.
        """
        if not factor > 0 or math.isinf(factor):
            raise ValueError(f"rate scale factor must be a finite number > 0, got {factor}")
        if factor == 1.0:
            return self
        inverse = 1.0 / factor
        scaled = [msgspec.structs.replace(r, arrival_s=r.arrival_s * inverse) for r in self.requests]
        return Workload(name=self.name, requests=scaled)

    def cap_lengths(self, max_input: int | None = None, max_output: int | None = None) -> Workload:
        """Clamp input lengths to ``max_input`` and output lengths to ``max_output``.

        Use this when a trace has requests longer than the served model's context
        (Mooncake inputs reach 190k tokens). Clamped requests keep their arrival
        time, so the arrival pattern is unchanged; only the work per request
        shrinks. ``hash_ids`` are cut to the blocks the clamped input still
        covers, so prefix sharing among the kept blocks is preserved.
        """
        if max_input is not None and max_input < 1:
            raise ValueError(f"max_input must be >= 1, got {max_input}")
        if max_output is not None and max_output < 1:
            raise ValueError(f"max_output must be >= 1, got {max_output}")
        capped: list[TraceRequest] = []
        for r in self.requests:
            input_tokens = r.input_tokens if max_input is None else min(r.input_tokens, max_input)
            output_tokens = r.output_tokens if max_output is None else min(r.output_tokens, max_output)
            hash_ids = r.hash_ids
            if input_tokens != r.input_tokens and hash_ids:
                hash_ids = hash_ids[: -(-input_tokens // HASH_BLOCK_TOKENS)]
            if (input_tokens, output_tokens, hash_ids) == (r.input_tokens, r.output_tokens, r.hash_ids):
                capped.append(r)
            else:
                capped.append(
                    msgspec.structs.replace(
                        r, input_tokens=input_tokens, output_tokens=output_tokens, hash_ids=hash_ids
                    )
                )
        return Workload(name=self.name, requests=capped)
