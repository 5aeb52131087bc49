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
