"""``kill -9`` during a page-out: no checkpoint is lost, and a restart removes the dead process's
page files (they are not checkpoints: a model's unsaved state goes with its process).

A child process trains models under a budget of one model, so that every operation pages one out;
it saves a checkpoint first. The test kills it with SIGKILL while a page file is half written (its
temporary file exists), then opens a runtime on the same data dir."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import opentinker
from opentinker.service.runtime import Runtime
from tests.conftest import TEST_MODEL

CHILD = """
import sys
import opentinker
from tinker import types
from opentinker.service.runtime import Runtime

rt = Runtime(sys.argv[1], memory_budget=int(sys.argv[2]))
service = opentinker.ServiceClient(runtime=rt)
datum = types.Datum(
    model_input=types.ModelInput.from_ints(list(range(3, 40))),
    loss_fn_inputs={"target_tokens": list(range(4, 41)), "weights": [1.0] * 37},
)
tc = service.create_lora_training_client(sys.argv[3], rank=64, seed=0)
tc.forward_backward([datum], "cross_entropy").result()
tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
print(tc.save_state("kept").result().path, flush=True)
clients = [tc]
while True:  # every operation pages the other models out
    clients.append(service.create_lora_training_client(sys.argv[3], rank=64, seed=len(clients)))
    for c in clients[-3:]:
        c.forward_backward([datum], "cross_entropy").result()
        c.optim_step(types.AdamParams(learning_rate=1e-2)).result()
"""


def _killed_mid_page_out(data: Path, budget: int, timeout: float = 300.0) -> tuple[str, bool]:
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(data), str(budget), TEST_MODEL],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    path = proc.stdout.readline().strip()
    assert path.startswith("tinker://"), path
    deadline, caught = time.monotonic() + timeout, False
    pages = data / "pages"
    while time.monotonic() < deadline and proc.poll() is None:
        if any(p.suffix == ".tmp" for d in pages.glob("*") for p in d.iterdir()):
            os.kill(proc.pid, signal.SIGKILL)  # while that page file is half written
            caught = True
            break
    if not caught:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    return path, caught


def test_kill_9_during_a_page_out_loses_no_checkpoint(tmp_path: Path) -> None:
    data = tmp_path / "data"
    rt = Runtime(None, memory_budget="off")
    per_model = rt.base_stack(TEST_MODEL).engine.state_bytes(opentinker.lora.LoRAConfig(rank=64))
    rt.shutdown()
    path, caught = _killed_mid_page_out(data, per_model)
    assert caught, "no page-out was seen under way in the time given"
    assert list((data / "pages").glob("*/*")), "the dead process left page files"

    restarted = Runtime(data, memory_budget=per_model)
    try:
        assert not list((data / "pages").glob("*")), "a restart removes a dead process's page files"
        tc = opentinker.ServiceClient(runtime=restarted).create_training_client_from_state_with_optimizer(
            path
        )
        state = restarted.base_stack(TEST_MODEL).engine.optimizer_state(tc.model_id)
        assert state and all(bool(t.isfinite().all()) for t in state.values())  # checksummed, whole
    finally:
        restarted.shutdown()
