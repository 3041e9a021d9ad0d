"""OpenAI's Responses API on ``opentinker serve``: ``POST /v1/responses`` and
``GET /v1/responses/{id}`` (SERVER.md, "OpenAI-compatible API"), what openai-agents' default model
and Inspect's ``openai/…`` models call.

**One path with chat.** A request is turned into a chat request (:class:`ChatRequest`) and run
by the chat route's own machinery (:meth:`OpenAIRoutes.chat_run`): the same chat template, tool
calls (Hermes), ``tool_choice`` and structured outputs (``text.format``, by constrained
decoding), sampling path, metering and limits. Its answer is written as a ``Response``, from the
``openai`` package's own types:

* ``input``: a string, or items: messages (``role`` with ``content``, a string or
  ``input_text`` / ``output_text`` / ``input_image`` parts), ``function_call`` (an assistant's
  call, by ``call_id``) and ``function_call_output`` (its result); ``instructions`` is a system
  message before them;
* ``tools``: function tools (``{"type": "function", "name", "parameters", …}``); other kinds
  (web search, files, computer use) are a 400 naming them;
* ``max_output_tokens``; ``temperature``; ``top_p``; ``text.format`` (``text``,
  ``json_object``, ``json_schema``); ``tool_choice`` (``auto``, ``none``, ``required``,
  ``{"type": "function", "name"}``);
* the output: a ``message`` item with the text (``output_text``), then a ``function_call`` item
  per call; ``status`` ``incomplete`` (``max_output_tokens``) when the sample was cut at its
  length; ``usage`` with the prompt tokens reused from the prefix cache (``cached_tokens``).

**Stored responses.** With ``store`` (OpenAI's default, true) a response is kept in memory, its
conversation with it (the input and the output), for :data:`KEPT` responses (the oldest go
first) until the server stops: ``previous_response_id`` continues one (another tenant's, or one
no longer kept, is a 404 naming it), and ``GET /v1/responses/{id}`` reads it. ``store: false``
keeps nothing.

**Streams** are the chat stream (the same samples, the same stable text and tool calls,
:mod:`openai_stream`) written as the Responses API's events: ``response.created``,
``response.in_progress``, ``response.output_item.added``, ``response.content_part.added``,
``response.output_text.delta`` …, ``response.function_call_arguments.delta`` / ``.done``,
``response.output_item.done``, and ``response.completed`` (or ``response.incomplete``) with the
whole response, each with its ``sequence_number``. So a stream adds up to the whole answer.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from openai.types.responses import (
    Response as OAResponse,
)
from openai.types.responses import (
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponseUsage,
)
from openai.types.responses.response_usage import InputTokensDetails, OutputTokensDetails

from opentinker.server import openai_responses as R
from opentinker.server.openai_routes import OpenAIRoutes, Routes
from opentinker.server.openai_schemas import ChatRequest, OpenAIError, parse
from opentinker.server.openai_stream import ClientGone

KEPT = 1024  # stored responses kept in memory (the oldest go first)
# what the Responses API takes that this server does not serve (each with the value meaning "off")
UNSERVED: dict[str, Any] = {"conversation": None, "prompt": None, "background": False, "reasoning": None}


@dataclass
class Stored:
    tenant: str
    body: dict[str, Any]  # the response
    messages: list[dict[str, Any]]  # its conversation, its output included (chat messages)


@dataclass
class Responses:
    """The stored responses of one server (module docstring)."""

    kept: OrderedDict[str, Stored] = field(default_factory=OrderedDict)

    def put(self, rid: str, stored: Stored) -> None:
        self.kept[rid] = stored
        while len(self.kept) > KEPT:
            self.kept.popitem(last=False)

    def get(self, tenant: str, rid: str, param: str) -> Stored:
        got = self.kept.get(rid)
        if got is None or got.tenant != tenant:
            raise OpenAIError(
                f"response {rid!r} is not found (responses are kept in memory, the last {KEPT}, until "
                "the server restarts; one made with store false is not kept)",
                status=404,
                param=param,
                type="not_found_error",
            )
        return got


# ---------------------------------------------------------------------------- the request
def _text(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message item's content as chat content (text parts joined; image parts kept)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise OpenAIError(f"{where} must be a string or a list of parts", param=where)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            raise OpenAIError(
                f"{where}[{j}] must be an input_text, output_text or input_image part (with an "
                "image_url); other parts (files, audio) are not served",
                param=f"{where}[{j}]",
            )
    if any(p["type"] == "image_url" for p in parts):
        return parts
    return "".join(p["text"] for p in parts)


def messages_of(raw: dict[str, Any]) -> list[dict[str, Any]]:
    """``instructions`` and ``input`` as chat messages (a 400 naming a bad item)."""
    out: list[dict[str, Any]] = []
    items = raw.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise OpenAIError("input must be a string or a non-empty list of items", param="input")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and isinstance(item, dict) and "role" in item:
            out.append({"role": item["role"], "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")},
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and not isinstance(last["content"], list):
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text(output, f"{where}.output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": text})
        elif kind == "reasoning":
            continue  # a reasoning model's summary, sent back by some clients: nothing to render
        else:
            raise OpenAIError(
                f"{where} must be a message, function_call or function_call_output item; got {kind!r}",
                param=where,
            )
    return out


def _tools(raw: Any) -> list[dict[str, Any]] | None:
    if not raw:
        return None
    if not isinstance(raw, list):
        raise OpenAIError("tools must be a list", param="tools")
    out = []
    for i, tool in enumerate(raw):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise OpenAIError(
                f"tools[{i}]: only function tools are served, not {kind!r}", param=f"tools[{i}]"
            )
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
        out.append({"type": "function", "function": fn})
    return out


def chat_request(raw: Any, history: list[dict[str, Any]]) -> tuple[ChatRequest, list[dict[str, Any]]]:
    """A Responses request as a chat request, and its conversation (``history`` first)."""
    if not isinstance(raw, dict):
        raise OpenAIError("the request body must be a JSON object")
    for name, off in UNSERVED.items():
        if raw.get(name, off) not in (off, {}):
            raise OpenAIError(f"{name} is not served by this server", param=name)
    messages = list(history)
    if isinstance(raw.get("instructions"), str):  # instructions are this turn's: not carried on
        messages = [m for m in messages if not m.get("instructions")]
        messages.insert(0, {"role": "system", "content": raw["instructions"], "instructions": True})
    messages += messages_of(raw)
    text = raw.get("text")
    fmt = text.get("format") if isinstance(text, dict) else None
    chat: dict[str, Any] = {
        "model": raw.get("model"),
        "messages": [{k: v for k, v in m.items() if k != "instructions"} for m in messages],
        "tools": _tools(raw.get("tools")),
        "tool_choice": raw.get("tool_choice"),
        "response_format": fmt,
        "stream": bool(raw.get("stream")),
    }
    pairs = [("max_tokens", "max_output_tokens"), ("temperature", "temperature"), ("top_p", "top_p")]
    pairs += [("seed", "seed"), ("ignore_eos", "ignore_eos")]  # chat's and vLLM's, not OpenAI's here
    for ours, theirs in pairs:
        if raw.get(theirs) is not None:
            chat[ours] = raw[theirs]
    try:
        req: ChatRequest = parse(ChatRequest, chat)
    except OpenAIError as e:
        if e.param == "max_tokens":
            e.param, e.message = "max_output_tokens", e.message.replace("max_tokens", "max_output_tokens")
        raise
    return req, messages


# ---------------------------------------------------------------------------- the response
def body_of(raw: dict[str, Any], rid: str, created: int, a: R.Answer | None, status: str) -> dict[str, Any]:
    """The ``Response`` object (``a`` None: none sampled yet, the stream's first events)."""
    output: list[Any] = []
    incomplete = None
    if a is not None:
        c = a.choices[0]
        if c.text:
            text = ResponseOutputText(type="output_text", text=c.text, annotations=[])
            output.append(
                ResponseOutputMessage(
                    id=f"msg_{rid[5:]}", type="message", role="assistant", status="completed", content=[text]
                )
            )
        for call in c.tool_calls or []:
            output.append(
                ResponseFunctionToolCall(
                    type="function_call",
                    id=f"fc_{call.id[5:]}",
                    call_id=call.id,
                    name=call.function.name,
                    arguments=call.function.arguments,
                    status="completed",
                )
            )
        if c.finish_reason == "length":
            status, incomplete = "incomplete", {"reason": "max_output_tokens"}
    use = None
    if a is not None:
        cached = (a.usage.prompt_tokens_details.cached_tokens or 0) if a.usage.prompt_tokens_details else 0
        use = ResponseUsage(
            input_tokens=a.usage.prompt_tokens,
            input_tokens_details=InputTokensDetails(
                cached_tokens=cached, cache_write_tokens=0
            ),  # not counted
            output_tokens=a.usage.completion_tokens,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=0),
            total_tokens=a.usage.total_tokens,
        )
    tools = [{**t, "strict": t.get("strict", True)} for t in raw.get("tools") or []]
    body = OAResponse.model_validate(
        {
            "id": rid,
            "object": "response",
            "created_at": created,
            "model": raw.get("model"),
            "status": status,
            "output": [o.model_dump(mode="json") for o in output],
            "parallel_tool_calls": bool(raw.get("parallel_tool_calls", True)),
            "tool_choice": raw.get("tool_choice") or "auto",
            "tools": tools,
            "incomplete_details": incomplete,
            "instructions": raw.get("instructions"),
            "max_output_tokens": raw.get("max_output_tokens"),
            "previous_response_id": raw.get("previous_response_id"),
            "temperature": raw.get("temperature", 1.0),
            "top_p": raw.get("top_p", 1.0),
            "store": raw.get("store", True) is not False,
            "text": raw.get("text") or {"format": {"type": "text"}},
            "usage": use.model_dump(mode="json") if use is not None else None,
            "error": None,
            "metadata": raw.get("metadata") or {},
        }
    )
    return body.model_dump(mode="json", exclude_none=False)


