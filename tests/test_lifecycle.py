"""Model lifecycle and tenancy have one owner, the ``Runtime``; both front doors obey it alike.

One runtime serves the embedded clients (tenant ``local``, or any tenant given) and the HTTP app
(in-process, ``--dev``: a key's tenant is derived from its hash) at once. A tenant's checkpoints
and models do not exist for another tenant through either door; a refused creation creates
nothing; errors about a checkpoint name its tinker path, never a folder of the server.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient
from tinker import types

import opentinker
from opentinker.client import Runtime
from opentinker.engine import EngineError, UnknownPolicyError
from opentinker.engine.checkpoint import CheckpointError
from opentinker.lora import LoRAConfig
from opentinker.server.app import create_app
from opentinker.server.config import ServerConfig
from tests.conftest import TEST_MODEL

KEY = "tml-lifecycle-test-key-0001"


@pytest.fixture
def runtime(tmp_path) -> Iterator[Runtime]:
    rt = Runtime(tmp_path / "data")
    yield rt
    rt.shutdown()


@pytest.fixture
def http(runtime: Runtime, tmp_path) -> Iterator[TestClient]:
    config = ServerConfig(tmp_path / "data", base_models=(TEST_MODEL,), dev=True, poll_timeout_s=5.0)
    app = create_app(config, runtime=runtime)
    with TestClient(app, base_url="http://test/api/v1", headers={"X-API-Key": KEY}) as client:
        yield client


def _result(http: TestClient, request_id: str) -> dict[str, Any]:
    for _ in range(100):
        out = http.post("/retrieve_future", json={"request_id": request_id}).json()
        if out.get("type") != "try_again":
            return out
    raise AssertionError("no result")


def _session(http: TestClient) -> str:
    return http.post("/create_session", json={"tags": [], "sdk_version": "test"}).json()["session_id"]


def _datum(tokens: list[int]) -> types.Datum:
    inputs: dict[str, Any] = {"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)}
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


def test_another_tenants_checkpoint_and_model_do_not_exist_through_either_door(
    runtime: Runtime, http: TestClient
) -> None:
    local = opentinker.ServiceClient(runtime=runtime)
    tc = local.create_lora_training_client(TEST_MODEL, rank=2, seed=0)
    path = tc.save_state("mine").result().path
    sampler_path = tc.save_weights_for_sampler("mine-s").result().path
    models = set(runtime.models)

    # the server's tenant: 404, and nothing was created
    sid = _session(http)
    body = {"session_id": sid, "model_seq_id": 0, "path": path, "optimizer": True}
    r = http.post("/load_weights", json=body)
    assert r.status_code == 404 and "unknown checkpoint" in r.json()["detail"]
    body = {"session_id": sid, "sampling_session_seq_id": 0, "model_path": sampler_path}
    assert http.post("/create_sampling_session", json=body).status_code == 404
    # another embedded tenant: the same answer from the same rule
    bob = opentinker.ServiceClient(runtime=runtime, tenant="bob")
    for make in (
        lambda: bob.create_training_client_from_state(path),
        lambda: bob.create_training_client_from_state_with_optimizer(path),
        lambda: bob.create_sampling_client(model_path=sampler_path),
    ):
        with pytest.raises(UnknownPolicyError, match="unknown checkpoint"):
            make()
    with pytest.raises(UnknownPolicyError, match="unknown model"):
        bob.delete_model(tc.model_id)
    assert set(runtime.models) == models

    # a model the server's tenant creates is unknown to the embedded local tenant
    rid = http.post(
        "/create_model",
        json={"session_id": sid, "model_seq_id": 1, "base_model": TEST_MODEL, "lora_config": {"rank": 2}},
    ).json()["request_id"]
    theirs = _result(http, rid)["model_id"]
    assert runtime.models[theirs].tenant != "local"
    with pytest.raises(UnknownPolicyError):
        local.delete_model(theirs)
    with pytest.raises(UnknownPolicyError):
        runtime.model(theirs, "local")
    # and the checkpoints the server's tenant saves are unknown to the local tenant
    saved = _result(
        http, http.post("/save_weights", json={"model_id": theirs, "path": "t"}).json()["request_id"]
    )
    with pytest.raises(UnknownPolicyError, match="unknown checkpoint"):
        local.create_training_client_from_state(saved["path"])
    assert saved["path"] not in {
        c.tinker_path for c in local.create_rest_client().list_user_checkpoints().result().checkpoints
    }


def test_an_unsupported_optimizer_is_refused_by_both_doors_and_creates_nothing(
    runtime: Runtime, http: TestClient
) -> None:
    service = opentinker.ServiceClient(runtime=runtime)
    before = set(runtime.models)
    with pytest.raises(EngineError, match="unknown optimizer type .sgd. in optimizer_config"):
        service.create_lora_training_client(TEST_MODEL, rank=2, optimizer=SimpleNamespace(type="sgd"))
    sid = _session(http)
    body = {
        "session_id": sid,
        "model_seq_id": 0,
        "base_model": TEST_MODEL,
        "optimizer_config": {"type": "sgd"},
    }
    err = _result(http, http.post("/create_model", json=body).json()["request_id"])
    assert err["category"] == "user" and "unknown optimizer type 'sgd' in optimizer_config" in err["error"]
    assert set(runtime.models) == before
    assert http.post("/get_info", json={"model_id": f"{sid}:train:0"}).status_code == 404
    assert runtime.base_stack(TEST_MODEL).engine.adapter_ids() == []


def test_create_from_checkpoint_is_checked_before_anything_is_made(runtime: Runtime) -> None:
    service = opentinker.ServiceClient(runtime=runtime)
    tc = service.create_lora_training_client(TEST_MODEL, rank=2, seed=0)
    path = tc.save_state("ckpt").result().path
    adapters = runtime.base_stack(TEST_MODEL).engine.adapter_ids()
    # trained on another base model: refused before that model is even loaded
    with pytest.raises(CheckpointError, match="was trained on 'opentinker/tiny'"):
        service.create_training_client_from_state(path, base_model="HuggingFaceTB/SmolLM2-135M-Instruct")
    assert runtime.loaded_base_models() == [TEST_MODEL]
    # a model id in use is refused, the live model untouched
    with pytest.raises(EngineError, match="already exists"):
        runtime.create_model(tc.model_id, TEST_MODEL, LoRAConfig(rank=2), tenant="local")
    # a torn checkpoint: the error names its tinker path, not the folder on disk
    folder = runtime.store.folder(runtime.checkpoint(path, "local")[0])
    (folder / "manifest.json").write_text("{torn")
    with pytest.raises(CheckpointError) as info:
        service.create_training_client_from_state(path)
    assert path in str(info.value) and str(runtime.data_dir) not in str(info.value)
    with pytest.raises(CheckpointError) as info:
        tc.load_state(path)
    assert str(runtime.data_dir) not in str(info.value)
    assert runtime.base_stack(TEST_MODEL).engine.adapter_ids() == adapters


def test_from_checkpoint_equals_the_saved_model_through_both_doors(
    runtime: Runtime, http: TestClient
) -> None:
    """The server's create-from-state and the embedded one make the same model from one checkpoint
    (same weights, same LoRA config, the checkpoint as parent) and record it for its tenant."""
    sid = _session(http)
    rid = http.post(
        "/create_model",
        json={
            "session_id": sid,
            "model_seq_id": 0,
            "base_model": TEST_MODEL,
            "lora_config": {"rank": 3, "seed": 4},
        },
    ).json()["request_id"]
    mid = _result(http, rid)["model_id"]
    tenant = runtime.models[mid].tenant
    tc = opentinker.client.TrainingClient(runtime, mid)
    tc.forward_backward([_datum([1, 5, 9, 12, 7])]).result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    path = tc.save_state("s").result().path

    rid = http.post(
        "/load_weights", json={"session_id": sid, "model_seq_id": 1, "path": path, "optimizer": True}
    ).json()["request_id"]
    via_server = _result(http, rid)["model_id"]
    embedded = opentinker.ServiceClient(runtime=runtime, tenant=tenant)
    via_embedded = embedded.create_training_client_from_state_with_optimizer(path).model_id

    engine = runtime.base_stack(TEST_MODEL).engine
    want = engine.adapter_weights(mid).state_dict()
    for other in (via_server, via_embedded):
        rec = runtime.models[other]
        assert (rec.tenant, rec.parent, rec.lora) == (tenant, path, runtime.models[mid].lora)
        got = engine.adapter_weights(other).state_dict()
        assert all(got[k].equal(want[k]) for k in want)
    info = http.post("/get_info", json={"model_id": via_server}).json()
    assert info["model_data"]["tokenizer_id"] == runtime.base_model_info(TEST_MODEL).path
    assert info["lora_rank"] == 3


def test_delete_and_accessors(runtime: Runtime) -> None:
    service = opentinker.ServiceClient(runtime=runtime)
    tc = service.create_lora_training_client(TEST_MODEL, rank=2, seed=0)
    engine = runtime.base_stack(TEST_MODEL).engine
    assert tc.get_tokenizer() is runtime.tokenizer(TEST_MODEL) is engine.base.tokenizer
    info = runtime.base_model_info("tiny")  # an alias names the same base model
    assert (info.name, info.path, info.max_context, info.vocab_size) == (
        engine.base.name,
        engine.base.path,
        engine.max_context,
        engine.vocab_size,
    )
    assert tc.get_info().model_data.tokenizer_id == info.path
    service.delete_model(tc.model_id)
    assert not engine.has_adapter(tc.model_id)
    with pytest.raises(EngineError, match="was deleted"):
        tc.forward([_datum([1, 5, 9])])
    with pytest.raises(EngineError, match="was deleted"):
        service.delete_model(tc.model_id)
