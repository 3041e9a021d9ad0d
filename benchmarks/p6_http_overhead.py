"""P6: an SFT step through the ``tinker`` SDK over HTTP ÷ the same step in-process.

What it measures (target: docs/DESIGN.md): one supervised training step — ``forward_backward`` of a batch of
``--batch`` × ``--seq`` tokens (``cross_entropy``) pipelined with an ``optim_step``, waiting for
both results — done two ways on the same base model, adapter config and data:

- **http**: the UNMODIFIED ``tinker`` SDK (``tinker.ServiceClient(base_url=…)``) against
  ``opentinker serve`` running in a child process on a loopback port: protobuf request, long-polled
  futures, protobuf result;
- **inproc**: the embedded ``opentinker.ServiceClient()`` in this process (same engine, scheduler
  and clients; no HTTP).

Ideal 1.0, target ≤ 1.10: the wire protocol, its encodings and the polling must cost little next
to the compute. Runs alternate (http, inproc, inproc, http, …) after warm-up steps, so a noisy
machine drifts on both alike; medians are quoted. Each side trains its own adapter (same seed),
and both processes are idle while the other one steps.

    python benchmarks/p6_http_overhead.py --model HuggingFaceTB/SmolLM2-135M-Instruct

The default model is ``opentinker/tiny`` (seconds); SmolLM2 takes about 2.5 minutes on 2 CPU
cores. Each side computes with ``--threads`` torch threads (default 1): two processes with two
OpenMP threads each on a shared 2-core machine oversubscribe it, and a step's time then swings
3-6x with whatever else runs, drowning the ~10 ms the HTTP layer costs (measured: 5.8-37 s for
the same SmolLM2 step, either side). The last line printed is ``P6 <http/inproc>``.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from timing import interleaved
from tinker import types

import opentinker
from opentinker.client import Runtime
from opentinker.server.local import LocalServer


def make_batch(vocab: int, batch: int, seq: int, seed: int = 0) -> list[types.Datum]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(batch):
        toks = [int(t) for t in rng.integers(3, vocab, seq + 1)]
        weights = [0.0] * (seq // 4) + [1.0] * (seq - seq // 4)  # a prompt, then the completion
        out.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(toks[:-1]),
                loss_fn_inputs={"target_tokens": toks[1:], "weights": weights},
            )
        )
    return out


def sft_step(client: Any, data: list[types.Datum], lr: float) -> float:
    fb = client.forward_backward(data, "cross_entropy")
    opt = client.optim_step(types.AdamParams(learning_rate=lr))
    loss = fb.result().metrics["loss:sum"]
    opt.result()
    return float(loss)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="opentinker/tiny")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--threads", type=int, default=1, help="torch threads on each side (0: torch's default)")
    args = p.parse_args(argv)
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    if args.threads:  # the same for this process and the server child (which inherits the env)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
        torch.set_num_threads(args.threads)
    logging.getLogger("tinker").setLevel(logging.ERROR)  # its "try_again" notices on long steps
    import tinker  # after TINKER_TELEMETRY is set

    with tempfile.TemporaryDirectory(prefix="p6-") as tmp:
        runtime = Runtime(os.path.join(tmp, "inproc"))
        local = opentinker.ServiceClient(runtime=runtime)
        tc_local = local.create_lora_training_client(args.model, rank=args.rank, seed=0)
        data = make_batch(runtime.base_stack(args.model).engine.vocab_size, args.batch, args.seq)
        server = LocalServer(["--dev", "--base-model", args.model], data_dir=os.path.join(tmp, "server"))
        with server:
            remote = tinker.ServiceClient(base_url=server.base_url, api_key="tml-p6-benchmark-key")
            tc_http = remote.create_lora_training_client(
                base_model=args.model, rank=args.rank, seed=0
            ).result()
            losses: dict[str, list[float]] = {"http": [], "inproc": []}
            alternatives: dict[str, Callable[[], object]] = {
                "http": lambda: losses["http"].append(sft_step(tc_http, data, args.lr)),
                "inproc": lambda: losses["inproc"].append(sft_step(tc_local, data, args.lr)),
            }
            times = interleaved(alternatives, args.repeats, args.warmup)
            remote.close("success").result()
        runtime.shutdown()
    # both adapters saw the same data from the same init: the same losses, step by step
    np.testing.assert_allclose(losses["http"], losses["inproc"], rtol=1e-4)
    tokens = args.batch * args.seq
    print(
        f"model {args.model}, batch {args.batch} x {args.seq} tokens, rank {args.rank}, {args.repeats} repeats"
    )
    print(f"{'run':<10} {'median ms':>10} {'min ms':>9} {'max ms':>9} {'tokens/s':>9}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(
            f"{name:<10} {med * 1e3:>10.1f} {min(ts) * 1e3:>9.1f} {max(ts) * 1e3:>9.1f} {tokens / med:>9.0f}"
        )
    print(f"best-of ratio {min(times['http']) / min(times['inproc']):.3f} (less sensitive to a busy machine)")
    ratio = statistics.median(times["http"]) / statistics.median(times["inproc"])
    print(f"P6 {ratio:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
