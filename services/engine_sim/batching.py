"""Step formation per mode, and what a step does when it ends.

The engine's scheduler loop (engine.py) calls, between forward steps: ``take_intake`` (new requests enter
their role's first queue, as SGLang's recv_requests), ``plan`` (form the next batch and price it with the
latency model) and, once the step's time has passed, ``apply`` (its effects land). Plain functions over the
engine's state: its ``queues``, ``kv``, ``metrics`` and the /v1/loads counters.

Per mode (SGLang's ``--disaggregation-mode``):

- ``prefill``: a request first waits in the bootstrap queue until its decode peer claims its bootstrap room
  (see handoff.py), then in the waiting queue; the prefill policy plans each pass (see "Prefill passes"
  below) and its prompts are admitted in plan order while their KV fits (``prefill_batch_time_s``). A finished prefill
  produces the first token, publishes it under the room and keeps its KV (inflight queue) until the decode
  side releases the room; only then does the request finish (``finish_reason`` length 0, as SGLang's prefill).
- ``decode``: a request waits in the prealloc queue until KV for prompt + min(max_new_tokens,
  ``num_reserved_decode_tokens``) fits, pulls the KV from its prefill peer (transfer queue), then joins the
  running batch (up to ``max_running_requests``): the prefill's first token is emitted on joining, then
  each step (``decode_step_time_s``) emits one token per running request.
- ``null`` (colocated): decode-prioritised mixed steps: every running request decodes, and prefill chunks fill
  what is left of the chunk budget (``mixed_step_time_s``). A decode engine does the same while it holds
  prompts sent to it to prefill locally (``poise_local_prefill``, DOPD's ultra-short requests).

Prefill passes (prefill and null): the prefill policy (``shared.policies.prefill_order``) gets every prompt with
tokens left (admitted or waiting, in arrival order) and the pass's token budget (``chunked_prefill_size``; with
-1, SGLang's ``--max-prefill-tokens`` default and whole prompts) and returns the pass's parts; prompts not yet
admitted are admitted in plan order until one does not fit (it and later unadmitted ones wait; admitted ones
still run). An event-driven policy is asked only after a prompt arrived or a pass completed a prompt (between
those, the engine keeps computing its last plan); a plan with no parts and ``retry_at_s`` makes the loop wake
then. Each pass is reported back with ``observe(tokens, seconds)``, each decode step with the decode policy's
``observe``. With ``preemption="operator"`` (prefill mode) an arrival during a pass re-plans and may cut the
pass at its next operator boundary (``preemption_point``, ``cut``); with ``chunk`` a pass always runs to its end.

KV is counted in tokens (kv.py). A request that outgrows its reservation takes free KV one token at a time;
when there is not enough for the whole batch a running request is retracted in SGLang's order, fewest
output tokens first (null: back to the waiting queue to be re-prefilled with its output, like SGLang's
retract; decode: parked in the retracted queue, its KV notionally kept on the host, and resumed when it
fits). KV in use never exceeds capacity.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import TYPE_CHECKING

from services.engine_sim import transfer
from services.engine_sim.requests import Phase, SimRequest, finish_length, finish_stop
from services.engine_sim.tokens import EOS_TOKEN_ID
from shared.policies.prefill_order import fill, preempts, whole_prompts
from shared.policies.retraction import retraction_key

if TYPE_CHECKING:
    from services.engine_sim.engine import SimEngine


@dataclass(slots=True)
class Step:
    time_s: float
    prefill: list[tuple[SimRequest, int]]  # (request, new tokens this step)
    decode: list[SimRequest]
    # The modelled time of the step's prefill and decode parts (what the policies' observe() is told); -1:
    # all of ``time_s`` (a pure prefill or decode step).
    prefill_s: float = -1.0
    decode_s: float = -1.0


def take_intake(eng: SimEngine) -> None:
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
            req.phase = Phase.PREALLOC
            q.prealloc.append(req)


def plan(eng: SimEngine) -> Step | None:
    """The next batch for the engine's current mode, or None when there is nothing to compute."""
    eng.prefill_retry_at = None  # set again by this plan if the prefill policy still chooses to wait
    if eng.mode == "prefill":
        return _plan_prefill(eng)
    if eng.mode == "decode":
        return _plan_decode(eng)
    return _plan_null(eng)


