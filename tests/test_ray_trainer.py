"""Training on Ray trainer workers: ``Runtime(trainer_workers=2)`` and ``opentinker serve
--trainer-workers 2`` against the single-process runtime and server.

Each trainer worker is a Ray actor with its own base-model replica, scheduler and optimizer state;
the front-end routes every model to the worker holding it (new models to the least loaded). The
reference is the plain runtime in this process: 8 concurrent clients' losses (first step within
1e-5 relative, later steps at the trajectory bound), their greedy samples after training and
their checkpoints' resumed losses must match it. Worker loss: ``ray.kill`` of a worker's actor →
its models answer an error naming the worker and the model (never a hang), the other worker's
models go on, ``create_training_client_from_state_with_optimizer`` restores onto the live worker,
and with ``auto_restore`` the runtime does it and reports the steps lost.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import tinker
from tinker import types

import opentinker
from opentinker.engine import EngineError
from opentinker.server.local import LocalServer
from opentinker.service.runtime import Runtime
from tests.conftest import TEST_MODEL
from tests.tolerances import TRAJECTORY_REL, assert_greedy_equal, assert_scalar_close

ray = pytest.importorskip("ray")

from opentinker.cluster.trainer import WorkerLostError  # noqa: E402

pytestmark = pytest.mark.slow  # Ray, two worker processes per runtime, a server: ~2 min here

CLIENTS = 8
STEPS = 2
WAIT = 120  # seconds: a request that would hang fails the test instead of blocking it


@pytest.fixture(scope="module")
def ray_up():
    ray.init(num_cpus=2, object_store_memory=300 * 2**20, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _datum(tokens: list[int]) -> types.Datum:
    inputs: dict[str, Any] = {"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)}
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


def _client(service: Any, i: int) -> Any:
    tc = service.create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=i)
    return tc.result() if hasattr(tc, "result") else tc


def _one_client(service: Any, i: int, barrier: threading.Barrier) -> dict[str, Any]:
    """Client ``i``: STEPS fused steps on its own data, a greedy sample, a save and a resumed loss."""
    tc = _client(service, i)
    data = [_datum([3 + (7 * i + 3 * j + k) % 200 for k in range(10 + i + j)]) for j in range(2)]
    barrier.wait(timeout=WAIT)  # all clients train together: their requests share ticks
    losses = []
    for _ in range(STEPS):
        fb = tc.forward_backward(data, "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=2e-2))
        losses.append(fb.result(timeout=WAIT).metrics["loss:sum"])
        opt.result(timeout=WAIT)
    sampler = tc.save_weights_and_get_sampling_client().result(timeout=WAIT)
    prompt = types.ModelInput.from_ints([3 + i, 40, 41, 42])
    params = types.SamplingParams(max_tokens=8, temperature=0.0, stop=[])
    greedy = sampler.sample(prompt, num_samples=1, sampling_params=params).result(timeout=WAIT)
    path = tc.save_state(f"c{i}").result(timeout=WAIT).path
    resumed = service.create_training_client_from_state_with_optimizer(path)
    resumed = resumed.result() if hasattr(resumed, "result") else resumed
    after = resumed.forward_backward(data, "cross_entropy").result(timeout=WAIT).metrics["loss:sum"]
    return {"losses": losses, "greedy": list(greedy.sequences[0].tokens), "resumed": after, "id": tc.model_id}


def _many(service: Any) -> list[dict[str, Any]]:
    barrier = threading.Barrier(CLIENTS)
    with ThreadPoolExecutor(CLIENTS) as ex:
        return list(ex.map(lambda i: _one_client(service, i, barrier), range(CLIENTS)))


def _assert_same(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    for g, w in zip(got, want, strict=True):
        assert_scalar_close(g["losses"][0], w["losses"][0], rel=1e-5)  # the first step: same weights
        for step in range(1, STEPS):
            assert_scalar_close(g["losses"][step], w["losses"][step], rel=TRAJECTORY_REL)
        assert_scalar_close(g["resumed"], w["resumed"], rel=TRAJECTORY_REL)
        assert_greedy_equal(g["greedy"], w["greedy"], f"client {g['id']}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    rt = Runtime(tmp_path_factory.mktemp("plain"))
    try:
        return _many(opentinker.ServiceClient(runtime=rt))
    finally:
        rt.shutdown()


def test_eight_clients_on_two_trainer_workers_equal_one_process(
    ray_up: None, reference: list[dict[str, Any]], tmp_path: Path
) -> None:
    rt = Runtime(tmp_path, trainer_workers=2)
    try:
        got = _many(opentinker.ServiceClient(runtime=rt))
        [stats] = rt.engine_stats()
        workers = stats["trainer_workers"]
        assert [w["alive"] for w in workers] == [True, True]
        # 8 trained + 8 resumed models, placed on the least loaded: both workers hold half
        assert [w["models"] for w in workers] == [CLIENTS, CLIENTS]
        assert all(w["ticks"] > 0 for w in workers)
    finally:
        rt.shutdown()
    _assert_same(got, reference)


def _train(tc: Any, data: list[types.Datum], steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        fb = tc.forward_backward(data, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=2e-2)).result(timeout=WAIT)
        out.append(fb.result(timeout=WAIT).metrics["loss:sum"])
    return out


def test_a_lost_worker_fails_its_models_clearly_and_they_restore_elsewhere(
    ray_up: None, tmp_path: Path
) -> None:
    rt = Runtime(tmp_path, trainer_workers=2)
    try:
        service = opentinker.ServiceClient(runtime=rt)
        a, b = _client(service, 0), _client(service, 1)
        pool = rt.base_stack(TEST_MODEL).scheduler.pool  # type: ignore[attr-defined]
        where = pool.placement()
        assert {where[a.model_id], where[b.model_id]} == {"trainer-0", "trainer-1"}
        data = [_datum(list(range(3, 20)))]
        _train(a, data, 1)
        _train(b, data, 1)
        path = a.save_state("one").result(timeout=WAIT).path
        # placed on the least loaded, ties to the lowest rank: a on trainer-0, b on trainer-1
        assert where[a.model_id] == "trainer-0"
        pool.kill_worker(0)
        for _ in range(2):  # the first request meets the dead actor; the next is refused at once
            with pytest.raises(WorkerLostError, match=rf"trainer worker trainer-0 .*model {a.model_id!r}"):
                a.forward_backward(data, "cross_entropy").result(timeout=WAIT)
        with pytest.raises(WorkerLostError, match="trainer-0"):
            a.save_state("late").result(timeout=WAIT)
        _train(b, data, 1)  # the other worker's models go on
        [stats] = rt.engine_stats()
        assert [w["alive"] for w in stats["trainer_workers"]] == [False, True]
        assert stats["restored"][a.model_id]["reason"] == "auto-restore is off"
        # restore from the checkpoint on the live worker; it trains as a plain resume does
        restored = service.create_training_client_from_state_with_optimizer(path)
        assert pool.placement()[restored.model_id] == "trainer-1"
        got = _train(restored, data, 2)
        plain = Runtime(tmp_path)  # the same storage: it reads the checkpoint
        try:
            ref = opentinker.ServiceClient(runtime=plain).create_training_client_from_state_with_optimizer(
                path
            )
            want = _train(ref, data, 2)
        finally:
            plain.shutdown()
        for g, w in zip(got, want, strict=True):
            assert_scalar_close(g, w, rel=1e-5)
    finally:
        rt.shutdown()


def wait_restored(rt: Runtime, model_id: str) -> dict[str, Any]:
    """Auto-restore's report on ``model_id`` once it is back (the restore runs in the background)."""
    pause = threading.Event()
    for _ in range(WAIT * 10):
        if rt.scaleout.restored.get(model_id, {}).get("restored"):
            break
        pause.wait(0.1)
    return rt.scaleout.restored[model_id]


