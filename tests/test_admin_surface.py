"""The SDK's admin reads, console URLs and client plumbing, through the UNMODIFIED ``tinker`` SDK.

``AdminClient`` (and ``RestClient``'s deprecated copies of its methods): the audit log must list
what this tenant did, in order, and nothing of another tenant's; billing usage must equal the
tokens the test itself trained and sampled (counted here from its own requests and responses);
current storage must equal the bytes of the tenant's checkpoint folders, summed here from disk.
``get_console_url()`` must name a page this server serves. ``SamplingClient.create``,
sampler handles, ``holder``, ``get_telemetry`` and ``on_queue_state_change`` are driven for real.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
import warnings
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinker
from tinker import types
from tinker.lib.api_future_impl import QueueState
from tinker.lib.public_interfaces.api_future import APIFuture

from opentinker.server.console import local_console_url
from opentinker.server.local import LocalServer
from tests.conftest import TEST_MODEL, local_server

KEY = "tml-admin-surface-tenant-a"
OTHER = "tml-admin-surface-tenant-b"
PROJECT = "proj-alpha"
PROMPT = [5, 17, 3, 99, 42, 7]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    with local_server(tmp_path_factory, "admin-data", "--poll-timeout", "5") as srv:
        yield srv


def _datum(toks: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(toks[:-1]), loss_fn_inputs={"target_tokens": toks[1:]}
    )


@pytest.fixture(scope="module")
def work(server: LocalServer) -> Iterator[dict[str, Any]]:
    """Tenant A's history: one run trained, saved twice, one save deleted, sampled; counted here."""
    started = time.time()
    service = tinker.ServiceClient(base_url=server.base_url, api_key=KEY, project_id=PROJECT)
    tc = service.create_lora_training_client(base_model=TEST_MODEL, rank=2, seed=0).result()
    batches = [[list(range(3, 3 + n)) for n in (9, 14)], [list(range(40, 60))]]
    trained = 0
    for batch in batches:
        tc.forward_backward([_datum(t) for t in batch], "cross_entropy").result()
        trained += sum(len(t) - 1 for t in batch)
    tc.forward([_datum(batches[1][0])], "cross_entropy").result()
    trained += len(batches[1][0]) - 1
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    kept = tc.save_state("kept").result().path
    doomed = tc.save_weights_for_sampler("doomed").result().path
    rest = tinker.RestClient(base_url=server.base_url, api_key=KEY)
    rest.delete_checkpoint_from_tinker_path(doomed).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=5, seed=3, temperature=1.0)
    res = sampler.sample(types.ModelInput.from_ints(PROMPT), 3, params).result()
    generated = sum(len(s.tokens) for s in res.sequences)
    yield {
        "service": service,
        "trainer": tc,
        "sampler": sampler,
        "rest": rest,
        "kept": kept,
        "doomed": doomed,
        "trained": trained,
        "prefill": len(PROMPT),
        "generated": generated,
        "started": started,
    }
    service.close("success").result()


def _admin(server: LocalServer, key: str = KEY) -> tinker.AdminClient:
    return tinker.AdminClient(base_url=server.base_url, api_key=key)


def _http(server: LocalServer, key: str = KEY) -> httpx.Client:
    return httpx.Client(base_url=server.base_url, headers={"X-API-Key": key}, timeout=60)


def _hour(t: datetime) -> datetime:
    return t.replace(minute=0, second=0, microsecond=0)


def _window() -> tuple[str, str]:
    now = _hour(datetime.now(UTC))
    return (now - timedelta(hours=2)).isoformat(), (now + timedelta(hours=1)).isoformat()


