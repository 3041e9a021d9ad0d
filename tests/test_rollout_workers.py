"""Rollout worker processes (opentinker/rollout): sampling served by N = 2 worker processes, each
with its own copy of the base model, snapshots handed to them as safetensors bytes.

Every result is compared with in-process sampling of the same request: the parent engine's
``NativeBackend.generate`` (one batch to completion) or an embedded ``Runtime`` with no workers.
Greedy and seeded T = 1 tokens must be identical, logprobs within ``LOGPROB_ATOL`` (fp32 rounding
of another batch shape: tests/tolerances.py). One runtime with two workers serves the module; the
fault tests kill its workers with ``kill -9`` and check that they come back.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import tinker
from tinker import types

import opentinker
from opentinker.engine import AdamParams, Engine, EngineError, ForwardRequest, UnknownPolicyError
from opentinker.lora import LoRAConfig
from opentinker.sampling import NativeBackend, SampleRequest, SampleResult, SamplingParams
from opentinker.sampling.handles import SampleCancelled
from opentinker.sampling.loop import Done
from opentinker.server.local import LocalServer
from opentinker.service.runtime import Runtime
from opentinker.workers.pool import WorkerPool
from opentinker.workers.process import WorkerStartError
from opentinker.workers.wire import (
    Cancel,
    LoRABytes,
    Publish,
    Published,
    Sample,
    WorkerOptions,
    from_bytes,
    to_bytes,
)
from opentinker.workers.worker import WorkerCore
from tests.conftest import TEST_MODEL, make_examples
from tests.tolerances import LOGPROB_ATOL, assert_greedy_equal, assert_logprobs_close

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, stop=[])
SEEDED = SamplingParams(max_tokens=24, temperature=1.0, seed=7, stop=[])


class Served:
    """A runtime whose sampling runs in two rollout workers (processes unless ``runtime_options``
    say otherwise), its engine, pool and a reference."""

    def __init__(self, data_dir: Path, **runtime_options: Any) -> None:
        self.runtime = Runtime(data_dir, rollout_workers=2, **runtime_options)
        backend = self.runtime.base_stack(TEST_MODEL)
        self.engine: Engine = backend.engine
        pool = backend.scheduler.rollout
        assert isinstance(pool, WorkerPool)
        self.pool = pool
        self.scheduler = backend.scheduler
        self.reference = NativeBackend(self.engine, prefix_cache_bytes=0)  # in process, each alone

    def train_snapshot(self, aid: str, seed: int) -> str:
        self.engine.forward_backward(ForwardRequest(aid, make_examples(4, self.engine.vocab_size, seed=seed)))
        self.engine.optim_step(aid, AdamParams(learning_rate=2e-2))
        return self.engine.snapshot(aid).snapshot_id

    def sample(self, reqs: list[SampleRequest], timeout: float = 180) -> list[SampleResult | BaseException]:
        futs = [self.scheduler.submit_sample(r).future for r in reqs]
        out: list[SampleResult | BaseException] = []
        for f in futs:
            try:
                out.append(f.result(timeout=timeout))
            except Exception as e:
                out.append(e)
        return out


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    s = Served(tmp_path_factory.mktemp("workers"))
    yield s
    s.runtime.shutdown()


@pytest.fixture(scope="module")
def snaps(served: Served) -> list[str | None]:
    a = served.engine.create_adapter(LoRAConfig(rank=4, seed=0))
    b = served.engine.create_adapter(LoRAConfig(rank=8, seed=1, train_mlp=False))
    return [served.train_snapshot(a, 1), served.train_snapshot(b, 2), None]


def _same(got: SampleResult | BaseException, want: SampleResult | BaseException) -> None:
    assert isinstance(got, SampleResult), got
    assert isinstance(want, SampleResult), want
    assert len(got.sequences) == len(want.sequences)
    for g, w in zip(got.sequences, want.sequences, strict=True):
        assert g.tokens == w.tokens and g.stop_reason == w.stop_reason
        assert_logprobs_close(g.logprobs, w.logprobs)
    if want.prompt_logprobs is not None:
        assert got.prompt_logprobs is not None
        assert got.prompt_logprobs[0] is None
        assert_logprobs_close(got.prompt_logprobs[1:], want.prompt_logprobs[1:])  # type: ignore[arg-type]


def _same_up_to_near_ties(
    got: SampleResult | BaseException, req: SampleRequest, reference: NativeBackend
) -> None:
    """Long greedy rows: tokens identical up to the first near tie of the reference's top two
    logprobs (where the paths' fp32 rounding may pick either), logprobs close up to there."""
    [want] = reference.generate([replace(req, topk_sample_logprobs=2)])
    assert isinstance(got, SampleResult) and isinstance(want, SampleResult), (got, want)
    for g, w in zip(got.sequences, want.sequences, strict=True):
        assert w.topk_logprobs is not None
        gaps = [top[0][1] - top[1][1] for top in w.topk_logprobs]
        assert_greedy_equal(g.tokens, w.tokens, gaps=gaps, gap_tol=2 * LOGPROB_ATOL)
        n = next((i for i, x in enumerate(gaps) if x < 2 * LOGPROB_ATOL), len(gaps))
        assert_logprobs_close(g.logprobs[:n], w.logprobs[:n])


def _requests(
    policies: list[str | None], n: int, params: SamplingParams, num_samples: int = 1
) -> list[SampleRequest]:
    """``n`` requests cycling over ``policies``, each with its own prompt (and seed, if seeded)."""
    out = []
    for i in range(n):
        p = replace(params, seed=params.seed + i) if params.seed is not None else params
        out.append(SampleRequest(policies[i % len(policies)], [1, 5 + i, 9, 20 + 3 * i, 7], p, num_samples))
    return out


def _wait(cond: object, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():  # type: ignore[operator]
            return
        time.sleep(0.02)
    raise AssertionError("condition not met in time")


# ---------------------------------------------------------------------- equivalence
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_two_workers_sample_what_in_process_sampling_does(
    served: Served, snaps: list[str | None], params: SamplingParams
) -> None:
    reqs = _requests(snaps, 9, params, num_samples=3)
    reqs.append(SampleRequest(snaps[0], [3, 4, 5, 6, 7, 8], params, prompt_logprobs=True))
    got = served.sample(reqs)
    for g, r in zip(got, reqs, strict=True):
        [want] = served.reference.generate([r])
        _same(g, want)
    assert sum(served.pool.stats.served) >= len(reqs)
    assert all(n > 0 for n in served.pool.stats.served[:2])  # both workers served


def test_handoff_is_bytes_once_per_worker_per_version(served: Served, snaps: list[str | None]) -> None:
    before = served.pool.stats.published
    served.sample(_requests(snaps[:1], 6, GREEDY))
    served.sample(_requests(snaps[:1], 6, GREEDY))
    wire = next(
        w
        for w in served.pool.worker_snapshots(0) | served.pool.worker_snapshots(1)
        if w.startswith(str(snaps[0]))
    )
    holders = [i for i in range(2) if wire in served.pool.worker_snapshots(i)]
    assert holders and served.pool.stats.published - before <= 2 - len(holders) + len(holders)
    # the bytes round-trip to the same tensors
    w = served.engine.adapter_weights(snaps[0])
    cfg, data = to_bytes(w)
    assert isinstance(data, bytes)
    back = from_bytes(cfg, data)
    assert back.config == w.config and all(
        (back.state_dict()[k] == t).all() for k, t in w.state_dict().items()
    )


def test_a_pinned_snapshot_stays_pinned_after_a_newer_publish(served: Served) -> None:
    aid = served.engine.create_adapter(LoRAConfig(rank=4, seed=3))
    v1 = served.train_snapshot(aid, 5)
    req = SampleRequest(v1, [2, 4, 6, 8], SEEDED)
    [first] = served.sample([req])
    v2 = served.train_snapshot(aid, 6)
    [again, newer] = served.sample([req, replace(req, policy=v2)])
    _same(again, first)
    [want_v2] = served.reference.generate([replace(req, policy=v2)])
    _same(newer, want_v2)
    assert isinstance(newer, SampleResult) and isinstance(first, SampleResult)
    assert newer.sequences[0].logprobs != first.sequences[0].logprobs


def test_bad_requests_fail_alone_with_the_in_process_errors(served: Served, snaps: list[str | None]) -> None:
    ctx = served.engine.max_context
    good = SampleRequest(snaps[0], [1, 2, 3], GREEDY)
    bad = [
        SampleRequest("nope@v9", [1, 2, 3], GREEDY),
        SampleRequest(snaps[0], [1] * ctx, GREEDY),
        SampleRequest(snaps[1], [1, 2, 3], replace(GREEDY, max_tokens=0)),
        SampleRequest(snaps[1], [1, 2, 3], replace(GREEDY, top_p=0.0)),
    ]
    got = served.sample([good, *bad, good])
    _same(got[0], served.reference.generate([good])[0])
    _same(got[-1], got[0])
    for g, r in zip(got[1:-1], bad, strict=True):
        [want] = served.reference.generate([r])
        assert isinstance(want, EngineError) and type(g) is type(want) and str(g) == str(want)


def test_a_retired_snapshot_is_refused_and_freed_on_the_workers(served: Served) -> None:
    aid = served.engine.create_adapter(LoRAConfig(rank=4, seed=4))
    sid = served.train_snapshot(aid, 7)
    served.sample([SampleRequest(sid, [1, 2, 3], GREEDY)] * 4)
    held = lambda: [w for i in range(2) for w in served.pool.worker_snapshots(i) if w.startswith(sid + "#")]  # noqa: E731
    assert held()
    pending = served.scheduler.submit_sample(
        SampleRequest(sid, [1, 2, 3], replace(GREEDY, max_tokens=64))
    ).future
    served.runtime.release_snapshot(TEST_MODEL, sid)
    _wait(lambda: sid not in served.engine.snapshot_ids())
    assert isinstance(pending.result(timeout=60), SampleResult)  # submitted before: finishes on it
    [late] = served.sample([SampleRequest(sid, [1, 2, 3], GREEDY)])
    assert isinstance(late, UnknownPolicyError) and sid in str(late)
    _wait(lambda: not held(), timeout=30)  # Retire reached every worker holding it
    assert served.pool.stats.retired >= 1


def test_a_conversations_next_turn_goes_to_the_worker_holding_its_prefix(
    served: Served, snaps: list[str | None]
) -> None:
    first = SampleRequest(snaps[1], [1, 9, 8, 7, 6, 5, 4, 3, 2, 11], GREEDY)
    [turn1] = served.sample([first])
    assert isinstance(turn1, SampleResult)
    routed = served.pool.stats.prefix_routed
    nxt = SampleRequest(snaps[1], first.prompt + turn1.sequences[0].tokens + [12, 13], GREEDY)
    [turn2] = served.sample([nxt])
    assert served.pool.stats.prefix_routed == routed + 1
    _same(turn2, served.reference.generate([nxt])[0])
    # the worker's prefix cache served turn 2's prompt, and the count crossed the process boundary:
    # all of turn 1's prompt and reply but the reply's last token (never fed to the model)
    assert turn1.prompt_cache_hit_tokens == 0
    assert isinstance(turn2, SampleResult)
    assert turn2.prompt_cache_hit_tokens == len(first.prompt) + len(turn1.sequences[0].tokens) - 1


# ---------------------------------------------------------------------- faults
@pytest.mark.slow  # a worker restart loads a base model (seconds; more on a loaded machine)
def test_kill_9_mid_decode_reruns_its_requests_and_the_worker_comes_back(
    served: Served, snaps: list[str | None]
) -> None:
    pool = served.pool
    long = replace(GREEDY, max_tokens=min(400, served.engine.max_context - 16))
    reqs = _requests(snaps, 8, long, num_samples=2)
    rerun, restarts, pids = pool.stats.rerun, pool.stats.restarts[0], pool.worker_pids()
    futs = [served.scheduler.submit_sample(r).future for r in reqs]
    _wait(lambda: len(pool._slots[0].inflight) > 0)
    time.sleep(0.2)  # decoding
    assert not all(f.done() for f in futs)
    os.kill(pids[0], signal.SIGKILL)  # type: ignore[arg-type]
    got = [f.result(timeout=180) for f in futs]
    for g, r in zip(got, reqs, strict=True):
        _same_up_to_near_ties(g, r, served.reference)
    assert pool.stats.rerun > rerun
    pool.wait_ready(timeout=180)
    assert pool.stats.restarts[0] == restarts + 1 and pool.worker_pids()[0] not in (None, pids[0])
    # the restarted worker holds nothing: it receives the snapshots its requests need, and serves
    served_before = pool.stats.served[0]
    more = _requests(snaps, 6, GREEDY)
    for g, r in zip(served.sample(more), more, strict=True):
        _same(g, served.reference.generate([r])[0])
    assert pool.stats.served[0] > served_before


@pytest.mark.slow  # starts a third worker
def test_a_late_joining_worker_serves_the_current_snapshots(served: Served, snaps: list[str | None]) -> None:
    pool = served.pool
    index = pool.add_worker()
    assert pool.worker_snapshots(index) == set()
    reqs = _requests(snaps[:2], 9, SEEDED)
    for g, r in zip(served.sample(reqs), reqs, strict=True):
        _same(g, served.reference.generate([r])[0])
    assert pool.stats.served[index] > 0
    assert any(
        w.startswith(str(snaps[0]) + "#") or w.startswith(str(snaps[1]) + "#")
        for w in pool.worker_snapshots(index)
    )


def test_a_worker_that_cannot_start_fails_at_start_up_naming_it(tmp_path: Path, engine: Engine) -> None:
    """A bad backend name is refused by the runtime at once; a worker whose start-up fails (here:
    the pool asks it for a backend it does not have) fails the pool's start naming the worker and
    the cause, within the handshake's timeout rather than hanging."""
    with pytest.raises(ValueError, match="unknown rollout backend 'no-such-backend'"):
        Runtime(tmp_path, rollout_workers=1, rollout_backend="no-such-backend")
    with pytest.raises(ValueError, match="rollout_workers"):
        Runtime(tmp_path, rollout_workers=-1)
    pin = NativeBackend(engine, lean_decode=False, prefix_cache_bytes=0).decoder(snapshots_only=True).pin
    t = time.monotonic()
    with pytest.raises(
        WorkerStartError,
        match=r"rollout worker 0 could not start: .*unknown rollout backend 'no-such-backend'",
    ):
        WorkerPool(
            engine, pin, 1, WorkerOptions(TEST_MODEL, backend="no-such-backend", max_rank=engine.max_rank)
        )
    assert time.monotonic() - t < 120


def test_worker_core_publishes_whole_snapshots_and_cancels_waiting_requests(
    served: Served, snaps: list[str | None]
) -> None:
    """The transport-agnostic core, driven by messages in this process."""
    core = WorkerCore(7, WorkerOptions(TEST_MODEL, prefix_cache_bytes=0))
    cfg, data = to_bytes(served.engine.adapter_weights(snaps[0]))
    assert core.handle(Publish("s#1", LoRABytes(cfg, data))) == [Published("s#1")]
    req = SampleRequest("s#1", [1, 5, 9, 20, 7], GREEDY)
    assert core.handle(Sample(1, req)) == [] and core.handle(Sample(2, req)) == []
    [cancelled] = core.handle(Cancel(2))
    assert isinstance(cancelled, Done) and isinstance(cancelled.error, SampleCancelled)
    done: list[Done] = []
    while core.busy:
        done += [m for m in core.tick() if isinstance(m, Done)]  # its results (and Rows)
    [d] = done
    _same(d.result, served.reference.generate([replace(req, policy=snaps[0])])[0])  # type: ignore[arg-type]
    [refused] = core.handle(Sample(3, replace(req, policy="unknown#2")))
    assert isinstance(refused, Done) and isinstance(refused.error, UnknownPolicyError)


@pytest.mark.slow  # the killed worker restarts (loads a base model)
def test_a_handoff_cut_by_a_dying_worker_is_sent_again(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker a snapshot's tensors go to is killed (kill -9) right after the Publish is sent,
    before it answers: the request still runs, on weights sent again whole, and gives the
    in-process result; the dead worker is restarted."""
    pool = served.pool
    aid = served.engine.create_adapter(LoRAConfig(rank=4, seed=9))
    sid = served.train_snapshot(aid, 11)
    real, killed = pool._send_publish, []

    def send_then_die(slot: Any, wire: str, pinned: Any) -> None:
        real(slot, wire, pinned)
        if wire.startswith(sid + "#") and not killed:
            killed.append(slot.index)
            os.kill(slot.handle.pid, signal.SIGKILL)
            slot.handle.proc.join(timeout=10)  # dead before the request can follow the tensors

    monkeypatch.setattr(pool, "_send_publish", send_then_die)
    sent, restarts = pool.stats.published, sum(pool.stats.restarts)
    req = SampleRequest(sid, [1, 5, 9, 20, 7, 3], GREEDY)
    [got] = served.sample([req], timeout=240)
    _same(got, served.reference.generate([req])[0])
    assert killed, "no handoff of the snapshot was cut"
    assert pool.stats.published >= sent + 2  # the tensors were sent again, to a live worker
    holders = [
        i for i in range(len(pool._slots)) if any(w.startswith(sid + "#") for w in pool.worker_snapshots(i))
    ]
    assert holders  # a live worker acknowledged the snapshot whole
    pool.wait_ready(timeout=240)
    assert sum(pool.stats.restarts) == restarts + 1


def test_a_torn_snapshot_payload_is_never_registered(served: Served, snaps: list[str | None]) -> None:
    """Bytes that are not a whole snapshot are refused before anything is registered, so no request
    can run on part of one; the whole payload sent afterwards serves."""
    core = WorkerCore(8, WorkerOptions(TEST_MODEL, prefix_cache_bytes=0))
    cfg, data = to_bytes(served.engine.adapter_weights(snaps[1]))
    with pytest.raises(EngineError, match="snapshot 's#2' arrived incomplete"):
        core.handle(Publish("s#2", LoRABytes(cfg, data[: len(data) // 2])))
    assert core.snapshot_ids() == []
    req = SampleRequest("s#2", [1, 5, 9, 20, 7], GREEDY)
    [refused] = core.handle(Sample(1, req))
    assert isinstance(refused, Done) and isinstance(refused.error, UnknownPolicyError)
    assert core.handle(Publish("s#2", LoRABytes(cfg, data))) == [Published("s#2")]
    assert core.handle(Sample(2, req)) == []
    done: list[Done] = []
    while core.busy:
        done += [m for m in core.tick() if isinstance(m, Done)]  # its results (and Rows)
    [d] = done
    _same(d.result, served.reference.generate([replace(req, policy=snaps[1])])[0])  # type: ignore[arg-type]


# ---------------------------------------------------------------------- RL loops
class _Recorder:
    """A training client that keeps every batch of datums the RL loop trains on."""

    def __init__(self, tc: Any) -> None:
        self.tc, self.batches = tc, []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tc, name)

    def forward_backward(self, data: list[types.Datum], *a: Any, **k: Any) -> Any:
        self.batches.append(data)
        return self.tc.forward_backward(data, *a, **k)


def _rl_run(runtime: Runtime, log_dir: Path) -> tuple[list[dict[str, Any]], list[list[types.Datum]]]:
    import asyncio

    from opentinker.renderers import ChatMLRenderer
    from opentinker.rl import RLConfig, run_rl
    from opentinker.tasks.arithmetic import AdditionDataset

    service = opentinker.ServiceClient(runtime=runtime)
    renderer = ChatMLRenderer(runtime.base_stack(TEST_MODEL).engine.base.tokenizer)
    cfg = RLConfig(
        base_model=TEST_MODEL, log_dir=str(log_dir), steps=2, groups_per_step=2, group_size=3,
        lora_rank=4, learning_rate=5e-3, max_tokens=10, progress=False, drop_constant_groups=False,
        eval_every=0,
    )  # fmt: skip
    tc = _Recorder(service.create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=0))
    dataset = AdditionDataset(renderer, cfg.groups_per_step, cfg.group_size, seed=cfg.seed)
    res = asyncio.run(run_rl(cfg, service, dataset, None, training_client=tc))
    return res.metrics, tc.batches


def test_the_rl_loop_with_two_workers_trains_on_what_in_process_sampling_gives(
    served: Served, tmp_path: Path
) -> None:
    """Two steps of the library's RL loop (seeded T = 1 sampling, the second step on the first
    step's trained snapshot): the datums trained on carry the same tokens and advantages, and the
    sampler's logprobs within LOGPROB_ATOL, whether the workers or this process sampled."""
    got_rows, got = _rl_run(served.runtime, tmp_path / "workers")
    want_rows, want = _rl_run(Runtime(tmp_path / "local"), tmp_path / "local-run")
    assert len(got) == len(want) == 2
    for gb, wb in zip(got, want, strict=True):
        assert len(gb) == len(wb) > 0
        for g, w in zip(gb, wb, strict=True):
            assert g.model_input.to_ints() == w.model_input.to_ints()
            gi, wi = g.loss_fn_inputs, w.loss_fn_inputs
            assert gi["target_tokens"].tolist() == wi["target_tokens"].tolist()
            assert gi["advantages"].tolist() == wi["advantages"].tolist()
            assert_logprobs_close(gi["logprobs"].tolist(), wi["logprobs"].tolist())
    for g, w in zip(got_rows, want_rows, strict=True):
        assert g["reward/mean"] == w["reward/mean"] and g["env/episodes"] == w["env/episodes"]


# ---------------------------------------------------------------------- over HTTP
@pytest.mark.slow
def test_the_sdk_over_http_with_two_rollout_workers_matches_in_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    for var in ("TINKER_API_KEY", "TINKER_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    srv = LocalServer(
        ["--dev", "--base-model", TEST_MODEL, "--rollout-workers", "2"], data_dir=tmp_path / "srv"
    )
    srv.start()
    try:
        remote = tinker.ServiceClient(base_url=srv.base_url, api_key="tml-workers-probe-0001")
        local = opentinker.ServiceClient(runtime=Runtime(tmp_path / "local"))
        got = _probe(remote)
        want = _probe(local)
        remote.close("success").result()
    finally:
        srv.stop()
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g[0] == w[0]
        assert_logprobs_close(g[1], w[1])


def _probe(service: tinker.ServiceClient) -> list[tuple[list[int], list[float]]]:
    tc = service.create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=0)
    if hasattr(tc, "result"):
        tc = tc.result()  # type: ignore[assignment]
    toks = list(range(3, 27))
    inputs: dict[str, Any] = {"target_tokens": toks[1:], "weights": [1.0] * (len(toks) - 1)}
    datum = types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]), loss_fn_inputs=inputs)
    for _ in range(2):
        tc.forward_backward([datum], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(toks[:8])
    out: list[tuple[list[int], list[float]]] = []
    for params in (
        types.SamplingParams(max_tokens=12, temperature=0.0, stop=[]),
        types.SamplingParams(max_tokens=12, temperature=1.0, seed=5, stop=[]),
    ):
        res = sampler.sample(
            prompt, num_samples=3, sampling_params=params, include_prompt_logprobs=True
        ).result()
        out += [(list(s.tokens), list(s.logprobs or [])) for s in res.sequences]
        out.append(([], [x for x in (res.prompt_logprobs or [])[1:] if x is not None]))
    lp = sampler.compute_logprobs(types.ModelInput.from_ints(toks)).result()
    out.append(([], [x for x in lp[1:] if x is not None]))
    return out
