"""``SampleResponse.prompt_cache_hit_tokens``: the prompt tokens whose keys and values came from the
sampler's prefix cache instead of a prefill.

What the cache reuses, exactly (``sampling/prefix_cache.py``): a finished sequence is stored as its
prompt and every sampled token but the last (the last was never fed to the model). So when turn 2
of a conversation is turn 1's prompt ``P``, its reply ``R`` and some new tokens, turn 2 reuses
``len(P) + len(R) - 1`` tokens, and turn 1 reuses none. The same count comes back from the native
backend, the embedded client and the SDK over HTTP (the worker-process path is checked in
``test_rollout_workers.py``). The count is per prompt: ``num_samples`` rows fan out from one prefill
and do not multiply it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tinker
from tinker import types

import opentinker
from opentinker.client import Runtime
from opentinker.engine import Engine
from opentinker.sampling import NativeBackend, SampleRequest, SamplingParams
from opentinker.sampling.types import SampleResult
from opentinker.server.local import LocalServer
from tests.conftest import TEST_MODEL

KEY = "tml-prompt-cache-hits"
REPLY = 6  # tokens per reply (no stop: every reply is exactly this long)
PARAMS = SamplingParams(max_tokens=REPLY, temperature=1.0, seed=11, stop=[])
SDK_PARAMS = types.SamplingParams(max_tokens=REPLY, temperature=1.0, seed=11, stop=[])
ANSWER = [21, 22, 23]  # the environment's answer appended after the reply


def _ok(out: SampleResult | BaseException) -> SampleResult:
    assert isinstance(out, SampleResult), out
    return out


def test_native_backend_counts_the_reused_prefix(engine: Engine) -> None:
    backend = NativeBackend(engine)
    prompt = list(range(30, 45))
    [turn1] = backend.generate([SampleRequest(None, prompt, PARAMS)])
    assert _ok(turn1).prompt_cache_hit_tokens == 0
    nxt = prompt + _ok(turn1).sequences[0].tokens + ANSWER
    [turn2] = backend.generate([SampleRequest(None, nxt, PARAMS, num_samples=3)])
    assert _ok(turn2).prompt_cache_hit_tokens == len(prompt) + REPLY - 1  # once, not per sample
    # a request that needs every prompt position's logits prefills it all: nothing reused
    [scored] = backend.generate([SampleRequest(None, nxt, PARAMS, prompt_logprobs=True)])
    assert _ok(scored).prompt_cache_hit_tokens == 0
    # without the cache nothing is ever reused
    plain = NativeBackend(engine, prefix_cache_bytes=0)
    [again] = plain.generate([SampleRequest(None, nxt, PARAMS)])
    assert _ok(again).prompt_cache_hit_tokens == 0


def _two_turns(sampler: Any, prompt: list[int]) -> tuple[types.SampleResponse, types.SampleResponse]:
    turn1 = sampler.sample(types.ModelInput.from_ints(prompt), 1, SDK_PARAMS).result()
    nxt = prompt + list(turn1.sequences[0].tokens) + ANSWER
    turn2 = sampler.sample(types.ModelInput.from_ints(nxt), 2, SDK_PARAMS).result()
    return turn1, turn2


def test_embedded_client_reports_the_reused_prefix(tmp_path: Path) -> None:
    runtime = Runtime(tmp_path)
    try:
        sampler = opentinker.ServiceClient(runtime=runtime).create_sampling_client(base_model=TEST_MODEL)
        prompt = list(range(50, 62))
        turn1, turn2 = _two_turns(sampler, prompt)
    finally:
        runtime.shutdown()
    assert turn1.prompt_cache_hit_tokens == 0
    assert turn2.prompt_cache_hit_tokens == len(prompt) + REPLY - 1


@pytest.fixture
def sdk_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    for var in ("TINKER_API_KEY", "TINKER_BASE_URL", "TINKER_PROJECT_ID"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def server(tmp_path: Path, sdk_env: None) -> Iterator[LocalServer]:
    with LocalServer(["--dev", "--base-model", TEST_MODEL], data_dir=tmp_path / "srv") as srv:
        yield srv


def test_sdk_over_http_reports_the_reused_prefix(server: LocalServer) -> None:
    service = tinker.ServiceClient(base_url=server.base_url, api_key=KEY)
    try:
        sampler = service.create_sampling_client(base_model=TEST_MODEL).result()
        prompt = list(range(70, 81))
        turn1, turn2 = _two_turns(sampler, prompt)
    finally:
        service.close("success").result()
    assert turn1.prompt_cache_hit_tokens == 0
    assert turn2.prompt_cache_hit_tokens == len(prompt) + REPLY - 1
