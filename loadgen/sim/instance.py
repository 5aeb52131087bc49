"""One simulated engine: the shared engine model (``shared.engine.model``) driven by the simulator's event queue.

The engine's scheduling (queues, KV admission and retraction, the prefix cache, prefill passes, decode and
mixed steps, operator preemption) is :class:`shared.engine.model.EngineModel`, the same code engine_sim runs;
steps take the latency model's time (:class:`shared.latency.LatencyModel`). This adapter adds what a simulated
cluster needs around it:

- **lifecycle** (driven by :class:`loadgen.sim.cluster.SimCluster`): ``starting`` → ``ready``; ``draining``
  (takes no new requests, finishes what it has) → ``switching`` (the role switch's cost) → ``ready`` in the
  new role, or → ``stopped``;
- **the P→D handoff**: a decode instance reserves KV for a request at dispatch (SGLang's ``early`` decode
  allocation: the prefill starts once the decode side claimed the bootstrap room, ``handshake_s`` later); a
  finished prompt's KV stays on its prefill instance until the transfer (``kv_transfer_time_s(prompt)``, plus
  the serving path's own delay, ``overhead.py``) is done; the request then joins the decode batch with its
  first token;
- **migration** (decode → decode, ``migrate_out``): the request stalls for the migration mechanism's time
  (``shared.policies.migration_cost``: a KV copy or a recompute) while the other requests of both instances
  keep decoding;
- **what the dispatcher sees** (:meth:`SimInstance.view`): the engine's load by engine_sim's function
  (``shared.engine.load``), reported and viewed by the sidecar's and the gateway's functions
  (``shared.load_view``), with the dispatcher's in-flight ledger (``shared.policies.inflight``, the cluster's,
  fed the events the live gateway sees).

Decode KV, two models (``EngineSpec.decode_kv``, the engine model's ``decode_kv``):

- ``grow`` (default; SGLang's and engine_sim's): admission reserves prompt + min(remaining output,
  ``reserved_decode_tokens``), a request outgrowing that takes free KV a token per step, and when a step's
  growth does not fit, running requests are retracted in SGLang's order and resumed (before any new
  admission) once they fit again. This is where imbalanced decode instances lose (ARES' OOMs).
- ``whole``: KV for prompt + whole output is reserved at admission, so no request ever runs out of memory: an
  oracle no engine has (it knows the output length), which queues requests instead of retracting them.

An engine reports the KV its requests have written (prompt + generated, and the prefix-tree blocks they lock),
as SGLang's allocator counts it and as ARES' baseline balances on; ``EngineSpec.kv_report = "reserved"``
reports each request's whole reservation instead (under ``whole``, its final size): an oracle no engine
reports.

Colocated instances follow the same model: with ``grow`` a colocated engine retracts as SGLang does, the request
going back to the waiting queue to be prefilled again with its output (engine_sim's colocated engines too).
Prefix cache (``EngineSpec.prefix_cache``): prefill and colocated instances keep SGLang's radix cache, keyed
by the requests' prefix blocks (the Mooncake traces' ``hash_ids``); a role change starts an empty tree.
Transfers do not contend for bandwidth.
"""

from __future__ import annotations

