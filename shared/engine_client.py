"""A small typed async client for the SGLang HTTP endpoints the control plane uses (not the inference API).

``/health``, ``/server_info``, ``/v1/loads``, ``/pd_role_switch`` and ``/abort_request`` of SGLang 0.5.23
(and of engine_sim, which speaks the same API). Shapes follow SGLang's ``entrypoints/v1_loads.py``
(envelope ``{timestamp, version, accelerator, num_accelerators, loads: [per DP rank]}``) and
``managers/load_snapshot.py`` (``LoadSnapshot.to_dict``: flat core fields plus optional sections such as
``disaggregation``). Every httpx failure becomes :class:`shared.errors.EngineError` (timeouts:
:class:`shared.errors.EngineTimeout`); the caller owns the ``httpx.AsyncClient``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec

from shared.errors import EngineError, EngineTimeout


class EngineLoads(msgspec.Struct, frozen=True, kw_only=True):
    """``/v1/loads`` summed over the engine's DP ranks."""

    dp_ranks: int  # how many DP ranks reported
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_waiting_uncached_tokens: int = 0
    num_used_tokens: int = 0  # KV tokens in use
    max_total_num_tokens: int = 0  # KV capacity in tokens
    max_running_requests: int = 0
    token_usage: float = 0.0  # used / capacity over all ranks (engine's own ratio when capacity is unknown)
    gen_throughput_tps: float = 0.0  # decode tokens per second
    mode: str | None = None  # disaggregation mode: "prefill", "decode", "null"; None when not reported
    prefill_bootstrap_queue_reqs: int = 0
    prefill_inflight_queue_reqs: int = 0
    decode_prealloc_queue_reqs: int = 0
    decode_transfer_queue_reqs: int = 0
    decode_retracted_queue_reqs: int = 0
    # engine_sim's extension: recent prompts prefilled alone, (seq, tokens, seconds); empty from SGLang.
    prefill_samples: tuple[tuple[int, int, float], ...] = ()
    running_tokens: int | None = None  # engine_sim's extension: context tokens of the running batch
    # When the numbers were taken (unix s, the engine's clock; the oldest rank's), None when the engine gives
    # no times. SGLang answers /v1/loads from a snapshot its scheduler publishes after every prefill batch, every
    # --load-snapshot-publish-interval decode steps (15 by default: ~1 s on a CPU core, 0.1-0.5 s on a GPU) and
    # every 50 ms while it has no batch, so the numbers can be that old.
    snapshot_unix_s: float | None = None
    # The same, over the ranks that report work only; None when none does. One that grows old means a scheduler
    # stuck in a step (a hung kernel): the snapshot stops advancing while work waits.
    busy_snapshot_unix_s: float | None = None

    @property
    def prefill_queue_reqs(self) -> int:
        """Requests in the prefill bootstrap and in-flight (KV being sent) queues."""
        return self.prefill_bootstrap_queue_reqs + self.prefill_inflight_queue_reqs

    @property
    def decode_queue_reqs(self) -> int:
        """Requests in the decode pre-allocation and transfer queues (retracted ones count too)."""
        return self.decode_prealloc_queue_reqs + self.decode_transfer_queue_reqs + self.decode_retracted_queue_reqs

    @property
    def idle(self) -> bool:
        """Nothing running, waiting or queued for a KV transfer: what ``/pd_role_switch`` requires."""
        return (self.num_running_reqs == 0 and self.num_waiting_reqs == 0
                and self.prefill_queue_reqs == 0 and self.decode_queue_reqs == 0)


class EngineServerInfo(msgspec.Struct, frozen=True, kw_only=True):
    """The ``/server_info`` fields the control plane reads; ``None`` where the engine does not say."""

    max_total_num_tokens: int | None  # KV capacity in tokens (scheduler info)
    max_running_requests: int | None
    disaggregation_mode: str | None  # "prefill", "decode" or "null"
    disaggregation_bootstrap_port: int | None
    served_model_name: str | None
    raw: dict[str, Any]  # the whole answer, for anything else
    # Started with --enable-deterministic-inference: the only mode in which SGLang 0.5.23 samples with a
    # request's ``seed`` (otherwise it accepts the field and samples without it).
    deterministic: bool = False


_CORE_INT_FIELDS = ("num_running_reqs", "num_waiting_reqs", "num_waiting_uncached_tokens", "num_used_tokens",
                    "max_total_num_tokens", "max_running_requests")
_DISAGG_INT_FIELDS = ("prefill_bootstrap_queue_reqs", "prefill_inflight_queue_reqs", "decode_prealloc_queue_reqs",
                      "decode_transfer_queue_reqs", "decode_retracted_queue_reqs")


