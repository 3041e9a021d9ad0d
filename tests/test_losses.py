"""Each built-in loss against a value computed by hand (docs/DESIGN.md, "Data path")."""

from __future__ import annotations

import math

import pytest
import torch

from opentinker.engine.losses import LOSSES, resolve_config
from tests.tolerances import ELEMENTWISE_REL, assert_rel_close

LP = torch.tensor([-1.0, -2.0, -0.5])
Q = torch.tensor([-1.2, -1.5, -0.5])
ADV = torch.tensor([1.0, -2.0, 0.5])


def _loss(
    name: str, lp: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict[str, float] | None = None
) -> float:
    return float(LOSSES[name].fn(lp, inputs, resolve_config(name, config or {})).sum())


def test_cross_entropy_hand_value() -> None:
    w = torch.tensor([0.0, 1.0, 2.0])
    assert _loss("cross_entropy", LP, {"weights": w}) == pytest.approx(-(0 * -1 + 1 * -2 + 2 * -0.5))  # 3.0


def test_cross_entropy_soft_targets_hand_value() -> None:
    lp = torch.tensor([[-1.0, -3.0], [-0.1, -2.0]])
    w = torch.tensor([[0.75, 0.25], [1.0, 0.0]])
    assert _loss("cross_entropy", lp, {"weights": w}) == pytest.approx(0.75 + 0.75 + 0.1)


def test_importance_sampling_hand_value() -> None:
    r = [math.exp(0.2), math.exp(-0.5), 1.0]
    expected = -(r[0] * 1.0 + r[1] * -2.0 + r[2] * 0.5)
    assert _loss("importance_sampling", LP, {"logprobs": Q, "advantages": ADV}) == pytest.approx(
        expected, rel=ELEMENTWISE_REL
    )


def test_ppo_hand_value_and_config() -> None:
    r = [math.exp(0.2), math.exp(-0.5), 1.0]  # 1.2214, 0.6065, 1.0
    # token 0: A>0, r>hi -> min(r·A, 1.2·A) = 1.2;  token 1: A<0, r<lo -> min(-2r, -2·0.8) = -1.6
    expected = -(1.2 + min(r[1] * -2.0, 0.8 * -2.0) + 0.5)
    assert _loss("ppo", LP, {"logprobs": Q, "advantages": ADV}) == pytest.approx(
        expected, rel=ELEMENTWISE_REL
    )
    wide = -(r[0] + min(r[1] * -2.0, 0.5 * -2.0) + 0.5)
    cfg = {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0}
    assert _loss("ppo", LP, {"logprobs": Q, "advantages": ADV}, cfg) == pytest.approx(
        wide, rel=ELEMENTWISE_REL
    )


def test_cispo_hand_value_and_gradient_is_clipped_ratio_times_advantage() -> None:
    lp = LP.clone().requires_grad_(True)
    loss = LOSSES["cispo"].fn(lp, {"logprobs": Q, "advantages": ADV}, resolve_config("cispo", {})).sum()
    clipped = [1.2, 0.8, 1.0]
    assert float(loss) == pytest.approx(
        -(1.2 * -1.0 * 1.0 + 0.8 * -2.0 * -2.0 + 1.0 * -0.5 * 0.5), rel=ELEMENTWISE_REL
    )
    loss.backward()
    assert lp.grad is not None
    assert_rel_close(lp.grad, -torch.tensor(clipped) * ADV, ELEMENTWISE_REL)


def test_dro_hand_value() -> None:
    beta = 0.1
    d = [0.2, -0.5, 0.0]
    expected = -sum(
        lp * a - 0.5 * beta * dd**2 for lp, a, dd in zip([-1.0, -2.0, -0.5], [1.0, -2.0, 0.5], d, strict=True)
    )
    assert _loss("dro", LP, {"logprobs": Q, "advantages": ADV}, {"beta": beta}) == pytest.approx(
        expected, rel=ELEMENTWISE_REL
    )


def test_gspo_hand_value_and_token_gradients() -> None:
    mask = torch.tensor([1.0, 1.0, 0.0])
    s = math.exp((0.2 - 0.5) / 2)  # mean log-ratio over the two masked tokens -> 0.8607
    # every token carries ratio s; clip to [0.8, 1.2] leaves it; min(sA, clip(s)A) = sA
    expected = -(s * 1.0 + s * -2.0 + s * 0.5)
    lp = LP.clone().requires_grad_(True)
    inputs = {"logprobs": Q, "advantages": ADV, "sequence_ratio_mask": mask}
    loss = LOSSES["gspo"].fn(lp, inputs, resolve_config("gspo", {})).sum()
    assert float(loss) == pytest.approx(expected, rel=ELEMENTWISE_REL)
    loss.backward()
    assert lp.grad is not None
    assert_rel_close(lp.grad, -s * ADV, ELEMENTWISE_REL)  # d(s·exp(lp - sg lp))/dlp = s, per token


def test_every_tinker_loss_is_registered() -> None:
    assert set(LOSSES) == {
        "cross_entropy",
        "importance_sampling",
        "ppo",
        "cispo",
        "dro",
        "gspo",
        "stable_reinforce",
    }


def test_stable_reinforce_hand_value_and_gradient() -> None:
    """Two sequences in one datum (positions 1-2 from sequence 0, 3-4 from sequence 1), a prompt
    position 0; the weights, by hand: w_0 = exp(mean(0.2, -0.4)) = exp(-0.1), under the cap;
    w_1 = exp(mean(1.0, 1.4)) = exp(1.2) = 3.32, truncated to c = 2."""
    lp = torch.tensor([-3.0, -1.0, -2.0, -0.5, -0.1], requires_grad=True)
    inputs = {
        "stability_logprobs": torch.tensor([0.0, -1.2, -1.6, -1.5, -1.5]),
        "stability_mask": torch.tensor([0.0, 1.0, 1.0, 1.0, 1.0]),
        "stability_sequence": torch.tensor([-1.0, 0.0, 0.0, 1.0, 1.0]),
        "advantages": torch.tensor([5.0, 1.0, 1.0, -2.0, -2.0]),  # position 0's is masked out
    }
    w0, w1 = math.exp(-0.1), 2.0
    expected = -(w0 * 1 * -1.0 + w0 * 1 * -2.0 + w1 * -2 * -0.5 + w1 * -2 * -0.1)
    loss = LOSSES["stable_reinforce"].fn(lp, inputs, resolve_config("stable_reinforce", {}))
    assert float(loss.sum()) == pytest.approx(expected, rel=ELEMENTWISE_REL)
    loss.sum().backward()
    assert lp.grad is not None  # the weight is a stop-gradient: d/dlp_t = -w_s · A_t
    assert_rel_close(lp.grad, torch.tensor([0.0, -w0, -w0, 2 * w1, 2 * w1]), ELEMENTWISE_REL)
    # another cap: both sequences under it
    capped = LOSSES["stable_reinforce"].fn(
        lp, inputs, resolve_config("stable_reinforce", {"max_importance_weight": 5.0})
    )
    w1 = math.exp(1.2)
    expected = -(w0 * -1.0 + w0 * -2.0 + w1 * -2 * -0.5 + w1 * -2 * -0.1)
    assert float(capped.sum()) == pytest.approx(expected, rel=ELEMENTWISE_REL)
