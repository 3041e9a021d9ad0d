"""Shared helpers for the benchmark scripts: interleaved repeats, medians, a result table, and the
``--device`` / ``--dtype`` / ``--json`` / ``--cpu-time`` options of P1-P3.

Time on the project's machines is noisy, so every comparison alternates its runs (A B, B A, ...)
after warm-ups on each, and quotes medians. On an accelerator each timed run ends with a device
synchronisation (kernels run asynchronously: without it the clock would time only the launches).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_clock: Callable[[], float] = time.perf_counter  # ``--cpu-time``: time.process_time


def clock() -> float:
    """Seconds on the clock ``--cpu-time`` chose: wall time, or the CPU time of this process (all
    its threads). On a machine shared with other jobs the CPU time leaves out the time spent
    waiting for a core, which swamps wall-time ratios when the load is many times the cores."""
    return _clock()


def add_device_args(ap: argparse.ArgumentParser) -> None:
    """``--device`` (cpu, cuda, cuda:1, ...), ``--dtype``, ``--json`` (write the ratios there) and
    ``--cpu-time``."""
    ap.add_argument("--device", default="cpu", help="where the engine and the baselines run")
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--json", type=Path, default=None, help="also write the results to this file")
    ap.add_argument("--cpu-time", action="store_true", help="time CPU time, not wall time (CPU only)")


def device_of(args: argparse.Namespace) -> tuple[torch.device, torch.dtype]:
    """The requested device (refused clearly if absent; TF32 off on CUDA: fp32 means fp32) and dtype."""
    global _clock
    dev = torch.device(args.device)
    if getattr(args, "cpu_time", False):
        if dev.type != "cpu":
            raise SystemExit("--cpu-time times CPU work: it cannot time a device's kernels")
        _clock = time.process_time
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit(f"--device {args.device}: torch sees no CUDA device here")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    return dev, DTYPES[args.dtype]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def write_json(args: argparse.Namespace, results: dict[str, Any]) -> None:
    if args.json is not None:
        out = {"device": args.device, "dtype": args.dtype, "threads": torch.get_num_threads(), **results}
        if torch.device(args.device).type == "cuda":
            out["peak_mem_GiB"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        args.json.write_text(json.dumps(out, indent=1, default=str))


def interleaved(
    alternatives: dict[str, Callable[[], object]],
    repeats: int,
    warmup: int,
    device: torch.device | None = None,
) -> dict[str, list[float]]:
    """Warm each alternative up, then time them in rounds (A B C, C B A, ...); seconds per run,
    each run followed by a synchronisation of ``device``."""
    dev = device or torch.device("cpu")
    for _ in range(warmup):
        for fn in alternatives.values():
            fn()
    sync(dev)
    times: dict[str, list[float]] = {name: [] for name in alternatives}
    names = list(alternatives)
    for rep in range(repeats):
        for name in names if rep % 2 == 0 else reversed(names):
            t0 = clock()
            alternatives[name]()
            sync(dev)
            times[name].append(clock() - t0)
    return times


def medians_ms(times: dict[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(ts) * 1e3 for name, ts in times.items()}


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
