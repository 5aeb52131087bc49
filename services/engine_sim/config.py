"""engine_sim's settings: ``POISE_ENGINE_SIM_*`` env vars and ``--flags`` (see :func:`shared.settings.parse_settings`).

Names follow SGLang's launch flags where one exists (``--disaggregation-mode`` → ``mode``,
``--disaggregation-bootstrap-port`` → ``bootstrap_port``, ``--num-reserved-decode-tokens``, ...), so a
stack file can describe a simulated engine and a real one the same way.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from shared.latency import DEFAULT_PROFILE
from shared.policies import DECODE_BATCH_POLICIES, PREFILL_POLICIES, Preemption
from shared.policies.length import LENGTH_PREDICTORS
from shared.settings import ServiceSettings, settings_config

Mode = Literal["prefill", "decode", "null"]

SGLANG_DEFAULT_BOOTSTRAP_PORT = 8998  # --disaggregation-bootstrap-port default (sglang arg_groups/fields/disagg.py)


class EngineSimSettings(ServiceSettings):
    """engine_sim: an SGLang-API engine stand-in timed by Poise's latency model."""

    model_config = settings_config("POISE_ENGINE_SIM_")

    host: str = Field("127.0.0.1", description="Interface the HTTP API (and the bootstrap server) listen on.")
    port: int = Field(30000, ge=0, le=65535, description="HTTP API port (SGLang's --port).")
    mode: Mode = Field(
        "null",
        description="SGLang --disaggregation-mode: prefill, decode, or null (colocated prefill+decode).",
    )
    bootstrap_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="Port of the KV bootstrap server a prefill engine serves (SGLang --disaggregation-bootstrap-port); "
        f"unset means SGLang's default {SGLANG_DEFAULT_BOOTSTRAP_PORT}. Used in prefill mode and after a switch to it.",
    )
    api_key: str | None = Field(None, description="SGLang --api-key: every endpoint but /health*, /ready* and /metrics* wants 'Authorization: Bearer <key>' (401 otherwise). Prefer the environment (POISE_ENGINE_SIM_API_KEY) to the flag, which shows in ps.")
    served_model_name: str = Field(
        "meta-llama/Llama-3.1-8B-Instruct", description="Model name reported by /v1/models, /model_info and metrics."
    )
    profile: str = Field(DEFAULT_PROFILE, description="Latency profile: a built-in name or a path to a profile JSON.")
    time_scale: float = Field(
        1.0, ge=0.0, description="Multiplies every modelled time: 1 = the profiled GPU, 0 = free compute."
    )
    seed: int = Field(0, description="Seed for token ids and output lengths (deterministic per (seed, prompt)).")
    enable_pd_role_switch: bool = Field(True, description="Allow POST /pd_role_switch (SGLang --enable-pd-role-switch).")
    kv_capacity_tokens: int | None = Field(
        None, gt=0, description="KV cache size in tokens (SGLang max_total_num_tokens); unset = the profile's."
    )
    max_running_requests: int | None = Field(
        None, gt=0, description="Most requests in the running batch; unset = the profile's."
    )
    chunked_prefill_size: int | None = Field(
        None,
        ge=-1,
        description="Most prefill tokens per forward pass (SGLang --chunked-prefill-size); unset = the profile's; "
        "-1 = no chunking: every prompt is prefilled whole, prompts batched up to SGLang's --max-prefill-tokens "
        "default (16384 tokens; a longer prompt runs alone).",
    )
    disable_radix_cache: bool = Field(
        False, description="SGLang --disable-radix-cache: no prefix cache. Without it, prefill and colocated engines "
        "reuse the KV of cached prompt prefixes (matched on 512-token blocks; least recently used blocks evicted).")
    enable_cache_report: bool = Field(
        False, description="SGLang --enable-cache-report: OpenAI usage carries prompt_tokens_details.cached_tokens.")
    num_reserved_decode_tokens: int = Field(
        512, ge=0, description="KV reserved per request beyond its prompt when admitted to decode (SGLang's default 512)."
    )
    mean_output_tokens: float = Field(
        256.0,
        ge=1.0,
        description="Mean output length when ignore_eos is false: the stop point is geometric, seeded by (seed, rid).",
    )
    context_length: int = Field(
        131072, gt=1, description="Model context length: longer prompts (or prompt + max tokens) are rejected."
    )
    bootstrap_timeout_s: float = Field(
        30.0,
        gt=0.0,
        description="How long a prefill request waits for its decode peer (and a decode waits for its prefill room) "
        "before failing, like SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT.",
    )
    health_check_timeout_s: float = Field(
        20.0, gt=0.0, description="How long /health waits for the scheduler to produce something before answering 503 "
                                  "(SGLANG_HEALTH_CHECK_TIMEOUT).")
    migration_gbps: float = Field(
        25.0, gt=0, description="Link speed of a decode-to-decode KV copy (poise_resume with a KV source), "
                                "Gbit/s; ARES' simulator uses 25.")
    length_predictor: str = Field(
        "none", description="Remaining-length predictions put on decode streams that ask (poise_predict_length): none, "
                            "oracle (the truth) or ares-noise (ARES Fig. 7's error, shrinking as tokens are generated); "
                            "the stand-in for ARES' hidden-state MLP, which engine_sim does not have.")
    predict_every_tokens: int = Field(20, ge=1, description="Re-predict every this many generated tokens (ARES' k).")
    instance_id: str = Field("engine-sim", description="Name of this engine in logs and /server_info.")
    prefill_policy: str = Field(
        "fcfs",
        description="Prefill scheduling policy: a name in shared.policies.PREFILL_POLICIES (fcfs, edf, ...); it "
        "plans every prefill forward pass (prefill and colocated engines).",
    )
    decode_policy: str = Field(
        "continuous",
        description="Decode batch policy: a name in shared.policies.DECODE_BATCH_POLICIES (continuous, ...); it "
        "picks the running requests that take each decode step (decode and colocated engines).",
    )
    preemption: Preemption = Field(
        "chunk",
        description="Where a prefill engine can switch to a more urgent prompt. chunk: a pass is one chunk of "
        "chunked_prefill_size and the prefill policy re-plans at chunk boundaries (SGLang). operator: a prompt "
        "arriving during a pass makes the policy re-plan, and a plan headed by a prompt outside the running pass "
        "cuts it at the next operator boundary, the cut prompts keeping the work done (FlowPrefill's cooperative "
        "preemption; prefill mode only).",
    )

    give_up_late_prompts: bool = Field(
        False,
        description="Colocated mode: at each step boundary, refuse (429, finish_reason abort) the prompts still "
        "waiting, unstarted, past their TTFT target (poise_slo). They are late whatever happens; past capacity "
        "the queue otherwise fills with them, each served at the cost of one that still had time. Not an SGLang "
        "option: Poise's engines only.",
    )

    @model_validator(mode="after")
    def _check(self) -> EngineSimSettings:
        if self.bootstrap_port is not None and self.bootstrap_port == self.port and self.port != 0:
            raise ValueError("bootstrap_port must differ from port")
        if self.chunked_prefill_size == 0:
            raise ValueError("chunked_prefill_size must be positive, or -1 for no chunking")
        if self.prefill_policy not in PREFILL_POLICIES:
            raise ValueError(f"unknown prefill_policy {self.prefill_policy!r}; known: {', '.join(sorted(PREFILL_POLICIES))}")
        if self.decode_policy not in DECODE_BATCH_POLICIES:
            raise ValueError(
                f"unknown decode_policy {self.decode_policy!r}; known: {', '.join(sorted(DECODE_BATCH_POLICIES))}")
        if self.length_predictor != "none" and self.length_predictor not in LENGTH_PREDICTORS:
            raise ValueError(f"unknown length_predictor {self.length_predictor!r}; known: none, "
                             f"{', '.join(sorted(LENGTH_PREDICTORS))}")
        return self

    def resolved_bootstrap_port(self) -> int:
        """The bootstrap port a prefill role listens on."""
        return SGLANG_DEFAULT_BOOTSTRAP_PORT if self.bootstrap_port is None else self.bootstrap_port
