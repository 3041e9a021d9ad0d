"""A worker lost from a sharded group (``shard_base=2``), through the runtime with ``auto_restore``.

Each loss is a real one (``ray.kill`` of the member's actor). The group's model must answer an
error naming the group and the lost member, at once and on every later call, whether the member
lost is a follower or the group's leader; the group's survivors are stopped with it. With
auto-restore the group is rebuilt on fresh workers and the model put back from its newest
checkpoint under the same id: it then trains on as a plain resume of that checkpoint does (the
reference: an in-process runtime loading it; the first loss after it on the same weights, fp32
rounding). Where the cluster cannot place a new group (another actor holds its CPUs), the report
says how many workers the group needs and what is free; once they are free again it is rebuilt.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

import opentinker
from opentinker.service.runtime import Runtime
from tests.conftest import TEST_MODEL
from tests.test_ray_trainer import WAIT, _client, _datum, _train
from tests.tolerances import assert_scalar_close

ray = pytest.importorskip("ray")

from opentinker.cluster.trainer import WorkerLostError  # noqa: E402

pytestmark = pytest.mark.slow  # three sharded groups of two workers started in turn: ~3-5 min here
REBUILD = 600  # seconds: two fresh workers loading and forming a group on a loaded 2-core machine


@pytest.fixture(scope="module")
def ray_up():
    ray.init(num_cpus=2, object_store_memory=300 * 2**20, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _report(rt: Runtime, model_id: str, done: Any) -> dict[str, Any]:
    """Auto-restore's report on ``model_id`` once ``done(report)`` holds (it runs in the background)."""
    pause = threading.Event()
    for _ in range(REBUILD * 10):
        if done(rt.scaleout.restored.get(model_id, {})):
            break
        pause.wait(0.1)
    return rt.scaleout.restored[model_id]


def _resumed_loss(tmp_path: Path, path: str, data: list[Any]) -> float:
    plain = Runtime(tmp_path)  # the same storage: it reads the checkpoint
    try:
        ref = opentinker.ServiceClient(runtime=plain).create_training_client_from_state_with_optimizer(path)
        return _train(ref, data, 1)[0]
    finally:
        plain.shutdown()


@ray.remote(num_cpus=2)
class _Blocker:
    """Another job on the cluster, holding every CPU a new group would need."""

    def ready(self) -> bool:
        return True


def test_a_lost_member_or_leader_fails_the_group_and_auto_restore_rebuilds_it(
    ray_up: None, tmp_path: Path
) -> None:
    rt = Runtime(tmp_path, trainer_workers=2, shard_base=2, trainer_cpus=0.5, auto_restore=True)
    try:
        tc = _client(opentinker.ServiceClient(runtime=rt), 3)
        router = rt.base_stack(TEST_MODEL).scheduler
        pool = router.pool  # type: ignore[attr-defined]
        data = [_datum(list(range(5, 30)))]
        _train(tc, data, 1)
        path = tc.save_state("s1").result(timeout=WAIT).path
        _train(tc, data, 1)  # one step past the checkpoint: what the loss costs
        pool.kill_worker(1)  # group-0's follower
        for _ in range(2):  # the call that finds it gone, and the next
            with pytest.raises(WorkerLostError, match=r"sharded group group-0 lost trainer worker trainer-1"):
                tc.forward_backward(data, "cross_entropy").result(timeout=WAIT)
        report = _report(rt, tc.model_id, lambda r: "restored" in r and (r["restored"] or "reason" in r))
        assert report["restored"], report
        assert report["to_worker"] == "trainer-2" and report["lost_steps"] == 1
        assert [m.alive for m in pool.members["trainer-0"]] == [False, False]  # the survivor stopped too
        got = _train(tc, data, 1)[0]  # on group-1, from the checkpoint
        assert_scalar_close(got, _resumed_loss(tmp_path, path, data))

        # the leader lost, auto-restore off: the error names the group and its leader
        rt.scaleout.auto_restore = False
        pool.kill_worker(2)
        for _ in range(2):
            with pytest.raises(
                WorkerLostError, match=r"sharded group group-1 lost trainer worker trainer-2 \(its leader\)"
            ):
                tc.forward_backward(data, "cross_entropy").result(timeout=WAIT)
        report = _report(rt, tc.model_id, lambda r: r.get("reason") == "auto-restore is off")
        assert report["worker"] == "trainer-2"
        # another job takes the freed CPUs: the group cannot be rebuilt, and the report says why
        blocker = _Blocker.remote()  # type: ignore[attr-defined]
        assert ray.get(blocker.ready.remote(), timeout=WAIT)
        rt.scaleout.auto_restore = True
        rt.scaleout.worker_lost(router, "trainer-2", [tc.model_id])  # what the router calls on a loss
        reason = rt.scaleout.restored[tc.model_id]["reason"]
        assert (
            "sharded group group-1 cannot be rebuilt: it needs 2 trainer workers (--shard-base 2)" in reason
        )
        assert "2 more trainer workers × 0.5 CPUs = 1 CPU asked, but the cluster has 0 CPUs free" in reason
        # the CPUs back: rebuilt as group-2 from the newest checkpoint
        ray.kill(blocker, no_restart=True)
        rt.scaleout.worker_lost(router, "trainer-2", [tc.model_id])
        report = rt.scaleout.restored[tc.model_id]
        assert report["restored"] and report["to_worker"] == "trainer-4", report
        assert pool.placement()[tc.model_id] == "trainer-4"
        assert_scalar_close(_train(tc, data, 1)[0], _resumed_loss(tmp_path, path, data))
    finally:
        rt.shutdown()
