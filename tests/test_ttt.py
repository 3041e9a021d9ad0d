"""Test-time training inside live episodes (rl/ttt.py): the n-gram rule, isolation of each
episode's adapter, the cheap fork, the server path equal to the embedded one, bad configs."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from tinker import types

import opentinker
from opentinker.data.datum import datum_from_tokens
from opentinker.renderers import get_renderer
from opentinker.rl.loop import RLConfig, run_rl
from opentinker.rl.rollout import rollout_group
from opentinker.rl.ttt import (
    TTTConfig,
    TTTStats,
    TTTUpdates,
    fork_point,
    ngram_weights,
    ttt_datum,
    ttt_rollout_group,
)
from opentinker.service.runtime import Runtime
from opentinker.tasks.guess_number_long import LongGuessDataset, LongGuessGroup
from tests.conftest import TEST_MODEL
from tests.tolerances import TRAJECTORY_LOGIT_ATOL, assert_logprobs_close, assert_scalar_close


@pytest.mark.parametrize(
    ("kw", "names"),
    [
        ({"steps": 0}, "steps (k)"),
        ({"steps": -2}, "steps (k)"),
        ({"steps": 1.5}, "steps (k)"),
        ({"ngram": 0}, "ngram size (n)"),
        ({"repeat_weight": -0.1}, "repeat_weight"),
        ({"repeat_weight": 1.01}, "repeat_weight"),
        ({"repeat_weight": math.nan}, "repeat_weight"),
        ({"learning_rate": 0.0}, "learning_rate"),
        ({"max_wait_s": -1.0}, "max_wait_s"),
        ({"max_wait_s": math.inf}, "max_wait_s"),
    ],
)
def test_bad_config_is_refused_naming_the_field(kw: dict[str, Any], names: str) -> None:
    with pytest.raises(ValueError, match=names.replace("(", r"\(").replace(")", r"\)")):
        TTTConfig(**kw)


def test_ngram_weights_follow_the_documented_rule() -> None:
    x = [5, 1, 2, 3, 1, 2, 3, 1, 2, 4]
    w, grams = ngram_weights(x, prompt_len=2, seen=set(), n=2, repeat_weight=0.5)
    # targets j = 1..9; j = 1 is the prompt; (1,2) (2,3) (3,1) are new at j = 2, 3, 4, repeated
    # at j = 5..8; (2,4) at j = 9 is new
    assert w == [0.0, 1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.5, 1.0]
    assert grams == {(1, 2), (2, 3), (3, 1), (2, 4)}
    # the next update: the text grew by 7, 2, 4; everything already trained on weighs 0.5, and so
    # does (2,4) again; (4,7) and (7,2) are new
    w2, grams2 = ngram_weights([*x, 7, 2, 4], prompt_len=2, seen=grams, n=2, repeat_weight=0.5)
    assert w2 == [0.0] + [0.5] * 8 + [1.0, 1.0, 0.5]
    assert grams2 == grams | {(4, 7), (7, 2)}
    # n-grams that would reach before the text's start are never repeats; n = 1 is per token
    w3, _ = ngram_weights([9, 9, 9, 8], prompt_len=1, seen=set(), n=3, repeat_weight=0.0)
    assert w3 == [1.0, 1.0, 1.0]
    w4, _ = ngram_weights([9, 9, 9, 8], prompt_len=1, seen={(8,)}, n=1, repeat_weight=0.0)
    assert w4 == [1.0, 0.0, 0.0]  # (9,) new at j = 1, repeated at j = 2; (8,) seen before
    # the datum divides by the trained span's length
    d = ttt_datum(x, w, 2)
    assert d.loss_fn_inputs["weights"].tolist() == pytest.approx([v / 8 for v in w])
    assert d.model_input.to_ints() == x[:-1] and d.loss_fn_inputs["target_tokens"].tolist() == x[1:]


def _tensors(engine: Any, ref: str) -> dict[str, torch.Tensor]:
    w = engine.adapter_weights(ref)
    return {f"{k}.{g}": t.detach().clone() for k, d in (("a", w.a), ("b", w.b)) for g, t in d.items()}


def _opt(engine: Any, ref: str) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.optimizer_state(ref).items()}


def _same(x: dict[str, torch.Tensor], y: dict[str, torch.Tensor]) -> bool:
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.fixture()
def runtime(tmp_path: Path) -> Iterator[Runtime]:
    rt = Runtime(tmp_path / "data")
    yield rt
    rt.shutdown()


def test_an_update_changes_only_its_own_episodes_adapter(runtime: Runtime) -> None:
    service = opentinker.ServiceClient(runtime=runtime)
    tc = service.create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=0)
    tok = tc.get_tokenizer()
    # the policy has trained a step (so it has optimizer state that must stay as it is)
    ids = tok.encode("I'm thinking of a number between 1 and 1000. Is it 500? Higher.")
    d = datum_from_tokens(ids, weights=[1.0] * len(ids))
    tc.forward_backward([d], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    engine = runtime.base_stack(TEST_MODEL).engine

    async def go() -> None:
        path = await fork_point(tc, "fork")
        policy = await tc.save_weights_and_get_sampling_client()
        stats = TTTStats()
        ups = TTTUpdates(service, TTTConfig(steps=2, learning_rate=1e-2, keep=True))
        b = ups.episode(path, 4, policy, stats)
        await b._update(ids[:12])  # b exists, with its own optimizer state
        b_id = b.tc.model_id
        a = ups.episode(path, 4, policy, stats)
        b.close()  # b's episode is over (keep=True keeps its adapter): a updates alone
        before = {
            "policy": (_tensors(engine, tc.model_id), _opt(engine, tc.model_id)),
            "b": (_tensors(engine, b_id), _opt(engine, b_id)),
        }
        await a._update(ids)
        assert a.tc is not None
        for name, ref in (("policy", tc.model_id), ("b", b_id)):
            assert _same(_tensors(engine, ref), before[name][0]), f"{name}'s weights changed"
            assert _same(_opt(engine, ref), before[name][1]), f"{name}'s optimizer state changed"
        assert not _same(_tensors(engine, a.tc.model_id), before["policy"][0])
        assert stats.forks == 2 and stats.updates == 4 and stats.reused == 0
        # a fork starts bitwise equal to the policy's saved weights, with a fresh optimizer
        c = await service.create_training_client_from_state_async(path)
        assert _same(_tensors(engine, c.model_id), before["policy"][0])
        assert engine.pending_gradients(c.model_id) is None
        a_id = a.tc.model_id
        a.close()
        assert [t.model_id for t in stats.kept] == [b_id, a_id]  # keep=True keeps them
        assert {b_id, a_id} <= set(engine.adapter_ids())

    asyncio.run(go())


def _fork_setup(runtime: Runtime) -> tuple[Any, Any, list[int]]:
    service = opentinker.ServiceClient(runtime=runtime)
    tc = service.create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=0)
    ids = tc.get_tokenizer().encode(
        "I'm thinking of a number between 1 and 1000. Is it 500? Higher. Is it 750?"
    )
    d = datum_from_tokens(ids, weights=[1.0] * len(ids))
    tc.forward_backward([d], "cross_entropy").result()  # B != 0: every LoRA weight gets a gradient
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    return service, tc, ids


def test_live_episodes_updates_are_released_together_and_equal_each_alone(runtime: Runtime) -> None:
    service, tc, ids = _fork_setup(runtime)
    engine = runtime.base_stack(TEST_MODEL).engine
    texts = [ids[:14], ids[:18], ids]

    async def go() -> None:
        path = await fork_point(tc, "fork")
        policy = await tc.save_weights_and_get_sampling_client()
        cfg = TTTConfig(steps=1, learning_rate=1e-2)
        ups = TTTUpdates(service, cfg)
        stats = [TTTStats() for _ in texts]
        eps = [ups.episode(path, 4, policy, st) for st in stats]
        await asyncio.gather(*(ep._update(t) for ep, t in zip(eps, texts, strict=True)))
        # one release of all three (each counts the three it went with)
        assert [(st.gated, st.fused_sum, st.updates) for st in stats] == [(1, 3, 1)] * 3
        assert len({ep.tc.model_id for ep in eps}) == 3
        # each alone, from a fresh pool: the same loss (one fused forward/backward changes nobody's)
        for ep, t, st in zip(eps, texts, stats, strict=True):
            alone = TTTStats()
            solo = TTTUpdates(service, cfg).episode(path, 4, policy, alone)
            await solo._update(t)
            assert alone.fused_sum == 1
            assert_scalar_close(st.loss_sum, alone.loss_sum)
            assert not _same(_tensors(engine, ep.tc.model_id), _tensors(engine, tc.model_id))

    asyncio.run(go())


def test_a_reused_fork_is_bitwise_a_fresh_one(runtime: Runtime) -> None:
    service, tc, ids = _fork_setup(runtime)
    engine = runtime.base_stack(TEST_MODEL).engine

    async def go() -> None:
        path = await fork_point(tc, "fork")
        policy = await tc.save_weights_and_get_sampling_client()
        cfg = TTTConfig(steps=2, learning_rate=1e-2)
        ups, stats = TTTUpdates(service, cfg), TTTStats()
        first = ups.episode(path, 4, policy, stats)
        await first._update(ids[:16])
        used = first.tc.model_id
        first.close()  # its adapter (trained, with optimizer state) goes to the pool
        second = ups.episode(path, 4, policy, stats)
        await second._update(ids)
        assert second.tc.model_id == used and stats.forks == 2 and stats.reused == 1
        fresh = TTTUpdates(service, cfg).episode(path, 4, policy, TTTStats())
        await fresh._update(ids)
        assert fresh.tc.model_id != used
        assert _same(_tensors(engine, used), _tensors(engine, fresh.tc.model_id))
        assert _same(_opt(engine, used), _opt(engine, fresh.tc.model_id))
        assert engine.adapter_step(used) == engine.adapter_step(fresh.tc.model_id)
        second.close()
        await ups.close()  # the pool's adapters are dropped
        assert used not in engine.adapter_ids()

    asyncio.run(go())


def test_an_update_waits_for_a_stalled_episode_at_most_max_wait_s(runtime: Runtime) -> None:
    service, tc, ids = _fork_setup(runtime)

    async def go() -> None:
        path = await fork_point(tc, "fork")
        policy = await tc.save_weights_and_get_sampling_client()
        ups, stats = TTTUpdates(service, TTTConfig(max_wait_s=0.05)), TTTStats()
        ups.episode(path, 4, policy, TTTStats())  # live, never asks for an update
        ep = ups.episode(path, 4, policy, stats)
        await asyncio.wait_for(ep._update(ids), 60)
        assert (stats.gated, stats.fused_sum, stats.updates) == (1, 1, 1)

    asyncio.run(go())


def test_fork_reads_the_checkpoint_once_and_rereads_an_overwritten_one(runtime: Runtime) -> None:
    service = opentinker.ServiceClient(runtime=runtime)
    tc = service.create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=0)
    engine = runtime.base_stack(TEST_MODEL).engine
    path = tc.save_state("p").result().path
    forks = [service.create_training_client_from_state(path) for _ in range(3)]
    cached = [s for s in engine.snapshot_ids() if s.startswith("checkpoint-weights:")]
    assert len(cached) == 1  # one read for three forks
    ids = tc.get_tokenizer().encode("Is it 5? Lower.")
    d = datum_from_tokens(ids, weights=[1.0] * len(ids))
    tc.forward_backward([d], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    tc.save_state("p", overwrite=True).result()
    fresh = service.create_training_client_from_state(path)
    assert _same(_tensors(engine, fresh.model_id), _tensors(engine, tc.model_id))
    assert not _same(_tensors(engine, fresh.model_id), _tensors(engine, forks[0].model_id))


def _episodes(groups: list[Any]) -> list[list[tuple[list[int], list[float]]]]:
    return [[(tr.ac_T, tr.logprobs_T) for tr in t.transitions] for g in groups for t in g.trajectories]


async def _ttt_run(service: Any, seed: int = 0, cfg: TTTConfig | None = None) -> tuple[list[Any], TTTStats]:
    tc = await service.create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=0)
    renderer = get_renderer("auto", tc.get_tokenizer())
    policy = await tc.save_weights_and_get_sampling_client()
    path = await fork_point(tc, "ttt-fork")
    group = LongGuessGroup(renderer, [700, 123], high=1000, max_turns=4)
    params = types.SamplingParams(max_tokens=8, temperature=0.0)
    stats, again = TTTStats(), TTTStats()
    cfg = cfg if cfg is not None else TTTConfig(steps=1, learning_rate=5e-2)
    ups = TTTUpdates(service, cfg)
    kw: dict[str, Any] = {"service": service, "fork_path": path, "cfg": cfg, "seed": seed, "updates": ups}
    g = await ttt_rollout_group(group, policy, params, stats=stats, **kw)
    # the same episodes again, on the first run's pooled adapters (reset with load_state)
    g2 = await ttt_rollout_group(group, policy, params, stats=again, **kw)
    await ups.close()
    # embedded, the second run reuses the first's adapters; the SDK deprecates load_state, so
    # against the server every episode forks anew
    assert again.forks == stats.forks and again.reused == (
        stats.forks if isinstance(service, opentinker.ServiceClient) else 0
    )
    base = await rollout_group(group, policy, params, seed=seed)
    return [g, g2, base], stats


def test_ttt_against_the_server_equals_embedded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tinker

    from opentinker.server.local import LocalServer

    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    for var in ("TINKER_API_KEY", "TINKER_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    rt = Runtime(tmp_path / "embedded")
    try:
        (emb, emb2, emb_base), emb_stats = asyncio.run(_ttt_run(opentinker.ServiceClient(runtime=rt)))
    finally:
        rt.shutdown()
    with LocalServer(["--dev", "--base-model", TEST_MODEL], data_dir=tmp_path / "server") as srv:
        sc = tinker.ServiceClient(base_url=srv.base_url, api_key="tml-ttt-test-key-0001")
        (rem, rem2, rem_base), rem_stats = asyncio.run(_ttt_run(sc))
        sc.close("success").result()
    assert emb.errors == rem.errors == 0 and len(emb.trajectories) == 2
    assert emb_stats.updates == rem_stats.updates > 0 and emb_stats.forks == rem_stats.forks == 2
    # a reused adapter is a fresh fork: the second run repeats the first
    for e, r in zip(_episodes([emb, emb2, emb]), _episodes([rem, rem2, emb2]), strict=True):
        assert [t for t, _ in e] == [t for t, _ in r]
        for (_, lp_e), (_, lp_r) in zip(e, r, strict=True):
            assert_logprobs_close(lp_r, lp_e, atol=TRAJECTORY_LOGIT_ATOL)
    # and the updates did something: the TTT episodes' later turns are not the policy's
    assert _episodes([emb]) != _episodes([emb_base])
    assert all(len(t.transitions) >= 2 for t in emb.trajectories)  # a turn after an update


def test_rl_loop_trains_the_policy_on_ttt_episodes(runtime: Runtime, tmp_path: Path) -> None:
    service = opentinker.ServiceClient(runtime=runtime)
    cfg = RLConfig(
        base_model=TEST_MODEL, log_dir=str(tmp_path / "run"), steps=2, groups_per_step=2, group_size=2,
        lora_rank=4, learning_rate=1e-3, max_tokens=8, progress=False, eval_every=0,
        ttt=TTTConfig(steps=1, learning_rate=1e-2),
    )  # fmt: skip
    renderer = get_renderer("auto", service.create_sampling_client(base_model=TEST_MODEL).get_tokenizer())
    dataset = LongGuessDataset(renderer, 2, 2, high=100, max_turns=3)
    result = asyncio.run(run_rl(cfg, service, dataset))
    rows = result.metrics
    assert len(rows) == 2 and all(r["ttt/forks"] >= 1 and r["ttt/updates"] >= 1 for r in rows)
    # the run keeps one pool: the second step's episodes reuse the first step's adapters
    assert rows[0]["ttt/reused"] == 0 and rows[1]["ttt/reused"] >= 1
    engine = runtime.base_stack(TEST_MODEL).engine
    assert engine.adapter_step(result.training_client.model_id) == 2  # the outer policy trained
    # every episode's adapter was dropped at its episode's end: only the policy is left
    assert engine.adapter_ids() == [result.training_client.model_id]
