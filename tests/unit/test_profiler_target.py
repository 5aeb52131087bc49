"""What the profiler reads from /server_info, and the clear errors for engines it cannot profile."""

from __future__ import annotations

from typing import Any

import pytest

from services.profiler.target import describe_target
from shared.errors import PoiseError

URL = "http://gpu1:30000"


def sglang_info(**extra: Any) -> dict[str, Any]:
    """The fields of a real SGLang 0.5.x /server_info the profiler reads (server args + internal_states)."""
    info: dict[str, Any] = {"disaggregation_mode": "null", "chunked_prefill_size": 8192, "context_length": None,
                            "tp_size": 1, "served_model_name": "meta-llama/Llama-3.1-8B-Instruct",
                            "internal_states": [{"max_total_num_tokens": 380000, "max_running_requests": 256}],
                            "version": "0.5.23"}
    info.update(extra)
    return info


def test_real_sglang_runs_at_scale_one() -> None:
    t = describe_target(URL, sglang_info(), context_length=131072)
    assert not t.is_engine_sim and t.time_scale == 1.0 and "real engine" in t.time_scale_source
    assert (t.kv_capacity_tokens, t.max_running_requests, t.chunked_prefill_size) == (380000, 256, 8192)
    assert t.context_length == 131072 and t.tp == 1 and t.model == "meta-llama/Llama-3.1-8B-Instruct"


def test_engine_sim_time_scale_is_read_and_divided_out() -> None:
    info = sglang_info(engine="poise-engine-sim", time_scale=2.5, context_length=131072, chunked_prefill_size=-1,
                       gpu_profile={"name": "llama-3.1-8b-h100", "gpu": "H100-SXM-80GB", "time_scale": 2.5})
    t = describe_target(URL, info)
    assert t.is_engine_sim and t.time_scale == 2.5 and t.time_scale_source == "/server_info time_scale"
    assert t.chunked_prefill_size is None  # -1: no chunking
    assert t.gpu_profile is not None and t.gpu_profile["name"] == "llama-3.1-8b-h100"


def test_time_scale_hint_must_agree_with_the_engine() -> None:
    assert describe_target(URL, sglang_info(), time_scale_hint=4.0).time_scale == 4.0
    with pytest.raises(PoiseError, match="contradicts"):
        describe_target(URL, sglang_info(time_scale=2.0), time_scale_hint=4.0)


def test_free_compute_is_refused() -> None:
    with pytest.raises(PoiseError, match="nothing to measure"):
        describe_target(URL, sglang_info(engine="poise-engine-sim", time_scale=0.0))


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_pd_engines_are_refused_with_what_to_do(mode: str) -> None:
    with pytest.raises(PoiseError, match=r"--disaggregation-mode null") as err:
        describe_target(URL, sglang_info(disaggregation_mode=mode))
    assert f"PD {mode} engine" in str(err.value)


@pytest.mark.parametrize("info", [{"status": "ok"}, [], "hello", {"disaggregation_mode": "null"}])
def test_non_sglang_answers_are_refused(info: Any) -> None:
    with pytest.raises(PoiseError, match="SGLang"):
        describe_target(URL, info)
