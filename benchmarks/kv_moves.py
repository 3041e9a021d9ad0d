"""What a continuous batch's leaves and joins cost in the lean KV cache (``sampling/kv_cache.py``):
moving only the rows that leave or join ÷ copying every row in use into a new cache (what each
leave and join did before the cache kept spare rows), side by side in one run.

The cache has SmolLM2-135M's shape (30 layers, 3 kv heads of 64) by default, ``--rows`` rows of
``--columns`` written columns. A **leave**: two rows finish and the rest go on, in the decoder's
order (``fill_holes``) against the same rows copied into a new buffer. A **join**: a prefilled group
of two rows, narrower than the batch, joins it (into its spare rows) against a join into a new
cache. The copies include allocating and first touching the new buffer, as they did then.
Medians of ``--repeats``; also printed, the cache's size.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch

from opentinker.sampling.kv_cache import LeanCache, fill_holes

CPU = torch.device("cpu")


@dataclass
class Shape:  # what LeanCache reads of a LlamaLean
    layers: tuple[None, ...]
    n_kv: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    device: torch.device = CPU


def filled(shape: Shape, rows: int, columns: int, spare: int) -> LeanCache:
    c = LeanCache(shape, rows, columns, 2 * columns, spare_rows=spare)
    c.append(columns, None)
    c._buf.normal_()  # every page touched, spare rows too: as in a batch that has been running
    return c


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--columns", type=int, default=100)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    shape = Shape((None,) * a.layers, a.kv_heads, a.head_dim)
    n = a.rows
    leave = torch.tensor(fill_holes([i for i in range(n) if i not in (3, n // 2)], n))
    times: dict[str, list[float]] = {
        k: [] for k in ("leave_in_place", "leave_copy", "join_in_place", "join_copy")
    }
    for _ in range(a.repeats):
        c = filled(shape, n, a.columns, spare=8)
        t = time.perf_counter()
        c.select(leave)
        times["leave_in_place"].append(time.perf_counter() - t)
        c = filled(shape, n, a.columns, spare=0)
        t = time.perf_counter()
        c._realloc(n, c.kv.shape[4], leave)  # the same rows, copied into a new buffer
        times["leave_copy"].append(time.perf_counter() - t)
        group = filled(shape, 2, a.columns // 2, spare=0)
        for kind, spare in (("join_in_place", 8), ("join_copy", 0)):
            c = filled(shape, n, a.columns, spare=spare)
            t = time.perf_counter()
            out = c.join(group, room=64)
            times[kind].append(time.perf_counter() - t)
            assert (out is c) == (kind == "join_in_place")
    med = {k: statistics.median(v) for k, v in times.items()}
    mb = n * a.columns * a.layers * 2 * a.kv_heads * a.head_dim * 4 / 1e6
    print(f"cache: {n} rows x {a.columns} columns, {mb:.0f} MB of keys and values")
    for k, v in med.items():
        print(f"  {k:15s} {v * 1e3:8.2f} ms")
    print(f"leave: copy / in place = {med['leave_copy'] / med['leave_in_place']:.0f}")
    print(f"join:  copy / in place = {med['join_copy'] / med['join_in_place']:.0f}")


if __name__ == "__main__":
    main()
