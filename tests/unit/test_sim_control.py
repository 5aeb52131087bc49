"""The simulator's control plane: flips, replica scaling, migrations and the engine policies, with their costs."""

from __future__ import annotations

import dataclasses
import functools

import msgspec
import pytest

from loadgen.sim.baselines import make_mix
from loadgen.sim.cluster import SimCluster, SimCosts
from loadgen.sim.control import ControlLoop, ControlParams
from loadgen.sim.events import PRIORITY_ARRIVAL, EventQueue
from loadgen.sim.instance import SimRequest
from loadgen.sim.overhead import NO_DELAY
from loadgen.sim.run import simulate
from loadgen.slo import SLO, parse_slo_classes
from loadgen.traces import load_trace
from loadgen.workload import TraceRequest, Workload
from shared.latency import LatencyModel, load_profile
from shared.policies import DECODE_BATCH_POLICIES, PolicyContext, PoolDecision, RoleChange
from shared.policies.length_batching import LengthBatching
from shared.policies.report import PolicyReport
from shared.protocol.messages import ClusterSnapshot

SLO_ = SLO(ttft_s=2.0, tpot_s=0.15)


def model(**changes: object) -> LatencyModel:
    return LatencyModel(msgspec.structs.replace(load_profile(), **changes))


def workload(*reqs: tuple[float, int, int]) -> Workload:
    return Workload(name="test", requests=[TraceRequest(index=i, arrival_s=t, input_tokens=n, output_tokens=o)
                                          for i, (t, n, o) in enumerate(reqs)])


def steady(rate: float, seconds: float, prompt: int = 1000, output: int = 50) -> Workload:
    n = int(rate * seconds)
    return workload(*((i / rate, prompt, output) for i in range(n)))


def all_complete(result: object) -> bool:
    records = result.records  # type: ignore[attr-defined]
    return all(r.ok and r.output_tokens_received == r.output_tokens_expected for r in records)


class FlipOnce:
    """A test pool policy: flip one instance at one time (what Arrow's flips will do, minus the judgement)."""

    name = "flip-once"
    note = "test"
    interval_s = 1.0

    def __init__(self, instance_id: str, new_role: str, at_s: float) -> None:
        self.instance_id, self.new_role, self.at_s = instance_id, new_role, at_s
        self.done = False
        self.snapshots: list[ClusterSnapshot] = []

    def decide(self, snapshot: ClusterSnapshot, now_s: float) -> PoolDecision | None:
        self.snapshots.append(snapshot)
        if self.done or now_s < self.at_s:
            return None
        self.done = True
        return PoolDecision(changes=[RoleChange(instance_id=self.instance_id, new_role=self.new_role,  # type: ignore[arg-type]
                                                reason="test")])

    def report(self) -> PolicyReport:
        return PolicyReport()


def test_a_flip_drains_pays_the_switch_and_loses_nothing() -> None:
    m = model(role_switch_s=2.0)
    w = steady(rate=20, seconds=10)
    policy = FlipOnce("p1", "decode", at_s=3.0)
    mix = dataclasses.replace(make_mix("static-minload", 4, "2P2D"), pools=policy)
    result = simulate(w, mix, m, SLO_, first_token_delay=NO_DELAY)
    assert all_complete(result)
    lifecycle = result.config["lifecycle"]
    assert lifecycle["flips"] == 1
    # The instance left prefill when drained and came back as decode one role_switch_s later.
    (t_back, prefill, decode) = [p for p in lifecycle["timeline"] if p[1] == 1][0]
    assert (prefill, decode) == (1, 3) and t_back >= 3.0 + 2.0
    # The policy saw the monitor's view: loads of every instance and a rolling series.
    last = policy.snapshots[-1]
    assert {i.info.instance_id for i in last.instances} == {"p0", "p1", "d0", "d1"}
    assert last.series and last.series[-1].completed > 0
    # While p1 drained and switched, every request after the decision went to p0.
    prefills = {r.rid: r for r in result.records}
    assert len(prefills) == len(w.requests)


