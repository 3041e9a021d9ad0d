"""Streams of the OpenAI-compatible routes (:mod:`openai_routes`) sent token by token, while the
samples decode.

**Tokens in.** A streamed request is sampled with a
:class:`~opentinker.sampling.types.TokenSink` (``SamplingClient.sample_streamed``): the rollout
loop (or a rollout worker, through its pool) hands it each sample's new tokens after every decode
step. :class:`Feed` carries them from that thread to the stream's event loop.

**Text out: only what is stable.** Each choice's text so far is its tokens decoded whole
(:class:`TextSoFar`), and a chunk sends only what no later token can change:

* trailing ``U+FFFD``: an incomplete UTF-8 character (a byte-level token that splits one) waits
  for the tokens that complete it;
* text from a stop string on is never sent (OpenAI's rule), and a tail that may be the start of
  a stop string waits until the next tokens show it is not one;
* with a tokenizer that cleans up spaces before punctuation on decode, trailing whitespace waits.

**A lost worker.** A request whose rollout worker dies mid-stream runs again elsewhere, and its
tokens come again from the first: every stream is seeded (:mod:`openai_routes`), so they are the
same tokens, those already taken are skipped, and the text goes on where it stopped.

So what a stream has sent is always the start of the whole answer's text; when the samples end,
each choice's rest (the whole text after what was sent) goes out with its ``finish_reason``, then
the usage (``stream_options.include_usage``, counted from the result: exact). Tokens a choice
received but has not sent text for yet have their logprobs in the next chunk of that choice.

**Tool calls.** A chat stream with tools in the Hermes format sends its content and its tool
calls as OpenAI does, each call once its block has closed and parsed (:mod:`openai_tools`), so a
call cut off at ``max_tokens`` or not JSON is never sent: the stream equals the whole answer.

Where tokens do not come while decoding (the vLLM backend, sampling inside the scheduler's ticks),
a choice's pieces, one per token, follow one another once the samples are done (a tool stream's
deltas too, the result's tokens fed one by one).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

from openai.types import Completion, CompletionChoice
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice
from openai.types.chat.chat_completion_chunk import (
    ChoiceDelta,
    ChoiceDeltaToolCall,
    ChoiceDeltaToolCallFunction,
)

from opentinker.server import openai_responses as R
from opentinker.server.openai_format import Choice, completion_logprobs, pieces
from opentinker.server.openai_tools import SentCall, ToolText
from opentinker.service.sampling import Tokens, TokenSink

log = logging.getLogger(__name__)


class ClientGone(Exception):
    """The client disconnected before its answer was complete."""


class Feed:
    """Tokens from the rollout thread to this event loop's stream (make it on that loop)."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[int, Tokens]] = asyncio.Queue()

    def sink(self, prompt: int) -> TokenSink:
        """The sink of prompt ``prompt``'s sample request."""

        def deliver(piece: Tokens) -> None:
            with contextlib.suppress(RuntimeError):  # the stream's loop is closed: nobody reads
                self.loop.call_soon_threadsafe(self.queue.put_nowait, (prompt, piece))

        return TokenSink(deliver)


