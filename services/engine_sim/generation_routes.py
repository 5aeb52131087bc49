"""engine_sim's generation routes: SGLang's /generate and the OpenAI /v1/completions and /v1/chat/completions.

Response timing follows SGLang: a non-streaming response is sent when the request finishes; the OpenAI
streaming routes wait for the first output before sending headers (SGLang "kick-starts" the generator so a
refused request still gets an HTTP error), then send one SSE event per wake-up (several tokens when the
reader falls behind, as SGLang coalesces). A request that fails inside the engine with a status (e.g. a
PD request without ``bootstrap_room``: 400; a failed KV handoff: 500) is an HTTP error when not streaming
and an error event (HTTP 200) when streaming, as in SGLang. A client that disconnects aborts its request.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator
from http import HTTPStatus
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from services.engine_sim import protocol as P
from services.engine_sim.answers import JSON, engine_of, json_response, openai_error, schema_error
from services.engine_sim.engine import EngineRequestError, SimEngine
from services.engine_sim.logprobs import chat_logprobs, completion_logprobs
from services.engine_sim.requests import SimRequest
from services.engine_sim.stops import TextCut, visible_text
from services.engine_sim.tokens import detokenize

router = APIRouter()
SSE = "text/event-stream"


def _engine_failure(req: SimRequest, openai: bool) -> Response | None:
    """A non-streaming request that ended in an abort carrying a status is an HTTP error (tokenizer_manager.
    _handle_abort_finish_reason): 400 is a ValueError, others an HTTPException."""
    status = req.status_code
    if status is None or not 400 <= status < 600:
        return None
    message = (req.finish or {}).get("message", "Aborted")
    if status == 400:
        if openai:
            return openai_error(message)
        return json_response({"error": {"message": message}}, 400)  # http_server._create_error_response
    return openai_error(message, str(status), status)


def submit(engine: SimEngine, gen: P.GenRequest) -> SimRequest:
    return engine.submit(
        prompt_tokens=gen.prompt_tokens, max_new_tokens=gen.max_new_tokens, rid=gen.rid,
        ignore_eos=gen.ignore_eos, stream=gen.stream, bootstrap_host=gen.bootstrap_host,
        bootstrap_port=gen.bootstrap_port, bootstrap_room=gen.bootstrap_room, priority=gen.priority,
        slo=gen.slo, stream_key=gen.stream_key, resume=gen.resume, predict_length=gen.predict_length,
        local_prefill=gen.local_prefill, prefix_blocks=gen.prefix_blocks, seed=gen.seed, stops=gen.stops,
    )


async def finish_non_stream(engine: SimEngine, req: SimRequest, request: Request) -> None:
    await engine.wait_for(req, request.is_disconnected, first_output=False)


def abort_if_running(engine: SimEngine, req: SimRequest) -> None:
    if not req.finished:  # the client went away mid-stream (or the stream broke): abort like SGLang
        engine.abort(req.rid)


@router.api_route("/generate", methods=["POST", "PUT"])
async def generate(request: Request) -> Response:
    engine = engine_of(request)
    try:
        gen = P.parse_generate(P.load_json(await request.body()))
    except P.SchemaError as exc:
        return schema_error(exc)
    except P.RequestRefused as exc:
        return json_response({"error": {"message": str(exc)}}, 400)
    try:
        req = submit(engine, gen)
    except EngineRequestError as exc:
        return json_response({"error": {"message": str(exc)}}, exc.status)
    if not gen.stream:
        await finish_non_stream(engine, req, request)
        failure = _engine_failure(req, openai=False)
        if failure is not None:
            return failure
        return json_response(P.generate_output(req, visible_text(detokenize(req.output_ids), req.stop_match),
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
            abort_if_running(engine, req)

    return StreamingResponse(events(), media_type=SSE)


async def openai_generation(request: Request, kind: P.Kind) -> Response:
    engine = engine_of(request)
    if request.headers.get("content-type", "").split(";", 1)[0].strip().lower() != JSON:
        # validate_json_request (http_server.py)
        return openai_error("Unsupported Media Type: Only 'application/json' is allowed",
                             HTTPStatus.BAD_REQUEST.phrase, 400)
    try:
        body = P.load_json(await request.body())
        gen = P.parse_completion(body) if kind == "completion" else P.parse_chat(body)
    except P.SchemaError as exc:
        return schema_error(exc)
    except P.RequestRefused as exc:
        return openai_error(str(exc))
    try:
        req = submit(engine, gen)
    except EngineRequestError as exc:
        return openai_error(str(exc), "BadRequestError" if exc.status == 400 else HTTPStatus(exc.status).phrase,
                             exc.status)
    if not gen.stream:
        await finish_non_stream(engine, req, request)
        failure = _engine_failure(req, openai=True)
        if failure is not None:
            return failure
        text = visible_text(detokenize(req.output_ids), req.stop_match)
        build = P.completion_response if kind == "completion" else P.chat_response
        return json_response(build(req, gen.model, text, cached(engine, req), gen.logprobs))
    stream = completion_events(engine, req, gen) if kind == "completion" else chat_events(engine, req, gen)
    try:
        await engine.wait_for(req, request.is_disconnected, first_output=True)
        first = await anext(stream)  # kick-start: headers go out with the first output
    except BaseException:
        abort_if_running(engine, req)
        raise

    async def prepend() -> AsyncIterator[bytes]:
        try:
            yield first
            async for chunk in stream:
                yield chunk
        finally:
            await stream.aclose()
            abort_if_running(engine, req)

    return StreamingResponse(prepend(), media_type=SSE)


def cached(engine: SimEngine, req: SimRequest) -> int | None:
    """The request's cached prompt tokens for its usage, with --enable-cache-report (SGLang's)."""
    return req.cached_tokens if engine.settings.enable_cache_report else None


async def completion_events(engine: SimEngine, req: SimRequest, gen: P.GenRequest) -> AsyncGenerator[bytes, None]:
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
                                       cached(engine, req))
    yield P.DONE


async def chat_events(engine: SimEngine, req: SimRequest, gen: P.GenRequest) -> AsyncGenerator[bytes, None]:
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
        yield P.chat_usage_chunk(req.rid, created, gen.model, req.prompt_tokens, len(req.output_ids), cached(engine, req))
    yield P.DONE


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await openai_generation(request, "completion")


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await openai_generation(request, "chat")
