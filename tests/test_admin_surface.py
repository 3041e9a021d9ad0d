"""The SDK's admin reads, console URLs and client plumbing, through the UNMODIFIED ``tinker`` SDK.

``AdminClient`` (and ``RestClient``'s deprecated copies of its methods): the audit log must list
what this tenant did, in order, and nothing of another tenant's; billing usage must equal the
tokens the test itself trained and sampled (counted here from its own requests and responses);
current storage must equal the bytes of the tenant's checkpoint folders, summed here from disk.
``get_console_url()`` must name a page this server serves. ``SamplingClient.create``,
sampler handles, ``holder``, ``get_telemetry`` and ``on_queue_state_change`` are driven for real.
Every ``*_async`` member of the SDK's clients has its own test (``test_an_async_twin_...[member]``,
the member list read from the SDK): the twin and its sync method, side by side, give the same
result or make the same change, and that result is checked for what it must say.
"""

from __future__ import annotations

import asyncio
import base64
import inspect
import json
import logging
import time
import warnings
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import safetensors.torch
import tinker
import torch
from tinker import types
from tinker.lib.api_future_impl import QueueState
from tinker.lib.client_connection_pool_type import ClientConnectionPoolType
from tinker.lib.public_interfaces.api_future import APIFuture
from transformers import AutoTokenizer

from opentinker.models.registry import resolve_model_path
from opentinker.server.console import local_console_url
from opentinker.server.local import LocalServer
from tests import route_coverage
from tests.conftest import TEST_MODEL, local_server
from tests.tolerances import assert_logprobs_close, assert_scalar_close

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
    for client in (work["service"], work["trainer"], work["sampler"], work["rest"], _admin(server)):
        assert client.get_telemetry() is None  # TINKER_TELEMETRY=0
    monkeypatch.setenv("TINKER_TELEMETRY", "1")
    service = tinker.ServiceClient(base_url=server.base_url, api_key=KEY)
    try:
        tc = service.create_lora_training_client(base_model=TEST_MODEL, rank=2, seed=1).result()
        assert tc.get_telemetry() is not None and service.get_telemetry() is not None
        # a REST-only client shares its holder with every one of the same URL and key: a new key
        assert _admin(server, "tml-admin-surface-telemetry").get_telemetry() is not None
    finally:
        service.close("success").result()


def test_create_rest_client_reads_what_a_rest_client_reads(server: LocalServer, work: dict[str, Any]) -> None:
    service: tinker.ServiceClient = work["service"]
    with pytest.warns(FutureWarning, match="create_rest_client"):  # deprecated: construct RestClient
        made = service.create_rest_client()
    runs = made.list_training_runs().result().training_runs
    assert work["trainer"].model_id in [r.training_run_id for r in runs]
    assert (
        made.list_checkpoints(work["trainer"].model_id).result()
        == work["rest"].list_checkpoints(work["trainer"].model_id).result()
    )
    assert made.get_session(service.holder.get_session_id()).result().training_run_ids == [
        work["trainer"].model_id
    ]


def test_the_sdks_health_check_reads_ok(server: LocalServer, work: dict[str, Any]) -> None:
    """No public SDK method calls ``/healthz``: the SDK's own service resource does, on a
    connection of the client's holder."""
    holder = work["service"].holder

    async def health() -> types.HealthResponse:
        with holder.aclient(ClientConnectionPoolType.SESSION) as client:
            return await client.service.health_check()

    answer = holder.run_coroutine_threadsafe(health()).result(timeout=60)
    assert isinstance(answer, types.HealthResponse) and answer.status == "ok"


