"""Starting Ray workers the cluster cannot place fails at once, naming why, instead of waiting.

- ``opentinker serve --ray --trainer-workers N --rollout-workers N`` with one CPU per worker, on a
  Ray instance of N CPUs that it starts itself (N = what Ray finds on this machine: on 2 cores,
  the command that used to hang at start-up forever), exits 2 promptly naming the CPUs asked for
  per kind, their sum and the CPUs there are;
- the ``Runtime`` equivalent raises the same before any actor exists, and a server's start of
  several base models counts every one's workers;
- a worker still unplaced after the placement timeout fails its pool's start, naming it, and
  every actor that start made is stopped (the arithmetic's check is bypassed for this: it would
  refuse the request first).

That a start which fits still starts is shown by every other tests/test_ray_*.py (e.g.
tests/test_ray_trainer_scale.py fills a 2-CPU cluster exactly). The arithmetic itself is
tested without Ray in tests/test_cluster_fit.py.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from opentinker.cluster import trainer as trainer_mod  # noqa: E402
from opentinker.cluster.ray_env import NAMESPACE  # noqa: E402
from opentinker.cluster.ray_rollout import RayTransport  # noqa: E402
from opentinker.cluster.trainer import ClusterConfigError, TrainerPool  # noqa: E402
from opentinker.engine import Engine  # noqa: E402
from opentinker.sampling import NativeBackend  # noqa: E402
from opentinker.server.local import free_port  # noqa: E402
from opentinker.service.runtime import Runtime  # noqa: E402
from opentinker.workers.pool import WorkerPool  # noqa: E402
from opentinker.workers.process import WorkerStartError  # noqa: E402
from opentinker.workers.wire import WorkerOptions  # noqa: E402
from tests.conftest import TEST_MODEL  # noqa: E402

pytestmark = pytest.mark.slow  # Ray instances, a serve process, actors loading the base model

WAIT = 240.0  # seconds: a start that would hang fails the test instead of blocking it
PLACEMENT = 10.0  # the placement timeout of the pending-placement tests


def _wait(cond: Callable[[], bool], timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.2)


def _actors() -> set[str]:
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}


def test_serve_refuses_a_start_the_cluster_cannot_place_at_once(tmp_path: Path) -> None:
    """The command of the start-up hang: serve's own Ray instance, one CPU per worker by default."""
    from ray._private.utils import get_num_cpus  # what a Ray instance started here will have

    n = get_num_cpus()
    cmd = [sys.executable, "-m", "opentinker.server", "--base-model", TEST_MODEL, "--dev", "--ray"]
    cmd += ["--trainer-workers", str(n), "--rollout-workers", str(n)]
    cmd += ["--port", str(free_port()), "--data-dir", str(tmp_path)]
    t0 = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=WAIT, check=False)
    took = time.monotonic() - t0
    assert out.returncode == 2, out.stderr[-3000:]
    want = (
        f"opentinker serve: error: {n} rollout workers × 1 CPU + {n} trainer workers × 1 CPU = "
        f"{2 * n} CPUs asked, but the cluster has {n} CPUs free ({n} in all; each kind alone would "
        "fit); lower --worker-cpus / --trainer-cpus or the worker counts"
    )
    assert want in out.stderr, out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "serving" not in out.stdout
    print(f"serve refused the start in {took:.1f} s")


@pytest.fixture(scope="module")
def two_cpus() -> Iterator[None]:
    ray.init(num_cpus=2, object_store_memory=300 * 2**20, include_dashboard=False, namespace=NAMESPACE)
    yield
    ray.shutdown()


def test_a_runtime_refuses_the_same_start_before_any_actor_exists(two_cpus: None, tmp_path: Path) -> None:
    with pytest.raises(ValueError) as info:
        Runtime(tmp_path / "refused", ray="local", rollout_workers=2, trainer_workers=2)
    assert not (tmp_path / "refused").exists()  # refused before anything was written
    assert str(info.value) == (
        "2 rollout workers × 1 CPU + 2 trainer workers × 1 CPU = 4 CPUs asked, but the cluster has "
        "2 CPUs free (2 in all; each kind alone would fit); lower --worker-cpus / --trainer-cpus or "
        "the worker counts"
    )
    assert not _actors()
    # one base model's workers fit; a second one's would not: refused before either is loaded
    rt = Runtime(tmp_path, ray="local", rollout_workers=1, trainer_workers=1)
    try:
        with pytest.raises(ValueError, match=r"^2 rollout workers × 1 CPU \+ 2 trainer workers × 1 CPU = 4"):
            rt.scaleout.check_start([TEST_MODEL, "opentinker/another-model"])
        rt.scaleout.check_start([TEST_MODEL])
        assert not rt.loaded_base_models() and not _actors()
    finally:
        rt.shutdown()


def test_a_trainer_worker_still_unplaced_after_the_timeout_fails_the_pool_naming_it(
    two_cpus: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(trainer_mod, "check_resources", lambda *args: None)
    t0 = time.monotonic()
    with pytest.raises(ClusterConfigError) as info:  # the first placed takes both CPUs: the other waits
        TrainerPool(TEST_MODEL, workers=2, worker_cpus=2, placement_timeout=PLACEMENT)
    took = time.monotonic() - t0
    # (on a loaded machine the placed one may not have its process yet either: both named)
    assert re.search(rf"trainer worker trainer-[01] of {TEST_MODEL}.* not placed", str(info.value))
    assert f"not placed within {PLACEMENT:g} s: each asks for 2 CPUs and 0 GPUs" in str(info.value)
    assert "raise --placement-timeout" in str(info.value)
    assert took < WAIT
    _wait(lambda: ray.available_resources().get("CPU", 0.0) == 2.0)  # every actor it made is gone


def test_a_rollout_worker_still_unplaced_after_the_timeout_fails_the_pool_naming_it(
    two_cpus: None, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(RayTransport, "check_capacity", lambda self, workers: None)
    pin = NativeBackend(engine, lean_decode=False, prefix_cache_bytes=0).decoder(snapshots_only=True).pin
    # both actors are asked for at once: whichever Ray places first takes both CPUs
    with pytest.raises(
        WorkerStartError, match=rf"^rollout worker [01]\b.* not placed within {PLACEMENT:g} s"
    ):
        WorkerPool(
            engine,
            pin,
            2,
            WorkerOptions(TEST_MODEL, max_rank=engine.max_rank),
            transport=RayTransport(2.0, placement_timeout=PLACEMENT),
        )
    _wait(lambda: not _actors() and ray.available_resources().get("CPU", 0.0) == 2.0)
