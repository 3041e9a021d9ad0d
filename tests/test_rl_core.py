"""The RL library on the tiny model: trajectory -> Datum masks, advantage math, failing
environments (each fails alone, counted), sync/async, KL shaping, resume, several runs at once."""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from tinker import types

from opentinker.client import ServiceClient
from opentinker.renderers import ChatMLRenderer, Renderer
from opentinker.rl import (
    Env,
    EnvGroupBuilder,
    RLConfig,
    RLDataset,
    StepResult,
    Trajectory,
    Transition,
    group_advantages,
    is_constant,
    learning_rate_at,
    rl_datums,
    rollout_group,
    run_rl,
    run_rl_many,
    trajectory_segments,
)
from opentinker.service.runtime import Runtime
from opentinker.tasks import get_task
from opentinker.tracking import read_metrics
from tests.conftest import TEST_MODEL, SlowSampler
from tests.tolerances import LOGPROB_ATOL, assert_logprobs_close, assert_rel_close, assert_scalar_close

# ------------------------------------------------------------------------------ trajectory -> Datum


def _fields(d: types.Datum) -> dict[str, list[float]]:
    return {k: v.tolist() for k, v in d.loss_fn_inputs.items()}


def test_single_turn_datum_masks_and_shift() -> None:
    ob, ac, lps = [10, 11, 12], [20, 21], [-0.5, -1.25]
    traj = Trajectory([Transition(ob, ac, lps, reward=1.0, done=True)])
    (d,) = rl_datums(traj, advantage=0.75)
    tokens = ob + ac
    f = _fields(d)
    # input is tokens[:-1]; position i predicts target tokens[i + 1]
    assert d.model_input.to_ints() == tokens[:-1]
    assert f["target_tokens"] == tokens[1:]
    # per-token fields are aligned with the targets: the context's targets carry 0
    assert f["advantages"] == [0.0, 0.0, 0.75, 0.75]
    assert f["logprobs"] == pytest.approx([0.0, 0.0, -0.5, -1.25])


def test_multi_turn_is_one_datum_with_observations_masked() -> None:
    t1 = Transition([1, 2, 3], [4, 5], [-0.1, -0.2])
    t2 = Transition([1, 2, 3, 4, 5, 6, 7], [8], [-0.3], reward=1.0, done=True)  # 6, 7: env reply
    traj = Trajectory([t1, t2])
    ((tokens, lps, act),) = trajectory_segments(traj)
    assert tokens == [1, 2, 3, 4, 5, 6, 7, 8]
    assert act == [False, False, False, True, True, False, False, True]
    (d,) = rl_datums(traj, advantage=-2.0)
    f = _fields(d)
    assert d.model_input.to_ints() == tokens[:-1] and f["target_tokens"] == tokens[1:]
    assert f["advantages"] == [0.0, 0.0, -2.0, -2.0, 0.0, 0.0, -2.0]
    assert f["logprobs"] == pytest.approx([0.0, 0.0, -0.1, -0.2, 0.0, 0.0, -0.3])


def test_rewritten_context_starts_a_new_datum() -> None:
    t1 = Transition([1, 2], [3], [-0.1])
    t2 = Transition([9, 9, 9], [4, 5], [-0.2, -0.3], done=True)  # does not extend [1, 2, 3]
    datums = rl_datums(Trajectory([t1, t2]), advantage=1.0)
    assert [d.model_input.to_ints() for d in datums] == [[1, 2], [9, 9, 9, 4]]
    assert [_fields(d)["advantages"] for d in datums] == [[0.0, 1.0], [0.0, 0.0, 1.0, 1.0]]


def test_token_shaping_is_added_on_actions_only() -> None:
    traj = Trajectory([Transition([1, 2], [3, 4], [-0.1, -0.2], done=True)])
    (d,) = rl_datums(traj, 1.0, token_advantages=[[9.0, 9.0, -0.5, 0.25]])
    assert _fields(d)["advantages"] == [0.0, 0.5, 1.25]


