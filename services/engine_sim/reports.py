"""What the engine reports about itself: /v1/loads, the /metrics gauges, /model_info and /server_info.

Read-only views of the engine's state, in SGLang's shapes. Plain functions; SimEngine's methods of the same
names call them.
"""

from __future__ import annotations

import sys
from datetime import UTC, datetime
from typing import Any

from services.engine_sim import clock
from services.engine_sim.engine_state import EngineState
from shared.engine.load import EngineLoad, engine_load
from shared.policies.prefill_order import MAX_PREFILL_TOKENS

ENGINE_NAME = "poise-engine-sim"
SGLANG_API_VERSION = "0.5.23"  # the SGLang release whose HTTP API this emulates


def num_queue_reqs(eng: EngineState) -> int:
    """SGLang's num_queue_reqs: the scheduler's waiting queue (PD queues are separate gauges)."""
    q = eng.queues
    return len(q.intake) + len(q.waiting) + len(q.ready)


def load(eng: EngineState) -> EngineLoad:
    """The engine's load numbers (shared.engine.load: the function the simulator's engines report by too)."""
    q = eng.queues
    return engine_load(eng.core, intake=q.intake, bootstrap=len(q.bootstrap), sent=q.inflight.values(),
                       transfer=q.transfer.values())


def load_snapshot(eng: EngineState) -> dict[str, Any]:
    """One LoadSnapshot (sglang/srt/managers/load_snapshot.py) as LoadSnapshot.to_dict() renders it."""
    now = clock.monotonic()
    q = eng.queues
    current = load(eng)
    if eng.mode == "decode":
        pending_tokens = sum(r.prompt_tokens for r in q.intake) + sum(
            r.context_tokens for r in (*q.prealloc, *q.retracted))
        awaiting_kv = sum(r.prompt_tokens for r in (*q.prealloc, *q.transfer.values()))
    else:
        pending_tokens = sum(r.input_tokens for r in (*q.intake, *q.waiting, *q.bootstrap.values()))
        awaiting_kv = 0
    in_use = current.used_tokens
    total_tokens = in_use + pending_tokens
    tps, util = eng.window.rates(now)
    moments = list(eng.decode_moments) if eng.decode_moments[0] > 0 else None
    kv_gb = eng.capacity * eng.profile.kv_bytes_per_token / 1e9
    return {
        "timestamp": eng.snapshot_unix_s(),
        "dp_rank": 0,
        "num_running_reqs": current.running_reqs,
        "num_waiting_reqs": current.waiting_reqs,
        "num_waiting_uncached_tokens": current.uncached_tokens,
        "num_used_tokens": in_use,
        "num_total_tokens": total_tokens,
        "num_active_tokens": max(0, total_tokens - awaiting_kv),
        "num_prealloc_ready_tokens": 0,
        "max_total_num_tokens": eng.capacity,
        "max_running_requests": eng.max_running,
        "token_usage": round(in_use / eng.capacity, 4),
        "gen_throughput": round(tps, 2),
        "cache_hit_rate": cache_hit_rate(eng),
        "utilization": round(util, 4),
        "total_prefill_uncached_tokens": eng.total_prefill_tokens,
        "total_prefill_busy_us": eng.total_prefill_busy_us,
        "decode_moments": moments,
        "memory": {"weight_gb": 0.0, "kv_cache_gb": round(kv_gb, 3), "graph_gb": 0.0,
                   "token_capacity": eng.capacity},
        "disaggregation": {
            "mode": eng.mode,
            "prefill_bootstrap_queue_reqs": current.bootstrap_reqs,
            "prefill_inflight_queue_reqs": current.inflight_reqs,
            "decode_prealloc_queue_reqs": current.prealloc_reqs,
            "decode_transfer_queue_reqs": current.transfer_reqs,
            "decode_retracted_queue_reqs": current.retracted_reqs,
            "kv_transfer_speed_gb_s": round(eng.last_kv_transfer_gb_s, 3),
            "kv_transfer_latency_ms": round(eng.last_kv_transfer_ms, 3),
        },
        "queues": {"waiting": num_queue_reqs(eng), "grammar": 0, "paused": 0,
                   "retracted": current.retracted_reqs, "prealloc_ready": 0},
        # Poise extensions (not in SGLang): recent prompts prefilled alone, [seq, tokens, seconds]; and the
        # context tokens of the running batch (Arrow's decode load, which KV in use overstates).
        "poise_prefill_samples": [list(sample) for sample in eng.prefill_samples],
        "poise_running_tokens": current.running_tokens,
    }


def cache_hit_rate(eng: EngineState) -> float:
    """The prefix cache's hit rate since the engine took its role (0 without a cache)."""
    cache = eng.core.cache
    return cache.hit_rate if cache is not None else 0.0