# ---------------------------------------------------------------------------- audit log
def test_audit_log_lists_the_tenants_actions_in_order(server: LocalServer, work: dict[str, Any]) -> None:
    entries = _admin(server).get_audit_log().result().entries
    events = [e.event for e in entries]
    tc: tinker.TrainingClient = work["trainer"]
    assert events[:2] == ["session_create", "training_run_create"], events
    assert [e.timestamp for e in entries] == sorted(e.timestamp for e in entries)
    by_path = {e.event_details.get("tinker_path"): e for e in entries if e.event == "checkpoint_create"}
    assert set(by_path) == {work["kept"], work["doomed"]}
    kept = by_path[work["kept"]]
    assert kept.tinker_path == work["kept"] and kept.model_id == tc.model_id
    assert kept.event_details["actor"].startswith("dev-")
    assert int(kept.event_details["size_bytes"]) > 0  # type: ignore[call-overload]
    deleted = [e for e in entries if e.event == "checkpoint_delete"]
    assert [e.tinker_path for e in deleted] == [work["doomed"]]
    assert events.index("checkpoint_delete") > events.index("checkpoint_create")
    assert "sampler_create" in events  # the ephemeral sampler of save_weights_and_get_sampling_client
    run = next(e for e in entries if e.event == "training_run_create")
    assert run.event_details["model_id"] == tc.model_id
    assert run.event_details["base_model"] == TEST_MODEL


def test_audit_log_filters_by_event_type_and_day(server: LocalServer, work: dict[str, Any]) -> None:
    admin = _admin(server)
    only = admin.get_audit_log("checkpoints").result().entries
    assert only and all(e.event.startswith("checkpoint_") for e in only)
    assert admin.get_audit_log("projects").result().entries == []
    yesterday = datetime.now(UTC).date() - timedelta(days=1)
    assert admin.get_audit_log(day=yesterday).result().entries == []
    with pytest.warns(FutureWarning):  # RestClient's deprecated copy reads the same log
        same = work["rest"].get_audit_log("checkpoints", datetime.now(UTC).date()).result().entries
    assert [e.tinker_path for e in same] == [e.tinker_path for e in only]


def test_audit_log_of_another_tenant_shows_nothing_of_this_one(
    server: LocalServer, work: dict[str, Any]
) -> None:
    entries = _admin(server, OTHER).get_audit_log().result().entries
    assert all(e.tinker_path is None or work["trainer"].model_id not in e.tinker_path for e in entries)
    assert not [e for e in entries if e.event.startswith(("checkpoint_", "training_run_"))]


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ({"event_type": "everything"}, "unknown event_type 'everything'"),
        ({"day": "2026-13-45"}, "day must be a date as YYYY-MM-DD"),
    ],
)
def test_audit_log_refuses_bad_queries(server: LocalServer, query: dict[str, str], message: str) -> None:
    with _http(server) as http:
        r = http.get("/api/v1/audit", params=query)
    assert r.status_code == 400 and message in r.json()["detail"], r.text


# ---------------------------------------------------------------------------- billing usage
def _usage(server: LocalServer, key: str = KEY) -> types.BillingUsageResponse:
    return _admin(server, key).get_billing_usage(*_window()).result()


def test_billing_usage_counts_the_tokens_trained_and_sampled(
    server: LocalServer, work: dict[str, Any]
) -> None:
    usage = _usage(server)
    totals: dict[str, float] = {}
    for e in usage.data:
        info = e.event_info
        amount = getattr(info, "token_count", None) or getattr(info, "count", None) or 0
        totals[info.type] = totals.get(info.type, 0) + amount
        if info.type != "storage":
            assert e.session_id == work["service"].holder.get_session_id()
            assert e.project_id == PROJECT and e.base_model == TEST_MODEL
        assert e.estimated_cost_usd is None
    assert totals["training"] == work["trained"]
    assert totals["sampling_prefill"] == work["prefill"]
    assert totals["sampling_sample"] == work["generated"]
    assert totals["checkpoint"] == 2  # both saves, the deleted one included
    storage = [e.event_info for e in usage.data if isinstance(e.event_info, types.StorageBillingEvent)]
    assert storage and all(s.gigabyte_hours > 0 for s in storage)
    # GB-hours: at least the kept checkpoint from its save until the query began, at most both
    # checkpoints over the whole time since the work started
    asked = time.time()
    usage = _usage(server)
    answered = time.time()
    gb_hours = sum(
        e.event_info.gigabyte_hours for e in usage.data if isinstance(e.event_info, types.StorageBillingEvent)
    )
    kept = next(
        c for c in work["rest"].list_user_checkpoints().result().checkpoints if c.tinker_path == work["kept"]
    )
    log = _admin(server).get_audit_log("checkpoints").result().entries
    sizes = {e.tinker_path: int(e.event_details["size_bytes"]) for e in log if e.event == "checkpoint_create"}  # type: ignore[call-overload]
    low = kept.size_bytes * (asked - kept.time.timestamp()) / 3600 / 1e9
    high = sum(sizes.values()) * (answered - work["started"]) / 3600 / 1e9
    assert low * 0.999 <= gb_hours <= high * 1.001, (low, gb_hours, high)
    assert list(usage.sessions) == [work["service"].holder.get_session_id()]
    with pytest.warns(FutureWarning):
        deprecated = work["rest"].get_billing_usage(*_window()).result()
    assert sum(getattr(e.event_info, "token_count", 0) for e in deprecated.data) == sum(
        getattr(e.event_info, "token_count", 0) for e in usage.data
    )


