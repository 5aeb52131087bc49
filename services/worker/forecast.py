"""The planner's ISL forecast, relayed to the engine's prefill policy (DOPD's length-aware batching).

DOPD sizes its short-prompt batches by the ARIMA one-step forecast of the mean input length (the paper's
L_th and L_cap). The planner computes that forecast and publishes it as a ``forecast`` PlannerEvent; the
engine's ``dopd-length`` policy (shared/policies/length_batching.py) takes it through
``set_forecast_isl``. The sidecar is the bridge: it hears the event on NATS and hands the number to its
engine over HTTP (engine_sim's ``POST /poise_sim/forecast``; stock SGLang has no such hook).

A forecast is only as good as it is fresh: a planner that stopped (paused, crashed, replaced by a policy
without DOPD) leaves the last number behind, so after ``ttl_s`` without a new one the relay withdraws it
and the policy goes back to its own running mean of the inputs it sees.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from shared.protocol.engine_forecast import FORECAST_PATH
from shared.protocol.messages import PlannerEvent, Role

log = logging.getLogger(__name__)


@dataclass
class ForecastRelay:
    """What to send the engine and when; pure, the sidecar does the I/O."""

    ttl_s: float
    isl: float | None = None  # the forecast the engine was last given (None: none, or withdrawn)
    heard_at: float | None = None  # monotonic time of the newest forecast event

    def heard(self, isl: float | None, now: float) -> float | None:
        """A forecast event arrived: the value to send (every time: cheap, and it heals an engine restart),
        or None when the event carried no ISL."""
        if isl is None or not isl > 0:
            return None
        self.isl, self.heard_at = float(isl), now
        return self.isl

    def stale(self, now: float) -> bool:
        """True once, when the forecast the engine holds is older than ``ttl_s``: send null then."""
        if self.isl is None or self.heard_at is None or now - self.heard_at <= self.ttl_s:
            return False
        self.isl = None
        return True


def takes_forecast(engine_kind: str, server_info: dict[str, Any]) -> bool:
    """engine_sim has the forecast hook (spawned, or attached and saying so in /server_info)."""
    return engine_kind == "sim" or (engine_kind == "attach" and server_info.get("engine") == "poise-engine-sim")


class ForecastHook:
    """The sidecar's end of the relay: it hears the planner's events and sends its engine what the
    :class:`ForecastRelay` says, to the engine's current URL (a restart may have moved it)."""

    def __init__(self, relay: ForecastRelay, http: httpx.AsyncClient, url: Callable[[], str], *, timeout_s: float,
                 instance_id: str) -> None:
        self.relay, self._http, self._url = relay, http, url
        self._timeout_s, self._id = timeout_s, instance_id

    async def on_event(self, event: PlannerEvent, role: Role | None) -> None:
        if event.kind != "forecast" or role not in ("prefill", "null"):
            return
        isl = self.relay.heard(event.forecast_isl, time.monotonic())
        if isl is not None:
            await self._send(isl)

    async def expire(self) -> None:
        if self.relay.stale(time.monotonic()):
            log.info("worker %s: no planner forecast for %.0fs; the prefill policy goes back to its own mean",
                     self._id, self.relay.ttl_s)
            await self._send(None)

    async def _send(self, isl: float | None) -> None:
        """A refusal is logged; an engine that does not answer is the load loop's to report."""
        try:
            response = await self._http.post(self._url() + FORECAST_PATH, json={"isl": isl}, timeout=self._timeout_s)
            if response.status_code != 200:
                log.warning("worker %s: engine refused the ISL forecast: HTTP %s %s", self._id,
                            response.status_code, response.text[:200])
        except httpx.HTTPError as exc:
            log.debug("worker %s: forecast not delivered: %s", self._id, exc)
