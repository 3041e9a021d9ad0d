"""Request plumbing: seq_id gaps, batch polling, cancelling, clone ids, unloading, queue states.

Units first (the reorder buffer, the refused-body parser, the completion queues, the scheduler's
sample tickets on the real tiny engine), then one server (a child process, ``--dev``, the test
model) driven by the unmodified ``tinker`` SDK — or by raw HTTP with the SDK's own request types
where the SDK has no public method for a route.
"""

from __future__ import annotations

import asyncio
import json
import pickle
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import httpx
import numpy as np
import pytest
import tinker
from tinker import types
from tinker.lib.api_future_impl import QueueState
from tinker.lib.client_connection_pool_type import ClientConnectionPoolType
from tinker.lib.queue_state_logger import QueueStateLogger
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output
from tinker.types.try_again_response import TryAgainResponse

from opentinker.engine import Engine
from opentinker.sampling import NativeBackend, SampleHandle, SampleRequest, SamplingParams
from opentinker.sampling.loop import SamplingCore, SamplingLoop
from opentinker.sampling.types import Tokens
from opentinker.scheduler import Scheduler
from opentinker.server.completions import CompletionQueues
from opentinker.server.errors import BadRequest, TooManyPending
from opentinker.server.futures import FutureStore
from opentinker.server.local import LocalServer
from opentinker.server.ordering import GapTimeout, Sequencer
from opentinker.server.refusals import refused_seq, sdk_gives_up
from tests.conftest import TEST_MODEL, local_server

GAP_S = 2.0
KEY_A = "tml-lifecycle-tenant-a"
KEY_B = "tml-lifecycle-tenant-b"
PROTO = {"Content-Type": "application/x-protobuf"}
TOKENS = [int(t) for t in np.random.default_rng(1).integers(3, 1000, 12)]


# ---------------------------------------------------------------------------- unit: the buffer
def _runner(log: list[int], seq: int) -> Any:
    return lambda: log.append(seq)


def test_a_refused_seq_id_is_skipped_as_soon_as_a_later_one_waits() -> None:
    seq, log = Sequencer(), []
    seq.open("m")
    seq.refused("m", 1)  # nothing waits yet: seq 1 may still be sent again, fixed
    seq.submit("m", 1, "d1", "r1", Future(), _runner(log, 1))
    assert log == [1]
    seq.refused("m", 2)
    seq.submit("m", 3, "d3", "r3", Future(), _runner(log, 3))  # waits only for the refused 2
    assert log == [1, 3]
    seq.submit("m", 5, "d5", "r5", Future(), _runner(log, 5))  # 4 is missing, not refused
    assert log == [1, 3]
    seq.refused("m", 4)
    assert log == [1, 3, 5]


def test_a_refused_duplicate_never_skips_the_registered_request() -> None:
    seq, log = Sequencer(), []
    seq.open("m")
    seq.submit("m", 2, "d2", "r2", Future(), _runner(log, 2))
    seq.refused("m", 2)  # e.g. seq 2 again with another body (400): the first one stands
    seq.refused("m", 10**9)  # far outside the window: ignored
    seq.refused("other-model", 1)  # unknown model: ignored
    assert log == []
    seq.submit("m", 1, "d1", "r1", Future(), _runner(log, 1))
    assert log == [1, 2]


def test_the_gap_timeout_fails_the_requests_behind_the_gap_and_the_model_goes_on() -> None:
    seq, log = Sequencer(), []
    seq.open("m")
    outs = {i: Future() for i in (3, 4, 6)}
    for i in (3, 4, 6):
        seq.submit("m", i, f"d{i}", f"r{i}", outs[i], _runner(log, i))
    assert seq.skip_gaps(gap_timeout_s=60) == 0
    assert seq.skip_gaps(gap_timeout_s=-1) == 2  # 3 and 4 waited for 1..2
    for i in (3, 4):
        err = outs[i].exception()
        assert isinstance(err, GapTimeout) and "seq_ids 1..2" in str(err) and f"seq_id {i} " in str(err)
    assert not outs[6].done() and log == []  # 6 waits for 5 with a fresh clock
    assert seq.skip_gaps(gap_timeout_s=60) == 0
    seq.submit("m", 5, "d5", "r5", Future(), _runner(log, 5))
    assert log == [5, 6]
    with pytest.raises(BadRequest, match="seq_id 2 of model m arrived after later requests"):
        seq.submit("m", 2, "d2", "r2", Future(), _runner(log, 2))


