"""engine_sim's scheduler driven in-process (no HTTP): token counts, determinism, KV admission and
accounting, pacing, chunked prefill, abort, pause, role switch, and an in-process PD pair.

Every test runs on virtual time (``looptime``): the engine reads the loop's clock (``engine_clock_on_loop``),
so its steps, a role switch's seconds and every timeout pass without waiting, in the order real time would
have them. Tests of a PD pair, whose KV handoff goes over loopback HTTP, run on the real clock (``REAL_TIME``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import msgspec
import pytest

from services.engine_sim import clock
from services.engine_sim.config import EngineSimSettings
from services.engine_sim.engine import SimEngine
from services.engine_sim.reports import load, load_snapshot
from services.engine_sim.requests import Phase, SimRequest
from services.engine_sim.tokens import EOS_TOKEN_ID, TokenSource, draw_output_length
from shared.engine_client import parse_loads
from shared.load_view import engine_loads, load_report
from tests.bench.router_compare import metric_total

# Virtual time: looptime's loop, and engine_sim's clock driven by it (tests/unit/conftest.py).
VIRTUAL_TIME = [pytest.mark.looptime, pytest.mark.usefixtures("engine_clock_on_loop")]
pytestmark = VIRTUAL_TIME
# A PD pair hands KV off over loopback HTTP, which a virtual clock would not wait for: its timeouts could fire
# while a request is still on the wire. Those tests run on the real clock.
REAL_TIME = pytest.mark.looptime(False)


def make_engine(**overrides: Any) -> SimEngine:
    settings: dict[str, Any] = {"time_scale": 0.0, "bootstrap_timeout_s": 5.0}
    settings.update(overrides)
    return SimEngine(EngineSimSettings(**settings))


@asynccontextmanager
async def running(*engines: SimEngine) -> AsyncIterator[None]:
    for e in engines:
        await e.start()
    try:
        yield
    finally:
        for e in engines:
            await e.stop()


async def until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Poll the engine's state (it changes between scheduler steps; there is no event to wait on)."""
    deadline = clock.monotonic() + timeout_s
    while not predicate():
        if clock.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.001)


async def finish(engine: SimEngine, req: SimRequest, timeout_s: float = 10.0) -> SimRequest:
    await asyncio.wait_for(engine.wait_for(req), timeout_s)
    assert req.finished
    return req


@pytest.mark.asyncio
async def test_ignore_eos_generates_exactly_max_tokens() -> None:
    engine = make_engine()
    async with running(engine):
        reqs = [engine.submit(prompt_tokens=100 + i, max_new_tokens=37, ignore_eos=True, rid=f"r{i}") for i in range(8)]
        for req in reqs:
            await finish(engine, req)
            assert len(req.output_ids) == 37
            assert req.finish == {"type": "length", "length": 37}
            assert EOS_TOKEN_ID not in req.output_ids
        assert engine.core.used_kv == 0 and load(engine).used_tokens == 0
        assert engine.is_idle()


@pytest.mark.asyncio
async def test_tokens_are_deterministic_per_seed_and_rid() -> None:
    async def ids(seed: int, rid: str) -> list[int]:
        engine = make_engine(seed=seed)
        async with running(engine):
            req = engine.submit(prompt_tokens=10, max_new_tokens=20, ignore_eos=True, rid=rid)
            return list((await finish(engine, req)).output_ids)

    a = await ids(7, "same")
    assert a == await ids(7, "same")
    assert a != await ids(8, "same")
    assert a != await ids(7, "other")
    # The sequence is TokenSource's, so another engine (the decode side of a PD pair) can continue it.
    src = TokenSource(7, "same")
    assert a == [src.next() for _ in range(20)]


@pytest.mark.asyncio
async def test_length_model_stops_with_eos_deterministically() -> None:
    engine = make_engine(mean_output_tokens=8.0, seed=3)
    async with running(engine):
        for i in range(20):
            rid = f"len{i}"
            req = await finish(engine, engine.submit(prompt_tokens=5, max_new_tokens=30, rid=rid))
            drawn = draw_output_length(3, rid, 8.0)
            if drawn < 30:
                assert len(req.output_ids) == drawn
                assert req.output_ids[-1] == EOS_TOKEN_ID
                assert req.finish == {"type": "stop", "matched": EOS_TOKEN_ID}
            else:
                assert len(req.output_ids) == 30
                assert req.finish == {"type": "length", "length": 30}
    lengths = [draw_output_length(0, f"x{i}", 256.0) for i in range(4000)]
    assert 230 < sum(lengths) / len(lengths) < 280  # geometric with the configured mean


