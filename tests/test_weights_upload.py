"""SDK 0.39's external-weights upload against ``opentinker serve``: ``external_weights_upload_start``,
a PUT of each file to its signed URL, ``external_weights_upload_finish``, and their tenancy.

The installed SDK is 0.38, which has none of these calls, so :class:`Uploader` is built from the
request and response types Tinker's 0.39 reference documents (``ExternalWeightsUploadStart
Request`` / ``Response``, ``ExternalWeightsUploadFinishRequest`` / ``Response``) as pydantic
models, sent as plain HTTP with the SDK's ``X-API-Key`` header; the PUTs carry no key (the
signature is the credential). The weights uploaded are what ``save_weights_external`` wrote,
downloaded through the 0.38 SDK's ``get_external_weights_urls``; the result downloads back byte
for byte and is listed with its base model. Bad input, each refused at finish naming the tensor
or field, with nothing stored: another base model's layout, an unknown key, a wrong shape, a
missing tensor, a config of another rank, a file that is not safetensors; and at start or PUT: a
base model not served, a changed or another tenant's URL, a file name that is not one of the two.
"""

from __future__ import annotations

import io
import json
import urllib.parse
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tinker
import torch
from pydantic import BaseModel
from safetensors.torch import load, save
from tinker import types

from opentinker.server.local import LocalServer
from tests.conftest import TEST_MODEL, local_server

KEY_A, KEY_B = "tml-upload-tenant-a", "tml-upload-tenant-b"
WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"
TOKENS = [int(t) for t in np.random.default_rng(3).integers(3, 1000, 12)]


class UploadStartResponse(BaseModel):  # ExternalWeightsUploadStartResponse, 0.39
    upload_id: str
    urls: dict[str, str]
    expires: datetime


class UploadFinishResponse(BaseModel):  # ExternalWeightsUploadFinishResponse, 0.39
    tinker_path: str


class Uploader:
    """``RestClient.external_weights_upload_start`` / ``_finish`` of SDK 0.39, over plain HTTP."""

    def __init__(self, server: LocalServer, key: str) -> None:
        self.http = httpx.Client(base_url=server.base_url, headers={"X-API-Key": key}, timeout=120)

    def start_raw(self, **body: Any) -> httpx.Response:
        return self.http.post("/api/v1/external_weights_upload_start", json=body)

    def start(self, base_model: str = TEST_MODEL, rank: int = 4, **kw: Any) -> UploadStartResponse:
        resp = self.start_raw(base_model=base_model, lora_config={"rank": rank}, **kw)
        assert resp.status_code == 200, resp.text
        return UploadStartResponse.model_validate(resp.json())

    def finish_raw(self, upload_id: str) -> httpx.Response:
        return self.http.post("/api/v1/external_weights_upload_finish", json={"upload_id": upload_id})

    def upload(self, files: dict[str, bytes], **kw: Any) -> httpx.Response:
        """Start, PUT every file (no API key), finish: the finish's answer."""
        started = self.start(**kw)
        for name, data in files.items():
            assert httpx.put(started.urls[name], content=data, timeout=60).status_code == 200
        return self.finish_raw(started.upload_id)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    with local_server(tmp_path_factory, "upload-data", "--poll-timeout", "5") as srv:
        yield srv


@pytest.fixture(scope="module")
def exported(server: LocalServer) -> Iterator[dict[str, bytes]]:
    """Tenant A's trained adapter as ``save_weights_external`` wrote it, downloaded: file -> bytes."""
    sc = tinker.ServiceClient(base_url=server.base_url, api_key=KEY_A)
    tc = sc.create_lora_training_client(TEST_MODEL, rank=4, seed=0).result()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(TOKENS[:-1]),
        loss_fn_inputs={"target_tokens": TOKENS[1:]},  # type: ignore[dict-item]
    )
    tc.forward_backward([datum], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=3e-2)).result()
    path = tc.save_weights_external("src").result().path
    yield _download(server, KEY_A, path)
    sc.close("success").result()


def _download(server: LocalServer, key: str, tinker_path: str) -> dict[str, bytes]:
    urls = tinker.RestClient(base_url=server.base_url, api_key=key).get_external_weights_urls(tinker_path)
    return {name: httpx.get(url, timeout=60).content for name, url in urls.result().urls.items()}


def _with_query(url: str, **changes: str) -> str:
    parts = urllib.parse.urlsplit(url)
    query = dict(urllib.parse.parse_qsl(parts.query)) | changes
    return urllib.parse.urlunsplit(parts._replace(query=urllib.parse.urlencode(query)))


def _checkpoint_files(server: LocalServer) -> set[Path]:
    return {p for p in (server.data_dir / "checkpoints").rglob("*") if p.is_file()}