def test_billing_usage_is_per_tenant(server: LocalServer, work: dict[str, Any]) -> None:
    assert _usage(server, OTHER).data == []


def test_billing_usage_refuses_bad_windows(server: LocalServer) -> None:
    now = _hour(datetime.now(UTC))
    bad = [
        ((now + timedelta(minutes=30)).isoformat(), now.isoformat(), "aligned to a UTC hour"),
        ((now + timedelta(hours=2)).isoformat(), (now + timedelta(hours=3)).isoformat(), "in the future"),
        (now.isoformat(), (now - timedelta(hours=1)).isoformat(), "must be after starting_on"),
        ((now - timedelta(days=15)).isoformat(), now.isoformat(), "longer than 14 days"),
        ("yesterday", now.isoformat(), "must be an RFC 3339 time"),
        (now.replace(tzinfo=None).isoformat(), now.isoformat(), "must carry a UTC offset"),
    ]
    with _http(server) as http:
        for start, end, message in bad:
            r = http.get("/api/v1/billing/usage/events", params={"starting_on": start, "ending_before": end})
            assert r.status_code == 400 and message in r.json()["detail"], (start, end, r.text)
    with pytest.raises(tinker.BadRequestError, match="longer than 14 days"):
        _admin(server).get_billing_usage((now - timedelta(days=20)).isoformat(), now.isoformat()).result()


# ---------------------------------------------------------------------------- storage usage
def _bytes_on_disk(server: LocalServer, model_id: str) -> tuple[int, int]:
    root = Path(server.data_dir) / "checkpoints" / model_id
    folders = [d for kind in ("weights", "sampler_weights") for d in (root / kind).glob("*") if d.is_dir()]
    return len(folders), sum(f.stat().st_size for d in folders for f in d.iterdir() if f.is_file())


def test_storage_usage_is_the_bytes_of_the_tenants_checkpoints_on_disk(
    server: LocalServer, work: dict[str, Any]
) -> None:
    count, size = _bytes_on_disk(server, work["trainer"].model_id)
    assert count == 1 and size > 0  # the kept save; the deleted one is gone from disk
    usage = _admin(server).get_current_checkpoint_storage_usage().result()
    assert [(d.project_id, d.checkpoint_count, d.size_bytes) for d in usage.data] == [(PROJECT, count, size)]
    assert usage.data[0].size_gigabytes == pytest.approx(size / 1e9)
    assert _admin(server).get_current_checkpoint_storage_usage(PROJECT).result().data[0].size_bytes == size
    assert _admin(server).get_current_checkpoint_storage_usage("proj-other").result().data == []
    assert _admin(server, OTHER).get_current_checkpoint_storage_usage().result().data == []
    with pytest.warns(FutureWarning):
        assert work["rest"].get_current_checkpoint_storage_usage().result().data[0].size_bytes == size
    with _http(server) as http:
        r = http.get("/api/v1/billing/usage/checkpoints/current", params={"project_id": "../etc"})
    assert r.status_code == 400 and "invalid project id '../etc'" in r.json()["detail"]


