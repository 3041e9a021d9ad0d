"""Invariant 9: bad input gets an error naming the problem, and no adapter or optimizer state changes."""

from __future__ import annotations

import math

import pytest
import torch

from opentinker.engine import AdamParams, Engine, EngineError, Example, ForwardRequest, UnknownPolicyError
from opentinker.lora import LoRAConfig
from tests.conftest import make_examples
from tests.tolerances import assert_scalar_close, assert_state_close


@pytest.fixture
def trained(engine: Engine) -> tuple[Engine, str, dict[str, torch.Tensor]]:
    aid = engine.create_adapter(LoRAConfig(rank=4, seed=0))
    engine.forward_backward(ForwardRequest(aid, make_examples(2, engine.vocab_size, seed=1)))
    engine.optim_step(aid, AdamParams(learning_rate=1e-2))
    engine.forward_backward(ForwardRequest(aid, make_examples(2, engine.vocab_size, seed=2)))  # pending grads
    return engine, aid, _snapshot_state(engine, aid)


def _snapshot_state(engine: Engine, aid: str) -> dict[str, torch.Tensor]:
    st = {f"w.{k}": v.detach().clone() for k, v in engine.adapter_weights(aid).state_dict().items()}
    st.update({f"o.{k}": v.clone() for k, v in engine.optimizer_state(aid).items()})
    st.update({f"g.{k}": v.clone() for k, v in (engine.pending_gradients(aid) or {}).items()})
    return st


def _unchanged(engine: Engine, aid: str, before: dict[str, torch.Tensor]) -> None:
    after = _snapshot_state(engine, aid)
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)


def _example(tokens: list[int], **inputs: list[float] | list[int] | torch.Tensor) -> Example:
    tensors = {k: (v if isinstance(v, torch.Tensor) else torch.tensor(v)) for k, v in inputs.items()}
    return Example(torch.tensor(tokens, dtype=torch.long), tensors)


def _bad_requests(aid: str, vocab: int) -> list[tuple[ForwardRequest, str]]:
    good = dict(target_tokens=[5, 6, 7], weights=[1.0, 1.0, 1.0])
    rl = dict(target_tokens=[5, 6, 7], logprobs=[-1.0, -1.0, -1.0], advantages=[1.0, 1.0, 1.0])
    return [
        (ForwardRequest(aid, [_example([4, 5, vocab], **good)]), "outside the vocabulary"),
        (ForwardRequest(aid, [_example([4, 5, -1], **good)]), "outside the vocabulary"),
        (
            ForwardRequest(aid, [_example([4, 5, 6], target_tokens=[5, 6, vocab + 3], weights=[1.0] * 3)]),
            "outside the vocabulary",
        ),
        (ForwardRequest(aid, [_example([4, 5, 6, 7], **good)]), "has shape"),
        (
            ForwardRequest(aid, [_example([4, 5, 6], target_tokens=[5, 6, 7], weights=[1.0, 1.0])]),
            "has shape",
        ),
        (
            ForwardRequest(aid, [_example([4, 5, 6], target_tokens=[5, 6, 7], weights=[1.0, math.nan, 1.0])]),
            "NaN or inf",
        ),
        (
            ForwardRequest(aid, [_example([4, 5, 6], **{**rl, "advantages": [1.0, math.inf, 0.0]})], "ppo"),
            "NaN or inf",
        ),
        (
            ForwardRequest(
                aid, [_example([4, 5, 6], **{**rl, "logprobs": [math.nan, 0.0, 0.0]})], "importance_sampling"
            ),
            "NaN or inf",
        ),
        (ForwardRequest(aid, [_example([4, 5, 6], **good)], "nonsense_loss"), "unknown loss_fn"),
        (
            ForwardRequest(aid, [_example([4, 5, 6], **rl)], "ppo", {"clip_lo": 0.5}),
            "unknown loss_fn_config key",
        ),
        (
            ForwardRequest(aid, [_example([4, 5, 6], **good)], "cross_entropy", {"beta": 1.0}),
            "unknown loss_fn_config key",
        ),
        (
            ForwardRequest(aid, [_example([4, 5, 6], **good, advantages=[1.0, 1.0, 1.0])]),
            "unknown loss_fn_inputs key",
        ),
        (ForwardRequest(aid, [_example([4, 5, 6], target_tokens=[5, 6, 7])], "ppo"), "missing 'logprobs'"),
        (ForwardRequest(aid, [_example([], target_tokens=torch.zeros(0, dtype=torch.long))]), "empty"),
        (ForwardRequest(aid, []), "no data"),
        (ForwardRequest("no-such-adapter", [_example([4, 5, 6], **good)]), "unknown adapter"),
        (ForwardRequest(None, [_example([4, 5, 6], **good)]), "cannot train the base model"),
    ]


def test_each_bad_request_is_refused_by_name_and_changes_nothing(trained) -> None:
    engine, aid, before = trained
    for req, message in _bad_requests(aid, engine.vocab_size):
        with pytest.raises(EngineError, match=message):
            engine.forward_backward(req)
        _unchanged(engine, aid, before)


