"""A sharded base through the server: the unmodified ``tinker`` SDK over HTTP against
``opentinker serve --ray --trainer-workers 2 --shard-base 2`` (one group of two trainer workers
holding one FSDP2-sharded copy of the base).

A model trains there and its losses equal the same model trained in a plain in-process
:class:`~opentinker.service.runtime.Runtime` (fp32 rounding: rows summed in another order); its
snapshot samples on the group itself (``--shard-sampling group``, the default: the front-end
holds no weight of the base), and the sampler's logprobs of the sampled tokens equal the
trainer's (the sharded group's forward) within ``LOGPROB_ATOL``. A ``--shard-base`` that does not
divide the trainer workers stops ``serve`` before Ray starts, naming both, and so does sampling
on the group asked for together with settings that sample on whole copies of the base.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import tinker
import torch
from tinker import types

import opentinker
from opentinker.server.local import LocalServer
from opentinker.server.main import serve
from opentinker.service.runtime import Runtime
from tests.conftest import TEST_MODEL
from tests.test_ray_trainer import WAIT, _datum, _train
from tests.tolerances import assert_logprobs_close, assert_scalar_close

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.slow  # a serve child with Ray and a group of two workers: ~1 min here

KEY = "tml-shard-serve-probe-01"
SEED = 5
STEPS = 3


def _data() -> list[types.Datum]:
    return [_datum([3 + (5 * j + 7 * k) % 190 for k in range(8 + 3 * j)]) for j in range(5)]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    mp = pytest.MonkeyPatch()
    mp.setenv("TINKER_TELEMETRY", "0")
    for var in ("TINKER_API_KEY", "TINKER_BASE_URL"):
        mp.delenv(var, raising=False)
    args = ["--dev", "--base-model", TEST_MODEL, "--ray", "--trainer-workers", "2", "--shard-base", "2"]
    args += ["--trainer-cpus", "0.5"]
    srv = LocalServer(args, data_dir=tmp_path_factory.mktemp("shardserve"))
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()
        mp.undo()


def test_the_sdk_trains_and_samples_a_sharded_model(server: LocalServer, tmp_path: Path) -> None:
    remote = tinker.ServiceClient(base_url=server.base_url, api_key=KEY)
    tc = remote.create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=SEED).result()
    # the router sees one worker: the group's leader (its other member holds the other half)
    stats = httpx.get(f"{server.base_url}/console/api/engine", headers={"X-API-Key": KEY}, timeout=30).json()
    assert [w["worker_id"] for w in stats["engines"][0]["trainer_workers"]] == ["trainer-0"]
    data = _data()
    got = _train(tc, data, STEPS)
    rt = Runtime(tmp_path)  # the reference: one unsharded engine in this process
    try:
        local = (
            opentinker.ServiceClient(runtime=rt)
            .create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=SEED)
            .result()
        )
        want = _train(local, data, STEPS)
    finally:
        rt.shutdown()
    for g, w in zip(got, want, strict=True):
        assert_scalar_close(g, w)
    assert abs(got[-1] - got[0]) > 1e-2 * abs(got[0])  # the steps moved the weights
    sampler = tc.save_weights_and_get_sampling_client().result(timeout=WAIT)
    prompt = [5, 40, 41, 42]
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=3, stop=[])
    seq = sampler.sample(types.ModelInput.from_ints(prompt), 1, params).result(timeout=WAIT).sequences[0]
    tokens = prompt + list(seq.tokens)
    scored = tc.forward([_datum(tokens)], "cross_entropy").result(timeout=WAIT)
    trainer_lp = torch.tensor(scored.loss_fn_outputs[0]["logprobs"].tolist())[len(prompt) - 1 :]
    assert_logprobs_close(torch.tensor(seq.logprobs), trainer_lp)
    # the prompt's logprobs too (compute_logprobs: a one-token request with prompt logprobs)
    scored_lp = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result(timeout=WAIT)
    assert scored_lp[0] is None
    assert_logprobs_close(torch.tensor(scored_lp[len(prompt) :]), trainer_lp)
    # every one of them sampled on the group: jobs ran there, each member replaying the forwards
    stats = httpx.get(f"{server.base_url}/console/api/engine", headers={"X-API-Key": KEY}, timeout=30).json()
    rollout = stats["engines"][0]["rollout"]
    assert rollout["jobs"] >= 2 and rollout["finished"] >= 2 and rollout["forwards"] > rollout["steps"]
    remote.close("success").result()


def test_a_shard_base_that_does_not_divide_the_workers_stops_serve(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    was_up = ray.is_initialized()
    argv = ["--dev", "--base-model", TEST_MODEL, "--data-dir", str(tmp_path / "srv")]
    argv += ["--trainer-workers", "3", "--shard-base", "2"]
    assert serve(argv) == 2
    assert "shard_base 2 must divide the trainer workers (3)" in capsys.readouterr().err
    assert ray.is_initialized() == was_up  # refused before any Ray instance started
    with pytest.raises(ValueError, match=r"shard_base shards the base over trainer workers"):
        Runtime(tmp_path, shard_base=2)
    with pytest.raises(ValueError, match=r"data parallelism over sharded groups is not served"):
        Runtime(tmp_path, trainer_workers=2, shard_base=2, data_parallel=2)
    with pytest.raises(ValueError, match=r"samples on its group .* but rollout_workers samples on whole"):
        Runtime(tmp_path, trainer_workers=2, shard_base=2, rollout_workers=1)
    with pytest.raises(ValueError, match=r"shard_sampling must be 'group' or 'front', got 'tp'"):
        Runtime(tmp_path, trainer_workers=2, shard_base=2, shard_sampling="tp")
    assert ray.is_initialized() == was_up


def test_sharded_groups_the_cluster_cannot_place_stop_serve_at_once(tmp_path: Path) -> None:
    from ray._private.utils import get_num_cpus  # what a Ray instance started here will have

    n = get_num_cpus()
    cmd = [sys.executable, "-m", "opentinker.server", "--base-model", TEST_MODEL, "--dev", "--ray"]
    cmd += ["--trainer-workers", str(2 * n), "--shard-base", "2", "--data-dir", str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=WAIT, check=False)
    assert out.returncode == 2, out.stderr[-3000:]
    want = f"{2 * n} trainer workers × 1 CPU = {2 * n} CPUs asked, but the cluster has {n} CPUs free"
    assert want in out.stderr and "Traceback" not in out.stderr, out.stderr[-3000:]
