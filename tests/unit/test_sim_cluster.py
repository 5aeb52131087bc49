"""The virtual-time simulator: exact latencies from the shared model, capacity limits, determinism."""

from __future__ import annotations

import msgspec
import pytest

from loadgen.sim.baselines import POISE_ENGINE, make_mix, parse_split
from loadgen.sim.cluster import SimCluster
from loadgen.sim.events import PRIORITY_ARRIVAL, EventQueue
from loadgen.sim.instance import SimRequest
from loadgen.sim.overhead import LIVE_STACK_DELAY, NO_DELAY
from loadgen.sim.run import simulate
from loadgen.slo import SLO
from loadgen.traces import load_trace
from loadgen.workload import TraceRequest, Workload
from shared.latency import LatencyModel, load_profile
from shared.policies import LeastLoad

SLO_ = SLO(ttft_s=2.0, tpot_s=0.15)


def model(**changes: object) -> LatencyModel:
    return LatencyModel(msgspec.structs.replace(load_profile(), **changes))


def workload(*reqs: tuple[float, int, int]) -> Workload:
    return Workload(name="test", requests=[TraceRequest(index=i, arrival_s=t, input_tokens=n, output_tokens=o)
                                          for i, (t, n, o) in enumerate(reqs)])


def test_a_lone_request_takes_exactly_the_models_time() -> None:
    m = model()
    result = simulate(workload((0.0, 1000, 5)), make_mix("static-minload", 2), m, SLO_, first_token_delay=NO_DELAY)
    (r,) = result.records
    ttft = m.prefill_batch_time_s([(1000, 0)]) + m.kv_transfer_time_s(1000)
    assert r.ttft_s == pytest.approx(ttft)
    steps = sum(m.decode_step_time_s(1, 1000 + g) for g in range(1, 5))  # tokens 2..5, one step each
    assert r.finished_s == pytest.approx(ttft + steps)
    assert r.output_tokens_received == 5 and r.ok


def test_colocated_first_token_comes_with_the_prompts_last_chunk() -> None:
    m = model(chunked_prefill_size=512)
    result = simulate(workload((0.0, 1000, 1)), make_mix("colocated", 1), m, SLO_)
    (r,) = result.records
    # Two chunks (512 + 488) in two steps; one output token means done at the first token.
    expected = m.prefill_batch_time_s([(512, 0)]) + m.prefill_batch_time_s([(488, 512)])
    assert r.ttft_s == pytest.approx(expected) and r.e2e_s == pytest.approx(expected)


def test_kv_capacity_makes_requests_wait() -> None:
    m = model(kv_capacity_tokens=1500)
    # Each needs 1000 + 100 KV tokens on the decode side: the second waits for the first to finish.
    result = simulate(workload((0.0, 1000, 100), (0.0, 1000, 100)), make_mix("static-minload", 2), m, SLO_)
    first, second = sorted(result.records, key=lambda r: r.finished_s)
    assert second.first_token_s is not None and second.first_token_s >= first.finished_s


def test_too_large_requests_fail_and_others_complete() -> None:
    m = model(kv_capacity_tokens=2000)
    result = simulate(workload((0.0, 5000, 10), (0.1, 500, 10)), make_mix("static-minload", 2), m, SLO_)
    big, small = result.records
    assert big.status == "error" and "KV tokens" in (big.error or "")
    assert small.ok and small.output_tokens_received == 10


def test_every_request_of_a_real_slice_completes_with_exact_tokens() -> None:
    w = load_trace("azure-conv").slice(0.0, 120.0)
    for name, split in (("static-minload", "2P2D"), ("static-rr", "3P1D"), ("colocated", None)):
        result = simulate(w, make_mix(name, 4, split), model(), SLO_)
        assert len(result.records) == len(w.requests)
        assert all(r.ok and r.output_tokens_received == r.output_tokens_expected for r in result.records), name
        assert result.summary.token_mismatches == 0


