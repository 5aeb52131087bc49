"""The migration cost model (shared/policies/migration_cost.py): one copy for the policy and the simulator."""

from __future__ import annotations

import msgspec
import pytest

from shared.latency import LatencyModel, load_profile
from shared.policies.migration_cost import (
    MIGRATION_MECHANISMS,
    KvTransfer,
    KvTransferParams,
    MigrationMechanism,
    Recompute,
    make_migration_mechanism,
)

MODEL = LatencyModel(load_profile())
_checks: tuple[MigrationMechanism, MigrationMechanism] = (KvTransfer(MODEL), Recompute(MODEL))


def test_kv_transfer_is_bytes_over_25_gbps_plus_control() -> None:
    kv = make_migration_mechanism("kv-transfer", MODEL)
    # Llama-3.1-8B: 131,072 B/token; 10K tokens = 1.31 GB over 3.125 GB/s = 0.419 s, + 5 ms
    assert kv.seconds(10_000) == pytest.approx(0.005 + 10_000 * 131_072 / 3.125e9)
    assert kv.seconds(0) == pytest.approx(0.005)
    # spec §4.3's example: R1-Distill-Qwen-7B (57,344 B/token), 10K tokens at 25 Gbps = 0.18 s, 30K = 0.55 s
    qwen = LatencyModel(msgspec.structs.replace(load_profile(), kv_bytes_per_token=57_344))
    assert KvTransfer(qwen).seconds(10_000) - 0.005 == pytest.approx(0.1835, abs=1e-3)
    assert KvTransfer(qwen).seconds(30_000) - 0.005 == pytest.approx(0.5505, abs=1e-3)
    fast = KvTransfer(MODEL, KvTransferParams(bandwidth_gbps=100.0, control_overhead_s=0.0))
    assert fast.seconds(10_000) == pytest.approx(10_000 * 131_072 / 12.5e9)
    with pytest.raises(ValueError):
        KvTransferParams(bandwidth_gbps=0.0)


def test_recompute_is_the_prefill_of_the_context_plus_the_handoff() -> None:
    rc = make_migration_mechanism("recompute", MODEL)
    expected = MODEL.prefill_time_s(10_000) + MODEL.kv_transfer_time_s(10_000)
    assert rc.seconds(10_000) == pytest.approx(expected)
    # 0.008 + 3.25e-5 x 1e4 + 5.3e-10 x 1e8 = 0.386 s of prefill, + 2 ms + 1.31 GB / 25 GB/s
    assert expected == pytest.approx(0.386 + 0.002 + 0.0524288)
    # recompute grows quadratically, the copy linearly: at long contexts the copy wins by far
    kv = KvTransfer(MODEL)
    assert rc.seconds(100_000) / kv.seconds(100_000) > rc.seconds(10_000) / kv.seconds(10_000)


def test_registry_and_time_scale() -> None:
    assert set(MIGRATION_MECHANISMS) == {"kv-transfer", "recompute"}
    with pytest.raises(ValueError, match="known: kv-transfer, recompute"):
        make_migration_mechanism("rdma", MODEL)
    free = LatencyModel(load_profile(), time_scale=0.0)
    assert KvTransfer(free).seconds(10_000) == 0.0 and Recompute(free).seconds(10_000) == 0.0
