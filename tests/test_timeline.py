"""Timeline merging (rl/timeline.py): the merge rule on hand-built calls, inconsistent claims
refused naming the call, merged datums = per-call datums in loss and gradient from fewer, shorter
sequences, and the multi-call planner_solver task end to end in the RL loop."""

from __future__ import annotations

import asyncio
import json
import random

import pytest
import torch
from tinker import types

import opentinker
from opentinker.client import Runtime
from opentinker.engine import Engine, ForwardRequest
from opentinker.lora import LoRAConfig
from opentinker.renderers import get_renderer
from opentinker.rl import (
    RLConfig,
    TimelineError,
    Trajectory,
    Transition,
    merge_timelines,
    rl_datums,
    rollout_group,
    run_rl,
)
from opentinker.rl.datums import build_datums, per_call_segments
from opentinker.rl.multiagent import move_token_advantages
from opentinker.rl.timeline import OBSERVATION, per_call_tokens, timeline_tokens
from opentinker.rl.types import EnvGroupBuilder
from opentinker.service.convert import datum_to_example
from opentinker.tasks.planner_solver import PlannerSolverEnv, build
from tests.conftest import TEST_MODEL
from tests.tolerances import assert_rel_close, assert_scalar_close


def call(ob: list[int], ac: list[int], extends: int | None = None) -> Transition:
    return Transition(ob, ac, [-0.5 - 0.1 * k for k in range(len(ac))], extends=extends)


def test_merge_rule_on_hand_built_calls() -> None:
    calls = [
        call([1, 2, 3], [4, 5]),
        call([1, 2, 3, 4, 5, 6], [7], extends=0),  # claims and extends call 0: appended
        call([1, 2, 9], [8]),  # rewritten (a summary): a new timeline sharing [1, 2]
        call([1, 2, 3, 4, 5, 6, 7, 10], [11]),  # no claim, extends timeline 0: found and appended
        call([1, 2, 3, 4, 5, 12], [13], extends=0),  # a branch off call 0 (already extended)
        call([1, 2, 9, 8, 14], [15]),  # extends call 2, not the latest call
    ]
    tls = merge_timelines(calls)
    assert [tl.calls for tl in tls] == [[0, 1, 3], [2, 5], [4]]
    assert tls[0].tokens_T == [1, 2, 3, 4, 5, 6, 7, 10, 11]
    assert tls[0].call_T == [OBSERVATION] * 3 + [0, 0, OBSERVATION, 1, OBSERVATION, 3]
    assert tls[0].logprobs_T == [0.0] * 3 + [-0.5, -0.6, 0.0, -0.5, 0.0, -0.5]
    # the branch keeps call 0's tokens as observation: nothing is trained twice
    assert tls[2].tokens_T == [1, 2, 3, 4, 5, 12, 13] and tls[2].is_action_T == [False] * 6 + [True]
    assert tls[1].tokens_T == [1, 2, 9, 8, 14, 15] and tls[1].call_T == [-1, -1, -1, 2, -1, 5]
    # every action token is trained exactly once, with its own sampler logprob
    per_call = [
        (c, lp) for i, t in enumerate(calls) for c, lp in zip([i] * len(t.ac_T), t.logprobs_T, strict=True)
    ]
    merged = sorted((c, lp) for tl in tls for c, lp in zip(tl.call_T, tl.logprobs_T, strict=True) if c >= 0)
    assert merged == sorted(per_call)
    assert timeline_tokens(tls) == 22 < per_call_tokens(calls) == 38


@pytest.mark.parametrize(
    ("ob", "extends", "message"),
    [
        ([1, 2, 3, 4, 6, 7], 0, "call 1 claims to extend call 0's context + output (5 tokens), but its context differs at token 4 (token 6, expected 5)"),
        ([1, 2, 3, 4], 0, "call 1 claims to extend call 0's context + output (5 tokens), but its context is only 4 tokens long"),
        ([1, 2, 3, 4, 5], 1, "call 1 claims to extend call 1, which is not an earlier call"),
        ([1, 2, 3, 4, 5], -1, "call 1 claims to extend call -1, which is not an earlier call"),
    ],
)  # fmt: skip
def test_a_false_claim_is_refused_naming_the_call(ob: list[int], extends: int, message: str) -> None:
    traj = Trajectory([call([1, 2, 3], [4, 5]), call(ob, [9], extends=extends)])
    with pytest.raises(TimelineError) as e:
        merge_timelines(traj.transitions)
    assert str(e.value) == message
    with pytest.raises(TimelineError, match="call 1 claims"):  # the datum path never merges it
        rl_datums(traj, 1.0)


