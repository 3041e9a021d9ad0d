"""The tracking logger's sinks: TensorBoard event files and W&B (offline), with the keys and steps
of ``metrics.jsonl``, read back with each library's own reader; and ``rollouts.jsonl``'s budget."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from opentinker.tracking import RolloutLog, RunLogger, read_metrics

ROWS = [{"reward/mean": 0.25 * i, "loss:sum": 3.0 - i, "note": "text"} for i in range(4)]


def test_tensorboard_events_have_the_jsonl_keys_and_steps(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = RunLogger(tmp_path, {"lr": 1e-3}, progress=False, tensorboard=True)
    for step, row in enumerate(ROWS):
        log.log(step, row)
    log.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    jsonl = read_metrics(tmp_path)
    numeric = {k for k, v in jsonl[0].items() if k != "step" and isinstance(v, int | float)}
    assert set(acc.Tags()["scalars"]) == numeric
    for key in numeric:
        got = [(e.step, e.value) for e in acc.Scalars(key)]
        assert got == [(r["step"], pytest.approx(r[key], rel=1e-6)) for r in jsonl]  # fp32 in the events


def test_wandb_offline_run_has_the_jsonl_keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    log = RunLogger(tmp_path, {"lr": 1e-3}, progress=False, wandb=True, name="sinks")
    for step, row in enumerate(ROWS):
        log.log(step, row)
    log.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((tmp_path / "wandb").iterdir())
    files = list(runs[0].glob("*.wandb"))
    assert files
    # wandb 0.31 has no Python reader of its run file (its Go core writes it: LevelDB-log framed
    # protobuf records); each history item holds its key and its value as JSON, so look for them.
    # ``finish()`` returns once the core has acknowledged the exit record; the core's writer may
    # still be flushing the file then (seen on a loaded machine: only the 7-byte header on disk)
    keys = [k.encode() for k in ("reward/mean", "loss:sum", "time/elapsed_s")]
    values = [json.dumps(row["reward/mean"]).encode() for row in read_metrics(tmp_path)]
    blob = _read_when_it_holds(files[0], [*keys, *values], timeout_s=60.0)
    for needle in [*keys, *values]:
        assert needle in blob, needle
    assert b"note" not in blob  # only numbers go to the sinks


def _read_when_it_holds(path: Path, needles: list[bytes], timeout_s: float) -> bytes:
    deadline = time.monotonic() + timeout_s
    while True:
        blob = path.read_bytes()
        if all(n in blob for n in needles) or time.monotonic() > deadline:
            return blob
        time.sleep(0.2)


def _traj(reward: float, n: int) -> SimpleNamespace:
    t = SimpleNamespace(ob_T=[1, 2, 3], ac_T=list(range(4, 4 + n)), logprobs_T=[-0.5] * n, reward=reward)
    return SimpleNamespace(transitions=[t], total_reward=reward, policy_version=0)


class _Tok:
    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return " ".join(f"t{i}" for i in ids)


def test_rollouts_keep_best_and_worst_and_stop_at_the_budget(tmp_path: Path) -> None:
    log = RolloutLog(tmp_path, _Tok(), series="a", per_step=2, max_bytes=2000)
    wrote = log.log(0, [(0, _traj(r, 3), r - 0.5) for r in (0.1, 0.9, 0.5)])
    lines = [json.loads(x) for x in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    assert wrote == 2 and [e["reward"] for e in lines] == [0.9, 0.1]
    assert lines[0]["turns"][0] == {"kind": "prompt", "text": "t1 t2 t3"}
    assert lines[0]["turns"][1]["tokens"] == ["t4", "t5", "t6"]
    for step in range(1, 50):
        log.log(step, [(0, _traj(0.5, 20), 0.0)])
    text = (tmp_path / "rollouts.jsonl").read_text()
    assert len(text) <= 2000 + 200  # the budget, plus the one line that says it was reached
    assert "byte budget" in text.splitlines()[-1]
    resumed = RolloutLog(tmp_path, _Tok(), per_step=2, start_step=1)  # resume at step 1
    assert {json.loads(x)["step"] for x in resumed.path.read_text().splitlines()} == {0}
