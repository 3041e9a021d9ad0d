"""The lean decoder's KV cache (sampling/kv_cache.py): rows leave and join moving only their own
rows, and every row keeps exactly its keys and values. Reference: a plain list of each row's
real (non-padding) keys and values, updated by hand."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from opentinker.sampling.kv_cache import MIN_SPARE_ROWS, LeanCache, fill_holes

CPU = torch.device("cpu")


@dataclass
class _Shape:  # what LeanCache reads of a LlamaLean
    layers: tuple[None, ...] = (None, None)
    n_kv: int = 2
    head_dim: int = 3
    dtype: torch.dtype = torch.float32
    device: torch.device = CPU


def _group(g: torch.Generator, lengths: list[int], spare: int = 0) -> tuple[LeanCache, list[torch.Tensor]]:
    """A cache of rows with these real lengths (right-aligned, left-padded), and each row's K/V."""
    shape = _Shape()
    rows = [torch.randn(len(shape.layers), 2, shape.n_kv, n, shape.head_dim, generator=g) for n in lengths]
    c = LeanCache(shape, len(rows), 4, 4096, spare_rows=spare)
    c.load_prefixes(list(rows))
    return c, rows


def _check(c: LeanCache, want: list[torch.Tensor]) -> None:
    assert c.rows == len(want) == c.kv.shape[2]
    for i, kv in enumerate(want):
        assert torch.equal(c.row_kv(i), kv), f"row {i} lost its keys and values"
    assert c.padded == any(kv.shape[3] < c.length for kv in want)


def test_fill_holes_keeps_rows_in_place_and_moves_only_the_tail() -> None:
    assert fill_holes([0, 1, 2, 4, 5, 6, 8, 9], 10) == [0, 1, 2, 8, 4, 5, 6, 9]
    assert fill_holes([1, 2, 3], 4) == [3, 1, 2]
    assert fill_holes([0, 1], 2) == [0, 1]
    assert fill_holes([], 3) == []
    for n in range(1, 12):
        for _ in range(20):
            keep = sorted(random.Random(n).sample(range(n), random.Random(n * 7).randint(0, n)))
            order = fill_holes(keep, n)
            assert sorted(order) == keep
            assert all(s == d or s >= len(keep) for d, s in enumerate(order))


def test_rows_leave_and_join_in_place_and_every_row_keeps_its_keys_and_values() -> None:
    g = torch.Generator().manual_seed(0)
    rng = random.Random(0)
    c, want = _group(g, [5, 3, 5, 1, 4, 5], spare=4)
    _check(c, want)
    for step in range(40):
        # a decode step: one more column, real in every row (past the columns held: a new buffer)
        new = torch.randn(2, 2, c.rows, 2, 1, 3, generator=g)
        c.append(1, None)
        buf = c._buf
        c.kv[..., c.length - 1 : c.length, :] = new
        want = [torch.cat([kv, new[:, :, i]], dim=3) for i, kv in enumerate(want)]
        # rows leave, in the decoder's order: in place, the same buffer
        keep = sorted(rng.sample(range(c.rows), max(1, c.rows - rng.randint(0, 2))))
        order = fill_holes(keep, c.rows)
        c.select(torch.tensor(order))
        want = [want[j] for j in order]
        assert c._buf is buf
        c.trim()
        _check(c, want)
        # a group joins: in place while it fits the spare rows and columns, else a new buffer
        lengths = [rng.randint(1, c.length + (3 if step % 5 == 0 else 0)) for _ in range(rng.randint(1, 3))]
        other, rows = _group(g, lengths)
        fits = max(lengths) <= c.length and len(lengths) <= c.spare_rows
        joined = c.join(other, room=8)
        assert (joined is c) == fits and (joined._buf is buf) == fits
        if not fits:
            assert joined.spare_rows >= MIN_SPARE_ROWS
        c, want = joined, want + rows
        _check(c, want)


def test_other_orders_and_repeats_copy_into_a_new_buffer() -> None:
    g = torch.Generator().manual_seed(1)
    c, want = _group(g, [2, 4, 3])
    c.select(torch.tensor([2, 0, 0, 1]))  # a fan-out repeats rows; a reorder moves all of them
    _check(c, [want[2], want[0], want[0], want[1]])
    assert c.spare_rows >= MIN_SPARE_ROWS
    c.select(torch.tensor([0, 1, 2, 3]))  # every row where it is: nothing moves
    _check(c, [want[2], want[0], want[0], want[1]])


def test_a_trimmed_cache_still_joins_in_place() -> None:
    g = torch.Generator().manual_seed(2)
    c, want = _group(g, [40, 2, 3], spare=4)
    c.select(torch.tensor(fill_holes([1, 2], 3)))  # the long row leaves: 37 leading columns of padding
    c.trim()
    assert c.length == 3 and c._col0 == 37
    _check(c, [want[2], want[1]])
    other, rows = _group(g, [1, 3])
    assert c.join(other, room=4) is c
    _check(c, [want[2], want[1], *rows])
