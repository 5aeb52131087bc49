"""The engine's load numbers (shared/engine/load.py): the KV a running batch has written, summed the fast way,
is what its requests hold written, through admissions, growth, retractions and finishes."""

from __future__ import annotations

import pytest

from loadgen.sim.cluster import SimCluster
from loadgen.sim.events import EventQueue
from loadgen.sim.instance import EngineSpec, SimRequest
from shared.engine.load import engine_load, running_written
from shared.latency import LatencyModel, load_profile
from shared.policies import LeastLoad


@pytest.mark.parametrize("roles", [["prefill", "decode"], ["null"]])
@pytest.mark.parametrize("decode_kv", ["grow", "whole"])
def test_the_running_batchs_written_kv_is_its_requests_contexts(roles: list[str], decode_kv: str) -> None:
    q = EventQueue()
    engine = EngineSpec(decode_kv=decode_kv, reserved_decode_tokens=16)  # type: ignore[arg-type]
    c = SimCluster(roles, LatencyModel(load_profile()), LeastLoad(), q, engine=engine)
    for inst in c.instances.values():
        inst.kv_capacity = 6000  # small enough that growth retracts requests under grow
    reqs = [SimRequest(index=i, rid=f"r{i}", arrival_s=i * 0.01, input_tokens=300 + 37 * (i % 7),
                       output_tokens=40 + 29 * (i % 11)) for i in range(60)]
    for r in reqs:
        q.at(r.arrival_s, 2, lambda r=r: c.submit(r))
    checked = [0]

    def check() -> None:
        for inst in c.live:
            core = inst.core
            if core.role == "prefill":
                continue
            assert running_written(core) == sum(min(r.kv_held, r.context_tokens) for r in core.running)
            assert engine_load(core).used_tokens <= core.used_kv
            checked[0] += bool(core.running)
        if any(r.finished_s is None for r in reqs):
            q.at(q.now_s + 0.003, 3, check)

    q.at(0.0, 3, check)
    q.run()
    assert all(r.finished_s is not None and r.error is None for r in reqs)
    assert checked[0] > 50
    if decode_kv == "grow":
        assert sum(i.retractions for i in c.instances.values()) > 0  # the growth and retraction paths were met