def test_same_inputs_same_results() -> None:
    w = load_trace("azure-code").slice(0.0, 60.0)
    a = simulate(w, make_mix("static-rr", 4), model(), SLO_, rate_scale=3.0)
    b = simulate(w, make_mix("static-rr", 4), model(), SLO_, rate_scale=3.0)
    assert [(r.first_token_s, r.finished_s) for r in a.records] == [(r.first_token_s, r.finished_s) for r in b.records]


def test_more_load_means_more_latency() -> None:
    w = load_trace("azure-conv").slice(0.0, 120.0)
    calm = simulate(w, make_mix("static-minload", 2), model(), SLO_).summary
    busy = simulate(w, make_mix("static-minload", 2), model(), SLO_, rate_scale=6.0).summary
    assert busy.ttft_p90_s > calm.ttft_p90_s  # type: ignore[operator]


@pytest.mark.parametrize("split, instances, expected", [(None, 8, (4, 4)), (None, 3, (2, 1)), ("4P4D", 8, (4, 4)),
                                                         ("6:2", 8, (6, 2))])
def test_parse_split(split: str | None, instances: int, expected: tuple[int, int]) -> None:
    assert parse_split(split, instances) == expected


@pytest.mark.parametrize("split, instances", [("4P3D", 8), ("0P8D", 8), ("four", 8)])
def test_bad_splits(split: str, instances: int) -> None:
    with pytest.raises(ValueError):
        parse_split(split, instances)


def test_unknown_mix_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="static-minload"):
        make_mix("kairos", 8)


