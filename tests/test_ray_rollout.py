"""Rollout workers as Ray actors (opentinker/cluster): the worker pool over its Ray transport, on one
local Ray instance for the whole module (``ray.init(num_cpus=2, ...)``), each worker 0.5 CPUs.

Every result is compared with in-process sampling of the same request (the parent engine's
``NativeBackend.generate``, or an embedded ``Runtime`` without workers for the SDK over HTTP):
greedy and seeded T = 1 tokens identical, logprobs within ``LOGPROB_ATOL`` (tests/tolerances.py).
The in-process tests share one runtime with two actors (class-scoped, stopped before the HTTP
tests start theirs). Over HTTP, ``opentinker serve --ray HOST:PORT`` joins this module's Ray
instance, so the test can find its actors, and ``opentinker cluster scale`` changes its workers under load.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import tinker
from tinker import types

ray = pytest.importorskip("ray")

import opentinker  # noqa: E402
from opentinker.cli import main as cli_main  # noqa: E402
from opentinker.cluster.ray_env import NAMESPACE  # noqa: E402
from opentinker.cluster.ray_rollout import RayTransport, RayWorker  # noqa: E402
from opentinker.engine import Engine  # noqa: E402
from opentinker.lora import LoRAConfig  # noqa: E402
from opentinker.sampling import NativeBackend, SampleRequest, SampleResult, SamplingParams  # noqa: E402
from opentinker.sampling.handles import SampleCancelled  # noqa: E402
from opentinker.sampling.types import TokenSink  # noqa: E402
from opentinker.server.auth import create_key  # noqa: E402
from opentinker.server.local import LocalServer, free_port  # noqa: E402
from opentinker.service.runtime import Runtime  # noqa: E402
from opentinker.workers.pool import WorkerPool  # noqa: E402
from opentinker.workers.process import WorkerStartError  # noqa: E402
from opentinker.workers.wire import WorkerOptions, to_bytes  # noqa: E402
from tests.conftest import TEST_MODEL  # noqa: E402
from tests.test_rollout_workers import Served as ProcessServed  # noqa: E402
from tests.test_rollout_workers import _probe, _requests, _same, _same_up_to_near_ties, _wait  # noqa: E402
from tests.tolerances import assert_logprobs_close  # noqa: E402

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, stop=[])
SEEDED = SamplingParams(max_tokens=24, temperature=1.0, seed=7, stop=[])
CPUS = 0.5  # per worker: two runtimes of two workers fit the module's 2 CPUs


@pytest.fixture(scope="module", autouse=True)
def ray_instance() -> Iterator[None]:
    ray.init(num_cpus=2, object_store_memory=300 * 2**20, include_dashboard=False, namespace=NAMESPACE)
    yield
    ray.shutdown()


def _address() -> str:
    """This module's Ray instance, as HOST:PORT (``auto`` could find another one on the machine)."""
    return ray.get_runtime_context().gcs_address


def _actors() -> set[str]:
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}


class Served(ProcessServed):
    """A runtime whose sampling runs on two Ray actors, its engine, pool and a reference."""

    def __init__(self, data_dir: Path) -> None:
        super().__init__(data_dir, ray="local", worker_cpus=CPUS)
        assert isinstance(self.pool.transport, RayTransport)
        self.transport: RayTransport = self.pool.transport

    def handle(self, index: int) -> RayWorker:
        h = self.pool.worker_handle(index)
        assert isinstance(h, RayWorker)
        return h


