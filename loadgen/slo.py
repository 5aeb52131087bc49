"""Latency SLOs per workload: the TTFT and TPOT targets attainment is measured against.

Owns `SLO`, the per-trace targets and the per-request SLO classes (`SLOClasses`).
The per-trace values are Arrow's Table 1 (Arrow: adaptive instance scheduling for
PD-disaggregated serving), so Poise's attainment numbers are comparable with the
numbers that paper reports.
"""

from __future__ import annotations

import msgspec

from loadgen.workload import Workload
from shared.slo_spec import PRESETS as SPEC_PRESETS
from shared.slo_spec import check_class_name, parse_class_spec, preset_specs


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
#: The stress set (`loadgen.stress`) is judged by one SLO, Azure conversation's, for every workload:
#: ``stress-mix-shift``'s code-trace phase included, so attainment on the set compares across its workloads
#: and a shift of the length mix is not also a shift of the targets. The held-out set (`loadgen.heldout`) is
#: judged by the same SLO.
TRACE_SLOS: dict[str, SLO] = {
    "azure-code": SLO(ttft_s=3.0, tpot_s=0.1),
    "azure-conv": SLO(ttft_s=2.0, tpot_s=0.15),
    "burstgpt": SLO(ttft_s=0.25, tpot_s=0.075),
    "mooncake-conv": SLO(ttft_s=30.0, tpot_s=0.1),
    "mooncake-synthetic": SLO(ttft_s=30.0, tpot_s=0.1),
    "stress-step": SLO(ttft_s=2.0, tpot_s=0.15),
    "stress-ramp": SLO(ttft_s=2.0, tpot_s=0.15),
    "stress-bursts": SLO(ttft_s=2.0, tpot_s=0.15),
    "stress-mix-shift": SLO(ttft_s=2.0, tpot_s=0.15),
    "stress-diurnal": SLO(ttft_s=2.0, tpot_s=0.15),
    "heldout-batch-waves": SLO(ttft_s=2.0, tpot_s=0.15),
    "heldout-multi-tenant": SLO(ttft_s=2.0, tpot_s=0.15),
    "heldout-week": SLO(ttft_s=2.0, tpot_s=0.15),
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


# --- Per-request SLO classes ---------------------------------------------------------------------------------
#
# A workload can mix requests with different latency targets (an interactive chat next to a batch job). Each
# request gets a class name; attainment then judges it against its class's SLO. The assignment depends only on
# the request's trace index, so the same request lands in the same class on every run, in every process, at
# every rate scale and in every slice: runs stay comparable and the simulator agrees with the live replay.

#: How far the shares may sum from 1 (rounding of hand-written decimals like 0.1 + 0.2 + 0.7).
SHARE_TOLERANCE = 1e-6
_MASK64 = (1 << 64) - 1


def _splitmix64(value: int) -> int:
    """SplitMix64's finaliser: a fixed, well-mixed 64-bit hash (Python's ``hash()`` is salted per process)."""
    z = (value + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def index_fraction(index: int) -> float:
    """A uniform-looking number in ``[0, 1)`` that depends only on ``index`` (the top 32 bits of its hash)."""
    return (_splitmix64(index) >> 32) / 2**32


class SLOClass(msgspec.Struct, frozen=True):
    """One class of requests: its name, its SLO and the share of the workload's requests it gets."""

    name: str
    slo: SLO
    share: float

    def __post_init__(self) -> None:
        check_class_name(self.name, "SLO class")
        if not 0 < self.share <= 1:
            raise ValueError(f"SLO class {self.name!r}: share must be in (0, 1], got {self.share}")

    @property
    def spec(self) -> str:
        """This class as a `parse_slo_classes` spec (``NAME=TTFT_S:TPOT_S:SHARE``); floats kept exact by repr."""
        return f"{self.name}={self.slo.ttft_s!r}:{self.slo.tpot_s!r}:{self.share!r}"


class SLOClasses(msgspec.Struct, frozen=True):
    """A set of SLO classes whose shares sum to 1, and the deterministic request -> class assignment.

    Classes own consecutive ranges of ``[0, 1)`` in their listed order (the first class gets
    ``[0, share_0)``...); a request belongs to the class whose range holds `index_fraction` of its trace
    index. Keeping the order fixed therefore keeps every request's class fixed.
    """

    classes: tuple[SLOClass, ...]

    def __post_init__(self) -> None:
        if not self.classes:
            raise ValueError("SLO classes: at least one class is needed")
        names = [c.name for c in self.classes]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"SLO classes: duplicate class name(s): {', '.join(duplicates)}")
        total = sum(c.share for c in self.classes)
        if abs(total - 1.0) > SHARE_TOLERANCE:
            shares = ", ".join(f"{c.name}={c.share:g}" for c in self.classes)
            raise ValueError(f"SLO classes: shares must sum to 1, got {total:g} ({shares})")

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.classes]

    @property
    def specs(self) -> list[str]:
        """The classes as CLI specs: ``parse_slo_classes(classes.specs, slo)`` rebuilds an equal object."""
        return [c.spec for c in self.classes]

    def describe(self) -> str:
        """One line for progress output, e.g. ``interactive 30% (TTFT 1s, TPOT 0.075s), batch 70% (...)``."""
        return ", ".join(f"{c.name} {c.share:.0%} (TTFT {c.slo.ttft_s:g}s, TPOT {c.slo.tpot_s:g}s)" for c in self.classes)

    def class_for(self, index: int) -> str:
        """The class of the request with trace index ``index``; the same on every run and in every process."""
        point = index_fraction(index)
        cumulative = 0.0
        for slo_class in self.classes:
            cumulative += slo_class.share
            if point < cumulative:
                return slo_class.name
        return self.classes[-1].name  # shares summing to 1 - tolerance leave a sliver at the top

    def slo_of(self, class_name: str) -> SLO:
        """The SLO of the class called ``class_name``, or a ValueError listing the classes."""
        for slo_class in self.classes:
            if slo_class.name == class_name:
                return slo_class.slo
        raise ValueError(f"unknown SLO class {class_name!r}; classes: {', '.join(self.names)}")

    def assign(self, workload: Workload) -> Workload:
        """A copy of ``workload`` whose every request carries its `class_for` name in ``slo_class``."""
        labelled = [msgspec.structs.replace(r, slo_class=self.class_for(r.index)) for r in workload.requests]
        return Workload(name=workload.name, requests=labelled)