def apply(eng: SimEngine, step: Step) -> None:
    """The step's effects, at its end: prefill progress, one token per decoding request, the counters."""
    now = time.monotonic()
    generated = 0
    if step.decode:
        contexts = [r.context_tokens for r in step.decode]  # before this step's token
        decode_s = step.time_s if step.decode_s < 0 else step.decode_s
        if decode_s > 0:
            eng.decode_policy.observe(len(contexts), max(contexts), sum(contexts), decode_s)
    if step.prefill:
        prefill_s = step.time_s if step.prefill_s < 0 else step.prefill_s
        if prefill_s > 0:
            eng.prefill_policy.observe(sum(n for _, n in step.prefill), prefill_s)
    if eng.mode == "prefill" and len(step.prefill) == 1 and not step.decode:
        req, n = step.prefill[0]
        if req.prefilled == 0 and n == req.prefill_len:  # a whole prompt alone: a clean (length, time) sample
            eng.prefill_sample_seq += 1
            eng.prefill_samples.append((eng.prefill_sample_seq, n, step.time_s))
    for req in step.decode:
        if req.phase is Phase.RUNNING:
            _emit(eng, req, now)
            generated += 1
    for req, n in step.prefill:
        if req.phase is Phase.PREFILLING:
            generated += _advance_prefill(eng, req, n, now)
    if step.decode:
        eng.queues.running = [r for r in eng.queues.running if r.phase is Phase.RUNNING]
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


# -- batch formation per mode --------------------------------------------------------------------------
def _admit(eng: SimEngine, req: SimRequest, reserve: int, now: float) -> None:
    matched = req.cache_hold.matched_tokens if req.cache_hold is not None else 0
    eng.kv.admit(req, req.prefill_len - matched, reserve - matched)
    req.phase = Phase.PREFILLING
    eng.queues.prefilling.append(req)
    if req.admitted_s is None:
        req.admitted_s = now
        eng.metrics.queue_time.observe(now - req.received_s)


def _decode_reserve(eng: SimEngine, req: SimRequest) -> int:
    """Output KV set aside at admission: min(remaining output, num_reserved_decode_tokens), at least 1 while
    any output remains (so the first token never has to wait for KV). submit() caps max_new_tokens at
    capacity - prompt, so a request alone always fits."""
    remaining = req.max_new_tokens - len(req.output_ids)
    if remaining <= 0:
        return 0
    return max(1, min(remaining, eng.settings.num_reserved_decode_tokens))


def prefill_queue(eng: SimEngine) -> list[SimRequest]:
    """What the prefill policy plans over: every prompt with tokens left, admitted or waiting, in arrival order."""
    q = eng.queues
    queue = [*q.prefilling, *q.waiting]
    queue.sort(key=lambda r: r.arrival_s)
    return queue


def _unfinished(req: SimRequest) -> bool:
    return (req.phase is Phase.WAITING or req.phase is Phase.PREFILLING) and req.prefilled < req.prefill_len


def _planned_parts(eng: SimEngine, budget: int, now: float) -> list[tuple[SimRequest, int]]:
    """The policy's parts for the next pass: a new plan, or (event-driven policies between events) the rest of
    the last one."""
    policy = eng.prefill_policy
    if policy.event_driven and not eng.prefill_replan:
        task = [r for r in eng.prefill_task if _unfinished(r)]
        if task:
            return fill(task, budget)
    plan = policy.plan(prefill_queue(eng), budget, now)
    eng.prefill_replan = False
    eng.prefill_task = [r for r, _ in plan.parts]
    if not plan.parts and plan.retry_at_s is not None:
        eng.prefill_retry_at = plan.retry_at_s
    return plan.parts


