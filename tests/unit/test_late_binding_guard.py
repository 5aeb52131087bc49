"""Late binding that guards the decode side (``LateBinding.guard_decode``, on with early rejection): nothing
is released while no decode engine could start a request, and a prompt held past its TTFT target is refused."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loadgen.sim.baselines import make_mix
from loadgen.sim.run import simulate
from loadgen.slo import slo_for
from loadgen.traces import load_trace
from shared.latency import LatencyModel, load_profile
from shared.policies import make_prefill_policy
from shared.policies.late_binding import LateBinding
from shared.policies.views import EngineView

MODEL = LatencyModel(load_profile())


@dataclass
class Held:
    rid: str
    arrival_s: float
    slo_ttft_s: float
    input_tokens: int = 1000
    prefilled: int = 0
    retries: int = 0


def decode(instance_id: str, running: int, waiting: int, **kw: Any) -> EngineView:
    return EngineView(instance_id=instance_id, role="decode", status=kw.pop("status", "ready"),
                      kv_capacity_tokens=100_000, max_running_requests=8, running_reqs=running,
                      waiting_reqs=waiting, **kw)


def binding(guard: bool) -> LateBinding:
    return LateBinding(make_prefill_policy("edf", MODEL), guard_decode=guard)


def test_a_prompt_held_past_its_target_is_overdue_only_with_the_guard() -> None:
    held = [Held("a", 0.0, 2.0), Held("b", 1.0, 2.0), Held("c", 0.0, float("inf"))]
    assert [h.rid for h in binding(True).overdue(held, 2.5)] == ["a"]
    assert binding(False).overdue(held, 100.0) == []


def test_nothing_is_released_while_no_decode_engine_could_start_a_request() -> None:
    full = [decode("d0", 8, 0), decode("d1", 5, 3)]
    assert not binding(True).decode_room(full)
    assert binding(True).decode_room([*full, decode("d2", 7, 0)])
    assert binding(True).decode_room([*full, decode("d2", 0, 0, status="draining")]) is False  # not accepting
    assert binding(True).decode_room([])  # nothing to guard (colocated)
    assert binding(False).decode_room(full)


def test_far_past_capacity_the_guard_keeps_serving_what_can_be_served() -> None:
    """Two instances at 16x Azure conversation (two minutes of it): released on prefill room alone, prompts pile up on the decode
    engine waiting for a running slot, which early rejection does not judge, and none starts in time; with the
    guard, the held ones that can no longer make it are refused and the rest are served in time."""
    w = load_trace("azure-conv").slice(0.0, 120.0)
    slo = slo_for("azure-conv")

    def run(guard: bool) -> Any:
        mix = make_mix("poise", 2, "1P1D", late_binding="flowprefill-fewest-late", early_rejection=guard)
        return simulate(w, mix, MODEL, slo, rate_scale=16.0, rate_mode="natural", warmup_s=30.0)

    unguarded, guarded = run(False), run(True)
    assert unguarded.summary.slo_attainment < 0.1
    assert guarded.summary.slo_attainment > 0.25
    refused = [r for r in guarded.records if "held" in (r.error or "")]
    assert refused and all((r.error or "").startswith("429: early rejection") for r in refused)
