"""Shared-prefix training: rows that start with the same tokens under the same policy compute that
prefix once.

RL with group-relative advantages trains on ``group_size`` completions of each prompt: most of a
row's tokens are the prompt, identical across its group. The fused forward then runs in two
phases: (1) each distinct prefix once, left-padded, keeping its KV cache; (2) every row's suffix,
attending to its group's prefix cache (rows index it, so autograd sums their gradients back into
the one prefix pass). Logprobs of the prefix positions are gathered per row from the shared
logits, with each row's own targets. Results equal the one-pass forward up to float rounding
(tested against it); the compute saved is (rows in the group - 1) x prefix length per group.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Hashable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

MIN_PREFIX = 8  # shorter common prefixes are not worth a second model call
MIN_SAVING = 0.2  # share only when it removes at least this fraction of the batch's tokens


@dataclass
class PrefixGroup:
    rows: list[int]  # batch rows sharing the prefix
    shared: int  # number of leading input tokens computed once (< every member's length)


def _lcp(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def plan_shared_prefixes(
    tokens: list[list[int]],
    keys: list[Hashable],
    *,
    min_prefix: int = MIN_PREFIX,
    min_saving: float = MIN_SAVING,
) -> list[PrefixGroup] | None:
    """Group rows (same ``key`` = same policy) by common prefix, greedily over the sorted rows: a row
    joins the current group when that does not lower the group's saving. Returns None when sharing
    would save less than ``min_saving`` of the tokens (then the one-pass forward is used)."""
    order = sorted(range(len(tokens)), key=lambda i: (repr(keys[i]), tokens[i]))
    groups: list[PrefixGroup] = []
    for i in order:
        cap = len(tokens[i]) - 1  # every row keeps at least one token for phase 2
        g = groups[-1] if groups else None
        if g is not None and keys[g.rows[0]] == keys[i]:
            q = min(g.shared, _lcp(tokens[g.rows[0]], tokens[i]), cap)
            m = len(g.rows)
            if q >= min_prefix and m * q >= (m - 1) * g.shared:
                g.rows.append(i)
                g.shared = q
                continue
        groups.append(PrefixGroup([i], cap))
    total = sum(len(t) for t in tokens)
    saved = sum((len(g.rows) - 1) * g.shared for g in groups)
    if total == 0 or saved < min_saving * total:
        return None
    return groups


def shared_prefix_logprobs(
    model: Any,
    route: Callable[[list[Any]], AbstractContextManager[Any]],
    policies: list[Any],
    tokens: list[torch.Tensor],
    targets: list[torch.Tensor],
    groups: list[PrefixGroup],
) -> list[torch.Tensor]:
    """Per-row logprobs ``[T, K]`` of ``targets`` (each ``[T, K]``) with prefixes computed once."""
    dev = tokens[0].device
    R, G = len(tokens), len(groups)
    group_of = [0] * R
    slot_of = [0] * R
    for gi, g in enumerate(groups):
        for s, r in enumerate(g.rows):
            group_of[r], slot_of[r] = gi, s
    Q = max(g.shared for g in groups)
    K = max(int(t.shape[1]) for t in targets)
    M = max(len(g.rows) for g in groups)

    # phase 1: every distinct prefix once, left-padded to Q
    ids1 = torch.zeros(G, Q, dtype=torch.long, device=dev)
    mask1 = torch.zeros(G, Q, dtype=torch.long, device=dev)
    tgt1 = torch.zeros(G, Q, M * K, dtype=torch.long, device=dev)  # each member's own targets
    for gi, g in enumerate(groups):
        q, r0 = g.shared, g.rows[0]
        ids1[gi, Q - q :] = tokens[r0][:q]
        mask1[gi, Q - q :] = 1
        for s, r in enumerate(g.rows):
            t = targets[r][:q]
            tgt1[gi, Q - q :, s * K : s * K + t.shape[1]] = t
    pos1 = (mask1.cumsum(-1) - 1).clamp(min=0)
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache = DynamicCache()
    with route([policies[g.rows[0]] for g in groups]):
        out1 = model(
            input_ids=ids1, attention_mask=mask1, position_ids=pos1, use_cache=True, **{cache_kw: cache}
        )
    logits1 = out1.logits.float()
    lp1 = logits1.gather(-1, tgt1) - torch.logsumexp(logits1, dim=-1, keepdim=True)  # [G, Q, M*K]
    del logits1, out1

    # phase 2: each row's suffix, on its group's prefix cache
    sel = torch.tensor(group_of, device=dev)
    cache.batch_select_indices(sel)
    suffix = [int(tokens[r].shape[0]) - groups[group_of[r]].shared for r in range(R)]
    S = max(suffix)
    ids2 = torch.zeros(R, S, dtype=torch.long, device=dev)
    mask2 = torch.zeros(R, Q + S, dtype=torch.long, device=dev)
    pos2 = torch.zeros(R, S, dtype=torch.long, device=dev)
    tgt2 = torch.zeros(R, S, K, dtype=torch.long, device=dev)
    for r in range(R):
        q, n = groups[group_of[r]].shared, suffix[r]
        ids2[r, :n] = tokens[r][q:]
        mask2[r, Q - q : Q + n] = 1
        pos2[r] = q + torch.arange(S, device=dev)
        t = targets[r][q:]
        tgt2[r, :n, : t.shape[1]] = t
    with route(policies):
        out2 = model(
            input_ids=ids2, attention_mask=mask2, position_ids=pos2, use_cache=True, **{cache_kw: cache}
        )
    logits2 = out2.logits.float()
    lp2 = logits2.gather(-1, tgt2) - torch.logsumexp(logits2, dim=-1, keepdim=True)  # [R, S, K]

    out: list[torch.Tensor] = []
    for r in range(R):
        g = groups[group_of[r]]
        q, k, s = g.shared, int(targets[r].shape[1]), slot_of[r]
        head = lp1[group_of[r], Q - q :, s * K : s * K + k]
        out.append(torch.cat([head, lp2[r, : suffix[r], :k]], dim=0))
    return out
