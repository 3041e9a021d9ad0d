"""The sampling loop (sampling/loop.py): continuous batching, pinned versions, threads.

Every result is compared with a plain reference: the same request run alone through
``NativeBackend.generate`` (one batch to completion). Continuous batching must change no row's
tokens (greedy and seeded T = 1) and its logprobs only within ``LOGPROB_ATOL``, whatever joins or
leaves its batch; short requests must not wait for long ones; and the loop's thread must be safe
beside a training thread that updates adapters in place.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace

import pytest
from tinker import types

import opentinker
from opentinker.engine import AdamParams, Engine, EngineError, ForwardRequest, UnknownPolicyError
from opentinker.lora import LoRAConfig
from opentinker.sampling import NativeBackend, SampleRequest, SampleResult, SamplingParams
from opentinker.sampling.loop import Publish, Retire, SamplingCore, SamplingLoop
from opentinker.service.runtime import Runtime
from tests.conftest import TEST_MODEL, make_examples
from tests.tolerances import LOGPROB_ATOL, assert_greedy_equal, assert_logprobs_close

GREEDY = SamplingParams(max_tokens=48, temperature=0.0, stop=[])
SEEDED = SamplingParams(max_tokens=48, temperature=1.0, seed=7, stop=[])


def _train(engine: Engine, aid: str, seed: int, steps: int = 2) -> None:
    for s in range(steps):
        engine.forward_backward(ForwardRequest(aid, make_examples(4, engine.vocab_size, seed=seed * 10 + s)))
        engine.optim_step(aid, AdamParams(learning_rate=2e-2))


@pytest.fixture
def snaps(engine: Engine) -> list[str | None]:
    """Two trained snapshots of different ranks and the bare base model."""
    a = engine.create_adapter(LoRAConfig(rank=4, seed=0))
    b = engine.create_adapter(LoRAConfig(rank=8, seed=1, train_mlp=False))
    _train(engine, a, 1)
    _train(engine, b, 2)
    return [engine.snapshot(a).snapshot_id, engine.snapshot(b).snapshot_id, None]


def _loop(backend: NativeBackend, *, continuous: bool = True) -> SamplingLoop:
    return SamplingLoop(SamplingCore(backend.decoder(snapshots_only=True), backend, continuous=continuous))


def _ok(res: object) -> SampleResult:
    assert isinstance(res, SampleResult), res
    return res


def _solo(backend: NativeBackend, req: SampleRequest) -> SampleResult:
    [res] = backend.generate([req])
    return _ok(res)


def _assert_same(got: SampleResult, ref: SampleResult) -> None:
    assert len(got.sequences) == len(ref.sequences)
    for g, r in zip(got.sequences, ref.sequences, strict=True):
        assert_greedy_equal(g.tokens, r.tokens)
        assert g.stop_reason == r.stop_reason
        assert_logprobs_close(g.logprobs, r.logprobs)


def _same_up_to_near_ties(got: SampleResult, backend: NativeBackend, req: SampleRequest) -> None:
    """A long greedy row against its solo run: tokens identical up to the first near tie of the
    solo run's top two logprobs (a prefill of another length runs other matmul kernels, whose
    fp32 rounding may pick either there: tests/tolerances.py), logprobs close up to there."""
    [want] = backend.generate([replace(req, topk_sample_logprobs=2)])
    want = _ok(want)
    for g, w in zip(got.sequences, want.sequences, strict=True):
        assert w.topk_logprobs is not None
        gaps = [top[0][1] - top[1][1] for top in w.topk_logprobs]
        assert_greedy_equal(g.tokens, w.tokens, gaps=gaps, gap_tol=2 * LOGPROB_ATOL)
        n = next((i for i, x in enumerate(gaps) if x < 2 * LOGPROB_ATOL), len(gaps))
        assert_logprobs_close(g.logprobs[:n], w.logprobs[:n])


def _wait_steps(loop: SamplingLoop, n: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while loop.stats.steps < n:
        assert time.monotonic() < deadline, "the loop made no progress"
        time.sleep(0.0005)


def _prompt(engine: Engine, n: int, seed: int) -> list[int]:
    return [3 + (seed * 131 + 17 * i) % (engine.vocab_size - 3) for i in range(n)]


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "hf"])
def test_a_row_does_not_depend_on_what_joins_its_batch(
    engine: Engine, snaps: list[str | None], lean: bool
) -> None:
    """Greedy and seeded T = 1 rows decoding while others (other policies, lengths, samples,
    prompt logprobs) join mid-decode and leave: tokens identical to their solo runs, logprobs
    within tolerance; the joiners equal their solo runs too."""
    backend = NativeBackend(engine, lean_decode=lean, prefix_cache_bytes=0)
    a, b, base = snaps
    first = [
        # long enough to be still decoding when the last joiner arrives, even on a loaded machine
        SampleRequest(a, _prompt(engine, 9, 1), SamplingParams(max_tokens=200, temperature=0.0, stop=[])),
        SampleRequest(b, _prompt(engine, 5, 2), SEEDED, num_samples=2),
    ]
    joiners = [
        SampleRequest(base, _prompt(engine, 23, 3), SamplingParams(max_tokens=6, temperature=0.0, stop=[])),
        SampleRequest(a, _prompt(engine, 3, 4), SamplingParams(max_tokens=30, temperature=1.0, seed=3, stop=[])),
        SampleRequest(b, _prompt(engine, 14, 5), SamplingParams(max_tokens=10, temperature=0.7, top_k=20, seed=1),
                      num_samples=3, prompt_logprobs=True, topk_prompt_logprobs=2),
    ]  # fmt: skip
    refs = [_solo(backend, r) for r in first + joiners]
    loop = _loop(NativeBackend(engine, lean_decode=lean, prefix_cache_bytes=0))
    try:
        futs = [loop.submit(r).future for r in first]
        _wait_steps(loop, 4)
        for r in joiners:  # one at a time, a few steps apart
            futs.append(loop.submit(r).future)
            _wait_steps(loop, loop.stats.steps + 3)
        assert not futs[0].done()  # they joined while the first batch decoded
        results = [_ok(f.result(timeout=120)) for f in futs]
        assert loop.stats.joined == len(joiners)
    finally:
        loop.shutdown()
    for got, ref in zip(results, refs, strict=True):
        _assert_same(got, ref)
    got_lp, ref_lp = results[-1], refs[-1]
    assert got_lp.prompt_logprobs is not None and ref_lp.prompt_logprobs is not None
    assert_logprobs_close(got_lp.prompt_logprobs[1:], ref_lp.prompt_logprobs[1:])


def _long_and_short(engine: Engine, snap: str | None) -> tuple[SampleRequest, list[SampleRequest]]:
    long = SampleRequest(
        snap, _prompt(engine, 6, 0), SamplingParams(max_tokens=256, temperature=0.0, stop=[])
    )
    short = [
        SampleRequest(snap, _prompt(engine, 4 + i % 5, i + 1), SamplingParams(max_tokens=8, temperature=1.0, seed=i, stop=[]))
        for i in range(15)
    ]  # fmt: skip
    return long, short


def test_short_requests_resolve_before_the_long_one_finishes(engine: Engine, snaps: list[str | None]) -> None:
    """One 256-token request and fifteen 8-token ones in one batch: every short one is answered
    while the long one still decodes (at its own stop, not the batch's end)."""
    long, short = _long_and_short(engine, snaps[0])
    short = [replace(r, params=replace(r.params, temperature=0.0)) for r in short]
    backend = NativeBackend(engine)
    loop = _loop(backend)
    long_done_when: list[bool] = []
    try:
        futs = [loop.submit(r).future for r in [long, *short]]
        for f in futs[1:]:
            f.add_done_callback(lambda _f: long_done_when.append(futs[0].done()))
        results = [_ok(f.result(timeout=120)) for f in futs]
    finally:
        loop.shutdown()
    assert long_done_when == [False] * 15
    assert len(results[0].sequences[0].tokens) == 256
    # every row against its solo run up to a near tie: the batch's prefill runs at other shapes
    # (other kernels, other rounding), so a seeded draw could flip at a near tie too: greedy rows
    for got, req in zip(results, [long, *short], strict=True):
        _same_up_to_near_ties(got, backend, req)


@pytest.mark.parametrize("continuous", [True, False], ids=["continuous", "to-completion"])
def test_a_request_submitted_mid_decode_starts_before_the_batch_ends(
    engine: Engine, snaps: list[str | None], continuous: bool
) -> None:
    """A short request submitted while a 256-token one decodes joins it and is answered first;
    without continuous batching (the reference) it waits for the running batch to end."""
    long, short = _long_and_short(engine, snaps[1])
    loop = _loop(NativeBackend(engine), continuous=continuous)
    try:
        lf = loop.submit(long).future
        _wait_steps(loop, 5)
        sf = loop.submit(short[0]).future
        res = _ok(sf.result(timeout=120))
        long_running = not lf.done()
        _ok(lf.result(timeout=120))
    finally:
        loop.shutdown()
    assert len(res.sequences[0].tokens) == 8
    assert long_running == continuous
    assert loop.stats.joined == (1 if continuous else 0)


def test_pinned_snapshot_survives_retire_in_flight_and_publish_by_message(
    engine: Engine, snaps: list[str | None]
) -> None:
    """Retiring a snapshot while a request on it decodes: that request finishes on the weights it
    was pinned to (same result as before the retire); a request submitted after the retire fails
    with the unknown-policy error, the others in the batch unaffected. A version published by
    message is served; retired by message it is refused."""
    a, b, _ = snaps
    assert a is not None
    backend = NativeBackend(engine)
    req = SampleRequest(
        a, _prompt(engine, 7, 9), SamplingParams(max_tokens=120, temperature=1.0, seed=5, stop=[])
    )
    ref = _solo(backend, req)
    weights = engine.adapter_weights(a).clone()
    loop = _loop(backend)
    try:
        fut = loop.submit(req).future
        other = loop.submit(SampleRequest(b, _prompt(engine, 5, 1), SEEDED)).future
        _wait_steps(loop, 5)
        engine.release_snapshot(a)  # what the runtime does when the last client lets go
        late = loop.submit(SampleRequest(a, _prompt(engine, 5, 2), SEEDED)).future
        with pytest.raises(UnknownPolicyError, match="unknown adapter or snapshot"):
            late.result(timeout=60)
        assert not fut.done()
        _assert_same(_ok(fut.result(timeout=120)), ref)
        _ok(other.result(timeout=120))
        loop.send(Publish("again@v1", weights))
        _wait_steps(loop, 0)
        got = _ok(_retry(lambda: loop.submit(SampleRequest("again@v1", req.prompt, req.params)).future))
        _assert_same(got, ref)  # the same weights under a new id: the same tokens
        loop.send(Retire("again@v1"))
        gone = _retry_until_refused(
            lambda: loop.submit(SampleRequest("again@v1", req.prompt, req.params)).future
        )
        assert isinstance(gone, UnknownPolicyError)
    finally:
        loop.shutdown()


def _retry(submit: Callable[[], Future], timeout: float = 30.0) -> object:
    """The result of ``submit()``'s future, resubmitting while the policy is not there yet (a
    message is applied on the loop's thread, after ``send`` returns)."""
    deadline = time.monotonic() + timeout
    while True:
        fut: Future = submit()
        try:
            return fut.result(timeout=60)
        except UnknownPolicyError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def _retry_until_refused(submit: Callable[[], Future], timeout: float = 30.0) -> BaseException:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        err = submit().exception(timeout=60)
        if err is not None:
            return err
        time.sleep(0.01)
    raise AssertionError("the retired policy is still served")


def test_bad_requests_and_live_adapters_are_refused_alone(engine: Engine, snaps: list[str | None]) -> None:
    """The loop's errors are the backend's; a live adapter (trained in place on another thread)
    is refused with a message saying what to sample instead; the others still run."""
    live = engine.create_adapter(LoRAConfig(rank=2, seed=5))
    loop = _loop(NativeBackend(engine))
    try:
        good = loop.submit(SampleRequest(snaps[0], [5, 6, 7], SEEDED)).future
        bad = {
            "the prompt is empty": SampleRequest(snaps[0], [], SEEDED),
            "max_tokens must be a positive integer": SampleRequest(None, [5], SamplingParams(max_tokens=0)),
            "unknown adapter or snapshot": SampleRequest("ghost@v1", [5], SEEDED),
            "is a model being trained; sample from a snapshot": SampleRequest(live, [5], SEEDED),
        }
        for message, req in bad.items():
            with pytest.raises(EngineError, match=message):
                loop.submit(req).future.result(timeout=60)
        _ok(good.result(timeout=120))
    finally:
        loop.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        loop.submit(SampleRequest(None, [5], SEEDED))


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "hf"])
def test_sampling_beside_a_training_thread(engine: Engine, snaps: list[str | None], lean: bool) -> None:
    """The loop samples a snapshot of an adapter while another thread trains that adapter in
    place (forward/backward through the same base model and LoRA layers, optim_step): every
    result equals the reference sampled before training started. On the HF path the two threads'
    LoRA routings share the model's layers, so they must not see each other's."""
    aid = engine.create_adapter(LoRAConfig(rank=4, seed=3))
    _train(engine, aid, 5)
    snap = engine.snapshot(aid).snapshot_id
    backend = NativeBackend(engine, lean_decode=lean, prefix_cache_bytes=0)
    reqs = [
        SampleRequest(p, _prompt(engine, 5 + i, 20 + i), SamplingParams(max_tokens=24, temperature=1.0, seed=i, stop=[]))
        for i, p in enumerate([snap, snaps[1], snap, None] * 2)
    ]  # fmt: skip
    refs = [_solo(backend, r) for r in reqs]
    stop = threading.Event()
    errors: list[BaseException] = []

    def train() -> None:
        try:
            k = 0
            while not stop.is_set():
                _train(engine, aid, 100 + k, steps=1)
                k += 1
        except BaseException as e:  # surfaced below
            errors.append(e)

    trainer = threading.Thread(target=train)
    loop = _loop(NativeBackend(engine, lean_decode=lean, prefix_cache_bytes=0))
    trainer.start()
    try:
        futs = []
        for r in reqs:
            futs.append(loop.submit(r).future)
            time.sleep(0.002)
        results = [_ok(f.result(timeout=120)) for f in futs]
    finally:
        stop.set()
        trainer.join()
        loop.shutdown()
    assert not errors
    for got, ref in zip(results, refs, strict=True):
        _assert_same(got, ref)


