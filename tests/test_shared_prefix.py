"""Shared-prefix training (engine/prefix.py) equals the one-pass forward: same logprobs, losses and
gradients for every adapter, on batches shaped like RL groups (many completions of few prompts)."""

from __future__ import annotations

import pytest
import torch

from opentinker.engine import Engine, Example, ForwardRequest
from opentinker.engine.prefix import plan_shared_prefixes
from opentinker.lora import LoRAConfig
from opentinker.models import load_base_model
from tests.conftest import other_family_model
from tests.tolerances import assert_rel_close, assert_scalar_close


def grouped_examples(
    vocab: int,
    *,
    seed: int,
    prompts: int = 3,
    group: int = 4,
    soft: bool = False,
    reply: tuple[int, int] = (1, 8),
) -> list[Example]:
    """``group`` completions (``reply[0]``-``reply[1]`` tokens) of each of ``prompts`` prompts of
    different lengths that share their first 10 tokens (like a chat template's system turn)."""
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(3, vocab, (10,), generator=g).tolist()
    out = []
    for p in range(prompts):
        prompt = head + torch.randint(3, vocab, (12 + 5 * p,), generator=g).tolist()
        for _ in range(group):
            comp = torch.randint(
                3, vocab, (int(torch.randint(reply[0], reply[1] + 1, (1,), generator=g)),), generator=g
            ).tolist()
            seq = prompt + comp
            n = len(seq) - 1
            act = torch.tensor([0.0] * (len(prompt) - 1) + [1.0] * len(comp))
            if soft:
                tgt = torch.stack([torch.tensor(seq[1:]), torch.randint(3, vocab, (n,), generator=g)], dim=1)
                inputs = {"target_tokens": tgt, "weights": torch.stack([act * 0.7, act * 0.3], dim=1)}
            else:
                inputs = {
                    "target_tokens": torch.tensor(seq[1:]),
                    "advantages": act * torch.randn(n, generator=g),
                    "logprobs": -torch.rand(n, generator=g) - 1,
                }
            out.append(Example(torch.tensor(seq[:-1]), inputs))
    return out


def run_both(engine: Engine, reqs: list[ForwardRequest], adapters: list[str]):
    out = {}
    for share in (False, True):
        engine.share_prefixes = share
        for aid in adapters:
            engine._adapters[aid].grads = None
        res = engine.forward_backward_many(reqs)
        grads = {
            aid: {k: v.clone() for k, v in (engine.pending_gradients(aid) or {}).items()} for aid in adapters
        }
        out[share] = (res, grads)
    return out


def perturbed_adapter(engine: Engine, rank: int, seed: int) -> str:
    aid = engine.create_adapter(LoRAConfig(rank=rank, seed=seed))
    g = torch.Generator().manual_seed(seed)
    for b in engine._adapters[aid].weights.b.values():
        b.data.copy_(torch.randn(b.shape, generator=g) * 0.05)  # B = 0 at init would hide routing bugs
    return aid


def check_equal(out) -> None:
    (dense, g_dense), (shared, g_shared) = out[False], out[True]
    for d, s in zip(dense, shared, strict=True):
        assert_scalar_close(s.metrics["loss:sum"], d.metrics["loss:sum"])
        for od, os_ in zip(d.outputs, s.outputs, strict=True):
            assert_rel_close(os_["logprobs"], od["logprobs"])
            assert_rel_close(os_["elementwise_loss"], od["elementwise_loss"])
    for aid, grads in g_dense.items():
        assert grads, "no gradient"
        for name, g in grads.items():
            assert_rel_close(g_shared[aid][name], g)


def test_plan_groups_completions_of_one_prompt_and_never_mixes_policies() -> None:
    head = list(range(10, 40))
    rows = [[*head, 1, 2, 3], [*head, 1, 2, 4, 5], [*head, 7], list(range(100, 140))]
    plan = plan_shared_prefixes(rows, ["a", "a", "b", "a"])
    assert plan is not None
    by_rows = {tuple(sorted(g.rows)): g.shared for g in plan}
    assert by_rows[(0, 1)] == 32  # common prefix 32 (= 30 + [1, 2]), both keep a suffix token
    assert (2,) in by_rows  # another policy: alone
    assert all(g.shared < min(len(rows[r]) for r in g.rows) for g in plan)
    assert (
        plan_shared_prefixes([list(range(i, i + 20)) for i in range(4)], ["a"] * 4) is None
    )  # nothing shared


def test_shared_prefix_equals_one_pass_mixed_adapters_and_losses(engine: Engine) -> None:
    vocab = engine.vocab_size
    a1, a2 = perturbed_adapter(engine, 8, 1), perturbed_adapter(engine, 4, 2)
    ex1, ex2 = grouped_examples(vocab, seed=0), grouped_examples(vocab, seed=1)
    ex3 = grouped_examples(vocab, seed=2, soft=True)
    sft = [
        Example(
            e.tokens_T,
            {"target_tokens": e.inputs["target_tokens"], "weights": (e.inputs["advantages"] != 0).float()},
        )
        for e in ex1[:3]
    ]
    reqs = [
        ForwardRequest(a1, ex1, "importance_sampling"),
        ForwardRequest(a2, ex2, "ppo"),
        ForwardRequest(a1, ex3, "cross_entropy"),
        ForwardRequest(a2, sft, "cross_entropy", backward=False),  # forward-only rides along
    ]
    assert plan_shared_prefixes(
        [e.tokens_T.tolist() for r in reqs for e in r.examples], [r.policy for r in reqs for _ in r.examples]
    )
    check_equal(run_both(engine, reqs, [a1, a2]))


@pytest.mark.parametrize("family", ["qwen2", "gpt2"])
def test_shared_prefix_other_families(tmp_path, family: str, device: torch.device) -> None:
    engine = Engine(load_base_model(other_family_model(tmp_path, family), device=device))
    vocab = engine.vocab_size
    aid = perturbed_adapter(engine, 4, 3)
    check_equal(
        run_both(engine, [ForwardRequest(aid, grouped_examples(vocab, seed=5), "importance_sampling")], [aid])
    )
