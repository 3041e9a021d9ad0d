"""The SFT loop: per step one ``forward_backward("cross_entropy")`` + ``optim_step``, submitted
together; an eval hook; periodic checkpoints; exact resume.

It uses only the Tinker client API (any ``ServiceClient``: embedded or the SDK against a server).

Metrics (one ``metrics.jsonl`` row per step *s*, for the update from *s* to *s + 1* updates):

* ``loss/nll_per_token``: Tinker's ``cross_entropy`` is a SUM of weighted token NLLs, so the
  loop divides ``loss/sum`` by the batch's trained tokens (``train/tokens``, the sum of weights);
* ``optim/lr`` (the schedule: ``constant``, ``linear`` decay to 0, or ``cosine`` to 0),
  ``train/epoch``, ``train/datums``, ``time/step_s``;
* ``eval/nll_per_token`` (a ``forward`` over the eval set) and, when an ``evaluator`` is given,
  its metrics as ``eval/<name>``: measured on the weights *before* step *s* when
  ``s % eval_every == 0`` (always at step 0), and after the last step in an extra row
  ``step == steps`` that holds only eval metrics;
* at step 0 (or the resume step): the data counts ``data/train_examples``,
  ``data/train_truncated``, ``data/train_dropped`` (and ``data/eval_*``).

Resume (``resume=True``) reloads the last checkpoint in ``log_dir/checkpoints.jsonl`` with its
optimizer state; batches and learning rates depend only on ``(seed, step)``, so the resumed
run's metrics equal the uninterrupted run's (tested).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tinker import types

from opentinker.sft.data import Batcher, SupervisedData, trained_tokens
from opentinker.tracking.run import RunConfig, RunResult, check_at_least, open_run
from opentinker.tracking.schedule import schedule_factor

Evaluator = Callable[[Any, int], Awaitable[dict[str, float]]]  # (sampling client, step) -> metrics
Data = SupervisedData | Sequence[types.Datum]


@dataclass
class SFTConfig(RunConfig):
    """``steps`` > 0 overrides ``epochs``; ``lr_schedule`` decays to 0 at the last step."""

    log_dir: str = "runs/sft"
    plot_keys: tuple[str, ...] = ("loss/nll_per_token", "eval/nll_per_token", "eval/accuracy")
    data: str = ""  # chat JSONL for tasks that read one (``chat_sft``: "" = the bundled set)
    eval_data: str = ""
    epochs: int = 1
    batch_size: int = 16
    train_on: str = "all_assistant"  # or "last_assistant"
    max_length: int = 1024
    overlong: str = "raise"  # raise | truncate | skip (see opentinker.sft.data)
    eval_every: int = 10  # 0 = only at the start and the end
    eval_batch_size: int = 64

    def check(self) -> None:
        super().check()
        if self.train_on not in ("all_assistant", "last_assistant"):
            raise ValueError(f"train_on must be 'all_assistant' or 'last_assistant', got {self.train_on!r}")
        if self.overlong not in ("raise", "truncate", "skip"):
            raise ValueError(f"overlong must be 'raise', 'truncate' or 'skip', got {self.overlong!r}")
        check_at_least(self, 1, "epochs", "batch_size", "max_length", "eval_batch_size")
        check_at_least(self, 0, "steps", "eval_every")

    def total_steps(self, n_train: int) -> int:
        return self.steps or self.epochs * math.ceil(n_train / self.batch_size)


def lr_at(learning_rate: float, schedule: str, step: int, total: int) -> float:
    """The learning rate of update ``step`` (0-based) out of ``total`` under ``schedule`` (decaying to 0)."""
    return learning_rate * schedule_factor(schedule, step / max(1, total))


SFTResult = RunResult  # the run scaffold's result, under this loop's name


def _datums(data: Data | None) -> list[types.Datum]:
    if data is None:
        return []
    return list(data.datums) if isinstance(data, SupervisedData) else list(data)


async def eval_nll(tc: Any, data: Sequence[types.Datum], batch_size: int = 64) -> dict[str, float]:
    """Mean NLL per trained token of ``data`` under ``tc``'s current weights (``forward`` only)."""
    chunks = [list(data[i : i + batch_size]) for i in range(0, len(data), batch_size)]
    futures = [tc.forward(c, "cross_entropy") for c in chunks]
    total = sum([float((await f).metrics["loss:sum"]) for f in futures])
    tokens = trained_tokens(data)
    return {"eval/nll_per_token": total / max(1.0, tokens), "eval/tokens": tokens}


