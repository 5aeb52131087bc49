"""Typed messages on the bus and in the registry (msgspec structs, JSON on the wire).

Every struct carries a ``schema`` tag naming its type and version, so a reader can reject a message meant
for someone else instead of mis-decoding it. Field names carry their units (``_s``, ``_tokens``).
Wall-clock fields (``*_unix_s``) are used wherever two processes compare times; monotonic clocks are
per-process.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

import msgspec

from shared.errors import ProtocolError

Role = Literal["prefill", "decode", "null"]
"""An engine's phase: SGLang's ``--disaggregation-mode`` values (``null`` = colocated)."""

InstanceStatus = Literal["starting", "ready", "draining", "switching"]
EngineKind = Literal["sim", "sglang", "attach"]


class InstanceInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What a sidecar registers in etcd for its engine (the registry's source of truth)."""

    schema: Literal["poise.v1.instance"] = "poise.v1.instance"
    instance_id: str
    role: Role
    status: InstanceStatus = "ready"
    engine_kind: EngineKind
    url: str  # engine HTTP base URL, e.g. http://127.0.0.1:30001
    bootstrap_host: str  # where a decode engine reaches this prefill engine's bootstrap server
    bootstrap_port: int | None  # None for engines that are not in PD mode
    model: str  # served model name (what clients put in "model")
    profile: str  # latency profile name (engine_sim) or the profile the planner should assume
    kv_capacity_tokens: int  # SGLang max_total_num_tokens
    max_running_requests: int
    sidecar: str  # host:pid of the sidecar, for operators
    registered_at_unix_s: float
    # The engine samples with a request's ``seed`` (SGLang: only when started with
    # --enable-deterministic-inference; engine_sim: always). The gateway refuses ``seed`` where it would be
    # accepted and not applied.
    applies_seed: bool = False


class LoadReport(msgspec.Struct, frozen=True, kw_only=True):
    """One sample of an engine's load, read from its ``/v1/loads`` by the sidecar (~4 Hz)."""

    schema: Literal["poise.v1.load"] = "poise.v1.load"
    instance_id: str
    role: Role
    status: InstanceStatus
    ts_unix_s: float
    healthy: bool = True
    error: str | None = None  # why the sample is missing or the engine is unhealthy
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_waiting_uncached_tokens: int = 0
    num_used_tokens: int = 0  # KV tokens in use (held and pre-allocated)
    num_running_tokens: int | None = None  # context tokens of the running decode batch (Arrow); None = not reported
    max_total_num_tokens: int = 0  # KV capacity in tokens
    token_usage: float = 0.0  # num_used_tokens / max_total_num_tokens
    gen_throughput_tps: float = 0.0  # decode tokens per second, engine-reported
    prefill_queue_reqs: int = 0  # prefill bootstrap + inflight queues (prefill role)
    # Of those, the bootstrap queue: prompts waiting for their decode side's KV, not for this engine's compute.
    # SGLang counts them in num_waiting_reqs too (not in num_waiting_uncached_tokens).
    prefill_bootstrap_reqs: int = 0
    decode_queue_reqs: int = 0  # decode prealloc + transfer queues (decode role)
    # Of those, the requests waiting for KV: the prealloc and retracted queues (what early rejection reads).
    decode_kv_waiting_reqs: int = 0
    # Prompts prefilled alone since the previous report, (tokens, seconds): what Arrow's TTFT predictor refits
    # from. Only engine_sim reports them; empty for SGLang.
    prefill_samples: list[tuple[int, float]] = msgspec.field(default_factory=list)

    @property
    def compute_waiting_reqs(self) -> int:
        """Requests waiting for this engine's compute: ``num_waiting_reqs`` less a prefill engine's bootstrap
        queue (whose prompts wait for decode KV; a full decode side must not read as a prefill backlog)."""
        return max(0, self.num_waiting_reqs - self.prefill_bootstrap_reqs)


class InstanceLoad(msgspec.Struct, frozen=True, kw_only=True):
    """An instance as the monitor sees it: registration plus its latest load sample."""

    info: InstanceInfo
    load: LoadReport | None  # None until the first sample arrives
    load_age_s: float | None  # seconds since that sample, None when there is none


