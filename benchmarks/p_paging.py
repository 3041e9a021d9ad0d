"""Paging: models held under a memory budget (``engine/paging.py``), measured side by side.

- **Pcap**: ``--models N`` models created under ``--budget`` and each trained ``--steps`` steps (a
  forward-backward and an optimizer step each) through the embedded clients; reports the peak
  RSS growth (``VmHWM``) against the budget and against the state the models hold in all.
- **Ppage-hot**: ``--active`` models train in lockstep (each pipelines forward-backward + optimizer
  step, every tick fuses them all) with ``--registered`` models registered (nearly all paged out)
  ÷ the same with only the active models registered, all resident. Target >= 0.95.
- **Psample-many**: ``--samplers`` sampling clients on as many distinct snapshots, one request
  each, all at once, under a budget that holds 64 snapshots ÷ all resident; tokens/s.
- **Ppage-cold**: a round-robin over ``--cold-factor`` x the budget's worth of models, so that every
  tick pages models in (prefetched while the previous tick computes) ÷ the same models all resident
  (no budget). Target >= 0.8 where a tick's compute outlasts its page-ins. Also the page-in rate
  ÷ the disk's sequential read bandwidth (read of a file of the same size, measured in this run).

    python benchmarks/p_paging.py --which cap --models 10000 --budget 64MiB
    python benchmarks/p_paging.py --which hot --registered 4096
    python benchmarks/p_paging.py --which cold --model HuggingFaceTB/SmolLM2-135M-Instruct
    python benchmarks/p_paging.py --which sample --samplers 1000

Runs alternate arms (paged, resident, resident, paged, ...) and quote medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from tinker import types

import opentinker
from opentinker.lora import LoRAConfig
from opentinker.service.memory import memory_budget_arg
from opentinker.service.runtime import Runtime

ADAM = types.AdamParams(learning_rate=1e-3)


def _datum(seed: int, n: int = 32) -> types.Datum:
    tokens = [(seed * 37 + 11 * i) % 900 + 3 for i in range(n + 1)]
    inputs: dict[str, Any] = {"target_tokens": tokens[1:], "weights": [1.0] * n}
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


def _rss_kib(field: str = "VmRSS") -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(field)


def _state_bytes(folder: Path, model: str, rank: int) -> int:
    """One model's most state (weights, gradients, moments), from a runtime that is then closed."""
    probe = Runtime(folder, memory_budget="off")
    try:
        return probe.base_stack(model).engine.state_bytes(LoRAConfig(rank=rank))
    finally:
        probe.shutdown()


def _clients(rt: Runtime, model: str, n: int, rank: int) -> list[Any]:
    service = opentinker.ServiceClient(runtime=rt)
    return [service.create_lora_training_client(model, rank=rank, seed=i) for i in range(n)]


def _steps(clients: list[Any], steps: int) -> float:
    """Seconds for ``steps`` rounds, every client pipelining forward-backward + optimizer step."""
    t0 = time.perf_counter()
    for s in range(steps):
        futs: list[Future[Any]] = []
        for i, tc in enumerate(clients):
            futs.append(tc.forward_backward([_datum(s * 1000 + i)], "cross_entropy"))
            futs.append(tc.optim_step(ADAM))
        for f in futs:
            f.result()
    return time.perf_counter() - t0


