"""One program, two front-ends, one lifecycle: the embedded ``ServiceClient`` and the official
``tinker`` SDK against a real server (uvicorn on a thread of this process, real HTTP) run the same
program and get the same results, because both call the service's ``Lifecycle``:

- training and greedy sampling (losses and tokens equal);
- inflight samplers: an earlier inflight sampler follows a newer inflight save (its next sample
  equals the newest sampler's);
- eviction of a quiet session's model: its state is saved to ``weights/evicted-<time>``, its
  requests are refused naming that checkpoint, its inflight samplers are retired saying why, and
  a model restored from the checkpoint trains on exactly as the model would have;
- session finish: the restored model is freed with its session and refused after.

The eviction is started by the service's ``evict_idle(0.0)`` on each runtime (every session is
quiet for zero seconds), which the server's sweeper calls with ``--session-inactive-s``. After
``close`` the SDK refuses the session's clients itself, so that its models left memory is read
from the runtime serving it.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import tinker
import uvicorn
from tinker import types

import opentinker
from opentinker.server.app import create_app
from opentinker.server.config import ServerConfig
from opentinker.service import Runtime
from opentinker.service.config import RuntimeConfig
from opentinker.service.lifecycle import lifecycle_of
from tests.conftest import TEST_MODEL

KEY = "tml-parity-test-key-0001"
TOKENS = list(range(5, 17))
GREEDY = types.SamplingParams(max_tokens=4, temperature=0.0)


def _until(cond: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _datum(tokens: list[int]) -> types.Datum:
    inputs: dict[str, Any] = {"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)}
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


def _step(tc: Any) -> float:
    out = tc.forward_backward([_datum(TOKENS)], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    return float(out.metrics["loss:sum"])


def _sample(client: Any) -> list[int]:
    prompt = types.ModelInput.from_ints(TOKENS[:5])
    return list(client.sample(prompt, 1, GREEDY).result().sequences[0].tokens)


def _refusal(call: Callable[[], Any]) -> str:
    try:
        call()
    except Exception as e:
        return str(e)
    raise AssertionError("the call was not refused")


def _program(service: Any, runtime: Runtime) -> dict[str, Any]:
    """The program both front-ends run (``runtime``: the one serving it); returns what it saw."""
    seen: dict[str, Any] = {}
    tc = service.create_lora_training_client(base_model=TEST_MODEL, rank=2, seed=0).result()
    seen["losses"] = [_step(tc)]
    first = tc.save_weights_and_get_sampling_client(kind="inflight").result()
    seen["first_samples"] = [_sample(first)]
    seen["losses"].append(_step(tc))
    newest = tc.save_weights_and_get_sampling_client(kind="inflight").result()
    seen["first_follows_newest"] = _sample(first) == _sample(newest)
    seen["newest_sample"] = _sample(newest)

    assert lifecycle_of(runtime).evict_idle(3600.0) == []  # an active session keeps its models
    assert lifecycle_of(runtime).evict_idle(0.0) == [tc.model_id]
    rest = service.create_rest_client()

    def saved() -> list[str]:
        ckpts = rest.list_checkpoints(tc.model_id).result().checkpoints
        return [c.tinker_path for c in ckpts if c.checkpoint_id.startswith("weights/evicted-")]

    _until(lambda: bool(saved()), "the eviction's save")
    [path] = saved()
    seen["evicted_checkpoint"] = path.split("/", 3)[-1].split("-")[0]  # "weights/evicted"
    _until(lambda: "evicted" in _refusal(lambda: tc.forward_backward([_datum(TOKENS)], "cross_entropy").result()), "the model to leave memory")  # fmt: skip
    said = _refusal(lambda: tc.forward_backward([_datum(TOKENS)], "cross_entropy").result())
    seen["model_refusal_names_checkpoint"] = path in said and "was evicted from memory" in said
    said = _refusal(lambda: _sample(first))
    seen["inflight_refusal"] = said.split("which are gone: ", 1)[-1]

    restored = service.create_training_client_from_state_with_optimizer(path).result()
    seen["losses"].append(_step(restored))

    service.close("success").result()
    seen["freed_with_session"] = runtime.models[restored.model_id].deleted  # the SDK refuses locally
    return seen


@contextlib.contextmanager
def _served(app: Any) -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        _until(lambda: server.started or not thread.is_alive(), "uvicorn to start")
        assert server.started
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)


def test_one_program_gives_the_same_results_embedded_and_over_http(tmp_path: Path) -> None:
    runtime = Runtime(tmp_path / "embedded", memory_budget="off")  # eviction: without a budget
    try:
        embedded = _program(opentinker.ServiceClient(runtime=runtime), runtime)
    finally:
        runtime.shutdown()

    # the server's own sweeper would evict after an hour; the program starts the eviction itself
    config = ServerConfig(
        tmp_path / "server", base_models=(TEST_MODEL,), dev=True, session_inactive_s=3600.0,
        runtime=RuntimeConfig(memory_budget="off"),
    )  # fmt: skip
    app = create_app(config)
    with _served(app) as base_url:
        over_http = _program(tinker.ServiceClient(base_url=base_url, api_key=KEY), app.state.server.runtime)

    assert embedded["first_follows_newest"] and embedded["model_refusal_names_checkpoint"]
    assert embedded["freed_with_session"] and embedded["evicted_checkpoint"] == "weights/evicted"
    assert "the model was evicted (its state is saved at tinker://" in embedded["inflight_refusal"]
    embedded_losses, http_losses = embedded.pop("losses"), over_http.pop("losses")
    assert len(http_losses) == 3 and http_losses == embedded_losses
    # each side's checkpoint path names its own session; the reason's words are the same
    for seen in (embedded, over_http):
        seen["inflight_refusal"] = seen["inflight_refusal"].split("tinker://", 1)[0]
    assert over_http == embedded
