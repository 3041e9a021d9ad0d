"""Renderers: chat messages <-> tokens with per-token weights (``chatml``, ``role_colon``)."""

from __future__ import annotations

from typing import Any

from opentinker.renderers.base import Message, Renderer, TrainOn, check_messages
from opentinker.renderers.chatml import ChatMLRenderer
from opentinker.renderers.role_colon import RoleColonRenderer

RENDERERS: dict[str, type[Renderer]] = {"chatml": ChatMLRenderer, "role_colon": RoleColonRenderer}


def get_renderer(name: str, tokenizer: Any) -> Renderer:
    """A renderer by name; ``"auto"`` picks ChatML when the tokenizer's template is ChatML."""
    if name == "auto":
        name = (
            "chatml" if "<|im_start|>" in (getattr(tokenizer, "chat_template", None) or "") else "role_colon"
        )
    if name not in RENDERERS:
        raise ValueError(f"unknown renderer {name!r}; known: {sorted(RENDERERS)} or 'auto'")
    return RENDERERS[name](tokenizer)


__all__ = [
    "RENDERERS",
    "ChatMLRenderer",
    "Message",
    "Renderer",
    "RoleColonRenderer",
    "TrainOn",
    "check_messages",
    "get_renderer",
]
