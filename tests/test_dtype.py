"""A bf16 frozen base (docs/DESIGN.md, invariant 11): the invariants in their bf16 form on the tiny
model, LoRA state kept in fp32, checkpoints moving between a bf16 and an fp32 base, the dtype's
path to rollout workers, trainer workers and vLLM, and its choice and refusals at start-up.

The bounds are ``tests/tolerances.py``'s ``BF16_*`` (each justified there). The sampler–trainer
figures the README quotes are printed by ``test_sampler_matches_trainer_on_a_bf16_base`` (``-s``)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from opentinker.engine import AdamParams, Engine, Example, ForwardRequest
from opentinker.lora import LoRAConfig
from opentinker.models import BaseModel, load_base_model
from opentinker.models import dtype as dtypes
from opentinker.sampling import NativeBackend, SampleRequest, SamplingParams
from opentinker.service.runtime import Runtime
from opentinker.workers.wire import WorkerOptions
from opentinker.workers.worker import WorkerCore
from tests.conftest import TEST_MODEL, make_examples
from tests.tolerances import (
    BF16_CROSS_DTYPE_ATOL,
    BF16_CROSS_DTYPE_MEAN,
    BF16_KL_V1,
    BF16_LOGPROB_ATOL,
    BF16_LOGPROB_MEAN,
    BF16_REL,
    assert_logprobs_close,
    assert_mean_abs_close,
    assert_state_close,
)


@pytest.fixture(scope="module")
def bf16_base(device: torch.device) -> BaseModel:
    return load_base_model(TEST_MODEL, dtype=torch.bfloat16, device=device)


@pytest.fixture
def bf16_engine(bf16_base: BaseModel) -> Engine:
    return Engine(bf16_base, max_rank=64)


def _train(engine: Engine, aid: str, seed: int, steps: int = 2) -> None:
    for s in range(steps):
        engine.forward_backward(ForwardRequest(aid, make_examples(4, engine.vocab_size, seed=seed * 10 + s)))
        engine.optim_step(aid, AdamParams(learning_rate=2e-2))


def _logprobs(engine: Engine, policy: str | None, data: list[Example]) -> torch.Tensor:
    res = engine.forward_backward(ForwardRequest(policy, data, backward=False))
    return torch.cat([o["logprobs"].reshape(-1) for o in res.outputs])


# ----------------------------------------------------------------------------------- LoRA in fp32
def test_lora_weights_gradients_and_optimizer_state_are_fp32_on_a_bf16_base(bf16_engine: Engine) -> None:
    assert bf16_engine.base.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in bf16_engine.base.model.parameters())
    aid = bf16_engine.create_adapter(LoRAConfig(rank=4, seed=0))
    _train(bf16_engine, aid, 1, steps=1)  # B ≠ 0: every A and B now gets a gradient
    bf16_engine.forward_backward(ForwardRequest(aid, make_examples(3, bf16_engine.vocab_size, seed=5)))
    grads = bf16_engine.pending_gradients(aid)
    assert grads is not None
    weights = bf16_engine.adapter_weights(aid).state_dict()
    assert sorted(grads) == sorted(weights)
    for name, g in grads.items():  # the gradient lands in the fp32 adapter tensors, not lost
        assert g.dtype == torch.float32 and weights[name].dtype == torch.float32, name
        assert float(g.abs().sum()) > 0, f"{name} got no gradient through the bf16 base"
    bf16_engine.optim_step(aid, AdamParams(learning_rate=1e-3))
    state = bf16_engine.optimizer_state(aid)
    assert state and all(t.dtype == torch.float32 for t in state.values())
    snap = bf16_engine.snapshot(aid).snapshot_id
    assert all(t.dtype == torch.float32 for t in bf16_engine.adapter_weights(snap).tensors())


# -------------------------------------------------------------------- invariant 1, bf16 form
def test_mixed_batch_equals_separate_runs_on_a_bf16_base(bf16_engine: Engine) -> None:
    ids = [bf16_engine.create_adapter(LoRAConfig(rank=r, seed=i)) for i, r in enumerate((2, 4, 8))]
    for i, aid in enumerate(ids):
        _train(bf16_engine, aid, i + 1, steps=1)
    data = [make_examples(2, bf16_engine.vocab_size, seed=40 + i) for i in range(len(ids))]
    mixed = bf16_engine.forward_backward_many([ForwardRequest(a, d) for a, d in zip(ids, data, strict=True)])
    mixed_grads = {a: bf16_engine.pending_gradients(a) for a in ids}
    for aid in ids:  # clear the accumulated gradients: a zero-lr step
        bf16_engine.optim_step(aid, AdamParams(learning_rate=0.0))
    for aid, d, res in zip(ids, data, mixed, strict=True):
        assert not isinstance(res, Exception)
        alone = bf16_engine.forward_backward(ForwardRequest(aid, d))
        for m, s in zip(res.outputs, alone.outputs, strict=True):
            assert_logprobs_close(m["logprobs"], s["logprobs"], atol=BF16_LOGPROB_ATOL)
        got, want = mixed_grads[aid], bf16_engine.pending_gradients(aid)
        assert got is not None and want is not None
        assert_state_close(got, want, rel=BF16_REL)


# -------------------------------------------------------------------- invariant 3, bf16 form
def _agreement(engine: Engine, sampler: NativeBackend, reqs: list[SampleRequest]) -> torch.Tensor:
    """Sampler minus trainer logprob of every sampled token."""
    diffs = []
    for req, res in zip(reqs, sampler.generate(reqs), strict=True):
        assert not isinstance(res, Exception), res
        for seq in res.sequences:
            toks = req.prompt + seq.tokens
            ex = Example(torch.tensor(toks[:-1]), {"target_tokens": torch.tensor(toks[1:])})
            lp = _logprobs(engine, req.policy, [ex])[len(req.prompt) - 1 :]
            diffs.append(torch.tensor(seq.logprobs, dtype=torch.float64) - lp.cpu().double())
    return torch.cat(diffs)


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "hf"])
def test_sampler_matches_trainer_on_a_bf16_base(bf16_engine: Engine, lean: bool) -> None:
    a = bf16_engine.create_adapter(LoRAConfig(rank=4, seed=0))
    b = bf16_engine.create_adapter(LoRAConfig(rank=8, seed=1, train_mlp=False))
    _train(bf16_engine, a, 1)
    _train(bf16_engine, b, 2)
    snap = bf16_engine.snapshot(a).snapshot_id
    tok = bf16_engine.base.tokenizer
    prompts = [tok.encode("Hello there, how are you"), tok.encode("1 2 3 4"), tok.encode("The cat sat")]
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=0, stop=[])
    reqs = [SampleRequest(p, prompts[i % 3], params, num_samples=3) for i, p in enumerate([a, b, snap, None])]
    d = _agreement(bf16_engine, NativeBackend(bf16_engine, lean_decode=lean), reqs)
    kl_v1 = float(d.mean())  # tinker-cookbook's kl_sample_train_v1 (rl/metrics.py)
    print(
        f"\nbf16 base, {'lean' if lean else 'HF'} decode, {d.numel()} tokens: mean |Δlogprob| "
        f"{float(d.abs().mean()):.2e}, max {float(d.abs().max()):.2e}, kl_sample_train_v1 {kl_v1:.2e}, "
        f"v2 {float(0.5 * (d**2).mean()):.2e}"
    )
    assert_logprobs_close(d, torch.zeros_like(d), atol=BF16_LOGPROB_ATOL)
    assert_mean_abs_close(d, BF16_LOGPROB_MEAN)
    assert abs(kl_v1) <= BF16_KL_V1, f"kl_sample_train_v1 {kl_v1:.3g} > {BF16_KL_V1}"


def test_lean_decode_with_a_row_per_adapter_on_a_bf16_base(bf16_engine: Engine) -> None:
    """Every row on its own adapter: the lean decode step's LoRA terms are one GEMV per output
    block, kept in fp32 on a CPU (faster there than bf16's at this size); the sampled logprobs
    equal the trainer's within the bf16 bounds."""
    ids = [bf16_engine.create_adapter(LoRAConfig(rank=4, seed=i)) for i in range(3)]
    for i, aid in enumerate(ids):
        _train(bf16_engine, aid, 3 + i, steps=1)
    tok = bf16_engine.base.tokenizer
    prompts = [tok.encode("Hello there, how are you"), tok.encode("1 2 3 4"), tok.encode("The cat sat")]
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=0, stop=[])
    sampler = NativeBackend(bf16_engine)
    d = _agreement(
        bf16_engine, sampler, [SampleRequest(a, p, params) for a, p in zip(ids, prompts, strict=True)]
    )
    assert_logprobs_close(d, torch.zeros_like(d), atol=BF16_LOGPROB_ATOL)
    assert_mean_abs_close(d, BF16_LOGPROB_MEAN)
    [(_, lora)] = sampler._lora_cache._loras.values()
    terms = [t for t in lora.step_terms(bf16_engine.base.model.config.num_hidden_layers) if t is not None]
    assert "blocks" in {t[0] for t in terms}
    want = torch.float32 if bf16_engine.device.type == "cpu" else torch.bfloat16
    assert {t[1].dtype for t in terms} == {t[2].dtype for t in terms} == {want}