import functools
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from loadgen.sim.events import PRIORITY_STEP_END, PRIORITY_TRANSFER_DONE, EventQueue
from shared.engine.chunking import role_chunk_tokens
from shared.engine.load import EngineLoad, engine_load
from shared.engine.model import EngineModel, EngineRequest, Phase, Step, given_up_reason
from shared.engine.prefix_cache import PrefixCache
from shared.event_rate import EventRate
from shared.latency import LatencyModel
from shared.load_view import engine_loads, engine_view, load_report
from shared.policies import DecodeBatchPolicy, EngineView, Preemption, PrefillPolicy
from shared.policies.inflight import InflightLedger
from shared.protocol import LoadReport
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
    kv_report: Literal["reserved", "current"] = "current"  # KV use as reported: written, or reserved (module doc)
    decode_kv: Literal["whole", "grow"] = "grow"  # decode and colocated KV: grow and retract (SGLang's), or whole outputs
    reserved_decode_tokens: int = 512  # grow: output KV set aside at admission (SGLang's default)
    prefix_cache: bool = False  # prefill and colocated instances reuse cached prompt prefixes (the module doc)
    # Colocated instances refuse prompts still waiting past their TTFT target (shared.engine.model; Poise's engines)
    give_up_late: bool = False

    def describe(self) -> str:
        chunk = "profile" if self.chunk_tokens is None else ("off" if self.chunk_tokens <= 0 else str(self.chunk_tokens))
        kv = "" if self.kv_report == "current" else ", reports reserved KV (an oracle)"
        if self.decode_kv == "grow":
            kv += f", decode KV grows from prompt + {self.reserved_decode_tokens} and retracts when full"
        cache = ", radix prefix cache" if self.prefix_cache else ""
        late = ", colocated engines refuse prompts waiting past their TTFT target" if self.give_up_late else ""
        return (f"prefill {self.prefill_policy} ({self.preemption} preemption, chunk {chunk}){cache}, "
                f"decode {self.decode_policy}{kv}{late}")

    def model(self, role: Role, latency: LatencyModel) -> EngineModel:
        """A fresh engine model with these settings."""
        # A colocated engine's chunk as Poise's worker launches it (shared.engine.chunking).
        colocated = role_chunk_tokens(self.chunk_tokens, "null")
        return EngineModel(role, latency, prefill_policy=self.prefill_policy, decode_policy=self.decode_policy,
                           preemption=self.preemption, chunk_tokens=self.chunk_tokens,
                           colocated_chunk_tokens=latency.profile.chunked_prefill_size if colocated is None else colocated,
                           decode_kv=self.decode_kv,
                           colocated_kv=self.decode_kv, reserved_decode_tokens=self.reserved_decode_tokens,
                           prefix_cache=self.prefix_cache, give_up_late=self.give_up_late)


@dataclass
class PreemptionStats:
    """Operator-level cuts an instance made: how many and how long the preempting prompt waited for each."""

    count: int = 0
    blocking_s: list[float] = field(default_factory=list)


@dataclass(eq=False, slots=True, kw_only=True)
class SimRequest(EngineRequest):
    """One request's progress through the simulated cluster (times in simulated seconds). The engine model's
    fields (:class:`shared.engine.model.EngineRequest`) are shared by its prefill and decode instance: each
    writes only its own side's."""

    index: int
    slo_class: str | None = None
    finished_s: float | None = None
    error: str | None = None
    prefill: SimInstance | None = None
    decode: SimInstance | None = None
    migrate_to: SimInstance | None = None  # set while a migration waits for the current step to end
    migrate_from: SimInstance | None = None  # set from the migration decision until it joined the target
    migrations: int = 0
    predicted: float = 0.0  # the length predictor's latest output (remaining tokens) ...
    predicted_at: int = -1  # ... made at this many generated tokens (loadgen.sim.prediction)
    kv_incoming: int = 0  # KV reserved on a migration's target, until the move is done
    # A client that retries a refusal sends the request again (SimCluster.client_retries): its first send,
    # from which the client counts the TTFT, and how many times it has been sent.
    first_arrival_s: float = math.nan
    attempts: int = 1

    @property
    def retries(self) -> int:
        """The client's earlier sends, as its ``X-Stainless-Retry-Count`` tells the gateway."""
        return self.attempts - 1

    @property
    def http_status(self) -> int | None:
        """The HTTP status its failure stands for: a failure's reason starts with it ("429: ..."), as the
        gateway's answers do; None when it did not fail."""
        code = (self.error or "")[:3]
        return int(code) if code.isdigit() else None

    @property
    def ledger_key(self) -> str:
        """The request's key in the dispatcher's ledger: one per attempt (a client's retry is a new request)."""
        return f"{self.rid}/{self.attempts}"

    @property
    def kv_tokens(self) -> int:
        """KV a decode or colocated instance reserves for the request (prompt + whole output)."""
        return self.input_tokens + self.output_tokens


