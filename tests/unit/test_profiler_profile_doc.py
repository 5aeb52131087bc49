"""The profile the profiler writes: measured fields, engine-reported fields, copied fields; loadable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.profiler.fit import DecodeFit, FitStats, PrefillFit
from services.profiler.profile_doc import MEASURED_FIELDS, base_profile, build_profile, write_profile
from services.profiler.target import EngineTarget
from shared.errors import PoiseError
from shared.latency import LatencyModel, load_profile

STATS = FitStats(points=10, r2=0.9999, rmse_s=1e-4, max_rel_error=0.01, rel_errors=[0.0] * 10)


def fits(o: float = 0.009) -> tuple[PrefillFit, DecodeFit]:
    pf = PrefillFit(overhead_s=o, s_per_token=3e-5, s_per_token2=5e-10, request_overhead_s=0.001,
                    separated_request_overhead=True, clamped=[], outliers=[], statistic="min", stats=STATS,
                    std_errors={})
    df = DecodeFit(overhead_s=0.007, s_per_seq=2.1e-5, s_per_context_token=5e-8, clamped=[], outliers=[],
                   stats=STATS, std_errors={})
    return pf, df


def sim_target(source: str = "llama-3.1-8b-h100") -> EngineTarget:
    return EngineTarget(url="http://e:1", server_info={"engine": "poise-engine-sim"}, is_engine_sim=True,
                        time_scale=2.0, time_scale_source="/server_info time_scale", chunked_prefill_size=2048,
                        context_length=131072, kv_capacity_tokens=123456, max_running_requests=128, tp=1,
                        model="m", gpu_profile={"name": "llama-3.1-8b-h100", "source": source, "gpu": "H100"})


def test_base_profile_follows_the_engine_then_the_default() -> None:
    assert base_profile(sim_target(), None)[0].name == "llama-3.1-8b-h100"
    profile, why = base_profile(sim_target(source="/elsewhere/missing.json"), None)
    assert profile.name == "llama-3.1-8b-h100" and "name" in why  # the path is not here: its name is


def test_profile_fields_say_where_they_came_from(tmp_path: Path) -> None:
    base = load_profile()
    pf, df = fits()
    profile, sources = build_profile(base, pf, df, sim_target(), name="x", labels={"gpu": ("H100", "--gpu")},
                                     provenance=["p"])
    assert profile.prefill_overhead_s == 0.009 and profile.decode_s_per_seq == 2.1e-5
    assert profile.kv_capacity_tokens == 123456 and profile.chunked_prefill_size == 2048
    assert profile.kv_bytes_per_token == base.kv_bytes_per_token  # copied
    assert {f for f, s in sources.items() if s == "measured"} == set(MEASURED_FIELDS)
    assert sources["kv_capacity_tokens"] == "server_info" and sources["transfer_bytes_per_s"] == f"base:{base.name}"
    assert (profile.gpu, sources["gpu"]) == ("H100", "--gpu") and sources["model"] == f"base:{base.name}"

    path = tmp_path / "out.json"
    loaded = write_profile(profile, {"fields": sources, "std_errors": {"x": float("inf")}}, path)
    assert loaded == load_profile(path) == profile
    doc = json.loads(path.read_text())["profiling"]
    assert doc["fields"]["prefill_s_per_token"] == "measured" and doc["std_errors"]["x"] is None  # strict JSON
    assert LatencyModel(loaded).prefill_time_s(1000) > 0


def test_invalid_fit_is_refused() -> None:
    pf, df = fits(o=-1.0)  # LatencyProfile refuses negative values
    with pytest.raises(PoiseError, match="not valid"):
        build_profile(load_profile(), pf, df, sim_target(), name="x", provenance=[])