def _num(value: Any) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0


def parse_loads(body: Any) -> EngineLoads:
    """Sum SGLang's ``/v1/loads`` JSON over DP ranks (raises ``ValueError`` on a foreign shape)."""
    if not isinstance(body, dict) or not isinstance(body.get("loads"), list):
        raise ValueError("expected an object with a 'loads' list")
    ranks = [r for r in body["loads"] if isinstance(r, dict)]
    totals: dict[str, float] = dict.fromkeys(_CORE_INT_FIELDS + _DISAGG_INT_FIELDS, 0.0)
    gen_tps = 0.0
    usages: list[float] = []
    mode: str | None = None
    samples: list[tuple[int, int, float]] = []
    running_tokens: int | None = None
    busy_snapshot: float | None = None
    snapshot: float | None = None
    for rank in ranks:
        disagg = rank.get("disaggregation")
        queued = sum(_num(disagg.get(f)) for f in _DISAGG_INT_FIELDS) if isinstance(disagg, dict) else 0.0
        stamp = _num(rank.get("timestamp"))
        if stamp > 0:
            snapshot = stamp if snapshot is None else min(snapshot, stamp)
        if stamp > 0 and _num(rank.get("num_running_reqs")) + _num(rank.get("num_waiting_reqs")) + queued > 0:
            busy_snapshot = stamp if busy_snapshot is None else min(busy_snapshot, stamp)
        if isinstance(rank.get("poise_running_tokens"), int):
            running_tokens = (running_tokens or 0) + rank["poise_running_tokens"]
        for sample in rank.get("poise_prefill_samples") or []:
            if isinstance(sample, list) and len(sample) == 3 and all(isinstance(x, int | float) for x in sample):
                samples.append((int(sample[0]), int(sample[1]), float(sample[2])))
        for f in _CORE_INT_FIELDS:
            totals[f] += _num(rank.get(f))
        gen_tps += _num(rank.get("gen_throughput"))
        usages.append(_num(rank.get("token_usage")))
        if isinstance(disagg, dict):
            if isinstance(disagg.get("mode"), str):
                mode = disagg["mode"]
            for f in _DISAGG_INT_FIELDS:
                totals[f] += _num(disagg.get(f))
    capacity = int(totals["max_total_num_tokens"])
    usage = totals["num_used_tokens"] / capacity if capacity > 0 else (sum(usages) / len(usages) if usages else 0.0)
    ints = {f: int(v) for f, v in totals.items()}
    return EngineLoads(dp_ranks=len(ranks), token_usage=usage, gen_throughput_tps=gen_tps, mode=mode,
                       prefill_samples=tuple(samples), running_tokens=running_tokens,
                       snapshot_unix_s=snapshot, busy_snapshot_unix_s=busy_snapshot, **ints)


def _opt_int(value: Any) -> int | None:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def parse_server_info(body: Any) -> EngineServerInfo:
    """Read the fields we need from ``/server_info``; per-DP ``internal_states`` fill gaps at the top level."""
    if not isinstance(body, dict):
        raise ValueError("expected a JSON object")
    states = [s for s in body.get("internal_states") or [] if isinstance(s, dict)]

    def pick(name: str) -> Any:
        if body.get(name) is not None:
            return body[name]
        return next((s[name] for s in states if s.get(name) is not None), None)

    capacity = _opt_int(body.get("max_total_num_tokens"))
    if capacity is None and states:
        per_rank = [_opt_int(s.get("max_total_num_tokens")) for s in states]
        capacity = sum(c for c in per_rank if c is not None) or None
    mode = pick("disaggregation_mode")
    served = body.get("served_model_name")
    return EngineServerInfo(
        max_total_num_tokens=capacity,
        max_running_requests=_opt_int(pick("max_running_requests")),
        disaggregation_mode=mode if isinstance(mode, str) else None,
        disaggregation_bootstrap_port=_opt_int(body.get("disaggregation_bootstrap_port")),
        served_model_name=served if isinstance(served, str) else None,
        raw=body,
        deterministic=body.get("enable_deterministic_inference") is True,
    )


def _error_message(response: httpx.Response) -> str:
    """The engine's own words: ``message`` (role switch), ``error.message`` (SGLang errors) or the body."""
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:500] or f"HTTP {response.status_code}"
    if isinstance(body, dict):
        if isinstance(body.get("message"), str) and body["message"]:
            return str(body["message"])
        error = body.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
        if isinstance(body.get("detail"), str):
            return str(body["detail"])
    return str(body)[:500]


