"""Shared fixtures: the tiny model (loaded once per session, on the test device) and data helpers.

``OPENTINKER_TEST_DEVICE`` (default ``cpu``) is where the engine-level tests build the base model,
the engine and their own models: ``OPENTINKER_TEST_DEVICE=cuda pytest tests/test_engine_invariants.py
tests/test_sampling.py ...`` runs the invariants on a GPU (``benchmarks/device_check.py`` does that
and the P1-P3 benchmarks in one go). TF32 is turned off there: the tolerances of
``tests/tolerances.py`` are fp32's. Asked for a device that is not there, those tests are skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from opentinker.engine import Engine, Example
from opentinker.models import BaseModel, load_base_model
from opentinker.server.local import LocalServer
from tests import route_coverage

TEST_MODEL = os.environ.get("OPENTINKER_TEST_MODEL", "opentinker/tiny")
TEST_DEVICE = os.environ.get("OPENTINKER_TEST_DEVICE", "cpu")


def other_family_model(folder: Path, family: str) -> str:
    """A random 2-layer ``qwen2`` or ``gpt2`` model with the tiny model's tokenizer, saved to
    ``folder`` (what ``load_base_model`` takes): families with biases (Qwen2) or learned positions (GPT-2)."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

    from opentinker.models.registry import tiny_model_dir

    tok_dir = tiny_model_dir()
    vocab = len(AutoTokenizer.from_pretrained(str(tok_dir)))
    if family == "qwen2":
        model: Any = Qwen2ForCausalLM(
            Qwen2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=48, vocab_size=vocab)
        )  # fmt: skip
    else:
        model = GPT2LMHeadModel(
            GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=vocab, bos_token_id=1, eos_token_id=2)
        )
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(str(tok_dir)).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def device() -> torch.device:
    """The device the engine-level tests run on (``OPENTINKER_TEST_DEVICE``); skips if absent."""
    dev = torch.device(TEST_DEVICE)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            pytest.skip(f"OPENTINKER_TEST_DEVICE={TEST_DEVICE} but torch sees no CUDA device")
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 (tests/tolerances.py)
        torch.backends.cudnn.allow_tf32 = False
    elif dev.type != "cpu":
        try:
            torch.zeros(1, device=dev)
        except (RuntimeError, AssertionError) as e:
            pytest.skip(f"OPENTINKER_TEST_DEVICE={TEST_DEVICE} is not usable here: {e}")
    return dev


@pytest.fixture(scope="session")
def tiny_base(device: torch.device) -> BaseModel:
    torch.manual_seed(0)
    return load_base_model(TEST_MODEL, device=device)


@pytest.fixture
def engine(tiny_base: BaseModel) -> Engine:
    """A fresh engine (no adapters) over the shared, frozen tiny base model, on its device."""
    return Engine(tiny_base, max_rank=64)