class SimInstance:
    """One engine. ``kick()`` starts a step whenever the instance is idle and has work."""

    def __init__(self, instance_id: str, role: Role, model: LatencyModel, queue: EventQueue,
                 on_finish: Callable[[SimRequest], None], first_token_delay: Callable[[int], float] = lambda i: 0.0,
                 *, engine: EngineSpec | None = None, on_prefill_done: Callable[[SimInstance], None] | None = None,
                 on_drained: Callable[[SimInstance], None] | None = None, status: SimStatus = "ready",
                 handshake_s: float = 0.0, migration_s: Callable[[int], float] | None = None,
                 ledger: InflightLedger | None = None) -> None:
        self.instance_id = instance_id
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
        self.ledger = ledger if ledger is not None else InflightLedger()  # the cluster's dispatcher's
        self.core = self.engine.model(role, model)
        self.preemptions = PreemptionStats()
        self.given_up = 0  # colocated prompts refused for waiting past their TTFT target (EngineSpec.give_up_late)
        self.busy = False
        self.incoming: list[SimRequest] = []  # decode: migrating here (KV reserved), not yet in the batch
        self._moving = 0  # requests here with a move decided, waiting for the current step to end
        self.assigned = 0  # requests dispatched (or migrated) here and not done here
        self.bootstrapping = 0  # prefill: requests dispatched here whose decode side has not claimed them yet
        self.sent: dict[SimRequest, None] = {}  # prefill: prompts computed, their KV not at the decode side yet
        self.transfers: dict[SimRequest, None] = {}  # decode: KV reserved here, the request's KV on its way
        self.step_ewma_s: float | None = None  # decode/null: recent decode step time (the token interval)
        self.finishes = EventRate()  # decode/null: requests that finished here, as the dispatcher counts them
        self.on_prefill_step: Callable[[SimInstance, list[tuple[SimRequest, int]], float], None] | None = None
        self.steps = 0
        self._step: Step | None = None  # the step in progress
        self._step_id = 0  # a cut step's end event finds a newer id and does nothing
        self._step_start_s = 0.0
        self._cut_at: float | None = None
        self._retry_at: float | None = None

    # -- the engine model's state, under the names the cluster and the tests read ---------------------
    @property
    def role(self) -> Role:
        return self.core.role

    @role.setter
    def role(self, role: Role) -> None:
        self.core.switch_role(role)

    def reset_cache(self) -> None:
        """An empty prefix cache (a role change: SGLang resets its radix cache on a switch)."""
        self.core.reset_cache()

    @property
    def cache(self) -> PrefixCache | None:
        return self.core.cache

    @property
    def used_kv(self) -> int:
        return self.core.used_kv

    @property
    def kv_capacity(self) -> int:
        return self.core.kv_capacity

    @kv_capacity.setter
    def kv_capacity(self, value: int) -> None:
        self.core.kv_capacity = value

    @property
    def max_running(self) -> int:
        return self.core.max_running

    @max_running.setter
    def max_running(self, value: int) -> None:
        self.core.max_running = value

    @property
    def prefill_policy(self) -> PrefillPolicy:
        return self.core.prefill_policy

    @property
    def decode_batch(self) -> DecodeBatchPolicy:
        return self.core.decode_policy

    @property
    def waiting(self) -> deque[SimRequest]:
        return self.core.waiting  # type: ignore[return-value]

    @property
    def prefilling(self) -> list[SimRequest]:
        return self.core.prefilling  # type: ignore[return-value]

    @property
    def reserve_queue(self) -> deque[SimRequest]:
        return self.core.prealloc  # type: ignore[return-value]

    @property
    def ready(self) -> deque[SimRequest]:
        return self.core.ready  # type: ignore[return-value]

    @property
    def running(self) -> list[SimRequest]:
        return self.core.running  # type: ignore[return-value]

    @property
    def retracted(self) -> deque[SimRequest]:
        return self.core.retracted  # type: ignore[return-value]

    @property
    def running_context(self) -> int:
        return self.core.running_context

    @property
    def retractions(self) -> int:
        return self.core.retractions

    # -- what the dispatcher sees ------------------------------------------------------------------
    @property
    def grows_kv(self) -> bool:
        return self.core.grows

    def admission_kv(self, req: SimRequest) -> int:
        """KV the request needs to be admitted (or resumed, or migrated in) here: see the module doc."""
        return self.core.admission_kv(req)

    def load(self) -> EngineLoad:
        """The engine's load numbers, by engine_sim's function (shared.engine.load)."""
        return engine_load(self.core, bootstrap=self.bootstrapping, sent=self.sent, transfer=self.transfers,
                           reserved=self.engine.kv_report == "reserved")

    def load_report(self) -> LoadReport:
        """What this engine's sidecar would publish now (shared.load_view: the sidecar's own function)."""
        running = len(self.core.running)
        tps = running / self.step_ewma_s if running and self.step_ewma_s else 0.0
        loads = engine_loads(self.load(), mode=self.role, kv_capacity_tokens=self.core.kv_capacity,
                             max_running_requests=self.core.max_running, gen_throughput_tps=tps)
        return load_report(self.instance_id, self.role, self.status, loads, self.queue.now_s)  # type: ignore[arg-type]

    def view(self) -> EngineView:
        """What the dispatcher sees (shared.load_view: the gateway's own function), reading a report as fresh as
        the event that asked."""
        role = self.core.role
        return engine_view(
            self.instance_id, role, "ready" if self.status == "ready" else "draining",
            kv_capacity_tokens=self.core.kv_capacity, max_running_requests=self.core.max_running,
            load=self.load_report(), load_age_s=0.0, held=self.ledger.engine(self.instance_id),
            finish_rate_rps=self.finishes.rate(self.queue.now_s) if role != "prefill" else None,
            local_prefill=role == "decode")

    @property
    def empty(self) -> bool:
        return self.assigned == 0 and self.core.used_kv == 0 and not self.busy

    # -- intake ------------------------------------------------------------------------------------
    def enqueue_prefill(self, req: SimRequest) -> None:
        self.enqueue_prefills([req])

    def enqueue_prefills(self, reqs: list[SimRequest]) -> None:
        self.core.add_prompts(reqs)  # type: ignore[arg-type]
        step = self._step
        if (self.busy and self.core.preemptible and self.role == "prefill" and step is not None and step.prefill
                and self._cut_at is None):
            self._maybe_preempt(step)
        self.kick()

    def _maybe_preempt(self, step: Step) -> None:
        """Operator preemption: an arrival re-plans; a plan headed by a prompt outside the running pass cuts
        the pass at its next operator boundary."""
        now = self.queue.now_s
        cut = self.core.preemption_point(step, self._step_start_s, now)
        if cut is None:
            return
        self._cut_at = cut
        self.preemptions.count += 1
        self.preemptions.blocking_s.append(cut - now)
        self.queue.at(cut, PRIORITY_STEP_END, functools.partial(self._cut, self._step_id))

    def _cut(self, step_id: int) -> None:
        if step_id != self._step_id:
            return
        step = self._step
        assert step is not None
        self.core.cut(step, self.queue.now_s - self._step_start_s)
        self._step = None
        self._cut_at = None
        self._step_id += 1
        self.busy = False
        self.kick()

    def enqueue_reserve(self, req: SimRequest) -> None:
        self.core.add_prealloc(req)
        if not self.busy:  # a busy engine claims rooms between two steps (engine_sim's and SGLang's loop)
            self._claim(self.core.admit_prealloc(self.queue.now_s))

    def _claim(self, admitted: list[EngineRequest]) -> None:
        """Decode: requests whose KV was just reserved; each may start its prefill once the claim reached the
        prefill engine (``handshake_s`` later). Claims made together arrive together, so a prefill engine sees
        them in one scheduling round (and may batch them in one step)."""
        if not admitted:
            return
        claimed: dict[SimInstance, list[SimRequest]] = {}
        for req in admitted:
            assert isinstance(req, SimRequest) and req.prefill is not None
            self.transfers[req] = None
            claimed.setdefault(req.prefill, []).append(req)
        for prefill, reqs in claimed.items():
            if self.handshake_s > 0:
                self.queue.at(self.queue.now_s + self.handshake_s, PRIORITY_TRANSFER_DONE,
                              functools.partial(prefill.claimed, reqs))
            else:
                prefill.claimed(reqs)

    def claimed(self, reqs: list[SimRequest]) -> None:
        """Prefill: the decode side claimed these requests' bootstrap rooms; their prompts may be scheduled."""
        self.bootstrapping -= len(reqs)
        self.enqueue_prefills(reqs)

    def transfer_done(self, req: SimRequest) -> None:
        del self.transfers[req]
        self.core.transfer_done(req)
        self.kick()

    def release(self, tokens: int) -> None:
        self.core.release(tokens)
        self._freed()

    def _freed(self) -> None:
        """KV was freed: queued decode requests may fit now."""
        if self.role == "decode" and not self.busy:
            self._claim(self.core.admit_prealloc(self.queue.now_s))
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
        if req.decode is not self or req.phase is not Phase.RUNNING or req.migrate_to is not None:
            return False
        if target.status != "ready" or target.role != "decode":
            return False
        need = target.core.move_in(req)
        if not need:
            return False
        req.kv_incoming = need
        target.assigned += 1
        self.ledger.hold(req.ledger_key, target.instance_id, req.prompt_tokens + req.output_tokens)
        target.incoming.append(req)
        req.migrate_to = target
        req.migrate_from = self
        self._moving += 1
        if not self.busy:
            self._detach_migrating(req)
        return True

    def _cancel_move(self, req: SimRequest) -> None:
        """A move decided but not started (the request finished, or was retracted, first)."""
        target = req.migrate_to
        assert target is not None
        source = req.migrate_from
        assert source is not None
        source._moving -= 1
        req.migrate_to = req.migrate_from = None
        target.assigned -= 1
        self.ledger.release(req.ledger_key, target.instance_id)
        target.incoming.remove(req)
        target.core.cancel_move_in(req.kv_incoming)
        target._freed()
        req.kv_incoming = 0

    def _detach_migrating(self, req: SimRequest) -> None:
        target = req.migrate_to
        assert target is not None
        req.migrate_to = None
        self._moving -= 1
        self.core.unrun(req)
        req.phase = Phase.TRANSFER
        self.assigned -= 1
        req.migrations += 1
        req.decode = target

        target.transfers[req] = None
        held, req.kv_held, req.kv_incoming = req.kv_held, req.kv_incoming, 0
        key = req.ledger_key

        def copied() -> None:
            target.incoming.remove(req)
            req.migrate_from = None
            self.ledger.release(key, self.instance_id)
            self.ledger.first_token(key, target.instance_id)
            self.release(held)
            target.transfer_done(req)

        delay = self.migration_s(req.input_tokens + req.generated)
        self.queue.at(self.queue.now_s + delay, PRIORITY_TRANSFER_DONE, copied)

    # -- steps -------------------------------------------------------------------------------------
    def kick(self) -> None:
        if self.busy:
            return
        step = self._begin_step()
        if step is None:
            if self.status == "draining" and self.empty and self.on_drained is not None:
                self.on_drained(self)
            return
        self.busy = True
        self.steps += 1
        self._step_id += 1
        self._step_start_s = self.queue.now_s
        self._step = step
        duration = step.time_s
        if step.decode:
            # Decode steps set the token interval (EWMA over ~10 steps, like a monitor's recent average).
            self.step_ewma_s = duration if self.step_ewma_s is None else 0.9 * self.step_ewma_s + 0.1 * duration
        elif step.prefill and self.on_prefill_step is not None:
            self.on_prefill_step(self, step.prefill, duration)  # type: ignore[arg-type]
        self.queue.at(self.queue.now_s + duration, PRIORITY_STEP_END, functools.partial(self._end_step, self._step_id))

    def _begin_step(self) -> Step | None:
        """The engine model's next step, after acting on what its boundary did (in the order it did it)."""
        if self.status in ("starting", "switching", "stopped"):
            return None
        step = self.core.plan(self.queue.now_s)
        self._claim(step.admitted)
        for req in step.finished:
            self._finish(req)  # type: ignore[arg-type]
        for req in step.given_up:
            self._give_up(req)  # type: ignore[arg-type]
        for req in step.retracted:
            if req.migrate_to is not None:  # type: ignore[attr-defined]
                self._cancel_move(req)  # type: ignore[arg-type]
        if self.core.retry_at is not None:
            self._retry(self.core.retry_at)
        return None if step.idle else step

    def _retry(self, at_s: float) -> None:
        """Ask the prefill policy again at ``at_s`` (it chose to wait, e.g. for a batching timeout)."""
        if self._retry_at is not None and self._retry_at <= at_s:
            return
        self._retry_at = at_s

        def wake() -> None:
            if self._retry_at is not None and self.queue.now_s >= self._retry_at:
                self._retry_at = None
                self.core.replan = True
                self.kick()

        self.queue.at(max(at_s, self.queue.now_s), PRIORITY_STEP_END, wake)

    def _end_step(self, step_id: int) -> None:
        if step_id != self._step_id:
            return  # this pass was cut at an operator boundary (_cut)
        step = self._step
        assert step is not None
        self.busy = False
        self._cut_at = None
        self._step = None
        core = self.core
        applied = core.apply(step, self.queue.now_s)
        if step.decode:
            if self._moving:  # moves wait for this step's end: in batch order, with the finishes
                for req in step.decode:
                    if req.phase is Phase.FINISHED:
                        if req.migrate_to is not None:  # type: ignore[attr-defined]  # finished before it could move
                            self._cancel_move(req)  # type: ignore[arg-type]
                        self._finish(req)  # type: ignore[arg-type]
                    elif req.migrate_to is not None:  # type: ignore[attr-defined]
                        self._detach_migrating(req)  # type: ignore[arg-type]
            else:
                for req in applied.finished:
                    self._finish(req)  # type: ignore[arg-type]
        if step.prefill:  # prefill, colocated, or decode with local prompts
            if core.role == "prefill":
                for req in applied.prompts_done:
                    self._handoff(req)  # type: ignore[arg-type]
            else:  # its first token is due here: the dispatcher's ledger rule
                for req in applied.prompts_done:
                    self.ledger.first_token(req.ledger_key, self.instance_id)  # type: ignore[attr-defined]
            if core.replan and core.role == "prefill" and self.on_prefill_done is not None:
                self.on_prefill_done(self)  # may send this instance more prompts: after the step's own effects
        self.kick()

    def _handoff(self, req: SimRequest) -> None:
        """Prefill: a computed prompt's KV goes to the decode instance; this instance keeps it until the copy
        is done."""
        self.assigned -= 1
        self.sent[req] = None
        decode = req.decode
        assert decode is not None
        key = req.ledger_key

        def arrived() -> None:  # the first token at the decode side (the dispatcher's ledger rule)
            del self.sent[req]
            self.ledger.first_token(key, decode.instance_id, self.instance_id)
            self.core.release_prompt(req, self.queue.now_s)
            self._freed()
            decode.transfer_done(req)
            if self.on_prefill_done is not None:
                self.on_prefill_done(self)  # the dispatcher's hold on this instance is over: room for a held prompt

        # The KV copy, plus the serving path's own handoff delay (see loadgen/sim/overhead.py).
        delay = self.model.kv_transfer_time_s(req.input_tokens) + self.first_token_delay(req.index)
        self.queue.at(self.queue.now_s + delay, PRIORITY_TRANSFER_DONE, arrived)

    def _give_up(self, req: SimRequest) -> None:
        """A colocated engine refused a prompt that waited past its TTFT target (``EngineSpec.give_up_late``):
        a retryable 429, as the gateway's early rejection answers. Not a departure the dispatcher counts in
        the engine's service rate: it was never served."""
        req.error = (f"429: early rejection: {given_up_reason(self.queue.now_s - req.arrival_s, req.slo_ttft_s)} "
                     f"(colocated engine {self.instance_id})")
        req.finished_s = self.queue.now_s
        self.assigned -= 1
        self.given_up += 1
        self.on_finish(req)

    def _finish(self, req: SimRequest) -> None:
        req.finished_s = self.queue.now_s
        self.assigned -= 1
        self.finishes.record(req.finished_s)
        self.on_finish(req)  # the freed KV is claimed again at the next step boundary (_begin_step)
