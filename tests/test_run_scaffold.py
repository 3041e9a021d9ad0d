"""The run scaffold (``tracking/run.py``) that RL, SFT and DPO share: a run interrupted after a
checkpoint and resumed continues from the newest checkpoint; the final save happens once, at the
last step reached, and a resumed run with nothing left to do names the newest checkpoint in the
index (the checkpoint-index fallback, which DPO lacked) without saving again."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from opentinker.client import ServiceClient
from opentinker.renderers import ChatMLRenderer
from opentinker.rl.loop import RLConfig, run_rl
from opentinker.service.runtime import Runtime
from opentinker.sft.data import ChatExample, render_examples
from opentinker.sft.dpo import DPOConfig, PreferencePair, render_pairs, run_dpo
from opentinker.sft.loop import SFTConfig, run_sft
from opentinker.tasks.arithmetic import question
from opentinker.tracking import read_metrics
from opentinker.tracking.checkpoints import newest_checkpoint
from opentinker.tracking.run import Run, RunConfig
from tests.conftest import TEST_MODEL
from tests.test_rl_core import Dataset

STEPS, SAVE_EVERY, CRASH_AT = 5, 2, 2  # dies logging step 2: 3 updates done, the newest checkpoint at 2


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceClient]:
    rt = Runtime(tmp_path_factory.mktemp("scaffold-data"), max_rank=16)
    yield ServiceClient(runtime=rt)
    rt.shutdown()


@pytest.fixture(scope="module")
def renderer(service: ServiceClient) -> ChatMLRenderer:
    return ChatMLRenderer(service.runtime.base_stack(TEST_MODEL).engine.base.tokenizer)


def _problems(n: int) -> list[tuple[int, int]]:
    return [(10 + i, 21 + (7 * i) % 70) for i in range(n)]


Loop = Callable[[str, bool], Any]  # (log_dir, resume) -> the loop's result


def _rl(service: ServiceClient, renderer: ChatMLRenderer) -> Loop:
    data = Dataset([["", "", "", ""]], renderer)

    def go(log_dir: str, resume: bool) -> Any:
        cfg = RLConfig(
            base_model=TEST_MODEL, log_dir=log_dir, steps=STEPS, save_every=SAVE_EVERY, groups_per_step=1,
            group_size=4, lora_rank=4, learning_rate=1e-3, max_tokens=4, progress=False,
            rollouts_per_step=0,
        )  # fmt: skip
        return run_rl(cfg, service, data, resume=resume)

    return go


def _sft(service: ServiceClient, renderer: ChatMLRenderer) -> Loop:
    chats = [
        ChatExample(
            [{"role": "user", "content": question(a, b)}, {"role": "assistant", "content": str(a + b)}]
        )
        for a, b in _problems(8)
    ]
    data = render_examples(renderer, chats)

    def go(log_dir: str, resume: bool) -> Any:
        cfg = SFTConfig(
            base_model=TEST_MODEL, log_dir=log_dir, steps=STEPS, save_every=SAVE_EVERY, batch_size=4,
            lora_rank=4, eval_every=0, progress=False,
        )  # fmt: skip
        return run_sft(cfg, service, data, resume=resume)

    return go


def _dpo(service: ServiceClient, renderer: ChatMLRenderer) -> Loop:
    pairs = [
        PreferencePair(
            [{"role": "user", "content": question(a, b)}],
            {"role": "assistant", "content": str(a + b)},
            {"role": "assistant", "content": str(a + b + 10)},
        )
        for a, b in _problems(4)
    ]
    data = render_pairs(renderer, pairs)

    def go(log_dir: str, resume: bool) -> Any:
        cfg = DPOConfig(
            base_model=TEST_MODEL, log_dir=log_dir, steps=STEPS, save_every=SAVE_EVERY, batch_size=2,
            lora_rank=4, progress=False,
        )  # fmt: skip
        return run_dpo(cfg, service, data, resume=resume)

    return go


class _Killed(RuntimeError):
    pass


def _index_steps(log_dir: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (log_dir / "checkpoints.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("make", [_rl, _sft, _dpo], ids=["rl", "sft", "dpo"])
def test_interrupted_run_resumes_from_the_newest_checkpoint(
    make: Callable[[ServiceClient, ChatMLRenderer], Loop],
    service: ServiceClient,
    renderer: ChatMLRenderer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    go, log_dir = make(service, renderer), tmp_path / "run"
    log_row = Run.log

    def dies(self: Run, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        if step == CRASH_AT:
            raise _Killed(f"killed while logging step {step}")
        return log_row(self, step, metrics)

    with monkeypatch.context() as m:
        m.setattr(Run, "log", dies)
        with pytest.raises(_Killed):
            asyncio.run(go(str(log_dir), False))
    assert _index_steps(log_dir) == [2]  # no final save after a crash
    assert [r["step"] for r in read_metrics(log_dir)] == [0, 1]

    res = asyncio.run(go(str(log_dir), True))
    assert [r["step"] for r in res.metrics] == [2, 3, 4]  # from the newest checkpoint, step 2
    assert [r["step"] for r in read_metrics(log_dir)] == [0, 1, 2, 3, 4]
    assert _index_steps(log_dir) == [2, 4, 5]  # the cadence, then the final save at the end
    assert res.final_path == newest_checkpoint(log_dir / "checkpoints.jsonl")[1][""]
    assert (log_dir / "curves.png").exists()

    again = asyncio.run(go(str(log_dir), True))  # nothing left to do: the index names the checkpoint
    assert again.metrics == [] and again.final_path == res.final_path
    assert _index_steps(log_dir) == [2, 4, 5]  # not saved again


@pytest.mark.parametrize("make", [_sft, _dpo], ids=["sft", "dpo"])
def test_the_final_save_is_skipped_when_the_cadence_saved_the_last_step(
    make: Callable[[ServiceClient, ChatMLRenderer], Loop],
    service: ServiceClient,
    renderer: ChatMLRenderer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("tests.test_run_scaffold.STEPS", 4)
    res = asyncio.run(make(service, renderer)(str(tmp_path / "run"), False))
    assert _index_steps(tmp_path / "run") == [2, 4]
    assert res.final_path == newest_checkpoint(tmp_path / "run" / "checkpoints.jsonl")[1][""]


@pytest.mark.parametrize("kind", [RLConfig, SFTConfig, DPOConfig])
@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"lora_rank": 0}, "lora_rank must be >= 1, got 0"),
        ({"save_every": -1}, "save_every must be >= 0, got -1"),
        ({"learning_rate": float("nan")}, "learning_rate must be a positive number, got nan"),
        ({"learning_rate": 0.0}, "learning_rate must be a positive number, got 0.0"),
        ({"lr_schedule": "step"}, "lr_schedule"),
    ],
)
def test_every_run_config_refuses_the_shared_fields_alike(
    kind: type[RunConfig], bad: dict[str, Any], message: str
) -> None:
    """The three loops' configs share one base: its fields, and the same refusal of each bad value."""
    assert issubclass(kind, RunConfig)
    kind().check()  # the defaults pass
    with pytest.raises(ValueError, match=message):
        kind(**bad).check()
