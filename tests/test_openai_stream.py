"""Token-by-token streaming below the OpenAI routes, and aborts reaching rollout workers.

- Incremental detokenization (``server/openai_stream.py``'s ``TextSoFar``) with the tiny model's
  real byte-level tokenizer: text holding characters split over several tokens (é, CJK, emoji)
  fed one token at a time never sends a broken character, never sends text from a stop string
  on, and what it sent plus the rest is exactly the whole decode (the non-streamed text).
- Hermes tool calls streamed (``server/openai_tools.py``): fed a character at a time, the content
  before ``<tool_call>``, then, once the block closes, the call's id/type/name and its arguments
  as the whole answer writes them (odd spacing, nested values, escapes, a late name, a string);
  a block cut off or not a call is never sent as one, as the whole answer never has it.
- A re-run request's tokens (sent again from the first) are skipped where already taken.
- The sampling loop (in process) and a rollout worker process hand a streamed request's tokens to
  its ``TokenSink`` while it decodes: the first piece arrives while its rows are still in the
  running batch (read on the thread that runs the batch / resolves the result, so no timing),
  and the pieces concatenate to the result's tokens and logprobs exactly.
- ``WorkerPool.abort`` reaches the worker: the aborted request's rows leave that worker's running
  batch (its reported rows shrink, its aborted count moves) and a request beside it finishes
  every token it asked for.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from opentinker.engine import Engine
from opentinker.models.registry import tiny_model_dir
from opentinker.sampling import NativeBackend, SampleRequest, SampleResult, SamplingParams
from opentinker.sampling.handles import SampleCancelled
from opentinker.sampling.loop import SamplingCore, SamplingLoop
from opentinker.sampling.types import Tokens, TokenSink
from opentinker.server.openai_format import Choice, parse_tool_calls
from opentinker.server.openai_stream import TextSoFar
from opentinker.server.openai_tools import ToolText
from opentinker.service.runtime import Runtime
from opentinker.workers.pool import WorkerPool
from tests.conftest import TEST_MODEL

SEEDED = SamplingParams(max_tokens=40, temperature=1.0, seed=11, stop=[])


def _wait(cond: Callable[[], bool], what: str, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _feed(tok: object, ids: list[int], stops: list[str]) -> tuple[list[str], TextSoFar]:
    so_far = TextSoFar(tok, stops)
    sent = []
    for i, t in enumerate(ids):
        assert so_far.add(Tokens(1, 0, i, [t], [0.0]))
        sent.append(so_far.new_text())
    return sent, so_far


def test_only_stable_text_is_sent_across_split_characters_and_stop_strings() -> None:
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir()))
    text = "naïve café: 中文 🙂 done. Ünïcödé ok"
    ids = list(tok.encode(text, add_special_tokens=False))
    assert any("\ufffd" in tok.decode([t]) for t in ids)  # characters do split over tokens here
    whole = tok.decode(ids, skip_special_tokens=True)
    sent, so_far = _feed(tok, ids, [])
    assert not any("\ufffd" in s for s in sent)
    assert sum(1 for s in sent if s) > 5  # it streams, piece by piece
    final = Choice(ids, [0.0] * len(ids), None, whole, "stop")
    assert "".join(sent) + so_far.rest(final) == whole

    # a stop string: nothing from it on is sent, even while it is only partly decoded
    stops = ["🙂 do"]
    cut = whole[: whole.find("🙂 do")]
    sent, so_far = _feed(tok, ids, stops)
    assert "".join(sent) == cut
    assert "".join(sent) + so_far.rest(Choice(ids, [], None, cut, "stop")) == cut
    # the text before a partial stop waits until the next tokens show it is no stop
    sent, _ = _feed(tok, ids, ["中文 🙂 zzz"])
    upto = []
    for s in sent:
        upto.append((upto[-1] if upto else "") + s)
    assert all(not u.endswith("中") for u in upto)  # "中" might start the stop: held, then sent
    assert "".join(sent) == whole  # it was no stop: all of it went out


def test_a_re_run_from_the_start_goes_on_where_the_stream_stopped() -> None:
    """A request run again (its worker lost) sends its tokens from the first: the same tokens
    (seeded) are skipped and the text goes on; other tokens stop the choice's text there."""
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir()))
    whole = "naïve café: 中文 🙂 done."
    ids = list(tok.encode(whole, add_special_tokens=False))
    so_far, sent = TextSoFar(tok, []), []
    for i in range(6):
        assert so_far.add(Tokens(1, 0, i, [ids[i]], [float(i)]))
        sent.append(so_far.new_text())
    # the re-run: tokens from the first, in other pieces
    assert not so_far.add(Tokens(2, 0, 0, ids[:4], [0.5] * 4))  # nothing new
    assert so_far.add(Tokens(2, 0, 4, ids[4:9], [0.5] * 5))  # 2 held, 3 new
    sent.append(so_far.new_text())
    assert so_far.add(Tokens(2, 0, 9, ids[9:], [0.5] * (len(ids) - 9)))
    sent.append(so_far.new_text())
    assert so_far.tokens == ids and so_far.logprobs[:6] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert "".join(sent) + so_far.rest(Choice(ids, [], None, whole, "stop")) == whole
    # a re-run that samples other tokens: nothing more is taken
    other = TextSoFar(tok, [])
    assert other.add(Tokens(1, 0, 0, ids[:5], [0.0] * 5))
    assert not other.add(Tokens(2, 0, 0, [ids[0], ids[1] + 1, *ids[2:7]], [0.0] * 7))
    assert not other.add(Tokens(2, 0, 7, ids[7:8], [0.0]))
    assert other.tokens == ids[:5]


