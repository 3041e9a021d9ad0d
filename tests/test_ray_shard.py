"""A sharded base (``shard_base=2``): one copy of the frozen base split over two Ray trainer
workers with FSDP2 (gloo), every adapter replicated on both, a tick's rows split between them and
the LoRA gradients summed over the group before they are accumulated.

The reference is a plain in-process :class:`~opentinker.engine.Engine` holding the whole base:
each worker's base share must be about half of it, and over 3 steps losses, logprobs, gradients
and weights must equal the reference's within tests/tolerances.py's bounds: fp32 ones on the
first step (rows summed in another order), AdamW-trajectory ones after it (weights, and what
they compute, drift apart by rounding that AdamW's division by |g| amplifies);
a tick mixing adapters (and a forward-only policy, and one row fewer than the group has workers)
must equal each request run alone; a checkpoint saved on the group loads on an unsharded engine,
and the reverse, with equal logprobs. Without the gradient all-reduce each worker would step on
its half of the batch: the reference check then fails (checked below: half a batch's step is far
outside REL). A checkpoint trained on another base is refused naming both, and no member takes
it. The last test kills a member and expects every later call to name the group and it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from opentinker.engine import AdamParams, Engine, EngineError, ForwardRequest
from opentinker.engine.checkpoint import CheckpointError
from opentinker.lora import LoRAConfig
from tests.conftest import TEST_DEVICE, TEST_MODEL, make_examples, other_family_model
from tests.tolerances import (
    LOGPROB_ATOL,
    REL,
    TRAJECTORY_LOGIT_ATOL,
    TRAJECTORY_REL,
    assert_logprobs_close,
    assert_rel_close,
    assert_scalar_close,
    assert_state_close,
)

ray = pytest.importorskip("ray")

from opentinker.cluster.shard import split_rows  # noqa: E402
from opentinker.cluster.trainer import ClusterConfigError, TrainerPool, check_shard_base  # noqa: E402

pytestmark = pytest.mark.slow  # Ray, two workers forming a group: ~1 min here

CONFIG = LoRAConfig(rank=4, seed=7)
# eps above the gradients' rounding noise: with Tinker's 1e-12 a first step is sign(g), and on
# SmolLM2 a few near-zero coordinates of the two paths' gradients take opposite signs (rounding),
# 4.7e-3 apart in norm after one step; AdamW divides by |g| + eps, which amplifies the gradients'
# rounding (within REL) on coordinates near eps: with eps 1e-4, 1.6e-4 after one step and 1.1e-3
# after three on SmolLM2. With 1e-3 the step is smooth enough for the bounds below there too.
ADAM = AdamParams(learning_rate=1e-2, eps=1e-3)
WAIT = 300
# on a GPU (the device check, OPENTINKER_TEST_DEVICE=cuda) each member has its own, over NCCL
GPUS = 1.0 if TEST_DEVICE.startswith("cuda") else 0.0


class Group:
    """The pool's one group as the router drives it: ordered ops on its leader."""

    def __init__(self, pool: TrainerPool) -> None:
        self.pool, self.leader = pool, pool.workers[0]
        self.seqs: dict[str, int] = {}

    def op(self, model: str, kind: str, payload: object, *args: object, **kwargs: object) -> object:
        seq = self.seqs.get(model, 0)
        self.seqs[model] = seq + 1
        ref = self.leader.actor.submit.remote(model, seq, kind, payload, args, kwargs)
        return self.pool.get(self.leader, model, ref)

    def call(self, model: str, method: str, *args: object, **kwargs: object) -> object:
        return self.op(model, "call", method, *args, **kwargs)


@pytest.fixture(scope="module")
def pool():
    ray.init(num_cpus=2, object_store_memory=300 * 2**20, include_dashboard=False, log_to_driver=False)
    device = "cuda" if GPUS else None
    p = TrainerPool(TEST_MODEL, workers=2, worker_cpus=0.5, worker_gpus=GPUS, device=device, shard_base=2)
    yield p
    p.shutdown()
    ray.shutdown()


def _grads(eng_or_group: object, model: str) -> dict[str, torch.Tensor]:
    if isinstance(eng_or_group, Engine):
        g = eng_or_group.pending_gradients(model)
    else:
        assert isinstance(eng_or_group, Group)
        g = eng_or_group.call(model, "pending_gradients", model)
    assert isinstance(g, dict)
    return {k: v.detach().cpu().clone() for k, v in g.items()}


