"""The output: a latency profile JSON that ``shared.latency.load_profile`` reads, plus how it was made.

The six timing coefficients are measured. What the engine reports about itself is read from ``/server_info``
(KV capacity, max running requests, chunk size, TP). Everything else cannot be measured over HTTP on one
colocated engine (KV bytes per token, transfer cost, role-switch time, layers and operators per layer) and is
copied from a base profile. The file's ``profiling`` object (ignored by ``load_profile``, which reads only the
profile's fields) says which field came from where, and holds the measurements and the fit's quality.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import msgspec

from services.profiler.fit import DecodeFit, PrefillFit
from services.profiler.target import EngineTarget
from shared.errors import ConfigError, PoiseError
from shared.latency import DEFAULT_PROFILE, LatencyModel, LatencyProfile, load_profile

MEASURED_FIELDS = ("prefill_overhead_s", "prefill_s_per_token", "prefill_s_per_token2", "decode_overhead_s",
                   "decode_s_per_seq", "decode_s_per_context_token")


def base_profile(target: EngineTarget, requested: str | None) -> tuple[LatencyProfile, str]:
    """The profile to copy unmeasurable fields from: ``--base-profile``; else the profile an engine_sim emulates
    (its path, then its name, when readable here); else the default. Returns it and how it was chosen."""
    if requested:
        return load_profile(requested), f"--base-profile {requested}"
    gp = target.gpu_profile or {}
    for key in ("source", "name"):
        candidate = gp.get(key)
        if isinstance(candidate, str) and candidate:
            try:
                return load_profile(candidate), f"the engine's gpu_profile {key} {candidate!r}"
            except ConfigError:
                continue
    return load_profile(DEFAULT_PROFILE), f"the default profile {DEFAULT_PROFILE!r}"


def build_profile(base: LatencyProfile, prefill: PrefillFit, decode: DecodeFit, target: EngineTarget, *,
                  name: str, labels: dict[str, tuple[str, str]] | None = None,
                  provenance: list[str]) -> tuple[LatencyProfile, dict[str, str]]:
    """The fitted profile and, per field, where its value came from. ``labels``: model / gpu names to set, each
    with where it came from (a flag, the engine)."""
    sources = {f: f"base:{base.name}" for f in base.__struct_fields__ if f not in ("name", "provenance")}
    values: dict[str, Any] = {
        "prefill_overhead_s": prefill.overhead_s, "prefill_s_per_token": prefill.s_per_token,
        "prefill_s_per_token2": prefill.s_per_token2, "decode_overhead_s": decode.overhead_s,
        "decode_s_per_seq": decode.s_per_seq, "decode_s_per_context_token": decode.s_per_context_token,
    }
    sources.update(dict.fromkeys(MEASURED_FIELDS, "measured"))
    reported: dict[str, Any] = {"kv_capacity_tokens": target.kv_capacity_tokens,
                                "max_running_requests": target.max_running_requests}
    if target.chunked_prefill_size is not None:
        reported["chunked_prefill_size"] = target.chunked_prefill_size
    if target.tp is not None:
        reported["tp"] = target.tp
    values.update(reported)
    sources.update(dict.fromkeys(reported, "server_info"))
    for field, (value, source) in (labels or {}).items():
        values[field] = value
        sources[field] = source
    try:
        profile = msgspec.structs.replace(base, name=name, provenance=provenance, **values)
        msgspec.json.decode(msgspec.json.encode(profile), type=LatencyProfile)  # runs the profile's own checks
    except (ConfigError, msgspec.ValidationError) as exc:
        raise PoiseError(f"the fitted profile is not valid: {exc}") from exc
    return profile, sources


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float (a standard error with no spare points is inf) as None: strict JSON,
    which the profile's reader (msgspec) requires."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def write_profile(profile: LatencyProfile, profiling: dict[str, Any], path: Path) -> LatencyProfile:
    """Write the profile with its ``profiling`` object, load it back the way every consumer does, and build a
    LatencyModel from it (so a file that would not load is never left looking finished)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    document = json_safe({**msgspec.to_builtins(profile), "profiling": msgspec.to_builtins(profiling)})
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(document, indent=2, allow_nan=False) + "\n")
    try:
        loaded = load_profile(tmp)
        LatencyModel(loaded).prefill_time_s(1024)
    except ConfigError as exc:
        tmp.unlink(missing_ok=True)
        raise PoiseError(f"the profile written to {path} does not load back: {exc}") from exc
    tmp.replace(path)
    return loaded
