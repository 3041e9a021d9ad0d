"""Invariants 1, 2, 4 and 6 of docs/DESIGN.md on the tiny model, each against a plain reference."""

from __future__ import annotations

import copy

import pytest
import torch

from opentinker.engine import AdamParams, Engine, EngineError, ForwardRequest
from opentinker.lora import LoRAConfig
from tests.conftest import make_examples
from tests.tolerances import ELEMENTWISE_REL, assert_rel_close, assert_scalar_close, assert_state_close

ADAM = AdamParams(learning_rate=1e-2)


def _bump(engine: Engine, aid: str, seed: int) -> None:
    """Give an adapter non-trivial weights (B = 0 at init would hide routing bugs)."""
    engine.forward_backward(ForwardRequest(aid, make_examples(3, engine.vocab_size, seed=seed)))
    engine.optim_step(aid, ADAM)


def _clone_grads(engine: Engine, aid: str) -> dict[str, torch.Tensor]:
    grads = engine.pending_gradients(aid)
    assert grads is not None
    return {k: v.clone() for k, v in grads.items()}


def _flat(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """One adapter's tensors as one vector: relative error is judged on the whole adapter."""
    return torch.cat([tensors[k].detach().reshape(-1) for k in sorted(tensors)])


def _state(engine: Engine, aid: str) -> dict[str, torch.Tensor]:
    w = engine.adapter_weights(aid).state_dict()
    st = {f"w.{k}": v.detach().clone() for k, v in w.items()}
    st.update({f"opt.{k}": v.clone() for k, v in engine.optimizer_state(aid).items()})
    g = engine.pending_gradients(aid)
    st.update({f"grad.{k}": v.clone() for k, v in (g or {}).items()})
    return st


def _assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "ppo"])
def test_inv1_mixed_batch_equals_separate_runs(engine: Engine, loss_fn: str) -> None:
    ranks = [4, 8, 4, 16]
    ids = [engine.create_adapter(LoRAConfig(rank=r, seed=i)) for i, r in enumerate(ranks)]
    for i, aid in enumerate(ids):
        _bump(engine, aid, seed=100 + i)
    rl = loss_fn != "cross_entropy"
    data = {aid: make_examples(3, engine.vocab_size, seed=i, rl=rl) for i, aid in enumerate(ids)}
    reqs = [ForwardRequest(aid, data[aid], loss_fn) for aid in ids]

    mixed = engine.forward_backward_many(reqs)
    mixed_grads = {aid: _clone_grads(engine, aid) for aid in ids}
    for aid in ids:  # clear the accumulators with a zero-lr step
        engine.optim_step(aid, AdamParams(learning_rate=0.0))

    for req, res in zip(reqs, mixed, strict=True):
        assert not isinstance(res, Exception)
        alone = engine.forward_backward(req)
        assert_scalar_close(res.metrics["loss:sum"], alone.metrics["loss:sum"])
        for out_m, out_a in zip(res.outputs, alone.outputs, strict=True):
            assert_rel_close(out_m["logprobs"], out_a["logprobs"])
        alone_grads = _clone_grads(engine, req.policy)  # type: ignore[arg-type]
        assert_rel_close(_flat(mixed_grads[req.policy]), _flat(alone_grads))  # type: ignore[index]


def test_inv1_forward_only_and_snapshots_share_the_batch(engine: Engine) -> None:
    a = engine.create_adapter(LoRAConfig(rank=4, seed=0))
    _bump(engine, a, 1)
    snap = engine.snapshot(a)
    _bump(engine, a, 2)
    ex = make_examples(2, engine.vocab_size, seed=5)
    reqs = [ForwardRequest(p, ex, backward=False) for p in (a, snap.snapshot_id, None)]
    fused = engine.forward_backward_many(reqs)
    for req, res in zip(reqs, fused, strict=True):
        assert not isinstance(res, Exception)
        alone = engine.forward_backward(req)
        assert_rel_close(res.outputs[0]["logprobs"], alone.outputs[0]["logprobs"])
    live, pinned, base = (r.outputs[0]["logprobs"] for r in fused)  # type: ignore[union-attr]
    assert not torch.allclose(live, pinned) and not torch.allclose(pinned, base)
    assert engine.pending_gradients(a) is None  # forward-only never accumulates