def test_bad_request_in_a_fused_batch_fails_alone(trained) -> None:
    engine, aid, _ = trained
    other = engine.create_adapter(LoRAConfig(rank=4, seed=3))
    good = ForwardRequest(other, make_examples(2, engine.vocab_size, seed=4))
    bad = _bad_requests(aid, engine.vocab_size)[0][0]
    res_bad, res_good = engine.forward_backward_many([bad, good])
    assert isinstance(res_bad, EngineError) and not isinstance(res_good, Exception)
    alone = engine.create_adapter(LoRAConfig(rank=4, seed=3))
    ref = engine.forward_backward(ForwardRequest(alone, good.examples))
    assert_scalar_close(res_good.metrics["loss:sum"], ref.metrics["loss:sum"])


def test_oversize_request_is_refused(tiny_base) -> None:
    engine = Engine(tiny_base, max_batch_tokens=40)
    aid = engine.create_adapter(LoRAConfig(rank=2))
    with pytest.raises(EngineError, match="over the limit"):
        engine.forward_backward(
            ForwardRequest(aid, make_examples(5, engine.vocab_size, seed=0, min_len=10, max_len=11))
        )
    long = engine.max_context + 1
    with pytest.raises(EngineError, match="context length"):
        engine.forward_backward(
            ForwardRequest(
                aid,
                [
                    Example(
                        torch.ones(long, dtype=torch.long),
                        {"target_tokens": torch.ones(long, dtype=torch.long)},
                    )
                ],
            )
        )


def test_loss_overflow_is_refused_without_update(trained) -> None:
    engine, aid, before = trained
    # finite inputs whose importance ratio overflows: exp(lp - q) with q = -1e30 -> inf
    ex = _example([4, 5, 6], target_tokens=[5, 6, 7], logprobs=[-1e30] * 3, advantages=[1.0] * 3)
    with pytest.raises(EngineError, match="NaN or inf"):
        engine.forward_backward(ForwardRequest(aid, [ex], "importance_sampling"))
    _unchanged(engine, aid, before)


def test_a_non_finite_gradient_of_a_finite_loss_fails_alone_in_a_fused_batch(trained) -> None:
    engine, aid, before = trained
    other = engine.create_adapter(LoRAConfig(rank=4, seed=3))
    good = ForwardRequest(other, make_examples(2, engine.vocab_size, seed=4))

    class SqrtAtZero:  # the engine's side of a custom loss: its inputs, its datum check, its call
        input_names: tuple[str, ...] = ()

        def check_datum(self, where: str, shape: tuple[int, ...], inputs: dict) -> None:
            pass

        def __call__(self, lp: torch.Tensor, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
            return torch.sqrt(lp - lp.detach()).sum(), {}  # the loss is 0, its gradient 1 / 0

    examples = make_examples(1, engine.vocab_size, seed=5)
    bad = ForwardRequest(aid, examples, "custom", custom_loss=SqrtAtZero())  # type: ignore[arg-type]
    res_bad, res_good = engine.forward_backward_many([bad, good])
    assert isinstance(res_bad, EngineError) and "gradient is NaN or inf" in str(res_bad)
    _unchanged(engine, aid, before)
    alone = engine.create_adapter(LoRAConfig(rank=4, seed=3))
    engine.forward_backward(ForwardRequest(alone, good.examples))
    ours, ref = engine.pending_gradients(other), engine.pending_gradients(alone)
    assert ours is not None and ref is not None
    assert_state_close(ours, ref)  # its gradients as if it had run alone


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(rank=0), "rank"),
        (dict(rank=-3), "rank"),
        (dict(rank=65), "rank"),
        (dict(rank=4, alpha=0.0), "alpha"),
        (dict(rank=4, train_attn=False, train_mlp=False, train_unembed=False), "at least one"),
    ],
)
def test_bad_adapter_config(engine: Engine, kwargs, message: str) -> None:
    with pytest.raises(EngineError, match=message):
        engine.create_adapter(LoRAConfig(**kwargs))
    assert engine.adapter_ids() == []


@pytest.mark.parametrize(
    "params, message",
    [
        (AdamParams(learning_rate=-1e-3), "learning_rate"),
        (AdamParams(learning_rate=math.nan), "learning_rate"),
        (AdamParams(beta1=1.0), "beta1"),
        (AdamParams(eps=-1.0), "eps"),
        (AdamParams(grad_clip_norm=-1.0), "grad_clip_norm"),
    ],
)
def test_bad_adam_params_change_nothing(trained, params: AdamParams, message: str) -> None:
    engine, aid, before = trained
    with pytest.raises(EngineError, match=message):
        engine.optim_step(aid, params)
    _unchanged(engine, aid, before)


def test_unknown_adapter_and_snapshot(engine: Engine) -> None:
    with pytest.raises(UnknownPolicyError, match="unknown adapter"):
        engine.optim_step("ghost", AdamParams())
    with pytest.raises(UnknownPolicyError):
        engine.delete_adapter("ghost")
    with pytest.raises(UnknownPolicyError, match="snapshot"):
        engine.release_snapshot("ghost@v1")
    aid = engine.create_adapter(LoRAConfig(rank=2))
    with pytest.raises(EngineError, match="taken"):
        engine.create_adapter(LoRAConfig(rank=2), aid)