def test_embedded_sdk_samples_on_the_rollout_loop(tmp_path) -> None:
    """Through the embedded SDK clients, sampling runs on the sampling loop (not in the training
    ticks) and gives what the backend's own one-batch ``generate`` gives; ``topk_sample_logprobs``
    comes back per sampled token."""
    rt = Runtime(tmp_path / "data")
    try:
        service = opentinker.ServiceClient(runtime=rt)
        tc = service.create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=0).result()
        sampler = tc.save_weights_and_get_sampling_client()
        got = sampler.sample(
            types.ModelInput.from_ints([5, 6, 7, 8]),
            num_samples=2,
            sampling_params=types.SamplingParams(max_tokens=8, temperature=1.0, seed=3),
            topk_sample_logprobs=3,
        ).result()
        stack = rt.base_stack(TEST_MODEL)
        assert isinstance(stack.scheduler.rollout, SamplingLoop)
        params = SamplingParams(max_tokens=8, temperature=1.0, seed=3)
        [ref] = stack.sampler.generate(
            [SampleRequest(sampler.policy, [5, 6, 7, 8], params, num_samples=2, topk_sample_logprobs=3)]
        )
    finally:
        rt.shutdown()
    for g, r in zip(got.sequences, _ok(ref).sequences, strict=True):
        assert g.tokens == r.tokens
        assert_logprobs_close(g.logprobs, r.logprobs)
        assert g.topk_logprobs is not None and len(g.topk_logprobs) == len(g.tokens)
        assert all(len(top or []) == 3 for top in g.topk_logprobs)
