"""Hermes tool calls, whole and streamed (:mod:`openai_format`, :mod:`openai_stream`), read by
one rule so that a stream always adds up to the whole answer.

**The rule** (:func:`call_of`). A ``<tool_call>`` block is the text from ``<tool_call>`` to the
first ``</tool_call>`` after it; it is a call if its text (whitespace stripped) is a JSON object
with a string ``name`` (the arguments under ``arguments`` or ``parameters``, an object or a JSON
string). Anything else, and a block that never closes (cut off at ``max_tokens``), stays text in
``content``: never sent as ``tool_calls``, whole or streamed, and never guessed at.

**Streamed**, per choice (:class:`ToolText`):

* the text before the first ``<tool_call>`` as ``content`` (a tail that may be the start of
  ``<tool_call>``, and trailing whitespace, wait until the next tokens show what they are);
* each call once its block has closed and parsed, and every block before it has closed: a delta
  with its ``id``, ``type`` and ``function.name`` (``arguments`` empty), then one with its
  ``arguments`` as the whole answer writes them (``json.dumps`` of the parsed value).

A call's name cannot be sent before its block closes: until then the block may still be cut off
or turn out not to be JSON, and a call sent cannot be taken back (an agent would run it). The
stream's end settles the content against the whole answer (:mod:`openai_stream`).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from openai.types.chat.chat_completion_chunk import ChoiceDeltaToolCall, ChoiceDeltaToolCallFunction

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def call_of(block: str) -> tuple[str, str] | None:
    """A block's (name, arguments as the answer writes them), or None: it is not a call."""
    try:
        call = json.loads(block.strip())
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    args = call.get("arguments", call.get("parameters", {}))
    return call["name"], args if isinstance(args, str) else json.dumps(args)


def blocks(text: str) -> list[tuple[int, int, tuple[str, str] | None]]:
    """The closed ``<tool_call>`` blocks of ``text``, in order: (start, end, their call or None)."""
    out, at = [], text.find(OPEN)
    while at >= 0:
        end = text.find(CLOSE, at + len(OPEN))
        if end < 0:
            break
        out.append((at, end + len(CLOSE), call_of(text[at + len(OPEN) : end])))
        at = text.find(OPEN, end + len(CLOSE))
    return out


@dataclass
class SentCall:
    id: str
    name: str
    arguments: str = ""


@dataclass
class ToolText:
    """What a choice's stream has sent of a Hermes answer: its content, and its calls."""

    content: str = ""
    calls: list[SentCall] = field(default_factory=list)

    def update(self, text: str) -> tuple[str, list[ChoiceDeltaToolCall]]:
        """From the stable text so far: the new content, and the tool-call deltas to send (in
        order; a call's first delta is its id, type and name)."""
        first = text.find(OPEN)
        if first < 0:
            held = max((k for k in range(1, len(OPEN)) if text.endswith(OPEN[:k])), default=0)
            before = text[: len(text) - held]
        else:
            before = text[:first]
        before = before.rstrip()
        new = ""
        if len(before) > len(self.content) and before.startswith(self.content):
            new, self.content = before[len(self.content) :], before
        calls = [call for _, _, call in blocks(text) if call is not None]
        deltas = []
        for j in range(len(self.calls), len(calls)):
            name, args = calls[j]
            self.calls.append(SentCall(f"call_{uuid.uuid4().hex[:24]}", name))
            fn = ChoiceDeltaToolCallFunction(name=name, arguments="")
            deltas.append(ChoiceDeltaToolCall(index=j, id=self.calls[j].id, type="function", function=fn))
            deltas += self.more_arguments(j, args)
        return new, deltas

    def more_arguments(self, j: int, args: str) -> list[ChoiceDeltaToolCall]:
        """Call ``j``'s arguments delta up to ``args`` (none if nothing new or not a follow-on)."""
        sent = self.calls[j].arguments
        if len(args) <= len(sent) or not args.startswith(sent):
            return []
        self.calls[j].arguments = args
        fn = ChoiceDeltaToolCallFunction(arguments=args[len(sent) :])
        return [ChoiceDeltaToolCall(index=j, function=fn)]