def test_bad_values_refused() -> None:
    with pytest.raises(ValueError, match="logprobs"):
        Transition([1], [2, 3], [-0.1])
    traj = Trajectory([Transition([1, 2], [3], [float("nan")], done=True)])
    with pytest.raises(ValueError, match="finite"):
        rl_datums(traj, 1.0)


# ------------------------------------------------------------------------------ advantages


def test_group_advantages_mean_centred() -> None:
    adv = group_advantages([1.0, 0.0, 0.0, 1.0, 1.0])
    assert adv == pytest.approx([0.4, -0.6, -0.6, 0.4, 0.4])
    assert sum(adv) == pytest.approx(0.0, abs=1e-12)
    assert group_advantages([]) == []


def test_group_advantages_std_normalised() -> None:
    rewards = [3.0, 1.0, 2.0, 6.0]
    adv = group_advantages(rewards, normalize_std=True)
    t = torch.tensor(rewards, dtype=torch.float64)
    want = (t - t.mean()) / (t.std(unbiased=False) + 1e-6)
    assert adv == pytest.approx(want.tolist())
    assert math.sqrt(sum(a * a for a in adv) / len(adv)) == pytest.approx(1.0, rel=1e-5)
    # a constant group stays 0 (eps guards the division)
    assert group_advantages([2.0, 2.0], normalize_std=True) == [0.0, 0.0]
    with pytest.raises(ValueError, match="finite"):
        group_advantages([1.0, float("nan")])


def test_constant_groups_detected() -> None:
    assert is_constant([1.0, 1.0, 1.0]) and is_constant([0.5]) and is_constant([])
    assert not is_constant([1.0, 1.0, 0.0])


# ------------------------------------------------------------------------------ environments on the tiny model


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> ServiceClient:
    return ServiceClient(runtime=Runtime(tmp_path_factory.mktemp("rl-data"), max_rank=16))


@pytest.fixture(scope="module")
def renderer(service: ServiceClient) -> ChatMLRenderer:
    return ChatMLRenderer(service.runtime.base_stack(TEST_MODEL).engine.base.tokenizer)


def _cfg(tmp_path: Path, name: str = "run", **kw: Any) -> RLConfig:
    base: dict[str, Any] = dict(
        base_model=TEST_MODEL, log_dir=str(tmp_path / name), steps=2, groups_per_step=1, group_size=4,
        lora_rank=4, learning_rate=1e-3, max_tokens=8, progress=False, episode_timeout_s=5.0,
    )  # fmt: skip
    base.update(kw)
    return RLConfig(**base)


class ScriptedEnv(Env):
    """One turn on an open prompt; the reward is a hash of the sampled tokens in [0, 1] (so a
    group's rewards almost never tie). ``fail`` picks a way to break."""

    def __init__(self, renderer: Renderer, question: str = "Tell me a story.", fail: str = "") -> None:
        self.renderer, self.question, self.fail = renderer, question, fail
        self.stop = renderer.stop

    async def initial_observation(self) -> list[int]:
        if self.fail == "reset":
            raise RuntimeError("boom at reset")
        if self.fail == "too_long":
            return [5] * 1100  # longer than the tiny model's 1024-token context
        return self.renderer.build_generation_prompt([{"role": "user", "content": self.question}])

    async def step(self, action: list[int]) -> StepResult:
        if self.fail == "step":
            raise RuntimeError("boom at step")
        if self.fail == "timeout":
            await asyncio.sleep(30)
        if self.fail == "nan":
            return StepResult(float("nan"), True)
        if self.fail == "grow":  # a multi-turn env whose context outgrows the model
            return StepResult(0.0, False, next_ob_T=[5] * 1100)
        return StepResult(sum(action) % 101 / 100, True, metrics={"first": float(action[0])})


class Group(EnvGroupBuilder):
    def __init__(self, renderer: Renderer, fails: list[str], question: str = "Tell me a story.") -> None:
        self.renderer, self.fails, self.question = renderer, fails, question

    async def make_envs(self) -> Sequence[Env]:
        if "make_envs" in self.fails:
            raise RuntimeError("boom in make_envs")
        # a failing env asks another question, so the healthy envs share one sample request
        return [
            ScriptedEnv(self.renderer, self.question if not f else f"{self.question} ({f})", f)
            for f in self.fails
        ]