def test_the_seq_id_held_requests_wait_for_gets_past_the_pending_limit() -> None:
    async def run() -> None:
        store, seq = FutureStore(max_pending=1, result_ttl_s=60), Sequencer()
        seq.open("m")
        _, held = store.create("t")
        seq.submit("m", 2, "d2", "r2", held, lambda: None)  # the tenant's one slot: waits for 1
        assert seq.awaited("m", 1) and not seq.awaited("m", 3)
        with pytest.raises(TooManyPending):
            store.create("t")
        _, first = store.create("t", exempt=seq.awaited("m", 1))  # would deadlock otherwise
        assert store.pending("t") == 2

    asyncio.run(run())


def test_refused_bodies_name_their_seq_id() -> None:
    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[], loss_fn="cross_entropy"),
        model_id="s:train:0",
        seq_id=7,
    )
    proto = forward_backward_request_to_proto(req).SerializeToString()
    assert refused_seq(proto, "application/x-protobuf") == ("s:train:0", 7)
    assert refused_seq(b'{"model_id": "m", "seq_id": 3, "x": 1}', "application/json") == ("m", 3)
    for body in (
        b"",
        b"\xff\x00garbage",
        b"[1, 2]",
        b'{"model_id": "m"}',
        b'{"model_id": "m", "seq_id": true}',
    ):
        assert refused_seq(body, "application/json") is None
    assert refused_seq(b"\xff\xff\xff", "application/x-protobuf") is None
    assert [s for s in (400, 401, 402, 404, 408, 409, 413, 422, 429, 500) if sdk_gives_up(s)] == [
        400,
        401,
        404,
        413,
        422,
    ]


# ---------------------------------------------------------------------------- unit: completions
def test_completion_queues_report_each_request_once_with_cursors() -> None:
    async def run() -> None:
        q = CompletionQueues(ttl_s=60)
        ok, bad = Future(), Future()
        q.track(("s", 0), "r1", ok)
        q.track(("s", 0), "r2", bad)
        q.track(("s", 1), "r3", Future())  # another clone's queue
        t0 = time.monotonic()
        assert await q.poll(("s", 0), 0, timeout=0.2) == ([], 0)  # nothing yet: waits, then empty
        assert time.monotonic() - t0 >= 0.15
        ok.set_result(b"12345")
        events, cursor = await q.poll(("s", 0), 0, timeout=5)
        assert events == [{"state": "finished", "request_id": "r1", "response_payload_uncompressed_size": 5}]
        waiter = asyncio.ensure_future(q.poll(("s", 0), cursor, timeout=5))
        await asyncio.sleep(0.05)
        bad.set_exception(ValueError("boom"))
        events2, cursor2 = await waiter  # woken by the completion, before its timeout
        assert events2 == [{"state": "failed", "request_id": "r2"}] and cursor2 > cursor
        assert (await q.poll(("s", 0), cursor, timeout=0))[0] == events2  # not acked yet: again
        # a cursor of an earlier process reads as 0: what this process still has is news to it
        assert (await q.poll(("s", 0), 12345, timeout=0))[0] == events2
        assert await q.poll(("s", 0), cursor2, timeout=0) == ([], cursor2)  # acknowledged: gone
        assert (await q.poll(("s", 0), cursor, timeout=0))[0] == []
        with pytest.raises(BadRequest, match="prev_cursor must be >= 0"):
            await q.poll(("s", 0), -1, timeout=0)

    asyncio.run(run())


