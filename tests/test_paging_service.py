"""Paging through the service: a runtime under a memory budget of a few models serves more models
than it holds, through the clients, bitwise as a runtime that holds them all; the scheduler pages in
the models of queued requests while a tick computes, and shrinks ticks to the budget."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tinker import types

import opentinker
from opentinker.scheduler import ModelQueue
from opentinker.service.lifecycle import lifecycle_of
from opentinker.service.runtime import Runtime
from tests.conftest import TEST_MODEL

MODELS = 8
RANK = 4


def _datum(seed: int) -> types.Datum:
    tokens = [(seed * 37 + 11 * i) % 1000 + 3 for i in range(12)]
    inputs: dict[str, Any] = {"target_tokens": tokens[1:], "weights": [1.0] * 11}
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


def _budget_for(models: float) -> int:
    rt = Runtime(None, memory_budget="off")
    try:
        engine = rt.base_stack(TEST_MODEL).engine
        return int(models * engine.state_bytes(opentinker.lora.LoRAConfig(rank=RANK)))
    finally:
        rt.shutdown()


@pytest.fixture(scope="module")
def budget() -> int:
    return _budget_for(3.0)


@pytest.fixture
def runtimes(tmp_path: Path, budget: int) -> Iterator[tuple[Runtime, Runtime]]:
    resident = Runtime(tmp_path / "resident", memory_budget="off")
    paged = Runtime(tmp_path / "paged", memory_budget=budget)
    yield resident, paged
    resident.shutdown()
    paged.shutdown()


def _train_and_sample(rt: Runtime) -> tuple[list[float], list[list[int]]]:
    service = opentinker.ServiceClient(runtime=rt)
    clients = [service.create_lora_training_client(TEST_MODEL, rank=RANK, seed=i) for i in range(MODELS)]
    adam = types.AdamParams(learning_rate=1e-2)
    losses = []
    for step in range(2):
        for i, tc in enumerate(clients):
            out = tc.forward_backward([_datum(100 * step + i)], "cross_entropy").result()
            losses.append(out.metrics["loss:sum"])
            tc.optim_step(adam).result()
    tokens = []
    for i, tc in enumerate(clients):
        sc = tc.save_weights_and_get_sampling_client(f"s{i}")
        got = sc.sample(
            types.ModelInput.from_ints([5, 9, 17 + i]), 2, types.SamplingParams(max_tokens=8, temperature=0.0)
        ).result()
        tokens += [list(s.tokens) for s in got.sequences]
    return losses, tokens


def test_a_paged_runtime_trains_and_samples_bitwise_as_a_resident_one(
    runtimes: tuple[Runtime, Runtime],
) -> None:
    resident, paged = runtimes
    want = _train_and_sample(resident)
    got = _train_and_sample(paged)
    assert got == want
    engine = paged.base_stack(TEST_MODEL).engine
    stats = engine.pages.counts()
    assert stats["page_outs"] >= MODELS and stats["page_ins"] >= MODELS, stats
    assert paged.budget.resident <= paged.budget.limit  # type: ignore[operator]
    assert resident.base_stack(TEST_MODEL).engine.pages.counts()["page_outs"] == 0


def test_the_scheduler_pages_in_queued_models_while_a_tick_computes(
    runtimes: tuple[Runtime, Runtime],
) -> None:
    _, paged = runtimes
    service = opentinker.ServiceClient(runtime=paged)
    clients = [service.create_lora_training_client(TEST_MODEL, rank=RANK, seed=i) for i in range(MODELS)]
    for tc in clients:  # every model has moments: its whole state pages
        tc.forward_backward([_datum(1)], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    scheduler = paged.base_stack(TEST_MODEL).scheduler
    pages = paged.base_stack(TEST_MODEL).engine.pages
    ticks, waited, ins = scheduler.stats.ticks, scheduler.stats.waited_ticks, pages.stats.page_ins
    futures = []
    for r in range(3):  # every request queued before any runs: the scheduler knows what comes next
        for i, tc in enumerate(clients):
            futures.append(tc.forward_backward([_datum(10 * r + i)], "cross_entropy"))
            futures.append(tc.optim_step(types.AdamParams(learning_rate=1e-2)))
    for f in futures:
        f.result()
    ran = scheduler.stats.ticks - ticks
    paged_in = pages.stats.page_ins - ins
    # each tick holds at most half the budget (1.5 models here): more ticks than rounds
    assert ran >= 3 * MODELS // 2, ran
    assert paged_in >= 2 * MODELS and pages.stats.prefetched > 0
    # the first tick's models could not be known before it; later ones were paged in ahead
    assert scheduler.stats.waited_ticks - waited <= max(2, ran // 4), (
        scheduler.stats.waited_ticks - waited,
        ran,
    )
    assert paged.budget.resident <= paged.budget.limit  # type: ignore[operator]


def test_a_quiet_sessions_models_page_out_first_and_stay_servable(runtimes: tuple[Runtime, Runtime]) -> None:
    results = []
    for rt in runtimes:
        tc = opentinker.ServiceClient(runtime=rt).create_lora_training_client(TEST_MODEL, rank=RANK, seed=0)
        tc.forward_backward([_datum(1)], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        engine = rt.base_stack(TEST_MODEL).engine
        life = lifecycle_of(rt)
        if rt.budget.limit is not None:
            assert life.evict_idle(0.0) == [tc.model_id]  # the session is quiet: paged out
            queue = ModelQueue(tc.model_id)  # the page-out ran in the model's order, before this
            rt.base_stack(TEST_MODEL).scheduler.submit_call(queue, lambda e: None).result()
            assert not engine.pages.is_resident(tc.model_id) and not life.evicted
        results.append(tc.forward_backward([_datum(2)], "cross_entropy").result().metrics["loss:sum"])
    assert results[0] == results[1]  # served on, bitwise as if it had stayed resident


def test_vllms_host_tier_is_sized_from_the_budget() -> None:
    from opentinker.service.memory import vllm_cpu_loras

    assert vllm_cpu_loras(None, 10 << 20, 16) is None  # no budget: vLLM's own default
    assert vllm_cpu_loras(4 << 30, 10 << 20, 16) == (1 << 30) // (10 << 20)  # a quarter of it
    assert vllm_cpu_loras(64 << 20, 10 << 20, 16) == 16  # never fewer than on the device
