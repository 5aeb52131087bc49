"""One simulated engine: batching like SGLang, timed by the shared latency model, ordered by the engine policies.

What is modelled, per role (times from :class:`shared.latency.LatencyModel`, as in engine_sim):

- **prefill**: a request waits until its decode instance has reserved KV for it (SGLang's ``early`` decode
  allocation: the prefill starts once the decode side claimed the bootstrap room); then admission by KV
  capacity in the prefill order policy's order (FCFS by default); each step prefills chunks of admitted
  prompts up to ``chunked_prefill_size`` tokens in one forward pass. Its KV is held until the transfer to
  the decode instance ends.
- **decode**: KV for prompt + output is reserved at dispatch time in FCFS order (a request waits while it
  does not fit); after the prefill, the KV transfer takes ``kv_transfer_time_s(prompt)``; the request then
  joins the running batch (at most ``max_running_requests``) and its first token is emitted; every decode
  step emits one token per request the decode batch policy selects (all of them, by default).
- **null** (colocated): decode-prioritised mixed steps, every running request decodes and prefill chunks
  fill the chunk budget; a request's first token comes at the end of the step that finishes its prompt.

Lifecycle (driven by :class:`loadgen.sim.cluster.SimCluster`): ``starting`` → ``ready``; ``draining``
(takes no new requests, finishes what it has) → ``switching`` (the role switch's cost) → ``ready`` in the new
role, or → ``stopped``. A decode request can be migrated out (stop-and-copy of its KV, see ``migrate_out``).

Simplifications, written down so results are read right: KV for the whole output is reserved up front (no
retraction) and transfers do not contend for bandwidth. The serving path's own delay before the first token
(HTTP legs, bootstrap handshake) is a per-request draw calibrated on the live stack (``overhead.py``).
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from loadgen.sim.events import PRIORITY_STEP_END, PRIORITY_TRANSFER_DONE, EventQueue
from shared.latency import LatencyModel
from shared.policies import Continuous, DecodeBatchPolicy, EngineView, Fcfs, PrefillOrderPolicy
from shared.protocol.messages import Role

SimStatus = Literal["starting", "ready", "draining", "switching", "stopped"]


@dataclass(eq=False)
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
    generated: int = 0  # output tokens emitted so far
    first_token_s: float | None = None
    finished_s: float | None = None
    error: str | None = None
    prefill: SimInstance | None = None
    decode: SimInstance | None = None
    migrate_to: SimInstance | None = None  # set while a migration waits for the current step to end
    migrations: int = 0

    @property
    def kv_tokens(self) -> int:
        """KV a decode or colocated instance reserves for the request (prompt + whole output)."""
        return self.input_tokens + self.output_tokens


class SimInstance:
    """One engine. ``kick()`` starts a step whenever the instance is idle and has work."""

    def __init__(self, instance_id: str, role: Role, model: LatencyModel, queue: EventQueue,
                 on_finish: Callable[[SimRequest], None], first_token_delay: Callable[[int], float] = lambda i: 0.0,
                 *, prefill_order: PrefillOrderPolicy | None = None, decode_batch: DecodeBatchPolicy | None = None,
                 on_drained: Callable[[SimInstance], None] | None = None, status: SimStatus = "ready",
                 handshake_s: float = 0.0) -> None:
        p = model.profile
        self.instance_id = instance_id
        self.role: Role = role
        self.status: SimStatus = status
        self.model = model
        self.queue = queue
        self.on_finish = on_finish
        self.on_drained = on_drained
        self.first_token_delay = first_token_delay
        self.handshake_s = handshake_s  # decode claims the bootstrap room -> the prefill may start (HTTP hop)
        self.prefill_order = prefill_order or Fcfs()
        self.decode_batch = decode_batch or Continuous()
        self.kv_capacity = p.kv_capacity_tokens
        self.max_running = p.max_running_requests
        self.chunk = p.chunked_prefill_size
        self.used_kv = 0
        self.busy = False
        self.waiting: deque[SimRequest] = deque()  # prefill/null: before KV admission
        self.prefilling: list[SimRequest] = []  # prefill/null: admitted, prompt not done
        self.reserve_queue: deque[SimRequest] = deque()  # decode: waiting for KV
        self.ready: deque[SimRequest] = deque()  # decode/null: KV in place, waiting for a batch slot
        self.running: list[SimRequest] = []  # decode/null: in the decode batch
        self.assigned = 0  # requests dispatched (or migrated) here and not done here
        self.pending_tokens = 0  # prefill: prompt tokens not computed yet; decode: KV not reserved yet
        self.pending_sq = 0  # prefill: sum of squared prompt lengths of prompts not done yet
        self.step_ewma_s: float | None = None  # decode/null: recent decode step time (the token interval)
        self.on_prefill_step: Callable[[SimInstance, list[tuple[SimRequest, int]], float], None] | None = None
        self.steps = 0
        self._batch: list[SimRequest] = []
        self._plan: list[tuple[SimRequest, int]] = []

    # -- what the dispatcher sees ------------------------------------------------------------------
    def view(self) -> EngineView:
        return EngineView(
            instance_id=self.instance_id, role=self.role, status="ready" if self.status == "ready" else "draining",
            kv_capacity_tokens=self.kv_capacity, max_running_requests=self.max_running,
            running_reqs=len(self.running) + len(self.prefilling),
            waiting_reqs=len(self.waiting) + len(self.reserve_queue) + len(self.ready), used_tokens=self.used_kv,
            load_age_s=0.0, inflight_reqs=self.assigned, inflight_tokens=self.pending_tokens,
            inflight_tokens_sq=self.pending_sq, token_interval_s=self.step_ewma_s if self.running else None,
        )

    @property
    def empty(self) -> bool:
        return self.assigned == 0 and self.used_kv == 0 and not self.busy

    # -- intake ------------------------------------------------------------------------------------
    def enqueue_prefill(self, req: SimRequest) -> None:
        self.enqueue_prefills([req])

    def enqueue_prefills(self, reqs: list[SimRequest]) -> None:
        self.waiting.extend(reqs)
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
        while self.reserve_queue and self.used_kv + self.reserve_queue[0].kv_tokens <= self.kv_capacity:
            req = self.reserve_queue.popleft()
            self.used_kv += req.kv_tokens
            self.pending_tokens -= req.kv_tokens
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
        """Move a running request's KV to ``target`` (stop-and-copy); False when it cannot move now.

        The target reserves the request's KV at once; the request leaves the batch at the end of the
        current step (at once when the instance is idle), pauses for the copy of its context, and then
        joins the target's batch. The source frees its KV when the copy is done.
        """
        if req.decode is not self or req not in self.running or req.migrate_to is not None:
            return False
        if target.status != "ready" or target.role != "decode" or target.used_kv + req.kv_tokens > target.kv_capacity:
            return False
        target.used_kv += req.kv_tokens
        target.assigned += 1
        req.migrate_to = target
        if not self.busy:
            self._detach_migrating(req)
        return True

    def _detach_migrating(self, req: SimRequest) -> None:
        target = req.migrate_to
        assert target is not None
        req.migrate_to = None
        self.running.remove(req)
        self.assigned -= 1
        req.migrations += 1
        req.decode = target

        def copied() -> None:
            self.release(req.kv_tokens)
            target.transfer_done(req)

        delay = self.model.kv_transfer_time_s(req.input_tokens + req.generated)
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
        if self._batch:
            # Decode steps set the token interval (EWMA over ~10 steps, like a monitor's recent average).
            self.step_ewma_s = duration if self.step_ewma_s is None else 0.9 * self.step_ewma_s + 0.1 * duration
        elif self._plan and self.on_prefill_step is not None:
            self.on_prefill_step(self, self._plan, duration)
        self.queue.at(self.queue.now_s + duration, PRIORITY_STEP_END, self._end_step)

    def _admit_prompts(self, kv_per_request: Callable[[SimRequest], int]) -> None:
        if self.prefill_order.reorders and len(self.waiting) > 1:
            self.waiting = deque(self.prefill_order.order(self.waiting, self.queue.now_s))
        while self.waiting and self.used_kv + kv_per_request(self.waiting[0]) <= self.kv_capacity:
            req = self.waiting.popleft()
            self.used_kv += kv_per_request(req)
            self.prefilling.append(req)

    def _chunk_plan(self, budget: int) -> list[tuple[SimRequest, int]]:
        if self.prefill_order.reorders and len(self.prefilling) > 1:
            # Chunk boundaries are where a prefill engine can be preempted: the policy's order wins there.
            self.prefilling = self.prefill_order.order(self.prefilling, self.queue.now_s)
        plan = []
        for req in self.prefilling:
            if budget <= 0:
                break
            n = min(req.input_tokens - req.prefilled, budget)
            plan.append((req, n))
            budget -= n
        return plan

    def _join_ready(self) -> None:
        now = self.queue.now_s
        while self.ready and len(self.running) < self.max_running:
            req = self.ready.popleft()
            if req.generated:  # migrated in: it already had its first token
                self.running.append(req)
                continue
            req.first_token_s = now
            req.generated = 1
            if req.generated >= req.output_tokens:
                self._finish(req)
            else:
                self.running.append(req)

    def _decode_batch(self) -> list[SimRequest]:
        if self.decode_batch.selects_all:
            return list(self.running)
        return list(self.decode_batch.select(self.running, self.max_running, self.queue.now_s))

    def _begin_step(self) -> float | None:
        if self.status in ("starting", "switching", "stopped"):
            return None
        if self.role == "prefill":
            self._admit_prompts(lambda r: r.input_tokens)
            self._plan = self._chunk_plan(self.chunk)
            if not self._plan:
                return None
            return self.model.prefill_batch_time_s((n, r.prefilled) for r, n in self._plan)
        if self.role == "decode":
            self._reserve()
            self._join_ready()
            self._batch = self._decode_batch()
            if not self._batch:
                return None
            return self.model.decode_step_time_s(len(self._batch), sum(r.input_tokens + r.generated for r in self._batch))
        # colocated
        self._admit_prompts(lambda r: r.kv_tokens)
        self._join_ready()
        self._batch = self._decode_batch()
        self._plan = self._chunk_plan(self.chunk)
        if not self._batch and not self._plan:
            return None
        context = sum(r.input_tokens + r.generated for r in self._batch)
        return self.model.mixed_step_time_s(len(self._batch), context, ((n, r.prefilled) for r, n in self._plan))

    def _end_step(self) -> None:
        self.busy = False
        if self.role in ("decode", "null"):
            for req in self._batch:
                req.generated += 1
                if req.generated >= req.output_tokens:
                    self.running.remove(req)
                    if req.migrate_to is not None:  # finished before it could move: give the room back
                        req.migrate_to.used_kv -= req.kv_tokens
                        req.migrate_to.assigned -= 1
                        req.migrate_to = None
                    self._finish(req)
                elif req.migrate_to is not None:
                    self._detach_migrating(req)
        if self.role in ("prefill", "null"):
            for req, n in self._plan:
                req.prefilled += n
                self.pending_tokens -= n if self.role == "prefill" else 0
                if req.prefilled >= req.input_tokens:
                    self.prefilling.remove(req)
                    self._prompt_done(req)
            self._plan = []
        self._batch = []
        self.kick()

    def _prompt_done(self, req: SimRequest) -> None:
        if self.role == "null":
            self.ready.append(req)  # first token when it joins the batch, at once if there is room
            return
        # prefill: hand the KV to the decode instance; this instance keeps it until the copy is done
        self.assigned -= 1
        self.pending_sq -= req.input_tokens * req.input_tokens
        decode = req.decode
        assert decode is not None

        def arrived() -> None:
            self.release(req.input_tokens)
            decode.transfer_done(req)

        # The KV copy, plus the serving path's own handoff delay (see loadgen/sim/overhead.py).
        delay = self.model.kv_transfer_time_s(req.input_tokens) + self.first_token_delay(req.index)
        self.queue.at(self.queue.now_s + delay, PRIORITY_TRANSFER_DONE, arrived)

    def _finish(self, req: SimRequest) -> None:
        req.finished_s = self.queue.now_s
        self.assigned -= 1
        self.used_kv -= req.kv_tokens
        self.on_finish(req)  # the freed KV is claimed again at the next step boundary (_begin_step)
