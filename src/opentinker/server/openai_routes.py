"""OpenAI-compatible routes on ``opentinker serve``: ``POST /v1/chat/completions``,
``POST /v1/completions``, ``GET /v1/models`` and ``GET /v1/models/{id}`` (SERVER.md,
"OpenAI-compatible API"; the Responses API, run by :meth:`OpenAIRoutes.chat_run`, is
:mod:`openai_responses_route`; ``tool_choice`` and ``response_format``, :mod:`openai_constraints`).

**Models.** ``model`` names what to sample: a checkpoint path (``tinker://<run>/sampler_weights/
<name>`` or a training checkpoint, ``tinker://<run>/weights/<name>``), a sampler id of the Tinker
routes (``<session>:sample:<n>``), or a served base model's name. They resolve as on the Tinker
routes (:class:`~opentinker.server.registry.Registry`), with the same tenancy: another tenant's
path (unless published) is a 404, worded exactly as an unknown one.

**Auth.** The same keys (and ``/auth/token`` tokens), sent as ``Authorization: Bearer <key>`` (the
``openai`` client's header) or ``X-API-Key``.

**Sampling.** Each request (each prompt of a completions request) is one sample request of ``n``
sequences through the path of the Tinker ``asample`` route: the tenant's pending limit and
admission (:mod:`admission`), the rollout service (continuous batching, the prefix cache, rollout
workers, vLLM when on), and the usage ledger's ``sampling_prefill`` / ``sampling_sample``
counts. A client that goes away before its answer is complete (a stream cut, a closed
connection) has its sample aborted: its rows leave the running batch before the next decode step
(``SamplingLoop.abort``; with rollout worker processes or actors, the pool sends the worker an
``Abort`` and its rows leave that worker's batch).

**Streams** (``stream``) send each choice's text token by token while it decodes
(:mod:`openai_stream`). An unseeded stream is given a random seed (each prompt of a completions
request its own; each of its ``n`` samples draws from its own generator seeded from it and its
index), so that a request run again after its rollout worker was lost samples the very tokens the
stream has already sent, and the stream goes on. A row's draws come from its own generator, so
the re-run's batch neighbours do not change them. A whole (non-streamed) answer needs no such
seed: nothing of it was sent before the re-run (and vLLM draws for seeded rows one by one).

**Errors** are OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``
(:class:`~opentinker.server.openai_schemas.OpenAIError`), every message redacted of server paths.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from openai.types import Model
from tinker import types

from opentinker.server import openai_responses as R
from opentinker.server.deps import ServerDep
from opentinker.server.errors import ApiError, NotFound, error_message
from opentinker.server.futures import fail
from opentinker.server.openai_constraints import answer_grammar, tool_choice
from opentinker.server.openai_format import (
    ChatFormat,
    Choice,
    decode,
    echoed,
    new_id,
    parse_tool_calls,
    usage,
)
from opentinker.server.openai_images import image_prompt, inline_images
from opentinker.server.openai_schemas import (
    MAX_N,
    ChatRequest,
    CompletionRequest,
    OpenAIError,
    check_echo,
    check_messages,
    check_tools,
    parse,
    prompt_text,
    prompts_of,
)
from opentinker.server.openai_stream import ClientGone, Feed, Live
from opentinker.server.registry import SamplerNotLoaded
from opentinker.server.state import Server
from opentinker.service import EngineError, SampleHandle, SamplingClient
from opentinker.service.convert import Grammar, ShapedSamplingParams
from opentinker.service.metering import meter_sample
from opentinker.service.sampling import TokenSink
from opentinker.service.sessions import is_sampler_id

log = logging.getLogger(__name__)
CACHED_CLIENTS = 1024  # checkpoint samplers kept loaded for the OpenAI routes (least recently used go)


@dataclass
class Started:
    """A sample request handed to the rollout service: its result, and what aborts it."""

    out: Future
    abort: Callable[[], bool]
    prompt: list[int]


@dataclass
class ChatRun:
    """A chat request handed to the rollout service: what turns its results into its answer."""

    req: ChatRequest
    started: list[Started]
    answer: Callable[[list[types.SampleResponse]], R.Answer]
    tok: Any
    feed: Feed | None  # a stream's
    hermes: bool  # tool calls parsed in the Hermes format
    top: int | None  # top logprobs per token (None: no logprobs)


class OpenAIRoutes:
    def __init__(self, server: Server) -> None:
        self.server = server
        self.reg = server.registry
        self.template = server.config.chat_template
        self._formats: dict[str, ChatFormat] = {}
        self._clients: OrderedDict[tuple[str, str, float], SamplingClient] = OrderedDict()

    # ------------------------------------------------------------------ plumbing
    def error(self, exc: BaseException) -> JSONResponse:
        err = self.as_error(exc)
        return JSONResponse(err.body(), status_code=err.status)

    def as_error(self, exc: BaseException) -> OpenAIError:
        """``exc`` as an OpenAI-shaped error, its message redacted (500s logged, never detailed)."""
        if isinstance(exc, OpenAIError):
            err = exc
        elif isinstance(exc, ApiError):
            kind = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}
            err = OpenAIError(
                exc.message, status=exc.status, type=kind.get(exc.status, "invalid_request_error")
            )
        elif isinstance(exc, EngineError | ValueError):
            err = OpenAIError(error_message(exc))
        else:
            log.error("an OpenAI-compatible request failed", exc_info=exc)
            err = OpenAIError("the server failed to serve this request", status=500, type="server_error")
        err.message = self.server.redact(err.message)
        return err

    def tenant(self, request: Request) -> str:
        auth = request.headers.get("authorization", "")
        key = auth[7:].strip() if auth[:7].lower() == "bearer " else request.headers.get("x-api-key")
        try:
            return self.server.auth.tenant(key)
        except ApiError as e:
            raise OpenAIError(
                e.message, status=401, type="invalid_request_error", code="invalid_api_key"
            ) from None

    @staticmethod
    async def body(request: Request) -> Any:
        try:
            return json.loads(await request.body())
        except ValueError:
            raise OpenAIError("the request body is not valid JSON") from None

    def format(self, base: str) -> ChatFormat:
        fmt = self._formats.get(base)
        if fmt is None:
            fmt = self._formats[base] = ChatFormat(self.reg.runtime.tokenizer(base), self.template, base)
        return fmt

    # ------------------------------------------------------------------ models
    async def resolve(self, tenant: str, model: str) -> SamplingClient:
        """The sampler ``model`` names for ``tenant`` (404 if unknown or another tenant's)."""
        unknown = OpenAIError(
            f"the model {model!r} does not exist or you do not have access to it",
            status=404,
            param="model",
            code="model_not_found",
            type="not_found_error",
        )
        try:
            if model.startswith("tinker://"):
                return await self._checkpoint_client(tenant, model)
            if is_sampler_id(model):
                try:
                    return self.reg.sampler(tenant, model).client
                except SamplerNotLoaded as e:
                    return (await asyncio.to_thread(self.reg.reload_sampler, e.row)).client
            return self._base_client(self.reg.base_model(model))
        except (NotFound, EngineError):
            raise unknown from None

    def _base_client(self, base: str) -> SamplingClient:
        key = ("", base, 0.0)
        client = self._clients.get(key)
        if client is None:
            client = self._clients[key] = SamplingClient(self.reg.runtime, base, None)
        return client

    async def _checkpoint_client(self, tenant: str, path: str) -> SamplingClient:
        ref, meta = self.reg.checkpoint(tenant, path)  # another tenant's: 404, as on the Tinker routes
        self.reg.base_model(str(meta.get("base_model", "")))  # never load an unserved base model
        row = self.reg.store.checkpoint(ref.tinker_path)
        key = (tenant, ref.tinker_path, row.created if row is not None else 0.0)  # a re-save: new weights
        client = self._clients.get(key)
        if client is None:
            runtime = self.reg.runtime
            client = await asyncio.to_thread(
                SamplingClient.for_checkpoint, runtime, ref.tinker_path, tenant=tenant
            )
            self._clients[key] = client
            while len(self._clients) > CACHED_CLIENTS:
                self._clients.popitem(last=False)
        self._clients.move_to_end(key)
        return client

    def models(self, tenant: str) -> dict[str, Any]:
        data = [Model(id=name, created=0, object="model", owned_by="opentinker") for name in self.reg.served]
        rows, _ = self.reg.store.checkpoints(tenant, limit=1000)
        for row in rows:
            if row.kind in ("weights", "sampler_weights"):
                data.append(
                    Model(id=row.tinker_path, created=int(row.created), object="model", owned_by=tenant)
                )
        return {"object": "list", "data": [m.model_dump(mode="json", exclude_unset=True) for m in data]}

    # ------------------------------------------------------------------ sampling
    def params(
        self,
        req: Any,
        limit: int | None,
        prompt: list[int],
        base: str,
        what: str,
        grammar: Grammar | None = None,
    ) -> types.SamplingParams:
        """The request's sampling parameters, checked against the limits and the context (with
        OpenAI's penalties, logit bias and ``grammar``: sampling/grammar.py)."""
        most = min(MAX_N, self.server.config.max_num_samples)
        if req.n > most:
            raise OpenAIError(f"n must be at most {most}, got {req.n}", param="n")
        info = self.reg.base_info(base)
        ctx = info.max_context
        room = ctx - len(prompt)
        if not prompt:
            raise OpenAIError(f"the {what} is empty", param=what)
        if room < 1 or (limit is not None and limit > room):
            raise OpenAIError(  # OpenAI's and vLLM's wording, which clients match on (litellm)
                f"This model's maximum context length is {ctx} tokens. However, you requested "
                f"{len(prompt) + (limit or 0)} tokens ({len(prompt)} in the {what}, {limit or 0} in the "
                f"completion). Please reduce the length of the {what} or completion.",
                param="max_tokens" if room >= 1 else what,
                code="context_length_exceeded",
            )
        stops = req.stops()
        seed = req.seed
        if seed is None and req.stream:  # a re-run (its worker lost) samples the same tokens
            seed = secrets.randbits(62)
        return ShapedSamplingParams(
            max_tokens=limit or room,
            temperature=req.temperature,
            top_p=req.top_p,
            seed=seed,
            stop=stops if stops else ([] if req.ignore_eos else None),
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            logit_bias=req.bias(info.vocab_size),
            grammar=grammar,
        )

    def start(
        self,
        tenant: str,
        client: SamplingClient,
        prompt: list[int],
        n: int,
        params: types.SamplingParams,
        topk: int,
        prompt_topk: int | None = None,
        sink: TokenSink | None = None,
        model_input: types.ModelInput | None = None,
        metered: bool = True,
    ) -> Started:
        """Sample through the Tinker ``asample`` path (see the module docstring); ``prompt_topk``
        not None: with the prompt's logprobs (and that many top logprobs), as its
        ``prompt_logprobs`` / ``topk_prompt_logprobs``; ``sink``: the tokens also go there while
        they decode (a stream's); ``model_input``: the prompt with its images (else ``prompt``'s
        tokens); ``metered`` False: its sampled tokens are not counted (``echo`` with ``max_tokens``
        0 samples one token and returns none). Its prompt cache hits go to ``/metrics``, as the
        Tinker route's do."""
        ops = self.server.ops
        handle: SampleHandle | None = None  # once queued with the sampler

        def submit() -> Future:
            nonlocal handle
            submitted = client.submit(
                model_input or types.ModelInput.from_ints(prompt),
                n,
                params,
                sink=sink,
                include_prompt_logprobs=prompt_topk is not None,
                topk_prompt_logprobs=prompt_topk or 0,
                topk_sample_logprobs=topk,
            )
            handle = submitted.handle
            return submitted.response.future()

        def counted(res: types.SampleResponse) -> types.SampleResponse:
            if ops.ledger is not None:
                meter_sample(
                    ops.ledger,
                    tenant,
                    res,
                    len(prompt),
                    session_id="",
                    base_model=str(client.base_model),
                    sampled=metered,
                )
            return res

        rid = ops.run(tenant, submit, counted)
        out = ops.futures.future_of(rid)
        assert out is not None

        def abort() -> bool:
            stopped = ops.admit.cancel(tenant, out) or (handle is not None and client.abort(handle))
            fail(out, ClientGone(f"request {rid}: the client went away"))
            ops.futures.drop([rid], tenant)
            return stopped

        ops.futures.hooks(rid, cancel=abort)
        out.add_done_callback(lambda _: ops.futures.drop([rid], tenant))
        return Started(out, abort, prompt)

    async def wait(self, request: Request, started: list[Started]) -> list[types.SampleResponse]:
        """The samples' results; if the client disconnects first, abort them all (ClientGone)."""
        futs = [asyncio.wrap_future(s.out) for s in started]
        for f in futs:  # an aborted one's error is never read
            f.add_done_callback(lambda f: f.cancelled() or f.exception())
        gone = asyncio.ensure_future(_disconnected(request))
        everything = asyncio.ensure_future(asyncio.gather(*futs))
        everything.add_done_callback(lambda f: f.cancelled() or f.exception())
        try:
            await asyncio.wait({gone, everything}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not everything.done():
                for s in started:
                    s.abort()
                everything.cancel()
        if not everything.done() or everything.cancelled():
            raise ClientGone("the client went away")
        return everything.result()

    # ------------------------------------------------------------------ routes
    async def chat(self, request: Request) -> Response:
        try:
            tenant = self.tenant(request)
            req: ChatRequest = parse(ChatRequest, await self.body(request))
            run = await self.chat_run(tenant, req)
        except Exception as e:
            return self.error(e)
        if req.stream:
            return self._stream(self.chat_events(request, run))
        return await self._whole(request, run.started, run.answer, lambda a: R.chat_body(run.tok, a))

    async def chat_run(self, tenant: str, req: ChatRequest) -> ChatRun:
        """A chat request checked, rendered and handed to the rollout service (also the
        Responses API's, :mod:`openai_responses_route`)."""
        messages = check_messages(req.messages)
        tools = check_tools(req.tools) if req.tools else None
        choice = tool_choice(req.tool_choice, tools)
        if choice.mode == "none":  # no call can come: the tools are not offered
            tools = None
        client = await self.resolve(tenant, req.model)
        fmt = self.format(client.base_model)
        vision = self.reg.runtime.vision(client.base_model)  # image parts: openai_images.py
        messages, images = inline_images(messages, fmt.tok, vision, client.base_model)
        prompt, model_input = image_prompt(
            fmt.render(messages, tools, req.chat_template_kwargs), images, vision
        )
        vocab, hermes = self.reg.base_info(client.base_model).vocab_size, fmt.tool_format == "hermes"
        grammar = answer_grammar(choice, tools, req.response_format, str(fmt.tok.name_or_path), vocab, hermes)
        params = self.params(req, req.limit(), prompt, client.base_model, "messages", grammar)
        k = (req.top_logprobs or 0) if req.logprobs else 0
        feed = Feed() if req.stream else None
        started = [
            self.start(
                tenant, client, prompt, req.n, params, k, sink=feed and feed.sink(0), model_input=model_input
            )
        ]
        notes = []
        if tools and fmt.tool_format is None:
            notes.append(
                f"tool calls were not parsed: the chat template of {client.base_model!r} renders tools "
                "in a format this server does not know (it parses Qwen/Hermes <tool_call> JSON)"
            )
        hermes = bool(tools and fmt.tool_format == "hermes")  # calls parsed (and streamed as they close)
        top = (req.top_logprobs or 0) if req.logprobs else None

        def answer(results: list[types.SampleResponse]) -> R.Answer:
            choices = [decode(fmt.tok, s, req.stops()) for s in results[0].sequences]
            if hermes:
                for c in choices:
                    parse_tool_calls(c)
            return self._answer(
                "chatcmpl", req.model, started, results, choices, top, req.return_tokens_as_token_ids, notes
            )

        return ChatRun(req, started, answer, fmt.tok, feed, hermes, top)

    def chat_events(self, request: Request, run: ChatRun) -> AsyncIterator[str]:
        """A chat run's stream: its Server-Sent Events (:meth:`events`)."""
        assert run.feed is not None
        return self.events(
            request, run.started, run.answer, run.tok, run.req, run.feed, run.top, chat=True, tools=run.hermes
        )

    async def completions(self, request: Request) -> Response:
        try:
            tenant = self.tenant(request)
            req: CompletionRequest = parse(CompletionRequest, await self.body(request))
            check_echo(req)
            client = await self.resolve(tenant, req.model)
            tok = self.format(client.base_model).tok
            prompts = prompts_of(tok, req.prompt, self.reg.base_info(client.base_model).vocab_size)
            limit = 1 if req.max_tokens == 0 else req.max_tokens  # 0: sample one, return none
            echo_k = (req.logprobs or 0) if req.echo else None
            feed = Feed() if req.stream else None
            started = []
            for i, prompt in enumerate(prompts):
                params = self.params(req, limit, prompt, client.base_model, "prompt")
                sink = feed and feed.sink(i)
                started.append(
                    self.start(
                        tenant, client, prompt, req.n, params, req.logprobs or 0, echo_k, sink,
                        metered=req.max_tokens != 0,
                    )
                )  # fmt: skip
        except Exception as e:
            if "started" in locals():
                for s in started:
                    s.abort()
            return self.error(e)

        def answer(results: list[types.SampleResponse]) -> R.Answer:
            choices = []
            for i, res in enumerate(results):
                for seq in res.sequences:
                    c = decode(tok, seq, req.stops())
                    if req.echo:
                        text = prompt_text(tok, req.prompt, i, started[i].prompt)
                        c = echoed(c, started[i].prompt, text, res, sampled=req.max_tokens != 0)
                    choices.append(c)
            return self._answer(
                "cmpl", req.model, started, results, choices, req.logprobs, req.return_tokens_as_token_ids, []
            )

        if req.stream:
            assert feed is not None
            return self._stream(
                self.events(request, started, answer, tok, req, feed, req.logprobs, chat=False)
            )
        return await self._whole(request, started, answer, lambda a: R.completion_body(tok, a))

    @staticmethod
    def _answer(
        kind: str,
        model: str,
        started: list[Started],
        results: list[types.SampleResponse],
        choices: list[Choice],
        logprobs: int | None,
        as_ids: bool,
        notes: list[str],
    ) -> R.Answer:
        prompt_tokens = sum(len(s.prompt) for s in started)
        cached = sum(int(r.prompt_cache_hit_tokens or 0) for r in results)
        use = usage(prompt_tokens, sum(len(c.tokens) for c in choices), cached)
        return R.Answer(new_id(kind), model, choices, use, logprobs, as_ids, notes)

    async def _whole(
        self,
        request: Request,
        started: list[Started],
        answer: Callable[[list[types.SampleResponse]], R.Answer],
        body: Callable[[R.Answer], dict[str, Any]],
    ) -> Response:
        try:
            return JSONResponse(body(answer(await self.wait(request, started))))
        except ClientGone:
            return Response(status_code=499)  # nobody reads it
        except Exception as e:
            return self.error(e)

    @staticmethod
    def _stream(events: AsyncIterator[str]) -> StreamingResponse:
        return StreamingResponse(
            events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    async def events(
        self,
        request: Request,
        started: list[Started],
        answer: Callable[[list[types.SampleResponse]], R.Answer],
        tok: Any,
        req: Any,
        feed: Feed,
        logprobs: int | None,
        *,
        chat: bool,
        tools: bool = False,
    ) -> AsyncIterator[str]:
        """The answer as Server-Sent Events: token by token while the samples decode, as ``feed``
        brings their tokens (:mod:`openai_stream`); those it did not bring, once they are done."""
        stub = R.Answer(
            new_id("chatcmpl" if chat else "cmpl"), req.model, [], usage(0, 0, 0), None, False, []
        )
        stub.logprobs, stub.as_ids = logprobs, bool(req.return_tokens_as_token_ids)
        live = Live(tok, req, stub, req.n, chat=chat, tools=tools)
        if chat:
            yield R.chat_first(stub.id, req.model, stub.created, req.n)
        results = asyncio.ensure_future(self.wait(request, started))
        try:
            async for event in live.follow(feed, results):
                yield event
            a = answer(await results)
        except ClientGone:
            return
        except Exception as e:
            yield R.sse(self.as_error(e).body())
            return
        finally:
            results.cancel()  # the stream closed early: its samples are aborted (wait)
        a.id, a.created = stub.id, stub.created
        for event in live.finish(a, req.include_usage()):
            yield event


async def _disconnected(request: Request) -> None:
    """Return when the client disconnects (the ASGI ``http.disconnect`` message)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _routes(request: Request, server: ServerDep) -> OpenAIRoutes:
    """The app's :class:`OpenAIRoutes`, made on first use (its chat formats and sampling clients
    are kept across requests)."""
    state = request.app.state
    if getattr(state, "openai_routes", None) is None:
        state.openai_routes = OpenAIRoutes(server)
    return state.openai_routes


Routes = Annotated[OpenAIRoutes, Depends(_routes)]
router = APIRouter()


@router.post("/v1/chat/completions", tags=["openai"])
async def chat_completions(routes: Routes, request: Request) -> Response:
    return await routes.chat(request)


@router.post("/v1/completions", tags=["openai"])
async def completions(routes: Routes, request: Request) -> Response:
    return await routes.completions(request)


@router.get("/v1/models", tags=["openai"])
async def models(routes: Routes, request: Request) -> Response:
    try:
        return JSONResponse(routes.models(routes.tenant(request)))
    except Exception as e:
        return routes.error(e)


@router.get("/v1/models/{model:path}", tags=["openai"])
async def model(routes: Routes, request: Request, model: str) -> Response:
    try:
        tenant = routes.tenant(request)
        found = next((m for m in routes.models(tenant)["data"] if m["id"] == model), None)
        if found is None:
            await routes.resolve(tenant, model)  # a sampler id: served, if it resolves (else its 404)
            found = Model(id=model, created=0, object="model", owned_by=tenant).model_dump(mode="json")
        return JSONResponse(found)
    except Exception as e:
        return routes.error(e)
