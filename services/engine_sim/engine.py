"""SimEngine: SGLang's scheduler semantics on an asyncio loop, timed by the latency model in real time.

One scheduler task runs forward "steps" back to back. Between steps it takes new requests in and forms the
next batch (as SGLang's scheduler does between forward passes); a step then lasts the latency model's time
for that batch (``await asyncio.sleep(step_s)``; at ``time_scale`` 0 a step is ``sleep(0)``), and its
effects (prefill progress, one token per decoding request) land when it ends. With nothing to compute the
task waits on an ``asyncio.Event``, so an idle engine costs nothing.

Per mode (SGLang's ``--disaggregation-mode``):

- ``prefill``: a request first waits in the bootstrap queue until its decode peer claims its bootstrap room
  (see handoff.py), then FCFS in the waiting queue until its prompt's KV fits; each step prefills chunks of
  admitted requests up to ``chunked_prefill_size`` tokens (``prefill_batch_time_s``). A finished prefill
  produces the first token, publishes it under the room and keeps its KV (inflight queue) until the decode
  side releases the room; only then does the request finish (``finish_reason`` length 0, as SGLang's prefill).
- ``decode``: a request waits in the prealloc queue until KV for prompt + min(max_new_tokens,
  ``num_reserved_decode_tokens``) fits, pulls the KV from its prefill peer (transfer queue), then joins the
  running batch (up to ``max_running_requests``): the prefill's first token is emitted on joining, then
  each step (``decode_step_time_s``) emits one token per running request.
- ``null`` (colocated): decode-prioritised mixed steps: every running request decodes, and prefill chunks fill
  what is left of the chunk budget (``mixed_step_time_s``).

KV is counted in tokens (kv.py). A request that outgrows its reservation takes free KV one token at a time;
when there is not enough for the whole batch the newest running request is retracted (null: back to the
waiting queue to be re-prefilled with its output, like SGLang's retract; decode: parked in the retracted
queue, its KV notionally kept on the host, and resumed when it fits). KV in use never exceeds capacity.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from datetime import UTC, datetime
from http import HTTPStatus
from typing import Any

from services.engine_sim.config import EngineSimSettings, Mode
from services.engine_sim.handoff import (
    BootstrapServer,
    HandoffError,
    RoomRegistry,
    create_bootstrap_app,
    pull_kv,
    release_kv,
)
from services.engine_sim.kv import KvPool
from services.engine_sim.metrics import EngineMetrics, ThroughputWindow
from services.engine_sim.requests import (
    Phase,
    SimRequest,
    finish_abort,
    finish_length,
    finish_stop,
)
from services.engine_sim.tokens import EOS_TOKEN_ID, TokenSource, draw_output_length
from shared.http1 import Http1Pool
from shared.latency import LatencyModel, LatencyProfile, load_profile

log = logging.getLogger(__name__)

ENGINE_NAME = "poise-engine-sim"
SGLANG_API_VERSION = "0.5.23"  # the SGLang release whose HTTP API this emulates
CATCH_UP_SLACK_S = 0.010  # a step that starts this soon after the last one ended absorbs the loop's lateness

# Where each phase's requests count in SGLang's queue gauges.
_QUEUED_PHASES = frozenset({Phase.INTAKE, Phase.BOOTSTRAP, Phase.WAITING, Phase.PREALLOC, Phase.READY})


class EngineRequestError(ValueError):
    """A request the engine refuses before queueing it (SGLang raises ValueError in its tokenizer manager)."""


@dataclass(slots=True)
class Step:
    time_s: float
    prefill: list[tuple[SimRequest, int]]  # (request, new tokens this step)
    decode: list[SimRequest]


@dataclass(frozen=True, slots=True)
class RoleSwitchResult:
    """PdRoleSwitchReqOutput (sglang/srt/managers/io_struct.py); HTTP 200 on success, 400 otherwise."""

    success: bool
    message: str
    old_role: str
    new_role: str
    safe_to_restore: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"success": self.success, "message": self.message, "old_role": self.old_role,
                "new_role": self.new_role, "safe_to_restore": self.safe_to_restore}


class SimEngine:
    def __init__(self, settings: EngineSimSettings, *, profile: LatencyProfile | None = None) -> None:
        self.settings = settings
        self.profile = profile if profile is not None else load_profile(settings.profile)
        self.latency = LatencyModel(self.profile, settings.time_scale)
        self.mode: Mode = settings.mode
        self.capacity = settings.kv_capacity_tokens or self.profile.kv_capacity_tokens
        self.max_running = settings.max_running_requests or self.profile.max_running_requests
        self.chunk_size = settings.chunked_prefill_size or self.profile.chunked_prefill_size
        self.kv = KvPool(self.capacity)
        self.metrics = EngineMetrics(model_name=settings.served_model_name, mode=settings.mode,
                                     role_switch_enabled=settings.enable_pd_role_switch)
        self.window = ThroughputWindow()
        self.rooms = RoomRegistry(self)
        self.bootstrap_port: int | None = None  # where the bootstrap server listens, while prefill

        self._reqs: dict[str, SimRequest] = {}  # every live request
        self._intake: deque[SimRequest] = deque()
        self._bootstrap: dict[str, SimRequest] = {}
        self._waiting: deque[SimRequest] = deque()
        self._prefilling: list[SimRequest] = []
        self._inflight: dict[str, SimRequest] = {}
        self._prealloc: deque[SimRequest] = deque()
        self._transfer: dict[str, SimRequest] = {}
        self._ready: deque[SimRequest] = deque()
        self._running: list[SimRequest] = []
        self._retracted: deque[SimRequest] = deque()

        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._paused = False
        self._switching = False
        self._unhealthy = False
        self._stopping = False
        self._started = False
        self._task: asyncio.Task[None] | None = None
        self._bg: set[asyncio.Task[Any]] = set()
        self._client: Http1Pool | None = None
        self._bootstrap_server: BootstrapServer | None = None
        self._prev_deadline = 0.0
        self.startup_unix_s = time.time()

        # counters for /v1/loads
        self.total_prefill_tokens = 0
        self.total_prefill_busy_us = 0
        self.decode_moments = [0.0] * 6  # count, sum b, sum t_us, sum b^2, sum b*t, sum generated (SGLang's)
        self.last_kv_transfer_ms = 0.0
        self.last_kv_transfer_gb_s = 0.0
        self.num_retracted_total = 0

    # ------------------------------------------------------------------------------------------------
    # lifecycle
    async def start(self) -> None:
        if self._started:
            return
        self._client = Http1Pool()  # one keep-alive pool shared by every KV pull
        if self.mode == "prefill":
            await self._start_bootstrap()
        self._task = asyncio.create_task(self._run(), name="engine-sim-scheduler")
        self._started = True

    async def stop(self) -> None:
        if not self._started:
            return
        self._stopping = True
        for req in list(self._reqs.values()):
            self._finish(req, finish_abort("engine_sim is shutting down", HTTPStatus.SERVICE_UNAVAILABLE))
        self.rooms.fail_all("engine_sim is shutting down")
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for task in list(self._bg):
            task.cancel()
        if self._bg:
            await asyncio.wait(self._bg, timeout=2.0)
        await self._stop_bootstrap()
        if self._client is not None:
            await self._client.aclose()
        self._started = False

    @property
    def healthy(self) -> bool:
        return self._started and not self._unhealthy and self._task is not None and not self._task.done()

    async def _start_bootstrap(self) -> None:
        port = self.settings.resolved_bootstrap_port()
        server = BootstrapServer(create_bootstrap_app(self.rooms), self.settings.host, port)
        await server.start()
        self._bootstrap_server = server
        self.bootstrap_port = server.port

    async def _stop_bootstrap(self) -> None:
        if self._bootstrap_server is not None:
            self.rooms.fail_all("prefill role stopped")
            await self._bootstrap_server.stop()
            self._bootstrap_server = None
        self.bootstrap_port = None

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.create_task(coro)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    def _kick(self) -> None:
        self._wake.set()

    # ------------------------------------------------------------------------------------------------
    # requests in and out
    def submit(
        self,
        *,
        prompt_tokens: int,
        max_new_tokens: int | None,
        rid: str | None = None,
        ignore_eos: bool = False,
        stream: bool = False,
        bootstrap_host: str | None = None,
        bootstrap_port: int | None = None,
        bootstrap_room: int | None = None,
        priority: int | None = None,
    ) -> SimRequest:
        """Queue a request. Raises :class:`EngineRequestError` where SGLang's tokenizer manager would refuse it."""
        if self._stopping:
            raise EngineRequestError("engine_sim is shutting down")
        rid = rid if rid is not None else uuid.uuid4().hex
        if rid in self._reqs:
            raise EngineRequestError(f"Duplicate request ID detected: {rid}")
        ctx = self.settings.context_length
        prompt_tokens = max(1, prompt_tokens)  # SGLang's tokenizer adds BOS: never an empty prompt
        if prompt_tokens >= ctx:
            raise EngineRequestError(
                f"The input ({prompt_tokens} tokens) is longer than the model's context length ({ctx} tokens).")
        if max_new_tokens is None:
            max_new_tokens = ctx - prompt_tokens - 1  # SGLang: unlimited, then capped by the context
        elif max_new_tokens < 0:
            raise EngineRequestError(f"max_new_tokens must be at least 0, got {max_new_tokens}.")
        elif prompt_tokens + max_new_tokens > ctx:
            raise EngineRequestError(
                f"Requested token count exceeds the model's maximum context length of {ctx} tokens. You requested "
                f"a total of {prompt_tokens + max_new_tokens} tokens: {prompt_tokens} tokens from the input messages "
                f"and {max_new_tokens} tokens for the completion. Please reduce the number of tokens in the input "
                "messages or the completion to fit within the limit.")
        # Like SGLang's init_req_max_new_tokens: never more output than the KV pool could ever hold.
        max_new_tokens = max(0, min(max_new_tokens, self.capacity - prompt_tokens))
        seed = self.settings.seed
        stop_after = max_new_tokens if ignore_eos else min(max_new_tokens, draw_output_length(
            seed, rid, self.settings.mean_output_tokens))
        req = SimRequest(
            rid=rid, prompt_tokens=prompt_tokens, max_new_tokens=max_new_tokens, ignore_eos=ignore_eos,
            stream=stream, bootstrap_host=bootstrap_host, bootstrap_port=bootstrap_port,
            bootstrap_room=bootstrap_room, priority=priority, stop_after=stop_after,
            prefill_len=prompt_tokens, tokens=TokenSource(seed, rid),
        )
        self._reqs[rid] = req
        self._idle.clear()
        self._intake.append(req)
        self._kick()
        return req

    async def outputs(self, req: SimRequest) -> AsyncIterator[tuple[list[int], dict[str, Any] | None]]:
        """New output ids (possibly several, when the reader fell behind) and, last, the finish reason."""
        offset = 0
        while True:
            n = len(req.output_ids)
            if n > offset or req.finish is not None:
                new = req.output_ids[offset:n]
                offset = n
                done = req.finish is not None and offset == len(req.output_ids)
                yield new, (req.finish if done else None)
                if done:
                    return
                continue
            req.event.clear()
            await req.event.wait()

    async def wait_for(self, req: SimRequest, disconnected: Callable[[], Coroutine[Any, Any, bool]] | None = None,
                       *, first_output: bool = False, poll_s: float = 2.0) -> None:
        """Wait until the request finishes (or, with ``first_output``, has any output); abort it if
        ``disconnected()`` reports the client gone (polled every ``poll_s``, like SGLang's tokenizer manager)."""
        while req.finish is None and not (first_output and req.output_ids):
            req.event.clear()
            try:
                await asyncio.wait_for(req.event.wait(), poll_s)
            except TimeoutError:
                if disconnected is not None and await disconnected():
                    self.abort(req.rid)
                    return

    def abort(self, rid: str | None = None, abort_all: bool = False) -> int:
        """SGLang's /abort_request: end the request(s) wherever they are, free their KV. Returns how many."""
        if abort_all:
            targets = list(self._reqs.values())
        else:
            req = self._reqs.get(rid) if rid else None
            targets = [req] if req is not None else []
        for req in targets:
            message = "Abort in waiting queue" if req.phase in _QUEUED_PHASES else "Aborted"
            self._finish(req, finish_abort(message))
            self.metrics.num_aborted_requests.inc()
        if targets:
            self._kick()
        return len(targets)

    # ------------------------------------------------------------------------------------------------
    # finishing
    def _detach(self, req: SimRequest) -> None:
        """Take the request out of whatever queue its phase says it is in."""
        phase = req.phase
        if phase is Phase.INTAKE:
            self._intake.remove(req)
        elif phase is Phase.BOOTSTRAP:
            self._bootstrap.pop(req.rid, None)
        elif phase is Phase.WAITING:
            self._waiting.remove(req)
        elif phase is Phase.PREFILLING:
            self._prefilling.remove(req)
        elif phase is Phase.INFLIGHT:
            self._inflight.pop(req.rid, None)
        elif phase is Phase.PREALLOC:
            self._prealloc.remove(req)
        elif phase is Phase.TRANSFER:
            self._transfer.pop(req.rid, None)
        elif phase is Phase.READY:
            self._ready.remove(req)
        elif phase is Phase.RUNNING:
            self._running.remove(req)
        elif phase is Phase.RETRACTED:
            self._retracted.remove(req)

    def _finish(self, req: SimRequest, reason: dict[str, Any], *, detach: bool = True) -> None:
        if req.finish is not None:
            return
        if detach:
            self._detach(req)
        was_prefill_req = req.phase in (Phase.BOOTSTRAP, Phase.WAITING, Phase.PREFILLING, Phase.INFLIGHT) and (
            self.mode == "prefill")
        if req.phase is Phase.PREALLOC and req.bootstrap_host and req.bootstrap_room is not None and (
                self._client is not None and not self._stopping):
            # Dropped before claiming its room: tell the prefill peer now rather than let it time out.
            port = req.bootstrap_port if req.bootstrap_port is not None else self.settings.resolved_bootstrap_port()
            self._spawn(release_kv(self._client, req.bootstrap_host, port, req.bootstrap_room, {"outcome": "abort"}))
        self.kv.release(req)
        req.finish = reason
        req.phase = Phase.FINISHED
        if req.timer is not None:
            req.timer.cancel()
            req.timer = None
        task = req.handoff_task
        if task is not None and task is not asyncio.current_task() and not task.done():
            task.cancel()
        self._reqs.pop(req.rid, None)
        now = time.monotonic()
        if self.mode == "prefill" and req.output_ids and req.first_token_s is not None:
            self.metrics.first_token(req, now)  # the prefill's first output reaches the client only now
        self.metrics.finished(req, now)
        if was_prefill_req and req.bootstrap_room is not None and reason["type"] == "abort":
            self.rooms.request_gone(req, reason["message"], self.settings.bootstrap_timeout_s)
        req.notify()
        if not self._reqs:
            self._idle.set()
        self._kick()  # KV was freed: queued requests may fit now

    def _fail(self, req: SimRequest, message: str, status: HTTPStatus, *, detach: bool = True) -> None:
        log.warning("%s", message)
        self._finish(req, finish_abort(message, status), detach=detach)

    # -- prefill-side handoff hooks (called by RoomRegistry / timers) --------------------------------
    def room_claimed(self, req: SimRequest) -> None:
        if req.phase is not Phase.BOOTSTRAP:
            return
        self._bootstrap.pop(req.rid, None)
        if req.timer is not None:
            req.timer.cancel()
            req.timer = None
        req.phase = Phase.WAITING
        self._waiting.append(req)
        self._kick()

    def _bootstrap_timed_out(self, req: SimRequest) -> None:
        req.timer = None
        if req.phase is not Phase.BOOTSTRAP:
            return
        self.metrics.num_bootstrap_failed_reqs.inc()
        self._fail(req, f"Prefill bootstrap failed for request rank=0 req.rid={req.rid!r} "
                        f"req.bootstrap_room={req.bootstrap_room} with exception no decode peer claimed the room "
                        f"within {self.settings.bootstrap_timeout_s:g}s", HTTPStatus.INTERNAL_SERVER_ERROR)

    def transfer_done(self, req: SimRequest, transfer_ms: float | None, nbytes: int | None) -> None:
        if req.phase is not Phase.INFLIGHT:
            return
        if transfer_ms is not None:
            speed = (nbytes / transfer_ms / 1e6) if nbytes and transfer_ms > 0 else None
            self.metrics.kv_transfer(transfer_ms, speed)
            self.last_kv_transfer_ms = float(transfer_ms)
            if speed is not None:
                self.last_kv_transfer_gb_s = speed
        if req.first_token_id is not None:  # the first token reaches the prefill's client only now, as in SGLang
            req.output_ids.append(req.first_token_id)
        self._finish(req, finish_length(0))  # SGLang's prefill: FINISH_LENGTH(length=0) once the KV is sent

    def transfer_failed(self, req: SimRequest, message: str) -> None:
        if req.finished:
            return
        self.metrics.num_transfer_failed_reqs.inc()
        self._fail(req, f"Prefill transfer failed for request rank=0 req.rid={req.rid!r} "
                        f"req.bootstrap_room={req.bootstrap_room} with exception {message}",
                   HTTPStatus.INTERNAL_SERVER_ERROR)

    def _release_timed_out(self, req: SimRequest) -> None:
        req.timer = None
        if req.phase is Phase.INFLIGHT:
            self.transfer_failed(req, f"the decode side did not release the KV within "
                                      f"{self.settings.bootstrap_timeout_s:g}s")

    # -- decode-side KV pull ---------------------------------------------------------------------------
    async def _pull(self, req: SimRequest) -> None:
        host = req.bootstrap_host
        port = req.bootstrap_port if req.bootstrap_port is not None else self.settings.resolved_bootstrap_port()
        room = req.bootstrap_room
        assert room is not None and self._client is not None
        client = self._client
        try:
            if not host:
                raise HandoffError("handshake", "the request has no bootstrap_host")
            info = await pull_kv(client, host, port, room, self.settings.bootstrap_timeout_s)
            self.metrics.kv_transfer_bootstrap_ms.observe(info["bootstrap_ms"])
            nbytes = self.latency.kv_bytes(req.prompt_tokens)
            transfer_s = self.latency.kv_transfer_time_s(req.prompt_tokens)
            await asyncio.sleep(transfer_s)
        except Exception as exc:  # HandoffError, or anything unexpected: the request must not hang in TRANSFER
            if not isinstance(exc, HandoffError):
                log.exception("KV pull for %s failed unexpectedly", req.rid)
                exc = HandoffError("transfer", repr(exc))
            if req.phase is Phase.TRANSFER:
                if exc.kind == "handshake":
                    self.metrics.num_bootstrap_failed_reqs.inc()
                    what = "handshake"
                else:
                    self.metrics.num_transfer_failed_reqs.inc()
                    what = "transfer"
                self._fail(req, f"Decode {what} failed for request rank=0 decode_req.req.rid={req.rid!r} "
                                f"decode_req.req.bootstrap_room={room} with exception {exc}",
                           HTTPStatus.INTERNAL_SERVER_ERROR)
            return
        except asyncio.CancelledError:
            if host and not self._stopping:  # aborted here: tell the prefill to drop its side
                self._spawn(release_kv(client, host, port, room, {"outcome": "abort"}))
            raise
        if req.phase is not Phase.TRANSFER:
            return
        transfer_ms = transfer_s * 1000.0
        speed = nbytes / transfer_s / 1e9 if transfer_s > 0 else None
        self.metrics.kv_transfer(transfer_ms, speed)
        self.last_kv_transfer_ms = transfer_ms
        if speed is not None:
            self.last_kv_transfer_gb_s = speed
        # Release in the background: the prefill learns of the finished transfer in parallel, as with Mooncake.
        self._spawn(release_kv(client, host, port, room, {"outcome": "ok", "transfer_ms": transfer_ms,
                                                          "bytes": nbytes}))
        self._transfer.pop(req.rid, None)
        req.handoff_task = None
        req.phase = Phase.READY
        req.first_token_id = int(info["first_token_id"])
        self._ready.append(req)
        self._kick()

    # ------------------------------------------------------------------------------------------------
    # the scheduler
    async def _run(self) -> None:
        try:
            while True:
                self._wake.clear()
                if self._paused or self._switching:
                    await self._wake.wait()
                    continue
                self._take_intake()
                step = self._plan()
                if step is None:
                    self._prev_deadline = 0.0
                    await self._wake.wait()
                    continue
                now = time.monotonic()
                start = self._prev_deadline if now - self._prev_deadline < CATCH_UP_SLACK_S else now
                deadline = start + step.time_s
                self._prev_deadline = deadline
                await asyncio.sleep(max(0.0, deadline - now))
                self._apply(step)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("engine_sim scheduler crashed")
            self._unhealthy = True
            raise

    def _take_intake(self) -> None:
        """Requests received since the last step enter their role's first queue (SGLang's recv_requests)."""
        while self._intake:
            req = self._intake.popleft()
            # Already out of the intake queue and in no other: failures below must not detach.
            if req.prompt_tokens > self.capacity:
                self._fail(req, f"Request {req.rid} exceeds the maximum number of tokens: "
                                f"{req.prompt_tokens} > {self.capacity}", HTTPStatus.BAD_REQUEST, detach=False)
                continue
            if self.mode == "null":
                req.phase = Phase.WAITING
                self._waiting.append(req)
                continue
            if req.bootstrap_room is None:
                self._fail(req, "Invalid request: Disaggregated request received without bootstrap room id. "
                                f"req.rid={req.rid!r}", HTTPStatus.BAD_REQUEST, detach=False)
                continue
            if self.mode == "prefill":
                problem = self.rooms.attach(req)
                if problem is not None:
                    status = HTTPStatus.BAD_REQUEST if problem.startswith("Duplicate") else (
                        HTTPStatus.INTERNAL_SERVER_ERROR)
                    self._fail(req, problem, status, detach=False)
                    continue
                if self.rooms.is_claimed(req.bootstrap_room):
                    req.phase = Phase.WAITING
                    self._waiting.append(req)
                else:
                    req.phase = Phase.BOOTSTRAP
                    self._bootstrap[req.rid] = req
                    req.timer = asyncio.get_running_loop().call_later(
                        self.settings.bootstrap_timeout_s, self._bootstrap_timed_out, req)
            else:  # decode
                req.phase = Phase.PREALLOC
                self._prealloc.append(req)

    def _plan(self) -> Step | None:
        if self.mode == "prefill":
            return self._plan_prefill()
        if self.mode == "decode":
            return self._plan_decode()
        return self._plan_null()

    def _apply(self, step: Step) -> None:
        now = time.monotonic()
        generated = 0
        for req in step.decode:
            if req.phase is Phase.RUNNING:
                self._emit(req, now)
                generated += 1
        for req, n in step.prefill:
            if req.phase is Phase.PREFILLING:
                generated += self._advance_prefill(req, n, now)
        if step.decode:
            self._running = [r for r in self._running if r.phase is Phase.RUNNING]
        step_us = int(step.time_s * 1e6)
        if step.prefill:
            self.total_prefill_busy_us += step_us
        elif step.decode:
            b, t, m = float(len(step.decode)), float(step_us), self.decode_moments
            m[0] += 1.0
            m[1] += b
            m[2] += t
            m[3] += b * b
            m[4] += b * t
            m[5] += float(generated)
        self.window.record(now, generated, step.time_s)

    # -- batch formation per mode ----------------------------------------------------------------------
    def _admit(self, req: SimRequest, reserve: int, now: float) -> None:
        self.kv.admit(req, req.prefill_len, reserve)
        req.phase = Phase.PREFILLING
        self._prefilling.append(req)
        if req.admitted_s is None:
            req.admitted_s = now
            self.metrics.queue_time.observe(now - req.arrival_s)

    def _decode_reserve(self, req: SimRequest) -> int:
        """Output KV set aside at admission: min(remaining output, num_reserved_decode_tokens), at least 1 while
        any output remains (so the first token never has to wait for KV). submit() caps max_new_tokens at
        capacity - prompt, so a request alone always fits."""
        remaining = req.max_new_tokens - len(req.output_ids)
        if remaining <= 0:
            return 0
        return max(1, min(remaining, self.settings.num_reserved_decode_tokens))

    def _prefill_parts(self, budget: int, reserve_for: Callable[[SimRequest], int], headroom: int,
                       max_admitted: int) -> list[tuple[SimRequest, int]]:
        """Continue the chunked request(s), then admit waiting requests FCFS while budget and KV allow."""
        now = time.monotonic()
        parts: list[tuple[SimRequest, int]] = []
        for req in self._prefilling:
            if budget <= 0:
                break
            n = min(req.prefill_len - req.prefilled, budget)
            parts.append((req, n))
            budget -= n
        while budget > 0 and self._waiting and len(self._prefilling) < max_admitted:
            req = self._waiting[0]
            reserve = reserve_for(req)
            if not self.kv.fits(reserve + headroom):
                break  # FCFS: the head of the queue waits for KV, and so does everyone behind it
            self._waiting.popleft()
            self._admit(req, reserve, now)
            n = min(req.prefill_len, budget)
            parts.append((req, n))
            budget -= n
        return parts

    def _plan_prefill(self) -> Step | None:
        parts = self._prefill_parts(self.chunk_size, lambda r: r.prefill_len, 0, self.max_running)
        if not parts:
            return None
        return Step(self.latency.prefill_batch_time_s([(n, r.prefilled) for r, n in parts]), parts, [])

    def _plan_decode(self) -> Step | None:
        now = time.monotonic()
        # New admissions leave the running batch the KV its next step grows by (else they would force retracts).
        growth = sum(1 for r in self._running if self.kv.needs_growth(r))
        self._resume_retracted(growth)
        self._admit_prealloc(now, growth)
        self._join_ready(now)
        self._ensure_growth()
        if not self._running:
            return None
        running = list(self._running)
        ctx = sum(r.prompt_tokens + len(r.output_ids) for r in running)
        return Step(self.latency.decode_step_time_s(len(running), ctx), [], running)

    def _plan_null(self) -> Step | None:
        growth = self._ensure_growth()
        budget = max(0, self.chunk_size - len(self._running))
        max_admitted = max(0, self.max_running - len(self._running))
        parts = self._prefill_parts(budget, lambda r: r.prefill_len + self._decode_reserve(r), growth,
                                    max_admitted)
        if not parts and not self._running:
            return None
        running = list(self._running)
        ctx = sum(r.prompt_tokens + len(r.output_ids) for r in running)
        t = self.latency.mixed_step_time_s(len(running), ctx, [(n, r.prefilled) for r, n in parts])
        return Step(t, parts, running)

    def _admit_prealloc(self, now: float, headroom: int = 0) -> None:
        # The request-slot pool bounds how many requests hold decode KV at once (~2x the running batch).
        if self._retracted:
            return  # retracted requests get the KV back first (SGLang resumes them before new preallocations)
        slots = 2 * self.max_running - len(self._running) - len(self._transfer) - len(self._ready)
        while self._prealloc and slots > 0:
            req = self._prealloc[0]
            reserve = req.prompt_tokens + self._decode_reserve(req)
            if not self.kv.fits(reserve + headroom):
                break
            self._prealloc.popleft()
            self.kv.admit(req, req.prompt_tokens, reserve)
            req.admitted_s = now
            self.metrics.queue_time.observe(now - req.arrival_s)
            req.phase = Phase.TRANSFER
            self._transfer[req.rid] = req
            req.handoff_task = asyncio.create_task(self._pull(req))
            slots -= 1

    def _join_ready(self, now: float) -> None:
        while self._ready and len(self._running) < self.max_running:
            req = self._ready.popleft()
            req.phase = Phase.RUNNING
            self._running.append(req)
            first = req.first_token_id
            if req.max_new_tokens == 0 or first is None:
                self._finish(req, finish_length(0))
                continue
            req.tokens.skip(1)  # the prefill produced id #0 of this rid's sequence
            self._emit(req, now, first)

    def _resume_retracted(self, headroom: int = 0) -> None:
        while self._retracted and len(self._running) < self.max_running:
            req = self._retracted[0]
            reserve = req.context_tokens + self._decode_reserve(req)
            if not self.kv.fits(reserve + headroom):
                break
            self._retracted.popleft()
            self.kv.admit(req, req.context_tokens, reserve)
            req.phase = Phase.RUNNING
            self._running.append(req)

    def _ensure_growth(self) -> int:
        """Make room for one more token per running request, retracting the newest if KV runs short.

        Returns how many free tokens this step's growth will take (admission must leave them alone).
        """
        need = sum(1 for r in self._running if self.kv.needs_growth(r))
        while need > self.kv.free and self._running:
            victim = self._running.pop()
            if self.kv.needs_growth(victim):
                need -= 1
            self._retract(victim)
        return need

    def _retract(self, req: SimRequest) -> None:
        self.kv.release(req)
        req.num_retractions += 1
        self.num_retracted_total += 1
        self.metrics.num_retracted_requests_total.inc()
        if self.mode == "null":
            req.phase = Phase.WAITING
            req.prefill_len = req.context_tokens
            req.prefilled = 0
            req.recompute = True
            self._waiting.appendleft(req)
        else:
            req.phase = Phase.RETRACTED
            self._retracted.append(req)

    # -- effects of a step -----------------------------------------------------------------------------
    def _advance_prefill(self, req: SimRequest, n: int, now: float) -> int:
        """Returns the number of tokens generated (1 when a prefill completes with a first token)."""
        req.prefilled += n
        self.total_prefill_tokens += n
        if req.prefilled < req.prefill_len:
            return 0
        self._prefilling.remove(req)
        if self.mode == "prefill":
            token = self._next_token(req)
            req.first_token_id = token
            req.first_token_s = req.last_token_s = now
            req.prefill_done_unix_s = time.time()
            req.phase = Phase.INFLIGHT
            self._inflight[req.rid] = req
            self.rooms.prefill_done(req, token, self.latency.kv_bytes(req.prompt_tokens))
            req.timer = asyncio.get_running_loop().call_later(
                self.settings.bootstrap_timeout_s, self._release_timed_out, req)
            return 1
        req.phase = Phase.RUNNING
        self._running.append(req)
        if req.recompute:  # back from a retraction: its output is already out
            req.recompute = False
            return 0
        if req.max_new_tokens == 0:
            self._finish(req, finish_length(0))
            return 0
        self._emit(req, now)
        return 1

    def _next_token(self, req: SimRequest) -> int:
        if not req.ignore_eos and len(req.output_ids) + 1 == req.stop_after < req.max_new_tokens:
            return EOS_TOKEN_ID
        assert req.tokens is not None
        return req.tokens.next()

    def _emit(self, req: SimRequest, now: float, token: int | None = None) -> None:
        """One output token: KV grows by one, the reader wakes, and the request may finish."""
        req.output_ids.append(self._next_token(req) if token is None else token)
        self.kv.grow(req, 1)
        if req.first_token_s is None:
            req.first_token_s = now
            self.metrics.first_token(req, now)
        req.last_token_s = now
        n = len(req.output_ids)
        if n >= req.stop_after:
            if n < req.max_new_tokens and req.output_ids[-1] == EOS_TOKEN_ID:
                reason = finish_stop(EOS_TOKEN_ID)
            else:
                reason = finish_length(req.max_new_tokens)
            # The caller filters the running list after the step; joins remove the request themselves.
            if req.phase is Phase.RUNNING:
                self._finish(req, reason, detach=False)
                if self._running and self._running[-1] is req:
                    self._running.pop()
            else:
                self._finish(req, reason)
        elif req.stream:  # a non-streaming reader only cares about the finish (_finish notifies it)
            req.event.set()

    # ------------------------------------------------------------------------------------------------
    # control endpoints
    def is_idle(self) -> bool:
        """SGLang's is_fully_idle: nothing queued, running, transferring, or holding KV for a peer."""
        return not self._reqs and not self.rooms.busy()

    async def wait_idle(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return self.is_idle()

    async def pd_role_switch(self, new_role: str | None, prepare_only: bool = False) -> RoleSwitchResult:
        """Preconditions and messages in SGLang's order (tokenizer_control_mixin.pd_role_switch, then
        role_switch._reject_reason and handle_pd_role_switch)."""
        old = self.mode
        requested = new_role or ""
        if not self.settings.enable_pd_role_switch:
            return RoleSwitchResult(False, "--enable-pd-role-switch is not set on this server", old, requested, True)
        role = requested.lower()

        def fail(message: str, safe: bool) -> RoleSwitchResult:
            log.warning("PD role switch rejected (%s -> %s): %s", old, role, message)
            return RoleSwitchResult(False, message, old, requested, safe)

        if self._unhealthy:
            return fail("instance is unhealthy after a failed role switch; restart required", False)
        if self._switching:
            return fail("another role switch is already in progress", False)
        if role not in ("prefill", "decode"):
            return fail(f"invalid new_role={role!r}", True)
        if old == "null":
            return fail("instance is not running in PD disaggregation mode", True)
        if role == old:
            return RoleSwitchResult(True, "ready" if prepare_only else "ok", old, requested, False)
        if not self.is_idle():
            return fail("instance is not idle; drain all requests before switching", True)
        if prepare_only:
            return RoleSwitchResult(True, "ready", old, requested, True)
        self._switching = True
        try:
            await asyncio.sleep(self.latency.role_switch_time_s())  # teardown, rebuild, graph capture
            if role == "decode":
                await self._stop_bootstrap()
            else:
                await self._start_bootstrap()
            self.mode = role  # type: ignore[assignment]
            self._prev_deadline = 0.0
        except Exception as exc:
            self._unhealthy = True
            log.critical("PD role switch (%s -> %s) failed; instance unhealthy: %r", old, role, exc)
            return fail(f"role switch failed; instance unhealthy, restart required: {exc}", False)
        finally:
            self._switching = False
            self._kick()
        log.info("PD role switch succeeded: %s -> %s", old, role)
        return RoleSwitchResult(True, "ok", old, requested, False)

    def pause(self, mode: str) -> None:
        """SGLang's pause_generation. ``abort`` aborts everything then pauses; ``in_place`` stops taking steps
        and keeps requests and KV. ``retract`` is treated as ``in_place`` (nothing is sent back to the queue)."""
        if mode == "abort":
            self.abort(abort_all=True)
        self._paused = True

    def resume(self) -> None:
        self._paused = False
        self._kick()

    @property
    def paused(self) -> bool:
        return self._paused

    async def flush_cache(self, timeout_s: float = 0.0) -> bool:
        """engine_sim has no prefix cache; like SGLang, a flush only succeeds when the engine is idle."""
        if self.is_idle():
            return True
        if timeout_s > 0:
            return await self.wait_idle(timeout_s)
        return False

    # ------------------------------------------------------------------------------------------------
    # load and info
    def _queue_counts(self) -> dict[str, int]:
        return {
            "intake": len(self._intake), "bootstrap": len(self._bootstrap), "waiting": len(self._waiting),
            "prefilling": len(self._prefilling), "inflight": len(self._inflight), "prealloc": len(self._prealloc),
            "transfer": len(self._transfer), "ready": len(self._ready), "running": len(self._running),
            "retracted": len(self._retracted),
        }

    def num_running_reqs(self) -> int:
        # A prefill engine has no decode batch; its running requests are the ones being prefilled.
        return len(self._prefilling) if self.mode == "prefill" else len(self._running)

    def num_queue_reqs(self) -> int:
        """SGLang's num_queue_reqs: the scheduler's waiting queue (PD queues are separate gauges)."""
        return len(self._intake) + len(self._waiting) + len(self._ready)

    def load_snapshot(self) -> dict[str, Any]:
        """One LoadSnapshot (sglang/srt/managers/load_snapshot.py) as LoadSnapshot.to_dict() renders it."""
        now = time.monotonic()
        mode = self.mode
        pending = [*self._intake, *self._waiting]
        if mode == "prefill":
            pending += list(self._bootstrap.values())
            num_waiting = len(pending)
        elif mode == "decode":
            num_waiting = len(self._intake) + len(self._ready) + len(self._prealloc) + len(self._transfer) + len(
                self._retracted)
        else:
            num_waiting = len(pending)
        uncached = sum(r.prefill_len - r.prefilled for r in (*pending, *self._prefilling))
        if mode == "decode":
            pending_tokens = sum(r.prompt_tokens for r in self._intake) + sum(
                r.context_tokens for r in (*self._prealloc, *self._retracted))
            awaiting_kv = sum(r.prompt_tokens for r in (*self._prealloc, *self._transfer.values()))
            uncached = 0
        else:
            pending_tokens = sum(r.prefill_len for r in pending)
            awaiting_kv = 0
        total_tokens = self.kv.used + pending_tokens
        tps, util = self.window.rates(now)
        moments = list(self.decode_moments) if self.decode_moments[0] > 0 else None
        kv_gb = self.capacity * self.profile.kv_bytes_per_token / 1e9
        return {
            "timestamp": time.time(),
            "dp_rank": 0,
            "num_running_reqs": self.num_running_reqs(),
            "num_waiting_reqs": num_waiting,
            "num_waiting_uncached_tokens": uncached,
            "num_used_tokens": self.kv.used,
            "num_total_tokens": total_tokens,
            "num_active_tokens": max(0, total_tokens - awaiting_kv),
            "num_prealloc_ready_tokens": 0,
            "max_total_num_tokens": self.capacity,
            "max_running_requests": self.max_running,
            "token_usage": round(self.kv.usage, 4),
            "gen_throughput": round(tps, 2),
            "cache_hit_rate": 0.0,
            "utilization": round(util, 4),
            "total_prefill_uncached_tokens": self.total_prefill_tokens,
            "total_prefill_busy_us": self.total_prefill_busy_us,
            "decode_moments": moments,
            "memory": {"weight_gb": 0.0, "kv_cache_gb": round(kv_gb, 3), "graph_gb": 0.0,
                       "token_capacity": self.capacity},
            "disaggregation": {
                "mode": mode,
                "prefill_bootstrap_queue_reqs": len(self._bootstrap),
                "prefill_inflight_queue_reqs": len(self._inflight),
                "decode_prealloc_queue_reqs": len(self._prealloc),
                "decode_transfer_queue_reqs": len(self._transfer),
                "decode_retracted_queue_reqs": len(self._retracted),
                "kv_transfer_speed_gb_s": round(self.last_kv_transfer_gb_s, 3),
                "kv_transfer_latency_ms": round(self.last_kv_transfer_ms, 3),
            },
            "queues": {"waiting": self.num_queue_reqs(), "grammar": 0, "paused": 0,
                       "retracted": len(self._retracted), "prealloc_ready": 0},
        }

    def gauges(self) -> dict[str, float]:
        """Values for the scheduler-side gauges, refreshed at each /metrics scrape."""
        tps, util = self.window.rates(time.monotonic())
        return {
            "num_running_reqs": self.num_running_reqs(),
            "num_queue_reqs": self.num_queue_reqs(),
            "num_grammar_queue_reqs": 0,
            "gen_throughput": tps,
            "cache_hit_rate": 0.0,
            "token_usage": self.kv.usage,
            "num_used_tokens": self.kv.used,
            "kv_used_tokens": self.kv.used,
            "kv_available_tokens": self.capacity - self.kv.used,
            "max_total_num_tokens": self.capacity,
            "utilization": util,
            "num_retracted_reqs": len(self._retracted),
            "num_paused_reqs": 0,
            "num_prefill_bootstrap_queue_reqs": len(self._bootstrap),
            "num_prefill_inflight_queue_reqs": len(self._inflight),
            "num_decode_prealloc_queue_reqs": len(self._prealloc),
            "num_decode_transfer_queue_reqs": len(self._transfer),
        }

    def model_info(self) -> dict[str, Any]:
        """GET /model_info (sglang/srt/entrypoints/http_server.py model_info)."""
        name = self.settings.served_model_name
        llama = "llama" in self.profile.model.lower()
        return {
            "model_path": name,
            "served_model_name": name,
            "tokenizer_path": name,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "load_format": "auto",
            "reasoning_parser": None,
            "tool_call_parser": None,
            "disaggregation_mode": self.mode,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": "llama" if llama else None,
            "architectures": ["LlamaForCausalLM"] if llama else None,
        }

    def server_info(self) -> dict[str, Any]:
        """GET /server_info: SGLang's resolved server args (the fields Poise reads) plus what this engine is."""
        s = self.settings
        p = self.profile
        tps, _ = self.window.rates(time.monotonic())
        return {
            "engine": ENGINE_NAME,
            "emulated_model": p.model,
            "gpu_profile": {"name": p.name, "model": p.model, "gpu": p.gpu, "tp": p.tp, "source": s.profile,
                            "time_scale": s.time_scale},
            "instance_id": s.instance_id,
            "model_path": s.served_model_name,
            "served_model_name": s.served_model_name,
            "tokenizer_path": s.served_model_name,
            "host": s.host,
            "port": s.port,
            "context_length": s.context_length,
            "disaggregation_mode": self.mode,
            "disaggregation_bootstrap_port": s.resolved_bootstrap_port(),
            "disaggregation_transfer_backend": "poise-sim",
            "disaggregation_decode_allocation_policy": "early",
            "enable_pd_role_switch": s.enable_pd_role_switch,
            "enable_metrics": True,
            "schedule_policy": "fcfs",
            "max_running_requests": self.max_running,
            "max_total_num_tokens": self.capacity,
            "chunked_prefill_size": self.chunk_size,
            "num_reserved_decode_tokens": s.num_reserved_decode_tokens,
            "tp_size": p.tp,
            "dp_size": 1,
            "pp_size": 1,
            "random_seed": s.seed,
            "time_scale": s.time_scale,
            "mean_output_tokens": s.mean_output_tokens,
            "bootstrap_timeout_s": s.bootstrap_timeout_s,
            "launch_command": " ".join(sys.argv),
            "startup_time": self.startup_unix_s,
            "startup_time_iso": datetime.fromtimestamp(self.startup_unix_s, UTC).isoformat(),
            "internal_states": [{
                "last_gen_throughput": round(tps, 2),
                "disaggregation_mode": self.mode,
                "paused": self._paused,
                "max_total_num_tokens": self.capacity,
                "max_running_requests": self.max_running,
            }],
            "version": SGLANG_API_VERSION,
            "frontend": "python",
        }
