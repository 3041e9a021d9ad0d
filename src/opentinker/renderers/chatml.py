"""ChatML (``<|im_start|>role\\ncontent<|im_end|>\\n``): SmolLM2's and ``opentinker/tiny``'s format.

The default system turn that a model's own chat template inserts when a conversation has none is
read from the template itself, so prompts equal ``tokenizer.apply_chat_template(...,
add_generation_prompt=True)`` token for token (tested).
"""

from __future__ import annotations

from typing import Any

from opentinker.renderers.base import Message, Renderer

IM_START, IM_END = "<|im_start|>", "<|im_end|>"


def template_default_system(tokenizer: Any) -> str | None:
    """The system message the tokenizer's chat template adds to a conversation without one."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    text = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)
    head = f"{IM_START}system\n"
    if not text.startswith(head):
        return None
    return text[len(head) : text.index(IM_END)]


class ChatMLRenderer(Renderer):
    name = "chatml"

    def __init__(self, tokenizer: Any, default_system: str | bool | None = True) -> None:
        super().__init__(tokenizer)
        end = tokenizer.convert_tokens_to_ids(IM_END)
        if not isinstance(end, int) or end == getattr(tokenizer, "unk_token_id", None):
            raise ValueError(f"tokenizer has no {IM_END} token: ChatML needs it")
        self.end_id: int = end
        self.default_system = (
            template_default_system(tokenizer) if default_system is True else default_system or None
        )
        self._nl = self.encode("\n")

    def _header(self, role: str) -> list[int]:
        return self.encode(f"{IM_START}{role}\n")

    def _body(self, content: str) -> list[int]:
        return [*self.encode(content), self.end_id]

    def _trailer(self) -> list[int]:
        return list(self._nl)

    def _end_marker(self) -> list[int]:
        return [self.end_id]

    @property
    def stop(self) -> list[int]:
        return [self.end_id]

    def _strip_end(self, text: str) -> tuple[str, bool]:
        if IM_END in text:
            return text[: text.index(IM_END)], True
        return text, False

    def _prefix(self, messages: list[Message]) -> list[Message]:
        if self.default_system is not None and (not messages or messages[0]["role"] != "system"):
            return [{"role": "system", "content": self.default_system}]
        return []
