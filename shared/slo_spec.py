"""The SLO class spec, ``NAME=TTFT_S:TPOT_S[:SHARE]``: one parser for the gateway's class table
(services/gateway/slo.py, which ignores SHARE) and the load generator's class sets (loadgen/slo.py, which
assigns each class its share of a workload's requests).

An empty TTFT or TPOT takes the caller's default (``batch=::0.7``: the default targets at 70%); a caller with
no default for one refuses the empty field. Bad input raises ValueError naming the spec.
"""

from __future__ import annotations

import math

import msgspec

#: Characters allowed in a class name: it is a key in reports, metrics and CLI specs.
NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")


class ClassSpec(msgspec.Struct, frozen=True):
    name: str
    ttft_s: float
    tpot_s: float
    share: float | None  # None: not given (the load generator gives such a class the remainder)


def check_class_name(name: str, what: str) -> str:
    if not name or not set(name) <= NAME_CHARS:
        raise ValueError(f"{what}: a class name is letters, digits, '_', '.' or '-', got {name!r}")
    return name


def _seconds(text: str, default: float | None, what: str, spec: str) -> float:
    if not text.strip():
        if default is None:
            raise ValueError(f"SLO class spec {spec!r}: {what} is empty and there is no default to take")
        return default
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"SLO class spec {spec!r}: {what} must be a number of seconds, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"SLO class spec {spec!r}: {what} must be a positive number of seconds, got {value!r}")
    return value


def parse_class_spec(spec: str, default_ttft_s: float | None, default_tpot_s: float | None) -> ClassSpec:
    """``NAME=TTFT_S:TPOT_S[:SHARE]`` -> :class:`ClassSpec` (see the module doc)."""
    name, sep, rest = spec.partition("=")
    parts = rest.split(":")
    if not sep or not name.strip() or len(parts) not in (2, 3):
        raise ValueError(f"SLO class spec {spec!r}: expected NAME=TTFT_S:TPOT_S[:SHARE], e.g. interactive=0.5:0.05:0.3")
    share: float | None = None
    if len(parts) == 3 and parts[2].strip():
        try:
            share = float(parts[2])
        except ValueError:
            raise ValueError(f"SLO class spec {spec!r}: SHARE must be a number in (0, 1], got {parts[2]!r}") from None
    return ClassSpec(name=check_class_name(name.strip(), f"SLO class spec {spec!r}"),
                     ttft_s=_seconds(parts[0], default_ttft_s, "TTFT", spec),
                     tpot_s=_seconds(parts[1], default_tpot_s, "TPOT", spec), share=share)


#: FlowPrefill's per-task TTFT SLOs (Table 2, Llama3-8B) with QwenTrace's task shares (FlowPrefill Table 1).
FLOWPREFILL_TASKS: tuple[tuple[str, float, float], ...] = (
    ("text", 0.25, 0.68), ("image", 0.5, 0.08), ("search", 4.0, 0.20), ("file", 6.0, 0.04),
)


def _interactive_batch(ttft_s: float, tpot_s: float) -> tuple[ClassSpec, ...]:
    return (ClassSpec("interactive", ttft_s / 2, tpot_s / 2, 0.3), ClassSpec("batch", ttft_s, tpot_s, 0.7))


def _flowprefill_tasks(_ttft_s: float, tpot_s: float) -> tuple[ClassSpec, ...]:
    return tuple(ClassSpec(name, ttft, tpot_s, share) for name, ttft, share in FLOWPREFILL_TASKS)


#: Named class sets, each built from a base SLO (the trace's, or the gateway's own) so one preset fits all.
#: ``interactive-batch``: 30% interactive requests at half the base TTFT and TPOT targets, 70% batch requests
#: at the base targets. An illustrative mix, not taken from a paper.
#: ``tasks-flowprefill``: FlowPrefill's Table 2 TTFT SLOs for Llama3-8B (text 0.25 s, image 0.5 s, search 4 s,
#: file 6 s) at QwenTrace's shares (68%, 8%, 20%, 4%); TPOT targets are the base's (FlowPrefill judges TTFT).
PRESETS = {"interactive-batch": _interactive_batch, "tasks-flowprefill": _flowprefill_tasks}


def preset_specs(name: str, ttft_s: float, tpot_s: float) -> tuple[ClassSpec, ...]:
    """The preset ``name`` built on the base targets, or a ValueError listing the presets."""
    try:
        return PRESETS[name](ttft_s, tpot_s)
    except KeyError:
        raise ValueError(f"unknown SLO-class preset {name!r}; presets: {', '.join(sorted(PRESETS))}") from None
