"""The embedded, SDK-shaped client API and the scheduler (issue: client API and scheduler)."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import torch
from tinker import types

import opentinker
from opentinker.client import Runtime
from opentinker.engine import EngineError, UnknownPolicyError
from opentinker.engine.checkpoint import CheckpointError
from tests.conftest import TEST_MODEL
from tests.tolerances import (
    TRAJECTORY_LOGIT_ATOL,
    TRAJECTORY_REL,
    assert_greedy_equal,
    assert_scalar_close,
    assert_state_close,
)


@pytest.fixture
def runtime(tmp_path):
    rt = Runtime(tmp_path / "data")
    yield rt
    rt.shutdown()


def _datum(tokens: list[int], weights: list[float] | None = None) -> types.Datum:
    w = weights if weights is not None else [1.0] * (len(tokens) - 1)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": w},
    )


def _sft_data(tok, seed: int, n: int = 4) -> list[types.Datum]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        a, b = (int(x) for x in rng.integers(10, 99, 2))
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": f"What is {a} + {b}? Answer with just the number."}],
            add_generation_prompt=True,
        )["input_ids"]
        answer = tok.encode(f"{a + b}", add_special_tokens=False)
        toks = list(prompt) + answer
        out.append(_datum(toks, [0.0] * (len(prompt) - 1) + [1.0] * len(answer)))
    return out


def _weights(runtime: Runtime, tc) -> dict[str, torch.Tensor]:
    engine = runtime.base_stack(TEST_MODEL).engine
    return {k: v.detach().clone() for k, v in engine.adapter_weights(tc.model_id).state_dict().items()}


def test_sdk_program_runs_embedded(runtime: Runtime) -> None:
    """SFT steps, an RL step with sampling, save, resume from state with optimizer."""
    service = opentinker.ServiceClient(runtime=runtime)
    caps = service.get_server_capabilities()
    assert any(m.model_name == "opentinker/tiny" for m in caps.supported_models)
    tc = service.create_lora_training_client(base_model=TEST_MODEL, rank=8, seed=0).result()
    tok = tc.get_tokenizer()
    info = tc.get_info()
    assert info.model_id == tc.model_id and info.lora_rank == 8 and ":train:" in tc.model_id
    losses = []
    for step in range(3):
        fb = tc.forward_backward(_sft_data(tok, step), "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=1e-2))
        losses.append(fb.result().metrics["loss:sum"])
        opt.result()
    # RL: sample a group from the current policy, advantages = reward - mean, importance sampling
    sampler = tc.save_weights_and_get_sampling_client()
    prompt = _sft_data(tok, 99, 1)[0].model_input
    res = sampler.sample(
        prompt, num_samples=4, sampling_params=types.SamplingParams(max_tokens=6, temperature=1.0, seed=1)
    ).result()
    rewards = np.array([float(len(s.tokens)) for s in res.sequences])
    adv = rewards - rewards.mean()
    rl_data = []
    ptoks = prompt.to_ints()
    for s, a in zip(res.sequences, adv, strict=True):
        toks = ptoks + list(s.tokens)
        n = len(toks) - 1
        lp = [0.0] * (len(ptoks) - 1) + list(s.logprobs)
        av = [0.0] * (len(ptoks) - 1) + [float(a)] * len(s.tokens)
        rl_data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(toks[:-1]),
                loss_fn_inputs={"target_tokens": toks[1:], "logprobs": lp[:n], "advantages": av[:n]},
            )
        )
    out = tc.forward_backward(rl_data, "importance_sampling").result()
    assert len(out.loss_fn_outputs) == 4 and "loss:sum" in out.metrics
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    path = tc.save_state("after-rl").result().path
    assert path == f"tinker://{tc.model_id}/weights/after-rl"
    resumed = service.create_training_client_from_state_with_optimizer(path).result()
    # both continue identically: weights and optimizer state came along
    for step in range(2):
        for client in (tc, resumed):
            client.forward_backward(_sft_data(tok, 50 + step), "cross_entropy")
            client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    wa, wb = _weights(runtime, tc), _weights(runtime, resumed)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    # lineage: the checkpoint names the sampler version that produced its RL data
    ckpts = service.create_rest_client().list_checkpoints(tc.model_id).result().checkpoints
    assert [c.tinker_path for c in ckpts] == [path]
    meta = runtime.store.record(opentinker.service.checkpoints.parse_tinker_path(path)).meta
    assert meta["step"] == 4 and meta["sampler_versions"] == [sampler.policy]


def test_pipelined_forward_backward_and_optim_run_in_one_tick(runtime: Runtime) -> None:
    service = opentinker.ServiceClient(runtime=runtime)
    tc = service.create_lora_training_client(TEST_MODEL, rank=4, seed=0)
    data = _sft_data(tc.get_tokenizer(), 0)
    fb, opt = tc.forward_backward(data), tc.optim_step(types.AdamParams(learning_rate=1e-3))
    assert fb.result().metrics["clock_cycle:unique"] == opt.result().metrics["clock_cycle:unique"]


def test_fairness_a_small_client_is_not_starved_by_a_big_one(runtime: Runtime) -> None:
    service = opentinker.ServiceClient(runtime=runtime)
    big = service.create_lora_training_client(TEST_MODEL, rank=4, seed=0)
    small = service.create_lora_training_client(TEST_MODEL, rank=4, seed=1)
    tok = big.get_tokenizer()
    sched = runtime.base_stack(TEST_MODEL).scheduler
    start = sched.stats.ticks
    with sched._cv:  # hold the loop so both clients' work is queued before the next tick
        big_futs = [big.forward_backward(_sft_data(tok, i, n=8)) for i in range(6)]
        small_fut = small.forward_backward(_sft_data(tok, 100, n=1))
    small_tick = small_fut.result().metrics["clock_cycle:unique"]
    big_ticks = [f.result().metrics["clock_cycle:unique"] for f in big_futs]
    assert small_tick == start + 1 == big_ticks[0]  # served in the very first tick, beside the big one
    assert big_ticks == sorted(big_ticks) and big_ticks[-1] >= start + 6  # one request per model per tick


def test_concurrent_clients_equal_their_solo_runs(runtime: Runtime, tmp_path) -> None:
    n_clients, steps = 8, 3

    def run(service, seed: int, out: dict) -> None:
        tc = service.create_lora_training_client(TEST_MODEL, rank=4, seed=seed)
        tok = tc.get_tokenizer()
        losses = []
        for s in range(steps):
            fb = tc.forward_backward(_sft_data(tok, seed * 100 + s, n=2))
            tc.optim_step(types.AdamParams(learning_rate=1e-2))
            losses.append(fb.result().metrics["loss:sum"])
        sampler = tc.save_weights_and_get_sampling_client()
        prompt = _sft_data(tok, seed, 1)[0].model_input
        res = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=5, temperature=0.0)).result()
        tokens = list(res.sequences[0].tokens)
        # the top-2 logprob gap at each greedy position: where the two runs may pick differently
        scored = sampler.sample(
            types.ModelInput.from_ints(prompt.to_ints() + tokens),
            1,
            types.SamplingParams(max_tokens=1),
            include_prompt_logprobs=True,
            topk_prompt_logprobs=2,
        ).result()
        tops = scored.topk_prompt_logprobs[prompt.length :]
        out[seed] = (losses, tokens, [top[0][1] - top[1][1] for top in tops])

    together: dict = {}
    threads = [
        threading.Thread(target=run, args=(opentinker.ServiceClient(runtime=runtime), i, together))
        for i in range(n_clients)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert runtime.base_stack(TEST_MODEL).scheduler.stats.fused_requests >= n_clients * steps
    solo_rt = Runtime(tmp_path / "solo")
    try:
        for i in range(n_clients):
            alone: dict = {}
            run(opentinker.ServiceClient(runtime=solo_rt), i, alone)
            # step 1 runs on identical weights; later steps drift within TRAJECTORY_REL
            assert_scalar_close(together[i][0][0], alone[i][0][0])
            for got, want in zip(together[i][0], alone[i][0], strict=True):
                assert_scalar_close(got, want, TRAJECTORY_REL)
            assert_greedy_equal(together[i][1], alone[i][1], gaps=alone[i][2], gap_tol=TRAJECTORY_LOGIT_ATOL)
    finally:
        solo_rt.shutdown()


def test_forward_backward_custom_equals_builtin_cross_entropy(runtime: Runtime) -> None:
    service = opentinker.ServiceClient(runtime=runtime)
    a = service.create_lora_training_client(TEST_MODEL, rank=4, seed=0)
    b = service.create_lora_training_client(TEST_MODEL, rank=4, seed=0)
    data = _sft_data(a.get_tokenizer(), 3)

    def nll(batch, logprobs):
        loss = sum(
            -(lp * torch.tensor(d.loss_fn_inputs["weights"].tolist())).sum()
            for d, lp in zip(batch, logprobs, strict=True)
        )
        return loss, {"custom:sum": float(loss)}

    out = a.forward_backward_custom(data, nll).result()
    ref = b.forward_backward(data).result()
    assert_scalar_close(out.metrics["loss:sum"], ref.metrics["loss:sum"])
    for c in (a, b):
        c.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    wa, wb = _weights(runtime, a), _weights(runtime, b)
    assert_state_close(wa, wb)


def test_checkpoint_registry_list_delete_and_sampler_weights(runtime: Runtime) -> None:
    service = opentinker.ServiceClient(runtime=runtime)
    tc = service.create_lora_training_client(TEST_MODEL, rank=4, seed=0)
    tok = tc.get_tokenizer()
    tc.forward_backward(_sft_data(tok, 0))
    tc.optim_step(types.AdamParams(learning_rate=1e-2))
    w = tc.save_state("w1").result().path
    s = tc.save_weights_for_sampler("s1").result().path
    assert s == f"tinker://{tc.model_id}/sampler_weights/s1"
    rest = service.create_rest_client()
    assert {c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints} == {w, s}
    prompt = _sft_data(tok, 5, 1)[0].model_input
    greedy = types.SamplingParams(max_tokens=5, temperature=0.0)
    from_disk = service.create_sampling_client(model_path=s).sample(prompt, 1, greedy).result()
    live = tc.save_weights_and_get_sampling_client().sample(prompt, 1, greedy).result()
    assert list(from_disk.sequences[0].tokens) == list(live.sequences[0].tokens)
    with pytest.raises(CheckpointError, match="already exists"):
        tc.save_state("w1").result()
    rest.delete_checkpoint_from_tinker_path(w).result()
    assert [c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints] == [s]
    with pytest.raises(CheckpointError):
        service.create_training_client_from_state(w)


def test_bad_calls_are_refused_and_change_nothing(runtime: Runtime, tmp_path) -> None:
    service = opentinker.ServiceClient(runtime=runtime)
    tc = service.create_lora_training_client(TEST_MODEL, rank=4, seed=0)
    tok = tc.get_tokenizer()
    tc.forward_backward(_sft_data(tok, 0))
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    before = _weights(runtime, tc)
    with pytest.raises(EngineError, match="learning_rate"):
        tc.optim_step(types.AdamParams(learning_rate=-1e-3))
    for bad in [
        "tinker:/x/weights/a",
        "tinker://m/other/a",
        "tinker://m/weights/../../etc",
        "s3://m/weights/a",
        "",
    ]:
        with pytest.raises(EngineError, match="malformed checkpoint path"):
            service.create_training_client_from_state(bad)
        with pytest.raises(EngineError, match="malformed checkpoint path"):
            tc.load_state(bad)
    with pytest.raises(EngineError, match="unknown loss_fn"):
        tc.forward_backward(_sft_data(tok, 1), "no_such_loss").result()
    after = _weights(runtime, tc)
    assert all(torch.equal(before[k], after[k]) for k in before)
    # a checkpoint of another base model cannot be loaded into this one
    other_dir = tmp_path / "other-base"
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    vocab = len(tok)
    Qwen2ForCausalLM(
        Qwen2Config(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=48,
            vocab_size=vocab,
        )
    ).save_pretrained(other_dir)
    AutoTokenizer.from_pretrained(runtime.base_stack(TEST_MODEL).engine.base.path).save_pretrained(other_dir)
    other = service.create_lora_training_client(str(other_dir), rank=4, seed=0)
    foreign = other.save_state("x").result().path
    with pytest.raises(CheckpointError, match="trained on"):
        tc.load_state(foreign).result()
    with pytest.raises(CheckpointError, match="trained on"):
        service.create_training_client_from_state(foreign, base_model=TEST_MODEL)
    after = _weights(runtime, tc)
    assert all(torch.equal(before[k], after[k]) for k in before)
    # a deleted model refuses every call
    service.delete_model(tc.model_id)
    with pytest.raises(EngineError, match="deleted"):
        tc.forward_backward(_sft_data(tok, 2))
    with pytest.raises(EngineError, match="deleted"):
        tc.optim_step(types.AdamParams(learning_rate=1e-3))
    with pytest.raises(EngineError, match="deleted"):
        tc.save_state("nope")
    # another tenant's checkpoints are invisible
    stranger = opentinker.ServiceClient(runtime=runtime, tenant="someone-else")
    with pytest.raises(UnknownPolicyError):
        stranger.create_training_client_from_state(foreign)
    assert stranger.create_rest_client().list_checkpoints(other.model_id).result().checkpoints == []
    theirs = stranger.create_lora_training_client(str(other_dir), rank=4, seed=0)
    with pytest.raises(UnknownPolicyError):
        theirs.load_state(foreign)


def test_ephemeral_snapshots_are_released_with_their_sampling_client(runtime: Runtime) -> None:
    import gc

    service = opentinker.ServiceClient(runtime=runtime)
    tc = service.create_lora_training_client(TEST_MODEL, rank=4, seed=0)
    engine = runtime.base_stack(TEST_MODEL).engine
    before = len(engine.snapshot_ids())
    for _ in range(5):  # an RL loop: a fresh sampler every step, the old one dropped
        sampler = tc.save_weights_and_get_sampling_client()
        sampler.sample(types.ModelInput.from_ints([1, 5, 6]), 1, types.SamplingParams(max_tokens=2)).result()
    kept = sampler.policy
    # a temporary sampler stays alive until its queued request has run
    fut = tc.save_weights_and_get_sampling_client().sample(
        types.ModelInput.from_ints([1, 5]), 1, types.SamplingParams(max_tokens=2)
    )
    gc.collect()
    assert len(fut.result().sequences) == 1
    gc.collect()
    tc.get_info()  # a later op of the same model runs after the queued releases
    tc.forward_backward(_sft_data(tc.get_tokenizer(), 0, n=1)).result()
    assert engine.snapshot_ids()[before:] == [kept]


def test_a_sampler_for_an_overwritten_checkpoint_serves_the_new_weights(runtime: Runtime) -> None:
    """``save_weights_for_sampler`` under one name twice: a sampling client made from the path
    after the second save serves the second weights; one made before keeps the first (pinned)."""
    service = opentinker.ServiceClient(runtime=runtime)
    tc = service.create_lora_training_client(base_model=TEST_MODEL, rank=8, seed=0).result()
    data = _sft_data(tc.get_tokenizer(), 0)
    prompt = data[0].model_input.append_int(7)

    def step() -> None:
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()

    def logprobs(sampler) -> list[float | None]:
        return sampler.compute_logprobs(prompt).result()

    step()
    path = tc.save_weights_for_sampler("policy").result().path
    first = service.create_sampling_client(model_path=path)
    assert first.model_path == path
    before = logprobs(first)
    step()
    assert tc.save_weights_for_sampler("policy").result().path == path
    second = service.create_sampling_client(model_path=path)
    live = logprobs(tc.save_weights_and_get_sampling_client())
    assert logprobs(second) == pytest.approx(live, abs=1e-5)
    assert logprobs(second) != pytest.approx(before, abs=1e-3)  # the step moved these logprobs
    assert logprobs(first) == before  # the earlier client stays on the weights it was made for


def test_user_metadata_is_kept_and_its_degree_checked_embedded(runtime: Runtime) -> None:
    """``user_metadata`` reaches the model's record, as the server stores it; its
    ``{"data_parallel": "k"}`` is checked as over HTTP: here (no trainer workers) k = 2 is refused
    naming why, before anything is made (test_ray_dp_loss.py: k = 2 on trainer workers)."""
    service = opentinker.ServiceClient(runtime=runtime)
    above = r"data_parallel 2 is above the number of trainer workers \(0\); serve with --ray"
    with pytest.raises(ValueError, match=above):
        service.create_lora_training_client(TEST_MODEL, rank=4, user_metadata={"data_parallel": "2"})
    assert not runtime.models
    tc = service.create_lora_training_client(TEST_MODEL, rank=4, user_metadata={"data_parallel": "1", "n": 7})
    rec = runtime.models[tc.model_id]
    assert rec.user_metadata == {"data_parallel": "1", "n": "7"} and rec.data_parallel == 1
    path = tc.save_state("s").result().path
    with pytest.raises(ValueError, match=above):
        service.create_training_client_from_state(path, user_metadata={"data_parallel": "2"})
    again = service.create_training_client_from_state(path, user_metadata={"from": "s"})
    assert runtime.models[again.model_id].user_metadata == {"from": "s"}


def test_only_the_embedded_client_releases_models(runtime: Runtime) -> None:
    """``ReleasesModels`` is what a library pooling adapters asks: the embedded client drops a
    model it made (its adapter is freed, the model is refused after), the SDK's client cannot."""
    import tinker

    from opentinker.client import ReleasesModels

    service = opentinker.ServiceClient(runtime=runtime)
    assert isinstance(service, ReleasesModels)
    tc = service.create_lora_training_client(TEST_MODEL, rank=4)
    asyncio.run(service.delete_model_async(tc.model_id))
    with pytest.raises(EngineError, match="was deleted"):
        runtime.model(tc.model_id)
    sdk = tinker.ServiceClient(base_url="http://127.0.0.1:9", api_key="tml-unused")
    assert not isinstance(sdk, ReleasesModels)


@pytest.mark.parametrize(
    ("settings", "refused"),
    [
        ({"data_parallel": 2}, r"data_parallel 2 is above the number of trainer workers \(0\)"),
        ({"ray": "local"}, "give rollout_workers >= 1 or trainer_workers >= 1"),
        ({"placement_timeout": 0}, "placement_timeout must be > 0"),
    ],
)
def test_a_refused_runtime_leaves_no_data_dir(tmp_path, settings, refused) -> None:
    """Scale-out settings are checked before the runtime writes anything: no empty data dir is
    left behind by a start that was refused."""
    data = tmp_path / "never"
    with pytest.raises(ValueError, match=refused):
        Runtime(data, **settings)
    assert not data.exists()
