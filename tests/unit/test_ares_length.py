"""Length predictors for ARES: the oracle, the noise model calibrated to ARES Fig. 7, and the simulator's
prediction cadence (every k decode steps, counting down in between)."""

from __future__ import annotations

import random

import pytest

from loadgen.sim.instance import SimRequest
from loadgen.sim.prediction import PredictionCadence
from shared.policies import LengthPredictor, RequestView, make_length_predictor
from shared.policies.length import AresNoise, AresNoiseParams, Oracle

_checks: tuple[LengthPredictor, LengthPredictor] = (Oracle(), AresNoise())


def view(rid: str, out: int = 32_000) -> RequestView:
    return RequestView(rid=rid, input_tokens=100, max_output_tokens=out)


def test_oracle_says_the_truth_and_needs_it() -> None:
    o = make_length_predictor("oracle")
    assert o.predict_remaining(view("r"), 100, 1500) == 1400
    assert o.predict_remaining(view("r"), 1500, 1500) == 0
    with pytest.raises(ValueError, match="true output length"):
        o.predict_remaining(view("r"), 100)


@pytest.mark.parametrize(("generated", "paper_mae"), [(0, 18_256), (8_000, 2_929)])
def test_noise_model_matches_ares_fig7_within_15_percent(generated: int, paper_mae: int) -> None:
    # ARES Fig. 7 / §4.3: requests whose true output is 30-32K tokens; MAE of the remaining length with the
    # prompt only, and after 8,000 generated tokens.
    p = make_length_predictor("ares-noise")
    rng = random.Random(11)
    errors = []
    for i in range(3000):
        out = rng.randint(30_000, 32_000)
        errors.append(abs(p.predict_remaining(view(f"r{i}"), generated, out) - (out - generated)))
    mae = sum(errors) / len(errors)
    assert paper_mae * 0.85 <= mae <= paper_mae * 1.15, mae


def test_noise_is_deterministic_per_seed_request_and_point_and_clamped() -> None:
    p = AresNoise()
    a = p.predict_remaining(view("r1"), 40, 5000)
    assert a == AresNoise().predict_remaining(view("r1"), 40, 5000)
    assert a != p.predict_remaining(view("r2"), 40, 5000)
    assert a != p.predict_remaining(view("r1"), 60, 5000)
    assert a != AresNoise(AresNoiseParams(seed=1)).predict_remaining(view("r1"), 40, 5000)
    for i in range(500):
        g = 30_000 + i
        guess = p.predict_remaining(view(f"c{i}"), g, 32_700)
        assert 1.0 <= guess <= 32_768 - g
    # the error shrinks as tokens are generated (relative MAE over many requests)
    def rel_mae(g: int) -> float:
        return sum(abs(p.predict_remaining(view(f"m{i}"), g, 20_000) - (20_000 - g)) / (20_000 - g)
                   for i in range(400)) / 400
    assert rel_mae(0) > rel_mae(4000) > rel_mae(12_000)
    # max_tokens is the truth in trace replays, so the clamp to it is off unless asked for
    capped = AresNoise(AresNoiseParams(clamp_to_max_tokens=True))
    assert all(capped.predict_remaining(view(f"k{i}", out=600), 0, 600) <= 600 for i in range(200))
    with pytest.raises(ValueError, match="true output length"):
        p.predict_remaining(view("r"), 0)


class Recording:
    name = "recording"

    def __init__(self) -> None:
        self.calls: list[int] = []

    def predict_remaining(self, request: RequestView, generated: int, true_total: int | None = None) -> float:
        self.calls.append(generated)
        return 1000.0

    def observe(self, input_tokens: int, output_tokens: int) -> None:
        return None


def test_cadence_repredicts_every_k_tokens_and_counts_down_between() -> None:
    rec = Recording()
    cadence = PredictionCadence(rec, interval_tokens=20)
    req = SimRequest(index=0, rid="r", arrival_s=0.0, input_tokens=10, output_tokens=5000)
    seen = []
    for g in (1, 5, 19, 20, 25, 39, 40, 41):
        req.generated = g
        seen.append(cadence.remaining(req))
    assert rec.calls == [0, 20, 40]  # one prediction per cadence point, made with that point's generated count
    assert seen == [999, 995, 981, 1000, 995, 981, 1000, 999]
    req.generated = 1400
    assert cadence.remaining(req) == 1000 and rec.calls[-1] == 1400
    req.generated = 1419
    assert cadence.remaining(req) == 981
    with pytest.raises(ValueError):
        PredictionCadence(rec, interval_tokens=0)