def _scripted_episode(renderer, terms: tuple[int, ...], rng: random.Random) -> Trajectory:
    """One planner_solver episode with scripted replies (some right, some wrong) and made-up
    sampler logprobs: the token layout of a real episode, without a sampler."""

    async def run() -> Trajectory:
        env = PlannerSolverEnv(renderer, terms)
        ob = await env.initial_observation()
        traj, extends, running = Trajectory(), None, terms[0]
        for r in range(len(terms) - 1):
            running += terms[r + 1]
            for text in (
                f"add {terms[r + 1]} next",
                str(running + rng.choice([0, 1])),
                str(running + rng.choice([0, 0, 3])),
            ):
                ac = renderer.encode(text) + list(renderer._end_marker())
                res = await env.step(ac)
                lps = [-rng.uniform(0.1, 3.0) for _ in ac]
                traj.transitions.append(
                    Transition(ob, ac, lps, res.reward, res.done, dict(res.metrics), extends)
                )
                ob, extends = res.next_ob_T, res.extends
        return traj

    return asyncio.run(run())


@pytest.fixture(scope="module")
def runtime(tmp_path_factory: pytest.TempPathFactory):
    rt = Runtime(tmp_path_factory.mktemp("data"))
    yield rt
    rt.shutdown()


@pytest.fixture(scope="module")
def service(runtime: Runtime):
    return opentinker.ServiceClient(runtime=runtime)


@pytest.fixture(scope="module")
def renderer(service):
    return get_renderer("auto", service.create_sampling_client(base_model=TEST_MODEL).get_tokenizer())


def test_planner_solver_calls_form_one_timeline_per_round(renderer) -> None:
    traj = _scripted_episode(renderer, (12, 34, 56), random.Random(0))
    assert len(traj.transitions) == 6
    assert [t.extends for t in traj.transitions] == [None, 0, 1, None, 3, 4]
    tls = merge_timelines(traj.transitions)
    assert [tl.calls for tl in tls] == [[0, 1, 2], [3, 4, 5]]
    r0, r1 = traj.transitions[0].ob_T, traj.transitions[3].ob_T
    assert r1[: len(r0)] != r0  # the scratchpad was summarised: round 2 is no extension
    shared = next(i for i, (a, b) in enumerate(zip(r0, r1, strict=False)) if a != b)
    assert shared >= 8  # but the rounds share the system turn and the problem (shared-prefix pass)
    assert sum(t.reward for t in traj.transitions) == pytest.approx(
        traj.transitions[-1].metrics["rounds_right"]
    )


def test_merged_timelines_give_the_per_call_gradients(renderer, engine: Engine) -> None:
    """One fused importance_sampling pass over merged datums vs one over per-call datums, each call's
    action tokens carrying their own advantage and sampler logprobs. The per-token terms are the
    same (same tokens, positions, causal context); only the batch layout differs (row lengths,
    padding, the shared-prefix plan), which reorders fp32 reductions: tests/tolerances.py's REL
    (gradients, in norm) and SCALAR_REL (loss:sum) bound exactly that."""
    rng = random.Random(1)
    trajs = [
        _scripted_episode(renderer, (rng.randint(10, 99), rng.randint(10, 99), rng.randint(10, 99)), rng)
        for _ in range(4)
    ]
    aid = engine.create_adapter(LoRAConfig(rank=4, seed=3))
    for b in engine._adapters[aid].weights.b.values():  # B = 0 at init would hide a wrong context
        b.data.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(3))
    merged, per_call = [], []
    for traj in trajs:
        advs = [rng.uniform(-1.0, 1.0) for _ in traj.transitions]  # each call its own advantage
        merged += rl_datums(traj, 0.0, move_token_advantages(traj, advs))
        per_call_adv = [
            [advs[i] if a else 0.0 for a in act] for i, (_, _, act) in enumerate(per_call_segments(traj))
        ]
        per_call += rl_datums(traj, 0.0, per_call_adv, merge=False)
    assert len(merged) == 8 and len(per_call) == 24  # 2 timelines vs 6 calls per episode
    n_merged = sum(d.model_input.length for d in merged)
    n_per_call = sum(d.model_input.length for d in per_call)
    assert n_merged < 0.6 * n_per_call, (n_merged, n_per_call)
    assert max(d.model_input.length for d in merged) <= max(d.model_input.length for d in per_call) + 16

    # the same action tokens are trained, each with its own call's advantage and sampler logprob
    def action_terms(ds) -> list[tuple[int, float, float]]:
        return sorted(
            (tok, adv, lp)
            for d in ds
            for tok, adv, lp in zip(*(d.loss_fn_inputs[k].tolist() for k in ("target_tokens", "advantages", "logprobs")), strict=True)
            if lp != 0.0
        )  # fmt: skip

    assert action_terms(merged) == action_terms(per_call)

    out = {}
    for name, datums in (("merged", merged), ("per_call", per_call)):
        engine._adapters[aid].grads = None
        examples = [datum_to_example(d, i) for i, d in enumerate(datums)]
        (res,) = engine.forward_backward_many([ForwardRequest(aid, examples, "importance_sampling")])
        assert not isinstance(res, Exception), res
        grads = {k: v.clone() for k, v in (engine.pending_gradients(aid) or {}).items()}
        out[name] = (res.metrics["loss:sum"], grads)
    (loss_m, g_m), (loss_p, g_p) = out["merged"], out["per_call"]
    assert_scalar_close(loss_m, loss_p)
    assert g_p and g_m.keys() == g_p.keys()
    for k, g in g_p.items():
        assert_rel_close(g_m[k], g)