class Dataset(RLDataset):
    def __init__(self, groups: list[list[str]], renderer: Renderer) -> None:
        self.groups, self.renderer = groups, renderer

    def batch(self, step: int) -> list[EnvGroupBuilder]:
        return [
            Group(self.renderer, fails, f"Tell me a story about {step} and {k}.")
            for k, fails in enumerate(self.groups)
        ]


def _weights(service: ServiceClient, tc: Any) -> list[torch.Tensor]:
    eng = service.runtime.base_stack(TEST_MODEL).engine
    return [t.detach().clone() for t in eng.adapter_weights(tc.model_id).tensors()]


def test_rollout_datums_carry_the_samplers_logprobs(service: ServiceClient, renderer: Renderer) -> None:
    tc = service.create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=0)
    params = types.SamplingParams(max_tokens=6, temperature=1.0)
    # one update first, so that the adapter is not the identity (B = 0 at creation)
    g0 = asyncio.run(
        rollout_group(Group(renderer, [""] * 4), tc.save_weights_and_get_sampling_client(), params, seed=0)
    )
    warm = [
        d
        for t, a in zip(g0.trajectories, group_advantages(g0.rewards_G), strict=True)
        for d in rl_datums(t, a)
    ]
    tc.forward_backward(warm, "importance_sampling")
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    eng = service.runtime.base_stack(TEST_MODEL).engine
    assert any(float(b.detach().abs().max()) > 0 for b in eng.adapter_weights(tc.model_id).b.values())
    policy = tc.save_weights_and_get_sampling_client()
    g = asyncio.run(rollout_group(Group(renderer, [""] * 3), policy, params, seed=1))
    assert g.errors == 0 and len(g.trajectories) == 3
    for traj, adv in zip(g.trajectories, group_advantages(g.rewards_G), strict=True):
        (tr,) = traj.transitions
        (d,) = rl_datums(traj, adv)
        f = _fields(d)
        n_ob = len(tr.ob_T)
        assert f["target_tokens"][n_ob - 1 :] == tr.ac_T
        assert f["logprobs"][n_ob - 1 :] == pytest.approx(tr.logprobs_T, abs=1e-6)
        assert f["advantages"] == pytest.approx([0.0] * (n_ob - 1) + [adv] * len(tr.ac_T))
        # and the sampler's logprobs are the trainer's (importance ratio 1 on fresh data)
        fwd = tc.forward([d], "importance_sampling").result().loss_fn_outputs[0]["logprobs"].tolist()
        assert_logprobs_close(fwd[n_ob - 1 :], tr.logprobs_T)


def test_update_moves_towards_rewarded_replies(service: ServiceClient, renderer: Renderer) -> None:
    """The sign of the whole path: after updates on one group, the advantage-weighted sum of the
    replies' logprobs (the objective) has risen, and the reply with the highest advantage gained
    on the one with the lowest (each alone may move either way: the replies share tokens and
    parameters)."""
    tc = service.create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=1)
    params = types.SamplingParams(max_tokens=6, temperature=1.0)
    g = asyncio.run(
        rollout_group(Group(renderer, [""] * 6), tc.save_weights_and_get_sampling_client(), params, seed=2)
    )
    advs = group_advantages(g.rewards_G)
    assert len(advs) == 6 and not is_constant(g.rewards_G)
    datums = [d for t, a in zip(g.trajectories, advs, strict=True) for d in rl_datums(t, a)]

    def seq_logprobs() -> list[float]:
        outs = tc.forward(datums, "importance_sampling").result().loss_fn_outputs
        return [
            sum(
                lp
                for lp, a in zip(o["logprobs"].tolist(), d.loss_fn_inputs["advantages"].tolist(), strict=True)
                if a
            )
            for o, d in zip(outs, datums, strict=True)
        ]

    before = seq_logprobs()
    for _ in range(3):
        tc.forward_backward(datums, "importance_sampling")
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    after = seq_logprobs()
    best, worst = advs.index(max(advs)), advs.index(min(advs))
    gain = [a - b for a, b in zip(after, before, strict=True)]
    assert sum(a * d for a, d in zip(advs, gain, strict=True)) > 0
    assert gain[best] > gain[worst]


