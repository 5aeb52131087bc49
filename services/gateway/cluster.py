"""The gateway's live view of the cluster: registrations (etcd), load reports (NATS), its own in-flight work.

It turns them into the :class:`EngineView` snapshots that dispatch policies read. The in-flight work is the
dispatcher's ledger (:class:`shared.policies.inflight.InflightLedger`, the simulator's too), updated
synchronously at dispatch, first token and completion, so back-to-back requests see each other even though
load reports arrive only every ~250 ms.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from shared.event_rate import EventRate
from shared.load_view import engine_view
from shared.policies import EngineView
from shared.policies.inflight import InflightLedger
from shared.protocol import InstanceInfo, LoadReport


class ClusterView:
    def __init__(self) -> None:
        self.instances: dict[str, InstanceInfo] = {}
        self._loads: dict[str, tuple[LoadReport, float]] = {}
        self.ledger = InflightLedger()
        # Requests served to their end on each engine: a decode engine's service rate, which early rejection
        # divides its queue by (shared/policies/admission.py).
        self._departures: dict[str, EventRate] = {}
        self.on_release: Callable[[], None] | None = None  # called after every release (the late-binding queue)

    # -- inputs ------------------------------------------------------------------------------------
    def set_instances(self, instances: dict[str, InstanceInfo]) -> None:
        self.instances = instances
        for gone in set(self._loads) - set(instances):
            del self._loads[gone]
        for gone in set(self._departures) - set(instances):
            del self._departures[gone]

    async def on_load(self, report: LoadReport, subject: str) -> None:
        self._loads[report.instance_id] = (report, time.monotonic())

    def release(self, rid: str, instance_id: str | None = None, *, finished_on: str | None = None) -> None:
        """Give back ``rid``'s hold on ``instance_id`` (None: on every engine); ``finished_on``: the engine
        that served it to its end (what that engine's finish rate counts)."""
        released = self.ledger.release(rid, instance_id)
        if finished_on is not None:
            self._departures.setdefault(finished_on, EventRate()).record(time.monotonic())
        if released and self.on_release is not None:
            self.on_release()

    def first_token(self, rid: str, decode_id: str, prefill_id: str | None) -> None:
        """``rid``'s first token came from ``decode_id``: the ledger's rule (shared/policies/inflight.py)."""
        self.ledger.first_token(rid, decode_id, prefill_id)
        if self.on_release is not None:
            self.on_release()

    # -- outputs -----------------------------------------------------------------------------------
    def served_models(self) -> list[str]:
        return sorted({i.model for i in self.instances.values()})

    def applies_seed(self, model: str) -> bool:
        """Every engine of ``model`` samples with a request's ``seed`` (whichever serves it, it is applied)."""
        return all(i.applies_seed for i in self.instances.values() if i.model == model)

    def engines(self, model: str | None = None) -> list[EngineView]:
        now = time.monotonic()
        views = []
        for info in self.instances.values():
            if model is not None and info.model != model:
                continue
            load, received = self._loads.get(info.instance_id, (None, None))
            views.append(engine_view(
                info.instance_id, info.role, info.status, kv_capacity_tokens=info.kv_capacity_tokens,
                max_running_requests=info.max_running_requests, load=load,
                load_age_s=None if received is None else now - received, held=self.ledger.engine(info.instance_id),
                finish_rate_rps=self._finish_rate(info, now) if load is not None else None,
                local_prefill=_prefills_locally(info)))
        return views

    def _finish_rate(self, info: InstanceInfo, now: float) -> float | None:
        """Requests per second that finished on a decode or colocated engine lately (None: a prefill engine, or
        too few to tell). A request refused, failed or moved away was not served there, so it does not count:
        an engine refusing prompts would otherwise look faster than it serves (the simulator counts the same)."""
        departures = self._departures.get(info.instance_id)
        if info.role == "prefill" or departures is None:
            return None
        return departures.rate(now)

    def servable_models(self) -> list[str]:
        """Models with a ready prefill + decode pair or a ready colocated engine: what a request can get now."""
        ready: dict[str, set[str]] = {}
        for info in self.instances.values():
            if info.status == "ready":
                ready.setdefault(info.model, set()).add(info.role)
        return sorted(m for m, roles in ready.items() if "null" in roles or {"prefill", "decode"} <= roles)

    def inflight_total(self) -> int:
        """Requests dispatched and not ended (those holding an engine)."""
        return self.ledger.requests()


def _prefills_locally(info: InstanceInfo) -> bool:
    """A decode engine that can also prefill a request itself: engine_sim's (poise_local_prefill); SGLang's PD
    decode mode cannot."""
    return info.role == "decode" and info.engine_kind == "sim"

