"""What the P→D handoff does to the engine's requests (the wire side is handoff.py).

Prefill side: hooks the RoomRegistry and the request timers call (room claimed, KV released, transfer failed,
bootstrap / release timeouts). Decode side: ``pull``, the per-request task that claims the room, waits for the
prefill, sleeps the transfer time and moves the request to the ready queue. Plain functions over the engine.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from http import HTTPStatus

import orjson

from services.engine_sim.engine_state import EngineState
from services.engine_sim.handoff import HandoffError, pull_kv, release_kv
from services.engine_sim.requests import Phase, SimRequest, finish_length
from services.engine_sim.stops import cut_at_stop

log = logging.getLogger(__name__)


# -- prefill-side handoff hooks (called by RoomRegistry / timers) --------------------------------------
def room_claimed(eng: EngineState, req: SimRequest) -> None:
    if req.phase is not Phase.BOOTSTRAP:
        return
    eng.queues.bootstrap.pop(req.rid, None)
    if req.timer is not None:
        req.timer.cancel()
        req.timer = None
    eng.enqueue_waiting(req)
    eng.kick()


def bootstrap_timed_out(eng: EngineState, req: SimRequest) -> None:
    req.timer = None
    if req.phase is not Phase.BOOTSTRAP:
        return
    eng.metrics.num_bootstrap_failed_reqs.inc()
    eng.fail_request(req, f"Prefill bootstrap failed for request rank=0 req.rid={req.rid!r} "
                          f"req.bootstrap_room={req.bootstrap_room} with exception no decode peer claimed the room "
                          f"within {eng.settings.bootstrap_timeout_s:g}s", HTTPStatus.INTERNAL_SERVER_ERROR)


def transfer_done(eng: EngineState, req: SimRequest, transfer_ms: float | None, nbytes: int | None) -> None:
    if req.phase is not Phase.INFLIGHT:
        return
    if transfer_ms is not None:
        speed = (nbytes / transfer_ms / 1e6) if nbytes and transfer_ms > 0 else None
        eng.metrics.kv_transfer(transfer_ms, speed)
        eng.last_kv_transfer_ms = float(transfer_ms)
        if speed is not None:
            eng.last_kv_transfer_gb_s = speed
    if req.first_token_id is not None:  # the first token reaches the prefill's client only now, as in SGLang
        req.output_ids.append(req.first_token_id)
    eng.finish_request(req, finish_length(0))  # SGLang's prefill: FINISH_LENGTH(length=0) once the KV is sent


def transfer_failed(eng: EngineState, req: SimRequest, message: str) -> None:
    if req.finished:
        return
    eng.metrics.num_transfer_failed_reqs.inc()
    eng.fail_request(req, f"Prefill transfer failed for request rank=0 req.rid={req.rid!r} "
                          f"req.bootstrap_room={req.bootstrap_room} with exception {message}",
                     HTTPStatus.INTERNAL_SERVER_ERROR)


def release_timed_out(eng: EngineState, req: SimRequest) -> None:
    req.timer = None
    if req.phase is Phase.INFLIGHT:
        transfer_failed(eng, req, f"the decode side did not release the KV within "
                                  f"{eng.settings.bootstrap_timeout_s:g}s")


# -- decode-side KV pull -------------------------------------------------------------------------------
async def pull(eng: EngineState, req: SimRequest) -> None:
    if req.kv_source is not None:
        await pull_migrated(eng, req)
        return
    host = req.bootstrap_host
    port = req.bootstrap_port if req.bootstrap_port is not None else eng.settings.resolved_bootstrap_port()
    room = req.bootstrap_room
    assert room is not None and eng.client is not None
    client = eng.client
    try:
        if not host:
            raise HandoffError("handshake", "the request has no bootstrap_host")
        info = await pull_kv(client, host, port, room, eng.settings.bootstrap_timeout_s)
        eng.metrics.kv_transfer_bootstrap_ms.observe(info["bootstrap_ms"])
        nbytes = eng.latency.kv_bytes(req.prompt_tokens)
        transfer_s = eng.latency.kv_transfer_time_s(req.prompt_tokens)
        await asyncio.sleep(transfer_s)
    except Exception as exc:  # HandoffError, or anything unexpected: the request must not hang in TRANSFER
        if not isinstance(exc, HandoffError):
            log.exception("KV pull for %s failed unexpectedly", req.rid)
            exc = HandoffError("transfer", repr(exc))
        if req.phase is Phase.TRANSFER:
            if exc.kind == "handshake":
                eng.metrics.num_bootstrap_failed_reqs.inc()
                what = "handshake"
            else:
                eng.metrics.num_transfer_failed_reqs.inc()
                what = "transfer"
            eng.fail_request(req, f"Decode {what} failed for request rank=0 decode_req.req.rid={req.rid!r} "
                                  f"decode_req.req.bootstrap_room={room} with exception {exc}",
                             HTTPStatus.INTERNAL_SERVER_ERROR)
        return
    except asyncio.CancelledError:
        if host and not eng.stopping:  # aborted here: tell the prefill to drop its side
            eng.spawn(release_kv(client, host, port, room, {"outcome": "abort"}))
        raise
    if req.phase is not Phase.TRANSFER:
        return
    transfer_ms = transfer_s * 1000.0
    speed = nbytes / transfer_s / 1e9 if transfer_s > 0 else None
    eng.metrics.kv_transfer(transfer_ms, speed)
    eng.last_kv_transfer_ms = transfer_ms
    if speed is not None:
        eng.last_kv_transfer_gb_s = speed
    # Release in the background: the prefill learns of the finished transfer in parallel, as with Mooncake.
    eng.spawn(release_kv(client, host, port, room, {"outcome": "ok", "transfer_ms": transfer_ms,
                                                    "bytes": nbytes}))
    eng.queues.transfer.pop(req.rid, None)
    req.handoff_task = None
    req.first_token_id = int(info["first_token_id"])
    if req.stops:
        _stops_after_first_token(req)
    eng.core.transfer_done(req)
    eng.kick()


def _stops_after_first_token(req: SimRequest) -> None:
    """The prefill peer drew the first token with its own seed, so the stop strings are found again in the
    sequence this engine emits: that token, then its own from the second on (before the request joins the
    batch, so the engine model stops it at the new length)."""
    assert req.tokens is not None and req.first_token_id is not None
    rest = req.tokens.clone()
    rest.skip(1)
    req.output_tokens, req.stop_match = cut_at_stop(itertools.chain([req.first_token_id], rest), req.stops,
                                                    req.uncut_tokens, req.max_new_tokens)


# -- decode → decode migration by KV copy (poise_resume with a KV source) -------------------------------
KV_EXPORT_PATH = "/poise_sim/kv_export"


async def pull_migrated(eng: EngineState, req: SimRequest) -> None:
    """Copy a running request's KV from the decode engine it runs on, then join this engine's batch.

    Models ARES' asynchronous D→D copy: the source keeps decoding its other requests (and this one: the
    gateway holds back what it produces until the copy is done), the copy takes ``kv_bytes / migration
    bandwidth``. A source that no longer has the request (finished, aborted, died) fails the migration; the
    gateway then keeps the request where it was.
    """
    assert req.kv_source is not None and eng.client is not None
    url, source_rid = req.kv_source
    try:
        try:
            status, body = await asyncio.wait_for(
                eng.client.post_json(url + KV_EXPORT_PATH, orjson.dumps({"rid": source_rid})), 10.0)
        except (OSError, TimeoutError) as exc:
            raise HandoffError("handshake", f"source engine {url} unreachable: {exc}") from exc
        if status != 200:
            raise HandoffError("handshake", f"source engine {url} answered {status}: {body[:200]!r}")
        tokens = req.prompt_tokens  # the prompt grew by the generated tokens at submit: the whole context
        transfer_s = eng.latency.migration_transfer_time_s(tokens, eng.settings.migration_gbps)
        await asyncio.sleep(transfer_s)
    except HandoffError as exc:
        if req.phase is Phase.TRANSFER:
            eng.metrics.num_transfer_failed_reqs.inc()
            eng.fail_request(req, f"Migration of {source_rid!r} failed: {exc}", HTTPStatus.INTERNAL_SERVER_ERROR)
        return
    if req.phase is not Phase.TRANSFER:
        return
    eng.metrics.kv_transfer(transfer_s * 1000.0, eng.latency.kv_bytes(tokens) / transfer_s / 1e9 if transfer_s > 0
                            else None)
    eng.queues.transfer.pop(req.rid, None)
    req.handoff_task = None
    assert req.tokens is not None
    req.first_token_id = req.tokens.peek()
    eng.core.transfer_done(req)
    eng.kick()