def test_rows_split_evenly_and_in_order() -> None:
    ex = make_examples(5, 100, seed=1)
    reqs = [ForwardRequest("a", ex[:3]), ForwardRequest("b", ex[3:])]
    shares = split_rows(reqs, 2)
    assert [[(i, len(r.examples)) for i, r in s] for s in shares] == [[(0, 3)], [(1, 2)]]
    assert [[(i, len(r.examples)) for i, r in s] for s in split_rows(reqs[1:], 3)] == [[(0, 1)], [(0, 1)], []]


def test_a_shard_base_that_does_not_fit_is_refused_at_start() -> None:
    with pytest.raises(ClusterConfigError, match=r"--shard-base 3 must divide the trainer workers \(2\)"):
        check_shard_base(TEST_MODEL, 2, 3)
    # the tiny model's narrowest weights have 128 rows: 256 workers would leave shares empty
    with pytest.raises(
        ClusterConfigError, match=r"--shard-base 256 does not suit this model: weight .* rows"
    ):
        check_shard_base(TEST_MODEL, 256, 256)
    with pytest.raises(ClusterConfigError, match=r"--shard-base must be an integer >= 1, got 0"):
        check_shard_base(TEST_MODEL, 2, 0)


def test_sharded_group_equals_one_unsharded_engine(pool: TrainerPool) -> None:
    g = Group(pool)
    infos = ray.get([m.actor.info.remote() for m in pool.members["trainer-0"]])
    full = sum(p.numel() * p.element_size() for p in Engine(TEST_MODEL).base.model.parameters())
    for info in infos:  # each member holds half the base (FSDP pads a weight's rows to an even split)
        assert 0.45 * full <= info["base_bytes"] <= 0.55 * full, (info["base_bytes"], full)
    ref = Engine(TEST_MODEL)
    ref.create_adapter(CONFIG, "m")
    g.call("m", "create_adapter", CONFIG, "m")
    vocab = pool.limits["vocab_size"]
    for step in range(3):
        ex = make_examples(7, vocab, seed=100 + step)
        got = g.op("m", "forward", ForwardRequest("m", ex))
        want = ref.forward_backward(ForwardRequest("m", ex))
        # the first step on the same weights: fp32 bounds; after it the weights are AdamW steps apart
        rel, atol = (REL, LOGPROB_ATOL) if step == 0 else (TRAJECTORY_REL, TRAJECTORY_LOGIT_ATOL)
        assert_scalar_close(got.metrics["loss:sum"], want.metrics["loss:sum"], rel)  # type: ignore[attr-defined]
        for a, b in zip(got.outputs, want.outputs, strict=True):  # type: ignore[attr-defined]
            assert_logprobs_close(a["logprobs"], b["logprobs"], atol)
        gg, rg = _grads(g, "m"), _grads(ref, "m")
        for name in rg:
            assert_rel_close(gg[name], rg[name], rel)
        if step == 0:  # teeth: half the batch's gradient is far from the whole batch's
            half = Engine(TEST_MODEL)
            half.create_adapter(CONFIG, "m")
            half.forward_backward(ForwardRequest("m", ex[:4]))
            with pytest.raises(AssertionError):
                assert_state_close(_grads(half, "m"), rg, REL)
        g.op("m", "optim", ADAM)
        ref.optim_step("m", ADAM)
        weights = g.call("m", "adapter_weights", "m").state_dict()  # type: ignore[attr-defined]
        assert_state_close(weights, ref.adapter_weights("m").state_dict(), TRAJECTORY_REL)
    # both members stepped on the same summed gradients: the same weights, bit for bit
    other = ray.get(pool.members["trainer-0"][1].actor.adapter_state.remote("m"))
    assert all(torch.equal(other[n], weights[n]) for n in other)
    g.call("m", "delete_adapter", "m")