@pytest.mark.parametrize(
    "block",
    [
        '{"name": "get_weather", "arguments": {"city": "Paris"}}',
        '{ "name":"f","arguments":{"a" :[1, 2.50,-3e2 ,true,null],"b":{"c":"x\\"y\\u00e9", "d": {}}} }',
        '{"arguments": {"n": 10}, "name": "late_name"}',
        '{"name": "s", "arguments": "{\\"raw\\": 1}"}',
    ],
)
def test_a_tool_call_is_sent_once_its_block_closes_and_adds_up_to_the_whole_answer(block: str) -> None:
    """A Hermes answer fed one character at a time: content before the block, then, once the
    block has closed and parsed (never before: it could still be cut off), the call's
    id/type/name and its ``arguments`` as the whole answer writes them."""
    text = f"Let me check. <tool_call>\n{block}\n</tool_call>"
    whole = Choice([], [], None, text, "stop")
    parse_tool_calls(whole)
    assert whole.tool_calls is not None
    [want] = whole.tool_calls
    sent, content, deltas = ToolText(), "", []
    for i in range(len(text) + 1):
        new, calls = sent.update(text[:i])
        content += new
        deltas += [(i, d) for d in calls]
    assert content == whole.text == "Let me check."
    first = deltas[0][1]
    assert (first.index, first.type, first.function.name, first.function.arguments) == (
        0,
        "function",
        want.function.name,
        "",
    )
    assert first.id and all(d.id is None and d.function.name is None for _, d in deltas[1:])
    assert "".join(d.function.arguments for _, d in deltas[1:]) == want.function.arguments
    assert {i for i, _ in deltas} == {len(text)}  # all at the block's last character


@pytest.mark.parametrize(
    "text",
    [
        'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',  # cut off
        'Sure. <tool_call>\n{"name": "get_we</tool_call>',  # not JSON
        'Sure. <tool_call>["get_weather"]</tool_call> and <tool_call>{"name": "f"}</tool_call>',
    ],
)
def test_a_cut_off_or_unparsable_block_is_never_sent_as_a_call(text: str) -> None:
    """Streamed a character at a time, the calls sent are exactly the whole answer's: none for a
    block cut off or not a call, and a later good block after a bad one."""
    whole = Choice([], [], None, text, "length")
    parse_tool_calls(whole)
    sent, deltas = ToolText(), []
    for i in range(len(text) + 1):
        deltas += sent.update(text[:i])[1]
    names = [d.function.name for d in deltas if d.function is not None and d.function.name]
    assert names == [c.function.name for c in whole.tool_calls or []]
    assert "Sure." in whole.text and sent.content == "Sure."


def _loop(engine: Engine) -> SamplingLoop:
    backend = NativeBackend(engine, prefix_cache_bytes=0)
    return SamplingLoop(SamplingCore(backend.decoder(snapshots_only=True), backend))


def _check_pieces(pieces: list[Tokens], res: SampleResult, samples: int) -> None:
    for k in range(samples):
        mine = [p for p in pieces if p.sample == k]
        assert [p.start for p in mine] == [sum(len(q.tokens) for q in mine[:i]) for i in range(len(mine))]
        tokens = [t for p in mine for t in p.tokens]
        logprobs = [x for p in mine for x in p.logprobs]
        seq = res.sequences[k]
        assert seq.tokens[: len(tokens)] == tokens and seq.logprobs[: len(logprobs)] == logprobs
        assert len(tokens) >= len(seq.tokens) - 1  # only the last step's token may come with the result
        assert seq.topk_logprobs is not None
        assert [t for p in mine for t in p.topk or []] == seq.topk_logprobs[: len(tokens)]


