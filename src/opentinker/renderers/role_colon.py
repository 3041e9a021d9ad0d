"""A model-agnostic plain-text format: ``User: …\\n\\nAssistant: …\\n\\n``.

Works with any tokenizer (no special tokens). A turn ends at a blank line, so the sampling stop is
the string ``"\\n\\n"`` and replies are single paragraphs.
"""

from __future__ import annotations

from opentinker.renderers.base import Renderer

END = "\n\n"


class RoleColonRenderer(Renderer):
    name = "role_colon"

    def _header(self, role: str) -> list[int]:
        return self.encode(f"{role.capitalize()}:")

    def _body(self, content: str) -> list[int]:
        return self.encode(f" {content}{END}")

    def _trailer(self) -> list[int]:
        return []

    def _end_marker(self) -> list[int]:
        return self.encode(END)

    @property
    def stop(self) -> list[str]:
        return [END]

    def _strip_end(self, text: str) -> tuple[str, bool]:
        text = text[1:] if text.startswith(" ") else text
        if END in text:
            return text[: text.index(END)], True
        return text, False