def test_flipping_an_idle_instance_takes_only_the_switch_time() -> None:
    m = model(role_switch_s=1.5)
    w = workload((0.0, 500, 5), (10.0, 500, 5))
    mix = dataclasses.replace(make_mix("static-minload", 3, "2P1D"), pools=FlipOnce("p1", "decode", at_s=2.0))
    result = simulate(w, mix, m, SLO_)
    assert result.config["lifecycle"]["timeline"][-1] == pytest.approx([2.0 + 1.5, 1, 2])


def test_dynamo_sla_sizes_replicas_from_demand_and_saves_gpu_seconds() -> None:
    w = steady(rate=2, seconds=400)
    params = ControlParams(tick_s=1.0, series_interval_s=5.0)
    result = simulate(w, make_mix("dynamo-sla", 8), model(), SLO_, control=params)
    lifecycle = result.config["lifecycle"]
    # 2 req/s of 1000-token prompts is far below one prefill and one decode engine: at its first decision
    # (180 s, Dynamo's interval) it scales to 1P1D.
    assert lifecycle["timeline"][-1][1:] == [1, 1]
    assert 180.0 <= lifecycle["timeline"][-1][0] < 190.0
    assert lifecycle["stops"] == 6 and lifecycle["starts"] == 0
    makespan = result.summary.wall_s
    assert lifecycle["gpu_seconds"] < 8 * makespan * 0.9
    assert all_complete(result)
    assert any(kind == "scale" for _, kind, _ in result.config["decisions"])


def test_dynamo_load_adds_prefill_replicas_under_a_prefill_burst_after_the_start_cost() -> None:
    # Long prompts at a rate one prefill engine cannot keep up with; decode work is tiny.
    w = steady(rate=12, seconds=60, prompt=6000, output=4)
    costs = SimCosts(start_s=10.0)
    result = simulate(w, make_mix("dynamo-load", 8, "2P6D"), model(), SLO(ttft_s=0.5, tpot_s=0.1), costs=costs)
    lifecycle = result.config["lifecycle"]
    assert lifecycle["starts"] >= 1
    timeline = [tuple(p) for p in lifecycle["timeline"]]
    peak_prefill = max(p for _, p, _ in timeline)
    assert peak_prefill >= 2
    assert all_complete(result)
    # Every started replica became ready exactly start_s after the decision.
    events = lifecycle["events"]
    started = {i: t for t, i, what in events if what.startswith("start")}
    ready = {i: t for t, i, what in events if what == "ready"}
    assert started and all(ready[i] - t == pytest.approx(10.0) for i, t in started.items() if i in ready)
    assert result.config["decisions"]


def test_kv_balance_migrates_off_a_full_decode_instance_and_delivers_every_token() -> None:
    # Round-robin over 1P2D with alternating big and small requests: d0 gets every big one and fills its
    # (small) KV while d1 idles, so kv-balance moves requests from d0 to d1.
    m = model(kv_capacity_tokens=40_000, max_running_requests=64)
    w = workload(*((i * 0.01, 2000, 2000) if i % 2 == 0 else (i * 0.01, 200, 50) for i in range(20)))
    base = simulate(w, make_mix("static-rr", 3, "1P2D"), m, SLO_)
    result = simulate(w, make_mix("static-rr", 3, "1P2D", migration="kv-balance"), m, SLO_)
    assert all_complete(result) and all_complete(base)
    assert result.config["policies"]["migration"] == "kv-balance"
    assert result.config["lifecycle"]["migrations"] > 0 and base.config["lifecycle"]["migrations"] == 0
    # Two decode instances share the big requests' steps: the last one finishes sooner.
    assert result.summary.wall_s < base.summary.wall_s