# ---------------------------------------------------------------------------- unit: sample request ids
def test_sample_requests_say_held_back_and_cancel_before_admission(engine: Engine) -> None:
    backend = NativeBackend(engine)
    loop = SamplingLoop(SamplingCore(backend.decoder(), backend, max_rows=4))
    sched = Scheduler(engine, loop)
    seen: list[list[str]] = []  # what stood where while request 1 decoded
    handles: list[SampleHandle] = []

    def look(_piece: Tokens) -> None:
        seen.append([sched.sample_state(h) for h in handles[:2]])

    try:
        params = SamplingParams(max_tokens=4, temperature=1.0, seed=0)
        with loop._cv:  # queue all three before the loop can take one
            for n in (4, 2, 1):
                sink = look if n == 4 else None
                handles.append(
                    sched.submit_sample(SampleRequest(None, TOKENS, params, num_samples=n, stream=sink))
                )
            h1, h2, h3 = handles
            assert [h.request_id for h in handles] == [1, 2, 3]  # in submission order
            assert sched.sample_state(h2) == "queued"
            assert sched.cancel_sample(h3) and not sched.cancel_sample(h3)
        assert len(h1.future.result(timeout=120).sequences) == 4
        assert len(h2.future.result(timeout=120).sequences) == 2
        with pytest.raises(RuntimeError, match="cancelled"):
            h3.future.result(timeout=60)
        # request 1 filled the batch: 2 was held back by capacity meanwhile
        assert seen and seen[0] == ["taken", "held_back"]
        assert loop.stats.admitted == 2  # 3 was never decoded
        assert not sched.cancel_sample(h2) and sched.sample_state(h2) == "taken"
        assert not sched.abort_sample(h2)  # answered already
    finally:
        sched.shutdown()


# ---------------------------------------------------------------------------- through the server
@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    args = ["--gap-timeout", str(GAP_S), "--poll-timeout", "0.3", "--max-running", "2", "--batch-polling"]
    with local_server(tmp_path_factory, "lifecycle-data", *args) as srv:
        yield srv


@pytest.fixture(scope="module")
def service(server: LocalServer) -> Iterator[tinker.ServiceClient]:
    sc = tinker.ServiceClient(base_url=server.base_url, api_key=KEY_A)
    yield sc
    sc.close("success").result()


def _datum(toks: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(toks[:-1]),
        loss_fn_inputs={"target_tokens": toks[1:]},  # type: ignore[dict-item]  # lists: the SDK converts
    )


def _http(server: LocalServer, key: str = KEY_A) -> httpx.Client:
    return httpx.Client(base_url=f"{server.base_url}/api/v1", headers={"X-API-Key": key}, timeout=60)


def _fb(model_id: str, seq_id: int, n: int = 1) -> bytes:
    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[_datum(TOKENS)] * n, loss_fn="cross_entropy"),
        model_id=model_id,
        seq_id=seq_id,
    )
    return forward_backward_request_to_proto(req).SerializeToString()


def _result(http: httpx.Client, rid: str, states: list[dict[str, Any]] | None = None) -> httpx.Response:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        r = http.post("/retrieve_future", json=types.FutureRetrieveRequest(request_id=rid).model_dump())
        assert r.status_code == 200, r.text
        if (
            not r.headers["content-type"].startswith("application/json")
            or r.json().get("type") != "try_again"
        ):
            return r
        if states is not None:
            states.append(r.json())
    raise AssertionError(f"no result for {rid}")


def _raw_model(http: httpx.Client) -> str:
    sid = http.post("/create_session", json={}).json()["session_id"]
    body = {"session_id": sid, "model_seq_id": 0, "base_model": TEST_MODEL, "lora_config": {"rank": 2}}
    return _result(http, http.post("/create_model", json=body).json()["request_id"]).json()["model_id"]


def _no_path(text: str, server: LocalServer) -> None:
    assert str(server.data_dir) not in text and "/tmp/" not in text, text


def test_a_send_the_server_refuses_does_not_stall_the_model(
    server: LocalServer, service: tinker.ServiceClient
) -> None:
    """The issue's case: the SDK numbers a call, the server refuses its route (404), and the
    model's next calls must still run — at once, not after a timeout (which would fail them)."""
    tc = service.create_lora_training_client(base_model=TEST_MODEL, rank=2, seed=3).result()
    tc.forward_backward([_datum(TOKENS)], "cross_entropy").result()

    async def refused_send() -> None:  # exactly what TrainingClient.save_weights_external does
        request_id = tc._get_request_id()
        async with tc._take_turn(request_id):
            with tc.holder.aclient(ClientConnectionPoolType.TRAIN) as client:
                await client.post(
                    "/api/v1/a_route_this_server_does_not_serve",
                    body={"model_id": tc.model_id, "seq_id": request_id + 1, "path": "x"},
                    cast_to=dict,
                    options={"max_retries": 0},
                )

    with pytest.raises(tinker.NotFoundError):
        tc.holder.run_coroutine_threadsafe(refused_send()).result(timeout=60)
    t0 = time.monotonic()
    sampler = tc.save_weights_and_get_sampling_client().result(timeout=60)
    params = types.SamplingParams(max_tokens=3, temperature=1.0, seed=1)
    assert (
        len(sampler.sample(types.ModelInput.from_ints(TOKENS), 1, params).result(timeout=60).sequences) == 1
    )
    loss = tc.forward_backward([_datum(TOKENS)], "cross_entropy").result(timeout=60).metrics["loss:sum"]
    assert np.isfinite(loss) and time.monotonic() - t0 < 60


