"""engine_sim's side of the engine model: what a step boundary and a step's end mean for live requests.

The engine's scheduling (queues, KV admission and retraction, the prefix cache, prefill passes, decode and
mixed steps, operator preemption) is :class:`shared.engine.model.EngineModel`, the same code the simulator
runs. The scheduler loop (engine.py) calls, between forward steps: ``take_intake`` (new requests enter their
role's first queue, as SGLang's recv_requests), ``plan`` (the model's next step, and what its boundary did:
KV pulls to start, first tokens to send, retractions to count) and, once the step's time has passed,
``apply`` (the model's effects, then the tokens: ids drawn, streams woken, finished requests answered, a
prefill's first token published under its bootstrap room). Plain functions over the engine.

Per mode (SGLang's ``--disaggregation-mode``), what is engine_sim's own:

- ``prefill``: a request first waits in the bootstrap queue until its decode peer claims its bootstrap room
  (handoff.py); a finished prefill produces the first token, publishes it under the room and keeps its KV
  (inflight queue) until the decode side releases the room; only then does the request finish
  (``finish_reason`` length 0, as SGLang's prefill).
- ``decode``: once the model reserved its KV, a request pulls the KV from its prefill peer (transfer queue,
  transfer.py), then joins the running batch; the prefill's first token is emitted on joining.
- ``null`` (colocated), and decode engines with prompts sent to them to prefill locally (``poise_local_prefill``):
  a prompt's first token is emitted when it joins the running batch, at the boundary after its prefill.

engine_sim's engines grow decode KV per token and retract when it runs out, colocated ones included (SGLang's
model); the radix cache is on unless ``--disable-radix-cache``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from http import HTTPStatus
from typing import cast

from services.engine_sim import clock, transfer
from services.engine_sim.engine_state import EngineState
from services.engine_sim.requests import Phase, SimRequest, finish_abort, finish_length, finish_stop
from services.engine_sim.tokens import EOS_TOKEN_ID
from shared.engine.model import Step, given_up_reason

__all__ = ["Step", "apply", "cut", "plan", "take_intake"]


def take_intake(eng: EngineState) -> None:
    """Requests received since the last step enter their role's first queue (SGLang's recv_requests)."""
    q = eng.queues
    while q.intake:
        req = q.intake.popleft()
        # Already out of the intake queue and in no other: failures below must not detach.
        if req.prompt_tokens > eng.capacity:
            eng.fail_request(req, f"Request {req.rid} exceeds the maximum number of tokens: "
                                  f"{req.prompt_tokens} > {eng.capacity}", HTTPStatus.BAD_REQUEST, detach=False)
            continue
        if eng.mode == "null" or req.local_prefill:  # local prefill: a decode engine prefills it itself
            eng.enqueue_waiting(req)
            continue
        if req.bootstrap_room is None and req.kv_source is None:  # a KV copy from a decode peer needs no room
            eng.fail_request(req, "Invalid request: Disaggregated request received without bootstrap room id. "
                                  f"req.rid={req.rid!r}", HTTPStatus.BAD_REQUEST, detach=False)
            continue
        if eng.mode == "prefill":
            assert req.bootstrap_room is not None  # submit() takes a KV source on decode engines only
            problem = eng.rooms.attach(req)
            if problem is not None:
                status = HTTPStatus.BAD_REQUEST if problem.startswith("Duplicate") else (
                    HTTPStatus.INTERNAL_SERVER_ERROR)
                eng.fail_request(req, problem, status, detach=False)
                continue
            if eng.rooms.is_claimed(req.bootstrap_room):
                eng.enqueue_waiting(req)
            else:
                req.phase = Phase.BOOTSTRAP
                q.bootstrap[req.rid] = req
                req.timer = asyncio.get_running_loop().call_later(
                    eng.settings.bootstrap_timeout_s, transfer.bootstrap_timed_out, eng, req)
        else:  # decode
            eng.core.add_prealloc(req)


def plan(eng: EngineState) -> Step | None:
    """The engine model's next step (None when there is nothing to compute), after acting on what its boundary
    did: KV pulls for the requests whose decode KV was reserved, first tokens for those that joined the batch."""
    now = clock.monotonic()
    step = eng.core.plan(now)
    for req in _live(step.admitted):  # decode: KV reserved, pull it from the prefill peer
        _admitted(eng, req, now)
        eng.queues.transfer[req.rid] = req
        req.handoff_task = asyncio.create_task(transfer.pull(eng, req))
    for req in _live(step.prompts_admitted):
        _admitted(eng, req, now)
    joined = 0
    for req in _live(step.joined):
        if req.generated == 0:  # max_new_tokens 0: the model finished it without a token
            eng.finish_request(req, finish_length(0))
            continue
        if req.first_token_id is not None:  # the prefill peer's first token (or a migrated request's next)
            assert req.tokens is not None  # set by submit()
            req.tokens.skip(1)
            token = req.first_token_id
        else:  # prefilled here
            token = _next_token(req)
        eng.metrics.first_token(req, now)
        _emit(eng, req, token, now)
        joined += 1
    for req in _live(step.given_up):  # colocated: waited past its TTFT target unstarted (give_up_late_prompts)
        eng.finish_request(req, finish_abort(given_up_reason(now - req.arrival_s, req.slo_ttft_s),
                                             HTTPStatus.TOO_MANY_REQUESTS))
        eng.metrics.num_aborted_requests.inc()
    for _ in step.retracted:
        eng.num_retracted_total += 1
        eng.metrics.num_retracted_requests_total.inc()
    if joined:
        eng.window.record(now, joined, 0.0)
    return None if step.idle else step


def _live(reqs: list) -> list[SimRequest]:  # type: ignore[type-arg]
    return cast("list[SimRequest]", reqs)


def _admitted(eng: EngineState, req: SimRequest, now: float) -> None:
    if req.admitted_s is None:
        req.admitted_s = now
        eng.metrics.queue_time.observe(now - req.received_s)


def apply(eng: EngineState, step: Step) -> None:
    """The step's effects, at its end: the model's (prefill progress, one token per decoding request), then
    the tokens' ids, the streams, the finished requests and the counters."""
    now = clock.monotonic()
    step.drop_departed()  # aborted while the step ran
    if eng.mode == "prefill" and len(step.prefill) == 1 and not step.decode:
        req, n = step.prefill[0]
        if req.prefilled == 0 and n == req.input_tokens:  # a whole prompt alone: a clean (length, time) sample
            eng.prefill_sample_seq += 1
            eng.prefill_samples.append((eng.prefill_sample_seq, n, step.time_s))
    applied = eng.core.apply(step, now)
    generated = 0
    for req in _live(step.decode):
        _emit(eng, req, _next_token(req), now)
        generated += 1
    eng.total_prefill_tokens += sum(n for _, n in step.prefill)
    if eng.mode == "prefill":
        for req in _live(applied.prompts_done):
            _prefill_done(eng, req, now)
            generated += 1
    step_us = int(step.time_s * 1e6)
    if step.prefill:
        eng.total_prefill_busy_us += step_us
    elif step.decode:
        b, t, m = float(len(step.decode)), float(step_us), eng.decode_moments
        m[0] += 1.0
        m[1] += b
        m[2] += t
        m[3] += b * b
        m[4] += b * t
        m[5] += float(generated)
    eng.window.record(now, generated, step.time_s)