def test_inv2_isolation_every_op_leaves_other_adapters_bitwise_unchanged(engine: Engine, tmp_path) -> None:
    a = engine.create_adapter(LoRAConfig(rank=4, seed=0))
    b = engine.create_adapter(LoRAConfig(rank=8, seed=1, train_mlp=False))
    _bump(engine, a, 1)
    _bump(engine, b, 2)
    engine.forward_backward(
        ForwardRequest(b, make_examples(2, engine.vocab_size, seed=3))
    )  # b has pending grads
    before = _state(engine, b)
    ops = [
        lambda: engine.forward_backward(ForwardRequest(a, make_examples(4, engine.vocab_size, seed=4))),
        lambda: engine.optim_step(a, AdamParams(learning_rate=0.1, weight_decay=0.1, grad_clip_norm=1.0)),
        lambda: engine.forward_backward(
            ForwardRequest(a, make_examples(2, engine.vocab_size, seed=6, rl=True), "gspo")
        ),
        lambda: engine.snapshot(a),
        lambda: engine.save_state(a, tmp_path / "a"),
        lambda: engine.load_state(tmp_path / "a", into=a),
        lambda: engine.create_adapter(LoRAConfig(rank=2)),
        lambda: engine.delete_adapter(a),
    ]
    for op in ops:
        op()
        _assert_bitwise_equal(before, _state(engine, b))
    # weights never exist above an adapter's own rank: stored shapes are exactly its rank
    for name, t in engine.adapter_weights(b).a.items():
        assert t.shape[1] == 8, name
    for name, t in engine.adapter_weights(b).b.items():
        assert t.shape[2] == 8, name
    assert all("mlp" not in n for n in engine.adapter_weights(b).a)


def test_inv4_save_load_reproduces_logprobs_and_training(engine: Engine, tmp_path) -> None:
    a = engine.create_adapter(LoRAConfig(rank=4, seed=0))
    for s in range(3):
        _bump(engine, a, s)
    engine.save_state(a, tmp_path / "ck")
    b = engine.load_state(tmp_path / "ck")
    probe = make_examples(3, engine.vocab_size, seed=9)
    ra = engine.forward_backward(ForwardRequest(a, probe, backward=False))
    rb = engine.forward_backward(ForwardRequest(b, probe, backward=False))
    for x, y in zip(ra.outputs, rb.outputs, strict=True):
        assert torch.equal(x["logprobs"], y["logprobs"])
    assert engine.adapter_step(b) == engine.adapter_step(a) == 3
    for s in range(3):  # continue training both identically: optimizer state came along
        for aid in (a, b):
            engine.forward_backward(ForwardRequest(aid, make_examples(3, engine.vocab_size, seed=50 + s)))
            engine.optim_step(aid, ADAM)
    _assert_bitwise_equal(
        {k: v.detach() for k, v in engine.adapter_weights(a).state_dict().items()},
        {k: v.detach() for k, v in engine.adapter_weights(b).state_dict().items()},
    )
    # without the optimizer, the same weights but a fresh optimizer: training diverges
    c = engine.load_state(tmp_path / "ck", optimizer=False)
    assert engine.optimizer_state(c) == {}


