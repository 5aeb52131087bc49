"""Planner settings (env prefix ``POISE_PLANNER_``, or the matching ``--flags``)."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from shared.elected import ElectedServiceSettings
from shared.policies import POOL_POLICIES
from shared.settings import SloPlanSettings, settings_config


class PlannerSettings(SloPlanSettings, ElectedServiceSettings):
    """Leader-elected loop: cluster snapshot -> pool policy -> role commands to the sidecars."""

    model_config = settings_config("POISE_PLANNER_")

    policy: str = Field("static", description=f"Pool policy: one of {', '.join(sorted(POOL_POLICIES))}.")
    drain_timeout_s: float = Field(60.0, gt=0.0, description="Drain timeout, in seconds, sent with each role command (how long a sidecar waits for its engine to go idle).")
    command_timeout_s: float = Field(150.0, gt=0.0, description="Seconds to wait for a sidecar's answer to a role command (drain plus the switch itself).")

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        if value not in POOL_POLICIES:
            raise ValueError(f"unknown pool policy {value!r}; known: {', '.join(sorted(POOL_POLICIES))}")
        return value

    @model_validator(mode="after")
    def _timeouts(self) -> PlannerSettings:
        if self.command_timeout_s <= self.drain_timeout_s:
            raise ValueError("command_timeout_s must exceed drain_timeout_s (the sidecar drains before it answers)")
        return self
