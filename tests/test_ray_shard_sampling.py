"""Sampling a sharded base on its own group (``shard_base=2``, FSDP2 over gloo): the leader decodes
with the native sampler over the sharded model's forward, the other member replays each forward
(:mod:`opentinker.cluster.shard_sampling`).

The reference is the unsharded native sampler (an in-process :class:`~opentinker.engine.Engine`
holding the whole base, its default lean decode): greedy and seeded rows sample the same tokens,
their logprobs (and prompt logprobs) within fp32 bounds (tests/tolerances.py: another kernel
path, the same function); a batch mixing two snapshots and the bare base equals each request
sampled alone; a snapshot of a model trained on the group samples tokens whose logprobs equal the
group's own ``forward`` of them within ``LOGPROB_ATOL`` (sampler = trainer). The front-end side
(:class:`~opentinker.cluster.shard_sampling.GroupSampling`) holds the base on the meta device
only: no weight of it is loaded there.
"""

from __future__ import annotations

import pytest
import torch

from opentinker.engine import AdamParams, Engine, EngineError, ForwardRequest
from opentinker.lora import LoRAConfig
from opentinker.sampling import NativeBackend, SampleRequest, SamplingParams
from tests.conftest import TEST_MODEL, make_examples
from tests.tolerances import assert_logprobs_close

ray = pytest.importorskip("ray")

from opentinker.cluster.shard_sampling import GroupSampling, SampleJob, front_base  # noqa: E402
from opentinker.cluster.trainer import TrainerPool  # noqa: E402
from tests.test_ray_shard import GPUS, WAIT, Group  # noqa: E402

pytestmark = pytest.mark.slow  # Ray, two workers forming a group: ~1 min here

A, B = LoRAConfig(rank=4, seed=11, train_unembed=True), LoRAConfig(rank=8, seed=12, train_mlp=False)


@pytest.fixture(scope="module")
def pool():
    ray.init(num_cpus=2, object_store_memory=300 * 2**20, include_dashboard=False, log_to_driver=False)
    device = "cuda" if GPUS else None
    p = TrainerPool(TEST_MODEL, workers=2, worker_cpus=0.5, worker_gpus=GPUS, device=device, shard_base=2)
    yield p
    p.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def ref() -> Engine:
    """The whole base in this process, with two snapshots whose LoRA B is not zero (they differ
    from the base and from each other)."""
    eng = Engine(TEST_MODEL)
    for name, cfg in (("a", A), ("b", B)):
        eng.create_adapter(cfg, name)
        eng.forward_backward(ForwardRequest(name, make_examples(3, eng.vocab_size, seed=len(name))))
        eng.optim_step(name, AdamParams(learning_rate=5e-2))
        eng.snapshot(name)
    return eng


@pytest.fixture(scope="module")
def front(pool: TrainerPool, ref: Engine):
    eng = Engine(front_base(TEST_MODEL, "float32"), device="cpu")
    assert all(p.device.type == "meta" for p in eng.base.model.parameters())  # no weight loaded here
    for sid in ("a@v1", "b@v1"):
        eng.add_snapshot(sid, ref.adapter_weights(sid).clone())
    svc = GroupSampling(eng, pool)
    yield eng, svc
    svc.shutdown()


def _requests() -> list[SampleRequest]:
    greedy = SamplingParams(max_tokens=7, temperature=0.0, stop=[])
    seeded = SamplingParams(max_tokens=6, temperature=1.0, seed=4, stop=[])
    return [
        SampleRequest("a@v1", [5, 17, 29, 31, 2], greedy, prompt_logprobs=True),
        SampleRequest("b@v1", [9, 8, 7], seeded, num_samples=3),
        SampleRequest(None, [40, 41, 42, 43, 44, 45], seeded, topk_sample_logprobs=2),
        SampleRequest("a@v1", [3, 1, 4, 1, 5, 9, 2, 6], seeded, num_samples=2),
    ]


def _same(got: object, want: object) -> None:
    assert not isinstance(got, Exception), got
    assert not isinstance(want, Exception), want
    assert len(got.sequences) == len(want.sequences)  # type: ignore[attr-defined]
    for g, w in zip(got.sequences, want.sequences, strict=True):  # type: ignore[attr-defined]
        assert g.tokens == w.tokens
        assert_logprobs_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs))
    if want.prompt_logprobs is not None:  # type: ignore[attr-defined]
        pl = [0.0 if x is None else x for x in got.prompt_logprobs]  # type: ignore[attr-defined]
        wl = [0.0 if x is None else x for x in want.prompt_logprobs]  # type: ignore[attr-defined]
        assert_logprobs_close(torch.tensor(pl), torch.tensor(wl))


def test_the_group_samples_what_the_unsharded_sampler_samples(front, ref: Engine) -> None:
    _, svc = front
    reqs = _requests()
    want = NativeBackend(ref).generate(reqs)  # the whole base, lean decode
    futs = [svc.submit(r).future for r in reqs]
    got = [f.result(timeout=WAIT) for f in futs]
    for g, w in zip(got, want, strict=True):
        _same(g, w)
    # teeth: another seed draws other tokens here
    other = SampleRequest("b@v1", [9, 8, 7], SamplingParams(max_tokens=6, seed=5, stop=[]), num_samples=3)
    assert [s.tokens for s in svc.submit(other).future.result(timeout=WAIT).sequences] != [
        s.tokens
        for s in got[1].sequences  # type: ignore[union-attr]
    ]
    assert svc.stats.jobs >= 2 and svc.stats.forwards > svc.stats.steps
    # queued requests go together: however the four split, one job held two or more of them
    # (the largest request has 3 rows; whatever the first job took, the rest queued behind it)
    assert svc.stats.max_rows >= 4
    # unseeded rows: only the leader draws (the other member replays forwards), so nothing to agree on
    free = SampleRequest(
        "a@v1", [1, 2, 3], SamplingParams(max_tokens=5, temperature=1.0, stop=[]), num_samples=4
    )
    assert [len(s.tokens) for s in svc.submit(free).future.result(timeout=WAIT).sequences] == [5] * 4
    # refused on the front-end, naming the problem, before any job: an unknown snapshot, a bad token
    with pytest.raises(EngineError, match="unknown"):
        svc.submit(SampleRequest("nope@v1", [1, 2])).future.result(timeout=WAIT)
    with pytest.raises(EngineError, match="outside the vocabulary"):
        svc.submit(SampleRequest("a@v1", [10**6])).future.result(timeout=WAIT)


