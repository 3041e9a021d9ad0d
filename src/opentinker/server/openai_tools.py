"""Hermes tool calls streamed as they decode (:mod:`openai_stream`), the way OpenAI streams them.

A chat stream with tools in the Hermes format (:mod:`openai_format`) sends, per choice:

* the text before the first ``<tool_call>`` as ``content`` (a tail that may be the start of
  ``<tool_call>``, and trailing whitespace, wait until the next tokens show what they are);
* for each ``<tool_call>`` block, once its JSON shows the function's name, a first delta with the
  call's ``id``, ``type`` and ``function.name`` (``arguments`` empty), then ``arguments`` string
  deltas as the arguments' JSON arrives.

**Arguments as the whole answer has them.** A whole answer's ``arguments`` is the parsed value
written back by ``json.dumps`` (:func:`~opentinker.server.openai_format.parse_tool_calls`), so
the model's own spacing is not what it sends. The stream sends the same: the arguments' JSON is
read token by lexical token (:func:`partial_call`), and each complete token is written as
``json.dumps`` writes it (``", "`` and ``": "`` between items, strings and numbers re-encoded), so
the deltas concatenate to the whole answer's ``arguments``. A token is sent only once it is
complete (a string once closed, a number once something follows it). Arguments given as a JSON
string are sent once the string is closed, as that string.

What decoding shows can still turn out otherwise: JSON that never closes or does not parse stays
text in the whole answer, but a call whose name was sent is not taken back. The stream's end
settles the rest against the whole answer (:mod:`openai_stream`).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from openai.types.chat.chat_completion_chunk import ChoiceDeltaToolCall, ChoiceDeltaToolCallFunction

OPEN, CLOSE = "<tool_call>", "</tool_call>"
ARG_KEYS = ("arguments", "parameters")
_TOKEN = re.compile(
    r"\s*(?:"
    r'(?P<s>"(?:[^"\\\x00-\x1f]|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))*")'
    r"|(?P<n>-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?)"
    r"|(?P<l>true|false|null)"
    r"|(?P<p>[{}\[\]:,]))"
)
_NUMBER_GOES_ON = set(".eE+-0123456789")


def _tokens(raw: str) -> list[tuple[str, str]]:
    """The complete JSON tokens at the start of ``raw`` (kind ``s``/``n``/``l``/``p``, text)."""
    out, at = [], 0
    while (m := _TOKEN.match(raw, at)) is not None:
        kind = m.lastgroup
        assert kind is not None
        if kind == "n" and (m.end() == len(raw) or raw[m.end()] in _NUMBER_GOES_ON):
            break  # the number may go on
        out.append((kind, m.group(kind)))
        at = m.end()
    return out


def _value_end(toks: list[tuple[str, str]], i: int) -> int | None:
    """The index after the value starting at ``toks[i]``; None: it is not complete yet."""
    if toks[i][0] != "p":
        return i + 1
    depth = 0
    for j in range(i, len(toks)):
        kind, t = toks[j]
        if kind == "p" and t in "{[":
            depth += 1
        elif kind == "p" and t in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
    return None


def _dumped(toks: list[tuple[str, str]]) -> str:
    """Tokens as ``json.dumps`` writes the value they make (default separators)."""
    out = []
    for kind, t in toks:
        if kind in "sn":
            out.append(json.dumps(json.loads(t)))
        else:
            out.append({":": ": ", ",": ", "}.get(t, t))
    return "".join(out)


def partial_call(raw: str) -> tuple[str | None, str]:
    """The function name (None: not known yet) and the arguments as far as they are known, as
    the whole answer will write them, from the start of a ``<tool_call>`` block's JSON."""
    toks = _tokens(raw)
    if not toks or toks[0] != ("p", "{"):
        return None, ""
    name, args, i, key = None, None, 1, None
    while i < len(toks):
        kind, t = toks[i]
        if kind == "p" and t in "},":
            if t == "}":
                break
            key, i = None, i + 1
            continue
        if key is None:  # a key, then ":"
            if kind != "s" or i + 1 >= len(toks) or toks[i + 1] != ("p", ":"):
                break
            key, i = json.loads(t), i + 2
            continue
        end = _value_end(toks, i)
        if key == "name" and kind == "s" and name is None:
            name = json.loads(t)
        elif key in ARG_KEYS and args is None:
            value = toks[i : end if end is not None else len(toks)]
            if kind == "s":
                args = json.loads(t)
            else:
                args = _dumped(value)
        if end is None:
            break
        i = end
    return name, args or ""


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
        return new, self._calls(text, first)

    def _calls(self, text: str, at: int) -> list[ChoiceDeltaToolCall]:
        deltas, j = [], 0
        while at >= 0:
            start = at + len(OPEN)
            end = text.find(CLOSE, start)
            name, args = partial_call(text[start:] if end < 0 else text[start:end])
            if name is None:
                break
            if j == len(self.calls):
                self.calls.append(SentCall(f"call_{uuid.uuid4().hex[:24]}", name))
                fn = ChoiceDeltaToolCallFunction(name=name, arguments="")
                deltas.append(ChoiceDeltaToolCall(index=j, id=self.calls[j].id, type="function", function=fn))
            deltas += self.more_arguments(j, args)
            if end < 0:
                break
            at, j = text.find(OPEN, end + len(CLOSE)), j + 1
        return deltas

    def more_arguments(self, j: int, args: str) -> list[ChoiceDeltaToolCall]:
        """Call ``j``'s arguments delta up to ``args`` (none if nothing new or not a follow-on)."""
        sent = self.calls[j].arguments
        if len(args) <= len(sent) or not args.startswith(sent):
            return []
        self.calls[j].arguments = args
        fn = ChoiceDeltaToolCallFunction(arguments=args[len(sent) :])
        return [ChoiceDeltaToolCall(index=j, function=fn)]
