"""P14: the engine's throughput with the console open and polling ÷ without it.

The workload, through the unmodified ``tinker`` SDK against ``opentinker serve`` in a child process:
``--adapters`` LoRA adapters of one tenant; a *round* is, for every adapter at once, one
``forward_backward`` (``--batch`` × ``--seq`` tokens, ``cross_entropy``) with its ``optim_step``,
and one ``sample`` of ``--samples`` × ``--max-tokens`` tokens from a sampler of that adapter, all
submitted before any is awaited (so they fuse into shared ticks and share decode batches). A
*block* is ``--rounds`` rounds, timed.

The console: a second process polls, with the tenant's key, what an open console page reads. With
``--page engine`` (the default) that is the live engine page, the page that polls fastest: its
``engine`` route once per ``--poll-interval`` seconds (1 s, the page's own interval; every other
page reads its routes once when opened, and a run's curves every 3 s). With ``--page all`` it is a
stress bound no real page makes: every console JSON route (``whoami``, ``engine``, ``sessions``, a
session's ``trace``, ``models``, a run with its curves, its ``lineage``, ``checkpoints``; not the
PEFT download, which is a click, not a poll) once per interval. It is switched on for the ``console`` blocks and off
for the ``plain`` blocks; the two alternate (plain, console, console, plain, …) after a warm-up
of each, so a noisy machine drifts on both alike.

Reported: training steps/s and sampled tokens/s per condition (medians over blocks) and three
ratios, with the console ÷ without (ideal 1.0, target ≤ 1.02):

- **wall time** per block, the median of the (plain, console) pairs: the throughput ratio itself,
  and the last line ``P14 <ratio>``. On a shared machine its blocks swing far more than 2 %, so
  read it with the next two;
- **server cpu** per block: the server process's user + system seconds (``/proc``), which other
  processes on the machine hardly move;
- **the serialized bound**: the idle server's cpu while polled minus unpolled, per second, as a
  share of one core (``--idle-s`` each). Were every bit of it taken from the engine (the event
  loop and the engine's thread share one interpreter lock), throughput would drop by that share.

The poller's request count per condition is printed too (the console blocks must have polled, the
plain ones must not have).

    python benchmarks/p14_console_overhead.py                       # opentinker/tiny, ~3 minutes
    python benchmarks/p14_console_overhead.py --model HuggingFaceTB/SmolLM2-135M-Instruct --rounds 1
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import quote

import numpy as np
from tinker import types

from opentinker.server.auth import create_key
from opentinker.server.local import LocalServer

CONSOLE = "/console/api"


def console_routes(model_ids: list[str]) -> list[str]:
    """The console JSON routes an open server page reads, with this tenant's ids."""
    session = model_ids[0].split(":train:")[0]
    first = quote(model_ids[0])
    return [
        f"{CONSOLE}/whoami",
        f"{CONSOLE}/engine",
        f"{CONSOLE}/sessions",
        f"{CONSOLE}/sessions/{quote(session)}/trace",
        f"{CONSOLE}/models",
        f"{CONSOLE}/models/{first}",
        f"{CONSOLE}/models/{first}/lineage",
        f"{CONSOLE}/checkpoints",
    ]


def poller(
    base_url: str, key: str, routes: list[str], interval: float, on: Any, stop: Any, count: Any, busy: Any
) -> None:
    """While ``on`` is set: every route once per ``interval`` s; each answer must be 200. Once
    ``on`` is cleared no new request starts; ``busy`` is 0 while none is in flight."""
    import httpx

    with httpx.Client(base_url=base_url, headers={"X-API-Key": key}, timeout=60) as client:
        while not stop.is_set():
            if not on.wait(0.05):
                continue
            t0 = time.monotonic()
            for route in routes:
                busy.value = 1
                if not on.is_set():
                    busy.value = 0
                    break
                r = client.get(route)
                r.read()
                with count.get_lock():
                    count.value += 1
                busy.value = 0
                if r.status_code != 200:
                    raise RuntimeError(f"{route}: HTTP {r.status_code} {r.text[:200]}")
            while on.is_set() and time.monotonic() - t0 < interval:
                time.sleep(0.01)


