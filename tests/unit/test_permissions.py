"""The permission matrix and the credentials plumbing, without servers (tests/integration/test_auth.py has them)."""

from __future__ import annotations

import json
from pathlib import Path

import bcrypt

from services.cli.stack import Stack, StackSettings, planner_uses_local_connector
from services.deploy.devstack import clean_env, environment, poise_up_processes
from shared.protocol import Subjects
from shared.protocol.permissions import ROLES, markdown_table, role_permissions, user_permissions
from shared.security import Credentials, NatsUser, nats_config, redact_url, url_with_credentials, without_secrets

SECURITY_DOC = Path(__file__).resolve().parents[2] / "docs" / "security.md"
S = Subjects("ns")


def test_readme_has_the_permission_matrix() -> None:
    assert markdown_table() in SECURITY_DOC.read_text(), "docs/security.md's permission table is stale: paste markdown_table()"


def test_no_role_but_the_admin_publishes_admin_subjects_or_inboxes() -> None:
    for role in ROLES:
        p = role_permissions(role, S, "p0")
        admin_subjects = [s for s in p.publish if s.startswith(S.admin_all()[:-1])]
        assert bool(admin_subjects) == (role == "admin"), role
        assert not any(s.startswith("_INBOX") for s in p.publish), role  # replies go through allow_responses


def test_a_worker_may_publish_its_own_load_only() -> None:
    p = role_permissions("worker", S, "d3")
    assert p.publish == (S.load("d3"),)
    assert set(p.subscribe) == {S.worker_command("d3"), S.worker_control("d3"), S.admin("worker-d3"), S.planner_events()}
    assert p.respond


def test_every_user_of_a_deployment() -> None:
    users = user_permissions(S, ["p0", "d0"])
    assert set(users) == {"gateway", "monitor", "planner", "migrator", "admin", "worker-p0", "worker-d0"}


def test_nats_config_blocks() -> None:
    monitor = role_permissions("monitor", S)
    admin = role_permissions("admin", S)
    text = nats_config([NatsUser("monitor", "pw", monitor), NatsUser("admin", "$ADMIN_PW", admin),
                        NatsUser("test", 'q"uote', None)])
    lines = {line.split('"')[1]: line for line in text.splitlines() if line.strip().startswith("{user:")}
    assert "allow_responses: true" in lines["monitor"]
    assert "publish:" not in lines["monitor"]  # allow_responses alone: it answers, publishes nothing
    assert "password: $ADMIN_PW," in lines["admin"] and "allow_responses" not in lines["admin"]
    assert "permissions" not in lines["test"]
    # The file holds bcrypt hashes (what nats-server checks a client's password against), never a password.
    for user, password in (("monitor", "pw"), ("test", 'q"uote')):
        hashed = lines[user].split("password: ")[1].split('"')[1]
        assert hashed.startswith("$2b$") and bcrypt.checkpw(password.encode(), hashed.encode())
        assert json.dumps(password) not in lines[user]


def test_urls_with_credentials_and_redaction() -> None:
    url = url_with_credentials("nats://h:4222", "u", "p")
    assert url == "nats://u:p@h:4222"
    assert redact_url(url + ",nats://h2:1") == "nats://u:***@h:4222,nats://h2:1"
    assert url_with_credentials("http://h:2379", None, None) == "http://h:2379"


def test_credentials_file_is_private(tmp_path: Path) -> None:
    creds = Credentials.generate(["gateway", "admin"])
    path = tmp_path / "c.json"
    creds.write(path)
    assert path.stat().st_mode & 0o777 == 0o600
    assert Credentials.read(path) == creds
    assert creds.api_key and creds.etcd_password and len({*creds.nats.values(), creds.api_key}) == 3
    subset = creds.subset(["admin"])
    assert set(subset.nats) == {"admin"} and subset.etcd_root_password is None and subset.api_key is None


def test_children_do_not_inherit_secrets() -> None:
    env = {"POISE_WORKER_NATS_PASSWORD": "x", "POISE_GATEWAY_API_KEYS": "y", "POISE_WORKER_NATS_USER": "u", "PATH": "/"}
    assert without_secrets(env) == {"POISE_WORKER_NATS_USER": "u", "PATH": "/"}


def test_poise_up_gives_each_process_its_own_user_in_its_environment() -> None:
    with environment(clean_env()):
        processes = {p.name: p for p in poise_up_processes(StackSettings())}
    for name, proc in processes.items():
        env = dict(proc.env)
        assert not any("password" in a.lower() for a in proc.argv)  # never a flag: ps shows flags
        if proc.module is None:
            assert env == {}
            continue
        prefix = {"services.worker": "POISE_WORKER_"}.get(proc.module, f"POISE_{name.upper()}_")
        assert env[prefix + "NATS_USER"] == (name if proc.module != "services.worker" else name)  # worker-<id>
        assert env[prefix + "NATS_PASSWORD"] and env[prefix + "ETCD_PASSWORD"]
        # a sidecar logs in to etcd as itself (it may write its own instance key only), the rest as poise
        assert env[prefix + "ETCD_USER"] == (name if proc.module == "services.worker" else "poise")
    assert json.loads(dict(processes["gateway"].env)["POISE_GATEWAY_API_KEYS"])
    assert "-c" in processes["nats-server"].args


def test_no_auth_turns_everything_off() -> None:
    with environment(clean_env()):
        processes = poise_up_processes(StackSettings(auth=False))
    assert all(p.env == () for p in processes)
    assert not any(a == "-c" for p in processes for a in p.argv)


def test_spare_worker_users_only_with_the_local_connector(tmp_path: Path) -> None:
    assert planner_uses_local_connector(["--scaling-policy", "dopd", "--connector", "local"])
    assert planner_uses_local_connector(["--connector=local"])
    assert not planner_uses_local_connector(["--connector", "kubernetes"])
    stack = Stack(StackSettings(prefill=2, decode=1, spare_worker_ids=2, run_dir=tmp_path,
                                planner_args=["--connector", "local"]))
    assert stack._spare_ids() == ["p2", "p3", "d1", "d2", "c0", "c1"]
    users = {u.user for u in stack._make_credentials()}
    assert {"worker-p0", "worker-p1", "worker-d0", "worker-p3", "worker-c1"} <= users
    spares = Credentials.read(tmp_path / "worker-credentials.json")
    assert set(spares.nats) == {f"worker-{i}" for i in stack._spare_ids()}  # no service's or the admin's
    assert spares.etcd_root_password is None and spares.api_key is None


def test_admin_and_bench_find_the_running_stacks_credentials(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from services.cli.stack import current_admin_credentials, current_api_key

    monkeypatch.chdir(tmp_path)
    creds = Credentials.generate(["admin"], api_key="the-key")
    creds.write(tmp_path / "credentials.json")
    (tmp_path / ".poise").mkdir()
    (tmp_path / ".poise" / "current.json").write_text(json.dumps({
        "nats_url": "nats://127.0.0.1:4222", "gateway_url": "http://127.0.0.1:8000", "api_key": "the-key",
        "credentials_file": str(tmp_path / "credentials.json")}))
    assert current_admin_credentials("nats://127.0.0.1:4222") == ("admin", creds.nats["admin"])
    assert current_admin_credentials("nats://elsewhere:4222") is None  # never another server's
    assert current_api_key("http://127.0.0.1:8000/") == "the-key"
    assert current_api_key("http://elsewhere:8000") is None