def make_examples(
    n: int, vocab: int, *, seed: int, min_len: int = 5, max_len: int = 17, rl: bool = False
) -> list[Example]:
    """Random datums of varied lengths; ``rl`` adds sampler logprobs and advantages."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(min_len, max_len, (1,), generator=g))
        seq = torch.randint(3, vocab, (length + 1,), generator=g)
        inputs: dict[str, torch.Tensor] = {"target_tokens": seq[1:].clone()}
        if rl:
            inputs["logprobs"] = -torch.rand(length, generator=g) * 3 - 2
            inputs["advantages"] = torch.randn(length, generator=g)
        else:
            w = (torch.rand(length, generator=g) > 0.3).float()
            inputs["weights"] = w
        out.append(Example(seq[:-1].clone(), inputs))
    return out


class SlowSampler:
    """A sampling client that takes ``delay`` seconds per call (as on a loaded machine)."""

    def __init__(self, inner: Any, delay: float) -> None:
        self.inner, self.delay = inner, delay

    async def sample(self, **kw: Any) -> Any:
        await asyncio.sleep(self.delay)
        return await self.inner.sample_async(**kw)


@pytest.fixture(scope="session", autouse=True)
def sdk_background_loop_stopped() -> Iterator[None]:
    """At the session's end, stop the ``tinker`` SDK's background event loop (one daemon thread per
    process, shared by every ``ServiceClient``). Tests leave clients open after their server has
    gone; their heartbeat and token-refresh tasks keep logging to stderr from that thread, and a
    daemon thread that writes while the interpreter finalizes aborts the process (SIGABRT, exit
    134) after every test has passed. Cancelling its tasks and joining it first ends that."""
    yield
    from tinker.lib import internal_client_holder as holders

    logging.getLogger("tinker").setLevel(logging.CRITICAL)
    single = holders._internal_client_holder_thread_singleton
    loop, thread = single.loop_if_started(), getattr(single, "_thread", None)
    if loop is None or thread is None or not loop.is_running():
        return

    async def cancel_all() -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    with contextlib.suppress(Exception):
        asyncio.run_coroutine_threadsafe(cancel_all(), loop).result(timeout=30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=30)


SDK_ENV = ("TINKER_API_KEY", "TINKER_BASE_URL", "TINKER_PROJECT_ID", "TINKER_CREDENTIAL_CMD")


@contextlib.contextmanager
def local_server(
    tmp_path_factory: pytest.TempPathFactory,
    name: str,
    *args: str,
    dev: bool = True,
    base_model: str = TEST_MODEL,
    threads: int | None = None,
) -> Iterator[LocalServer]:
    """A started ``opentinker serve`` child on a free port with ``base_model`` (the tiny model unless told; ``--dev`` unless told
    otherwise), over a fresh data dir named ``name``; stopped on exit. The SDK's environment
    variables are cleared (so a developer's own settings never leak into a test) and its telemetry is
    off; ``threads`` sets the child's ``OMP_NUM_THREADS``."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TINKER_TELEMETRY", "0")
        for var in SDK_ENV:
            mp.delenv(var, raising=False)
        if threads is not None:
            mp.setenv("OMP_NUM_THREADS", str(threads))
        argv = [*(["--dev"] if dev else []), "--base-model", base_model, *args]
        with LocalServer(argv, data_dir=tmp_path_factory.mktemp(name)) as srv:
            yield srv


# ---------------------------------------------------------------------------- the SDK's surface
# Every server the session starts logs the routes it served (route_coverage.py); at the session's
# end, a run of the whole suite in every tier (``-m "slow or not slow"``, as CI's first pass) fails
# unless SDK calls reached the SDK's whole surface. A hook rather than a test that "runs last": it
# sees every module whatever the order, and a partial run (a file, ``-k``, the default tier, which
# deselects the slow tests) is no evidence, so there it is not checked unless
# ``OPENTINKER_ROUTE_CHECK=1`` asks (``=0`` turns it off).
_ROUTE_LOG_GIVEN = route_coverage.ENV in os.environ
_collected_files: set[Path] = set()
_deselected = [0]


def pytest_configure(config: pytest.Config) -> None:
    if not _ROUTE_LOG_GIVEN:
        os.environ[route_coverage.ENV] = tempfile.mkdtemp(prefix="opentinker-routes-")
    route_coverage.instrument_sdk()


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.nodeid.endswith(".py"):
        _collected_files.add(Path(report.fspath).resolve())


def pytest_deselected(items: list[pytest.Item]) -> None:
    _deselected[0] += len(items)


def _whole_suite(session: pytest.Session) -> bool:
    asked = os.environ.get("OPENTINKER_ROUTE_CHECK")
    if asked is not None:
        return asked == "1"
    every_file = {p.resolve() for p in Path(__file__).parent.glob("test_*.py")}
    return (
        not _deselected[0]
        and not session.config.option.keyword
        and every_file <= _collected_files
        and not session.shouldstop
        and not session.shouldfail
    )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    folder = Path(os.environ[route_coverage.ENV])
    try:
        if exitstatus == pytest.ExitCode.INTERRUPTED or not _whole_suite(session):
            return
        from fastapi.routing import APIRoute

        from opentinker.server.app import create_app
        from opentinker.server.config import ServerConfig

        with tempfile.TemporaryDirectory() as data:
            app = create_app(ServerConfig(data_dir=Path(data)))
            try:
                served = [r for r in app.routes if isinstance(r, APIRoute)]
            finally:
                app.state.server.close()
        found = route_coverage.problems(route_coverage.read_log(folder), route_coverage.CALLED, served)
        gaps = route_coverage.unexpected(found)  # known gaps are listed in route_coverage.PENDING
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if gaps and reporter is not None:
            reporter.write_sep("=", "the SDK's surface that no SDK call reached over HTTP", red=True)
            for line in gaps:
                reporter.write_line(line)
        if gaps:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
    finally:
        if not _ROUTE_LOG_GIVEN:
            shutil.rmtree(folder, ignore_errors=True)


# ---------------------------------------------------------------------------- no silent skips
# Under ``OPENTINKER_NO_SKIPS=1`` (scripts/check.sh, so CI) or ``CI=true`` every extra is installed
# (scripts/install.sh), and a test that did not run proves nothing: there every skip is a failure
# (a ``pytest.importorskip`` of Ray, vLLM, peft, playwright, wandb, tensorboard, tinker-cookbook or
# the SDK, the browser tests' chromium, whatever its reason says) except those that depend on the
# machine, which :data:`MACHINE_SKIP` names: OPENTINKER_TEST_DEVICE absent (conftest's ``device``), a
# CPU without native bf16 or a machine with CUDA (test_dtype.py), a completion without two
# consecutive text tokens (test_sampling.py). An allow-list, so a new skip fails until it is named.
MACHINE_SKIP = re.compile(
    r"but torch sees no CUDA device|is not usable here: |this CPU has no native bf16"
    r"|needs a machine without a CUDA device|no two consecutive text tokens"
)


def _no_skips() -> bool:
    return os.environ.get("OPENTINKER_NO_SKIPS") == "1" or os.environ.get("CI") == "true"


def _fail_extra_skip(report: pytest.TestReport | pytest.CollectReport) -> None:
    if not (report.skipped and _no_skips()) or getattr(report, "wasxfail", None) is not None:
        return
    longrepr = report.longrepr
    reason = str(longrepr[2]) if isinstance(longrepr, tuple) else str(longrepr)
    if not MACHINE_SKIP.search(reason):
        report.outcome = "failed"
        report.longrepr = (
            f"skipped, a failure under OPENTINKER_NO_SKIPS=1 / CI (only a skip that depends on the machine "
            f"stays one: conftest.py's MACHINE_SKIP): {reason}"
        )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    _fail_extra_skip(outcome.get_result())  # type: ignore[attr-defined]


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    outcome = yield
    _fail_extra_skip(outcome.get_result())  # type: ignore[attr-defined]