def test_auto_restore_puts_the_model_back_and_reports_the_lost_steps(ray_up: None, tmp_path: Path) -> None:
    rt = Runtime(tmp_path, trainer_workers=2, auto_restore=True)
    try:
        service = opentinker.ServiceClient(runtime=rt)
        tc = _client(service, 3)
        pool = rt.base_stack(TEST_MODEL).scheduler.pool  # type: ignore[attr-defined]
        rank = int(pool.placement()[tc.model_id].rpartition("-")[2])
        data = [_datum(list(range(5, 30)))]
        _train(tc, data, 1)
        path = tc.save_state("s1").result(timeout=WAIT).path
        _train(tc, data, 2)  # two steps past the checkpoint: what the loss costs
        pool.kill_worker(rank)
        with pytest.raises(WorkerLostError, match=tc.model_id):
            tc.forward_backward(data, "cross_entropy").result(timeout=WAIT)
        report = wait_restored(rt, tc.model_id)
        assert report["restored"] and report["checkpoint"] == path
        assert report["lost_steps"] == 2 and report["steps_at_loss"] == 3
        assert report["to_worker"] == f"trainer-{1 - rank}"
        got = _train(tc, data, 1)  # the same model id trains on, from the checkpoint
        plain = Runtime(tmp_path)  # the same storage: it reads the checkpoint
        try:
            ref = opentinker.ServiceClient(runtime=plain).create_training_client_from_state_with_optimizer(
                path
            )
            want = _train(ref, data, 1)
        finally:
            plain.shutdown()
        assert_scalar_close(got[0], want[0], rel=1e-5)
    finally:
        rt.shutdown()


