"""Migrator settings (env prefix ``POISE_MIGRATOR_``, or the matching ``--flags``)."""

from __future__ import annotations

from pydantic import Field, field_validator

from shared.policies.migration import MIGRATION_POLICIES
from shared.settings import ControlPlaneSettings, settings_config


class MigratorSettings(ControlPlaneSettings):
    """Leader-elected loop: cluster snapshot -> migration policy -> decode-to-decode moves."""

    model_config = settings_config("POISE_MIGRATOR_")

    policy: str = Field("none", description=f"Migration policy: one of {', '.join(sorted(MIGRATION_POLICIES))}.")
    tick_interval_s: float = Field(2.0, gt=0.0, description="Seconds between policy decisions (while this replica leads).")
    leader_ttl_s: int = Field(5, ge=1, description="Leader-election lease TTL in seconds: a dead leader is replaced within about this long.")
    snapshot_timeout_s: float = Field(2.0, gt=0.0, description="Seconds to wait for the monitor's cluster snapshot.")
    replica_id: str | None = Field(None, description="Name of this replica in leader election and status; unset = hostname:pid.")

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        if value not in MIGRATION_POLICIES:
            raise ValueError(f"unknown migration policy {value!r}; known: {', '.join(sorted(MIGRATION_POLICIES))}")
        return value
