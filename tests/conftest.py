"""Session fixtures: real nats-server and etcd on free loopback ports (never mocks), with authentication on.

nats-server has the users of a Poise namespace (every service, the admin, workers p0-p3, d0-d3, c0; namespace
``authz``, see tests/integration/test_auth.py) plus a full-access ``test`` user; etcd has auth on with the
``poise`` user. Both servers' ``url`` carries the credentials of the user tests connect as (``test`` /
``poise``), so ``Bus(nats_server.url)``, ``Registry(etcd_server.url)`` and ``nats_url=nats_server.url`` work
as they did without auth; ``plain_url`` has no credentials.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.devservers import EtcdServer, NatsServer
from shared.protocol import Subjects
from shared.protocol.permissions import user_permissions
from shared.security import Credentials, EtcdAuth, NatsUser, new_secret

AUTHZ_NAMESPACE = "authz"
AUTHZ_WORKERS = ("p0", "p1", "p2", "p3", "d0", "d1", "d2", "d3", "c0")


@pytest.fixture(scope="session")
def servers_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("servers")


@pytest.fixture(scope="session")
def nats_credentials() -> Credentials:
    """Passwords of the session nats-server's role users (namespace ``authz``) and its ``test`` user."""
    permissions = user_permissions(Subjects(AUTHZ_NAMESPACE), AUTHZ_WORKERS)
    creds = Credentials.generate(permissions)
    creds.nats["test"] = new_secret()
    return creds


@pytest.fixture(scope="session")
def nats_server(servers_dir: Path, nats_credentials: Credentials) -> Iterator[NatsServer]:
    permissions = user_permissions(Subjects(AUTHZ_NAMESPACE), AUTHZ_WORKERS)
    users = [NatsUser(u, nats_credentials.nats[u], p) for u, p in permissions.items()]
    users.append(NatsUser("test", nats_credentials.nats["test"], None))  # every subject: the tests' own user
    server = NatsServer(servers_dir / "nats", users=users, client_user="test")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def etcd_server(servers_dir: Path) -> Iterator[EtcdServer]:
    # bcrypt cost 4: every Registry logs in, and the suite makes hundreds (etcd's default costs ~0.1 s each).
    server = EtcdServer(servers_dir / "etcd", auth=EtcdAuth.generate(), bcrypt_cost=4)
    yield server
    server.stop()
