"""SimEngine: SGLang's scheduler semantics on an asyncio loop, timed by the latency model in real time.

One scheduler task runs forward "steps" back to back. Between steps it takes new requests in and forms the
next batch (as SGLang's scheduler does between forward passes); a step then lasts the latency model's time
for that batch (``await asyncio.sleep(step_s)``; at ``time_scale`` 0 a step is ``sleep(0)``), and its
effects (prefill progress, one token per decoding request) land when it ends. With nothing to compute the
task waits on an ``asyncio.Event``, so an idle engine costs nothing.

This module holds the engine's state, its lifecycle, requests in and out (submit, outputs, abort, finishing),
the scheduler loop and pause. The rest is split by concern into plain functions over the engine:

- batching.py: what the engine model's steps (``shared.engine.model``: queues, KV, retraction, the prefix
  cache, prefill passes and decode batches, the same code the simulator runs) mean for live requests;
- transfer.py: what the P→D handoff does to requests (room hooks, timeouts, the decode-side KV pull);
- role_switch.py: POST /pd_role_switch;
- reports.py: /v1/loads, the /metrics gauges, /model_info, /server_info;
- queues.py: the per-phase queues they all share;
- engine_state.py: the engine as those modules see it (a Protocol this class satisfies), so none imports this one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Coroutine
from http import HTTPStatus
from typing import Any

from services.engine_sim import batching, clock, reports, role_switch, transfer
from services.engine_sim.admission import EngineRequestError, draw_answer, output_limit
from services.engine_sim.batching import Step
from services.engine_sim.config import EngineSimSettings, Mode
from services.engine_sim.handoff import BootstrapServer, RoomRegistry, create_bootstrap_app, release_kv
from services.engine_sim.heartbeat import Heartbeat
from services.engine_sim.metrics import EngineMetrics, ThroughputWindow
from services.engine_sim.queues import QUEUED_PHASES, RequestQueues
from services.engine_sim.reports import ENGINE_NAME, SGLANG_API_VERSION
from services.engine_sim.requests import Phase, SimRequest, finish_abort
from services.engine_sim.role_switch import RoleSwitchResult
from shared.engine.model import EngineModel
from shared.engine_client import engine_auth_headers
from shared.http1 import Http1Pool
from shared.latency import LatencyModel, LatencyProfile, load_profile
from shared.policies import DecodeBatchPolicy, PrefillPolicy, RequestView
from shared.policies.length import LengthPredictor, make_length_predictor
from shared.policies.prefill_order import MAX_PREFILL_TOKENS
from shared.protocol.request_resume import RequestResume
from shared.protocol.request_slo import RequestSlo

# Re-exported: app.py, __init__.py and older imports take these names from engine.py.
__all__ = ["CATCH_UP_SLACK_S", "ENGINE_NAME", "SGLANG_API_VERSION", "EngineRequestError", "RoleSwitchResult",
           "SimEngine", "Step"]

log = logging.getLogger(__name__)

CATCH_UP_SLACK_S = 0.010  # a step that starts this soon after the last one ended absorbs the loop's lateness


class SimEngine:
    """The engine's state, shared with the helper modules (batching, transfer, role_switch, reports):

    - configuration: ``settings``, ``profile``, ``latency``, ``capacity``, ``max_running``, ``chunk_size``
      (a prefill pass's token budget) and ``chunked``, ``preemption``; ``mode`` changes only on a role switch;
    - ``core``, the engine model (``shared.engine.model``: the scheduling queues, KV and prefix cache, the
      engine policies ``prefill_policy`` and ``decode_policy``), and the arrivals operator preemption watches
      (``prefill_arrivals``, ``last_prefill_arrival_s``, ``num_prefill_preemptions``);
    - ``queues`` (every live request, by phase), ``rooms`` (prefill side of the handoff),
      ``client`` (the keep-alive pool for KV pulls/releases, set while started), ``metrics``, ``window``;
    - flags: ``stopping`` (no new requests, no abort notices to peers), ``switching`` (a role switch is in
      progress: no steps), ``unhealthy`` (the scheduler crashed or a role switch failed), ``frozen`` (a
      fault injected on SIGUSR1: the scheduler takes no steps while the HTTP server answers, as with a hung
      kernel);
    - the /v1/loads counters (``total_prefill_tokens`` ... ``num_retracted_total``), written by batching.py
      and transfer.py.

    Everything else (the scheduler task, its wake/idle events, pause, background tasks) is private here.
    """

    def __init__(self, settings: EngineSimSettings, *, profile: LatencyProfile | None = None) -> None:
        self.settings = settings
        self.profile = profile if profile is not None else load_profile(settings.profile)
        self.latency = LatencyModel(self.profile, settings.time_scale)
        self.capacity = settings.kv_capacity_tokens or self.profile.kv_capacity_tokens
        self.max_running = settings.max_running_requests or self.profile.max_running_requests
        # The engine model the simulator's engines run too, with SGLang's KV model (decode KV grows per token,
        # retracts when full; colocated engines too) and its radix cache unless --disable-radix-cache.
        # chunked_prefill_size -1: no chunking (whole prompts, batched up to --max-prefill-tokens).
        self.core = EngineModel(
            settings.mode, self.latency, prefill_policy=settings.prefill_policy,
            decode_policy=settings.decode_policy, preemption=settings.preemption,
            chunk_tokens=settings.chunked_prefill_size, decode_kv="grow", colocated_kv="grow",
            reserved_decode_tokens=settings.num_reserved_decode_tokens,
            prefix_cache=not settings.disable_radix_cache, kv_capacity=self.capacity, max_running=self.max_running,
            mixed_chunk_tokens=MAX_PREFILL_TOKENS if settings.chunked_prefill_size == -1 else None,
            give_up_late=settings.give_up_late_prompts)
        self.chunked = self.core.chunked
        self.chunk_size = self.core.chunk  # the prefill token budget of a pass
        self.length_predictor: LengthPredictor | None = (
            None if settings.length_predictor == "none" else make_length_predictor(settings.length_predictor))
        self.preemption = settings.preemption
        # The prompts that entered the waiting queue (operator preemption re-plans on those).
        self.prefill_arrivals = 0
        self.last_prefill_arrival_s = 0.0
        self.num_prefill_preemptions = 0
        self.metrics = EngineMetrics(model_name=settings.served_model_name, mode=settings.mode,
                                     role_switch_enabled=settings.enable_pd_role_switch)
        self.window = ThroughputWindow()
        self.rooms = RoomRegistry(self)
        self.bootstrap_port: int | None = None  # where the bootstrap server listens, while prefill

        self._reqs: dict[str, SimRequest] = {}  # every live request
        self.queues = RequestQueues(self.core)

        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._paused = False
        self.switching = False
        self.frozen = False
        self.unhealthy = False
        self._heartbeat = Heartbeat()  # /health and the load snapshot's stamp read it
        self.stopping = False
        self._started = False
        self._task: asyncio.Task[None] | None = None
        self._bg: set[asyncio.Task[Any]] = set()
        self.client: Http1Pool | None = None
        self._bootstrap_server: BootstrapServer | None = None
        self._prev_deadline = 0.0
        self.startup_unix_s = time.time()
        # SGLang captures decode CUDA graphs at launch as decode, or at the first switch to decode, which must
        # then say how much memory they may take (decode_cuda_graph_memory_gb)
        self.decode_graphs = settings.mode == "decode"
        self.startup_s = 0.0  # creation to serving, set by start(): the whole of SGLang's startup_time phases

        # counters for /v1/loads
        self.total_prefill_tokens = 0
        self.total_prefill_busy_us = 0
        # Prompts prefilled alone in one step: (seq, tokens, seconds), for the gateway's TTFT predictor refit
        # (Arrow). A Poise extension of /v1/loads; SGLang reports no per-prompt prefill time.
        self.prefill_samples: deque[tuple[int, int, float]] = deque(maxlen=32)
        self.prefill_sample_seq = 0
        self.decode_moments = [0.0] * 6  # count, sum b, sum t_us, sum b^2, sum b*t, sum generated (SGLang's)
        self.last_kv_transfer_ms = 0.0
        self.last_kv_transfer_gb_s = 0.0
        self.num_retracted_total = 0

    @property
    def mode(self) -> Mode:
        return self.core.role

    @mode.setter
    def mode(self, mode: Mode) -> None:
        """A role switch: the model takes the new role with an empty prefix cache (as SGLang resets its radix
        cache on a switch)."""
        self.core.switch_role(mode)

    @property
    def prefill_policy(self) -> PrefillPolicy:
        return self.core.prefill_policy

    @property
    def decode_policy(self) -> DecodeBatchPolicy:
        return self.core.decode_policy

    # ------------------------------------------------------------------------------------------------
    # lifecycle
    async def start(self) -> None:
        if self._started:
            return
        # One keep-alive pool shared by every KV pull; a peer's HTTP API (a decode-to-decode KV copy) wants the
        # cluster's engine key, which every engine of a stack shares.
        self.client = Http1Pool(headers=engine_auth_headers(self.settings.api_key))
        if self.mode == "prefill":
            await self.start_bootstrap()
        self._task = asyncio.create_task(self._run(), name="engine-sim-scheduler")
        self._started = True
        self.startup_s = time.time() - self.startup_unix_s

    async def stop(self) -> None:
        if not self._started:
            return
        self.stopping = True
        for req in list(self._reqs.values()):
            self.finish_request(req, finish_abort("engine_sim is shutting down", HTTPStatus.SERVICE_UNAVAILABLE))
        self.rooms.fail_all("engine_sim is shutting down")
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for task in list(self._bg):
            task.cancel()
        if self._bg:
            await asyncio.wait(self._bg, timeout=2.0)
        await self.stop_bootstrap()
        if self.client is not None:
            await self.client.aclose()
        self._started = False

    @property
    def healthy(self) -> bool:
        return self._started and not self.unhealthy and self._task is not None and not self._task.done()

    async def start_bootstrap(self) -> None:
        port = self.settings.resolved_bootstrap_port()
        server = BootstrapServer(create_bootstrap_app(self.rooms), self.settings.host, port)
        await server.start()
        self._bootstrap_server = server
        self.bootstrap_port = server.port

    async def stop_bootstrap(self) -> None:
        if self._bootstrap_server is not None:
            self.rooms.fail_all("prefill role stopped")
            await self._bootstrap_server.stop()
            self._bootstrap_server = None
        self.bootstrap_port = None

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run a background task the engine cancels (and briefly awaits) on stop."""
        task = asyncio.create_task(coro)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    def enqueue_waiting(self, req: SimRequest) -> None:
        """A prompt enters the prefill waiting queue: an arrival for the prefill policy (an event-driven policy
        plans again; with operator preemption, a running pass re-plans and may be cut)."""
        self.core.add_prompts([req])
        self.prefill_arrivals += 1
        self.last_prefill_arrival_s = clock.monotonic()

    def kick(self) -> None:
        """Wake the scheduler: something it may act on changed (a request arrived, KV was freed, ...)."""
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
        slo: RequestSlo | None = None,
        stream_key: str | None = None,
        resume: RequestResume | None = None,
        predict_length: bool = False,
        local_prefill: bool = False,
        prefix_blocks: tuple[int, ...] = (),
        seed: int | None = None,
        stops: tuple[str, ...] = (),
    ) -> SimRequest:
        """Queue a request. Raises :class:`EngineRequestError` where SGLang's tokenizer manager would refuse it.

        ``slo`` (the ``poise_slo`` body field) sets the request's TTFT/TPOT targets for the engine policies and
        dates its arrival back by ``waited_s``, so TTFT deadlines count from the gateway's arrival.

        Output ids and the output length are drawn from ``stream_key`` (the prompt's digest; the rid when not
        given). ``resume`` (``poise_resume``) continues a request another engine started: the prompt grows by
        the tokens already generated (what a re-prefill would see) and the ids continue from that position.
        ``local_prefill`` (``poise_local_prefill``) has a decode engine prefill the prompt itself, with no
        prefill peer (DOPD's local prefill of ultra-short prompts); a colocated engine does that anyway.
        ``prefix_blocks`` (``shared.engine.prefix_blocks`` of the prompt) is what the prefix cache matches on; a
        resumed request's grown prompt is not matched. ``seed`` (the request's) draws them from the prompt and
        the seed alone, not the engine's seed; ``stops`` end the output where a stop string first appears
        (:mod:`services.engine_sim.stops`)."""
        if self.stopping:
            raise EngineRequestError("engine_sim is shutting down", status=503)
        rid = rid if rid is not None else uuid.uuid4().hex
        key = stream_key if stream_key is not None else rid
        done = resume.generated_tokens if resume is not None else 0
        if resume is not None and resume.kv_transfer and self.mode != "decode":
            raise EngineRequestError("poise_resume with a KV source needs a decode engine", status=409)
        if local_prefill and self.mode == "prefill":
            raise EngineRequestError("poise_local_prefill needs a decode (or colocated) engine, not a prefill engine",
                                     status=409)
        if rid in self._reqs:
            raise EngineRequestError(f"Duplicate request ID detected: {rid}")
        prompt_tokens = max(1, prompt_tokens) + done  # SGLang's tokenizer adds BOS: never an empty prompt
        max_new_tokens = output_limit(prompt_tokens, max_new_tokens, context_length=self.settings.context_length,
                                      capacity=self.capacity)
        answer = draw_answer(key, engine_seed=self.settings.seed, seed=seed, generated=done,
                             max_new_tokens=max_new_tokens, ignore_eos=ignore_eos,
                             mean_output_tokens=self.settings.mean_output_tokens, stops=stops)
        req = SimRequest(
            rid=rid, prompt_tokens=prompt_tokens, max_new_tokens=max_new_tokens, ignore_eos=ignore_eos,
            stream=stream, bootstrap_host=bootstrap_host, bootstrap_port=bootstrap_port,
            bootstrap_room=bootstrap_room, priority=priority, output_tokens=answer.output_tokens,
            tokens=answer.tokens, stops=stops, stop_match=answer.stop_match, uncut_tokens=answer.uncut_tokens,
        )
        if resume is not None and resume.kv_transfer:
            req.kv_source = (resume.kv_source_url or "", resume.kv_source_rid or "")
        req.resumed_from, req.stream_key = done, answer.key
        req.blocks = prefix_blocks if done == 0 else ()
        req.predict_length = predict_length and self.length_predictor is not None
        req.local_prefill = local_prefill and self.mode == "decode"
        if slo is not None:
            req.slo_class = slo.slo_class
            req.slo_ttft_s = math.inf if slo.ttft_s is None else slo.ttft_s
            req.slo_tpot_s = math.inf if slo.tpot_s is None else slo.tpot_s
            req.arrival_s = req.received_s - slo.waited_s
        self._reqs[rid] = req
        self._idle.clear()
        self.queues.intake.append(req)
        self.kick()
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

    def due_prediction(self, req: SimRequest) -> float | None:
        """The remaining-length prediction to put on the stream now, if one is due (every k-th token)."""
        if not req.predict_length or self.length_predictor is None:
            return None
        generated = req.resumed_from + len(req.output_ids)
        if generated < req.next_prediction_at or req.finished:
            return None
        k = self.settings.predict_every_tokens
        req.next_prediction_at = (generated // k + 1) * k
        view = RequestView(rid=req.stream_key, input_tokens=req.prompt_tokens - req.resumed_from,
                           max_output_tokens=req.resumed_from + req.max_new_tokens)
        return self.length_predictor.predict_remaining(view, generated, req.resumed_from + req.stop_after)

    def running_request(self, rid: str) -> SimRequest | None:
        """The request ``rid`` if it is decoding here (a KV copy can start from it)."""
        req = self._reqs.get(rid)
        return req if req is not None and req.phase in (Phase.RUNNING, Phase.RETRACTED) else None

    def abort(self, rid: str | None = None, abort_all: bool = False) -> int:
        """SGLang's /abort_request: end the request(s) wherever they are, free their KV. Returns how many."""
        if abort_all:
            targets = list(self._reqs.values())
        else:
            req = self._reqs.get(rid) if rid else None
            targets = [req] if req is not None else []
        for req in targets:
            message = "Abort in waiting queue" if req.phase in QUEUED_PHASES else "Aborted"
            self.finish_request(req, finish_abort(message))
            self.metrics.num_aborted_requests.inc()
        if targets:
            self.kick()
        return len(targets)

    # ------------------------------------------------------------------------------------------------
    # finishing
    def finish_request(self, req: SimRequest, reason: dict[str, Any], *, detach: bool = True) -> None:
        """End the request once (later calls are no-ops): out of its queue (unless the caller already took it
        out: ``detach=False``), KV freed, timers and its KV pull cancelled, peers told, reader woken."""
        if req.finish is not None:
            return
        was_prefill_req = req.phase in (Phase.BOOTSTRAP, Phase.WAITING, Phase.PREFILLING, Phase.INFLIGHT) and (
            self.mode == "prefill")
        if req.phase is Phase.PREALLOC and req.bootstrap_host and req.bootstrap_room is not None and (
                self.client is not None and not self.stopping):
            # Dropped before claiming its room: tell the prefill peer now rather than let it time out.
            port = req.bootstrap_port if req.bootstrap_port is not None else self.settings.resolved_bootstrap_port()
            self.spawn(release_kv(self.client, req.bootstrap_host, port, req.bootstrap_room, {"outcome": "abort"}))
        if detach:
            self.queues.detach(req, clock.monotonic())  # frees its KV and cache lock
        req.finish = reason
        req.phase = Phase.FINISHED
        if req.timer is not None:
            req.timer.cancel()
            req.timer = None
        task = req.handoff_task
        if task is not None and task is not asyncio.current_task() and not task.done():
            task.cancel()
        self._reqs.pop(req.rid, None)
        now = clock.monotonic()
        if self.mode == "prefill" and req.output_ids and req.first_token_s is not None:
            self.metrics.first_token(req, now)  # the prefill's first output reaches the client only now
        self.metrics.finished(req, now)
        if was_prefill_req and req.bootstrap_room is not None and reason["type"] == "abort":
            self.rooms.request_gone(req, reason["message"], self.settings.bootstrap_timeout_s)
        req.notify()
        if not self._reqs:
            self._idle.set()
        self.kick()  # KV was freed: queued requests may fit now

    def fail_request(self, req: SimRequest, message: str, status: HTTPStatus, *, detach: bool = True) -> None:
        log.warning("%s", message)
        self.finish_request(req, finish_abort(message, status), detach=detach)

    # -- prefill-side handoff hooks, called by RoomRegistry (the logic is in transfer.py) ----------------
    def room_claimed(self, req: SimRequest) -> None:
        transfer.room_claimed(self, req)

    def transfer_done(self, req: SimRequest, transfer_ms: float | None, nbytes: int | None) -> None:
        transfer.transfer_done(self, req, transfer_ms, nbytes)

    def transfer_failed(self, req: SimRequest, message: str) -> None:
        transfer.transfer_failed(self, req, message)

    # ------------------------------------------------------------------------------------------------
    # the scheduler loop (step formation and effects: batching.py)
    async def _run(self) -> None:
        try:
            while True:
                self._wake.clear()
                if self._paused or self.switching or self.frozen:
                    self._prev_deadline = 0.0  # time without steps is no step's lateness
                    await self._wake.wait()
                    continue
                batching.take_intake(self)
                step = self._plan()
                if step is None:
                    self._prev_deadline = 0.0
                    await self._wait_for_work()
                    continue
                now = clock.monotonic()
                if now - self._prev_deadline < CATCH_UP_SLACK_S:
                    start = self._prev_deadline
                else:
                    if self._prev_deadline:  # back to back with the last step, yet started late: the host's time
                        self.metrics.behind_model_seconds.inc(now - self._prev_deadline)
                    start = now
                deadline = start + step.time_s
                self._prev_deadline = deadline
                if self.preemption == "operator" and self.mode == "prefill" and step.prefill:
                    cut = await batching.run_preemptible(self, self._wake, step, start, deadline)
                    if cut is not None:
                        await self._hang_while_frozen()
                        self._prev_deadline = cut[0]
                        self._cut(step, start, *cut)
                        self._heartbeat.beat()
                        continue
                else:
                    await asyncio.sleep(max(0.0, deadline - now))
                await self._hang_while_frozen()
                self._apply(step)
                self._heartbeat.beat()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("engine_sim scheduler crashed")
            self.unhealthy = True
            raise

    async def _wait_for_work(self) -> None:
        """Nothing to compute: wait for a kick, or until the prefill policy asked to be planned again."""
        self._heartbeat.awaiting_work = True
        self._heartbeat.beat()  # an idle scheduler would run a health check's one-token request at once
        try:
            retry = self.core.retry_at
            if retry is None:
                await self._wake.wait()
                return
            delay = max(retry - clock.monotonic(), 0.001)  # never spin on a retry time already past
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), delay)
        finally:
            self._heartbeat.awaiting_work = False

    async def _hang_while_frozen(self) -> None:
        """A frozen engine's step in flight does not end (a hung kernel) until it is thawed."""
        while self.frozen:
            self._wake.clear()
            await self._wake.wait()

    def snapshot_unix_s(self) -> float:
        """When SGLang's scheduler would have stamped its latest load snapshot (heartbeat.py)."""
        return self._heartbeat.snapshot_unix_s(
            looping=not self.frozen and (self._heartbeat.awaiting_work or self._paused or self.switching))

    async def health_check(self, timeout_s: float) -> bool:
        """SGLang's /health: false when the engine is not serving, or its scheduler makes no progress within
        ``timeout_s`` (SGLANG_HEALTH_CHECK_TIMEOUT; heartbeat.py)."""
        free = self._heartbeat.awaiting_work and not (self._paused or self.frozen)
        return self.healthy and await self._heartbeat.healthy(timeout_s, free=free) and self.healthy

    def freeze(self) -> None:
        """Fault injection (SIGUSR1): the step in flight does not end and no other starts; requests, KV and the
        HTTP server stay as they are."""
        log.warning("engine_sim %s: scheduler frozen (fault injection); SIGUSR2 thaws it", self.settings.instance_id)
        self.frozen = True
        self.kick()

    def thaw(self) -> None:
        """Undo ``freeze`` (SIGUSR2)."""
        self.frozen = False
        self.reset_pacing()
        self.kick()

    # Methods rather than direct calls so that a test can wrap a step's effects on one engine.
    def _plan(self) -> Step | None:
        return batching.plan(self)

    def _apply(self, step: Step) -> None:
        batching.apply(self, step)

    def _cut(self, step: Step, start: float, cut: float, arrival: float) -> None:
        batching.cut(self, step, start, cut, arrival)

    def reset_pacing(self) -> None:
        """Forget the last step's deadline: the next step must not absorb time that passed without steps."""
        self._prev_deadline = 0.0

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

    async def pd_role_switch(self, new_role: str | None, prepare_only: bool = False,
                             decode_cuda_graph_memory_gb: float | None = None) -> RoleSwitchResult:
        """POST /pd_role_switch (role_switch.py)."""
        return await role_switch.pd_role_switch(self, new_role, prepare_only, decode_cuda_graph_memory_gb)

    def pause(self, mode: str) -> None:
        """SGLang's pause_generation. ``abort`` aborts everything then pauses; ``in_place`` stops taking steps
        and keeps requests and KV. ``retract`` is treated as ``in_place`` (nothing is sent back to the queue)."""
        if mode == "abort":
            self.abort(abort_all=True)
        self._paused = True

    def resume(self) -> None:
        self._paused = False
        self.kick()

    @property
    def paused(self) -> bool:
        return self._paused

    async def flush_cache(self, timeout_s: float = 0.0) -> bool:
        """Empty the prefix cache; like SGLang, a flush only succeeds when the engine is idle (no tree block is
        locked then)."""
        if not self.is_idle() and not (timeout_s > 0 and await self.wait_idle(timeout_s)):
            return False
        self.core.reset_cache()
        return True

    # ------------------------------------------------------------------------------------------------
    # load and info (reports.py)
    def load_snapshot(self) -> dict[str, Any]:
        return reports.load_snapshot(self)

    def gauges(self) -> dict[str, float]:
        return reports.gauges(self)

    def model_info(self) -> dict[str, Any]:
        return reports.model_info(self)

    def server_info(self) -> dict[str, Any]:
        return reports.server_info(self)
