"""The main job (``opentinker demo``) and its task: the reply-length reward against a plain
formula, what "separated" means, and the whole command on the tiny model (files, summary, usage
errors)."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
from pathlib import Path

import pytest

from opentinker.cli.demo import HELD_OUT_SAMPLES, TARGETS, HeldOut, nearest_target, separated, typical_words
from opentinker.cli.main import main
from opentinker.tasks.reply_length import (
    EVAL,
    QUESTIONS,
    TOPICS,
    TRAIN,
    LengthEnv,
    length_reward,
    on_topic,
    reply_reward,
)
from opentinker.tracking import read_metrics
from tests.conftest import TEST_MODEL


def words(n: int) -> str:
    return " ".join(["word"] * n)


@pytest.mark.parametrize(("n", "target"), [(1, 3), (3, 3), (6, 3), (13, 8), (20, 20), (57, 40), (200, 40)])
def test_length_reward_is_the_formula(n: int, target: int) -> None:
    assert length_reward(words(n), target) == pytest.approx(1 / (1 + math.log2(n / target) ** 2))


def test_length_reward_shape() -> None:
    assert length_reward(words(8), 8) == 1.0
    assert length_reward("", 8) == 0.0 and length_reward("   \n ", 8) == 0.0  # empty earns nothing
    # symmetric on the ratio: half and twice the target cost the same, 1/2
    assert length_reward(words(4), 8) == pytest.approx(0.5) == length_reward(words(16), 8)
    # strictly better the nearer, from either side, and never 0 for a finished reply
    below = [length_reward(words(n), 20) for n in range(1, 21)]
    above = [length_reward(words(n), 20) for n in range(20, 400)]
    assert all(a < b for a, b in itertools.pairwise(below))
    assert all(a > b > 0 for a, b in itertools.pairwise(above))
    with pytest.raises(ValueError, match="target must be >= 1"):
        length_reward("hi", 0)


def test_each_demo_target_pays_most_on_its_own_length() -> None:
    for n in TARGETS:
        own = length_reward(words(n), n)
        assert all(length_reward(words(n), t) <= 0.5 * own for t in TARGETS if t != n)


def test_a_cut_reply_earns_nothing_whatever_its_length() -> None:
    class Plain:  # the env only needs the renderer's stop tokens here
        stop = ()

    env = LengthEnv(Plain(), "Describe a forest.", 3)  # type: ignore[arg-type]
    reply = {"role": "assistant", "content": "Tall green trees."}
    cut = asyncio.run(env.respond(reply, ended=False))
    done = asyncio.run(env.respond(reply, ended=True))
    assert cut.reward == 0.0 and done.reward == 1.0
    assert cut.metrics == {"words": 3.0, "ended": 0.0, "on_topic": 1.0}


@pytest.mark.parametrize(
    ("question", "reply", "topical"),
    [
        ("What is kindness?", "Kindness is caring for others.", True),
        ("What is kindness?", "Being KIND.", True),  # case and punctuation ignored, a stem's word
        ("What is kindness?", "finally", False),  # the replies reward hacking found without the check
        ("What is kindness?", "No answer available.", False),
        ("What is kindness?", "This sentence didn't make it into the actual answer.", False),
        ("What is kindness?", "Humankind.", False),  # a stem counts at the start of a word only
        ("How do you make tea?", "Boil water, add tea leaves.", True),
        ("How do you make tea?", "Teas.", True),  # a short stem: the word or its plural
        ("How do you make tea?", "Teamwork.", False),  # ... not every word that starts with it
        ("Why do cats purr?", "Cats purr when content.", True),
        ("What is electricity?", "Electrical current.", True),  # a long stem: any word it starts
        ("What is the capital of France?", "Paris.", True),  # a topic names the answer's words too
        ("Why do cats purr?", "Why do cats purr?", False),  # the question back, found by RL
        ("Why do cats purr?", "why do cats purr", False),  # ... in any case or punctuation
        ("Why do cats purr?", "Do cats purr?", False),  # a question is no answer
    ],
)
def test_on_topic_is_the_questions_stems(question: str, reply: str, topical: bool) -> None:
    assert on_topic(reply, question) is topical
    want = length_reward(reply, 3) if topical else 0.0
    assert reply_reward(reply, question, 3) == want


def test_every_question_has_a_topic_in_plain_lower_case() -> None:
    assert set(TOPICS) == set(QUESTIONS) and len(QUESTIONS) == len(TRAIN) + len(EVAL)
    assert not set(TRAIN) & set(EVAL)
    for question, stems in TOPICS.items():
        assert stems and all(s.isalpha() and s.islower() for s in stems), question
        # the question's own words name its topic ... but repeating the question is no answer
        assert on_topic(question.rstrip("?.") + " indeed.", question), question
        assert not on_topic(question, question) and not on_topic(question.rstrip("?.") + ".", question)


def test_typical_words_is_the_geometric_mean() -> None:
    assert typical_words([2, 8]) == pytest.approx(4.0)  # not 5: the ratio scale
    assert typical_words([3, 3, 3]) == pytest.approx(3.0)
    assert typical_words([0, 2]) == pytest.approx(1.0)  # an empty reply counts as half a word
    # one long ramble moves a short adapter's figure much less than an arithmetic mean would
    assert typical_words([2] * 9 + [60]) < 3 < (2 * 9 + 60) / 10
    with pytest.raises(ValueError, match="no replies"):
        typical_words([])


def test_separated_means_nearest_own_target_above_base_and_on_topic() -> None:
    def h(target: int, w: float, reward: float = 0.8, base: float = 0.1, on_topic: float = 1.0) -> HeldOut:
        return HeldOut(target=target, words=w, reward=reward, on_topic=on_topic, base_reward=base, texts=[])

    targets = [3, 8, 20, 40]
    assert nearest_target(4.8, targets) == 3 and nearest_target(5.0, targets) == 8  # sqrt(24) = 4.9
    assert nearest_target(28.0, targets) == 20 and nearest_target(29.0, targets) == 40
    assert nearest_target(0.0, targets) == 3
    good = [h(3, 3.2), h(8, 7.0), h(20, 24.0), h(40, 33.0)]
    assert separated(good)
    assert not separated([*good[:3], h(40, 12.0)])  # the 40-word adapter collapsed towards 20
    assert not separated([*good[:3], h(40, 40.0, reward=0.1, base=0.2)])  # no better than the base
    # right length and better than the base, but most replies off topic: the adapter lost the task
    assert not separated([h(3, 3.0, reward=0.35, on_topic=0.35), *good[1:]])
    assert separated([h(3, 3.0, on_topic=0.75), *good[1:]])


def test_demo_command_on_the_tiny_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "demo"
    rc = main(["demo", "--base-model", TEST_MODEL, "--targets", "2,5", "--steps", "2", "--groups-per-step", "1",
               "--group-size", "2", "--max-tokens", "6", "--seed", "3", "--log-dir", str(d)])  # fmt: skip
    assert rc == 0
    for name in ("words-2", "words-5"):
        rows = read_metrics(d / name)
        assert [r["step"] for r in rows] == [0, 1]
        assert all(r["env/errors"] == 0 and "env/words" in r for r in rows)
    assert (d / "curves.png").stat().st_size > 0
    held = json.loads((d / "held_out.json").read_text())
    for name, target in (("words-2", 2), ("words-5", 5)):
        h = held["adapters"][name]
        assert h["target"] == target and len(h["replies"]) == 10 * HELD_OUT_SAMPLES
        assert h["typical_words"] == pytest.approx(typical_words([len(t.split()) for t in h["replies"]]))
        questions = [q for q in EVAL for _ in range(HELD_OUT_SAMPLES)]  # each question's replies together
        assert h["on_topic"] == pytest.approx(sum(map(on_topic, h["replies"], questions)) / len(questions))
    assert len(held["base_model"]["replies"]) == 10 * HELD_OUT_SAMPLES
    out = capsys.readouterr().out
    assert "RL towards [2, 5] words, 2 steps, seed 3" in out
    # each step's line shows every adapter's own row for that step (adapters run at their own pace)
    lines = {int(line.split()[0]): line for line in out.splitlines() if line[:4].strip().isdigit()}
    assert sorted(lines) == [0, 1]
    for step, line in lines.items():
        cells = [read_metrics(d / n)[step] for n in ("words-2", "words-5")]
        want = "  ".join(f"{r['reward/mean']:6.2f} / {r['env/words']:5.1f}".rjust(16) for r in cells)
        assert want in line
    assert (
        "held-out: 10 questions, 4 replies each at temperature 1" in out
        and "separated: " in out
        and "base model" in out
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--targets", "3,3"], "targets must be distinct word counts >= 1"),
        (["--targets", "0,4"], "targets must be distinct word counts >= 1"),
        (["--targets", "three"], "--targets expects comma-separated word counts"),
        (["--steps", "0"], "steps must be >= 1"),
        (["--kl-coef", "-0.1"], "--kl-coef must be a number >= 0"),
        (["--loss-fn", "nope"], "--loss-fn must be one of importance_sampling, ppo"),
    ],
)
def test_demo_usage_errors_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    assert main(["demo", "--base-model", TEST_MODEL, "--log-dir", str(tmp_path / "x"), *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()