def test_mixed_snapshots_in_one_job_equal_each_alone(pool: TrainerPool, front) -> None:
    eng, _ = front
    leader = pool.workers[0].actor
    reqs = _requests()
    weights = {sid: eng.adapter_weights(sid).clone(device="cpu") for sid in ("a@v1", "b@v1")}
    rows = [(i, r, None if r.policy is None else f"{r.policy}#job") for i, r in enumerate(reqs)]
    publish = {f"{sid}#job": w for sid, w in weights.items()}
    mixed = ray.get(leader.shard_sample.remote(SampleJob(rows, publish)), timeout=WAIT)
    assert len(set(mixed.forwards)) == 1 and mixed.forwards[0] > mixed.steps  # both members, same count
    by_rid = dict(mixed.done)
    for row in rows:  # each alone, in a job of its own (the table already holds the weights)
        [(rid, alone)] = ray.get(leader.shard_sample.remote(SampleJob([row])), timeout=WAIT).done
        _same(by_rid[rid], alone)
    # retired: a later job naming those weights is refused, naming the snapshot
    with pytest.raises(ray.exceptions.RayTaskError, match="does not hold snapshot 'a@v1'"):
        ray.get(leader.shard_sample.remote(SampleJob(rows[:1], retire=["a@v1#job"])), timeout=WAIT)
    with pytest.raises(ray.exceptions.RayTaskError, match="does not hold snapshot 'a@v1'"):
        ray.get(leader.shard_sample.remote(SampleJob(rows[:1])), timeout=WAIT)


def test_a_snapshot_trained_on_the_group_samples_with_the_trainers_logprobs(pool: TrainerPool, front) -> None:
    eng, svc = front
    g = Group(pool)
    g.call("t", "create_adapter", A, "t")
    g.op("t", "forward", ForwardRequest("t", make_examples(4, pool.limits["vocab_size"], seed=3)))
    g.op("t", "optim", AdamParams(learning_rate=5e-2))
    info, weights = ray.get(pool.workers[0].actor.snapshot.remote("t", g.seqs["t"]), timeout=WAIT)
    g.seqs["t"] += 1
    eng.add_snapshot(info.snapshot_id, weights)
    prompt = [5, 40, 41, 42]
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=3, stop=[])
    res = svc.submit(SampleRequest(info.snapshot_id, prompt, params, num_samples=2)).future.result(
        timeout=WAIT
    )
    from opentinker.engine.types import Example

    for seq in res.sequences:
        tokens = torch.tensor(prompt + seq.tokens)
        ex = Example(tokens[:-1], {"target_tokens": tokens[1:], "weights": torch.ones(len(tokens) - 1)})
        out = g.op("t", "forward", ForwardRequest("t", [ex], backward=False))
        trainer = out.outputs[0]["logprobs"][len(prompt) - 1 :]  # type: ignore[attr-defined]
        assert_logprobs_close(torch.tensor(seq.logprobs), trainer)
    g.call("t", "delete_adapter", "t")


def test_a_runtime_on_a_sharded_group_loads_no_weight_of_the_base_and_samples_there(
    pool: TrainerPool, tmp_path
) -> None:
    import opentinker
    from opentinker.service.runtime import Runtime

    # on the Ray instance already up (its two CPUs: the pool above holds one of them)
    rt = Runtime(tmp_path, trainer_workers=2, shard_base=2, trainer_cpus=0.5)
    try:
        client = opentinker.ServiceClient(runtime=rt)
        tc = client.create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=1).result()
        engine = rt.base_stack(TEST_MODEL).engine
        assert {p.device.type for p in engine.base.model.parameters()} == {"meta"}
        sampler = tc.save_weights_and_get_sampling_client()
        from tinker import types

        params = types.SamplingParams(max_tokens=5, temperature=0.0, stop=[])
        res = sampler.sample(types.ModelInput.from_ints([5, 6, 7]), 2, params).result(timeout=WAIT)
        assert len(res.sequences) == 2 and len(res.sequences[0].tokens) == 5
        assert res.sequences[0].tokens == res.sequences[1].tokens  # greedy
        assert rt.engine_stats(trainers=False)[0]["rollout"]["jobs"] >= 1
    finally:
        rt.shutdown()


def test_a_member_lost_fails_sampling_naming_the_group_and_it(pool: TrainerPool, front) -> None:
    _, svc = front  # last: the pool's group stays broken
    pool.kill_worker(1)
    req = SampleRequest("a@v1", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0))
    for _ in range(2):  # the job that finds it gone, and every later one
        with pytest.raises(EngineError, match=r"sharded group group-0 lost trainer worker trainer-1"):
            svc.submit(req).future.result(timeout=WAIT)