def test_inv6_gradient_accumulation_halves_equal_whole(engine: Engine) -> None:
    a = engine.create_adapter(LoRAConfig(rank=4, seed=0))
    b = engine.create_adapter(LoRAConfig(rank=4, seed=0))
    _bump(engine, a, 1)
    _bump(engine, b, 1)
    data = make_examples(8, engine.vocab_size, seed=11)
    engine.forward_backward(ForwardRequest(a, data[:4]))
    engine.forward_backward(ForwardRequest(a, data[4:]))
    engine.forward_backward(ForwardRequest(b, data))
    ga, gb = _clone_grads(engine, a), _clone_grads(engine, b)
    assert_rel_close(_flat(ga), _flat(gb))
    engine.optim_step(a, ADAM)
    engine.optim_step(b, ADAM)
    wa, wb = engine.adapter_weights(a).state_dict(), engine.adapter_weights(b).state_dict()
    assert_rel_close(_flat(wa), _flat(wb))


def test_training_reduces_loss_and_matches_manual_adamw(engine: Engine) -> None:
    """optim_step is AdamW with Tinker's defaults: compare one step with torch's reference."""
    a = engine.create_adapter(LoRAConfig(rank=4, seed=0))
    _bump(engine, a, 1)
    data = make_examples(4, engine.vocab_size, seed=2)
    before = {k: v.detach().clone() for k, v in engine.adapter_weights(a).state_dict().items()}
    engine.forward_backward(ForwardRequest(a, data))
    grads = _clone_grads(engine, a)
    ref_params = {k: v.clone().requires_grad_(True) for k, v in before.items()}
    ref_opt = torch.optim.AdamW(
        list(ref_params.values()), lr=1e-2, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0
    )
    ref_opt.load_state_dict(copy.deepcopy(_adam_state_for(engine, a, ref_opt, ref_params)))
    for k, p in ref_params.items():
        p.grad = grads[k]
    ref_opt.step()
    engine.optim_step(a, ADAM)
    got = engine.adapter_weights(a).state_dict()
    assert_state_close({k: got[k] for k in ref_params}, ref_params, ELEMENTWISE_REL)
    losses = []
    for _ in range(5):
        losses.append(engine.forward_backward(ForwardRequest(a, data)).metrics["loss:sum"])
        engine.optim_step(a, ADAM)
    assert losses[-1] < losses[0]


def _adam_state_for(
    engine: Engine, aid: str, opt: torch.optim.Optimizer, params: dict[str, torch.Tensor]
) -> dict:
    state = engine.optimizer_state(aid)
    sd = opt.state_dict()
    for idx, k in enumerate(params):
        sd["state"][idx] = {
            "step": state[f"{k}.step"].reshape(()).clone().cpu(),  # torch keeps it on the CPU
            "exp_avg": state[f"{k}.exp_avg"].clone(),
            "exp_avg_sq": state[f"{k}.exp_avg_sq"].clone(),
        }
    return sd


def test_soft_targets_in_a_mixed_batch_match_their_hard_target_parts(engine: Engine) -> None:
    """2-D targets [T, K] with weights [T, K]: logprobs of each column equal the 1-D runs."""
    a = engine.create_adapter(LoRAConfig(rank=4, seed=0))
    _bump(engine, a, 1)
    from opentinker.engine import Example

    tokens = torch.randint(3, engine.vocab_size, (9,), generator=torch.Generator().manual_seed(0))
    alt = torch.randint(3, engine.vocab_size, (9,), generator=torch.Generator().manual_seed(1))
    soft = Example(
        tokens, {"target_tokens": torch.stack([tokens.roll(-1), alt], 1), "weights": torch.full((9, 2), 0.5)}
    )
    hard = [Example(tokens, {"target_tokens": t}) for t in (tokens.roll(-1), alt)]
    res_soft, res_hard = engine.forward_backward_many(
        [ForwardRequest(a, [soft], backward=False), ForwardRequest(a, hard, backward=False)]
    )
    assert not isinstance(res_soft, Exception) and not isinstance(res_hard, Exception)
    lp = res_soft.outputs[0]["logprobs"]
    assert lp.shape == (9, 2)
    for col in range(2):
        assert_rel_close(lp[:, col], res_hard.outputs[col]["logprobs"])
    assert_scalar_close(res_soft.metrics["loss:sum"], 0.5 * res_hard.metrics["loss:sum"])