def test_migration_is_carried_out_with_its_copy_time() -> None:
    from loadgen.sim.cluster import SimCluster
    from loadgen.sim.events import EventQueue
    from loadgen.sim.instance import SimRequest
    from shared.policies import LeastLoad, MigrationDecision

    m = model()
    q = EventQueue()
    cluster = SimCluster(["prefill", "decode", "decode"], m, LeastLoad(), q)
    req = SimRequest(index=0, rid="r0", arrival_s=0.0, input_tokens=1000, output_tokens=200)
    q.at(0.0, 2, lambda: cluster.submit(req))
    moved: list[bool] = []
    q.at(0.5, 2, lambda: moved.append(cluster.migrate(MigrationDecision(rid="r0", source_id="d0", target_id="d1",
                                                                          reason="test"))))
    q.run()
    assert moved == [True] and req.migrations == 1 and req.decode is cluster.instances["d1"]
    assert req.generated == 200 and req.finished_s is not None
    assert cluster.instances["d0"].used_kv == 0 and cluster.instances["d1"].used_kv == 0
    # Unmigrated, the same request finishes earlier by at least the KV copy of its context.
    q2 = EventQueue()
    c2 = SimCluster(["prefill", "decode", "decode"], m, LeastLoad(), q2)
    same = SimRequest(index=0, rid="r0", arrival_s=0.0, input_tokens=1000, output_tokens=200)
    q2.at(0.0, 2, lambda: c2.submit(same))
    q2.run()
    assert req.finished_s - same.finished_s >= m.kv_transfer_time_s(1000) * 0.99  # type: ignore[operator]
    # Moves that cannot happen are refused, not half-done.
    assert not cluster.migrate(MigrationDecision(rid="r0", source_id="d1", target_id="d0", reason="gone"))


def test_edf_prefill_order_serves_the_tight_class_first() -> None:
    classes = parse_slo_classes(["tight=1.5:0.1:0.5", "loose=30:0.1:0.5"], SLO_)
    assert classes is not None
    # A backlog of prompts on one prefill engine: EDF admits the tight ones first.
    w = workload(*((0.0 + i * 0.001, 4000, 5) for i in range(40)))
    fcfs = simulate(w, make_mix("static-minload", 2), model(), SLO_, slo_classes=classes)
    edf = simulate(w, make_mix("static-minload", 2, prefill_policy="edf"), model(), SLO_, slo_classes=classes)
    tight_fcfs = fcfs.summary.per_class["tight"].ttft_attainment
    tight_edf = edf.summary.per_class["tight"].ttft_attainment
    assert tight_edf > tight_fcfs + 0.15, (tight_fcfs, tight_edf)
    assert edf.summary.per_class["loose"].ttft_attainment == 1.0
    assert all_complete(edf)
    assert edf.config["policies"]["prefill"] == "edf"


class OnePerStep:
    name = "one-per-step"
    selects_all = False

    def select(self, running, max_batch, now_s, kv_waiting=0):  # type: ignore[no-untyped-def]
        return running[:1]

    def observe(self, batch_size: int, max_context: int, total_context: int, seconds: float) -> None:
        self.observed = (batch_size, max_context, total_context, seconds)


def test_a_decode_batch_policy_decides_who_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(DECODE_BATCH_POLICIES, OnePerStep.name, lambda model: OnePerStep())
    w = workload((0.0, 500, 20), (0.0, 500, 20))
    full = simulate(w, make_mix("static-minload", 2), model(), SLO_)
    one = simulate(w, make_mix("static-minload", 2, decode_policy=OnePerStep.name), model(), SLO_)
    assert all_complete(one)
    assert one.summary.e2e_p99_s > full.summary.e2e_p99_s  # type: ignore[operator]


def test_controlled_runs_are_deterministic_on_a_real_slice() -> None:
    w = load_trace("azure-code").slice(0.0, 120.0)
    a = simulate(w, make_mix("dynamo-load", 8), model(), SLO_, rate_scale=4.0)
    b = simulate(w, make_mix("dynamo-load", 8), model(), SLO_, rate_scale=4.0)
    assert a.config["lifecycle"] == b.config["lifecycle"]
    assert [r.finished_s for r in a.records] == [r.finished_s for r in b.records]
    assert all_complete(a)


