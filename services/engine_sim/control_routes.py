"""engine_sim's control routes: /abort_request, /pd_role_switch, /pause_generation, /continue_generation,
/flush_cache as SGLang answers them, and Poise's own: the decode-to-decode KV export and the planner's ISL
forecast."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from services.engine_sim import protocol as P
from services.engine_sim.answers import engine_of, json_response, openai_error
from services.engine_sim.engine import SimEngine
from services.engine_sim.transfer import KV_EXPORT_PATH
from shared.protocol.engine_forecast import FORECAST_PATH

router = APIRouter()


async def optional_body(request: Request) -> dict[str, Any]:
    """The body as an object ({} when empty); a malformed one raises P.SchemaError, answered with SGLang's 400
    by the app's handler (app.py)."""
    raw = await request.body()
    return P.load_json(raw) if raw.strip() else {}


@router.post("/abort_request")
async def abort_request(request: Request) -> Response:
    """AbortReq {rid, abort_all}: 200 with an empty body, even for an unknown rid (as SGLang)."""
    engine = engine_of(request)
    body = await optional_body(request)
    rid = P._str(body, "rid") or ""
    abort_all = P._bool(body, "abort_all")
    if abort_all or rid:  # an empty rid without abort_all is ignored (tokenizer_manager.abort_request)
        engine.abort(rid, abort_all=abort_all)
    return Response(status_code=200)


@router.post(KV_EXPORT_PATH)
async def kv_export(request: Request) -> Response:
    """engine_sim's side of a decode→decode KV copy (poise_resume with a KV source; transfer.pull_migrated):
    200 with the request's context while it is decoding here, 404 otherwise (finished, aborted, unknown)."""
    engine = engine_of(request)
    rid = P._str(await optional_body(request), "rid") or ""
    req = engine.running_request(rid)
    if req is None:
        return openai_error(f"no decoding request {rid!r} here", "NotFoundError", 404)
    return json_response({"rid": rid, "context_tokens": req.context_tokens, "generated": req.generated,
                          "kv_bytes": engine.latency.kv_bytes(req.context_tokens)})


def forecast_state(engine: SimEngine) -> dict[str, Any]:
    policy = engine.prefill_policy
    # long_threshold: what the policy batches by now (the forecast, else its running mean), so a caller can
    # see the forecast take effect and, once withdrawn, stop.
    return {"isl": getattr(policy, "forecast_isl", None), "policy": policy.name,
            "applies": hasattr(policy, "set_forecast_isl"),
            "long_threshold": getattr(policy, "long_threshold", None)}


@router.get(FORECAST_PATH)
async def get_forecast(request: Request) -> Response:
    engine = engine_of(request)
    return json_response(forecast_state(engine))


@router.post(FORECAST_PATH)
async def set_forecast(request: Request) -> Response:
    """The planner's ISL forecast for DOPD's length-aware batching (shared/protocol/engine_forecast.py)."""
    engine = engine_of(request)
    body = await optional_body(request)
    isl = body.get("isl")
    if isl is not None and (isinstance(isl, bool) or not isinstance(isl, int | float) or not isl > 0):
        return openai_error(f"isl: Input should be a positive number or null, got {isl!r}",
                             HTTPStatus.BAD_REQUEST.phrase, 400, "isl")
    setter = getattr(engine.prefill_policy, "set_forecast_isl", None)
    if setter is not None:
        setter(None if isl is None else float(isl))
    return json_response(forecast_state(engine))


@router.post("/pd_role_switch")
async def pd_role_switch(request: Request) -> Response:
    """PdRoleSwitchReqInput -> PdRoleSwitchReqOutput; 200 on success, 400 otherwise."""
    engine = engine_of(request)
    body = await optional_body(request)
    new_role = P._str(body, "new_role")
    prepare_only = P._bool(body, "prepare_only")
    P._number(body, "decode_cuda_graph_memory_gb")
    graph_memory = body.get("decode_cuda_graph_memory_gb")
    if new_role not in (None, "prefill", "decode", ""):  # PdRoleSwitchReqInput.new_role is a Literal
        raise P.SchemaError(f"new_role: Input should be 'prefill', 'decode' or '', got {new_role!r}",
                            "new_role")
    result = await engine.pd_role_switch(new_role, prepare_only,
                                         None if graph_memory is None else float(graph_memory))
    # msgspec_to_builtins(PdRoleSwitchReqOutput) also dumps BaseReq's rid and http_worker_ipc (both None).
    return json_response({"rid": None, "http_worker_ipc": None, **result.to_dict()}, 200 if result.success else 400)


@router.post("/pause_generation")
async def pause_generation(request: Request) -> Response:
    engine = engine_of(request)
    body = await optional_body(request)
    mode = body.get("mode", "abort")
    if mode not in ("abort", "retract", "in_place"):
        return openai_error(f"mode: Input should be 'abort', 'retract' or 'in_place', got {mode!r}",
                             HTTPStatus.BAD_REQUEST.phrase, 400, "mode")
    engine.pause(mode)
    return json_response({"message": "Generation paused successfully.", "status": "ok"})


@router.post("/continue_generation")
async def continue_generation(request: Request) -> Response:
    engine = engine_of(request)
    engine.resume()
    return json_response({"message": "Generation continued successfully.", "status": "ok"})


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request) -> Response:
    """?timeout= seconds to wait for the engine to drain (SGLang's flush_cache query parameter, ``ge=0``).
    Plain-text answers without a content type, as SGLang's ``Response(content=...)``."""
    engine = engine_of(request)
    try:
        wait_s = float(request.query_params.get("timeout", "0"))
        if not wait_s >= 0.0:
            raise ValueError(wait_s)
    except ValueError:
        return openai_error("timeout: Input should be a number greater than or equal to 0",
                             HTTPStatus.BAD_REQUEST.phrase, 400)
    if await engine.flush_cache(wait_s):
        return Response(
            "Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting "
            "requests, the operation will not be performed.)\n")
    # SchedulerFlushWrapper: an immediate refusal has no message; a deferred flush that timed out says so.
    return Response("Timed out waiting for idle state." if wait_s > 0 else "Flush cache failed.\n", status_code=400)
