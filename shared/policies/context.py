"""What SLO-aware policies are configured with: the SLO they plan for and the GPUs they may use.

Policies that need it (Dynamo's planners, Arrow, DOPD) are built with a :class:`PolicyContext` and the
engines' :class:`shared.latency.LatencyModel` (their performance model); the others ignore both.
"""

from __future__ import annotations

import msgspec


class PolicyContext(msgspec.Struct, frozen=True, kw_only=True):
    ttft_slo_s: float
    tpot_slo_s: float
    max_instances: int  # the GPU budget: prefill + decode replicas never exceed it
    min_per_role: int = 1  # never fewer prefill (or decode) instances than this (Dynamo's min_endpoint)
