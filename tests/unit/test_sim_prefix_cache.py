"""The simulator's radix prefix cache and the cache-aware dispatchers: cached prefixes skip prefill, the KV
pool is shared with the tree and every token comes back, the dispatchers route by the prefixes they sent."""

from __future__ import annotations

import msgspec
import pytest

from loadgen.sim.baselines import make_mix
from loadgen.sim.cluster import SimCluster
from loadgen.sim.events import PRIORITY_ARRIVAL, EventQueue
from loadgen.sim.instance import EngineSpec, SimRequest
from loadgen.sim.overhead import NO_DELAY
from loadgen.sim.run import simulate
from loadgen.slo import SLO
from loadgen.traces import load_trace
from shared.latency import LatencyModel, load_profile
from shared.policies import ArrowDispatch, EngineView, LeastLoad, Placement, PolicyContext, RequestView
from shared.policies.cache_aware import CacheAware, CacheAwareParams

MODEL = LatencyModel(load_profile())
SLO_ = SLO(ttft_s=30.0, tpot_s=0.1)
CACHED = EngineSpec(prefix_cache=True)


def request(k: int, t: float, blocks: tuple[int, ...], n: int, out: int = 4) -> SimRequest:
    return SimRequest(index=k, rid=f"r{k}", arrival_s=t, input_tokens=n, output_tokens=out, blocks=blocks)


def run(roles: list[str], reqs: list[SimRequest], engine: EngineSpec = CACHED, kv: int | None = None) -> SimCluster:
    queue = EventQueue()
    sim = SimCluster(roles, MODEL, LeastLoad(), queue, engine=engine)  # type: ignore[arg-type]
    if kv is not None:
        for inst in sim.instances.values():
            inst.kv_capacity = kv
    for req in reqs:
        queue.at(req.arrival_s, PRIORITY_ARRIVAL, lambda req=req: sim.submit(req))  # type: ignore[misc]
    queue.run()
    return sim


def test_a_repeated_prefix_is_not_prefilled_again_and_every_kv_token_comes_back() -> None:
    blocks = tuple(range(8))  # 4096 tokens
    first, second = request(0, 0.0, blocks, 4096), request(1, 5.0, (*blocks[:6], 99, 100), 4096)
    sim = run(["prefill", "decode"], [first, second])
    assert first.cached == 0 and second.cached == 6 * 512
    # The second prompt computed only its last 1024 tokens, after the cached 3072.
    ttft = second.first_token_s - second.arrival_s  # type: ignore[operator]
    cold = MODEL.prefill_time_s(4096) + MODEL.kv_transfer_time_s(4096)
    warm = MODEL.prefill_time_s(1024, 3072) + MODEL.kv_transfer_time_s(4096)
    assert ttft == pytest.approx(warm) and warm < cold
    p0 = sim.instances["p0"]
    assert p0.cache is not None and p0.cache.tokens == 10 * 512 and p0.cache.locked_tokens == 0
    assert all(i.used_kv == 0 for i in sim.instances.values())


def test_the_tree_gives_way_to_admissions_least_recently_used_first() -> None:
    # Room for two 2048-token prompts: the third evicts the oldest unlocked one, not the one used since.
    a, b = (1, 2, 3, 4), (5, 6, 7, 8)
    reqs = [request(0, 0.0, a, 2048), request(1, 1.0, b, 2048), request(2, 2.0, a, 2048),
            request(3, 3.0, (9, 10, 11, 12), 2048), request(4, 4.0, a, 2048), request(5, 5.0, b, 2048)]
    sim = run(["prefill", "decode"], reqs, kv=4096 + 64)
    assert [r.cached for r in reqs] == [0, 0, 2047, 0, 2047, 0]
    p0 = sim.instances["p0"]
    assert p0.cache is not None and p0.used_kv == 0 and p0.cache.tokens <= 4096 + 64
    assert len(sim.finished) == 6


def test_colocated_engines_cache_too_and_a_role_change_starts_an_empty_tree() -> None:
    blocks = (1, 2, 3, 4)
    reqs = [request(0, 0.0, blocks, 2048), request(1, 5.0, blocks, 2048)]
    sim = run(["null"], reqs)
    assert reqs[1].cached == 2047
    c0 = sim.instances["c0"]
    assert c0.used_kv == 0 and c0.cache is not None and c0.cache.locked_tokens == 0
    c0.reset_cache()
    assert c0.cache is not None and c0.cache.tokens == 0


