"""``opentinker train rl|sft`` called in-process on the tiny model: files written, task defaults
vs flags, several runs at once, resume, usage errors (exit 2, one line, no traceback), and a run
against a server subprocess through the SDK."""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from opentinker.cli.main import main
from opentinker.server.local import LocalServer
from opentinker.tracking import read_metrics
from tests.conftest import TEST_MODEL, local_server

FAST = ["--base-model", TEST_MODEL, "--extra", "eval_problems=10", "--no-progress"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("ckpts"))


def _train(*argv: str) -> int:
    return main(["train", *argv])


def test_rl_addition_writes_metrics(
    tmp_path: Path, data_dir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    d = tmp_path / "run"
    rc = _train("rl", "--task", "addition", "--steps", "2", "--log-dir", str(d), "--data-dir", data_dir,
                "--group-size", "4", *FAST)  # fmt: skip
    assert rc == 0
    rows = read_metrics(d)
    assert [r["step"] for r in rows] == [0, 1]
    assert all("reward/mean" in r for r in rows) and "eval/accuracy" in rows[-1]
    assert (d / "curves.png").stat().st_size > 0
    cfg = json.loads((d / "config.json").read_text())
    # the task's defaults apply, the flags win over them
    assert cfg["max_tokens"] == 8 and cfg["groups_per_step"] == 8  # addition's defaults
    assert cfg["group_size"] == 4 and cfg["steps"] == 2 and cfg["base_model"] == TEST_MODEL  # flags
    assert cfg["extra"] == {"eval_problems": 10}
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith("addition: 2 steps") and "reward/mean" in out[-1] and "wall" in out[-1]
    assert "eval/accuracy" in out[-1]


def test_rl_resume(tmp_path: Path, data_dir: str) -> None:
    d = str(tmp_path / "run")
    common = ["rl", "--task", "addition", "--log-dir", d, "--data-dir", data_dir, "--save-every", "1",
              "--group-size", "2", "--groups-per-step", "2", *FAST]  # fmt: skip
    assert _train(*common, "--steps", "2") == 0
    assert _train(*common, "--steps", "3", "--resume") == 0
    assert [r["step"] for r in read_metrics(d)] == [0, 1, 2]
    index = [json.loads(x) for x in (Path(d) / "checkpoints.jsonl").read_text().splitlines()]
    assert [x["step"] for x in index] == [1, 2, 3]


def test_rl_several_runs_at_once(tmp_path: Path, data_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "multi"
    rc = _train("rl", "--task", "addition", "--runs", "2", "--steps", "2", "--seed", "5", "--log-dir", str(d),
                "--data-dir", data_dir, "--group-size", "2", "--groups-per-step", "2", *FAST)  # fmt: skip
    assert rc == 0
    for run in ("seed5", "seed6"):
        assert [r["step"] for r in read_metrics(d / run)] == [0, 1]
        assert json.loads((d / run / "config.json").read_text())["seed"] == int(run[4:])
    merged = read_metrics(d)
    assert sorted((r["run"], r["step"]) for r in merged) == [
        ("seed5", 0),
        ("seed5", 1),
        ("seed6", 0),
        ("seed6", 1),
    ]
    top = json.loads((d / "config.json").read_text())
    assert set(top["runs"]) == {"seed5", "seed6"} and top["command"][:3] == ["opentinker", "train", "rl"]
    assert (d / "curves.png").exists()
    out = capsys.readouterr().out
    assert "seed5: 2 steps" in out and "seed6: 2 steps" in out and "done: 2 runs at once" in out


def test_rl_multiagent_task(tmp_path: Path, data_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "ttt"
    rc = _train("rl", "--task", "tictactoe", "--steps", "1", "--log-dir", str(d), "--data-dir", data_dir,
                "--group-size", "2", "--groups-per-step", "1", "--base-model", TEST_MODEL, "--extra",
                "eval_games=2", "--no-progress")  # fmt: skip
    assert rc == 0 and [r["step"] for r in read_metrics(d)] == [0]
    out = capsys.readouterr().out
    assert "X/reward/mean" in out and "O/reward/mean" in out
    # the same command with more steps and --resume continues from both agents' checkpoints
    rc = _train("rl", "--task", "tictactoe", "--steps", "2", "--log-dir", str(d), "--data-dir", data_dir,
                "--group-size", "2", "--groups-per-step", "1", "--base-model", TEST_MODEL, "--extra",
                "eval_games=2", "--no-progress", "--resume")  # fmt: skip
    assert rc == 0 and [r["step"] for r in read_metrics(d)] == [0, 1]


@pytest.mark.parametrize("task", ["addition_retry", "calculator", "guess_number", "reply_length"])
def test_rl_task_recipe_command_smoke(tmp_path: Path, data_dir: str, task: str) -> None:
    """Each single-agent RL task's recipe command (``opentinker train rl --task T``) on the tiny model."""
    d = tmp_path / task
    rc = _train("rl", "--task", task, "--steps", "1", "--log-dir", str(d), "--data-dir", data_dir,
                "--group-size", "2", "--groups-per-step", "1", "--max-tokens", "6", *FAST)  # fmt: skip
    assert rc == 0
    [row] = read_metrics(d)
    assert row["step"] == 0 and row["env/errors"] == 0 and "reward/mean" in row


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["rl", "--task", "no_such_task"], "unknown task 'no_such_task'; known tasks: addition"),
        (["rl", "--task", "chat_sft"], "is an SFT task"),
        (["sft", "--task", "addition"], "is an rl task"),
        (["rl", "--task", "addition", "--lr", "-1"], "learning_rate must be a positive number"),
        (["rl", "--task", "addition", "--runs", "0"], "--runs must be >= 1"),
        (["rl", "--task", "addition", "--extra", "oops"], "--extra expects KEY=VALUE"),
        (["sft", "--data", "/no/such/file.jsonl"], "no such file"),
        (["rl", "--task", "addition,addition"], "names a task twice"),
        (
            ["rl", "--task", "addition", "--server", "http://127.0.0.1:9", "--dtype", "bfloat16"],
            "--dtype is the server's choice",
        ),
    ],
)
def test_usage_errors_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert _train(*argv, "--log-dir", str(tmp_path / "x")) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()  # nothing started


