"""The simulator's control plane: what the monitor, planner and migrator do live, in virtual time.

Every ``tick_s`` the loop samples every instance's load (as sidecars do) into the monitor's own
:class:`shared.series.SeriesBuilder`, closes a series interval every ``series_interval_s``, and asks each
policy whose interval is due for a decision on a :class:`ClusterSnapshot` built exactly like the monitor's:

- the scaling policy (replica counts; roles never flip): the cluster starts and stops replicas;
- the pool policy (role flips): the cluster drains and switches instances;
- the migration policy: the cluster moves decode requests.

Finished requests become the gateway's ``RequestEvent`` and feed the series and the length predictor;
running decode requests carry the length predictor's estimate, re-made every ``prediction_interval_tokens``
(``loadgen.sim.prediction``). Each tick also records how far apart the decode instances are (the variance
of their token loads and of their step times, ARES Fig. 13), reported as ``config.decode_balance``.
Static mixes have none of these policies and run without the loop, at no cost.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from loadgen.sim.cluster import SimCluster
from loadgen.sim.events import PRIORITY_ARRIVAL, EventQueue
from loadgen.sim.instance import SimRequest
from loadgen.sim.prediction import DEFAULT_INTERVAL_TOKENS, PredictionCadence
from shared.policies import LengthPredictor, MigrationPolicy, PoolPolicy, ScalingPolicy, ScalingTarget
from shared.policies.dopd import Split
from shared.protocol.messages import ClusterSnapshot, RequestEvent, SeriesPoint
from shared.series import SeriesBuilder


@dataclass(frozen=True)
class ControlParams:
    tick_s: float = 1.0  # load sampling and decision granularity (the live sidecars report at ~4 Hz)
    series_interval_s: float = 5.0  # the monitor's default
    series_length: int = 720
    prediction_interval_tokens: int = DEFAULT_INTERVAL_TOKENS  # ARES k: re-predict every k decode steps
    # DOPD's ISL forecast to the engines' dopd-length policies, as the live sidecars relay it; off = the engines
    # keep their running mean (what SGLang engines get live, and the bench's ablation of the forecast).
    relay_forecast: bool = True


@dataclass
class DecodeBalance:
    """Per tick: (t, variance of the decode instances' token loads in tokens^2, of their step times in ms^2),
    and the largest token load any decode instance held."""

    series: list[tuple[float, float, float]]
    max_token_load: float = 0.0

    def summary(self) -> dict[str, object]:
        n = len(self.series)
        return {"mean_token_load_var": sum(v for _, v, _ in self.series) / n if n else None,
                "mean_step_ms_var": sum(v for _, _, v in self.series) / n if n else None,
                "max_token_load": self.max_token_load, "series": [list(p) for p in self.series]}


def _variance(values: list[float]) -> float:
    if not values:
        return 0.0
    mean = sum(values) / len(values)
    return sum((v - mean) ** 2 for v in values) / len(values)


class ControlLoop:
    def __init__(self, cluster: SimCluster, queue: EventQueue, *, total_requests: int, profile_name: str,
                 scaling: ScalingPolicy | None, pools: PoolPolicy | None, migration: MigrationPolicy | None,
                 length: LengthPredictor, params: ControlParams | None = None) -> None:
        self.cluster, self.queue = cluster, queue
        self.total = total_requests
        self.profile_name = profile_name
        self.scaling, self.pools, self.migration, self.length = scaling, pools, migration, length
        self.params = params or ControlParams()
        self.cadence = PredictionCadence(length, self.params.prediction_interval_tokens)
        self.balance = DecodeBalance(series=[])
        self.series: deque[SeriesPoint] = deque(maxlen=self.params.series_length)
        self._builder = SeriesBuilder(0.0)
        self._next_roll = self.params.series_interval_s
        self._due = {"scaling": 0.0, "pools": 0.0, "migration": 0.0}
        self.decisions: list[tuple[float, str, str]] = []  # (t, kind, reason), for the report
        self._relayed: Split | None = None  # the DOPD forecast last handed to the engines' prefill policies
        self._relayed_to = 0  # how many instances existed then
        self.relayed_isl: list[tuple[float, float]] = []  # (t, forecast ISL) as handed to the engines, for the report
        cluster.on_finish = self._finished

    def start(self) -> None:
        self.queue.at(0.0, PRIORITY_ARRIVAL, self._tick)

    def _finished(self, req: SimRequest) -> None:
        ok = req.error is None
        ttft = req.first_token_s - req.arrival_s if req.first_token_s is not None else None
        tpot = ((req.finished_s or 0.0) - req.first_token_s) / (req.generated - 1) \
            if req.first_token_s is not None and req.generated > 1 else None
        self._builder.add_event(RequestEvent(
            rid=req.rid, model="sim", arrived_unix_s=req.arrival_s, finished_unix_s=req.finished_s or 0.0,
            prefill_id=req.prefill.instance_id if req.prefill else None,
            decode_id=req.decode.instance_id if req.decode else None, input_tokens=req.input_tokens,
            output_tokens=req.generated, ttft_s=ttft, tpot_s=tpot, status="ok" if ok else "error", error=req.error,
            cached_tokens=req.cached))
        if ok:
            self.length.observe(req.input_tokens, req.generated)

    def _tick(self) -> None:
        now = self.queue.now_s
        loads = self.cluster.instance_loads(self.profile_name)
        tokens: list[float] = []
        steps_ms: list[float] = []
        for inst in loads:
            if inst.load is not None:
                self._builder.add_load(inst.load)
                if inst.info.role == "decode" and inst.info.status == "ready":
                    tokens.append(float(inst.load.num_running_tokens or 0))
                    if inst.load.gen_throughput_tps > 0:
                        steps_ms.append(1e3 * inst.load.num_running_reqs / inst.load.gen_throughput_tps)
        if tokens:
            self.balance.series.append((now, _variance(tokens), _variance(steps_ms)))
            self.balance.max_token_load = max(self.balance.max_token_load, max(tokens))
        if now >= self._next_roll:
            self.series.append(self._builder.roll(now))
            self._next_roll = now + self.params.series_interval_s
        snapshot: ClusterSnapshot | None = None
        migration_due = self.migration is not None and self._is_due("migration")

        def snap() -> ClusterSnapshot:
            nonlocal snapshot
            if snapshot is None:
                wants = migration_due and self.migration is not None and self.migration.needs_requests
                snapshot = ClusterSnapshot(ts_unix_s=now, instances=loads, series=list(self.series),
                                           decode_requests=self.cluster.decode_requests(self.cadence) if wants else [])
            return snapshot

        if self.scaling is not None and self._is_due("scaling"):
            self._due["scaling"] = now + self.scaling.interval_s
            target = self.scaling.decide(snap(), now)
            if target is not None:
                self._apply_scaling(target)
        if self.pools is not None and self._is_due("pools"):
            decision = self.pools.decide(snap(), now)
            next_at = decision.next_decision_at_s if decision is not None else None
            self._due["pools"] = next_at if next_at is not None else now + self.pools.interval_s
            for change in decision.changes if decision is not None else []:
                engine = self.cluster.instances.get(change.instance_id)
                if engine is not None and self.cluster.flip(engine, change.new_role):
                    self.decisions.append((now, "flip", f"{change.instance_id} -> {change.new_role}: {change.reason}"))
        self._relay_forecast()
        if self.migration is not None and migration_due:
            self._due["migration"] = now + self.migration.interval_s
            for move in self.migration.select(snap(), now):
                self.cluster.migrate(move)
        if len(self.cluster.finished) < self.total:
            self.queue.at(now + self.params.tick_s, PRIORITY_ARRIVAL, self._tick)

    def _relay_forecast(self) -> None:
        """DOPD's newest ISL forecast to every engine prefill policy that batches by it (``dopd-length``), as
        the live sidecars relay the planner's forecast events; new instances get it when they appear."""
        if not self.params.relay_forecast:
            return
        reports = [p.report() for p in (self.pools, self.scaling) if p is not None]
        split = next((r.forecast for r in reports if r.forecast is not None), None)
        if split is None or (split is self._relayed and len(self.cluster.instances) == self._relayed_to):
            return
        self._relayed, self._relayed_to = split, len(self.cluster.instances)
        self.relayed_isl.append((self.queue.now_s, split.isl))
        for inst in self.cluster.instances.values():
            setter = getattr(inst.prefill_policy, "set_forecast_isl", None)
            if setter is not None:
                setter(split.isl)

    def _is_due(self, kind: str) -> bool:
        return self.queue.now_s >= self._due[kind]

    def _apply_scaling(self, target: ScalingTarget) -> None:
        changed = False
        changed |= self.cluster.scale_to("prefill", target.prefill)
        changed |= self.cluster.scale_to("decode", target.decode)
        if changed:
            self.decisions.append((self.queue.now_s, "scale", f"{target.prefill}P{target.decode}D: {target.reason}"))

