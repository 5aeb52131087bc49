"""Migrator settings (env prefix ``POISE_MIGRATOR_``, or the matching ``--flags``)."""

from __future__ import annotations

from pydantic import Field, field_validator

from shared.elected import ElectedServiceSettings
from shared.policies.migration import MIGRATION_POLICIES
from shared.settings import settings_config


class MigratorSettings(ElectedServiceSettings):
    """Leader-elected loop: cluster snapshot -> migration policy -> decode-to-decode moves."""

    model_config = settings_config("POISE_MIGRATOR_")

    policy: str = Field("none", description=f"Migration policy: one of {', '.join(sorted(MIGRATION_POLICIES))}.")

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        if value not in MIGRATION_POLICIES:
            raise ValueError(f"unknown migration policy {value!r}; known: {', '.join(sorted(MIGRATION_POLICIES))}")
        return value
