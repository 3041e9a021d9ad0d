"""SDK 0.39's checkpoint calls against ``opentinker serve``: ``search_checkpoints`` (its filters, limit
and cursor), ``Checkpoint.base_model``, and their tenancy.

The installed SDK is 0.38, which has none of them, so :class:`Client039` is built from the types
Tinker's 0.39 reference documents (``CheckpointSearchRequest``, ``CheckpointSearchResponse``,
``CheckpointSearchCursor``, ``Checkpoint``), written here as pydantic models, and sends them as
plain HTTP with the SDK's own ``X-API-Key`` header. Checkpoints are made with the unmodified 0.38
SDK. Two ``--dev`` keys are two tenants (A, B). Bad input: a limit out of range, a malformed
cursor, another tenant's project id, each a 4xx naming the field; B's checkpoints never in A's
results.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from typing import Any

import httpx
import pytest
import tinker
from pydantic import BaseModel

from opentinker.server.local import LocalServer
from tests.conftest import TEST_MODEL, local_server

KEY_A, KEY_B = "tml-search-tenant-a", "tml-search-tenant-b"


class Checkpoint(BaseModel):  # tinker.types.Checkpoint, 0.39
    checkpoint_id: str
    checkpoint_type: str
    time: datetime
    tinker_path: str
    size_bytes: int | None = None
    public: bool = False
    user_metadata: dict[str, str] | None = None
    expires_at: datetime | None = None
    base_model: str | None = None


class CheckpointSearchCursor(BaseModel):
    last_created_at: datetime
    last_checkpoint_uuid: str


class CheckpointSearchResponse(BaseModel):
    checkpoints: list[Checkpoint]
    next_cursor: CheckpointSearchCursor | None


class Client039:
    """``RestClient.search_checkpoints`` of SDK 0.39, over plain HTTP with the SDK's headers."""

    def __init__(self, server: LocalServer, key: str) -> None:
        self.http = httpx.Client(base_url=server.base_url, headers={"X-API-Key": key}, timeout=60)

    def raw(self, route: str, body: dict[str, Any]) -> httpx.Response:
        return self.http.post(f"/api/v1/{route}", json=body)

    def search_checkpoints(self, **request: Any) -> CheckpointSearchResponse:
        resp = self.raw("checkpoints/search", request)
        assert resp.status_code == 200, resp.text
        return CheckpointSearchResponse.model_validate(resp.json())

    def search_all(self, **request: Any) -> list[Checkpoint]:
        """Every page, following ``next_cursor``."""
        out, cursor = [], None
        while True:
            page = self.search_checkpoints(**request, cursor=cursor)
            out += page.checkpoints
            if page.next_cursor is None:
                return out
            cursor = page.next_cursor.model_dump(mode="json")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    with local_server(tmp_path_factory, "search-data", "--poll-timeout", "5") as srv:
        yield srv


@pytest.fixture(scope="module")
def saved(server: LocalServer) -> Iterator[dict[str, str]]:
    """A's checkpoints in project ``proj-a`` (two states, one with metadata, sampler weights,
    external weights) and B's one state in ``proj-b``: name -> tinker path."""
    sc_a = tinker.ServiceClient(base_url=server.base_url, api_key=KEY_A, project_id="proj-a")
    sc_b = tinker.ServiceClient(base_url=server.base_url, api_key=KEY_B, project_id="proj-b")
    tc = sc_a.create_lora_training_client(TEST_MODEL, rank=4, seed=0).result()
    paths = {
        "s1": tc.save_state("s1", user_metadata={"stage": "sft", "run": "7"}).result().path,
        "w1": tc.save_weights_for_sampler("w1").result().path,
        "s2": tc.save_state("s2", user_metadata={"stage": "rl"}).result().path,
        "e1": tc.save_weights_external("e1").result().path,
    }
    tb = sc_b.create_lora_training_client(TEST_MODEL, rank=4, seed=0).result()
    paths["b1"] = tb.save_state("b1", user_metadata={"stage": "sft"}).result().path
    yield paths
    sc_a.close("success").result()
    sc_b.close("success").result()


