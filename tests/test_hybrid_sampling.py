"""The native sampler on models whose layers keep other state than equal-width keys and values
(sampling/hf_cache.py): recurrent-state layers (Gated DeltaNet in Qwen3.5 and Qwen3-Next, also in
Qwen3.5-MoE; Mamba2 in Nemotron-H) and MLA's compressed latent (DeepSeek V3), over random 2-layer
models (tests/families.py).

For each family: sampled logprobs equal the trainer's in a mixed batch (two adapters and the base
model, two samples each); a greedy row of a mixed batch with longer and shorter prompts equals its
solo run (left padding does not leak into a recurrent state); a request joining a running batch
mid-decode equals its solo run, and so do the rows it joins; a second turn reuses the first's
state from the prefix cache (a recurrent state only whole: a prompt that diverges inside a stored
sequence misses on a hybrid model and hits on MLA) and equals a fresh prefill; an inflight switch
keeps the state the old weights computed, keys and values and recurrent state alike.
"""

from __future__ import annotations

from typing import Any

import pytest

from opentinker.engine import Engine
from opentinker.lora import LoRAConfig
from opentinker.models import load_base_model
from opentinker.sampling import NativeBackend, SampleRequest, SampleResult, SamplingParams
from opentinker.sampling.hf_cache import is_recurrent
from opentinker.sampling.loop import Done, FollowInflight, Sample, SamplingCore
from tests.families import HYBRID_FAMILIES, family_model
from tests.test_inflight import _switched, _teacher_forced, _train
from tests.test_moe import _forward_logprobs
from tests.tolerances import LOGPROB_ATOL, assert_greedy_equal, assert_logprobs_close

FAMILIES = [*sorted(HYBRID_FAMILIES), "deepseek_v3", "qwen3_5_moe_text"]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, stop=[])
SEEDED = SamplingParams(max_tokens=8, temperature=1.0, seed=0, stop=[])


@pytest.fixture(scope="module", params=FAMILIES)
def setup(request: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Engine, str, list[str | None]]:
    """An engine on the family's model, a trained model id and two snapshots of different
    adapters (one of that model) and the base model."""
    base = load_base_model(family_model(tmp_path_factory.mktemp(request.param), request.param))
    engine = Engine(base, max_rank=16)
    a, b = (engine.create_adapter(LoRAConfig(rank=r, seed=s)) for s, r in ((0, 4), (1, 8)))
    _train(engine, a, 1, steps=2)
    _train(engine, b, 2, steps=2)
    return engine, a, [engine.snapshot(a).snapshot_id, engine.snapshot(b).snapshot_id, None]


def _prompt(engine: Engine, n: int, seed: int) -> list[int]:
    return [3 + (seed * 131 + 17 * i) % (engine.vocab_size - 3) for i in range(n)]


def _ok(res: object) -> SampleResult:
    assert isinstance(res, SampleResult), res
    return res


def _assert_same(got: SampleResult, ref: SampleResult, what: str = "") -> None:
    assert len(got.sequences) == len(ref.sequences)
    for g, r in zip(got.sequences, ref.sequences, strict=True):
        assert_greedy_equal(g.tokens, r.tokens, what)
        assert_logprobs_close(g.logprobs, r.logprobs)


def test_sampler_equals_trainer_in_a_mixed_batch(setup: tuple[Engine, str, list[str | None]]) -> None:
    engine, _, pols = setup
    prompts = [_prompt(engine, n, i) for i, n in enumerate((6, 11, 3))]
    reqs = [SampleRequest(p, prompts[i], SEEDED, num_samples=2) for i, p in enumerate(pols)]
    for req, res in zip(reqs, NativeBackend(engine).generate(reqs), strict=True):
        for seq in _ok(res).sequences:
            assert len(seq.tokens) == SEEDED.max_tokens
            lp = _forward_logprobs(engine, req.policy, req.prompt + seq.tokens)[len(req.prompt) - 1 :]
            assert_logprobs_close(lp, seq.logprobs)


def test_greedy_rows_of_a_mixed_batch_equal_their_solo_runs(
    setup: tuple[Engine, str, list[str | None]],
) -> None:
    """Prompts of 3, 9 and 14 tokens (two of one length, prefilled together): each row alone and
    beside longer and shorter ones gives the same tokens and logprobs."""
    engine, _, pols = setup
    backend = NativeBackend(engine, prefix_cache_bytes=0)
    lens = (9, 3, 14, 9)
    reqs = [SampleRequest(pols[i % 3], _prompt(engine, n, i + 5), GREEDY) for i, n in enumerate(lens)]
    mixed = backend.generate(reqs)
    for i, req in enumerate(reqs):
        [solo] = backend.generate([req])
        _assert_same(_ok(mixed[i]), _ok(solo), f"(row {i}, prompt of {lens[i]})")


