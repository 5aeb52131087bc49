"""The engine to profile: what its ``/server_info`` says, checked before anything is measured.

Only a colocated engine (SGLang ``--disaggregation-mode null``) can be profiled alone: a PD prefill engine does
not start a prefill until a decode peer claims the request's bootstrap room, and a decode engine cannot start
without a prefill peer. Launch a colocated engine with the same model, GPU and TP to profile both roles (they
run the same forward passes; the P→D transfer is not measured here).

The time scale: ``engine_sim`` multiplies every modelled duration by ``--time-scale`` and reports it in
``/server_info``; measured times are divided by it, so the profile describes the emulated GPU. A real engine
has no such thing: its scale is 1.
"""

from __future__ import annotations

from typing import Any

import httpx
import msgspec

from shared.engine_client import engine_auth_headers, parse_server_info
from shared.errors import PoiseError

ENGINE_SIM = "poise-engine-sim"  # /server_info "engine" of services/engine_sim


class EngineTarget(msgspec.Struct, frozen=True, kw_only=True):
    url: str
    server_info: dict[str, Any]
    is_engine_sim: bool
    time_scale: float  # measured wall seconds / this = engine seconds
    time_scale_source: str  # where time_scale came from
    chunked_prefill_size: int | None  # tokens per prefill pass; None: no chunking
    context_length: int | None  # longest prompt + output the engine accepts (None: not reported)
    kv_capacity_tokens: int
    max_running_requests: int
    tp: int | None
    model: str | None  # served model name / path
    gpu_profile: dict[str, Any] | None  # engine_sim's emulated profile (name, source, gpu, ...)


def _positive_int(value: Any) -> int | None:
    if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
        return int(value)
    return None


def describe_target(url: str, info: Any, *, time_scale_hint: float | None = None,
                    context_length: int | None = None) -> EngineTarget:
    """Check ``/server_info``'s answer and read what profiling needs from it (pure; raises PoiseError).

    ``context_length``: from ``/v1/models`` when ``/server_info`` has none (SGLang derives it from the model).
    """
    if not isinstance(info, dict) or "disaggregation_mode" not in info and "internal_states" not in info:
        raise PoiseError(f"{url} does not look like an SGLang server: /server_info has neither "
                         "disaggregation_mode nor internal_states")
    parsed = parse_server_info(info)
    mode = parsed.disaggregation_mode or "null"
    if mode != "null":
        raise PoiseError(
            f"{url} is a PD {mode} engine (disaggregation_mode={mode!r}); profile a colocated engine instead "
            "(SGLang --disaggregation-mode null, engine_sim --mode null) with the same model, GPU and TP: a prefill "
            "engine waits for a decode peer and a decode engine for a prefill peer")
    if not parsed.max_total_num_tokens or not parsed.max_running_requests:
        raise PoiseError(f"{url}: /server_info reports no max_total_num_tokens / max_running_requests "
                         "(needed to plan batches that fit); is this an SGLang server?")
    is_sim = info.get("engine") == ENGINE_SIM
    gpu_profile = info.get("gpu_profile") if isinstance(info.get("gpu_profile"), dict) else None
    reported = info.get("time_scale")
    if reported is None and gpu_profile is not None:
        reported = gpu_profile.get("time_scale")
    if time_scale_hint is not None:
        scale, source = float(time_scale_hint), "--time-scale-hint"
        if isinstance(reported, int | float) and abs(float(reported) - scale) > 1e-9 * max(1.0, scale):
            raise PoiseError(f"--time-scale-hint {scale:g} contradicts the engine's own time_scale {reported:g}")
    elif isinstance(reported, int | float) and not isinstance(reported, bool):
        scale, source = float(reported), "/server_info time_scale"
    else:
        scale, source = 1.0, "1 (a real engine runs at its own speed)"
    if scale <= 0:
        raise PoiseError(f"{url} runs at time_scale {scale:g}: its compute is free, there is nothing to measure "
                         "(restart it with a positive --time-scale)")
    chunk = info.get("chunked_prefill_size")
    chunk = int(chunk) if isinstance(chunk, int) and chunk > 0 else None
    served = parsed.served_model_name or info.get("model_path")
    return EngineTarget(
        url=url.rstrip("/"), server_info=info, is_engine_sim=is_sim, time_scale=scale, time_scale_source=source,
        chunked_prefill_size=chunk,
        context_length=_positive_int(info.get("context_length")) or context_length,
        kv_capacity_tokens=parsed.max_total_num_tokens, max_running_requests=parsed.max_running_requests,
        tp=_positive_int(info.get("tp_size")), model=served if isinstance(served, str) else None,
        gpu_profile=gpu_profile,
    )


def _get_json(http: httpx.Client, url: str, path: str) -> tuple[int, Any]:
    try:
        response = http.get(url + path)
    except httpx.HTTPError as exc:
        raise PoiseError(f"cannot reach the engine at {url} ({type(exc).__name__}: {exc}); is it running, and is "
                         "the URL its HTTP port (SGLang --port)?") from exc
    try:
        return response.status_code, response.json()
    except ValueError:
        return response.status_code, None


def connect(url: str, *, time_scale_hint: float | None = None, timeout_s: float = 10.0,
            api_key: str | None = None) -> EngineTarget:
    """Read the engine's ``/server_info`` (and ``/v1/models`` for its context length if needed).

    Synchronous on purpose: it runs once, before the event loop that measures starts.
    """
    url = url.rstrip("/")
    if not url.startswith("http://"):
        raise PoiseError(f"--engine must be an http:// URL, got {url!r}")
    with httpx.Client(timeout=timeout_s, trust_env=False, headers=engine_auth_headers(api_key)) as http:
        status, info = _get_json(http, url, "/server_info")
        if status == 401:
            raise PoiseError(f"{url} answered 401 to /server_info: it was started with --api-key; pass the same key "
                             "with --api-key (or POISE_PROFILE_API_KEY)")
        if status != 200 or not isinstance(info, dict):
            raise PoiseError(f"{url} does not look like an SGLang server: GET /server_info answered HTTP {status}"
                             + ("" if isinstance(info, dict) else " without a JSON object"))
        context = None
        if _positive_int(info.get("context_length")) is None:
            status, models = _get_json(http, url, "/v1/models")
            if status == 200 and isinstance(models, dict) and models.get("data"):
                context = _positive_int(models["data"][0].get("max_model_len"))
    return describe_target(url, info, time_scale_hint=time_scale_hint, context_length=context)
