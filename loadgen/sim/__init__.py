"""The virtual-time cluster simulator: replays a trace against a policy mix with the live system's
latency model (``shared.latency``) and policy objects (``shared.policies``), in seconds of wall time.

Results are :class:`loadgen.replay.ReplayResult` values, so the live replay's metrics and report code serve
both. See ``cluster.py`` for what is modelled and ``baselines.py`` for the named policy mixes.
"""
