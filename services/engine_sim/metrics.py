"""Prometheus metrics under SGLang's names and labels, in a registry private to one engine.

Names, label sets and buckets follow sglang/srt/observability/metrics_collector.py:

- scheduler-side series (queues, KV, throughput, PD queues, KV transfer) carry ``model_name``,
  ``engine_type``, ``tp_rank``, ``pp_rank``, ``moe_ep_rank``; ``engine_type`` is ``"dynamic"`` when role
  switching is enabled so a series survives a flip, else prefill/decode/unified (SchedulerMetricsCollector);
- tokenizer-side series (tokens, latencies, aborts) carry ``model_name`` and ``engine_type`` fixed at start
  (tokenizer_metric_labels), plus ``is_streaming`` where SGLang has it.

Poise's own series (not in SGLang) are named ``poise:...`` and carry the scheduler labels: operator-level
prefill preemptions (``poise:prefill_preemptions_total``, ``poise:prefill_preemption_blocking_seconds``), and
the time the scheduler fell behind its latency model because the host did not run it in time
(``poise:engine_sim_behind_model_seconds_total``: while it grows, live timings measure the host, not the model).
Latencies count from when the request reached this engine (``received_s``), as SGLang's do, not from the
gateway's arrival that a ``poise_slo`` field moves ``arrival_s`` back to.

Gauges are refreshed from the engine when ``/metrics`` is scraped; counters and histograms are updated per
request (never per token: inter-token latency is recorded once per request, as a bulk observation).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from services.engine_sim.requests import SimRequest

TTFT_BUCKETS = [0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400]
E2E_BUCKETS = [0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200, 1800, 2400]
ITL_BUCKETS = [0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060, 0.080, 0.100,
               0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000]
QUEUE_TIME_BUCKETS = [0.0, 0.1, 0.2, 0.5, 1, 2, 3, 4, 5, 10, 15, 20, 30, 40, 50, 60, 70, 80, 90, 100, 200, 300, 400,
                      500, 600, 700, 800, 900, 1000, 1200, 1400, 1600, 1800, 2000, 2500, 3000]
KV_LATENCY_MS_BUCKETS = (1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000)
KV_SPEED_BUCKETS = (0.1, 0.5, 1, 5, 10, 25, 50, 100, 200, 400)
KV_BOOTSTRAP_MS_BUCKETS = (1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500)
# From the arrival that triggers an operator-level preemption to the operator boundary where the pass stops:
# at most one operator (~0.1-30 ms on the built-in profiles, more at a large time_scale).
PREEMPTION_BLOCKING_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


def engine_type(mode: str) -> str:
    """DisaggregationMode.to_engine_type (sglang/srt/disaggregation/utils.py)."""
    return mode if mode in ("prefill", "decode") else "unified"


def _observe_many(child: Any, total: float, count: int) -> None:
    """``count`` observations averaging ``total / count`` in O(buckets), as SGLang's observe_inter_token_latency."""
    if count <= 0:
        return
    each = total / count
    buckets = getattr(child, "_buckets", None)
    bounds = getattr(child, "_upper_bounds", None)
    if buckets is None or bounds is None:  # a prometheus_client without these internals: slow path
        for _ in range(count):
            child.observe(each)
        return
    child._sum.inc(total)
    for i, bound in enumerate(bounds):
        if each <= bound:
            buckets[i].inc(count)
            break


class ThroughputWindow:
    """Generated tokens and busy time over the last few seconds (gen_throughput, utilization)."""

    def __init__(self, window_s: float = 5.0, sample_every_s: float = 0.25) -> None:
        self.window_s = window_s
        self.sample_every_s = sample_every_s
        self.tokens = 0
        self.busy_s = 0.0
        self._samples: deque[tuple[float, int, float]] = deque()

    def record(self, now: float, tokens: int, busy_s: float) -> None:
        self.tokens += tokens
        self.busy_s += busy_s
        if not self._samples or now - self._samples[-1][0] >= self.sample_every_s:
            self._samples.append((now, self.tokens, self.busy_s))
            while len(self._samples) > 2 and now - self._samples[1][0] > self.window_s:
                self._samples.popleft()

    def rates(self, now: float) -> tuple[float, float]:
        """(tokens per second, busy fraction) since the oldest sample in the window."""
        if not self._samples:
            return 0.0, 0.0
        t0, tok0, busy0 = self._samples[0]
        if now - t0 > self.window_s * 2:  # idle for a while: nothing recent to report
            return 0.0, 0.0
        dt = now - t0
        if dt <= 0:
            return 0.0, 0.0
        return (self.tokens - tok0) / dt, min(1.0, (self.busy_s - busy0) / dt)


