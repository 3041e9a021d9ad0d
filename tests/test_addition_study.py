"""The fixed task's measurements: the exploration metrics of a step (entropy estimate, advantage
scale, constant groups) on hand-built groups, the held-out error classes, and
recipes/addition/seed_study.py end to end on the tiny model (its CPU clock, its stopping rule,
its refusals)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from opentinker.rl import RLConfig
from opentinker.rl.datums import build_datums
from opentinker.rl.rollout import group_metrics
from opentinker.rl.types import Trajectory, TrajectoryGroup, Transition
from tests.conftest import TEST_MODEL

ROOT = Path(__file__).resolve().parents[1]
STUDY = ROOT / "recipes/addition/seed_study.py"


def traj(logprobs: list[float], reward: float) -> Trajectory:
    return Trajectory([Transition([1, 2, 3], [4 + k for k in range(len(logprobs))], logprobs, reward=reward)])


def groups() -> list[TrajectoryGroup]:
    return [
        TrajectoryGroup([traj([-0.5, -1.5], 1.0), traj([-2.0], 0.0), traj([-1.0], 0.0), traj([-3.0], 0.0)]),
        TrajectoryGroup([traj([-0.25], 1.0), traj([-0.75], 1.0)]),  # constant, all solved
        TrajectoryGroup([traj([-1.0], 0.0), traj([-1.0], 0.0)]),  # constant, all failed
        TrajectoryGroup([traj([-1.0], 0.0), traj([-1.0], 0.0)]),
    ]


def test_entropy_estimate_is_the_sampled_tokens_mean_negative_logprob() -> None:
    m = group_metrics(groups())
    lps = [-0.5, -1.5, -2.0, -1.0, -3.0, -0.25, -0.75] + [-1.0] * 4
    assert m["policy/nll_per_token"] == pytest.approx(-sum(lps) / len(lps), rel=1e-12)


def test_advantage_scale_and_constant_groups() -> None:
    cfg = RLConfig(base_model=TEST_MODEL)
    _, m = asyncio.run(build_datums(groups(), cfg, None))
    assert m["groups/kept"] == 1 and m["groups/dropped_constant"] == 3
    # the kept group: rewards 1, 0, 0, 0 -> advantages 0.75, -0.25 x 3
    assert m["advantage/abs_mean"] == pytest.approx((0.75 + 3 * 0.25) / 4, rel=1e-12)
    assert m["groups/constant_reward_mean"] == pytest.approx(1 / 3, rel=1e-12)
    std = RLConfig(base_model=TEST_MODEL, normalize_std=True)  # unit-variance advantages
    _, m = asyncio.run(build_datums(groups(), std, None))
    # std of (0.75, -0.25, -0.25, -0.25) is sqrt(0.1875); eps 1e-6 in the divisor
    assert m["advantage/abs_mean"] == pytest.approx(0.375 / 0.1875**0.5, rel=1e-5)


def load_study():
    spec = importlib.util.spec_from_file_location("seed_study", STUDY)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize(
    ("text", "a", "b", "want"),
    [
        ("82", 45, 37, "correct"),
        ("82 is the sum", 45, 37, "correct"),
        ("45 + 37 = 82", 45, 37, "format"),  # restated: its first integer is an operand
        ("The answer", 45, 37, "format"),
        ("72", 45, 37, "carry"),  # the carry dropped
        ("242", 45, 97, "carry"),  # 142: a hundred invented
        ("83", 45, 37, "ones"),
        ("62", 45, 37, "other"),
    ],
)
def test_error_classes(text: str, a: int, b: int, want: str) -> None:
    assert load_study().error_class(text, a, b) == want


def run_study(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, str(STUDY), "--model", TEST_MODEL, "--eval-problems", "10", "--log-dir", str(tmp_path / "run"), *extra]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)


@pytest.mark.slow  # a subprocess that loads the model; slow on a loaded machine
def test_study_on_the_tiny_model_stops_on_its_cpu_clock(tmp_path: Path) -> None:
    out = run_study(tmp_path, "--max-cpu-minutes", "0.05", "--eval-every", "3", "--set", "group_size=4")
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads((tmp_path / "run/study.json").read_text())
    assert r["settings"]["group_size"] == 4 and r["settings"]["learning_rate"] == 4e-4  # the task's default
    clocks = [t["train_cpu_s"] for t in r["trace"]]
    assert clocks[0] == 0.0 and clocks == sorted(clocks)
    assert clocks[-1] >= 3.0 and all(c < 3.0 for c in clocks[:-1])  # it stops at the first eval past the cap
    assert [t["step"] for t in r["trace"]] == list(range(0, 3 * len(clocks), 3))
    for t in r["trace"]:  # the classes partition the held-out problems
        parts = t["accuracy"] + t["err_format"] + t["err_carry"] + t["err_ones"] + t["err_other"]
        assert parts == pytest.approx(1.0, abs=1e-9)
    rows = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert len(rows) == r["steps"] and all("policy/nll_per_token" in x for x in rows)


@pytest.mark.parametrize(
    ("flag", "says"),
    [
        ("no_such_field=1", "no_such_field=...: not an RLConfig field"),
        ("seed=3", "seed=...: not an RLConfig field"),  # --seed sets it
        ("learning_rate=-1", "--set: learning_rate must be a positive number"),
        ("group_size", "--set wants FIELD=VALUE"),
    ],
)
def test_study_refuses_bad_settings(tmp_path: Path, flag: str, says: str) -> None:
    out = run_study(tmp_path, "--set", flag)
    assert out.returncode != 0 and says in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "run/metrics.jsonl").exists()
