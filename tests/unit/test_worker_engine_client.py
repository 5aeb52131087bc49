"""The SGLang control-endpoint client against httpx.MockTransport (SGLang's response shapes)."""

from __future__ import annotations

import json

import httpx
import pytest

from shared.engine_client import EngineClient, parse_loads, parse_server_info
from shared.errors import EngineError, EngineTimeout
from shared.load_view import load_report


def _rank(dp_rank: int, running: int, waiting: int, used: int, cap: int, **disagg: int) -> dict[str, object]:
    rank: dict[str, object] = {
        "timestamp": 1.0, "dp_rank": dp_rank, "num_running_reqs": running, "num_waiting_reqs": waiting,
        "num_waiting_uncached_tokens": waiting * 10, "num_used_tokens": used, "num_total_tokens": used,
        "num_active_tokens": used, "num_prealloc_ready_tokens": 0, "max_total_num_tokens": cap,
        "max_running_requests": 64, "token_usage": used / cap, "gen_throughput": 100.0, "cache_hit_rate": 0.0,
        "utilization": 0.5, "total_prefill_uncached_tokens": 0, "total_prefill_busy_us": 0, "decode_moments": None,
    }
    if disagg:
        rank["disaggregation"] = {"mode": "decode", "prefill_bootstrap_queue_reqs": 0, "prefill_inflight_queue_reqs": 0,
                                  "decode_prealloc_queue_reqs": 0, "decode_transfer_queue_reqs": 0,
                                  "decode_retracted_queue_reqs": 0, "kv_transfer_speed_gb_s": 0.0,
                                  "kv_transfer_latency_ms": 0.0, **disagg}
    return rank


def _envelope(*ranks: dict[str, object]) -> dict[str, object]:
    return {"timestamp": "2026-01-01T00:00:00+00:00", "version": "0.5.23", "accelerator": None,
            "num_accelerators": 1, "loads": list(ranks)}


def test_parse_loads_sums_dp_ranks() -> None:
    loads = parse_loads(_envelope(_rank(0, 3, 1, 100, 1000, decode_prealloc_queue_reqs=2),
                                  _rank(1, 5, 0, 300, 1000, decode_transfer_queue_reqs=1, decode_retracted_queue_reqs=1)))
    assert loads.dp_ranks == 2
    assert (loads.num_running_reqs, loads.num_waiting_reqs, loads.num_used_tokens, loads.max_total_num_tokens) == (8, 1, 400, 2000)
    assert loads.max_running_requests == 128 and loads.gen_throughput_tps == 200.0
    assert loads.token_usage == pytest.approx(0.2)
    assert loads.mode == "decode" and loads.decode_queue_reqs == 4 and loads.prefill_queue_reqs == 0
    assert not loads.idle
    # What the sidecar reports as waiting for KV (early rejection's queue): prealloc and retracted, not transfer.
    report = load_report("d0", "decode", "ready", loads, 0.0)
    assert (report.decode_queue_reqs, report.decode_kv_waiting_reqs) == (4, 3)


def test_parse_loads_idle_and_without_disagg_section() -> None:
    loads = parse_loads(_envelope(_rank(0, 0, 0, 0, 1000)))
    assert loads.idle and loads.mode is None
    assert parse_loads(_envelope()).dp_ranks == 0
    assert not parse_loads(_envelope(_rank(0, 0, 0, 0, 1000, prefill_inflight_queue_reqs=1))).idle
    with pytest.raises(ValueError):
        parse_loads([1, 2])


def test_parse_server_info() -> None:
    info = parse_server_info({"served_model_name": "m", "disaggregation_mode": "prefill",
                              "disaggregation_bootstrap_port": 8998, "max_running_requests": None,
                              "internal_states": [{"max_total_num_tokens": 500, "max_running_requests": 32},
                                                  {"max_total_num_tokens": 700}]})
    assert (info.served_model_name, info.disaggregation_mode, info.disaggregation_bootstrap_port) == ("m", "prefill", 8998)
    assert info.max_total_num_tokens == 1200 and info.max_running_requests == 32
    bare = parse_server_info({})
    assert bare.max_total_num_tokens is None and bare.disaggregation_mode is None


def _client(handler: object) -> EngineClient:
    http = httpx.AsyncClient(transport=httpx.MockTransport(handler))  # type: ignore[arg-type]
    return EngineClient("http://engine:1/", http, engine_id="e0")


@pytest.mark.asyncio
async def test_role_switch_ok_and_refused() -> None:
    busy = True

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/pd_role_switch"
        body = json.loads(request.content)
        if busy:
            return httpx.Response(400, json={"success": False, "message": "drain all requests before switching",
                                             "old_role": "prefill", "new_role": body["new_role"], "safe_to_restore": True})
        return httpx.Response(200, json={"success": True, "message": "switched", "old_role": "prefill",
                                         "new_role": body["new_role"], "safe_to_restore": True})

    client = _client(handler)
    with pytest.raises(EngineError, match="drain all requests") as err:
        await client.pd_role_switch("decode")
    assert err.value.status == 400 and err.value.engine_id == "e0"
    busy = False
    result = await client.pd_role_switch("decode")
    assert result["success"] and result["new_role"] == "decode"


@pytest.mark.asyncio
async def test_errors_are_mapped() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            raise httpx.ConnectError("refused", request=request)
        if request.url.path == "/v1/loads":
            raise httpx.ReadTimeout("slow", request=request)
        if request.url.path == "/server_info":
            return httpx.Response(500, json={"error": {"message": "scheduler died"}})
        return httpx.Response(200)

    client = _client(handler)
    with pytest.raises(EngineError, match="ConnectError"):
        await client.health()
    with pytest.raises(EngineTimeout):
        await client.loads()
    with pytest.raises(EngineError, match="scheduler died"):
        await client.server_info()
    await client.abort("r1")
    with pytest.raises(ValueError):
        await client.abort()


@pytest.mark.asyncio
async def test_health_loads_and_abort_requests() -> None:
    seen: list[tuple[str, str]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.method, str(request.url)))
        if request.url.path == "/health":
            return httpx.Response(503)
        if request.url.path == "/v1/loads":
            return httpx.Response(200, json=_envelope(_rank(0, 1, 2, 10, 100)))
        if request.url.path == "/abort_request":
            assert json.loads(request.content) == {"rid": "", "abort_all": True}
            return httpx.Response(200)
        return httpx.Response(404)

    client = _client(handler)
    assert await client.health() is False
    loads = await client.loads()
    assert loads.num_running_reqs == 1 and loads.num_waiting_reqs == 2
    await client.abort(abort_all=True)
    assert seen[1] == ("GET", "http://engine:1/v1/loads?include=core%2Cdisagg")


@pytest.mark.asyncio
async def test_a_switch_to_decode_carries_the_cuda_graph_memory_budget_when_given() -> None:
    """SGLang 0.5.23 refuses a switch to decode without ``decode_cuda_graph_memory_gb`` on an engine launched as
    prefill; the field goes only with a switch to decode, and only when set."""
    bodies: list[dict[str, object]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        bodies.append(body)
        return httpx.Response(200, json={"success": True, "message": "", "old_role": "x", "new_role": body["new_role"],
                                         "safe_to_restore": True})

    client = _client(handler)
    await client.pd_role_switch("decode", decode_cuda_graph_memory_gb=0.0)
    await client.pd_role_switch("prefill", decode_cuda_graph_memory_gb=0.0)
    await client.pd_role_switch("decode")
    assert bodies == [{"new_role": "decode", "decode_cuda_graph_memory_gb": 0.0}, {"new_role": "prefill"},
                      {"new_role": "decode"}]
