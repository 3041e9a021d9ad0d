"""TTT's cost options (rl/ttt.py): the update window's exact tokens, the embedded inflight
sessions whose KV-cache namespace outlives the saves (service/inflight.py), an update still
changing only its own episode's adapter with both options on, server = embedded, bad configs."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tinker import types

import opentinker
from opentinker.data.datum import datum_from_tokens
from opentinker.rl.ttt import TTTConfig, TTTStats, TTTUpdates, fork_point, ngram_weights, window_datum
from opentinker.sampling.native import NativeBackend
from opentinker.service.runtime import Runtime
from tests.conftest import TEST_MODEL
from tests.test_ttt import _opt, _same, _tensors


@pytest.fixture()
def runtime(tmp_path: Path) -> Iterator[Runtime]:
    rt = Runtime(tmp_path / "data")
    yield rt
    rt.shutdown()


@pytest.mark.parametrize(
    ("kw", "names"),
    [
        ({"window": 0}, "window (W)"),
        ({"window": -3}, "window (W)"),
        ({"window": 2.5}, "window (W)"),
        ({"window": True}, "window (W)"),
        ({"reuse_kv": 1}, "reuse_kv"),
        ({"window_prompt": "no"}, "window_prompt"),
    ],
)
def test_bad_cost_options_are_refused_naming_the_field(kw: dict[str, Any], names: str) -> None:
    with pytest.raises(ValueError, match=names.replace("(", r"\(").replace(")", r"\)")):
        TTTConfig(**kw)


def test_the_window_selects_exactly_the_documented_tokens() -> None:
    x = [5, 6, 1, 2, 3, 1, 2, 3, 4, 7, 8, 9]  # L = 12, prompt P = 2
    raw, _ = ngram_weights(x, prompt_len=2, seen=set(), n=2, repeat_weight=0.5)
    # W = 4: s = max(2, 12 - 4) = 8; kept: x_0 x_1 (the prompt), then x_7 … x_11
    d, s = window_datum(x, raw, prompt_len=2, window=4)
    assert s == 8
    assert d.model_input.to_ints() == [5, 6, 3, 4, 7, 8]
    assert d.loss_fn_inputs["target_tokens"].tolist() == [6, 3, 4, 7, 8, 9]
    # targets x_1 (prompt) and x_7 (the window's context token) weigh 0; x_8 … x_11 their raw
    # weights divided by L - s = 4
    want = [0.0, 0.0, *(raw[j - 1] / 4 for j in range(8, 12))]
    assert d.loss_fn_inputs["weights"].tolist() == pytest.approx(want)
    assert raw[7:] == [1.0, 1.0, 1.0, 1.0]  # (3,4) (4,7) (7,8) (8,9) are new
    # a window covering all the text after x_{P} leaves nothing out (s <= P + 1)
    for w in (9, 10, 50):
        d, s = window_datum(x, raw, prompt_len=2, window=w)
        assert d.model_input.to_ints() == x[:-1] and s == max(2, 12 - w)
        lw = d.loss_fn_inputs["weights"].tolist()
        assert lw == pytest.approx([raw[j - 1] / (12 - s) if j >= s else 0.0 for j in range(1, 12)])
    # the n-gram rule reads the whole text: a repeat from before the window still counts
    y = [5, 6, 1, 2, 9, 9, 1, 2]
    raw_y, _ = ngram_weights(y, prompt_len=2, seen=set(), n=2, repeat_weight=0.5)
    d, s = window_datum(y, raw_y, prompt_len=2, window=1)
    assert s == 7 and d.loss_fn_inputs["weights"].tolist() == pytest.approx([0.0, 0.0, 0.5])
    with pytest.raises(ValueError, match="one weight per target"):
        window_datum(x, raw[:-1], prompt_len=2, window=4)


def test_the_window_alone_drops_the_prompt_and_keeps_the_targets_and_weights() -> None:
    x = [5, 6, 1, 2, 3, 1, 2, 3, 4, 7, 8, 9]  # L = 12, prompt P = 2
    raw, _ = ngram_weights(x, prompt_len=2, seen=set(), n=2, repeat_weight=0.5)
    # W = 4: s = 8; the datum is x_7 … x_11 alone: x_7 is context, x_8 … x_11 the targets
    d, s = window_datum(x, raw, prompt_len=2, window=4, prompt=False)
    assert s == 8
    assert d.model_input.to_ints() == [3, 4, 7, 8]
    assert d.loss_fn_inputs["target_tokens"].tolist() == [4, 7, 8, 9]
    assert d.loss_fn_inputs["weights"].tolist() == pytest.approx([raw[j - 1] / 4 for j in range(8, 12)])
    # the same trained targets and weights as with the prompt in front, from fewer tokens
    full, _ = window_datum(x, raw, prompt_len=2, window=4)
    fw = full.loss_fn_inputs["weights"].tolist()
    ft = full.loss_fn_inputs["target_tokens"].tolist()
    assert [(t, w) for t, w in zip(ft, fw, strict=True) if w] == list(
        zip(d.loss_fn_inputs["target_tokens"].tolist(), d.loss_fn_inputs["weights"].tolist(), strict=True)
    )
    # a window longer than the text after the prompt starts at x_{P-1}: the prompt's last token
    d, s = window_datum(x, raw, prompt_len=2, window=50, prompt=False)
    assert s == 2 and d.model_input.to_ints() == x[1:-1]
    assert d.loss_fn_inputs["weights"].tolist() == pytest.approx([raw[j - 1] / 10 for j in range(2, 12)])


def test_an_inflight_session_reuses_its_keys_and_values_across_saves(runtime: Runtime) -> None:
    service = opentinker.ServiceClient(runtime=runtime)
    tc = service.create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=0)
    tok = tc.get_tokenizer()
    ids = tok.encode("I'm thinking of a number between 1 and 1000. Is it 500? Higher. Is it")
    sampler = runtime.base_stack(TEST_MODEL).sampler
    assert isinstance(sampler, NativeBackend)
    cache = sampler.prefix_cache
    params = types.SamplingParams(max_tokens=4, temperature=0.0)

    def train() -> None:
        d = datum_from_tokens(ids, weights=[1.0] * len(ids))
        tc.forward_backward([d], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()

    train()
    session = tc.save_weights_and_get_sampling_client(kind="inflight").result()
    first = session.policy
    out = session.sample(types.ModelInput.from_ints(ids), 1, params).result()
    turn = [*ids, *out.sequences[0].tokens, *tok.encode(" Lower. Is it")]
    train()
    later = tc.save_weights_and_get_sampling_client(kind="inflight").result()
    assert session.policy == later.policy != first  # every inflight client follows the new save
    assert session.kv_namespace != later.kv_namespace  # a new save: a new namespace
    snap = tc.save_weights_and_get_sampling_client().result()  # the same weights, as a snapshot
    hits, reused = cache.hits, cache.reused_tokens
    a = session.sample(types.ModelInput.from_ints(turn), 1, params).result()
    assert cache.hits == hits + 1 and cache.reused_tokens - reused >= len(ids)  # the old turn's KV
    b = snap.sample(types.ModelInput.from_ints(turn), 1, params).result()
    c = later.sample(types.ModelInput.from_ints(turn), 1, params).result()
    assert cache.hits == hits + 1  # neither the snapshot nor the new session shares those entries
    # the new session prefilled everything under the new weights: exactly the snapshot's result
    assert c.sequences[0].tokens == b.sequences[0].tokens
    assert c.sequences[0].logprobs == pytest.approx(b.sequences[0].logprobs, rel=1e-5, abs=1e-6)
    # the reused keys and values are the old weights': the session's logprobs differ from them
    assert a.sequences[0].logprobs != pytest.approx(b.sequences[0].logprobs, rel=1e-5, abs=1e-6)
    with pytest.raises(ValueError, match="kind must be"):
        tc.save_weights_and_get_sampling_client(kind="mutable")  # type: ignore[arg-type]


def test_with_the_cost_options_an_update_changes_only_its_own_adapter(runtime: Runtime) -> None:
    service = opentinker.ServiceClient(runtime=runtime)
    tc = service.create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=0)
    ids = tc.get_tokenizer().encode("I'm thinking of a number between 1 and 1000. Is it 500? Higher.")
    d = datum_from_tokens(ids, weights=[1.0] * len(ids))
    tc.forward_backward([d], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    engine = runtime.base_stack(TEST_MODEL).engine

    async def go() -> None:
        path = await fork_point(tc, "fork")
        policy = await tc.save_weights_and_get_sampling_client()
        stats = TTTStats()
        cfg = TTTConfig(steps=2, learning_rate=1e-2, keep=True, window=6, reuse_kv=True)
        ups = TTTUpdates(service, cfg)
        b = ups.episode(path, 4, policy, stats)
        await b._update(ids[:12])
        b_id = b.tc.model_id
        a = ups.episode(path, 4, policy, stats)
        before = {
            "policy": (_tensors(engine, tc.model_id), _opt(engine, tc.model_id)),
            "b": (_tensors(engine, b_id), _opt(engine, b_id)),
        }
        b_session = b.sampler
        await a._update(ids)
        for name, ref in (("policy", tc.model_id), ("b", b_id)):
            assert _same(_tensors(engine, ref), before[name][0]), f"{name}'s weights changed"
            assert _same(_opt(engine, ref), before[name][1]), f"{name}'s optimizer state changed"
        assert not _same(_tensors(engine, a.tc.model_id), before["policy"][0])
        assert b.sampler is b_session and a.sampler.follow == a.tc.model_id  # each its own session
        # the window: 4 prompt tokens + 6 + its context token, of len(ids)
        assert stats.tokens == 2 * (min(12, 4 + 7) - 1) + 2 * (4 + 7 - 1)
        first = a.sampler
        await a._update([*ids, *ids[4:8]])
        assert a.sampler is first and a.sampler.policy == f"{a.tc.model_id}@v2"  # one session, followed
        a.close()
        b.close()

    asyncio.run(go())


def test_ttt_with_the_cost_options_against_the_server_equals_embedded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tinker

    from opentinker.server.local import LocalServer
    from tests.test_ttt import _episodes, _ttt_run
    from tests.tolerances import TRAJECTORY_LOGIT_ATOL, assert_logprobs_close

    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    for var in ("TINKER_API_KEY", "TINKER_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    cfg = TTTConfig(steps=1, learning_rate=5e-2, window=16, reuse_kv=True)
    rt = Runtime(tmp_path / "embedded")
    try:
        (emb, emb2, _), emb_stats = asyncio.run(_ttt_run(opentinker.ServiceClient(runtime=rt), cfg=cfg))
    finally:
        rt.shutdown()
    with LocalServer(["--dev", "--base-model", TEST_MODEL], data_dir=tmp_path / "server") as srv:
        sc = tinker.ServiceClient(base_url=srv.base_url, api_key="tml-ttt-test-key-0001")
        (rem, rem2, _), rem_stats = asyncio.run(_ttt_run(sc, cfg=cfg))
        sc.close("success").result()
    assert emb.errors == rem.errors == 0 and emb_stats.updates == rem_stats.updates > 0
    assert emb_stats.tokens == rem_stats.tokens
    for e, r in zip(_episodes([emb, emb2]), _episodes([rem, rem2]), strict=True):
        assert [t for t, _ in e] == [t for t, _ in r]
        for (_, lp_e), (_, lp_r) in zip(e, r, strict=True):
            assert_logprobs_close(lp_r, lp_e, atol=TRAJECTORY_LOGIT_ATOL)