def test_refused_bodies_spend_their_seq_id_only_for_their_own_tenant(server: LocalServer) -> None:
    with _http(server) as http, _http(server, KEY_B) as other:
        model = _raw_model(http)
        # seq 1: a malformed body (422) the SDK would not resend; seq 2 then runs at once
        bad = http.post("/optim_step", json={"model_id": model, "seq_id": 1, "adam_params": {"beta1": "x"}})
        assert bad.status_code == 422 and "beta1" in bad.text
        r2 = http.post("/forward_backward", content=_fb(model, 2), headers=PROTO).json()["request_id"]
        assert "loss:sum" in deserialize_forward_backward_output(_result(http, r2).content).metrics
        # another tenant's refusal naming this model's seq 3 is not this model's business
        assert other.post(
            "/optim_step", json={"model_id": model, "seq_id": 3, "adam_params": 5}
        ).status_code in (
            404,
            422,
        )
        r4 = http.post("/forward_backward", content=_fb(model, 4), headers=PROTO).json()["request_id"]
        failed = _result(http, r4).json()  # waited for 3, which never came: fails after the gap timeout
        assert (
            failed["category"] == "user"
            and "for seq_id 3," in failed["error"]
            and "never arrived" in failed["error"]
        )
        _no_path(failed["error"], server)
        r5 = http.post("/forward_backward", content=_fb(model, 5), headers=PROTO).json()["request_id"]
        assert "loss:sum" in deserialize_forward_backward_output(_result(http, r5).content).metrics
        late = http.post("/forward_backward", content=_fb(model, 3), headers=PROTO)
        assert late.status_code == 400 and "seq_id 3" in late.json()["detail"]


def test_sampling_through_the_sdk_polls_retrieve_futures(
    server: LocalServer, service: tinker.ServiceClient
) -> None:
    sampler = service.create_sampling_client(base_model=TEST_MODEL).result()
    params = types.SamplingParams(max_tokens=3, temperature=1.0, seed=2)
    futures = [sampler.sample(types.ModelInput.from_ints(TOKENS), 2, params) for _ in range(3)]
    assert [len(f.result(timeout=120).sequences) for f in futures] == [2, 2, 2]
    assert sampler._futures_poller is not None  # the SDK waited on the batch poller, not per request
    # an unpickled clone asks the server for its id: unique, never the original's 0
    clones = [pickle.loads(pickle.dumps(sampler)) for _ in range(2)]
    assert [
        len(c.sample(types.ModelInput.from_ints(TOKENS), 1, params).result(60).sequences) for c in clones
    ] == [1, 1]
    ids = [c._cloned_sampler_id for c in clones]
    assert None not in ids and 0 not in ids and len(set(ids)) == 2, ids


def _sampler_id(http: httpx.Client) -> str:
    sid = http.post("/create_session", json={}).json()["session_id"]
    req = types.CreateSamplingSessionRequest(session_id=sid, sampling_session_seq_id=0, base_model=TEST_MODEL)
    return http.post("/create_sampling_session", json=req.model_dump(mode="json")).json()[
        "sampling_session_id"
    ]


def _asample(
    http: httpx.Client, sampler: str, seq_id: int, n: int = 1, max_tokens: int = 3, full: bool = False
) -> str:
    """An async sample request; ``full``: no stop at all (``stop=[]``), so every row runs to
    ``max_tokens`` and none leaves the running batch early (continuous batching would admit a
    waiting request into the room a finished row leaves)."""
    params = types.SamplingParams(
        max_tokens=max_tokens, temperature=1.0, seed=seq_id, stop=[] if full else None
    )
    req = types.SampleRequest(
        sampling_session_id=sampler,
        seq_id=seq_id,
        num_samples=n,
        prompt=types.ModelInput.from_ints(TOKENS),
        sampling_params=params,
    )
    r = http.post("/asample", json=req.model_dump(mode="json", exclude_none=True))
    assert r.status_code == 200, r.text
    return r.json()["request_id"]