@pytest.mark.asyncio
async def test_kv_limit_makes_a_request_wait() -> None:
    # 1000 KV tokens: A reserves 600 + min(100, 512) = 700, B needs 700 too, so B waits for A.
    engine = make_engine(kv_capacity_tokens=1000, time_scale=0.1)
    async with running(engine):
        a = engine.submit(prompt_tokens=600, max_new_tokens=100, ignore_eos=True, rid="a")
        b = engine.submit(prompt_tokens=600, max_new_tokens=100, ignore_eos=True, rid="b")
        await until(lambda: a.phase is Phase.RUNNING)
        assert b.phase is Phase.WAITING
        assert engine.load_snapshot()["num_waiting_reqs"] == 1
        await finish(engine, a)
        await finish(engine, b)
        assert b.admitted_s is not None and a.last_token_s is not None and b.admitted_s >= a.last_token_s
        assert len(b.output_ids) == 100


@pytest.mark.asyncio
async def test_kv_never_exceeds_capacity_and_retracts_instead() -> None:
    # Reservations (prompt + 8) fit many requests, but their outputs (200 each) do not: growth must retract.
    engine = make_engine(kv_capacity_tokens=2000, num_reserved_decode_tokens=8)
    peak = {"used": 0, "reserved": 0}
    apply = engine._apply

    def checked_apply(step: Any) -> None:
        apply(step)
        peak["used"] = max(peak["used"], load(engine).used_tokens)
        peak["reserved"] = max(peak["reserved"], engine.core.used_kv)
        assert load(engine).used_tokens <= engine.core.used_kv <= engine.capacity

    engine._apply = checked_apply  # type: ignore[method-assign]
    async with running(engine):
        reqs = [engine.submit(prompt_tokens=100, max_new_tokens=200, ignore_eos=True, rid=f"k{i}") for i in range(12)]
        for req in reqs:
            await finish(engine, req, 30.0)
            assert len(req.output_ids) == 200
        assert engine.num_retracted_total > 0
        assert any(r.num_retractions for r in reqs)
        assert engine.core.used_kv == 0 and load(engine).used_tokens == 0
    assert peak["reserved"] <= 2000 and peak["used"] > 1500


@pytest.mark.asyncio
async def test_real_time_pacing_follows_the_latency_model() -> None:
    engine = make_engine(time_scale=1.0)
    async with running(engine):
        lat = engine.latency
        expected = lat.prefill_time_s(1000) + sum(lat.decode_step_time_s(1, 1000 + k) for k in range(1, 10))
        t0 = clock.monotonic()
        req = await finish(engine, engine.submit(prompt_tokens=1000, max_new_tokens=10, ignore_eos=True))
        elapsed = clock.monotonic() - t0
        assert len(req.output_ids) == 10
        assert elapsed == pytest.approx(expected, rel=0.01)
        assert req.first_token_s is not None
        assert req.first_token_s - req.arrival_s >= lat.prefill_time_s(1000) * 0.95


def behind_model_s(engine: SimEngine) -> float:
    return metric_total(engine.metrics.render(engine.gauges()).decode(), "poise:engine_sim_behind_model_seconds_total")


@pytest.mark.asyncio
@REAL_TIME
async def test_a_step_the_host_starts_late_counts_as_time_behind_the_model() -> None:
    engine = make_engine(time_scale=1.0)
    async with running(engine):
        req = engine.submit(prompt_tokens=100, max_new_tokens=40, ignore_eos=True)
        await until(lambda: len(req.output_ids) >= 2)
        time.sleep(0.1)  # noqa: ASYNC251 -- the host does not run the loop: the next step starts 0.1 s late
        await finish(engine, req)
    assert behind_model_s(engine) >= 0.09


@pytest.mark.asyncio
async def test_time_paused_or_idle_is_not_time_behind_the_model() -> None:
    engine = make_engine(time_scale=1.0)
    async with running(engine):
        req = engine.submit(prompt_tokens=100, max_new_tokens=40, ignore_eos=True)
        await until(lambda: len(req.output_ids) >= 2)
        engine.pause("in_place")
        await asyncio.sleep(0.5)
        engine.resume()
        await finish(engine, req)
        await asyncio.sleep(0.5)
        await finish(engine, engine.submit(prompt_tokens=100, max_new_tokens=5, ignore_eos=True))
    assert behind_model_s(engine) == 0.0