def test_pages_newest_first_through_the_cursor_and_only_the_callers(
    server: LocalServer, saved: dict[str, str]
) -> None:
    a = Client039(server, KEY_A)
    first = a.search_checkpoints(limit=3)
    assert len(first.checkpoints) == 3 and first.next_cursor is not None
    every = a.search_all(limit=1)
    assert [c.tinker_path for c in every] == [saved[n] for n in ("e1", "s2", "w1", "s1")]
    times = [c.time for c in every]
    assert times == sorted(times, reverse=True)
    assert first.next_cursor.last_checkpoint_uuid == every[2].tinker_path
    assert {c.base_model for c in every} == {TEST_MODEL}  # Checkpoint.base_model
    assert {c.checkpoint_type for c in every} == {"training", "sampler", "external"}
    # the 0.38 SDK's listing carries them too (its Checkpoint has user_metadata)
    listed = tinker.RestClient(base_url=server.base_url, api_key=KEY_A).list_user_checkpoints().result()
    by_path = {c.tinker_path: c for c in listed.checkpoints}
    assert by_path[saved["s1"]].user_metadata == {"stage": "sft", "run": "7"}
    assert by_path[saved["w1"]].user_metadata is None
    # B sees B's alone, whatever the owner asked for
    b = Client039(server, KEY_B)
    for owner in ({"type": "own"}, {"type": "accessible"}):
        assert [c.tinker_path for c in b.search_all(owner=owner)] == [saved["b1"]]
    assert b.search_checkpoints(owner={"type": "user", "owner_urns": ["tml:user:x"]}).checkpoints == []


def test_filters_all_hold(server: LocalServer, saved: dict[str, str]) -> None:
    a = Client039(server, KEY_A)

    def paths(**request: Any) -> list[str]:
        return [c.tinker_path for c in a.search_all(**request)]

    assert paths(checkpoint_type="training") == [saved["s2"], saved["s1"]]
    assert paths(checkpoint_type="external") == [saved["e1"]]
    assert paths(user_metadata={"stage": "sft"}) == [saved["s1"]]
    assert paths(user_metadata={"stage": "sft", "run": "8"}) == []
    assert a.search_all(user_metadata={"run": "7"})[0].user_metadata == {"stage": "sft", "run": "7"}
    assert paths(base_models=[TEST_MODEL], checkpoint_type="sampler") == [saved["w1"]]
    assert paths(base_models=[]) == [] and paths(base_models=["someone/else"]) == []
    assert len(paths(project_ids=["proj-a"])) == 4


@pytest.mark.parametrize(
    ("body", "status", "field"),
    [
        ({"limit": 0}, 422, "limit"),
        ({"limit": 201}, 422, "limit"),
        ({"cursor": {"last_created_at": "yesterday", "last_checkpoint_uuid": "x"}}, 422, "last_created_at"),
        ({"cursor": {"last_created_at": "2026-12-07T10:00:00", "last_checkpoint_uuid": "x"}}, 422, "cursor"),
        ({"cursor": {"last_checkpoint_uuid": "x"}}, 422, "last_created_at"),
        ({"project_ids": ["proj-b"]}, 404, "project_ids"),  # B's project: unknown to A
        ({"checkpoint_type": "weights"}, 422, "checkpoint_type"),
        ({"sort": "oldest"}, 422, "sort"),
    ],
)
def test_bad_search_is_a_4xx_naming_the_field(
    server: LocalServer, saved: dict[str, str], body: dict[str, Any], status: int, field: str
) -> None:
    resp = Client039(server, KEY_A).raw("checkpoints/search", body)
    assert resp.status_code == status, resp.text
    assert field in resp.text
    assert "/tmp/" not in resp.text and str(server.data_dir) not in resp.text