def _poll(http: httpx.Client, sampler: str, cursor: int = 0, **kw: Any) -> dict[str, Any]:
    target = {
        "type": "sampling_session",
        "sampling_session_id": sampler,
        "cloned_sampler_id": kw.pop("clone", 0),
    }
    r = http.post("/retrieve_futures", json={"target": target, "prev_cursor": cursor, **kw})
    assert r.status_code == 200, r.text
    return types.FuturesRetrieveResponse.model_validate(r.json()).model_dump(mode="json")


def test_retrieve_futures_reports_completions_and_drops_retrieved_results(server: LocalServer) -> None:
    with _http(server) as http:
        sampler = _sampler_id(http)
        rid = _asample(http, sampler, 7)
        got: list[dict[str, Any]] = []
        cursor = 0
        while not got:
            answer = _poll(http, sampler, cursor)
            got, cursor = answer["completions"], answer["cursor"]
        payload = _result(http, rid)
        assert got == [
            {
                "state": "finished",
                "request_id": rid,
                "response_payload_uncompressed_size": len(payload.content),
            }
        ]
        # a clone's requests (seq_id in its 10⁹ block) are reported on its own queue
        rid_clone = _asample(http, sampler, 5 * 10**9 + 1)
        clone_events: list[dict[str, Any]] = []
        while not clone_events:
            clone_events = _poll(http, sampler, clone=5)["completions"]
        assert [e["request_id"] for e in clone_events] == [rid_clone]
        assert _poll(http, sampler, cursor, timeout=0)["completions"] == []  # acked, nothing new
        _result(http, rid_clone)
        _poll(http, sampler, cursor, timeout=0, retrieved_request_ids=[rid_clone])
        gone = http.post("/retrieve_future", json={"request_id": rid_clone}).json()
        assert "unknown" in gone["error"]  # its result was dropped once reported retrieved


def test_retrieve_futures_refuses_bad_input(server: LocalServer) -> None:
    with _http(server) as http, _http(server, KEY_B) as other:
        sampler = _sampler_id(http)
        target = {"type": "sampling_session", "sampling_session_id": sampler}
        for who, body in (
            (other, {"target": target}),
            (http, {"target": {**target, "sampling_session_id": "nope"}}),
        ):
            r = who.post("/retrieve_futures", json=body)
            assert r.status_code == 404 and "unknown sampler" in r.json()["detail"], r.text
        for bad, field in (
            ({"target": target, "prev_cursor": -1}, "prev_cursor"),
            ({"target": target, "timeout": -3}, "timeout"),
            ({"target": {**target, "cloned_sampler_id": 10**9}}, "cloned_sampler_id"),
            ({"target": target, "retrieved_request_ids": "r1"}, "retrieved_request_ids"),
            ({"prev_cursor": 0}, "target"),
        ):
            r = http.post("/retrieve_futures", json=bad)
            assert r.status_code == 422 and field in r.text, (bad, r.text)
        r = http.post("/retrieve_futures", content=b"{not json", headers={"Content-Type": "application/json"})
        assert r.status_code == 422
        # another tenant's ids in retrieved_request_ids drop nothing
        rid = _asample(http, sampler, 1)
        _result(http, rid)
        b_sampler = _sampler_id(other)
        b_target = {"type": "sampling_session", "sampling_session_id": b_sampler}
        assert (
            other.post(
                "/retrieve_futures", json={"target": b_target, "timeout": 0, "retrieved_request_ids": [rid]}
            ).status_code
            == 200
        )
        assert _result(http, rid).headers["content-type"] == "application/x-protobuf"


def test_join_sampling_session_allocates_distinct_ids_and_refuses_others(server: LocalServer) -> None:
    with _http(server) as http, _http(server, KEY_B) as other:
        sampler = _sampler_id(http)
        req = types.JoinSamplingSessionRequest(sampling_session_id=sampler).model_dump(mode="json")
        ids = [
            types.JoinSamplingSessionResponse.model_validate(
                http.post("/join_sampling_session", json=req).json()
            ).client_counter
            for _ in range(5)
        ]
        assert len(set(ids)) == 5 and all(0 < i < 10**9 for i in ids)
        for who, body in ((other, req), (http, {**req, "sampling_session_id": "sess-x:sample:0"})):
            r = who.post("/join_sampling_session", json=body)
            assert r.status_code == 404 and "unknown sampler" in r.json()["detail"]
        assert http.post("/join_sampling_session", json={}).status_code == 422


