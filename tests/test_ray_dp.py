"""Data parallelism over Ray trainer workers: one model's ``forward_backward`` split over k actors,
LoRA gradients all-reduced (gloo) inside them before the optimizer step.

The reference is a plain in-process :class:`~opentinker.engine.Engine` running the whole batch;
k = 1 and k = 2 over the pool must both equal it (losses, per-token logprobs, updated weights) and
the two replicas of k = 2 must hold the same weights bit for bit (they step on the same summed
gradients). Without the all-reduce each replica would follow half the data, far outside these
tolerances (checked: the step on one shard alone differs from the reference).
"""

from __future__ import annotations

import time

import pytest
import torch

from opentinker.engine import AdamParams, Engine, EngineError
from opentinker.lora import LoRAConfig
from tests.conftest import TEST_MODEL, make_examples
from tests.tolerances import (
    REL,
    TRAJECTORY_REL,
    assert_logprobs_close,
    assert_scalar_close,
    assert_state_close,
)

ray = pytest.importorskip("ray")

from opentinker.cluster.dp import DataParallelModel, merge_results, shard_sizes  # noqa: E402
from opentinker.cluster.trainer import ClusterConfigError, TrainerPool  # noqa: E402

pytestmark = pytest.mark.slow  # Ray start-up and two worker processes: ~40 s in all here

CONFIG = LoRAConfig(rank=4, seed=7)
ADAM = AdamParams(learning_rate=1e-2)
STEPS = 3


@pytest.fixture(scope="module")
def pool():
    ray.init(num_cpus=2, object_store_memory=300 * 2**20, include_dashboard=False, log_to_driver=False)
    p = TrainerPool(TEST_MODEL, workers=2, worker_cpus=1)
    yield p
    p.shutdown()
    ray.shutdown()


def batches(vocab: int) -> list[list]:
    return [make_examples(7, vocab, seed=100 + s) for s in range(STEPS)]


def reference_run(data: list[list]) -> tuple[list[float], list[list[torch.Tensor]], list[dict]]:
    eng = Engine(TEST_MODEL)
    from opentinker.engine import ForwardRequest

    aid = eng.create_adapter(CONFIG, "ref")
    losses, logprobs, weights = [], [], []
    for examples in data:
        res = eng.forward_backward(ForwardRequest(aid, examples, "cross_entropy"))
        eng.optim_step(aid, ADAM)
        losses.append(res.metrics["loss:sum"])
        logprobs.append([o["logprobs"] for o in res.outputs])
        weights.append({k: v.detach().clone() for k, v in eng.adapter_weights(aid).state_dict().items()})
    return losses, logprobs, weights


def test_shards_and_merge_are_plain():
    assert shard_sizes(7, 2) == [4, 3] and shard_sizes(1, 3) == [1, 0, 0] and sum(shard_sizes(9, 4)) == 9
    from opentinker.engine import ForwardResult

    a = ForwardResult(
        [{"x": torch.ones(1)}] * 3, {"loss:sum": 2.0, "acc:mean": 1.0, "clock_cycle:unique": 5.0}
    )
    b = ForwardResult([{"x": torch.zeros(1)}], {"loss:sum": 3.0, "acc:mean": 0.0, "clock_cycle:unique": 9.0})
    m = merge_results([a, b], [3, 1])
    assert m.metrics == {"loss:sum": 5.0, "acc:mean": 0.75, "clock_cycle:unique": 5.0}
    assert [float(o["x"]) for o in m.outputs] == [1.0, 1.0, 1.0, 0.0]


def test_data_parallel_k2_equals_k1_and_one_process(pool: TrainerPool):
    vocab = pool.limits["vocab_size"]
    data = batches(vocab)
    ref_losses, ref_lps, ref_weights = reference_run(data)
    runs = {}
    for k in (1, 2):
        model = DataParallelModel(pool, f"dp-k{k}", CONFIG, degree=k)
        assert model.degree == k
        losses, lps, weights = [], [], []
        for examples in data:
            res = model.forward_backward(examples, "cross_entropy")
            model.optim_step(ADAM)
            assert len(res.outputs) == len(examples)
            losses.append(res.metrics["loss:sum"])
            lps.append([o["logprobs"] for o in res.outputs])
            weights.append(model.weights(0))
        if k == 2:  # both replicas stepped on the same summed gradients: the same weights exactly
            other = model.weights(1)
            assert all(torch.equal(other[n], weights[-1][n]) for n in other)
        runs[k] = (losses, lps, weights)
        model.delete()
    for k, (losses, lps, weights) in runs.items():
        for step in range(STEPS):
            assert_scalar_close(losses[step], ref_losses[step])
            for got, want in zip(lps[step], ref_lps[step], strict=True):
                assert_logprobs_close(got, want)
        assert_state_close(weights[0], ref_weights[0], REL)  # one step: one step's rounding
        assert_state_close(weights[-1], ref_weights[-1], TRAJECTORY_REL)
        assert any(float(v.abs().sum()) > 0 for n, v in weights[-1].items() if n.endswith("lora_B")), k
    # the check has teeth: one shard's gradient alone gives another step
    eng = Engine(TEST_MODEL)
    from opentinker.engine import ForwardRequest

    aid = eng.create_adapter(CONFIG, "half")
    eng.forward_backward(ForwardRequest(aid, data[0][:4], "cross_entropy"))
    eng.optim_step(aid, ADAM)
    half = eng.adapter_weights(aid).state_dict()
    with pytest.raises(AssertionError):
        assert_state_close(half, ref_weights[0], REL)