def test_failing_episodes_fail_alone(service: ServiceClient, renderer: Renderer, tmp_path: Path) -> None:
    """Raising at reset or step, a timeout, a NaN reward, a context longer than the model's: each
    loses only its own episode, is counted in ``env/errors``, and the run trains on the rest."""
    groups = [
        ["", "", "", "reset"],
        ["", "", "", "step"],
        ["", "", "", "timeout"],
        ["", "", "", "nan"],
        ["", "", "", "too_long"],
        ["", "", "", "grow"],
    ]
    cfg = _cfg(tmp_path, groups_per_step=len(groups), episode_timeout_s=0.5, drop_constant_groups=False)
    res = asyncio.run(run_rl(cfg, service, Dataset(groups, renderer)))
    assert len(res.metrics) == 2
    for row in res.metrics:
        assert row["env/errors"] == len(groups)
        assert row["env/episodes"] == 3 * len(groups)
        assert row["train/datums"] == 3 * len(groups)
        assert math.isfinite(row["loss/sum"])
    assert all(torch.isfinite(t).all() for t in _weights(service, res.training_client))


class _TwoTurns(Env):
    """Two turns; its step sleeps ``delay`` seconds (the environment's own time)."""

    def __init__(self, delay: float) -> None:
        self.delay, self.turn = delay, 0

    async def initial_observation(self) -> list[int]:
        return [5, 6, 7, 8]

    async def step(self, action: list[int]) -> StepResult:
        await asyncio.sleep(self.delay)
        self.turn += 1
        if self.turn == 2:
            return StepResult(1.0, True)
        return StepResult(0.0, False, next_ob_T=[5, 6, 7, 8, *action, 9])


class _TwoTurnGroup(EnvGroupBuilder):
    def __init__(self, delays: list[float]) -> None:
        self.delays = delays

    async def make_envs(self) -> Sequence[Env]:
        return [_TwoTurns(d) for d in self.delays]


def test_episode_timeout_counts_the_environment_not_the_sampler(
    service: ServiceClient, caplog: pytest.LogCaptureFixture
) -> None:
    """A slow sampler never fails an episode (its turns took 2 x 0.4 s > the 0.3 s limit); an
    environment step slower than the limit fails its own episode, with a message saying so."""
    policy = SlowSampler(service.create_sampling_client(base_model=TEST_MODEL), 0.4)
    params = types.SamplingParams(max_tokens=3, temperature=1.0)
    g = asyncio.run(rollout_group(_TwoTurnGroup([0.0, 0.0, 1.0]), policy, params, seed=0, timeout_s=0.3))
    assert g.errors == 1 and len(g.trajectories) == 2
    assert all(len(t.transitions) == 2 and t.total_reward == 1.0 for t in g.trajectories)
    assert "the environment's step took longer than 0.3 s" in caplog.text


def test_raising_make_envs_fails_only_its_group(
    service: ServiceClient, renderer: Renderer, tmp_path: Path
) -> None:
    """A builder whose make_envs raises loses its group only (was: the whole run died)."""
    cfg = _cfg(tmp_path, steps=1, groups_per_step=2)
    res = asyncio.run(run_rl(cfg, service, Dataset([["", "", ""], ["make_envs"]], renderer)))
    (row,) = res.metrics
    assert row["env/errors"] >= 1 and row["env/episodes"] == 3 and row["train/datums"] == 3