# ---------------------------------------------------------------------- in process, over Ray
class TestPoolOnRay:
    @pytest.fixture(scope="class")
    def served(self, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
        s = Served(tmp_path_factory.mktemp("ray-workers"))
        yield s
        s.runtime.shutdown()

    @pytest.fixture(scope="class")
    def snaps(self, served: Served) -> list[str | None]:
        a = served.engine.create_adapter(LoRAConfig(rank=4, seed=0))
        b = served.engine.create_adapter(LoRAConfig(rank=8, seed=1, train_mlp=False))
        return [served.train_snapshot(a, 1), served.train_snapshot(b, 2), None]

    @pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
    def test_two_actors_sample_what_in_process_sampling_does(
        self, served: Served, snaps: list[str | None], params: SamplingParams
    ) -> None:
        reqs = _requests(snaps, 9, params, num_samples=3)
        reqs.append(SampleRequest(snaps[0], [3, 4, 5, 6, 7, 8], params, prompt_logprobs=True))
        for g, r in zip(served.sample(reqs), reqs, strict=True):
            [want] = served.reference.generate([r])
            _same(g, want)
            if r.prompt_logprobs:
                assert isinstance(g, SampleResult) and isinstance(want, SampleResult)
                assert_logprobs_close(g.prompt_logprobs[1:], want.prompt_logprobs[1:])  # type: ignore[index, arg-type]
        assert all(n > 0 for n in served.pool.stats.served[:2])  # both actors served
        # the workers are Ray actors in processes of their own, found by name in the namespace
        pids = served.pool.worker_pids()
        assert len(set(pids)) == 2 and os.getpid() not in pids and None not in pids
        names = {served.handle(i).name for i in range(2)}
        assert names <= _actors()

    def test_an_actor_streams_tokens_and_an_abort_reaches_it(self, served: Served) -> None:
        """A streamed request's tokens come from its actor while it decodes (the pool's reader
        hands them to its sink before the result) and concatenate to the result; an aborted
        request's rows leave its actor's running batch, the request beside it unaffected."""
        pool, pieces = served.pool, []
        req = SampleRequest(None, [5, 6, 7, 8], SEEDED, num_samples=2, stream=TokenSink(pieces.append))
        res = pool.submit(req).future.result(timeout=300)
        assert isinstance(res, SampleResult)
        for k, seq in enumerate(res.sequences):
            got = [t for p in pieces if p.sample == k for t in p.tokens]
            assert got == seq.tokens[: len(got)] and len(got) >= len(seq.tokens) - 1
        long = SamplingParams(max_tokens=1000, temperature=1.0, seed=3, stop=[])
        aborted, busy = pool.stats.aborted, pool.stats.live_rows
        other = pool.submit(SampleRequest(None, [7, 8, 9, 10], long, num_samples=3)).future
        _wait(lambda: pool.stats.live_rows == busy + 3, 180)
        cut = pool.submit(SampleRequest(None, [11, 12, 13], long, num_samples=2))
        _wait(lambda: pool.stats.live_rows == busy + 5, 180)
        assert pool.abort(cut)
        with pytest.raises(SampleCancelled):
            cut.future.result(timeout=10)
        _wait(lambda: pool.stats.aborted == aborted + 1, 180)
        assert pool.stats.live_rows <= busy + 3  # its batch shrank by the aborted rows
        assert [len(s.tokens) for s in other.result(timeout=900).sequences] == [1000] * 3

    def test_handoff_goes_through_the_object_store_once_per_version(self, served: Served) -> None:
        aid = served.engine.create_adapter(LoRAConfig(rank=4, seed=11))
        v = served.train_snapshot(aid, 12)
        puts, published = served.transport.puts, served.pool.stats.published
        for _ in range(2):
            reqs = _requests([v], 6, GREEDY)
            for g, r in zip(served.sample(reqs), reqs, strict=True):
                _same(g, served.reference.generate([r])[0])
        holders = [i for i in range(2) if any(w.startswith(v + "#") for w in served.pool.worker_snapshots(i))]
        assert holders == [0, 1]
        assert served.transport.puts == puts + 1  # one ray.put for the version
        assert served.pool.stats.published == published + 2  # one handoff per worker
        [wire] = [w for w in served.pool.worker_snapshots(0) if w.startswith(v + "#")]
        config, ref = served.pool._bytes[wire]
        assert isinstance(ref, ray.ObjectRef)  # the Publish carried a reference, not the bytes
        assert ray.get(ref) == to_bytes(served.engine.adapter_weights(v))[1] and config["rank"] == 4
        # a released version is retired on both actors and its object dropped
        del ref
        served.engine.release_snapshot(v)
        _wait(lambda: all(wire not in served.pool.worker_snapshots(i) for i in range(2)))
        assert wire not in served.pool._bytes

    def test_a_removed_actor_drains_first_and_a_new_one_serves_the_current_snapshots(
        self, served: Served, snaps: list[str | None]
    ) -> None:
        pool = served.pool
        long = replace(GREEDY, max_tokens=min(200, served.engine.max_context - 16))
        reqs = _requests(snaps, 6, long, num_samples=2)
        rerun = pool.stats.rerun
        futs = [served.scheduler.submit_sample(r).future for r in reqs]
        _wait(lambda: len(pool._slots[1].inflight) > 0)
        with pool._lock:
            draining, running = pool._slots[1].handle, [r.future for r in pool._slots[1].inflight.values()]
        assert not any(f.done() for f in running)
        assert served.runtime.scaleout.scale_rollout_workers(1) == {TEST_MODEL: 1}  # returns once drained
        assert pool.worker_states()[1] == "removed" and all(f.done() for f in running)
        for f, r in zip(futs, reqs, strict=True):
            _same_up_to_near_ties(f.result(), r, served.reference)
        assert pool.stats.rerun == rerun  # its requests finished on it, none re-run
        assert isinstance(draining, RayWorker)
        _wait(lambda: draining.name not in _actors())  # then it was stopped
        # scale back: a new actor, holding nothing, serves the snapshots published before it came
        assert served.runtime.scaleout.scale_rollout_workers(2) == {TEST_MODEL: 2}
        new = len(pool.worker_states()) - 1
        assert pool.worker_snapshots(new) == set()
        for _ in range(3):
            more = _requests(snaps[:2], 6, SEEDED)
            for g, r in zip(served.sample(more), more, strict=True):
                _same(g, served.reference.generate([r])[0])
        assert pool.stats.served[new] > 0 and pool.worker_snapshots(new)
        info = served.runtime.scaleout.rollout_workers_info()["base_models"][TEST_MODEL]
        assert info["workers"] == 2 and info["transport"] == "ray"

    def test_ray_kill_mid_decode_reruns_its_requests_and_the_actor_is_restarted(
        self, served: Served, snaps: list[str | None]
    ) -> None:
        pool = served.pool
        long = replace(GREEDY, max_tokens=min(400, served.engine.max_context - 16))
        reqs = _requests(snaps, 8, long, num_samples=2)
        rerun, restarts, old = pool.stats.rerun, pool.stats.restarts[0], served.handle(0)
        futs = [served.scheduler.submit_sample(r).future for r in reqs]
        answered = [0] * len(futs)
        for i, f in enumerate(futs):
            f.add_done_callback(lambda _, i=i: answered.__setitem__(i, answered[i] + 1))
        _wait(lambda: len(pool._slots[0].inflight) > 0)
        time.sleep(0.2)  # decoding
        assert not all(f.done() for f in futs)
        ray.kill(ray.get_actor(old.name, namespace=NAMESPACE))
        got = [f.result(timeout=240) for f in futs]
        for g, r in zip(got, reqs, strict=True):
            _same_up_to_near_ties(g, r, served.reference)
        assert answered == [1] * len(futs)  # every future resolved exactly once
        assert pool.stats.rerun > rerun
        pool.wait_ready(timeout=240)
        new = served.handle(0)
        assert pool.stats.restarts[0] == restarts + 1
        assert new.name != old.name and new.name in _actors() and old.name not in _actors()
        served_before = pool.stats.served[0]
        more = _requests(snaps, 6, GREEDY)  # the new actor receives the snapshots it needs
        for g, r in zip(served.sample(more), more, strict=True):
            _same(g, served.reference.generate([r])[0])
        assert pool.stats.served[0] > served_before

    def test_scaling_below_one_or_beyond_the_cluster_is_refused_and_changes_nothing(
        self, served: Served, tmp_path: Path
    ) -> None:
        states, actors = served.pool.worker_states(), _actors()
        for k in (0, -1):
            with pytest.raises(ValueError, match="below one"):
                served.runtime.scaleout.scale_rollout_workers(k)
        with pytest.raises(
            ValueError, match=r"more rollout workers × 0.5 CPUs = .* CPUs asked, but the cluster has"
        ):
            served.runtime.scaleout.scale_rollout_workers(40)
        with pytest.raises(ValueError, match="asks for 64 CPUs but the largest Ray node has 2"):
            Runtime(tmp_path, rollout_workers=1, ray="local", worker_cpus=64)
        with pytest.raises(ValueError, match="asks for 1 GPUs but the largest Ray node has 0"):
            Runtime(tmp_path, rollout_workers=1, ray="local", worker_gpus=1)
        with pytest.raises(ValueError, match="rollout_workers >= 1"):
            Runtime(tmp_path, ray="local")
        assert served.pool.worker_states() == states and _actors() == actors


def test_an_actor_that_cannot_start_fails_the_pool_naming_it(engine: Engine) -> None:
    """The worker's own error (here: a backend it does not have) comes back from the actor's
    creation, naming the worker; the actor is gone."""
    pin = NativeBackend(engine, lean_decode=False, prefix_cache_bytes=0).decoder(snapshots_only=True).pin
    actors = _actors()
    with pytest.raises(
        WorkerStartError, match=r"rollout worker 0 could not start: .*unknown rollout backend"
    ):
        WorkerPool(
            engine,
            pin,
            1,
            WorkerOptions(TEST_MODEL, backend="no-such-backend", max_rank=engine.max_rank),
            transport=RayTransport(CPUS),
        )
    _wait(lambda: _actors() == actors)


# ---------------------------------------------------------------------- the server and its CLI
def _serve(args: list[str], data_dir: Path) -> subprocess.CompletedProcess[str]:
    """``opentinker serve`` that is expected to refuse its arguments before opening a port."""
    cmd = [sys.executable, "-m", "opentinker.server", "--base-model", TEST_MODEL, "--dev", *args]
    cmd += ["--port", str(free_port()), "--data-dir", str(data_dir)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)


def test_serve_refuses_an_address_that_does_not_answer_and_resources_it_cannot_place(tmp_path: Path) -> None:
    port = free_port()  # nothing listens there
    for address in (f"127.0.0.1:{port}", f"ray://127.0.0.1:{port}"):
        out = _serve(["--ray", address, "--rollout-workers", "1"], tmp_path)
        assert out.returncode == 2, out.stderr[-2000:]
        assert f"no Ray cluster answers at '{address}'" in out.stderr and "Traceback" not in out.stderr
    actors = _actors()
    out = _serve(["--ray", _address(), "--rollout-workers", "1", "--worker-cpus", "64"], tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "a rollout worker asks for 64 CPUs but the largest Ray node has 2" in out.stderr
    assert "Traceback" not in out.stderr and _actors() == actors


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = cli_main(["cluster", *args])
    out = capsys.readouterr()
    return code, out.out + out.err


@contextlib.contextmanager
def _ray_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: int
) -> Iterator[tuple[LocalServer, str]]:
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    for var in ("TINKER_API_KEY", "TINKER_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    data = tmp_path / "srv"
    data.mkdir()
    ops = create_key(data, "ops")
    args = ["--dev", "--base-model", TEST_MODEL, "--operator", "ops", "--ray", _address()]
    args += ["--rollout-workers", str(workers), "--worker-cpus", str(CPUS)]
    srv = LocalServer(args, data_dir=data)
    srv.start()
    try:
        yield srv, ops
    finally:
        srv.stop()


@pytest.mark.slow  # a server, its actors and a scale-up's actor each load the base model
def test_the_sdk_through_serve_ray_matches_in_process_and_scales_1_2_1_under_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with _ray_server(tmp_path, monkeypatch, workers=2) as (srv, ops):
        url = ["--url", srv.base_url, "--api-key", ops]
        remote = tinker.ServiceClient(base_url=srv.base_url, api_key="tml-ray-probe-0001")
        got = _probe(remote)
        want = _probe(opentinker.ServiceClient(runtime=Runtime(tmp_path / "local")))
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert g[0] == w[0]
            assert_logprobs_close(g[1], w[1])
        code, text = _cli(capsys, "scale", "--rollout-workers", "1", *url)
        assert code == 0, text
        # bad input: refused with the reason, nothing changed
        for k in ("0", "-2"):
            code, text = _cli(capsys, "scale", "--rollout-workers", k, *url)
            assert code == 1 and "400: rollout workers cannot be scaled below one" in text, text
        code, text = _cli(
            capsys,
            "scale",
            "--rollout-workers",
            "2",
            "--url",
            srv.base_url,
            "--api-key",
            "tml-not-an-operator-01",
        )
        assert code == 1 and "403: the cluster routes need an operator's key" in text, text
        code, text = _cli(capsys, "status", *url)
        assert code == 0 and '"workers": 1' in text, text

        # load: four SDK clients sample the same greedy request in a loop while the workers change
        tc = remote.create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=3).result()
        sampler = tc.save_weights_and_get_sampling_client().result()
        prompt = types.ModelInput.from_ints(list(range(5, 15)))
        params = types.SamplingParams(max_tokens=16, temperature=0.0, stop=[])
        first = sampler.sample(prompt, num_samples=2, sampling_params=params).result()
        results: list[Any] = []
        stop = threading.Event()

        def client() -> None:
            while not stop.is_set():
                try:
                    results.append(sampler.sample(prompt, num_samples=2, sampling_params=params).result())
                except Exception as e:
                    results.append(e)

        threads = [threading.Thread(target=client, daemon=True) for _ in range(4)]
        for t in threads:
            t.start()
        try:
            _wait(lambda: len(results) >= 4, timeout=120)
            code, text = _cli(capsys, "scale", "--rollout-workers", "2", *url)
            assert code == 0, text
            served_then = _info(srv, ops)["served"]
            _wait(lambda: _info(srv, ops)["served"][-1] > served_then[-1], timeout=120)  # the new one serves
            code, text = _cli(capsys, "scale", "--rollout-workers", "1", *url)  # drains the newest
            assert code == 0, text
            n = len(results)
            _wait(lambda: len(results) >= n + 4, timeout=120)
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=120)
        info = _info(srv, ops)
        assert info["workers"] == 1 and info["states"].count("removed") == 2, info
        assert info["states"][-1] == "removed" and info["served"][-1] > 0
        failed = [r for r in results if isinstance(r, BaseException)]
        assert not failed, failed[:3]
        for r in results:
            for g, w in zip(r.sequences, first.sequences, strict=True):
                assert list(g.tokens) == list(w.tokens)
                assert_logprobs_close(list(g.logprobs or []), list(w.logprobs or []))
        remote.close("success").result()


