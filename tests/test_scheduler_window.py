"""The scheduler's batching window: clients in a loop fall into lockstep; a lone client never waits.

The contract (scheduler/scheduler.py): before a tick the scheduler waits until every client that
had work in the previous tick has queued its next operation. So each client's next operation runs
in the very next tick — a client in a loop has work in every tick from its first to its last, and
never trails into a tick of its own. The tests record the tick of every operation of every client
(calls read the tick counter while they run, a sample among them, decoded inside the tick;
forward and optimizer results carry ``clock_cycle:unique``) and check exactly that; without the window (``max_gather_s=0``) a
client that thinks for a few milliseconds misses the ticks run meanwhile for the others.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections import defaultdict
from typing import Any

from opentinker.engine import AdamParams, Engine, ForwardRequest
from opentinker.lora import LoRAConfig
from opentinker.sampling import NativeBackend, SampleRequest, SamplingParams
from opentinker.scheduler import ModelQueue, Scheduler
from tests.conftest import make_examples

ADAM = AdamParams(learning_rate=1e-3)


def _client_loop(
    sched: Scheduler, model_id: str, rounds: int, think_s: tuple[float, float], seed: int
) -> list[tuple[str, int]]:
    """What an RL client does: sample, think (build data), forward_backward + optim_step, think.
    Returns (operation, tick) for each of its operations, in order."""
    rng = random.Random(seed)
    vocab = sched.engine.vocab_size
    sampler = NativeBackend(sched.engine)
    ops: list[tuple[str, int]] = []

    def call(name: str, fn: Any) -> Any:
        out, tick = sched.submit_call(
            ModelQueue(model_id), lambda eng: (fn(eng), sched.stats.ticks + 1)
        ).result()
        ops.append((name, tick))
        return out

    for r in range(rounds):
        snap = call("snapshot", lambda eng: eng.snapshot(model_id).snapshot_id)
        req = SampleRequest(
            snap, [5, 6, 7], SamplingParams(max_tokens=2, temperature=1.0, seed=r), num_samples=2
        )
        call("sample", lambda _eng, req=req: sampler.generate([req]))
        time.sleep(rng.uniform(*think_s))  # longer than gather_s: the old quiet window split these
        fb = sched.submit_forward(model_id, ForwardRequest(model_id, make_examples(2, vocab, seed=seed + r)))
        opt = sched.submit_optim(model_id, ADAM)
        fb_tick, opt_tick = (
            int(fb.result().metrics["clock_cycle:unique"]),
            int(opt.result()["clock_cycle:unique"]),
        )
        if sched.max_gather_s > 0:  # with no window at all, a tick may start between the two
            assert fb_tick == opt_tick  # a pipelined optim_step joins its forward_backward's tick
        ops.append(("forward_backward+optim_step", fb_tick))
        call("release", lambda eng, s=snap: eng.release_snapshot(s))
        time.sleep(rng.uniform(*think_s))
    return ops


def _run_clients(sched: Scheduler, n: int, rounds: int) -> list[list[tuple[str, int]]]:
    ids = [sched.engine.create_adapter(LoRAConfig(rank=2, seed=i)) for i in range(n)]
    out: list[list[tuple[str, int]]] = [[] for _ in ids]
    errors: list[BaseException] = []

    def client(i: int) -> None:
        try:
            out[i] = _client_loop(sched, ids[i], rounds, (0.005, 0.03), i)
        except BaseException as e:  # surfaced below: a thread's assertion must fail the test
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def _scheduler(engine: Engine, max_gather_s: float) -> Scheduler:
    return Scheduler(engine, max_gather_s=max_gather_s)


def test_clients_in_a_loop_have_work_in_every_tick(engine: Engine) -> None:
    n, rounds = 4, 4
    sched = _scheduler(engine, max_gather_s=5.0)
    try:
        clients = _run_clients(sched, n, rounds)
    finally:
        sched.shutdown()
    per_tick: dict[int, set[int]] = defaultdict(set)
    for i, ops in enumerate(clients):
        assert len(ops) == 4 * rounds
        ticks = [t for _, t in ops]
        # each next operation in the very next tick: the window waited for this client every time
        assert ticks == list(range(ticks[0], ticks[0] + len(ticks))), (i, ops)
        for t in ticks:
            per_tick[t].add(i)
    # clients start at different moments, so they may be offset by a tick or two, but every tick
    # between the last one's start and the first one's end serves every client
    start, end = max(ops[0][1] for ops in clients), min(ops[-1][1] for ops in clients)
    assert end - start >= 4 * rounds - 4
    assert all(per_tick[t] == set(range(n)) for t in range(start, end + 1))
    assert sched.stats.fused_requests == n * rounds and sched.stats.optim_steps == n * rounds


def test_without_the_window_clients_trail_into_ticks_of_their_own(engine: Engine) -> None:
    """The reference: with no window, thinking clients miss ticks (the check above can fail)."""
    sched = _scheduler(engine, max_gather_s=0.0)
    sched.gather_s = 0.0
    try:
        clients = _run_clients(sched, 4, 2)
    finally:
        sched.shutdown()
    gaps = [b - a for ops in clients for (_, a), (_, b) in itertools.pairwise(ops)]
    assert max(gaps) > 1


def test_a_lone_client_never_waits_for_the_window(engine: Engine) -> None:
    sched = _scheduler(engine, max_gather_s=5.0)
    try:
        model_id = engine.create_adapter(LoRAConfig(rank=2, seed=0))
        t = time.perf_counter()
        ops = _client_loop(sched, model_id, 3, (0.005, 0.01), 0)
        # not one max_gather_s spent waiting for others: 12 operations well inside one window
        assert time.perf_counter() - t < sched.max_gather_s
        ticks = [tk for _, tk in ops]
        assert ticks == list(range(1, len(ops) + 1))  # one tick per operation, none empty or shared
    finally:
        sched.shutdown()
