"""Named engine presets: what one kind of host needs for SGLang to start and serve, kept in one place.

A preset is a set of defaults for :class:`services.worker.config.WorkerSettings`: a field the operator sets
wins over the preset's value, and ``engine_env`` is merged (the operator's keys win). ``poise up --engines
sglang-cpu``, the real-SGLang test tier and a hand-run worker (``--engine-preset sglang-cpu``) all read the
same preset, so the flags that make SGLang run on a CPU are written once.

``sglang-cpu`` is SGLang 0.5.23 on an x86 CPU with AVX-512 (AMX where there is one) and SmolLM2-135M-Instruct,
as ``make sglang-setup`` installs it (``.venv-sglang``, from ``../shared/sglang-cpu/``). Each value answers a
failure seen without it (../shared/sglang-cpu/README.md):

- ``device cpu``, ``SGLANG_USE_CPU_ENGINE=1``: SGLang's CPU backend;
- ``attention_backend torch_native``: 0.5.23's ``intel_amx`` attention calls the prebuilt kernel with
  arguments it does not take;
- ``max_total_tokens 16384``: otherwise the KV pool takes most of the host's memory;
- ``disable_overlap_schedule``: a prefill engine's first request with a cached prefix fails otherwise (a CUDA
  event); every role gets it, since a decode engine may be switched to prefill;
- ``sleep_on_idle``: an idle scheduler otherwise polls, one core busy per engine, starving the rest of a small
  host (two idle engines on two cores made a 50-token answer take 89 s);
- ``decode_retraction_backup none``: the default ``host_pool`` registers pinned memory with CUDA;
- ``transfer_backend mooncake_tcp`` and ``SGLANG_HOST_IP``: KV over TCP, announced on the engine's own address;
- ``decode_cuda_graph_memory_gb 0``: a switch to decode is refused without a CUDA-graph memory budget.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared.settings import fill_unset

REPO = Path(__file__).resolve().parents[2]
#: The SGLang-for-CPU environment ``make sglang-setup`` makes; POISE_SGLANG_CPU_VENV points elsewhere.
SGLANG_CPU_VENV_ENV = "POISE_SGLANG_CPU_VENV"
SGLANG_CPU_MODEL = "SmolLM2-135M-Instruct"
#: The latency profile fitted to this preset's engines (one core each; shared/latency/profiles/), which the
#: planner and gateway policies plan with when `poise up` runs them.
SGLANG_CPU_PROFILE = "smollm2-135m-cpu"
#: (TTFT, TPOT) seconds such a pair can meet: a 1024-token prompt prefills in ~2.2 s on one core and a decode
#: step takes 80-560 ms, so Azure's 2 s / 0.15 s would be missed by almost every request however it is routed.
SGLANG_CPU_SLO_S = (4.0, 0.3)


def sglang_cpu_venv() -> Path:
    """Where the SGLang-for-CPU venv is (it may not exist: the worker's version check says so clearly)."""
    return Path(os.environ.get(SGLANG_CPU_VENV_ENV) or REPO / ".venv-sglang")


@dataclass(frozen=True)
class EnginePreset:
    """Defaults for the worker's engine fields (the names are :class:`WorkerSettings` fields)."""

    name: str
    description: str
    settings: dict[str, Any]
    #: Environment of the spawned engine; ``{host}`` is replaced by the address the engine is reached at.
    env: dict[str, str] = field(default_factory=dict)

    def apply(self, data: dict[str, Any]) -> dict[str, Any]:
        """``data`` (flags and env merged, before validation) with this preset's values where unset."""
        merged = fill_unset(data, self.settings)
        host = merged.get("advertise_host") or merged.get("engine_host") or "127.0.0.1"
        own = merged.get("engine_env") or {}
        if isinstance(own, str):  # an env var holds JSON; pydantic would parse it after this hook
            own = json.loads(own)
        merged["engine_env"] = {**{k: v.format(host=host) for k, v in self.env.items()}, **own}
        return merged


def _sglang_cpu() -> EnginePreset:
    venv = sglang_cpu_venv()
    return EnginePreset(
        name="sglang-cpu",
        description="SGLang 0.5.23 on this CPU with SmolLM2-135M-Instruct (make sglang-setup)",
        settings={
            "engine_kind": "sglang",
            "sglang_python": str(venv / "bin" / "python"),
            "model_path": str(venv / "models" / "smollm2-135m"),
            "model": SGLANG_CPU_MODEL,
            "transfer_backend": "mooncake_tcp",
            "device": "cpu",
            "attention_backend": "torch_native",
            "max_total_tokens": 16384,
            "disable_overlap_schedule": True,
            "sleep_on_idle": True,
            "decode_retraction_backup": "none",
            "decode_cuda_graph_memory_gb": 0.0,
        },
        env={"SGLANG_USE_CPU_ENGINE": "1", "SGLANG_HOST_IP": "{host}"},
    )


def engine_preset(name: str) -> EnginePreset:
    """The preset called ``name``; ``ValueError`` naming the known ones otherwise."""
    presets = {"sglang-cpu": _sglang_cpu}
    if name not in presets:
        raise ValueError(f"unknown engine preset {name!r}; known: {', '.join(presets)}")
    return presets[name]()
