"""engine_sim's HTTP API: the subset of SGLang 0.5.23's routes Poise uses (sglang/srt/entrypoints/http_server.py).

Response timing follows SGLang: a non-streaming response is sent when the request finishes; the OpenAI
streaming routes wait for the first output before sending headers (SGLang "kick-starts" the generator so a
refused request still gets an HTTP error), then send one SSE event per wake-up (several tokens when the
reader falls behind, as SGLang coalesces). A request that fails inside the engine with a status (e.g. a
PD request without ``bootstrap_room``: 400; a failed KV handoff: 500) is an HTTP error when not streaming
and an error event (HTTP 200) when streaming, as in SGLang. A client that disconnects aborts its request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from http import HTTPStatus
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.engine_sim import protocol as P
from services.engine_sim.auth import ApiKeyMiddleware
from services.engine_sim.engine import SGLANG_API_VERSION, EngineRequestError, SimEngine
from services.engine_sim.logprobs import chat_logprobs, completion_logprobs
from services.engine_sim.requests import SimRequest
from services.engine_sim.stops import TextCut, visible_text
from services.engine_sim.tokens import detokenize
from services.engine_sim.transfer import KV_EXPORT_PATH
from shared.protocol.engine_forecast import FORECAST_PATH

log = logging.getLogger(__name__)

JSON = "application/json"
SSE = "text/event-stream"
LOAD_SECTIONS = {"core", "memory", "spec", "lora", "disagg", "queues", "all"}  # LoadSnapshot.VALID_SECTIONS
_SECTION_OF = {"memory": "memory", "disaggregation": "disagg", "queues": "queues"}


def _json(body: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type=JSON)


def _openai_error(message: str, err_type: str = "BadRequestError", status: int = 400,
                  param: str | None = None) -> Response:
    return _json(P.error_body(message, err_type, status, param), status)


def _schema_error(exc: P.SchemaError) -> Response:
    # SGLang's RequestValidationError handler: 400 with type "Bad Request".
    return _openai_error(str(exc), HTTPStatus.BAD_REQUEST.phrase, 400, exc.param)


def _engine_failure(req: SimRequest, openai: bool) -> Response | None:
    """A non-streaming request that ended in an abort carrying a status is an HTTP error (tokenizer_manager.
    _handle_abort_finish_reason): 400 is a ValueError, others an HTTPException."""
    status = req.status_code
    if status is None or not 400 <= status < 600:
        return None
    message = (req.finish or {}).get("message", "Aborted")
    if status == 400:
        if openai:
            return _openai_error(message)
        return _json({"error": {"message": message}}, 400)  # http_server._create_error_response
    return _openai_error(message, str(status), status)


def _load_dict(snapshot: dict[str, Any], include: set[str] | None) -> dict[str, Any]:
    """LoadSnapshot.to_dict(include)."""
    sections = ("memory", "disaggregation", "queues")
    core = {k: v for k, v in snapshot.items() if k not in sections}
    if include is None or "all" in include:
        return {**core, **{s: snapshot[s] for s in sections}}
    if include == {"core"}:
        return core
    return {**core, **{s: snapshot[s] for s in sections if _SECTION_OF[s] in include}}


def _loads_prometheus(loads: list[dict[str, Any]]) -> Response:
    """v1_loads._format_loads_prometheus."""
    prefixes = {"speculative": "spec", "disaggregation": "disagg"}
    samples: dict[str, list[tuple[int, float]]] = {}
    for load in loads:
        load = dict(load)
        dp_rank = load.pop("dp_rank")
        for key, value in load.items():
            if isinstance(value, dict):
                prefix = prefixes.get(key, key)
                for sub, v in value.items():
                    if isinstance(v, int | float) and not isinstance(v, bool):
                        samples.setdefault(f"sglang_{prefix}_{sub}", []).append((dp_rank, v))
            elif isinstance(value, int | float) and not isinstance(value, bool):
                samples.setdefault(f"sglang_{key}", []).append((dp_rank, value))
    lines: list[str] = []
    for name, vals in samples.items():
        lines.append(f"# TYPE {name} gauge")
        lines.extend(f'{name}{{dp_rank="{r}"}} {v}' for r, v in vals)
    return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4; charset=utf-8")


def create_app(engine: SimEngine) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        try:
            yield
        finally:
            await engine.stop()

    app = FastAPI(title="poise engine_sim", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    if engine.settings.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=engine.settings.api_key)
    app.state.engine = engine

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> Response:
        # SGLang renders HTTPException as ErrorResponse with type = the status code.
        return _openai_error(str(exc.detail), str(exc.status_code), exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> Response:
        return _openai_error(str(exc), HTTPStatus.BAD_REQUEST.phrase, 400)

    # -- generation --------------------------------------------------------------------------------------
    def submit(gen: P.GenRequest) -> SimRequest:
        return engine.submit(
            prompt_tokens=gen.prompt_tokens, max_new_tokens=gen.max_new_tokens, rid=gen.rid,
            ignore_eos=gen.ignore_eos, stream=gen.stream, bootstrap_host=gen.bootstrap_host,
            bootstrap_port=gen.bootstrap_port, bootstrap_room=gen.bootstrap_room, priority=gen.priority,
            slo=gen.slo, stream_key=gen.stream_key, resume=gen.resume, predict_length=gen.predict_length,
            local_prefill=gen.local_prefill, prefix_blocks=gen.prefix_blocks, seed=gen.seed, stops=gen.stops,
        )

    async def finish_non_stream(req: SimRequest, request: Request) -> None:
        await engine.wait_for(req, request.is_disconnected, first_output=False)

    def abort_if_running(req: SimRequest) -> None:
        if not req.finished:  # the client went away mid-stream (or the stream broke): abort like SGLang
            engine.abort(req.rid)

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> Response:
        try:
            gen = P.parse_generate(P.load_json(await request.body()))
        except P.SchemaError as exc:
            return _schema_error(exc)
        except P.RequestRefused as exc:
            return _json({"error": {"message": str(exc)}}, 400)
        try:
            req = submit(gen)
        except EngineRequestError as exc:
            return _json({"error": {"message": str(exc)}}, exc.status)
        if not gen.stream:
            await finish_non_stream(req, request)
            failure = _engine_failure(req, openai=False)
            if failure is not None:
                return failure
            return _json(P.generate_output(req, visible_text(detokenize(req.output_ids), req.stop_match),
                                           len(req.output_ids), req.finish))

        async def events() -> AsyncIterator[bytes]:
            parts: list[str] = []
            cut = TextCut()
            try:
                async for new_ids, finish in engine.outputs(req):
                    parts.append(cut.piece(detokenize(new_ids), req.stop_match))
                    out = P.generate_output(req, "".join(parts), len(req.output_ids), finish)
                    yield b"data: " + orjson.dumps(out) + b"\n\n"
                yield P.DONE
            finally:
                abort_if_running(req)

        return StreamingResponse(events(), media_type=SSE)

    async def openai_generation(request: Request, kind: P.Kind) -> Response:
        if request.headers.get("content-type", "").split(";", 1)[0].strip().lower() != JSON:
            # validate_json_request (http_server.py)
            return _openai_error("Unsupported Media Type: Only 'application/json' is allowed",
                                 HTTPStatus.BAD_REQUEST.phrase, 400)
        try:
            body = P.load_json(await request.body())
            gen = P.parse_completion(body) if kind == "completion" else P.parse_chat(body)
        except P.SchemaError as exc:
            return _schema_error(exc)
        except P.RequestRefused as exc:
            return _openai_error(str(exc))
        try:
            req = submit(gen)
        except EngineRequestError as exc:
            return _openai_error(str(exc), "BadRequestError" if exc.status == 400 else HTTPStatus(exc.status).phrase,
                                 exc.status)
        if not gen.stream:
            await finish_non_stream(req, request)
            failure = _engine_failure(req, openai=True)
            if failure is not None:
                return failure
            text = visible_text(detokenize(req.output_ids), req.stop_match)
            build = P.completion_response if kind == "completion" else P.chat_response
            return _json(build(req, gen.model, text, cached(req), gen.logprobs))
        stream = completion_events(req, gen) if kind == "completion" else chat_events(req, gen)
        try:
            await engine.wait_for(req, request.is_disconnected, first_output=True)
            first = await anext(stream)  # kick-start: headers go out with the first output
        except BaseException:
            abort_if_running(req)
            raise

        async def prepend() -> AsyncIterator[bytes]:
            try:
                yield first
                async for chunk in stream:
                    yield chunk
            finally:
                await stream.aclose()
                abort_if_running(req)

        return StreamingResponse(prepend(), media_type=SSE)

    def cached(req: SimRequest) -> int | None:
        """The request's cached prompt tokens for its usage, with --enable-cache-report (SGLang's)."""
        return req.cached_tokens if engine.settings.enable_cache_report else None

    async def completion_events(req: SimRequest, gen: P.GenRequest) -> AsyncGenerator[bytes, None]:
        """OpenAIServingCompletion._generate_completion_stream."""
        created = int(time.time())
        cut, offset = TextCut(), 0
        async for new_ids, finish in engine.outputs(req):
            if finish is not None and finish.get("status_code") is not None:
                yield P.stream_error_chunk(finish["message"], int(finish["status_code"]))
                break
            chunk_usage = P.usage(req.prompt_tokens, len(req.output_ids)) if gen.continuous_usage else None
            text = cut.piece(detokenize(new_ids), req.stop_match)
            logprobs = None if gen.logprobs is None else completion_logprobs(new_ids, gen.logprobs, offset)
            offset += len(text)
            yield P.completion_chunk(req.rid, created, gen.model, text, finish, chunk_usage,
                                     engine.due_prediction(req), logprobs)
        if gen.include_usage:
            yield P.completion_usage_chunk(req.rid, created, gen.model, req.prompt_tokens, len(req.output_ids),
                                           cached(req))
        yield P.DONE

    async def chat_events(req: SimRequest, gen: P.GenRequest) -> AsyncGenerator[bytes, None]:
        """OpenAIServingChat._generate_chat_stream: a role chunk, content chunks, then a finish_reason chunk."""
        created = int(time.time())
        first = True
        final: dict[str, Any] | None = None
        cut = TextCut()
        async for new_ids, finish in engine.outputs(req):
            if finish is not None and finish.get("status_code") is not None:
                yield P.stream_error_chunk(finish["message"], int(finish["status_code"]))
                final = None
                break
            if first:
                first = False
                yield P.chat_chunk(req.rid, created, gen.model, role="assistant", content="")
            text = cut.piece(detokenize(new_ids), req.stop_match)
            if text:  # as SGLang, no chunk for an end-of-turn token alone (nor for its log-probability)
                chunk_usage = P.usage(req.prompt_tokens, len(req.output_ids)) if gen.continuous_usage else None
                logprobs = None if gen.logprobs is None else chat_logprobs(new_ids, gen.logprobs)
                yield P.chat_chunk(req.rid, created, gen.model, content=text, chunk_usage=chunk_usage,
                                   prediction=engine.due_prediction(req), logprobs=logprobs)
            final = finish
        if final is not None:
            yield P.chat_chunk(req.rid, created, gen.model, finish=final)
        if gen.include_usage:
            yield P.chat_usage_chunk(req.rid, created, gen.model, req.prompt_tokens, len(req.output_ids), cached(req))
        yield P.DONE

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await openai_generation(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await openai_generation(request, "chat")

    # -- health and info -----------------------------------------------------------------------------------
    @app.get("/health")
    @app.get("/health_generate")
    async def health() -> Response:
        ok = await engine.health_check(engine.settings.health_check_timeout_s)
        return Response(status_code=200 if ok else 503)

    @app.get("/ready")
    async def ready() -> Response:
        return Response(status_code=200 if engine.healthy else 503)

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> Response:
        return _json(engine.server_info())

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> Response:
        return _json(engine.model_info())

    @app.get("/v1/models")
    async def models() -> Response:
        card = P.model_card(engine.settings.served_model_name, engine.settings.context_length)
        return _json({"object": "list", "data": [card]})

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> Response:
        if model != engine.settings.served_model_name:
            return _json({"error": {"message": f"The model '{model}' does not exist", "type": "invalid_request_error",
                                    "param": "model", "code": "model_not_found"}}, 404)
        return _json(P.model_card(model, engine.settings.context_length))

    @app.get("/v1/loads")
    async def loads(dp_rank: int | None = None, include: str | None = None, format: str | None = None) -> Response:
        """v1_loads.get_loads: ``{timestamp, version, accelerator, num_accelerators, loads: [per DP rank]}``."""
        include_set = {s.strip() for s in include.split(",")} if include else None
        if include_set is not None and not include_set <= LOAD_SECTIONS:
            return _openai_error(
                f"Invalid include sections: {include_set - LOAD_SECTIONS}. Valid options: {sorted(LOAD_SECTIONS)}",
                "400", 400)
        snapshot = engine.load_snapshot()
        per_rank = [] if dp_rank not in (None, 0) else [_load_dict(snapshot, include_set)]
        if format == "prometheus":
            return _loads_prometheus(per_rank)
        return _json({
            "timestamp": datetime.now(UTC).isoformat(),
            "version": SGLANG_API_VERSION,
            "accelerator": engine.profile.gpu,
            "num_accelerators": engine.profile.tp,
            "loads": per_rank,
        })

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(engine.gauges()), media_type=CONTENT_TYPE_LATEST)

    # -- control -----------------------------------------------------------------------------------------
    async def optional_body(request: Request) -> dict[str, Any]:
        raw = await request.body()
        return P.load_json(raw) if raw.strip() else {}

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        """AbortReq {rid, abort_all}: 200 with an empty body, even for an unknown rid (as SGLang)."""
        try:
            body = await optional_body(request)
            rid = P._str(body, "rid") or ""
            abort_all = P._bool(body, "abort_all")
        except P.SchemaError as exc:
            return _schema_error(exc)
        if abort_all or rid:  # an empty rid without abort_all is ignored (tokenizer_manager.abort_request)
            engine.abort(rid, abort_all=abort_all)
        return Response(status_code=200)

    @app.post(KV_EXPORT_PATH)
    async def kv_export(request: Request) -> Response:
        """engine_sim's side of a decode→decode KV copy (poise_resume with a KV source; transfer.pull_migrated):
        200 with the request's context while it is decoding here, 404 otherwise (finished, aborted, unknown)."""
        try:
            rid = P._str(await optional_body(request), "rid") or ""
        except P.SchemaError as exc:
            return _schema_error(exc)
        req = engine.running_request(rid)
        if req is None:
            return _openai_error(f"no decoding request {rid!r} here", "NotFoundError", 404)
        return _json({"rid": rid, "context_tokens": req.context_tokens, "generated": req.generated,
                      "kv_bytes": engine.latency.kv_bytes(req.context_tokens)})

    def forecast_state() -> dict[str, Any]:
        policy = engine.prefill_policy
        # long_threshold: what the policy batches by now (the forecast, else its running mean), so a caller can
        # see the forecast take effect and, once withdrawn, stop.
        return {"isl": getattr(policy, "forecast_isl", None), "policy": policy.name,
                "applies": hasattr(policy, "set_forecast_isl"),
                "long_threshold": getattr(policy, "long_threshold", None)}

    @app.get(FORECAST_PATH)
    async def get_forecast() -> Response:
        return _json(forecast_state())

    @app.post(FORECAST_PATH)
    async def set_forecast(request: Request) -> Response:
        """The planner's ISL forecast for DOPD's length-aware batching (shared/protocol/engine_forecast.py)."""
        try:
            body = await optional_body(request)
        except P.SchemaError as exc:
            return _schema_error(exc)
        isl = body.get("isl")
        if isl is not None and (isinstance(isl, bool) or not isinstance(isl, int | float) or not isl > 0):
            return _openai_error(f"isl: Input should be a positive number or null, got {isl!r}",
                                 HTTPStatus.BAD_REQUEST.phrase, 400, "isl")
        setter = getattr(engine.prefill_policy, "set_forecast_isl", None)
        if setter is not None:
            setter(None if isl is None else float(isl))
        return _json(forecast_state())

    @app.post("/pd_role_switch")
    async def pd_role_switch(request: Request) -> Response:
        """PdRoleSwitchReqInput -> PdRoleSwitchReqOutput; 200 on success, 400 otherwise."""
        try:
            body = await optional_body(request)
            new_role = P._str(body, "new_role")
            prepare_only = P._bool(body, "prepare_only")
            P._number(body, "decode_cuda_graph_memory_gb")
            graph_memory = body.get("decode_cuda_graph_memory_gb")
            if new_role not in (None, "prefill", "decode", ""):  # PdRoleSwitchReqInput.new_role is a Literal
                raise P.SchemaError(f"new_role: Input should be 'prefill', 'decode' or '', got {new_role!r}",
                                    "new_role")
        except P.SchemaError as exc:
            return _schema_error(exc)
        result = await engine.pd_role_switch(new_role, prepare_only,
                                             None if graph_memory is None else float(graph_memory))
        # msgspec_to_builtins(PdRoleSwitchReqOutput) also dumps BaseReq's rid and http_worker_ipc (both None).
        return _json({"rid": None, "http_worker_ipc": None, **result.to_dict()}, 200 if result.success else 400)

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> Response:
        try:
            body = await optional_body(request)
        except P.SchemaError as exc:
            return _schema_error(exc)
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            return _openai_error(f"mode: Input should be 'abort', 'retract' or 'in_place', got {mode!r}",
                                 HTTPStatus.BAD_REQUEST.phrase, 400, "mode")
        engine.pause(mode)
        return _json({"message": "Generation paused successfully.", "status": "ok"})

    @app.post("/continue_generation")
    async def continue_generation() -> Response:
        engine.resume()
        return _json({"message": "Generation continued successfully.", "status": "ok"})

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(request: Request) -> Response:
        """?timeout= seconds to wait for the engine to drain (SGLang's flush_cache query parameter, ``ge=0``).
        Plain-text answers without a content type, as SGLang's ``Response(content=...)``."""
        try:
            wait_s = float(request.query_params.get("timeout", "0"))
            if not wait_s >= 0.0:
                raise ValueError(wait_s)
        except ValueError:
            return _openai_error("timeout: Input should be a number greater than or equal to 0",
                                 HTTPStatus.BAD_REQUEST.phrase, 400)
        if await engine.flush_cache(wait_s):
            return Response(
                "Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting "
                "requests, the operation will not be performed.)\n")
        # SchedulerFlushWrapper: an immediate refusal has no message; a deferred flush that timed out says so.
        return Response("Timed out waiting for idle state." if wait_s > 0 else "Flush cache failed.\n", status_code=400)

    return app
