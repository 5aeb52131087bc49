"""Gateway settings (env prefix ``POISE_GATEWAY_``)."""

from __future__ import annotations

from pydantic import Field

from shared.policies import DISPATCH_POLICIES
from shared.settings import ControlPlaneSettings, SloPlanSettings, settings_config


class GatewaySettings(SloPlanSettings, ControlPlaneSettings):
    """The OpenAI-compatible gateway in front of the prefill/decode engines."""

    model_config = settings_config("POISE_GATEWAY_")

    host: str = Field("127.0.0.1", description="Address the HTTP API binds to.")
    port: int = Field(8000, description="Port of the OpenAI-compatible HTTP API.")
    dispatch_policy: str = Field("least-load", description=f"Dispatch policy: one of {', '.join(sorted(DISPATCH_POLICIES))}.")
    max_pending_per_engine: int = Field(512, description="Queued plus in-flight requests beyond which an engine counts as full; when all are full the gateway answers 429.")
    default_max_tokens: int = Field(256, description="max_tokens used when a request gives none.")
    max_tokens_limit: int = Field(32768, description="Largest max_tokens a request may ask for (400 above it).")
    request_timeout_s: float = Field(600.0, description="Whole-request deadline in seconds; past it both legs are aborted.")
    first_token_timeout_s: float = Field(120.0, description="Seconds to wait for the first token before the attempt counts as failed (and is retried on another pair).")
    retries: int = Field(1, description="Extra attempts on another prefill/decode pair when a leg fails before the first token.")
    api_keys: list[str] = Field(default_factory=list, description="Accepted bearer API keys (JSON list); empty = no authentication.")
    tokenizer: str | None = Field(None, description="Hugging Face tokenizer name or path (local files only) for counting text prompts; unset = estimate 4 chars/token.")
    publish_events: bool = Field(True, description="Publish a RequestEvent per finished request on NATS (the monitor's series).")
    engine_connect_timeout_s: float = Field(5.0, description="TCP connect timeout to an engine, in seconds.")
