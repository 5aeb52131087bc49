"""One request inside engine_sim: where it is, the KV it holds, and the tokens it has produced.

The HTTP handler owns nothing but a reference: the scheduler appends token ids to ``output_ids``, sets
``finish`` once, and sets ``event`` to wake the handler, which reads from its own offset (the same
``out_list`` + ``event`` handshake as SGLang's ``ReqState`` in tokenizer_manager.py).
"""

from __future__ import annotations

import asyncio
import enum
import math
import time
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from services.engine_sim.tokens import TokenSource
from shared.engine import CacheHold


class Phase(enum.Enum):
    INTAKE = "intake"  # received, not yet seen by the scheduler (it picks requests up between steps)
    BOOTSTRAP = "bootstrap"  # prefill: waiting for the decode peer to claim its bootstrap room
    WAITING = "waiting"  # prefill/null: queued for prefill, no KV yet
    PREFILLING = "prefilling"  # prefill/null: KV allocated, prefill chunks in progress
    INFLIGHT = "inflight"  # prefill: first token ready, KV held until the decode side has pulled it
    PREALLOC = "prealloc"  # decode: waiting for KV space
    TRANSFER = "transfer"  # decode: KV allocated, pulling from the prefill peer
    READY = "ready"  # decode: KV arrived, waiting for a slot in the running batch
    RUNNING = "running"  # decode/null: one token per decode step
    RETRACTED = "retracted"  # decode: evicted from the batch for lack of KV (held on "host"), waits to return
    FINISHED = "finished"


# SGLang's finish reasons, as BaseFinishReason.to_json() renders them (sglang/srt/managers/schedule_batch.py).
def finish_length(length: int) -> dict[str, Any]:
    return {"type": "length", "length": length}


def finish_stop(matched: int | str) -> dict[str, Any]:
    return {"type": "stop", "matched": matched}


def finish_abort(message: str = "Aborted", status_code: HTTPStatus | None = None) -> dict[str, Any]:
    """A user abort has no status code (the response still succeeds); a failure carries one."""
    return {"type": "abort", "message": message, "status_code": status_code, "err_type": None}


@dataclass(eq=False, slots=True)
class SimRequest:
    rid: str
    prompt_tokens: int
    max_new_tokens: int
    ignore_eos: bool = False
    stream: bool = False
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    priority: int | None = None
    slo_ttft_s: float = math.inf  # the request's SLO class targets (the poise_slo body field); inf = none given
    slo_tpot_s: float = math.inf
    slo_class: str | None = None
    stop_after: int = 0  # output length at which the request stops (the length model's draw, capped)

    phase: Phase = Phase.INTAKE
    created_unix_s: float = field(default_factory=time.time)
    received_s: float = field(default_factory=time.monotonic)  # reached this engine (SGLang's latency metrics)
    # Reached the serving system (the gateway: received_s - poise_slo.waited_s), on this engine's monotonic
    # clock; TTFT deadlines count from here. Equal to received_s when the request carries no poise_slo.
    arrival_s: float = math.nan  # nan: received_s
    prefill_len: int = 0  # tokens to prefill: the prompt, or prompt + generated after a retraction
    prefilled: int = 0
    recompute: bool = False  # re-prefilling after a retraction: no new first token at the end
    kv_used: int = 0  # KV tokens actually filled
    kv_reserved: int = 0  # KV tokens set aside at admission (>= kv_used until the request outgrows it)
    output_ids: list[int] = field(default_factory=list)
    first_token_id: int | None = None  # PD: the first token, held until it is handed over / emitted on decode
    finish: dict[str, Any] | None = None
    event: asyncio.Event = field(default_factory=asyncio.Event)
    tokens: TokenSource | None = None
    first_token_s: float | None = None  # monotonic time of the first output token
    last_token_s: float | None = None
    admitted_s: float | None = None  # left the queue (queue time = admitted - arrival)
    prefill_done_unix_s: float | None = None
    num_retractions: int = 0
    handoff_task: asyncio.Task[None] | None = None  # decode: the KV pull
    kv_source: tuple[str, str] | None = None  # decode, migrated in by KV copy: (source engine URL, its rid)
    resumed_from: int = 0  # tokens another engine generated before this one took over (poise_resume)
    stream_key: str = ""  # what the ids and the length are drawn from (the prompt's digest, or the rid)
    predict_length: bool = False  # put remaining-length predictions on the stream (poise_predict_length)
    local_prefill: bool = False  # decode: prefilled here, in this engine's own steps (poise_local_prefill)
    next_prediction_at: int = 0  # generated count (whole answer) at which the next prediction is due
    timer: asyncio.TimerHandle | None = None  # prefill: bootstrap / release timeout
    prefix_blocks: tuple[int, ...] = ()  # the prompt's prefix identity (shared.engine.prefix_blocks)
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (usage: prompt_tokens_details)
    cache_hold: CacheHold | None = None  # its lock on the prefix cache, from admission until its KV is freed

    def __post_init__(self) -> None:
        if math.isnan(self.arrival_s):
            self.arrival_s = self.received_s

    @property
    def finished(self) -> bool:
        return self.finish is not None

    # What the shared prefill and decode-batch policies read (shared.policies PrefillItem / DecodeItem; rid,
    # arrival_s, prefilled, slo_ttft_s, slo_tpot_s and first_token_s are fields).
    @property
    def input_tokens(self) -> int:
        """While queued for or in prefill (PrefillItem): the tokens to prefill, i.e. the prompt, or prompt +
        output after a retraction (null mode); otherwise (DecodeItem): the prompt."""
        if self.phase is Phase.WAITING or self.phase is Phase.PREFILLING:
            return self.prefill_len
        return self.prompt_tokens

    @property
    def generated(self) -> int:
        return len(self.output_ids)

    @property
    def context_tokens(self) -> int:
        return self.prompt_tokens + len(self.output_ids)

    @property
    def status_code(self) -> int | None:
        """The HTTP status an abort carries (None for a normal finish or a user abort)."""
        if self.finish is None:
            return None
        code = self.finish.get("status_code")
        return int(code) if code is not None else None

    def notify(self) -> None:
        self.event.set()