def test_the_rollout_loop_streams_tokens_while_the_rows_decode(engine: Engine) -> None:
    loop = _loop(engine)
    try:
        pieces: list[Tokens] = []
        live_at_first: list[int] = []

        def deliver(piece: Tokens) -> None:  # on the loop's thread, between two steps
            if not pieces:
                live_at_first.append(loop.core.decoder.live_rows)
            pieces.append(piece)

        prompt = [5 + (7 * i) % 200 for i in range(12)]
        req = SampleRequest(
            None, prompt, SEEDED, num_samples=2, topk_sample_logprobs=2, stream=TokenSink(deliver)
        )
        res = loop.submit(req).future.result(timeout=300)
        assert isinstance(res, SampleResult)
        assert live_at_first == [2]  # the first tokens went out while both rows decoded
        _check_pieces(pieces, res, 2)
        [plain] = NativeBackend(engine, prefix_cache_bytes=0).generate(
            [SampleRequest(None, prompt, SEEDED, 2)]
        )
        assert isinstance(plain, SampleResult)
        assert [s.tokens for s in res.sequences] == [
            s.tokens for s in plain.sequences
        ]  # streaming changes nothing
    finally:
        loop.shutdown()


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Runtime, WorkerPool]]:
    runtime = Runtime(tmp_path_factory.mktemp("stream-workers"), rollout_workers=1)
    p = runtime.base_stack(TEST_MODEL).scheduler.rollout
    assert isinstance(p, WorkerPool)
    yield runtime, p
    runtime.shutdown()


def test_a_rollout_worker_streams_tokens_while_the_rows_decode(pool: tuple[Runtime, WorkerPool]) -> None:
    _, workers = pool
    pieces: list[Tokens] = []
    done_at_first: list[bool] = []
    fut: list[Future] = []
    ready = threading.Event()

    def deliver(piece: Tokens) -> None:  # on the pool's dispatcher, which also resolves the result
        ready.wait(60)
        if not pieces:
            done_at_first.append(fut[0].done())
        pieces.append(piece)

    prompt = [9 + (11 * i) % 200 for i in range(10)]
    req = SampleRequest(
        None, prompt, SEEDED, num_samples=2, topk_sample_logprobs=2, stream=TokenSink(deliver)
    )
    fut.append(workers.submit(req).future)
    ready.set()
    res = fut[0].result(timeout=300)
    assert isinstance(res, SampleResult)
    assert done_at_first == [False]  # tokens came before the answer
    _check_pieces(pieces, res, 2)
    plain = workers.submit(SampleRequest(None, prompt, SEEDED, num_samples=2)).future.result(timeout=300)
    assert [s.tokens for s in plain.sequences] == [s.tokens for s in res.sequences]


def test_an_abort_reaches_the_worker_and_its_rows_leave_the_batch(pool: tuple[Runtime, WorkerPool]) -> None:
    _, workers = pool
    long = SamplingParams(max_tokens=1000, temperature=1.0, seed=3, stop=[])
    aborted = workers.stats.aborted
    other = workers.submit(SampleRequest(None, [7, 8, 9, 10], long, num_samples=3)).future
    _wait(lambda: workers.stats.live_rows == 3, "the 3 rows to decode")
    cut = workers.submit(SampleRequest(None, [11, 12, 13, 14], long, num_samples=2))
    _wait(lambda: workers.stats.live_rows == 5, "the 2 rows to join")
    assert workers.abort(cut)
    with pytest.raises(SampleCancelled):
        cut.future.result(timeout=10)  # failed at once
    _wait(lambda: workers.stats.aborted == aborted + 1, "the worker's abort")
    assert workers.stats.live_rows <= 3  # the worker's batch shrank by the aborted rows
    res = other.result(timeout=600)
    assert [len(s.tokens) for s in res.sequences] == [1000] * 3  # the request beside it, unaffected
    assert not workers.abort(cut)  # answered (aborted) already


def test_token_sinks_cross_to_a_worker_as_a_bare_marker(tmp_path: Path) -> None:
    import pickle

    got: list[Tokens] = []
    sink = TokenSink(got.append)
    copy = pickle.loads(pickle.dumps(SampleRequest(None, [1], SEEDED, stream=sink)))
    assert isinstance(copy.stream, TokenSink)
    copy.stream(Tokens(1, 0, 0, [1], [0.0]))  # the worker's copy delivers nowhere
    assert got == []