def conversation(messages: list[dict[str, Any]], a: R.Answer) -> list[dict[str, Any]]:
    """``messages`` with the answer's output after them (what ``previous_response_id`` continues)."""
    c = a.choices[0]
    reply: dict[str, Any] = {"role": "assistant", "content": c.text or None}
    if c.tool_calls:
        reply["tool_calls"] = [
            {
                "id": t.id,
                "type": "function",
                "function": {"name": t.function.name, "arguments": t.function.arguments},
            }
            for t in c.tool_calls
        ]
    return [*messages, reply]


class Events:
    """The chat stream's chunks written as the Responses API's events (module docstring)."""

    def __init__(self, raw: dict[str, Any], rid: str, created: int) -> None:
        self.raw, self.rid, self.created = raw, rid, created
        self.seq = 0
        self.items: list[dict[str, Any]] = []  # in output_index order: {"kind", "id", "text" / call}
        self.message: int | None = None  # the message item's output_index
        self.calls: dict[int, int] = {}  # a chat tool call's index -> its item's output_index

    def event(self, kind: str, **fields: Any) -> str:
        self.seq += 1
        return R.sse({"type": kind, "sequence_number": self.seq - 1, **fields})

    def start(self) -> list[str]:
        body = body_of(self.raw, self.rid, self.created, None, "in_progress")
        return [
            self.event("response.created", response=body),
            self.event("response.in_progress", response=body),
        ]

    def chunk(self, chunk: dict[str, Any]) -> list[str]:
        """The events of one chat chunk (its first choice: the Responses API has one)."""
        out: list[str] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                out += self._text(delta["content"])
            for call in delta.get("tool_calls") or []:
                out += self._call(call)
        return out

    def _text(self, text: str) -> list[str]:
        out = []
        if self.message is None:
            self.message = len(self.items)
            mid = f"msg_{self.rid[5:]}"
            self.items.append({"kind": "message", "id": mid, "text": ""})
            item = {"id": mid, "type": "message", "role": "assistant", "status": "in_progress", "content": []}
            part = {"type": "output_text", "text": "", "annotations": []}
            out.append(self.event("response.output_item.added", output_index=self.message, item=item))
            out.append(
                self.event(
                    "response.content_part.added",
                    item_id=mid,
                    output_index=self.message,
                    content_index=0,
                    part=part,
                )
            )
        it = self.items[self.message]
        it["text"] += text
        out.append(
            self.event(
                "response.output_text.delta",
                item_id=it["id"],
                output_index=self.message,
                content_index=0,
                delta=text,
                logprobs=[],
            )
        )
        return out

    def _call(self, call: dict[str, Any]) -> list[str]:
        out = []
        index = int(call.get("index", 0))
        fn = call.get("function") or {}
        if index not in self.calls:
            self.calls[index] = len(self.items)
            cid = call.get("id") or f"call_{uuid.uuid4().hex[:24]}"
            it = {
                "kind": "call",
                "id": f"fc_{cid[5:]}",
                "call_id": cid,
                "name": fn.get("name"),
                "arguments": "",
            }
            self.items.append(it)
            item = {k: it[k] for k in ("id", "call_id", "name", "arguments")}
            item.update(type="function_call", status="in_progress")
            out.append(self.event("response.output_item.added", output_index=self.calls[index], item=item))
        at = self.calls[index]
        it = self.items[at]
        if fn.get("arguments"):
            it["arguments"] += fn["arguments"]
            out.append(
                self.event(
                    "response.function_call_arguments.delta",
                    item_id=it["id"],
                    output_index=at,
                    delta=fn["arguments"],
                )
            )
        return out

    def finish(self, body: dict[str, Any]) -> list[str]:
        """Each item's end, then ``response.completed`` (or ``.incomplete``) with the whole response."""
        out = []
        done = {o.get("id"): o for o in body["output"]}
        for at, it in enumerate(self.items):
            final = done.get(it["id"])
            if it["kind"] == "message":
                part = {"type": "output_text", "text": it["text"], "annotations": []}
                common = {"item_id": it["id"], "output_index": at, "content_index": 0}
                out.append(self.event("response.output_text.done", **common, text=it["text"], logprobs=[]))
                out.append(self.event("response.content_part.done", **common, part=part))
            else:
                out.append(
                    self.event(
                        "response.function_call_arguments.done",
                        item_id=it["id"],
                        output_index=at,
                        name=it["name"],
                        arguments=it["arguments"],
                    )
                )
            out.append(self.event("response.output_item.done", output_index=at, item=final or {}))
        kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
        out.append(self.event(kind, response=body))
        return out

    def ids(self, body: dict[str, Any]) -> None:
        """Give the whole response's calls the ids the stream sent them (in order: the same calls)."""
        sent = [it for it in self.items if it["kind"] == "call"]
        calls = [o for o in body["output"] if o["type"] == "function_call"]
        for it, o in zip(sent, calls, strict=False):
            o["id"], o["call_id"] = it["id"], it["call_id"]


