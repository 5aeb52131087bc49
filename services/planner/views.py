"""What ``poise admin pools`` shows of the planner's policy and instances (plain dicts: they travel in
``ServiceStatus.details``).

Everything about the policy comes from its :class:`PolicyReport` (``policy.report()``), a value the planner
takes only between decisions, on the event loop, so it never reads a policy while the decider thread changes
it.
"""

from __future__ import annotations

from typing import Any

import msgspec

from services.planner.decider import quantile
from shared.policies import PoolPolicy
from shared.policies.report import PolicyReport, finite
from shared.protocol import InstanceInfo


def _forecast_stats(report: PolicyReport) -> dict[str, Any]:
    """DOPD's own timing of its forecast decisions (ARIMA fits + ratio), the slow part of a decision."""
    times = sorted(report.forecast_recent_s)
    if not times:
        return {"count": report.forecast_decisions, "p50_ms": None, "p99_ms": None, "max_ms": None}
    return {"count": report.forecast_decisions, "p50_ms": quantile(times, 0.5) * 1e3,
            "p99_ms": quantile(times, 0.99) * 1e3, "max_ms": times[-1] * 1e3}


def policy_view(policy: PoolPolicy, report: PolicyReport) -> dict[str, Any]:
    """The policy's name, note and what its report says (JSON-ready)."""
    view: dict[str, Any] = {"name": policy.name, "note": policy.note, "interval_s": policy.interval_s}
    if report.forecasts or report.target_prefill is not None:
        view["dopd"] = {"target_prefill": report.target_prefill,
                        "last_split": msgspec.to_builtins(report.forecast) if report.forecast is not None else None,
                        "forecasts": _forecast_stats(report)}
    if report.splits:
        view["splits"] = [msgspec.to_builtins(s) for s in report.splits]
        view["split_reason"] = report.reason
        view["drains_deferred"] = report.drains_deferred  # flips held back: no quick drain
    arrow = report.arrow
    if arrow is not None:
        view["arrow"] = {"bounds": list(arrow.bounds) if arrow.bounds is not None else None,
                         "max_running_tokens": arrow.max_running_tokens,
                         "last_flip_s": finite(arrow.last_flip_s),
                         # when each trigger last asked for an instance in that role (a flip or not)
                         "wanted_s": {role: finite(t) for role, t in arrow.wanted_s.items()}}
    return view


def pool_rows(instances: dict[str, InstanceInfo], flipping: set[str]) -> list[dict[str, Any]]:
    """One row per registered instance, by role then id; ``flipping`` = ids with a role command running."""
    return [{"instance_id": i.instance_id, "role": i.role, "status": i.status, "url": i.url,
             "flipping": i.instance_id in flipping}
            for i in sorted(instances.values(), key=lambda i: (i.role, i.instance_id))]
