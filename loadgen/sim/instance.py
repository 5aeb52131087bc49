"""One simulated engine: batching like SGLang, timed by the shared latency model, ordered by the engine policies.

What is modelled, per role (times from :class:`shared.latency.LatencyModel`, as in engine_sim):

- **prefill**: a request waits until its decode instance has reserved KV for it (SGLang's ``early`` decode
  allocation: the prefill starts once the decode side claimed the bootstrap room); then the prefill policy
  plans each forward pass (FCFS chunks by default, see ``shared.policies.prefill_order``) and the planned
  prompts are admitted by KV capacity in plan order. With ``chunk`` preemption a pass is one chunk of up
  to ``chunk_tokens``; with ``operator`` preemption an arriving prompt the policy ranks first cuts the
  running pass at its next operator boundary (FlowPrefill), the cut prompts keeping the work done. Its KV
  is held until the transfer to the decode instance ends.
- **decode**: KV for prompt + output is reserved at dispatch time in FCFS order (a request waits while it
  does not fit); after the prefill, the KV transfer takes ``kv_transfer_time_s(prompt)``; the request then
  joins the running batch (at most ``max_running_requests``) and its first token is emitted; every decode
  step emits one token per request the decode batch policy selects (all of them, by default).
- **null** (colocated): decode-prioritised mixed steps, every running request decodes and prefill chunks
  fill the chunk budget; a request's first token comes at the end of the step that finishes its prompt.

Lifecycle (driven by :class:`loadgen.sim.cluster.SimCluster`): ``starting`` → ``ready``; ``draining``
(takes no new requests, finishes what it has) → ``switching`` (the role switch's cost) → ``ready`` in the new
role, or → ``stopped``. A decode request can be migrated out (see ``migrate_out``): it stalls for the
migration mechanism's time (``shared.policies.migration_cost``: a KV copy or a recompute) while the other
requests of both instances keep decoding.

Decode KV, two models (``EngineSpec.decode_kv``):

- ``whole`` (default): KV for prompt + whole output is reserved at admission, so no request ever runs out of
  memory: an oracle no engine has (it knows the output length), which queues requests instead of retracting
  them. What a decode engine *reports* as its KV use is that reservation by default, so a KV-balancing
  dispatcher sees every request's final size; with ``EngineSpec.kv_report = "current"`` it reports the tokens
  its requests hold so far (prompt + generated), as SGLang does and as ARES' baseline balances on.
- ``grow`` (SGLang's and engine_sim's): admission reserves prompt + min(remaining output,
  ``reserved_decode_tokens``), a request that outgrows that takes free KV a token per step, and when a step's
  growth does not fit, a running request is retracted in SGLang's order (fewest output tokens first, then
  the longest prompt): parked with its KV notionally on the host,
  not decoding, and resumed (before any new admission) once its context plus a reservation fits again. This
  is where imbalanced decode instances lose (ARES' OOMs). The engine reports the KV it holds.

Prefix cache (``EngineSpec.prefix_cache``, SGLang's radix cache: ``shared.engine.prefix_cache``): prefill and
colocated instances keep the KV of the prompts they computed, by the requests' prefix blocks (the Mooncake
traces' ``hash_ids``). A prompt admitted there skips its cached prefix (it counts as already prefilled) and
allocates KV only for the rest; the tree shares the KV pool, and its unlocked blocks are evicted, least
recently used first, when an admission needs the room. A computed prompt joins the tree, locked until the
request lets go of its KV (a prefill instance at the end of the transfer, a colocated one at the finish).
A role change starts an empty tree (SGLang resets its radix cache on a switch). Decode instances keep no
cache (SGLang's ``--disaggregation-decode-enable-radix-cache`` is off by default).

Colocated instances always reserve whole outputs. Transfers do not contend for bandwidth. The serving path's own delay before the first token
(HTTP legs, bootstrap handshake) is a per-request draw calibrated on the live stack (``overhead.py``).
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from loadgen.sim.events import PRIORITY_STEP_END, PRIORITY_TRANSFER_DONE, EventQueue
from shared.engine import CacheHold, PrefixCache
from shared.latency import LatencyModel
from shared.policies import EngineView, Preemption, make_decode_batch_policy, make_prefill_policy, preempts
from shared.policies.prefill_order import MAX_PREFILL_TOKENS, fill, whole_prompts
from shared.policies.retraction import retraction_key
from shared.protocol.messages import Role

SimStatus = Literal["starting", "ready", "draining", "switching", "stopped"]


@dataclass(frozen=True)
class EngineSpec:
    """How every engine of a simulated cluster schedules inside itself (engine_sim's settings of the same
    names). Policies are built per instance: some keep online estimates (Kairos' throughput, its LUT)."""

    prefill_policy: str = "fcfs"
    decode_policy: str = "continuous"
    preemption: Preemption = "chunk"
    chunk_tokens: int | None = None  # None: the profile's chunked_prefill_size; <= 0: prompts are not chunked
    kv_report: Literal["reserved", "current"] = "reserved"  # decode KV use as reported (see the module doc)
    decode_kv: Literal["whole", "grow"] = "whole"  # decode KV admission: whole outputs, or grow and retract
    reserved_decode_tokens: int = 512  # grow: output KV set aside at admission (SGLang's default)
    prefix_cache: bool = False  # prefill and colocated instances reuse cached prompt prefixes (the module doc)

    def describe(self) -> str:
        chunk = "profile" if self.chunk_tokens is None else ("off" if self.chunk_tokens <= 0 else str(self.chunk_tokens))
        kv = "" if self.kv_report == "reserved" else ", reports current KV"
        if self.decode_kv == "grow":
            kv += f", decode KV grows from prompt + {self.reserved_decode_tokens} and retracts when full"
        cache = ", radix prefix cache" if self.prefix_cache else ""
        return (f"prefill {self.prefill_policy} ({self.preemption} preemption, chunk {chunk}){cache}, "
                f"decode {self.decode_policy}{kv}")


@dataclass
class PreemptionStats:
    """Operator-level cuts an instance made: how many and how long the preempting prompt waited for each."""

    count: int = 0
    blocking_s: list[float] = field(default_factory=list)


@dataclass(eq=False, slots=True)
class SimRequest:
    """One request's progress through the simulated cluster (times in simulated seconds)."""

    index: int
    rid: str
    arrival_s: float
    input_tokens: int
    output_tokens: int
    slo_ttft_s: float = float("inf")
    slo_tpot_s: float = float("inf")
    slo_class: str | None = None
    prefilled: int = 0  # prompt tokens computed so far
    admitted: bool = False  # prefill/null: its prompt's KV is allocated on the instance
    generated: int = 0  # output tokens emitted so far
    first_token_s: float | None = None
    finished_s: float | None = None
    error: str | None = None
    prefill: SimInstance | None = None
    decode: SimInstance | None = None
    migrate_to: SimInstance | None = None  # set while a migration waits for the current step to end
    migrate_from: SimInstance | None = None  # set from the migration decision until it joined the target
    migrations: int = 0
    predicted: float = 0.0  # the length predictor's latest output (remaining tokens) ...
    predicted_at: int = -1  # ... made at this many generated tokens (loadgen.sim.prediction)
    kv_held: int = 0  # KV held on its decode (or colocated) instance
    kv_incoming: int = 0  # KV reserved on a migration's target, until the move is done
    retractions: int = 0  # times a decode instance parked it for lack of KV (grow model)
    blocks: tuple[int, ...] = ()  # the prompt's prefix blocks (a trace's hash_ids): the prefix cache's key
    cached: int = 0  # prompt tokens its prefill or colocated instance found in its prefix cache
    hold: CacheHold | None = None  # its claim on that cache, from admission until it lets go of its KV

    @property
    def kv_tokens(self) -> int:
        """KV a decode or colocated instance reserves for the request (prompt + whole output)."""
        return self.input_tokens + self.output_tokens


def retraction_order(req: SimRequest) -> tuple[int, int]:
    """SGLang's decode retraction order (``shared.policies.retraction``)."""
    return retraction_key(req.generated, req.input_tokens)


class SimInstance:
    """One engine. ``kick()`` starts a step whenever the instance is idle and has work."""

    def __init__(self, instance_id: str, role: Role, model: LatencyModel, queue: EventQueue,
                 on_finish: Callable[[SimRequest], None], first_token_delay: Callable[[int], float] = lambda i: 0.0,
                 *, engine: EngineSpec | None = None, on_prefill_done: Callable[[SimInstance], None] | None = None,
                 on_drained: Callable[[SimInstance], None] | None = None, status: SimStatus = "ready",
                 handshake_s: float = 0.0, migration_s: Callable[[int], float] | None = None) -> None:
        p = model.profile
        self.instance_id = instance_id
        self.role: Role = role
        self.status: SimStatus = status
        self.model = model
        self.queue = queue
        self.on_finish = on_finish
        self.on_drained = on_drained
        self.on_prefill_done = on_prefill_done  # a prompt left this prefill instance (late binding listens)
        self.first_token_delay = first_token_delay
        self.handshake_s = handshake_s  # decode claims the bootstrap room -> the prefill may start (HTTP hop)
        # A migrating request's stall for its context tokens (the migration mechanism; default: a KV copy).
        self.migration_s = migration_s or model.kv_transfer_time_s
        self.engine = engine or EngineSpec()
        self.prefill_policy = make_prefill_policy(self.engine.prefill_policy, model)
        self.decode_batch = make_decode_batch_policy(self.engine.decode_policy, model)
        self.kv_capacity = p.kv_capacity_tokens
        self.max_running = p.max_running_requests
        chunk = p.chunked_prefill_size if self.engine.chunk_tokens is None else self.engine.chunk_tokens
        self.chunked = chunk > 0
        self.chunk = chunk if self.chunked else MAX_PREFILL_TOKENS
        self.mixed_chunk = chunk if self.chunked else p.chunked_prefill_size
        self.cache: PrefixCache | None = PrefixCache() if self.engine.prefix_cache else None
        self.preemptible = self.engine.preemption == "operator"
        self.preemptions = PreemptionStats()
        self.used_kv = 0
        self.busy = False
        self.waiting: deque[SimRequest] = deque()  # prefill/null: before KV admission
        self.prefilling: list[SimRequest] = []  # prefill/null: admitted, prompt not done
        self.reserve_queue: deque[SimRequest] = deque()  # decode: waiting for KV
        self.ready: deque[SimRequest] = deque()  # decode/null: KV in place, waiting for a batch slot
        self.running: list[SimRequest] = []  # decode/null: in the decode batch (_run / _unrun)
        self.running_context = 0  # sum of the running requests' contexts (prompt + generated), kept as they change
        self.retracted: deque[SimRequest] = deque()  # decode, grow model: parked for lack of KV, oldest first
        self.retractions = 0
        self.incoming: list[SimRequest] = []  # decode: migrating here (KV reserved), not yet in the batch
        self.assigned = 0  # requests dispatched (or migrated) here and not done here
        self.pending_tokens = 0  # prefill: prompt tokens not computed yet; decode: KV not reserved yet
        self.pending_sq = 0  # prefill: sum of squared prompt lengths of prompts not done yet
        self.pending_prompt_tokens = 0  # decode: the prompt part of pending_tokens
        self.unwritten_kv = 0  # decode: reserved KV of output tokens not generated yet (used_kv - current use)
        self.step_ewma_s: float | None = None  # decode/null: recent decode step time (the token interval)
        self.on_prefill_step: Callable[[SimInstance, list[tuple[SimRequest, int]], float], None] | None = None
        self.steps = 0
        self._batch: list[SimRequest] = []
        self._plan: list[tuple[SimRequest, int]] = []
        self._step_id = 0  # a cut step's end event finds a newer id and does nothing
        self._step_start_s = 0.0
        self._step_s = 0.0
        self._cut_at: float | None = None
        self._replan = True  # event-driven policies: a prompt arrived or one finished since the last plan
        self._task: list[SimRequest] = []  # event-driven policies: the prompts of the last plan
        self._retry_at: float | None = None

    # -- what the dispatcher sees ------------------------------------------------------------------
    @property
    def reports_current_kv(self) -> bool:
        return self.engine.kv_report == "current" and self.role == "decode"

    @property
    def grows_kv(self) -> bool:
        return self.engine.decode_kv == "grow" and self.role == "decode"

    @property
    def reported_kv(self) -> int:
        """KV use as the engine reports it (see the module doc)."""
        return self.used_kv - self.unwritten_kv if self.reports_current_kv and not self.grows_kv else self.used_kv

    def admission_kv(self, req: SimRequest) -> int:
        """KV the request needs to be admitted (or resumed, or migrated in) here: see the module doc."""
        if not self.grows_kv:
            return req.kv_tokens
        remaining = req.output_tokens - req.generated
        reserve = max(1, min(remaining, self.engine.reserved_decode_tokens)) if remaining > 0 else 0
        return req.input_tokens + req.generated + reserve

    def _needs_growth(self, req: SimRequest) -> bool:
        return req.input_tokens + req.generated + 1 > req.kv_held

    def view(self) -> EngineView:
        current = self.reports_current_kv
        return EngineView(
            instance_id=self.instance_id, role=self.role, status="ready" if self.status == "ready" else "draining",
            kv_capacity_tokens=self.kv_capacity, max_running_requests=self.max_running,
            running_reqs=len(self.running) + len(self.prefilling),
            waiting_reqs=self.waiting_reqs,
            used_tokens=self.reported_kv + (self.cache.locked_tokens if self.cache is not None else 0),
            load_age_s=0.0, inflight_reqs=self.assigned,
            inflight_tokens=self.pending_prompt_tokens if current else self.pending_tokens,
            inflight_tokens_sq=self.pending_sq, token_interval_s=self.step_ewma_s if self.running else None,
            local_prefill=self.role == "decode",
        )

    @property
    def waiting_reqs(self) -> int:
        return len(self.waiting) + len(self.reserve_queue) + len(self.ready) + len(self.retracted)

    @property
    def empty(self) -> bool:
        return self.assigned == 0 and self.used_kv == 0 and not self.busy

    # -- intake ------------------------------------------------------------------------------------
    def enqueue_prefill(self, req: SimRequest) -> None:
        self.enqueue_prefills([req])

    def enqueue_prefills(self, reqs: list[SimRequest]) -> None:
        self.waiting.extend(reqs)
        self._replan = True
        if self.busy and self.preemptible and self.role == "prefill" and self._plan and self._cut_at is None:
            self._maybe_preempt()
        self.kick()

    def _maybe_preempt(self) -> None:
        """Operator preemption: an arrival re-plans; a plan headed by a prompt outside the running pass cuts
        the pass at its next operator boundary."""
        now = self.queue.now_s
        plan = self.prefill_policy.plan(self._prefill_queue(), self.chunk, now)
        if not preempts(plan, self._plan):
            return
        head = plan.parts[0][0]
        if not head.admitted and self.used_kv + head.input_tokens > self.kv_capacity:
            return  # it could not run after the cut either: cutting would only leave more KV half-used
        cut = self.model.operator_boundary_s(self._step_start_s, now, self._step_s, self.model.attention_share(
            (n, r.prefilled) for r, n in self._plan))
        if cut >= self._step_start_s + self._step_s:
            return  # the pass ends at that boundary anyway
        self._cut_at = cut
        self.preemptions.count += 1
        self.preemptions.blocking_s.append(cut - now)
        self.queue.at(cut, PRIORITY_STEP_END, functools.partial(self._cut, self._step_id))

    def _cut(self, step_id: int) -> None:
        if step_id != self._step_id:
            return
        frac = (self.queue.now_s - self._step_start_s) / self._step_s if self._step_s > 0 else 1.0
        done = 0
        for req, n in self._plan:
            # engine_sim keeps the same share; a cut never completes a prompt (its end is the pass's job)
            k = min(n - 1, self.model.prefill_tokens_done(n, req.prefilled, frac))
            req.prefilled += k
            done += k
        self.pending_tokens -= done
        self.prefill_policy.observe(done, self.queue.now_s - self._step_start_s)
        self._plan = []
        self._cut_at = None
        self._step_id += 1
        self.busy = False
        self._replan = True
        self.kick()

    def enqueue_reserve(self, req: SimRequest) -> None:
        self.reserve_queue.append(req)
        if not self.busy:  # a busy engine claims rooms between two steps (engine_sim's and SGLang's loop)
            self._reserve()

    def _reserve(self) -> None:
        """Decode: reserve KV for queued requests in order; each reserved one may start its prefill once the
        claim reached the prefill engine (``handshake_s`` later). Claims made together arrive together, so
        a prefill engine sees them in one scheduling round (and may batch them in one step)."""
        claimed: dict[SimInstance, list[SimRequest]] = {}
        if self.retracted:
            return  # retracted requests get the KV back first (SGLang resumes them before new preallocations)
        headroom = self._growth() if self.grows_kv else 0  # leave the running batch its next step's growth
        while self.reserve_queue and self.used_kv + self.admission_kv(self.reserve_queue[0]) + headroom <= self.kv_capacity:
            req = self.reserve_queue.popleft()
            req.kv_held = self.admission_kv(req)
            self.used_kv += req.kv_held
            self.unwritten_kv += req.output_tokens
            self.pending_tokens -= req.kv_tokens
            self.pending_prompt_tokens -= req.input_tokens
            assert req.prefill is not None
            claimed.setdefault(req.prefill, []).append(req)
        for prefill, reqs in claimed.items():
            if self.handshake_s > 0:
                self.queue.at(self.queue.now_s + self.handshake_s, PRIORITY_TRANSFER_DONE,
                              functools.partial(prefill.enqueue_prefills, reqs))
            else:
                prefill.enqueue_prefills(reqs)

    def transfer_done(self, req: SimRequest) -> None:
        self.ready.append(req)
        self.kick()

    def release(self, tokens: int) -> None:
        self.used_kv -= tokens
        if self.role == "decode" and not self.busy:
            self._reserve()
        self.kick()

    # -- migration (decode → decode) ---------------------------------------------------------------
    def migrate_out(self, req: SimRequest, target: SimInstance) -> bool:
        """Move a running request to ``target``; False when it cannot move now (the target has no room for its
        KV, is not a ready decode instance, or the request is not running here or already moving).

        The target reserves the request's KV at once and lists it as incoming; the request leaves the batch
        at the end of the current step (at once when the instance is idle), stalls for ``migration_s`` of its
        context (the mechanism: a KV copy or a recompute), and then joins the target's batch. The source
        frees its KV when the move is done; its other requests decode on meanwhile.
        """
        if req.decode is not self or req not in self.running or req.migrate_to is not None:
            return False
        need = target.admission_kv(req)
        if target.status != "ready" or target.role != "decode" or target.used_kv + need > target.kv_capacity:
            return False
        req.kv_incoming = need
        target.used_kv += need
        target.assigned += 1
        target.incoming.append(req)
        req.migrate_to = target
        req.migrate_from = self
        if not self.busy:
            self._detach_migrating(req)
        return True

    def _cancel_move(self, req: SimRequest) -> None:
        """A move decided but not started (the request finished, or was retracted, first)."""
        target = req.migrate_to
        assert target is not None
        req.migrate_to = req.migrate_from = None
        target.assigned -= 1
        target.incoming.remove(req)
        target.release(req.kv_incoming)
        req.kv_incoming = 0

    def _detach_migrating(self, req: SimRequest) -> None:
        target = req.migrate_to
        assert target is not None
        req.migrate_to = None
        self._unrun(req)
        self.assigned -= 1
        req.migrations += 1
        req.decode = target

        unwritten = req.output_tokens - req.generated  # no tokens come while it moves
        target.unwritten_kv += unwritten
        held, req.kv_held, req.kv_incoming = req.kv_held, req.kv_incoming, 0

        def copied() -> None:
            target.incoming.remove(req)
            req.migrate_from = None
            self.unwritten_kv -= unwritten
            self.release(held)
            target.transfer_done(req)

        delay = self.migration_s(req.input_tokens + req.generated)
        self.queue.at(self.queue.now_s + delay, PRIORITY_TRANSFER_DONE, copied)

    # -- steps -------------------------------------------------------------------------------------
    def kick(self) -> None:
        if self.busy:
            return
        duration = self._begin_step()
        if duration is None:
            if self.status == "draining" and self.empty and self.on_drained is not None:
                self.on_drained(self)
            return
        self.busy = True
        self.steps += 1
        self._step_id += 1
        self._step_start_s = self.queue.now_s
        self._step_s = duration
        if self._batch:
            # Decode steps set the token interval (EWMA over ~10 steps, like a monitor's recent average).
            self.step_ewma_s = duration if self.step_ewma_s is None else 0.9 * self.step_ewma_s + 0.1 * duration
        elif self._plan and self.on_prefill_step is not None:
            self.on_prefill_step(self, self._plan, duration)
        self.queue.at(self.queue.now_s + duration, PRIORITY_STEP_END, functools.partial(self._end_step, self._step_id))

    def _prefill_queue(self) -> list[SimRequest]:
        """Every prompt with tokens left, admitted or waiting, in arrival order (as engine_sim's)."""
        queue = [*self.prefilling, *self.waiting]
        queue.sort(key=lambda r: r.arrival_s)  # two sorted runs: timsort merges them in linear time
        return queue

    def _prefill_parts(self, budget: int, kv_per_request: Callable[[SimRequest], int]) -> list[tuple[SimRequest, int]]:
        """The next pass's prompts: the policy's plan (or, for an event-driven policy between events, the
        rest of its last plan), admitted by KV in plan order."""
        if budget <= 0 or not (self.prefilling or self.waiting):
            return []
        now = self.queue.now_s
        policy = self.prefill_policy
        parts: list[tuple[SimRequest, int]] | None = None
        if policy.event_driven and not self._replan:
            task = [r for r in self._task if r.prefilled < r.input_tokens]
            if task:
                parts = fill(task, budget)
        if parts is None:
            plan = policy.plan(self._prefill_queue(), budget, now)
            self._replan = False
            parts = plan.parts
            self._task = [r for r, _ in parts]
            if not parts and plan.retry_at_s is not None:
                self._retry(plan.retry_at_s)
        if not self.chunked:
            parts = whole_prompts(parts, budget)
        admitted: list[tuple[SimRequest, int]] = []
        blocked = False
        for req, n in parts:
            if not req.admitted:
                need = kv_per_request(req)
                if blocked or not self._fits_prompt(req, need):
                    blocked = True  # in plan order: later prompts wait for KV too; admitted ones still run
                    continue
                need -= req.hold.matched_tokens if req.hold is not None else 0
                n = min(n, req.input_tokens - req.prefilled)  # its cached prefix counts as prefilled
                self.used_kv += need
                if self.role != "prefill":  # its decode-side KV (a prefill instance frees its own on the handoff)
                    req.kv_held = need
                if self.role == "decode":  # a local prompt: its KV was pending, its output not yet written
                    self.unwritten_kv += req.output_tokens
                    self.pending_tokens -= req.kv_tokens
                    self.pending_prompt_tokens -= req.input_tokens
                req.admitted = True
                self.waiting.remove(req)
                self.prefilling.append(req)
            admitted.append((req, n))
        if not admitted and blocked and self.prefilling:
            # The plan's prompts all wait for KV that the admitted ones (cut or chunked) hold: compute those,
            # in the policy's order, rather than stall (engine_sim does the same).
            parts = policy.plan(list(self.prefilling), budget, now).parts
            admitted = whole_prompts(parts, budget) if not self.chunked else parts
        return admitted

    def _fits_prompt(self, req: SimRequest, need: int) -> bool:
        """Whether a prompt needing ``need`` KV tokens can be admitted now. With a prefix cache its cached
        prefix is locked first (that KV is there already) and unlocked cache is evicted for the rest; a
        prompt that still does not fit gives its lock back."""
        cache = self.cache
        if cache is None or not req.blocks or self.role == "decode":
            return self.used_kv + need <= self.kv_capacity
        hold = cache.claim(req.blocks, req.input_tokens, need, self.kv_capacity - self.used_kv, self.queue.now_s)
        if hold is None:
            return False
        req.hold, req.cached = hold, hold.cached_tokens
        skipped = max(0, hold.cached_tokens - req.prefilled)
        req.prefilled += skipped
        if self.role == "prefill":
            self.pending_tokens -= skipped
        return True

    def reset_cache(self) -> None:
        """An empty prefix cache (a role change: SGLang resets its radix cache on a switch)."""
        self.cache = PrefixCache() if self.engine.prefix_cache else None

    def _retry(self, at_s: float) -> None:
        """Ask the prefill policy again at ``at_s`` (it chose to wait, e.g. for a batching timeout)."""
        if self._retry_at is not None and self._retry_at <= at_s:
            return
        self._retry_at = at_s

        def wake() -> None:
            if self._retry_at is not None and self.queue.now_s >= self._retry_at:
                self._retry_at = None
                self._replan = True
                self.kick()

        self.queue.at(max(at_s, self.queue.now_s), PRIORITY_STEP_END, wake)

    def _join_ready(self) -> None:
        now = self.queue.now_s
        while self.ready and len(self.running) < self.max_running:
            req = self.ready.popleft()
            if req.generated:  # migrated in: it already had its first token
                self._run(req)
                continue
            req.first_token_s = now
            req.generated = 1
            if self.role == "decode":
                self.unwritten_kv -= 1
            if req.generated >= req.output_tokens:
                self._finish(req)
            else:
                self._run(req)

    # -- the grow model's KV (module doc) ---------------------------------------------------------------
    def _growth(self) -> int:
        """Free KV the running batch's next step takes (one token each beyond what it holds)."""
        return sum(1 for r in self.running if self._needs_growth(r))

    def _grow(self) -> None:
        """Give every running request the KV of its next token, retracting the newest while that does not fit."""
        need = self._growth()
        while need > self.kv_capacity - self.used_kv and self.running:
            victim = min(self.running, key=retraction_order)
            self._unrun(victim)
            if self._needs_growth(victim):
                need -= 1
            if victim.migrate_to is not None:
                self._cancel_move(victim)
            self.used_kv -= victim.kv_held
            victim.kv_held = 0
            victim.retractions += 1
            self.retractions += 1
            self.retracted.append(victim)
        for r in self.running:
            if self._needs_growth(r):
                r.kv_held += 1
        self.used_kv += need
        assert self.used_kv <= self.kv_capacity, f"{self.instance_id}: KV over capacity after retractions"

    def _resume_retracted(self) -> None:
        headroom = self._growth()
        while self.retracted and len(self.running) < self.max_running:
            req = self.retracted[0]
            need = self.admission_kv(req)
            if self.used_kv + need + headroom > self.kv_capacity:
                break
            self.retracted.popleft()
            req.kv_held = need
            self.used_kv += need
            self._run(req)

    def _run(self, req: SimRequest) -> None:
        self.running.append(req)
        self.running_context += req.input_tokens + req.generated

    def _unrun(self, req: SimRequest) -> None:
        self.running.remove(req)
        self.running_context -= req.input_tokens + req.generated

    def _batch_context(self) -> int:
        """The batch's summed context: the running total when the batch is every running request (a step per
        token of the trace would otherwise re-add the whole batch)."""
        if self.decode_batch.selects_all:
            return self.running_context
        return sum(r.input_tokens + r.generated for r in self._batch)

    def _decode_batch(self) -> list[SimRequest]:
        if self.decode_batch.selects_all:
            return list(self.running)
        kv_waiting = len(self.reserve_queue) + len(self.retracted) if self.role == "decode" else len(self.waiting)
        return list(self.decode_batch.select(self.running, self.max_running, self.queue.now_s, kv_waiting))

    def _decode_time(self, batch: list[SimRequest]) -> float:
        if self.decode_batch.selects_all:
            return self.model.decode_step_time_s(len(batch), self.running_context)
        contexts = [r.input_tokens + r.generated for r in batch]
        seconds = self.model.decode_step_time_s(len(batch), sum(contexts))
        self.decode_batch.observe(len(batch), max(contexts), sum(contexts), seconds)
        return seconds

    def _begin_step(self) -> float | None:
        if self.status in ("starting", "switching", "stopped"):
            return None
        if self.role == "prefill":
            self._plan = self._prefill_parts(self.chunk, lambda r: r.input_tokens)
            if not self._plan:
                return None
            return self.model.prefill_batch_time_s((n, r.prefilled) for r, n in self._plan)
        if self.role == "decode":
            if self.grows_kv:
                self._resume_retracted()
            self._reserve()
            self._join_ready()
            if self.grows_kv:
                self._grow()
            self._batch = self._decode_batch()
            if self.waiting or self.prefilling:  # prompts sent here to prefill locally: a mixed step
                return self._mixed_step()
            if not self._batch:
                return None
            return self._decode_time(self._batch)
        self._join_ready()
        self._batch = self._decode_batch()
        return self._mixed_step()

    def _mixed_step(self) -> float | None:
        """Colocated (and decode with local prompts): decode-prioritised, prefill chunks fill what the decode
        batch leaves of the budget. The budget is the chunk size even when prefill instances run unchunked
        (FlowPrefill's operator preemption): a mixed step's prefill part delays every running request's next
        token (live, the launcher starts colocated engines chunked: services/worker/launcher.py)."""
        self._plan = self._prefill_parts(max(0, self.mixed_chunk - len(self._batch)), self.admission_kv)
        if not self._batch and not self._plan:
            return None
        return self.model.mixed_step_time_s(len(self._batch), self._batch_context(), ((n, r.prefilled) for r, n in self._plan))

    def _end_step(self, step_id: int) -> None:
        if step_id != self._step_id:
            return  # this pass was cut at an operator boundary (_cut)
        self.busy = False
        self._cut_at = None
        if self.role in ("decode", "null"):
            self.unwritten_kv -= len(self._batch) if self.role == "decode" else 0
            self.running_context += len(self._batch)
            for req in self._batch:  # once per token of the whole trace: locals, not attribute reads
                generated = req.generated + 1
                req.generated = generated
                if generated >= req.output_tokens:
                    self._unrun(req)
                    if req.migrate_to is not None:  # finished before it could move: give the room back
                        self._cancel_move(req)
                    self._finish(req)
                elif req.migrate_to is not None:
                    self._detach_migrating(req)
        if self._plan:  # prefill, colocated, or decode with local prompts
            self.prefill_policy.observe(sum(n for _, n in self._plan), self._step_s)
            for req, n in self._plan:
                req.prefilled += n
                self.pending_tokens -= n if self.role == "prefill" else 0
                if req.prefilled >= req.input_tokens:
                    self.prefilling.remove(req)
                    self._replan = True
                    self._prompt_done(req)
            self._plan = []
            if self._replan and self.role == "prefill" and self.on_prefill_done is not None:
                self.on_prefill_done(self)  # may send this instance more prompts: after the step's own effects
        self._batch = []
        self.kick()

    def _prompt_done(self, req: SimRequest) -> None:
        if req.hold is not None and self.cache is not None:
            # The computed prompt joins the tree: its own copy of those blocks is the tree's from now on.
            self.cache.insert(req.hold, self.queue.now_s)
            moved = req.hold.tree_tokens - req.hold.matched_tokens
            self.used_kv -= moved
            if self.role != "prefill":
                req.kv_held -= moved
        if self.role != "prefill":  # colocated, or prefilled locally on a decode instance: no KV to move
            self.ready.append(req)  # first token when it joins the batch, at once if there is room
            return
        # prefill: hand the KV to the decode instance; this instance keeps it until the copy is done
        self.assigned -= 1
        self.pending_sq -= req.input_tokens * req.input_tokens
        decode = req.decode
        assert decode is not None

        def arrived() -> None:
            hold, req.hold = req.hold, None
            if hold is not None and self.cache is not None:
                self.cache.release(hold, self.queue.now_s)
                self.release(req.input_tokens - hold.tree_tokens)
            else:
                self.release(req.input_tokens)
            decode.transfer_done(req)

        # The KV copy, plus the serving path's own handoff delay (see loadgen/sim/overhead.py).
        delay = self.model.kv_transfer_time_s(req.input_tokens) + self.first_token_delay(req.index)
        self.queue.at(self.queue.now_s + delay, PRIORITY_TRANSFER_DONE, arrived)

    def _finish(self, req: SimRequest) -> None:
        req.finished_s = self.queue.now_s
        self.assigned -= 1
        self.used_kv -= req.kv_held
        req.kv_held = 0
        if req.hold is not None and self.cache is not None:
            self.cache.release(req.hold, self.queue.now_s)
            req.hold = None
        self.on_finish(req)  # the freed KV is claimed again at the next step boundary (_begin_step)
