"""The training engine's forward as the vLLM backend's reference: it scores finished rows for the
sampler–trainer mismatch, and gives the prompt logprobs the backend returns.

**Sampler–trainer mismatch.** Given the training engine (``trainer``), every batch of finished
rows is scored again by the engine's forward on the same weights (the rows' pinned snapshot) and
the backend's ``mismatch_last`` / ``mismatch_total`` report mean and max
``|lp_vllm - lp_engine|`` on the sampled tokens and the KL estimate
(:class:`~opentinker.sampling.backend.Mismatch`, from :func:`mismatch_of`).

**Prompt logprobs** (and top-k prompt logprobs) are the raw model's, from the engine's forward
(:func:`engine_prompt_logprobs`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from opentinker.engine import Engine, EngineError
from opentinker.lora import LoRAWeights
from opentinker.sampling.backend import Mismatch
from opentinker.sampling.types import SampledSequence
from opentinker.sampling.vllm_requests import Job

# (weights or None, prompt + sampled tokens, prompt length, temperature) -> logprob of each sampled
# token under the trainer's forward, with the sampler's convention (log softmax(logits / T))
TrainerLogprobs = Callable[[list[tuple[LoRAWeights | None, list[int], int, float]]], list[list[float]]]


# (weights or None, prompt, k) -> the prompt's logprobs and top-k logprobs (the first of each None)
PromptLogprobs = Callable[
    [list[tuple[LoRAWeights | None, list[int], int]]],
    list[tuple[list[float | None], list[list[tuple[int, float]] | None]]],
]


def fill_prompt_logprobs(job: Job, scorer: PromptLogprobs | None) -> None:
    """Give ``job`` the prompt logprobs its request asks for, from ``scorer``."""
    req = job.pinned.req
    if scorer is None:
        raise EngineError(
            "prompt logprobs (and compute_logprobs) need the training engine's forward, which this "
            "vLLM sampler does not have (a sharded base sampled by vLLM holds no weights on the "
            "front-end); serve with shard_sampling='group' (--shard-sampling group) for them"
        )
    [(lps, tops)] = scorer([(job.pinned.weights, req.prompt, req.topk_prompt_logprobs)])
    if req.prompt_logprobs:
        job.prompt_logprobs = lps
    if req.topk_prompt_logprobs:
        job.topk_prompt_logprobs = tops


def mismatch_of(trainer: TrainerLogprobs, scored: list[tuple[Job, SampledSequence]]) -> Mismatch:
    """The mismatch of finished rows ``scored``: their sampled logprobs against ``trainer``'s."""
    items = [
        (
            job.pinned.weights,
            [*job.pinned.req.prompt, *seq.tokens],
            len(job.pinned.req.prompt),
            job.pinned.req.params.temperature,
        )
        for job, seq in scored
        if seq.tokens
    ]
    if not items:
        return Mismatch()
    theirs = trainer(items)
    d = torch.tensor(
        [
            t - s
            for (_, seq), lt in zip([x for x in scored if x[1].tokens], theirs, strict=True)
            for s, t in zip(seq.logprobs, lt, strict=True)
        ],
        dtype=torch.float64,
    )
    return Mismatch(
        int(d.numel()), float(d.abs().mean()), float(d.abs().max()), float((d.exp() - 1 - d).mean())
    )


def engine_logprobs(engine: Engine, *, max_rows: int = 16) -> TrainerLogprobs:
    """The training engine's forward as the mismatch reference: each row through its own weights
    (right-padded, no mask needed: causal attention never lets a real token see a pad)."""

    @torch.no_grad()
    def score(items: list[tuple[LoRAWeights | None, list[int], int, float]]) -> list[list[float]]:
        out: list[list[float]] = []
        for lo in range(0, len(items), max_rows):
            chunk = items[lo : lo + max_rows]
            order: dict[int, int] = {}
            entries: list[LoRAWeights | None] = []
            rows = []
            for w, _, _, _ in chunk:
                key = -1 if w is None else w.uid
                if key not in order:
                    order[key] = len(entries)
                    entries.append(w)
                rows.append(order[key])
            width = max(len(t) for _, t, _, _ in chunk)
            tokens = torch.zeros(len(chunk), width, dtype=torch.long, device=engine.device)
            for i, (_, t, _, _) in enumerate(chunk):
                tokens[i, : len(t)] = torch.tensor(t)
            plan = engine.lora.make_batch(entries, torch.tensor(rows, dtype=torch.long, device=engine.device))
            with engine.lora.use(plan):
                logits = engine.base.model(input_ids=tokens, use_cache=False).logits.float()
            for i, (_, t, p, temp) in enumerate(chunk):
                lg = logits[i, p - 1 : len(t) - 1]
                if temp > 0:
                    lg = lg / temp
                lp = torch.log_softmax(lg, -1).gather(-1, torch.tensor(t[p:], device=lg.device)[:, None])
                out.append(lp.squeeze(-1).tolist())
        return out

    return score


def engine_prompt_logprobs(engine: Engine) -> PromptLogprobs:
    """Prompt and top-k prompt logprobs from the training engine's forward on the same weights."""

    @torch.no_grad()
    def score(
        items: list[tuple[LoRAWeights | None, list[int], int]],
    ) -> list[tuple[list[float | None], list[list[tuple[int, float]] | None]]]:
        out: list[tuple[list[float | None], list[list[tuple[int, float]] | None]]] = []
        for w, prompt, k in items:
            plan = engine.lora.make_batch([w], torch.zeros(1, dtype=torch.long, device=engine.device))
            tokens = torch.tensor([prompt], dtype=torch.long, device=engine.device)
            with engine.lora.use(plan):
                logits = engine.base.model(input_ids=tokens, use_cache=False).logits[0].float()
            logp = torch.log_softmax(logits[:-1], -1)
            lps: list[float | None] = [None, *logp.gather(-1, tokens[0, 1:, None]).squeeze(-1).tolist()]
            tops: list[list[tuple[int, float]] | None] = [None]
            if k:
                values, indices = torch.topk(logp, min(k, logp.shape[-1]), dim=-1)
                tops += [
                    list(zip(ix, vs, strict=True))
                    for ix, vs in zip(indices.tolist(), values.tolist(), strict=True)
                ]
            out.append((lps, tops))
        return out

    return score