def test_sft_bundled_chat(tmp_path: Path, data_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "sft"
    rc = _train("sft", "--task", "chat_sft", "--steps", "2", "--batch-size", "4", "--log-dir", str(d),
                "--data-dir", data_dir, *FAST[:2], "--no-progress")  # fmt: skip
    assert rc == 0
    rows = read_metrics(d)
    assert [r["step"] for r in rows if "loss/nll_per_token" in r] == [0, 1]
    assert "eval/nll_per_token" in rows[-1] and (d / "curves.png").exists()
    assert "chat_sft: 2 steps" in capsys.readouterr().out


def test_sft_on_a_bf16_base(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "sft"
    rc = _train("sft", "--task", "chat_sft", "--steps", "2", "--batch-size", "4", "--log-dir", str(d),
                "--data-dir", str(tmp_path / "data"), "--dtype", "bfloat16", *FAST[:2], "--no-progress")  # fmt: skip
    assert rc == 0
    rows = read_metrics(d)
    assert [r["step"] for r in rows if "loss/nll_per_token" in r] == [0, 1]
    assert "chat_sft: 2 steps" in capsys.readouterr().out


def test_sft_user_data_and_bad_lines(
    tmp_path: Path, data_dir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    good = tmp_path / "chats.jsonl"
    lines = [
        {
            "messages": [
                {"role": "user", "content": f"What is {a} + 1?"},
                {"role": "assistant", "content": str(a + 1)},
            ]
        }
        for a in range(6)
    ]
    good.write_text("".join(json.dumps(x) + "\n" for x in lines))
    d = tmp_path / "sft"
    rc = _train("sft", "--data", str(good), "--steps", "2", "--batch-size", "3", "--log-dir", str(d),
                "--data-dir", data_dir, *FAST[:2], "--no-progress")  # fmt: skip
    assert rc == 0 and len([r for r in read_metrics(d) if "loss/sum" in r]) == 2
    assert json.loads((d / "config.json").read_text())["data"] == str(good)

    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps(lines[0]) + "\n" + json.dumps({"messages": [{"role": "robot", "content": "x"}]}) + "\n"
    )
    capsys.readouterr()
    assert (
        _train("sft", "--data", str(bad), "--log-dir", str(tmp_path / "b"), "--data-dir", data_dir, *FAST[:2])
        == 2
    )
    err = capsys.readouterr().err
    assert "bad.jsonl, line 2" in err and "role" in err and "Traceback" not in err


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    with local_server(tmp_path_factory, "srv", threads=1) as srv:
        yield srv


def test_rl_against_a_server(tmp_path: Path, server: LocalServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The RL loop through the official SDK over HTTP, using only its current (not deprecated)
    methods: SDK 0.38 warns on each *_async call and on concurrent.futures use of its futures."""
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    d = tmp_path / "remote"
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        rc = _train("rl", "--task", "addition", "--steps", "2", "--log-dir", str(d), "--server", server.base_url,
                    "--api-key", "tml-cli-test-key-0001", "--group-size", "4", "--groups-per-step", "2", *FAST)  # fmt: skip
    assert [str(w.message) for w in seen if "DEPRECATED" in str(w.message)] == []
    assert rc == 0
    assert [r["step"] for r in read_metrics(d)] == [0, 1]
    index = [json.loads(x) for x in (d / "checkpoints.jsonl").read_text().splitlines()]
    assert index[-1]["path"].startswith("tinker://")


def test_server_needs_a_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("TINKER_API_KEY", raising=False)
    rc = _train(
        "rl", "--task", "addition", "--log-dir", str(tmp_path / "x"), "--server", "http://127.0.0.1:9"
    )
    assert rc == 2 and "API key" in capsys.readouterr().err
