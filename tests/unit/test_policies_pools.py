"""Pool and migration policies: the static/none defaults and their registries."""

from __future__ import annotations

import subprocess
import sys

import pytest

from shared.latency import LatencyModel, load_profile
from shared.policies import (
    MIGRATION_POLICIES,
    POOL_POLICIES,
    MigrationPolicy,
    NoMigration,
    PolicyContext,
    PoolDecision,
    PoolPolicy,
    RoleChange,
    StaticPools,
    make_migration_policy,
    make_pool_policy,
)
from shared.protocol import ClusterSnapshot, InstanceInfo, InstanceLoad, LoadReport

_pool: PoolPolicy = StaticPools()  # checked by mypy: the classes satisfy their Protocols
_migration: MigrationPolicy = NoMigration()


def _snapshot(n_prefill: int, n_decode: int, running: int) -> ClusterSnapshot:
    instances = []
    for i, role in enumerate(["prefill"] * n_prefill + ["decode"] * n_decode):
        info = InstanceInfo(instance_id=f"i{i}", role=role, engine_kind="sim", url=f"http://127.0.0.1:{30000 + i}",  # type: ignore[arg-type]
                            bootstrap_host="127.0.0.1", bootstrap_port=9000 + i, model="m", profile="p",
                            kv_capacity_tokens=1000, max_running_requests=8, sidecar="h:1", registered_at_unix_s=0.0)
        load = LoadReport(instance_id=info.instance_id, role=info.role, status="ready", ts_unix_s=1.0,
                          num_running_reqs=running, num_waiting_reqs=running * 3)
        instances.append(InstanceLoad(info=info, load=load, load_age_s=0.1))
    return ClusterSnapshot(ts_unix_s=1.0, instances=instances, series=[])


@pytest.mark.parametrize(("n_prefill", "n_decode", "running"), [(0, 0, 0), (1, 1, 0), (4, 1, 8), (1, 7, 200)])
def test_static_pools_never_changes_roles(n_prefill: int, n_decode: int, running: int) -> None:
    decision = StaticPools().decide(_snapshot(n_prefill, n_decode, running), now_s=100.0)
    assert decision is not None and decision.changes == [] and decision.next_decision_at_s is None


@pytest.mark.parametrize(("n_prefill", "n_decode", "running"), [(0, 0, 0), (2, 2, 50)])
def test_no_migration_never_moves(n_prefill: int, n_decode: int, running: int) -> None:
    assert NoMigration().select(_snapshot(n_prefill, n_decode, running), now_s=5.0) == []


def test_registries_and_notes() -> None:
    assert set(POOL_POLICIES) == {"static", "arrow", "dopd", "poise"}
    assert set(MIGRATION_POLICIES) == {"none", "kv-balance", "ares", "ares-oracle", "llumnix-like"}
    ctx = PolicyContext(ttft_slo_s=2.0, tpot_slo_s=0.15, max_instances=8)
    model = LatencyModel(load_profile())
    pool = make_pool_policy("static", model, ctx)
    assert pool.name == "static" and "keeps the registered roles" in pool.note
    migration = make_migration_policy("none")
    assert migration.name == "none" and not migration.needs_requests
    assert make_pool_policy("poise", model, ctx).name == "poise"
    with pytest.raises(ValueError, match="known: arrow, dopd, poise, static"):
        make_pool_policy("llumnix", model, ctx)
    with pytest.raises(ValueError, match="known: ares, ares-oracle, kv-balance, llumnix-like, none"):
        make_migration_policy("nope")


def test_decisions_are_plain_values() -> None:
    change = RoleChange(instance_id="p0", new_role="decode", reason="too many prefills")
    assert PoolDecision(changes=[change]).changes[0].new_role == "decode"
    assert PoolDecision().changes == []


def test_pool_and_migration_modules_import_no_io() -> None:
    blocked = ["asyncio", "nats", "aetcd", "httpx", "fastapi", "uvicorn", "grpc"]
    code = ("import sys\nimport shared.policies.pools, shared.policies.migration\n"
            f"print(','.join(m for m in {blocked!r} if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == ""