def test_nan_reward_never_reaches_the_update(
    service: ServiceClient, renderer: Renderer, tmp_path: Path
) -> None:
    """A run whose groups include a NaN-reward episode trains exactly as the run without it."""
    with_nan = asyncio.run(
        run_rl(_cfg(tmp_path, "nan", seed=3), service, Dataset([["", "", "", "nan"]], renderer))
    )
    clean = asyncio.run(run_rl(_cfg(tmp_path, "clean", seed=3), service, Dataset([["", "", ""]], renderer)))
    for a, b in zip(with_nan.metrics, clean.metrics, strict=True):
        assert a["env/errors"] == 1 and b["env/errors"] == 0
        assert a["reward/mean"] == b["reward/mean"]
        assert_scalar_close(a.get("loss/sum", 0.0), b.get("loss/sum", 0.0))
    assert "loss/sum" in with_nan.metrics[0]
    w_nan, w_clean = _weights(service, with_nan.training_client), _weights(service, clean.training_client)
    for x, y in zip(w_nan, w_clean, strict=True):
        assert torch.isfinite(x).all()
        assert_rel_close(x, y)
    assert any(float(t.abs().max()) > 0 for t in w_nan)  # it did train


def _greedy_accuracy(policy: Any, renderer: Renderer, problems: list[tuple[int, int]]) -> float:
    """The reference evaluation: each held-out problem alone, greedy, the first integer == a + b."""
    params = types.SamplingParams(max_tokens=8, temperature=0.0, stop=renderer.stop)
    right = 0
    for a, b in problems:
        prompt = renderer.build_generation_prompt(
            [{"role": "user", "content": f"What is {a} + {b}? Answer with just the number."}]
        )
        res = policy.sample(types.ModelInput.from_ints(prompt), 1, params).result()
        found = re.search(r"-?\d+", renderer.parse_response(list(res.sequences[0].tokens))[0]["content"])
        right += found is not None and int(found.group()) == a + b
    return right / len(problems)


def test_addition_smoke(service: ServiceClient, renderer: Renderer, tmp_path: Path) -> None:
    """The fixed task end to end: it trains (datums, moved weights), it writes its metrics,
    checkpoint, config and plot, and the accuracies it logs are those of the base model (before)
    and of the saved final weights (after) on the held-out problems, recomputed here one by one."""
    from opentinker.tasks.arithmetic import eval_problems

    spec = get_task("addition")
    cfg = _cfg(
        tmp_path,
        steps=3,
        groups_per_step=2,
        eval_every=2,
        extra={"eval_problems": 20},
        max_tokens=8,
        learning_rate=5e-3,
    )
    dataset, evaluator = spec.build()(renderer, cfg)
    res = asyncio.run(run_rl(cfg, service, dataset, evaluator))
    log_dir = Path(cfg.log_dir)
    rows = read_metrics(log_dir)
    assert [r["step"] for r in rows] == [0, 1, 2] and rows == res.metrics
    assert (log_dir / "curves.png").stat().st_size > 0 and (log_dir / "config.json").exists()
    assert all(r["env/episodes"] == 8 and r["env/errors"] == 0 for r in rows)
    # it trained: some groups had differing rewards, so there were datums and the weights moved
    assert sum(r.get("train/datums", 0) for r in rows) > 0
    final = _weights(service, res.training_client)
    assert any(float(t.abs().max()) > 0 for t in final)  # B = 0 at creation
    # the checkpoint of the last step holds exactly those weights
    assert res.final_path is not None
    ckpt = (log_dir / "checkpoints.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in ckpt][-1] == {"step": 3, "path": res.final_path}
    reloaded = service.create_training_client_from_state(res.final_path)
    assert all(torch.equal(x, y) for x, y in zip(_weights(service, reloaded), final, strict=True))
    # held out: no training problem is an evaluation problem
    held = eval_problems(20)
    trained_on = {(g.a, g.b) for s in range(cfg.steps) for g in dataset.batch(s)}  # type: ignore[attr-defined]
    assert trained_on and not trained_on & set(eval_problems())
    # the logged accuracies are the base model's (step 0) and the final weights' (last row); at this
    # learning rate the policy moves enough for the two to differ (0.25 and 0.15 here), so a run
    # that evaluated the wrong weights would fail
    base = service.create_sampling_client(base_model=TEST_MODEL)
    assert rows[0]["eval/accuracy"] == _greedy_accuracy(base, renderer, held)
    policy = reloaded.save_weights_and_get_sampling_client()
    assert rows[-1]["eval/accuracy"] == _greedy_accuracy(policy, renderer, held)


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
def test_async_respects_max_staleness(
    service: ServiceClient, renderer: Renderer, tmp_path: Path, max_staleness: int
) -> None:
    cfg = _cfg(tmp_path, mode="async", steps=6, max_staleness=max_staleness)
    res = asyncio.run(run_rl(cfg, service, Dataset([["", "", "", ""]], renderer)))
    rows = read_metrics(cfg.log_dir)
    assert [r["step"] for r in rows] == list(range(6)) and len(res.metrics) == 6
    trained = [r for r in rows if "train/datums" in r]
    assert trained, "async mode trained on nothing"
    assert all(r["policy/staleness"] <= max_staleness for r in trained)
    assert all(r["policy/staleness"] > max_staleness for r in rows if r.get("train/dropped_stale"))
    assert rows[-1]["policy/version"] == len(trained)


class SlowTrainer:
    """A training client whose ``forward_backward`` takes a while: sampling outruns training."""

    def __init__(self, tc: Any, delay_s: float) -> None:
        self.tc, self.delay_s = tc, delay_s

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tc, name)

    def forward_backward(self, *a: Any, **k: Any) -> Any:
        fut = self.tc.forward_backward(*a, **k)

        async def slow() -> Any:
            await asyncio.sleep(self.delay_s)
            return await fut

        return asyncio.ensure_future(slow())


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_async_never_samples_a_batch_it_must_drop(
    service: ServiceClient, renderer: Renderer, tmp_path: Path, max_staleness: int
) -> None:
    """When sampling outruns training, the producer waits instead of sampling batches that would
    be too stale to train on (was: staleness max_staleness + 1, sampled then dropped)."""
    cfg = _cfg(tmp_path, mode="async", steps=5, max_staleness=max_staleness, drop_constant_groups=False)
    tc = service.create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=0)
    data = Dataset([["", "", "", ""]], renderer)
    rows = asyncio.run(run_rl(cfg, service, data, training_client=SlowTrainer(tc, 0.3))).metrics
    assert all(r["policy/staleness"] <= max_staleness for r in rows)
    assert not any(r.get("train/dropped_stale") for r in rows)
    assert rows[-1]["policy/version"] == 5


