"""KV of finished sequences, kept to serve as the cached prefix of later prompts (multi-turn).

A multi-turn episode's next prompt is its previous prompt, the reply just sampled and the
environment's answer (``MessageEnv.step`` appends tokens; it never re-renders). Without a cache
every turn prefills the whole conversation again; with it, a prompt under the same policy that
begins with a finished sequence's tokens starts from that sequence's keys and values, and only the
new tokens are prefilled. Any common prefix counts (keys and values of a causal model depend only
on the tokens before them), so a reply re-tokenised differently still reuses what precedes it.

What is stored: for each sequence a sampling call finished, its prompt and every sampled token but
the last (the last was never fed to the model), with the state of exactly those tokens (padding
removed): the lean path's KV tensor ``[layers, 2, kv_heads, n, head_dim]``, or the HF path's
:class:`~opentinker.sampling.hf_cache.RowState` (keys and values of any widths per layer, and on a
hybrid model each recurrent layer's state *after the last token*). Keys and values can be cut at
any prefix; a recurrent state cannot, so an entry holding one serves only a prompt that continues
all of its tokens (the usual next turn), and a shorter common prefix is a miss. Entries are keyed by the *policy state*
they were computed under (:func:`policy_key` in the sampler: a snapshot's id, or an adapter's id
with its weights' version counters, so a trained adapter never reuses stale keys and values).
A new entry replaces every entry of its key whose tokens it extends (a turn replaces the turn
before it). Least recently used entries leave first when the byte budget is exceeded.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch

from opentinker.sampling.hf_cache import RowState

# a stored row: the lean path's KV tensor or the HF path's per-layer state
Prefix = torch.Tensor | RowState


@dataclass
class PrefixHit:
    length: int  # tokens of the prompt covered by the cached keys and values
    kv: Prefix  # the state after ``length`` tokens (a view of the entry)


@dataclass
class _Entry:
    key: Hashable
    tokens: tuple[int, ...]
    kv: Prefix

    @property
    def nbytes(self) -> int:
        kv = self.kv
        return kv.nbytes if isinstance(kv, RowState) else kv.numel() * kv.element_size()

    def usable(self, n: int) -> int:
        """The longest prefix of at most ``n`` tokens this entry can serve (0: none)."""
        return n if not isinstance(self.kv, RowState) or self.kv.cuttable or n == len(self.tokens) else 0

    def cut(self, n: int) -> Prefix:
        return self.kv.cut(n) if isinstance(self.kv, RowState) else self.kv[:, :, :, :n]


class PrefixCache:
    def __init__(self, max_bytes: int, min_tokens: int = 8) -> None:
        """``max_bytes``: the most the stored KV may take (0 keeps nothing); ``min_tokens``: the
        shortest common prefix worth reusing."""
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.min_tokens = min_tokens
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._by_key: dict[Hashable, dict[int, _Entry]] = {}
        self._next = 0
        self.nbytes = 0
        self.lookups = 0  # prompts looked up
        self.hits = 0  # prompts served from the cache
        self.reused_tokens = 0  # prompt tokens not prefilled thanks to it

    def __len__(self) -> int:
        return len(self._entries)

    def match(self, key: Hashable, prompt: list[int]) -> PrefixHit | None:
        """The longest cached prefix of ``prompt`` under ``key`` (leaving at least the prompt's
        last token to prefill, whose logits start the sampling), or None if shorter than
        ``min_tokens``."""
        self.lookups += 1
        limit = len(prompt) - 1
        best_n, best_id = 0, -1
        for eid, e in self._by_key.get(key, {}).items():
            n = e.usable(_common_prefix(e.tokens, prompt, min(limit, len(e.tokens))))
            if n > best_n:
                best_n, best_id = n, eid
        if best_n < max(self.min_tokens, 1):
            return None
        self._entries.move_to_end(best_id)
        self.hits += 1
        self.reused_tokens += best_n
        return PrefixHit(best_n, self._entries[best_id].cut(best_n))

    def put(self, key: Hashable, tokens: list[int], kv: Prefix) -> None:
        """Store ``kv`` (the state after ``tokens``) of ``tokens`` under ``key``."""
        n = kv.length if isinstance(kv, RowState) else kv.shape[3]
        if n != len(tokens):
            raise ValueError(f"{n} KV columns for {len(tokens)} tokens")
        new = tuple(tokens)
        same = self._by_key.get(key, {})
        for eid in [eid for eid, e in same.items() if new[: len(e.tokens)] == e.tokens]:
            self._remove(eid)
        entry = _Entry(key, new, kv)
        if entry.nbytes > self.max_bytes or len(new) < self.min_tokens:
            return
        self._entries[self._next] = entry
        self._by_key.setdefault(key, {})[self._next] = entry
        self._next += 1
        self.nbytes += entry.nbytes
        while self.nbytes > self.max_bytes:
            self._remove(next(iter(self._entries)))

    def drop(self, which: Callable[[Hashable], bool]) -> None:
        """Forget every entry whose key ``which`` accepts (e.g. a retired snapshot's)."""
        for eid in [eid for eid, e in self._entries.items() if which(e.key)]:
            self._remove(eid)

    def clear(self) -> None:
        self._entries.clear()
        self._by_key.clear()
        self.nbytes = 0

    def _remove(self, eid: int) -> None:
        entry = self._entries.pop(eid)
        same = self._by_key[entry.key]
        del same[eid]
        if not same:
            del self._by_key[entry.key]
        self.nbytes -= entry.nbytes


def _common_prefix(a: tuple[int, ...], b: list[int], n: int) -> int:
    """Length of the common prefix of ``a`` and ``b`` within their first ``n`` tokens."""
    if a[:n] == tuple(b[:n]):
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]: bisect on slices (C-speed compares)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == tuple(b[lo:mid]):
            lo = mid
        else:
            hi = mid
    return lo