class EngineMetrics:
    """SGLang's metric families (scheduler and tokenizer), with its names, labels and buckets, and Poise's
    extensions beside them."""

    def __init__(self, *, model_name: str, mode: str, role_switch_enabled: bool) -> None:
        # SGLang exports through prometheus_client's multiprocess collector, which writes no *_created series
        # (recorded from 0.5.23: tests/contract/fixtures/sglang-0.5.23-cpu/metrics_decode.json); a process-wide
        # switch, and this process is the engine
        disable_created_metrics()
        self.registry = CollectorRegistry()
        self.scheduler_labels = {
            "model_name": model_name,
            "engine_type": "dynamic" if role_switch_enabled else engine_type(mode),
            "tp_rank": "0",
            "pp_rank": "0",
            "moe_ep_rank": "0",
        }
        self.tokenizer_labels = {"model_name": model_name, "engine_type": engine_type(mode)}
        self._scheduler_basics()
        self._disaggregation()
        self._poise_extensions()
        self._tokenizer()

    # -- scheduler families: one child each, with the scheduler's labels ---------------------------------
    def _gauge(self, name: str, doc: str) -> Any:
        sched = self.scheduler_labels
        return Gauge(name, doc, list(sched), registry=self.registry, multiprocess_mode="mostrecent").labels(**sched)

    def _counter(self, name: str, doc: str) -> Any:
        sched = self.scheduler_labels
        return Counter(name, doc, list(sched), registry=self.registry).labels(**sched)

    def _histogram(self, name: str, doc: str, buckets: Sequence[float]) -> Any:
        sched = self.scheduler_labels
        return Histogram(name, doc, list(sched), registry=self.registry, buckets=buckets).labels(**sched)

    def _scheduler_basics(self) -> None:
        gauge = self._gauge
        self.num_running_reqs = gauge("sglang:num_running_reqs", "The number of running requests.")
        self.num_queue_reqs = gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.")
        self.num_grammar_queue_reqs = gauge("sglang:num_grammar_queue_reqs", "The number of requests in the grammar waiting queue.")
        self.gen_throughput = gauge("sglang:gen_throughput", "The generation throughput (token/s).")
        self.cache_hit_rate = gauge("sglang:cache_hit_rate", "The prefix cache hit rate.")
        self.token_usage = gauge("sglang:token_usage", "The token usage.")
        self.num_used_tokens = gauge("sglang:num_used_tokens", "The number of used tokens.")
        self.kv_used_tokens = gauge("sglang:kv_used_tokens", "KV tokens in use.")
        self.kv_available_tokens = gauge("sglang:kv_available_tokens", "KV tokens available.")
        self.max_total_num_tokens = gauge("sglang:max_total_num_tokens", "KV cache capacity in tokens.")
        self.utilization = gauge("sglang:utilization", "Share of recent time the engine was computing.")
        self.num_retracted_reqs = gauge("sglang:num_retracted_reqs", "The number of retracted requests.")
        self.num_paused_reqs = gauge("sglang:num_paused_reqs", "The number of paused requests by async weight sync.")
        self.num_retracted_requests_total = self._counter("sglang:num_retracted_requests_total",
                                                          "Total retracted requests.")
        self.queue_time = self._histogram("sglang:queue_time_seconds", "Histogram of queueing time in seconds.",
                                          QUEUE_TIME_BUCKETS)

    def _disaggregation(self) -> None:
        gauge = self._gauge
        self.num_prefill_bootstrap_queue_reqs = gauge(
            "sglang:num_prefill_bootstrap_queue_reqs", "The number of requests in the prefill bootstrap queue.")
        self.num_prefill_inflight_queue_reqs = gauge(
            "sglang:num_prefill_inflight_queue_reqs", "The number of requests in the prefill inflight queue.")
        self.num_decode_prealloc_queue_reqs = gauge(
            "sglang:num_decode_prealloc_queue_reqs", "The number of requests in the decode prealloc queue.")
        self.num_decode_transfer_queue_reqs = gauge(
            "sglang:num_decode_transfer_queue_reqs", "The number of requests in the decode transfer queue.")
        self.kv_transfer_speed_gb_s = self._histogram(
            "sglang:kv_transfer_speed_gb_s", "Histogram of KV cache transfer speed in GB/s.", KV_SPEED_BUCKETS)
        self.kv_transfer_latency_ms = self._histogram(
            "sglang:kv_transfer_latency_ms", "Histogram of KV cache transfer latency in ms.", KV_LATENCY_MS_BUCKETS)
        self.kv_transfer_bootstrap_ms = self._histogram(
            "sglang:kv_transfer_bootstrap_ms", "Histogram of KV transfer bootstrap time in ms.", KV_BOOTSTRAP_MS_BUCKETS)
        self.num_bootstrap_failed_reqs = self._counter(
            "sglang:num_bootstrap_failed_reqs_total", "The number of bootstrap failed requests.")
        self.num_transfer_failed_reqs = self._counter(
            "sglang:num_transfer_failed_reqs_total", "The number of transfer failed requests.")

    def _poise_extensions(self) -> None:
        self.prefill_preemptions = self._counter(
            "poise:prefill_preemptions_total",
            "Prefill forward passes cut at an operator boundary for a more urgent prompt (preemption=operator).")
        self.prefill_preemption_blocking = self._histogram(
            "poise:prefill_preemption_blocking_seconds",
            "Time from the arrival that preempted a prefill pass to the operator boundary where the pass stopped.",
            PREEMPTION_BLOCKING_BUCKETS)
        self.behind_model_seconds = self._counter(
            "poise:engine_sim_behind_model_seconds",
            "Time steps started later than the latency model's schedule and could not catch up: the host was too "
            "busy to run this stand-in on time (a GPU engine has no such term).")

    # -- tokenizer families: by is_streaming, bound once per value -------------------------------------
    def _tokenizer(self) -> None:
        r, tok = self.registry, self.tokenizer_labels
        tn = list(tok)
        stream_names = [*tn, "is_streaming"]
        self._prompt_tokens = Counter("sglang:prompt_tokens_total", "Number of prefill tokens processed.",
                                      stream_names, registry=r)
        self._generation_tokens = Counter("sglang:generation_tokens_total", "Number of generation tokens processed.",
                                          stream_names, registry=r)
        self._num_requests = Counter("sglang:num_requests_total", "The number of requests processed.",
                                     stream_names, registry=r)
        self._cached_tokens = Counter("sglang:cached_tokens_total",
                                      "Number of cached prompt tokens by source (device/host/storage).",
                                      [*tn, "cache_source"], registry=r).labels(**tok, cache_source="device")
        self.num_aborted_requests = Counter("sglang:num_aborted_requests_total", "Number of requests aborted.", tn,
                                            registry=r).labels(**tok)
        self._ttft = Histogram("sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                               stream_names, registry=r, buckets=TTFT_BUCKETS)
        self.itl = Histogram("sglang:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", tn,
                             registry=r, buckets=ITL_BUCKETS).labels(**tok)
        self._tpot = Histogram("sglang:request_time_per_output_token_seconds",
                               "Per-request TPOT in seconds: (finished_time - first_token_time) / (completion_tokens - 1).",
                               stream_names, registry=r, buckets=ITL_BUCKETS)
        self._e2e = Histogram("sglang:e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds",
                              stream_names, registry=r, buckets=E2E_BUCKETS)
        # Children per is_streaming value, bound once (labels() is a dict lookup under a lock).
        self._by_stream: dict[str, dict[str, Any]] = {  # Counters and Histograms: mypy cannot join their types
            s: {
                "prompt": self._prompt_tokens.labels(**tok, is_streaming=s),
                "gen": self._generation_tokens.labels(**tok, is_streaming=s),
                "requests": self._num_requests.labels(**tok, is_streaming=s),
                "ttft": self._ttft.labels(**tok, is_streaming=s),
                "tpot": self._tpot.labels(**tok, is_streaming=s),
                "e2e": self._e2e.labels(**tok, is_streaming=s),
            }
            for s in ("true", "false")
        }

    # -- per-request events ---------------------------------------------------------------------------
    def first_token(self, req: SimRequest, now: float) -> None:
        self._by_stream["true" if req.stream else "false"]["ttft"].observe(now - req.received_s)

    def finished(self, req: SimRequest, now: float) -> None:
        c = self._by_stream["true" if req.stream else "false"]
        n = len(req.output_ids)
        c["requests"].inc()
        c["prompt"].inc(req.prompt_tokens)
        if req.cached_tokens:
            self._cached_tokens.inc(req.cached_tokens)
        if n:
            c["gen"].inc(n)
        c["e2e"].observe(now - req.received_s)
        if n > 1 and req.first_token_s is not None and req.last_token_s is not None:
            decode_s = req.last_token_s - req.first_token_s
            _observe_many(self.itl, decode_s, n - 1)
            c["tpot"].observe(decode_s / (n - 1))

    def prefill_preempted(self, blocking_s: float) -> None:
        self.prefill_preemptions.inc()
        self.prefill_preemption_blocking.observe(max(0.0, blocking_s))

    def kv_transfer(self, latency_ms: float, speed_gb_s: float | None) -> None:
        self.kv_transfer_latency_ms.observe(latency_ms)
        if speed_gb_s is not None:
            self.kv_transfer_speed_gb_s.observe(speed_gb_s)

    # -- scrape ---------------------------------------------------------------------------------------
    def render(self, gauges: dict[str, float]) -> bytes:
        for name, value in gauges.items():
            getattr(self, name).set(value)
        return generate_latest(self.registry)