def _info(srv: LocalServer, key: str) -> dict[str, Any]:
    from opentinker.cli.cluster import request

    out = request(srv.base_url, "/api/v1/cluster", key, None, timeout=60)
    [only] = out["base_models"].values()
    return only


def test_plain_serve_and_the_embedded_mode_never_import_ray(tmp_path: Path) -> None:
    """Ray is imported only when asked for: a server app and an embedded runtime that samples
    (in process, and from one worker process) leave it unloaded."""
    probe = (
        "import sys\n"
        "from opentinker.service.runtime import Runtime\n"
        "from opentinker.server.app import create_app\n"
        "from opentinker.server.config import ServerConfig\n"
        "from opentinker.sampling import SampleRequest, SamplingParams\n"
        f"create_app(ServerConfig(data_dir={str(tmp_path / 'srv')!r}))\n"
        f"for n in (0, 1):\n"
        f"    rt = Runtime({str(tmp_path)!r} + f'/rt{{n}}', rollout_workers=n)\n"
        f"    s = rt.base_stack({TEST_MODEL!r}).scheduler\n"
        "    s.submit_sample(SampleRequest(None, [1, 2, 3], SamplingParams(max_tokens=2))).future.result(120)\n"
        "    rt.shutdown()\n"
        "print('ray' in sys.modules)\n"
    )
    assert _last_line_of(probe, timeout=300) == "False"


def test_a_ray_instance_started_here_runs_its_workers_at_the_servers_priority() -> None:
    """Ray starts worker processes at nice 15 by default; ``connect("local")`` starts them at
    nice 0, so the actors that sample and train are not starved by any other job on the machine."""
    probe = (
        "import os, ray\n"
        "from opentinker.cluster.ray_env import connect\n"
        "connect('local', num_cpus=1)\n"
        "prio = ray.remote(lambda: os.getpriority(os.PRIO_PROCESS, 0))\n"
        "print(ray.get(prio.remote()) - os.getpriority(os.PRIO_PROCESS, 0))\n"
        "ray.shutdown()\n"
    )
    assert _last_line_of(probe, timeout=180) == "0"


def _last_line_of(probe: str, *, timeout: float) -> str:
    """Run ``probe`` in a fresh interpreter (one torch thread); the last line it printed."""
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=timeout, check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]