def _prefill_parts(eng: SimEngine, budget: int, reserve_for: Callable[[SimRequest], int], headroom: int,
                   max_admitted: int) -> list[tuple[SimRequest, int]]:
    """The next pass's prompts: the prefill policy's plan, its prompts admitted by KV in plan order (the first
    that does not fit stops admission; prompts already admitted still run)."""
    q = eng.queues
    if budget <= 0 or not (q.prefilling or q.waiting):
        return []
    now = time.monotonic()
    parts = _planned_parts(eng, budget, now)
    if not eng.chunked:
        parts = whole_prompts(parts, budget)
    out: list[tuple[SimRequest, int]] = []
    blocked = False
    for req, n in parts:
        if req.phase is Phase.WAITING:
            if blocked:
                continue
            reserve = reserve_for(req)
            if len(q.prefilling) >= max_admitted or not _fits_prompt(eng, req, reserve + headroom, now):
                blocked = True  # in plan order: later prompts wait for KV too
                continue
            q.waiting.remove(req)
            _admit(eng, req, reserve, now)
        elif req.phase is not Phase.PREFILLING:
            continue
        n = min(n, req.prefill_len - req.prefilled)
        if n > 0:
            out.append((req, n))
    if not out and blocked and q.prefilling:
        # The plan's prompts all wait for KV (or a slot) that only the admitted prompts' progress can free:
        # compute those, in the policy's order, rather than stall.
        fallback = eng.prefill_policy.plan(sorted(q.prefilling, key=lambda r: r.arrival_s), budget, now).parts
        out = whole_prompts(fallback, budget) if not eng.chunked else list(fallback)
    return out


def _fits_prompt(eng: SimEngine, req: SimRequest, need: int, now: float) -> bool:
    """Whether a prompt needing ``need`` KV tokens can be admitted. With the prefix cache its cached prefix is
    locked first (that KV is there already; it counts as prefilled) and unlocked cache is evicted for the
    rest; a prompt that still does not fit gives its lock back."""
    cache = eng.kv.cache
    if cache is None or not req.prefix_blocks or req.recompute or req.prefilled:
        return eng.kv.fits(need)
    hold = cache.claim(req.prefix_blocks, req.prefill_len, need, eng.kv.capacity - eng.kv.reserved, now)
    if hold is None:
        return False
    req.cache_hold, req.cached_tokens, req.prefilled = hold, hold.cached_tokens, hold.cached_tokens
    return True


def _plan_prefill(eng: SimEngine) -> Step | None:
    parts = _prefill_parts(eng, eng.chunk_size, lambda r: r.prefill_len, 0, eng.max_running)
    if not parts:
        return None
    return Step(eng.latency.prefill_batch_time_s([(n, r.prefilled) for r, n in parts]), parts, [])


def preemption_point(eng: SimEngine, step: Step, start: float, now: float) -> float | None:
    """Operator preemption, called when a prompt arrived during the prefill pass ``step`` (which started at
    ``start``): the policy re-plans, and if the new plan's head is not in the running pass (and could be
    admitted), the pass stops at its next operator boundary. Returns that time, or None to let the pass run."""
    plan = eng.prefill_policy.plan(prefill_queue(eng), eng.chunk_size, now)
    if not preempts(plan, step.prefill):
        return None
    head = plan.parts[0][0]
    if head.phase is Phase.WAITING and (
            len(eng.queues.prefilling) >= eng.max_running or not eng.kv.fits(head.prefill_len)):
        return None  # it could not run next anyway: cutting would only cost a launch
    end = start + step.time_s
    cut = eng.latency.operator_boundary_s(start, now, step.time_s, eng.latency.attention_share(
        (n, r.prefilled) for r, n in step.prefill))
    return cut if cut < end else None


def cut(eng: SimEngine, step: Step, start: float, at: float, arrival: float) -> None:
    """A prefill pass stopped at ``at`` (an operator boundary): each part keeps the tokens whose work is the
    elapsed share of its own (``LatencyModel.prefill_tokens_done``, as the simulator), the prompts keep their
    KV, and the next pass follows a new plan."""
    elapsed = at - start
    frac = elapsed / step.time_s if step.time_s > 0 else 1.0
    done = 0
    for req, n in step.prefill:
        k = min(n - 1, eng.latency.prefill_tokens_done(n, req.prefilled, frac))  # a cut never completes a prompt
        if k > 0 and req.phase is Phase.PREFILLING:
            req.prefilled += k
            done += k
    eng.total_prefill_tokens += done
    eng.total_prefill_busy_us += int(elapsed * 1e6)
    eng.window.record(time.monotonic(), 0, elapsed)
    if elapsed > 0:
        eng.prefill_policy.observe(done, elapsed)
    eng.num_prefill_preemptions += 1
    eng.metrics.prefill_preempted(at - arrival)
    eng.prefill_replan = True


