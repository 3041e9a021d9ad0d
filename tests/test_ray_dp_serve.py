"""Data parallelism through the server: the unmodified ``tinker`` SDK over HTTP against
``opentinker serve --ray --trainer-workers 2 --data-parallel 2``.

Every new model is data-parallel over both workers (the server's default) unless its
``user_metadata`` asks for another degree; the reference is a ``{"data_parallel": "1"}`` model on
one worker, made with the same LoRA seed. Over 3 steps the k = 2 model's losses equal it (the sum
of the two shards' gradients is the whole batch's, so only fp32 summation order differs), its
greedy samples after training are identical, its checkpoint (replica 0's state, recording the
degree) makes a k = 2 model again by default and a plain one with the same tensors when asked
(``{"data_parallel": "1"}``), and loads into it reach both replicas (a step after the load equals
the plain model's). A degree the server cannot serve is a 400 at once, naming the value and the
trainer workers, and creates nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import tinker
import torch
from safetensors.torch import load_file
from tinker import types

from opentinker.server.local import LocalServer
from opentinker.server.main import serve
from opentinker.service.checkpoints import CheckpointStore, parse_tinker_path
from opentinker.service.runtime import Runtime
from tests.conftest import TEST_MODEL
from tests.test_ray_trainer import WAIT, _datum, _train
from tests.tolerances import assert_greedy_equal, assert_scalar_close

ray = pytest.importorskip("ray")

KEY = "tml-dp-serve-probe-0001"
SEED = 11
STEPS = 3
REL = 1e-5  # losses: token sums over the same weights, shards summed in another order (fp32)
# user_metadata {"data_parallel": value} on two trainer workers -> the refusal (HTTP 400 here, the
# same ValueError embedded: test_ray_dp_loss.py)
BAD_DEGREES = {
    "3": r"data_parallel 3 is above the number of trainer workers \(2\)",
    "0": r"data_parallel must be an integer >= 1, got '0'",
    "-1": r"data_parallel must be an integer >= 1, got '-1'",
    "two": r"data_parallel must be an integer >= 1, got 'two'",
    "1.5": r"data_parallel must be an integer >= 1, got '1.5'",
}


def _data() -> list[types.Datum]:
    """Five datums of different lengths: the two shards (3 + 2) are uneven and padded differently."""
    return [_datum([3 + (5 * j + 7 * k) % 190 for k in range(8 + 3 * j)]) for j in range(5)]


def _loss(tc: Any, data: list[types.Datum]) -> float:
    return tc.forward(data, "cross_entropy").result(timeout=WAIT).metrics["loss:sum"]


def _greedy(sampler: Any) -> list[int]:
    params = types.SamplingParams(max_tokens=8, temperature=0.0, stop=[])
    prompt = types.ModelInput.from_ints([5, 40, 41, 42])
    out = sampler.sample(prompt, num_samples=1, sampling_params=params).result(timeout=WAIT)
    return list(out.sequences[0].tokens)


def _tensors(store: CheckpointStore, path: str) -> dict[str, torch.Tensor]:
    folder = store.folder(parse_tinker_path(path))
    return {
        f"{name}/{k}": v
        for name in ("adapter.safetensors", "optimizer.safetensors")
        for k, v in load_file(folder / name).items()
    }


def _models_per_worker(base_url: str) -> list[int]:
    stats = httpx.get(f"{base_url}/console/api/engine", headers={"X-API-Key": KEY}, timeout=30).json()
    return [w["models"] for w in stats["engines"][0]["trainer_workers"]]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    mp = pytest.MonkeyPatch()
    mp.setenv("TINKER_TELEMETRY", "0")
    for var in ("TINKER_API_KEY", "TINKER_BASE_URL"):
        mp.delenv(var, raising=False)
    args = ["--dev", "--base-model", TEST_MODEL, "--ray", "--trainer-workers", "2", "--data-parallel", "2"]
    srv = LocalServer(args, data_dir=tmp_path_factory.mktemp("dpserve"))
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()
        mp.undo()


@pytest.fixture(scope="module")
def service(server: LocalServer):
    remote = tinker.ServiceClient(base_url=server.base_url, api_key=KEY)
    yield remote
    remote.close("success").result()


def test_a_degree_the_server_cannot_serve_is_a_400_creating_nothing(
    server: LocalServer, service: Any
) -> None:
    before = _models_per_worker(server.base_url)
    for value, message in BAD_DEGREES.items():
        with pytest.raises(tinker.BadRequestError, match=message):
            service.create_lora_training_client(
                base_model=TEST_MODEL, rank=4, seed=SEED, user_metadata={"data_parallel": value}
            ).result()
    assert _models_per_worker(server.base_url) == before


def test_data_parallel_model_over_the_sdk_equals_one_worker(server: LocalServer, service: Any) -> None:
    before = sum(_models_per_worker(server.base_url))
    dp = service.create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=SEED).result()  # default 2
    one = service.create_lora_training_client(
        base_model=TEST_MODEL, rank=4, seed=SEED, user_metadata={"data_parallel": "1"}
    ).result()
    # the k = 2 model is held by both workers, the k = 1 model by one
    assert sum(_models_per_worker(server.base_url)) == before + 3
    info = dp.get_info()
    assert info.model_id == dp.model_id and info.lora_rank == 4
    data = _data()
    got, want = _train(dp, data, STEPS), _train(one, data, STEPS)
    for g, w in zip(got, want, strict=True):
        assert_scalar_close(g, w, rel=REL)
    assert abs(got[-1] - got[0]) > 100 * REL * abs(got[0])  # the steps moved the weights, far past REL
    # sampling after training: the snapshot, and named sampler weights, give the same greedy tokens
    want_greedy = _greedy(one.save_weights_and_get_sampling_client().result(timeout=WAIT))
    assert_greedy_equal(_greedy(dp.save_weights_and_get_sampling_client().result(timeout=WAIT)), want_greedy)
    path = dp.save_weights_for_sampler("dp-sampler").result(timeout=WAIT).path
    assert_greedy_equal(_greedy(service.create_sampling_client(model_path=path).result()), want_greedy)
    assert_scalar_close(_loss(dp, data), _loss(one, data), rel=REL)  # forward only


def test_a_data_parallel_checkpoint_loads_into_a_plain_model_and_back(
    server: LocalServer, service: Any
) -> None:
    store = CheckpointStore(server.data_dir)
    data = _data()
    dp = service.create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=SEED + 1).result()
    _train(dp, data, 2)
    path = dp.save_state("dp-two").result(timeout=WAIT).path
    at_save = _loss(dp, data)
    # a model made from the checkpoint keeps its degree (both workers) unless it asks for one
    before = sum(_models_per_worker(server.base_url))
    kept = service.create_training_client_from_state_with_optimizer(path).result()
    assert sum(_models_per_worker(server.base_url)) == before + 2
    assert_scalar_close(_loss(kept, data), at_save, rel=REL)
    # a plain one (one worker), with the same tensors
    plain = service.create_training_client_from_state_with_optimizer(
        path, user_metadata={"data_parallel": "1"}
    ).result()
    assert sum(_models_per_worker(server.base_url)) == before + 3
    copy = plain.save_state("copy").result(timeout=WAIT).path
    saved, copied = _tensors(store, path), _tensors(store, copy)
    assert saved.keys() == copied.keys() and any(k.startswith("optimizer") for k in saved)
    assert all(torch.equal(saved[k], copied[k]) for k in saved)  # read then written: no arithmetic
    assert_scalar_close(_loss(plain, data), at_save, rel=REL)
    # the optimizer state came along: the next step is the same on both
    assert_scalar_close(_train(dp, data, 1)[0], _train(plain, data, 1)[0], rel=REL)
    after_plain = _loss(plain, data)
    # loading back into the data-parallel model reaches both replicas: a step after it equals the
    # plain model's (a replica left on other weights would all-reduce another gradient)
    dp.load_state_with_optimizer(path).result(timeout=WAIT)
    assert_scalar_close(_loss(dp, data), at_save, rel=REL)
    _train(dp, data, 1)
    assert_scalar_close(_loss(dp, data), after_plain, rel=REL)
    dp.load_state(path).result(timeout=WAIT)  # weights only, a fresh optimizer, on both replicas
    assert_scalar_close(_loss(dp, data), at_save, rel=REL)
    fresh = service.create_training_client_from_state(path).result()
    assert_scalar_close(_train(dp, data, 1)[0], _train(fresh, data, 1)[0], rel=REL)
    assert_scalar_close(_loss(dp, data), _loss(fresh, data), rel=REL)


def test_a_default_degree_the_workers_cannot_serve_is_refused_before_ray_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    was_up = ray.is_initialized()
    with pytest.raises(ValueError, match=r"data_parallel 3 is above the number of trainer workers \(2\)"):
        Runtime(tmp_path, trainer_workers=2, data_parallel=3)
    with pytest.raises(ValueError, match=r"above the number of trainer workers \(0\); serve with --ray"):
        Runtime(tmp_path, data_parallel=2)
    argv = ["--dev", "--base-model", TEST_MODEL, "--data-dir", str(tmp_path / "srv")]
    argv += ["--trainer-workers", "2", "--data-parallel", "3"]
    assert serve(argv) == 2
    assert "data_parallel 3 is above the number of trainer workers (2)" in capsys.readouterr().err
    assert ray.is_initialized() == was_up  # refused before any Ray instance started
