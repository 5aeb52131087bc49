"""``poise admin``: status and commands over NATS request/reply.

    poise admin status [--json]              instances (role, status, load) and every service's status
    poise admin pools [--json]               instances by role, the planner's policy targets and decision latency
    poise admin flip ID --to prefill|decode  ask the planner to flip an engine (drain, /pd_role_switch, re-register)
    poise admin set-role ID ROLE             the same as flip (older spelling)
    poise admin planner pause|resume         stop / restart the planner's own flips (admin flips still work)
    poise admin events [--count N]           print the planner's events (flips, pauses, target changes) as they come
    poise admin migrate RID --to ID          move a running request to another decode engine (its stream goes on)

Every command exits non-zero when the service does not answer or refuses.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any

import msgspec

from services.cli import admin_planner
from services.cli.admin_planner import table
from services.cli.stack import current_admin_credentials, read_current_stack
from shared.bus import Bus
from shared.errors import BusTimeout, PoiseError
from shared.protocol import AdminCommand, AdminReply, ClusterSnapshot, SnapshotReply, SnapshotRequest, Subjects

SERVICES = ("gateway", "monitor", "planner", "migrator")


def _parser() -> argparse.ArgumentParser:
    current = read_current_stack() or {}
    p = argparse.ArgumentParser(prog="poise admin", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nats-url", default=current.get("nats_url", "nats://127.0.0.1:4222"),
                   help="NATS URL (default: the stack `poise up` started here)")
    p.add_argument("--namespace", default=current.get("namespace", "default"))
    p.add_argument("--user", default=None,
                   help="NATS user (default: the admin user of the stack `poise up` started here, when --nats-url is its)")
    p.add_argument("--password", default=None, help="NATS password (or env POISE_ADMIN_NATS_PASSWORD)")
    p.add_argument("--timeout-s", type=float, default=2.0)
    sub = p.add_subparsers(dest="verb", required=True)
    status = sub.add_parser("status", help="instances, roles, loads and service status")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    role = sub.add_parser("set-role", help="flip an engine to another role through the planner (same as flip)")
    role.add_argument("instance")
    role.add_argument("role", choices=["prefill", "decode", "null"], help="null: colocated serving (the engine restarts)")
    flip = sub.add_parser("flip", help="flip an engine to another role through the planner")
    flip.add_argument("instance", metavar="ID")
    flip.add_argument("--to", dest="role", required=True, choices=["prefill", "decode", "null"],
                      help="null: colocated serving (the engine restarts)")
    flip.add_argument("--reason", default=None, help="recorded in the planner's events and the sidecar's log")
    flip.add_argument("--drain-timeout-s", type=float, default=None, help="drain timeout (default: the planner's)")
    for verb in (role, flip):
        verb.add_argument("--wait-s", type=float, default=200.0, help="how long to wait for the flip to finish")
    pools = sub.add_parser("pools", help="instances by role, the policy's targets, decision latency")
    pools.add_argument("--json", action="store_true", help="machine-readable output (the planner's reply)")
    planner = sub.add_parser("planner", help="pause or resume the planner's own flips")
    planner.add_argument("action", choices=["pause", "resume"])
    planner.add_argument("--reason", default=None)
    events = sub.add_parser("events", help="print planner events until Ctrl-C")
    events.add_argument("--count", type=int, default=None, help="exit after this many events")
    events.add_argument("--max-wait-s", type=float, default=None, help="give up after this long (exit 1 with --count)")
    events.add_argument("--json", action="store_true", help="one JSON PlannerEvent per line")
    migrate = sub.add_parser("migrate", help="move a running request to another decode engine through the migrator")
    migrate.add_argument("rid", metavar="RID", help="the request id the client sees (x-request-id)")
    migrate.add_argument("--to", dest="target", required=True, metavar="ID", help="the decode instance to move it to")
    migrate.add_argument("--mechanism", choices=["recompute", "kv-transfer"], default=None,
                         help="default: the migrator's setting")
    migrate.add_argument("--wait-s", type=float, default=90.0, help="how long to wait for the move's outcome")
    return p


async def _migrate(bus: Bus, subjects: Subjects, args: argparse.Namespace) -> int:
    command_args = {"rid": args.rid, "to": args.target}
    if args.mechanism:
        command_args["mechanism"] = args.mechanism
    reply = await bus.request(subjects.admin("migrator"), AdminCommand(verb="migrate", args=command_args), AdminReply,
                              timeout_s=max(args.timeout_s, args.wait_s))
    print(reply.message, file=sys.stdout if reply.ok else sys.stderr)
    return 0 if reply.ok else 1


def render_status(snapshot: ClusterSnapshot | None, services: dict[str, AdminReply | str]) -> str:
    out = []
    if snapshot is None:
        out.append("instances: monitor did not answer")
    else:
        rows = []
        for inst in sorted(snapshot.instances, key=lambda i: (i.info.role, i.info.instance_id)):
            load = inst.load
            rows.append([
                inst.info.instance_id, inst.info.role, inst.info.status, inst.info.engine_kind,
                str(load.num_running_reqs) if load else "-", str(load.num_waiting_reqs) if load else "-",
                f"{load.token_usage * 100:.1f}%" if load else "-",
                f"{inst.load_age_s:.1f}s" if inst.load_age_s is not None else "-",
                inst.info.url,
            ])
        out.append(f"instances ({len(rows)}):")
        out.append(table(rows, ["id", "role", "status", "kind", "running", "waiting", "kv", "load age", "url"]))
    out.append("")
    rows = []
    for name, reply in services.items():
        if isinstance(reply, str) or reply.status is None:
            rows.append([name, "-", "-", "-", reply if isinstance(reply, str) else reply.message])
            continue
        s = reply.status
        policy = f"{s.policy} (paused)" if s.details.get("paused") else s.policy
        rows.append([name, s.replica_id, "yes" if s.is_leader else "no", policy, s.policy_note])
    out.append("services:")
    out.append(table(rows, ["service", "replica", "leader", "policy", "note"]))
    return "\n".join(out)


async def _status(bus: Bus, subjects: Subjects, timeout_s: float) -> tuple[ClusterSnapshot | None, dict[str, AdminReply | str]]:
    async def snap() -> ClusterSnapshot | None:
        try:
            reply = await bus.request(subjects.monitor_snapshot(), SnapshotRequest(series_points=0), SnapshotReply, timeout_s=timeout_s)
        except BusTimeout:
            return None
        return reply.snapshot

    async def status(name: str) -> AdminReply | str:
        try:
            return await bus.request(subjects.admin(name), AdminCommand(verb="status"), AdminReply, timeout_s=timeout_s)
        except BusTimeout as exc:
            return f"no answer ({exc})"

    snapshot_task = asyncio.ensure_future(snap())
    replies = await asyncio.gather(*(status(n) for n in SERVICES))
    return await snapshot_task, dict(zip(SERVICES, replies, strict=True))


async def _main(args: argparse.Namespace) -> int:
    user, password = args.user, args.password or os.environ.get("POISE_ADMIN_NATS_PASSWORD")
    if user is None:
        user, password = current_admin_credentials(args.nats_url) or (None, None)
    bus = Bus(args.nats_url, name="poise-admin", user=user, password=password, connect_timeout_s=3)
    await bus.connect()
    subjects = Subjects(args.namespace)
    try:
        if args.verb == "status":
            snapshot, services = await _status(bus, subjects, args.timeout_s)
            if args.json:
                doc: dict[str, Any] = {
                    "snapshot": msgspec.to_builtins(snapshot),
                    "services": {k: (v if isinstance(v, str) else msgspec.to_builtins(v)) for k, v in services.items()},
                }
                print(json.dumps(doc, indent=2))
            else:
                print(render_status(snapshot, services))
            return 0 if snapshot is not None else 1
        if args.verb in ("flip", "set-role"):
            return await admin_planner.flip(bus, subjects, args.instance, args.role, verb=args.verb,
                                            reason=getattr(args, "reason", None),
                                            drain_timeout_s=getattr(args, "drain_timeout_s", None),
                                            wait_s=max(args.timeout_s, args.wait_s))
        if args.verb == "pools":
            return await admin_planner.pools(bus, subjects, args.timeout_s, args.json)
        if args.verb == "planner":
            return await admin_planner.pause_resume(bus, subjects, args.action, args.reason, args.timeout_s)
        if args.verb == "migrate":
            return await _migrate(bus, subjects, args)
        if args.verb == "events":
            return await admin_planner.events(bus, subjects, args.count, args.max_wait_s, args.json)
        raise PoiseError(f"unknown admin command {args.verb!r}")
    finally:
        await bus.close()


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        return asyncio.run(_main(args))
    except PoiseError as exc:
        print(f"poise admin: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # how `poise admin events` is meant to end
        return 0
