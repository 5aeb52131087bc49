"""One SGLang engine's scheduler, pure and clock-free: the model both engine_sim and the simulator run.

:class:`EngineModel` holds an engine's queues, its KV pool (with the radix prefix cache) and its engine policies,
and knows nothing of time or I/O: the caller passes ``now`` and calls, between two forward steps,

- :meth:`EngineModel.plan` to form the next step (it also makes the step boundary's admissions, joins and
  retractions, listed on the returned :class:`Step`), and priced by the latency model;
- :meth:`EngineModel.apply` once the step's time has passed, for its effects (prefill progress, one token per
  decoding request, finishes); it returns what the adapter must act on (:class:`Applied`).

Two adapters drive it: services/engine_sim (an asyncio loop that sleeps each step's time and streams tokens
over HTTP) and loadgen/sim (an event queue in virtual time). They own what is not the engine's own scheduling:
receiving requests, the P->D handoff (bootstrap rooms, the KV transfer), token ids, migration between engines,
what the engine reports.

What is modelled, per role (SGLang's ``--disaggregation-mode``):

- ``prefill``: prompts wait in ``waiting`` until the prefill policy (``shared.policies.prefill_order``) plans a
  pass over every prompt with tokens left (admitted or waiting, in arrival order) and the pass's token budget
  (the chunk, or with chunking off SGLang's ``--max-prefill-tokens`` and whole prompts); unadmitted prompts of
  the plan are admitted in plan order while their KV fits (the first that does not stops admission; admitted
  ones still run). An event-driven policy is asked only after a prompt arrived or a pass completed one
  (between those the engine keeps computing its last plan); a plan with no parts and ``retry_at_s`` asks to
  be planned again then (:attr:`EngineModel.retry_at`). With operator preemption an arrival during a pass
  re-plans and may cut the pass at its next operator boundary (:meth:`preemption_point`, :meth:`cut`). A
  finished prompt's KV stays (``prompt_kv``) until the adapter's transfer is done (:meth:`release_prompt`).
- ``decode``: a request waits in ``prealloc`` until KV for it fits (:meth:`admit_prealloc`: prompt + whole
  output, or with the ``grow`` model prompt + min(remaining output, ``reserved_decode_tokens``)), at most
  ``2 x max_running`` requests holding decode KV at once (SGLang's request-slot pool); the adapter then moves
  its KV in and calls :meth:`transfer_done`; it joins the running batch (up to ``max_running``) with its first
  token, and each step emits one token per request the decode batch policy selects (all, by default).
- ``null`` (colocated), and decode engines holding prompts to prefill locally: decode-prioritised mixed steps,
  every selected running request decodes and prefill chunks fill what is left of the chunk budget. With
  ``give_up_late`` (Poise's engines; SGLang has no such rule) a colocated engine gives up, at each step
  boundary, the prompts still waiting unstarted past their TTFT target (``Step.given_up``; the adapter refuses
  them): they are late whatever happens, and past capacity the queue otherwise fills with them, each served
  in the engine's slack at the cost of one that still had time.

KV (``decode_kv`` / ``colocated_kv``): ``whole`` reserves prompt + whole output at admission, so a request never
runs out (an oracle no engine has, the simulator's default); ``grow`` is SGLang's: a request outgrowing its
reservation takes free KV a token per step, and when a step's growth does not fit, running requests are
retracted in SGLang's order (``shared.policies.retraction``): parked in ``retracted`` with their KV on the host
(decode, resumed before any new admission once they fit), or back to the front of ``waiting`` to be prefilled
again with their output (colocated, SGLang's retract). KV in use never exceeds capacity.

Prefix cache (``prefix_cache``, SGLang's radix cache: ``shared.engine.prefix_cache``): prefill and colocated
engines keep the KV of the prompts they computed, by the requests' prefix blocks. A prompt admitted there
locks its cached prefix (it counts as prefilled) and allocates KV only for the rest; the tree shares the
pool, and its unlocked blocks are evicted, least recently used first, when an admission needs the room. A
computed prompt joins the tree, locked until the request lets go of its KV. Decode engines keep no cache
(SGLang's ``--disaggregation-decode-enable-radix-cache`` is off by default).

One request object may pass through two models (the simulator shares it between its prefill and decode
engine): each field below says which side owns it, so the two never write the same one.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from shared.engine.prefix_cache import CacheHold, PrefixCache
from shared.latency import LatencyModel
from shared.policies import make_decode_batch_policy, make_prefill_policy, preempts
from shared.policies.prefill_order import MAX_PREFILL_TOKENS, fill, whole_prompts
from shared.policies.retraction import retraction_key
from shared.protocol.messages import Role

KvModel = Literal["whole", "grow"]
Preemption = Literal["chunk", "operator"]


class Phase(enum.Enum):
    """Where a request is on one engine (SGLang's scheduler queues). The model sets the phases of the queues it
    owns; INTAKE, BOOTSTRAP, INFLIGHT and FINISHED are the adapter's."""

    INTAKE = "intake"  # received, not yet seen by the scheduler (it picks requests up between steps)
    BOOTSTRAP = "bootstrap"  # prefill: waiting for the decode peer to claim its bootstrap room
    WAITING = "waiting"  # prefill/null: queued for prefill, no KV yet
    PREFILLING = "prefilling"  # prefill/null: KV allocated, prefill chunks in progress
    INFLIGHT = "inflight"  # prefill: first token ready, KV held until the decode side has it
    PREALLOC = "prealloc"  # decode: waiting for KV space
    TRANSFER = "transfer"  # decode: KV allocated, the prompt's KV on its way
    READY = "ready"  # decode/null: KV in place, waiting for a slot in the running batch
    RUNNING = "running"  # decode/null: one token per decode step
    RETRACTED = "retracted"  # decode: evicted from the batch for lack of KV (held on the host), waits to return
    FINISHED = "finished"


@dataclass(eq=False, slots=True, kw_only=True)
class EngineRequest:
    """What the engine model reads and writes on a request (the adapters subclass it)."""

    rid: str
    arrival_s: float = math.nan  # reached the serving system, on the caller's clock (TTFT deadlines count from here)
    # Tokens to prefill (what a prefill policy reads): the prompt, or its context while a colocated retraction
    # prefills it again; -1: prompt_tokens.
    input_tokens: int = -1
    output_tokens: int = 0  # the output length at which it stops
    slo_ttft_s: float = math.inf
    slo_tpot_s: float = math.inf
    blocks: tuple[int, ...] = ()  # the prompt's prefix blocks: the prefix cache's key
    prompt_tokens: int = -1  # the prompt; -1: input_tokens
    phase: Phase = Phase.INTAKE
    # The prefill side (a prefill or colocated engine, or a decode engine prefilling locally):
    prefilled: int = 0  # of input_tokens, computed so far (a cached prefix counts)
    prompt_kv: int = 0  # prefill engine: KV its prompt holds there, until the transfer is done
    cached: int = 0  # prompt tokens its engine found in the prefix cache
    hold: CacheHold | None = None  # its lock on that cache, from admission until it lets go of its KV
    recompute: bool = False  # colocated: re-prefilling after a retraction (its output is already out)
    # The decode side (a decode or colocated engine):
    generated: int = 0  # output tokens emitted
    first_token_s: float | None = None
    kv_held: int = 0  # KV allocated to it (its reservation included)
    retractions: int = 0

    def __post_init__(self) -> None:
        if self.input_tokens < 0:
            self.input_tokens = self.prompt_tokens
        elif self.prompt_tokens < 0:
            self.prompt_tokens = self.input_tokens

    @property
    def context_tokens(self) -> int:
        return self.prompt_tokens + self.generated


@dataclass(slots=True)
class Step:
    """The next forward pass and what the step boundary did. ``prefill``: (request, new tokens) in plan order;
    ``decode``: the requests that decode a token; ``time_s``: the latency model's time for the pass (what
    the prefill policy is told a pass with prefill parts took, a mixed step's decode part included).

    Made at the boundary, for the adapter to act on: ``admitted`` (decode: KV reserved, the prompt's KV may
    come now), ``prompts_admitted`` (prompts that got KV), ``joined`` (joined the running batch; a fresh one
    got its first token), ``finished`` (ended on joining: a one-token output), ``retracted``, ``given_up``
    (``give_up_late``: out of the queue, unstarted, past their TTFT target; the adapter refuses them)."""

    time_s: float = 0.0
    prefill: list[tuple[EngineRequest, int]] = field(default_factory=list)
    decode: list[EngineRequest] = field(default_factory=list)
    admitted: list[EngineRequest] = field(default_factory=list)
    prompts_admitted: list[EngineRequest] = field(default_factory=list)
    joined: list[EngineRequest] = field(default_factory=list)
    finished: list[EngineRequest] = field(default_factory=list)
    retracted: list[EngineRequest] = field(default_factory=list)
    given_up: list[EngineRequest] = field(default_factory=list)

    @property
    def idle(self) -> bool:
        """Nothing to compute."""
        return not self.prefill and not self.decode

    def drop_departed(self) -> None:
        """Forget the requests that left the engine while the step ran (aborted): they get no token."""
        self.decode = [r for r in self.decode if r.phase is Phase.RUNNING]
        self.prefill = [(r, n) for r, n in self.prefill if r.phase is Phase.PREFILLING]


@dataclass(slots=True)
class Applied:
    """A step's effects for the adapter: ``finished`` (reached their length, KV freed) and ``prompts_done``
    (prefill engine: the prompt is computed, its first token due; the transfer is the adapter's)."""

    finished: list[EngineRequest]
    prompts_done: list[EngineRequest]


class EngineModel:
    """One engine's scheduler state and rules (module doc). ``role`` changes only through :meth:`switch_role`."""

    def __init__(self, role: Role, latency: LatencyModel, *, prefill_policy: str = "fcfs",
                 decode_policy: str = "continuous", preemption: Preemption = "chunk", chunk_tokens: int | None = None,
                 decode_kv: KvModel = "whole", colocated_kv: KvModel = "whole", reserved_decode_tokens: int = 512,
                 prefix_cache: bool = False, kv_capacity: int | None = None, max_running: int | None = None,
                 mixed_chunk_tokens: int | None = None, colocated_chunk_tokens: int | None = None,
                 give_up_late: bool = False) -> None:
        p = latency.profile
        self.latency = latency
        self.prefill_policy = make_prefill_policy(prefill_policy, latency)
        self.decode_policy = make_decode_batch_policy(decode_policy, latency)
        self.preemptible = preemption == "operator"
        self.give_up_late = give_up_late  # colocated: refuse prompts waiting past their TTFT target (module doc)
        self.kv_capacity = kv_capacity or p.kv_capacity_tokens
        self.max_running = max_running or p.max_running_requests
        self._chunk_setting = p.chunked_prefill_size if chunk_tokens is None else chunk_tokens
        self._mixed_chunk_setting = mixed_chunk_tokens
        self._colocated_chunk_setting = colocated_chunk_tokens  # None: the same as the other roles
        self.chunked, self.chunk, self.mixed_chunk = True, 0, 0  # set for the role by switch_role
        self.decode_kv: KvModel = decode_kv
        self.colocated_kv: KvModel = colocated_kv
        self.reserved_decode_tokens = reserved_decode_tokens
        self.uses_prefix_cache = prefix_cache
        self.role: Role = role
        self.grows = False
        self.cache: PrefixCache | None = None
        self.switch_role(role)
        self.used_kv = 0  # the requests' own KV (reservations included); the tree's blocks are the cache's
        self.waiting: deque[EngineRequest] = deque()  # prefill/null: before KV admission
        self.prefilling: list[EngineRequest] = []  # prefill/null: admitted, prompt not done
        self.prealloc: deque[EngineRequest] = deque()  # decode: waiting for KV
        self.transferring = 0  # decode: KV admitted, not yet ready (the adapter's transfer)
        self.ready: deque[EngineRequest] = deque()  # decode/null: KV in place, waiting for a batch slot
        self.running: list[EngineRequest] = []  # decode/null: in the running batch
        # ... those whose reservation does not cover their whole output: the only ones a step can push past it
        # (grow model), so the per-step growth looks at them alone
        self._outgrowing: dict[EngineRequest, None] = {}
        self.running_context = 0  # the running requests' summed contexts, kept as they change
        self.retracted: deque[EngineRequest] = deque()  # decode, grow model: parked for lack of KV, oldest first
        self.retractions = 0
        self.replan = True  # event-driven policies: a prompt arrived or one finished since the last plan
        self.retry_at: float | None = None  # the prefill policy chose to wait: plan again then
        self._task: list[EngineRequest] = []  # event-driven policies: the prompts of the last plan

    def switch_role(self, role: Role) -> None:
        """A new role, with an empty prefix cache (SGLang resets its radix cache on a switch) and the role's
        chunking."""
        self.role = role
        self.grows = (self.decode_kv if role == "decode" else self.colocated_kv) == "grow" and role != "prefill"
        profile = self.latency.profile
        chunk = self._chunk_setting
        if role == "null" and self._colocated_chunk_setting is not None:
            chunk = self._colocated_chunk_setting
        self.chunked = chunk > 0
        self.chunk = chunk if self.chunked else MAX_PREFILL_TOKENS  # a prefill pass's token budget
        # A mixed step's prefill budget (a decode engine prefilling locally, a colocated one): the chunk, or
        # the profile's where prefill passes run unchunked; engine_sim passes its own budget, SGLang's.
        self.mixed_chunk = self._mixed_chunk_setting or (chunk if self.chunked else profile.chunked_prefill_size)
        # Policies that weigh a prompt's prefill by whether decode shares its steps (FlowPrefill's cautious count).
        sharing = getattr(self.prefill_policy, "set_decode_sharing", None)
        if sharing is not None:
            sharing(role != "prefill")
        self.reset_cache()

    def reset_cache(self) -> None:
        """An empty prefix cache: prefill and colocated engines only."""
        self.cache = PrefixCache() if self.uses_prefix_cache and self.role != "decode" else None

    # -- what the engine holds ---------------------------------------------------------------------
    @property
    def uncached_prompt_tokens(self) -> int:
        """SGLang's ``num_waiting_uncached_tokens`` of this scheduler: prompt tokens left to compute in the
        waiting queue and in the prompts in progress. An adapter's own queues (a prefill engine's bootstrap
        queue, whose prompts wait for their decode side) are not the scheduler's and are not counted."""
        return (sum(r.input_tokens - r.prefilled for r in self.waiting)
                + sum(r.input_tokens - r.prefilled for r in self.prefilling))

    @property
    def empty(self) -> bool:
        return not (self.waiting or self.prefilling or self.prealloc or self.transferring or self.ready
                    or self.running or self.retracted) and self.used_kv == 0

    def admission_kv(self, req: EngineRequest) -> int:
        """KV a request needs to be admitted (or resumed, or moved in) on a decode or colocated engine."""
        if not self.grows:
            return req.prompt_tokens + req.output_tokens
        remaining = req.output_tokens - req.generated
        reserve = max(1, min(remaining, self.reserved_decode_tokens)) if remaining > 0 else 0
        return req.context_tokens + reserve

    # -- requests in -------------------------------------------------------------------------------
    def add_prompts(self, reqs: list[EngineRequest]) -> None:
        """Prompts enter the prefill waiting queue (an event for event-driven policies)."""
        for r in reqs:
            r.phase = Phase.WAITING
        self.waiting.extend(reqs)
        self.replan = True

    def add_prealloc(self, req: EngineRequest) -> None:
        """Decode: a request waits for its KV."""
        req.phase = Phase.PREALLOC
        self.prealloc.append(req)

    def admit_prealloc(self, now: float, headroom: int | None = None) -> list[EngineRequest]:
        """Decode: reserve KV for queued requests in order while it fits (leaving the running batch its next
        step's growth, and retracted requests first) and request slots last. Returns those admitted: their
        prompt's KV may come now (:meth:`transfer_done` when it has). ``headroom``: that growth, when the caller
        has counted it."""
        out: list[EngineRequest] = []
        if self.retracted:
            return out  # retracted requests get the KV back first (SGLang resumes them before new preallocations)
        if headroom is None:
            headroom = self._growth() if self.grows else 0
        slots = 2 * self.max_running - len(self.running) - self.transferring - len(self.ready)
        q = self.prealloc
        while q and slots > 0:
            need = self.admission_kv(q[0])
            if self.used_kv + need + headroom > self.kv_capacity:
                break
            req = q.popleft()
            req.kv_held = need
            self.used_kv += need
            req.phase = Phase.TRANSFER
            self.transferring += 1
            slots -= 1
            out.append(req)
        return out

    def transfer_done(self, req: EngineRequest) -> None:
        """Decode: the request's KV is in place (a prefill's transfer, or a move from another engine with its
        KV reserved here); it joins the batch at the next step boundary."""
        self.transferring -= 1
        req.phase = Phase.READY
        self.ready.append(req)

    def move_in(self, req: EngineRequest) -> int:
        """Decode: reserve KV for a request another engine will hand over (it is then transferring here).
        Returns the tokens reserved, or 0 when they do not fit."""
        need = self.admission_kv(req)
        if self.used_kv + need > self.kv_capacity:
            return 0
        self.used_kv += need
        self.transferring += 1
        return need

    def cancel_move_in(self, tokens: int) -> None:
        self.transferring -= 1
        self.used_kv -= tokens

    def release(self, tokens: int) -> None:
        """Free ``tokens`` of KV the adapter accounted for a request that left (a move out)."""
        self.used_kv -= tokens

    def release_prompt(self, req: EngineRequest, now: float) -> None:
        """Prefill: the request's transfer is done (or it ended): its prompt's KV and cache lock go."""
        self.used_kv -= req.prompt_kv
        req.prompt_kv = 0
        self._release_hold(req, now)

    def remove(self, req: EngineRequest, now: float) -> None:
        """Take a request out wherever it is (an abort, a failure) and free what it holds here."""
        phase = req.phase
        if phase is Phase.WAITING:
            self.waiting.remove(req)
        elif phase is Phase.PREFILLING:
            self.prefilling.remove(req)
            if self.role == "prefill":
                self.release_prompt(req, now)
                return
        elif phase is Phase.PREALLOC:
            self.prealloc.remove(req)
        elif phase is Phase.TRANSFER:
            self.transferring -= 1
        elif phase is Phase.READY:
            self.ready.remove(req)
        elif phase is Phase.RUNNING:
            self.unrun(req)
        elif phase is Phase.RETRACTED:
            self.retracted.remove(req)
        elif phase is Phase.INFLIGHT:
            self.release_prompt(req, now)
            return
        self.used_kv -= req.kv_held
        req.kv_held = 0
        self._release_hold(req, now)

    def _release_hold(self, req: EngineRequest, now: float) -> None:
        hold, req.hold = req.hold, None
        if hold is not None and self.cache is not None:
            self.cache.release(hold, now)

    # -- the running batch -------------------------------------------------------------------------
    def run(self, req: EngineRequest) -> None:
        req.phase = Phase.RUNNING
        self.running.append(req)
        self.running_context += req.prompt_tokens + req.generated
        if req.kv_held < req.prompt_tokens + req.output_tokens:
            self._outgrowing[req] = None

    def unrun(self, req: EngineRequest) -> None:
        self.running.remove(req)
        self.running_context -= req.prompt_tokens + req.generated
        self._outgrowing.pop(req, None)

    def _finish(self, req: EngineRequest, now: float) -> None:
        self.used_kv -= req.kv_held
        req.kv_held = 0
        self._release_hold(req, now)
        req.phase = Phase.FINISHED

    def _join_ready(self, now: float, step: Step) -> None:
        while self.ready and len(self.running) < self.max_running:
            req = self.ready.popleft()
            if req.generated:  # moved in from another engine: it already had its first token
                self.run(req)
                continue
            step.joined.append(req)
            if req.output_tokens <= 0:  # nothing to generate (max_new_tokens 0)
                self._finish(req, now)
                step.finished.append(req)
                continue
            req.first_token_s = now
            req.generated = 1
            if req.generated >= req.output_tokens:
                self._finish(req, now)
                step.finished.append(req)
            else:
                self.run(req)

    # -- the grow model (module doc) ---------------------------------------------------------------
    def _needs_growth(self, req: EngineRequest) -> bool:
        return req.prompt_tokens + req.generated + 1 > req.kv_held

    def _growth(self) -> int:
        """Free KV the running batch's next step takes (one token each beyond what it holds)."""
        return sum(1 for r in self._outgrowing if r.prompt_tokens + r.generated >= r.kv_held)

    def _grow(self, now: float, step: Step) -> None:
        """Give every running request the KV of its next token, retracting in SGLang's order while that does
        not fit."""
        needy = [r for r in self._outgrowing if r.prompt_tokens + r.generated >= r.kv_held]  # past their reservation
        need = len(needy)
        if self.cache is not None:
            self.cache.make_room(need, self.kv_capacity - self.used_kv)  # evict before retracting
        free = self.kv_capacity - self.used_kv - (self.cache.tokens if self.cache is not None else 0)
        while need > free and self.running:
            victim = min(self.running, key=retraction_order)
            self.unrun(victim)
            if self._needs_growth(victim):
                need -= 1
            self.used_kv -= victim.kv_held
            free += victim.kv_held
            victim.kv_held = 0
            victim.retractions += 1
            self.retractions += 1
            step.retracted.append(victim)
            if self.role == "null":  # SGLang's retract: back to the queue, prefilled again with its output
                self._release_hold(victim, now)
                victim.input_tokens = victim.context_tokens
                victim.prefilled = 0
                victim.recompute = True
                victim.phase = Phase.WAITING
                self.waiting.appendleft(victim)
                self.replan = True
            else:
                victim.phase = Phase.RETRACTED
                self.retracted.append(victim)
        if step.retracted:
            needy = [r for r in needy if r.phase is Phase.RUNNING]
        for r in needy:
            r.kv_held += 1
        self.used_kv += need

    def _resume_retracted(self, headroom: int) -> None:
        while self.retracted and len(self.running) < self.max_running:
            req = self.retracted[0]
            need = self.admission_kv(req)
            if self.used_kv + need + headroom > self.kv_capacity:
                break
            self.retracted.popleft()
            req.kv_held = need
            self.used_kv += need
            self.run(req)

    # -- step formation ----------------------------------------------------------------------------
    def plan(self, now: float) -> Step:
        """The next step for the engine's role (``Step.idle`` when there is nothing to compute)."""
        self.retry_at = None
        step = Step()
        if self.role == "prefill":
            step.prefill = self._prefill_parts(self.chunk, _prompt_kv, now, step)
            if step.prefill:
                step.time_s = self.latency.prefill_batch_time_s(
                    (n, r.prefilled) for r, n in step.prefill)
            return step
        if self.role == "decode":
            if self.retracted or self.prealloc:
                # The running batch's next growth, left free for it (resumed requests hold their reservation).
                headroom = self._growth() if self.grows else 0
                if self.retracted:
                    self._resume_retracted(headroom)
                step.admitted = self.admit_prealloc(now, headroom)
            self._join_ready(now, step)
            if self.grows:
                self._grow(now, step)
            step.decode = self._decode_batch(now)
            if self.waiting or self.prefilling:  # prompts sent here to prefill locally: a mixed step
                self._mixed_step(now, step)
            elif step.decode:
                step.time_s = self._decode_time(step.decode)
            return step
        if self.ready:
            self._join_ready(now, step)
        if self.grows:
            self._grow(now, step)
        if self.give_up_late and self.waiting:
            self._give_up_late(now, step)
        step.decode = self._decode_batch(now)
        self._mixed_step(now, step)
        return step

    def _give_up_late(self, now: float, step: Step) -> None:
        """Colocated: out of the queue with the prompts that waited past their TTFT target and never started
        (none prefilled, none back from a retraction, whose output is already out)."""
        late = [r for r in self.waiting
                if now - r.arrival_s > r.slo_ttft_s and r.prefilled == 0 and not r.recompute]
        if not late:
            return
        gone = {id(r) for r in late}
        kept = [r for r in self.waiting if id(r) not in gone]
        self.waiting.clear()  # in place: the adapters hold this deque
        self.waiting.extend(kept)
        for req in late:
            req.phase = Phase.FINISHED  # it holds nothing: waiting prompts get KV only on admission
        step.given_up.extend(late)
        self.replan = True

    def _mixed_step(self, now: float, step: Step) -> None:
        """Decode-prioritised: the selected running requests decode, prefill chunks fill what is left of the
        budget (colocated engines, and decode engines with prompts to prefill locally)."""
        batch = step.decode
        step.prefill = self._prefill_parts(max(0, self.mixed_chunk - len(batch)), self.admission_kv, now, step)
        if not step.prefill:  # a decode step (the common case: once per token), or nothing at all
            if batch:
                step.time_s = self._decode_time(batch)
            return
        if self.decode_policy.selects_all:
            context = self.running_context
        else:
            contexts = [r.prompt_tokens + r.generated for r in batch]
            context = sum(contexts)
            if batch:  # the decode part's time, as the policy would see it alone
                self.decode_policy.observe(len(batch), max(contexts), context,
                                           self.latency.decode_step_time_s(len(batch), context))
        step.time_s = self.latency.mixed_step_time_s(
            len(batch), context, ((n, r.prefilled) for r, n in step.prefill))

    def _decode_batch(self, now: float) -> list[EngineRequest]:
        """The running requests that step now: all of them (continuous batching) unless the policy holds some."""
        if self.decode_policy.selects_all:
            return list(self.running)
        kv_waiting = len(self.prealloc) + len(self.retracted) if self.role == "decode" else len(self.waiting)
        return list(self.decode_policy.select(self.running, self.max_running, now, kv_waiting))

    def _decode_time(self, batch: list[EngineRequest]) -> float:
        if self.decode_policy.selects_all:
            return self.latency.decode_step_time_s(len(batch), self.running_context)
        contexts = [r.prompt_tokens + r.generated for r in batch]
        seconds = self.latency.decode_step_time_s(len(batch), sum(contexts))
        self.decode_policy.observe(len(batch), max(contexts), sum(contexts), seconds)
        return seconds

    def prefill_queue(self) -> list[EngineRequest]:
        """What the prefill policy plans over: every prompt with tokens left, admitted or waiting, in arrival
        order."""
        queue = [*self.prefilling, *self.waiting]
        queue.sort(key=_arrival)  # two sorted runs: timsort merges them in linear time
        return queue

    def _prefill_parts(self, budget: int, kv_for: Callable[[EngineRequest], int], now: float,
                       step: Step) -> list[tuple[EngineRequest, int]]:
        """The next pass's prompts: the policy's plan (or, for an event-driven policy between events, the rest
        of its last plan), admitted by KV in plan order."""
        if budget <= 0 or not (self.prefilling or self.waiting):
            return []
        policy = self.prefill_policy
        parts: list[tuple[EngineRequest, int]] | None = None
        if policy.event_driven and not self.replan:
            task = [r for r in self._task if r.prefilled < r.input_tokens and r.phase in _PREFILL_PHASES]
            if task:
                parts = fill(task, budget)
        if parts is None:
            plan = policy.plan(self.prefill_queue(), budget, now)
            self.replan = False
            parts = plan.parts
            self._task = [r for r, _ in parts]
            if not parts and plan.retry_at_s is not None:
                self.retry_at = plan.retry_at_s
        if not self.chunked:
            parts = whole_prompts(parts, budget)
        out: list[tuple[EngineRequest, int]] = []
        blocked = False
        slots = self._request_slots()
        for req, n in parts:
            if req.phase is not Phase.PREFILLING:
                need = kv_for(req)
                if blocked or slots <= 0 or not self._fits_prompt(req, need, now):
                    blocked = True  # in plan order: later prompts wait for KV too; admitted ones still run
                    continue
                need -= req.hold.matched_tokens if req.hold is not None else 0
                n = min(n, req.input_tokens - req.prefilled)  # its cached prefix counts as prefilled
                self.used_kv += need
                if self.role == "prefill":
                    req.prompt_kv = need
                else:
                    req.kv_held = need
                slots -= 1
                self.waiting.remove(req)
                req.phase = Phase.PREFILLING
                self.prefilling.append(req)
                step.prompts_admitted.append(req)
            out.append((req, n))
        if not out and blocked and self.prefilling:
            # The plan's prompts all wait for KV that the admitted ones (cut or chunked) hold: compute those,
            # in the policy's order, rather than stall.
            parts = policy.plan(list(self.prefilling), budget, now).parts
            out = whole_prompts(parts, budget) if not self.chunked else parts
        return out

    def _request_slots(self) -> int:
        """How many more prompts a colocated engine may admit to prefill: SGLang caps a new prefill batch at
        ``max_running_requests`` less the requests it already runs (``get_num_allocatable_reqs``), so past
        that arrivals wait unprefilled, holding no KV. Other roles: no cap here (a prefill engine's passes
        stay far below it, a decode engine's local prompts are DOPD's few short ones)."""
        if self.role != "null":
            return self.max_running
        return self.max_running - len(self.running) - len(self.ready) - len(self.prefilling)

    def _fits_prompt(self, req: EngineRequest, need: int, now: float) -> bool:
        """Whether a prompt needing ``need`` KV tokens can be admitted now. With a prefix cache its cached
        prefix is locked first (that KV is there already) and unlocked cache is evicted for the rest; a
        prompt that still does not fit gives its lock back."""
        cache = self.cache
        if cache is None:
            return self.used_kv + need <= self.kv_capacity
        if not req.blocks or req.recompute:
            return cache.make_room(need, self.kv_capacity - self.used_kv)
        hold = cache.claim(req.blocks, req.input_tokens, need, self.kv_capacity - self.used_kv, now)
        if hold is None:
            return False
        req.hold, req.cached = hold, hold.cached_tokens
        req.prefilled = max(req.prefilled, hold.cached_tokens)
        return True

    # -- operator preemption (FlowPrefill) ---------------------------------------------------------
    def preemption_point(self, step: Step, start: float, now: float) -> float | None:
        """A prompt arrived during the prefill pass ``step`` (started at ``start``): the policy re-plans, and if
        the new plan's head is not in the running pass (and could be admitted), the pass stops at its next
        operator boundary. Returns that time, or None to let the pass run."""
        plan = self.prefill_policy.plan(self.prefill_queue(), self.chunk, now)
        if not preempts(plan, step.prefill):
            return None
        head = plan.parts[0][0]
        if head.phase is not Phase.PREFILLING and self.used_kv + head.input_tokens > self.kv_capacity:
            return None  # it could not run after the cut either: cutting would only leave more KV half-used
        cut = self.latency.operator_boundary_s(start, now, step.time_s, self.latency.attention_share(
            (n, r.prefilled) for r, n in step.prefill))
        return cut if cut < start + step.time_s else None

    def cut(self, step: Step, elapsed_s: float) -> int:
        """The prefill pass ``step`` stopped ``elapsed_s`` in (an operator boundary): each part keeps the
        tokens whose work is the elapsed share of its own, the prompts keep their KV, and the next pass follows
        a new plan. Returns the tokens computed."""
        frac = elapsed_s / step.time_s if step.time_s > 0 else 1.0
        done = 0
        for req, n in step.prefill:
            if req.phase is not Phase.PREFILLING:
                continue
            k = min(n - 1, self.latency.prefill_tokens_done(n, req.prefilled, frac))  # a cut never completes a prompt
            if k > 0:
                req.prefilled += k
                done += k
        self.prefill_policy.observe(done, elapsed_s)
        self.replan = True
        return done

    # -- a step's effects --------------------------------------------------------------------------
    def apply(self, step: Step, now: float) -> Applied:
        """The step's effects at its end: one token per decoding request (finishing those at their length), the
        prefill progress (completed prompts join the tree; on colocated and decode engines they join the batch
        at the next boundary). Every request of ``step.decode`` must still be running: an adapter that lets
        requests leave during a step calls :meth:`Step.drop_departed` first."""
        finished: list[EngineRequest] = []
        done: list[EngineRequest] = []
        batch = step.decode
        if batch:
            self.running_context += len(batch)
            for req in batch:  # once per token of a whole trace: locals, not attribute reads
                generated = req.generated + 1
                req.generated = generated
                if generated >= req.output_tokens:
                    self.unrun(req)
                    self._finish(req, now)
                    finished.append(req)
        if step.prefill:
            self.prefill_policy.observe(sum(n for _, n in step.prefill), step.time_s)
            for req, n in step.prefill:
                if req.phase is not Phase.PREFILLING:
                    continue
                req.prefilled += n
                if req.prefilled >= req.input_tokens:
                    self.prefilling.remove(req)
                    self.replan = True
                    self._prompt_done(req, now)
                    done.append(req)
        return Applied(finished, done)

    def _prompt_done(self, req: EngineRequest, now: float) -> None:
        if req.hold is not None and self.cache is not None:
            # The computed prompt joins the tree: its own copy of those blocks is the tree's from now on.
            self.cache.insert(req.hold, now)
            moved = req.hold.tree_tokens - req.hold.matched_tokens
            self.used_kv -= moved
            if self.role == "prefill":
                req.prompt_kv -= moved
            else:
                req.kv_held -= moved
        if self.role == "prefill":
            req.phase = Phase.INFLIGHT
            return
        if req.recompute:  # back from a retraction: its output is already out
            req.recompute = False
            req.input_tokens = req.prompt_tokens
            self.run(req)
            return
        req.phase = Phase.READY
        self.ready.append(req)  # first token when it joins the batch, at once if there is room


_PREFILL_PHASES = (Phase.WAITING, Phase.PREFILLING)


def _prompt_kv(req: EngineRequest) -> int:
    return req.input_tokens


def _arrival(req: EngineRequest) -> float:
    return req.arrival_s


def given_up_reason(waited_s: float, slo_ttft_s: float) -> str:
    """What a prompt a colocated engine gave up (``give_up_late``) is told, with a retryable 429 (engine_sim and
    the simulator alike)."""
    return f"waited {waited_s:.1f} s without starting, past its TTFT target of {slo_ttft_s:.1f} s; retry later"


def retraction_order(req: EngineRequest) -> tuple[int, int]:
    """SGLang's decode retraction order (``shared.policies.retraction``): the first to go sorts lowest."""
    return retraction_key(req.generated, req.prompt_tokens)
