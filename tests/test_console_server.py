"""The server's console routes (``/console/api/…``) against a live server, over HTTP.

Security: every console JSON route refuses a missing or wrong key (401) and answers 404 for
another tenant's session, run or checkpoint, as the API does; an operator key sees every tenant;
every console route only reads (GET), so nothing in the console trains, samples or deletes.
Content: the runs listed are the tenant's; loss and grad-norm history are the steps taken; the
lineage names the checkpoint a run was created from; a checkpoint downloads as a PEFT folder
that ``peft`` loads; the engine counters moved with the work done.
"""

from __future__ import annotations

import io
import json
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
import tinker

from opentinker.server.app import create_app
from opentinker.server.config import ServerConfig
from opentinker.server.local import LocalServer
from tests.console_world import start_world

API = "/console/api"


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalServer, dict[str, Any]]]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TINKER_TELEMETRY", "0")
        for var in ("TINKER_API_KEY", "TINKER_BASE_URL", "TINKER_PROJECT_ID"):
            mp.delenv(var, raising=False)
        srv, w = start_world(tmp_path_factory.mktemp("console-srv"))
        try:
            yield srv, w
        finally:
            srv.stop()


def _get(srv: LocalServer, path: str, key: str | None) -> httpx.Response:
    headers = {"X-API-Key": key} if key is not None else {}
    return httpx.get(srv.base_url + path, headers=headers, timeout=60)


def _ckpt_route(path: str) -> str:
    model_id, kind, name = path.removeprefix("tinker://").split("/")
    return f"{API}/checkpoints/{quote(model_id)}/{kind}/{name}"


def _routes_for(w: dict[str, Any], owner: str) -> dict[str, str]:
    """Every console JSON route, with ``owner``'s ids where it takes one."""
    model, path = w[owner]["model_id"], w[owner]["path"]
    session = model.split(":train:")[0]
    return {
        f"{API}/whoami": "",
        f"{API}/engine": "",
        f"{API}/sessions": "",
        f"{API}/sessions/{{session_id}}/trace": f"{API}/sessions/{quote(session)}/trace",
        f"{API}/models": "",
        f"{API}/models/{{model_id}}": f"{API}/models/{quote(model)}",
        f"{API}/models/{{model_id}}/lineage": f"{API}/models/{quote(model)}/lineage",
        f"{API}/checkpoints": "",
        f"{API}/checkpoints/{{model_id}}/{{kind}}/{{name}}": _ckpt_route(path),
        f"{API}/checkpoints/{{model_id}}/{{kind}}/{{name}}/peft.zip": _ckpt_route(path) + "/peft.zip",
    }


def test_the_table_covers_every_console_route_and_all_only_read(tmp_path: Path) -> None:
    app = create_app(ServerConfig(data_dir=tmp_path))
    console = {r.path: r.methods for r in app.routes if getattr(r, "path", "").startswith(API)}  # type: ignore[attr-defined]
    console.pop(f"{API}/mode")  # says "server" or "runs": no data
    table = _routes_for({"x": {"model_id": "s:train:0", "path": "tinker://s:train:0/weights/n"}}, "x")
    assert set(console) == set(table)
    assert all(methods == {"GET"} for methods in console.values()), console


def test_every_route_refuses_a_missing_or_wrong_key(world: tuple[LocalServer, dict[str, Any]]) -> None:
    srv, w = world
    for template, concrete in _routes_for(w, "alice").items():
        for key in (None, "tml-not-a-key-of-this-server", "garbage"):
            r = _get(srv, concrete or template, key)
            assert r.status_code == 401, (template, key, r.status_code, r.text)


def test_another_tenants_ids_are_unknown(world: tuple[LocalServer, dict[str, Any]]) -> None:
    srv, w = world
    for template, concrete in _routes_for(w, "alice").items():
        if not concrete:
            continue
        mine = _get(srv, concrete, w["keys"]["alice"])
        assert mine.status_code == 200, (template, mine.text)
        theirs = _get(srv, concrete, w["keys"]["bob"])
        assert theirs.status_code == 404, (template, theirs.status_code, theirs.text)
        assert w["alice"]["model_id"] not in theirs.json().get("detail", "") or "unknown" in theirs.text
        assert _get(srv, concrete, w["keys"]["ops"]).status_code == 200, template  # the operator


def test_listings_are_scoped_to_the_tenant_and_the_operator_sees_all(
    world: tuple[LocalServer, dict[str, Any]],
) -> None:
    srv, w = world
    keys = w["keys"]
    alice_models = {m["model_id"] for m in _get(srv, f"{API}/models", keys["alice"]).json()["models"]}
    assert alice_models == {w["alice"]["model_id"], w["alice_child"]["model_id"]}
    bob = _get(srv, f"{API}/models", keys["bob"]).json()["models"]
    assert [m["model_id"] for m in bob] == [w["bob"]["model_id"]]
    every = {m["model_id"] for m in _get(srv, f"{API}/models", keys["ops"]).json()["models"]}
    assert every == alice_models | {w["bob"]["model_id"]}
    for route, field in ((f"{API}/checkpoints", "checkpoints"), (f"{API}/sessions", "sessions")):
        rows = _get(srv, route, keys["bob"]).json()[field]
        assert rows and {r["tenant"] for r in rows} == {"bob"}, route
        assert {r["tenant"] for r in _get(srv, route, keys["ops"]).json()[field]} == {"alice", "bob"}
    assert _get(srv, f"{API}/whoami", keys["ops"]).json() == {"tenant": "ops", "operator": True}
    assert _get(srv, f"{API}/whoami", keys["bob"]).json() == {"tenant": "bob", "operator": False}


