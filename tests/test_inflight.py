"""``kind="inflight"`` sampling: requests that follow a training model's newest saved weights
switch to them mid-decode, keeping their keys and values (``StepDecoder.switch`` states the rule).

On the rollout core, step by step: a following request's tokens before the switch have the old
weights' teacher-forced logprobs; from the step after the switch on, the logprobs of a forward
that reads the old weights' keys and values for the prompt and the earlier tokens and runs the
new weights from the last token fed (the cache is kept, not recomputed: they differ from the new
weights' own teacher-forced logprobs). A pinned request in the same batch equals the old weights'
throughout; a following request still waiting for admission prefills on the new weights.

Over HTTP, with the unmodified SDK: a long request of a ``kind="inflight"`` sampler decoding while
its training run saves new inflight weights switches at some step inside it, to exactly the
logprobs that rule gives; a snapshot sampler's request beside it keeps the old weights.

The snapshots held only for a model's inflight samplers are released when the model leaves
memory (``unload_model``, eviction of an inactive session's model, the session's end).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import tinker
import torch
from fastapi.testclient import TestClient
from tinker import types
from tinker.proto import tinker_public_pb2 as pb

from opentinker.client import Runtime
from opentinker.engine import AdamParams, Engine, ForwardRequest
from opentinker.lora import LoRAConfig
from opentinker.sampling import NativeBackend, SampleRequest, SampleResult, SamplingParams
from opentinker.sampling.loop import Done, FollowInflight, Sample, SamplingCore
from opentinker.server.app import create_app
from opentinker.server.config import ServerConfig
from opentinker.service.checkpoints import CheckpointStore, parse_tinker_path
from tests.conftest import TEST_MODEL, local_server, make_examples
from tests.tolerances import LOGPROB_ATOL, assert_logprobs_close

PARAMS = SamplingParams(max_tokens=24, temperature=1.0, seed=11, stop=[])


def _train(engine: Engine, aid: str, seed: int, steps: int) -> None:
    for s in range(steps):
        engine.forward_backward(ForwardRequest(aid, make_examples(4, engine.vocab_size, seed=seed * 10 + s)))
        engine.optim_step(aid, AdamParams(learning_rate=2e-2))


def _prompt(engine: Engine, n: int, seed: int) -> list[int]:
    return [3 + (seed * 131 + 17 * i) % (engine.vocab_size - 3) for i in range(n)]


def _token_logprobs(logits: torch.Tensor, tokens: list[int]) -> list[float]:
    lp = torch.log_softmax(logits.double(), -1)
    return [float(lp[i, t]) for i, t in enumerate(tokens)]


@torch.no_grad()
def _teacher_forced(engine: Engine, policy: str, prompt: list[int], tokens: list[int]) -> list[float]:
    """Each sampled token's logprob (T = 1) under ``policy``: one plain HF forward."""
    with engine.routing([policy]):
        logits = engine.base.model(input_ids=torch.tensor([prompt + tokens[:-1]])).logits[0]
    return _token_logprobs(logits[len(prompt) - 1 :], tokens)


@torch.no_grad()
def _switched(
    engine: Engine, old: str, new: str, prompt: list[int], tokens: list[int], s: int
) -> list[float]:
    """The logprobs of tokens ``s..`` when the prompt and tokens ``..s-2`` ran on ``old`` (their
    keys and values cached) and the forwards from token ``s - 1`` on run ``new``: plain HF."""
    model = engine.base.model
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with engine.routing([old]):
        out = model(input_ids=torch.tensor([prompt + tokens[: s - 1]]), use_cache=True)
    with engine.routing([new]):
        logits = model(
            input_ids=torch.tensor([tokens[s - 1 : -1]]), **{cache_kw: out.past_key_values}
        ).logits[0]
    return _token_logprobs(logits, tokens[s:])


