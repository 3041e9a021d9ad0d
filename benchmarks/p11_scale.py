"""P11: scaling training over Ray trainer workers, and the per-op costs the capacity model uses.

``train``: 8 tenants, one thread each, in a training-bound loop (``forward_backward`` of
``--rows`` datums of ``--seq`` tokens + ``optim_step``; no sampling), served by
``Runtime(trainer_workers=1)`` and ``Runtime(trainer_workers=2)`` (each worker one CPU, one torch
thread), both alive at once and timed in alternating rounds; aggregate optimizer steps per second.
Line ``P11train <2 workers ÷ 1>``. The in-process runtime (one torch thread, no Ray) runs the same
loop as the baseline the routing overhead is read against.

``rollout``: 8 sampling-bound RL loops, one thread each (per step: save the weights for a sampler,
sample ``--samples`` replies of ``--rollout-tokens`` tokens, then train on one short datum), served
by one trainer (the runtime's own engine, one torch thread) with 1 and with 2 Ray rollout workers
(one torch thread each), both alive at once and timed in alternating rounds; aggregate episodes
per second. Line ``P11rollout <2 rollout workers ÷ 1>``, and how long a loop waited for its
samples and for its training per round. ``--overlap`` pipelines each loop one step off-policy,
as asynchronous RL runs (the samples of step s + 1, from the weights saved before step s trains,
are asked for before step s trains), so the training hides under the next rollouts.
Also printed per round: the CPU seconds the rollout actors and this process (the trainer and the
loops) spent, of the core-seconds the machine had (Linux ``/proc``), which says whether two
workers were short of a core or of work.

``costs`` (one engine in this process, one thread): a fused forward/backward + optimizer step
against the rows in it (the trainer's cost model, ``step(rows) = a + b·rows``), the LoRA snapshot
bytes per policy version (what a handoff moves), and decode tokens per second for a mixed batch
(the sampler's). ``docs/SCALING.md`` projects these to a cluster.

    python benchmarks/p11_scale.py [--what train|rollout|costs|both] [--model opentinker/tiny] [--steps 6] [--repeats 3] [--overlap] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from tinker import types

import opentinker
from opentinker.client import Runtime
from opentinker.cluster.ray_env import LOCAL_SYSTEM_CONFIG
from opentinker.engine import AdamParams, Engine, Example, ForwardRequest
from opentinker.lora import LoRAConfig
from opentinker.models.registry import SMOLLM2 as SMOLLM2_INSTRUCT

TENANTS = 8


def _datums(seed: int, rows: int, seq: int, vocab: int) -> list[types.Datum]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(rows):
        toks = torch.randint(3, vocab, (seq + 1,), generator=g).tolist()
        out.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(toks[:-1]),
                loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * seq},
            )
        )
    return out


def _start_ray(num_cpus: int) -> None:
    import ray

    ray.init(
        num_cpus=num_cpus,
        object_store_memory=300 * 2**20,
        include_dashboard=False,
        log_to_driver=False,
        _system_config=LOCAL_SYSTEM_CONFIG,  # workers at nice 0, as the server starts them
    )


def train_round(clients: list[Any], data: list[list[types.Datum]], steps: int) -> float:
    """Every tenant's ``steps`` training steps, all tenants at once; seconds."""
    barrier = threading.Barrier(len(clients) + 1)

    def loop(tc: Any, d: list[types.Datum]) -> None:
        barrier.wait()
        for _ in range(steps):
            fb = tc.forward_backward(d, "cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=1e-4)).result()
            fb.result()

    return _timed(
        [threading.Thread(target=loop, args=(tc, d)) for tc, d in zip(clients, data, strict=True)], barrier
    )


def _timed(threads: list[threading.Thread], barrier: threading.Barrier) -> float:
    """Start every tenant's thread, release them together at ``barrier``; seconds until all end."""
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def bench_train(args: argparse.Namespace, model: str) -> dict[str, Any]:
    import ray

    _start_ray(3)
    root = Path(tempfile.mkdtemp(prefix="p11-"))
    runtimes = {
        "in-process": Runtime(root / "plain"),
        "1 trainer worker": Runtime(root / "w1", trainer_workers=1),
        "2 trainer workers": Runtime(root / "w2", trainer_workers=2),
    }
    setups = {}
    try:
        for name, rt in runtimes.items():
            svc = opentinker.ServiceClient(runtime=rt)
            clients = [svc.create_lora_training_client(model, rank=8, seed=i) for i in range(TENANTS)]
            vocab = rt.base_model_info(model).vocab_size
            data = [_datums(i, args.rows, args.seq, vocab) for i in range(TENANTS)]
            train_round(clients, data, 1)  # warm-up: first-use costs on every worker
            setups[name] = (clients, data)
        times: dict[str, list[float]] = {n: [] for n in runtimes}
        names = list(runtimes)
        for rep in range(args.repeats):
            for name in names if rep % 2 == 0 else reversed(names):
                clients, data = setups[name]
                times[name].append(train_round(clients, data, args.steps))
        placement = runtimes["2 trainer workers"].engine_stats()[0]["trainer_workers"]
    finally:
        for rt in runtimes.values():
            rt.shutdown()
        ray.shutdown()
    steps = TENANTS * args.steps
    rates = {n: steps / statistics.median(ts) for n, ts in times.items()}
    print(
        f"{'run':<20} {'median s':>9} {'steps/s':>8}   ({TENANTS} tenants x {args.steps} steps, {args.rows}x{args.seq})"
    )
    for n, ts in times.items():
        print(f"{n:<20} {statistics.median(ts):>9.2f} {rates[n]:>8.2f}")
    ratio = rates["2 trainer workers"] / rates["1 trainer worker"]
    print(f"P11train {ratio:.2f}")
    print(f"P11route {rates['1 trainer worker'] / rates['in-process']:.2f}  (1 worker over Ray ÷ in-process)")
    return {"times_s": times, "steps_per_s": rates, "P11train": ratio, "placement": placement}


def rollout_round(
    clients: list[Any], data: list[list[types.Datum]], args: argparse.Namespace, phases: dict[str, float]
) -> float:
    """Every tenant's ``args.steps`` RL-shaped steps (sampling-bound), all at once; seconds.
    ``phases`` gains each loop's seconds spent waiting for its samples and for its training.

    In order (the default), a loop saves its weights, samples from them, then trains on the
    result. With ``args.overlap`` it is pipelined one step off-policy, as asynchronous RL runs: the
    samples of step s + 1 are asked for (from the weights saved before step s trains) before step
    s trains, so a loop's training runs while its next rollouts decode."""
    barrier = threading.Barrier(len(clients) + 1)
    params = types.SamplingParams(max_tokens=args.rollout_tokens, temperature=1.0, stop=[])
    lock = threading.Lock()

    def loop(i: int, tc: Any, d: list[types.Datum]) -> None:
        waited = {"sample": 0.0, "train": 0.0}

        def ask(step: int) -> Any:
            sc = tc.save_weights_and_get_sampling_client(f"t{i}-s{step}")
            prompt = types.ModelInput.from_ints([1, 5 + i, 9, 20 + step])
            return sc.sample(prompt=prompt, num_samples=args.samples, sampling_params=params)

        def timed(kind: str, fn: Any) -> None:
            t = time.perf_counter()
            fn()
            waited[kind] += time.perf_counter() - t

        def train() -> None:
            fb = tc.forward_backward(d, "cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=1e-4)).result()
            fb.result()

        barrier.wait()
        pending = ask(0) if args.overlap else None
        for step in range(args.steps):
            if args.overlap:
                timed("sample", pending.result)
                pending = ask(step + 1) if step + 1 < args.steps else None
            else:
                timed("sample", lambda s=step: ask(s).result())
            timed("train", train)
        with lock:
            for k, v in waited.items():
                phases[k] = phases.get(k, 0.0) + v / len(clients)

    pairs = enumerate(zip(clients, data, strict=True))
    return _timed([threading.Thread(target=loop, args=(i, tc, d)) for i, (tc, d) in pairs], barrier)


def _cpu_seconds() -> dict[str, float]:
    """CPU seconds (user + system) so far of this process and of every Ray rollout actor on this
    machine, by pid (Linux ``/proc``; empty elsewhere)."""
    proc = Path("/proc")
    if not proc.is_dir():
        return {}
    me, tick, out = str(os.getpid()), os.sysconf("SC_CLK_TCK"), {}
    for pid in (p.name for p in proc.iterdir() if p.name.isdigit()):
        try:
            cmd = (proc / pid / "cmdline").read_bytes()
            fields = (proc / pid / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # it ended meanwhile
            continue
        if pid == me or cmd.startswith(b"ray::RolloutActor"):
            out[pid] = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return out


def _accounted_round(
    clients: list[Any], data: list[list[types.Datum]], args: argparse.Namespace, phases: dict[str, float],
    cpu: dict[str, float],
) -> float:  # fmt: skip
    """:func:`rollout_round`, adding to ``cpu`` the CPU seconds this process ("driver") and the
    rollout actors ("workers") spent in it, and the core-seconds the machine had ("available")."""
    before = _cpu_seconds()
    wall = rollout_round(clients, data, args, phases)
    after = _cpu_seconds()
    me = str(os.getpid())
    spent = {pid: t - before.get(pid, 0.0) for pid, t in after.items()}
    cpu["driver"] = cpu.get("driver", 0.0) + spent.pop(me, 0.0)
    cpu["workers"] = cpu.get("workers", 0.0) + sum(spent.values())
    cpu["available"] = cpu.get("available", 0.0) + wall * (os.cpu_count() or 1)
    return wall


def bench_rollout(args: argparse.Namespace, model: str) -> dict[str, Any]:
    import ray

    torch.set_num_threads(1)  # the trainer: one thread, like each rollout worker
    _start_ray(2)
    root = Path(tempfile.mkdtemp(prefix="p11r-"))
    runtimes = {
        f"{k} rollout worker{'s' if k > 1 else ''}": Runtime(
            root / f"r{k}", rollout_workers=k, ray="local", worker_cpus=0.5
        )
        for k in (1, 2)
    }
    setups = {}
    try:
        for name, rt in runtimes.items():
            svc = opentinker.ServiceClient(runtime=rt)
            clients = [svc.create_lora_training_client(model, rank=8, seed=i) for i in range(TENANTS)]
            vocab = rt.base_model_info(model).vocab_size
            data = [_datums(i, 1, 16, vocab) for i in range(TENANTS)]
            warm = argparse.Namespace(**{**vars(args), "steps": 1})
            rollout_round(clients, data, warm, {})  # first-use costs on every worker
            setups[name] = (clients, data)
        times: dict[str, list[float]] = {n: [] for n in runtimes}
        phases: dict[str, dict[str, float]] = {n: {} for n in runtimes}
        cpu: dict[str, dict[str, float]] = {n: {} for n in runtimes}
        names = list(runtimes)
        for rep in range(args.repeats):
            for name in names if rep % 2 == 0 else reversed(names):
                clients, data = setups[name]
                times[name].append(_accounted_round(clients, data, args, phases[name], cpu[name]))
    finally:
        for rt in runtimes.values():
            rt.shutdown()
        ray.shutdown()
    episodes = TENANTS * args.steps * args.samples
    rates = {n: episodes / statistics.median(ts) for n, ts in times.items()}
    print(
        f"{'run':<20} {'median s':>9} {'episodes/s':>10}   ({TENANTS} loops x {args.steps} steps x "
        f"{args.samples} samples of {args.rollout_tokens} tokens)"
    )
    for n, ts in times.items():
        waits = {k: v / args.repeats for k, v in phases[n].items()}
        print(
            f"{n:<20} {statistics.median(ts):>9.2f} {rates[n]:>10.2f}   a loop waits per round: "
            f"{waits.get('sample', 0.0):.2f} s for samples, {waits.get('train', 0.0):.2f} s for training"
        )
        c = {k: v / args.repeats for k, v in cpu[n].items()}
        if c.get("available"):
            print(
                f"{'':<20} CPU per round: rollout workers {c['workers']:.1f} s, this process (trainer, "
                f"loops) {c['driver']:.1f} s, of {c['available']:.1f} core-s "
                f"({(c['workers'] + c['driver']) / c['available']:.0%} busy)"
            )
    ratio = rates["2 rollout workers"] / rates["1 rollout worker"]
    print(f"P11rollout {ratio:.2f}{'  (pipelined one step off-policy)' if args.overlap else ''}")
    return {"times_s": times, "episodes_per_s": rates, "P11rollout": ratio, "waits_s": phases, "cpu_s": cpu}


def bench_costs(args: argparse.Namespace, model: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    eng = Engine(model)
    vocab = eng.vocab_size
    aid = eng.create_adapter(LoRAConfig(rank=8, seed=0))
    step_ms: dict[int, float] = {}
    for rows in args.cost_rows:
        g = torch.Generator().manual_seed(rows)
        ex = []
        for _ in range(rows):
            seq = torch.randint(3, vocab, (args.seq + 1,), generator=g)
            ex.append(Example(seq[:-1], {"target_tokens": seq[1:], "weights": torch.ones(args.seq)}))
        ts = []
        for _ in range(args.repeats + 1):
            t0 = time.perf_counter()
            eng.forward_backward(ForwardRequest(aid, ex))
            eng.optim_step(aid, AdamParams(learning_rate=1e-4))
            ts.append(time.perf_counter() - t0)
        step_ms[rows] = statistics.median(ts[1:]) * 1e3
    xs, ys = list(step_ms), list(step_ms.values())
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    snap = {r: eng.snapshot(eng.create_adapter(LoRAConfig(rank=r, seed=0))).nbytes for r in (8, 32)}
    # decode: 16 rows on 16 adapters, --new-tokens each, through the embedded sampler
    rt = Runtime(Path(tempfile.mkdtemp(prefix="p11-sample-")))
    try:
        svc = opentinker.ServiceClient(runtime=rt)
        samplers = [
            svc.create_lora_training_client(model, rank=8, seed=i)
            .save_weights_and_get_sampling_client()
            .result()
            for i in range(16)
        ]
        params = types.SamplingParams(max_tokens=args.new_tokens, temperature=1.0, seed=1, stop=[])
        prompt = types.ModelInput.from_ints(list(range(3, 35)))
        rates = []
        for _ in range(args.repeats + 1):
            t0 = time.perf_counter()
            futs = [s.sample(prompt, 1, params) for s in samplers]
            toks = sum(len(f.result().sequences[0].tokens) for f in futs)
            rates.append(toks / (time.perf_counter() - t0))
        tok_s = statistics.median(rates[1:])
    finally:
        rt.shutdown()
    print(
        f"fused step (fwd+bwd+optim, seq {args.seq}) ms by rows: "
        + ", ".join(f"{r}: {v:.0f}" for r, v in step_ms.items())
    )
    print(f"  fit: {my - slope * mx:.1f} ms + {slope:.2f} ms/row")
    print(f"snapshot bytes: rank 8 {snap[8]:,}, rank 32 {snap[32]:,}")
    print(f"decode, 16 adapters x 1 row, {args.new_tokens} new tokens: {tok_s:.0f} tokens/s")
    return {
        "step_ms_by_rows": step_ms,
        "step_fit_ms": {"fixed": my - slope * mx, "per_row": slope},
        "snapshot_bytes": snap,
        "decode_tokens_per_s_16_rows": tok_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=SMOLLM2_INSTRUCT)
    ap.add_argument("--what", choices=("train", "rollout", "costs", "both"), default="both")
    ap.add_argument("--steps", type=int, default=4, help="training steps per tenant per timed round")
    ap.add_argument("--rows", type=int, default=2, help="datums per tenant per step")
    ap.add_argument("--seq", type=int, default=64, help="tokens per datum")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cost-rows", type=int, nargs="+", default=[4, 8, 16, 32])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--samples", type=int, default=4, help="rollout: replies per step per loop")
    ap.add_argument("--rollout-tokens", type=int, default=64, help="rollout: tokens per reply")
    ap.add_argument("--overlap", action="store_true", help="rollout: pipeline each loop one step off-policy")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    model = args.model
    out: dict[str, Any] = {"model": model, "args": {k: v for k, v in vars(args).items() if k != "json"}}
    if args.what in ("costs", "both"):
        out["costs"] = bench_costs(args, model)
    if args.what in ("train", "both"):
        out["train"] = bench_train(args, model)
    if args.what == "rollout":
        out["rollout"] = bench_rollout(args, model)
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
