"""What this machine can scale: one process ÷ two at once, one torch thread each, on three kernels.

Every multi-worker ratio here (P11train, P11rollout) is bounded by how well two single-thread
processes share the machine. This measures it without our code in the way:

- ``compute``: a 256×256 fp32 matmul (its operands fit in L2), over and over;
- ``stream``: a 540 MB fp32 matrix (SmolLM2-135M's weights) times 16 columns: each pass reads
  every weight once from memory, as a decode step does;
- ``layers``: 64 rows through 60 576×1536 matrices (a decode step's shape, 212 MB).

Each kind runs in 1 process, then in 2 at once (released together at a barrier), twice; the line
is the best aggregate rate of each and their ratio (2.0 = two independent cores).

    python benchmarks/machine_scaling.py [compute stream layers]
"""

from __future__ import annotations

import multiprocessing as mp
import sys
import time
from collections.abc import Callable
from typing import Any


def _kernel(kind: str) -> tuple[Callable[[], Any], int]:
    import torch

    torch.set_num_threads(1)
    if kind == "compute":
        a, b = torch.randn(256, 256), torch.randn(256, 256)
        return (lambda: torch.mm(a, b)), 400
    if kind == "stream":
        w, x = torch.randn(135_000_000 // 576, 576), torch.randn(576, 16)
        return (lambda: torch.mm(w, x)), 8
    if kind == "layers":
        ws, h = [torch.randn(1536, 576) for _ in range(60)], torch.randn(64, 576)

        def step() -> None:
            for w in ws:
                torch.mm(h, w.T)

        return step, 30
    raise SystemExit(f"unknown kernel {kind!r}: compute, stream or layers")


def _work(kind: str, out: Any, start: Any) -> None:
    fn, n = _kernel(kind)
    fn()  # first-use costs
    start.wait()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    out.put(n / (time.perf_counter() - t))


def rate(kind: str, procs: int) -> float:
    """Aggregate passes per second of ``procs`` processes running ``kind`` at once."""
    out, start = mp.Queue(), mp.Barrier(procs)
    ps = [mp.Process(target=_work, args=(kind, out, start)) for _ in range(procs)]
    for p in ps:
        p.start()
    rates = [out.get() for _ in ps]
    for p in ps:
        p.join()
    return sum(rates)


def main() -> None:
    for kind in sys.argv[1:] or ["compute", "stream", "layers"]:
        runs: dict[int, list[float]] = {1: [], 2: []}
        for procs in (1, 2, 1, 2):
            runs[procs].append(rate(kind, procs))
        one, two = max(runs[1]), max(runs[2])
        print(
            f"{kind:<8} 1 process {one:8.1f}/s   2 processes {two:8.1f}/s   ratio {two / one:.2f}", flush=True
        )


if __name__ == "__main__":
    main()