def _result(done: list[Done], rid: int) -> SampleResult:
    [d] = [d for d in done if d.rid == rid]
    assert d.error is None and d.result is not None, d.error
    return d.result


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "hf"])
def test_inflight_rows_switch_at_the_next_step_and_keep_their_cache(engine: Engine, lean: bool) -> None:
    aid = engine.create_adapter(LoRAConfig(rank=4, seed=0))
    _train(engine, aid, 1, steps=2)
    old = engine.snapshot(aid).snapshot_id
    _train(engine, aid, 2, steps=3)
    new = engine.snapshot(aid).snapshot_id
    backend = NativeBackend(engine, lean_decode=lean, prefix_cache_bytes=0)
    core = SamplingCore(backend.decoder(snapshots_only=True), backend)
    prompt, late_prompt = _prompt(engine, 9, 1), _prompt(engine, 6, 2)
    core.handle(Sample(1, SampleRequest(old, prompt, PARAMS, num_samples=2, follow=aid)))
    core.handle(Sample(2, SampleRequest(old, prompt, PARAMS, num_samples=2)))  # pinned: no follow
    core.handle(Sample(3, SampleRequest(old, prompt, PARAMS, follow="another-model")))
    ticks = 5
    done: list[Done] = []
    for _ in range(ticks):  # the first tick prefills (token 0) and steps (token 1); then one each
        done += core.tick()
    assert not done
    s = ticks + 1  # tokens sampled so far: the next step samples token s on the new weights
    core.handle(Sample(4, SampleRequest(old, late_prompt, PARAMS, follow=aid)))  # waiting
    core.handle(FollowInflight(aid, new))
    while core.busy:
        done += core.tick()

    for seq in _result(done, 2).sequences + _result(done, 3).sequences:  # never switched
        assert len(seq.tokens) == PARAMS.max_tokens
        assert_logprobs_close(seq.logprobs, _teacher_forced(engine, old, prompt, seq.tokens))
    for seq in _result(done, 1).sequences:
        assert len(seq.tokens) == PARAMS.max_tokens
        on_old = _teacher_forced(engine, old, prompt, seq.tokens)
        on_new = _teacher_forced(engine, new, prompt, seq.tokens)
        switched = _switched(engine, old, new, prompt, seq.tokens, s)
        assert_logprobs_close(seq.logprobs[:s], on_old[:s])
        assert_logprobs_close(seq.logprobs[s:], switched)
        # the switch is visible, and the old keys and values were kept (not recomputed on new)
        assert max(abs(a - b) for a, b in zip(switched, on_old[s:], strict=True)) > 10 * LOGPROB_ATOL
        assert max(abs(a - b) for a, b in zip(switched, on_new[s:], strict=True)) > 10 * LOGPROB_ATOL
    [late] = _result(done, 4).sequences  # admitted after the follow: all on the new weights
    assert_logprobs_close(late.logprobs, _teacher_forced(engine, new, late_prompt, late.tokens))


def test_a_follow_naming_unknown_weights_changes_nothing(engine: Engine) -> None:
    """A follow whose snapshot is gone (released before the loop took the message) is dropped:
    the following request finishes on the weights it had."""
    aid = engine.create_adapter(LoRAConfig(rank=4, seed=0))
    _train(engine, aid, 1, steps=2)
    old = engine.snapshot(aid).snapshot_id
    backend = NativeBackend(engine, prefix_cache_bytes=0)
    core = SamplingCore(backend.decoder(snapshots_only=True), backend)
    prompt = _prompt(engine, 7, 3)
    core.handle(Sample(1, SampleRequest(old, prompt, PARAMS, follow=aid)))
    done = core.tick()
    assert core.handle(FollowInflight(aid, f"{aid}@gone")) == []
    assert core.handle(FollowInflight(aid, aid)) == []  # a live adapter is never sampled mid-training
    while core.busy:
        done += core.tick()
    [seq] = _result(done, 1).sequences
    assert_logprobs_close(seq.logprobs, _teacher_forced(engine, old, prompt, seq.tokens))


# ---------------------------------------------------------------------------- over HTTP
KEY = "tml-inflight-switch-0001"
HTTP_PROMPT = [5, 17, 42, 99, 7, 250, 31, 64, 12]


