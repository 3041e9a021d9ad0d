"""What the OpenAI-compatible routes enforce, driven by the real ``openai`` client against the
embedded app (the ASGI app ``serve`` runs) on the tiny model and on a random 2-layer qwen2 model
served with a Hermes tool template (``tests/test_openai_api.py``'s :data:`HERMES`):

- ``tool_choice``: ``required`` and a named function make every answer a call of an allowed tool
  whose arguments validate against its schema (``jsonschema``), over several seeds of a model that
  was never trained to call anything (constrained decoding, ``sampling/grammar.py``); ``none``
  never answers with calls; bad values are 400s naming ``tool_choice``.
- ``response_format``: ``json_schema`` answers validate against the schema, ``json_object``
  answers are JSON objects.
- Per row in one batch (``choice.shaped``, real xgrammar matchers on the tiny tokenizer): a
  grammar row's chosen tokens are all allowed by its grammar, and the unshaped rows beside it get
  bitwise the tokens and logprobs they get alone.
- ``presence_penalty`` / ``frequency_penalty`` / ``logit_bias`` equal a plain reference: Hugging
  Face's model, greedy, with OpenAI's formula applied by hand; the logprobs reported are the
  shaped distribution's.
- OpenAI's refusals: out-of-range values, more than 4 stop strings, unserved parameters, 404 and
  405 under ``/v1`` in OpenAI's error shape, the context-overflow wording clients match on; and an
  assistant ``content: null`` with ``tool_calls`` accepted.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from opentinker.client import Runtime
from opentinker.models.registry import tiny_model_dir
from opentinker.sampling.choice import Row, choose_tokens, shaped
from opentinker.sampling.grammar import Grammar, compiled
from opentinker.sampling.types import SamplingParams
from opentinker.server.app import embedded_app
from tests.conftest import TEST_MODEL, other_family_model
from tests.test_openai_api import HERMES

KEY = "tml-constrained"
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}},
    "required": ["city"],
    "additionalProperties": False,
}
UNIT = {
    "type": "object",
    "properties": {
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "exact": {"type": "boolean"},
    },
    "required": ["unit", "exact"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": CITY}},
    {"type": "function", "function": {"name": "set_unit", "parameters": UNIT}},
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class World:
    def __init__(self, app: Any, qwen: str) -> None:
        self.app, self.qwen = app, qwen

    def run(self, fn: Callable[[openai.AsyncOpenAI, httpx.AsyncClient], Any]) -> Any:
        async def go() -> Any:
            transport = httpx.ASGITransport(app=self.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://embedded") as http:
                c = openai.AsyncOpenAI(
                    base_url="http://embedded/v1", api_key=KEY, http_client=http, max_retries=0
                )
                return await fn(c, http)

        return asyncio.run(go())


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("constrained")
    torch.manual_seed(0)  # the random model's weights: the same model every run
    qwen = other_family_model(tmp / "qwen2", "qwen2")
    app = embedded_app(Runtime(tmp / "data"), base_models=[qwen, TEST_MODEL], chat_template=HERMES)
    app.state.server.auth.tenant(KEY)
    try:
        yield World(app, qwen)
    finally:
        app.state.server.close()


def test_a_forced_tool_call_is_a_call_of_an_allowed_tool_with_valid_arguments(world: World) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

    async def go(c: openai.AsyncOpenAI, _: httpx.AsyncClient) -> list[tuple[Any, Any]]:
        out = []
        named = {"type": "function", "function": {"name": "set_unit"}}
        for choice in ["required", named]:
            for seed in range(4):
                a = await c.chat.completions.create(
                    model=world.qwen, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=200, seed=seed
                )  # type: ignore[arg-type]
                out.append((choice, a.choices[0]))
        return out

    for choice, got in world.run(go):
        assert got.finish_reason == "tool_calls" and got.message.tool_calls, got.message.content
        [call] = got.message.tool_calls
        if isinstance(choice, dict):
            assert call.function.name == "set_unit"
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_tool_choice_none_never_calls_and_bad_choices_are_refused(world: World) -> None:
    async def go(c: openai.AsyncOpenAI, _: httpx.AsyncClient) -> list[Any]:
        answers = [
            await c.chat.completions.create(
                model=world.qwen, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=24, seed=seed
            )  # type: ignore[arg-type]
            for seed in range(3)
        ]
        refusals = []
        for bad in ["sometimes", {"type": "function", "function": {"name": "nope"}}, {"type": "tool"}]:
            with pytest.raises(openai.BadRequestError) as e:
                await c.chat.completions.create(model=world.qwen, messages=ASK, tools=TOOLS, tool_choice=bad)  # type: ignore[arg-type]
            refusals.append(e.value.body)
        with pytest.raises(openai.BadRequestError) as e:
            await c.chat.completions.create(model=world.qwen, messages=ASK, tool_choice="required")
        refusals.append(e.value.body)
        return [answers, refusals]

    answers, refusals = world.run(go)
    for a in answers:
        assert not a.choices[0].message.tool_calls and a.choices[0].finish_reason != "tool_calls"
    assert [r["param"] for r in refusals] == ["tool_choice"] * 4
    assert "'nope'" in refusals[1]["message"] and "not in tools" in refusals[1]["message"]


def test_structured_outputs_match_their_schema(world: World) -> None:
    schema_format = {"type": "json_schema", "json_schema": {"name": "unit", "schema": UNIT, "strict": True}}

    async def go(c: openai.AsyncOpenAI, _: httpx.AsyncClient) -> list[tuple[str, Any]]:
        out = []
        for fmt in [schema_format, {"type": "json_object"}]:
            for seed in range(4):
                a = await c.chat.completions.create(
                    model=world.qwen, messages=ASK, response_format=fmt, max_tokens=120, seed=seed
                )  # type: ignore[arg-type]
                out.append((fmt["type"], a.choices[0]))
        return out

    answers = world.run(go)
    for kind, got in answers:
        if kind == "json_schema":
            assert got.finish_reason == "stop"
            jsonschema.validate(json.loads(got.message.content), UNIT)
        elif got.finish_reason == "stop":  # any object: one may still run to max_tokens
            assert isinstance(json.loads(got.message.content), dict)
    assert sum(got.finish_reason == "stop" for kind, got in answers if kind == "json_object") >= 2


def test_grammar_rows_are_masked_and_rows_beside_them_are_untouched() -> None:
    """One batch of five rows, two with a grammar (the tool call and a schema), three without."""
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir()))
    vocab = len(tok)
    grammars = [
        Grammar("json_schema", json.dumps(UNIT), str(tiny_model_dir())),
        Grammar(
            "tool_call", json.dumps([{"name": "get_weather", "parameters": CITY}]), str(tiny_model_dir())
        ),
    ]

    def row(i: int, grammar: Grammar | None) -> Row:
        gen = torch.Generator().manual_seed(100 + i)
        params = SamplingParams(temperature=1.0, seed=100 + i, grammar=grammar)
        return Row(
            req=i, policy=None, params=params, prompt_len=1, gen=gen, stop_ids=frozenset(), stop_strs=()
        )

    torch.manual_seed(0)
    steps = [torch.randn(5, vocab) for _ in range(12)]
    mixed = [row(0, None), row(1, grammars[0]), row(2, None), row(3, grammars[1]), row(4, None)]
    plain = [row(0, None), row(2, None), row(4, None)]
    for logits in steps:
        for r, (t, lp) in zip(mixed, choose_tokens(shaped(logits, mixed), mixed), strict=True):
            r.tokens.append(t)
            r.logprobs.append(lp)
        alone = logits[[0, 2, 4]]
        assert shaped(alone, plain) is alone  # no row shaped: the very logits
        for r, (t, lp) in zip(plain, choose_tokens(alone, plain), strict=True):
            r.tokens.append(t)
            r.logprobs.append(lp)
    for a, b in zip([mixed[0], mixed[2], mixed[4]], plain, strict=True):
        assert a.tokens == b.tokens and a.logprobs == b.logprobs  # bitwise
    import xgrammar as xgr

    for r, g in ((mixed[1], grammars[0]), (mixed[3], grammars[1])):
        m = xgr.GrammarMatcher(compiled(g, vocab))
        assert all(m.accept_token(t) for t in r.tokens)  # every chosen token allowed
        assert all(lp > -1e9 for lp in r.logprobs)
    assert tok.decode(mixed[3].tokens).startswith("<tool_call>\n{")


def test_penalties_and_logit_bias_equal_a_reference_loop(world: World) -> None:
    """Greedy with OpenAI's penalties and a bias equals Hugging Face's model with the same formula
    applied by hand, tokens and logprobs (the shaped distribution's)."""
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir()))
    messages = [{"role": "user", "content": "Count: one one one two"}]
    prompt = tok.encode(
        tok.apply_chat_template(messages, chat_template=HERMES, add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )  # the server's template (--chat-template)
    bias = {str(tok.encode(" one")[0]): 8.0, str(tok.encode("!")[0]): -100.0}
    presence, frequency, n = 0.7, 1.9, 16

    async def go(c: openai.AsyncOpenAI, _: httpx.AsyncClient) -> Any:
        return await c.chat.completions.create(
            model=TEST_MODEL,
            messages=messages,  # type: ignore[arg-type]
            temperature=0,
            max_tokens=n,
            presence_penalty=presence,
            frequency_penalty=frequency,
            logit_bias=bias,  # type: ignore[arg-type]
            logprobs=True,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
        )

    got = world.run(go).choices[0].logprobs.content
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir()), dtype=torch.float32).eval()
    ids, want, lps, plain = list(prompt), [], [], []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1].double()
            plain.append(int(logits.argmax()))
            for t in set(want):
                logits[t] -= want.count(t) * frequency + presence
            for t, b in bias.items():
                logits[int(t)] += b
            nxt = int(logits.argmax())
            lps.append(float(torch.log_softmax(logits, -1)[nxt]))
            want.append(nxt)
            ids.append(nxt)
    assert [int(e.token.removeprefix("token_id:")) for e in got] == want
    assert plain != want  # the shaping changed the greedy path
    assert max(abs(e.logprob - lp) for e, lp in zip(got, lps, strict=True)) < 1e-3


