"""Load and crash tests for ``opentinker serve``, driven by the UNMODIFIED ``tinker`` SDK.

1. 16 SDK clients in parallel, each in its own (spawned) process, each running a sample / SFT
   loop on its own LoRA model; every client's losses must equal the same client's losses run
   solo against the same server (only clients 0 and 7 are re-run solo, with fresh model ids, to
   keep the runtime down; the per-client data is a pure function of (client, step)).
2. ``kill -9`` of the server while a client's training loop runs in another process; after a
   restart on the same data dir the checkpoints saved before the crash are listed and loadable.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tinker
from tinker import types

from opentinker.server.local import LocalServer
from tests.conftest import TEST_MODEL, local_server
from tests.test_server_conformance import DEV_KEY, _datum
from tests.tolerances import TRAJECTORY_REL, assert_scalar_close

pytestmark = pytest.mark.slow

N_CLIENTS = 16
N_STEPS = 20
SOLO = (0, 7)
SPAWN = mp.get_context("spawn")


def _server_env(mp_: pytest.MonkeyPatch) -> None:
    mp_.setenv("TINKER_TELEMETRY", "0")  # spawned children inherit os.environ
    for var in ("TINKER_API_KEY", "TINKER_BASE_URL"):
        mp_.delenv(var, raising=False)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    with local_server(tmp_path_factory, "load-data") as srv:
        yield srv


def _step_data(client: int, step: int) -> list[types.Datum]:
    """Two fixed SFT datums per (client, step), independent of anything sampled."""
    rng = np.random.default_rng(client * 1000 + step)
    return [_datum([int(t) for t in rng.integers(3, 1000, n)]) for n in (12, 9)]


PROMPT = [5, 17, 123, 42, 7, 99]


def run_client(base_url: str, client: int, n_steps: int = N_STEPS) -> dict[str, Any]:
    """One SDK client's loop (top level, so a spawned process can run it)."""
    os.environ["TINKER_TELEMETRY"] = "0"
    sc = tinker.ServiceClient(base_url=base_url, api_key=DEV_KEY)
    t0 = time.monotonic()
    tc = sc.create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=client).result()
    setup_s = time.monotonic() - t0
    losses: list[float] = []
    samples: list[list[list[int]]] = []
    step_s: list[float] = []
    prompt = types.ModelInput.from_ints(PROMPT)
    for step in range(n_steps):
        t = time.monotonic()
        sampler = tc.save_weights_and_get_sampling_client().result()
        params = types.SamplingParams(max_tokens=4, temperature=1.0, seed=client * 1000 + step)
        res = sampler.sample(prompt, num_samples=2, sampling_params=params).result()
        assert len(res.sequences) == 2 and all(1 <= len(s.tokens) <= 4 for s in res.sequences)
        samples.append([list(s.tokens) for s in res.sequences])
        fb = tc.forward_backward(_step_data(client, step), "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=1e-3))
        losses.append(float(fb.result().metrics["loss:sum"]))
        opt.result()
        step_s.append(time.monotonic() - t)
    sc.close("success").result()
    return {"client": client, "model_id": tc.model_id, "losses": losses, "samples": samples,
            "setup_s": setup_s, "step_s": step_s}  # fmt: skip


def test_parallel_clients_match_solo(server: LocalServer) -> None:
    t0 = time.monotonic()
    with ProcessPoolExecutor(max_workers=N_CLIENTS, mp_context=SPAWN) as pool:
        futs = [pool.submit(run_client, server.base_url, i) for i in range(N_CLIENTS)]
        results = [f.result(timeout=600) for f in futs]  # re-raises any client's error
    parallel_s = time.monotonic() - t0
    assert [r["client"] for r in results] == list(range(N_CLIENTS))
    assert len({r["model_id"] for r in results}) == N_CLIENTS
    for r in results:
        assert len(r["losses"]) == N_STEPS and all(np.isfinite(r["losses"]))
        steps = np.asarray(r["step_s"])
        print(f"client {r['client']:2d}: setup {r['setup_s']:.2f}s, step mean {steps.mean():.2f}s "
              f"min {steps.min():.2f}s max {steps.max():.2f}s")  # fmt: skip
    print(f"{N_CLIENTS} clients x {N_STEPS} steps in parallel: {parallel_s:.1f}s")
    assert server.healthy()
    # Solo runs of a couple of the clients (not all 16, for time), after the parallel run, against the
    # same server: new model ids, same seeds and data, so the same losses.
    for i in SOLO:
        t = time.monotonic()
        solo = run_client(server.base_url, i)
        print(f"solo client {i}: {time.monotonic() - t:.1f}s, step mean {np.mean(solo['step_s']):.2f}s")
        assert solo["model_id"] != results[i]["model_id"]
        for got, want in zip(results[i]["losses"], solo["losses"], strict=True):
            assert_scalar_close(got, want, TRAJECTORY_REL)  # fused with 15 others vs alone, 3 steps
        if results[i]["samples"] != solo["samples"]:  # seeded sampling: reported, not required
            print(f"client {i}: seeded samples differ between the parallel and the solo run")


# ---------------------------------------------------------------------------- kill -9 mid-run
def train_forever(base_url: str, steps_done: Any, ready: Event) -> None:
    """A training loop that runs until the server dies under it (in a spawned process)."""
    os.environ["TINKER_TELEMETRY"] = "0"
    sc = tinker.ServiceClient(base_url=base_url, api_key=DEV_KEY)
    tc = sc.create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=3).result()
    step = 0
    while True:
        tc.forward_backward(_step_data(99, step), "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        step += 1
        steps_done.value = step
        if step >= 2:
            ready.set()


@pytest.fixture
def crash_server(tmp_path: Path) -> Iterator[LocalServer]:
    with pytest.MonkeyPatch.context() as m:
        _server_env(m)
        srv = LocalServer(["--dev", "--base-model", TEST_MODEL], data_dir=tmp_path / "crash-data")
        try:
            srv.start()
            yield srv
        finally:
            srv.stop()


def test_kill9_mid_run_then_restart(crash_server: LocalServer) -> None:
    srv = crash_server
    sc = tinker.ServiceClient(base_url=srv.base_url, api_key=DEV_KEY)
    tc = sc.create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=1).result()
    data = _step_data(1, 0)
    tc.forward_backward(data, "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    path_a = tc.save_state("a").result().path
    path_b = tc.save_weights_for_sampler("b").result().path
    expected = tc.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()

    steps_done, ready = SPAWN.Value("i", 0), SPAWN.Event()
    loop = SPAWN.Process(target=train_forever, args=(srv.base_url, steps_done, ready), daemon=True)
    loop.start()
    try:
        assert ready.wait(timeout=120), "the background training loop did not get going"
        assert loop.is_alive()
        before_kill = steps_done.value
        srv.kill()  # SIGKILL while the loop is mid-flight
        print(f"killed the server after {before_kill} background steps")
        srv.start()  # same data dir, same port
    finally:
        loop.kill()
        loop.join(timeout=30)
    assert srv.healthy()
    rest = tinker.RestClient(base_url=srv.base_url, api_key=DEV_KEY)
    listed = {c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints}
    assert {path_a, path_b} <= listed
    sc2 = tinker.ServiceClient(base_url=srv.base_url, api_key=DEV_KEY)
    resumed = sc2.create_training_client_from_state_with_optimizer(path_a).result()
    got = resumed.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    np.testing.assert_array_equal(got, expected)
    sampler = sc2.create_sampling_client(model_path=path_b).result()
    params = types.SamplingParams(max_tokens=4, temperature=0.0, stop=[])
    out = sampler.sample(types.ModelInput.from_ints(PROMPT), 2, params).result()
    assert len(out.sequences) == 2 and all(len(s.tokens) == 4 for s in out.sequences)
    sc2.close("success").result()
