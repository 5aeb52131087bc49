"""Unit-test fixtures."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from services.engine_sim import clock


@pytest.fixture
def engine_clock_on_loop() -> Iterator[None]:
    """engine_sim reads the event loop's time, so a test marked ``looptime`` runs its engines on virtual time."""
    with clock.driven_by(clock.loop_time):
        yield
