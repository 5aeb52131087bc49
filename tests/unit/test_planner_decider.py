"""The planner's decider: the pool policy runs off the event loop, one call at a time, and is timed."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from services.planner.decider import Decider, quantile
from services.planner.views import policy_view, pool_rows
from shared.latency import LatencyModel, load_profile
from shared.policies import PolicyContext, PoolDecision, make_pool_policy
from shared.protocol import ClusterSnapshot, InstanceInfo


class _SlowPolicy:
    """Records where and how often it runs; sleeps like an ARIMA fit."""

    name = "slow"
    note = "test"
    interval_s = 1.0

    def __init__(self, sleep_s: float) -> None:
        self.sleep_s = sleep_s
        self.threads: list[threading.Thread] = []
        self.active = 0
        self.max_active = 0
        self._lock = threading.Lock()

    def decide(self, snapshot: ClusterSnapshot, now_s: float) -> PoolDecision | None:
        with self._lock:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        self.threads.append(threading.current_thread())
        time.sleep(self.sleep_s)
        with self._lock:
            self.active -= 1
        return PoolDecision()


def _snapshot() -> ClusterSnapshot:
    return ClusterSnapshot(ts_unix_s=time.time(), instances=[], series=[])


def test_decide_runs_off_the_event_loop_while_the_loop_stays_responsive() -> None:
    policy = _SlowPolicy(0.2)
    decider = Decider(policy)

    async def go() -> list[float]:
        gaps: list[float] = []
        stop = asyncio.Event()

        async def heartbeat() -> None:
            last = time.monotonic()
            while not stop.is_set():
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        beat = asyncio.create_task(heartbeat())
        await asyncio.sleep(0.02)
        decision = await decider.decide(_snapshot(), time.time())
        assert decision == PoolDecision()
        stop.set()
        await beat
        return gaps

    gaps = asyncio.run(go())
    decider.close()
    assert policy.threads and policy.threads[0] is not threading.main_thread()
    assert policy.threads[0].name.startswith(Decider.THREAD_NAME)
    # The loop kept ticking every ~10 ms through the 200 ms decision (a blocking call would show a 200 ms gap).
    assert len(gaps) >= 10 and max(gaps) < 0.15, max(gaps)
    stats = decider.stats()
    assert stats["decisions"] == 1 and 190 <= stats["p50_ms"] <= 1000 and stats["p99_ms"] == stats["max_ms"]
    assert stats["cpu_p50_ms"] < 100  # sleeping costs no CPU: the two clocks tell cost from waiting


def test_calls_never_overlap_even_when_asked_concurrently() -> None:
    policy = _SlowPolicy(0.05)
    decider = Decider(policy)

    async def go() -> None:
        await asyncio.gather(*(decider.decide(_snapshot(), time.time()) for _ in range(4)))

    asyncio.run(go())
    decider.close()
    assert policy.max_active == 1 and len(policy.threads) == 4
    assert len({t.ident for t in policy.threads}) == 1  # one thread: policies keep state between calls
    assert decider.stats()["window"] == 4


def test_stats_before_any_decision_and_quantiles() -> None:
    decider = Decider(_SlowPolicy(0.0))
    assert decider.stats()["p99_ms"] is None
    decider.close()
    assert quantile([1.0, 2.0, 3.0, 4.0], 0.5) == pytest.approx(2.5)
    assert quantile([5.0], 0.99) == 5.0


@pytest.mark.parametrize("name", ["static", "arrow", "dopd", "poise"])
def test_policy_view_reads_what_each_policy_keeps(name: str) -> None:
    ctx = PolicyContext(ttft_slo_s=2.0, tpot_slo_s=0.15, max_instances=8)
    policy = make_pool_policy(name, LatencyModel(load_profile()), ctx)
    report = policy.report()
    view = policy_view(policy, report)
    assert view["name"] == name and view["note"]
    assert ("dopd" in view) == (name == "dopd")  # Poise shows its target once it has scored the splits
    assert ("arrow" in view) == (name == "arrow")
    assert report.target_prefill is None and report.forecast is None  # nothing decided yet


def test_pool_rows_are_sorted_by_role_and_mark_flips() -> None:
    def info(i: str, role: str) -> InstanceInfo:
        return InstanceInfo(instance_id=i, role=role, engine_kind="sim", url="u", bootstrap_host="h",  # type: ignore[arg-type]
                            bootstrap_port=1, model="m", profile="p", kv_capacity_tokens=1, max_running_requests=1,
                            sidecar="s", registered_at_unix_s=0.0)

    rows = pool_rows({"p0": info("p0", "prefill"), "d0": info("d0", "decode")}, {"p0"})
    assert [(r["instance_id"], r["flipping"]) for r in rows] == [("d0", False), ("p0", True)]
