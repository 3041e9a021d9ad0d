"""``GET /metrics`` (server/metrics.py): Prometheus' text format, scraped by ``prometheus-client``'s
own parser, operators only; its counters move by exactly the traffic the official SDK sends (and the ``openai`` client).

One real ``serve`` child (``--operator ops``): a scrape, then a LoRA model trained one step,
saved, snapshotted and sampled as a two-turn conversation (so the prefix cache hits), then a
second scrape. The label values never show a filesystem path of the server.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import tinker
from prometheus_client.parser import text_string_to_metric_families
from tinker import types

from opentinker.models.registry import tiny_model_dir
from opentinker.server.auth import create_key, hash_key
from opentinker.server.config import ServerConfig
from opentinker.server.local import LocalServer
from opentinker.server.metrics import snapshot_owner
from opentinker.server.state import Server
from opentinker.service.config import RuntimeConfig
from tests.conftest import SDK_ENV, TEST_MODEL

USER = "tml-metrics-user"  # a --dev key: its own tenant, dev-<hash prefix>
USER_TENANT = f"dev-{hash_key(USER)[:16]}"
REPLY = 5
PARAMS = types.SamplingParams(max_tokens=REPLY, temperature=1.0, seed=3, stop=[])

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= lab)


def wait_for(cond: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    data_dir = tmp_path_factory.mktemp("metrics")
    ops_key = create_key(data_dir, "ops")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TINKER_TELEMETRY", "0")
        for var in SDK_ENV:
            mp.delenv(var, raising=False)
        argv = ["--dev", "--base-model", TEST_MODEL, "--operator", "ops"]
        with LocalServer(argv, data_dir=data_dir) as srv:
            yield {"srv": srv, "ops": ops_key, "data_dir": data_dir}


def scrape(srv: LocalServer, key: str, *, bearer: bool = False) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if bearer else {"X-API-Key": key}
    return httpx.get(f"{srv.base_url}/metrics", headers=headers, timeout=60)


def test_metrics_are_for_operators_only(world: dict[str, Any]) -> None:
    srv = world["srv"]
    assert httpx.get(f"{srv.base_url}/metrics", timeout=60).status_code == 401
    assert scrape(srv, "tml-").status_code in (401, 403)  # a dev key of its own, not an operator
    assert scrape(srv, USER).status_code == 403
    assert scrape(srv, USER, bearer=True).status_code == 403
    assert scrape(srv, "not-a-key", bearer=True).status_code == 401
    ok = scrape(srv, world["ops"], bearer=True)  # as Prometheus' `authorization` sends it
    assert ok.status_code == 200 and ok.headers["content-type"].startswith("text/plain")
    assert "opentinker_requests" in ok.text


def _train_and_sample(service: tinker.ServiceClient) -> dict[str, Any]:
    tc = service.create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=0).result()
    seqs = [list(range(5, 19)), list(range(30, 39))]
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints(s[:-1]),
            loss_fn_inputs={"target_tokens": s[1:], "weights": [1.0] * (len(s) - 1)},
        )
        for s in seqs
    ]
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    tc.save_state("m1").result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = list(range(60, 71))
    turn1 = sampler.sample(types.ModelInput.from_ints(prompt), 1, PARAMS).result()
    nxt = prompt + list(turn1.sequences[0].tokens) + [21, 22]
    turn2 = sampler.sample(types.ModelInput.from_ints(nxt), 2, PARAMS).result()
    return {
        "trained": sum(d.model_input.length for d in data),
        "prompts": len(prompt) + len(nxt),
        "sampled": sum(len(s.tokens) for t in (turn1, turn2) for s in t.sequences),
        "hits": turn2.prompt_cache_hit_tokens,
        "prefix": len(prompt) + REPLY - 1,
    }


def test_counters_move_with_the_sdk_traffic(world: dict[str, Any]) -> None:
    srv, key = world["srv"], world["ops"]
    before = parse(scrape(srv, key).text)
    service = tinker.ServiceClient(base_url=srv.base_url, api_key=USER)
    try:  # scraped while the session is open: its model and sampler are live
        sent = _train_and_sample(service)
        after = _scrape_after(srv, key, before, sent)
    finally:
        service.close("success").result()
    _check(world, before, after, sent)


def test_openai_route_traffic_is_counted_as_sampling(world: dict[str, Any]) -> None:
    """Requests of the OpenAI-compatible routes are counted as the Tinker sample route's are (the
    usage ledger's kinds, hence billing, and the prompt cache hits): by exactly the ``usage`` they
    answered with (a prompt prefilled once for its ``n`` samples; an echo with ``max_tokens`` 0
    samples none; a second turn's reused prefix as its ``cached_tokens``)."""
    srv, key = world["srv"], world["ops"]
    before = parse(scrape(srv, key).text)
    oa = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key=USER, max_retries=0)
    extra = {"ignore_eos": True}
    messages = [{"role": "user", "content": "Hi"}]
    chat = oa.chat.completions.create(
        model=TEST_MODEL, messages=messages, max_tokens=REPLY, temperature=0, extra_body=extra
    )  # type: ignore[arg-type]
    comp = oa.completions.create(
        model=TEST_MODEL, prompt=["one two", "three"], n=2, max_tokens=REPLY, seed=1, extra_body=extra
    )
    turn2 = [*messages, {"role": "assistant", "content": chat.choices[0].message.content}]
    again = oa.chat.completions.create(
        model=TEST_MODEL,
        messages=[*turn2, {"role": "user", "content": "More"}],
        max_tokens=REPLY,
        temperature=0,
    )  # type: ignore[arg-type]  # the first turn's prefix comes from the prefix cache
    echo = oa.completions.create(
        model=TEST_MODEL, prompt="one two three", max_tokens=0, echo=True, logprobs=0
    )
    answers = [chat, comp, again, echo]
    assert all(a.usage is not None for a in answers)
    use = [a.usage for a in answers if a.usage is not None]
    sent = {
        "prompts": sum(u.prompt_tokens for u in use),
        "sampled": sum(u.completion_tokens for u in use),
        "hits": sum(u.prompt_tokens_details.cached_tokens or 0 for u in use if u.prompt_tokens_details),
    }
    assert echo.usage is not None and echo.usage.completion_tokens == 0  # echo, max_tokens 0: none sampled
    assert sent["sampled"] == REPLY * 5 + again.usage.completion_tokens  # type: ignore[union-attr]
    assert sent["hits"] > 0
    after = _scrape_after(srv, key, before, sent)
    tokens, me = "opentinker_tokens_total", {"tenant": USER_TENANT}
    for kind, want in (("sampling_prefill", sent["prompts"]), ("sampling_sample", sent["sampled"])):
        assert total(after, tokens, kind=kind, **me) - total(before, tokens, kind=kind, **me) == want
    hits = "opentinker_prompt_cache_hit_tokens_total"
    assert total(after, hits, **me) - total(before, hits, **me) == sent["hits"]