def test_poise_sim_command_writes_reports(tmp_path: object) -> None:
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = Path(str(tmp_path))
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "sim", "--trace", "azure-conv", "--duration-s", "60", "--instances", "4",
         "--split", "2P2D", "--policy", "static-rr", "--out-dir", str(out / "rep"), "--json", str(out / "s.json")],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "SLO attainment" in proc.stdout and "simulated s per wall s" in proc.stdout
    doc = json.loads((out / "s.json").read_text())
    assert doc["config"]["policy"] == "static-rr" and doc["config"]["roles"] == ["prefill"] * 2 + ["decode"] * 2
    assert doc["summary"]["requests_failed"] == 0
    assert (out / "rep" / "report.png").stat().st_size > 10_000
    bad = subprocess.run([sys.executable, "-m", "services.cli", "sim", "--split", "3P3D", "--instances", "8"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "split 3P3D has 6 instances" in bad.stderr


def test_the_live_stack_delay_is_added_before_the_first_token() -> None:
    m = model()
    bare = simulate(workload((0.0, 1000, 5)), make_mix("static-minload", 2), m, SLO_, first_token_delay=NO_DELAY)
    live = simulate(workload((0.0, 1000, 5)), make_mix("static-minload", 2), m, SLO_)
    delta = live.records[0].ttft_s - bare.records[0].ttft_s  # type: ignore[operator]
    # A lone request: the room claim's hop before the prefill, plus the drawn delay after it.
    assert delta == pytest.approx(LIVE_STACK_DELAY.handshake_s + LIVE_STACK_DELAY(0)) and 0.002 < delta < 0.05
    draws = sorted(LIVE_STACK_DELAY(i) for i in range(2001))
    assert draws[1000] == pytest.approx(LIVE_STACK_DELAY.median_s, rel=0.1)
    assert draws[1800] == pytest.approx(LIVE_STACK_DELAY.p90_s, rel=0.1)


def test_prompts_wait_for_the_decode_engines_step_boundary_and_can_then_share_a_prefill_step() -> None:
    # A decode engine busy with a long request claims new rooms only between its steps (engine_sim and
    # SGLang): two prompts that arrive 1 ms apart mid-step reach the prefill engine together.
    m = model()
    # The first request keeps the decode engine stepping (~7.6 ms a step) while the two others arrive 0.1 ms
    # apart inside one of its steps.
    w = workload((0.0, 2000, 2000), (0.5, 1000, 2), (0.5001, 1000, 2))
    result = simulate(w, make_mix("static-minload", 2), m, SLO_, first_token_delay=NO_DELAY)
    _, a, b = result.records
    assert a.first_token_s == pytest.approx(b.first_token_s)  # one prefill step for both  # type: ignore[arg-type]
    step = m.decode_step_time_s(1, 2000 + 2000)  # at most the step it waited for
    assert a.ttft_s > m.prefill_batch_time_s([(1000, 0), (1000, 0)]) + m.kv_transfer_time_s(1000)  # type: ignore[operator]
    assert a.ttft_s < m.prefill_batch_time_s([(1000, 0), (1000, 0)]) + m.kv_transfer_time_s(1000) + 2 * step  # type: ignore[operator]


def grow_mix(reserved: int) -> object:
    import dataclasses

    mix = make_mix("static-minload", 2, decode_kv="grow")
    return dataclasses.replace(mix, engine=dataclasses.replace(mix.engine, reserved_decode_tokens=reserved))


def test_growing_decode_kv_retracts_when_full_and_loses_nothing() -> None:
    m = model(kv_capacity_tokens=2300)
    w = workload((0.0, 1000, 600), (0.05, 1000, 600))
    # Whole outputs reserved (1600 each): the second waits for the first, nothing is ever retracted.
    whole = simulate(w, make_mix("static-minload", 2), m, SLO_)
    assert whole.config["retractions"] == 0
    # Growing from prompt + 50: both run at once until their 2300 tokens are used up; then the one with the
    # fewer output tokens (the later) is parked and resumes once the other finished.
    grow = simulate(w, grow_mix(50), m, SLO_)  # type: ignore[arg-type]
    assert grow.config["retractions"] >= 1
    assert all(r.ok and r.output_tokens_received == 600 for r in grow.records)
    first, second = grow.records
    assert second.first_token_s is not None and second.first_token_s < first.finished_s  # ran side by side
    assert second.finished_s > first.finished_s
    # The parked request's tokens stop: its TPOT is worse than with whole reservations' wait-then-run.
    assert second.tpot_s is not None and whole.records[1].tpot_s is not None
    assert second.tpot_s > whole.records[1].tpot_s


def test_a_colocated_engine_that_grows_kv_retracts_by_recompute_and_loses_nothing() -> None:
    import dataclasses

    m = model(kv_capacity_tokens=2300)
    w = workload((0.0, 1000, 600), (0.05, 1000, 600))
    mix = make_mix("colocated", 1, decode_kv="grow")
    mix = dataclasses.replace(mix, engine=dataclasses.replace(mix.engine, reserved_decode_tokens=50))
    grow = simulate(w, mix, m, SLO_)
    # Both start; when their growth no longer fits, the later one goes back to the queue and is prefilled
    # again with its output (SGLang's colocated retract), after which it finishes its 600 tokens.
    assert grow.config["retractions"] >= 1
    assert all(r.ok and r.output_tokens_received == 600 for r in grow.records)
    first, second = grow.records
    assert second.first_token_s is not None and second.first_token_s < first.finished_s
    assert second.finished_s > first.finished_s


def test_retraction_takes_the_fewest_output_tokens_then_the_longest_prompt() -> None:
    from shared.engine.model import retraction_order

    reqs = [SimRequest(index=i, rid=str(i), arrival_s=0.0, input_tokens=n, output_tokens=100) for i, n in
            enumerate((100, 900, 500))]
    reqs[0].generated, reqs[1].generated, reqs[2].generated = 5, 5, 50
    assert min(reqs, key=retraction_order) is reqs[1]


def test_unknown_decode_kv_model_is_refused() -> None:
    with pytest.raises(ValueError, match="decode KV model"):
        make_mix("static-minload", 2, decode_kv="paged")


def test_a_prefill_instance_reports_its_bootstrap_queue_as_sglang_does() -> None:
    # SGLang counts a prefill engine's bootstrap queue (requests whose decode side has no KV for them yet) in
    # num_waiting_reqs, and only the waiting queue's and the running prompt's tokens as uncached tokens.
    m = model(kv_capacity_tokens=5000)  # the decode side holds one 4000 + 300 request at a time
    q = EventQueue()
    cluster = SimCluster(["prefill", "decode"], m, LeastLoad(), q)
    for k in range(2):
        req = SimRequest(index=k, rid=f"r{k}", arrival_s=0.0, input_tokens=4000, output_tokens=300)
        q.at(0.0, PRIORITY_ARRIVAL, lambda req=req: cluster.submit(req))  # type: ignore[misc]
    seen = []
    q.at(0.01, PRIORITY_ARRIVAL, lambda: seen.extend(cluster.instance_loads("p")))
    q.run()
    prefill = next(i.load for i in seen if i.info.role == "prefill")
    assert prefill is not None
    assert prefill.num_running_reqs == 1 and prefill.num_waiting_reqs == 1  # r1 waits in the bootstrap queue
    assert prefill.num_waiting_uncached_tokens == 4000  # r0's prompt only
    assert (prefill.prefill_queue_reqs, prefill.prefill_bootstrap_reqs, prefill.compute_waiting_reqs) == (1, 1, 0)


def test_colocated_engines_chunk_where_the_prefill_engines_do_not() -> None:
    # Poise's engines prefill whole prompts (operator preemption replaces the chunk); a colocated engine, in
    # the simulator as from Poise's worker, keeps the profile's chunk, also after a restart into that mode.
    m = model()
    prefill = POISE_ENGINE.model("prefill", m)
    assert not prefill.chunked
    prefill.switch_role("null")
    assert prefill.chunked and prefill.chunk == m.profile.chunked_prefill_size
    assert POISE_ENGINE.model("null", m).chunked


def test_an_engine_override_replaces_what_the_mix_says_of_its_engines() -> None:
    stock = make_mix("poise", 8, "4P4D", prefill_policy="fcfs", preemption="chunk", chunk_tokens=8192)
    assert stock.engine.prefill_policy == "fcfs"
    assert POISE_ENGINE.describe() not in stock.description
    assert stock.description.count("prefill fcfs (chunk preemption, chunk 8192)") == 1
    # A mix that does not name its engines gets them appended.
    assert make_mix("static-minload", 8, "4P4D", prefill_policy="edf").description.endswith(
        "; prefill edf (chunk preemption, chunk profile), decode continuous, decode KV grows from prompt + 512 and "
        "retracts when full")


def test_clients_send_a_refused_request_again_after_retry_after_and_count_from_the_first_send() -> None:
    from shared.protocol.refusal import RETRY_AFTER_S

    # A burst of long prompts at once on one prefill engine with early rejection and late binding: the gateway
    # refuses what it cannot start in time, and the clients come back.
    burst = workload(*[(0.01 * i, 6000, 20) for i in range(40)])
    slo = SLO(ttft_s=1.0, tpot_s=0.15)
    once = simulate(burst, make_mix("poise", 2, "1P1D"), model(), slo)
    retried = simulate(burst, make_mix("poise", 2, "1P1D"), model(), slo, client_retries=2)
    assert once.summary.refused_share > 0 and all(r.attempts == 1 for r in once.records)
    assert len(retried.records) == len(burst.requests)  # one record per request, however often it was sent
    assert retried.summary.retries == sum(r.attempts - 1 for r in retried.records) == retried.config["retries"] > 0
    assert max(r.attempts for r in retried.records) == 3  # refused three times: given up, a miss
    assert all(r.attempts == 3 for r in retried.records if not r.ok and r.http_status == 429)
    came_back = [r for r in retried.records if r.ok and r.attempts > 1]
    assert came_back and all(r.ttft_s is not None and r.ttft_s >= RETRY_AFTER_S for r in came_back)
    assert {r.arrival_s for r in retried.records} == {r.arrival_s for r in once.records}  # judged from the first send
    # A request that cannot be served at all (400) is not sent again.
    too_big = simulate(workload((0.0, 500_000, 10)), make_mix("static-minload", 2), model(), SLO_, client_retries=2)
    assert too_big.records[0].attempts == 1 and too_big.records[0].http_status == 400
