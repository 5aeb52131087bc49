"""What a pool or scaling policy last decided and why, as one value.

Every pool and scaling policy answers :meth:`report` with a :class:`PolicyReport`: the prefill count it aims
for, the one-line reason behind it, DOPD's newest forecast and the splits Poise scored, Arrow's bounds and
triggers. The planner's status (``poise admin pools``), its ``forecast`` and ``resize_requested`` events and
the simulator's control loop read this value, never a policy's attributes, so a policy is free to keep its
state as it likes. The planner reads it only between decisions, so a report never sees a decision half made.

Pure: plain frozen values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the policies' modules import this one
    from shared.policies.dopd import Split
    from shared.policies.split_capacity import SideLoad


@dataclass(frozen=True, slots=True, kw_only=True)
class ArrowState:
    """Arrow's role-flip state (Alg. 3/4)."""

    bounds: tuple[int, int] | None  # (min, max) prefill instances a ratio planner allows; None: unbounded
    max_running_tokens: int  # the decode batch's token bound whose step stays under the TPOT SLO (A10.6)
    last_flip_s: float  # when Arrow last flipped an instance (-inf: never)
    wanted_s: dict[str, float] = field(default_factory=dict)  # when each trigger last asked for that role


@dataclass(frozen=True, slots=True, kw_only=True)
class PolicyReport:
    """A policy's newest decision, with what it rests on. Empty (the defaults) for a policy that keeps none."""

    target_prefill: int | None = None  # the prefill count it aims for; None: no target (yet)
    reason: str = ""  # one line on the evaluation behind the target
    forecasts: bool = False  # it plans on DOPD's forecast (then ``forecast`` is its newest, once it has one)
    forecast: Split | None = None  # DOPD's newest forecast-driven split (Eq. 14): what engines batch by
    forecast_decisions: int = 0  # forecast decisions made so far
    forecast_recent_s: tuple[float, ...] = ()  # wall seconds of the newest of them (ARIMA fits + ratio)
    splits: tuple[SideLoad, ...] = ()  # Poise: every split scored at the newest evaluation
    drains_deferred: int | None = None  # Poise: flips wanted that no instance could drain in time
    arrow: ArrowState | None = None


def split_line(split: Split) -> str:
    """DOPD's forecast and the ratio it gives, in one line."""
    return (f"forecast ISL {split.isl:.0f}, OSL {split.osl:.0f}, concurrency {split.concurrency:.1f} "
            f"-> R* {split.ratio:.2f}")


def finite(value: float) -> float | None:
    """JSON has no infinity: None for a time that never happened."""
    return value if math.isfinite(value) else None
