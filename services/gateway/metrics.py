"""The gateway's Prometheus metrics (per-request TTFT/TPOT as clients see them)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 3, 5, 10, 20, 30, 60, 120)
_TPOT_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter("poise_gateway_requests", "Finished requests by outcome", ["endpoint", "status"], registry=r)
        self.rejections = Counter("poise_gateway_rejections", "Requests refused before dispatch", ["reason"], registry=r)
        self.retries = Counter("poise_gateway_retries", "Attempts retried on another pair", registry=r)
        self.ttft = Histogram("poise_gateway_ttft_seconds", "Time to first token seen by the client", buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("poise_gateway_tpot_seconds", "Mean time per output token after the first", buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("poise_gateway_e2e_seconds", "End-to-end request latency", buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("poise_gateway_prompt_tokens", "Prompt tokens dispatched (estimated for text)", registry=r)
        self.output_tokens = Counter("poise_gateway_output_tokens", "Output tokens streamed to clients", registry=r)
        self.inflight = Gauge("poise_gateway_inflight_requests", "Requests in flight", registry=r)
        self.late_binding_held = Gauge("poise_gateway_late_binding_held_requests",
                                       "Requests held in the late-binding queue, waiting for a prefill slot", registry=r)
        self.late_binding_wait = Histogram("poise_gateway_late_binding_wait_seconds",
                                           "Time a request waited in the late-binding queue", buckets=_LATENCY_BUCKETS,
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
                                         buckets=_LATENCY_BUCKETS, registry=r)
        self.stalls = Counter("poise_gateway_stalled_streams",
                              "Decode streams given up after stall_timeout_s without a token (then rescued)", registry=r)
        self.rescues = Counter("poise_gateway_rescues",
                               "Requests resumed on another pair after their decode stream broke mid-answer",
                               registry=r)
