"""``kind="inflight"`` sampling: requests that follow a training model's newest saved weights
switch to them mid-decode, keeping their keys and values (``StepDecoder.switch`` states the rule).

On the rollout core, step by step: a following request's tokens before the switch have the old
weights' teacher-forced logprobs; from the step after the switch on, the logprobs of a forward
that reads the old weights' keys and values for the prompt and the earlier tokens and runs the
new weights from the last token fed (the cache is kept, not recomputed: they differ from the new
weights' own teacher-forced logprobs). A pinned request in the same batch equals the old weights'
throughout; a following request still waiting for admission prefills on the new weights.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from opentinker.engine import AdamParams, Engine, ForwardRequest
from opentinker.lora import LoRAConfig
from opentinker.sampling import NativeBackend, SampleRequest, SampleResult, SamplingParams
from opentinker.sampling.rollout import Done, Follow, RolloutCore, Sample
from tests.conftest import make_examples
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
    core = RolloutCore(backend.decoder(snapshots_only=True), backend)
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
    core.handle(Follow(aid, new))
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
    core = RolloutCore(backend.decoder(snapshots_only=True), backend)
    prompt = _prompt(engine, 7, 3)
    core.handle(Sample(1, SampleRequest(old, prompt, PARAMS, follow=aid)))
    done = core.tick()
    assert core.handle(Follow(aid, f"{aid}@gone")) == []
    assert core.handle(Follow(aid, aid)) == []  # a live adapter is never sampled mid-training
    while core.busy:
        done += core.tick()
    [seq] = _result(done, 1).sequences
    assert_logprobs_close(seq.logprobs, _teacher_forced(engine, old, prompt, seq.tokens))