async def run_sft(
    cfg: SFTConfig,
    service: Any,
    train: Data,
    eval: Data | None = None,
    *,
    evaluator: Evaluator | None = None,
    training_client: Any | None = None,
    resume: bool = False,
) -> SFTResult:
    """Train one adapter by SFT on ``train`` (rendered ``Datum`` s, see :mod:`opentinker.sft.data`);
    write ``cfg.log_dir/{config.json, metrics.jsonl, checkpoints.jsonl, curves.png}`` (the run
    scaffold, :func:`~opentinker.tracking.run.open_run`: resume, checkpoints, final save)."""
    cfg.check()
    train_d, eval_d = _datums(train), _datums(eval)
    batcher = Batcher(len(train_d), cfg.batch_size, cfg.seed)
    total = cfg.total_steps(len(train_d))
    data_stats: dict[str, float] = {}
    for prefix, d in (("train", train), ("eval", eval)):
        if isinstance(d, SupervisedData):
            data_stats.update(d.stats(prefix))
    async with open_run(
        cfg, service, total_steps=total + bool(eval_d or evaluator), resume=resume,
        training_client=training_client, show=("loss/nll_per_token", "eval/nll_per_token", "eval/accuracy"),
    ) as run:  # fmt: skip
        for step in range(run.start, total):
            m: dict[str, float] = dict(data_stats) if step == run.start else {}
            if step == 0 or (cfg.eval_every and step % cfg.eval_every == 0):
                m.update(await _evaluate(run.tc, cfg, eval_d, evaluator, step))
            m.update(await _sft_step(run.tc, cfg, batcher, train_d, step, total))
            await run.maybe_checkpoint(step + 1)
            run.log(step, m)
        final = await _evaluate(run.tc, cfg, eval_d, evaluator, total)
        if final:
            run.log(total, final)
    return SFTResult.of(run)


async def _evaluate(
    tc: Any, cfg: SFTConfig, eval_d: list[types.Datum], evaluator: Evaluator | None, step: int
) -> dict[str, float]:
    """The eval set's NLL and the ``evaluator``'s metrics on ``tc``'s current weights (``{}``: neither)."""
    t = time.monotonic()
    out: dict[str, float] = {}
    if eval_d:
        out.update(await eval_nll(tc, eval_d, cfg.eval_batch_size))
    if evaluator is not None:
        policy = await tc.save_weights_and_get_sampling_client()
        out.update({f"eval/{k}": v for k, v in (await evaluator(policy, step)).items()})
    if out:
        out["time/eval_s"] = time.monotonic() - t
    return out


async def _sft_step(
    tc: Any, cfg: SFTConfig, batcher: Batcher, train_d: list[types.Datum], step: int, total: int
) -> dict[str, float]:
    """One update: ``forward_backward("cross_entropy")`` and ``optim_step``, submitted together."""
    t0 = time.monotonic()
    batch = batcher.batch(train_d, step)
    lr = lr_at(cfg.learning_rate, cfg.lr_schedule, step, total)
    fb = tc.forward_backward(batch, "cross_entropy")
    opt = tc.optim_step(types.AdamParams(learning_rate=lr))
    out = await fb
    await opt
    loss = float(out.metrics["loss:sum"])
    tokens = trained_tokens(batch)
    return {
        "loss/sum": loss, "loss/nll_per_token": loss / max(1.0, tokens), "train/tokens": tokens,
        "train/datums": float(len(batch)), "train/epoch": float(batcher.epoch(step)),
        "optim/lr": lr, "time/step_s": time.monotonic() - t0,
    }  # fmt: skip


def train_sft(cfg: SFTConfig, service: Any, train: Data, eval: Data | None = None, **kw: Any) -> SFTResult:
    """Synchronous entry point for :func:`run_sft`."""
    return asyncio.run(run_sft(cfg, service, train, eval, **kw))
