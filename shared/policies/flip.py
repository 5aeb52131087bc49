"""A role flip's rules, one copy for the planner, the sidecar, the migrator and the simulator.

A flip drains the instance (it stops taking requests and finishes what it has), then switches it: between
prefill and decode in place (SGLang's ``/pd_role_switch``), into or out of colocated serving by a restart
(SGLang chooses the mode at launch). A drain that outlives its deadline calls the flip off and the instance
serves on in its old role: a prefill instance with a deep queue, or a decode instance with long answers,
would otherwise be lost to both sides for minutes. A decode instance draining for a flip may be emptied by
migration instead of waiting for its answers (:class:`shared.policies.evacuation.Evacuation`).

Live, the planner sends the command (and asks the migrator to evacuate), the sidecar drains, switches and
calls the flip off; the simulator runs the same steps on its clock (loadgen/sim/cluster.py).
"""

from __future__ import annotations

from shared.protocol.messages import Role

#: How long a flip's drain may take before it is called off (the planner sends it with each command; the
#: sidecar never waits longer than its own).
DRAIN_TIMEOUT_S = 60.0


def is_restart(old: Role, new: Role) -> bool:
    """Colocated and PD serving differ at launch in SGLang: a move between them restarts the engine; prefill
    and decode switch in place (``/pd_role_switch``)."""
    return "null" in (old, new)


def drain_deadline_s(asked_s: float, configured_s: float) -> float:
    """The drain bound: the command's where it gives one (never past the sidecar's own), else the sidecar's."""
    return min(asked_s, configured_s) if asked_s > 0 else configured_s


def drained_by_migration(enabled: bool, old: Role | None, new: Role) -> bool:
    """Whether a flip ``old -> new`` empties the instance by migration (``enabled``: the planner's
    ``drain_by_migration``): a decode instance's running requests can move to the other decode instances.
    ``old`` None: not known (etcd unreachable), judged by where it goes (only a decode instance becomes a
    prefill one by ``/pd_role_switch``)."""
    return enabled and (old == "decode" or (old is None and new == "prefill"))
