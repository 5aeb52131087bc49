"""The P→D KV handoff between two engine_sim processes, keyed by ``bootstrap_room``.

This is engine_sim's stand-in for SGLang's KV transfer engines (Mooncake, NIXL): no KV moves, only the facts
the decode side needs, over a small HTTP server the prefill engine runs on its bootstrap port (as SGLang's
prefill runs its bootstrap server there; its real route ``GET /health`` is kept). The protocol follows
SGLang's default ``--disaggregation-decode-allocation-policy early``:

1. The decode engine admits the request to its prealloc queue and waits until KV for prompt +
   ``num_reserved_decode_tokens`` fits; then it calls ``GET /poise_sim/kv/{room}?timeout_s=T``.
   That call is the bootstrap handshake: it *claims* the room, which lets the prefill request leave the
   prefill's bootstrap queue and be prefilled (a prefill request waits for its decode peer, like SGLang's).
   The call long-polls until the prefill is done: ``200 {room, rid, prompt_tokens, first_token_id,
   prefill_done_unix_s, kv_bytes}``; ``202 {"status": "pending"}`` when the request is known but still
   queued/prefilling after T (poll again); ``404`` when no prefill request for the room arrived within T;
   ``410`` when it was aborted or failed.
2. The decode waits ``kv_transfer_time_s(prompt_tokens)`` (the modelled transfer), then calls
   ``POST /poise_sim/kv/{room}/release`` with ``{"outcome": "ok", "transfer_ms": ..., "bytes": ...}``: the
   prefill frees the KV and only now answers its own HTTP request, as SGLang's prefill answers after the
   transfer succeeds. ``{"outcome": "abort"}`` (the decode request was aborted) fails the prefill request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from services.engine_sim import clock
from services.engine_sim.config import EngineSimSettings
from services.engine_sim.requests import Phase, SimRequest
from shared.http1 import Http1Pool

log = logging.getLogger(__name__)

KV_ROUTE = "/poise_sim/kv/{room}"


@dataclass(eq=False)
class Room:
    room: int
    req: SimRequest | None = None
    claimed: bool = False
    arrived: asyncio.Event = field(default_factory=asyncio.Event)  # a prefill request holds the room
    done: asyncio.Event = field(default_factory=asyncio.Event)  # prefill finished (info set) or failed
    info: dict[str, Any] | None = None
    failed: str | None = None
    expiry: asyncio.TimerHandle | None = None


class RoomHooks(Protocol):
    """What a room registry tells its engine (``SimEngine``; the logic is in transfer.py)."""

    @property
    def settings(self) -> EngineSimSettings: ...

    def room_claimed(self, req: SimRequest) -> None: ...

    def transfer_done(self, req: SimRequest, transfer_ms: float | None, nbytes: int | None) -> None: ...

    def transfer_failed(self, req: SimRequest, message: str) -> None: ...


class RoomRegistry:
    """Prefill side: bootstrap rooms by id, and the long-poll / release logic behind the bootstrap routes."""

    def __init__(self, engine: RoomHooks) -> None:
        self._engine = engine
        self.rooms: dict[int, Room] = {}

    def __len__(self) -> int:
        return len(self.rooms)

    def _get_or_create(self, room_id: int) -> Room:
        room = self.rooms.get(room_id)
        if room is None:
            room = self.rooms[room_id] = Room(room_id)
        return room

    def _drop(self, room: Room) -> None:
        if room.expiry is not None:
            room.expiry.cancel()
        if self.rooms.get(room.room) is room:
            del self.rooms[room.room]

    def _expire_later(self, room: Room, delay_s: float) -> None:
        """Keep a failed room for a while so a late poll gets 410 (not 404), then forget it."""
        if room.expiry is not None:
            room.expiry.cancel()
        room.expiry = asyncio.get_running_loop().call_later(delay_s, self._drop, room)

    # -- engine side ---------------------------------------------------------------------------------
    def attach(self, req: SimRequest) -> str | None:
        """A prefill request arrived for its room. Returns why it must fail, or None."""
        assert req.bootstrap_room is not None
        room = self._get_or_create(req.bootstrap_room)
        if room.req is not None and not room.req.finished:
            return f"Duplicate bootstrap_room {req.bootstrap_room}: request {room.req.rid!r} already holds it"
        if room.failed is not None:
            return room.failed
        room.req = req
        room.arrived.set()
        return None

    def is_claimed(self, room_id: int) -> bool:
        room = self.rooms.get(room_id)
        return room is not None and room.claimed

    def prefill_done(self, req: SimRequest, first_token_id: int, kv_bytes: int) -> None:
        room = self.rooms.get(req.bootstrap_room) if req.bootstrap_room is not None else None
        if room is None or room.req is not req:
            return
        room.info = {
            "status": "ready",
            "room": room.room,
            "rid": req.rid,
            "prompt_tokens": req.prompt_tokens,
            "first_token_id": first_token_id,
            "prefill_done_unix_s": req.prefill_done_unix_s,
            "kv_bytes": kv_bytes,
        }
        room.done.set()

    def request_gone(self, req: SimRequest, reason: str, keep_s: float) -> None:
        """The room's prefill request ended without a release (abort, timeout): tell the decode poller."""
        room = self.rooms.get(req.bootstrap_room) if req.bootstrap_room is not None else None
        if room is None or room.req is not req:
            return
        room.failed = reason
        room.arrived.set()
        room.done.set()
        self._expire_later(room, keep_s)

    def fail_all(self, reason: str) -> None:
        for room in list(self.rooms.values()):
            room.failed = room.failed or reason
            room.arrived.set()
            room.done.set()
            self._drop(room)

    def busy(self) -> bool:
        """Any room still holding a live prefill request (unreleased KV)."""
        return any(r.req is not None and not r.req.finished for r in self.rooms.values())

    # -- bootstrap HTTP side -------------------------------------------------------------------------
    async def wait_ready(self, room_id: int, timeout_s: float) -> tuple[int, dict[str, Any]]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        room = self._get_or_create(room_id)
        if not room.claimed:
            room.claimed = True
            if room.req is not None and room.req.phase is Phase.BOOTSTRAP:
                self._engine.room_claimed(room.req)
        if room.req is None and room.failed is None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(room.arrived.wait(), timeout_s)
            if room.req is None and room.failed is None:
                self._drop(room)
                return 404, {"status": "unknown", "room": room_id,
                             "message": f"no prefill request for bootstrap_room {room_id} within {timeout_s:g}s"}
        if room.failed is None and not room.done.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(room.done.wait(), max(0.0, deadline - loop.time()))
        if room.failed is not None:
            return 410, {"status": "failed", "room": room_id, "message": room.failed}
        if room.info is None:
            return 202, {"status": "pending", "room": room_id}
        return 200, room.info

    def release(self, room_id: int, outcome: str, transfer_ms: float | None, nbytes: int | None) -> tuple[int, dict[str, Any]]:
        room = self.rooms.get(room_id)
        if room is None:
            return 404, {"released": False, "message": f"unknown bootstrap_room {room_id}"}
        req = room.req
        if outcome != "ok":
            message = "decode side aborted the request"
            if req is None:  # the decode gave up before the prefill request arrived: fail it on arrival
                room.failed = f"Prefill transfer failed for bootstrap_room={room_id}: {message}"
                room.arrived.set()
                room.done.set()
                self._expire_later(room, self._engine.settings.bootstrap_timeout_s)
            elif not req.finished:
                self._engine.transfer_failed(req, message)
            return 200, {"released": True}
        if req is None or req.phase is not Phase.INFLIGHT:
            return 409, {"released": False, "message": f"bootstrap_room {room_id} has no finished prefill to release"}
        self._drop(room)
        self._engine.transfer_done(req, transfer_ms, nbytes)
        return 200, {"released": True}