@pytest.mark.asyncio
async def test_chunked_prefill_splits_long_prompts() -> None:
    engine = make_engine(time_scale=0.01, chunked_prefill_size=4096)
    async with running(engine):
        req = await finish(engine, engine.submit(prompt_tokens=10000, max_new_tokens=1, ignore_eos=True))
        assert len(req.output_ids) == 1
        lat = engine.latency
        chunks = lat.prefill_time_s(4096, 0) + lat.prefill_time_s(4096, 4096) + lat.prefill_time_s(1808, 8192)
        assert engine.total_prefill_tokens == 10000
        assert engine.total_prefill_busy_us == pytest.approx(chunks * 1e6, abs=5)


@pytest.mark.asyncio
async def test_max_running_requests_caps_the_batch() -> None:
    engine = make_engine(max_running_requests=3, time_scale=1.0)
    async with running(engine):
        reqs = [engine.submit(prompt_tokens=10, max_new_tokens=50, ignore_eos=True) for _ in range(7)]
        seen = 0
        while not all(r.finished for r in reqs):
            seen = max(seen, len(engine.queues.running) + len(engine.queues.prefilling) + len(engine.queues.ready))
            assert len(engine.queues.running) <= 3
            await asyncio.sleep(0.001)
        assert seen == 3


@pytest.mark.asyncio
async def test_abort_frees_kv_and_ends_the_stream() -> None:
    engine = make_engine(time_scale=0.05)
    async with running(engine):
        req = engine.submit(prompt_tokens=2000, max_new_tokens=5000, ignore_eos=True, rid="victim", stream=True)
        queued = engine.submit(prompt_tokens=10, max_new_tokens=5, rid="queued")
        got: list[int] = []

        async def read() -> dict[str, Any] | None:
            async for new, fin in engine.outputs(req):
                got.extend(new)
                if fin is not None:
                    return fin
            return None

        reader = asyncio.create_task(read())
        await until(lambda: len(req.output_ids) >= 3)
        assert load(engine).used_tokens > 2000
        assert engine.abort("victim") == 1
        fin = await asyncio.wait_for(reader, 2)
        assert fin == {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
        assert got == req.output_ids
        await finish(engine, queued)
        assert engine.core.used_kv == 0 and engine.is_idle()
        assert engine.abort("no-such-rid") == 0
        metrics = engine.metrics.render(engine.gauges()).decode()
        assert 'sglang:num_aborted_requests_total{engine_type="unified"' in metrics
        assert any(line.startswith("sglang:num_aborted_requests_total{") and line.endswith(" 1.0")
                   for line in metrics.splitlines())


@pytest.mark.asyncio
async def test_abort_all_and_pause_in_place() -> None:
    engine = make_engine(time_scale=0.01)
    async with running(engine):
        req = engine.submit(prompt_tokens=10, max_new_tokens=1000, ignore_eos=True)
        await until(lambda: len(req.output_ids) >= 2)
        # How long five tokens take here while it runs: the negative checks below wait twice that, so a
        # paused engine that kept going would show it.
        loop = asyncio.get_running_loop()
        t0, n0 = loop.time(), len(req.output_ids)
        await until(lambda: len(req.output_ids) >= n0 + 5)
        window = 2 * (loop.time() - t0)
        engine.pause("in_place")
        await asyncio.sleep(window / 2)  # a step already under way ends (it takes a fifth of that)
        frozen = len(req.output_ids)
        await asyncio.sleep(window)
        assert len(req.output_ids) == frozen and not req.finished
        engine.resume()
        await until(lambda: len(req.output_ids) > frozen)
        engine.pause("abort")  # SGLang's default mode: abort everything, then pause
        assert req.finish is not None and req.finish["type"] == "abort"
        late = engine.submit(prompt_tokens=10, max_new_tokens=3)
        await asyncio.sleep(window)  # running, it would have prefilled and produced its 3 tokens in that time
        assert not late.finished
        engine.resume()
        await finish(engine, late)


@pytest.mark.asyncio
async def test_health_answers_when_the_scheduler_produces_and_not_while_it_is_frozen() -> None:
    # SGLang's /health is a one-token generation: it answers once the scheduler produces something, so a
    # scheduler stuck in a step fails it while the HTTP server still answers. Its load snapshot stops
    # advancing too, which is what the worker sidecar watches.
    engine = make_engine(time_scale=0.01)
    async with running(engine):
        assert await engine.health_check(1.0)  # idle: the check's own request would run at once
        req = engine.submit(prompt_tokens=10, max_new_tokens=100_000, ignore_eos=True)
        await until(lambda: len(req.output_ids) >= 2)
        assert await engine.health_check(1.0)  # busy: answered after the current step
        engine.freeze()  # the step in flight hangs: no token comes out
        stuck = len(req.output_ids)
        assert not await engine.health_check(0.2)
        assert len(req.output_ids) == stuck
        before = parse_loads({"loads": [load_snapshot(engine)]}).busy_snapshot_unix_s
        assert before is not None and clock.unix() - before >= 0.19  # the snapshot stopped with the scheduler
        engine.thaw()
        assert await engine.health_check(1.0)
        await until(lambda: len(req.output_ids) > stuck)
        after = parse_loads({"loads": [load_snapshot(engine)]}).busy_snapshot_unix_s
        assert after is not None and after > before
        engine.abort(req.rid)
        await until(engine.is_idle)
        assert parse_loads({"loads": [load_snapshot(engine)]}).busy_snapshot_unix_s is None  # idle: nothing to judge


@pytest.mark.asyncio
async def test_request_validation_like_sglang() -> None:
    engine = make_engine(context_length=1000, kv_capacity_tokens=500)
    async with running(engine):
        with pytest.raises(ValueError, match="longer than the model's context length"):
            engine.submit(prompt_tokens=1000, max_new_tokens=1)
        with pytest.raises(ValueError, match="maximum context length"):
            engine.submit(prompt_tokens=900, max_new_tokens=200)
        engine.submit(prompt_tokens=10, max_new_tokens=1000 - 10, rid="dup")
        with pytest.raises(ValueError, match="Duplicate request ID"):
            engine.submit(prompt_tokens=10, max_new_tokens=1, rid="dup")
        too_big = engine.submit(prompt_tokens=600, max_new_tokens=10)
        await finish(engine, too_big)
        assert too_big.status_code == 400 and "exceeds the maximum number of tokens" in too_big.finish["message"]
        capped = engine.submit(prompt_tokens=400, max_new_tokens=500, ignore_eos=True)
        await finish(engine, capped, 20)
        assert len(capped.output_ids) == 100  # max_new_tokens capped to what the KV pool can hold


@pytest.mark.asyncio
async def test_pd_modes_reject_requests_without_bootstrap_room() -> None:
    engine = make_engine(mode="decode")
    async with running(engine):
        req = await finish(engine, engine.submit(prompt_tokens=10, max_new_tokens=5, rid="noroom"))
        assert req.status_code == 400
        assert req.finish["message"] == ("Invalid request: Disaggregated request received without bootstrap room id. "
                                         "req.rid='noroom'")


@pytest.mark.asyncio
@REAL_TIME
async def test_in_process_pd_pair_hands_off_by_bootstrap_room() -> None:
    prefill = make_engine(mode="prefill", bootstrap_port=0, seed=5)
    decode = make_engine(mode="decode", seed=5)
    colocated = make_engine(seed=5)
    async with running(prefill, decode, colocated):
        port = prefill.bootstrap_port
        assert port
        room = dict(bootstrap_host="127.0.0.1", bootstrap_port=port, bootstrap_room=42)
        d = decode.submit(prompt_tokens=300, max_new_tokens=12, ignore_eos=True, rid="pd", **room)
        await until(lambda: d.phase is Phase.TRANSFER)  # the decode peer claimed the room and waits for the prefill
        p = prefill.submit(prompt_tokens=300, max_new_tokens=12, ignore_eos=True, rid="pd", **room)
        await finish(decode, d)
        await finish(prefill, p)
        assert p.finish == {"type": "length", "length": 0} and len(p.output_ids) == 1
        assert len(d.output_ids) == 12 and d.output_ids[0] == p.output_ids[0]
        ref = await finish(colocated, colocated.submit(prompt_tokens=300, max_new_tokens=12, ignore_eos=True, rid="pd"))
        assert d.output_ids == ref.output_ids  # PD gives the colocated engine's tokens for the same rid
        assert prefill.core.used_kv == 0 and decode.core.used_kv == 0
        assert prefill.is_idle() and decode.is_idle() and len(prefill.rooms) == 0


@pytest.mark.asyncio
@REAL_TIME
async def test_prefill_waits_for_its_decode_peer_then_times_out() -> None:
    prefill = make_engine(mode="prefill", bootstrap_port=0, bootstrap_timeout_s=0.2)
    async with running(prefill):
        p = prefill.submit(prompt_tokens=50, max_new_tokens=4, rid="lonely", bootstrap_host="127.0.0.1",
                           bootstrap_port=prefill.bootstrap_port, bootstrap_room=7)
        await until(lambda: p.phase is Phase.BOOTSTRAP)
        loads = prefill.load_snapshot()
        assert loads["disaggregation"]["prefill_bootstrap_queue_reqs"] == 1
        # As SGLang reports it: a waiting request, but no tokens waiting for this engine's compute.
        assert loads["num_waiting_reqs"] == 1 and loads["num_waiting_uncached_tokens"] == 0
        # The sidecar's report keeps the two apart, so the planners see no prefill work here.
        report = load_report("p0", "prefill", "ready", parse_loads({"loads": [loads]}), 0.0)
        assert (report.prefill_bootstrap_reqs, report.compute_waiting_reqs) == (1, 0)
        await finish(prefill, p)
        assert p.status_code == 500 and p.finish["message"].startswith("Prefill bootstrap failed")
        assert prefill.is_idle()


@pytest.mark.asyncio
@REAL_TIME
async def test_decode_fails_when_the_prefill_peer_is_unreachable() -> None:
    decode = make_engine(mode="decode", bootstrap_timeout_s=0.5)
    async with running(decode):
        d = decode.submit(prompt_tokens=50, max_new_tokens=4, bootstrap_host="127.0.0.1", bootstrap_port=1,
                          bootstrap_room=9)
        await finish(decode, d)
        assert d.status_code == 500 and d.finish["message"].startswith("Decode handshake failed")
        assert decode.core.used_kv == 0


@pytest.mark.asyncio
async def test_role_switch_preconditions_and_success() -> None:
    engine = make_engine(mode="decode", bootstrap_port=0, time_scale=0.01)
    async with running(engine):
        busy = engine.submit(prompt_tokens=10, max_new_tokens=5, bootstrap_host="127.0.0.1", bootstrap_port=1,
                             bootstrap_room=1)
        r = await engine.pd_role_switch("prefill")
        assert r.to_dict() == {"success": False, "message": "instance is not idle; drain all requests before switching",
                               "old_role": "decode", "new_role": "prefill", "safe_to_restore": True}
        engine.abort(busy.rid)
        r = await engine.pd_role_switch("bogus")
        assert not r.success and r.message == "invalid new_role='bogus'" and r.safe_to_restore
        r = await engine.pd_role_switch("prefill", prepare_only=True)
        assert r.success and r.message == "ready" and engine.mode == "decode"
        r = await engine.pd_role_switch("decode")
        assert r.success and r.message == "ok" and r.safe_to_restore is False
        t0 = clock.monotonic()
        r = await engine.pd_role_switch("prefill")
        assert r.to_dict() == {"success": True, "message": "ok", "old_role": "decode", "new_role": "prefill",
                               "safe_to_restore": False}
        assert clock.monotonic() - t0 >= engine.latency.role_switch_time_s()
        assert engine.mode == "prefill" and engine.bootstrap_port
        r = await engine.pd_role_switch("decode")
        assert r.success and engine.mode == "decode" and engine.bootstrap_port is None

    launched_prefill = make_engine(mode="prefill", bootstrap_port=0, time_scale=0.01)
    async with running(launched_prefill):
        # as SGLang 0.5.23 answered on this CPU (tests/contract/fixtures/sglang-0.5.23-cpu/): no decode CUDA
        # graphs yet, so the switch must say how much memory they may take; once captured, it need not
        r = await launched_prefill.pd_role_switch("decode")
        assert r.to_dict() == {"success": False, "old_role": "prefill", "new_role": "decode", "safe_to_restore": True,
                               "message": "decode_cuda_graph_memory_gb is required before capturing decode graphs"}
        assert (await launched_prefill.pd_role_switch("decode", decode_cuda_graph_memory_gb=0.0)).success
        assert (await launched_prefill.pd_role_switch("prefill")).success
        assert (await launched_prefill.pd_role_switch("decode")).success

    colocated = make_engine()
    async with running(colocated):
        r = await colocated.pd_role_switch("decode")
        assert not r.success and r.message == "instance is not running in PD disaggregation mode"
    disabled = make_engine(mode="prefill", bootstrap_port=0, enable_pd_role_switch=False)
    async with running(disabled):
        r = await disabled.pd_role_switch("decode")
        assert r.to_dict() == {"success": False, "message": "--enable-pd-role-switch is not set on this server",
                               "old_role": "prefill", "new_role": "decode", "safe_to_restore": True}


@pytest.mark.asyncio
async def test_load_snapshot_and_metrics_use_sglang_names() -> None:
    engine = make_engine(mode="decode", enable_pd_role_switch=False)
    async with running(engine):
        snap = engine.load_snapshot()
        for key in ("num_running_reqs", "num_waiting_reqs", "num_waiting_uncached_tokens", "num_used_tokens",
                    "num_total_tokens", "max_total_num_tokens", "max_running_requests", "token_usage",
                    "gen_throughput", "cache_hit_rate", "utilization", "total_prefill_uncached_tokens",
                    "total_prefill_busy_us", "decode_moments"):
            assert key in snap
        assert set(snap["disaggregation"]) == {
            "mode", "prefill_bootstrap_queue_reqs", "prefill_inflight_queue_reqs", "decode_prealloc_queue_reqs",
            "decode_transfer_queue_reqs", "decode_retracted_queue_reqs", "kv_transfer_speed_gb_s",
            "kv_transfer_latency_ms"}
        assert snap["max_total_num_tokens"] == engine.profile.kv_capacity_tokens
        text = engine.metrics.render(engine.gauges()).decode()
        assert 'sglang:num_running_reqs{engine_type="decode",model_name="meta-llama/Llama-3.1-8B-Instruct"' in text
        for name in ("sglang:num_queue_reqs", "sglang:token_usage", "sglang:gen_throughput",
                     "sglang:prompt_tokens_total", "sglang:generation_tokens_total",
                     "sglang:time_to_first_token_seconds", "sglang:inter_token_latency_seconds",
                     "sglang:e2e_request_latency_seconds", "sglang:num_aborted_requests_total",
                     "sglang:kv_transfer_latency_ms", "sglang:num_decode_prealloc_queue_reqs",
                     "sglang:num_decode_transfer_queue_reqs", "sglang:num_prefill_bootstrap_queue_reqs",
                     "sglang:num_prefill_inflight_queue_reqs"):
            assert f"# TYPE {name}" in text or f"# HELP {name}" in text, name


@pytest.mark.asyncio
@REAL_TIME
async def test_decode_abort_during_transfer_fails_the_prefill_side() -> None:
    prefill = make_engine(mode="prefill", bootstrap_port=0, time_scale=1.0)
    decode = make_engine(mode="decode")
    async with running(prefill, decode):
        room = dict(bootstrap_host="127.0.0.1", bootstrap_port=prefill.bootstrap_port, bootstrap_room=77)
        p = prefill.submit(prompt_tokens=8000, max_new_tokens=4, rid="long", **room)  # ~0.3 s of prefill
        d = decode.submit(prompt_tokens=8000, max_new_tokens=4, rid="long", **room)
        await until(lambda: p.phase is Phase.PREFILLING)
        assert d.phase is Phase.TRANSFER
        decode.abort("long")
        await finish(prefill, p, 5)
        assert p.status_code == 500 and p.finish["message"].startswith("Prefill transfer failed")
        assert prefill.core.used_kv == 0 and prefill.is_idle()


def kv_pressed_pair() -> tuple[SimEngine, SimEngine]:
    """A prefill engine and a decode engine whose KV holds about ten requests' prompts and little more."""
    return (make_engine(mode="prefill", bootstrap_port=0),
            make_engine(mode="decode", kv_capacity_tokens=2000, num_reserved_decode_tokens=8))


def submit_pairs(prefill: SimEngine, decode: SimEngine, prefix: str, first_room: int) -> list[tuple[SimRequest, SimRequest]]:
    """Ten requests of 100 + 200 tokens, each sent to both engines with its bootstrap room."""
    pairs = []
    for i in range(10):
        room = dict(bootstrap_host="127.0.0.1", bootstrap_port=prefill.bootstrap_port, bootstrap_room=first_room + i)
        kw = dict(prompt_tokens=100, max_new_tokens=200, ignore_eos=True, rid=f"{prefix}{i}", **room)
        pairs.append((prefill.submit(**kw), decode.submit(**kw)))
    return pairs


@pytest.mark.asyncio
@REAL_TIME
async def test_decode_engine_retracts_and_resumes_under_kv_pressure() -> None:
    prefill, decode = kv_pressed_pair()
    async with running(prefill, decode):
        pairs = submit_pairs(prefill, decode, "dr", 500)
        for p, d in pairs:
            await finish(decode, d, 30)
            await finish(prefill, p, 30)
            assert len(d.output_ids) == 200 and d.finish == {"type": "length", "length": 200}
        assert decode.num_retracted_total > 0
        assert decode.core.used_kv == 0 and decode.is_idle() and prefill.is_idle()


@pytest.mark.asyncio
@REAL_TIME
async def test_decode_repolls_while_the_prefill_is_still_running() -> None:
    prefill = make_engine(mode="prefill", bootstrap_port=0, time_scale=1.0)
    decode = make_engine(mode="decode", bootstrap_timeout_s=0.1)  # each long-poll gives up after 0.1 s (202)
    async with running(prefill, decode):
        room = dict(bootstrap_host="127.0.0.1", bootstrap_port=prefill.bootstrap_port, bootstrap_room=88)
        p = prefill.submit(prompt_tokens=8000, max_new_tokens=3, ignore_eos=True, rid="slow", **room)  # ~0.3 s
        d = decode.submit(prompt_tokens=8000, max_new_tokens=3, ignore_eos=True, rid="slow", **room)
        await finish(decode, d, 5)
        await finish(prefill, p, 5)
        assert len(d.output_ids) == 3 and p.finish == {"type": "length", "length": 0}
        assert d.first_token_s is not None and d.first_token_s - d.arrival_s >= prefill.latency.prefill_time_s(8000)


@pytest.mark.asyncio
@pytest.mark.parametrize("order", ["fcfs", "edf"])
async def test_the_prefill_policy_decides_who_is_prefilled_first(order: str) -> None:
    # The same shared policy objects as the simulator: with EDF the request with a TTFT target overtakes the
    # three submitted before it (which have none); with FCFS it waits its turn.
    engine = make_engine(time_scale=0.05, prefill_policy=order, chunked_prefill_size=8192)
    async with running(engine):
        reqs = [engine.submit(prompt_tokens=8000, max_new_tokens=2, ignore_eos=True, rid=f"r{i}") for i in range(4)]
        reqs[3].slo_ttft_s = 0.5
        for req in reqs:
            await finish(engine, req)
    firsts = [r.first_token_s for r in reqs]
    assert all(t is not None for t in firsts)
    if order == "edf":
        assert firsts[3] < min(firsts[:3])  # type: ignore[operator,type-var]
    else:
        assert firsts[3] > max(firsts[:3])  # type: ignore[operator,type-var]


def test_unknown_engine_policies_are_rejected() -> None:
    with pytest.raises(ValueError, match=r"unknown prefill_policy 'no-such-policy'; known: .*edf, fcfs"):
        EngineSimSettings(prefill_policy="no-such-policy")
    with pytest.raises(ValueError, match=r"unknown decode_policy 'no-such-policy'; known: .*continuous"):
        EngineSimSettings(decode_policy="no-such-policy")


@pytest.mark.asyncio
@REAL_TIME
async def test_a_prompt_prefilled_alone_is_reported_for_the_ttft_refit() -> None:

    prefill = make_engine(mode="prefill", bootstrap_port=0, time_scale=0.01)
    decode = make_engine(mode="decode")
    async with running(prefill, decode):
        room = dict(bootstrap_host="127.0.0.1", bootstrap_port=prefill.bootstrap_port, bootstrap_room=3)
        d = decode.submit(prompt_tokens=2000, max_new_tokens=2, ignore_eos=True, rid="alone", **room)
        await until(lambda: d.phase is Phase.TRANSFER)  # the decode side is there first
        p = prefill.submit(prompt_tokens=2000, max_new_tokens=2, ignore_eos=True, rid="alone", **room)
        await finish(decode, d)
        await finish(prefill, p)
        loads = parse_loads({"loads": [load_snapshot(prefill)]})
    ((seq, tokens, seconds),) = loads.prefill_samples
    assert tokens == 2000 and seconds == pytest.approx(prefill.latency.prefill_time_s(2000))
    assert loads.running_tokens == 0  # nothing running on a prefill engine once it is done
    # The sidecar forwards each sample once: the next report (same engine reading) carries none.
    assert load_report("p0", "prefill", "ready", loads, 0.0).prefill_samples == [(2000, seconds)]
    assert load_report("p0", "prefill", "ready", loads, 0.0, after_seq=seq).prefill_samples == []


@pytest.mark.asyncio
async def test_loads_report_the_running_batchs_context_tokens() -> None:

    engine = make_engine(time_scale=1.0)
    async with running(engine):
        req = engine.submit(prompt_tokens=500, max_new_tokens=400, ignore_eos=True, rid="ctx")
        await until(lambda: len(req.output_ids) >= 5)
        loads = parse_loads({"loads": [load_snapshot(engine)]})
        assert loads.running_tokens == 500 + len(req.output_ids)
        assert loads.num_used_tokens >= loads.running_tokens  # KV in use also holds what is reserved


@pytest.mark.asyncio
@REAL_TIME
async def test_a_decode_engine_prefills_locally_alongside_its_decode_batch() -> None:
    # DOPD's ultra-short prompts: poise_local_prefill has a decode engine prefill the prompt itself, in mixed
    # steps with the requests it is decoding, and answer with the colocated engine's tokens.
    prefill = make_engine(mode="prefill", bootstrap_port=0, seed=5)
    decode = make_engine(mode="decode", seed=5)
    colocated = make_engine(seed=5)
    async with running(prefill, decode, colocated):
        room = dict(bootstrap_host="127.0.0.1", bootstrap_port=prefill.bootstrap_port, bootstrap_room=7)
        remote = decode.submit(prompt_tokens=300, max_new_tokens=3000, ignore_eos=True, rid="remote", **room)
        prefill.submit(prompt_tokens=300, max_new_tokens=3000, ignore_eos=True, rid="remote", **room)
        await until(lambda: len(remote.output_ids) >= 2)  # decoding when the local prompt arrives
        local = decode.submit(prompt_tokens=64, max_new_tokens=12, ignore_eos=True, rid="local", local_prefill=True)
        await finish(decode, local)
        assert not remote.finished  # the local prompt did not wait for the decode batch to empty
        ref = await finish(colocated, colocated.submit(prompt_tokens=64, max_new_tokens=12, ignore_eos=True, rid="local"))
        assert local.output_ids == ref.output_ids and local.status_code in (None, 200)
        await finish(decode, remote)
        assert decode.total_prefill_tokens == 64  # only the local prompt was prefilled on the decode engine
        assert decode.core.used_kv == 0 and decode.is_idle()
        with pytest.raises(Exception, match="poise_local_prefill needs a decode"):
            prefill.submit(prompt_tokens=10, max_new_tokens=2, rid="wrong", local_prefill=True)


@pytest.mark.asyncio
@REAL_TIME
async def test_what_engine_sim_reports_is_what_the_simulators_engines_report() -> None:
    """engine_sim's /v1/loads, as the sidecar parses it, carries exactly the numbers the simulator's engines hand
    the dispatcher (shared.load_view.engine_loads over shared.engine.load): one formula for every field."""
    prefill, decode = kv_pressed_pair()
    seen: dict[str, int] = {}
    async with running(prefill, decode):
        pairs = submit_pairs(prefill, decode, "lr", 900)
        deadline = time.monotonic() + 60
        while not all(d.phase is Phase.FINISHED for _, d in pairs):
            assert time.monotonic() < deadline, "the pairs did not finish"
            for engine in (prefill, decode):
                parsed = parse_loads({"loads": [load_snapshot(engine)]})
                direct = engine_loads(load(engine), mode=engine.mode, kv_capacity_tokens=engine.capacity,
                                      max_running_requests=engine.max_running,
                                      gen_throughput_tps=parsed.gen_throughput_tps,
                                      snapshot_unix_s=parsed.snapshot_unix_s)
                assert msgspec.structs.replace(parsed, prefill_samples=(), busy_snapshot_unix_s=None) == direct
                for field in ("num_waiting_reqs", "num_used_tokens", "decode_transfer_queue_reqs",
                              "decode_retracted_queue_reqs", "prefill_inflight_queue_reqs"):
                    seen[field] = max(seen.get(field, 0), getattr(parsed, field))
            await asyncio.sleep(0.002)
    assert all(seen.get(f, 0) > 0 for f in ("num_waiting_reqs", "num_used_tokens", "decode_retracted_queue_reqs")), seen
