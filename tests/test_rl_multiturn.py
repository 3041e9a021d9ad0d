"""Multi-turn RL: the guess-the-number task, its token layout and datums, a short run on the tiny model."""

from __future__ import annotations

import asyncio
import json
import math
import os

import pytest
from tinker import types

import opentinker
from opentinker.client import Runtime
from opentinker.renderers import get_renderer
from opentinker.rl import RLConfig, rl_datums, rollout_group, run_rl, trajectory_segments
from opentinker.tasks.arithmetic import eval_problems, question
from opentinker.tasks.guess_number import (
    PROMPT,
    GuessNumberEnv,
    GuessNumberGroup,
    bisection_opening,
    build,
    held_out_secrets,
    parse_guess,
)
from tests.conftest import TEST_MODEL
from tests.tolerances import assert_logprobs_close


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
    policy = service.create_sampling_client(base_model=TEST_MODEL)
    return get_renderer("auto", policy.get_tokenizer())


def _say(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


def test_guess_number_rules(renderer) -> None:
    async def play(secret: int, guesses: list[str], **kw) -> list:
        env = GuessNumberEnv(renderer, secret, **kw)
        assert env.initial_messages() == [{"role": "user", "content": PROMPT}]
        return [await env.respond(_say(g), True) for g in guesses]

    out = asyncio.run(play(30, ["Is it 50?", "Is it 25?", "Is it 30?"]))
    assert [r.messages for r in out[:2]] == [[{"role": "user", "content": "Lower."}], [{"role": "user", "content": "Higher."}]]  # fmt: skip
    assert [r.done for r in out] == [False, False, True]
    assert out[-1].reward == pytest.approx(0.8)  # 1 - 0.1 * (3 - 1)
    assert out[-1].metrics == {"success": 1.0, "turns": 3.0, "invalid": 0.0, "in_range": 1.0, "bisect": 0.0}
    assert all(r.reward == 0 and "success" not in r.metrics for r in out[:2])  # outcome only at the end
    assert [r.metrics["bisect"] for r in out[:2]] == [1.0, 1.0]  # 50 in 1..100, 25 in 1..49
    out = asyncio.run(play(30, ["Is it 50?", "Is it 60?", "Is it 20?"]))
    assert [r.metrics["in_range"] for r in out] == [1.0, 0.0, 1.0]  # 60 > 49: contradicts "Lower."

    first = asyncio.run(play(7, ["Is it 7?"]))[0]
    assert (first.reward, first.done, first.metrics["turns"]) == (1.0, True, 1.0)
    out = asyncio.run(play(7, ["Is it 50?", "Is it 40?"], max_turns=2))
    assert out[-1].done and out[-1].reward == 0 and out[-1].metrics["success"] == 0
    bad = asyncio.run(play(7, ["no idea"]))[0]
    assert bad.done and bad.reward == 0 and bad.metrics["invalid"] == 1.0
    assert parse_guess("Is it -3? or 5") == -3 and parse_guess("none") is None

    # a game already under way: scripted midpoint guesses count as turns
    assert [m["content"] for m in bisection_opening(30, 2)] == ["Is it 50?", "Lower.", "Is it 25?", "Higher."]
    assert bisection_opening(50, 3) == []  # never plays the winning guess for the policy
    env = GuessNumberEnv(renderer, 30, opening=2)
    assert len(env.initial_messages()) == 5 and env.turns == 2
    assert asyncio.run(env.respond(_say("Is it 30?"), True)).reward == pytest.approx(0.8)


def test_guess_number_dataset_and_held_out(renderer) -> None:
    held = held_out_secrets()
    cfg = RLConfig(groups_per_step=6, group_size=3)
    ds, _ = build(renderer, cfg)
    for step in range(20):
        for g in ds.batch(step):
            envs = asyncio.run(g.make_envs())
            secrets = {e.secret for e in envs}  # type: ignore[attr-defined]
            assert len(envs) == 3 and len(secrets) == 1 and not secrets & set(held)
    assert [g.secrets for g in ds.batch(3)] == [g.secrets for g in ds.batch(3)]  # type: ignore[attr-defined]


def test_multiturn_token_layout_and_one_datum(service, renderer) -> None:
    """Turn t+1's observation = turn t's observation + action + the env reply's tokens; the episode
    is ONE datum: advantage and the sampler's logprob on action tokens only; and those logprobs
    are the policy's own in that context (so the layout is the one the sampler saw)."""
    policy = service.create_sampling_client(base_model=TEST_MODEL)
    group = GuessNumberGroup(renderer, [37] * 4, max_turns=7, shaping=0.1)
    params = types.SamplingParams(max_tokens=12, temperature=1.0)
    g = asyncio.run(rollout_group(group, policy, params, seed=5))
    assert g.errors == 0 and len(g.trajectories) == 4
    multi = [t for t in g.trajectories if len(t.transitions) >= 3]
    assert multi, "expected multi-turn episodes"
    for traj in multi:
        trs = traj.transitions
        for t in range(len(trs) - 1):
            guess = parse_guess(renderer.parse_response(trs[t].ac_T)[0]["content"])
            assert guess is not None and guess != 37
            hint = {"role": "user", "content": "Higher." if guess < 37 else "Lower."}
            reply = renderer.next_turn_tokens(True, [hint])
            assert trs[t + 1].ob_T == trs[t].ob_T + trs[t].ac_T + reply
            assert not trs[t].done
        assert trs[-1].done

        (datum,) = rl_datums(traj, 0.25)
        ((tokens, _, act),) = trajectory_segments(traj)
        assert tokens == trs[-1].ob_T + trs[-1].ac_T
        assert datum.model_input.to_ints() == tokens[:-1]
        adv = datum.loss_fn_inputs["advantages"].tolist()
        lps = datum.loss_fn_inputs["logprobs"].tolist()
        is_act = act[1:]
        assert sum(is_act) == traj.num_action_tokens
        assert all((a == 0.25) if m else (a == 0.0) for a, m in zip(adv, is_act, strict=True))
        sampled = [x for tr in trs for x in tr.logprobs_T]
        assert [lp for lp, m in zip(lps, is_act, strict=True) if m] == pytest.approx(sampled, abs=1e-6)
        assert all(lp == 0.0 for lp, m in zip(lps, is_act, strict=True) if not m)
        teacher = policy.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
        forced = [float(x) for x, m in zip(teacher, act, strict=True) if m and x is not None]
        assert_logprobs_close(forced, sampled)  # invariant 3 across turns


def test_guess_number_rl_smoke_writes_metrics(service, renderer, tmp_path) -> None:
    cfg = RLConfig(
        base_model=TEST_MODEL, log_dir=str(tmp_path / "run"), steps=3, groups_per_step=2, group_size=4,
        max_tokens=12, learning_rate=2e-3, eval_every=2, progress=False, extra={"eval_secrets": 6},
    )  # fmt: skip
    dataset, evaluator = build(renderer, cfg)
    res = asyncio.run(run_rl(cfg, service, dataset, evaluator))
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and len(res.metrics) == 3
    for r in rows:
        assert 0 <= r["env/success"] <= 1 and 1 <= r["env/turns"] <= 7
        assert r["env/errors"] == 0 and r["env/episodes"] == 8
    assert {"eval/success", "eval/turns", "eval/accuracy"} <= rows[0].keys()  # step 0 evaluation
    assert "eval/success" in rows[1] and "eval/success" in rows[2]
    assert all(math.isfinite(r["eval/turns"]) for r in rows if "eval/turns" in r)
    assert (tmp_path / "run" / "curves.png").exists() and res.final_path


def test_addition_retry_rules_and_smoke_run(runtime, service, renderer, tmp_path) -> None:
    from opentinker.tasks import addition_retry as ar

    async def play(replies: list[str], **kw) -> list:
        env = ar.RetryAdditionEnv(renderer, 23, 45, kw.get("attempts", 3), kw.get("retry_cost", 0.3))
        assert env.initial_messages() == [{"role": "user", "content": question(23, 45)}]
        return [await env.respond(_say(r), True) for r in replies]

    out = asyncio.run(play(["23 + 45 = 68", "67", "68."]))
    assert [r.done for r in out] == [False, False, True]
    assert [r.messages for r in out[:2]] == [[{"role": "user", "content": ar.FEEDBACK}]] * 2
    assert out[-1].reward == pytest.approx(0.4)  # 1 - 0.3 * (3 - 1)
    assert out[-1].metrics == {"success": 1.0, "first_try": 0.0, "attempts": 3.0}
    first = asyncio.run(play(["68"]))[0]
    assert (first.reward, first.done, first.metrics["first_try"]) == (1.0, True, 1.0)
    failed = asyncio.run(play(["1", "2"], attempts=2))
    assert failed[-1].done and failed[-1].reward == 0 and failed[-1].metrics["success"] == 0

    cfg = RLConfig(
        base_model=TEST_MODEL, log_dir=str(tmp_path / "run"), steps=2, groups_per_step=2, group_size=4,
        max_tokens=8, learning_rate=3e-4, eval_every=1, progress=False, extra={"eval_problems": 8},
    )  # fmt: skip
    dataset, evaluator = ar.build(renderer, cfg)
    held = set(eval_problems())
    assert all(not set(g.problems) & held for g in dataset.batch(0))  # type: ignore[attr-defined]
    cache = runtime.base_stack(TEST_MODEL).sampler.prefix_cache
    hits = cache.hits
    res = asyncio.run(run_rl(cfg, service, dataset, evaluator))
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and len(res.metrics) == 2
    assert rows[0]["env/turns_mean"] > 1 and cache.hits > hits  # later turns reused the earlier
    for r in rows:
        assert r["env/errors"] == 0 and r["env/episodes"] == 8 and 1 <= r["env/turns_mean"] <= 3
        assert 0 <= r["eval/success"] <= 1 and r["eval/first_try"] <= r["eval/success"]


def test_addition_retry_recipe_smoke(tmp_path) -> None:
    """recipes/addition_retry/run.py: single-turn RL, then the retry task from the same client."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, str(root / "recipes/addition_retry/run.py"), "--tiny", "--single-steps", "2",
           "--retry-steps", "2", "--eval-every", "1", "--eval-problems", "4", "--no-progress",
           "--log-dir", str(tmp_path)]  # fmt: skip
    subprocess.run(
        cmd, check=True, capture_output=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["model"] == TEST_MODEL and summary["retry"]
    assert all(0 <= r["eval/success"] <= 1 and 1 <= r["eval/attempts"] <= 3 for r in summary["retry"])
    ckpts = [json.loads(x) for x in (tmp_path / "retry" / "checkpoints.jsonl").read_text().splitlines()]
    assert ckpts and "retry-step-" in ckpts[-1]["path"]  # named apart from the first stage's


def test_calculator_rules_and_smoke_run(runtime, service, renderer, tmp_path) -> None:
    """The calculator tool: it answers the first expression the model writes (whatever numbers),
    a reply whose first number is the product ends the episode, anything else gets a nudge. In the
    run, every later turn's prompt continues the turn before it: the sampler serves it from its
    prefix cache."""
    from opentinker.tasks import calculator as calc

    assert calc.first_number("It is 56,876.") == 56876 and calc.first_number("1,2345 or 7") == 1
    assert calc.first_number("no digits") is None
    assert calc.calculator_call("CALC 964 × 59") == (964, "*", 59, 56876)
    assert calc.calculator_call("964 - 59 = 5") == (964, "-", 59, 905)
    assert calc.calculator_call("the answer is 3") is None

    async def play(replies: list[str], turns: int = 3) -> list:
        env = calc.CalculatorEnv(renderer, 964, 59, turns)
        assert env.initial_messages() == [{"role": "user", "content": calc.question(964, 59)}]
        return [await env.respond(_say(r), True) for r in replies]

    out = asyncio.run(play(["CALC 964 * 59", "56876"]))
    assert [r.done for r in out] == [False, True] and out[-1].reward == 1.0
    assert out[0].messages == [
        {"role": "user", "content": "CALC 964 * 59 = 56876. Now answer with just the number."}
    ]
    assert out[-1].metrics == {"success": 1.0, "turns": 2.0, "calls": 1.0, "right_call": 1.0}
    # a wrong expression is evaluated as written; a reply with neither answer nor call is nudged
    out = asyncio.run(play(["964 * 95 = ?", "I do not know", "55000"]))
    assert out[0].messages[0]["content"].startswith("CALC 964 * 95 = 91580.")
    assert out[1].messages == [{"role": "user", "content": calc.NUDGE}]
    assert out[-1].done and out[-1].reward == 0.0
    assert out[-1].metrics == {"success": 0.0, "turns": 3.0, "calls": 1.0, "right_call": 0.0}
    # the answer at once (even without a call) is a success; the turn limit ends the episode
    assert asyncio.run(play(["56,876"]))[0].reward == 1.0
    assert asyncio.run(play(["CALC 964 * 59"], turns=1))[0].done

    cfg = RLConfig(
        base_model=TEST_MODEL, log_dir=str(tmp_path / "run"), steps=2, groups_per_step=2, group_size=4,
        max_tokens=8, learning_rate=3e-4, eval_every=1, progress=False, extra={"eval_problems": 6},
    )  # fmt: skip
    dataset, evaluator = calc.build(renderer, cfg)
    held = set(calc.eval_problems())
    assert all(not set(g.problems) & held for g in dataset.batch(0))  # type: ignore[attr-defined]
    cache = runtime.base_stack(TEST_MODEL).sampler.prefix_cache
    hits = cache.hits
    res = asyncio.run(run_rl(cfg, service, dataset, evaluator))
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and len(res.metrics) == 2
    assert rows[0]["env/turns_mean"] > 1 and cache.hits > hits  # later turns reused the earlier
    for r in rows:
        assert r["env/errors"] == 0 and r["env/episodes"] == 8 and 1 <= r["env/turns_mean"] <= 3
        assert 0 <= r["eval/success"] <= 1 and r["eval/right_call"] <= r["eval/calls"] + 1e-9


@pytest.mark.parametrize(
    ("recipe", "args"),
    [
        ("guess_number", ["--steps", "1", "--groups", "1", "--group-size", "2", "--eval-samples", "1",
                          "--eval-every", "1"]),
        ("sft_then_rl", ["--sft-epochs", "1", "--sft-batch", "8", "--rl-steps", "1", "--groups", "1",
                         "--group-size", "2", "--eval-problems", "4"]),
    ],
)  # fmt: skip
def test_recipe_script_smoke(tmp_path, recipe: str, args: list[str]) -> None:
    """The recipe scripts not covered elsewhere, on the tiny model (their default), one short run."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENTINKER_HOME": str(tmp_path / "home")}
    cmd = [sys.executable, str(root / f"recipes/{recipe}/run.py"), *args, "--no-progress",
           "--log-dir", str(tmp_path / "run")]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, timeout=600, env=env)
    assert list((tmp_path / "run").rglob("metrics.jsonl"))
