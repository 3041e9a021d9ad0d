"""LoRA on routed experts, per MoE family (random 2-layer models from transformers' configs).

Each family: the loss falls; every routed expert that tokens reach gets its own update, and no
other; K = 4 adapters mixed in one batch equal separate runs (invariant 1); sampled logprobs equal
the trainer's (invariant 3); save/load is exact (invariant 4); the PEFT export (experts through
``target_parameters``) and the merged model give the engine's logits (invariant 5);
``train_mlp=False`` holds no expert or MLP weights. Bad input: an unknown expert layout, a dense
checkpoint on a MoE base, expert tensors of the wrong E or r.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from opentinker.engine import AdamParams, CheckpointError, Engine, EngineError, Example, ForwardRequest
from opentinker.lora import LoRAConfig
from opentinker.models import BaseModel, load_base_model
from opentinker.sampling import NativeBackend, SampleRequest, SamplingParams
from tests.conftest import make_examples
from tests.families import MOE_FAMILIES, family_model
from tests.tolerances import assert_logprobs_close, assert_rel_close, assert_scalar_close

ADAM = AdamParams(learning_rate=2e-2)


@pytest.fixture(scope="module", params=sorted(MOE_FAMILIES))
def moe_base(request: Any, tmp_path_factory: pytest.TempPathFactory) -> BaseModel:
    folder = tmp_path_factory.mktemp(request.param)
    return load_base_model(family_model(folder, request.param))


def _engine(base: BaseModel) -> Engine:
    return Engine(base, max_rank=16)


def _expert_groups(engine: Engine) -> list[str]:
    return sorted(n for n, g in engine.lora.groups.items() if g.experts)


def _bump(engine: Engine, aid: str, seed: int) -> None:
    engine.forward_backward(ForwardRequest(aid, make_examples(4, engine.vocab_size, seed=seed)))
    engine.optim_step(aid, ADAM)


def _routed_experts(engine: Engine, examples: list[Example]) -> dict[str, set[int]]:
    """Which experts each experts module's tokens were routed to, in a forward over ``examples``."""
    seen: dict[str, set[int]] = {}

    def hook(name: str):
        def record(_mod: Any, args: tuple[Any, ...]) -> None:
            seen.setdefault(name, set()).update(args[1].reshape(-1).tolist())

        return record

    wrapped = [(n, m) for n, m in engine.base.model.named_modules() if type(m).__name__ == "MultiLoRAExperts"]
    handles = [m.register_forward_pre_hook(hook(n)) for n, m in wrapped]
    try:
        engine.forward_backward(ForwardRequest(None, examples, backward=False))
    finally:
        for h in handles:
            h.remove()
    return seen


def test_every_routed_expert_gets_lora_and_the_loss_falls(moe_base: BaseModel) -> None:
    engine = _engine(moe_base)
    groups = _expert_groups(engine)
    assert groups, "no routed-expert target group found"
    aid = engine.create_adapter(LoRAConfig(rank=4, seed=0))
    weights = engine.adapter_weights(aid)
    assert set(groups) <= set(weights.a)
    routers = [n for n in engine.lora.groups if n.rpartition(".")[2].partition("@")[0] in ("gate", "router")]
    assert not routers, f"routers must stay frozen: {routers}"

    data = make_examples(6, engine.vocab_size, seed=1, min_len=12, max_len=16)
    routed = _routed_experts(engine, data)
    first = engine.forward_backward(ForwardRequest(aid, data)).metrics["loss:sum"]
    engine.optim_step(aid, ADAM)
    # one step: B moves from 0 exactly for the experts tokens were routed to, in each layer
    for name in groups:
        group = engine.lora.groups[name]
        b = engine.adapter_weights(aid).b[name].detach()  # [L, E, out, r]
        for layer, path in enumerate(group.paths):
            hit = routed[path.rpartition(".")[0]]
            moved = {e for e in range(group.experts) if b[layer, e].abs().sum() > 0}
            assert moved == hit, (name, layer, moved, hit)
    for _ in range(4):
        engine.forward_backward(ForwardRequest(aid, data))
        engine.optim_step(aid, ADAM)
    last = engine.forward_backward(ForwardRequest(aid, data, backward=False)).metrics["loss:sum"]
    assert last < 0.9 * first


