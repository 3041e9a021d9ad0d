"""Where derived files live: the cache dir for converted models, run data and checkpoints.

Its own module so that both the name registry and the SmolLM2 converter can use it without
importing each other (the registry dispatches to the converter; the converter writes here).
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where converted models and other derived files live (``$OPENTINKER_CACHE`` overrides)."""
    env = os.environ.get("OPENTINKER_CACHE")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "opentinker"