def test_refused_shard_leaves_every_replica_as_it_was(pool: TrainerPool):
    """A datum whose loss is not finite (sampler logprob -1e30: an infinite importance ratio) in
    the second shard: the first shard's gradients are put back, so the next step equals a run
    that never saw the refused batch."""
    vocab = pool.limits["vocab_size"]
    good = make_examples(4, vocab, seed=5, rl=True)
    bad = make_examples(4, vocab, seed=6, rl=True)
    bad[-1].inputs["logprobs"][0] = -1e30
    model = DataParallelModel(pool, "dp-refused", CONFIG, degree=2)
    clean = DataParallelModel(pool, "dp-clean", CONFIG, degree=2)
    try:
        with pytest.raises(EngineError, match="NaN or inf"):
            model.forward_backward(bad, "importance_sampling")
        for m in (model, clean):
            m.forward_backward(good, "importance_sampling")
            m.optim_step(ADAM)
        for r in (0, 1):
            w, c = model.weights(r), clean.weights(r)
            assert all(torch.equal(w[n], c[n]) for n in c)
    finally:
        model.delete()
        clean.delete()


def test_a_worker_holding_a_data_parallel_replica_is_not_removed_below_its_degree(pool: TrainerPool):
    """A scale-down that would leave a data-parallel model fewer live workers than its degree
    is refused, naming the model and why, and no worker is left draining (the handover where
    the degree can be kept: tests/test_ray_dp_scale.py)."""
    dp = DataParallelModel(pool, "dp-scale", CONFIG, degree=2)
    try:
        with pytest.raises(
            ClusterConfigError,
            match=r"0 hold no data-parallel replica .*'dp-scale': degree 2 needs 2 trainer workers, 1 would be left",
        ):
            pool.choose_leaving(1)
        with pytest.raises(ClusterConfigError, match="cannot be scaled below one"):
            pool.choose_leaving(2)
        assert not any(w.draining for w in pool.workers) and len(pool.live_workers()) == 2
    finally:
        dp.delete()


def test_bad_input_is_refused_at_once_changing_nothing(pool: TrainerPool):
    before = pool.placement()
    with pytest.raises(EngineError, match=r"degree 3 is above the number of live trainer workers \(2\)"):
        DataParallelModel(pool, "dp-too-wide", CONFIG, degree=3)
    with pytest.raises(EngineError, match="degree must be an integer >= 1"):
        DataParallelModel(pool, "dp-zero", CONFIG, degree=0)
    with pytest.raises(EngineError, match="needs a LoRA seed"):
        DataParallelModel(pool, "dp-noseed", LoRAConfig(rank=4), degree=2)
    assert pool.placement() == before
    assert all(not w.models for w in pool.workers)
    t0 = time.perf_counter()
    with pytest.raises(
        ClusterConfigError,
        match=r"3 trainer workers × 1 CPU = 3 CPUs asked, but the cluster has 0 CPUs free \(2 in all\)",
    ):
        TrainerPool(TEST_MODEL, workers=3, worker_cpus=1)
    with pytest.raises(
        ClusterConfigError, match="a trainer worker asks for 1 GPUs but the largest Ray node has 0"
    ):
        TrainerPool(TEST_MODEL, workers=1, worker_cpus=0, worker_gpus=1)
    with pytest.raises(ClusterConfigError, match="at least one worker"):
        TrainerPool(TEST_MODEL, workers=0)
    assert time.perf_counter() - t0 < 5  # refused before any actor starts
    # a bad datum (a token outside the vocabulary) is refused before any replica runs
    model = DataParallelModel(pool, "dp-bad-datum", CONFIG, degree=2)
    try:
        w0 = model.weights(0)
        examples = make_examples(3, vocab := pool.limits["vocab_size"], seed=1)
        examples[2].tokens_T[0] = vocab + 5
        with pytest.raises(EngineError, match="vocab"):
            model.forward_backward(examples)
        model.optim_step(ADAM)  # zero gradients everywhere: B stays zero, A decays by nothing
        w1 = model.weights(1)
        assert all(torch.equal(w0[n], w1[n]) for n in w0)
    finally:
        model.delete()
