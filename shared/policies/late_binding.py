"""Late binding of prompts to prefill engines, for engines whose scheduler cannot be patched (stock SGLang).

The gateway holds requests in its own queue and releases one to a prefill engine only when that engine has
fewer than ``depth`` prompts sent and not yet prefilled, so the order in which prompts reach the engines is
the prefill policy's order (Kairos, FlowPrefill, EDF, ...) instead of arrival order. What it cannot do is
preempt: a prompt already on an engine runs there. The simulator uses this same object for its
``late-binding`` mixes, to measure how much of the engine-level gain it keeps.

Pure: the caller owns the held requests and the per-engine counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

from shared.policies.prefill_order import PrefillItem, PrefillPolicy

T = TypeVar("T", bound=PrefillItem)

#: The budget handed to the policy: large enough that every held prompt fits (the gateway plans an order,
#: not a forward pass).
_UNBOUNDED = 1 << 40


@dataclass(slots=True)
class LateBinding:
    policy: PrefillPolicy
    depth: int = 2  # prompts an engine may hold unprefilled before the gateway stops sending it more

    def __post_init__(self) -> None:
        if self.depth < 1:
            raise ValueError(f"late-binding depth must be >= 1, got {self.depth}")

    def free_slots(self, unprefilled: int) -> int:
        """How many more prompts an engine holding ``unprefilled`` prompts may get now."""
        return max(0, self.depth - unprefilled)

    def release(self, held: Sequence[T], slots: int, now_s: float) -> tuple[list[T], float | None]:
        """The held prompts to send now (at most ``slots``, in the policy's order) and, when the policy
        chose to wait although slots are free, when to ask again."""
        if slots <= 0 or not held:
            return [], None
        plan = self.policy.plan(held, _UNBOUNDED, now_s)
        out: list[T] = []
        for item, _ in plan.parts:
            if len(out) >= slots:
                break
            out.append(item)
        return out, plan.retry_at_s
