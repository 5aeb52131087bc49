"""Who may publish and subscribe to which NATS subjects: the permission matrix of every Poise principal.

Built only from :class:`~shared.protocol.subjects.Subjects` (the one place subjects are made). The dev stack
(``poise up``), docker-compose and ``make deploy`` turn it into nats-server users (:mod:`shared.security`).

- A service publishes what it sends and subscribes to what it serves or reads; every service *answers*
  requests through nats-server's ``allow_responses`` (it may publish to the reply subject of a request it
  received, once), so no service needs publish rights on ``_INBOX.>``.
- Services that send requests subscribe to :data:`REPLY_INBOXES`, where their replies arrive.
- A worker sidecar publishes only its own load subject and serves only its own command, control and admin
  subjects: one sidecar cannot speak for another. It also hears the planner's events (the ISL forecast it
  relays to an engine_sim prefill policy).
- Only the admin user (``poise admin``) publishes the operator's admin subjects (``admin.*``). The planner's
  commands to other services go on dedicated subjects: role commands (``worker.<id>.cmd``), a sidecar's
  ``retire`` (``worker.<id>.control``) and the migrator's ``evacuate`` (``control.migrator``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from shared.protocol.subjects import REPLY_INBOXES, Subjects

SERVICE_ROLES: tuple[str, ...] = ("gateway", "monitor", "planner", "migrator")
ROLES: tuple[str, ...] = (*SERVICE_ROLES, "worker", "admin")


@dataclass(frozen=True)
class Permissions:
    """What one NATS user may do. ``respond``: answer requests it received (nats-server ``allow_responses``)."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    respond: bool = True


def worker_user(instance_id: str) -> str:
    """The NATS user name of one sidecar."""
    return f"worker-{instance_id}"


def role_permissions(role: str, subjects: Subjects, instance_id: str | None = None) -> Permissions:
    """The permissions of ``role`` (one of :data:`ROLES`); a worker needs its ``instance_id``."""
    s = subjects
    if role == "gateway":
        return Permissions(publish=(s.request_events(),),
                           subscribe=(s.load_all(), s.gateway_requests(), s.gateway_move_all(), s.admin("gateway")))
    if role == "monitor":
        return Permissions(publish=(),
                           subscribe=(s.load_all(), s.request_events(), s.planner_events(), s.monitor_snapshot(),
                                      s.admin("monitor")))
    if role == "planner":
        return Permissions(publish=(s.monitor_snapshot(), s.worker_command_all(), s.worker_control_all(),
                                    s.control("migrator"), s.planner_events()),
                           subscribe=(s.admin("planner"), REPLY_INBOXES))
    if role == "migrator":
        return Permissions(publish=(s.monitor_snapshot(), s.gateway_requests(), s.gateway_move_all()),
                           subscribe=(s.admin("migrator"), s.control("migrator"), REPLY_INBOXES))
    if role == "worker":
        if instance_id is None:
            raise ValueError("a worker's permissions need its instance id")
        return Permissions(publish=(s.load(instance_id),),
                           subscribe=(s.worker_command(instance_id), s.worker_control(instance_id),
                                      s.admin(worker_user(instance_id)), s.planner_events()))
    if role == "admin":
        return Permissions(publish=(s.admin_all(), s.monitor_snapshot()), subscribe=(s.everything(), REPLY_INBOXES),
                           respond=False)
    raise ValueError(f"unknown role {role!r}; known: {', '.join(ROLES)}")


def user_permissions(subjects: Subjects, worker_ids: Iterable[str]) -> dict[str, Permissions]:
    """NATS user name -> permissions: every service, the admin, and one user per worker id."""
    users = {role: role_permissions(role, subjects) for role in (*SERVICE_ROLES, "admin")}
    for instance_id in worker_ids:
        users[worker_user(instance_id)] = role_permissions("worker", subjects, instance_id)
    return users


def markdown_table(namespace: str = "NS") -> str:
    """The matrix as the Markdown table in docs/security.md; subjects shown without ``poise.v1.<ns>.``."""
    subjects = Subjects(namespace)
    root = subjects.everything()[:-1]

    def show(items: tuple[str, ...]) -> str:
        return ", ".join(f"`{i.removeprefix(root)}`" for i in items) or "-"

    rows = ["| user | publishes | subscribes | answers requests |", "|---|---|---|---|"]
    for role in ROLES:
        p = role_permissions(role, subjects, "ID" if role == "worker" else None)
        name = worker_user("ID") if role == "worker" else role
        rows.append(f"| {name} | {show(p.publish)} | {show(p.subscribe)} | {'yes' if p.respond else 'no'} |")
    return "\n".join(rows)