def test_cancel_future_drops_a_queued_sample_and_refuses_other_ids(server: LocalServer) -> None:
    with _http(server) as http, _http(server, KEY_B) as other:
        sampler = _sampler_id(http)
        big = _asample(http, sampler, 1, n=256, max_tokens=48, full=True)  # fills the sampler's 256-row tick
        small = _asample(http, sampler, 2)  # waits for capacity behind it
        states: list[dict[str, Any]] = []
        r = http.post("/retrieve_future", json={"request_id": small}).json()
        assert r["type"] == "try_again", r
        states.append(r)
        assert other.post("/cancel_future", json={"request_id": small}).status_code == 404  # not B's
        answer = http.post("/cancel_future", json={"request_id": small})
        assert answer.status_code == 200 and answer.json()["state"] == "cancelled", answer.text
        failed = _result(http, small).json()
        assert "cancelled by the client" in failed["error"] and failed["category"] == "user"
        assert states[0]["queue_state"] in ("paused_capacity", "active")
        _result(http, big)
        assert http.post("/cancel_future", json={"request_id": big}).json()["state"] == "finished"
        for rid in ("req-nope-1", small.rsplit("-", 1)[0] + "-999999"):
            r = http.post("/cancel_future", json={"request_id": rid})
            assert r.status_code == 404 and "unknown" in r.json()["detail"]
        assert http.post("/cancel_future", json={"id": small}).status_code == 422


@pytest.fixture
def one_running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    """A server that runs one request per tenant at a time and polls one request at a time (no
    ``--batch-polling``: the SDK's polls then report each request's queue state)."""
    with local_server(
        tmp_path_factory, "one-running-data", "--poll-timeout", "0.3", "--max-running", "1"
    ) as srv:
        yield srv


def test_a_sample_the_sdk_abandons_is_cancelled_on_the_server(one_running: LocalServer) -> None:
    """Cancelling a sample's future makes the SDK send ``/cancel_future`` (the server's dynamic
    config enables it), and the server drops the request unsampled. The SDK's request waits behind
    the tenant's one running request, a sample that fills the ticks for seconds; it is cancelled
    once the SDK's own poll reports it held (``paused_rate_limit``), so the server holds it then:
    its trace slice says it failed as cancelled, and it never ran."""
    key = "tml-lifecycle-cancel"
    service = tinker.ServiceClient(base_url=one_running.base_url, api_key=key)
    try:
        sampler = service.create_sampling_client(base_model=TEST_MODEL).result()
        held = threading.Event()

        def observe(state: QueueState, reason: str | None) -> None:
            if state == QueueState.PAUSED_RATE_LIMIT:
                held.set()

        sampler.on_queue_state_change = observe  # type: ignore[method-assign]  # the SDK's observer
        with _http(one_running, key) as http:
            big = _asample(http, _sampler_id(http), 1, n=256, max_tokens=96, full=True)
            params = types.SamplingParams(max_tokens=3, temperature=1.0, seed=1)
            future = sampler.sample(types.ModelInput.from_ints(TOKENS), 1, params)
            assert held.wait(timeout=120), "the SDK's poll never reported the sample held"
            future.future().cancel()
            assert _result(http, big).headers["content-type"] == "application/x-protobuf"
        assert future.future().cancelled()
        rest = tinker.RestClient(base_url=one_running.base_url, api_key=key)
        deadline = time.monotonic() + 120
        while True:  # the SDK sends the cancel from its own task: until the server has it
            url = rest.export_session_trace(service.holder.get_session_id()).result()
            trace = httpx.get(url, timeout=60).raise_for_status().json()
            (sample,) = [e["args"] for e in trace["traceEvents"] if e.get("name") == "sample"]
            if sample["status"] != "running" or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert sample["status"] == "failed: Cancelled" and sample["run_ms"] == 0, sample
    finally:
        service.close("success").result()


