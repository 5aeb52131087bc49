"""Poise's side of the contract: what a real SGLang 0.5.23 server sends (bodies built to the fixtures' shapes and
checked against them) is read correctly by Poise: /v1/loads over DP ranks into the sidecar's LoadReport,
/server_info's live role after a switch, /pd_role_switch answers and refusals, and stream error events."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from services.gateway.legs import _error_message
from services.worker.instance_record import live_mode
from shared.engine_client import EngineClient, parse_loads, parse_server_info
from shared.errors import EngineError
from shared.load_view import load_report
from shared.runtime import EmbeddedHttpServer
from tests.contract.shapes import assert_shape, fixture


def _rank(dp_rank: int, running: int, waiting: int, used: int, mode: str = "decode") -> dict[str, Any]:
    return {"timestamp": 1795333594.5, "dp_rank": dp_rank, "num_running_reqs": running, "num_waiting_reqs": waiting,
            "num_waiting_uncached_tokens": 10 * waiting, "num_used_tokens": used, "num_total_tokens": used + 50,
            "num_active_tokens": used, "num_prealloc_ready_tokens": 0, "max_total_num_tokens": 100_000,
            "max_running_requests": 128, "token_usage": round(used / 100_000, 4), "gen_throughput": 1500.25,
            "cache_hit_rate": 0.5, "utilization": 0.9, "total_prefill_uncached_tokens": 123456,
            "total_prefill_busy_us": 9_000_000, "decode_moments": [10.0, 0.1, 0.002],
            "memory": {"weight_gb": 15.0, "kv_cache_gb": 40.0, "graph_gb": 1.5, "token_capacity": 100_000},
            "disaggregation": {"mode": mode, "prefill_bootstrap_queue_reqs": 0, "prefill_inflight_queue_reqs": 0,
                               "decode_prealloc_queue_reqs": 2, "decode_transfer_queue_reqs": 1,
                               "decode_retracted_queue_reqs": 0, "kv_transfer_speed_gb_s": 12.5,
                               "kv_transfer_latency_ms": 3.25},
            "queues": {"waiting": waiting, "grammar": 0, "paused": 0, "retracted": 0, "prealloc_ready": 0}}


LOADS = {"timestamp": "2026-11-22T07:30:00.000000+00:00", "version": "0.5.23", "accelerator": "NVIDIA H100 80GB HBM3",
         "num_accelerators": 2, "loads": [_rank(0, 30, 3, 40_000), _rank(1, 20, 1, 10_000)]}


def test_loads_over_dp_ranks_become_one_load_report() -> None:
    assert_shape(LOADS, {"ref": "Loads"}, "v1_loads")
    loads = parse_loads(LOADS)
    assert (loads.dp_ranks, loads.num_running_reqs, loads.num_waiting_reqs, loads.num_used_tokens,
            loads.max_total_num_tokens, loads.mode) == (2, 50, 4, 50_000, 200_000, "decode")
    assert loads.token_usage == pytest.approx(0.25) and loads.gen_throughput_tps == pytest.approx(3000.5)
    assert loads.decode_queue_reqs == 6 and not loads.idle
    report = load_report("d0", "decode", "ready", loads, 1795333594.5)
    assert (report.num_running_reqs, report.num_waiting_reqs, report.num_waiting_uncached_tokens,
            report.num_used_tokens, report.max_total_num_tokens, report.decode_queue_reqs, report.prefill_queue_reqs) \
        == (50, 4, 40, 50_000, 200_000, 6, 0)
    # SGLang has neither Poise extension: no prefill samples, no running-batch tokens.
    assert report.prefill_samples == [] and report.num_running_tokens is None


def _server_info(launch_mode: str, live_mode: str) -> dict[str, Any]:
    state = {"disaggregation_mode": live_mode, "last_gen_throughput": 0.0, "effective_max_running_requests_per_dp": 128,
             "world_size": 1, "startup_time": {"load_weight": 2.3, "scheduler_e2e": 12.3}, "memory_usage": {"graph": {}},
             "decode_cuda_graph_bs": [1, 2, 4], "decode_cuda_graph_memory_gb": 0.8, "max_running_requests": None}
    return {"model_path": "meta-llama/Llama-3.1-8B-Instruct", "served_model_name": "llama-8b",
            "disaggregation_mode": launch_mode, "disaggregation_bootstrap_port": 8998, "enable_pd_role_switch": True,
            "tp_size": 1, "max_running_requests": None, "launch_command": "sglang serve ...", "status": "ready",
            "max_total_num_tokens": 100_000, "max_req_input_len": 99_999, "startup_time": {"load_weight": 2.3, "scheduler_e2e": 12.3},
            "hicache_object_layout": {}, "kv_events": None, "internal_states": [state], "version": "0.5.23",
            "frontend": "python"}


def test_live_role_after_a_switch_comes_from_loads_and_internal_states() -> None:
    body = _server_info("prefill", "decode")  # launched as prefill, switched to decode since
    assert_shape(body, {"ref": "ServerInfo"}, "server_info")
    info = parse_server_info(body)
    assert info.max_total_num_tokens == 100_000 and info.served_model_name == "llama-8b"
    assert info.disaggregation_mode == "prefill"  # the startup value: stale after the switch
    assert live_mode(None, info) == "decode"  # internal_states follows the switch
    loads = parse_loads({**LOADS, "loads": [_rank(0, 0, 0, 0, mode="prefill")]})
    assert live_mode(loads, info) == "prefill"  # /v1/loads (the scheduler's own mode) wins


@pytest.mark.asyncio
async def test_role_switch_answers_and_refusals() -> None:
    ok = {"rid": None, "http_worker_ipc": None, "success": True, "message": "ok", "old_role": "prefill",
          "new_role": "decode", "safe_to_restore": False}
    busy = {**ok, "success": False, "message": "instance is not idle; drain all requests before switching",
            "safe_to_restore": True}
    invalid = {"object": "error", "message": "1 validation error: new_role ...", "type": "Bad Request", "param": None,
               "code": 400}
    assert_shape(ok, {"ref": "PdRoleSwitchReqOutput"}, "pd_role_switch")
    assert_shape(invalid, {"ref": "#errors.json/ErrorResponse"}, "pd_role_switch")
    answers = iter([(200, ok), (400, busy), (400, invalid)])

    async def pd_role_switch(_: Request) -> Response:
        status, body = next(answers)
        return JSONResponse(body, status_code=status)

    server = EmbeddedHttpServer(Starlette(routes=[Route("/pd_role_switch", pd_role_switch, methods=["POST"])]),
                                "127.0.0.1", 0, name="sglang-answers")
    await server.start()
    try:
        async with httpx.AsyncClient(trust_env=False) as http:
            client = EngineClient(f"http://127.0.0.1:{server.port}", http, engine_id="p0")
            assert (await client.pd_role_switch("decode"))["old_role"] == "prefill"
            with pytest.raises(EngineError, match="instance is not idle"):
                await client.pd_role_switch("decode")
            with pytest.raises(EngineError, match="1 validation error"):
                await client.pd_role_switch("decode")
    finally:
        await server.stop()


def test_gateway_reads_sglang_stream_errors() -> None:
    spec = fixture("errors")
    event = {"error": {"object": "error", "message": "Request aborted: KV transfer failed", "type": "INTERNAL_SERVER_ERROR",
                       "param": None, "code": 500}}
    assert_shape(event, {"ref": "StreamError"}, "errors")
    assert _error_message(json.dumps(event).encode()) == "Request aborted: KV transfer failed"
    native = {"error": {"message": "Either text, input_ids or input_embeds should be provided."}}
    assert_shape(native, {"ref": "NativeError"}, "errors")
    assert _error_message(json.dumps(native).encode()).startswith("Either text")
    assert spec["cases"]["OpenAI streaming request the scheduler aborts with a status"]["status"] == 200
