"""Dispatch policies: table-driven, pure."""

from __future__ import annotations

from typing import Any

import pytest

from shared.policies import (
    DispatchParams,
    DispatchPolicy,
    EngineView,
    LeastLoad,
    Placement,
    Rejection,
    RequestView,
    RoundRobin,
    make_dispatch_policy,
)

_: DispatchPolicy = LeastLoad()  # the Protocol check mypy runs
__: DispatchPolicy = RoundRobin()

REQ = RequestView(rid="r", input_tokens=1000, max_output_tokens=100)


def eng(instance_id: str, role: str = "prefill", **kw: Any) -> EngineView:
    base: dict[str, Any] = {"status": "ready", "kv_capacity_tokens": 100_000, "max_running_requests": 64, "load_age_s": 0.1}
    base.update(kw)
    return EngineView(instance_id=instance_id, role=role, **base)  # type: ignore[arg-type]


@pytest.mark.parametrize("engines, expected", [
    # prefill by in-flight prompt tokens, decode by KV use
    ([eng("p0", inflight_tokens=5000), eng("p1", inflight_tokens=100), eng("d0", "decode", used_tokens=50_000),
      eng("d1", "decode", used_tokens=10_000)], ("p1", "d1")),
    # gateway's own in-flight decode tokens count as KV about to be used
    ([eng("p0"), eng("d0", "decode", used_tokens=10_000), eng("d1", "decode", used_tokens=0, inflight_tokens=20_000)],
     ("p0", "d0")),
    # ties go to the lowest id
    ([eng("p1"), eng("p0"), eng("d1", "decode"), eng("d0", "decode")], ("p0", "d0")),
    # draining and unhealthy engines are skipped
    ([eng("p0", status="draining"), eng("p1"), eng("d0", "decode", healthy=False), eng("d1", "decode", used_tokens=90_000)],
     ("p1", "d1")),
    # no pair: fall back to a colocated engine
    ([eng("p0"), eng("c0", "null")], (None, "c0")),
])
def test_least_load_places(engines: list[EngineView], expected: tuple[str | None, str]) -> None:
    decision = LeastLoad().place(REQ, engines, 0.0)
    assert decision == Placement(prefill_id=expected[0], decode_id=expected[1])


def test_exclude_skips_failed_engines() -> None:
    engines = [eng("p0"), eng("p1", inflight_tokens=10), eng("d0", "decode")]
    decision = LeastLoad().place(REQ, engines, 0.0, exclude=frozenset({"p0"}))
    assert isinstance(decision, Placement) and decision.prefill_id == "p1"


def test_empty_cluster_is_not_retryable() -> None:
    decision = LeastLoad().place(REQ, [], 0.0)
    assert isinstance(decision, Rejection) and not decision.retryable
    assert "no ready" in decision.reason


def test_full_cluster_is_retryable() -> None:
    params = DispatchParams(max_pending_per_engine=4)
    engines = [eng("p0", inflight_reqs=4), eng("d0", "decode")]
    decision = LeastLoad(params).place(REQ, engines, 0.0)
    assert isinstance(decision, Rejection) and decision.retryable


def test_stale_reports_are_ignored_but_inflight_counts() -> None:
    params = DispatchParams(max_pending_per_engine=4, stale_load_s=1.0)
    stale = [eng("p0", waiting_reqs=100, load_age_s=30.0), eng("d0", "decode")]
    assert LeastLoad(params).place(REQ, stale, 0.0) == Placement(prefill_id="p0", decode_id="d0")
    # The same queue reported fresh fills the engine, and so does the gateway's own in-flight count when stale.
    fresh = [eng("p0", waiting_reqs=100, load_age_s=0.5), eng("d0", "decode")]
    counted = [eng("p0", waiting_reqs=100, load_age_s=30.0, inflight_reqs=4), eng("d0", "decode")]
    for engines in (fresh, counted):
        decision = LeastLoad(params).place(REQ, engines, 0.0)
        assert isinstance(decision, Rejection) and decision.retryable


def test_round_robin_cycles() -> None:
    policy = RoundRobin()
    engines = [eng("p0"), eng("p1"), eng("d0", "decode"), eng("d1", "decode")]
    picks = [policy.place(REQ, engines, 0.0) for _ in range(4)]
    assert [p.prefill_id for p in picks] == ["p0", "p1", "p0", "p1"]  # type: ignore[union-attr]


def test_registry_rejects_unknown_names() -> None:
    from shared.latency import LatencyModel, load_profile
    from shared.policies import PolicyContext

    model, ctx = LatencyModel(load_profile()), PolicyContext(ttft_slo_s=2.0, tpot_slo_s=0.15, max_instances=8)
    assert make_dispatch_policy("least-load", model, ctx).name == "least-load"
    assert make_dispatch_policy("arrow", model, ctx).name == "arrow"
    with pytest.raises(ValueError, match="known: arrow, cache-aware, least-load, round-robin"):
        make_dispatch_policy("nope", model, ctx)
