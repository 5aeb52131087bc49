"""Gateway replicas' share of a prefill engine's late-binding depth (``shared.policies.late_binding``)."""

from __future__ import annotations

import pytest

from shared.policies.late_binding import DEFAULT_DEPTH, replica_depth


def test_gateway_replicas_share_an_engines_depth() -> None:
    assert [replica_depth(DEFAULT_DEPTH, n) for n in (1, 2, 3)] == [2, 1, 1]  # at least one each
    assert replica_depth(4, 2) == 2
    for bad in ((2, 0), (0, 2)):
        with pytest.raises(ValueError):
            replica_depth(*bad)