# ---------------------------------------------------------------------------- the routes
async def create(routes: OpenAIRoutes, request: Request) -> Response:
    store = _store(request)
    try:
        tenant = routes.tenant(request)
        raw = await routes.body(request)
        history: list[dict[str, Any]] = []
        if isinstance(raw, dict) and raw.get("previous_response_id") is not None:
            history = store.get(tenant, str(raw["previous_response_id"]), "previous_response_id").messages
        req, messages = chat_request(raw, history)
        run = await routes.chat_run(tenant, req)
    except Exception as e:
        return routes.error(e)
    rid, created = f"resp_{uuid.uuid4().hex}", int(time.time())

    def keep(a: R.Answer, body: dict[str, Any]) -> None:
        if raw.get("store", True) is not False:
            store.put(rid, Stored(tenant, body, conversation(messages, a)))

    if not req.stream:
        try:
            a = run.answer(await routes.wait(request, run.started))
            body = body_of(raw, rid, created, a, "completed")
            keep(a, body)
            return JSONResponse(body)
        except Exception as e:
            if isinstance(e, ClientGone):
                return Response(status_code=499)  # nobody reads it
            return routes.error(e)

    answers: list[R.Answer] = []
    answer = run.answer

    def caught(results: Any) -> R.Answer:
        a = answer(results)
        answers.append(a)
        return a

    run.answer = caught

    async def events() -> AsyncIterator[str]:
        ev = Events(raw, rid, created)
        for e in ev.start():
            yield e
        async for sse in routes.chat_events(request, run):
            data = sse.removeprefix("data: ").strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                err = chunk["error"]  # OpenAI's error event: its code, message and param
                yield ev.event(
                    "error", code=err.get("code"), message=err.get("message"), param=err.get("param")
                )
                return
            for e in ev.chunk(chunk):
                yield e
        if not answers:
            return
        body = body_of(raw, rid, created, answers[0], "completed")
        ev.ids(body)
        keep(answers[0], body)
        for e in ev.finish(body):
            yield e

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _store(request: Request) -> Responses:
    state = request.app.state
    if getattr(state, "openai_responses", None) is None:
        state.openai_responses = Responses()
    return state.openai_responses


def read(routes: OpenAIRoutes, request: Request, rid: str) -> Response:
    try:
        return JSONResponse(_store(request).get(routes.tenant(request), rid, "response_id").body)
    except Exception as e:
        return routes.error(e)


router = APIRouter()


@router.post("/v1/responses", tags=["openai"])
async def responses(routes: Routes, request: Request) -> Response:
    return await create(routes, request)


@router.get("/v1/responses/{response_id}", tags=["openai"])
async def response(routes: Routes, request: Request, response_id: str) -> Response:
    return read(routes, request, response_id)