def test_planner_solver_rl_run_merges_its_calls(service, tmp_path) -> None:
    cfg = RLConfig(
        base_model=TEST_MODEL, log_dir=str(tmp_path / "run"), steps=2, groups_per_step=2, group_size=4,
        max_tokens=8, learning_rate=2e-3, eval_every=2, progress=False, drop_constant_groups=False,
        extra={"eval_problems": 4},
    )  # fmt: skip
    renderer = get_renderer("auto", service.create_sampling_client(base_model=TEST_MODEL).get_tokenizer())
    dataset, evaluator = build(renderer, cfg)
    res = asyncio.run(run_rl(cfg, service, dataset, evaluator))
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1] and len(res.metrics) == 2 and res.final_path
    for r in rows:
        assert r["env/errors"] == 0 and r["env/episodes"] == 8 and r["env/turns_mean"] == 6
        assert r["train/calls"] == 48 and r["train/datums"] == 16  # 6 calls -> 2 timelines per episode
        assert 0 <= r["reward/mean"] <= 1 and 0 <= r["env/rounds_right"] <= 1
    assert 0 <= rows[0]["eval/accuracy"] <= 1 and "eval/rounds_right" in rows[0]


def test_planner_solver_bad_settings() -> None:
    with pytest.raises(ValueError, match="terms must be at least 2"):
        build(None, RLConfig(base_model=TEST_MODEL, extra={"terms": 1}))  # type: ignore[arg-type]


class _FalseClaim(PlannerSolverEnv):
    """The solver call claims to extend the planner call, but the context lost a token of it."""

    async def step(self, action: list[int]):
        res = await super().step(action)
        if res.extends is not None:
            res.next_ob_T = res.next_ob_T[:5] + res.next_ob_T[6:]
        return res


class _FalseClaimGroup(EnvGroupBuilder):
    def __init__(self, renderer) -> None:
        self.renderer = renderer

    async def make_envs(self):
        return [_FalseClaim(self.renderer, (12, 34, 56)) for _ in range(2)]


def test_an_episode_with_a_false_claim_fails_at_its_datums(service, renderer) -> None:
    """Rolled out by a real sampler, an environment whose context contradicts its claim is never
    trained on: the step's datum building raises, naming the call."""
    policy = service.create_sampling_client(base_model=TEST_MODEL)
    params = types.SamplingParams(max_tokens=4, temperature=1.0)
    group = asyncio.run(rollout_group(_FalseClaimGroup(renderer), policy, params, seed=0))
    assert len(group.trajectories) == 2 and group.errors == 0
    cfg = RLConfig(base_model=TEST_MODEL, drop_constant_groups=False)
    with pytest.raises(
        TimelineError,
        match=r"^call 1 claims to extend call 0's context \+ output \(\d+ tokens\), but its context differs at token 5",
    ):
        asyncio.run(build_datums([group], cfg, None))
