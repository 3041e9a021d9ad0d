"""The scheduler's batching window: clients in a loop fall into lockstep; a lone client never waits."""

from __future__ import annotations

import random
import threading
import time

from opentinker.engine import AdamParams, Engine, ForwardRequest
from opentinker.lora import LoRAConfig
from opentinker.sampling import NativeBackend, SampleRequest, SamplingParams
from opentinker.scheduler import Scheduler
from tests.conftest import make_examples

ADAM = AdamParams(learning_rate=1e-3)


def _client_loop(
    sched: Scheduler, model_id: str, rounds: int, think_s: tuple[float, float], seed: int
) -> None:
    """What an RL client does: sample, think (build data), forward_backward + optim_step, think."""
    rng = random.Random(seed)
    vocab = sched.engine.vocab_size
    for r in range(rounds):
        snap = sched.submit_call(model_id, lambda eng: eng.snapshot(model_id).snapshot_id).result()
        req = SampleRequest(
            snap, [5, 6, 7], SamplingParams(max_tokens=2, temperature=1.0, seed=r), num_samples=2
        )
        sched.submit_sample(req).result()
        time.sleep(rng.uniform(*think_s))  # longer than gather_s: the old quiet window split these
        fb = sched.submit_forward(model_id, ForwardRequest(model_id, make_examples(2, vocab, seed=seed + r)))
        opt = sched.submit_optim(model_id, ADAM)
        fb.result(), opt.result()
        sched.submit_call(model_id, lambda eng, s=snap: eng.release_snapshot(s)).result()
        time.sleep(rng.uniform(*think_s))


def test_clients_in_a_loop_share_every_tick(engine: Engine) -> None:
    sched = Scheduler(engine, NativeBackend(engine), max_gather_s=5.0)
    try:
        ids = [engine.create_adapter(LoRAConfig(rank=2, seed=i)) for i in range(4)]
        rounds = 4
        threads = [
            threading.Thread(target=_client_loop, args=(sched, m, rounds, (0.005, 0.03), i))
            for i, m in enumerate(ids)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # 4 ops per round (snapshot, sample, forward+optim, release), each shared by all 4 clients
        # once they are in step; the first calls may straggle into up to 3 extra ticks (threads
        # start at different moments). Without the window's lockstep this takes ~7 ticks a round.
        assert sched.stats.ticks <= 4 * rounds + 3, sched.stats
        assert sched.stats.fused_requests == 4 * rounds
    finally:
        sched.shutdown()


def test_a_lone_client_never_waits_for_the_window(engine: Engine) -> None:
    sched = Scheduler(engine, NativeBackend(engine), max_gather_s=5.0)
    try:
        model_id = engine.create_adapter(LoRAConfig(rank=2, seed=0))
        t = time.perf_counter()
        _client_loop(sched, model_id, 3, (0.005, 0.01), 0)
        assert time.perf_counter() - t < 5.0  # not one max_gather_s spent waiting for others
        fb = sched.submit_forward(
            model_id, ForwardRequest(model_id, make_examples(2, engine.vocab_size, seed=9))
        )
        opt = sched.submit_optim(model_id, ADAM)
        assert fb.result().metrics["clock_cycle:unique"] == opt.result()["clock_cycle:unique"]
    finally:
        sched.shutdown()