class RequestEvent(msgspec.Struct, frozen=True, kw_only=True):
    """A finished request, published by the gateway (the monitor's arrival and length series)."""

    schema: Literal["poise.v1.request_event"] = "poise.v1.request_event"
    rid: str
    model: str
    arrived_unix_s: float
    finished_unix_s: float
    prefill_id: str | None
    decode_id: str | None
    input_tokens: int
    output_tokens: int
    ttft_s: float | None
    tpot_s: float | None
    status: Literal["ok", "error", "aborted"]
    error: str | None = None
    # Prompt tokens the engine served from its prefix cache (usage.prompt_tokens_details.cached_tokens; 0 when
    # not reported): prefill instances computed only the rest.
    cached_tokens: int = 0


class RequestEventBatch(msgspec.Struct, frozen=True, kw_only=True):
    """Finished requests of one gateway, batched (~4 per second) so telemetry costs one publish, not one
    per request, at hundreds of requests per second."""

    schema: Literal["poise.v1.request_event_batch"] = "poise.v1.request_event_batch"
    gateway: str  # replica id of the publishing gateway
    events: list[RequestEvent]


class SeriesPoint(msgspec.Struct, frozen=True, kw_only=True):
    """One interval of the monitor's rolling series (what the planner forecasts from)."""

    start_unix_s: float
    interval_s: float
    arrivals: int  # requests that arrived in the interval (from gateway events)
    arrival_rate_rps: float
    completed: int
    mean_input_tokens: float
    mean_output_tokens: float
    mean_running_reqs: float  # cluster-wide concurrency, mean over the interval's load samples
    ttft_p90_s: float | None
    tpot_p90_s: float | None
    # Of the completed requests, those prefilled on the instance that decoded them (no prefill instance:
    # DOPD's local prefill of ultra-short prompts, or a colocated engine), and their mean prompt length.
    # DOPD's ratio prices prefill instances only for the rest.
    local_prefilled: int = 0
    mean_local_input_tokens: float = 0.0
    # Second moments of the completed requests' lengths (0 when none completed): prefill time is quadratic in
    # the prompt and a decode step reads every running request's context, so the work a mix costs depends on
    # them, not on the means alone (shared/policies/split_capacity.py).
    mean_input_tokens_sq: float = 0.0
    mean_output_tokens_sq: float = 0.0
    mean_input_output_tokens: float = 0.0
    # Third moments: a decode instance holds a request's KV from dispatch, through its prefill (quadratic in
    # the prompt), so the KV-seconds a prompt costs there grow with its length cubed.
    mean_input_tokens_cube: float = 0.0
    mean_input_sq_output_tokens: float = 0.0
    # Prompt tokens a prefill instance found in its prefix cache, and their square, per completed request (0
    # for a request no prefill instance prefilled): a prompt's prefill work is that of its whole length less
    # that of its cached prefix (shared/policies/split_capacity.py).
    mean_cached_input_tokens: float = 0.0
    mean_cached_input_tokens_sq: float = 0.0


class DecodeRequestInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One request running on a decode (or colocated) instance: what a migration policy chooses among."""

    rid: str
    instance_id: str
    input_tokens: int
    generated_tokens: int
    max_output_tokens: int
    arrived_unix_s: float
    slo_tpot_s: float | None = None
    predicted_remaining_tokens: float | None = None  # from the length predictor; None when there is none
    # A migration of this request is under way: it is listed on its target (``instance_id``), which already
    # holds its KV, and ``migration_source_id`` names the instance it leaves. It takes no decode steps until
    # the move is done. Policies count it on the target and do not move it again.
    migrating: bool = False
    migration_source_id: str | None = None


class ClusterSnapshot(msgspec.Struct, frozen=True, kw_only=True):
    """The monitor's view of the cluster, served on request.

    ``decode_requests`` is filled only where someone tracks running requests one by one (the simulator
    today; the migrator with ARES later); an empty list means "not known", not "idle".
    """

    schema: Literal["poise.v1.cluster_snapshot"] = "poise.v1.cluster_snapshot"
    ts_unix_s: float
    instances: list[InstanceLoad]
    series: list[SeriesPoint]
    decode_requests: list[DecodeRequestInfo] = msgspec.field(default_factory=list)


class SnapshotRequest(msgspec.Struct, frozen=True, kw_only=True):
    schema: Literal["poise.v1.snapshot_request"] = "poise.v1.snapshot_request"
    series_points: int = 60  # how many of the newest series intervals to include (0 = none)


class SnapshotReply(msgspec.Struct, frozen=True, kw_only=True):
    schema: Literal["poise.v1.snapshot_reply"] = "poise.v1.snapshot_reply"
    ok: bool
    message: str = ""
    snapshot: ClusterSnapshot | None = None


class RoleCommand(msgspec.Struct, frozen=True, kw_only=True):
    """Ask a sidecar to move its engine to another role: drain, ``/pd_role_switch``, re-register."""

    schema: Literal["poise.v1.role_command"] = "poise.v1.role_command"
    command_id: str
    new_role: Role
    reason: str = ""
    drain_timeout_s: float = 60.0


class RoleCommandReply(msgspec.Struct, frozen=True, kw_only=True):
    schema: Literal["poise.v1.role_command_reply"] = "poise.v1.role_command_reply"
    command_id: str
    instance_id: str
    ok: bool
    message: str
    old_role: Role
    new_role: Role


PlannerEventKind = Literal["flip_requested", "flip_done", "flip_failed", "paused", "resumed", "resize_requested",
                           "forecast"]
"""What a :class:`PlannerEvent` reports; ``resize_requested`` = the pool policy's target split moved;
``forecast`` = DOPD evaluated its model on a new forecast (the ``forecast_*`` fields)."""


class PlannerEvent(msgspec.Struct, frozen=True, kw_only=True):
    """One thing the planner did, published on ``Subjects.planner_events()`` (``poise admin events``).

    Every flip the planner carries out, whether a policy or an operator asked for it, produces
    ``flip_requested`` when the :class:`RoleCommand` is sent and ``flip_done`` or ``flip_failed`` when the
    sidecar answers (it answers after the drain, the switch and the re-registration, so ``duration_s`` is
    that whole span as the planner saw it). ``resize_requested`` says the policy's target P:D split moved.
    """

    schema: Literal["poise.v1.planner_event"] = "poise.v1.planner_event"
    kind: PlannerEventKind
    ts_unix_s: float
    replica_id: str  # the planner replica that acted
    instance_id: str | None = None  # flips only
    from_role: Role | None = None  # None when the planner did not know the role before the flip
    to_role: Role | None = None
    source: Literal["policy", "admin"] | None = None  # who asked (flips, pause, resume)
    reason: str = ""
    command_id: str | None = None  # ties a flip's requested/done/failed events together
    duration_s: float | None = None  # flip_done / flip_failed: command sent -> sidecar's reply
    message: str = ""  # the sidecar's answer (done/failed)
    target_prefill: int | None = None  # resize_requested: the policy's wanted prefill count
    target_decode: int | None = None
    # forecast: what DOPD's ARIMA forecasters predicted for the next interval, and the ratio it computed
    forecast_rate_rps: float | None = None
    forecast_isl: float | None = None
    forecast_osl: float | None = None
    forecast_concurrency: float | None = None
    forecast_ratio: float | None = None


class PlannerPause(msgspec.Struct, frozen=True, kw_only=True):
    """The etcd record ``Keys.planner_paused()`` holds while the planner is paused."""

    schema: Literal["poise.v1.planner_pause"] = "poise.v1.planner_pause"
    reason: str = ""
    replica_id: str  # the replica that took the pause command
    at_unix_s: float


class ServiceStatus(msgspec.Struct, frozen=True, kw_only=True):
    """What ``poise admin status`` shows for one service replica."""

    service: str
    replica_id: str
    is_leader: bool
    policy: str
    policy_note: str  # e.g. "static: no P:D changes until the adaptive policies land"
    uptime_s: float
    details: dict[str, Any] = msgspec.field(default_factory=dict)


class AdminCommand(msgspec.Struct, frozen=True, kw_only=True):
    schema: Literal["poise.v1.admin_command"] = "poise.v1.admin_command"
    verb: str  # "status" everywhere; services may add their own verbs
    args: dict[str, str] = msgspec.field(default_factory=dict)


class AdminReply(msgspec.Struct, frozen=True, kw_only=True):
    schema: Literal["poise.v1.admin_reply"] = "poise.v1.admin_reply"
    ok: bool
    message: str = ""
    status: ServiceStatus | None = None


_T = TypeVar("_T", bound=msgspec.Struct)
_ENCODER = msgspec.json.Encoder()
_DECODERS: dict[type[Any], msgspec.json.Decoder[Any]] = {}


def encode(message: msgspec.Struct) -> bytes:
    return _ENCODER.encode(message)


def decode(data: bytes, message_type: type[_T]) -> _T:
    """Decode ``data`` as ``message_type``; a wrong schema or shape raises :class:`ProtocolError`."""
    decoder = _DECODERS.get(message_type)
    if decoder is None:
        decoder = _DECODERS[message_type] = msgspec.json.Decoder(message_type)
    try:
        return decoder.decode(data)  # type: ignore[no-any-return]
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ProtocolError(f"cannot decode {message_type.__name__}: {exc}") from exc