def test_a_sampling_client_gets_the_tokenizer_of_a_base_model_served_from_a_folder(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """``SamplingClient.get_tokenizer`` loads transformers' tokenizer by the base model's *name*
    (``TrainingClient``'s uses the ``tokenizer_id`` the server sends). A built-in name such as
    ``opentinker/tiny`` is no Hugging Face id a client can load offline; a base model served from a
    local folder is named by that folder, which the client's transformers reads."""
    folder = resolve_model_path(TEST_MODEL)
    text = "The quick brown fox jumps over the lazy dog"
    want = AutoTokenizer.from_pretrained(folder).encode(text)
    with local_server(tmp_path_factory, "folder-data", base_model=folder) as srv:
        service = tinker.ServiceClient(base_url=srv.base_url, api_key=KEY)
        try:
            tc = service.create_lora_training_client(base_model=folder, rank=2, seed=0).result()
            sampler = tc.save_weights_and_get_sampling_client().result()
            assert sampler.get_base_model() == folder
            tokenizer = sampler.get_tokenizer()
            assert tokenizer.encode(text) == want == tc.get_tokenizer().encode(text)
            params = types.SamplingParams(max_tokens=6, seed=0, stop=[])
            (seq,) = sampler.sample(types.ModelInput.from_ints(want), 1, params).result().sequences
            assert len(seq.tokens) == 6 and isinstance(tokenizer.decode(seq.tokens), str)
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
# Every ``*_async`` member of the SDK's clients, one test each: the twin and its sync method are
# called side by side over HTTP and must give the same result (or make the same change), which
# must also be what this server should give. Tenant C's own: tenant A's counted usage stays exact.
THIRD = "tml-admin-surface-tenant-c"
TWIN_ADAM = types.AdamParams(learning_rate=1e-2)
TWIN_TOKENS = list(range(3, 17))
TWIN_DATA = [_datum(TWIN_TOKENS)]


@dataclass
class Twins:
    server: LocalServer
    service: tinker.ServiceClient
    rest: tinker.RestClient
    admin: tinker.AdminClient
    trained: tinker.TrainingClient  # one step from seed 5; no case changes its weights
    state: str  # its save_state
    weights: str  # its save_weights_for_sampler
    sampler: tinker.SamplingClient  # on ``weights``
    base_logprobs: list[float]  # the base model's, on PROMPT (from its second token)

    def client(self, cls: str) -> Any:
        return {
            "ServiceClient": self.service,
            "TrainingClient": self.trained,
            "SamplingClient": self.sampler,
            "RestClient": self.rest,
            "AdminClient": self.admin,
        }[cls]

    def fresh(self, seed: int = 5) -> tinker.TrainingClient:
        return self.service.create_lora_training_client(base_model=TEST_MODEL, rank=2, seed=seed).result()

    def saved(self, name: str) -> str:
        return self.trained.save_state(name).result().path

    def checkpoint(self, path: str) -> types.Checkpoint:
        listed = self.rest.list_user_checkpoints().result().checkpoints
        return next(c for c in listed if c.tinker_path == path)

    def paths(self) -> set[str]:
        return {c.tinker_path for c in self.rest.list_checkpoints(self.trained.model_id).result().checkpoints}


@pytest.fixture(scope="module")
def twins(server: LocalServer) -> Iterator[Twins]:
    service = tinker.ServiceClient(base_url=server.base_url, api_key=THIRD)
    trained = service.create_lora_training_client(base_model=TEST_MODEL, rank=2, seed=5).result()
    trained.forward_backward(TWIN_DATA, "cross_entropy").result()
    trained.optim_step(TWIN_ADAM).result()
    weights = trained.save_weights_for_sampler("twin").result().path
    base = service.create_sampling_client(base_model=TEST_MODEL).result()
    yield Twins(
        server=server,
        service=service,
        rest=tinker.RestClient(base_url=server.base_url, api_key=THIRD),
        admin=_admin(server, THIRD),
        trained=trained,
        state=trained.save_state("twin").result().path,
        weights=weights,
        sampler=service.create_sampling_client(model_path=weights).result(),
        base_logprobs=base.compute_logprobs(types.ModelInput.from_ints(PROMPT)).result()[1:],
    )
    service.close("success").result()


async def _done(value: Any) -> Any:
    """The deprecated ``*_async`` methods return a value, or an APIFuture to await as well."""
    value = await value
    return await value if isinstance(value, APIFuture) else value


def _counted(usage: types.BillingUsageResponse) -> list[Any]:
    """The token and checkpoint events (storage GB-hours grow with every second)."""
    return [e for e in usage.data if not isinstance(e.event_info, types.StorageBillingEvent)]


def _logprobs(out: types.ForwardBackwardOutput) -> list[float]:
    return out.loss_fn_outputs[0]["logprobs"].tolist()


async def _forward(tc: tinker.TrainingClient) -> list[float]:
    return _logprobs(await tc.forward(TWIN_DATA, "cross_entropy"))


async def _step(*tcs: tinker.TrainingClient) -> None:
    """One cross-entropy step on each of ``tcs``."""
    for tc in tcs:
        await tc.forward_backward(TWIN_DATA, "cross_entropy")
        await tc.optim_step(TWIN_ADAM)


async def _sampled(sampler: tinker.SamplingClient) -> list[float]:
    """``sampler``'s logprobs of PROMPT (the first token has none)."""
    first, *rest = await sampler.compute_logprobs(types.ModelInput.from_ints(PROMPT))
    assert first is None and None not in rest
    return rest  # type: ignore[return-value]


def _neg_ll(_: list[types.Datum], lps: list[Any]) -> tuple[Any, dict[str, float]]:
    return -sum(lp.sum() for lp in lps), {}


def _sampler_id(sampler: tinker.SamplingClient) -> str:
    return json.loads(base64.urlsafe_b64decode(sampler.get_sampler_handle()))["sampling_session_id"]


TwinCase = Callable[[Twins], Awaitable[None]]
TWIN_CASES: dict[str, TwinCase] = {}


def _twin(member: str) -> Callable[[TwinCase], TwinCase]:
    def register(case: TwinCase) -> TwinCase:
        assert member not in TWIN_CASES, member
        TWIN_CASES[member] = case
        return case

    return register


def _read(
    member: str,
    call: Callable[[Any, Twins], Any],
    fact: Callable[[Any, Twins], bool],
    same: Callable[[Any], Any] = lambda r: r,
) -> None:
    """A read: ``call(method, w)`` with the ``*_async`` method and with its sync method give equal
    results (``same`` of each), of which ``fact`` holds, so that two empty answers do not pass."""
    cls, name = member.split(".")

    async def case(w: Twins) -> None:
        client = w.client(cls)
        got = await _done(call(getattr(client, name), w))
        want = call(getattr(client, name.removesuffix("_async")), w)
        want = await want if inspect.isawaitable(want) else want
        assert same(got) == same(want)
        assert fact(got, w), got

    _twin(member)(case)


_read(
    "RestClient.get_training_run_async",
    lambda f, w: f(w.trained.model_id),
    lambda r, w: r.training_run_id == w.trained.model_id and r.base_model == TEST_MODEL,
)
_read(
    "RestClient.get_training_run_by_tinker_path_async",
    lambda f, w: f(w.state),
    lambda r, w: r.training_run_id == w.trained.model_id and r.lora_rank == 2,
)
_read(
    "RestClient.list_checkpoints_async",
    lambda f, w: f(w.trained.model_id),
    lambda r, w: {w.state, w.weights} <= {c.tinker_path for c in r.checkpoints},
)
_read(
    "RestClient.list_training_runs_async",
    lambda f, w: f(),
    lambda r, w: w.trained.model_id in [t.training_run_id for t in r.training_runs],
)
_read(
    "RestClient.list_user_checkpoints_async",
    lambda f, w: f(),
    lambda r, w: {w.state, w.weights} <= {c.tinker_path for c in r.checkpoints},
)
_read(
    "RestClient.get_sampler_async",
    lambda f, w: f(_sampler_id(w.sampler)),
    lambda r, w: r.base_model == TEST_MODEL and r.model_path == w.weights,
)
_read(
    "RestClient.get_session_async",
    lambda f, w: f(w.service.holder.get_session_id()),
    lambda r, w: w.trained.model_id in r.training_run_ids,
)
_read(
    "RestClient.list_sessions_async",
    lambda f, w: f(),
    lambda r, w: w.service.holder.get_session_id() in r.sessions,
)
for _cls in ("RestClient", "AdminClient"):  # RestClient's are the deprecated copies of AdminClient's
    _read(
        f"{_cls}.get_audit_log_async",
        lambda f, w: f("checkpoints"),
        lambda r, w: w.state in [e.tinker_path for e in r.entries if e.event == "checkpoint_create"],
    )
    _read(
        f"{_cls}.get_current_checkpoint_storage_usage_async",
        lambda f, w: f(),
        lambda r, w: sum(d.checkpoint_count for d in r.data) >= 2 and all(d.size_bytes > 0 for d in r.data),
    )
    _read(
        f"{_cls}.get_billing_usage_async",
        lambda f, w: f(*_window()),
        lambda r, w: any(e.event_info.type == "training" for e in _counted(r)),
        same=_counted,
    )
_read(
    "TrainingClient.get_info_async",
    lambda f, w: f(),
    lambda r, w: r.model_data.model_name == TEST_MODEL and r.model_id == w.trained.model_id,
)
_read(
    "TrainingClient.forward_async",
    lambda f, w: f(TWIN_DATA, "cross_entropy"),
    lambda r, w: len(_logprobs(r)) == len(TWIN_TOKENS) - 1,
    same=_logprobs,
)
_read("SamplingClient.get_base_model_async", lambda f, w: f(), lambda r, w: r == TEST_MODEL)
_read(
    "SamplingClient.compute_logprobs_async",
    lambda f, w: f(types.ModelInput.from_ints(PROMPT)),
    lambda r, w: len(r) == len(PROMPT) and r[0] is None and r[1:] != w.base_logprobs,
)
_read(
    "SamplingClient.sample_async",
    lambda f, w: f(
        types.ModelInput.from_ints(PROMPT), 2, types.SamplingParams(max_tokens=5, seed=4, stop=[])
    ),
    lambda r, w: [len(s.tokens) for s in r.sequences] == [5, 5],
    same=lambda r: [s.tokens for s in r.sequences],
)
_read(
    "ServiceClient.get_server_capabilities_async",
    lambda f, w: f(),
    lambda r, w: [m.model_name for m in r.supported_models] == [TEST_MODEL],
)


# the training calls: two clients from the same seed, one driven each way, stay the same
@_twin("TrainingClient.forward_backward_async")
async def _forward_backward(w: Twins) -> None:
    a, b = w.fresh(), w.fresh()
    got = await _done(a.forward_backward_async(TWIN_DATA, "cross_entropy"))
    want = await b.forward_backward(TWIN_DATA, "cross_entropy")
    assert_scalar_close(got.metrics["loss:sum"], want.metrics["loss:sum"])
    assert_logprobs_close(_logprobs(got), _logprobs(want))
    for tc in (a, b):  # the same gradients: the same step
        await tc.optim_step(TWIN_ADAM)
    assert_logprobs_close(await _forward(a), await _forward(b))


@_twin("TrainingClient.optim_step_async")
async def _optim_step(w: Twins) -> None:
    a, b = w.fresh(), w.fresh()
    before = await _forward(a)
    for tc in (a, b):
        await tc.forward_backward(TWIN_DATA, "cross_entropy")
    await _done(a.optim_step_async(TWIN_ADAM))
    await b.optim_step(TWIN_ADAM)
    after = await _forward(a)
    assert_logprobs_close(after, await _forward(b))
    assert sum(after) > sum(before)  # a step on the data's own cross-entropy raised its logprobs


@_twin("TrainingClient.forward_backward_custom_async")
async def _forward_backward_custom(w: Twins) -> None:
    a, b = w.fresh(), w.fresh()
    got = await _done(a.forward_backward_custom_async(TWIN_DATA, _neg_ll))
    want = await b.forward_backward_custom(TWIN_DATA, _neg_ll)
    assert_scalar_close(got.metrics["loss:sum"], want.metrics["loss:sum"])
    plain = await w.fresh().forward(TWIN_DATA, "cross_entropy")  # -sum(logprobs) is cross-entropy
    assert_scalar_close(got.metrics["loss:sum"], -sum(_logprobs(plain)))
    for tc in (a, b):
        await tc.optim_step(TWIN_ADAM)
    assert_logprobs_close(await _forward(a), await _forward(b))


@_twin("TrainingClient.load_state_async")
async def _load_state(w: Twins) -> None:
    want = await _forward(w.trained)
    a, b = w.fresh(seed=9), w.fresh(seed=9)  # another seed: only the initial weights differ
    assert max(abs(x - y) for x, y in zip(await _forward(a), want, strict=True)) > 1e-2
    await _done(a.load_state_async(w.state))
    await b.load_state(w.state)
    assert_logprobs_close(await _forward(a), want)
    assert_logprobs_close(await _forward(b), want)


@_twin("TrainingClient.load_state_with_optimizer_async")
async def _load_state_with_optimizer(w: Twins) -> None:
    want = await _forward(w.trained)
    a, b = w.fresh(seed=9), w.fresh(seed=9)
    await _done(a.load_state_with_optimizer_async(w.state))
    await b.load_state_with_optimizer(w.state)
    assert_logprobs_close(await _forward(a), want)
    await _step(a, b)  # the saved Adam moments, so the same next step
    assert_logprobs_close(await _forward(a), await _forward(b))


@_twin("TrainingClient.save_state_async")
async def _save_state(w: Twins) -> None:
    got = (await _done(w.trained.save_state_async("twin-async"))).path
    want = (await w.trained.save_state("twin-sync")).path
    prefix = f"tinker://{w.trained.model_id}/weights/"
    assert (got, want) == (f"{prefix}twin-async", f"{prefix}twin-sync")
    expected = await _forward(w.trained)
    for path in (got, want):
        loaded = await w.service.create_training_client_from_state(path)
        assert_logprobs_close(await _forward(loaded), expected)


@_twin("TrainingClient.save_weights_for_sampler_async")
async def _save_weights_for_sampler(w: Twins) -> None:
    got = (await _done(w.trained.save_weights_for_sampler_async("twin-async"))).path
    want = (await w.trained.save_weights_for_sampler("twin-sync")).path
    prefix = f"tinker://{w.trained.model_id}/sampler_weights/"
    assert (got, want) == (f"{prefix}twin-async", f"{prefix}twin-sync")
    expected = await _sampled(w.sampler)
    for path in (got, want):
        assert_logprobs_close(
            await _sampled(await w.service.create_sampling_client(model_path=path)), expected
        )


@_twin("TrainingClient.save_weights_and_get_sampling_client_async")
async def _save_weights_and_get_sampling_client(w: Twins) -> None:
    got = await w.trained.save_weights_and_get_sampling_client_async()
    want = await w.trained.save_weights_and_get_sampling_client()
    lp = await _sampled(got)
    assert_logprobs_close(lp, await _sampled(want))
    assert_logprobs_close(lp, await _sampled(w.sampler))  # the trained weights
    assert got.get_base_model() == want.get_base_model() == TEST_MODEL


@_twin("TrainingClient.create_sampling_client_async")
async def _training_create_sampling_client(w: Twins) -> None:
    got = await _sampled(await w.trained.create_sampling_client_async(w.weights))
    assert_logprobs_close(got, await _sampled(await w.trained.create_sampling_client(w.weights)))
    assert got != w.base_logprobs  # the trained weights, not the base model's


@_twin("ServiceClient.create_sampling_client_async")
async def _service_create_sampling_client(w: Twins) -> None:
    got = await _sampled(await w.service.create_sampling_client_async(model_path=w.weights))
    assert_logprobs_close(got, await _sampled(await w.service.create_sampling_client(model_path=w.weights)))
    assert got != w.base_logprobs
    base = await w.service.create_sampling_client_async(base_model=TEST_MODEL)
    assert_logprobs_close(await _sampled(base), w.base_logprobs)


@_twin("TrainingClient.save_weights_external_async")
async def _save_weights_external(w: Twins) -> None:
    got = (await _done(w.trained.save_weights_external_async("twin-async"))).path
    want = (await w.trained.save_weights_external("twin-sync")).path
    prefix = f"tinker://{w.trained.model_id}/external_weights/"
    assert (got, want) == (f"{prefix}twin-async", f"{prefix}twin-sync")
    a, b = (safetensors.torch.load(_download(w.rest, p)["adapter_model.safetensors"]) for p in (got, want))
    assert a.keys() == b.keys() and a and all(torch.equal(a[k], b[k]) for k in a)


def _download(rest: tinker.RestClient, path: str) -> dict[str, bytes]:
    urls = rest.get_external_weights_urls(path).result().urls
    return {name: httpx.get(url, timeout=60).raise_for_status().content for name, url in urls.items()}


@_twin("RestClient.get_external_weights_urls_async")
async def _external_weights_urls(w: Twins) -> None:
    path = (await w.trained.save_weights_external("twin-urls")).path
    got = await w.rest.get_external_weights_urls_async(path)
    want = await w.rest.get_external_weights_urls(path)
    assert set(got.urls) == set(want.urls) == {"adapter_model.safetensors", "adapter_config.json"}
    for name in got.urls:  # two signed URLs of the same files
        bodies = [httpx.get(u.urls[name], timeout=60).raise_for_status().content for u in (got, want)]
        assert bodies[0] == bodies[1] and bodies[0]


@_twin("ServiceClient.create_lora_training_client_async")
async def _create_lora_training_client(w: Twins) -> None:
    a = await w.service.create_lora_training_client_async(base_model=TEST_MODEL, rank=2, seed=7)
    b = await w.service.create_lora_training_client(base_model=TEST_MODEL, rank=2, seed=7)
    assert a.model_id != b.model_id and a.get_info().model_data == b.get_info().model_data
    await _step(a, b)  # the same seed: the same initial weights, so the same step
    assert_logprobs_close(await _forward(a), await _forward(b))


@_twin("ServiceClient.create_training_client_from_state_async")
async def _create_training_client_from_state(w: Twins) -> None:
    want = await _forward(w.trained)
    assert_logprobs_close(
        await _forward(await w.service.create_training_client_from_state_async(w.state)), want
    )
    assert_logprobs_close(await _forward(await w.service.create_training_client_from_state(w.state)), want)


@_twin("ServiceClient.create_training_client_from_state_with_optimizer_async")
async def _create_training_client_from_state_with_optimizer(w: Twins) -> None:
    a = await w.service.create_training_client_from_state_with_optimizer_async(w.state)
    b = await w.service.create_training_client_from_state_with_optimizer(w.state)
    assert_logprobs_close(await _forward(a), await _forward(w.trained))
    await _step(a, b)  # the saved Adam moments, so the same next step
    assert_logprobs_close(await _forward(a), await _forward(b))


# the writes: two checkpoints, one changed each way, the same change on both
@_twin("RestClient.delete_checkpoint_async")
async def _delete_checkpoint(w: Twins) -> None:
    paths = [w.saved("gone-a"), w.saved("gone-s")]
    await w.rest.delete_checkpoint_async(w.trained.model_id, "weights/gone-a")
    await w.rest.delete_checkpoint(w.trained.model_id, "weights/gone-s")
    await _gone(w, paths)


@_twin("RestClient.delete_checkpoint_from_tinker_path_async")
async def _delete_checkpoint_from_tinker_path(w: Twins) -> None:
    paths = [w.saved("gone-path-a"), w.saved("gone-path-s")]
    await w.rest.delete_checkpoint_from_tinker_path_async(paths[0])
    await w.rest.delete_checkpoint_from_tinker_path(paths[1])
    await _gone(w, paths)


async def _gone(w: Twins, paths: list[str]) -> None:
    """``paths`` are deleted (listed no more, logged, gone from disk); nothing else is."""
    assert not w.paths() & set(paths) and {w.state, w.weights} <= w.paths()
    log = (await w.admin.get_audit_log("checkpoints")).entries
    assert [e.tinker_path for e in log if e.event == "checkpoint_delete"][-2:] == paths
    root = Path(w.server.data_dir) / "checkpoints"
    assert not any((root / p.removeprefix("tinker://")).exists() for p in paths)


@_twin("RestClient.publish_checkpoint_from_tinker_path_async")
async def _publish(w: Twins) -> None:
    a, b = w.saved("public-a"), w.saved("public-s")
    await w.rest.publish_checkpoint_from_tinker_path_async(a)
    await w.rest.publish_checkpoint_from_tinker_path(b)
    assert w.checkpoint(a).public and w.checkpoint(b).public and not w.checkpoint(w.state).public


@_twin("RestClient.unpublish_checkpoint_from_tinker_path_async")
async def _unpublish(w: Twins) -> None:
    a, b = w.saved("private-a"), w.saved("private-s")
    for path in (a, b):
        await w.rest.publish_checkpoint_from_tinker_path(path)
    await w.rest.unpublish_checkpoint_from_tinker_path_async(a)
    await w.rest.unpublish_checkpoint_from_tinker_path(b)
    assert not w.checkpoint(a).public and not w.checkpoint(b).public


@_twin("RestClient.set_checkpoint_ttl_from_tinker_path_async")
async def _ttl(w: Twins) -> None:
    a, b = w.saved("ttl-a"), w.saved("ttl-s")
    before = datetime.now(UTC)
    await w.rest.set_checkpoint_ttl_from_tinker_path_async(a, 7200)
    await w.rest.set_checkpoint_ttl_from_tinker_path(b, 7200)
    after = datetime.now(UTC)
    for path in (a, b):
        expires = w.checkpoint(path).expires_at
        assert expires is not None
        assert before + timedelta(seconds=7199) <= expires <= after + timedelta(seconds=7201), expires
    assert w.checkpoint(w.state).expires_at is None


@_twin("RestClient.assign_session_project_async")
async def _assign_session_project(w: Twins) -> None:
    """Two sessions, one assigned each way: each brings its run's checkpoint into its project."""
    usage = []
    for project, twin in (("proj-assigned-a", True), ("proj-assigned-s", False)):
        service = tinker.ServiceClient(base_url=w.server.base_url, api_key=THIRD)
        try:
            tc = await service.create_lora_training_client_async(base_model=TEST_MODEL, rank=2, seed=5)
            await tc.save_state("assigned")
            assign = w.rest.assign_session_project_async if twin else w.rest.assign_session_project
            await assign(service.holder.get_session_id(), project)
        finally:
            await service.close("success")
        usage.append((await w.admin.get_current_checkpoint_storage_usage(project)).data)
    a, s = ([(d.project_id, d.checkpoint_count, d.size_bytes) for d in u] for u in usage)
    assert a[0][:2] == ("proj-assigned-a", 1) and s[0][:2] == ("proj-assigned-s", 1)
    assert a[0][2] == s[0][2] > 0  # the same shapes, the same bytes


@_twin("RestClient.copy_weights_async")
async def _copy_weights(w: Twins) -> None:
    """Both copies load to the trained weights. Their tensors are hard links of the state's files,
    counted once, in the project of the oldest checkpoint holding them (the state's): the copies'
    project counts only the files that are the copies' own."""
    project = "proj-copies"
    copies = [await w.rest.copy_weights_async(w.state, project), await w.rest.copy_weights(w.state, project)]
    assert len(set(copies)) == 2 and w.state not in copies and all(c.startswith("tinker://") for c in copies)
    want = await _forward(w.trained)
    for path in copies:
        assert_logprobs_close(await _forward(await w.service.create_training_client_from_state(path)), want)
    root = Path(w.server.data_dir) / "checkpoints"

    def files(path: str) -> dict[tuple[int, int], int]:
        stats = [f.stat() for f in (root / path.removeprefix("tinker://")).iterdir()]
        return {(st.st_dev, st.st_ino): st.st_size for st in stats}

    source, copied = files(w.state), files(copies[0]) | files(copies[1])
    assert max(source.values()) > 10_000 and max(source.values()) in [
        copied[k] for k in source.keys() & copied
    ]
    (usage,) = (await w.admin.get_current_checkpoint_storage_usage(project)).data
    own = sum(size for k, size in copied.items() if k not in source)
    assert (usage.project_id, usage.checkpoint_count, usage.size_bytes) == (project, 2, own)


@_twin("RestClient.export_session_trace_async")
async def _export_session_trace(w: Twins) -> None:
    session = w.service.holder.get_session_id()
    urls = [await w.rest.export_session_trace_async(session), await w.rest.export_session_trace(session)]
    traces = [httpx.get(url, timeout=60).raise_for_status().json() for url in urls]
    assert traces[0] == traces[1]
    names = {e["name"] for e in traces[0]["traceEvents"] if e.get("ph") == "X"}
    assert {"forward_backward", "optim_step"} <= names, names


def _async_members() -> list[str]:
    """Every public ``*_async`` member of the SDK's clients, read from the SDK."""
    return sorted(m for m in route_coverage.sdk_methods() if m.endswith("_async"))


def test_every_async_member_of_the_sdk_has_a_twin_case() -> None:
    assert sorted(TWIN_CASES) == _async_members()


@pytest.mark.parametrize("member", _async_members())
def test_an_async_twin_gives_what_its_sync_method_gives(twins: Twins, member: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the deprecated twins say so
        asyncio.run(TWIN_CASES[member](twins))
