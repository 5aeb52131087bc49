"""Gateway settings (env prefix ``POISE_GATEWAY_``)."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from shared.policies import DISPATCH_POLICIES, PREFILL_POLICIES
from shared.policies.late_binding import DEFAULT_DEPTH as LATE_BINDING_DEPTH
from shared.settings import ControlPlaneSettings, SloPlanSettings, settings_config


class GatewaySettings(SloPlanSettings, ControlPlaneSettings):
    """The OpenAI-compatible gateway in front of the prefill/decode engines."""

    model_config = settings_config("POISE_GATEWAY_")

    host: str = Field("127.0.0.1", description="Address the HTTP API binds to.")
    port: int = Field(8000, description="Port of the OpenAI-compatible HTTP API.")
    dispatch_policy: str = Field("least-load", description=f"Dispatch policy: one of {', '.join(sorted(DISPATCH_POLICIES))}.")
    max_pending_per_engine: int = Field(512, description="Queued plus in-flight requests beyond which an engine counts as full; when all are full the gateway answers 429.")
    default_max_tokens: int = Field(256, description="The output length the gateway plans with (its in-flight ledger, placement) for a chat request that gives no max_tokens; the engines get no limit and answer to the end, as OpenAI and SGLang do. A completions request without one gets the OpenAI API's 16.")
    max_tokens_limit: int = Field(32768, description="Largest max_tokens a request may ask for (400 above it).")
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024, description="Largest request body accepted, in bytes (413 above it; checked on Content-Length and while reading). 8 MiB holds a 1M-token prompt as token ids.")
    accept_unapplied_seed: bool = Field(False, description="Accept a request's `seed` where the model's engines do not apply it (SGLang applies one only when started with --enable-deterministic-inference; the sidecar reads that from /server_info): its answers then differ between runs. Off: such a request gets a 400 naming `seed`.")
    max_json_depth: int = Field(64, ge=4, description="Deepest nesting of objects and lists a request body may have (400 deeper): pass-through fields reach the engines re-encoded.")
    header_timeout_s: float = Field(10.0, gt=0, description="Seconds a client has to send a request's headers, from the connection's opening or the request's first byte (408 past it; an idle connection is closed): trickled headers do not hold a connection open (nginx's client_header_timeout).")
    body_timeout_s: float = Field(30.0, gt=0, description="Seconds a client has to send the whole request body once its headers arrived (408 past it): a trickled body does not hold a connection open.")
    request_timeout_s: float = Field(600.0, description="Whole-request deadline in seconds; past it both legs are aborted.")
    probe_timeout_s: float = Field(5.0, gt=0, description="Seconds an engine's /health has to answer when the gateway asks whether it still works: one that left the registry while requests wait on it for their first token, or one on which a request has waited stall_timeout_s for its first token. Past them (or on an error) the requests waiting on it are tried on another pair at once instead of waiting out first_token_timeout_s; an engine that answers keeps them. On SGLang /health answers at the scheduler's next output (polled each second), so this must exceed the engine's longest step plus 1 s.")
    first_token_timeout_s: float = Field(120.0, description="Seconds to wait for the first token before the attempt counts as failed (and is retried on another pair).")
    stall_timeout_s: float = Field(15.0, ge=0, description="Seconds a started decode stream may go without a token while the gateway waits on it before its engine counts as stalled: the stream is given up and the request resumed on another pair from the tokens sent (like a broken stream, within max_rescues). A request waiting this long for its first token has its engines' /health asked (probe_timeout_s). 0 = off.")
    retries: int = Field(1, description="Extra attempts on another prefill/decode pair when a leg fails before the first token.")
    length_predictions: bool = Field(True, description="Ask engine_sim decode engines for remaining-length predictions on the stream (poise_predict_length; engines started with a length_predictor answer) and offer them to the migrator's policy.")
    move_non_streaming: bool = Field(False, description="Stream the decode leg of non-streaming requests inside the gateway too, so the migrator can move them mid-answer and a decode engine that dies mid-answer is resumed from the tokens it produced instead of restarting the request (the client still gets one JSON body). Costs the gateway a parse per token; poise up turns it on with a migration policy.")
    max_rescues: int = Field(2, ge=0, description="Times a request whose decode stream breaks mid-answer is resumed on another pair from the tokens already sent (0: end it with an error event).")
    api_keys: list[str] = Field(default_factory=list, description="Accepted bearer API keys (JSON list); empty = no authentication.")
    tokenizer: str | None = Field(None, description="Hugging Face tokenizer name or path (local files only) for counting text prompts; unset = estimate 4 chars/token.")
    publish_events: bool = Field(True, description="Publish a RequestEvent per finished request on NATS (the monitor's series).")
    engine_api_key: str | None = Field(None, description="The engines' API key (SGLang --api-key), sent to every engine the gateway calls. Prefer the env var POISE_GATEWAY_ENGINE_API_KEY to the flag.")
    engine_connect_timeout_s: float = Field(5.0, description="TCP connect timeout to an engine, in seconds.")
    # -- per-request SLO classes (services/gateway/slo.py) ----------------------------------------------
    slo_class: list[str] = Field(default_factory=list, description="SLO class NAME=TTFT_S:TPOT_S a request may name in its 'slo_class' field (an empty target = slo_ttft_s / slo_tpot_s); repeat for more classes.")
    slo_preset: str | None = Field(None, description="SLO classes from a preset (shared/slo_spec.py) built on slo_ttft_s/slo_tpot_s, e.g. tasks-flowprefill (FlowPrefill Table 2: text 0.25 s, image 0.5 s, search 4 s, file 6 s TTFT) or interactive-batch; slo_class specs add to it.")
    slo_priority_class: list[str] = Field(default_factory=list, description="PRIORITY=CLASS: the class of a request whose integer 'priority' is PRIORITY (comma-separated pairs or repeated).")
    slo_model_class: list[str] = Field(default_factory=list, description="MODEL=CLASS: the default class of a model's requests.")
    slo_route_class: list[str] = Field(default_factory=list, description="ROUTE=CLASS: the default class of a route, completions (/v1/completions) or chat (/v1/chat/completions).")
    slo_default_class: str | None = Field(None, description="The class of requests no other rule classifies; unset = slo_fallback decides.")
    slo_fallback: bool = Field(True, description="Requests no rule classifies get the gateway's slo_ttft_s / slo_tpot_s (the SLO its dispatch plans for), so the engines order their prompts by deadline; false = no targets (best effort).")
    # -- DOPD's local prefill (shared/policies/local_prefill.py) -------------------------------------------
    local_prefill_max_tokens: int = Field(0, ge=0, description="Prompts up to this many tokens are prefilled on their decode engine, with no prefill engine or KV transfer (DOPD's ultra-short requests; the spec's L_us is 512). Only engine_sim decode engines can do it: requests for SGLang decode engines always take a prefill engine. 0 = off.")
    local_prefill_max_queue: int | None = Field(None, ge=1, description="Also prefill locally when the chosen prefill engine has this many requests queued or in flight (Dynamo's conditional-disaggregation queue rule; its default is 2). Unset = length rule only.")
    # -- early rejection (shared/policies/admission.py) -------------------------------------------------
    early_rejection: bool = Field(False, description="Refuse a request (429, code slo_unreachable) when its decode engine's queue of requests waiting for KV (a colocated engine's: its waiting queue), at the rate requests have been leaving it, would keep it from starting within its TTFT target and no other engine of that role can start it in time (Mooncake's early rejection, on a measured rate). Past the decode side's capacity this keeps the requests taken in time instead of every request waiting out the whole backlog. With late_binding, the held queue also guards the decode side: nothing is released while no decode engine runs and queues fewer requests than its cap, and a request held past its TTFT target is refused the same way. poise up turns it on with the poise planner.")
    early_rejection_colocated: bool = Field(True, description="Early rejection judges colocated engines too (their waiting queue). Turn it off where colocated engines refuse late prompts themselves (engine_sim --give-up-late-prompts): their fewest-late order keeps the prompts that can make their targets, and refusing at the gateway on the queue's length costs more than it saves (tests/bench/results/provenance.md). poise up turns it off with --give-up-late-prompts.")
    early_rejection_factor: float = Field(1.0, gt=0.0, description="Early rejection refuses when the decode wait passes this many times the request's TTFT target (1: only requests the wait alone would make late).")
    # -- late binding (services/gateway/admission.py, shared/gateway/model.py) --------------------------------------------------
    late_binding: bool = Field(False, description="Hold requests in the gateway and send one to a prefill engine only when it has fewer than late_binding_depth prompts sent and not yet prefilled, in late_binding_policy's order (for engines whose scheduler cannot be patched).")
    late_binding_policy: str = Field("edf", description=f"Prefill policy that orders the held requests: one of {', '.join(sorted(PREFILL_POLICIES))}.")
    late_binding_depth: int = Field(LATE_BINDING_DEPTH, ge=1, description="Late binding: prompts a prefill engine may hold unprefilled, of those this gateway sent, before it holds the next ones. Replicas count only their own: give each its share (make deploy and compose give each of two replicas 1).")

    @field_validator("late_binding_policy")
    @classmethod
    def _known_prefill_policy(cls, value: str) -> str:
        from shared.policies import lookup

        lookup(PREFILL_POLICIES, value, "prefill policy")
        return value

    @model_validator(mode="after")
    def _valid_slo_table(self) -> GatewaySettings:
        from services.gateway.slo import SloTable

        SloTable.from_settings(self)  # raises ValueError with the offending spec
        return self