def _sgd(tc: tinker.TrainingClient, steps: int) -> None:
    toks = [3, *HTTP_PROMPT, 8]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(toks[:-1]),
        loss_fn_inputs={"target_tokens": types.TensorData.from_numpy(np.asarray(toks[1:], np.int64))},
    )
    for _ in range(steps):
        tc.forward_backward([datum], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()


def test_an_inflight_request_over_http_switches_when_new_weights_are_saved(
    tmp_path_factory: pytest.TempPathFactory, engine: Engine
) -> None:
    """The unmodified SDK against ``opentinker serve``: a long request on an inflight sampler and
    the same request on a pinned snapshot sampler, decoding while the training run saves new
    inflight weights. The pinned one has the old weights' logprobs throughout. The inflight one
    has them up to a switch point inside the sequence, and from there on exactly the logprobs of
    the new weights over the old weights' cache (computed here, in-process, from the two saved
    checkpoints)."""
    with local_server(tmp_path_factory, "inflight-http", threads=1) as srv:
        sc = tinker.ServiceClient(base_url=srv.base_url, api_key=KEY)
        tc = sc.create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=0).result()
        _sgd(tc, 2)
        old_path = tc.save_weights_for_sampler("old").result().path
        inflight = tc.save_weights_and_get_sampling_client(kind="inflight").result()
        pinned = tc.save_weights_and_get_sampling_client().result()
        _sgd(tc, 3)
        new_path = tc.save_weights_for_sampler("new").result().path
        prompt = types.ModelInput.from_ints(HTTP_PROMPT)
        params = types.SamplingParams(max_tokens=1000, temperature=1.0, seed=5, stop=[])
        fut_in, fut_pin = inflight.sample(prompt, 1, params), pinned.sample(prompt, 1, params)
        # let them start decoding (a 1000-token decode takes seconds here): a short request sent
        # after them is admitted after them, so once it is answered they are in the batch
        pinned.sample(prompt, 1, types.SamplingParams(max_tokens=2, seed=0)).result()
        time.sleep(0.1)
        tc.save_weights_and_get_sampling_client(kind="inflight").result()  # the new weights: the switch
        [seq_in], [seq_pin] = fut_in.result().sequences, fut_pin.result().sequences
        store = CheckpointStore(srv.data_dir)
        old = engine.load_snapshot(store.folder(parse_tinker_path(old_path)), "old").snapshot_id
        new = engine.load_snapshot(store.folder(parse_tinker_path(new_path)), "new").snapshot_id

    assert seq_pin.logprobs is not None and seq_in.logprobs is not None
    assert_logprobs_close(seq_pin.logprobs, _teacher_forced(engine, old, HTTP_PROMPT, seq_pin.tokens))
    tokens, got = list(seq_in.tokens), list(seq_in.logprobs)
    on_old = _teacher_forced(engine, old, HTTP_PROMPT, tokens)
    first_off = next(
        (i for i, (a, b) in enumerate(zip(got, on_old, strict=True)) if abs(a - b) > LOGPROB_ATOL), None
    )
    assert first_off is not None, "the inflight request finished on the old weights"
    assert 0 < first_off < len(tokens) - 1, first_off  # mid-decode, not at admission
    # the switch point s: the first token whose logprob the new weights computed; the token
    # there may by chance have nearly the same logprob under both, so s may precede first_off
    matches = [
        s
        for s in range(max(1, first_off - 3), first_off + 1)
        if max(
            abs(a - b)
            for a, b in zip(got[s:], _switched(engine, old, new, HTTP_PROMPT, tokens, s), strict=True)
        )
        <= LOGPROB_ATOL
    ]
    assert matches, "no switch point explains the inflight request's logprobs"


# ---------------------------------------------------------------------------- cleanup
@pytest.fixture
def app_runtime(tmp_path) -> Iterator[tuple[TestClient, Runtime]]:
    runtime = Runtime(tmp_path / "data", memory_budget="off")  # eviction: without a budget
    config = ServerConfig(tmp_path / "data", base_models=(TEST_MODEL,), dev=True, poll_timeout_s=5.0)
    try:
        with TestClient(
            create_app(config, runtime=runtime), base_url="http://test/api/v1", headers={"X-API-Key": KEY}
        ) as client:
            yield client, runtime
    finally:
        runtime.shutdown()


def _poll(http: TestClient, response: Any) -> Any:
    assert response.status_code == 200, response.text
    request_id = response.json()["request_id"]
    for _ in range(100):
        out = http.post("/retrieve_future", json={"request_id": request_id})
        if (
            out.headers.get("content-type", "").startswith("application/json")
            and out.json().get("type") == "try_again"
        ):
            continue
        return out
    raise AssertionError("no result")


def _answer(http: TestClient, response: Any) -> dict[str, Any]:
    return _poll(http, response).json()


def _sampled(http: TestClient, response: Any) -> int:
    """How many sequences a sample answer holds (the SDK's protobuf SampleResponse)."""
    msg = pb.SampleResponse()
    msg.ParseFromString(_poll(http, response).content)
    return len(msg.sequences)


