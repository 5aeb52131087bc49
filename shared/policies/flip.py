"""A role flip's rules, one copy for the planner, the sidecar, the migrator and the simulator.

A flip drains the instance (it stops taking requests and finishes what it has), then switches it: between
prefill and decode in place (SGLang's ``/pd_role_switch``), into or out of colocated serving by a restart
(SGLang chooses the mode at launch). A drain that outlives its deadline calls the flip off and the instance
serves on in its old role: a prefill instance with a deep queue, or a decode instance with long answers,
would otherwise be lost to both sides for minutes. A decode instance draining for a flip may be emptied by
migration instead of waiting for its answers (:class:`shared.policies.evacuation.Evacuation`).

Live, the planner sends the command (and asks the migrator to evacuate), the sidecar drains, switches and
calls the flip off; the simulator runs the same steps on its clock (loadgen/sim/cluster.py). Both step one
:class:`Flip` through them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

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


#: Where a flip is: the status its instance is registered with while it runs (``ready`` once it is over).
FlipStage = Literal["draining", "switching", "ready"]
#: How a flip ended: switched to the new role, called off at the drain deadline, or failed in the switch.
FlipOutcome = Literal["", "switched", "called_off", "failed"]


@dataclass(slots=True)
class Flip:
    """One flip's sequence, the one state machine the sidecar steps on its engine and clock and the simulator on
    its events: ``draining`` until the instance is idle (:meth:`drained`) or the deadline passes
    (:meth:`expire`: called off), then ``switching`` until the switch is done (:meth:`switched`) or fails
    (:meth:`failed`); ``ready`` after, in the role :attr:`role` says."""

    old: Role
    new: Role
    started_s: float
    drain_s: float = DRAIN_TIMEOUT_S
    stage: FlipStage = "draining"
    outcome: FlipOutcome = ""

    def __post_init__(self) -> None:
        if self.old == self.new:
            raise ValueError(f"a flip changes the role; both are {self.old}")
        if not self.drain_s > 0:
            raise ValueError(f"a flip's drain bound must be > 0 s, got {self.drain_s}")

    @property
    def deadline_s(self) -> float:
        """When a drain still under way calls the flip off."""
        return self.started_s + self.drain_s

    @property
    def restart(self) -> bool:
        """Whether the switch restarts the engine (:func:`is_restart`) rather than ``/pd_role_switch``."""
        return is_restart(self.old, self.new)

    @property
    def role(self) -> Role:
        """The role the instance serves in: the old one until the switch is done."""
        return self.new if self.outcome == "switched" else self.old

    @property
    def over(self) -> bool:
        return self.stage == "ready"

    def drained(self) -> None:
        """The instance is idle: switch it."""
        self._expect("draining")
        self.stage = "switching"

    def expire(self, now_s: float) -> bool:
        """Call the flip off if its drain is still under way at its deadline; whether it did."""
        if self.stage != "draining" or now_s < self.deadline_s:
            return False
        self.stage, self.outcome = "ready", "called_off"
        return True

    def switched(self) -> Role:
        """The switch is done: the role the instance is ready in."""
        self._expect("switching")
        self.stage, self.outcome = "ready", "switched"
        return self.new

    def failed(self) -> Role:
        """The drain or the switch failed other than by the deadline: back to work in the old role."""
        if self.over:
            raise RuntimeError(f"flip {self.old} -> {self.new} is over ({self.outcome})")
        self.stage, self.outcome = "ready", "failed"
        return self.old

    def _expect(self, stage: FlipStage) -> None:
        if self.stage != stage:
            raise RuntimeError(f"flip {self.old} -> {self.new} is {self.stage} ({self.outcome or 'under way'}), "
                               f"not {stage}")