def test_openai_refusals_and_shapes(world: World) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}

    async def go(c: openai.AsyncOpenAI, http: httpx.AsyncClient) -> dict[str, Any]:
        out: dict[str, Any] = {}
        out["404"] = await http.post("/v1/assistants", headers=headers, json={})
        out["405"] = await http.get("/v1/chat/completions", headers=headers)
        bads = {
            "presence_penalty": {"presence_penalty": 2.5},
            "frequency_penalty": {"frequency_penalty": -3},
            "logit_bias": {"logit_bias": {"5": 101}},
            "logit_bias ": {"logit_bias": {"999999": 1}},
            "stop": {"stop": ["a", "b", "c", "d", "e"]},
            "audio": {"audio": {"voice": "alloy", "format": "wav"}},
            "response_format": {"response_format": {"type": "xml"}},
        }
        for name, extra in bads.items():
            with pytest.raises(openai.BadRequestError) as e:
                await c.chat.completions.create(
                    model=TEST_MODEL, messages=ASK, max_tokens=2, extra_body=extra
                )  # type: ignore[arg-type]
            out[name] = e.value.body
        with pytest.raises(openai.BadRequestError) as e:
            await c.chat.completions.create(model=TEST_MODEL, messages=ASK, max_tokens=5000)  # type: ignore[arg-type]
        out["overflow"] = e.value
        call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
        null = [
            *ASK,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "user", "content": "?"},
        ]
        out["null"] = await c.chat.completions.create(model=TEST_MODEL, messages=null, max_tokens=3)  # type: ignore[arg-type]
        tool_reply = {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
        out["null_hermes"] = await c.chat.completions.create(
            model=world.qwen, messages=[*null[:2], tool_reply], tools=TOOLS, max_tokens=3
        )  # type: ignore[arg-type]
        return out

    out = world.run(go)
    for status in ("404", "405"):
        r = out[status]
        assert r.status_code == int(status) and set(r.json()["error"]) == {"message", "type", "param", "code"}
    for name in ("presence_penalty", "frequency_penalty", "logit_bias", "logit_bias ", "stop", "audio"):
        assert out[name]["param"] == name.strip(), out[name]
    assert out["response_format"]["param"] == "response_format.type"
    overflow = out["overflow"]
    assert overflow.code == "context_length_exceeded"
    assert overflow.body["message"].startswith(
        "This model's maximum context length is 1024 tokens. However, you requested"
    )
    assert out["null"].choices[0].message.content is not None and out["null_hermes"].choices