def _scrape_after(srv: LocalServer, key: str, before: Samples, sent: dict[str, Any]) -> Samples:
    tokens = "opentinker_tokens_total"

    def moved(samples: Samples) -> bool:
        return (
            total(samples, tokens, tenant=USER_TENANT, kind="sampling_sample")
            - total(before, tokens, tenant=USER_TENANT, kind="sampling_sample")
            >= sent["sampled"]
        )

    after: Samples = {}

    def scraped() -> bool:
        nonlocal after
        after = parse(scrape(srv, key).text)
        return moved(after)

    wait_for(scraped)  # counted as each result is encoded: already there, waited on for safety
    return after


def _check(world: dict[str, Any], before: Samples, after: Samples, sent: dict[str, Any]) -> None:
    tokens = "opentinker_tokens_total"

    def delta(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    me = {"tenant": USER_TENANT}
    assert delta(tokens, kind="training", **me) == sent["trained"]
    assert delta(tokens, kind="sampling_sample", **me) == sent["sampled"]
    assert delta(tokens, kind="sampling_prefill", **me) == sent["prompts"]
    assert sent["hits"] == sent["prefix"] > 0
    assert delta("opentinker_prompt_cache_hit_tokens_total", **me) == sent["hits"]
    assert total(after, "opentinker_live_models", **me) == 1
    assert total(after, "opentinker_live_snapshots", **me) >= 1
    assert total(after, "opentinker_live_samplers", **me) >= 1
    assert total(after, "opentinker_checkpoint_bytes", kind="weights", **me) > 0
    assert total(after, "opentinker_checkpoints", kind="weights", **me) == 1
    assert total(after, "opentinker_ticks_total") > 0
    assert delta("opentinker_tick_seconds_count") == delta("opentinker_ticks_total") > 0
    assert delta("opentinker_tick_rows_sum") >= len(["two", "datums"])
    assert delta("opentinker_optim_steps_total") >= 1
    assert total(after, "opentinker_rollout_decode_steps_total") > 0
    for state in ("held_for_order", "held_rate_limit", "running", "done"):
        assert ("opentinker_requests", frozenset({("state", state)})) in after
    assert total(after, "opentinker_requests", state="done") >= 1
    # no label value is a filesystem path of the server (its data dir, the model folder, any path)
    for (_, labels), _v in after.items():
        for _k, value in labels:
            assert str(world["data_dir"]) not in value and not value.startswith(("/", "~")), value


def test_snapshot_owner_parses_every_kind_of_snapshot_id() -> None:
    assert snapshot_owner("s1:train:0@v3") == "s1:train:0"
    assert snapshot_owner("tinker://s1:train:0/sampler_weights/x@abc") == "s1:train:0"
    assert snapshot_owner("checkpoint-weights:tinker://s1:train:0/weights/y#4") == "s1:train:0"


def test_no_label_shows_a_server_path(tmp_path: Path) -> None:
    """A base model served from a folder (its name is that folder's path) and counts named after
    it: the exposition carries neither the folder nor the data dir."""
    folder = str(tiny_model_dir())
    server = Server(ServerConfig(data_dir=tmp_path / "data", base_models=(folder,)))
    try:
        server.metrics.observe("alice", "training", 7, folder)
        text = server.metrics.exposition().decode()
    finally:
        server.close()
    samples = parse(text)
    assert total(samples, "opentinker_tokens_total", tenant="alice") == 7
    assert total(samples, "opentinker_ticks_total") == 0  # the folder's engine is there, redacted
    labels = [value for (_, lab), _v in samples.items() for _k, value in lab]
    assert labels and "<server path>" in labels
    for value in labels:
        assert folder not in value and str(tmp_path) not in value and not value.startswith("/")


def test_rollout_worker_processes_are_counted(tmp_path: Path) -> None:
    """Without Ray, the rollout workers are processes: counted by state, with their restarts."""
    config = ServerConfig(
        data_dir=tmp_path / "data", base_models=(TEST_MODEL,), runtime=RuntimeConfig(rollout_workers=1)
    )
    server = Server(config)
    try:
        samples = parse(server.metrics.exposition().decode())
    finally:
        server.close()
    workers = "opentinker_rollout_workers"
    assert total(samples, workers, transport="process", state="ready") == 1
    assert total(samples, workers) == 1
    assert total(samples, "opentinker_rollout_worker_restarts_total", transport="process") == 0
    # the workers' running batches, summed as they report them (idle here)
    assert samples[("opentinker_rollout_running_rows", frozenset({("base_model", TEST_MODEL)}))] == 0
