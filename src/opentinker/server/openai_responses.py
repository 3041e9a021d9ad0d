"""The OpenAI-compatible routes' answers, whole and streamed (:mod:`openai_routes`), as the
``openai`` package's own response types: ``ChatCompletion`` / ``ChatCompletionChunk`` and
``Completion`` (a streamed completion's chunks are ``Completion`` objects too, as OpenAI sends).

A stream is Server-Sent Events: ``data: <chunk JSON>`` per event, ending with ``data: [DONE]``.
Each choice's text comes one piece per sampled token (pieces that concatenate to exactly the
whole answer's text, with that token's logprob when asked), then a chunk with its
``finish_reason``; with ``stream_options.include_usage`` a last chunk with no choices carries the
usage. Here the pieces follow one another once the sample is done (where tokens do not come
while decoding, see :mod:`openai_stream`, which streams the others token by token); the first
chunk (the assistant role) goes out at once.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from openai.types import Completion, CompletionChoice, CompletionUsage
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessage
from openai.types.chat.chat_completion import Choice as ChatChoice
from openai.types.chat.chat_completion import ChoiceLogprobs
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice
from openai.types.chat.chat_completion_chunk import (
    ChoiceDelta,
    ChoiceDeltaToolCall,
    ChoiceDeltaToolCallFunction,
)
from openai.types.chat.chat_completion_chunk import ChoiceLogprobs as ChunkLogprobs

from opentinker.server.openai_format import Choice, chat_logprobs, completion_logprobs, pieces


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


def chat_events(tok: Any, a: Answer, include_usage: bool) -> Iterator[str]:
    """The rest of a chat stream, after :func:`chat_first`."""
    for i, c in enumerate(a.choices):
        if c.tool_calls:
            if c.text:
                yield sse(
                    _chunk(
                        a.id, a.model, a.created, [ChunkChoice(index=i, delta=ChoiceDelta(content=c.text))]
                    )
                )
            calls = [
                ChoiceDeltaToolCall(
                    index=j,
                    id=call.id,
                    type="function",
                    function=ChoiceDeltaToolCallFunction(
                        name=call.function.name, arguments=call.function.arguments
                    ),
                )
                for j, call in enumerate(c.tool_calls)
            ]
            lps = _chunk_logprobs(tok, a, c, range(len(c.tokens)))
            yield sse(
                _chunk(
                    a.id,
                    a.model,
                    a.created,
                    [ChunkChoice(index=i, delta=ChoiceDelta(tool_calls=calls), logprobs=lps)],
                )
            )
        else:
            for t, piece in enumerate(pieces(tok, c.tokens, c.text)):
                lps = _chunk_logprobs(tok, a, c, range(t, t + 1))
                delta = ChoiceDelta(content=piece)
                yield sse(_chunk(a.id, a.model, a.created, [ChunkChoice(index=i, delta=delta, logprobs=lps)]))
        end = ChunkChoice(index=i, delta=ChoiceDelta(), finish_reason=c.finish_reason)  # type: ignore[arg-type]
        yield sse(_chunk(a.id, a.model, a.created, [end]))
    if include_usage:
        yield sse(_chunk(a.id, a.model, a.created, [], a.usage))
    yield DONE


def _chunk_logprobs(tok: Any, a: Answer, c: Choice, span: range) -> ChunkLogprobs | None:
    if a.logprobs is None:
        return None
    return ChunkLogprobs(content=chat_logprobs(tok, c, a.logprobs, a.as_ids, span))


def completion_events(tok: Any, a: Answer, include_usage: bool) -> Iterator[str]:
    """A completions stream: ``Completion`` chunks, one piece of one choice each."""

    def chunk(choices: list[CompletionChoice], usage: Any = None) -> str:
        body = Completion(
            id=a.id, object="text_completion", created=a.created, model=a.model, choices=choices
        )
        if usage is not None:
            body.usage = usage
        return sse(body)

    for i, c in enumerate(a.choices):
        reason = "length" if c.finish_reason == "length" else "stop"
        texts = pieces(tok, c.tokens, c.text) or [""]
        for t, piece in enumerate(texts):
            lps = None
            if a.logprobs is not None and t < len(c.tokens):
                one = Choice(
                    c.tokens[t : t + 1],
                    c.logprobs[t : t + 1],
                    c.top[t : t + 1] if c.top else None,
                    piece,
                    reason,
                )
                lps = completion_logprobs(tok, one, a.logprobs, a.as_ids)
            last = t == len(texts) - 1
            # a piece before the last has no finish_reason yet (built unvalidated: the type wants one)
            choice = CompletionChoice.model_construct(
                index=i, text=piece, finish_reason=reason if last else None, logprobs=lps
            )
            yield chunk([choice])
    if include_usage:
        yield chunk([], a.usage)
    yield DONE
