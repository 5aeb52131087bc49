"""Snapshots that policies read: frozen, I/O-free views of engines and requests.

The live gateway builds them from etcd registrations, NATS load reports and its own in-flight counters;
the simulator builds them from its event loop. Policies see nothing else.
"""

from __future__ import annotations

import msgspec

from shared.protocol.messages import InstanceStatus, Role


class EngineView(msgspec.Struct, frozen=True, kw_only=True):
    """One engine as a dispatcher sees it at one instant."""

    instance_id: str
    role: Role
    status: InstanceStatus
    healthy: bool = True
    kv_capacity_tokens: int
    max_running_requests: int
    # From the engine's latest load report (0 when none arrived yet):
    running_reqs: int = 0
    waiting_reqs: int = 0
    used_tokens: int = 0
    queue_reqs: int = 0  # disaggregation queues: prefill bootstrap/inflight or decode prealloc/transfer
    kv_waiting_reqs: int = 0  # decode: of those, the requests waiting for KV (SGLang's prealloc and retracted queues)
    load_age_s: float | None = None  # None = no report yet
    # From the dispatcher's own bookkeeping (fresh, unlike the reports):
    inflight_reqs: int = 0  # requests this dispatcher sent and that have not finished on this engine
    inflight_tokens: int = 0  # their prompt tokens (prefill) or prompt + max_tokens (decode)
    inflight_tokens_sq: int = 0  # prefill: sum of squared prompt lengths (a quadratic TTFT model sums exactly)
    token_interval_s: float | None = None  # decode: recent mean time between tokens; None = unknown
    # decode/null: requests this dispatcher saw leave the engine per second over a recent window (its service
    # rate while it has a queue); None = too few left to tell (shared/event_rate.py)
    finish_rate_rps: float | None = None
    # decode: the engine can also prefill a request itself (engine_sim, the simulator; SGLang's PD decode
    # mode cannot), so DOPD's local prefill of ultra-short prompts may send requests here alone
    local_prefill: bool = False

    @property
    def accepting(self) -> bool:
        return self.healthy and self.status == "ready"


class RequestView(msgspec.Struct, frozen=True, kw_only=True):
    """What a dispatcher knows about a request before it runs."""

    rid: str
    input_tokens: int
    max_output_tokens: int
    priority: int | None = None
    slo_ttft_s: float | None = None  # the request's SLO class targets, when it has one
    slo_tpot_s: float | None = None
    # The prompt's prefix blocks (chained hashes of 512-token blocks, or a trace's hash_ids): equal leading
    # blocks mean a shared prefix an engine's radix cache may hold (shared/policies/cache_aware.py)
    prefix_blocks: tuple[int, ...] = ()
