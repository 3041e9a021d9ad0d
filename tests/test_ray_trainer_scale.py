"""Elastic trainer workers: ``opentinker serve --ray ADDRESS --trainer-workers 2`` scaled while it
serves, over HTTP (the operator's route and ``opentinker cluster scale --trainer-workers``), with
the real ``tinker`` SDK as the client.

Removing a worker hands each of its models over (whole state through the data dir, onto another
worker) while the model trains: no request fails, and its losses, final weights and Adam moments
equal a run in one process with no move (rtol 1e-5; the same ops on the same tensors), its step
count goes on. Adding one: a new model lands on the new worker and trains. Bad scales are refused
at once with 400, nothing changed. The server joins this module's Ray instance (2 CPUs, one per
trainer worker), so what the cluster can place is known.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import tinker
import torch
from tinker import types

import opentinker
from opentinker.cli.main import main as cli_main
from opentinker.engine.checkpoint import read_checkpoint
from opentinker.server.auth import create_key
from opentinker.server.local import LocalServer
from opentinker.service.checkpoints import CheckpointStore, parse_tinker_path
from opentinker.service.runtime import Runtime
from tests.conftest import TEST_MODEL
from tests.tolerances import assert_scalar_close

ray = pytest.importorskip("ray")

from opentinker.cli.cluster import request  # noqa: E402
from opentinker.cluster.ray_env import NAMESPACE  # noqa: E402

pytestmark = pytest.mark.slow  # a server, two trainer actors and a scale-up's actor: ~1.5 min here

WAIT = 120  # seconds: a request that would hang fails the test instead
BEFORE, DURING, AFTER = 2, 4, 2  # steps before the scale, sent while it runs, after it
ADAM = types.AdamParams(learning_rate=2e-2)
KEY = "tml-trainer-scale-0001"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalServer, str]]:
    ray.init(num_cpus=2, object_store_memory=300 * 2**20, include_dashboard=False, namespace=NAMESPACE)
    data = tmp_path_factory.mktemp("srv")
    ops = create_key(data, "ops")
    args = ["--dev", "--base-model", TEST_MODEL, "--operator", "ops"]
    args += ["--ray", ray.get_runtime_context().gcs_address, "--trainer-workers", "2", "--trainer-cpus", "1"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TINKER_TELEMETRY", "0")
        for var in ("TINKER_API_KEY", "TINKER_BASE_URL"):
            mp.delenv(var, raising=False)
        srv = LocalServer(args, data_dir=data)
        srv.start()
        try:
            yield srv, ops
        finally:
            srv.stop()
            ray.shutdown()


def _trainers(srv: LocalServer, ops: str) -> list[dict[str, Any]]:
    [workers] = request(srv.base_url, "/api/v1/cluster", ops, None, timeout=60)["trainers"].values()
    return workers


def _placement(srv: LocalServer, ops: str) -> dict[str, str]:
    return {m: w["worker_id"] for w in _trainers(srv, ops) for m in w["model_ids"]}


def _scale(srv: LocalServer, ops: str, body: dict[str, Any]) -> Any:
    return request(srv.base_url, "/api/v1/cluster/scale", ops, body, timeout=WAIT)


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = cli_main(["cluster", *args])
    out = capsys.readouterr()
    return code, out.out + out.err


def _datum(tokens: list[int]) -> types.Datum:
    inputs: dict[str, Any] = {"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)}
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


def _data(step: int) -> list[types.Datum]:
    return [_datum([3 + (5 * step + 11 * j + k) % 150 for k in range(9 + j + step % 3)]) for j in range(2)]


def _steps(tc: Any, first: int, n: int) -> list[Any]:
    """``n`` pipelined steps (forward_backward + optim_step sent before any answer)."""
    futs = []
    for s in range(first, first + n):
        futs.append(tc.forward_backward(_data(s), "cross_entropy"))
        futs.append(tc.optim_step(ADAM))
    return futs


def _losses(futs: list[Any]) -> list[float]:
    out = [f.result(timeout=WAIT) for f in futs]  # every request answers (raises if one failed)
    return [r.metrics["loss:sum"] for r in out[::2]]


def _state(store: CheckpointStore, path: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], int]:
    files, meta = read_checkpoint(store.folder(parse_tinker_path(path)))
    return files["adapter.safetensors"], files["optimizer.safetensors"], int(meta["step"])


def _client(service: Any, seed: int) -> Any:
    tc = service.create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=seed)
    return tc.result() if hasattr(tc, "result") else tc


def test_bad_scales_are_refused_at_once_and_change_nothing(
    served: tuple[LocalServer, str], capsys: pytest.CaptureFixture[str]
) -> None:
    srv, ops = served
    before = _trainers(srv, ops)
    assert [w["worker_id"] for w in before] == ["trainer-0", "trainer-1"]
    refused = [
        ({"trainer_workers": 0}, "400: trainer workers cannot be scaled below one, got 0"),
        ({"trainer_workers": -3}, "400: trainer workers cannot be scaled below one, got -3"),
        (
            {"trainer_workers": 3},
            "400: 1 more trainer worker × 1 CPU = 1 CPU asked, but the cluster has 0 CPUs free (2 in all); "
            "scale to fewer workers or free some of the cluster's CPUs",
        ),
        ({}, "400: give rollout_workers and/or trainer_workers"),
        ({"trainer_workers": 1, "rollout_workers": 2}, "400: this service has no rollout workers to scale"),
        ({"trainer_workers": 1, "workers": 1}, "422"),  # extra fields are forbidden
    ]
    for body, reason in refused:
        with pytest.raises(RuntimeError) as info:
            _scale(srv, ops, body)
        assert str(info.value).startswith(reason), (body, str(info.value))
    url = ["--url", srv.base_url, "--api-key", ops]
    code, text = _cli(capsys, "scale", "--trainer-workers", "0", *url)
    assert code == 1 and "400: trainer workers cannot be scaled below one" in text, text
    code, text = _cli(capsys, "scale", "--trainer-workers", "1", "--url", srv.base_url, "--api-key", KEY)
    assert code == 1 and "403: the cluster routes need an operator's key" in text, text
    after = _trainers(srv, ops)
    assert [(w["worker_id"], w["alive"], w["model_ids"]) for w in after] == [
        (w["worker_id"], w["alive"], w["model_ids"]) for w in before
    ]


def test_scale_2_to_1_hands_a_training_model_over_without_losing_a_step(
    served: tuple[LocalServer, str], tmp_path: Path
) -> None:
    srv, ops = served
    remote = tinker.ServiceClient(base_url=srv.base_url, api_key=KEY)
    idle, tc = _client(remote, 1), _client(remote, 2)
    placed = _placement(srv, ops)  # the least loaded, ties to the lowest rank
    assert placed[idle.model_id] == "trainer-0" and placed[tc.model_id] == "trainer-1"
    losses = _losses(_steps(tc, 0, BEFORE))
    # the scale starts (it removes the least loaded, ties to the newest: trainer-1, with tc's
    # model) while the next steps are sent; they wait behind the handover, or it behind them
    with ThreadPoolExecutor(1) as ex:
        scaling = ex.submit(_scale, srv, ops, {"trainer_workers": 1})
        during = _steps(tc, BEFORE, DURING)
        out = scaling.result(timeout=WAIT)
        losses += _losses(during)
    losses += _losses(_steps(tc, BEFORE + DURING, AFTER))
    report = out["trainer_scale"][TEST_MODEL]
    assert report["removed"] == ["trainer-1"] and report["added"] == []
    moved = report["moved"][tc.model_id]
    assert (moved["from"], moved["to"]) == ("trainer-1", "trainer-0") and len(report["moved"]) == 1
    assert BEFORE <= moved["at_step"] <= BEFORE + DURING  # it moved while the client trained
    workers = _trainers(srv, ops)
    assert [(w["worker_id"], w["model_ids"]) for w in workers] == [
        ("trainer-0", sorted([idle.model_id, tc.model_id]))
    ]
    path = tc.save_state("final").result(timeout=WAIT).path

    # the reference: the same client in one process, no Ray, no move
    rt = Runtime(tmp_path / "ref")
    try:
        ref = _client(opentinker.ServiceClient(runtime=rt), 2)
        want = _losses(_steps(ref, 0, BEFORE + DURING + AFTER))
        ref_path = ref.save_state("final").result(timeout=WAIT).path
        w_ref, m_ref, step_ref = _state(rt.store, ref_path)
    finally:
        rt.shutdown()
    assert len(losses) == len(want) == BEFORE + DURING + AFTER
    for g, w in zip(losses, want, strict=True):
        assert_scalar_close(g, w, rel=1e-5)
    weights, moments, step = _state(CheckpointStore(srv.data_dir), path)
    assert step == step_ref == BEFORE + DURING + AFTER  # the step count went on across the move
    for got, exp in ((weights, w_ref), (moments, m_ref)):
        assert set(got) == set(exp)
        for k in exp:
            torch.testing.assert_close(got[k], exp[k], rtol=1e-5, atol=1e-6, msg=k)
    remote.close("success").result(timeout=WAIT)


def test_scale_1_to_2_places_a_new_model_on_the_new_worker(
    served: tuple[LocalServer, str], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    srv, ops = served
    if len(_trainers(srv, ops)) != 1:  # run alone: start from one worker
        _scale(srv, ops, {"trainer_workers": 1})
    remote = tinker.ServiceClient(base_url=srv.base_url, api_key=KEY)
    old = _client(remote, 4)  # the one worker holds a model
    url = ["--url", srv.base_url, "--api-key", ops]
    code, text = _cli(capsys, "scale", "--trainer-workers", "2", *url)
    assert code == 0, text
    [added] = json.loads(text)["trainer_scale"][TEST_MODEL]["added"]
    assert [w["worker_id"] for w in _trainers(srv, ops)][-1] == added
    tc = _client(remote, 5)
    assert _placement(srv, ops)[old.model_id] != added
    assert _placement(srv, ops)[tc.model_id] == added  # it holds nothing yet: the least loaded
    got = _losses(_steps(tc, 0, 2))
    rt = Runtime(tmp_path / "ref")
    try:
        want = _losses(_steps(_client(opentinker.ServiceClient(runtime=rt), 5), 0, 2))
    finally:
        rt.shutdown()
    for g, w in zip(got, want, strict=True):
        assert_scalar_close(g, w, rel=1e-5)
    [new] = [w for w in _trainers(srv, ops) if w["worker_id"] == added]
    assert new["alive"] and new["ticks"] > 0 and new["model_ids"] == [tc.model_id]
    remote.close("success").result(timeout=WAIT)


def test_gradients_accumulated_before_a_move_are_stepped_on_after_it(
    served: tuple[LocalServer, str], tmp_path: Path
) -> None:
    """A forward_backward before the move, its optim_step after: the gradients went with the model."""
    srv, ops = served
    if len(_trainers(srv, ops)) != 2:  # run alone: start from two workers
        _scale(srv, ops, {"trainer_workers": 2})
    remote = tinker.ServiceClient(base_url=srv.base_url, api_key=KEY)
    clients = [_client(remote, 6), _client(remote, 7)]  # one on each worker: one of them moves
    assert len({_placement(srv, ops)[c.model_id] for c in clients}) == 2
    pending = [c.forward_backward(_data(0), "cross_entropy").result(timeout=WAIT) for c in clients]
    moved = _scale(srv, ops, {"trainer_workers": 1})["trainer_scale"][TEST_MODEL]["moved"]
    assert len(moved) == 1 and next(iter(moved.values()))["at_step"] == 0
    for c in clients:
        c.optim_step(ADAM).result(timeout=WAIT)
    got = [[p.metrics["loss:sum"], *_losses(_steps(c, 1, 1))] for p, c in zip(pending, clients, strict=True)]
    rt = Runtime(tmp_path / "ref")
    try:
        service = opentinker.ServiceClient(runtime=rt)
        want = [_losses(_steps(_client(service, seed), 0, 2)) for seed in (6, 7)]
    finally:
        rt.shutdown()
    for g, w in zip(got, want, strict=True):
        for a, b in zip(g, w, strict=True):
            assert_scalar_close(a, b, rel=1e-5)
    remote.close("success").result(timeout=WAIT)
