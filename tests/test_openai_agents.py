"""Agent frameworks and the Responses API against the OpenAI-compatible routes, over real HTTP
(the embedded app served by uvicorn), on a model trained to emit a tool call: a random 2-layer
qwen2 model whose LoRA answers the weather question with a Hermes ``<tool_call>``
(``tests/test_openai_api.py``'s :func:`_train_tool_call`, served with its :data:`HERMES`
template).

- The ``openai`` client's Responses API: the call as a ``function_call`` item, whole and streamed
  (its events add up to the whole response), a ``function_call_output`` round trip,
  ``previous_response_id`` (the second turn's prompt holds the first, its prefix reused from the
  cache), ``store: false`` (nothing to retrieve: 404), every ``tool_choice``; ``GET
  /v1/models/{id}`` for the checkpoint, 404 for an unknown one.
- openai-agents: a tool loop with its default model (``OpenAIResponsesModel``) and with
  ``OpenAIChatCompletionsModel``, each run whole and streamed (``Runner.run_streamed``).
- langchain-openai: ``with_structured_output`` by its schema methods (``json_schema``, the
  default, and ``function_calling``: a forced call) returns the schema's object.
- A property: stream = whole (content, tool calls, finish reason) over many seeds and
  ``max_tokens`` values at temperatures 0.2 to 1, where calls are cut off or do not parse, on
  chat and on the Responses API.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import openai
import pytest
import torch
from pydantic import BaseModel

import opentinker
from opentinker.client import Runtime
from opentinker.server.app import embedded_app
from tests.conftest import other_family_model
from tests.test_openai_api import HERMES, KEY, TOOLS, _served, _train_tool_call

ASK = "What is the weather in Paris?"
MESSAGES = [{"role": "user", "content": ASK}]
RESPONSE_TOOLS = [{"type": "function", **TOOLS[0]["function"]}]


class World:
    def __init__(self, base_url: str, path: str, base: str) -> None:
        self.base_url, self.path, self.base = base_url, path, base
        self.oa = openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0)

    def aclient(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    tmp: Path = tmp_path_factory.mktemp("agents")
    torch.manual_seed(0)  # the random model's weights: the same model every run
    folder = other_family_model(tmp / "qwen2", "qwen2")
    runtime = Runtime(tmp / "data")
    app = embedded_app(runtime, base_models=[folder], chat_template=HERMES)
    try:
        tenant = app.state.server.auth.tenant(KEY)
        path = _train_tool_call(opentinker.ServiceClient(runtime=runtime, tenant=tenant), folder)
        with _served(app) as base_url:
            yield World(base_url, path, folder)
    finally:
        app.state.server.close()


def test_the_responses_api_with_the_openai_client(world: World) -> None:
    oa, kw = world.oa, dict(model=world.path, tools=RESPONSE_TOOLS, temperature=0, max_output_tokens=64)
    first = oa.responses.create(input=ASK, **kw)  # type: ignore[arg-type]
    assert first.status == "completed" and first.object == "response"
    [call] = [o for o in first.output if o.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert first.usage is not None and first.usage.output_tokens > 0

    events, final = [], None
    with oa.responses.stream(input=ASK, **kw) as stream:  # type: ignore[arg-type]
        for event in stream:
            events.append(event.type)
        final = stream.get_final_response()
    assert events[:2] == ["response.created", "response.in_progress"] and events[-1] == "response.completed"
    assert "response.function_call_arguments.delta" in events
    [streamed] = [o for o in final.output if o.type == "function_call"]
    assert (streamed.name, streamed.arguments) == (call.name, call.arguments)

    output = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}
    second = oa.responses.create(input=[output], previous_response_id=first.id, **kw)  # type: ignore[arg-type]
    assert second.usage is not None and second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0  # the first turn's prefix, reused
    assert oa.responses.retrieve(second.id).id == second.id
    by_items = oa.responses.create(
        input=[{"role": "user", "content": ASK}, call.model_dump(exclude_none=True), output], **kw
    )  # type: ignore[arg-type]
    assert by_items.usage is not None and by_items.usage.input_tokens == second.usage.input_tokens

    gone = oa.responses.create(input=ASK, store=False, **kw)  # type: ignore[arg-type]
    with pytest.raises(openai.NotFoundError):
        oa.responses.retrieve(gone.id)
    with pytest.raises(openai.NotFoundError):
        oa.responses.create(input="again", previous_response_id=gone.id, **kw)  # type: ignore[arg-type]

    none = oa.responses.create(input=ASK, tool_choice="none", **kw)  # type: ignore[arg-type]
    assert all(o.type != "function_call" for o in none.output)
    named = {"type": "function", "name": "get_weather"}
    for choice in ("required", named, "auto"):
        got = oa.responses.create(input=ASK, tool_choice=choice, **kw)  # type: ignore[arg-type]
        assert [o.name for o in got.output if o.type == "function_call"] == ["get_weather"]
    with pytest.raises(openai.BadRequestError) as e:
        oa.responses.create(input=ASK, tool_choice={"type": "function", "name": "nope"}, **kw)  # type: ignore[arg-type]
    assert e.value.body["param"] == "tool_choice"  # type: ignore[index]

    assert oa.models.retrieve(world.path).id == world.path
    with pytest.raises(openai.NotFoundError):
        oa.models.retrieve("no-such-model")


def test_openai_agents_run_a_tool_loop_with_either_model(world: World) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIProvider,
        OpenAIResponsesModel,
        RunConfig,
        Runner,
        function_tool,
        set_default_openai_client,
        set_tracing_disabled,
    )

    calls: list[str] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Rome", "Oslo"]) -> str:
        """The weather in a city"""
        calls.append(city)
        return f"sunny in {city}"

    async def go() -> list[tuple[str, Any]]:
        client = world.aclient()
        set_tracing_disabled(True)
        set_default_openai_client(client, use_for_tracing=False)
        # the SDK's own tool schema and system text differ from what the LoRA learned: the call
        # is forced (tool_choice, by constrained decoding), its arguments are the model's
        settings = ModelSettings(temperature=0, max_tokens=128, tool_choice="required")
        models: list[tuple[str, Any]] = [
            ("default", world.path),  # a name: the provider's default model, OpenAIResponsesModel
            ("responses", OpenAIResponsesModel(model=world.path, openai_client=client)),
            ("chat", OpenAIChatCompletionsModel(model=world.path, openai_client=client)),
        ]
        out = []
        for name, model in models:
            agent = Agent(
                name="weather",
                model=model,
                tools=[get_weather],
                model_settings=settings,
                tool_use_behavior="stop_on_first_tool",
            )
            # a model id with "/" (tinker://...) is no provider prefix: the provider is named here
            run = RunConfig(model_provider=OpenAIProvider(openai_client=client))
            whole = await Runner.run(agent, ASK, run_config=run)
            streamed = Runner.run_streamed(agent, ASK, run_config=run)
            kinds = [event.type async for event in streamed.stream_events()]
            out.append((name, (whole.final_output, streamed.final_output, kinds)))
        await client.close()
        return out

    runs = asyncio.run(go())
    assert len(calls) == 6 and len(set(calls)) == 1  # greedy: one call, the same by every route
    for name, (whole, streamed, kinds) in runs:
        assert whole == streamed == f"sunny in {calls[0]}", name
        assert "raw_response_event" in kinds, name


class Weather(BaseModel):
    city: Literal["Paris", "Rome", "Oslo"]
    sunny: bool


def test_langchain_with_structured_output_by_each_method(world: World) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        base_url=f"{world.base_url}/v1",
        api_key=KEY,
        model=world.base,
        temperature=0,
        max_tokens=200,
        max_retries=0,
    )  # type: ignore[arg-type]
    for method in ("json_schema", "function_calling"):  # JSON mode: test_openai_constrained.py
        got = llm.with_structured_output(Weather, method=method).invoke(ASK)  # type: ignore[arg-type]
        assert isinstance(got, Weather), method


def _chat_pair(oa: openai.OpenAI, path: str, seed: int, max_tokens: int, temp: float) -> tuple[Any, Any]:
    kw: dict[str, Any] = dict(model=path, messages=MESSAGES, tools=TOOLS, temperature=temp, seed=seed)
    kw["max_tokens"] = max_tokens
    whole = oa.chat.completions.create(**kw).choices[0]  # type: ignore[call-overload]
    content, calls, finish = "", {}, None
    for chunk in oa.chat.completions.create(stream=True, **kw):  # type: ignore[call-overload]
        for c in chunk.choices:
            content += c.delta.content or ""
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                got = calls.setdefault(d.index, ["", ""])
                got[0] += (d.function.name or "") if d.function else ""
                got[1] += (d.function.arguments or "") if d.function else ""
    want_calls = [[t.function.name, t.function.arguments] for t in whole.message.tool_calls or []]
    return (whole.message.content or "", want_calls, whole.finish_reason), (
        content,
        [calls[i] for i in sorted(calls)],
        finish,
    )


def test_a_stream_equals_the_whole_answer_over_seeds_and_lengths(world: World) -> None:
    """Seeded rows sample the same tokens streamed or not, so the two must agree exactly, including
    where the call is cut off (``max_tokens``) or sampled into something that does not parse."""
    lengths = [3, 6, 9, 12, 15, 18, 21, 24, 27, 30, 40, 64]
    kinds: set[str] = set()
    for i in range(24):
        seed, max_tokens = 1000 + i, lengths[i % len(lengths)]
        temp = (1.0, 0.5, 0.2)[i % 3]
        whole, streamed = _chat_pair(world.oa, world.path, seed, max_tokens, temp)
        assert streamed == whole, (seed, max_tokens, temp)
        kinds.add("call" if whole[1] else "cut" if "<tool_call>" in whole[0] else "text")
    assert {"call", "cut"} <= kinds  # both cases met
    for seed in range(6):  # the Responses API's stream: the chat stream's events, the same answer
        kw: dict[str, Any] = dict(model=world.path, input=ASK, tools=RESPONSE_TOOLS, temperature=1.0)
        kw["max_output_tokens"] = lengths[seed * 2]
        kw["extra_body"] = {"seed": seed}
        whole_r = world.oa.responses.create(**kw)
        last = None
        for event in world.oa.responses.create(stream=True, **kw):
            if event.type in ("response.completed", "response.incomplete"):
                last = event.response
        assert last is not None and last.status == whole_r.status

        def items(r: Any) -> list[tuple[Any, ...]]:
            return [(o.type, getattr(o, "name", None), getattr(o, "arguments", None)) for o in r.output]

        assert items(last) == items(whole_r) and last.output_text == whole_r.output_text
