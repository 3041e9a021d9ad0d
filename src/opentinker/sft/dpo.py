"""DPO (direct preference optimization) on preference pairs, through ``forward_backward_custom``.

Data: JSONL, one pair per line::

    {"prompt": [{"role": "user", "content": "..."}, ...],
     "chosen": {"role": "assistant", "content": "..."},
     "rejected": {"role": "assistant", "content": "..."}}

(a malformed line raises ``ValueError`` naming the file and line, as for chat JSONL). Each pair
becomes two datums, ``prompt + chosen`` and ``prompt + rejected``, with weight 1 on the response
(content and end marker) and 0 on the prompt.

Loss, per pair, with sequence logprobs summed over the response tokens::

    margin = beta * ((logpi(chosen) - logref(chosen)) - (logpi(rejected) - logref(rejected)))
    loss   = -log sigmoid(margin)            (mean over the batch's pairs)

The reference logprobs are computed once, before training, with ``compute_logprobs`` on a
reference sampling client: the base model by default (``service.create_sampling_client(
base_model=...)``), or any sampling client passed as ``reference`` (e.g. an SFT checkpoint's).
The loss runs through ``TrainingClient.forward_backward_custom`` (a forward for the logprobs, the
loss and its gradient on the client, a linear backward on the server), followed by ``optim_step``.

Metrics per step: ``dpo/loss``, ``dpo/margin`` (mean of the margin before ``beta``: the
implicit reward gap, in nats), ``dpo/accuracy`` (pairs with chosen > rejected),
``dpo/chosen_reward`` and ``dpo/rejected_reward`` (``logpi - logref`` of each), ``optim/lr``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tinker import types

from opentinker.data import supervised_datum
from opentinker.renderers import Message, Renderer, check_messages
from opentinker.sft.data import Batcher, read_jsonl
from opentinker.sft.loop import lr_at
from opentinker.tracking.run import RunConfig, RunResult, check_at_least, check_positive, open_run


@dataclass
class PreferencePair:
    prompt: list[Message]
    chosen: Message
    rejected: Message
    where: str = ""


def parse_pair_record(obj: Any, where: str) -> PreferencePair:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    missing = [k for k in ("prompt", "chosen", "rejected") if k not in obj]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(repr(k) for k in missing)}")
    try:
        check_messages(obj["prompt"], where="prompt")
        for k in ("chosen", "rejected"):
            check_messages([obj[k]], where=k)
            if obj[k]["role"] != "assistant":
                raise ValueError(f"{k}: role must be 'assistant', got {obj[k]['role']!r}")
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return PreferencePair(
        [_message(m) for m in obj["prompt"]], _message(obj["chosen"]), _message(obj["rejected"]), where
    )


def _message(m: dict[str, Any]) -> Message:
    return {"role": m["role"], "content": m["content"]}


def read_pairs_jsonl(path: str | Path) -> list[PreferencePair]:
    return read_jsonl(path, parse_pair_record, "preference")


@dataclass
class PairData:
    """Rendered pairs: ``datums[2k]`` is pair k's chosen sequence, ``datums[2k + 1]`` its rejected one."""

    datums: list[types.Datum]
    tokens: list[list[int]]
    weights: list[list[float]]
    sources: list[str]

    def __len__(self) -> int:
        return len(self.sources)


def render_pairs(
    renderer: Renderer, pairs: Sequence[PreferencePair], max_length: int | None = None
) -> PairData:
    out = PairData([], [], [], [])
    for p in pairs:
        for resp in (p.chosen, p.rejected):
            try:
                tokens, weights = renderer.build_supervised_example([*p.prompt, resp], "last_assistant")
            except ValueError as e:
                raise ValueError(f"{p.where or 'pair'}: {e}") from None
            if max_length is not None and len(tokens) > max_length:
                raise ValueError(
                    f"{p.where or 'pair'}: {len(tokens)} tokens, more than max_length={max_length}"
                )
            out.datums.append(supervised_datum(tokens, weights))
            out.tokens.append(tokens)
            out.weights.append(weights)
        out.sources.append(p.where)
    return out


