"""``poise profile``: measure a running SGLang-API engine and fit a latency profile (shared/latency) to it.

What Arrow and DOPD do at cluster start (spec-arrow-dopd.md A3, B7.1, C1-C2): TTFT against input length and
decode step time against batch size and context, measured over the engine's HTTP API only, then fitted to the
latency model's shapes by least squares. See README.md in this folder.

Modules, one idea each: ``target`` (what the engine says about itself), ``plan`` (what to measure),
``prompts`` (token-id prompts), ``prefill`` and ``decode`` (the measurements), ``samples`` (their records),
``fit`` (least squares), ``profile_doc`` (the profile JSON), ``report`` and ``plot`` (tables, PNG), ``cli``.
"""
