"""Session fixtures: real nats-server and etcd on free loopback ports (never mocks)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.devservers import EtcdServer, NatsServer


@pytest.fixture(scope="session")
def servers_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("servers")


@pytest.fixture(scope="session")
def nats_server(servers_dir: Path) -> Iterator[NatsServer]:
    server = NatsServer(servers_dir / "nats")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def etcd_server(servers_dir: Path) -> Iterator[EtcdServer]:
    server = EtcdServer(servers_dir / "etcd")
    yield server
    server.stop()
