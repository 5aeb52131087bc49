"""Planner settings (env prefix ``POISE_PLANNER_``, or the matching ``--flags``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import msgspec
from pydantic import Field, field_validator, model_validator

from shared.elected import ElectedServiceSettings
from shared.policies import POOL_POLICIES, SCALING_POLICIES, lookup
from shared.policies.flip import DRAIN_TIMEOUT_S
from shared.policies.migration_cost import MIGRATION_MECHANISMS
from shared.settings import SloPlanSettings, settings_config


class PlannerSettings(SloPlanSettings, ElectedServiceSettings):
    """Leader-elected loop: cluster snapshot -> pool policy -> role commands to the sidecars."""

    model_config = settings_config("POISE_PLANNER_")

    policy: str = Field("static", description=f"Pool policy: one of {', '.join(sorted(POOL_POLICIES))}.")
    drain_timeout_s: float = Field(DRAIN_TIMEOUT_S, gt=0.0, description="Drain timeout, in seconds, sent with each role command (how long a sidecar waits for its engine to go idle).")
    command_timeout_s: float = Field(150.0, gt=0.0, description="Seconds to wait for a sidecar's answer to a role command (drain plus the switch itself).")
    drain_by_migration: bool = Field(True, description="When a decode instance flips, ask the migrator to move its running requests to other decode instances (the drain then ends after one re-prefill instead of the longest answer); without a migrator the sidecar just waits.")
    drain_mechanism: str = Field("recompute", description="How the migrator moves a draining decode instance's requests (its --mechanism: recompute or kv-transfer); the pool policy judges a decode instance's drain by it while drain_by_migration is on.")
    scaling_policy: str = Field("none", description=f"Scaling policy (replica counts, needs a connector): none, {', '.join(sorted(SCALING_POLICIES))}.")
    connector: Literal["none", "local", "kubernetes"] = Field("none", description="Where the scaling policy starts and retires engines: local = engine_sim + sidecar processes on this host; kubernetes = the scale subresource of one workload per role.")
    max_instances: int = Field(8, ge=2, description="GPU budget of the scaling policy: prefill + decode replicas never exceed it.")
    worker_credentials_file: Path | None = Field(None, description="The local connector's credentials for the workers it starts (one NATS user per worker id, and etcd's); `poise up` writes one (docs/security.md). Unset = workers get the planner's own.")
    connector_settings: dict[str, Any] = Field(default_factory=dict, description="Extra settings of the connector (JSON): LocalConnectorSettings fields (profile, model, time_scale, log_dir, worker_args, ...) or KubernetesConnectorSettings fields (workloads, api_server, ...); the planner's namespace, NATS and etcd URLs are filled in.")

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        lookup(POOL_POLICIES, value, "pool policy")
        return value

    @field_validator("drain_mechanism")
    @classmethod
    def _known_mechanism(cls, value: str) -> str:
        lookup(MIGRATION_MECHANISMS, value, "migration mechanism")
        return value

    def pool_policy_context(self) -> Any:
        """The policy context, with how draining decode instances are emptied (``drain_migration``)."""
        ctx = self.policy_context()
        return msgspec.structs.replace(ctx, drain_migration=self.drain_mechanism if self.drain_by_migration else None)

    @field_validator("scaling_policy")
    @classmethod
    def _known_scaling_policy(cls, value: str) -> str:
        if value != "none":
            lookup(SCALING_POLICIES, value, "scaling policy")
        return value

    @model_validator(mode="after")
    def _scaling_needs_a_connector(self) -> PlannerSettings:
        if self.scaling_policy != "none" and self.connector == "none":
            raise ValueError(f"scaling_policy {self.scaling_policy} needs a connector (local or kubernetes)")
        return self

    @model_validator(mode="after")
    def _timeouts(self) -> PlannerSettings:
        if self.command_timeout_s <= self.drain_timeout_s:
            raise ValueError("command_timeout_s must exceed drain_timeout_s (the sidecar drains before it answers)")
        return self
