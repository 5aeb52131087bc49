"""engine_sim: a stand-in for a GPU SGLang engine.

A real HTTP server process that speaks the subset of SGLang 0.5.23's HTTP API Poise uses, with SGLang's
semantics (continuous batching, chunked prefill, KV capacity, P→D handoff by bootstrap room, role switch
only when idle), and takes its timing, in real time, from Poise's latency model (shared/latency). It says
what it is: ``/server_info`` reports ``"engine": "poise-engine-sim"``, the emulated model and GPU profile.
See README.md in this folder.
"""

from services.engine_sim.config import EngineSimSettings
from services.engine_sim.engine import ENGINE_NAME, SimEngine

__all__ = ["ENGINE_NAME", "EngineSimSettings", "SimEngine"]
