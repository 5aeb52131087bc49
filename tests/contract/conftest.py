"""engine_sim processes shared by the whole contract suite (started once, in parallel, on free ports)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.integration.engine_procs import Engine, start_engine, stop, wait_healthy


@dataclass
class Engines:
    null: Engine  # colocated, --enable-pd-role-switch (engine_sim's default): the OpenAI routes' target
    prefill: Engine  # PD prefill, role switch on
    decode: Engine  # PD decode, role switch on
    prefill_no_switch: Engine  # PD prefill launched with --no-enable-pd-role-switch

    def all(self) -> list[Engine]:
        return [self.null, self.prefill, self.decode, self.prefill_no_switch]


@pytest.fixture(scope="session")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
    tmp = tmp_path_factory.mktemp("contract-engines")
    # Real time (time_scale 1) on the colocated engine, so streams have several events; the PD engines only
    # serve control-plane calls and a few short requests.
    started = Engines(
        null=start_engine(tmp, "null", time_scale=1.0, name="contract"),
        prefill=start_engine(tmp, "prefill", time_scale=0.0, name="contract", bootstrap_timeout_s=30.0),
        decode=start_engine(tmp, "decode", time_scale=0.0, name="contract"),
        prefill_no_switch=start_engine(tmp, "prefill", "--no-enable-pd-role-switch", time_scale=0.0,
                                       name="contract-noswitch"),
    )
    try:
        wait_healthy(started.all(), timeout_s=60.0)
        yield started
    finally:
        stop(started.all())


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=30.0, trust_env=False) as c:
        yield c


def log_of(engine: Engine) -> str:
    return Path(engine.log).read_text(errors="replace")[-3000:]
