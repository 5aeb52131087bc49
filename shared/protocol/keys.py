"""etcd keys, built only through these functions.

Layout (namespace ``ns``)::

    /poise/v1/<ns>/instances/<instance_id>   InstanceInfo, under the sidecar's lease
    /poise/v1/<ns>/desired/<instance_id>     desired role written by the planner (later issues)
    /poise/v1/<ns>/leaders/<service>         leader-election key, under the leader's lease
    /poise/v1/<ns>/planner/paused            PlannerPause while the planner is paused (absent = running)
"""

from __future__ import annotations

from shared.protocol.subjects import PROTOCOL_VERSION, _token


class Keys:
    def __init__(self, namespace: str = "default") -> None:
        self.namespace = _token(namespace, "namespace")
        self.root = f"/poise/{PROTOCOL_VERSION}/{self.namespace}"

    def instances_prefix(self) -> str:
        return f"{self.root}/instances/"

    def instance(self, instance_id: str) -> str:
        return self.instances_prefix() + _token(instance_id, "instance id")

    def instance_id_from_key(self, key: str) -> str:
        prefix = self.instances_prefix()
        if not key.startswith(prefix):
            raise ValueError(f"{key!r} is not an instance key under {prefix!r}")
        return key[len(prefix):]

    def desired_prefix(self) -> str:
        return f"{self.root}/desired/"

    def desired(self, instance_id: str) -> str:
        return self.desired_prefix() + _token(instance_id, "instance id")

    def leader(self, service: str) -> str:
        return f"{self.root}/leaders/{_token(service, 'service')}"

    def planner_paused(self) -> str:
        """Present while the planner is paused: every replica (and a new leader after failover) reads it."""
        return f"{self.root}/planner/paused"