# -------------------------------------------------------------------- checkpoints across dtypes
@pytest.mark.parametrize("trained_on", ["bfloat16", "float32"])
def test_a_checkpoint_moves_between_a_bf16_and_an_fp32_base(
    tmp_path: Any, tiny_base: BaseModel, bf16_base: BaseModel, trained_on: str
) -> None:
    bf16, fp32 = Engine(bf16_base, max_rank=64), Engine(tiny_base, max_rank=64)
    src, dst = (bf16, fp32) if trained_on == "bfloat16" else (fp32, bf16)
    aid = src.create_adapter(LoRAConfig(rank=4, seed=3))
    _train(src, aid, 7)
    path = src.save_state(aid, tmp_path / "ckpt")
    loaded = dst.load_state(path)
    saved_w, loaded_w = src.adapter_weights(aid).state_dict(), dst.adapter_weights(loaded).state_dict()
    for name, t in saved_w.items():  # the fp32 LoRA weights move bit for bit, whatever the base
        assert loaded_w[name].dtype == torch.float32 and torch.equal(loaded_w[name], t), name
    assert_state_close(dst.optimizer_state(loaded), src.optimizer_state(aid), rel=0.0)
    data = make_examples(4, src.vocab_size, seed=99)
    there, here = _logprobs(dst, loaded, data), _logprobs(src, aid, data)
    assert_logprobs_close(there, here, atol=BF16_CROSS_DTYPE_ATOL)
    assert_mean_abs_close(there - here, BF16_CROSS_DTYPE_MEAN)
    dst.forward_backward(ForwardRequest(loaded, data))  # and training goes on there
    dst.optim_step(loaded, AdamParams(learning_rate=1e-3))
    assert dst.adapter_step(loaded) == src.adapter_step(aid) + 1


