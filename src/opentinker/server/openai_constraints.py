"""``tool_choice`` and ``response_format`` of the OpenAI-compatible routes, checked and turned
into the grammar a row decodes under (``sampling/grammar.py``: constrained decoding).

* ``tool_choice``: ``auto`` (the default with tools), ``none`` (the tools are not rendered and no
  call is parsed: the answer is text), ``required`` (the answer is one Hermes ``<tool_call>``
  block calling one of ``tools`` with arguments that match its ``parameters``) or a named function
  (``{"type": "function", "function": {"name": …}}``; the Responses API's ``{"type": "function",
  "name": …}``): a call of that one. Anything else, or a function not in ``tools``, is a 400.
* ``response_format``: ``text``, ``json_object`` (the answer is a JSON object) or ``json_schema``
  (``{"json_schema": {"name", "schema", "strict"}}``; the Responses API's ``text.format`` has the
  same fields flat): the answer matches the schema. A schema the grammar compiler cannot take is a
  400 naming it.

A forced call needs the Hermes tool format (a chat template that writes ``<tool_call>``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from opentinker.server.openai_schemas import OpenAIError, schema_problem
from opentinker.service.convert import Grammar, check_grammar

MODES = ("auto", "none", "required")


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # auto | none | required | function
    name: str | None = None  # mode function: the function's name

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "function")


def tool_choice(raw: Any, tools: list[dict[str, Any]] | None) -> ToolChoice:
    """``raw`` (the request's ``tool_choice``) checked against ``tools`` (a 400 if it is bad)."""
    names = [t["function"]["name"] for t in tools or []]
    if raw is None:
        return ToolChoice("auto")
    if isinstance(raw, str):
        if raw not in MODES:
            raise OpenAIError(
                f"tool_choice must be one of {', '.join(MODES)} or a function; got {raw!r}",
                param="tool_choice",
            )
        if raw == "required" and not tools:
            raise OpenAIError("tool_choice 'required' needs tools", param="tool_choice")
        return ToolChoice(raw)
    fn = raw.get("function") if isinstance(raw, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else raw.get("name") if isinstance(raw, dict) else None
    if not isinstance(raw, dict) or raw.get("type") != "function" or not isinstance(name, str):
        raise OpenAIError(
            "tool_choice must be one of auto, none, required or {'type': 'function', 'function': "
            "{'name': ...}}",
            param="tool_choice",
        )
    if name not in names:
        raise OpenAIError(f"tool_choice names function {name!r}, which is not in tools", param="tool_choice")
    return ToolChoice("function", name)


def call_grammar(
    choice: ToolChoice, tools: list[dict[str, Any]], tokenizer: str, vocab: int, hermes: bool
) -> Grammar | None:
    """The grammar of a forced call (None: ``choice`` forces none)."""
    if not choice.forced:
        return None
    if not hermes:
        raise OpenAIError(
            "a forced tool call needs a chat template in the Hermes <tool_call> format",
            param="tool_choice",
        )
    allowed = [
        {"name": t["function"]["name"], "parameters": t["function"].get("parameters")}
        for t in tools
        if choice.name is None or t["function"]["name"] == choice.name
    ]
    return _compiles(Grammar("tool_call", json.dumps(allowed), tokenizer), vocab, "tool_choice")


def format_grammar(raw: Any, tokenizer: str, vocab: int, where: str = "response_format") -> Grammar | None:
    """The grammar of a ``response_format`` (None: text); a 400 for a bad one."""
    if raw is None:
        return None
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return _compiles(Grammar("json_object", "", tokenizer), vocab, where)
    if kind != "json_schema":
        raise OpenAIError(f"{where}.type must be text, json_object or json_schema", param=f"{where}.type")
    body = raw.get("json_schema", raw)  # chat nests it; the Responses API's text.format is flat
    schema = body.get("schema") if isinstance(body, dict) else None
    if schema is None:
        schema = {"type": "object"}
    problem = schema_problem(schema)
    if problem is not None:
        raise OpenAIError(f"{where} schema is not a valid JSON Schema: {problem}", param=where)
    return _compiles(Grammar("json_schema", json.dumps(schema), tokenizer), vocab, where)


def answer_grammar(
    choice: ToolChoice,
    tools: list[dict[str, Any]] | None,
    response_format: Any,
    tokenizer: str,
    vocab: int,
    hermes: bool,
) -> Grammar | None:
    """What a chat answer must be: a forced call, else its ``response_format`` (None: free)."""
    answer_format = format_grammar(response_format, tokenizer, vocab)
    return call_grammar(choice, tools or [], tokenizer, vocab, hermes) or answer_format


def _compiles(grammar: Grammar, vocab: int, where: str) -> Grammar:
    try:
        check_grammar(grammar, vocab)
    except ValueError as e:
        raise OpenAIError(str(e), param=where) from None
    return grammar
