"""The pure helpers of tests/bench/router_compare.py: attainment specs, sglang-router's command, the ramp's verdict."""

from __future__ import annotations

import pytest

from tests.bench.router_compare import (
    AttainmentSpec,
    max_sustainable,
    metric_total,
    parse_attainment_spec,
    proc_cpu_s,
    ratio,
    sglang_router_command,
)


def test_attainment_spec_parses_policies_joined_by_plus() -> None:
    spec = parse_attainment_spec("6:1.5:least-load+arrow:cache_aware+round_robin")
    assert spec == AttainmentSpec(6.0, 1.5, ("least-load", "arrow"), ("cache_aware", "round_robin"))
    assert spec.label == "time_scale 6, 1.5x trace rate"
    assert parse_attainment_spec("1:2::round_robin").poise_policies == ()


@pytest.mark.parametrize("text", ["1:2:least-load", "x:2:a:b", "1:0:a:b", "-1:2:a:b", "1:2::"])
def test_attainment_spec_rejects_malformed(text: str) -> None:
    with pytest.raises(ValueError):
        parse_attainment_spec(text)


def test_sglang_router_command_pd_mode() -> None:
    cmd = sglang_router_command("py", [("http://h:1", 11), ("http://h:2", 12)], ["http://h:3"], "round_robin",
                                port=9, prometheus_port=10)
    assert cmd[:4] == ["py", "-m", "sglang_router.launch_router", "--pd-disaggregation"]
    joined = " ".join(cmd)
    assert "--prefill http://h:1 11 --prefill http://h:2 12 --decode http://h:3 --policy round_robin" in joined
    assert "--port 9" in joined and "--prometheus-port 10" in joined and "--log-level warn" in joined


def test_max_sustainable_is_the_highest_passing_rate() -> None:
    def row(rate: float, **routers: tuple[float, int]) -> dict[str, object]:
        return {"rate_rps": rate, "routers": {k: {"added_p99_ms": p99, "errors": e} for k, (p99, e) in routers.items()}}

    rows = [row(100, a=(2.0, 0), b=(1.0, 0)), row(200, a=(12.0, 0), b=(3.0, 1)), row(400, a=(9.0, 0))]
    assert max_sustainable(rows, "a", 10.0) == 400
    assert max_sustainable(rows, "b", 10.0) == 100  # errors fail a rate whatever the latency
    assert max_sustainable(rows, "c", 10.0) == 0.0


def test_ratio_handles_missing_and_zero() -> None:
    assert ratio(2.0, 4.0) == 0.5
    assert ratio(None, 1.0) is None and ratio(1.0, 0.0) is None


def test_metric_total_sums_every_label_set_of_one_metric() -> None:
    text = ("# HELP sglang:num_requests_total n\n# TYPE sglang:num_requests_total counter\n"
            'sglang:num_requests_total{model_name="m",engine_type="unified"} 3.0\n'
            'sglang:num_requests_total{model_name="m",engine_type="other"} 2.0\n'
            'sglang:num_requests_created{model_name="m"} 1.7e9\n'
            "sglang:num_requests_total_x 99\n")
    assert metric_total(text, "sglang:num_requests_total") == 5.0
    assert metric_total(text, "sglang:prompt_tokens_total") == 0.0


def test_proc_cpu_s_reads_utime_and_stime_after_the_command_name() -> None:
    # pid (comm with ") x" in it) state ppid ... field 14 utime = 250, field 15 stime = 50
    stat = "123 (python ) x) S 1 123 123 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 3 0 1000 0 0"
    assert proc_cpu_s(stat, 100) == 3.0