def test_bad_trainer_configurations_are_refused_at_once(ray_up: None, tmp_path: Path) -> None:
    with pytest.raises(
        ValueError,
        match=r"3 trainer workers × 1 CPU = 3 CPUs asked, but the cluster has [\d.]+ CPUs free \(2 in all\)",
    ):
        Runtime(tmp_path, trainer_workers=3)
    with pytest.raises(ValueError, match="a trainer worker asks for 2 GPUs but the largest Ray node has 0"):
        Runtime(tmp_path, trainer_workers=1, trainer_gpus=2)
    with pytest.raises(ValueError, match="trainer_workers must be an integer >= 0"):
        Runtime(tmp_path, trainer_workers=-1)
    assert not ray.util.list_named_actors(all_namespaces=True)  # nothing was started


def test_the_sdk_over_http_with_two_trainer_workers_matches_one_process(
    reference: list[dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``opentinker serve --trainer-workers 2`` (its own local Ray) with 8 concurrent SDK clients."""
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    for var in ("TINKER_API_KEY", "TINKER_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    srv = LocalServer(
        ["--dev", "--base-model", TEST_MODEL, "--trainer-workers", "2"], data_dir=tmp_path / "srv"
    )
    srv.start()
    try:
        remote = tinker.ServiceClient(base_url=srv.base_url, api_key="tml-trainers-probe-0001")
        got = _many(remote)
        import httpx

        stats = httpx.get(
            f"{srv.base_url}/console/api/engine", headers={"X-API-Key": "tml-trainers-probe-0001"}, timeout=30
        ).json()["engines"][0]
        remote.close("success").result()
    finally:
        srv.stop()
    assert [w["models"] for w in stats["trainer_workers"]] == [CLIENTS, CLIENTS]
    _assert_same(got, reference)


def test_engine_error_types_cross_the_actor_boundary(ray_up: None, tmp_path: Path) -> None:
    """A request the engine refuses on a worker answers the engine's own error, as in one process."""
    rt = Runtime(tmp_path, trainer_workers=1)
    try:
        tc = _client(opentinker.ServiceClient(runtime=rt), 0)
        bad = _datum([3, 4, 10**6])  # a token outside the vocabulary
        with pytest.raises(EngineError, match="vocab") as info:
            tc.forward_backward([bad], "cross_entropy").result(timeout=WAIT)
        assert not isinstance(info.value, WorkerLostError)
        assert _train(tc, [_datum(list(range(3, 12)))], 1)  # the model is as before and trains on
    finally:
        rt.shutdown()