def test_mixed_adapters_in_one_sharded_tick_equal_each_alone(pool: TrainerPool) -> None:
    g = Group(pool)
    vocab = pool.limits["vocab_size"]
    configs = {"a": LoRAConfig(rank=4, seed=1), "b": LoRAConfig(rank=8, seed=2, train_mlp=False)}
    data = {"a": make_examples(5, vocab, seed=1), "b": make_examples(1, vocab, seed=2)}
    for m, c in configs.items():
        g.call(m, "create_adapter", c, m)
    probe = make_examples(2, vocab, seed=3)
    # two adapters of other ranks and targets, and the bare base forward-only, in one tick
    reqs = [
        ForwardRequest("a", data["a"]),
        ForwardRequest(None, probe, backward=False),
        ForwardRequest("b", data["b"]),
    ]
    got = g.call("a", "forward_backward_many", reqs)
    # one row alone: the other member's share is its idle row only
    single = g.call("b", "forward_backward_many", [ForwardRequest("b", data["b"])])
    for i, (m, c) in zip((0, 2), configs.items(), strict=True):
        alone = Engine(TEST_MODEL)
        alone.create_adapter(c, m)
        want = alone.forward_backward(ForwardRequest(m, data[m]))
        assert_scalar_close(got[i].metrics["loss:sum"], want.metrics["loss:sum"])  # type: ignore[index]
        for x, y in zip(got[i].outputs, want.outputs, strict=True):  # type: ignore[index]
            assert_logprobs_close(x["logprobs"], y["logprobs"])
        if m == "b":  # b's single-row tick accumulated a second time
            alone.forward_backward(ForwardRequest(m, data[m]))
        want_g, got_g = _grads(alone, m), _grads(g, m)
        for name in want_g:
            assert_rel_close(got_g[name], want_g[name])
    base = Engine(TEST_MODEL).forward_backward(ForwardRequest(None, probe, backward=False))
    for x, y in zip(got[1].outputs, base.outputs, strict=True):  # type: ignore[index]
        assert_logprobs_close(x["logprobs"], y["logprobs"])
    assert_scalar_close(single[0].metrics["loss:sum"], got[2].metrics["loss:sum"])  # type: ignore[index]
    bad = g.call("a", "forward_backward_many", [ForwardRequest("nope", probe)])
    assert isinstance(bad[0], EngineError) and "nope" in str(bad[0])  # type: ignore[index]
    for m in configs:
        g.call(m, "delete_adapter", m)


def test_checkpoints_move_between_sharded_and_unsharded(pool: TrainerPool, tmp_path: Path) -> None:
    g = Group(pool)
    vocab = pool.limits["vocab_size"]
    ex = make_examples(4, vocab, seed=9)
    g.call("s", "create_adapter", CONFIG, "s")
    g.op("s", "forward", ForwardRequest("s", ex))
    g.op("s", "optim", ADAM)
    g.call("s", "save_state", "s", str(tmp_path / "sharded"))
    plain = Engine(TEST_MODEL)
    plain.load_state(tmp_path / "sharded", adapter_id="p")
    probe = make_examples(3, vocab, seed=10)
    on_group = g.op("s", "forward", ForwardRequest("s", probe, backward=False))
    on_plain = plain.forward_backward(ForwardRequest("p", probe, backward=False))
    for x, y in zip(on_group.outputs, on_plain.outputs, strict=True):  # type: ignore[attr-defined]
        assert_logprobs_close(x["logprobs"], y["logprobs"])
    # the reverse: trained unsharded, loaded into the group
    plain.forward_backward(ForwardRequest("p", ex))
    plain.optim_step("p", ADAM)
    plain.save_state("p", tmp_path / "plain")
    g.call("r", "load_state", str(tmp_path / "plain"), adapter_id="r")
    on_group = g.op("r", "forward", ForwardRequest("r", probe, backward=False))
    on_plain = plain.forward_backward(ForwardRequest("p", probe, backward=False))
    for x, y in zip(on_group.outputs, on_plain.outputs, strict=True):  # type: ignore[attr-defined]
        assert_logprobs_close(x["logprobs"], y["logprobs"])
    for m in ("s", "r"):
        g.call(m, "delete_adapter", m)


def test_a_checkpoint_of_another_base_is_refused_naming_both(pool: TrainerPool, tmp_path: Path) -> None:
    other = Engine(other_family_model(tmp_path / "qwen2", "qwen2"))
    other.create_adapter(CONFIG, "o")
    other.save_state("o", tmp_path / "other")
    g = Group(pool)
    with pytest.raises(CheckpointError, match=rf"trained on '.*qwen2', not on this engine's '{TEST_MODEL}'"):
        g.call("o", "load_state", str(tmp_path / "other"), adapter_id="o")
    # refused on the leader before any member took it: the group holds no trace of it
    infos = ray.get([m.actor.info.remote() for m in pool.members["trainer-0"]])
    assert all("o" not in info["adapters"] for info in infos)


def test_a_lost_member_fails_the_group_naming_it(pool: TrainerPool) -> None:
    g = Group(pool)
    g.call("x", "create_adapter", CONFIG, "x")
    pool.kill_worker(1)  # the group's other member
    ex = make_examples(3, pool.limits["vocab_size"], seed=4)
    for _ in range(2):  # the call that finds it gone, and every later one
        with pytest.raises(EngineError, match=r"sharded group group-0 lost trainer worker trainer-1"):
            g.op("x", "forward", ForwardRequest("x", ex))
