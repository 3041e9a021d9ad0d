"""``chat_sft``: supervised fine-tuning on a chat JSONL (``{"messages": [...]}`` per line).

``cfg.data`` / ``cfg.eval_data`` name the files; with ``cfg.data`` empty the bundled arithmetic set
is used (``data/arithmetic_chat.jsonl``, 500 conversations, and ``data/arithmetic_chat_eval.jsonl``,
100; built by ``scripts/make_chat_data.py``): 2-digit additions phrased as the ``addition`` RL task
asks them, none of them one of its 200 held-out evaluation problems. A user file without
``cfg.eval_data`` has no eval set.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from opentinker.renderers import Renderer
from opentinker.sft.data import SupervisedData, load_supervised

DATA_DIR = Path(__file__).resolve().parent / "data"
BUNDLED_TRAIN = DATA_DIR / "arithmetic_chat.jsonl"
BUNDLED_EVAL = DATA_DIR / "arithmetic_chat_eval.jsonl"


def build(renderer: Renderer, cfg: Any) -> tuple[SupervisedData, SupervisedData | None]:
    """Registry entry: (train, eval) rendered with ``cfg.train_on``, ``cfg.max_length``, ``cfg.overlong``."""
    train_path, eval_path = (cfg.data, cfg.eval_data) if cfg.data else (BUNDLED_TRAIN, BUNDLED_EVAL)
    kw: dict[str, Any] = {"train_on": cfg.train_on, "max_length": cfg.max_length, "overlong": cfg.overlong}
    train = load_supervised(renderer, train_path, **kw)
    return train, (load_supervised(renderer, eval_path, **kw) if eval_path else None)
