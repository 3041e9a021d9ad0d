"""Tokens in and out of the OpenAI-compatible routes (:mod:`openai_routes`): the chat template,
tool calls, and the response objects, built from the ``openai`` package's own types.

**Chat template.** A chat request is rendered with the base model's chat template (its
tokenizer's), or the one ``serve --chat-template FILE`` gave, by ``apply_chat_template`` with
``add_generation_prompt`` and the request's ``tools``; the text is then tokenized without adding
special tokens (the template writes them), as ``apply_chat_template(tokenize=True)`` does.

**Tools.** ``tools`` reach the template only if it renders them (its source names ``tools``); a
request with tools for a template that does not is refused, saying so, rather than sampled with
the tools silently dropped. Tool calls are parsed in the one format known here, Qwen's / Hermes'
``<tool_call>{"name": …, "arguments": {…}}</tool_call>`` (a template that writes ``<tool_call>``):
each such block becomes a ``tool_calls`` entry and ``finish_reason`` is ``tool_calls``. A block
that is not such JSON stays in ``content``. A template that renders tools in another format gets
its text back unparsed, and the response says so (``tool_call_format`` is null, with a note).

**Text.** A sequence's text is its tokens decoded without special tokens, cut before the first
stop string (OpenAI's rule: the stop string is not returned). ``usage.completion_tokens`` counts
every sampled token (what the server's usage ledger counts).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from openai.types import CompletionUsage
from openai.types.chat.chat_completion_message_function_tool_call import (
    ChatCompletionMessageFunctionToolCall,
    Function,
)
from openai.types.chat.chat_completion_token_logprob import ChatCompletionTokenLogprob, TopLogprob
from openai.types.completion_choice import Logprobs
from openai.types.completion_usage import PromptTokensDetails

from opentinker.server.openai_schemas import OpenAIError
from opentinker.server.openai_tools import blocks


class ChatFormat:
    """A base model's chat template (or the server's ``--chat-template``) and its tool format."""

    def __init__(self, tokenizer: Any, template: str | None, base_model: str) -> None:
        self.tok = tokenizer
        self.template = template or getattr(tokenizer, "chat_template", None)
        self.base_model = base_model

    @property
    def renders_tools(self) -> bool:
        return self.template is not None and "tools" in self.template

    @property
    def tool_format(self) -> str | None:
        """``hermes`` (Qwen's ``<tool_call>`` JSON) or None: not a format parsed here."""
        return "hermes" if self.template is not None and "<tool_call>" in self.template else None

    def render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, extra: dict[str, Any] | None
    ) -> list[int]:
        if self.template is None:
            raise OpenAIError(
                f"base model {self.base_model!r} has no chat template: use /v1/completions, or start "
                "serve with --chat-template FILE",
                param="messages",
            )
        if tools and not self.renders_tools:
            raise OpenAIError(
                f"the chat template of {self.base_model!r} does not render tools, so this server knows "
                "no tool format for it; send the request without tools, or start serve with a "
                "--chat-template that renders them",
                param="tools",
            )
        reserved = {"messages", "tools", "add_generation_prompt", "tokenize", "chat_template"}
        kwargs = {k: v for k, v in (extra or {}).items() if k not in reserved}
        try:
            text = self.tok.apply_chat_template(
                messages,
                tools=tools or None,
                chat_template=self.template,
                add_generation_prompt=True,
                tokenize=False,
                **kwargs,
            )
        except Exception as e:  # the template refused the conversation (raise_exception, a bad role)
            raise OpenAIError(f"the chat template refused these messages: {e}", param="messages") from None
        return list(self.tok.encode(str(text), add_special_tokens=False))


@dataclass
class Echo:
    """The prompt a completions choice echoes (``echo``): its tokens, their logprobs given what
    precedes them (the first None: nothing does) and top logprobs, as the Tinker ``sample`` route's
    ``prompt_logprobs`` / ``topk_prompt_logprobs``."""

    tokens: list[int]
    logprobs: list[float | None]
    top: list[list[tuple[int, float]] | None] | None


@dataclass
class Choice:
    """One sampled sequence, decoded."""

    tokens: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]] | None
    text: str
    finish_reason: str  # stop | length (| tool_calls, set by parse_tool_calls)
    tool_calls: list[ChatCompletionMessageFunctionToolCall] | None = None
    echo: Echo | None = None


