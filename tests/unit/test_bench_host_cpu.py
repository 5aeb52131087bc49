"""The fidelity check's reading of this host's CPU steal time (tests/bench/sim_fidelity.py), on /proc/stat
lines written here and on the running host's."""

from __future__ import annotations

import sys

import pytest

from tests.bench.sim_fidelity import cpu_ticks, steal_share


def test_steal_is_its_share_of_all_cpu_time_between_two_readings() -> None:
    #          user nice system idle iowait irq softirq steal
    before = [1000, 0, 100, 5000, 10, 0, 20, 70]
    after = [1300, 0, 150, 5450, 10, 0, 120, 170]  # 1,000 ticks later, 100 of them stolen
    assert steal_share(before, after) == pytest.approx(0.1)
    assert steal_share(before, before) is None  # no time passed
    assert steal_share(None, after) is None and steal_share(before, None) is None
    assert steal_share(before[:5], after[:5]) is None  # a kernel that does not count steal


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/stat is Linux's")
def test_this_host_reports_its_cpu_time_by_kind() -> None:
    first = cpu_ticks()
    assert first is not None and len(first) == 8
    total = sum(first)
    while (later := cpu_ticks()) is not None and sum(later) == total:
        sum(range(10_000))  # spend a clock tick
    assert later is not None and all(b >= a for a, b in zip(first, later, strict=True))
    share = steal_share(first, later)
    assert share is not None and 0.0 <= share <= 1.0
