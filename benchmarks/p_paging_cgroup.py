"""A server in a memory cgroup trains more models than the cgroup could hold, with no OOM kill.

``opentinker serve`` on SmolLM2 runs inside a cgroup (v1 ``memory.limit_in_bytes``, or v2
``memory.max``) of ``--limit`` bytes with ``--memory-budget``; one official SDK client creates
``--models`` rank-8 models and trains each one step (forward-backward + AdamW, so each holds its
weights and both moments: ~40 MB on SmolLM2, ~10 GB for 250 unpaged). Then it trains the first
model again (paged out by all the others). Reports the cgroup's peak usage against its limit, its
OOM kills, and the server's paging counters. Needs root (a writable ``/sys/fs/cgroup``).

    sudo .venv/bin/python benchmarks/p_paging_cgroup.py --models 250 --limit 4.5GiB --memory-budget 1GiB
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import tinker
from tinker import types

from opentinker.server.auth import create_key
from opentinker.server.local import free_port
from opentinker.service.memory import memory_budget_arg

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"


class Cgroup:
    """A fresh memory cgroup (v1 or v2) under the root hierarchy; removed on exit."""

    def __init__(self, limit: int) -> None:
        v1 = Path("/sys/fs/cgroup/memory")
        self.v1 = v1.is_dir()
        root = v1 if self.v1 else Path("/sys/fs/cgroup")
        self.path = root / f"opentinker-paging-{os.getpid()}"
        self.path.mkdir()
        (self.path / ("memory.limit_in_bytes" if self.v1 else "memory.max")).write_text(str(limit))

    def read(self, v1: str, v2: str) -> str:
        return (self.path / (v1 if self.v1 else v2)).read_text()

    def peak(self) -> int:
        return int(self.read("memory.max_usage_in_bytes", "memory.peak"))

    def oom_kills(self) -> int:
        text = self.read("memory.oom_control", "memory.events")
        return next((int(line.split()[1]) for line in text.splitlines() if line.startswith("oom_kill ")), 0)

    def close(self) -> None:
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def _datum(seed: int) -> types.Datum:
    tokens = [(seed * 37 + 11 * i) % 40000 + 3 for i in range(33)]
    inputs: dict[str, Any] = {"target_tokens": tokens[1:], "weights": [1.0] * 32}
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", type=int, default=250)
    p.add_argument("--limit", type=memory_budget_arg, default=int(4.5 * 2**30))
    p.add_argument("--memory-budget", default="1GiB")
    p.add_argument("--model", default=SMOLLM2)
    args = p.parse_args()
    group = Cgroup(int(args.limit))
    data = Path(tempfile.mkdtemp(prefix="opentinker-cgroup-"))
    ops = create_key(data, "ops")
    port = free_port()
    serve = [sys.executable, "-m", "opentinker.server", "--dev", "--base-model", args.model, "--operator", "ops",
             "--memory-budget", args.memory_budget, "--host", "127.0.0.1", "--port", str(port), "--data-dir", str(data)]  # fmt: skip
    procs = group.path / "cgroup.procs"
    log = (data / "server.log").open("wb")
    # the server's process joins the cgroup before it execs python: everything it allocates counts
    server = subprocess.Popen(
        ["sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh", *serve], stdout=log, stderr=log
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/api/v1/healthz", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(1)
        service = tinker.ServiceClient(base_url=url, api_key="tml-cgroup-user")
        adam = types.AdamParams(learning_rate=1e-3)
        t0 = time.perf_counter()
        first = None
        for i in range(args.models):
            tc = service.create_lora_training_client(args.model, rank=8, seed=i).result()
            loss = tc.forward_backward([_datum(i)], "cross_entropy").result().metrics["loss:sum"]
            tc.optim_step(adam).result()
            if first is None:
                first = (tc, loss)
            if (i + 1) % 25 == 0:
                print(
                    f"{i + 1} models, {time.perf_counter() - t0:.0f} s, cgroup peak {group.peak() / 2**30:.2f} GiB",
                    flush=True,
                )
        assert first is not None
        again = first[0].forward_backward([_datum(0)], "cross_entropy").result().metrics["loss:sum"]
        metrics = httpx.get(f"{url}/metrics", headers={"X-API-Key": ops}, timeout=30).text
        paging = [
            ln
            for ln in metrics.splitlines()
            if ln.startswith("opentinker_page") or "paged_out" in ln or "resident_model" in ln
        ]
        print("\n".join(paging))
        print(
            f"first model's loss {first[1]:.3f}, after its step and {args.models - 1} other models {again:.3f}"
        )
        hwm = next(
            ln for ln in Path(f"/proc/{server.pid}/status").read_text().splitlines() if ln.startswith("VmHWM")
        )
        print(f"server alive: {server.poll() is None}; OOM kills in the cgroup: {group.oom_kills()}; "
              f"server peak RSS {int(hwm.split()[1]) / 2**20:.2f} GiB (the cgroup's peak counts page cache too)")  # fmt: skip
        print(f"cgroup peak {group.peak() / 2**30:.2f} GiB of a {int(args.limit) / 2**30:.2f} GiB limit, "
              f"{args.models} models in {time.perf_counter() - t0:.0f} s")  # fmt: skip
    finally:
        server.terminate()
        server.wait(timeout=60)
        group.close()


if __name__ == "__main__":
    main()