def test_an_upload_becomes_external_weights_of_the_uploader_only(
    server: LocalServer, exported: dict[str, bytes]
) -> None:
    a = Uploader(server, KEY_A)
    started = a.start(destination_project_id="uploads")
    assert sorted(started.urls) == [CONFIG, WEIGHTS]
    assert 3000 < started.expires.timestamp() - datetime.now().timestamp() <= 3600
    # B can neither finish A's upload nor put a file with A's URL re-signed for B
    assert Uploader(server, KEY_B).finish_raw(started.upload_id).status_code == 404
    other = _with_query(started.urls[WEIGHTS], tenant="another-tenant")
    put = httpx.put(other, content=exported[WEIGHTS], timeout=60)
    assert put.status_code == 403 and "invalid upload URL signature" in put.text
    for name, data in exported.items():
        assert httpx.put(started.urls[name], content=data, timeout=60).status_code == 200
    resp = a.finish_raw(started.upload_id)
    assert resp.status_code == 200, resp.text
    path = UploadFinishResponse.model_validate(resp.json()).tinker_path
    assert path.startswith("tinker://") and path.endswith("/external_weights/uploaded")
    assert _download(server, KEY_A, path) == exported  # what was uploaded, byte for byte
    found = a.http.post("/api/v1/checkpoints/search", json={"checkpoint_type": "external"}).json()
    mine = {c["tinker_path"]: c for c in found["checkpoints"]}
    assert mine[path]["base_model"] == TEST_MODEL and mine[path]["size_bytes"] > 0
    projects = a.http.post("/api/v1/checkpoints/search", json={"project_ids": ["uploads"]}).json()
    assert [c["tinker_path"] for c in projects["checkpoints"]] == [path]
    # B: not listed, not downloadable; the upload is finished (its id is gone)
    b_found = Uploader(server, KEY_B).http.post("/api/v1/checkpoints/search", json={}).json()
    assert path not in {c["tinker_path"] for c in b_found["checkpoints"]}
    with pytest.raises(tinker.NotFoundError):
        _download(server, KEY_B, path)
    assert a.finish_raw(started.upload_id).status_code == 404


def _weights(exported: dict[str, bytes], change: Any) -> bytes:
    tensors = load(exported[WEIGHTS])
    change(tensors)
    return save(tensors)


def _first(tensors: dict[str, torch.Tensor]) -> str:
    return sorted(tensors)[0]


def _other_base(tensors: dict[str, torch.Tensor]) -> None:
    """A model of another family and width: gpt-oss's attention names, hidden size 64."""
    tensors.clear()
    tensors["base_model.model.model.layers.0.attn.q_proj.lora_A.weight"] = torch.zeros(4, 64)
    tensors["base_model.model.model.layers.0.attn.q_proj.lora_B.weight"] = torch.zeros(64, 4)


def _wider(tensors: dict[str, torch.Tensor]) -> None:
    k = _first(tensors)
    tensors[k] = torch.zeros(tensors[k].shape[0], tensors[k].shape[1] + 1)


def _nan(tensors: dict[str, torch.Tensor]) -> None:
    tensors[_first(tensors)][0, 0] = float("nan")


@pytest.mark.parametrize(
    ("what", "files", "message"),
    [
        (
            "another base's layout",
            lambda e: {WEIGHTS: _weights(e, _other_base)},
            "layers.0.attn.q_proj.lora_A",
        ),
        (
            "an unknown key",
            lambda e: {WEIGHTS: _weights(e, lambda t: t.update(extra=torch.zeros(2)))},
            "'extra'",
        ),
        ("a wrong shape", lambda e: {WEIGHTS: _weights(e, _wider)}, "has shape"),
        ("a missing tensor", lambda e: {WEIGHTS: _weights(e, lambda t: t.pop(_first(t)))}, "is missing"),
        ("NaN", lambda e: {WEIGHTS: _weights(e, _nan)}, "NaN"),
        (
            "another rank",
            lambda e: {CONFIG: json.dumps({**json.loads(e[CONFIG]), "r": 8}).encode()},
            "r is 8",
        ),
        ("not safetensors", lambda e: {WEIGHTS: b"\x00" * 64}, "not a safetensors file"),
        ("no weights", lambda e: {WEIGHTS: None}, f"{WEIGHTS} was not uploaded"),
    ],
)
def test_a_bad_upload_is_refused_at_finish_naming_it_and_nothing_is_stored(
    server: LocalServer, exported: dict[str, bytes], what: str, files: Any, message: str
) -> None:
    before = _checkpoint_files(server)
    listed = Uploader(server, KEY_A).http.post("/api/v1/checkpoints/search", json={}).json()["checkpoints"]
    sent = {**exported, **files(exported)}
    resp = Uploader(server, KEY_A).upload({k: v for k, v in sent.items() if v is not None})
    assert resp.status_code == 400, (what, resp.text)
    assert message in resp.text and "nothing stored" in resp.text, (what, resp.text)
    assert "/tmp/" not in resp.text and str(server.data_dir) not in resp.text
    assert _checkpoint_files(server) == before
    after = Uploader(server, KEY_A).http.post("/api/v1/checkpoints/search", json={}).json()["checkpoints"]
    assert after == listed
    assert not any((server.data_dir / "uploads").iterdir())  # the refused upload was discarded


def test_bad_start_or_put_is_refused_naming_it(server: LocalServer, exported: dict[str, bytes]) -> None:
    a = Uploader(server, KEY_A)
    resp = a.start_raw(base_model="someone/unserved", lora_config={"rank": 4})
    assert resp.status_code == 400 and "base_model" in resp.text and "not served" in resp.text
    resp = a.start_raw(base_model=TEST_MODEL, lora_config={"rank": 0})
    assert resp.status_code == 400 and "lora_config.rank" in resp.text
    resp = a.start_raw(base_model=TEST_MODEL, lora_config={"rank": 4}, extra=1)
    assert resp.status_code == 422 and "extra" in resp.text
    started = a.start()
    url = started.urls[WEIGHTS]
    changed = _with_query(url, expires=str(int(started.expires.timestamp()) + 60))
    assert httpx.put(changed, content=b"x", timeout=60).status_code == 403
    other_file = url.replace(f"/{WEIGHTS}?", "/model.bin?")
    assert httpx.put(other_file, content=b"x", timeout=60).status_code == 403  # signed for its file only
    buf = io.BytesIO(exported[WEIGHTS]).getvalue()
    assert httpx.put(url, content=buf, timeout=60).status_code == 200
    resp = a.finish_raw(started.upload_id)  # its config was never put
    assert resp.status_code == 400 and f"{CONFIG} was not uploaded" in resp.text