def cap(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as d:
        rt = Runtime(d, memory_budget=args.budget)
        rt.base_stack(args.model)
        per_model = rt.base_stack(args.model).engine.state_bytes(LoRAConfig(rank=args.rank))
        before = _rss_kib()
        service = opentinker.ServiceClient(runtime=rt)
        t0 = time.perf_counter()
        for i in range(args.models):
            tc = service.create_lora_training_client(args.model, rank=args.rank, seed=i)
            for s in range(args.steps):
                tc.forward_backward([_datum(i + s)], "cross_entropy").result()
                tc.optim_step(ADAM).result()
        wall = time.perf_counter() - t0
        growth = (_rss_kib("VmHWM") - before) * 1024
        pages = rt.base_stack(args.model).engine.pages.counts()
        rt.shutdown()
    print(f"models {args.models}, rank {args.rank}, {args.steps} steps each, {wall:.0f} s")
    print(
        f"state held in all: {args.models * per_model / 2**20:.0f} MiB; budget {args.budget / 2**20:.0f} MiB"
    )
    print(f"peak RSS growth {growth / 2**20:.0f} MiB = {growth / args.budget:.2f} x the budget; "
          f"page-outs {pages['page_outs']:.0f}, page-ins {pages['page_ins']:.0f}")  # fmt: skip
    print(f"Pcap {growth / args.budget:.2f}")


def hot(args: argparse.Namespace) -> None:
    ratios = []
    with tempfile.TemporaryDirectory() as d:
        per_model = _state_bytes(Path(d) / "probe", args.model, args.rank)
        budget = 2 * args.active * per_model + per_model  # a tick may use half: all active ones
        paged = Runtime(Path(d) / "paged", memory_budget=budget)
        resident = Runtime(Path(d) / "resident", memory_budget="off")
        p_clients = _clients(paged, args.model, args.active, args.rank)
        _clients(paged, args.model, args.registered - args.active, args.rank)  # paged out
        r_clients = _clients(resident, args.model, args.active, args.rank)
        _steps(p_clients, 1)
        _steps(r_clients, 1)
        for _ in range(args.repeats):
            tp, tr = _steps(p_clients, args.steps), _steps(r_clients, args.steps)
            tr2, tp2 = _steps(r_clients, args.steps), _steps(p_clients, args.steps)
            ratios += [tr / tp, tr2 / tp2]
        stats = paged.base_stack(args.model).engine.pages.counts()
        paged.shutdown()
        resident.shutdown()
    print(f"{args.active} active of {args.registered} registered; paged out {stats['paged_out']:.0f}")
    print(f"ratios {[round(r, 3) for r in ratios]}")
    print(f"Ppage-hot {statistics.median(ratios):.3f}")


def _disk_read_bandwidth(folder: Path, nbytes: int) -> float:
    path = folder / "probe.bin"
    path.write_bytes(os.urandom(min(nbytes, 1 << 28)))
    t0 = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(1 << 24):
            pass
    return path.stat().st_size / (time.perf_counter() - t0)


def cold(args: argparse.Namespace) -> None:
    ratios = []
    with tempfile.TemporaryDirectory() as d:
        per_model = _state_bytes(Path(d) / "probe", args.model, args.rank)
        budget = 2 * args.active * per_model + per_model
        n = int(args.cold_factor * budget / per_model)
        paged = Runtime(Path(d) / "paged", memory_budget=budget)
        resident = Runtime(Path(d) / "resident", memory_budget="off")
        p_clients, r_clients = (
            _clients(paged, args.model, n, args.rank),
            _clients(resident, args.model, n, args.rank),
        )
        _steps(p_clients, 1)
        _steps(r_clients, 1)
        pages = paged.base_stack(args.model).engine.pages
        ins0, bytes0, wait0, load0 = (
            pages.stats.page_ins,
            pages.stats.bytes_in,
            pages.stats.wait_s,
            pages.stats.load_s,
        )
        for k in range(args.repeats):  # alternating which arm runs first
            if k % 2:
                tr, tp = _steps(r_clients, args.steps), _steps(p_clients, args.steps)
            else:
                tp, tr = _steps(p_clients, args.steps), _steps(r_clients, args.steps)
            ratios.append(tr / tp)
        rate = (pages.stats.bytes_in - bytes0) / max(1e-9, pages.stats.load_s - load0)  # while paging in
        disk = _disk_read_bandwidth(Path(d), int(per_model * n))
        sched = paged.base_stack(args.model).scheduler.stats
        print(f"{n} models, {args.cold_factor}x a budget of {budget / 2**20:.1f} MiB; "
              f"page-ins {pages.stats.page_ins - ins0:.0f}, waited {pages.stats.wait_s - wait0:.2f} s, "
              f"ticks that waited {sched.waited_ticks} of {sched.ticks}")  # fmt: skip
        paged.shutdown()
        resident.shutdown()
    print(f"ratios {[round(r, 3) for r in ratios]}")
    print(f"page-in rate {rate / 2**20:.0f} MiB/s, disk read {disk / 2**20:.0f} MiB/s: {rate / disk:.3f}")
    print(f"Ppage-cold {statistics.median(ratios):.3f}")


def _snapshots(rt: Runtime, model: str, n: int, rank: int, per_model: int = 10) -> list[Any]:
    """``n`` sampling clients on ``n`` distinct snapshots: ``n / per_model`` models, each trained
    one step between its snapshots."""
    samplers = []
    for tc in _clients(rt, model, -(-n // per_model), rank):
        for k in range(per_model):
            if len(samplers) < n:
                tc.forward_backward([_datum(len(samplers))], "cross_entropy").result()
                tc.optim_step(ADAM).result()
                samplers.append(tc.save_weights_and_get_sampling_client(f"s{k}"))
    return samplers


def _sample_all(samplers: list[Any], tokens: int) -> float:
    """Tokens/s for one request per sampler, all submitted at once."""
    params = types.SamplingParams(max_tokens=tokens, temperature=1.0, seed=1, stop=[])
    t0 = time.perf_counter()
    futs = [
        sc.sample(types.ModelInput.from_ints([5, 9, 17 + i % 50]), 1, params) for i, sc in enumerate(samplers)
    ]
    n = sum(len(f.result().sequences[0].tokens) for f in futs)
    return n / (time.perf_counter() - t0)


def sample(args: argparse.Namespace) -> None:
    ratios = []
    with tempfile.TemporaryDirectory() as d:
        per_model = _state_bytes(Path(d) / "probe", args.model, args.rank)
        budget = 64 * (per_model // 4) + 2 * per_model  # 64 snapshots' weights, and the trained model's state
        paged = Runtime(Path(d) / "paged", memory_budget=budget)
        resident = Runtime(Path(d) / "resident", memory_budget="off")
        p_s, r_s = (
            _snapshots(paged, args.model, args.samplers, args.rank),
            _snapshots(resident, args.model, args.samplers, args.rank),
        )
        for _ in range(args.repeats):
            tp, tr = _sample_all(p_s, args.new_tokens), _sample_all(r_s, args.new_tokens)
            ratios.append(tp / tr)
            print(f"paged {tp:.0f} tokens/s, resident {tr:.0f} tokens/s", flush=True)
        pages = paged.base_stack(args.model).engine.pages.counts()
        paged.shutdown()
        resident.shutdown()
    print(f"{args.samplers} samplers on distinct snapshots, budget {budget / 2**20:.1f} MiB (64 snapshots); "
          f"page-ins {pages['page_ins']:.0f}, page-outs {pages['page_outs']:.0f}")  # fmt: skip
    print(f"ratios {[round(r, 3) for r in ratios]}")
    print(f"Psample-many {statistics.median(ratios):.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--which", choices=("cap", "hot", "cold", "sample"), required=True)
    p.add_argument("--model", default="opentinker/tiny")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--models", type=int, default=10000)
    p.add_argument("--budget", type=memory_budget_arg, default=64 << 20)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--active", type=int, default=8)
    p.add_argument("--registered", type=int, default=4096)
    p.add_argument("--cold-factor", type=float, default=4.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--samplers", type=int, default=1000)
    p.add_argument("--new-tokens", type=int, default=16)
    args = p.parse_args()
    {"cap": cap, "hot": hot, "cold": cold, "sample": sample}[args.which](args)


if __name__ == "__main__":
    main()
