"""SFT: chat JSONL loading and its errors, renderer masks in datums, batching, the SFT loop (loss,
eval hook, checkpoints, exact resume), the ``chat_sft`` task and its bundled data, DPO."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

import opentinker
from opentinker.client import Runtime
from opentinker.models import BaseModel
from opentinker.renderers import Renderer, get_renderer
from opentinker.sft.data import Batcher, ChatExample, read_chat_jsonl, render_examples
from opentinker.sft.loop import SFTConfig, lr_at, train_sft
from opentinker.tasks import get_task
from opentinker.tasks.arithmetic import eval_problems, question
from opentinker.tracking import read_metrics
from tests.conftest import TEST_MODEL
from tests.tolerances import ELEMENTWISE_REL, assert_scalar_close

GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


@pytest.fixture(scope="module")
def renderer(tiny_base: BaseModel) -> Renderer:
    return get_renderer("auto", tiny_base.tokenizer)


@pytest.fixture
def runtime(tmp_path: Path):
    rt = Runtime(tmp_path / "data")
    yield rt
    rt.shutdown()


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def _addition_chats(n: int, start: int = 10) -> list[ChatExample]:
    out = []
    for i in range(n):
        a, b = start + i, 21 + (7 * i) % 70
        out.append(
            ChatExample(
                [{"role": "user", "content": question(a, b)}, {"role": "assistant", "content": str(a + b)}],
                f"ex{i}",
            )
        )
    return out


# ------------------------------------------------------------------ JSONL loading
@pytest.mark.parametrize(
    ("bad", "needle"),
    [
        ('{"messages": [', "invalid JSON"),
        ('["not", "an", "object"]', "expected a JSON object"),
        ('{"msgs": []}', "missing 'messages'"),
        ('{"messages": "hello"}', "non-empty list"),
        ('{"messages": [{"role": "robot", "content": "x"}]}', "role must be one of"),
        ('{"messages": [{"role": "user", "content": 3}]}', "content must be a string"),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path: Path, bad: str, needle: str) -> None:
    path = _write(tmp_path / "chat.jsonl", [json.dumps(GOOD), "", bad, json.dumps(GOOD)])
    with pytest.raises(ValueError, match=needle) as e:
        read_chat_jsonl(path)
    assert "line 3" in str(e.value) and str(path) in str(e.value)


def test_blank_lines_are_skipped_and_sources_kept(tmp_path: Path) -> None:
    path = _write(tmp_path / "chat.jsonl", ["", json.dumps(GOOD), "   ", json.dumps(GOOD)])
    exs = read_chat_jsonl(path)
    assert [e.where for e in exs] == [f"{path}, line 2", f"{path}, line 4"]
    assert exs[0].messages == GOOD["messages"]
    with pytest.raises(ValueError, match="empty"):
        read_chat_jsonl(_write(tmp_path / "empty.jsonl", [""]))
    with pytest.raises(FileNotFoundError):
        read_chat_jsonl(tmp_path / "missing.jsonl")


# ------------------------------------------------------------------ renderer masks -> datums
def test_weights_mask_lands_in_datum(renderer: Renderer) -> None:
    msgs: list[Any] = [
        {"role": "user", "content": "What is 12 + 30? Answer with just the number."},
        {"role": "assistant", "content": "42"},
        {"role": "user", "content": "What is 11 + 22? Answer with just the number."},
        {"role": "assistant", "content": "33"},
    ]
    ex = [ChatExample(msgs, "conv")]
    for train_on, trained in (("all_assistant", ["42", "33"]), ("last_assistant", ["33"])):
        tokens, weights = renderer.build_supervised_example(msgs, train_on)  # type: ignore[arg-type]
        (d,) = render_examples(renderer, ex, train_on=train_on).datums  # type: ignore[arg-type]
        # Tinker's shift: input tokens[:-1], targets tokens[1:], weights of the targets
        assert d.model_input.to_ints() == tokens[:-1]
        assert d.loss_fn_inputs["target_tokens"].tolist() == tokens[1:]
        assert d.loss_fn_inputs["weights"].tolist() == weights[1:]
        assert set(weights) == {0.0, 1.0}
        # the trained tokens are exactly the trained assistant bodies (content + <|im_end|>)
        spans, cur = [], []
        for t, w in zip(tokens, weights, strict=True):
            if w:
                cur.append(t)
            elif cur:
                spans.append(renderer.decode(cur))
                cur = []
        assert spans == [f"{a}<|im_end|>" for a in trained]
        # the context (system, user turns, headers) is never trained
        first_one = weights.index(1.0)
        assert renderer.decode(tokens[:first_one]).endswith("<|im_start|>assistant\n")


def test_overlong_raise_truncate_skip(renderer: Renderer) -> None:
    exs = _addition_chats(3)
    n = len(renderer.build_supervised_example(exs[0].messages)[0])
    with pytest.raises(ValueError, match="ex0") as e:
        render_examples(renderer, exs, max_length=n - 1)
    assert "max_length" in str(e.value)
    cut = render_examples(renderer, exs, max_length=n - 2, overlong="truncate")
    assert cut.truncated == 3 and cut.dropped == 0 and all(d.model_input.length == n - 3 for d in cut.datums)
    # cut before the answer: nothing left to train on -> dropped, counted
    gone = render_examples(renderer, exs, max_length=n - 6, overlong="truncate")
    assert len(gone) == 0 and gone.dropped == 3
    skipped = render_examples(renderer, exs, max_length=n - 1, overlong="skip")
    assert len(skipped) == 0 and skipped.dropped == 3
    assert skipped.stats("train")["data/train_dropped"] == 3.0


def test_batcher_is_seeded_per_epoch_and_covers_every_example() -> None:
    b = Batcher(10, 4, seed=3)
    assert b.steps_per_epoch == 3
    epoch0 = [i for s in range(3) for i in b.indices(s)]
    epoch1 = [i for s in range(3, 6) for i in b.indices(s)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(10)) and epoch0 != epoch1
    fresh = Batcher(10, 4, seed=3)
    assert [fresh.indices(s) for s in (5, 0, 4)] == [b.indices(5), b.indices(0), b.indices(4)]
    assert Batcher(10, 4, seed=4).indices(0) != b.indices(0)


def test_lr_schedules() -> None:
    assert [lr_at(1.0, "linear", s, 4) for s in range(4)] == [1.0, 0.75, 0.5, 0.25]
    assert lr_at(1.0, "cosine", 0, 4) == 1.0 and math.isclose(lr_at(1.0, "cosine", 2, 4), 0.5)
    assert lr_at(1.0, "constant", 3, 4) == 1.0
    with pytest.raises(ValueError, match="lr_schedule"):
        SFTConfig(lr_schedule="step").check()


# ------------------------------------------------------------------ the loop
def _cfg(tmp_path: Path, name: str, **kw: Any) -> SFTConfig:
    base: dict[str, Any] = {
        "base_model": TEST_MODEL, "log_dir": str(tmp_path / name), "batch_size": 8, "learning_rate": 3e-3,
        "lr_schedule": "constant", "lora_rank": 4, "progress": False, "seed": 0,
    }  # fmt: skip
    return SFTConfig(**{**base, **kw})


def test_loss_decreases_and_eval_hook_logs(tmp_path: Path, runtime: Runtime, renderer: Renderer) -> None:
    service = opentinker.ServiceClient(runtime=runtime)
    train = render_examples(renderer, _addition_chats(8))
    eval_set = render_examples(renderer, _addition_chats(8))  # = the train set: eval is checkable
    calls: list[int] = []

    async def evaluator(policy: Any, step: int) -> dict[str, float]:
        calls.append(step)
        return {"custom": float(step)}

    cfg = _cfg(tmp_path, "run", steps=8, eval_every=3)
    res = train_sft(cfg, service, train, eval_set, evaluator=evaluator)
    rows = read_metrics(cfg.log_dir)
    assert [r["step"] for r in rows] == list(range(9))
    losses = [r["loss/nll_per_token"] for r in rows[:8]]
    assert losses[-1] < 0.6 * losses[0], losses  # same 8 examples every step: it learns them
    # loss/nll_per_token = Tinker's SUM / trained tokens (answer digits + <|im_end|>)
    assert rows[0]["train/tokens"] == sum(sum(d.loss_fn_inputs["weights"].tolist()) for d in train.datums)
    assert math.isclose(rows[0]["loss/nll_per_token"], rows[0]["loss/sum"] / rows[0]["train/tokens"])
    # eval before steps 0 and 3, and after the last one (a row of its own)
    assert [r["step"] for r in rows if "eval/nll_per_token" in r] == [0, 3, 6, 8] == calls
    assert [r["eval/custom"] for r in rows if "eval/custom" in r] == [0.0, 3.0, 6.0, 8.0]
    # eval before step s = the loss of step s (one full batch: the same data, the same weights)
    for r in rows[:8]:
        if "eval/nll_per_token" in r:
            assert_scalar_close(r["eval/nll_per_token"], r["loss/nll_per_token"])
    assert rows[-1]["eval/nll_per_token"] < 0.6 * rows[0]["eval/nll_per_token"]
    assert rows[0]["data/train_examples"] == 8 and rows[0]["data/eval_examples"] == 8
    assert set(rows[-1]) == {
        "step",
        "time/elapsed_s",
        "eval/nll_per_token",
        "eval/tokens",
        "eval/custom",
        "time/eval_s",
    }
    log_dir = Path(cfg.log_dir)
    assert json.loads((log_dir / "config.json").read_text())["train_on"] == "all_assistant"
    assert (log_dir / "curves.png").stat().st_size > 0
    ckpts = [json.loads(x) for x in (log_dir / "checkpoints.jsonl").read_text().splitlines()]
    assert ckpts == [{"step": 8, "path": res.final_path}]


class _Crash(RuntimeError):
    pass


class _CrashingClient:
    """Delegates to a training client; the ``crash_at``-th forward_backward raises (a killed run)."""

    def __init__(self, tc: Any, crash_at: int) -> None:
        self._tc, self._left = tc, crash_at

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tc, name)

    def forward_backward(self, *a: Any, **k: Any) -> Any:
        self._left -= 1
        if self._left < 0:
            raise _Crash("killed")
        return self._tc.forward_backward(*a, **k)


def test_resume_equals_uninterrupted(tmp_path: Path, runtime: Runtime, renderer: Renderer) -> None:
    service = opentinker.ServiceClient(runtime=runtime)
    train = render_examples(renderer, _addition_chats(12))
    eval_set = render_examples(renderer, _addition_chats(4, start=60))
    kw: dict[str, Any] = {
        "steps": 7,
        "batch_size": 5,
        "eval_every": 2,
        "save_every": 2,
        "lr_schedule": "cosine",
    }
    full = _cfg(tmp_path, "full", **kw)
    train_sft(full, service, train, eval_set)

    cut = _cfg(tmp_path, "cut", **kw)
    tc = service.create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=0, train_unembed=False)
    with pytest.raises(_Crash):  # dies in step 5, after the checkpoint of step 4
        train_sft(cut, service, train, eval_set, training_client=_CrashingClient(tc, 5))
    assert [r["step"] for r in read_metrics(cut.log_dir)] == [0, 1, 2, 3, 4]
    res = train_sft(cut, service, train, eval_set, resume=True)
    assert [r["step"] for r in res.metrics] == [4, 5, 6, 7]  # reloaded after 4 updates

    a, b = read_metrics(full.log_dir), read_metrics(cut.log_dir)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(8))
    keys = ("loss/sum", "loss/nll_per_token", "eval/nll_per_token", "optim/lr", "train/tokens", "train/epoch")
    for ra, rb in zip(a, b, strict=True):
        assert {k for k in keys if k in ra} == {k for k in keys if k in rb}
        for k in keys:
            if k in ra:
                assert_scalar_close(rb[k], ra[k], ELEMENTWISE_REL)  # the same computations, reloaded
    steps = [
        json.loads(x)["step"] for x in (Path(cut.log_dir) / "checkpoints.jsonl").read_text().splitlines()
    ]
    assert steps == [2, 4, 6, 7]


# ------------------------------------------------------------------ the chat_sft task
def test_chat_sft_task_bundled_data_excludes_held_out_problems(renderer: Renderer) -> None:
    spec = get_task("chat_sft")
    assert spec.kind == "sft"
    train, eval_set = spec.build()(renderer, SFTConfig(train_on="last_assistant"))
    assert len(train) == 500 and eval_set is not None and len(eval_set) == 100
    from opentinker.tasks.chat import BUNDLED_EVAL, BUNDLED_TRAIN

    held_out = {question(a, b) for a, b in eval_problems()}
    asked = [
        m["content"] for p in (BUNDLED_TRAIN, BUNDLED_EVAL) for ex in read_chat_jsonl(p) for m in ex.messages
        if m["role"] == "user"
    ]  # fmt: skip
    assert len(asked) > 600 and not held_out & set(asked) and len(set(asked)) == len(asked)
    assert all(q.endswith("? Answer with just the number.") for q in asked)
    multi = [ex for ex in read_chat_jsonl(BUNDLED_TRAIN) if len(ex.messages) > 2]
    assert multi  # multi-turn lines: last_assistant trains on the last answer only
    (d,) = render_examples(renderer, multi[:1], train_on="last_assistant").datums
    answer = multi[0].messages[-1]["content"]
    trained = [
        t
        for t, w in zip(
            d.loss_fn_inputs["target_tokens"].tolist(), d.loss_fn_inputs["weights"].tolist(), strict=True
        )
        if w
    ]
    assert renderer.decode(trained) == f"{answer}<|im_end|>"


# ------------------------------------------------------------------ DPO
def test_preference_jsonl_errors_name_line(tmp_path: Path) -> None:
    from opentinker.sft.dpo import read_pairs_jsonl

    good = {"prompt": GOOD["messages"][:1], "chosen": GOOD["messages"][1], "rejected": GOOD["messages"][1]}
    bad_role = {**good, "rejected": {"role": "user", "content": "x"}}
    for bad, needle in (("{", "invalid JSON"), (json.dumps({"prompt": []}), "missing 'chosen'"),
                        (json.dumps(bad_role), "rejected: role must be 'assistant'")):  # fmt: skip
        path = _write(tmp_path / "pairs.jsonl", [json.dumps(good), "", bad])
        with pytest.raises(ValueError, match=needle) as e:
            read_pairs_jsonl(path)
        assert "line 3" in str(e.value)
    assert len(read_pairs_jsonl(_write(tmp_path / "ok.jsonl", [json.dumps(good)] * 2))) == 2


def test_dpo_loss_falls_and_margin_grows(tmp_path: Path, runtime: Runtime, renderer: Renderer) -> None:
    from opentinker.sft.dpo import DPOConfig, PreferencePair, render_pairs, train_dpo

    pairs = [
        PreferencePair(
            [{"role": "user", "content": question(a, b)}],
            {"role": "assistant", "content": str(a + b)},
            {"role": "assistant", "content": str(a + b + 10)},
        )
        for a, b in ((12, 34), (25, 47), (61, 18), (33, 29), (70, 15), (44, 44))
    ]
    data = render_pairs(renderer, pairs)
    assert len(data) == 6 and len(data.datums) == 12
    cfg = DPOConfig(
        base_model=TEST_MODEL, log_dir=str(tmp_path / "dpo"), beta=0.5, steps=6, batch_size=6,
        learning_rate=3e-3, lr_schedule="constant", lora_rank=4, progress=False,
    )  # fmt: skip
    service = opentinker.ServiceClient(runtime=runtime)
    res = train_dpo(cfg, service, data)
    rows = read_metrics(cfg.log_dir)
    assert [r["step"] for r in rows] == list(range(6))
    # step 0: the policy is the base model (LoRA B = 0), the reference too: no margin yet
    assert abs(rows[0]["dpo/margin"]) < 1e-3 and math.isclose(rows[0]["dpo/loss"], math.log(2), rel_tol=1e-3)
    assert rows[-1]["dpo/loss"] < 0.8 * rows[0]["dpo/loss"], [r["dpo/loss"] for r in rows]
    assert rows[-1]["dpo/margin"] > 0.5 and rows[-1]["dpo/accuracy"] == 1.0
    assert rows[-1]["dpo/chosen_reward"] > rows[-1]["dpo/rejected_reward"]
    assert res.final_path is not None and (Path(cfg.log_dir) / "curves.png").exists()


def test_chat_sft_task_reads_a_user_file(tmp_path: Path, renderer: Renderer) -> None:
    from opentinker.tasks.chat import build

    path = _write(tmp_path / "mine.jsonl", [json.dumps(GOOD)] * 3)
    train, eval_set = build(renderer, SFTConfig(data=str(path)))
    assert len(train) == 3 and eval_set is None and train.sources[2] == f"{path}, line 3"
    _write(path, [json.dumps(GOOD), '{"messages": [{"role": "user", "content": "only a question"}]}'])
    with pytest.raises(ValueError, match="line 2.*at least one assistant"):
        build(renderer, SFTConfig(data=str(path)))