# -------------------------------------------------------------------- choice and refusals
def test_auto_is_fp32_on_cpu_and_bf16_on_a_gpu_that_has_it(monkeypatch: pytest.MonkeyPatch) -> None:
    assert dtypes.resolve_dtype("auto", "cpu") == torch.float32
    assert dtypes.resolve_dtype(None, "cpu") == torch.float32
    assert dtypes.resolve_dtype("bf16", "cpu") in (torch.bfloat16, torch.float32)
    monkeypatch.setattr(dtypes, "bf16_unsupported", lambda device: None)
    assert dtypes.default_dtype("cuda") == torch.bfloat16
    assert dtypes.resolve_dtype(torch.bfloat16, "cpu") == torch.bfloat16


@pytest.mark.parametrize("bad", ["float16", "fp8", "int8", ""])
def test_an_invalid_dtype_is_refused_naming_the_choices(tmp_path: Any, bad: str) -> None:
    with pytest.raises(ValueError, match="choose one of auto, float32, bfloat16"):
        dtypes.resolve_dtype(bad, "cpu")
    with pytest.raises(ValueError, match=f"unsupported base-model dtype '{bad}'"):
        Runtime(tmp_path, dtype=bad)


def test_bf16_on_a_device_without_it(monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    """A GPU without bf16: refused at start-up. A CPU without native bf16: fp32, logged."""
    monkeypatch.setattr(dtypes, "bf16_unsupported", lambda device: "no bf16 here (test)")
    with pytest.raises(ValueError, match="cannot load the base model in bfloat16 on cuda: no bf16 here"):
        dtypes.resolve_dtype("bfloat16", "cuda")
    with caplog.at_level(logging.WARNING, logger="opentinker.models.dtype"):
        assert dtypes.resolve_dtype("bfloat16", "cpu") == torch.float32
    assert "loading the base model in float32" in caplog.text and "no bf16 here" in caplog.text
    assert dtypes.default_dtype("cuda") == torch.float32


def test_the_runtime_and_its_workers_load_the_base_at_its_dtype(tmp_path: Any) -> None:
    rt = Runtime(tmp_path, dtype="bfloat16")
    if rt.dtype != "bfloat16":
        pytest.skip("this CPU has no native bf16: the runtime fell back to float32")
    assert rt.base_stack(TEST_MODEL).engine.base.dtype == torch.bfloat16
    core = WorkerCore(0, WorkerOptions(TEST_MODEL, dtype=rt.dtype, prefix_cache_bytes=0))
    assert core.engine.base.dtype == torch.bfloat16
    from opentinker.cluster.trainer_worker import TrainerWorker  # a Ray trainer worker's body

    trainer = TrainerWorker(TEST_MODEL, worker_id="w0", dtype=rt.dtype)
    assert trainer.engine.base.dtype == torch.bfloat16
    captured: dict[str, Any] = {}

    class Pool:  # what the runtime hands a rollout worker pool (its workers' WorkerCore options)
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            captured.update(options=args[3])

    import opentinker.service.scaleout as scaleout

    pool = scaleout.WorkerPool
    try:
        scaleout.WorkerPool = Pool  # type: ignore[misc, assignment]
        rt.scaleout.rollout_pool(rt.base_stack(TEST_MODEL).engine, TEST_MODEL)
    finally:
        scaleout.WorkerPool = pool  # type: ignore[misc]
    assert captured["options"].dtype == "bfloat16"


def test_vllm_is_started_at_the_engines_dtype(bf16_engine: Engine) -> None:
    from opentinker.sampling.vllm_backend import VLLMBackend

    captured: dict[str, Any] = {}

    class Capture(VLLMBackend):
        def __init__(self, *args: Any, **kwargs: Any) -> None:  # no vLLM engine: the options only
            captured.update(kwargs)

    Capture.for_engine(bf16_engine)
    assert captured["dtype"] == "bfloat16"
    Capture.for_engine(bf16_engine, dtype="float32")  # an explicit choice wins
    assert captured["dtype"] == "float32"


# -------------------------------------------------------------------- serve --dtype
def test_serve_refuses_an_invalid_dtype_at_start_up(capsys: pytest.CaptureFixture[str]) -> None:
    from opentinker.server.main import build_parser, config_from_args

    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["--base-model", TEST_MODEL, "--dtype", "float16"])
    assert exit_.value.code == 2
    assert "argument --dtype: invalid choice: 'float16'" in capsys.readouterr().err
    args = build_parser().parse_args(["--base-model", TEST_MODEL, "--dtype", "bfloat16"])
    assert config_from_args(args).runtime.dtype == "bfloat16"
    assert config_from_args(build_parser().parse_args(["--base-model", TEST_MODEL])).runtime.dtype == "auto"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA device")
