"""Constrained decoding: a row's next token restricted to what a grammar allows (structured
outputs and forced tool calls of the OpenAI-compatible routes), and OpenAI's logit shaping
(``presence_penalty``, ``frequency_penalty``, ``logit_bias``).

**Library.** Grammars are compiled and matched by xgrammar (installed with vLLM): it builds its
token tables from our Hugging Face tokenizers directly (``TokenizerInfo.from_huggingface``),
compiles JSON Schemas and EBNF, and fills one row of a shared token bitmask per matcher
(``fill_next_token_bitmask(mask, row)``), which is what a mixed batch needs: rows with and
without a grammar share one decode step, and only the rows with one are masked. Its matcher is
C++ and fills a 1k-token mask in microseconds on a CPU. (llguidance has the same per-row API but
wants its own tokenizer wrapper; outlines-core compiles a regex index up front, slow for a large
schema.)

**Which distribution.** A shaped row (a grammar, a penalty or a bias) samples from its shaped
logits, and its reported logprob is the sampled token's under that shaped distribution (the one
actually sampled from; a grammar's disallowed tokens have probability 0 there). Rows without any
shaping are untouched: their logits, tokens and logprobs are bitwise what they were (sampler =
trainer, invariant 3).

**State.** A row's matcher is made on its first step from its ``SamplingParams.grammar`` and fed
the row's tokens as they are appended, so nothing outside this module and the token choice knows
of it. Once the grammar is complete only the tokenizer's end tokens are allowed; a row that goes
on past them (``stop=[]``) is left unmasked.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass
from typing import Any, Literal

import torch

log = logging.getLogger(__name__)

GrammarKind = Literal["json_schema", "json_object", "tool_call"]


@dataclass(frozen=True)
class Grammar:
    """What a row's output must be: ``json_schema`` (``spec``: the schema's JSON), ``json_object``
    (any JSON object), or ``tool_call`` (``spec``: a JSON list of ``{"name", "parameters"}``; the
    output is one Hermes ``<tool_call>`` block calling one of them with arguments that match its
    parameters). ``tokenizer``: the base model's tokenizer (a folder or hub name)."""

    kind: GrammarKind
    spec: str
    tokenizer: str


@functools.lru_cache(maxsize=8)
def _compiler(tokenizer: str, vocab: int) -> Any:
    import xgrammar as xgr
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    return xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab), max_threads=1)


def _call_schema(tools: list[dict[str, Any]]) -> dict[str, Any]:
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t["name"]},
                "arguments": t.get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
        }
        for t in tools
    ]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


@functools.lru_cache(maxsize=256)
def compiled(grammar: Grammar, vocab: int) -> Any:
    """``grammar`` compiled for a vocabulary of ``vocab`` logits (a ValueError if it does not
    compile: a schema xgrammar does not support)."""
    import xgrammar as xgr

    compiler = _compiler(grammar.tokenizer, vocab)
    try:
        if grammar.kind == "json_object":  # OpenAI's JSON mode: any JSON object
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
        if grammar.kind == "json_schema":
            return compiler.compile_json_schema(grammar.spec, any_whitespace=False)
        body = xgr.Grammar.from_json_schema(
            json.dumps(_call_schema(json.loads(grammar.spec))), any_whitespace=False
        )
        grammar_ = xgr.Grammar.concat(
            xgr.Grammar.from_ebnf('root ::= "<tool_call>" "\\n"?'),  # Qwen writes newlines; some don't
            body,
            xgr.Grammar.from_ebnf('root ::= "\\n"? "</tool_call>"'),
        )
        return compiler.compile_grammar(grammar_)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"the {grammar.kind} grammar does not compile: {e}") from None


def check(grammar: Grammar, vocab: int) -> None:
    """Compile ``grammar`` now (cached for the rows that use it): a ValueError names what is wrong."""
    compiled(grammar, vocab)


class Matcher:
    """One row's place in its grammar."""

    def __init__(self, grammar: Grammar, vocab: int) -> None:
        import xgrammar as xgr

        self.m = xgr.GrammarMatcher(compiled(grammar, vocab))
        self.fed = 0  # the row's tokens accepted so far

    def feed(self, tokens: list[int]) -> None:
        for t in tokens[self.fed :]:
            if not self.m.is_terminated() and not self.m.accept_token(t):
                log.warning("a constrained row took token %d its grammar does not allow", t)
        self.fed = len(tokens)


def masked(logits_SV: torch.Tensor, matchers: list[tuple[int, Matcher]]) -> torch.Tensor:
    """``logits_SV`` with each listed row's disallowed tokens at -inf (a copy; the rows not
    listed keep their values)."""
    import xgrammar as xgr

    live = [(j, m) for j, m in matchers if not m.m.is_terminated()]
    if not live:
        return logits_SV
    out = logits_SV.float() if logits_SV.dtype != torch.float32 else logits_SV.clone()
    mask = xgr.allocate_token_bitmask(len(live), out.shape[-1])
    for i, (_, m) in enumerate(live):
        m.m.fill_next_token_bitmask(mask, i)
    rows = torch.tensor([j for j, _ in live], dtype=torch.long, device=out.device)
    picked = out.index_select(0, rows)
    xgr.apply_token_bitmask_inplace(picked, mask.to(out.device))
    out.index_copy_(0, rows, picked)
    return out.to(logits_SV.dtype)


def penalized(logits_V: torch.Tensor, tokens: list[int], presence: float, frequency: float) -> torch.Tensor:
    """OpenAI's penalties on one row: each token already sampled ``c`` times loses
    ``c * frequency + presence`` (the prompt's tokens do not count)."""
    if not tokens or (presence == 0 and frequency == 0):
        return logits_V
    ids, counts = torch.tensor(tokens, device=logits_V.device).unique(return_counts=True)
    ids = ids[ids < logits_V.shape[-1]]
    counts = counts[: len(ids)]
    out = logits_V.clone()
    out[ids] -= counts.to(out.dtype) * frequency + presence
    return out