# ---------------------------------------------------------------------------- console pages
def test_console_urls_name_pages_this_server_serves(server: LocalServer, work: dict[str, Any]) -> None:
    service: tinker.ServiceClient = work["service"]
    tc: tinker.TrainingClient = work["trainer"]
    session_id = service.holder.get_session_id()
    for sdk_url, subject, fact in [
        (service.get_console_url(), session_id, "<th>owner</th>"),
        (tc.get_console_url(), tc.model_id, "<th>base_model</th>"),
    ]:
        assert subject in sdk_url
        url = local_console_url(sdk_url, server.base_url)
        assert url.startswith(server.base_url)
        anonymous = httpx.get(url, timeout=30)
        assert anonymous.status_code == 200 and subject in anonymous.text and fact not in anonymous.text
        owner = httpx.get(url, headers={"X-API-Key": KEY}, timeout=30)
        assert subject in owner.text and fact in owner.text
        stranger = httpx.get(url, headers={"X-API-Key": OTHER}, timeout=30)
        assert fact not in stranger.text  # another tenant's id is not confirmed to exist
    hostile = httpx.get(f"{server.base_url}/sessions/%3Cscript%3Ex", timeout=30)
    assert "<script>" not in hostile.text and "&lt;script&gt;x" in hostile.text
    with pytest.raises(ValueError, match="not a console URL"):
        local_console_url("https://example.com/elsewhere", server.base_url)


# ---------------------------------------------------------------------------- client plumbing
def test_sampling_client_create_and_sampler_handles(server: LocalServer, work: dict[str, Any]) -> None:
    service: tinker.ServiceClient = work["service"]
    holder = service.holder
    assert holder.get_session_id() is not None
    made = tinker.SamplingClient.create(holder, base_model=TEST_MODEL).result()
    assert made.get_base_model() == TEST_MODEL
    params = types.SamplingParams(max_tokens=6, seed=11, temperature=1.0)
    prompt = types.ModelInput.from_ints(PROMPT)
    want = [s.tokens for s in made.sample(prompt, 2, params).result().sequences]
    handle = made.get_sampler_handle()
    assert KEY not in base64.urlsafe_b64decode(handle).decode()  # the handle carries no credentials
    again = tinker.SamplingClient.from_sampler_handle(handle, api_key=KEY)
    assert again.get_base_model() == TEST_MODEL
    assert [s.tokens for s in again.sample(prompt, 2, params).result().sequences] == want
    # the same sampler, so the trained policy's sampler gives other tokens than the base model
    trained: tinker.SamplingClient = work["sampler"]
    twin = tinker.SamplingClient.from_sampler_handle(trained.get_sampler_handle(), api_key=KEY)
    lp = trained.compute_logprobs(prompt).result()
    assert twin.compute_logprobs(prompt).result() == lp
    assert made.compute_logprobs(prompt).result() != lp