def test_sync_mode_versions(service: ServiceClient, renderer: Renderer, tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, mode="sync", steps=3, drop_constant_groups=False)
    rows = asyncio.run(run_rl(cfg, service, Dataset([["", "", "", ""]], renderer))).metrics
    assert [r["policy/version"] for r in rows] == [1.0, 2.0, 3.0]
    assert all(r["train/datums"] == 4 for r in rows)


def test_learning_rate_schedules() -> None:
    base = dict(base_model=TEST_MODEL, steps=10, learning_rate=1e-3, lr_final=0.1)
    const = RLConfig(**base)
    assert [learning_rate_at(const, s, 0.0) for s in (0, 9)] == [1e-3, 1e-3]
    lin = RLConfig(**base, lr_schedule="linear")
    assert learning_rate_at(lin, 0, 0.0) == pytest.approx(1e-3)
    assert learning_rate_at(lin, 5, 0.0) == pytest.approx(0.55e-3)
    cos = RLConfig(**base, lr_schedule="cosine")
    assert learning_rate_at(cos, 5, 0.0) == pytest.approx(0.55e-3)
    assert learning_rate_at(cos, 10, 0.0) == pytest.approx(1e-4)
    timed = RLConfig(**{**base, "steps": 1000}, lr_schedule="linear", max_train_s=100.0)
    assert learning_rate_at(timed, 1, 50.0) == pytest.approx(0.55e-3)  # the clock is further on
    assert learning_rate_at(timed, 1, 500.0) == pytest.approx(1e-4)  # never below lr_final
    for bad in (dict(lr_schedule="step"), dict(lr_final=2.0)):
        with pytest.raises(ValueError, match="lr_"):
            RLConfig(**{**base, **bad}).check()


