"""Named policy mixes: what ``poise sim --policy`` accepts.

A mix fixes the instances' roles and the dispatch policy. Roles never change in these baselines; the
adaptive mixes (Arrow, DOPD, ...) add pool and ratio policies in later releases.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from shared.policies import DispatchPolicy, LeastLoad, RoundRobin
from shared.protocol.messages import Role


@dataclass(frozen=True)
class PolicyMix:
    name: str
    roles: list[Role]
    dispatch: DispatchPolicy
    description: str


def parse_split(split: str | None, instances: int) -> tuple[int, int]:
    """``"4P4D"`` or ``"4:4"`` → (4, 4); None → an even split (prefill gets the odd one)."""
    if split is None:
        decode = instances // 2
        return instances - decode, decode
    m = re.fullmatch(r"\s*(\d+)\s*[Pp:]\s*(\d+)\s*[Dd]?\s*", split)
    if not m:
        raise ValueError(f"split {split!r} is not like 4P4D or 4:4")
    p, d = int(m.group(1)), int(m.group(2))
    if p < 1 or d < 1:
        raise ValueError("a disaggregated split needs at least one prefill and one decode instance")
    if p + d != instances:
        raise ValueError(f"split {split} has {p + d} instances, but --instances is {instances}")
    return p, d


def _static(name: str, policy: Callable[[], DispatchPolicy], what: str) -> Callable[[int, str | None], PolicyMix]:
    def build(instances: int, split: str | None) -> PolicyMix:
        p, d = parse_split(split, instances)
        prefill: list[Role] = ["prefill"]
        decode: list[Role] = ["decode"]
        roles = prefill * p + decode * d
        return PolicyMix(name, roles, policy(),
                         f"{p}P{d}D, fixed roles, {what} dispatch (sglang-router / DistServe-like)")
    return build


def _colocated(instances: int, split: str | None) -> PolicyMix:
    if split is not None:
        raise ValueError("colocated has no P:D split")
    return PolicyMix("colocated", ["null"] * instances, LeastLoad(),
                     f"{instances} colocated instances, chunked prefill, decode-prioritised (vLLM-like)")


MIXES: dict[str, Callable[[int, str | None], PolicyMix]] = {
    "colocated": _colocated,
    "static-rr": _static("static-rr", RoundRobin, "round-robin"),
    "static-minload": _static("static-minload", LeastLoad, "least-load"),
}


def make_mix(name: str, instances: int, split: str | None = None) -> PolicyMix:
    if instances < 1:
        raise ValueError("--instances must be at least 1")
    try:
        build = MIXES[name]
    except KeyError:
        raise ValueError(f"unknown policy mix {name!r}; known: {', '.join(sorted(MIXES))}") from None
    return build(instances, split)
