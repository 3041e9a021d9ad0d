"""Removing a trainer worker that holds a data-parallel replica: the model is handed over whole,
on one local Ray instance (3 CPUs: three trainer workers of 1 CPU).

Two k = 2 models with the same seed: ``twin`` on trainer-0 and trainer-1, ``main`` on trainer-2
(its replica 0) and trainer-0. ``main`` takes steps, takes a snapshot, accumulates one
``forward_backward`` without its ``optim_step``; the pool is scaled 3 -> 2 (trainer-2 leaves: the
least loaded, ties to the newest); the ``optim_step`` and the next steps are sent while it runs
and wait in ``main``'s lane. Before that, one scale whose handover is made to fail (a fault
injected in the router) puts ``main`` back where it was, from the handover folder, and keeps the
worker. ``main`` comes back on trainer-0 and trainer-1, same id, same degree,
and from then on is ``twin`` (which never moved, run on the same data afterwards) bit for bit:
losses, both replicas' weights, optimizer state, step, snapshot count. The summed pending
gradients went into the new replica 0 alone, and the next all-reduce gave the same sum.

A removal that would leave a data-parallel model fewer live workers than its degree is refused
at once, naming the model and why, and changes nothing. The choice itself (on a pool's bookkeeping,
no actors): workers without replicas first, least loaded, ties to the newest; a replica holder
only where its models keep their degree, on any live workers (a lost one does not count, a worker
added later does).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from tinker import types

import opentinker
from opentinker.engine import EngineError
from opentinker.scheduler import ModelQueue
from opentinker.service.runtime import Runtime
from tests.conftest import TEST_MODEL
from tests.test_ray_dp_loss import DATA, _router
from tests.test_ray_trainer import WAIT, _client, _train

ray = pytest.importorskip("ray")

from opentinker.cluster import trainer_router  # noqa: E402
from opentinker.cluster.trainer import ClusterConfigError, TrainerPool, WorkerSlot  # noqa: E402

pytestmark = pytest.mark.slow  # Ray, three trainer actors: ~1 min in all here

ADAM = types.AdamParams(learning_rate=2e-2)
BEFORE, AFTER = 2, 2  # steps before the move, and after the step on the moved gradients


@pytest.fixture(scope="module", autouse=True)
def ray_up():
    ray.init(num_cpus=3, object_store_memory=300 * 2**20, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _replicas(router: Any, model_id: str) -> list[str]:
    return [w.worker_id for w in router.dp[model_id].replicas]


def _state(router: Any, model_id: str) -> dict[str, Any]:
    """Everything the model's training goes on from: both replicas' weights, replica 0's
    optimizer state and step (read in the model's order)."""
    dp = router.dp[model_id]
    return router.submit_call(
        ModelQueue(model_id),
        lambda eng: {
            "w0": dp.weights(0),
            "w1": dp.weights(1),
            "opt": eng.optimizer_state(model_id),
            "step": eng.adapter_step(model_id),
        },
    ).result(timeout=WAIT)


def _run(rt: Runtime, tc: Any, scale: Any = None, first: Any = None) -> tuple[list[float], list[str], Any]:
    """The schedule both models follow: steps, a snapshot, a forward_backward whose optim_step
    comes later (``first``, then ``scale`` started in between, when given), more steps, a snapshot."""
    losses = _train(tc, DATA, BEFORE)
    snaps = [rt.snapshot(tc.model_id).result(timeout=WAIT).snapshot_id]
    losses.append(tc.forward_backward(DATA, "cross_entropy").result(timeout=WAIT).metrics["loss:sum"])
    if first is not None:
        first()
    report = None
    with ThreadPoolExecutor(1) as ex:
        if scale is not None:
            report = ex.submit(scale)
            deadline = time.monotonic() + WAIT
            while not any(w.draining for w in _router(rt).pool.workers):  # the handover is queued next
                assert time.monotonic() < deadline and not report.done(), report
                time.sleep(0.01)
            time.sleep(0.2)
        # sent while the model moves: they wait in its lane, then run on the new replicas
        step = tc.optim_step(ADAM)
        losses += _train(tc, DATA, AFTER)
        step.result(timeout=WAIT)
        if report is not None:
            report = report.result(timeout=WAIT)
    snaps.append(rt.snapshot(tc.model_id).result(timeout=WAIT).snapshot_id)
    return losses, snaps, report


def _failed_handover(rt: Runtime, model_id: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A scale whose handover cannot make the model on other workers (a fault injected in the
    router): the model is made again where it was, from the handover folder, and the worker kept."""
    router = _router(rt)
    made = trainer_router.DataParallelModel

    class Refused(made):
        def __init__(self, *args: Any, on: Any = None, **kwargs: Any) -> None:
            if on is None:
                raise EngineError("injected: no room")
            super().__init__(*args, on=on, **kwargs)

    with monkeypatch.context() as mp:
        mp.setattr(trainer_router, "DataParallelModel", Refused)
        with pytest.raises(RuntimeError) as info:
            rt.scaleout.scale_trainer_workers(2)
    text = str(info.value)
    assert text.startswith(f"trainer workers kept, models not handed over: {model_id!r} on trainer-2"), text
    assert "injected: no room" in text and "it stays on trainer-2, trainer-0" in text
    assert _replicas(router, model_id) == ["trainer-2", "trainer-0"]
    assert not any(w.draining for w in router.pool.workers) and len(router.pool.live_workers()) == 3


def test_a_removed_replica_holder_hands_its_data_parallel_model_over_bit_for_bit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rt = Runtime(tmp_path, trainer_workers=3, data_parallel=2)
    try:
        service = opentinker.ServiceClient(runtime=rt)
        twin, main = _client(service, 5), _client(service, 5)
        router = _router(rt)
        assert _replicas(router, twin.model_id) == ["trainer-0", "trainer-1"]
        assert _replicas(router, main.model_id) == ["trainer-2", "trainer-0"]

        # bad input: 3 -> 1 would leave one worker for two degree-2 models
        before = {m: _replicas(router, m) for m in router.dp}
        t0 = time.monotonic()
        with pytest.raises(ValueError) as info:
            rt.scaleout.scale_trainer_workers(1)
        for m in (twin.model_id, main.model_id):
            assert f"data-parallel model {m!r}: degree 2 needs 2 trainer workers, 1 would be left" in str(
                info.value
            )
        assert time.monotonic() - t0 < 5  # at once
        assert {m: _replicas(router, m) for m in router.dp} == before
        assert not any(w.draining for w in router.pool.workers) and len(router.pool.live_workers()) == 3

        # a handover that fails first (the model goes back where it was, its pending gradients
        # summed into replica 0), then the scale that moves it
        got, got_snaps, report = _run(
            rt,
            main,
            lambda: rt.scaleout.scale_trainer_workers(2),
            first=lambda: _failed_handover(rt, main.model_id, monkeypatch),
        )
        moved = report[TEST_MODEL]
        assert moved["removed"] == ["trainer-2"] and moved["added"] == []
        # it moved with the gradients of the forward_backward before the scale, not yet stepped on
        assert moved["moved"] == {
            main.model_id: {"from": "trainer-2", "to": "trainer-0,trainer-1", "at_step": 2}
        }
        assert _replicas(router, main.model_id) == ["trainer-0", "trainer-1"]
        assert router.pool.placement() == {} and router.dp[main.model_id].degree == 2
        assert [w.worker_id for w in router.pool.live_workers()] == ["trainer-0", "trainer-1"]
        assert rt.models[main.model_id].data_parallel == 2
        got_state = _state(router, main.model_id)

        want, want_snaps, _ = _run(rt, twin)  # the twin, the same schedule, never moved
        want_state = _state(router, twin.model_id)
    finally:
        rt.shutdown()
    assert got == want, (got, want)  # the same tensors went on: bit for bit
    assert got_state["step"] == want_state["step"] == BEFORE + 1 + AFTER
    for key in ("w0", "w1", "opt"):
        assert set(got_state[key]) == set(want_state[key])
        for name, t in want_state[key].items():
            assert torch.equal(got_state[key][name], t), (key, name)
    assert any(float(v.abs().sum()) > 0 for n, v in got_state["w0"].items() if n.endswith("lora_B"))
    # the snapshot count went on across the move
    assert (
        [s.rpartition("@")[2] for s in got_snaps]
        == [s.rpartition("@")[2] for s in want_snaps]
        == ["v1", "v2"]
    )


def _bare_pool(started: int, added: int, dp: dict[str, list[int]], plain: dict[int, int]) -> TrainerPool:
    """A pool's bookkeeping without its actors (what ``choose_leaving`` decides on): ``started``
    workers, then ``added`` ones."""
    pool = TrainerPool.__new__(TrainerPool)
    pool._lock, pool._placement, pool._dp, pool.shard_base = threading.RLock(), {}, {}, 1
    pool.workers = [WorkerSlot(r, f"trainer-{r}", None) for r in range(started + added)]
    for model_id, ranks in dp.items():
        pool.reserve(model_id, [pool.workers[r] for r in ranks])
    for r, n in plain.items():
        pool.workers[r].models |= {f"plain-{r}-{i}" for i in range(n)}
    return pool


def _leave(pool: TrainerPool, n: int) -> list[str]:
    chosen = list(pool.choose_leaving(n))
    for w in pool.workers:
        w.draining = False
    return chosen


def test_the_choice_prefers_workers_without_replicas_and_keeps_every_degree() -> None:
    # free workers first, least loaded, ties to the newest; a replica holder only when needed
    pool = _bare_pool(3, 1, {"a": [0, 1]}, {2: 2})
    assert _leave(pool, 1) == ["trainer-3"] and _leave(pool, 2) == ["trainer-3", "trainer-2"]
    with pytest.raises(ClusterConfigError, match=r"'a': degree 2 needs 2 trainer workers, 1 would be left"):
        pool.choose_leaving(3)  # both free ones and a holder of 'a': 1 worker would stay
    # every worker holds a replica: the least loaded (ties: the newest) whose models fit
    pool = _bare_pool(3, 0, {"a": [0, 1], "b": [2, 0]}, {})
    assert _leave(pool, 1) == ["trainer-2"]
    pool.workers[2].models |= {"plain-2-0", "plain-2-1"}
    assert _leave(pool, 1) == ["trainer-1"]
    # refused, naming each model and why, nothing left draining
    with pytest.raises(ClusterConfigError) as info:
        pool.choose_leaving(2)
    assert "'a': degree 2 needs 2 trainer workers, 1 would be left" in str(info.value)
    assert "'b': degree 2 needs 2 trainer workers, 1 would be left" in str(info.value)
    assert not any(w.draining for w in pool.workers)
    # a free worker leaving counts: degree 3 over the first 3, one added worker, remove 2
    pool = _bare_pool(3, 1, {"c": [0, 1, 2]}, {})
    with pytest.raises(ClusterConfigError, match=r"'c': degree 3 needs 3 trainer workers, 2 would be left"):
        pool.choose_leaving(2)
    # a lost worker does not count; a worker added later does, as any other
    pool = _bare_pool(3, 1, {"a": [0, 1]}, {})
    pool.workers[2].alive = False
    assert _leave(pool, 1) == ["trainer-3"]
    with pytest.raises(ClusterConfigError, match="'a': degree 2 needs 2 trainer workers, 1 would be left"):
        pool.choose_leaving(2)
    assert not any(w.draining for w in pool.workers)
    pool = _bare_pool(2, 2, {"a": [0, 1], "b": [2, 3]}, {})  # 'b' on the two added workers
    assert _leave(pool, 2) == ["trainer-3", "trainer-2"]  # both models fit on the 2 that stay
    with pytest.raises(ClusterConfigError, match="'b': degree 2 needs 2 trainer workers, 1 would be left"):
        pool.choose_leaving(3)