def test_poise_sim_reports_the_control_plane_and_plots_provisioning(tmp_path: object,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    import json
    from pathlib import Path

    from services.cli.main import cmd_sim

    out = Path(str(tmp_path))
    assert cmd_sim(["--trace", "azure-code", "--duration-s", "120", "--policy", "dynamo-load", "--rate-scale", "4",
                    "--replica-start-s", "5", "--out-dir", str(out / "rep"), "--json", str(out / "s.json")]) == 0
    text = capsys.readouterr().out
    assert "control:" in text and "GPU-seconds" in text
    assert (out / "rep" / "timeline.png").stat().st_size > 10_000
    doc = json.loads((out / "s.json").read_text())
    lifecycle = doc["config"]["lifecycle"]
    assert doc["config"]["policies"]["scaling"] == "dynamo-load" and lifecycle["stops"] > 0
    assert lifecycle["gpu_seconds"] < 8 * doc["summary"]["wall_s"]


def test_dopd_forecast_isl_reaches_the_engines_length_batching() -> None:
    # DOPD forecasts the mean input length every 10 s; the control loop hands it to the prefill engines'
    # dopd-length policy, as the live sidecars relay the planner's forecast events.
    mix = make_mix("dopd-ratio", 4, prefill_policy="dopd-length")
    result = simulate(steady(4.0, 60.0, prompt=1500), mix, model(), SLO_, first_token_delay=NO_DELAY)
    relayed = result.config["engine_forecast_isl"]
    assert relayed, "no forecast reached the engines"
    assert all(abs(isl - 1500) < 150 for _, isl in relayed[1:])  # every prompt is 1500 tokens
    assert all_complete(result)


def test_no_forecast_is_relayed_without_a_dopd_part() -> None:
    mix = make_mix("arrow", 4, prefill_policy="dopd-length")
    assert simulate(steady(4.0, 30.0), mix, model(), SLO_, first_token_delay=NO_DELAY).config["engine_forecast_isl"] == []


def _run_loop(mix_name: str, control: ControlParams) -> tuple[SimCluster, object]:
    """A controlled run built by hand (as ``simulate`` does), so the test can look inside the engines after it."""
    m = model()
    mix = make_mix(mix_name, 4, prefill_policy="dopd-length").bound(
        m, PolicyContext(ttft_slo_s=SLO_.ttft_s, tpot_slo_s=SLO_.tpot_s, max_instances=4))
    queue = EventQueue()
    cluster = SimCluster(mix.roles, m, mix.dispatch, queue, engine=mix.engine, max_instances=4)
    reqs = [SimRequest(index=r.index, rid=f"r{r.index}", arrival_s=r.arrival_s, input_tokens=r.input_tokens,
                       output_tokens=r.output_tokens, slo_ttft_s=SLO_.ttft_s, slo_tpot_s=SLO_.tpot_s)
            for r in steady(4.0, 60.0, prompt=1500).requests]
    for req in reqs:
        queue.at(req.arrival_s, PRIORITY_ARRIVAL, functools.partial(cluster.submit, req))
    loop = ControlLoop(cluster, queue, total_requests=len(reqs), profile_name=m.profile.name, scaling=mix.scaling,
                       pools=mix.pools, migration=mix.migration, length=mix.length, params=control)
    loop.start()
    queue.run()
    assert all(r.finished_s is not None and r.error is None for r in reqs)
    return cluster, mix.pools or mix.scaling


@pytest.mark.parametrize("mix_name", ["dopd-ratio", "dopd"])  # poise plans on the served mix, no forecast
def test_every_engine_batches_by_the_newest_forecast(mix_name: str) -> None:
    # Not the loop's record of what it sent: the dopd-length policy inside each engine holds the forecast.
    cluster, policy = _run_loop(mix_name, ControlParams())
    split = policy.report().forecast
    assert split is not None and abs(split.isl - 1500) < 150
    engines = [i.prefill_policy for i in cluster.instances.values()]
    assert engines and all(isinstance(p, LengthBatching) for p in engines)
    for p in engines:
        assert isinstance(p, LengthBatching)
        assert p.forecast_isl == split.isl and p.long_threshold == split.isl


def test_with_the_relay_off_engines_keep_their_running_mean() -> None:
    cluster, policy = _run_loop("dopd-ratio", ControlParams(relay_forecast=False))
    assert policy.report().forecast is not None  # DOPD did forecast; the engines just never heard it
    engines = [i.prefill_policy for i in cluster.instances.values()]
    assert all(isinstance(p, LengthBatching) and p.forecast_isl is None for p in engines)
    assert any(isinstance(p, LengthBatching) and p.isl_hat == p.isl_mean == 1500.0 for p in engines)