def engine_auth_headers(api_key: str | None) -> dict[str, str]:
    """The header an engine started with ``--api-key`` wants on every call but health and metrics."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


class EngineClient:
    """Control-plane calls to one engine. ``engine_id`` only labels errors."""

    def __init__(self, base_url: str, http: httpx.AsyncClient, *, engine_id: str = "engine",
                 timeout_s: float = 5.0, role_switch_timeout_s: float = 300.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.engine_id = engine_id
        self._http = http
        self._timeout_s = timeout_s
        self._role_switch_timeout_s = role_switch_timeout_s

    @contextlib.contextmanager
    def _map_errors(self, what: str) -> Iterator[None]:
        try:
            yield
        except httpx.TimeoutException as exc:
            raise EngineTimeout(self.engine_id, f"{what} timed out ({type(exc).__name__})") from exc
        except httpx.HTTPError as exc:
            raise EngineError(self.engine_id, f"{what} failed: {type(exc).__name__}: {exc}") from exc

    async def _get(self, path: str, *, params: dict[str, str] | None = None) -> httpx.Response:
        with self._map_errors(f"GET {path}"):
            return await self._http.get(self.base_url + path, params=params, timeout=self._timeout_s)

    def _json_or_raise(self, response: httpx.Response, what: str) -> Any:
        if response.status_code != 200:
            raise EngineError(self.engine_id, f"{what}: HTTP {response.status_code}: {_error_message(response)}",
                              status=response.status_code)
        try:
            return response.json()
        except ValueError as exc:
            raise EngineError(self.engine_id, f"{what}: answer is not JSON") from exc

    async def health(self) -> bool:
        """True when ``/health`` answers 200 (503 while starting or shutting down gives False)."""
        response = await self._get("/health")
        return response.status_code == 200

    async def server_info(self) -> EngineServerInfo:
        body = self._json_or_raise(await self._get("/server_info"), "GET /server_info")
        try:
            return parse_server_info(body)
        except ValueError as exc:
            raise EngineError(self.engine_id, f"GET /server_info: {exc}") from exc

    async def loads(self) -> EngineLoads:
        """``/v1/loads`` (core and disaggregation sections), summed over DP ranks."""
        response = await self._get("/v1/loads", params={"include": "core,disagg"})
        body = self._json_or_raise(response, "GET /v1/loads")
        try:
            return parse_loads(body)
        except ValueError as exc:
            raise EngineError(self.engine_id, f"GET /v1/loads: {exc}") from exc

    async def pd_role_switch(self, new_role: str, *, decode_cuda_graph_memory_gb: float | None = None) -> dict[str, Any]:
        """Flip the engine's PD role; the engine must be idle.

        ``decode_cuda_graph_memory_gb`` goes with a switch to decode: SGLang 0.5.23 refuses one without it when
        the engine has captured no decode CUDA graphs (it was launched as prefill).

        Returns SGLang's ``{success, message, old_role, new_role, safe_to_restore}``. An HTTP 400 (not idle,
        flag not set, ...) or ``success: false`` raises :class:`EngineError` carrying the engine's message.
        """
        with self._map_errors("POST /pd_role_switch"):
            body: dict[str, Any] = {"new_role": new_role}
            if new_role == "decode" and decode_cuda_graph_memory_gb is not None:
                body["decode_cuda_graph_memory_gb"] = decode_cuda_graph_memory_gb
            response = await self._http.post(self.base_url + "/pd_role_switch", json=body,
                                             timeout=self._role_switch_timeout_s)
        if response.status_code != 200:
            raise EngineError(self.engine_id, f"role switch to {new_role} refused: {_error_message(response)}",
                              status=response.status_code)
        answer = self._json_or_raise(response, "POST /pd_role_switch")
        if not isinstance(answer, dict) or not answer.get("success", False):
            message = answer.get("message", "") if isinstance(answer, dict) else str(answer)
            raise EngineError(self.engine_id, f"role switch to {new_role} failed: {message}", status=200)
        return answer

    async def abort(self, rid: str | None = None, *, abort_all: bool = False) -> None:
        """``/abort_request`` for one request id, or for every request with ``abort_all``."""
        if rid is None and not abort_all:
            raise ValueError("give a rid or abort_all=True")
        with self._map_errors("POST /abort_request"):
            response = await self._http.post(self.base_url + "/abort_request",
                                             json={"rid": rid or "", "abort_all": abort_all}, timeout=self._timeout_s)
        if response.status_code != 200:
            raise EngineError(self.engine_id, f"abort {rid or 'all'}: HTTP {response.status_code}: "
                              f"{_error_message(response)}", status=response.status_code)
