"""The latency model (one copy, used by engine_sim and the simulator) and its profiles."""

from shared.latency.model import (
    DEFAULT_PROFILE,
    LatencyModel,
    LatencyProfile,
    available_profiles,
    load_profile,
    save_profile,
)

__all__ = ["DEFAULT_PROFILE", "LatencyModel", "LatencyProfile", "available_profiles", "load_profile", "save_profile"]
