"""The fused forward's logprobs, in length buckets: rows of very different lengths run in separate
passes rather than all padded to the longest.

A tick fuses every waiting adapter's rows, and RL makes their lengths differ widely: an adapter
taught to answer in two words trains on 30-token rows beside one taught to answer in thirty (70
tokens). One padded pass computes every row to the longest, and backpropagates through the pads
too. Here the rows are sorted by length and cut into the passes that compute the fewest padded
positions, each pass counted as :data:`PASS_COST` positions more (so small batches stay one pass). Rows of one shared-prefix group stay in one pass (``engine/prefix.py``
computes their prefix once). Each pass is an ordinary forward under its own rows' routing; autograd
joins them, so one backward covers all. Results equal one padded pass up to float rounding (tested).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from opentinker.engine.images import has_images, image_kwargs
from opentinker.engine.prefix import PrefixGroup, plan_shared_prefixes, shared_prefix_logprobs
from opentinker.engine.types import Example

# what a pass costs beyond its token positions (its module calls, smaller matmuls), counted in
# padded token positions: a pass is split off only where that saves more than this
PASS_COST = 128


def length_buckets(units: list[list[int]], pass_cost: int | None = None) -> list[list[int]]:
    """Cut ``units`` (each the lengths of rows that must share a pass) into passes, as lists of
    unit indices, minimising the padded positions computed plus ``pass_cost`` (default
    :data:`PASS_COST`) per pass: with the units sorted longest first, a pass is a run of them,
    padded to its first one's length, so the best cut is found exactly by dynamic programming."""
    cost = PASS_COST if pass_cost is None else pass_cost
    order = sorted(range(len(units)), key=lambda u: -max(units[u]))
    width = [max(units[u]) for u in order]
    rows = [0, *itertools.accumulate(len(units[u]) for u in order)]
    n = len(order)
    best = [0] * (n + 1)  # best[j]: the cost of the first j units
    cut = [0] * (n + 1)  # cut[j]: where the last pass of that best starts
    for j in range(1, n + 1):
        best[j], cut[j] = min((best[i] + (rows[j] - rows[i]) * width[i] + cost, i) for i in range(j))
    passes: list[list[int]] = []
    j = n
    while j > 0:
        passes.append(order[cut[j] : j])
        j = cut[j]
    return passes[::-1]


def fused_logprobs(
    model: Any,
    route: Callable[[list[Any]], AbstractContextManager[Any]],
    vision: Any,
    policies: list[Any],
    examples: list[Example],
    targets: list[torch.Tensor],
    share_prefixes: bool,
) -> list[torch.Tensor]:
    """Each row's logprobs of its targets ``[T, K]`` (``targets[b]``), in length buckets; within
    a bucket with shared prefixes computed once when that saves enough, else one right-padded pass."""
    lengths = [int(ex.tokens_T.shape[0]) for ex in examples]
    images = has_images(examples)
    plan = None
    if share_prefixes and len(examples) > 1 and not images:
        plan = plan_shared_prefixes([ex.tokens_T.tolist() for ex in examples], list(policies))
    members = [g.rows for g in plan] if plan is not None else [[b] for b in range(len(examples))]
    if images:  # a vision batch stays one pass (its image rows are laid out together)
        buckets = [list(range(len(members)))]
    else:
        buckets = length_buckets([[lengths[b] for b in m] for m in members])
    out: dict[int, torch.Tensor] = {}
    for bucket in buckets:
        rows = [b for u in bucket for b in members[u]]
        sub = [policies[b] for b in rows]
        if plan is not None:
            index = {b: k for k, b in enumerate(rows)}
            groups = [PrefixGroup([index[b] for b in plan[u].rows], plan[u].shared) for u in bucket]
            toks = [examples[b].tokens_T.to(targets[b].device) for b in rows]
            lps = shared_prefix_logprobs(model, route, sub, toks, [targets[b] for b in rows], groups)
        else:
            exs, tgts = [examples[b] for b in rows], [targets[b] for b in rows]
            lps = one_pass_logprobs(model, route, vision, sub, exs, tgts)
        for b, lp in zip(rows, lps, strict=True):
            out[b] = lp
    return [out[b] for b in range(len(examples))]


def one_pass_logprobs(
    model: Any,
    route: Callable[[list[Any]], AbstractContextManager[Any]],
    vision: Any,
    policies: list[Any],
    examples: list[Example],
    targets: list[torch.Tensor],
) -> list[torch.Tensor]:
    """Logprobs ``[T, K]`` of each row's targets in one right-padded forward."""
    dev = targets[0].device
    lengths = [int(ex.tokens_T.shape[0]) for ex in examples]
    # Right padding needs no attention mask: causal attention never lets a real token see a pad.
    tokens_BT = torch.zeros(len(examples), max(lengths), dtype=torch.long, device=dev)
    for b, ex in enumerate(examples):
        tokens_BT[b, : lengths[b]] = ex.tokens_T.to(dev)
    with route(policies):
        images = image_kwargs(model, vision, tokens_BT, examples)
        logits_BTV = model(input_ids=tokens_BT, use_cache=False, **images).logits.float()
    lse_BT = torch.logsumexp(logits_BTV, dim=-1)
    # One batched gather of every row's targets (K > 1 for soft targets), padded with token
    # 0: a per-row gather would give each row a full [B, T, V] zero gradient in backward.
    width = max(int(t.shape[1]) for t in targets)
    tgt_BTK = torch.zeros(len(examples), tokens_BT.shape[1], width, dtype=torch.long, device=dev)
    for b, t in enumerate(targets):
        tgt_BTK[b, : lengths[b], : t.shape[1]] = t
    lp_BTK = logits_BTV.gather(-1, tgt_BTK) - lse_BT[..., None]
    return [lp_BTK[b, : lengths[b], : int(t.shape[1])] for b, t in enumerate(targets)]
