"""NATS subjects, built only through these functions (never by string formatting elsewhere)."""

from __future__ import annotations

import re

PROTOCOL_VERSION = "v1"

_TOKEN = re.compile(r"^[A-Za-z0-9_-]+$")


def _token(value: str, what: str) -> str:
    # A '.', '*' or '>' inside a token would silently change which messages a subscription matches.
    if not _TOKEN.match(value):
        raise ValueError(f"{what} {value!r} is not a valid NATS subject token (letters, digits, _ and -)")
    return value


class Subjects:
    """The subjects of one Poise namespace (one cluster on a shared NATS)."""

    def __init__(self, namespace: str = "default") -> None:
        self.namespace = _token(namespace, "namespace")
        self._root = f"poise.{PROTOCOL_VERSION}.{self.namespace}"

    # -- telemetry ---------------------------------------------------------------------------------
    def load(self, instance_id: str) -> str:
        """A sidecar's periodic :class:`LoadReport` (published only by that instance's sidecar)."""
        return f"{self._root}.load.{_token(instance_id, 'instance id')}"

    def load_all(self) -> str:
        return f"{self._root}.load.*"

    def request_events(self) -> str:
        """Finished requests (:class:`RequestEventBatch`) from gateways: what the monitor builds series from."""
        return f"{self._root}.events.requests"

    def planner_events(self) -> str:
        """:class:`PlannerEvent` from the planner: every flip it starts and finishes, pauses, target changes."""
        return f"{self._root}.events.planner"

    def audit_events(self) -> str:
        """Flips, registrations, leader changes: a human-readable audit trail."""
        return f"{self._root}.events.audit"

    # -- request/reply -----------------------------------------------------------------------------
    def worker_command(self, instance_id: str) -> str:
        """:class:`RoleCommand` to one sidecar; it replies with :class:`RoleCommandReply`."""
        return f"{self._root}.worker.{_token(instance_id, 'instance id')}.cmd"

    def gateway_requests(self) -> str:
        """:class:`GatewayRequestsQuery` to every gateway; each answers :class:`GatewayRequests` (gathered)."""
        return f"{self._root}.gateway.requests"

    def gateway_move(self, replica_id: str) -> str:
        """:class:`MoveCommand` to the gateway replica streaming the request; it replies :class:`MoveReply`."""
        return f"{self._root}.gateway.{_token(replica_id, 'gateway replica id')}.move"

    def monitor_snapshot(self) -> str:
        """Request a :class:`ClusterSnapshot` from the monitor."""
        return f"{self._root}.monitor.snapshot"

    def admin(self, service: str) -> str:
        """:class:`AdminCommand` from an operator (``poise admin``) to a service (``status`` and its verbs).

        Only the admin NATS user may publish here (:mod:`shared.protocol.permissions`); one service asks another
        on :meth:`control` / :meth:`worker_control` instead.
        """
        return f"{self._root}.admin.{_token(service, 'service')}"

    # -- service-to-service commands (not the operator's admin subjects) --------------------------------
    def worker_control(self, instance_id: str) -> str:
        """:class:`AdminCommand` from the planner's connector to one sidecar (``retire``); :class:`AdminReply`."""
        return f"{self._root}.worker.{_token(instance_id, 'instance id')}.control"

    def control(self, service: str) -> str:
        """:class:`AdminCommand` from another service (the planner's ``evacuate`` to the migrator); :class:`AdminReply`."""
        return f"{self._root}.control.{_token(service, 'service')}"

    # -- wildcards: subscriptions and NATS permissions (shared/protocol/permissions.py) ------------------
    def everything(self) -> str:
        """Every subject of this namespace."""
        return f"{self._root}.>"

    def worker_command_all(self) -> str:
        return f"{self._root}.worker.*.cmd"

    def worker_control_all(self) -> str:
        return f"{self._root}.worker.*.control"

    def gateway_move_all(self) -> str:
        return f"{self._root}.gateway.*.move"

    def admin_all(self) -> str:
        return f"{self._root}.admin.*"


REPLY_INBOXES = "_INBOX.>"
"""Where replies to requests arrive: nats-py's default inbox prefix (``Bus.request`` and ``Bus.gather``)."""