def _json(status: int, body: dict[str, Any]) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


def create_bootstrap_app(registry: RoomRegistry) -> Starlette:
    async def health(_: Request) -> Response:
        return PlainTextResponse("OK")  # SGLang's bootstrap server: GET /health -> "OK"

    async def get_kv(request: Request) -> Response:
        try:
            room_id = int(request.path_params["room"])
            timeout_s = float(request.query_params.get("timeout_s", "30"))
        except ValueError:
            return _json(400, {"message": "room must be an integer and timeout_s a number"})
        return _json(*await registry.wait_ready(room_id, max(0.0, min(timeout_s, 3600.0))))

    async def release_kv(request: Request) -> Response:
        try:
            room_id = int(request.path_params["room"])
            raw = await request.body()
            body = orjson.loads(raw) if raw else {}
            if not isinstance(body, dict):
                raise ValueError
        except ValueError:
            return _json(400, {"message": "room must be an integer and the body a JSON object"})
        return _json(*registry.release(room_id, str(body.get("outcome", "ok")), body.get("transfer_ms"),
                                       body.get("bytes")))

    return Starlette(routes=[
        Route("/health", health, methods=["GET"]),
        Route(KV_ROUTE, get_kv, methods=["GET"]),
        Route(KV_ROUTE + "/release", release_kv, methods=["POST"]),
    ])