class TextSoFar:
    """One choice while it decodes: its tokens, and the text sent of them (module docstring)."""

    def __init__(self, tok: Any, stops: list[str]) -> None:
        self.tok, self.stops = tok, stops
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.top: list[list[tuple[int, float]]] | None = None
        self.sent = ""  # the text sent so far
        self.covered = 0  # tokens whose logprobs were sent
        self.diverged = False  # a re-run sent other tokens (see add)
        self.tool: ToolText | None = None  # a chat stream's with Hermes tools: what it sent
        self.hold_spaces = bool(getattr(tok, "clean_up_tokenization_spaces", False))

    def add(self, piece: Tokens) -> bool:
        """Take the next tokens (False: none new). A request run again after its rollout worker
        was lost sends its tokens from the start: seeded, they are the tokens already here, which
        are skipped, and the stream goes on from where it was. Should they differ (they cannot
        with a seed, bar a near tie the re-run's rounding breaks the other way), nothing more is
        taken: the result settles what was sampled (:meth:`rest`)."""
        have, end = len(self.tokens), piece.start + len(piece.tokens)
        if self.diverged or piece.start > have:
            return False
        if self.tokens[piece.start : end] != piece.tokens[: have - piece.start]:
            self.diverged = True
            log.warning("a re-run request sampled other tokens than its stream sent; it stops here")
            return False
        skip = have - piece.start
        if skip >= len(piece.tokens):
            return False
        self.tokens += piece.tokens[skip:]
        self.logprobs += piece.logprobs[skip:]
        if piece.topk is not None:
            self.top = (self.top or []) + piece.topk[skip:]
        return True

    def stable(self) -> str:
        """The text of the tokens so far that no later token can change."""
        text = self.tok.decode(self.tokens, skip_special_tokens=True)
        cut = min((i for s in self.stops if (i := text.find(s)) >= 0), default=-1)
        if cut >= 0:
            return text[:cut]
        text = text.rstrip("\ufffd")
        held = max((k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        text = text[: len(text) - held]
        return text.rstrip() if self.hold_spaces else text

    def new_text(self) -> str:
        """The stable text not sent yet (now counted as sent)."""
        text = self.stable()
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            return ""
        new, self.sent = text[len(self.sent) :], text
        return new

    def rest(self, final: Choice) -> str:
        """The final text after what was sent."""
        if final.text.startswith(self.sent):
            return final.text[len(self.sent) :]
        log.warning("a stream sent text that is not the start of its answer; the rest is left out")
        return ""

    def so_far(self) -> Choice:
        return Choice(self.tokens, self.logprobs, self.top, self.sent, "stop")


class Live:
    """A stream's chunks while its samples decode, then their ends (module docstring)."""

    def __init__(
        self, tok: Any, req: Any, stub: R.Answer, n: int, *, chat: bool, tools: bool = False
    ) -> None:
        self.tok, self.req, self.stub, self.n, self.chat = tok, req, stub, n, chat
        self.tools = tools  # chat with tools in the Hermes format: calls streamed (openai_tools)
        self.choices: dict[int, TextSoFar] = {}

    def choice(self, index: int) -> TextSoFar:
        got = self.choices.get(index)
        if got is None:
            got = self.choices[index] = TextSoFar(self.tok, self.req.stops() or [])
            got.tool = ToolText() if self.tools else None
        return got

    async def follow(self, feed: Feed, done: asyncio.Future) -> AsyncIterator[str]:
        """Chunks of the tokens fed, until ``done`` (the samples' results) is."""
        while not done.done():
            get = asyncio.ensure_future(feed.queue.get())
            await asyncio.wait({get, done}, return_when=asyncio.FIRST_COMPLETED)
            if not get.done():
                get.cancel()
                return
            items = [get.result()]
            while not feed.queue.empty():
                items.append(feed.queue.get_nowait())
            touched: dict[int, None] = {}
            for prompt, piece in items:
                index = prompt * self.n + piece.sample
                if self.choice(index).add(piece):
                    touched[index] = None
            for index in touched:
                c = self.choices[index]
                if self.tools:
                    for event in self._tool_step(index, c):
                        yield event
                    continue
                text = c.new_text()
                if text:
                    yield self._chunk(index, c, text, range(c.covered, len(c.tokens)), None)
                    c.covered = len(c.tokens)

    def finish(self, a: R.Answer, include_usage: bool) -> Iterator[str]:
        """Each choice's rest and ``finish_reason``, the usage if asked, and the end."""
        for i, final in enumerate(a.choices):
            c = self.choice(i)
            if self.tools:
                yield from self._finish_tools(a, i, c, final)
                continue
            rest, span = c.rest(final), range(min(c.covered, len(final.tokens)), len(final.tokens))
            if not c.tokens and final.tokens:  # none came while decoding: a piece per token now
                parts = pieces(self.tok, final.tokens, final.text)
                for t, piece in enumerate(parts[:-1]):
                    yield self._chunk(i, final, piece, range(t, t + 1), None)
                rest, span = parts[-1], range(len(parts) - 1, len(final.tokens))
            if self.chat:
                if rest or (a.logprobs is not None and span):
                    yield self._chunk(i, final, rest, span, None)
                end = ChunkChoice(index=i, delta=ChoiceDelta(), finish_reason=final.finish_reason)  # type: ignore[arg-type]
                yield R.sse(R._chunk(a.id, a.model, a.created, [end]))
            else:
                yield self._chunk(
                    i, final, rest, span, "length" if final.finish_reason == "length" else "stop"
                )
        if include_usage:
            if self.chat:
                yield R.sse(R._chunk(a.id, a.model, a.created, [], a.usage))
            else:
                yield R.sse(self._completion([], a.usage))
        yield R.DONE

    def _tool_step(self, index: int, c: TextSoFar) -> Iterator[str]:
        """The content and tool-call deltas choice ``index``'s stable text adds (openai_tools)."""
        assert c.tool is not None
        content, calls = c.tool.update(c.stable())
        if content or calls:
            span = range(c.covered, len(c.tokens))
            c.covered = len(c.tokens)
            yield self._tool_chunk(index, c.so_far(), content, calls, span)

    def _finish_tools(self, a: R.Answer, i: int, c: TextSoFar, final: Choice) -> Iterator[str]:
        """A tool stream's end: the result's tokens not streamed, fed one by one as if they had
        come while decoding; then what the whole answer has beyond what was sent (its content's
        rest, its calls' arguments' rest, calls not sent at all), and the ``finish_reason``."""
        assert c.tool is not None
        if not c.diverged and final.tokens[: len(c.tokens)] == c.tokens:
            for t in range(len(c.tokens), len(final.tokens)):
                top = final.top[t : t + 1] if final.top else None
                c.add(Tokens(0, 0, t, final.tokens[t : t + 1], final.logprobs[t : t + 1], top))
                yield from self._tool_step(i, c)
        content, calls = "", []
        if final.text.startswith(c.tool.content):
            content = final.text[len(c.tool.content) :]
        elif final.text.startswith(c.tool.content.lstrip()):  # whitespace the whole answer strips
            content = final.text[len(c.tool.content.lstrip()) :]
        else:
            log.warning("a stream sent content that is not the start of its answer; the rest is left out")
        for j, call in enumerate(final.tool_calls or []):
            if j < len(c.tool.calls):
                more = c.tool.more_arguments(j, call.function.arguments)
                if not more and call.function.arguments != c.tool.calls[j].arguments:
                    log.warning("a stream sent tool call arguments that are not its answer's")
                calls += more
            else:
                c.tool.calls.append(SentCall(call.id, call.function.name, call.function.arguments))
                fn = ChoiceDeltaToolCallFunction(name=call.function.name, arguments=call.function.arguments)
                calls.append(ChoiceDeltaToolCall(index=j, id=call.id, type="function", function=fn))
        span = range(min(c.covered, len(final.tokens)), len(final.tokens))
        if content or calls or (a.logprobs is not None and span):
            yield self._tool_chunk(i, final, content, calls, span)
        end = ChunkChoice(index=i, delta=ChoiceDelta(), finish_reason=final.finish_reason)  # type: ignore[arg-type]
        yield R.sse(R._chunk(a.id, a.model, a.created, [end]))

    def _tool_chunk(
        self, index: int, whole: Choice, content: str, calls: list[ChoiceDeltaToolCall], span: range
    ) -> str:
        a = self.stub
        lps = R._chunk_logprobs(self.tok, a, whole, span) if span else None
        delta = ChoiceDelta(content=content or None, tool_calls=calls or None)
        return R.sse(
            R._chunk(a.id, a.model, a.created, [ChunkChoice(index=index, delta=delta, logprobs=lps)])
        )

    def _chunk(self, index: int, c: TextSoFar | Choice, text: str, span: range, reason: str | None) -> str:
        """A chunk of choice ``index``: ``text``, with the logprobs of tokens ``span`` if asked."""
        a = self.stub
        whole = c.so_far() if isinstance(c, TextSoFar) else c
        if self.chat:
            lps = R._chunk_logprobs(self.tok, a, whole, span) if span else None
            choice = ChunkChoice(index=index, delta=ChoiceDelta(content=text), logprobs=lps)
            return R.sse(R._chunk(a.id, a.model, a.created, [choice]))
        lp = None
        if a.logprobs is not None and span:
            top = whole.top[span.start : span.stop] if whole.top else None
            one = Choice(
                whole.tokens[span.start : span.stop],
                whole.logprobs[span.start : span.stop],
                top,
                text,
                "stop",
            )
            lp = completion_logprobs(self.tok, one, a.logprobs, a.as_ids)
        # a piece before the last has no finish_reason yet (built unvalidated: the type wants one)
        ch = CompletionChoice.model_construct(index=index, text=text, finish_reason=reason, logprobs=lp)
        return R.sse(self._completion([ch]))

    def _completion(self, choices: list[CompletionChoice], usage: Any = None) -> Completion:
        a = self.stub
        body = Completion(
            id=a.id, object="text_completion", created=a.created, model=a.model, choices=choices
        )
        if usage is not None:
            body.usage = usage
        return body