def gauges(eng: EngineState) -> dict[str, float]:
    """Values for the scheduler-side gauges, refreshed at each /metrics scrape."""
    current = load(eng)
    tps, util = eng.window.rates(clock.monotonic())
    in_use = current.used_tokens
    return {
        "num_running_reqs": current.running_reqs,
        "num_queue_reqs": num_queue_reqs(eng),
        "num_grammar_queue_reqs": 0,
        "gen_throughput": tps,
        "cache_hit_rate": cache_hit_rate(eng),
        "token_usage": in_use / eng.capacity,
        "num_used_tokens": in_use,
        "kv_used_tokens": in_use,
        "kv_available_tokens": eng.capacity - in_use,
        "max_total_num_tokens": eng.capacity,
        "utilization": util,
        "num_retracted_reqs": current.retracted_reqs,
        "num_paused_reqs": 0,
        "num_prefill_bootstrap_queue_reqs": current.bootstrap_reqs,
        "num_prefill_inflight_queue_reqs": current.inflight_reqs,
        "num_decode_prealloc_queue_reqs": current.prealloc_reqs,
        "num_decode_transfer_queue_reqs": current.transfer_reqs,
    }


def model_info(eng: EngineState) -> dict[str, Any]:
    """GET /model_info (sglang/srt/entrypoints/http_server.py model_info)."""
    name = eng.settings.served_model_name
    llama = "llama" in eng.profile.model.lower()
    return {
        "model_path": name,
        "served_model_name": name,
        "tokenizer_path": name,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "load_format": "auto",
        "reasoning_parser": None,
        "tool_call_parser": None,
        "disaggregation_mode": eng.mode,
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": "llama" if llama else None,
        "architectures": ["LlamaForCausalLM"] if llama else None,
    }


def server_info(eng: EngineState) -> dict[str, Any]:
    """GET /server_info: SGLang's resolved server args (the fields Poise reads) plus what this engine is."""
    s = eng.settings
    p = eng.profile
    tps, _ = eng.window.rates(clock.monotonic())
    return {
        "engine": ENGINE_NAME,
        "emulated_model": p.model,
        "gpu_profile": {"name": p.name, "model": p.model, "gpu": p.gpu, "tp": p.tp, "source": s.profile,
                        "time_scale": s.time_scale},
        "instance_id": s.instance_id,
        "model_path": s.served_model_name,
        "served_model_name": s.served_model_name,
        "tokenizer_path": s.served_model_name,
        "host": s.host,
        "port": s.port,
        "context_length": s.context_length,
        # The top level is the startup configuration: SGLang does not update it on a role switch (runtime
        # overrides show in internal_states only: sglang/srt/runtime_context.py resolved_server_args_dict).
        "disaggregation_mode": s.mode,
        "disaggregation_bootstrap_port": s.resolved_bootstrap_port(),
        "disaggregation_transfer_backend": "poise-sim",
        "disaggregation_decode_allocation_policy": "early",
        "enable_pd_role_switch": s.enable_pd_role_switch,
        "enable_metrics": True,
        "schedule_policy": "fcfs",
        "max_running_requests": eng.max_running,
        "max_total_num_tokens": eng.capacity,
        "chunked_prefill_size": eng.chunk_size if eng.chunked else -1,
        "max_prefill_tokens": MAX_PREFILL_TOKENS,
        "num_reserved_decode_tokens": s.num_reserved_decode_tokens,
        "tp_size": p.tp,
        "dp_size": 1,
        "pp_size": 1,
        "random_seed": s.seed,
        "enable_deterministic_inference": True,  # a request's seed decides its answer (tokens.py)
        "time_scale": s.time_scale,
        "mean_output_tokens": s.mean_output_tokens,
        "bootstrap_timeout_s": s.bootstrap_timeout_s,
        # Poise extensions: the engine's scheduling policies (shared/policies) and its preemption granularity.
        "prefill_policy": s.prefill_policy,
        "decode_policy": s.decode_policy,
        "preemption": s.preemption,
        "launch_command": " ".join(sys.argv),
        # SGLang's start-up phases in seconds (recorded from 0.5.23: load_weight, kv_cache_allocation, cuda_graph
        # per phase, scheduler_e2e, tokenizer_e2e); engine_sim loads nothing, so only the whole start counts
        "startup_time": {"load_weight": 0.0, "kv_cache_allocation": 0.0,
                         "cuda_graph": dict.fromkeys(("decode", "draft_decode", "draft_extend", "draft_prefill",
                                                      "prefill", "target_verify"), 0.0),
                         "scheduler_e2e": eng.startup_s, "tokenizer_e2e": eng.startup_s},
        "startup_time_iso": datetime.fromtimestamp(eng.startup_unix_s, UTC).isoformat(),
        "internal_states": [{
            "last_gen_throughput": round(tps, 2),
            "disaggregation_mode": eng.mode,
            "paused": eng.paused,
            "max_total_num_tokens": eng.capacity,
            "max_running_requests": eng.max_running,
            "effective_max_running_requests_per_dp": eng.max_running,  # SGLang's live limit (internal_state.py)
            "num_prefill_preemptions": eng.num_prefill_preemptions,
        }],
        "version": SGLANG_API_VERSION,
        "frontend": "python",
    }