def test_train_mlp_false_holds_no_expert_or_mlp_weights(moe_base: BaseModel) -> None:
    engine = _engine(moe_base)
    aid = engine.create_adapter(LoRAConfig(rank=4, seed=0, train_mlp=False))
    kinds = {engine.lora.groups[n].kind for n in engine.adapter_weights(aid).a}
    assert "mlp" not in kinds and not set(_expert_groups(engine)) & set(engine.adapter_weights(aid).a)


def test_mixed_four_adapters_equal_separate_runs(moe_base: BaseModel) -> None:
    engine = _engine(moe_base)
    ids = [engine.create_adapter(LoRAConfig(rank=r, seed=i)) for i, r in enumerate([4, 8, 4, 2])]
    for i, aid in enumerate(ids):
        _bump(engine, aid, seed=100 + i)
    reqs = [ForwardRequest(aid, make_examples(3, engine.vocab_size, seed=i)) for i, aid in enumerate(ids)]
    mixed = engine.forward_backward_many(reqs)
    grads = {aid: {k: v.clone() for k, v in (engine.pending_gradients(aid) or {}).items()} for aid in ids}
    for aid in ids:
        engine.optim_step(aid, AdamParams(learning_rate=0.0))
    for req, res in zip(reqs, mixed, strict=True):
        assert not isinstance(res, Exception)
        alone = engine.forward_backward(req)
        assert_scalar_close(res.metrics["loss:sum"], alone.metrics["loss:sum"])
        for out_m, out_a in zip(res.outputs, alone.outputs, strict=True):
            assert_rel_close(out_m["logprobs"], out_a["logprobs"])
        own = engine.pending_gradients(req.policy) or {}  # type: ignore[arg-type]
        for k in _expert_groups(engine):
            assert_rel_close(grads[req.policy][f"{k}.lora_B"], own[f"{k}.lora_B"])  # type: ignore[index]
        assert_rel_close(
            torch.cat([v.reshape(-1) for _, v in sorted(grads[req.policy].items())]),  # type: ignore[index]
            torch.cat([v.reshape(-1) for _, v in sorted(own.items())]),
        )


def _forward_logprobs(engine: Engine, policy: str | None, tokens: list[int]) -> torch.Tensor:
    ex = Example(torch.tensor(tokens[:-1]), {"target_tokens": torch.tensor(tokens[1:])})
    return engine.forward_backward(ForwardRequest(policy, [ex], backward=False)).outputs[0]["logprobs"]


# families the native sampler refuses (with this text in the reason, never a crash mid-decode):
# none since its cache holds each layer's kind (MLA's latent, Gated DeltaNet's state;
# tests/test_hybrid_sampling.py)
SAMPLER_REFUSES: dict[str, str] = {}


def test_sampled_logprobs_match_the_trainer(moe_base: BaseModel) -> None:
    engine = _engine(moe_base)
    refused = SAMPLER_REFUSES.get(moe_base.model_type)
    if refused is not None:
        [res] = NativeBackend(engine).generate(
            [SampleRequest(None, [5, 9, 14], SamplingParams(max_tokens=2))]
        )
        assert isinstance(res, EngineError) and refused in str(res) and moe_base.model_type in str(res)
        return
    a, b = (engine.create_adapter(LoRAConfig(rank=4, seed=s)) for s in (0, 1))
    _bump(engine, a, 1)
    _bump(engine, b, 2)
    snap = engine.snapshot(a).snapshot_id
    prompts = [[5, 9, 14, 3, 7, 22], [8, 8, 31, 40], [12, 5, 9]]
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=0, stop=[])
    reqs = [SampleRequest(p, prompts[i % 3], params, num_samples=2) for i, p in enumerate([a, b, snap, None])]
    for req, res in zip(reqs, NativeBackend(engine).generate(reqs), strict=True):
        assert not isinstance(res, Exception), res
        for seq in res.sequences:
            lp = _forward_logprobs(engine, req.policy, req.prompt + seq.tokens)[len(req.prompt) - 1 :]
            assert_logprobs_close(lp, seq.logprobs)


