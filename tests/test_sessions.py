"""Sessions and projects over the unmodified SDK: ``get_session``, ``list_sessions``,
``search_sessions``, ``project_id``, ``assign_session_project``, ``copy_weights``; and the models of
a session whose heartbeats stop: saved, evicted, restored by ``create_training_client_from_state``.

Each session id is tenant-scoped (another tenant's is 404, and never in a listing or a search).
Bad input — unknown session ids, bad project ids, malformed searches, bad copies — is refused with
a message naming the problem, no server path, and nothing stored changed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from opentinker.server.local import LocalServer
from tests.conftest import TEST_MODEL, local_server
from tests.tolerances import assert_logprobs_close, assert_scalar_close

KEY_A = "tml-sessions-tenant-a"
KEY_B = "tml-sessions-tenant-b"


# search_sessions is experimental in the SDK 0.38 and says so on every call
pytestmark = pytest.mark.filterwarnings("ignore::tinker.lib.experimental.ExperimentalWarning")


@pytest.fixture(scope="module", autouse=True)
def _env() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TINKER_TELEMETRY", "0")
        for var in ("TINKER_API_KEY", "TINKER_BASE_URL", "TINKER_PROJECT_ID"):
            mp.delenv(var, raising=False)
        yield


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    with local_server(tmp_path_factory, "sess") as srv:
        yield srv


def _http(server: LocalServer, key: str = KEY_A) -> httpx.Client:
    return httpx.Client(base_url=f"{server.base_url}/api/v1", headers={"X-API-Key": key}, timeout=60)


def _rest(server: LocalServer, key: str = KEY_A) -> tinker.RestClient:
    return tinker.RestClient(base_url=server.base_url, api_key=key)


def _session_id(sc: tinker.ServiceClient) -> str:
    """The session the SDK made for ``sc`` (it is the prefix of every model id it gets)."""
    tc = sc.create_lora_training_client(base_model=TEST_MODEL, rank=2, seed=0).result()
    return tc.model_id.split(":train:", 1)[0]


def _datum(seed: int) -> types.Datum:
    toks = [int(t) for t in np.random.default_rng(seed).integers(3, 1000, 17)]
    inputs: dict[str, Any] = {"target_tokens": toks[1:]}  # the SDK turns lists into TensorData
    return types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]), loss_fn_inputs=inputs)


def _no_path(text: str, server: LocalServer) -> None:
    assert str(server.data_dir) not in text and "/tmp/" not in text


def test_get_list_and_search_sessions(server: LocalServer) -> None:
    sc = tinker.ServiceClient(
        base_url=server.base_url,
        api_key=KEY_A,
        project_id="nightly",
        display_name="Nightly RL sweep",
        user_metadata={"lr": "1e-4", "team": "rl"},
    )
    sid = _session_id(sc)
    tc = sc.create_lora_training_client(base_model=TEST_MODEL, rank=2, seed=1).result()
    saved = tc.save_state("step-1").result().path
    sampler = tc.save_weights_and_get_sampling_client()  # an ephemeral sampler of this session
    other = tinker.ServiceClient(base_url=server.base_url, api_key=KEY_A, display_name="eval only")
    other_sid = _session_id(other)
    other.close("errored").result()
    rest = _rest(server)

    got = rest.get_session(sid).result()
    assert got.training_run_ids == [f"{sid}:train:0", tc.model_id]
    assert len(got.sampler_ids) == 1 and got.sampler_ids[0].startswith(f"{sid}:sample:")
    assert got.user_metadata == {"lr": "1e-4", "team": "rl"} and got.display_name == "Nightly RL sweep"
    assert rest.list_sessions(limit=2).result().sessions == [other_sid, sid]  # newest first
    assert rest.list_sessions(limit=1, offset=1).result().sessions == [sid]

    def search(**kw: Any) -> list[types.SessionSummary]:
        return rest.search_sessions(types.SessionSearchRequest(**kw)).result().sessions

    [hit] = search(display_name="rl NIGHTLY")  # every word, any case
    assert (hit.session_id, hit.project_id, hit.owner) == (sid, "nightly", hit.owner)
    assert hit.status == types.SessionActive() and hit.checkpoints_count == 1
    assert hit.checkpoint_storage_bytes and hit.checkpoint_storage_bytes > 0
    assert [s.session_id for s in search(session_id=other_sid, display_name="nightly")] == [other_sid, sid]
    assert [s.session_id for s in search(project_ids=["nightly"])] == [sid]
    assert [s.session_id for s in search(user_metadata={"team": "rl"})] == [sid]
    assert search(user_metadata={"team": "rl", "lr": "0.1"}) == []
    finished = search(statuses=[types.ClientFinishedSessionStatusQuery(reasons=["errored"])])
    assert [s.session_id for s in finished] == [other_sid]
    assert finished[0].status == types.ClientSessionFinished(reason=types.ClientSessionFinishErrored())
    assert [s.session_id for s in search(statuses=[types.ActiveSessionStatusQuery()], display_name="n")] == [
        sid
    ]
    assert search(owner=types.UserSearchOwner(owner_urns=["tml:user:someone-else"])) == []
    assert [s.session_id for s in search(owner=types.UserSearchOwner(owner_urns=[hit.owner]), limit=200)][
        :2
    ] == [
        other_sid,
        sid,
    ]
    # paging: one at a time, by the cursor, newest first, nothing twice
    seen, request = [], types.SessionSearchRequest(limit=1)
    while True:
        page = rest.search_sessions(request).result()
        seen += [s.session_id for s in page.sessions]
        if page.next_cursor is None:
            break
        request = request.model_copy(update={"cursor": page.next_cursor})
    assert seen[:2] == [other_sid, sid] and len(seen) == len(set(seen)) == len(
        rest.list_sessions(limit=1000).result().sessions
    )
    assert saved and sampler is not None
    sc.close("success").result()


def test_sessions_are_tenant_scoped(server: LocalServer) -> None:
    sc = tinker.ServiceClient(base_url=server.base_url, api_key=KEY_A, display_name="private")
    sid = _session_id(sc)
    rest_b = _rest(server, KEY_B)
    with pytest.raises(tinker.NotFoundError, match="unknown session"):
        rest_b.get_session(sid).result()
    with pytest.raises(tinker.NotFoundError, match="unknown session"):
        rest_b.assign_session_project(sid, "stolen").result()
    assert sid not in rest_b.list_sessions(limit=1000).result().sessions
    assert rest_b.search_sessions(types.SessionSearchRequest(session_id=sid)).result().sessions == []
    assert _rest(server).get_session(sid).result().display_name == "private"
    # nor can another tenant copy its weights, into a project or into its own session
    path = (
        sc.create_lora_training_client(base_model=TEST_MODEL, rank=2)
        .result()
        .save_state("mine")
        .result()
        .path
    )
    thief = tinker.ServiceClient(base_url=server.base_url, api_key=KEY_B, project_id="loot")
    with pytest.raises(tinker.NotFoundError, match="unknown checkpoint"):
        thief.copy_weights(path).result()
    with _http(server, KEY_B) as http:
        r = http.post("/copy_weights", json={"source_path": path, "session_id": sid, "model_seq_id": 9})
        assert r.status_code == 404
    assert all(
        s.project_id != "loot" for s in rest_b.search_sessions(types.SessionSearchRequest()).result().sessions
    )
    sc.close("success").result()
    thief.close("success").result()


def test_assign_session_project_moves_it_and_its_runs(server: LocalServer) -> None:
    sc = tinker.ServiceClient(base_url=server.base_url, api_key=KEY_A)
    sid = _session_id(sc)
    rest = _rest(server)
    [before] = rest.search_sessions(types.SessionSearchRequest(session_id=sid)).result().sessions
    assert before.project_id == "default"
    rest.assign_session_project(sid, "archive-2026").result()
    [after] = rest.search_sessions(types.SessionSearchRequest(project_ids=["archive-2026"])).result().sessions
    assert after.session_id == sid
    runs = rest.list_training_runs(project_id="archive-2026").result().training_runs
    assert [r.training_run_id for r in runs] == [f"{sid}:train:0"]
    sc.close("success").result()


def test_copy_weights_into_a_project_shares_storage(server: LocalServer) -> None:
    src = tinker.ServiceClient(base_url=server.base_url, api_key=KEY_A)
    tc = src.create_lora_training_client(base_model=TEST_MODEL, rank=2, seed=3).result()
    tc.forward_backward([_datum(0)], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    path = tc.save_state("step-1").result().path
    sampler_path = tc.save_weights_for_sampler("step-1-s").result().path
    expected = tc.forward([_datum(1)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()

    archive = tinker.ServiceClient(base_url=server.base_url, api_key=KEY_A, project_id="archive")
    copied = archive.copy_weights(path).result()
    copied_sampler = archive.copy_weights(sampler_path, ttl_seconds=7200).result()
    assert copied.endswith("/weights/step-1") and copied_sampler.endswith("/sampler_weights/step-1-s")
    run_id = copied.removeprefix("tinker://").split("/")[0]
    assert run_id != tc.model_id
    rest = _rest(server)
    copy_session = run_id.split(":train:")[0]
    [summary] = rest.search_sessions(types.SessionSearchRequest(session_id=copy_session)).result().sessions
    assert summary.project_id == "archive"
    # the same bytes: the tensor files are hard links of the source's
    ckpts = server.data_dir / "checkpoints"
    a = ckpts / tc.model_id / "weights" / "step-1" / "adapter.safetensors"
    b = ckpts / run_id / "weights" / "step-1" / "adapter.safetensors"
    assert a.exists() and os.path.samefile(a, b)
    # the copy restores the same model; its own run cannot be trained on
    restored = archive.create_training_client_from_state_with_optimizer(copied).result()
    got = restored.forward([_datum(1)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    np.testing.assert_array_equal(got, expected)
    with _http(server) as http:
        r = http.post("/get_info", json={"model_id": run_id})
        assert r.status_code == 404 and "cannot be trained on" in r.json()["detail"]
    sampled = (
        archive.create_sampling_client(model_path=copied_sampler)
        .result()
        .sample(types.ModelInput.from_ints([5, 6, 7]), 1, types.SamplingParams(max_tokens=3, seed=0))
    )
    assert len(sampled.result().sequences[0].tokens) == 3
    # into a live session at a model_seq_id of the caller's choice, once per idempotency key
    sid = _session_id(archive)
    with _http(server) as http:
        body = {"source_path": path, "session_id": sid, "model_seq_id": 7}
        first = http.post("/copy_weights", json=body, headers={"X-Idempotency-Key": "k1"})
        again = http.post("/copy_weights", json=body, headers={"X-Idempotency-Key": "k1"})
        assert first.status_code == again.status_code == 200
        assert first.json() == again.json() == {"tinker_path": f"tinker://{sid}:train:7/weights/step-1"}
    src.close("success").result()
    archive.close("success").result()


def test_bad_session_and_project_input_is_refused_and_changes_nothing(server: LocalServer) -> None:
    sc = tinker.ServiceClient(base_url=server.base_url, api_key=KEY_A, project_id="kept")
    sid = _session_id(sc)
    tc = sc.create_lora_training_client(base_model=TEST_MODEL, rank=2, seed=0).result()
    path = tc.save_state("c").result().path
    rest = _rest(server)
    with _http(server) as http:
        before = (http.get("/sessions", params={"limit": 1000}).json(), http.get("/checkpoints").json())
        bad = [
            http.get("/sessions/sess-doesnotexist"),
            http.put("/sessions/sess-doesnotexist/project", json={"project_id": "p"}),
            http.put(f"/sessions/{sid}/project", json={"project_id": "../etc"}),
            http.put(f"/sessions/{sid}/project", json={"project_id": ""}),
            http.put(f"/sessions/{sid}/project", json={}),
            http.post("/create_session", json={"tags": [], "sdk_version": "0.38", "project_id": "a b"}),
            http.post("/sessions/search", json={"limit": 0}),
            http.post("/sessions/search", json={"statuses": [{"type": "sleeping"}]}),
            http.post("/sessions/search", json={"owner": {"type": "user", "owner_urns": []}}),
            http.post(
                "/sessions/search", json={"cursor": {"last_created_at": "yesterday", "last_session_id": "x"}}
            ),
            http.post("/sessions/search", json={"display_name": ""}),
            http.post("/sessions/search", json={"project_ids": ["never-used"]}),
            http.post("/sessions/search", json={"project_ids": ["bad/id"]}),
            http.post("/sessions/search", json={"no_such_filter": 1}),
            http.post("/copy_weights", json={"source_path": path}),
            http.post("/copy_weights", json={"source_path": path, "destination_project_id": "../x"}),
            http.post(
                "/copy_weights", json={"source_path": path, "destination_project_id": "p", "ttl_seconds": 5}
            ),
            http.post("/copy_weights", json={"source_path": path, "session_id": sid}),
            http.post("/copy_weights", json={"source_path": path, "session_id": sid, "model_seq_id": 0}),
            http.post(
                "/copy_weights",
                json={"source_path": "tinker://nope/weights/x", "destination_project_id": "p"},
            ),
            http.post("/copy_weights", json={"source_path": "not-a-path", "destination_project_id": "p"}),
        ]
        statuses = [r.status_code for r in bad]
        assert statuses == [404, 404, 400, 400, 400, 400] + [422] * 5 + [404, 400, 422] + [400] * 5 + [
            404,
            404,
        ], statuses
        messages = [json.dumps(r.json()["detail"]) for r in bad]
        for needle, msg in zip(
            ["unknown session", "unknown session", "invalid project id", "project_id is missing",
             "project_id is missing", "invalid project id", "limit", "sleeping", "owner_urns",
             "last_created_at", "display_name", "unknown project", "invalid project id", "no_such_filter",
             "destination_project_id", "invalid project id", "ttl_seconds", "both session_id",
             "already exists", "unknown checkpoint", "malformed checkpoint path"],
            messages,
            strict=True,
        ):  # fmt: skip
            assert needle in msg, (needle, msg)
            _no_path(msg, server)
        after = (http.get("/sessions", params={"limit": 1000}).json(), http.get("/checkpoints").json())
    assert after == before
    [me] = rest.search_sessions(types.SessionSearchRequest(session_id=sid)).result().sessions
    assert me.project_id == "kept"
    with pytest.raises(tinker.NotFoundError):
        rest.get_session("sess-000000000000").result()
    sc.close("success").result()


# ---------------------------------------------------------------------------- inactive sessions
INACTIVE_S = 4.0
STEPS_BEFORE, STEPS_AFTER = 2, 3

_CLIENT = (
    textwrap.dedent(
        """
    import json, sys, time
    import numpy as np, tinker
    from tinker import types
    base_url, key, model = sys.argv[1:4]
    def datum(seed):
        toks = [int(t) for t in np.random.default_rng(seed).integers(3, 1000, 17)]
        return types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]),
                           loss_fn_inputs={"target_tokens": toks[1:]})
    def step(tc, i):
        out = tc.forward_backward([datum(i)], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        return out.metrics["loss:sum"]
    sc = tinker.ServiceClient(base_url=base_url, api_key=key)
    quiet = sc.create_lora_training_client(base_model=model, rank=4, seed=0).result()
    reference = sc.create_lora_training_client(base_model=model, rank=4, seed=0).result()
    for i in range(STEPS_BEFORE):
        step(quiet, i)
    ref = [step(reference, i) for i in range(STEPS_BEFORE + STEPS_AFTER)]
    probe = reference.forward([datum(99)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    print(json.dumps({"model_id": quiet.model_id, "losses": ref[STEPS_BEFORE:], "probe": probe}), flush=True)
    time.sleep(3600)  # until killed: a client that crashed, so its heartbeats stop
    """
    )
    .replace("STEPS_BEFORE", str(STEPS_BEFORE))
    .replace("STEPS_AFTER", str(STEPS_AFTER))
)


@pytest.fixture
def quiet_server(tmp_path: Path) -> Iterator[LocalServer]:
    args = [
        "--dev",
        "--base-model",
        TEST_MODEL,
        "--session-inactive-after",
        str(INACTIVE_S),
        "--memory-budget",
        "off",
    ]
    with LocalServer(args, data_dir=tmp_path / "data") as srv:
        yield srv


@pytest.mark.slow  # a second server, a client process, and the wait for the session to go quiet
def test_a_quiet_sessions_models_are_saved_evicted_and_restore_exactly(
    quiet_server: LocalServer, tmp_path: Path
) -> None:
    srv = quiet_server
    script = tmp_path / "client.py"
    script.write_text(_CLIENT)
    proc = subprocess.Popen(
        [sys.executable, str(script), srv.base_url, KEY_A, TEST_MODEL],
        stdout=subprocess.PIPE,
        env={**os.environ, "TINKER_TELEMETRY": "0"},
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, "the client script failed"
        report = json.loads(line)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    model_id = report["model_id"]
    sid = model_id.split(":train:")[0]
    rest = _rest(srv)
    deadline = time.monotonic() + 60
    evicted: list[str] = []
    while not evicted and time.monotonic() < deadline:
        time.sleep(0.5)
        ckpts = rest.list_checkpoints(model_id).result().checkpoints
        evicted = [c.tinker_path for c in ckpts if c.checkpoint_id.startswith("weights/evicted-")]
    assert evicted, "the quiet session's model was not saved and evicted"
    # evicted: its requests name the saved state; the session reads as no longer running
    with _http(srv) as http:
        for _ in range(50):
            r = http.post("/get_info", json={"model_id": model_id})
            if r.status_code == 404:
                break
            time.sleep(0.2)
        assert r.status_code == 404 and evicted[0] in r.json()["detail"]
        assert "create_training_client_from_state" in r.json()["detail"]
    [summary] = rest.search_sessions(types.SessionSearchRequest(session_id=sid)).result().sessions
    assert summary.status is None
    # restored, it trains on exactly as the model that was never evicted
    sc = tinker.ServiceClient(base_url=srv.base_url, api_key=KEY_A)
    tc = sc.create_training_client_from_state_with_optimizer(evicted[0]).result()
    for i, expected in enumerate(report["losses"], start=STEPS_BEFORE):
        out = tc.forward_backward([_datum(i)], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        assert_scalar_close(out.metrics["loss:sum"], expected)
    probe = tc.forward([_datum(99)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    assert_logprobs_close(probe, report["probe"])
    sc.close("success").result()


def _sdk_value(x: Any) -> Any:
    """What the SDK's future holds (over HTTP, ``create_lora_training_client`` answers a future);
    the embedded client answers the value itself."""
    from opentinker.service import TrainingClient

    return x if isinstance(x, TrainingClient) else x.result()


def _session_program(service: Any, rest: Any) -> tuple[str, types.GetSessionResponse, list[str]]:
    """One SDK program: a session with metadata, two models in it; its ``get_session`` and listing."""
    a = _sdk_value(service.create_lora_training_client(base_model=TEST_MODEL, rank=2, seed=0))
    b = _sdk_value(
        service.create_lora_training_client(
            base_model=TEST_MODEL, rank=2, seed=1, user_metadata={"data_parallel": "1", "arm": "b"}
        )
    )
    sid = a.model_id.split(":train:", 1)[0]
    assert b.model_id.split(":train:", 1)[0] == sid
    got = rest.get_session(sid).result()
    assert got.training_run_ids == [a.model_id, b.model_id]
    return sid, got, rest.list_sessions(limit=1000).result().sessions


def test_session_metadata_is_the_same_embedded_and_over_http(server: LocalServer, tmp_path: Path) -> None:
    """``ServiceClient(user_metadata=…, display_name=…, project_id=…)`` makes the same session
    embedded as over HTTP: ``get_session`` shows its metadata and its models, ``list_sessions``
    lists it, another tenant does not see it, and a bad project id is refused in both."""
    import opentinker
    from opentinker.service import Runtime
    from opentinker.service.sessions import UnknownSession

    md = {"team": "parity", "lr": "3e-4"}
    kw: dict[str, Any] = {"user_metadata": md, "display_name": "parity run", "project_id": "par"}
    over_http = tinker.ServiceClient(base_url=server.base_url, api_key=KEY_A, **kw)
    http_sid, http_got, http_listed = _session_program(over_http, _rest(server))
    runtime = Runtime(tmp_path / "data")
    try:
        embedded = opentinker.ServiceClient(runtime=runtime, **kw)
        emb_sid, emb_got, emb_listed = _session_program(embedded, embedded.create_rest_client())
        for sid, got, listed in ((http_sid, http_got, http_listed), (emb_sid, emb_got, emb_listed)):
            assert (got.user_metadata, got.display_name) == (md, "parity run")
            assert sid in listed
        assert runtime.models[emb_got.training_run_ids[1]].user_metadata == {"data_parallel": "1", "arm": "b"}
        other = opentinker.ServiceClient(runtime=runtime, tenant="someone-else").create_rest_client()
        with pytest.raises(UnknownSession, match="unknown session"):
            other.get_session(emb_sid)
        assert emb_sid not in other.list_sessions(limit=1000).result().sessions
        with pytest.raises(ValueError, match="invalid project id"):
            opentinker.ServiceClient(runtime=runtime, project_id="../x")
    finally:
        runtime.shutdown()
    with pytest.raises(tinker.NotFoundError, match="unknown session"):
        _rest(server, KEY_B).get_session(http_sid).result()
    with pytest.raises(
        tinker.BadRequestError, match="invalid project id"
    ):  # the SDK makes its session lazily
        bad = tinker.ServiceClient(base_url=server.base_url, api_key=KEY_A, project_id="../x")
        bad.create_lora_training_client(base_model=TEST_MODEL, rank=2).result()
    over_http.close("success").result()


def _close_program(service: Any, rest: Any, tokens: list[int]) -> tuple[str, list[str]]:
    """One SDK program: a model, a checkpoint, then ``with``'s exit on an error; returns the
    session id and the checkpoint's path."""
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    with pytest.raises(KeyError, match="mid-run"), service:
        tc = _sdk_value(service.create_lora_training_client(base_model=TEST_MODEL, rank=2, seed=0))
        tc.forward_backward([datum], "cross_entropy").result()
        path = tc.save_state("before-close").result().path
        raise KeyError("mid-run")
    with pytest.raises(Exception):  # noqa: B017 - the SDK's client refuses; embedded, the freed model
        tc.forward_backward([datum], "cross_entropy").result()
    with pytest.raises(RuntimeError, match="ServiceClient is closed"):
        _sdk_value(service.create_lora_training_client(base_model=TEST_MODEL, rank=2))
    service.close("success").result()  # a second close changes nothing: the first reason stays
    return tc.model_id, [path]


def test_closing_a_service_client_finishes_its_session_embedded_as_over_http(
    server: LocalServer, tmp_path: Path
) -> None:
    """``with ServiceClient(...)`` leaving on an exception finishes the session as ``errored``,
    frees its models' adapters (later calls on them fail) but keeps their checkpoints, and the
    client makes nothing more; the same embedded as over HTTP. A bad status is refused."""
    import opentinker
    from opentinker.service import Runtime, TrainingClient

    tokens = list(range(5, 17))
    over_http = tinker.ServiceClient(base_url=server.base_url, api_key=KEY_A)
    http_model, http_paths = _close_program(over_http, _rest(server), tokens)
    http_sid = http_model.split(":train:", 1)[0]
    with _http(server) as http:  # the model was freed with its session
        assert http.post("/get_info", json={"model_id": http_model}).status_code == 404
    found = _rest(server).search_sessions(types.SessionSearchRequest(session_id=http_sid)).result()
    [row] = [s for s in found.sessions if s.session_id == http_sid]
    assert row.status == types.ClientSessionFinished(reason=types.ClientSessionFinishErrored())
    runtime = Runtime(tmp_path / "data")
    try:
        embedded = opentinker.ServiceClient(runtime=runtime)
        emb_model, emb_paths = _close_program(embedded, embedded.create_rest_client(), tokens)
        assert runtime.models[emb_model].deleted
        with pytest.raises(Exception, match="is closed \\(its session .* is finished\\)"):
            TrainingClient(runtime, emb_model).get_info()
        rec = runtime.sessions.get(embedded.tenant, embedded.session_id)
        assert rec.finished == "errored"
        assert runtime.sessions.status(rec, 60.0) == {
            "type": "client_finished",
            "reason": {"type": "errored"},
        }
        again = opentinker.ServiceClient(runtime=runtime)  # the runtime goes on; the checkpoint stays
        tc = again.create_training_client_from_state(emb_paths[0])
        assert tc.get_info().model_data.model_name == TEST_MODEL
        with pytest.raises(ValueError, match="status must be one of success, errored, interrupted"):
            again.close("done")
        again.close("success").result()
        assert runtime.sessions.get(again.tenant, again.session_id).finished == "success"
    finally:
        runtime.shutdown()
    assert _rest(server).get_weights_info_by_tinker_path(http_paths[0]).result().base_model == TEST_MODEL