def test_lr_schedule_reaches_the_optimizer(
    service: ServiceClient, renderer: Renderer, tmp_path: Path
) -> None:
    cfg = _cfg(tmp_path, steps=3, drop_constant_groups=False, lr_schedule="linear", lr_final=0.5)
    rows = asyncio.run(run_rl(cfg, service, Dataset([["", "", "", ""]], renderer))).metrics
    lrs = [r["train/lr"] for r in rows]
    assert lrs == pytest.approx([cfg.learning_rate * f for f in (1.0, 1 - 0.5 / 3, 1 - 1.0 / 3)])


def test_kl_penalty_logged(service: ServiceClient, renderer: Renderer, tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, kl_coef=0.5, steps=2)
    rows = asyncio.run(run_rl(cfg, service, Dataset([["", "", "", ""]], renderer))).metrics
    kls = [r["kl/sampler_vs_base"] for r in rows]
    assert all(math.isfinite(k) for k in kls)
    assert abs(kls[0]) < LOGPROB_ATOL  # step 0: B = 0, the policy is the base model (2 paths' logprobs)
    assert abs(kls[1]) > 1e-6  # after an update they differ


def test_resume_continues_identically(service: ServiceClient, renderer: Renderer, tmp_path: Path) -> None:
    data = Dataset([["", "", "", ""], ["", "", "", ""]], renderer)
    full = asyncio.run(
        run_rl(_cfg(tmp_path, "full", steps=4, save_every=2, groups_per_step=2), service, data)
    )
    half = _cfg(tmp_path, "resumed", steps=2, save_every=2, groups_per_step=2)
    asyncio.run(run_rl(half, service, data))
    rest = _cfg(tmp_path, "resumed", steps=4, save_every=2, groups_per_step=2)
    resumed = asyncio.run(run_rl(rest, service, data, resume=True))
    assert [r["step"] for r in resumed.metrics] == [2, 3]
    rows = read_metrics(rest.log_dir)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for want, got in zip(full.metrics[2:], resumed.metrics, strict=True):
        assert got["reward/mean"] == want["reward/mean"]
        assert_scalar_close(got["loss/sum"], want["loss/sum"])
    for x, y in zip(
        _weights(service, full.training_client), _weights(service, resumed.training_client), strict=True
    ):
        assert_rel_close(x, y)


def test_run_rl_many_two_adapters(service: ServiceClient, renderer: Renderer, tmp_path: Path) -> None:
    jobs = [
        (_cfg(tmp_path, f"seed{s}", seed=s, steps=2), Dataset([["", "", "", ""]], renderer), None)
        for s in (0, 1)
    ]
    results = asyncio.run(run_rl_many(jobs, service))
    assert len(results) == 2
    assert results[0].training_client.model_id != results[1].training_client.model_id
    for cfg, _, _ in jobs:
        assert len(read_metrics(cfg.log_dir)) == 2 and (Path(cfg.log_dir) / "curves.png").exists()
    w0, w1 = (_weights(service, r.training_client) for r in results)
    assert any(not torch.equal(a, b) for a, b in zip(w0, w1, strict=True))


class CrashingDataset(Dataset):
    def batch(self, step: int) -> list[EnvGroupBuilder]:
        if step == 1:
            raise RuntimeError("the run dies at step 1")
        return super().batch(step)


def test_resume_never_continues_an_older_run(
    service: ServiceClient, renderer: Renderer, tmp_path: Path
) -> None:
    groups = [["", "", "", ""]]
    asyncio.run(run_rl(_cfg(tmp_path, "d", steps=2, save_every=2), service, Dataset(groups, renderer)))
    fresh = _cfg(tmp_path, "d", steps=3, seed=7)
    with pytest.raises(RuntimeError, match="dies"):
        asyncio.run(run_rl(fresh, service, CrashingDataset(groups, renderer)))
    resumed = asyncio.run(
        run_rl(_cfg(tmp_path, "d", steps=3, seed=7), service, Dataset(groups, renderer), resume=True)
    )
    assert [r["step"] for r in resumed.metrics] == [0, 1, 2]
