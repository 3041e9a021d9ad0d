"""Choosing tokens from logits: the SDK's ``SamplingParams`` (temperature, top-k, top-p, seeds)
and the logprobs the sampler reports.

A sampled token's logprob is ``log softmax(logits / T)`` of that token (T = 1 when greedy), so at
T = 1 it equals the trainer's logprob of it (invariant 3); top-k / top-p only restrict which tokens
can be drawn. Likewise the ``banned`` ids (a VL base model's image and vision markers, which a
completion must never contain: it could not go back into a datum as text) are never chosen, not
even greedily, while the logprob reported stays the unmasked one. Every row draws its uniforms
from its own seeded generator, so a row's tokens do not depend on which other rows share its
batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from opentinker.sampling.grammar import Matcher, masked, penalized
from opentinker.sampling.types import SampleRequest, SampleResult, SamplingParams, StopReason

UNIFORM_CHUNK = 64  # uniforms drawn at once from a row's generator


@dataclass
class Row:
    """One sequence being decoded."""

    req: int  # its request's id in the batch
    policy: str | None  # its slot in the batch's routing plan
    params: SamplingParams
    prompt_len: int
    gen: torch.Generator
    stop_ids: frozenset[int]
    stop_strs: tuple[str, ...]
    sample: int = 0  # which of its request's num_samples rows
    topk: int = 0  # top-k logprobs to report at each sampled position (0 = none)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    topk_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    reason: StopReason | None = None
    matcher: Matcher | None = None  # its grammar's state (sampling/grammar.py), made on first use
    _uniforms: list[float] = field(default_factory=list)

    def uniform(self) -> float:
        """The next U[0, 1) draw of this row's own generator (drawn 64 at a time): a row's draws do
        not depend on which other rows share its batch (same seed and request -> same tokens)."""
        if not self._uniforms:
            self._uniforms = torch.rand(UNIFORM_CHUNK, generator=self.gen, dtype=torch.float64).tolist()[::-1]
        return self._uniforms.pop()


def shaped(logits_SV: torch.Tensor, rows: list[Row]) -> torch.Tensor:
    """``logits_SV`` with each shaped row's penalties, bias and grammar mask applied (its
    choice, logprob and top logprobs are then under that distribution: sampling/grammar.py);
    the very tensor when no row is shaped, so unshaped batches are bitwise unchanged."""
    if not any(row.params.shaped for row in rows):
        return logits_SV
    out, matchers = logits_SV.clone(), []
    for j, row in enumerate(rows):
        p = row.params
        if p.presence_penalty or p.frequency_penalty:
            out[j] = penalized(out[j], row.tokens, p.presence_penalty, p.frequency_penalty)
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias], device=out.device)
            out[j, ids] += torch.tensor([b for _, b in p.logit_bias], dtype=out.dtype, device=out.device)
        if p.grammar is not None:
            if row.matcher is None:
                row.matcher = Matcher(p.grammar, out.shape[-1])
            row.matcher.feed(row.tokens)
            matchers.append((j, row.matcher))
    return masked(out, matchers) if matchers else out


def choose_tokens(
    logits_SV: torch.Tensor, rows: list[Row], banned: torch.Tensor | None = None
) -> list[tuple[int, float]]:
    """Pick one token per row (rows sharing sampling parameters are processed together), never one
    of ``banned`` (token ids; None = none); return each with its logprob under softmax(logits / T)
    (T = 1 when greedy), the unmasked distribution, as the trainer computes it."""
    groups: dict[tuple[float, int, float], list[int]] = {}
    for j, row in enumerate(rows):
        p = row.params
        groups.setdefault((p.temperature, p.top_k, p.top_p), []).append(j)
    if len(groups) == 1:  # every row alike: no gather, no scatter back
        [(key, _)] = groups.items()
        return _choose(logits_SV, rows, *key, banned)
    out: list[tuple[int, float]] = [(0, 0.0)] * len(rows)
    for key, idx in groups.items():
        for j, picked in zip(idx, _choose(logits_SV[idx], [rows[j] for j in idx], *key, banned), strict=True):
            out[j] = picked
    return out


def _choose(
    logits: torch.Tensor, rows: list[Row], temp: float, top_k: int, top_p: float, banned: torch.Tensor | None
) -> list[tuple[int, float]]:
    """One token per row of ``logits`` [n, V] under one set of sampling parameters."""
    if temp == 0:
        toks = (logits if banned is None else logits.index_fill(-1, banned, -math.inf)).argmax(-1)
        lps = torch.log_softmax(logits, -1).gather(-1, toks[:, None]).squeeze(-1)
        return list(zip(toks.tolist(), lps.tolist(), strict=True))
    logp = torch.log_softmax(logits if temp == 1 else logits / temp, -1)
    filtered = logp if banned is None else logp.index_fill(-1, banned, -math.inf)
    if 0 < top_k < logp.shape[-1]:
        kth = torch.topk(filtered, top_k, dim=-1).values[:, -1:]
        filtered = filtered.masked_fill(filtered < kth, -math.inf)
    if top_p < 1.0:
        sorted_lp, order = torch.sort(filtered, dim=-1, descending=True)
        probs = sorted_lp.softmax(-1)
        before = probs.cumsum(-1) - probs  # mass strictly before each token
        drop_sorted = before >= top_p  # keeps the smallest prefix reaching top_p (>= 1 token)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)  # vocab order
        filtered = filtered.masked_fill(drop, -math.inf)
    # inverse CDF of the kept tokens' (unnormalised) probabilities at one uniform per row
    cdf = (filtered.exp() if filtered is logp else filtered.softmax(-1)).cumsum(-1)  # [n, V]
    u = torch.tensor([row.uniform() for row in rows], dtype=cdf.dtype, device=cdf.device)
    toks = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).squeeze(-1).clamp_(max=cdf.shape[-1] - 1)
    lps = logp.gather(-1, toks[:, None]).squeeze(-1)
    return list(zip(toks.tolist(), lps.tolist(), strict=True))


def topk_logprobs(logits_SV: torch.Tensor, rows: list[Row]) -> list[list[tuple[int, float]] | None]:
    """For each row asking for them (``row.topk`` > 0), the ``topk`` most likely (token, logprob)
    of ``logits_SV`` [S, V] under the distribution its sampled logprob uses (softmax(logits / T),
    T = 1 when greedy); None for the other rows."""
    out: list[list[tuple[int, float]] | None] = [None] * len(rows)
    for j, row in enumerate(rows):
        if row.topk <= 0:
            continue
        temp = row.params.temperature
        logits = logits_SV[j] if temp in (0, 1) else logits_SV[j] / temp
        values, indices = torch.topk(torch.log_softmax(logits, -1), min(row.topk, logits.shape[-1]))
        out[j] = list(zip(indices.tolist(), values.tolist(), strict=True))
    return out


def prompt_logprobs(res: SampleResult, logits_PV: torch.Tensor, r: SampleRequest) -> None:
    """Fill ``res`` from the prefill logits of one prompt (row p predicts prompt token p + 1)."""
    logp = torch.log_softmax(logits_PV, -1)  # [P, V]
    prompt = torch.tensor(r.prompt, device=logits_PV.device)
    if r.prompt_logprobs:
        lps = logp[:-1].gather(-1, prompt[1:, None]).squeeze(-1).tolist()
        res.prompt_logprobs = [None, *lps]
    if r.topk_prompt_logprobs:
        k = min(r.topk_prompt_logprobs, logp.shape[-1])
        values, indices = torch.topk(logp[:-1], k, dim=-1)
        res.topk_prompt_logprobs = [None] + [
            list(zip(ix, vs, strict=True)) for ix, vs in zip(indices.tolist(), values.tolist(), strict=True)
        ]
    if r.target_prompt_tokens is not None:
        ids = torch.tensor(r.target_prompt_tokens, dtype=torch.long, device=logp.device)  # [P-1, K]
        if ids.numel():
            picked = logp[:-1].gather(-1, ids.clamp(min=0))
            res.target_prompt_logprobs = picked.masked_fill(ids < 0, 0.0).tolist()
        else:
            res.target_prompt_logprobs = [[] for _ in r.target_prompt_tokens]
    if r.prompt_alt_tokens_k:
        res.prompt_alt_tokens = prompt_alt_tokens(logits_PV[:-1], r)


def prompt_alt_tokens(logits_PV: torch.Tensor, r: SampleRequest) -> tuple[list[list[int]], list[list[float]]]:
    """``r.prompt_alt_tokens_k`` independent draws from each row of ``logits_PV`` at the request's
    temperature (the argmax when greedy), with their logprobs under the distribution a sampled
    token's logprob uses (softmax(logits / T), T = 1 when greedy). Top-k / top-p do not apply: these
    are draws from the model's distribution. Seeded by the request's seed."""
    k, temp = r.prompt_alt_tokens_k, r.params.temperature
    logp = torch.log_softmax(logits_PV if temp in (0, 1) else logits_PV / temp, -1)
    if temp == 0:
        toks = logp.argmax(-1, keepdim=True).expand(-1, k)
    else:
        gen = torch.Generator(device=logp.device)
        gen.manual_seed(r.params.seed if r.params.seed is not None else int(torch.seed()))
        toks = torch.multinomial(logp.exp(), k, replacement=True, generator=gen)
    return toks.tolist(), logp.gather(-1, toks).tolist()
