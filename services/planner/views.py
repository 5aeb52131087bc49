"""What ``poise admin pools`` shows of the planner's policy and instances (plain dicts: they travel in
``ServiceStatus.details``).

Policies expose different state (Arrow its bounds, DOPD its target split and the model evaluation behind
it, Poise its target and every split it scored), so this reads it with ``getattr`` and defaults instead of widening the PoolPolicy
protocol. The planner calls :func:`policy_view` only between decisions, on the event loop, so it never
reads a policy while the decider thread changes it.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

from services.planner.decider import quantile
from shared.protocol import InstanceInfo


def _dopd(policy: Any) -> Any:
    """The DOPD part of a policy: Poise's ``.dopd``, or the policy itself when it is DOPD."""
    return getattr(policy, "dopd", None) or (policy if hasattr(policy, "target_prefill") else None)


def _arrow(policy: Any) -> Any:
    """The Arrow part of a policy: Poise's ``.arrow``, or the policy itself when it is Arrow."""
    return getattr(policy, "arrow", None) or (policy if hasattr(policy, "bounds") else None)


def target_prefill(policy: Any) -> int | None:
    """The number of prefill instances the policy aims for (DOPD's target), None when it has none."""
    dopd = _dopd(policy)
    value = getattr(dopd, "target_prefill", None) if dopd is not None else None
    return int(value) if value is not None else None


def split_reason(policy: Any) -> str:
    """One line on the model evaluation behind the target (DOPD's last split, Poise's last scoring), empty when
    there is none."""
    describe = getattr(policy, "describe_split", None)
    if describe is not None:
        return str(describe())
    dopd = _dopd(policy)
    split = getattr(dopd, "last_split", None) if dopd is not None else None
    if split is None:
        return ""
    return (f"forecast ISL {split.isl:.0f}, OSL {split.osl:.0f}, concurrency {split.concurrency:.1f} "
            f"-> R* {split.ratio:.2f}")


def _forecast_stats(decision_s: list[float], window: int = 500) -> dict[str, Any]:
    """DOPD's own timing of its forecast decisions (ARIMA fits + ratio), the slow part of a decision."""
    times = sorted(decision_s[-window:])
    if not times:
        return {"count": len(decision_s), "p50_ms": None, "p99_ms": None, "max_ms": None}
    return {"count": len(decision_s), "p50_ms": quantile(times, 0.5) * 1e3, "p99_ms": quantile(times, 0.99) * 1e3,
            "max_ms": times[-1] * 1e3}


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def policy_view(policy: Any) -> dict[str, Any]:
    """The policy's name, note and whatever targets/bounds it keeps (JSON-ready)."""
    view: dict[str, Any] = {"name": getattr(policy, "name", "?"), "note": getattr(policy, "note", ""),
                            "interval_s": getattr(policy, "interval_s", None)}
    dopd = _dopd(policy)
    if dopd is not None:
        split = getattr(dopd, "last_split", None)
        view["dopd"] = {"target_prefill": getattr(dopd, "target_prefill", None),
                        "last_split": msgspec.to_builtins(split) if split is not None else None,
                        "forecasts": _forecast_stats(getattr(dopd, "decision_s", None) or [])}
    loads = getattr(policy, "last_loads", None)
    if loads:
        view["splits"] = [msgspec.to_builtins(s) for s in loads]
        view["split_reason"] = split_reason(policy)
        view["drains_deferred"] = getattr(policy, "drains_deferred", None)  # flips held back: no quick drain
    arrow = _arrow(policy)
    if arrow is not None:
        bounds = getattr(arrow, "bounds", None)
        view["arrow"] = {"bounds": list(bounds) if bounds is not None else None,
                         "max_running_tokens": getattr(arrow, "max_tokens", None),
                         "last_flip_s": _finite(float(getattr(arrow, "last_flip_s", -math.inf))),
                         # when each trigger last asked for an instance in that role (a flip or not)
                         "wanted_s": {role: _finite(t) for role, t in getattr(arrow, "wanted_s", {}).items()}}
    return view


def pool_rows(instances: dict[str, InstanceInfo], flipping: set[str]) -> list[dict[str, Any]]:
    """One row per registered instance, by role then id; ``flipping`` = ids with a role command running."""
    return [{"instance_id": i.instance_id, "role": i.role, "status": i.status, "url": i.url,
             "flipping": i.instance_id in flipping}
            for i in sorted(instances.values(), key=lambda i: (i.role, i.instance_id))]