@dataclass
class DPOConfig(RunConfig):
    """``steps`` > 0 overrides ``epochs``."""

    log_dir: str = "runs/dpo"
    learning_rate: float = 1e-5
    plot_keys: tuple[str, ...] = ("dpo/loss", "dpo/margin", "dpo/accuracy")
    data: str = ""
    beta: float = 0.1
    epochs: int = 1
    batch_size: int = 8  # pairs per step
    max_length: int = 1024

    def check(self) -> None:
        super().check()
        check_at_least(self, 1, "epochs", "batch_size", "max_length")
        check_at_least(self, 0, "steps")
        check_positive(self, "beta")


DPOResult = RunResult  # the run scaffold's result, under this loop's name


async def reference_logprobs(reference: Any, data: PairData) -> list[float]:
    """Per sequence: the reference's summed logprob of its weighted (response) tokens."""

    async def one(tokens: list[int], weights: list[float]) -> float:
        lps = await reference.compute_logprobs(types.ModelInput.from_ints(tokens))
        return float(sum(w * float(lp) for lp, w in zip(lps[1:], weights[1:], strict=True) if w))

    return list(await asyncio.gather(*(one(t, w) for t, w in zip(data.tokens, data.weights, strict=True))))


def dpo_loss(beta: float, ref: Sequence[float]):
    """The ``forward_backward_custom`` loss for a batch laid out chosen, rejected, chosen, …;
    ``ref`` holds the matching reference sums in the same order."""

    def loss_fn(
        data: list[types.Datum], logprobs: list[torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        seq = torch.stack(
            [
                (lp * d.loss_fn_inputs["weights"].to_torch()).sum()
                for d, lp in zip(data, logprobs, strict=True)
            ]
        )
        delta = seq - torch.tensor(list(ref), dtype=seq.dtype)
        chosen, rejected = delta[0::2], delta[1::2]
        gap = chosen - rejected
        loss = -torch.nn.functional.logsigmoid(beta * gap).mean()
        g = gap.detach()
        return loss, {
            "dpo/loss": float(loss.detach()),
            "dpo/margin": float(g.mean()),
            "dpo/accuracy": float((g > 0).float().mean()),
            "dpo/chosen_reward": float(chosen.detach().mean()),
            "dpo/rejected_reward": float(rejected.detach().mean()),
        }

    return loss_fn


async def run_dpo(
    cfg: DPOConfig,
    service: Any,
    pairs: PairData,
    *,
    reference: Any | None = None,
    training_client: Any | None = None,
    resume: bool = False,
) -> DPOResult:
    """Train one adapter by DPO on rendered ``pairs``; write ``cfg.log_dir/{config.json,
    metrics.jsonl, checkpoints.jsonl, curves.png}``. Resume as :func:`opentinker.sft.loop.run_sft`
    (the run scaffold, :func:`~opentinker.tracking.run.open_run`)."""
    cfg.check()
    batcher = Batcher(len(pairs), cfg.batch_size, cfg.seed)
    total = cfg.steps or cfg.epochs * batcher.steps_per_epoch
    async with open_run(
        cfg, service, total_steps=total, resume=resume, training_client=training_client,
        show=("dpo/loss", "dpo/margin", "dpo/accuracy"),
    ) as run:  # fmt: skip
        if reference is None:
            reference = await service.create_sampling_client(base_model=cfg.base_model)
        ref = await reference_logprobs(reference, pairs)
        for step in range(run.start, total):
            t0 = time.monotonic()
            idx = batcher.indices(step)
            seqs = [j for i in idx for j in (2 * i, 2 * i + 1)]
            lr = lr_at(cfg.learning_rate, cfg.lr_schedule, step, total)
            fb = run.tc.forward_backward_custom(
                [pairs.datums[j] for j in seqs], dpo_loss(cfg.beta, [ref[j] for j in seqs])
            )
            opt = run.tc.optim_step(types.AdamParams(learning_rate=lr))
            out = await fb
            await opt
            m = {k: float(v) for k, v in out.metrics.items() if k.startswith("dpo/")}
            m.update({"train/pairs": float(len(idx)), "optim/lr": lr, "time/step_s": time.monotonic() - t0})
            await run.maybe_checkpoint(step + 1)
            run.log(step, m)
    return DPOResult.of(run)


def train_dpo(cfg: DPOConfig, service: Any, pairs: PairData, **kw: Any) -> DPOResult:
    """Synchronous entry point for :func:`run_dpo`."""
    return asyncio.run(run_dpo(cfg, service, pairs, **kw))
