"""The OpenAI-compatible routes (``server/openai_routes.py``) driven by the real ``openai`` client,
sync, async and streaming, against ``opentinker serve`` on the tiny model.

- Chat and completions equal the Tinker ``sample`` route on the same sampler (a LoRA trained a few
  steps, so an adapter is in play), for n = 1 and 4, greedy and seeded: the same tokens
  (``return_tokens_as_token_ids`` reports them exactly), the same text, logprobs within 1e-4.
- Streams concatenate to the whole answer's text, with exact usage.
- Tenancy: another key's checkpoint is a 404 worded as an unknown one.
- Bad input: OpenAI-shaped errors with the right status and ``param``, no server path in them,
  and a good request sent among them unaffected.
- A client that disconnects mid-stream has its rows taken out of the running batch.
- With a rollout worker process, a stream whose worker is killed (``kill -9``) goes on where it
  stopped once its request runs again, seeded by the client or not.
- Tool calls parse on a Qwen-family template: a random 2-layer qwen2 model (conftest's
  ``other_family_model``) whose LoRA is trained to answer with a ``<tool_call>``, served by the
  embedded ASGI app with a minimal Hermes-style template written here (:data:`HERMES`): no
  tokenizer in the environment ships a Qwen template. Streamed (over real HTTP), the call comes as
  OpenAI streams it, once its block closes while the row decodes, and adds up to the whole answer's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import tinker
import uvicorn
from tinker import types
from transformers import AutoTokenizer

import opentinker
from opentinker.client import Runtime
from opentinker.models.registry import tiny_model_dir
from opentinker.sampling import SampleRequest, SampleResult, SamplingBackend
from opentinker.sampling.decoder import Pinned
from opentinker.sampling.handles import RequestBook, SampleState
from opentinker.server.app import embedded_app
from opentinker.server.local import LocalServer
from tests.conftest import TEST_MODEL, local_server, other_family_model
from tests.tolerances import LOGPROB_ATOL

KEY, OTHER = "tml-openai-a", "tml-openai-b"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12 + 34?"}]
MAX = 12


class World:
    def __init__(self, srv: LocalServer, path: str, sampler: Any, service: Any) -> None:
        self.srv, self.path, self.sampler, self.service = srv, path, sampler, service
        self.tok = AutoTokenizer.from_pretrained(str(tiny_model_dir()))
        self.oa = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key=KEY, max_retries=0)

    def arun(self, fn: Callable[[openai.AsyncOpenAI], Any], key: str = KEY) -> Any:
        async def go() -> Any:
            async with openai.AsyncOpenAI(
                base_url=f"{self.srv.base_url}/v1", api_key=key, max_retries=0
            ) as c:
                return await fn(c)

        return asyncio.run(go())

    def chat_prompt(self, messages: list[dict[str, Any]]) -> list[int]:
        text = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(self.tok.encode(text, add_special_tokens=False))

    def engine(self) -> dict[str, Any]:
        r = httpx.get(f"{self.srv.base_url}/console/api/engine", headers={"X-API-Key": KEY}, timeout=30)
        return r.json()["engines"][0]["rollout"]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    with local_server(tmp_path_factory, "openai-api") as srv:
        service = tinker.ServiceClient(base_url=srv.base_url, api_key=KEY)
        tc = service.create_lora_training_client(base_model=TEST_MODEL, rank=8, seed=0).result()
        ids = tc.get_tokenizer().encode("What is 12 + 34? 46")
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(ids[:-1]),
            loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
        )
        for _ in range(3):
            tc.forward_backward([datum], "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        path = tc.save_weights_for_sampler("openai").result().path
        sampler = service.create_sampling_client(model_path=path).result()
        yield World(srv, path, sampler, service)


def _ids(entries: Any) -> list[int]:
    return [int(e.token.removeprefix("token_id:")) for e in entries]


def _same(world: World, ref: types.SampleResponse, got: list[tuple[str, list[int], list[float]]]) -> None:
    assert len(got) == len(ref.sequences)
    for (text, ids, lps), seq in zip(got, ref.sequences, strict=True):
        assert ids == list(seq.tokens)
        assert text == world.tok.decode(list(seq.tokens), skip_special_tokens=True)
        assert (
            max((abs(a - b) for a, b in zip(lps, seq.logprobs or [], strict=True)), default=0) <= LOGPROB_ATOL
        )


@pytest.mark.parametrize("n", [1, 4])
@pytest.mark.parametrize("mode", ["greedy", "seeded"])
def test_chat_and_completions_equal_the_tinker_sample_route(world: World, n: int, mode: str) -> None:
    temperature, seed = (0.0, None) if mode == "greedy" else (1.0, 1234)
    prompt = world.chat_prompt(MESSAGES)
    params = types.SamplingParams(max_tokens=MAX, temperature=temperature, seed=seed)
    ref = world.sampler.sample(types.ModelInput.from_ints(prompt), n, params).result()
    extra = {"return_tokens_as_token_ids": True}
    kw: dict[str, Any] = dict(model=world.path, n=n, max_tokens=MAX, temperature=temperature, seed=seed)
    chat = world.oa.chat.completions.create(messages=MESSAGES, logprobs=True, extra_body=extra, **kw)  # type: ignore[call-overload]
    got = [
        (c.message.content or "", _ids(c.logprobs.content), [e.logprob for e in c.logprobs.content])
        for c in chat.choices
    ]
    _same(world, ref, got)
    assert chat.usage is not None and chat.usage.prompt_tokens == len(prompt)
    assert chat.usage.completion_tokens == sum(len(s.tokens) for s in ref.sequences)
    comp = world.arun(lambda c: c.completions.create(prompt=prompt, logprobs=0, extra_body=extra, **kw))
    got = [(c.text, _ids_text(c.logprobs.tokens), list(c.logprobs.token_logprobs)) for c in comp.choices]
    _same(world, ref, got)
    assert comp.usage.prompt_tokens == len(prompt)


def _ids_text(tokens: list[str]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in tokens]


def test_streams_concatenate_to_the_whole_answer(world: World) -> None:
    kw: dict[str, Any] = dict(model=world.path, n=2, max_tokens=MAX, temperature=1.0, seed=7)
    whole = world.oa.chat.completions.create(messages=MESSAGES, **kw)  # type: ignore[call-overload]
    texts: dict[int, str] = defaultdict(str)
    finish, usage = {}, None
    for chunk in world.oa.chat.completions.create(
        messages=MESSAGES, stream=True, stream_options={"include_usage": True}, **kw
    ):  # type: ignore[call-overload]
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            finish[c.index] = c.finish_reason or finish.get(c.index)
    assert dict(texts) == {c.index: c.message.content for c in whole.choices}
    assert finish == {c.index: c.finish_reason for c in whole.choices}
    assert usage is not None and whole.usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        whole.usage.prompt_tokens,
        whole.usage.completion_tokens,
    )

    prompt = "What is 12 + 34?"

    async def completions(c: openai.AsyncOpenAI) -> tuple[Any, dict[int, str], Any]:
        whole = await c.completions.create(prompt=prompt, **kw)
        parts: dict[int, str] = defaultdict(str)
        last = None
        async for chunk in await c.completions.create(
            prompt=prompt, stream=True, stream_options={"include_usage": True}, **kw
        ):
            last = chunk.usage or last
            for ch in chunk.choices:
                parts[ch.index] += ch.text
        return whole, dict(parts), last

    whole_c, parts, last = world.arun(completions)
    assert parts == {c.index: c.text for c in whole_c.choices}
    assert last is not None and last.completion_tokens == whole_c.usage.completion_tokens


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_scores_the_prompt_as_the_tinker_route(world: World, max_tokens: int) -> None:
    """``echo`` + ``logprobs`` (lm-eval's loglikelihood request): the prompt's tokens and their
    logprobs equal the Tinker ``sample`` route's ``prompt_logprobs`` (the first null), its top
    logprobs its ``topk_prompt_logprobs``; ``max_tokens`` 0 samples nothing more."""
    prompts = [world.tok.encode("What is 12 + 34? 46"), world.tok.encode("The cat sat on the mat")]
    extra = {"return_tokens_as_token_ids": True}
    comp = world.oa.completions.create(
        model=world.path,
        prompt=prompts,
        max_tokens=max_tokens,
        temperature=0,
        echo=True,
        logprobs=2,
        extra_body=extra,
    )
    assert [c.index for c in comp.choices] == [0, 1]
    for prompt, c in zip(prompts, comp.choices, strict=True):
        ref = world.sampler.sample(
            types.ModelInput.from_ints(prompt),
            1,
            types.SamplingParams(max_tokens=1, temperature=0.0),
            include_prompt_logprobs=True,
            topk_prompt_logprobs=2,
        ).result()
        lp = c.logprobs
        assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
        assert _ids_text(lp.tokens or [])[: len(prompt)] == prompt
        assert len(lp.tokens or []) == len(prompt) + max_tokens
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        want = list(ref.prompt_logprobs or [])[1:]
        got = lp.token_logprobs[1 : len(prompt)]
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= LOGPROB_ATOL  # type: ignore[operator]
        tops = ref.topk_prompt_logprobs or []
        for row, ref_row in zip(lp.top_logprobs[1 : len(prompt)], tops[1:], strict=True):
            assert _ids_text(list(row)) == [t for t, _ in ref_row]
            assert max(abs(a - b) for a, (_, b) in zip(row.values(), ref_row, strict=True)) <= LOGPROB_ATOL
        if max_tokens:
            assert _ids_text(lp.tokens or [])[-1] == ref.sequences[0].tokens[0]
        assert c.text.startswith(world.tok.decode(prompt))
    assert comp.usage is not None and comp.usage.completion_tokens == max_tokens * len(prompts)
    with pytest.raises(openai.BadRequestError, match="echo"):
        world.oa.completions.create(model=world.path, prompt="hi", max_tokens=0)


def test_usage_reports_the_cached_prefix_on_the_second_turn(world: World) -> None:
    """Turn 2 of a conversation (turn 1's messages, its reply, a new question) reports as cached
    exactly the prefix it shares with what turn 1 left in the prefix cache: turn 1's prompt and its
    reply's tokens but the last (``test_prompt_cache_hits.py``), as re-rendered by the template."""
    turn1 = [{"role": "user", "content": "Only for the cached-prefix test: name a colour."}]
    kw: dict[str, Any] = dict(model=TEST_MODEL, max_tokens=6, temperature=0, logprobs=True)
    kw["extra_body"] = {"ignore_eos": True, "return_tokens_as_token_ids": True}
    first = world.oa.chat.completions.create(messages=turn1, **kw)  # type: ignore[call-overload]
    reply = first.choices[0]
    turn2 = [*turn1, {"role": "assistant", "content": reply.message.content}]
    turn2.append({"role": "user", "content": "And another?"})
    second = world.oa.chat.completions.create(messages=turn2, **kw)  # type: ignore[call-overload]
    stored = world.chat_prompt(turn1) + _ids(reply.logprobs.content)[:-1]  # type: ignore[union-attr]
    prompt = world.chat_prompt(turn2)
    shared = next((i for i, (a, b) in enumerate(zip(stored, prompt, strict=False)) if a != b), len(stored))
    assert second.usage is not None and second.usage.prompt_tokens == len(prompt)
    details = second.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens == min(shared, len(prompt) - 1)
    assert shared > len(world.chat_prompt(turn1))  # some of the reply too


def test_another_tenants_checkpoint_is_not_found(world: World) -> None:
    fake = world.path.replace("sampler_weights/openai", "sampler_weights/nothing-here")
    errors = []
    for model in (world.path, fake):
        with pytest.raises(openai.NotFoundError) as e:
            world.arun(lambda c, m=model: c.chat.completions.create(model=m, messages=MESSAGES), key=OTHER)
        err = e.value.body
        assert isinstance(err, dict) and err["code"] == "model_not_found" and err["param"] == "model"
        errors.append(err["message"].replace(model, "<model>"))
    assert errors[0] == errors[1]  # worded exactly as an unknown path
    listed = world.arun(lambda c: c.models.list(), key=OTHER)
    assert world.path not in [m.id for m in listed.data]
    assert world.path in [m.id for m in world.oa.models.list().data]


def _bad_bodies(world: World) -> list[tuple[str, dict[str, Any], int, str | None]]:
    base = {"model": world.path, "messages": MESSAGES, "max_tokens": 4}
    bad_schema = {"type": "object", "properties": {"x": {"type": "no-such-type"}}}
    tool = {"type": "function", "function": {"name": "f", "parameters": bad_schema}}
    return [
        ("unknown model path", {**base, "model": "tinker://sess-0:train:0/sampler_weights/x"}, 404, "model"),
        ("messages not a list", {**base, "messages": "hello"}, 400, "messages"),
        ("a message not an object", {**base, "messages": [1]}, 400, "messages[0]"),
        (
            "unknown role",
            {**base, "messages": [{"role": "wizard", "content": "hi"}]},
            400,
            "messages[0].role",
        ),
        ("n over the limit", {**base, "n": 129}, 400, "n"),
        ("max_tokens over the context", {**base, "max_tokens": 5000}, 400, "max_tokens"),
        ("tool schema not JSON Schema", {**base, "tools": [tool]}, 400, "tools[0].function.parameters"),
    ]


def test_bad_input_gets_openai_errors_and_spares_the_batch(world: World) -> None:
    url = f"{world.srv.base_url}/v1/chat/completions"
    auth = {"Authorization": f"Bearer {KEY}"}
    good = {"model": world.path, "messages": MESSAGES, "max_tokens": MAX, "temperature": 0}
    alone = httpx.post(url, json=good, headers=auth, timeout=120).json()["choices"][0]["message"]["content"]
    answers: dict[str, Any] = {}

    def send(name: str, body: dict[str, Any]) -> None:
        answers[name] = httpx.post(url, json=body, headers=auth, timeout=120)

    cases = _bad_bodies(world)
    threads = [threading.Thread(target=send, args=("good", good))]
    threads += [threading.Thread(target=send, args=(name, body)) for name, body, _, _ in cases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert answers["good"].status_code == 200
    assert answers["good"].json()["choices"][0]["message"]["content"] == alone
    for name, _, status, param in cases:
        r = answers[name]
        assert r.status_code == status, (name, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, (name, err)
        assert err["type"] == ("not_found_error" if status == 404 else "invalid_request_error"), (name, err)
        assert str(world.srv.data_dir) not in err["message"] and "<server path>" not in err["message"]
    r = httpx.post(url, json=good, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    deep = b"[" * 100_000 + b"]" * 100_000
    r = httpx.post(url, content=deep, headers={**auth, "Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def _first_text_while_decoding(world: World, stream: Iterator[Any]) -> str:
    """Read ``stream`` up to its first chunk with text; the running batch must still hold the row."""
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            assert world.engine()["live_rows"] >= 1  # the row decodes on: this text came before its end
            return chunk.choices[0].delta.content
    raise AssertionError("the stream sent no text")


def test_a_stream_sends_text_while_its_row_decodes(world: World) -> None:
    """The first text of a long answer arrives while its row is still in the running batch (sync
    and async clients); cutting the stream then aborts the row."""
    room = 1024 - len(world.chat_prompt(MESSAGES))
    kw: dict[str, Any] = dict(
        model=world.path, messages=MESSAGES, max_tokens=room, seed=3, extra_body={"ignore_eos": True}
    )
    aborted = world.engine()["aborted"]
    stream = world.oa.chat.completions.create(stream=True, **kw)  # type: ignore[call-overload]
    assert _first_text_while_decoding(world, iter(stream))
    stream.close()
    _wait(lambda: world.engine()["aborted"] == aborted + 1, "the cut stream's abort")

    async def go(c: openai.AsyncOpenAI) -> None:
        stream = await c.completions.create(
            model=world.path,
            prompt="12 + 34 =",
            max_tokens=room,
            seed=4,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                assert world.engine()["live_rows"] >= 1
                break
        else:
            raise AssertionError("the stream sent no text")
        await stream.close()

    world.arun(go)
    _wait(lambda: world.engine()["aborted"] == aborted + 2, "the cut async stream's abort")
    _wait(lambda: world.engine()["live_rows"] == 0, "the batch to empty")


def test_a_streams_pieces_are_its_tokens_with_exact_usage(world: World) -> None:
    """Chunks come token by token (one logprob entry per sampled token, text in many chunks), and
    concatenate to the whole answer's text and tokens; usage is the whole answer's."""
    kw: dict[str, Any] = dict(model=world.path, n=2, max_tokens=40, temperature=1.0, seed=9, logprobs=True)
    extra = {"return_tokens_as_token_ids": True, "ignore_eos": True}
    whole = world.oa.chat.completions.create(messages=MESSAGES, extra_body=extra, **kw)  # type: ignore[call-overload]
    texts: dict[int, str] = defaultdict(str)
    ids: dict[int, list[int]] = defaultdict(list)
    pieces: dict[int, int] = defaultdict(int)
    usage = None
    for chunk in world.oa.chat.completions.create(
        messages=MESSAGES, stream=True, stream_options={"include_usage": True}, extra_body=extra, **kw
    ):  # type: ignore[call-overload]
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            pieces[c.index] += bool(c.delta.content)
            ids[c.index] += _ids(c.logprobs.content) if c.logprobs and c.logprobs.content else []
    for c in whole.choices:
        assert texts[c.index] == c.message.content
        assert ids[c.index] == _ids(c.logprobs.content)  # type: ignore[union-attr]
        assert pieces[c.index] > len(ids[c.index]) // 4  # many pieces, not one at the end
    assert usage is not None and whole.usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole.usage.prompt_tokens, 80)
    assert whole.usage.completion_tokens == 80


def _wait(cond: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_a_client_gone_mid_stream_frees_its_rows(world: World) -> None:
    """A long request of 8 rows decodes; a stream of 4 rows joins it and is cut: its 4 rows leave
    the batch at once, and the 8 others finish every token they were asked for."""
    room = 1024 - len(world.chat_prompt(MESSAGES))
    body = {
        "model": TEST_MODEL,
        "messages": MESSAGES,
        "max_tokens": room,
        "temperature": 1.0,
        "ignore_eos": True,
    }
    aborted = world.engine()["aborted"]
    other: dict[str, Any] = {}
    runner = threading.Thread(target=lambda: other.update(
        world.oa.chat.completions.create(n=8, seed=1, extra_body={"ignore_eos": True}, **{k: v for k, v in body.items() if k != "ignore_eos"}).model_dump()  # type: ignore[call-overload]
    ))  # fmt: skip
    runner.start()
    _wait(lambda: world.engine()["live_rows"] >= 8, "the 8 rows to decode")
    url, auth = f"{world.srv.base_url}/v1/chat/completions", {"Authorization": f"Bearer {KEY}"}
    with httpx.stream(
        "POST", url, json={**body, "n": 4, "seed": 2, "stream": True}, headers=auth, timeout=120
    ) as r:
        lines = r.iter_lines()  # kept: a discarded iterator closes the response (httpx)
        first = next(lines)
        assert json.loads(first.removeprefix("data: "))["choices"][0]["delta"]["role"] == "assistant"
        _wait(lambda: world.engine()["live_rows"] == 12, "the stream's 4 rows to join")
        del lines
    _wait(lambda: world.engine()["aborted"] == aborted + 1, "the cut stream's abort")
    assert world.engine()["live_rows"] <= 8  # the batch shrank by the stream's rows
    runner.join(timeout=600)
    assert other["usage"]["completion_tokens"] == 8 * room  # the other request, unaffected


class Workers:
    """``serve --rollout-workers 1``: sampling in one rollout worker process."""

    def __init__(self, srv: LocalServer) -> None:
        self.srv = srv
        self.oa = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key=KEY, max_retries=0)

    def engine(self) -> dict[str, Any]:
        r = httpx.get(f"{self.srv.base_url}/console/api/engine", headers={"X-API-Key": KEY}, timeout=30)
        return r.json()["engines"][0]["rollout"]

    def worker_pids(self) -> list[int]:
        """The server's rollout worker processes: its children spawned by ``multiprocessing``."""
        assert self.srv.proc is not None
        out = []
        for d in Path("/proc").iterdir():
            try:
                stat, cmd = (d / "stat").read_text(), (d / "cmdline").read_bytes()
            except OSError:  # not a process, or one that just ended
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == self.srv.proc.pid and b"spawn_main" in cmd:
                out.append(int(d.name))
        return out


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workers]:
    with local_server(tmp_path_factory, "openai-workers", "--rollout-workers", "1") as srv:
        yield Workers(srv)


@pytest.mark.slow  # a second server, whose rollout worker process loads its own base model
def test_with_rollout_workers_a_stream_is_live_and_a_cut_one_leaves_the_workers_batch(
    workers: Workers,
) -> None:
    """The disconnect test above, with sampling in a rollout worker process (``--rollout-workers``):
    the stream's first text arrives while its rows decode in the worker, and once it is cut the
    abort reaches the worker, whose running batch shrinks by the stream's rows (as the worker
    reports it); the request beside it finishes every token."""
    oa, engine = workers.oa, workers.engine
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir()))
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    room = 1024 - len(tok.encode(text, add_special_tokens=False))
    body: dict[str, Any] = dict(model=TEST_MODEL, messages=MESSAGES, max_tokens=room, temperature=1.0)
    other: dict[str, Any] = {}
    runner = threading.Thread(target=lambda: other.update(
        oa.chat.completions.create(n=3, seed=1, extra_body={"ignore_eos": True}, **body).model_dump()  # type: ignore[call-overload]
    ))  # fmt: skip
    runner.start()
    _wait(lambda: engine()["live_rows"] >= 3, "the 3 rows to decode in the worker")
    stream = oa.chat.completions.create(n=2, seed=2, stream=True, extra_body={"ignore_eos": True}, **body)  # type: ignore[call-overload]
    aborted = engine()["aborted"]
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            assert engine()["live_rows"] == 5  # text came while the stream's 2 rows decode
            break
    stream.close()
    _wait(lambda: engine()["aborted"] == aborted + 1, "the worker to take the abort")
    assert engine()["live_rows"] <= 3  # the worker's batch shrank by the stream's rows
    runner.join(timeout=900)
    assert other["usage"]["completion_tokens"] == 3 * room  # the other request, unaffected


@pytest.mark.slow  # the killed worker restarts (loads its base model)
def test_a_stream_whose_worker_dies_goes_on_where_it_stopped(workers: Workers) -> None:
    """Two streams of 2 choices decode in the rollout worker, one seeded by the client and one
    not; once both have sent text, the worker is killed (``kill -9``). Their requests run again on
    the restarted worker and each stream goes on where it stopped: its text (and the tokens of its
    logprobs) concatenate to the whole answer's, every token sent once, and the seeded one equals
    an unkilled whole answer with its seed. The unseeded stream was given a seed by the server:
    its re-run sampled the tokens it had sent (without one the text after the kill would be cut)."""
    n_tokens = 400  # decoding long after the first text
    kw: dict[str, Any] = dict(
        model=TEST_MODEL, messages=MESSAGES, n=2, max_tokens=n_tokens, temperature=1.0, logprobs=True
    )
    kw["extra_body"] = {"ignore_eos": True, "return_tokens_as_token_ids": True}
    texts: dict[str, dict[int, str]] = {"seeded": defaultdict(str), "unseeded": defaultdict(str)}
    ids: dict[str, dict[int, list[int]]] = {"seeded": defaultdict(list), "unseeded": defaultdict(list)}
    finish: dict[str, dict[int, str]] = {"seeded": {}, "unseeded": {}}
    failed: list[BaseException] = []

    def read(name: str, seed: int | None) -> None:
        try:
            for chunk in workers.oa.chat.completions.create(stream=True, seed=seed, **kw):  # type: ignore[call-overload]
                for c in chunk.choices:
                    texts[name][c.index] += c.delta.content or ""
                    ids[name][c.index] += (
                        _ids(c.logprobs.content) if c.logprobs and c.logprobs.content else []
                    )
                    if c.finish_reason:
                        finish[name][c.index] = c.finish_reason
        except BaseException as e:
            failed.append(e)

    threads = [threading.Thread(target=read, args=a) for a in (("seeded", 5), ("unseeded", None))]
    for t in threads:
        t.start()
    _wait(
        lambda: bool(failed) or all(len(texts[name]) == 2 for name in texts),
        "text of every choice",
        timeout=600,
    )
    assert not failed, failed
    [pid] = workers.worker_pids()
    rerun = workers.engine()["rerun"]
    os.kill(pid, signal.SIGKILL)
    for t in threads:
        t.join(timeout=900)
        assert not t.is_alive(), "a stream did not end"
    assert not failed, failed
    assert workers.engine()["rerun"] == rerun + 2  # both requests were cut and ran again
    assert workers.worker_pids() != [pid]  # a new worker served the re-runs
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir()))
    for name in texts:
        assert finish[name] == {0: "length", 1: "length"}
        for i in (0, 1):
            assert len(ids[name][i]) == n_tokens  # every token sent once
            assert texts[name][i] == tok.decode(ids[name][i], skip_special_tokens=True)
    whole = workers.oa.chat.completions.create(seed=5, **kw)  # type: ignore[call-overload]
    for c in whole.choices:
        assert texts["seeded"][c.index] == c.message.content
        assert ids["seeded"][c.index] == _ids(c.logprobs.content)  # type: ignore[union-attr]


HERMES = """{%- if tools %}<|im_start|>system
# Tools

You may call functions. Their signatures are within <tools></tools> XML tags:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

For each call, return a JSON object within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' %}<|im_start|>assistant
{% if message.content %}{{ message.content }}{% endif %}
{%- for call in message.tool_calls or [] %}<tool_call>{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call><|im_end|>'


def test_tool_calls_parse_on_a_qwen_family_template(tmp_path: Path) -> None:
    folder = other_family_model(tmp_path / "qwen2", "qwen2")
    runtime = Runtime(tmp_path / "data")
    app = embedded_app(runtime, base_models=[folder], chat_template=HERMES)
    try:
        tenant = app.state.server.auth.tenant(KEY)
        path = _train_tool_call(opentinker.ServiceClient(runtime=runtime, tenant=tenant), folder)

        async def ask(c: openai.AsyncOpenAI) -> Any:
            messages = [{"role": "user", "content": "What is the weather in Paris?"}]
            return await c.chat.completions.create(model=path, messages=messages, tools=TOOLS, temperature=0)  # type: ignore[arg-type]

        answer = asyncio.run(_embedded(app, ask))
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        [call] = choice.message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {
            "city": "Paris"
        }
        with _served(app) as base_url:
            _streamed_tool_call(app, base_url, path)
    finally:
        app.state.server.close()


@contextlib.contextmanager
def _served(app: Any) -> Iterator[str]:
    """``app`` served over real HTTP by uvicorn on a thread of this process (streams arrive as sent)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        _wait(lambda: server.started or not thread.is_alive(), "uvicorn to start")
        assert server.started
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)


def _streamed_tool_call(app: Any, base_url: str, path: str) -> None:
    """A streamed tool call as OpenAI streams it: its id, type and name first, then its
    ``arguments``, once its block has closed and while the row still decodes (``ignore_eos``: it
    goes on past its answer); accumulated, the call equals the whole (non-streamed) answer's."""
    oa = openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw: dict[str, Any] = dict(model=path, messages=messages, tools=TOOLS, temperature=0, max_tokens=300)
    kw["extra_body"] = {"ignore_eos": True}
    whole = oa.chat.completions.create(**kw).choices[0]  # type: ignore[call-overload]
    [want] = whole.message.tool_calls or []
    runtime = app.state.server.runtime
    deltas, content, finish, live_at_args = [], "", None, []
    for chunk in oa.chat.completions.create(stream=True, **kw):  # type: ignore[call-overload]
        for c in chunk.choices:
            content += c.delta.content or ""
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                if d.function and d.function.arguments and not live_at_args:
                    live_at_args.append(runtime.engine_stats(trainers=False)[0]["rollout"]["live_rows"])
                deltas.append(d)
    assert live_at_args == [1]  # the first arguments came while the row decoded
    first = deltas[0]
    assert first.id and first.type == "function" and first.function is not None
    assert (first.function.name, first.function.arguments) == ("get_weather", "")
    assert {d.index for d in deltas} == {0} and all(d.id is None for d in deltas[1:])
    args = [d.function.arguments or "" for d in deltas[1:] if d.function]
    assert len([a for a in args if a]) == 1 and "".join(args) == want.function.arguments  # once closed
    assert finish == whole.finish_reason == "tool_calls" and content == (whole.message.content or "")


def test_a_stream_whose_tokens_come_with_the_result_is_one_piece_per_token(tmp_path: Path) -> None:
    """A sampling service that hands no tokens on while decoding (a sharded group's sampler; here
    whole batches of the backend's ``generate``): the stream's pieces (one per token, with its
    logprob) follow the result and concatenate to the whole answer."""
    runtime = Runtime(tmp_path / "data")
    app = embedded_app(runtime, base_models=[TEST_MODEL])
    stack = runtime.base_stack(TEST_MODEL)
    assert stack.scheduler.rollout is not None
    stack.scheduler.rollout.shutdown()
    stack.scheduler.rollout = _WholeResults(stack.sampler)
    kw: dict[str, Any] = dict(
        model=TEST_MODEL, prompt="12 + 34 =", max_tokens=16, n=2, temperature=1.0, seed=5, logprobs=1
    )
    kw["extra_body"] = {"ignore_eos": True}

    async def ask(c: openai.AsyncOpenAI) -> tuple[Any, dict[int, list[Any]]]:
        whole = await c.completions.create(**kw)
        chunks: dict[int, list[Any]] = defaultdict(list)
        async for chunk in await c.completions.create(stream=True, **kw):
            for ch in chunk.choices:
                chunks[ch.index].append(ch)
        return whole, chunks

    try:
        whole, chunks = asyncio.run(_embedded(app, ask))
    finally:
        app.state.server.close()
    for c in whole.choices:
        mine = chunks[c.index]
        assert len(mine) == 16 and "".join(ch.text for ch in mine) == c.text
        assert [x for ch in mine for x in ch.logprobs.token_logprobs] == c.logprobs.token_logprobs
        assert [ch.finish_reason for ch in mine] == [None] * 15 + ["length"]


class _WholeResults(RequestBook[Future]):
    """A sampling service that streams nothing: each request is decoded whole by the backend's
    ``generate`` on a thread of its own, its tokens coming only with its result."""

    max_rows = 256

    def __init__(self, backend: SamplingBackend) -> None:
        super().__init__()
        self.backend = backend
        self._pool = ThreadPoolExecutor(1)

    def _pin(self, req: SampleRequest) -> Pinned:
        return Pinned(req, None)  # ``generate`` resolves the policy

    def _enqueue(self, rid: int, pinned: Pinned, future: Future) -> Future:
        self._pool.submit(self._run, rid, pinned.req)
        return future

    def _run(self, rid: int, req: SampleRequest) -> None:
        [out] = self.backend.generate([req])
        with self._lock:
            fut = self._answered(rid)
        if fut is not None:
            fut.set_result(out) if isinstance(out, SampleResult) else fut.set_exception(out)

    @staticmethod
    def _future(entry: Future) -> Future:
        return entry

    def _where(self, rid: int) -> SampleState:
        return "taken"

    def _unqueue(self, rid: int) -> bool:
        return False

    def _stop(self, rid: int) -> None:
        pass  # it runs to its end, unanswered

    def follow(self, group: str, policy_id: str) -> None:
        pass

    def shutdown(self) -> None:
        self._pool.shutdown()


async def _embedded(app: Any, fn: Callable[[openai.AsyncOpenAI], Any]) -> Any:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://embedded") as http:
        client = openai.AsyncOpenAI(
            base_url="http://embedded/v1", api_key=KEY, http_client=http, max_retries=0
        )
        return await fn(client)


def _train_tool_call(service: Any, folder: str) -> str:
    """A LoRA that answers the weather question with :data:`CALL` (greedy), trained to it."""
    tc = service.create_lora_training_client(base_model=folder, rank=16, seed=0)
    tok = tc.get_tokenizer()
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    text = tok.apply_chat_template(
        messages, tools=TOOLS, chat_template=HERMES, add_generation_prompt=True, tokenize=False
    )
    prompt, reply = tok.encode(text, add_special_tokens=False), tok.encode(CALL, add_special_tokens=False)
    ids = prompt + reply
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": [0.0] * (len(prompt) - 1) + [1.0] * len(reply)},
    )
    greedy = types.SamplingParams(max_tokens=len(reply) + 2, temperature=0)
    for step in range(1, 301):
        tc.forward_backward([datum], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        if step % 10 == 0:
            sampler = tc.save_weights_and_get_sampling_client()
            out = sampler.sample(types.ModelInput.from_ints(prompt), 1, greedy).result()
            if list(out.sequences[0].tokens) == reply:
                return tc.save_weights_for_sampler("tool-call").result().path
    raise AssertionError("the LoRA did not learn the tool call in 300 steps")