def parse_slo_classes(specs: list[str], default: SLO) -> SLOClasses | None:
    """Parse CLI specs ``NAME=TTFT_S:TPOT_S[:SHARE]`` into `SLOClasses`; None when ``specs`` is empty.

    Rules: an empty TTFT or TPOT takes ``default``'s value (``batch=::0.7`` is the trace's SLO at 70%).
    At most one class may leave out its share; it gets the remainder ``1 - sum(other shares)``, which must
    be > 0 (so a lone class without a share gets all requests). Otherwise the shares must sum to 1.
    Classes are assigned in the order given. Bad input raises ValueError naming the offending spec.
    """
    if not specs:
        return None
    parsed: list[tuple[str, SLO, float | None]] = []
    for spec in specs:
        c = parse_class_spec(spec, default.ttft_s, default.tpot_s)
        parsed.append((c.name, SLO(ttft_s=c.ttft_s, tpot_s=c.tpot_s), c.share))
    missing = [name for name, _, share in parsed if share is None]
    if len(missing) > 1:
        raise ValueError(f"SLO classes: only one class may leave out its share (the remainder), not {', '.join(missing)}")
    remainder = 1.0 - sum(share for _, _, share in parsed if share is not None)
    if missing and remainder <= SHARE_TOLERANCE:
        raise ValueError(f"SLO classes: the other shares leave nothing for {missing[0]!r} (remainder {remainder:g})")
    return SLOClasses(tuple(SLOClass(name, slo, remainder if share is None else share) for name, slo, share in parsed))


#: The named class sets (shared/slo_spec.py, where the gateway reads them too), built on a trace's own SLO.
PRESETS = SPEC_PRESETS


def preset_classes(name: str, trace_slo: SLO) -> SLOClasses:
    """The preset ``name`` built on ``trace_slo``, or a ValueError listing the presets."""
    return SLOClasses(tuple(SLOClass(c.name, SLO(ttft_s=c.ttft_s, tpot_s=c.tpot_s), c.share or 0.0)
                            for c in preset_specs(name, trace_slo.ttft_s, trace_slo.tpot_s)))
