"""The renderer contract: chat messages <-> tokens, with per-token training weights.

A renderer owns one conversation format. It turns a list of messages into the tokens the model
sees (``build_generation_prompt`` ends with the header of the assistant turn to be sampled), into a
supervised example whose per-token weights mark what is learned (``build_supervised_example``), and
turns sampled tokens back into a message (``parse_response``). Every message is encoded on its own,
so that a conversation's tokens are the concatenation of its messages' tokens: a multi-turn
episode's observation at turn t+1 then extends its observation and action at turn t exactly.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Literal, TypedDict

TrainOn = Literal["all_assistant", "last_assistant"]
ROLES = ("system", "user", "assistant", "tool")


class Message(TypedDict):
    role: str
    content: str


def check_messages(messages: list[Message], *, where: str = "messages") -> None:
    """Raise ``ValueError`` naming the first malformed message."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: expected a non-empty list of messages, got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(
                f"{where}[{i}]: expected an object with 'role' and 'content', got {type(m).__name__}"
            )
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise ValueError(f"{where}[{i}]: role must be one of {ROLES}, got {role!r}")
        if not isinstance(content, str):
            raise ValueError(f"{where}[{i}]: content must be a string, got {type(content).__name__}")


class Renderer(ABC):
    """One conversation format over one tokenizer."""

    name: str

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=False)

    # -- the format -------------------------------------------------------------------------------
    @abstractmethod
    def _header(self, role: str) -> list[int]:
        """Tokens that open a turn of ``role`` (what the generation prompt ends with)."""

    @abstractmethod
    def _body(self, content: str) -> list[int]:
        """Tokens of a turn's content including its end marker: what an assistant turn is trained on."""

    @abstractmethod
    def _trailer(self) -> list[int]:
        """Tokens after the end marker that separate turns (never trained on)."""

    @property
    @abstractmethod
    def stop(self) -> list[int] | list[str]:
        """Stop condition for sampling an assistant turn (``SamplingParams.stop``)."""

    @abstractmethod
    def _strip_end(self, text: str) -> tuple[str, bool]:
        """Remove the end marker from a decoded reply; say whether it was there."""

    def _prefix(self, messages: list[Message]) -> list[Message]:
        """Messages the format adds before the conversation (e.g. a template's default system turn)."""
        return []

    # -- built on the format ----------------------------------------------------------------------
    def message_tokens(self, message: Message) -> tuple[list[int], list[int], list[int]]:
        """(header, body, trailer) tokens of one message."""
        return self._header(message["role"]), self._body(message["content"]), self._trailer()

    def build_generation_prompt(self, messages: list[Message]) -> list[int]:
        check_messages(messages)
        tokens: list[int] = []
        for m in self._prefix(messages) + messages:
            h, b, t = self.message_tokens(m)
            tokens += h + b + t
        return tokens + self._header("assistant")

    def build_supervised_example(
        self, messages: list[Message], train_on: TrainOn = "all_assistant"
    ) -> tuple[list[int], list[float]]:
        """Tokens of the whole conversation and a weight per token: 1 on the trained assistant
        turns' bodies (content and end marker), 0 on everything else."""
        check_messages(messages)
        if train_on not in ("all_assistant", "last_assistant"):
            raise ValueError(f"train_on must be 'all_assistant' or 'last_assistant', got {train_on!r}")
        assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if not assistant:
            raise ValueError("messages: a supervised example needs at least one assistant message")
        trained = set(assistant if train_on == "all_assistant" else assistant[-1:])
        tokens: list[int] = []
        weights: list[float] = []
        for m in self._prefix(messages):
            h, b, t = self.message_tokens(m)
            tokens += h + b + t
            weights += [0.0] * (len(h) + len(b) + len(t))
        for i, m in enumerate(messages):
            h, b, t = self.message_tokens(m)
            on = 1.0 if i in trained else 0.0
            tokens += h + b + t
            weights += [0.0] * len(h) + [on] * len(b) + [0.0] * len(t)
        return tokens, weights

    def parse_response(self, tokens: list[int]) -> tuple[Message, bool]:
        """The assistant message in sampled ``tokens`` and whether it ended properly (end marker
        present, not cut by the token limit)."""
        text, ended = self._strip_end(self.decode(list(tokens)))
        return {"role": "assistant", "content": text}, ended

    def next_turn_tokens(self, reply_ended: bool, messages: list[Message]) -> list[int]:
        """Tokens that follow a sampled assistant reply when the conversation goes on with
        ``messages`` (environment feedback): the trailer (and the end marker if the reply was cut),
        then the new messages, then the next assistant header."""
        out = [] if reply_ended else self._end_marker()
        out += self._trailer()
        for m in messages:
            h, b, t = self.message_tokens(m)
            out += h + b + t
        return out + self._header("assistant")

    @abstractmethod
    def _end_marker(self) -> list[int]:
        """The tokens that close a turn's body."""
