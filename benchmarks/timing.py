"""Shared timing helpers for the benchmark scripts: interleaved repeats, medians, a result table.

Time on the project's machines is noisy, so every comparison alternates its runs (A B, B A, ...)
after warm-ups on each, and quotes medians.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def interleaved(
    alternatives: dict[str, Callable[[], object]], repeats: int, warmup: int
) -> dict[str, list[float]]:
    """Warm each alternative up, then time them in rounds (A B C, C B A, ...); seconds per run."""
    for _ in range(warmup):
        for fn in alternatives.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in alternatives}
    names = list(alternatives)
    for rep in range(repeats):
        for name in names if rep % 2 == 0 else reversed(names):
            t0 = time.perf_counter()
            alternatives[name]()
            times[name].append(time.perf_counter() - t0)
    return times


def print_table(times: dict[str, list[float]], baseline: str, width: int = 40) -> None:
    base = statistics.median(times[baseline])
    print(f"{'run':<{width}} {'median ms':>10} {'min ms':>9} {'max ms':>9} {'÷ ' + baseline:>22}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(
            f"{name:<{width}} {med * 1e3:>10.1f} {min(ts) * 1e3:>9.1f} {max(ts) * 1e3:>9.1f} {med / base:>22.3f}"
        )


def check(results: list[object]) -> None:
    """Raise the first refused request of an engine batch (a benchmark must not time failures)."""
    for r in results:
        if isinstance(r, Exception):
            raise r