def test_history_lineage_and_trace(world: tuple[LocalServer, dict[str, Any]]) -> None:
    srv, w = world
    key = w["keys"]["alice"]
    run = _get(srv, f"{API}/models/{quote(w['alice']['model_id'])}", key).json()
    assert run["steps"] == 3 and run["rank"] == 2 and run["base_model"]
    assert [p[0] for p in run["curves"]["grad_norm"]] == [1.0, 2.0, 3.0]
    assert len(run["curves"]["loss"]) == 3 and all(p[1] > 0 for p in run["curves"]["loss"])
    assert [c["tinker_path"] for c in run["checkpoints"]] == [w["alice"]["path"]]
    lin = _get(srv, f"{API}/models/{quote(w['alice_child']['model_id'])}/lineage", key).json()
    assert [a["tinker_path"] for a in lin["ancestors"]] == [w["alice"]["path"]]
    (saved,) = lin["checkpoints"]
    assert saved["tinker_path"] == w["alice_child"]["path"] and saved["parent"] == w["alice"]["path"]
    assert len(saved["sampler_versions"]) == 1  # its data came from the one snapshot it sampled


def _trace(srv: LocalServer, model_id: str, key: str) -> dict[str, Any]:
    return _get(srv, f"{API}/sessions/{quote(model_id.split(':train:')[0])}/trace", key).json()


def test_the_session_trace_shows_each_request_with_its_wait_and_tick(
    world: tuple[LocalServer, dict[str, Any]],
) -> None:
    srv, w = world
    key = w["keys"]["alice"]
    model = w["alice"]["model_id"]
    reqs = _trace(srv, model, key)["requests"]
    training = [r for r in reqs if r["track"] == model and r["kind"] in ("forward_backward", "optim_step")]
    assert [r["kind"] for r in training] == ["forward_backward", "optim_step"] * 3
    assert all(r["tick"] >= 1 and r["fused_rows"] is not None for r in training)
    assert all(r["fused_rows"] >= 1 for r in training if r["kind"] == "forward_backward")
    assert {r["kind"] for r in reqs} >= {"create_model", "save_weights"}
    for r in reqs:
        assert r["status"] == "done" and r["queue_wait_s"] >= 0 and r["run_s"] >= 0, r
        assert abs(r["queue_wait_s"] + r["run_s"] - r["duration_s"]) < 1e-5, r
        assert r["received"] <= r["started"] <= r["done"]
    # the session that sampled: its sample request, on its sampler's track
    child = _trace(srv, w["alice_child"]["model_id"], key)
    (sample,) = [r for r in child["requests"] if r["kind"] == "sample"]
    assert ":sample:" in sample["track"] and sample["status"] == "done" and sample["tick"] is None
    # pages: offset and limit over the same records
    page = _get(srv, f"{API}/sessions/{quote(model.split(':train:')[0])}/trace?offset=2&limit=3", key).json()
    assert [r["request_id"] for r in page["requests"]] == [r["request_id"] for r in reqs[2:5]]
    assert page["total_count"] == len(reqs)


def test_the_console_trace_and_the_exported_trace_are_the_same_records(
    world: tuple[LocalServer, dict[str, Any]],
) -> None:
    srv, w = world
    key, model = w["keys"]["alice"], w["alice_child"]["model_id"]
    session = model.split(":train:")[0]
    url = tinker.RestClient(base_url=srv.base_url, api_key=key).export_session_trace(session).result()
    events = httpx.get(url, timeout=30).json()["traceEvents"]
    exported = {
        e["args"]["request_id"]: e["args"]
        for e in events
        if e["ph"] == "X" and "request_id" in e.get("args", {})
    }
    shown = {r["request_id"]: r for r in _trace(srv, model, key)["requests"]}
    assert set(shown) == set(exported) and len(shown) >= 5
    for rid, r in shown.items():
        a = exported[rid]
        assert a["status"] == r["status"] and a.get("tick") == r["tick"], (a, r)
        # the same instants: ms rounded to 3 places there, s to 6 here
        assert abs(a["queue_wait_ms"] - r["queue_wait_s"] * 1e3) < 2e-3
        assert abs(a["run_ms"] - r["run_s"] * 1e3) < 2e-3


