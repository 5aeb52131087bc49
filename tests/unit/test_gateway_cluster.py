"""The gateway's cluster view: an engine's finish rate counts only the requests served there to their end."""

from __future__ import annotations

import asyncio

from services.gateway.cluster import ClusterView
from shared.protocol import InstanceInfo, LoadReport


def _view() -> ClusterView:
    cluster = ClusterView()
    info = InstanceInfo(instance_id="c0", role="null", engine_kind="sim", url="http://127.0.0.1:30000",
                        bootstrap_host="127.0.0.1", bootstrap_port=None, model="m", profile="p",
                        kv_capacity_tokens=1000, max_running_requests=8, sidecar="h:1", registered_at_unix_s=0.0)
    cluster.set_instances({"c0": info})
    asyncio.run(cluster.on_load(LoadReport(instance_id="c0", role="null", status="ready", ts_unix_s=1.0), "subject"))
    return cluster


def _finish_rate(cluster: ClusterView) -> float | None:
    (view,) = cluster.engines("m")
    return view.finish_rate_rps


def test_refused_failed_or_moved_requests_are_not_finishes() -> None:
    cluster = _view()
    for i in range(20):  # an engine giving every prompt up (429) serves none of them
        cluster.ledger.dispatched(f"r{i}", "c0", None, 100, 0)
        cluster.release(f"r{i}")
    assert _finish_rate(cluster) is None
    (view,) = cluster.engines("m")
    assert view.inflight_reqs == 0 and view.inflight_tokens == 0  # the slots are back all the same


def test_requests_served_to_their_end_are() -> None:
    cluster = _view()
    for i in range(20):
        cluster.ledger.dispatched(f"r{i}", "c0", None, 100, 0)
        cluster.release(f"r{i}", finished_on="c0")
    rate = _finish_rate(cluster)
    assert rate is not None and rate > 0