def test_a_request_joining_mid_decode_equals_its_solo_run(
    setup: tuple[Engine, str, list[str | None]],
) -> None:
    engine, _, (a, b, base) = setup
    backend = NativeBackend(engine, prefix_cache_bytes=0)
    first = [
        SampleRequest(a, _prompt(engine, 7, 1), SamplingParams(max_tokens=16, temperature=0.0, stop=[])),
        SampleRequest(base, _prompt(engine, 4, 2), SEEDED, num_samples=2),
    ]
    joiners = [
        SampleRequest(b, _prompt(engine, 12, 3), GREEDY),
        SampleRequest(
            a, _prompt(engine, 2, 4), SamplingParams(max_tokens=6, temperature=1.0, seed=3, stop=[])
        ),
    ]
    refs = [_ok(backend.generate([r])[0]) for r in first + joiners]
    core = SamplingCore(backend.decoder(snapshots_only=True), backend)
    done: list[Done] = []
    for rid, r in enumerate(first):
        core.handle(Sample(rid, r))
    for rid, r in enumerate(joiners, start=len(first)):
        done += core.tick() + core.tick()
        assert core.decoder.live_rows > 0 and not done
        core.handle(Sample(rid, r))
    while core.busy:
        done += core.tick()
    assert core.stats.joined == len(joiners)
    got = {d.rid: d.result for d in done}
    for rid, ref in enumerate(refs):
        _assert_same(_ok(got[rid]), ref, f"(request {rid})")


def test_a_second_turn_reuses_the_first(setup: tuple[Engine, str, list[str | None]]) -> None:
    """Turn 2 continues each conversation (prompt, reply, an answer): served from the prefix
    cache, equal to a backend without it. A prompt diverging inside a stored sequence: a miss on a
    hybrid model (a recurrent state is stored whole), a hit on MLA (columns cut anywhere)."""
    engine, _, pols = setup
    cached, plain = NativeBackend(engine), NativeBackend(engine, prefix_cache_bytes=0)
    prompts = [_prompt(engine, n, i + 20) for i, n in enumerate((10, 13, 9))]
    first = [
        _ok(r)
        for r in cached.generate([SampleRequest(p, q, GREEDY) for p, q in zip(pols, prompts, strict=True)])
    ]
    turn2 = [
        q + r.sequences[0].tokens + _prompt(engine, 3 + i, 40 + i)
        for i, (q, r) in enumerate(zip(prompts, first, strict=True))
    ]
    diverged = prompts[0] + first[0].sequences[0].tokens[:4] + [1, 2, 3]
    reqs = [SampleRequest(p, q, GREEDY) for p, q in zip(pols, turn2, strict=True)]
    reqs.append(SampleRequest(pols[0], diverged, GREEDY))
    got = [_ok(r) for r in cached.generate(reqs)]
    want = [_ok(r) for r in plain.generate(reqs)]
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        _assert_same(g, w, f"(turn 2, conversation {i})")
    for g, q, r in zip(got, prompts, first, strict=False):  # the whole first turn, its last token fed
        assert g.prompt_cache_hit_tokens == len(q) + len(r.sequences[0].tokens) - 1
    stored_whole = is_recurrent(engine.base.model)
    assert got[-1].prompt_cache_hit_tokens == (0 if stored_whole else len(prompts[0]) + 4)


def test_inflight_switch_keeps_the_old_weights_state(setup: tuple[Engine, str, list[str | None]]) -> None:
    """A following request switches at the next step; its cache (keys and values, recurrent
    state) stays as the old weights computed it: its logprobs from then on equal a plain HF
    forward continuing the old weights' cache on the new weights."""
    engine, aid, (old, _, _) = setup
    _train(engine, aid, 3, steps=2)
    new = engine.snapshot(aid).snapshot_id
    backend = NativeBackend(engine, prefix_cache_bytes=0)
    core = SamplingCore(backend.decoder(snapshots_only=True), backend)
    prompt, params = _prompt(engine, 8, 7), SamplingParams(max_tokens=12, temperature=1.0, seed=11, stop=[])
    core.handle(Sample(1, SampleRequest(old, prompt, params, follow=aid)))
    core.handle(Sample(2, SampleRequest(old, _prompt(engine, 5, 8), params)))  # pinned
    done = core.tick() + core.tick() + core.tick()
    s = 4  # tokens sampled so far (the first tick samples two)
    core.handle(FollowInflight(aid, new))
    while core.busy:
        done += core.tick()
    got = {d.rid: d.result for d in done}
    [seq] = _ok(got[1]).sequences
    switched = _switched(engine, old, new, prompt, seq.tokens, s)
    assert_logprobs_close(seq.logprobs[:s], _teacher_forced(engine, old, prompt, seq.tokens)[:s])
    assert_logprobs_close(seq.logprobs[s:], switched)
    on_new = _teacher_forced(engine, new, prompt, seq.tokens)[s:]
    assert max(abs(x - y) for x, y in zip(switched, on_new, strict=True)) > 10 * LOGPROB_ATOL
    [pinned] = _ok(got[2]).sequences
    assert_logprobs_close(pinned.logprobs, _teacher_forced(engine, old, _prompt(engine, 5, 8), pinned.tokens))


def test_a_layer_kind_the_cache_cannot_hold_is_refused_by_name() -> None:
    """HF's "hybrid" layers (attention and a recurrent state in one layer) are not served: the
    reason names the family and the kind; the kinds served have none."""
    from types import SimpleNamespace

    from opentinker.sampling.forward import unsupported_cache_reason

    def model(kinds: list[str]) -> Any:
        return SimpleNamespace(config=SimpleNamespace(model_type="fam", layer_types=kinds))

    reason = unsupported_cache_reason(model(["hybrid", "full_attention"]))
    assert reason is not None and "fam" in reason and "hybrid" in reason
    assert unsupported_cache_reason(model(["linear_attention", "full_attention", "moe", "mlp"])) is None
