"""Base models: resolve a name (built-in alias, local folder or HF id) and load it with its tokenizer."""

from opentinker.models.loader import BaseModel, load_base_model
from opentinker.models.registry import BUILTIN_MODELS, resolve_model_path

__all__ = ["BUILTIN_MODELS", "BaseModel", "load_base_model", "resolve_model_path"]