def echoed(choice: Choice, prompt: list[int], prompt_text: str, res: Any, sampled: bool) -> Choice:
    """``choice`` with the prompt echoed before it (its text and, in logprobs, its tokens);
    ``sampled`` False (``max_tokens`` 0): the prompt alone, the one token sampled dropped."""
    lps = [None if x is None or x != x else float(x) for x in res.prompt_logprobs or []]
    echo = Echo(list(prompt), lps, res.topk_prompt_logprobs)
    if not sampled:
        return Choice([], [], [] if choice.top is not None else None, prompt_text, "length", echo=echo)
    choice.text, choice.echo = prompt_text + choice.text, echo
    return choice


def decode(tok: Any, seq: Any, stops: list[str] | None) -> Choice:
    """A tinker ``SampledSequence`` as a :class:`Choice`: text without special tokens, cut before
    the first stop string."""
    tokens = list(seq.tokens)
    text = tok.decode(tokens, skip_special_tokens=True)
    cut = min((i for s in stops or () if (i := text.find(s)) >= 0), default=-1)
    if cut >= 0:
        text = text[:cut]
    reason = "stop" if seq.stop_reason == "stop" else "length"
    top = seq.topk_logprobs
    return Choice(tokens, [float(x) for x in seq.logprobs or []], top, text, reason)


def parse_tool_calls(choice: Choice) -> None:
    """Move Hermes ``<tool_call>`` blocks of ``choice.text`` into ``choice.tool_calls`` (the rule
    of :func:`~opentinker.server.openai_tools.call_of`, which streams follow too)."""
    calls: list[ChatCompletionMessageFunctionToolCall] = []
    rest, at = [], 0
    for start, end, call in blocks(choice.text):
        if call is None:
            continue  # not a call: left in the text, never guessed at
        rest.append(choice.text[at:start])
        at = end
        fn = Function(name=call[0], arguments=call[1])
        calls.append(
            ChatCompletionMessageFunctionToolCall(
                id=f"call_{uuid.uuid4().hex[:24]}", function=fn, type="function"
            )
        )
    if calls:
        rest.append(choice.text[at:])
        choice.text, choice.tool_calls, choice.finish_reason = "".join(rest).strip(), calls, "tool_calls"


def pieces(tok: Any, tokens: list[int], text: str) -> list[str]:
    """``text`` split into one piece per token (some empty), in order, as the tokens reveal it:
    the pieces of a stream, which concatenate to exactly ``text``."""
    out, done = [], 0
    for i in range(1, len(tokens) + 1):
        so_far = tok.decode(tokens[:i], skip_special_tokens=True)
        upto = _common(so_far, text)
        out.append(text[done:upto] if upto > done else "")
        done = max(done, upto)
    if out:
        out[-1] += text[done:]
    elif text:
        out.append(text)
    return out


def _common(a: str, b: str) -> int:
    """The length of the longest common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def token_text(tok: Any, token: int, as_ids: bool) -> str:
    return f"token_id:{token}" if as_ids else tok.decode([token])


def chat_logprobs(
    tok: Any, choice: Choice, k: int, as_ids: bool, span: range | None = None
) -> list[ChatCompletionTokenLogprob]:
    """``logprobs.content`` of a chat choice: each sampled token's logprob and its top ``k``."""
    out = []
    for i in span or range(len(choice.tokens)):
        text = token_text(tok, choice.tokens[i], as_ids)
        tops = []
        for t, lp in (choice.top[i] if choice.top is not None and k else [])[:k]:
            top_text = token_text(tok, t, as_ids)
            tops.append(TopLogprob(token=top_text, bytes=list(top_text.encode()), logprob=float(lp)))
        out.append(
            ChatCompletionTokenLogprob(
                token=text, bytes=list(text.encode()), logprob=choice.logprobs[i], top_logprobs=tops
            )
        )
    return out


def completion_logprobs(tok: Any, choice: Choice, k: int, as_ids: bool) -> Logprobs:
    """``logprobs`` of a completions choice (the legacy shape: parallel lists), the echoed
    prompt's first (its first token's logprob and top logprobs null, as OpenAI's)."""
    echo = choice.echo or Echo([], [], [])
    ids = echo.tokens + choice.tokens
    tokens = [token_text(tok, t, as_ids) for t in ids]
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    top = None
    if k and choice.top is not None:
        rows = list(echo.top or [None] * len(echo.tokens)) + list(choice.top)
        top = [
            None if row is None else {token_text(tok, t, as_ids): float(lp) for t, lp in row[:k]}
            for row in rows
        ]
    # built unvalidated: the type wants floats, and an echoed prompt's first logprob is null
    return Logprobs.model_construct(
        tokens=tokens,
        token_logprobs=[*echo.logprobs, *choice.logprobs],
        top_logprobs=top,
        text_offset=offsets,
    )


def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> CompletionUsage:
    return CompletionUsage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
