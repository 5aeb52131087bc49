"""The wire protocol: every NATS subject, etcd key and message type Poise uses, defined once.

::

    worker ──load (NATS, ~4 Hz)──▶ monitor ──snapshot (req/reply)──▶ planner, migrator, admin
      │                              ▲
      │ etcd lease: instance key     │ request events (NATS) ◀── gateway
      ▼                              │
    etcd ◀──watch── gateway          planner ──role command (req/reply)──▶ worker
                                        └──planner events (NATS)──▶ poise admin events

Version 1 of everything lives under ``/poise/v1/`` (etcd) and ``poise.v1.`` (NATS). A breaking change
bumps the version in :data:`PROTOCOL_VERSION` and both prefixes together.
"""

from shared.protocol.keys import Keys
from shared.protocol.messages import (
    AdminCommand,
    AdminReply,
    ClusterSnapshot,
    DecodeRequestInfo,
    InstanceInfo,
    InstanceLoad,
    LoadReport,
    PlannerEvent,
    PlannerPause,
    RequestEvent,
    RequestEventBatch,
    RoleCommand,
    RoleCommandReply,
    SeriesPoint,
    ServiceStatus,
    SnapshotReply,
    SnapshotRequest,
    decode,
    encode,
)
from shared.protocol.subjects import PROTOCOL_VERSION, Subjects

__all__ = [
    "PROTOCOL_VERSION",
    "AdminCommand",
    "AdminReply",
    "ClusterSnapshot",
    "DecodeRequestInfo",
    "InstanceInfo",
    "InstanceLoad",
    "Keys",
    "LoadReport",
    "PlannerEvent",
    "PlannerPause",
    "RequestEvent",
    "RequestEventBatch",
    "RoleCommand",
    "RoleCommandReply",
    "SeriesPoint",
    "ServiceStatus",
    "SnapshotReply",
    "SnapshotRequest",
    "Subjects",
    "decode",
    "encode",
]
