"""What engine_sim answers beyond, or short of, SGLang 0.5.23's shapes: every entry is deliberate and documented
(services/engine_sim/README.md, "HTTP API" and "Differences from SGLang"). The contract tests allow exactly
these and nothing else; adding a field to engine_sim's answers means listing it here."""

from __future__ import annotations

from shared.protocol.length_prediction import PREDICTION_FIELD

#: Poise extensions: keys engine_sim adds to an SGLang object (keyed by the fixture's object name).
EXTENSIONS: dict[str, set[str]] = {
    # What the engine is (it says it is a simulator) and its Poise scheduling settings.
    "ServerInfo": {"engine", "emulated_model", "gpu_profile", "instance_id", "time_scale", "mean_output_tokens",
                   "bootstrap_timeout_s", "prefill_policy", "decode_policy", "preemption", "startup_time_iso"},
    # Convenience copies of the capacity and pause state, and the FlowPrefill preemption counter.
    "InternalState": {"paused", "max_total_num_tokens", "num_prefill_preemptions"},
    # Arrow's inputs: recent prompts prefilled alone, and the running batch's context tokens.
    "LoadSnapshot": {"poise_prefill_samples", "poise_running_tokens"},
    # The remaining-length prediction, only when the request asked with poise_predict_length.
    "CompletionStreamResponse": {PREDICTION_FIELD},
    "StreamChunk": {PREDICTION_FIELD},
}

#: Keys SGLang always sends that engine_sim leaves out (nothing in Poise reads them).
OMISSIONS: dict[str, set[str]] = {
    "ServerInfo": {"status", "max_req_input_len", "hicache_object_layout", "kv_events"},
    "InternalState": {"world_size", "startup_time", "memory_usage", "decode_cuda_graph_bs",
                      "decode_cuda_graph_memory_gb"},
}

#: Prometheus families engine_sim exports that SGLang does not have (FlowPrefill's operator preemption, and the
#: time the stand-in fell behind its latency model on a busy host).
METRIC_EXTENSIONS = {"poise:prefill_preemptions", "poise:prefill_preemption_blocking_seconds",
                     "poise:engine_sim_behind_model_seconds"}

#: /v1/loads?format=prometheus gauges that come from the LoadSnapshot extensions above.
LOADS_PROMETHEUS_EXTENSIONS = {"sglang_poise_running_tokens"}

#: sglang: families engine_sim exports from its start on the decode side that SGLang 0.5.23's decode engine had not
#: exported after serving (recorded: fixtures/sglang-0.5.23-cpu/metrics_decode.json): SGLang creates the KV
#: transfer speed and latency on the prefill side, the failure and retraction counters at their first event;
#: nothing in Poise reads them.
METRIC_EAGER = {"sglang:kv_transfer_speed_gb_s", "sglang:kv_transfer_latency_ms", "sglang:num_bootstrap_failed_reqs_total",
                "sglang:num_transfer_failed_reqs_total", "sglang:num_retracted_requests_total"}
