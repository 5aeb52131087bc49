"""``poise admin``: status and commands over NATS request/reply.

    poise admin status [--json]              instances (role, status, load) and every service's status
    poise admin set-role INSTANCE ROLE       ask the planner to flip an engine (drain, /pd_role_switch, re-register)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

import msgspec

from services.cli.stack import read_current_stack
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
    p.add_argument("--user", default=None, help="NATS user (admin)")
    p.add_argument("--password", default=None)
    p.add_argument("--timeout-s", type=float, default=2.0)
    sub = p.add_subparsers(dest="verb", required=True)
    status = sub.add_parser("status", help="instances, roles, loads and service status")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    role = sub.add_parser("set-role", help="flip an engine to another role through the planner")
    role.add_argument("instance")
    role.add_argument("role", choices=["prefill", "decode"])
    return p


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=False)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=False))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)])


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
        out.append(_table(rows, ["id", "role", "status", "kind", "running", "waiting", "kv", "load age", "url"]))
    out.append("")
    rows = []
    for name, reply in services.items():
        if isinstance(reply, str) or reply.status is None:
            rows.append([name, "-", "-", "-", reply if isinstance(reply, str) else reply.message])
            continue
        s = reply.status
        rows.append([name, s.replica_id, "yes" if s.is_leader else "no", s.policy, s.policy_note])
    out.append("services:")
    out.append(_table(rows, ["service", "replica", "leader", "policy", "note"]))
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
    bus = Bus(args.nats_url, name="poise-admin", user=args.user, password=args.password, connect_timeout_s=3)
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
        reply = await bus.request(subjects.admin("planner"),
                                  AdminCommand(verb="set-role", args={"instance": args.instance, "role": args.role}),
                                  AdminReply, timeout_s=max(args.timeout_s, 120.0))
        print(reply.message)
        return 0 if reply.ok else 1
    finally:
        await bus.close()


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        return asyncio.run(_main(args))
    except PoiseError as exc:
        print(f"poise admin: {exc}", file=sys.stderr)
        return 1
