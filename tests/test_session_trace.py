"""``RestClient.export_session_trace`` over the unmodified SDK: a session's requests as a Chrome
trace-event JSON (what Perfetto opens), behind a signed, tenant-scoped download URL.

The trace is checked against what the SDK itself saw: one slice per request on its model's or
sampler's track, each forward_backward / optim_step slice naming the tick its result reported
(``clock_cycle:unique``) with that tick's fused batch, a ``wait`` and a ``run`` child inside it,
and the tick on its base model's track. Bad input: another tenant's or an unknown session (404),
a changed URL, another tenant's key, an expired URL (403).
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from opentinker.server.local import LocalServer
from opentinker.server.signing import UrlSigner
from tests.conftest import TEST_MODEL

KEY_A = "tml-trace-tenant-a"
KEY_B = "tml-trace-tenant-b"


@pytest.fixture(scope="module", autouse=True)
def _env() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TINKER_TELEMETRY", "0")
        for var in ("TINKER_API_KEY", "TINKER_BASE_URL", "TINKER_PROJECT_ID"):
            mp.delenv(var, raising=False)
        yield


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    with LocalServer(["--dev", "--base-model", TEST_MODEL], data_dir=tmp_path_factory.mktemp("trace")) as srv:
        yield srv


def _datum(seed: int) -> types.Datum:
    toks = [int(t) for t in np.random.default_rng(seed).integers(3, 1000, 17)]
    inputs: dict[str, Any] = {"target_tokens": toks[1:]}  # the SDK turns lists into TensorData
    return types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]), loss_fn_inputs=inputs)


@pytest.fixture(scope="module")
def session(server: LocalServer) -> dict[str, Any]:
    """A session that trained two steps (pipelined) and sampled once; what the SDK saw."""
    sc = tinker.ServiceClient(base_url=server.base_url, api_key=KEY_A)
    tc = sc.create_lora_training_client(base_model=TEST_MODEL, rank=2, seed=0).result()
    ticks: dict[str, list[int]] = {"forward_backward": [], "optim_step": []}
    for step in range(2):
        fb = tc.forward_backward([_datum(step), _datum(step + 10)], "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=1e-3))
        ticks["forward_backward"].append(int(fb.result().metrics["clock_cycle:unique"]))
        ticks["optim_step"].append(int((opt.result().metrics or {})["clock_cycle:unique"]))
    sampler = tc.save_weights_and_get_sampling_client().result()
    sampler.sample(
        types.ModelInput.from_ints([5, 6, 7]), 2, types.SamplingParams(max_tokens=3, seed=1)
    ).result()
    return {
        "sc": sc,
        "session_id": tc.model_id.split(":train:", 1)[0],
        "model_id": tc.model_id,
        "ticks": ticks,
    }


def _download(url: str, key: str | None = None) -> httpx.Response:
    headers = {"X-API-Key": key} if key else {}
    return httpx.get(url, headers=headers, timeout=30)


def test_the_trace_shows_every_request_with_its_tick(server: LocalServer, session: dict[str, Any]) -> None:
    rest = tinker.RestClient(base_url=server.base_url, api_key=KEY_A)
    url = rest.export_session_trace(session["session_id"]).result()
    assert url.startswith(server.base_url)
    with urllib.request.urlopen(url) as resp:  # a plain GET, no API key (as the SDK documents)
        trace = json.loads(resp.read())
    events = trace["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    model_tid = next(t for t, n in names.items() if n == session["model_id"])
    sampler_tids = [t for t, n in names.items() if ":sample:" in n]
    tick_tid = next(t for t, n in names.items() if n.startswith("ticks ("))
    slices = [e for e in events if e["ph"] == "X"]

    def on(tid: int, name: str) -> list[dict[str, Any]]:
        return sorted((e for e in slices if e["tid"] == tid and e["name"] == name), key=lambda e: e["ts"])

    tick_slices = {int(e["name"].split()[1]): e for e in slices if e["tid"] == tick_tid}
    for op in ("forward_backward", "optim_step"):
        spans = on(model_tid, op)
        assert [s["args"]["tick"] for s in spans] == session["ticks"][op]
        for s in spans:
            a = s["args"]
            assert a["status"] == "done"
            assert a["queue_wait_ms"] >= 0 and a["run_ms"] >= 0
            assert abs(a["queue_wait_ms"] + a["run_ms"] - s["dur"] / 1e3) < 0.01
            tick = tick_slices[a["tick"]]  # the tick that ran it, on its base model's track
            assert tick["args"]["fused_requests"] == a["fused_requests"]
            if op == "forward_backward":
                assert a["fused_requests"] >= 1
            else:
                assert tick["args"]["optim_steps"] >= 1
            assert tick["ts"] <= s["ts"] + s["dur"] + 1  # it ran before the result was ready
            for child in ("wait", "run"):  # nested inside the request's slice
                inner = [c for c in on(model_tid, child) if s["ts"] - 1 <= c["ts"] <= s["ts"] + s["dur"] + 1]
                assert inner and inner[0]["ts"] + inner[0]["dur"] <= s["ts"] + s["dur"] + 1
    fb = on(model_tid, "forward_backward")
    assert all(s["args"]["fused_rows"] >= 2 for s in fb)  # our two datums, and any fused with them
    samples = [s for t in sampler_tids for s in on(t, "sample")]
    assert len(samples) == 1 and samples[0]["args"]["status"] == "done"
    assert len(on(model_tid, "save_weights_for_sampler")) == 1
    # up to date: asking again hands out the same file; after new work, a new one
    again = rest.export_session_trace(session["session_id"]).result()
    assert urlsplit(again).path == urlsplit(url).path
    # the deprecated async form (a FutureWarning), after one more request
    session["sc"].create_lora_training_client(base_model=TEST_MODEL, rank=2, seed=1).result()
    with pytest.warns(FutureWarning):
        newer = asyncio.run(rest.export_session_trace_async(session["session_id"]))
    assert urlsplit(newer).path != urlsplit(url).path
    assert any(e["name"] == "create_model" for e in _download(newer).json()["traceEvents"])


def test_trace_urls_are_for_their_tenant_only(server: LocalServer, session: dict[str, Any]) -> None:
    sid = session["session_id"]
    url = tinker.RestClient(base_url=server.base_url, api_key=KEY_A).export_session_trace(sid).result()
    assert _download(url, KEY_A).status_code == 200
    other = _download(url, KEY_B)  # another tenant's key with it
    assert other.status_code == 403 and "another tenant" in other.text
    parts = urlsplit(url)
    query = {k: v[0] for k, v in parse_qs(parts.query).items()}

    def changed(**kw: str) -> str:
        return urlunsplit(parts._replace(query=urlencode({**query, **kw})))

    tampered = _download(changed(sig="0" * 64))
    assert tampered.status_code == 403 and "signature" in tampered.text
    assert _download(changed(tenant=KEY_B)).status_code == 403
    assert _download(changed(expires=str(int(query["expires"]) + 3600))).status_code == 403
    other_file = _download(url.replace("/trace.json?", "/adapter_config.json?"))
    assert other_file.status_code == 403  # the signature binds the file too
    # an expired URL, signed with this server's own secret
    signer = UrlSigner(server.data_dir)
    path = "tinker://" + parts.path.split("/downloads/", 1)[1].rsplit("/", 1)[0]
    old = signer.sign(server.base_url, KEY_A, path, "trace.json", expires=int(time.time()) - 5)
    expired = _download(old)
    assert expired.status_code == 403 and "expired" in expired.text
    assert str(server.data_dir) not in expired.text + tampered.text


def test_another_tenants_or_an_unknown_session_is_404(server: LocalServer, session: dict[str, Any]) -> None:
    for key, sid in ((KEY_B, session["session_id"]), (KEY_A, "sess-000000000000")):
        r = httpx.get(
            f"{server.base_url}/api/v1/sessions/{sid}/trace_export", headers={"X-API-Key": key}, timeout=30
        )
        assert r.status_code == 404 and "unknown session" in r.text, r.text
    rest_b = tinker.RestClient(base_url=server.base_url, api_key=KEY_B)
    with pytest.raises(tinker.NotFoundError):
        rest_b.export_session_trace(session["session_id"]).result()
