"""The latency model: shapes from the papers, profile loading, chunk additivity."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from shared.errors import ConfigError
from shared.latency import DEFAULT_PROFILE, LatencyModel, available_profiles, load_profile, save_profile


@pytest.fixture
def model() -> LatencyModel:
    return LatencyModel(load_profile(DEFAULT_PROFILE))


def test_default_profile_is_documented() -> None:
    profile = load_profile(DEFAULT_PROFILE)
    assert DEFAULT_PROFILE in available_profiles()
    assert profile.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # Llama-3.1-8B, bf16 KV
    assert len(profile.provenance) >= 5


def test_prefill_is_convex_in_length(model: LatencyModel) -> None:
    t1, t2, t4 = (model.prefill_time_s(n) for n in (2000, 4000, 8000))
    assert t1 < t2 < t4
    # Quadratic term: the second doubling costs more than the first.
    assert (t4 - t2) > (t2 - t1)


def test_chunks_add_up_to_the_whole_prefill(model: LatencyModel) -> None:
    whole = model.prefill_work_s(8192)
    chunks = sum(model.prefill_work_s(1024, done) for done in range(0, 8192, 1024))
    assert chunks == pytest.approx(whole, rel=1e-12)


def test_decode_step_linear_in_context_and_batch(model: LatencyModel) -> None:
    assert model.decode_step_time_s(0, 0) == 0.0
    base = model.decode_step_time_s(8, 8000)
    assert model.decode_step_time_s(8, 16000) - base == pytest.approx(model.profile.decode_s_per_context_token * 8000)
    assert model.decode_step_time_s(16, 8000) - base == pytest.approx(model.profile.decode_s_per_seq * 8)


def test_a_decode_batch_past_the_largest_cuda_graph_runs_eagerly(model: LatencyModel) -> None:
    p = model.profile
    assert p.cuda_graph_max_batch == 256  # SGLang's on an H100 at TP 1

    def graphed(batch: int, context: int) -> float:
        return p.decode_overhead_s + p.decode_s_per_seq * batch + p.decode_s_per_context_token * context

    assert model.decode_step_time_s(256, 256 * 1500) == pytest.approx(graphed(256, 256 * 1500))
    # GPU-bound: the launches the graph saves stretch the step by the factor ...
    assert model.decode_step_time_s(300, 300 * 1500) == pytest.approx(p.eager_decode_factor * graphed(300, 300 * 1500))
    # ... and a step shorter than the launches alone takes the launches' time.
    assert graphed(300, 300) < p.eager_decode_floor_s
    assert model.decode_step_time_s(300, 300) == pytest.approx(p.eager_decode_floor_s)
    # Without a graph limit every step is graphed.
    unlimited = LatencyModel(msgspec.structs.replace(p, cuda_graph_max_batch=None))
    assert unlimited.decode_step_time_s(300, 300 * 1500) == pytest.approx(graphed(300, 300 * 1500))


def test_transfer_time_is_bytes_over_bandwidth(model: LatencyModel) -> None:
    p = model.profile
    assert model.kv_transfer_time_s(1000) == pytest.approx(p.transfer_overhead_s + 1000 * p.kv_bytes_per_token / p.transfer_bytes_per_s)


def test_time_scale_zero_makes_compute_free() -> None:
    free = LatencyModel(load_profile(), time_scale=0.0)
    assert free.prefill_time_s(4000) == 0.0
    assert free.decode_step_time_s(64, 100_000) == 0.0
    assert free.kv_transfer_time_s(4000) == 0.0


def test_mixed_step_pays_one_overhead(model: LatencyModel) -> None:
    mixed = model.mixed_step_time_s(4, 4000, [(512, 0)])
    assert mixed == pytest.approx(model.decode_step_time_s(4, 4000) + model.prefill_work_s(512))


def test_profiles_load_from_files(tmp_path: Path) -> None:
    profile = load_profile()
    path = tmp_path / "custom.json"
    save_profile(msgspec.structs.replace(profile, name="custom", decode_overhead_s=0.02), path)
    loaded = load_profile(path)
    assert loaded.name == "custom" and loaded.decode_overhead_s == 0.02


@pytest.mark.parametrize("change, message", [
    ({"prefill_s_per_token": -1.0}, "negative"),
    ({"kv_capacity_tokens": 0}, "must be positive"),
    ({"transfer_bytes_per_s": 0.0}, "must be positive"),
    ({"cuda_graph_max_batch": 0}, "cuda_graph_max_batch"),
    ({"eager_decode_factor": 0.9}, "eager_decode_factor"),
])
def test_bad_profiles_are_rejected(tmp_path: Path, change: dict[str, float], message: str) -> None:
    data = msgspec.to_builtins(load_profile())
    data.update(change)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=message):
        load_profile(path)


def test_unknown_profile_names_the_builtins() -> None:
    with pytest.raises(ConfigError, match=DEFAULT_PROFILE):
        load_profile("no-such-profile")


def test_operators_split_a_layer_by_their_work() -> None:
    m = LatencyModel(load_profile())
    parts = [(8192, 0)]
    share = m.attention_share(parts)
    assert 0.1 < share < 0.13  # 8K tokens: attention is a ninth of the pass on the default profile
    pass_s = m.prefill_batch_time_s(parts)
    layer_s = pass_s / m.profile.num_layers
    ops = m.operator_durations_s(layer_s, share)
    assert len(ops) == 5 and sum(ops) == pytest.approx(layer_s)
    assert max(ops) == ops[3]  # gate_up_proj, the widest matrix product
    assert ops[1] == pytest.approx(share * layer_s)
    # A preemption in the middle of the first layer's gate_up_proj waits for its end, not a fifth of the layer.
    gate_up_start = sum(ops[:3])
    cut = m.operator_boundary_s(0.0, gate_up_start + ops[3] / 2, pass_s, share)
    assert cut == pytest.approx(gate_up_start + ops[3])
    assert m.operator_boundary_s(0.0, 0.0, pass_s, share) == 0.0
    assert m.operator_boundary_s(0.0, pass_s * 2, pass_s, share) == pytest.approx(pass_s)
    # Long prompts: attention becomes the longest operator (32K: about a third of the pass).
    assert m.attention_share([(32768, 0)]) > 0.3
    # Without a share, operators are equal (the model before the H100 check).
    assert m.operator_boundary_s(0.0, 0.01, 1.0) == pytest.approx(2.0 / 160)
    # Now a hair past a boundary, within the sum's rounding: the boundary is now, never before it (a cut in the
    # past, which the simulator's event queue refuses).
    start, now, pass_s, share = 537.4569764496049, 538.3084144578867, 1.696393136505093, 0.47007604043713763
    assert m.operator_boundary_s(start, now, pass_s, share) >= now


def test_operator_weights_must_match_the_matrix_products() -> None:
    with pytest.raises(ConfigError, match="operator_weights"):
        msgspec.structs.replace(load_profile(), operator_weights=[1.0, 2.0])
