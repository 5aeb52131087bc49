"""The gateway's Prometheus metrics (per-request TTFT/TPOT as clients see them)."""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_R10 = (1.0, 1.25, 1.6, 2.0, 2.5, 3.15, 4.0, 5.0, 6.3, 8.0)  # Renard's series: ten steps a decade, 25-28% apart


def _decades(low: float, high: float) -> tuple[float, ...]:
    """Bucket bounds from ``low`` to at least ``high``, ten to a factor of ten, so a percentile read from the
    histogram lies within one step (at most 28%) of the truth."""
    bounds: list[float] = []
    decade = 10.0 ** math.floor(math.log10(low))
    while not bounds or bounds[-1] < high:
        bounds += [float(f"{decade * r:.6g}") for r in _R10 if low <= decade * r * (1 + 1e-9)]
        decade *= 10
    return tuple(b for i, b in enumerate(bounds) if i == 0 or bounds[i - 1] < high)


#: SLO targets in use (Arrow's Table 1 per trace, the sglang-cpu preset's, the dashboard's choices) are bounds
#: too, so the share of requests within one reads exactly off the histogram (le="2.0").
SLO_TTFT_BOUNDS = (0.25, 0.5, 1.0, 2.0, 3.0, 4.0, 5.0, 30.0)
SLO_TPOT_BOUNDS = (0.05, 0.075, 0.1, 0.15, 0.2, 0.3)
LATENCY_BUCKETS = tuple(sorted(set(_decades(0.005, 300.0)) | set(SLO_TTFT_BOUNDS)))
TPOT_BUCKETS = tuple(sorted(set(_decades(0.002, 2.0)) | set(SLO_TPOT_BOUNDS)))


def with_bound(buckets: tuple[float, ...], bound: float | None) -> tuple[float, ...]:
    """``buckets`` with ``bound`` (a configured SLO target) among them."""
    return buckets if bound is None or bound in buckets else tuple(sorted((*buckets, bound)))


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, *, slo_ttft_s: float | None = None,
                 slo_tpot_s: float | None = None) -> None:
        """``slo_ttft_s`` / ``slo_tpot_s``: the gateway's own SLO, made a bucket bound as well."""
        self.registry = registry or CollectorRegistry()
        r = self.registry
        ttft_buckets, tpot_buckets = with_bound(LATENCY_BUCKETS, slo_ttft_s), with_bound(TPOT_BUCKETS, slo_tpot_s)
        self.requests = Counter("poise_gateway_requests", "Finished requests by outcome", ["endpoint", "status"], registry=r)
        self.rejections = Counter("poise_gateway_rejections", "Requests refused before dispatch", ["reason"], registry=r)
        self.placement_stages = Counter("poise_gateway_placement_stages",
                                        "Placements a wrapping dispatch policy changed, by stage (local-prefill: kept on "
                                        "its decode engine; redirected: moved to a decode engine that starts it in time)",
                                        ["stage"], registry=r)
        self.retries = Counter("poise_gateway_retries", "Attempts retried on another pair", registry=r)
        self.ttft = Histogram("poise_gateway_ttft_seconds", "Time to first token seen by the client", buckets=ttft_buckets, registry=r)
        self.tpot = Histogram("poise_gateway_tpot_seconds", "Mean time per output token after the first", buckets=tpot_buckets, registry=r)
        self.e2e = Histogram("poise_gateway_e2e_seconds", "End-to-end request latency", buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("poise_gateway_prompt_tokens", "Prompt tokens dispatched (estimated for text)", registry=r)
        self.output_tokens = Counter("poise_gateway_output_tokens", "Output tokens streamed to clients", registry=r)
        self.inflight = Gauge("poise_gateway_inflight_requests", "Requests in flight", registry=r)
        self.late_binding_held = Gauge("poise_gateway_late_binding_held_requests",
                                       "Requests held in the late-binding queue, waiting for a prefill slot", registry=r)
        self.late_binding_wait = Histogram("poise_gateway_late_binding_wait_seconds",
                                           "Time a request waited in the late-binding queue", buckets=LATENCY_BUCKETS,
                                           registry=r)
        self.slo_requests = Counter("poise_gateway_slo_class_requests", "Requests by resolved SLO class and the rule that picked it",
                                    ["slo_class", "source"], registry=r)
        self.instances = Gauge("poise_gateway_instances", "Registered instances by role and status", ["role", "status"], registry=r)
        self.migrations = Counter("poise_gateway_migrations", "Running requests moved to another decode engine",
                                  ["mechanism"], registry=r)
        self.migration_failures = Counter("poise_gateway_migration_failures",
                                          "Moves that failed (the request stayed on its source)", registry=r)
        self.migration_stall = Histogram("poise_gateway_migration_stall_seconds",
                                         "Client-visible gap of a move: last source token to the target's first",
                                         buckets=LATENCY_BUCKETS, registry=r)
        self.stalls = Counter("poise_gateway_stalled_streams",
                              "Decode streams given up after stall_timeout_s without a token (then rescued)", registry=r)
        self.rescues = Counter("poise_gateway_rescues",
                               "Requests resumed on another pair after their decode stream broke mid-answer",
                               registry=r)