class BootstrapServer:
    """A second uvicorn server in the engine's process and event loop, started and stopped with the role."""

    def __init__(self, app: Starlette, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self._app = app
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        # Bind here, not in uvicorn: uvicorn answers a bind error with sys.exit, which must not happen in a task.
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError:
            sock.close()
            raise
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self._app, log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=1, timeout_keep_alive=30)
        self._server = uvicorn.Server(config)
        # _serve skips serve()'s signal capture: the main server owns SIGINT/SIGTERM.
        self._task = asyncio.create_task(self._server._serve(sockets=[sock]), name="engine-sim-bootstrap")
        for _ in range(500):
            if self._server.started or self._task.done():
                break
            await asyncio.sleep(0.01)
        if self._task.done():
            self._task.result()  # re-raise a startup failure
        log.debug("bootstrap server listening on %s:%d", self.host, self.port)

    async def stop(self) -> None:
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        done, _ = await asyncio.wait({self._task}, timeout=5.0)
        if not done:
            self._task.cancel()
        elif not self._task.cancelled() and self._task.exception() is not None:
            log.error("bootstrap server stopped with an error: %r", self._task.exception())
        self._server = None
        self._task = None


class HandoffError(Exception):
    """The decode side could not get the KV: ``handshake`` (prefill unreachable) or ``transfer``."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


async def pull_kv(client: Http1Pool, host: str, port: int, room: int, timeout_s: float) -> dict[str, Any]:
    """Decode side of step 1: claim the room and wait for the prefill to finish.

    ``client`` is the engine's one keep-alive pool, shared by every pull (a pull runs once per request).
    """
    url = f"http://{host}:{port}/poise_sim/kv/{room}?timeout_s={timeout_s:g}"
    t0 = clock.monotonic()
    while True:
        try:
            status, body = await asyncio.wait_for(client.fetch("GET", url), timeout_s + 10.0)
        except (OSError, TimeoutError) as exc:
            raise HandoffError("handshake", f"bootstrap server {host}:{port} unreachable: {exc}") from exc
        if status == 202:
            continue
        try:
            info = orjson.loads(body)
        except orjson.JSONDecodeError:
            info = {"message": body[:200].decode(errors="replace")}
        if status == 200:
            info["bootstrap_ms"] = (clock.monotonic() - t0) * 1000.0
            return info
        kind = "handshake" if status == 404 else "transfer"
        raise HandoffError(kind, f"bootstrap server {host}:{port} answered {status}: {info.get('message', '')}")


async def release_kv(client: Http1Pool, host: str, port: int, room: int, body: dict[str, Any]) -> None:
    """Decode side of step 2 (or the abort notice). Best effort: the prefill times out a lost release."""
    try:
        await asyncio.wait_for(client.post_json(f"http://{host}:{port}/poise_sim/kv/{room}/release", orjson.dumps(body)), 10.0)
    except (OSError, TimeoutError) as exc:
        log.warning("release of bootstrap_room %s at %s:%s failed: %s", room, host, port, exc)