def _until(cond: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.parametrize("how", ["unload_model", "eviction", "session_end"])
def test_snapshots_held_for_inflight_samplers_are_released_when_the_model_goes(
    app_runtime: tuple[TestClient, Runtime], how: str
) -> None:
    """Two inflight saves (the target's current and previous snapshots) and a snapshot sampler:
    when the model is unloaded, evicted or its session ends, the inflight snapshots leave the
    engine and the registry, and the inflight samplers answer 404 saying why. On unload and
    eviction the snapshot sampler, which owns its own snapshot, still samples."""
    http, runtime = app_runtime
    server = http.app.state.server  # type: ignore[attr-defined]
    reg, engine = server.registry, runtime.base_stack(TEST_MODEL).engine
    sid = http.post("/create_session", json={"tags": [], "sdk_version": "test"}).json()["session_id"]
    body = {"session_id": sid, "model_seq_id": 0, "base_model": TEST_MODEL, "lora_config": {"rank": 2}}
    model_id = _answer(http, http.post("/create_model", json=body))["model_id"]
    samplers = []
    for seq, kind in enumerate(["inflight", "inflight", "snapshot"]):
        body = {"model_id": model_id, "sampling_session_seq_id": seq, "kind": kind}
        samplers.append(
            _answer(http, http.post("/save_weights_for_sampler", json=body))["sampling_session_id"]
        )
    life = reg.life
    target = life.inflight.targets[model_id]
    held = [target.current, target.previous]
    assert None not in held and set(held) <= set(engine.snapshot_ids())
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [5, 17, 42]}]}

    def sample(sampler_id: str) -> Any:
        body = {"prompt": prompt, "sampling_params": {"max_tokens": 2}, "sampling_session_id": sampler_id}
        return http.post("/asample", json=body)

    assert [_sampled(http, sample(s)) for s in samplers] == [1, 1, 1]

    if how == "unload_model":
        _answer(http, http.post("/unload_model", json={"model_id": model_id}))
        why = "was unloaded"
    elif how == "eviction":
        time.sleep(0.01)
        assert reg.evict_idle(0.0) == [model_id]
        _until(lambda: model_id in life.evicted)
        why = "was evicted"
    else:
        assert http.post(f"/sessions/{sid}/finish", json={"reason": {"type": "success"}}).status_code == 200
        why = "is finished"
    _until(lambda: not set(held) & set(engine.snapshot_ids()))
    assert model_id not in life.inflight.targets
    for sampler_id in samplers[:2]:
        r = sample(sampler_id)
        assert r.status_code == 404 and why in r.json()["detail"], r.text
        assert sampler_id not in reg.samplers
    if how != "session_end":
        assert _sampled(http, sample(samplers[2])) == 1


def test_only_the_newest_gone_reasons_are_kept(
    app_runtime: tuple[TestClient, Runtime], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Why an inflight sampler's weights went is kept for the newest ``GONE_KEPT`` samplers only
    (a long-running server does not grow without end); an older one gets the 404 of any sampler
    of in-memory weights that are gone (as after a restart), never the base model's samples."""
    from opentinker.service import inflight

    monkeypatch.setattr(inflight, "GONE_KEPT", 1)
    http, _ = app_runtime
    reg = http.app.state.server.registry  # type: ignore[attr-defined]
    sid = http.post("/create_session", json={"tags": [], "sdk_version": "test"}).json()["session_id"]
    body = {"session_id": sid, "model_seq_id": 0, "base_model": TEST_MODEL, "lora_config": {"rank": 2}}
    model_id = _answer(http, http.post("/create_model", json=body))["model_id"]
    samplers = [
        _answer(http, http.post("/save_weights_for_sampler", json={
            "model_id": model_id, "sampling_session_seq_id": seq, "kind": "inflight"}))["sampling_session_id"]
        for seq in range(2)
    ]  # fmt: skip
    _answer(http, http.post("/unload_model", json={"model_id": model_id}))
    assert len(reg.life.inflight.gone) == 1
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [5, 17, 42]}]}
    said = []
    for sampler_id in samplers:
        body = {"prompt": prompt, "sampling_params": {"max_tokens": 2}, "sampling_session_id": sampler_id}
        r = http.post("/asample", json=body)
        assert r.status_code == 404, r.text
        said.append(r.json()["detail"])
    assert "was unloaded" in said[1] and "in-memory snapshot that is gone" in said[0], said
