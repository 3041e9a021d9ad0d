"""The OpenAI-compatible routes' answers, whole and streamed (:mod:`openai_routes`), as the
``openai`` package's own response types: ``ChatCompletion`` / ``ChatCompletionChunk`` and
``Completion`` (a streamed completion's chunks are ``Completion`` objects too, as OpenAI sends).

A stream is Server-Sent Events: ``data: <chunk JSON>`` per event, ending with ``data: [DONE]``
(:data:`DONE`); its chunks are built here (:func:`chat_first`, the assistant role sent at once)
and sent as the samples decode by :mod:`openai_stream`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from openai.types import Completion, CompletionChoice, CompletionUsage
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessage
from openai.types.chat.chat_completion import Choice as ChatChoice
from openai.types.chat.chat_completion import ChoiceLogprobs
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice
from openai.types.chat.chat_completion_chunk import (
    ChoiceDelta,
)
from openai.types.chat.chat_completion_chunk import ChoiceLogprobs as ChunkLogprobs

from opentinker.server.openai_format import Choice, chat_logprobs, completion_logprobs


@dataclass
class Answer:
    """What a request's samples came to: its choices (in order) and their usage."""

    id: str
    model: str
    choices: list[Choice]
    usage: CompletionUsage
    logprobs: int | None  # None: no logprobs asked; else how many top logprobs per token
    as_ids: bool  # logprob tokens as ``token_id:<id>``
    notes: list[str]
    created: int = 0

    def __post_init__(self) -> None:
        self.created = self.created or int(time.time())


def _dump(obj: Any) -> dict[str, Any]:
    return obj.model_dump(mode="json", exclude_unset=True)


def chat_body(tok: Any, a: Answer) -> dict[str, Any]:
    choices = []
    for i, c in enumerate(a.choices):
        message = ChatCompletionMessage(
            role="assistant", content=c.text if c.text or not c.tool_calls else None
        )
        if c.tool_calls:
            message.tool_calls = list(c.tool_calls)
        lps = None
        if a.logprobs is not None:
            lps = ChoiceLogprobs(content=chat_logprobs(tok, c, a.logprobs, a.as_ids))
        choices.append(ChatChoice(index=i, message=message, finish_reason=c.finish_reason, logprobs=lps))  # type: ignore[arg-type]
    body = ChatCompletion(
        id=a.id, object="chat.completion", created=a.created, model=a.model, choices=choices, usage=a.usage
    )
    return _with_notes(_dump(body), a.notes)


def completion_body(tok: Any, a: Answer) -> dict[str, Any]:
    choices = [
        CompletionChoice(
            index=i,
            text=c.text,
            finish_reason="length" if c.finish_reason == "length" else "stop",
            logprobs=None if a.logprobs is None else completion_logprobs(tok, c, a.logprobs, a.as_ids),
        )
        for i, c in enumerate(a.choices)
    ]
    body = Completion(
        id=a.id, object="text_completion", created=a.created, model=a.model, choices=choices, usage=a.usage
    )
    return _with_notes(_dump(body), a.notes)


def _with_notes(body: dict[str, Any], notes: list[str]) -> dict[str, Any]:
    if notes:  # e.g. tools rendered in a format this server does not parse (openai_format.py)
        body["tool_call_format"] = None
        body["notes"] = notes
    return body


def sse(obj: Any) -> str:
    data = obj if isinstance(obj, dict) else _dump(obj)
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


DONE = "data: [DONE]\n\n"


def chat_first(id_: str, model: str, created: int, n: int) -> str:
    """The stream's first event: each choice's assistant role (sent before sampling ends)."""
    choices = [
        ChunkChoice(index=i, delta=ChoiceDelta(role="assistant", content=""), finish_reason=None)
        for i in range(n)
    ]
    return sse(_chunk(id_, model, created, choices))


def _chunk(
    id_: str, model: str, created: int, choices: list[ChunkChoice], usage: Any = None
) -> ChatCompletionChunk:
    chunk = ChatCompletionChunk(
        id=id_, object="chat.completion.chunk", created=created, model=model, choices=choices
    )
    if usage is not None:
        chunk.usage = usage
    return chunk


def _chunk_logprobs(tok: Any, a: Answer, c: Choice, span: range) -> ChunkLogprobs | None:
    if a.logprobs is None:
        return None
    return ChunkLogprobs(content=chat_logprobs(tok, c, a.logprobs, a.as_ids, span))