def test_engine_counters_moved_with_the_work(world: tuple[LocalServer, dict[str, Any]]) -> None:
    srv, w = world
    (eng,) = _get(srv, f"{API}/engine", w["keys"]["ops"]).json()["engines"]
    t = eng["ticks"]
    # the world's work: 5 forward_backward calls of one datum each, 4 of 11 input tokens, 1 of 9
    assert t["fused_requests"] == 5 and t["optim_steps"] == 5 and t["fused_rows"] == 5
    assert t["trained_tokens"] == 4 * 11 + 9
    assert eng["rollout"]["finished"] >= 1 and eng["rollout"]["sampled_tokens"] >= 1
    assert eng["rollout"]["prefill_tokens"] >= 3 and eng["prefix_cache"]["lookups"] >= 1


def test_a_checkpoint_downloads_as_a_peft_folder(world: tuple[LocalServer, dict[str, Any]]) -> None:
    srv, w = world
    r = _get(srv, _ckpt_route(w["bob"]["path"]) + "/peft.zip", w["keys"]["bob"])
    assert r.status_code == 200 and r.headers["content-type"] == "application/zip"
    z = zipfile.ZipFile(io.BytesIO(r.content))
    names = {Path(n).name for n in z.namelist()}
    assert {"adapter_model.safetensors", "adapter_config.json"} <= names
    cfg = json.loads(z.read(next(n for n in z.namelist() if n.endswith("adapter_config.json"))))
    assert cfg["r"] == 2 and cfg["peft_type"] == "LORA"


def test_a_huge_server_is_paginated_and_its_curves_downsampled(tmp_path: Path) -> None:
    """1,000 runs in one session, one of them 100k steps long, a session with more requests than
    its trace keeps: every console answer stays a page or a downsampled curve (sizes and counts,
    not timings). The rows are the store's and the history's own records, as the API writes them."""
    from fastapi.testclient import TestClient

    from opentinker.server.auth import create_key
    from opentinker.server.store import ModelRow
    from opentinker.server.traces import MAX_SPANS

    key = create_key(tmp_path, "big")
    other = create_key(tmp_path, "small")
    app = create_app(ServerConfig(data_dir=tmp_path))
    server = app.state.server
    n_models, n_steps, session = 1000, 100_000, "sess-0123456789ab"
    server.store.add_session(session, "big", {})
    for k in range(n_models):
        server.store.add_model(
            ModelRow(f"{session}:train:{k}", "big", session, "opentinker/tiny", {"rank": 2}, None, k, k, None)
        )
    long_run = f"{session}:train:0"
    for i in range(n_steps):
        server.ops.history.forward(long_run, {"loss:sum": 1.0 + (9.0 if i == 54_321 else 0.0)})
        server.ops.history.optim(long_run, {"grad_norm:mean": 0.5, "learning_rate:mean": 1e-4})
    for i in range(MAX_SPANS + 100):
        server.traces.begin(session, f"r{i}", "forward_backward", long_run, None, i)
    me, them = {"X-API-Key": key}, {"X-API-Key": other}
    with TestClient(app) as c:
        seen: list[str] = []
        offset, pages = 0, 0
        while True:
            page = c.get(f"{API}/models", params={"offset": offset, "limit": 500}, headers=me).json()
            pages += 1
            seen += [m["model_id"] for m in page["models"]]
            assert len(page["models"]) <= 500 and page["total_count"] == n_models
            offset += 500
            if offset >= page["total_count"]:
                break
        assert pages == 2 and len(set(seen)) == n_models
        assert c.get(f"{API}/models", params={"limit": 501}, headers=me).status_code == 422
        assert c.get(f"{API}/models", headers=them).json()["total_count"] == 0
        run = c.get(f"{API}/models/{quote(long_run)}", headers=me)
        body = run.json()
        assert body["steps"] == n_steps
        for name in ("loss", "grad_norm", "learning_rate"):
            assert 2 <= len(body["curves"][name]) <= 500  # the default max_points
        assert max(y for _, y in body["curves"]["loss"]) == 10.0  # the spike survives
        assert len(run.content) < 64_000  # 300k points would be ~6 MB
        more = c.get(f"{API}/models/{quote(long_run)}", params={"max_points": 2000}, headers=me).json()
        assert 500 < len(more["curves"]["loss"]) <= 2000
        assert (
            c.get(f"{API}/models/{quote(long_run)}", params={"max_points": 10**6}, headers=me).status_code
            == 422
        )
        (sess,) = c.get(f"{API}/sessions", headers=me).json()["sessions"]
        assert len(sess["models"]) == 500  # of the session's 1,000
        trace = c.get(f"{API}/sessions/{session}/trace", headers=me).json()
        assert trace["total_count"] == MAX_SPANS and len(trace["requests"]) == 500
        assert trace["requests"][0]["request_id"] == "r100"  # the oldest beyond the bound dropped
        last = c.get(f"{API}/sessions/{session}/trace", params={"offset": MAX_SPANS - 10}, headers=me).json()
        assert [r["request_id"] for r in last["requests"]] == [
            f"r{i}" for i in range(MAX_SPANS + 90, MAX_SPANS + 100)
        ]
        assert all(r["status"] == "running" for r in last["requests"])
