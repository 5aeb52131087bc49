"""A request's latency targets as they travel from the gateway to an engine (a Poise extension of SGLang's
request body).

The gateway resolves every request's SLO class (from the client's ``priority``, the ``slo`` extension field or
the route's default, see services/gateway/slo.py) and, for engines that accept it, adds ``poise_slo`` to the
body it sends to the prefill and decode engines. engine_sim reads it; stock SGLang has no such field, so the
gateway sends it only to engines registered with ``engine_kind`` ``sim`` and passes ``priority`` to all.

``waited_s`` is how long the request had been in the system when the gateway sent it, so an engine dates the
request's arrival (and its TTFT deadline) from the gateway's arrival without clocks synced across machines.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

#: Body field carrying :class:`RequestSlo` on engine requests (/generate, /v1/completions, /v1/chat/completions).
SLO_FIELD = "poise_slo"


class RequestSlo(msgspec.Struct, frozen=True, kw_only=True):
    schema: str = "poise.v1.request_slo"
    slo_class: str | None = None  # the class name, for reports
    ttft_s: float | None = None  # None: no target
    tpot_s: float | None = None
    waited_s: float = 0.0  # seconds since the gateway received the request, when this body was sent

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s"):
            v = getattr(self, name)
            if v is not None and not (v > 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be a positive number of seconds, got {v!r}")
        if not (self.waited_s >= 0 and math.isfinite(self.waited_s)):
            raise ValueError(f"waited_s must be >= 0, got {self.waited_s!r}")

    def to_body(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)  # type: ignore[no-any-return]


def parse_request_slo(value: Any) -> RequestSlo:
    """The ``poise_slo`` field of an engine request body; ValueError with a readable message when malformed."""
    if not isinstance(value, dict):
        raise ValueError(f"{SLO_FIELD} must be an object")
    try:
        return msgspec.convert(value, RequestSlo)
    except msgspec.ValidationError as exc:
        raise ValueError(f"{SLO_FIELD}: {exc}") from None