def test_save_load_is_exact_and_peft_export_matches(moe_base: BaseModel, tmp_path: Path) -> None:
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    engine = _engine(moe_base)
    aid = engine.create_adapter(LoRAConfig(rank=4, seed=0))
    _bump(engine, aid, 3)
    _bump(engine, aid, 4)
    data = make_examples(3, engine.vocab_size, seed=9, min_len=12, max_len=13)
    before = engine.forward_backward(ForwardRequest(aid, data, backward=False)).outputs
    loaded = engine.load_state(engine.save_state(aid, tmp_path / "ck"))
    after = engine.forward_backward(ForwardRequest(loaded, data, backward=False)).outputs
    for x, y in zip(before, after, strict=True):
        assert torch.equal(x["logprobs"], y["logprobs"])

    out = engine.export_peft(aid, tmp_path / "peft")
    fresh = AutoModelForCausalLM.from_pretrained(engine.base.path, dtype=torch.float32).eval()
    model = peft.PeftModel.from_pretrained(fresh, str(out)).eval()
    x = torch.stack([e.tokens_T for e in data])
    with torch.no_grad():
        ref = model(input_ids=x).logits
        with engine.routing([aid] * len(data)):
            ours = engine.base.model(input_ids=x).logits
        with model.disable_adapter():
            plain = model(input_ids=x).logits
    assert_logprobs_close(ours.log_softmax(-1).flatten(), ref.log_softmax(-1).flatten())
    assert (ours - plain).abs().max() > 1e-3  # the adapter (and its experts) really change the function

    merged_dir = engine.export_merged(aid, tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(str(merged_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        assert_logprobs_close(
            merged(input_ids=x).logits.log_softmax(-1).flatten(), ref.log_softmax(-1).flatten()
        )


def test_expert_tensors_of_the_wrong_shape_are_refused(moe_base: BaseModel, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    engine = _engine(moe_base)
    aid = engine.create_adapter(LoRAConfig(rank=4, seed=0))
    path = Path(engine.save_state(aid, tmp_path / "ck"))
    name = _expert_groups(engine)[0]
    for key, shrink in ((f"{name}.lora_A", 1), (f"{name}.lora_B", 1), (f"{name}.lora_A", 2)):
        ck = tmp_path / f"bad-{shrink}-{key}"
        import shutil

        shutil.copytree(path, ck)
        f = ck / "adapter.safetensors"
        tensors = load_file(str(f))
        t = tensors[key]
        cut = t[:, :-1] if shrink == 1 else t[..., :-1, :] if key.endswith("A") else t[..., :-1]
        tensors[key] = cut.contiguous()
        save_file(tensors, str(f))
        _rehash(ck)
        n_before = len(engine.adapter_ids())
        with pytest.raises(CheckpointError, match=r"has shape"):
            engine.load_state(ck)
        assert len(engine.adapter_ids()) == n_before


def _rehash(folder: Path) -> None:
    import hashlib
    import json

    manifest = json.loads((folder / "manifest.json").read_text())
    for name in manifest["files"]:
        manifest["files"][name] = hashlib.sha256((folder / name).read_bytes()).hexdigest()
    (folder / "manifest.json").write_text(json.dumps(manifest))


def test_dense_checkpoint_on_a_moe_base_names_both(tmp_path: Path, engine: Engine) -> None:
    moe = _engine(load_base_model(family_model(tmp_path / "moe", "qwen3_moe")))
    dense_ck = engine.save_state(engine.create_adapter(LoRAConfig(rank=4, seed=0)), tmp_path / "dense")
    with pytest.raises(CheckpointError) as err:
        moe.load_state(dense_ck)
    assert engine.base.name in str(err.value) and moe.base.name in str(err.value)
    moe_ck = moe.save_state(moe.create_adapter(LoRAConfig(rank=4, seed=0)), tmp_path / "moe-ck")
    with pytest.raises(CheckpointError) as err:
        engine.load_state(moe_ck)
    assert engine.base.name in str(err.value) and moe.base.name in str(err.value)


def test_an_unknown_expert_layout_is_refused_naming_it(tmp_path: Path) -> None:
    base = load_base_model(family_model(tmp_path / "m", "qwen3_moe"))
    for layer in base.model.model.layers:  # an experts class without transformers' layout flags
        experts = layer.mlp.experts
        del experts.has_gate
    engine = _engine(base)
    with pytest.raises(EngineError, match=r"mlp\.experts .*gate_up_proj.*train_mlp=False") as err:
        engine.create_adapter(LoRAConfig(rank=4, seed=0))
    assert "(4, 32, 32)" in str(err.value)
    engine.create_adapter(LoRAConfig(rank=4, seed=0, train_mlp=False))  # attention still trains


def test_the_sdk_over_http_trains_samples_and_resumes_a_moe_model(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    import tinker
    from tinker import types

    from tests.conftest import local_server

    folder = family_model(tmp_path / "qwen3-moe", "qwen3_moe")
    tokens = [5, 9, 14, 3, 7, 22, 31, 40, 8, 12, 19, 27, 33, 6]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    with local_server(tmp_path_factory, "moe-server", base_model=folder) as srv:
        service = tinker.ServiceClient(base_url=srv.base_url, api_key="tml-moe-http")
        try:
            tc = service.create_lora_training_client(base_model=folder, rank=4, seed=0).result()
            losses = []
            for _ in range(3):
                losses.append(tc.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"])
                tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
            assert losses[-1] < losses[0]
            sampler = tc.save_weights_and_get_sampling_client().result()
            params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=0, stop=[])
            out = sampler.sample(types.ModelInput.from_ints(tokens[:5]), 2, params).result()
            assert len(out.sequences) == 2 and all(len(s.tokens) == 6 for s in out.sequences)
            path = tc.save_state("moe-step-3").result().path
            resumed = service.create_training_client_from_state_with_optimizer(path).result()
            a = tc.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"]
            b = resumed.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"]
            assert_scalar_close(a, b)
        finally:
            service.close("success").result()


def test_the_per_row_gather_path_equals_the_grouped_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import opentinker.lora.experts as experts

    engine = _engine(load_base_model(family_model(tmp_path / "m", "qwen3_moe")))
    ids = [engine.create_adapter(LoRAConfig(rank=r, seed=i)) for i, r in enumerate([4, 8, 2])]
    for i, aid in enumerate(ids):
        _bump(engine, aid, seed=200 + i)
    x = torch.stack([e.tokens_T for e in make_examples(6, engine.vocab_size, seed=5, min_len=9, max_len=10)])
    policies = [ids[0], ids[1], None, ids[2], ids[0], ids[1]]
    outs, grads = [], []
    for below in (10**9, 0):  # always gather; never gather (grouped)
        monkeypatch.setattr(experts, "GATHER_BELOW", below)
        with torch.no_grad(), engine.routing(policies):
            outs.append(engine.base.model(input_ids=x).logits)
        weights = engine.adapter_weights(ids[1])
        with engine.routing(policies):
            engine.base.model(input_ids=x).logits.logsumexp(-1).sum().backward()
        grads.append(torch.cat([t.grad.flatten() for t in weights.tensors() if t.grad is not None]))
        for t in weights.tensors():
            t.grad = None
    for out, grad in zip(outs[1:], grads[1:], strict=True):
        assert_rel_close(out, outs[0])
        assert_rel_close(grad, grads[0])


def test_stacked_expert_pairs_are_reused_until_the_weights_change(moe_base: BaseModel) -> None:
    engine = _engine(moe_base)
    ids = [engine.create_adapter(LoRAConfig(rank=4, seed=i)) for i in range(3)]
    x = torch.stack([e.tokens_T for e in make_examples(3, engine.vocab_size, seed=7, min_len=6, max_len=7)])

    def logits() -> torch.Tensor:
        with torch.no_grad(), engine.routing(list(ids)):
            return engine.base.model(input_ids=x).logits

    first = engine.plan_routing(list(ids))
    with torch.no_grad():
        again = engine.plan_routing(list(ids))
        reused = engine.plan_routing(list(ids))
    assert first is not None and again is not None and reused is not None
    group = next(g for g in again.a if engine.lora.groups[g].experts)
    assert reused.a[group] is again.a[group]  # the same stack, not a copy
    before = logits()
    _bump(engine, ids[1], seed=300)  # an in-place change of one adapter: the stack is rebuilt
    after = logits()
    with torch.no_grad():
        assert engine.plan_routing(list(ids)).a[group] is not again.a[group]  # type: ignore[union-attr]
    assert not torch.equal(after[1], before[1])
    torch.testing.assert_close(after[0], before[0], rtol=0, atol=0)
