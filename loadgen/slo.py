"""Latency SLOs per workload: the TTFT and TPOT targets attainment is measured against.

Owns `SLO` and the per-trace targets. Values are Arrow's Table 1 (Arrow: adaptive
instance scheduling for PD-disaggregated serving), so Poise's attainment numbers
are comparable with the numbers that paper reports.
"""

from __future__ import annotations

import msgspec


class SLO(msgspec.Struct, frozen=True):
    """Per-request latency targets: time to first token and time per output token (seconds)."""

    ttft_s: float
    tpot_s: float

    def __post_init__(self) -> None:
        if not self.ttft_s > 0 or not self.tpot_s > 0:
            raise ValueError(f"SLO targets must be > 0, got ttft_s={self.ttft_s} tpot_s={self.tpot_s}")


#: SLOs from Arrow Table 1. ``mooncake-synthetic`` has no entry in the paper; it
#: reuses ``mooncake-conv``'s targets since both come from the same Mooncake
#: deployment and have similar (long-context) length profiles.
TRACE_SLOS: dict[str, SLO] = {
    "azure-code": SLO(ttft_s=3.0, tpot_s=0.1),
    "azure-conv": SLO(ttft_s=2.0, tpot_s=0.15),
    "burstgpt": SLO(ttft_s=0.25, tpot_s=0.075),
    "mooncake-conv": SLO(ttft_s=30.0, tpot_s=0.1),
    "mooncake-synthetic": SLO(ttft_s=30.0, tpot_s=0.1),
}


def slo_for(workload_name: str) -> SLO:
    """The Arrow Table 1 SLO for a trace name, or a ValueError listing the known names."""
    try:
        return TRACE_SLOS[workload_name]
    except KeyError:
        known = ", ".join(sorted(TRACE_SLOS))
        raise ValueError(
            f"no SLO known for workload {workload_name!r}; known: {known} "
            "(pass an explicit SLO(ttft_s=..., tpot_s=...) for other workloads)"
        ) from None
