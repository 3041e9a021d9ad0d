"""The lean decoder's static KV cache: rows that leave and join without copying the others.

One buffer ``[layers, 2, capacity_rows, kv_heads, columns, head_dim]`` holds every running row's
keys and values, right-aligned in the written columns (left padding is masked by ``valid``).
:attr:`LeanCache.kv` is the view of the rows in use (``rows`` <= ``capacity_rows``) from the
first live column; each layer's K and V are views of it. Columns past ``length`` are never read,
so they are left uninitialised (no page is touched before it is written), and so are the spare
rows.

What a continuous batch does to it each step, and what that costs:

* **Rows leave** (:meth:`LeanCache.select`). Given the rows to keep in an order that leaves each
  kept row among the first ``m`` where it is and moves the kept rows past them into the holes
  (what the decoder asks for: :func:`fill_holes`), only those moved rows are copied, in place;
  the spare rows are the ones past ``m``. Any other order (a fan-out repeating rows) copies the
  kept rows into a new buffer.
* **Rows join** (:meth:`LeanCache.join`). A newly prefilled group no wider than the running
  batch is written into the spare rows, right-aligned to the batch's columns: nothing else is
  copied. Otherwise both are copied into a new, wider buffer with spare rows for the next joins
  (half again as many rows, at least ``MIN_SPARE_ROWS``).
* **Columns grow** by doubling when a step needs one more (a copy of the rows in use, not per
  step), and leading columns that have become padding in every row are dropped
  (:meth:`LeanCache.trim`, a view).

Copying the whole cache instead, on every leave and every join, is what a 128-row SmolLM2
batch of 100 columns (590 MB of keys and values) cannot afford: each copy costs about as much as
a decode step on a CPU.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

TRIM_MIN_COLUMNS = 16  # leading all-padding columns worth dropping
MIN_SPARE_ROWS = 8  # spare rows a new buffer keeps for joining groups


def fill_holes(keep: list[int], n: int) -> list[int]:
    """``keep`` (increasing indices of the rows of ``n`` that go on) reordered so that every kept
    row among the first ``len(keep)`` stays where it is and the kept rows past them fill the
    holes: the order in which :meth:`LeanCache.select` moves only those rows."""
    m = len(keep)
    if m == n:
        return list(keep)
    kept = set(keep)
    tail = iter([j for j in keep if j >= m])
    return [d if d in kept else next(tail) for d in range(m)]


class LeanCache:
    """The static KV cache of the module docstring, for ``lean`` (its ``layers``, ``n_kv``,
    ``head_dim``, ``dtype`` and ``device``): ``rows`` rows (and ``spare_rows`` more of room),
    ``columns`` columns allocated, at most ``max_columns``."""

    def __init__(self, lean: Any, rows: int, columns: int, max_columns: int, *, spare_rows: int = 0) -> None:
        self.max_columns = max(columns, max_columns)
        self._shape = (len(lean.layers), 2, lean.n_kv, lean.head_dim)
        self._zero = torch.zeros(1, 1, 1, dtype=lean.dtype, device=lean.device)
        self.length = 0  # columns written (the same for every row)
        self.padded = False  # some written column of some row is padding
        self._allocate(rows, rows + spare_rows, columns)

    def _allocate(self, rows: int, capacity: int, columns: int) -> None:
        """Fresh buffers of ``capacity`` rows and ``columns`` columns (keys and values left
        uninitialised), ``rows`` of them in use from column 0."""
        layers, two, n_kv, head_dim = self._shape
        self._buf = self._zero.new_empty(layers, two, capacity, n_kv, columns, head_dim)
        self._vbuf = torch.zeros(capacity, columns, dtype=torch.bool, device=self._zero.device)
        self._rows, self._col0 = rows, 0
        self._bind()

    def _bind(self) -> None:
        """``kv`` and ``valid``: the rows in use from the first live column (views of the buffers);
        each layer's K and V, [rows, kv_heads, columns, head_dim] (views of ``kv``)."""
        self.kv = self._buf[:, :, : self._rows, :, self._col0 :]
        self.valid = self._vbuf[: self._rows, self._col0 :]
        self.keys = [self.kv[i, 0] for i in range(self.kv.shape[0])]
        self.values = [self.kv[i, 1] for i in range(self.kv.shape[0])]

    @property
    def rows(self) -> int:
        return self._rows

    @property
    def spare_rows(self) -> int:
        return self._buf.shape[2] - self._rows

    def append(self, n: int, valid: torch.Tensor | None) -> None:
        """Reserve ``n`` more columns (``valid``: [rows, n], None = all real)."""
        end = self.length + n
        if end > self.kv.shape[4]:
            self._grow(end)
        if valid is None:
            self.valid[:, self.length : end] = True
        else:
            self.valid[:, self.length : end] = valid
            self.padded = self.padded or not bool(valid.all())
        self.length = end

    def load_prefixes(self, prefixes: list[torch.Tensor | None]) -> None:
        """Start an empty cache with each row's cached keys and values (``[layers, 2, kv_heads, n_i,
        head_dim]``, None = nothing cached), right-aligned in the first ``max n_i`` columns (the
        rest of a shorter row is padding, zeroed)."""
        assert self.length == 0 and len(prefixes) == self._rows
        end = max(kv.shape[3] for kv in prefixes if kv is not None)
        if end > self.kv.shape[4]:
            self._grow(end)
        for i, kv in enumerate(prefixes):
            n = 0 if kv is None else kv.shape[3]
            if kv is not None:
                self.kv[:, :, i, :, end - n : end] = kv
                self.valid[i, end - n : end] = True
            if n < end:  # padding is masked out, but 0 · garbage (NaN) would not be
                self.kv[:, :, i, :, : end - n] = 0
        self.length = end
        self.padded = any(kv is None or kv.shape[3] < end for kv in prefixes)

    def row_kv(self, row: int) -> torch.Tensor:
        """A copy of one row's keys and values over its real (not padding) columns, in order:
        ``[layers, 2, kv_heads, n, head_dim]``."""
        if not self.padded:
            return self.kv[:, :, row, :, : self.length].clone()
        cols = self.valid[row, : self.length].nonzero().squeeze(1)
        return self.kv[:, :, row].index_select(3, cols)

    def _grow(self, need: int) -> None:
        """Room for ``need`` columns (doubling, at most ``max_columns``): the rows in use move to
        a new buffer with the same row capacity, from column 0."""
        cols = min(max(need, 2 * self.kv.shape[4]), max(self.max_columns, need))
        self._realloc(self._buf.shape[2], cols, None)

    def _realloc(self, capacity: int, cols: int, rows: torch.Tensor | None) -> None:
        """New buffers of ``capacity`` rows and ``cols`` columns holding the written columns of the
        rows in use (or of ``rows``, in that order, which become the rows in use)."""
        src_kv, src_valid = self.kv[..., : self.length, :], self.valid[:, : self.length]
        if rows is not None:
            src_kv, src_valid = src_kv.index_select(2, rows), src_valid.index_select(0, rows)
        self._allocate(src_valid.shape[0], capacity, cols)
        self.kv[..., : self.length, :] = src_kv
        self.valid[:, : self.length] = src_valid
        self.max_columns = max(self.max_columns, cols)

    def select(self, rows: torch.Tensor) -> None:
        """Keep (or repeat) ``rows`` of the batch, in that order. In the order :func:`fill_holes`
        gives, only the kept rows past the first ``len(rows)`` move (in place); otherwise the kept
        rows are copied into a new buffer."""
        n, m = self._rows, int(rows.numel())
        idx = rows.tolist()
        if idx == list(range(n)):
            return
        moved = [(d, s) for d, s in enumerate(idx) if s != d]
        if m <= n and len(set(idx)) == m and all(s >= m for _, s in moved):
            if moved:  # the moved rows' sources lie past every destination
                end = self.length
                dst = rows.new_tensor([d for d, _ in moved])
                src = rows.new_tensor([s for _, s in moved])
                kv = self.kv[..., :end, :]
                kv.index_copy_(2, dst, kv.index_select(2, src))
                valid = self.valid[:, :end]
                valid.index_copy_(0, dst, valid.index_select(0, src))
            self._rows = m
            self._bind()
        else:
            self._realloc(m + max(MIN_SPARE_ROWS, m // 2), self.kv.shape[4], rows)
        self.padded = self.padded and not bool(self.valid[:, : self.length].all())

    def join(self, other: LeanCache, room: int) -> LeanCache:
        """A cache holding this one's rows then ``other``'s, each right-aligned in the wider of the
        two (the narrower left-padded, masked, zeroed), with room for ``room`` more columns: this
        cache itself when ``other`` fits its spare rows and columns, else a new one."""
        width = max(self.length, other.length)
        ra, rb = self._rows, other._rows
        if other.length <= self.length and rb <= self.spare_rows:
            out = self
            out._rows = ra + rb
            out.max_columns = max(out.max_columns, width + room)
            out._bind()
            sources: tuple[tuple[int, LeanCache], ...] = ((ra, other),)
        else:
            total = ra + rb
            out = copy.copy(self)  # the same shape, dtype and device; buffers of its own
            out.max_columns = width + room
            out._allocate(total, total + max(MIN_SPARE_ROWS, total // 2), width + min(room, 256))
            sources = ((0, self), (ra, other))
        for r0, src in sources:
            n, pad = src._rows, width - src.length
            out.kv[:, :, r0 : r0 + n, :, pad:width] = src.kv[..., : src.length, :]
            out.valid[r0 : r0 + n, pad:width] = src.valid[:, : src.length]
            if pad:  # padding is masked out, but 0 · garbage (NaN) would not be
                out.kv[:, :, r0 : r0 + n, :, :pad] = 0
                out.valid[r0 : r0 + n, :pad] = False
        out.length = width
        out.padded = not bool(out.valid[:, :width].all())
        return out

    def trim(self) -> None:
        """Drop the leading columns that are padding in every row (views, no copy)."""
        used = self.valid[:, : self.length].any(0)
        lead = int(used.to(torch.int8).argmax()) if bool(used.any()) else 0
        if lead < TRIM_MIN_COLUMNS:
            return
        self._col0 += lead
        self.length -= lead
        self.max_columns -= lead
        self._bind()
        self.padded = not bool(self.valid[:, : self.length].all())

    def decode_bias(self, n_kv: int, window: int | None = None) -> torch.Tensor:
        """Additive attention bias of one query per row over the written columns, per (row, kv
        head): [rows·kv_heads, 1, length] with -inf on padding and, with a sliding ``window``, on
        the real columns more than ``window - 1`` positions before the query (a [1, 1, 1] zero
        where nothing is masked)."""
        end = self.length
        windowed = window is not None and end > window
        if not self.padded and not windowed:
            return self._zero
        rows = self.valid.shape[0]
        visible = self.valid[:, :end]
        if (
            window is not None and windowed
        ):  # the query is its row's last real column: count real columns back from it
            visible = visible & (visible.flip(1).cumsum(1).flip(1) <= window)
        bias = torch.zeros(rows, end, dtype=self.kv.dtype, device=self.kv.device)
        bias.masked_fill_(~visible, float("-inf"))
        return bias[:, None, None, :].expand(rows, n_kv, 1, end).reshape(rows * n_kv, 1, end)

    def attention_mask(self, c0: int, t: int, window: int | None = None) -> tuple[torch.Tensor | None, bool]:
        """(boolean mask [rows, 1, t, c0 + t] or None, is_causal) for ``t`` > 1 queries after column
        ``c0`` (call after :meth:`append`); with a sliding ``window``, a query sees the real
        columns less than ``window`` positions before it (a column's position: the real columns
        up to it in its row, minus one). A padding query attends at least to itself, so no row of
        the mask is empty; real queries never see padding."""
        end = c0 + t
        windowed = window is not None and end > window
        if not self.padded and c0 == 0 and not windowed:
            return None, True
        dev = self.valid.device
        qpos = torch.arange(c0, end, device=dev)[:, None]
        kpos = torch.arange(end, device=dev)[None]
        valid = self.valid[:, None, None, :end]
        mask = valid & (kpos <= qpos)
        if window is not None and windowed:
            real = self.valid[:, :end].cumsum(1) - 1  # each column's position in its row
            near = real[:, c0:end, None] - real[:, None, :] < window  # [rows, t, end]
            mask = mask & near[:, None]
        return mask | (kpos == qpos), False