def test_without_the_cache_nothing_is_cached() -> None:
    blocks = (1, 2, 3, 4)
    reqs = [request(0, 0.0, blocks, 2048), request(1, 5.0, blocks, 2048)]
    run(["prefill", "decode"], reqs, engine=EngineSpec())
    assert [r.cached for r in reqs] == [0, 0]


def test_a_whole_mooncake_slice_ends_with_every_kv_token_returned() -> None:
    w = load_trace("mooncake-conv").slice(0.0, 600.0)
    for mix in ("static-minload", "static-cache-aware", "static-arrow", "colocated"):
        result = simulate(w, make_mix(mix, 4, None if mix == "colocated" else "2P2D", prefix_cache=True), MODEL,
                          SLO_, first_token_delay=NO_DELAY)
        assert all(r.ok for r in result.records), mix
        cache = result.config["prefix_cache"]
        assert 0.0 < cache["hit_rate"] < 0.374, mix  # some reuse, never above the trace's own bound


def engines(n: int, inflight: tuple[int, ...] | None = None) -> list[EngineView]:
    loads = inflight or (0,) * n
    return [EngineView(instance_id=f"p{i}", role="prefill", status="ready", kv_capacity_tokens=380_000,  # type: ignore[arg-type]
                       max_running_requests=256, inflight_reqs=loads[i]) for i in range(n)] + [
        EngineView(instance_id="d0", role="decode", status="ready", kv_capacity_tokens=380_000,  # type: ignore[arg-type]
                   max_running_requests=256)]


def prompt(blocks: tuple[int, ...], n: int | None = None) -> RequestView:
    return RequestView(rid="x", input_tokens=n or 512 * len(blocks), max_output_tokens=8, prefix_blocks=blocks)


def test_smgs_cache_aware_follows_the_prefix_while_balanced_and_the_load_when_not() -> None:
    policy = CacheAware(cache=CacheAwareParams(balance_abs_threshold=4, balance_rel_threshold=1.5))
    first = policy.place(prompt((1, 2, 3, 4)), engines(3), 0.0)
    assert isinstance(first, Placement) and first.prefill_id == "p0"
    # No match: the engine whose tree is smallest (p0 now holds four blocks).
    other = policy.place(prompt((7, 8)), engines(3), 1.0)
    assert isinstance(other, Placement) and other.prefill_id == "p1"
    # Three of four blocks match on p0 (75% > 30%): there, although p0 has more in flight.
    again = policy.place(prompt((1, 2, 3, 9)), engines(3, (3, 0, 0)), 2.0)
    assert isinstance(again, Placement) and again.prefill_id == "p0"
    # A quarter matches (<= 30%): the smallest tree.
    low = policy.place(prompt((1, 5, 6, 9)), engines(3, (3, 0, 0)), 3.0)
    assert isinstance(low, Placement) and low.prefill_id == "p2"
    # Imbalanced (10 - 0 > 4 and 10 > 1.5 x 0): the least loaded, whatever it caches.
    busy = policy.place(prompt((1, 2, 3, 4)), engines(3, (10, 0, 1)), 4.0)
    assert isinstance(busy, Placement) and busy.prefill_id == "p1"


def test_poises_dispatch_takes_a_cached_prefix_when_it_saves_more_than_the_queue_costs() -> None:
    policy = ArrowDispatch(MODEL, PolicyContext(ttft_slo_s=30.0, tpot_slo_s=0.1, max_instances=3))
    long = tuple(range(32))  # 16K tokens
    first = policy.place(prompt(long), engines(2), 0.0)
    assert isinstance(first, Placement) and first.prefill_id == "p0"

    def queued(tokens: int) -> list[EngineView]:
        p0, *rest = engines(2)
        return [msgspec.structs.replace(p0, inflight_reqs=1, inflight_tokens=tokens, inflight_tokens_sq=tokens**2),
                *rest]

    # A short queue on p0: the 16K cached prefix saves more than the queue costs.
    warm = policy.place(prompt((*long, 99)), queued(2048), 1.0)
    assert isinstance(warm, Placement) and warm.prefill_id == "p0"
    # A long queue on p0: p1 computes the whole prompt sooner than p0 gets to it.
    cold = policy.place(prompt((*long, 98)), queued(64_000), 2.0)
    assert isinstance(cold, Placement) and cold.prefill_id == "p1"
    # Without prefix blocks the rule is Arrow's Algorithm 1 alone: the shorter queue.
    plain = policy.place(RequestView(rid="y", input_tokens=16_384, max_output_tokens=8), queued(2048), 3.0)
    assert isinstance(plain, Placement) and plain.prefill_id == "p1"