def _plan_decode(eng: SimEngine) -> Step | None:
    now = time.monotonic()
    q = eng.queues
    # New admissions leave the running batch the KV its next step grows by (else they would force retracts).
    growth = sum(1 for r in q.running if eng.kv.needs_growth(r))
    _resume_retracted(eng, growth)
    _admit_prealloc(eng, now, growth)
    _join_ready(eng, now)
    growth = _ensure_growth(eng)
    if q.waiting or q.prefilling:  # prompts sent here to prefill locally: a mixed step, as colocated
        return _mixed_step(eng, growth)
    if not q.running:
        return None
    running = _decode_batch(eng, now)
    if not running:
        return None
    ctx = sum(r.prompt_tokens + len(r.output_ids) for r in running)
    return Step(eng.latency.decode_step_time_s(len(running), ctx), [], running)


def _plan_null(eng: SimEngine) -> Step | None:
    return _mixed_step(eng, _ensure_growth(eng))


def _mixed_step(eng: SimEngine, growth: int) -> Step | None:
    """Decode-prioritised: every running request decodes, prefill chunks fill what is left of the budget
    (colocated engines, and decode engines with prompts to prefill locally)."""
    q = eng.queues
    budget = max(0, eng.chunk_size - len(q.running))
    max_admitted = max(0, eng.max_running - len(q.running))
    parts = _prefill_parts(eng, budget, lambda r: r.prefill_len + _decode_reserve(eng, r), growth, max_admitted)
    if not parts and not q.running:
        return None
    running = _decode_batch(eng, time.monotonic())
    ctx = sum(r.prompt_tokens + len(r.output_ids) for r in running)
    t = eng.latency.mixed_step_time_s(len(running), ctx, [(n, r.prefilled) for r, n in parts])
    decode_s = eng.latency.decode_step_time_s(len(running), ctx)
    return Step(t, parts, running, prefill_s=t - decode_s, decode_s=decode_s)


def _decode_batch(eng: SimEngine, now: float) -> list[SimRequest]:
    """The running requests that step now: all of them (continuous batching) unless the policy holds some."""
    if eng.decode_policy.selects_all:
        return list(eng.queues.running)
    q = eng.queues
    kv_waiting = len(q.prealloc) + len(q.retracted) if eng.mode == "decode" else len(q.waiting)
    return list(eng.decode_policy.select(q.running, eng.max_running, now, kv_waiting))


def _admit_prealloc(eng: SimEngine, now: float, headroom: int = 0) -> None:
    q = eng.queues
    # The request-slot pool bounds how many requests hold decode KV at once (~2x the running batch).
    if q.retracted:
        return  # retracted requests get the KV back first (SGLang resumes them before new preallocations)
    slots = 2 * eng.max_running - len(q.running) - len(q.transfer) - len(q.ready)
    while q.prealloc and slots > 0:
        req = q.prealloc[0]
        reserve = req.prompt_tokens + _decode_reserve(eng, req)
        if not eng.kv.fits(reserve + headroom):
            break
        q.prealloc.popleft()
        eng.kv.admit(req, req.prompt_tokens, reserve)
        req.admitted_s = now
        eng.metrics.queue_time.observe(now - req.received_s)
        req.phase = Phase.TRANSFER
        q.transfer[req.rid] = req
        req.handoff_task = asyncio.create_task(transfer.pull(eng, req))
        slots -= 1


def _join_ready(eng: SimEngine, now: float) -> None:
    q = eng.queues
    while q.ready and len(q.running) < eng.max_running:
        req = q.ready.popleft()
        req.phase = Phase.RUNNING
        q.running.append(req)
        first = req.first_token_id
        if req.max_new_tokens == 0 or first is None:
            eng.finish_request(req, finish_length(0))
            continue
        assert req.tokens is not None  # set by submit()
        req.tokens.skip(1)  # the prefill produced id #0 of this rid's sequence
        _emit(eng, req, now, first)