def test_a_ticks_optimizer_steps_at_once_are_bitwise_each_adapters_own(engine: Engine) -> None:
    """``optim_step_many`` (what a scheduler tick runs) against each adapter's own ``optim_step``:
    twins with the same seed, gradients and hyperparameters (ranks, learning rates, weight decay,
    clipping, fresh and stepped moments) end bitwise equal; a refused step (bad hyperparameters,
    an overflowing learning rate, an unknown adapter) fails alone and changes nothing."""
    hps = [
        AdamParams(learning_rate=1e-2),
        AdamParams(learning_rate=3e-3, weight_decay=0.1, beta1=0.8),
        AdamParams(learning_rate=1e-2, grad_clip_norm=1e-3, eps=1e-6),
        AdamParams(learning_rate=5e-4, beta2=0.99),
    ]
    pairs = []
    for i, rank in enumerate((4, 8, 8, 16)):
        cfg = LoRAConfig(rank=rank, seed=10 + i)
        pairs.append((engine.create_adapter(cfg), engine.create_adapter(cfg)))
    for round_ in range(3):
        for i, (solo, many) in enumerate(pairs):
            data = make_examples(2, engine.vocab_size, seed=100 * round_ + i)
            for aid in (solo, many):
                engine.forward_backward(ForwardRequest(aid, data))
        solo_metrics = [engine.optim_step(solo, hp) for (solo, _), hp in zip(pairs, hps, strict=True)]
        many_metrics = engine.optim_step_many([(many, hp) for (_, many), hp in zip(pairs, hps, strict=True)])
        assert many_metrics == solo_metrics
        for solo, many in pairs:
            _assert_bitwise_equal(_state(engine, solo), _state(engine, many))
            assert engine.adapter_step(solo) == engine.adapter_step(many) == round_ + 1
    # refusals: each fails in its place, the others step
    (_, a), (_, b), (_, c), (_, d) = pairs
    for aid in (b, c):
        engine.forward_backward(ForwardRequest(aid, make_examples(2, engine.vocab_size, seed=7)))
    grads = engine.pending_gradients(b)
    assert grads is not None  # squares past fp32's range: b's moments would be inf
    engine.set_pending_gradients(b, {k: torch.full_like(g, 1e38) for k, g in grads.items()})
    before = {aid: _state(engine, aid) for aid in (a, b, c)}
    out = engine.optim_step_many(
        [
            (a, AdamParams(learning_rate=-1.0)),
            (b, AdamParams(learning_rate=1e-2)),
            ("ghost", AdamParams()),
            (c, AdamParams(learning_rate=1e-2)),
        ]
    )
    assert "learning_rate" in str(out[0]) and "NaN or inf" in str(out[1]) and "ghost" in str(out[2])
    assert isinstance(out[3], dict) and out[3]["learning_rate:mean"] == 1e-2
    _assert_bitwise_equal(_state(engine, a), before[a])
    _assert_bitwise_equal(_state(engine, b), before[b])
    # a scalar past fp32's range runs the batch one adapter at a time: refused alone, as optim_step
    out = engine.optim_step_many([(a, AdamParams(learning_rate=3e38)), (d, AdamParams(learning_rate=1e-3))])
    assert "not applied" in str(out[0]) and isinstance(out[1], dict)
    _assert_bitwise_equal(_state(engine, a), before[a])
    assert not torch.equal(
        _state(engine, c)["w.self_attn.q_proj.lora_B"], before[c]["w.self_attn.q_proj.lora_B"]
    )
    assert engine.adapter_step(d) == 4


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_every_trainable_adapter_is_one_buffer_and_owns_it(engine: Engine, tmp_path) -> None:
    """However an adapter is made (created, forked from an adapter or a snapshot, loaded from a
    checkpoint), its tensors are views of one buffer its optimizer steps in one pass (the
    optimizer's moments and gradients are flat in the same order); no two adapters or snapshots
    share a buffer, and the flattening changes no value: a flattened adapter trains bitwise as
    its per-tensor twin does (the step is elementwise)."""
    a = engine.create_adapter(LoRAConfig(rank=4, seed=0))
    _bump(engine, a, 1)
    snap = engine.snapshot(a).snapshot_id
    engine.save_state(a, tmp_path / "ck")
    made = {
        "created": a,
        "fork of an adapter": engine.fork_adapter(a),
        "fork of a snapshot": engine.fork_adapter(snap),
        "loaded": engine.load_state(tmp_path / "ck"),
    }
    buffers = set()
    for how, aid in made.items():
        w = engine.adapter_weights(aid)
        assert w.flat is not None, how
        assert {_storage(t) for t in w.tensors()} == {_storage(w.flat)}, how
        assert sum(t.numel() for t in w.tensors()) == w.flat.numel(), how
        assert all(t.is_leaf and t.requires_grad for t in w.tensors()), how
        _assert_bitwise_equal(w.state_dict(), engine.adapter_weights(a).state_dict())
        buffers.add(_storage(w.flat))
    snap_w = engine.adapter_weights(snap)
    assert snap_w.flat is not None and not any(t.requires_grad for t in snap_w.tensors())
    buffers.add(_storage(snap_w.flat))
    assert len(buffers) == len(made) + 1
    # the loaded adapter came with its optimizer: it steps as the one it was saved from
    data = make_examples(2, engine.vocab_size, seed=5)
    for aid in (a, made["loaded"]):
        engine.forward_backward(ForwardRequest(aid, data))
        engine.optim_step(aid, ADAM)
    _assert_bitwise_equal(_state(engine, a), _state(engine, made["loaded"]))
    # against torch's fused AdamW (the same kernel) tensor by tensor on unflattened copies
    ref = {
        k: v.detach().clone().requires_grad_(True) for k, v in engine.adapter_weights(a).state_dict().items()
    }
    engine.forward_backward(ForwardRequest(a, data))
    grads = _clone_grads(engine, a)
    ref_opt = torch.optim.AdamW(
        list(ref.values()), lr=ADAM.learning_rate, betas=(ADAM.beta1, ADAM.beta2), eps=ADAM.eps,
        weight_decay=ADAM.weight_decay, fused=True,
    )  # fmt: skip
    ref_opt.load_state_dict(copy.deepcopy(_adam_state_for(engine, a, ref_opt, ref)))
    for k, p in ref.items():
        p.grad = grads[k]
    ref_opt.step()
    engine.optim_step(a, ADAM)
    for k, p in ref.items():
        assert torch.equal(engine.adapter_weights(a).state_dict()[k], p.detach()), k


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda st: st.pop(next(k for k in st if k.endswith(".exp_avg_sq"))), "lacks the moments or step"),
        (
            lambda st: st.__setitem__(next(k for k in st if k.endswith(".exp_avg")), torch.zeros(3)),
            "has shape",
        ),
        (
            lambda st: st.__setitem__(next(k for k in st if k.endswith(".step")), torch.tensor([9.0])),
            "different step",
        ),
    ],
)
def test_an_optimizer_state_that_does_not_fit_is_refused_and_changes_nothing(
    engine: Engine, damage, message: str
) -> None:
    a = engine.create_adapter(LoRAConfig(rank=4, seed=0))
    _bump(engine, a, 1)
    _bump(engine, a, 2)
    state = {k: v.clone() for k, v in engine.optimizer_state(a).items()}
    damage(state)
    before = _state(engine, a)
    with pytest.raises(EngineError, match=message):
        engine._adapters[a].optimizer.load_state_tensors(state)
    _assert_bitwise_equal(_state(engine, a), before)