def test_a_sample_held_back_by_capacity_says_paused_capacity(server: LocalServer) -> None:
    with _http(server) as http, _http(server, KEY_B) as other:
        # two full ticks' worth (256 rows each, from two tenants: each stays under its running
        # limit), then one more row: a tick runs at full capacity without it at least once
        first = _asample(other, _sampler_id(other), 1, n=256, max_tokens=48, full=True)
        sampler = _sampler_id(http)
        big = _asample(http, sampler, 1, n=256, max_tokens=48, full=True)
        small = _asample(http, sampler, 2)
        states: list[dict[str, Any]] = []
        _result(http, small, states)
        _result(http, big)
        _result(other, first)
        paused = [s for s in states if s["queue_state"] == "paused_capacity"]
        assert paused and "at most 256 sequences" in paused[0]["queue_state_reason"], states
        TryAgainResponse.model_validate(paused[0])  # the SDK's own shape


class _Recorder(QueueStateLogger):
    def __init__(self) -> None:
        super().__init__("recorder", "Training")
        self.states: list[tuple[QueueState, str | None]] = []

    def on_queue_state_change(self, queue_state: QueueState, queue_state_reason: str | None) -> None:
        self.states.append((queue_state, queue_state_reason))
        super().on_queue_state_change(queue_state, queue_state_reason)


def test_the_sdk_sees_paused_rate_limit_while_a_tenant_is_past_its_running_limit(
    server: LocalServer,
) -> None:
    sc = tinker.ServiceClient(base_url=server.base_url, api_key="tml-lifecycle-rate-limited")
    try:
        tcs = [
            sc.create_lora_training_client(base_model=TEST_MODEL, rank=2, seed=i).result() for i in range(3)
        ]
        recorders = []
        for tc in tcs:
            tc._queue_state_logger = rec = _Recorder()
            recorders.append(rec)
        # 12 requests against a running limit of 2: the later ones wait several fused ticks for a
        # slot, each tick far longer than the 0.3 s poll timeout, so their polls answer try_again
        data = [_datum(TOKENS * 8)] * 32
        futures = [tc.forward_backward(data, "cross_entropy") for tc in tcs for _ in range(4)]
        for f in futures:
            assert np.isfinite(f.result(timeout=300).metrics["loss:sum"])
        seen = [s for rec in recorders for s in rec.states if s[0] == QueueState.PAUSED_RATE_LIMIT]
        assert seen and "the limit is 2" in (seen[0][1] or ""), [r.states for r in recorders]
        assert all(rec.states[-1][0] == QueueState.ACTIVE for rec in recorders if rec.states)
    finally:
        sc.close("success").result()


def test_unload_model_frees_it_keeps_its_checkpoints_and_refuses_later_ops(
    server: LocalServer, service: tinker.ServiceClient
) -> None:
    tc = service.create_lora_training_client(base_model=TEST_MODEL, rank=2, seed=9).result()
    tc.forward_backward([_datum(TOKENS)], "cross_entropy").result()
    path = tc.save_state("before-unload").result().path
    before = tc.forward([_datum(TOKENS)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    with _http(server) as http, _http(server, KEY_B) as other:
        req = types.UnloadModelRequest(model_id=tc.model_id).model_dump(mode="json")
        assert other.post("/unload_model", json=req).status_code == 404  # not B's
        rid = http.post("/unload_model", json=req).json()["request_id"]
        done = types.UnloadModelResponse.model_validate(_result(http, rid).json())
        assert done.model_id == tc.model_id
        again = http.post("/unload_model", json=req)  # idempotent: the SDK may retry
        assert _result(http, again.json()["request_id"]).json()["model_id"] == tc.model_id
        r = http.post("/forward_backward", content=_fb(tc.model_id, 99), headers=PROTO)
        assert r.status_code == 404 and "was unloaded" in r.json()["detail"]
        _no_path(r.json()["detail"], server)
        for bad in ({}, {"model_id": 3}, {"model_id": "nope:train:0"}):
            assert http.post("/unload_model", json=bad).status_code in (404, 422)
    with pytest.raises(tinker.NotFoundError, match="was unloaded"):
        tc.forward([_datum(TOKENS)], "cross_entropy").result(timeout=60)
    # its checkpoints remain: a new training client resumes from one, with the same weights
    resumed = service.create_training_client_from_state(path).result()
    after = (
        resumed.forward([_datum(TOKENS)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    )
    np.testing.assert_allclose(after, before, rtol=0, atol=1e-5)
    assert path in json.dumps(
        [
            c.tinker_path
            for c in tinker.RestClient(base_url=server.base_url, api_key=KEY_A)
            .list_checkpoints(tc.model_id)
            .result()
            .checkpoints
        ]
    )
