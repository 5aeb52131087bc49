"""One request inside engine_sim: where it is, the KV it holds, and the tokens it has produced.

The HTTP handler owns nothing but a reference: the scheduler appends token ids to ``output_ids``, sets
``finish`` once, and sets ``event`` to wake the handler, which reads from its own offset (the same
``out_list`` + ``event`` handshake as SGLang's ``ReqState`` in tokenizer_manager.py).
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from services.engine_sim import clock
from services.engine_sim.stops import StopMatch
from services.engine_sim.tokens import TokenSource
from shared.engine.model import EngineRequest, Phase

__all__ = ["Phase", "SimRequest", "finish_abort", "finish_length", "finish_stop"]


# SGLang's finish reasons, as BaseFinishReason.to_json() renders them (sglang/srt/managers/schedule_batch.py).
def finish_length(length: int) -> dict[str, Any]:
    return {"type": "length", "length": length}


def finish_stop(matched: int | str) -> dict[str, Any]:
    return {"type": "stop", "matched": matched}


def finish_abort(message: str = "Aborted", status_code: HTTPStatus | None = None) -> dict[str, Any]:
    """A user abort has no status code (the response still succeeds); a failure carries one."""
    return {"type": "abort", "message": message, "status_code": status_code, "err_type": None}


@dataclass(eq=False, slots=True, kw_only=True)
class SimRequest(EngineRequest):
    """The engine model's request (:class:`shared.engine.model.EngineRequest`: the prompt, the output length at
    which it stops, its queue phase, KV and prefix-cache state), plus what engine_sim serves it with.

    ``output_tokens`` is the output length the request stops at (the length model's draw, capped; with
    ``ignore_eos``, max_new_tokens); ``arrival_s`` (nan: ``received_s``) is when it reached the serving system
    (the gateway: received_s - poise_slo.waited_s), on this engine's monotonic clock; TTFT deadlines count from
    there."""

    max_new_tokens: int = 0
    ignore_eos: bool = False
    stream: bool = False
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    priority: int | None = None
    slo_class: str | None = None

    created_unix_s: float = field(default_factory=time.time)
    received_s: float = field(default_factory=clock.monotonic)  # reached this engine (SGLang's latency metrics)
    output_ids: list[int] = field(default_factory=list)
    first_token_id: int | None = None  # PD: the first token, held until it is handed over / emitted on decode
    finish: dict[str, Any] | None = None
    event: asyncio.Event = field(default_factory=asyncio.Event)
    tokens: TokenSource | None = None
    last_token_s: float | None = None
    admitted_s: float | None = None  # left the queue (queue time = admitted - arrival)
    prefill_done_unix_s: float | None = None
    handoff_task: asyncio.Task[None] | None = None  # decode: the KV pull
    kv_source: tuple[str, str] | None = None  # decode, migrated in by KV copy: (source engine URL, its rid)
    resumed_from: int = 0  # tokens another engine generated before this one took over (poise_resume)
    stream_key: str = ""  # what the ids and the length are drawn from (the prompt's digest, or the rid)
    predict_length: bool = False  # put remaining-length predictions on the stream (poise_predict_length)
    local_prefill: bool = False  # decode: prefilled here, in this engine's own steps (poise_local_prefill)
    next_prediction_at: int = 0  # generated count (whole answer) at which the next prediction is due
    timer: asyncio.TimerHandle | None = None  # prefill: bootstrap / release timeout
    stops: tuple[str, ...] = ()  # the request's stop strings
    stop_match: StopMatch | None = None  # where the first stop string appears (output_tokens ends there)
    uncut_tokens: int = 0  # the output length without the stop strings

    def __post_init__(self) -> None:
        EngineRequest.__post_init__(self)
        if math.isnan(self.arrival_s):
            self.arrival_s = self.received_s

    @property
    def finished(self) -> bool:
        return self.finish is not None

    @property
    def stop_after(self) -> int:
        """The output length at which the request stops (its ``output_tokens``)."""
        return self.output_tokens

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache (usage: prompt_tokens_details)."""
        return self.cached

    @property
    def num_retractions(self) -> int:
        return self.retractions

    @property
    def status_code(self) -> int | None:
        """The HTTP status an abort carries (None for a normal finish or a user abort)."""
        if self.finish is None:
            return None
        code = self.finish.get("status_code")
        return int(code) if code is not None else None

    def notify(self) -> None:
        self.event.set()
