"""The embedded clients' ``*_async`` forms leave the event loop free while the engine works.

``run_rl_many`` drives many runs on one event loop; a ``*_async`` call that blocks on the
scheduler stalls all of them. The check: a gate queued ahead of the call on the same model holds
the scheduler until a ticker coroutine on the same loop opens it — so the call can only finish
if the loop kept running while it waited. The blocking form, driven the same way, is the
reference that shows the check can fail.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from tinker import types

import opentinker
from opentinker.client import Runtime
from opentinker.scheduler import ModelQueue
from tests.conftest import TEST_MODEL

TICKS_TO_OPEN = 20  # the ticker opens the gate after this many ticks of asyncio.sleep(0.001)


@pytest.fixture
def runtime(tmp_path):
    rt = Runtime(tmp_path / "data")
    yield rt
    rt.shutdown()


async def _while_gated(
    runtime: Runtime, model_id: str, call: Callable[[], Awaitable[Any]], gate_timeout_s: float
) -> tuple[Any, int, bool]:
    """Run ``call`` behind a gate on ``model_id``'s queue; a ticker on this loop opens the gate.

    Returns (the call's result, ticks counted while it ran, whether the ticker opened the gate
    rather than the gate timing out)."""
    gate = threading.Event()
    opened_by_ticker: list[bool] = []
    # the model's next op waits on the gate (the scheduler runs a model's ops in order)
    held = runtime.base_stack(TEST_MODEL).scheduler.submit_call(
        ModelQueue(model_id), lambda eng: opened_by_ticker.append(gate.wait(gate_timeout_s))
    )
    ticks = 0
    running = True

    async def ticker() -> None:
        nonlocal ticks
        while running:
            await asyncio.sleep(0.001)
            ticks += 1
            if ticks == TICKS_TO_OPEN:
                gate.set()

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)  # the ticker is scheduled before the call starts
    start = ticks
    result = await call()
    during = ticks - start
    running = False
    await task
    held.result(timeout=gate_timeout_s + 10)
    return result, during, opened_by_ticker == [True]


@pytest.mark.parametrize("form", ["awaited_future", "async_method"])
def test_save_weights_and_get_sampling_client_does_not_block_the_loop(runtime: Runtime, form: str) -> None:
    """Both SDK 0.38 forms: ``await tc.save_weights_and_get_sampling_client()`` (what the loops
    call) and the deprecated ``save_weights_and_get_sampling_client_async()``."""
    service = opentinker.ServiceClient(runtime=runtime)
    tc = service.create_lora_training_client(TEST_MODEL, rank=4, seed=0)

    async def call() -> Any:
        if form == "awaited_future":
            return await tc.save_weights_and_get_sampling_client()
        return await tc.save_weights_and_get_sampling_client_async()

    async def main() -> tuple[Any, int, bool]:
        return await _while_gated(runtime, tc.model_id, call, 30.0)

    t = time.perf_counter()
    sampler, ticks, opened_by_ticker = asyncio.run(main())
    assert opened_by_ticker, "the save blocked the loop until the gate timed out"
    assert ticks >= TICKS_TO_OPEN
    assert time.perf_counter() - t < 20.0

    # the same policy version as the blocking form's: both sample the same tokens and logprobs
    reference = tc.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints([1, 5, 6, 7])
    params = types.SamplingParams(max_tokens=6, seed=3, temperature=1.0)
    got = sampler.sample(prompt, 2, params).result().sequences
    want = reference.sample(prompt, 2, params).result().sequences
    assert [s.tokens for s in got] == [s.tokens for s in want]
    assert [s.logprobs for s in got] == [s.logprobs for s in want]


def test_the_check_catches_a_call_that_blocks_the_loop(runtime: Runtime) -> None:
    """Reference: the blocking form called from a coroutine stalls the ticker, and the check sees it."""
    service = opentinker.ServiceClient(runtime=runtime)
    tc = service.create_lora_training_client(TEST_MODEL, rank=4, seed=0)

    async def blocking() -> Any:
        return tc.save_weights_and_get_sampling_client().result()

    async def main() -> tuple[Any, int, bool]:
        return await _while_gated(runtime, tc.model_id, blocking, 0.3)

    _, ticks, opened_by_ticker = asyncio.run(main())
    assert not opened_by_ticker
    assert ticks == 0


def test_the_future_can_be_used_as_the_client(runtime: Runtime) -> None:
    """SDK backcompat: code that treats the returned future as the SamplingClient keeps working."""
    service = opentinker.ServiceClient(runtime=runtime)
    tc = service.create_lora_training_client(TEST_MODEL, rank=4, seed=0)
    prompt = types.ModelInput.from_ints([1, 5, 6, 7])
    params = types.SamplingParams(max_tokens=4, seed=1, temperature=1.0)
    direct = tc.save_weights_and_get_sampling_client().sample(prompt, 1, params).result()
    resolved = tc.save_weights_and_get_sampling_client().result().sample(prompt, 1, params).result()
    assert direct.sequences[0].tokens == resolved.sequences[0].tokens
