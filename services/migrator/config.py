"""Migrator settings (env prefix ``POISE_MIGRATOR_``, or the matching ``--flags``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from shared.elected import ElectedServiceSettings
from shared.policies.migration import MIGRATION_POLICIES
from shared.settings import SloPlanSettings, settings_config


class MigratorSettings(SloPlanSettings, ElectedServiceSettings):
    """Leader-elected loop: cluster snapshot -> migration policy -> decode-to-decode moves.

    ``profile`` is the engines' latency model: ARES' cost filter prices a move with it (a re-prefill of the
    context for ``recompute``, the KV copy for ``kv-transfer``)."""

    model_config = settings_config("POISE_MIGRATOR_")

    policy: str = Field("none", description=f"Migration policy: one of {', '.join(sorted(MIGRATION_POLICIES))}.")
    mechanism: Literal["recompute", "kv-transfer"] = Field(
        "recompute", description="How a move is carried out: recompute (re-prefill prompt + generated tokens on the "
                                 "target through a prefill engine; works with stock SGLang) or kv-transfer (copy the KV "
                                 "decode to decode; engine_sim only, others fall back to recompute).")
    gather_timeout_s: float = Field(0.3, gt=0.0, description="Seconds to collect the gateways' in-flight requests.")
    move_timeout_s: float = Field(60.0, gt=0.0, description="Seconds to wait for a gateway to report a move's outcome.")

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        if value not in MIGRATION_POLICIES:
            raise ValueError(f"unknown migration policy {value!r}; known: {', '.join(sorted(MIGRATION_POLICIES))}")
        return value