def test_queue_state_changes_are_reported_once_a_minute(
    work: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    sampler: tinker.SamplingClient = work["sampler"]
    with caplog.at_level(logging.WARNING, logger="tinker"):
        sampler.on_queue_state_change(QueueState.ACTIVE, None)
        assert not caplog.records
        sampler.on_queue_state_change(QueueState.PAUSED_RATE_LIMIT, None)
        sampler.on_queue_state_change(QueueState.PAUSED_CAPACITY, "again within the minute")
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and "concurrent sampler weights limit hit" in messages[0], messages


def test_telemetry_follows_the_environment(
    server: LocalServer, work: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    for client in (work["service"], work["trainer"], work["sampler"], work["rest"]):
        assert client.get_telemetry() is None  # TINKER_TELEMETRY=0
    monkeypatch.setenv("TINKER_TELEMETRY", "1")
    service = tinker.ServiceClient(base_url=server.base_url, api_key=KEY)
    try:
        tc = service.create_lora_training_client(base_model=TEST_MODEL, rank=2, seed=1).result()
        assert tc.get_telemetry() is not None and service.get_telemetry() is not None
    finally:
        service.close("success").result()


def test_server_capabilities_describe_every_served_model(server: LocalServer, work: dict[str, Any]) -> None:
    caps = work["rest"].get_server_capabilities().result()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        assert work["service"].get_server_capabilities() == caps
    (model,) = caps.supported_models
    info = work["trainer"].get_info()
    assert model.model_name == TEST_MODEL == info.model_data.model_name
    assert model.trainable and model.sampleable
    assert model.max_context_length is not None and model.max_context_length > len(PROMPT)


# ---------------------------------------------------------------------------- the async twins
THIRD = "tml-admin-surface-tenant-c"  # its own tenant: tenant A's counted usage stays exact


async def _done(value: Any) -> Any:
    """The deprecated ``*_async`` methods return a value, or an APIFuture to await as well."""
    value = await value
    return await value if isinstance(value, APIFuture) else value


def _counted(usage: types.BillingUsageResponse) -> list[Any]:
    """The token and checkpoint events (storage GB-hours grow with every second)."""
    return [e for e in usage.data if not isinstance(e.event_info, types.StorageBillingEvent)]


def _logprobs(out: types.ForwardBackwardOutput) -> list[float]:
    return out.loss_fn_outputs[0]["logprobs"].tolist()


def test_async_twins_give_what_their_sync_methods_give(server: LocalServer) -> None:
    import torch

    data = [_datum(list(range(3, 17)))]
    adam = types.AdamParams(learning_rate=1e-2)

    def neg_ll(_: list[types.Datum], lps: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        loss = -sum(lp.sum() for lp in lps)
        return loss, {}

    service = tinker.ServiceClient(base_url=server.base_url, api_key=THIRD)
    rest = tinker.RestClient(base_url=server.base_url, api_key=THIRD)
    admin = _admin(server, THIRD)

    async def main() -> None:
        a = await service.create_lora_training_client_async(base_model=TEST_MODEL, rank=2, seed=5)
        b = await service.create_lora_training_client(base_model=TEST_MODEL, rank=2, seed=5)
        assert _logprobs(await _done(a.forward_async(data, "cross_entropy"))) == _logprobs(
            await b.forward(data, "cross_entropy")
        )
        fa = await _done(a.forward_backward_async(data, "cross_entropy"))
        fb = await b.forward_backward(data, "cross_entropy")
        assert fa.metrics["loss:sum"] == pytest.approx(fb.metrics["loss:sum"], rel=1e-5)
        await _done(a.optim_step_async(adam))
        await b.optim_step(adam)
        custom = await _done(a.forward_backward_custom_async(data, neg_ll))
        plain = await b.forward_backward(data, "cross_entropy")
        assert custom.metrics["loss:sum"] == pytest.approx(plain.metrics["loss:sum"], rel=1e-5)
        for tc in (a, b):  # clear the accumulated gradients
            await tc.optim_step(types.AdamParams(learning_rate=0.0))
        assert (await a.get_info_async()).model_data == b.get_info().model_data
        state = (await _done(a.save_state_async("twin"))).path
        weights = (await _done(a.save_weights_for_sampler_async("twin"))).path
        want = _logprobs(await a.forward(data, "cross_entropy"))
        for load in (
            b.load_state_async(state),
            b.load_state_with_optimizer_async(state),
            b.load_state_with_optimizer(state),
        ):
            await _done(load) if asyncio.iscoroutine(load) else await load
            assert _logprobs(await b.forward(data, "cross_entropy")) == pytest.approx(want, abs=1e-5)
        for made in (
            await service.create_training_client_from_state_async(state),
            await service.create_training_client_from_state_with_optimizer_async(state),
        ):
            assert _logprobs(await made.forward(data, "cross_entropy")) == pytest.approx(want, abs=1e-5)
        prompt = types.ModelInput.from_ints(PROMPT)
        s1 = await service.create_sampling_client_async(model_path=weights)
        s2 = await a.create_sampling_client_async(weights)
        lp = await s1.compute_logprobs(prompt)
        assert await s1.compute_logprobs_async(prompt) == lp == await s2.compute_logprobs_async(prompt)
        assert await s2.get_base_model_async() == TEST_MODEL
        assert await service.get_server_capabilities_async() == (await rest.get_server_capabilities())

        # the REST reads
        run = await rest.get_training_run(a.model_id)
        assert await rest.get_training_run_async(a.model_id) == run
        assert (await rest.get_training_run_by_tinker_path(state)) == run
        assert await rest.get_training_run_by_tinker_path_async(state) == run
        listed = await rest.list_checkpoints(a.model_id)
        assert await rest.list_checkpoints_async(a.model_id) == listed
        assert {c.tinker_path for c in listed.checkpoints} == {state, weights}
        assert await rest.list_training_runs_async() == (await rest.list_training_runs())
        assert await rest.list_user_checkpoints_async() == (await rest.list_user_checkpoints())
        sampler_id = json.loads(base64.urlsafe_b64decode(s1.get_sampler_handle()))["sampling_session_id"]
        got = await rest.get_sampler(sampler_id)
        assert got.base_model == TEST_MODEL and got.model_path == weights
        assert await rest.get_sampler_async(sampler_id) == got

        # sessions and projects
        session_id = service.holder.get_session_id()
        assert await rest.get_session_async(session_id) == await rest.get_session(session_id)
        assert await rest.list_sessions_async() == await rest.list_sessions()
        await rest.assign_session_project_async(session_id, "proj-twin")
        copied = await rest.copy_weights_async(state, "proj-twin")
        assert copied != state and copied.startswith("tinker://")
        twin = await service.create_training_client_from_state_async(copied)
        assert _logprobs(await twin.forward(data, "cross_entropy")) == pytest.approx(want, abs=1e-5)

        # three more saves, deleted three ways
        paths = [(await a.save_state(f"gone-{i}")).path for i in range(3)]
        await rest.delete_checkpoint(a.model_id, "weights/gone-0")
        await rest.delete_checkpoint_async(a.model_id, "weights/gone-1")
        await rest.delete_checkpoint_from_tinker_path_async(paths[2])
        left = {c.tinker_path for c in (await rest.list_checkpoints(a.model_id)).checkpoints}
        assert left == {state, weights}

        # the admin reads, through both clients
        log = await admin.get_audit_log()
        assert await admin.get_audit_log_async() == log
        assert [e.tinker_path for e in log.entries if e.event == "checkpoint_delete"] == paths
        window = _window()
        usage = await admin.get_billing_usage(*window)
        assert _counted(await admin.get_billing_usage_async(*window)) == _counted(usage)
        storage = await admin.get_current_checkpoint_storage_usage()
        assert await admin.get_current_checkpoint_storage_usage_async() == storage
        # the state, the sampler weights and the copy, its files hard links of the state's: counted once
        assert [(d.project_id, d.checkpoint_count) for d in storage.data] == [("proj-twin", 3)]
        mine = [c.tinker_path for c in (await rest.list_user_checkpoints()).checkpoints]
        files = [
            f
            for path in mine
            for f in (Path(server.data_dir) / "checkpoints" / path.removeprefix("tinker://")).iterdir()
        ]
        unique = {(f.stat().st_dev, f.stat().st_ino): f.stat().st_size for f in files}
        assert len(mine) == 3 and len(unique) < len(files)  # the copy's tensors are shared
        assert storage.data[0].size_bytes == sum(unique.values())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            assert await rest.get_audit_log_async() == log
            assert _counted(await rest.get_billing_usage_async(*window)) == _counted(usage)
            assert await rest.get_current_checkpoint_storage_usage_async() == storage

        # external weights, publishing and TTLs, through the async twins
        ext = (await _done(a.save_weights_external_async("twin-ext"))).path
        assert ext == f"tinker://{a.model_id}/external_weights/twin-ext"
        urls = await rest.get_external_weights_urls_async(ext)
        assert {"adapter_model.safetensors", "adapter_config.json"} <= set(urls.urls)
        assert set((await rest.get_external_weights_urls(ext)).urls) == set(urls.urls)

        def meta(path: str) -> Any:
            return next(c for c in rest.list_user_checkpoints().result().checkpoints if c.tinker_path == path)

        await rest.publish_checkpoint_from_tinker_path_async(state)
        assert meta(state).public
        await rest.unpublish_checkpoint_from_tinker_path_async(state)
        assert not meta(state).public
        await rest.set_checkpoint_ttl_from_tinker_path_async(state, 7200)
        assert meta(state).expires_at is not None

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        try:
            asyncio.run(main())
        finally:
            service.close("success").result()
