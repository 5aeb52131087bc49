"""What moving a running decode request to another decode instance costs: one copy, used by the ARES policy
(its C_mig filter and the in-flight delay of its future simulation), the simulator (how long the request
stalls) and, later, the live migrator.

Two mechanisms (``MIGRATION_MECHANISMS``):

- ``kv-transfer``: copy the request's KV cache (engine_sim's extension; NIXL / Mooncake transfer engine on
  GPUs): ``kv_bytes_per_token x tokens / bandwidth + control overhead``. ARES' simulator charges KV size /
  bandwidth at 25 Gbps (spec §4.3); the fixed 5 ms (PREPARE, PAUSE_EXPORT, IMPORT_RESUME round trips) is
  ours (spec §1.9).
- ``recompute``: the portable path for stock SGLang: re-prefill prompt + generated tokens and hand the KV
  to the target (spec §1.8): ``prefill_time(tokens)`` from the latency model plus the P->D KV handoff.

Only the migrating request stalls for ``seconds(tokens)`` (ARES Fig. 11: its TBT includes the transfer); the
other requests on the source keep decoding. ``tokens`` is the request's context (prompt + generated).

Pure arithmetic; imports nothing from asyncio, nats, aetcd, httpx or fastapi.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import msgspec

from shared.latency import LatencyModel
from shared.policies.context import lookup


class MigrationMechanism(Protocol):
    """How a request's state reaches the target, and what that costs in seconds of stall for the request."""

    name: str

    def seconds(self, tokens: int) -> float: ...


class KvTransferParams(msgspec.Struct, frozen=True, kw_only=True):
    bandwidth_gbps: float = 25.0  # effective D->D link, gigabits/s (ARES' simulator, after DistServe)
    control_overhead_s: float = 0.005  # per migration: prepare/pause/resume round trips (ours, spec §1.9)

    def __post_init__(self) -> None:
        if not self.bandwidth_gbps > 0 or self.control_overhead_s < 0:
            raise ValueError(f"kv-transfer needs bandwidth_gbps > 0 and control_overhead_s >= 0, got {self}")


class KvTransfer:
    """Copy the KV cache: bytes / bandwidth + a fixed control cost."""

    name = "kv-transfer"

    def __init__(self, model: LatencyModel, params: KvTransferParams | None = None) -> None:
        self.params = params or KvTransferParams()
        self.model = model
        self._bytes_per_s = self.params.bandwidth_gbps * 1e9 / 8

    def seconds(self, tokens: int) -> float:
        copy = self.model.kv_bytes(max(tokens, 0)) / self._bytes_per_s
        return (self.params.control_overhead_s + copy) * self.model.time_scale


class Recompute:
    """Re-prefill prompt + generated tokens, then the P->D handoff of the rebuilt KV (no KV copy D->D).

    The prefill is charged as one uninterrupted pass of the latency model (chunking splits the same work);
    where it runs (a prefill instance, or the target itself) is the executor's business.
    """

    name = "recompute"

    def __init__(self, model: LatencyModel) -> None:
        self.model = model

    def seconds(self, tokens: int) -> float:
        tokens = max(tokens, 0)
        return self.model.prefill_time_s(tokens) + self.model.kv_transfer_time_s(tokens)


MIGRATION_MECHANISMS: dict[str, Callable[[LatencyModel], MigrationMechanism]] = {
    KvTransfer.name: KvTransfer,
    Recompute.name: Recompute,
}

DEFAULT_MECHANISM = KvTransfer.name  # ARES reproduction; SGLang without a KV-moving extension needs recompute


def make_migration_mechanism(name: str, model: LatencyModel) -> MigrationMechanism:
    return lookup(MIGRATION_MECHANISMS, name, "migration mechanism")(model)
