"""Raising a workload's load at natural time (the sustained yardstick) and by compressing time (Arrow's)."""

from __future__ import annotations

import pytest

from loadgen.rate_scaling import scale_load
from loadgen.traces import load_trace
from loadgen.workload import TraceRequest, Workload


@pytest.fixture(scope="module")
def conv() -> Workload:
    return load_trace("azure-conv").slice(0.0, 600.0)


def test_natural_time_keeps_the_clock_and_multiplies_the_rate(conv: Workload) -> None:
    scaled = scale_load(conv, 4.0)
    assert len(scaled) == pytest.approx(4 * len(conv), rel=0.02)
    assert scaled.duration_s == pytest.approx(conv.duration_s, rel=0.02)
    # The rate curve keeps its shape minute by minute: each minute carries about 4x the trace's requests.
    for minute in range(1, 9):
        mine = sum(1 for r in conv if minute * 60 <= r.arrival_s < (minute + 1) * 60)
        theirs = sum(1 for r in scaled if minute * 60 <= r.arrival_s < (minute + 1) * 60)
        assert theirs == pytest.approx(4 * mine, rel=0.15)
    assert len({r.index for r in scaled}) == len(scaled)  # every request stays unique
    # Every original request is there unchanged; the added ones carry length pairs from the trace.
    assert set(conv.requests) <= set(scaled.requests)
    pairs = {(r.input_tokens, r.output_tokens) for r in conv}
    assert all((r.input_tokens, r.output_tokens) in pairs for r in scaled)


def test_natural_time_is_deterministic_identity_at_1x_and_thins_below(conv: Workload) -> None:
    assert scale_load(conv, 2.5).requests == scale_load(conv, 2.5).requests
    assert scale_load(conv, 2.5, seed=1).requests != scale_load(conv, 2.5).requests
    assert scale_load(conv, 1.0) is conv
    half = scale_load(conv, 0.5)
    assert len(half) == pytest.approx(len(conv) / 2, rel=0.1) and set(half.requests) <= set(conv.requests)


def test_added_requests_take_lengths_from_their_own_minute() -> None:
    # Short prompts for ten minutes, then long ones: copies made in the second half are long.
    reqs = [TraceRequest(index=i, arrival_s=float(i), input_tokens=100 if i < 600 else 8000, output_tokens=10)
            for i in range(1200)]
    scaled = scale_load(Workload(name="shift", requests=reqs), 3.0)
    late = [r.input_tokens for r in scaled if r.arrival_s > 700]
    early = [r.input_tokens for r in scaled if r.arrival_s < 500]
    assert set(late) == {8000} and set(early) == {100}


def test_compress_divides_timestamps_and_bad_factors_are_refused(conv: Workload) -> None:
    fast = scale_load(conv, 4.0, "compress")
    assert len(fast) == len(conv) and fast.duration_s == pytest.approx(conv.duration_s / 4)
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="finite number > 0"):
            scale_load(conv, bad)
    with pytest.raises(ValueError, match="unknown rate mode"):
        scale_load(conv, 2.0, "stretch")  # type: ignore[arg-type]


def test_added_requests_share_prefixes_with_their_own_copies_only() -> None:
    moon = load_trace("mooncake-conv").slice(0.0, 300.0)
    ids = {h for r in moon for h in r.hash_ids}
    scaled = scale_load(moon, 3.0)
    originals = {r.index for r in moon}
    added = [r for r in scaled if r.index not in originals]
    assert added and all(r.hash_ids for r in added)
    # A copy's prefix blocks are its source's, moved out of the trace's id range: no copy repeats a trace
    # prompt for a prefix cache to serve, and the first and second copies do not share with each other.
    stride = max(ids) + 1
    assert not any(set(r.hash_ids) & ids for r in added)
    namespaces = {h // stride for r in added for h in r.hash_ids}
    assert namespaces == {1, 2}
    assert all(len({h // stride for h in r.hash_ids}) == 1 for r in added)
    assert all(h % stride in ids for r in added for h in r.hash_ids)
