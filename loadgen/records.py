"""Per-request measurement record: what the replay client saw for one request.

Owns `RequestRecord` and the latency definitions derived from it (TTFT, TPOT,
end-to-end). All times are seconds relative to the replay's start, measured on
one monotonic clock, so differences between them are exact latencies.
"""

from __future__ import annotations

from typing import Literal

import msgspec

Status = Literal["ok", "error"]


class RequestRecord(msgspec.Struct):
    """Outcome and timing of one replayed request.

    ``arrival_s`` is when the (rate-scaled) trace scheduled the request and
    ``sent_s`` when the client actually sent it; a gap means the client fell
    behind (see `lateness_s`). ``first_token_s`` is the arrival of the first
    streamed chunk carrying content (None if none came). ``token_times_s`` holds
    the arrival time of each content chunk; it may be left empty to save memory
    on long runs (the replay's ``keep_token_times=False``).
    ``output_tokens_received`` is the server's final ``usage.completion_tokens``
    when it reports one, else the number of content chunks. ``slo_class`` is
    copied from the trace request: the SLO class it is judged against (None:
    the run's own SLO). ``cached_tokens``: prompt tokens the engine served from its
    prefix cache (the usage's ``prompt_tokens_details.cached_tokens``; None when
    not reported). ``attempts``: how many times the client sent it (more than 1 when it retried a refusal;
    the times are then the first send's).
    """

    index: int
    rid: str
    arrival_s: float
    sent_s: float
    first_token_s: float | None
    finished_s: float
    input_tokens: int
    output_tokens_expected: int
    output_tokens_received: int
    status: Status
    error: str | None = None
    http_status: int | None = None
    token_times_s: list[float] = []
    slo_class: str | None = None
    cached_tokens: int | None = None
    attempts: int = 1  # times the client sent it: a client that retries refusals sends it again

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def ttft_s(self) -> float | None:
        """Time to first token, from send (not from scheduled arrival); None without tokens."""
        if self.first_token_s is None:
            return None
        return self.first_token_s - self.sent_s

    @property
    def e2e_s(self) -> float:
        """End-to-end latency from send to the end of the response."""
        return self.finished_s - self.sent_s

    @property
    def tpot_s(self) -> float:
        """Time per output token after the first (Arrow Eq. 3).

        ``(finished - first_token) / (received - 1)``; 0.0 when fewer than two
        tokens were received, since a single token has no decode interval.
        """
        if self.first_token_s is None or self.output_tokens_received < 2:
            return 0.0
        return (self.finished_s - self.first_token_s) / (self.output_tokens_received - 1)

    @property
    def lateness_s(self) -> float:
        """How far behind schedule the client sent this request (>= 0 normally)."""
        return self.sent_s - self.arrival_s
