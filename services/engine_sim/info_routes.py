"""engine_sim's health and information routes: /health, /ready, /server_info, /model_info, /v1/models,
/v1/loads (SGLang's load snapshot, JSON or Prometheus) and /metrics."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from services.engine_sim import protocol as P
from services.engine_sim.answers import engine_of, json_response, openai_error
from services.engine_sim.engine import SGLANG_API_VERSION

router = APIRouter()
LOAD_SECTIONS = {"core", "memory", "spec", "lora", "disagg", "queues", "all"}  # LoadSnapshot.VALID_SECTIONS
_SECTION_OF = {"memory": "memory", "disaggregation": "disagg", "queues": "queues"}


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


@router.get("/health")
@router.get("/health_generate")
async def health(request: Request) -> Response:
    engine = engine_of(request)
    ok = await engine.health_check(engine.settings.health_check_timeout_s)
    return Response(status_code=200 if ok else 503)


@router.get("/ready")
async def ready(request: Request) -> Response:
    engine = engine_of(request)
    return Response(status_code=200 if engine.healthy else 503)


@router.get("/server_info")
@router.get("/get_server_info")
async def server_info(request: Request) -> Response:
    engine = engine_of(request)
    return json_response(engine.server_info())


@router.get("/model_info")
@router.get("/get_model_info")
async def model_info(request: Request) -> Response:
    engine = engine_of(request)
    return json_response(engine.model_info())


@router.get("/v1/models")
async def models(request: Request) -> Response:
    engine = engine_of(request)
    card = P.model_card(engine.settings.served_model_name, engine.settings.context_length)
    return json_response({"object": "list", "data": [card]})


@router.get("/v1/models/{model:path}")
async def model(request: Request, model: str) -> Response:
    engine = engine_of(request)
    if model != engine.settings.served_model_name:
        return json_response({"error": {"message": f"The model '{model}' does not exist", "type": "invalid_request_error",
                                "param": "model", "code": "model_not_found"}}, 404)
    return json_response(P.model_card(model, engine.settings.context_length))


@router.get("/v1/loads")
async def loads(request: Request, dp_rank: int | None = None, include: str | None = None, format: str | None = None) -> Response:
    """v1_loads.get_loads: ``{timestamp, version, accelerator, num_accelerators, loads: [per DP rank]}``."""
    engine = engine_of(request)
    include_set = {s.strip() for s in include.split(",")} if include else None
    if include_set is not None and not include_set <= LOAD_SECTIONS:
        return openai_error(
            f"Invalid include sections: {include_set - LOAD_SECTIONS}. Valid options: {sorted(LOAD_SECTIONS)}",
            "400", 400)
    snapshot = engine.load_snapshot()
    per_rank = [] if dp_rank not in (None, 0) else [_load_dict(snapshot, include_set)]
    if format == "prometheus":
        return _loads_prometheus(per_rank)
    return json_response({
        "timestamp": datetime.now(UTC).isoformat(),
        "version": SGLANG_API_VERSION,
        "accelerator": engine.profile.gpu,
        "num_accelerators": engine.profile.tp,
        "loads": per_rank,
    })


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    engine = engine_of(request)
    return Response(engine.metrics.render(engine.gauges()), media_type=CONTENT_TYPE_LATEST)
