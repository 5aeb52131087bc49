"""What an engine reports of its load, from the engine model's state: one function for engine_sim and the simulator.

SGLang's ``LoadSnapshot`` (``/v1/loads``) counts, per scheduler: the running batch, the requests waiting in any
queue, the KV in use and the disaggregation queues. :func:`engine_load` computes those numbers from an
:class:`shared.engine.model.EngineModel` and the queues its adapter keeps around it (requests received but not
yet scheduled, a prefill engine's bootstrap and in-flight queues, a decode engine's transfers). engine_sim
renders them as SGLang's JSON; the simulator hands them, as :class:`shared.engine_client.EngineLoads`, to the
same report and view functions the sidecar and the gateway use (``shared.load_view``), so a dispatcher reads
the same numbers live and simulated.

KV in use is what SGLang's allocator counts: KV written (a prefill's whole prompt from admission; on decode
and colocated engines the requests' contexts, not the room set aside for output still to come) and the prefix
tree's blocks the requests lock (evictable cache counts as free). ``reserved=True`` counts each request's
whole reservation instead: the simulator's ``kv_report="reserved"``, an oracle no engine reports.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from shared.engine.model import EngineModel, EngineRequest


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """One scheduler's load in SGLang's terms (the ``LoadSnapshot`` field each mirrors is named)."""

    running_reqs: int  # num_running_reqs: the decode batch, or a prefill engine's prompts in progress
    waiting_reqs: int  # num_waiting_reqs: every queue a request waits in (see engine_load)
    uncached_tokens: int  # num_waiting_uncached_tokens: prompt tokens left to compute here
    used_tokens: int  # num_used_tokens: KV in use (see the module doc)
    running_tokens: int  # context tokens of the running batch (a Poise extension: Arrow's decode load)
    bootstrap_reqs: int  # prefill: prompts whose decode side has not claimed them yet
    inflight_reqs: int  # prefill: prompts computed, their KV not at the decode side yet
    prealloc_reqs: int  # decode: waiting for KV
    transfer_reqs: int  # decode: KV reserved, its prompt's KV (or a move's) on the way
    retracted_reqs: int  # decode: parked for lack of KV


def engine_load(core: EngineModel, *, intake: Collection[EngineRequest] = (), bootstrap: int = 0,
                sent: Collection[EngineRequest] = (), transfer: Collection[EngineRequest] = (),
                reserved: bool = False) -> EngineLoad:
    """The load of ``core`` and of its adapter's queues: ``intake`` (received, not yet scheduled), ``bootstrap``
    (prefill: how many wait for their decode side), ``sent`` (prefill: computed, KV held until the transfer is
    done) and ``transfer`` (decode: KV reserved here, arriving).

    Waiting requests: the scheduler's waiting queue and the intake, a prefill engine's bootstrap queue (SGLang
    counts it, though its prompts wait for their decode side: load_inquirer.py), and a decode engine's
    prealloc, transfer, ready and retracted queues (and prompts it prefills locally, a Poise extension)."""
    role = core.role
    # SGLang's decode engines compute no prompts (a Poise decode engine's local prompts are not counted either).
    uncached = 0 if role == "decode" else sum(r.input_tokens for r in intake) + core.uncached_prompt_tokens
    if role == "prefill":
        running = len(core.prefilling)
        own = sum(r.prompt_kv for r in core.prefilling) + sum(r.prompt_kv for r in sent)
    else:
        running = len(core.running)
        if reserved:
            own = sum(r.kv_held for r in (*core.prefilling, *transfer, *core.ready, *core.running))
        else:
            own = sum(_written(r) for r in (*core.prefilling, *transfer, *core.ready)) + running_written(core)
    cache = core.cache
    waiting = (len(intake) + len(core.waiting) + bootstrap + len(core.prealloc) + len(transfer) + len(core.ready)
               + len(core.retracted))
    return EngineLoad(
        running_reqs=running, waiting_reqs=waiting, uncached_tokens=uncached,
        used_tokens=own + (cache.locked_tokens if cache is not None else 0),
        running_tokens=core.running_context, bootstrap_reqs=bootstrap, inflight_reqs=len(sent),
        prealloc_reqs=len(core.prealloc), transfer_reqs=len(transfer), retracted_reqs=len(core.retracted))


def running_written(core: EngineModel) -> int:
    """KV the running batch has written. Without a prefix tree that is its contexts, which the model keeps
    summed: a running request holds KV for at least its context (admission reserves it, and growth takes the
    next token's before each step), so none is capped by its reservation. The simulator asks at every
    dispatch, over batches of hundreds."""
    if core.cache is None:
        return core.running_context
    return sum(_written(r) for r in core.running)


def _written(req: EngineRequest) -> int:
    in_tree = req.hold.tree_tokens if req.hold is not None else 0  # its matched prefix; after the insert, its prompt
    return max(0, min(req.kv_held, req.context_tokens - in_tree))