def test_serve_refuses_bf16_on_a_device_that_cannot_run_it(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from opentinker.server.main import serve

    argv = [
        "--base-model",
        TEST_MODEL,
        "--data-dir",
        str(tmp_path),
        "--device",
        "cuda",
        "--dtype",
        "bfloat16",
    ]
    assert serve(argv) == 2  # before the port opens
    err = capsys.readouterr().err
    assert "opentinker serve: error: cannot load the base model in bfloat16 on cuda" in err


def _sdk_probe(base_url: str, base_model: str) -> tuple[list[float], list[float]]:
    """The probe's calls through the official SDK: forward_backward, optim_step,
    save_weights_and_get_sampling_client, sample; then the sampled tokens' logprobs from the
    sampler and from a forward of the trained model, on the same weights."""
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=base_url, api_key="tml-dummy")
    try:
        tc = service.create_lora_training_client(base_model=base_model, rank=4, seed=0)
        tc = tc.result() if hasattr(tc, "result") else tc
        tokens = tc.get_tokenizer().encode("The quick brown fox jumps over the lazy dog")
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
        )
        losses = []
        for _ in range(3):
            out = tc.forward_backward([datum], "cross_entropy").result()
            losses.append(out.metrics["loss:sum"])
            tc.optim_step(types.AdamParams(learning_rate=5e-3)).result()
        assert losses[-1] < losses[0], losses  # it trains on the bf16 base
        sampler = tc.save_weights_and_get_sampling_client()
        sampler = sampler.result() if hasattr(sampler, "result") else sampler
        prompt = types.ModelInput.from_ints(tokens[:4])
        params = types.SamplingParams(max_tokens=12, temperature=1.0, seed=0)
        res = sampler.sample(prompt, num_samples=2, sampling_params=params).result()
        sampled, forward = [], []
        for seq in res.sequences:
            assert seq.logprobs is not None and len(seq.tokens) >= 1
            full = tokens[:4] + seq.tokens
            d = types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                            loss_fn_inputs={"target_tokens": full[1:]})  # fmt: skip
            lp = tc.forward([d], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
            sampled += list(seq.logprobs)
            forward += lp[3:]
        return sampled, forward
    finally:
        service.close("success").result()


def test_serve_dtype_bfloat16_through_the_sdk(tmp_path_factory: pytest.TempPathFactory) -> None:
    from tests.conftest import local_server

    if dtypes.resolve_dtype("bfloat16", "cpu") != torch.bfloat16:
        pytest.skip("this CPU has no native bf16: serve would fall back to float32")
    with local_server(tmp_path_factory, "bf16-serve", "--dtype", "bfloat16") as srv:
        sampled, forward = _sdk_probe(srv.base_url, TEST_MODEL)
        assert "(base weights bfloat16)" in srv.log_path.read_text()
    d = torch.tensor(sampled, dtype=torch.float64) - torch.tensor(forward, dtype=torch.float64)
    assert_logprobs_close(d, torch.zeros_like(d), atol=BF16_LOGPROB_ATOL)


@pytest.mark.slow
def test_serve_dtype_bfloat16_through_the_sdk_on_smollm2(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The same probe on SmolLM2; prints the sampler–trainer figures the README quotes for it."""
    from tests.conftest import local_server

    smollm2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
    with local_server(tmp_path_factory, "bf16-smollm2", "--dtype", "bfloat16", base_model=smollm2) as srv:
        sampled, forward = _sdk_probe(srv.base_url, smollm2)
    d = torch.tensor(sampled, dtype=torch.float64) - torch.tensor(forward, dtype=torch.float64)
    print(
        f"\nSmolLM2, bf16 base, over HTTP, {d.numel()} tokens: mean |Δlogprob| {float(d.abs().mean()):.2e}, "
        f"max {float(d.abs().max()):.2e}, kl_sample_train_v1 {float(d.mean()):.2e}"
    )
    assert float(d.abs().mean()) < 0.5  # SmolLM2's own figures are larger than tiny's (tolerances.py)