class Block(NamedTuple):
    wall: float  # seconds
    cpu: float  # the server process's cpu seconds (user + system)
    steps: int
    tokens: int
    polls: int  # console requests answered meanwhile


def cpu_seconds(pid: int) -> float:
    """User + system cpu time of process ``pid`` (Linux ``/proc``), its threads included."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def make_batch(vocab: int, batch: int, seq: int, seed: int) -> list[types.Datum]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(batch):
        toks = [int(t) for t in rng.integers(3, vocab, seq + 1)]
        out.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(toks[:-1]),
                loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * seq},
            )
        )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="opentinker/tiny")
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--batch", type=int, default=4, help="datums per forward_backward")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--samples", type=int, default=4, help="num_samples per sample request")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=20, help="rounds per timed block")
    p.add_argument("--repeats", type=int, default=8, help="timed blocks per condition")
    p.add_argument("--warmup", type=int, default=1, help="untimed blocks per condition first")
    p.add_argument("--poll-interval", type=float, default=1.0)
    p.add_argument(
        "--page", choices=("engine", "all"), default="engine",
        help="engine: what the open live-engine page polls; all: every console route each interval",
    )  # fmt: skip
    p.add_argument("--idle-s", type=float, default=20.0, help="the idle server's cpu, polled and not")
    p.add_argument("--threads", type=int, default=1, help="torch threads in the server (0: torch's default)")
    args = p.parse_args(argv)
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    logging.getLogger("tinker").setLevel(logging.ERROR)
    import tinker  # after TINKER_TELEMETRY is set

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="p14-") as tmp:
        key = create_key(tmp, "bench")
        with LocalServer(["--base-model", args.model], data_dir=tmp) as server:
            service = tinker.ServiceClient(base_url=server.base_url, api_key=key)
            tcs = [
                service.create_lora_training_client(base_model=args.model, rank=args.rank, seed=k).result()
                for k in range(args.adapters)
            ]
            vocab = tcs[0].get_tokenizer().vocab_size
            data = [make_batch(vocab, args.batch, args.seq, seed=k) for k in range(args.adapters)]
            samplers = [tc.save_weights_and_get_sampling_client().result() for tc in tcs]
            prompt = types.ModelInput.from_ints(list(range(5, 5 + 24)))
            tcs[0].save_state("p14-start").result()  # the checkpoints and lineage pages have a row
            params = types.SamplingParams(max_tokens=args.max_tokens, temperature=1.0, stop=[], seed=0)

            def block() -> tuple[int, int]:
                steps = tokens = 0
                for _ in range(args.rounds):
                    futs: list[Future[Any]] = []
                    for tc, d in zip(tcs, data, strict=True):
                        futs += [
                            tc.forward_backward(d, "cross_entropy"),
                            tc.optim_step(types.AdamParams(learning_rate=1e-4)),
                        ]
                    samples = [s.sample(prompt, args.samples, params) for s in samplers]
                    for f in futs:
                        f.result()
                    steps += len(tcs)
                    tokens += sum(len(seq.tokens) for f in samples for seq in f.result().sequences)
                return steps, tokens

            on, stop, count, busy = ctx.Event(), ctx.Event(), ctx.Value("l", 0), ctx.Value("i", 0)
            routes = console_routes([tc.model_id for tc in tcs])
            if args.page == "engine":
                routes = [r for r in routes if r.endswith("/engine")]
            proc = ctx.Process(
                target=poller,
                args=(server.base_url, key, routes, args.poll_interval, on, stop, count, busy),
                daemon=True,
            )
            proc.start()
            assert server.proc is not None
            pid = server.proc.pid
            results: dict[str, list[Block]] = {"plain": [], "console": []}

            def quiet() -> None:
                """Polling off, and the request in flight (if any) answered."""
                on.clear()
                while busy.value and proc.is_alive():
                    time.sleep(0.005)

            def run(name: str, timed: bool) -> None:
                if name == "console":
                    on.set()
                before, cpu0 = count.value, cpu_seconds(pid)
                t0 = time.perf_counter()
                steps, tokens = block()
                dt = time.perf_counter() - t0
                cpu = cpu_seconds(pid) - cpu0
                quiet()
                if not proc.is_alive():
                    raise RuntimeError("the console poller failed; see its traceback above")
                if timed:
                    results[name].append(Block(dt, cpu, steps, tokens, count.value - before))

            def idle(seconds: float, polling: bool) -> tuple[float, int]:
                """The server's CPU seconds over ``seconds`` of no work, polled or not; polls made."""
                if polling:
                    on.set()
                before, cpu0 = count.value, cpu_seconds(pid)
                time.sleep(seconds)
                quiet()
                return cpu_seconds(pid) - cpu0, count.value - before

            try:
                for _ in range(args.warmup):
                    run("plain", False)
                    run("console", False)
                for rep in range(args.repeats):
                    for name in ("plain", "console") if rep % 2 == 0 else ("console", "plain"):
                        run(name, True)
                idle_quiet, _ = idle(args.idle_s, False)
                idle_polled, idle_polls = idle(args.idle_s, True)
            finally:
                stop.set()
                proc.join(timeout=30)

    print(
        f"model {args.model}, {args.adapters} adapters (rank {args.rank}), a round = per adapter "
        f"forward_backward {args.batch}x{args.seq} + optim_step + sample {args.samples}x{args.max_tokens}; "
        f"{args.rounds} rounds a block, {args.repeats} blocks each, console polls {len(routes)} routes "
        f"every {args.poll_interval:g} s (--page {args.page})"
    )
    print(
        f"{'condition':<10} {'median s':>9} {'min s':>7} {'max s':>7} {'server cpu s':>12} "
        f"{'steps/s':>8} {'tokens/s':>9} {'requests':>8}"
    )
    med: dict[str, float] = {}
    cpu: dict[str, float] = {}
    for name, rows in results.items():
        ts = [r.wall for r in rows]
        med[name] = statistics.median(ts)
        cpu[name] = statistics.median([r.cpu for r in rows])
        steps_s = statistics.median([r.steps / r.wall for r in rows])
        toks_s = statistics.median([r.tokens / r.wall for r in rows])
        polls = sum(r.polls for r in rows)
        print(
            f"{name:<10} {med[name]:>9.3f} {min(ts):>7.3f} {max(ts):>7.3f} {cpu[name]:>12.3f} "
            f"{steps_s:>8.2f} {toks_s:>9.0f} {polls:>8}"
        )
    if sum(r.polls for r in results["console"]) == 0 or sum(r.polls for r in results["plain"]) != 0:
        raise SystemExit("the poller did not poll in exactly the console blocks: the comparison is void")
    pairs = [c.wall / q.wall for q, c in zip(results["plain"], results["console"], strict=True)]
    print(f"wall-clock ratios per pair: {' '.join(f'{r:.3f}' for r in pairs)}")
    wall = statistics.median(pairs)
    best = min(r.wall for r in results["console"]) / min(r.wall for r in results["plain"])
    cpu_ratio = cpu["console"] / cpu["plain"]
    # the console's own cost, measured with nothing else running on the server: if all of it came
    # out of the engine's time (the event loop and the engine's thread share one interpreter
    # lock), the engine would run at 1 / (1 + this share of a core) of its speed
    core_share = (idle_polled - idle_quiet) / args.idle_s
    per_request_ms = (idle_polled - idle_quiet) / max(1, idle_polls) * 1e3
    print(
        f"idle server: {idle_quiet:.2f} cpu s unpolled, {idle_polled:.2f} polled ({idle_polls} requests) "
        f"over {args.idle_s:g} s: {per_request_ms:.2f} ms of server cpu per console request, "
        f"{core_share * 1e3:.1f} ms per second polled"
    )
    print(
        f"with the console / without: wall time {wall:.3f} (median of pairs; best-of {best:.3f}); "
        f"server cpu per block {cpu_ratio:.3f}; serialized bound from the idle cost {1 + core_share:.3f}"
    )
    print(f"P14 {wall:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