def _prefill_done(eng: EngineState, req: SimRequest, now: float) -> None:
    """A prefill's first token: published under its room; the KV stays until the decode side has it."""
    token = _next_token(req)
    req.first_token_id = token
    req.first_token_s = req.last_token_s = now
    req.prefill_done_unix_s = time.time()
    eng.queues.inflight[req.rid] = req
    eng.rooms.prefill_done(req, token, eng.latency.kv_bytes(req.prompt_tokens))
    req.timer = asyncio.get_running_loop().call_later(
        eng.settings.bootstrap_timeout_s, transfer.release_timed_out, eng, req)


def cut(eng: EngineState, step: Step, start: float, at: float, arrival: float) -> None:
    """A prefill pass stopped at ``at`` (an operator boundary): the model keeps each part's elapsed share of
    the work; the counters and the preemption metrics here."""
    elapsed = at - start
    eng.total_prefill_tokens += eng.core.cut(step, elapsed)
    eng.total_prefill_busy_us += int(elapsed * 1e6)
    eng.window.record(clock.monotonic(), 0, elapsed)
    eng.num_prefill_preemptions += 1
    eng.metrics.prefill_preempted(at - arrival)


def _next_token(req: SimRequest) -> int:
    if not req.ignore_eos and req.stop_match is None and len(req.output_ids) + 1 == req.stop_after < req.max_new_tokens:
        return EOS_TOKEN_ID
    assert req.tokens is not None
    return req.tokens.next()


def _emit(eng: EngineState, req: SimRequest, token: int, now: float) -> None:
    """One output token the model counted: its id goes out, the reader wakes, a finished request is answered."""
    req.output_ids.append(token)
    if req.first_token_s is None:
        req.first_token_s = now
    req.last_token_s = now
    if req.phase is Phase.FINISHED:  # the model ended it at its length (KV freed)
        n = len(req.output_ids)
        if req.stop_match is not None and n == req.stop_match.tokens:
            reason = finish_stop(req.stop_match.stop)
        elif n < req.max_new_tokens and token == EOS_TOKEN_ID:
            reason = finish_stop(EOS_TOKEN_ID)
        else:
            reason = finish_length(req.max_new_tokens)
        eng.finish_request(req, reason)
    elif req.stream:  # a non-streaming reader only cares about the finish (finish_request notifies it)
        req.event.set()


async def run_preemptible(eng: EngineState, wake: asyncio.Event, step: Step, start: float,
                          deadline: float) -> tuple[float, float] | None:
    """Wait out a prefill pass (operator preemption): each prompt that enters the waiting queue meanwhile
    makes the policy re-plan; a plan the running pass must yield to cuts it at the next operator boundary.
    Returns (the cut time, already reached; the arrival that caused it), or None when the pass ran to its
    end."""
    seen = eng.prefill_arrivals
    while True:
        now = clock.monotonic()
        if now >= deadline:
            await asyncio.sleep(0)  # a zero-time pass (time_scale 0) still yields to the event loop
            return None
        wake.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(wake.wait(), deadline - now)
        take_intake(eng)  # FlowPrefill's scheduler takes arrivals while a pass runs
        if eng.prefill_arrivals == seen:
            continue
        seen = eng.prefill_arrivals
        now = clock.monotonic()
        cut = eng.core.preemption_point(step, start, now)
        if cut is not None:
            arrival = eng.last_prefill_arrival_s
            await asyncio.sleep(max(0.0, cut - clock.monotonic()))
            return cut, arrival