def _resume_retracted(eng: SimEngine, headroom: int = 0) -> None:
    q = eng.queues
    while q.retracted and len(q.running) < eng.max_running:
        req = q.retracted[0]
        reserve = req.context_tokens + _decode_reserve(eng, req)
        if not eng.kv.fits(reserve + headroom):
            break
        q.retracted.popleft()
        eng.kv.admit(req, req.context_tokens, reserve)
        req.phase = Phase.RUNNING
        q.running.append(req)


def _ensure_growth(eng: SimEngine) -> int:
    """Make room for one more token per running request, retracting the newest if KV runs short.

    Returns how many free tokens this step's growth will take (admission must leave them alone).
    """
    running = eng.queues.running
    need = sum(1 for r in running if eng.kv.needs_growth(r))
    while need > eng.kv.free and running:
        victim = min(running, key=lambda r: retraction_key(len(r.output_ids), r.prompt_tokens))  # SGLang's order
        running.remove(victim)
        if eng.kv.needs_growth(victim):
            need -= 1
        _retract(eng, victim)
    return need


def _retract(eng: SimEngine, req: SimRequest) -> None:
    eng.kv.release(req, time.monotonic())
    req.num_retractions += 1
    eng.num_retracted_total += 1
    eng.metrics.num_retracted_requests_total.inc()
    if eng.mode == "null":
        req.prefill_len = req.context_tokens
        req.prefilled = 0
        req.recompute = True
        eng.enqueue_waiting(req, front=True)
    else:
        req.phase = Phase.RETRACTED
        eng.queues.retracted.append(req)


# -- effects of a step ---------------------------------------------------------------------------------
def _advance_prefill(eng: SimEngine, req: SimRequest, n: int, now: float) -> int:
    """Returns the number of tokens generated (1 when a prefill completes with a first token)."""
    q = eng.queues
    req.prefilled += n
    eng.total_prefill_tokens += n
    if req.prefilled < req.prefill_len:
        return 0
    q.prefilling.remove(req)
    eng.kv.into_tree(req, now)
    eng.prefill_replan = True  # a completion: event-driven policies plan again
    if eng.mode == "prefill":
        token = _next_token(req)
        req.first_token_id = token
        req.first_token_s = req.last_token_s = now
        req.prefill_done_unix_s = time.time()
        req.phase = Phase.INFLIGHT
        q.inflight[req.rid] = req
        eng.rooms.prefill_done(req, token, eng.latency.kv_bytes(req.prompt_tokens))
        req.timer = asyncio.get_running_loop().call_later(
            eng.settings.bootstrap_timeout_s, transfer.release_timed_out, eng, req)
        return 1
    req.phase = Phase.RUNNING
    q.running.append(req)
    if req.recompute:  # back from a retraction: its output is already out
        req.recompute = False
        return 0
    if req.max_new_tokens == 0:
        eng.finish_request(req, finish_length(0))
        return 0
    _emit(eng, req, now)
    return 1


def _next_token(req: SimRequest) -> int:
    if not req.ignore_eos and len(req.output_ids) + 1 == req.stop_after < req.max_new_tokens:
        return EOS_TOKEN_ID
    assert req.tokens is not None
    return req.tokens.next()


def _emit(eng: SimEngine, req: SimRequest, now: float, token: int | None = None) -> None:
    """One output token: KV grows by one, the reader wakes, and the request may finish."""
    req.output_ids.append(_next_token(req) if token is None else token)
    eng.kv.grow(req, 1)
    if req.first_token_s is None:
        req.first_token_s = now
        eng.metrics.first_token(req, now)
    req.last_token_s = now
    n = len(req.output_ids)
    if n >= req.stop_after:
        if n < req.max_new_tokens and req.output_ids[-1] == EOS_TOKEN_ID:
            reason = finish_stop(EOS_TOKEN_ID)
        else:
            reason = finish_length(req.max_new_tokens)
        # The caller filters the running list after the step; joins remove the request themselves.
        if req.phase is Phase.RUNNING:
            eng.finish_request(req, reason, detach=False)
            running = eng.queues.running
            if running and running[-1] is req:
                running.pop()
        else:
            eng.finish_request(req, reason)
    elif req.stream:  # a non-streaming reader only cares about the finish (finish_request notifies it)
        req.event.set()
