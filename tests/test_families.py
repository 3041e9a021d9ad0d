"""The family conformance matrix over the dense families (random 2-layer models of transformers'
config classes, tests/families.py): each trains, samples (greedy and seeded), its sampled logprobs
equal the trainer's in a mixed batch (invariant 3), a mixed greedy batch equals solo runs, a row
that joins a running batch mid-decode gets what it gets alone (continuous batching), a
conversation's next turn from the prefix cache equals a fresh prefill, save/load is exact
(invariant 4) and the PEFT export gives the engine's logits (invariant 5). The MoE families are in
tests/test_moe.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from opentinker.engine import AdamParams, Engine, Example, ForwardRequest
from opentinker.lora import LoRAConfig
from opentinker.models import BaseModel, load_base_model
from opentinker.sampling import NativeBackend, SampleRequest, SamplingParams
from opentinker.sampling.decoder import run_to_completion
from opentinker.sampling.types import SampleResult
from tests.conftest import make_examples
from tests.families import DENSE_FAMILIES, HYBRID_FAMILIES, family_model
from tests.tolerances import assert_logprobs_close

ADAM = AdamParams(learning_rate=2e-2)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, stop=[])
PROMPTS = [[5, 9, 14, 3, 7, 22], [8, 8, 31, 40], [12, 5, 9, 17, 2, 44, 6, 3]]


@pytest.fixture(scope="module", params=sorted(DENSE_FAMILIES))
def base(request: Any, tmp_path_factory: pytest.TempPathFactory) -> BaseModel:
    return load_base_model(family_model(tmp_path_factory.mktemp(request.param), request.param))


@pytest.fixture
def trained(base: BaseModel) -> tuple[Engine, list[str]]:
    engine = Engine(base, max_rank=16)
    ids = [engine.create_adapter(LoRAConfig(rank=r, seed=i)) for i, r in enumerate([4, 8])]
    for i, aid in enumerate(ids):
        data = make_examples(4, engine.vocab_size, seed=10 + i)
        first = engine.forward_backward(ForwardRequest(aid, data)).metrics["loss:sum"]
        for _ in range(3):
            engine.optim_step(aid, ADAM)
            last = engine.forward_backward(ForwardRequest(aid, data)).metrics["loss:sum"]
        engine.optim_step(aid, ADAM)
        assert last < first  # it trains
    return engine, ids


def _ok(res: object) -> SampleResult:
    assert isinstance(res, SampleResult), res
    return res


def _forward_logprobs(engine: Engine, policy: str | None, tokens: list[int]) -> torch.Tensor:
    ex = Example(torch.tensor(tokens[:-1]), {"target_tokens": torch.tensor(tokens[1:])})
    return engine.forward_backward(ForwardRequest(policy, [ex], backward=False)).outputs[0]["logprobs"]


def test_sampled_logprobs_match_the_trainer_in_a_mixed_batch(trained: tuple[Engine, list[str]]) -> None:
    engine, (a, b) = trained
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=3, stop=[])
    reqs = [SampleRequest(p, PROMPTS[i], params, num_samples=2) for i, p in enumerate([a, b, None])]
    for req, res in zip(reqs, NativeBackend(engine).generate(reqs), strict=True):
        for seq in _ok(res).sequences:
            lp = _forward_logprobs(engine, req.policy, req.prompt + seq.tokens)[len(req.prompt) - 1 :]
            assert_logprobs_close(lp, seq.logprobs)


def test_greedy_mixed_equals_solo_and_seeds_reproduce(trained: tuple[Engine, list[str]]) -> None:
    engine, (a, b) = trained
    sampler = NativeBackend(engine, prefix_cache_bytes=0)
    reqs = [SampleRequest(p, PROMPTS[i], GREEDY) for i, p in enumerate([a, b, None])]
    mixed = [_ok(r).sequences[0].tokens for r in sampler.generate(reqs)]
    solo = [_ok(sampler.generate([r])[0]).sequences[0].tokens for r in reqs]
    assert mixed == solo
    seeded = SampleRequest(a, PROMPTS[0], SamplingParams(max_tokens=8, temperature=1.0, seed=7, stop=[]))
    first, again = (_ok(sampler.generate([seeded])[0]).sequences[0].tokens for _ in range(2))
    assert first == again


def test_a_row_joining_mid_decode_gets_what_it_gets_alone(trained: tuple[Engine, list[str]]) -> None:
    engine, (a, b) = trained
    sampler = NativeBackend(engine, prefix_cache_bytes=0)
    early = SampleRequest(a, PROMPTS[2], SamplingParams(max_tokens=10, temperature=0.0, stop=[]))
    late = SampleRequest(b, PROMPTS[0], GREEDY)
    alone = [
        _ok(r).sequences[0].tokens
        for r in (run_to_completion(sampler.decoder(), [q])[0] for q in (early, late))
    ]
    dec = sampler.decoder()
    done = dec.admit([(0, dec.pin(early))])
    for _ in range(3):
        done += dec.step()
    done += dec.admit([(1, dec.pin(late))])  # joins the running batch
    while dec.live_rows:
        done += dec.step()
    got = {i: _ok(res).sequences[0].tokens for i, res in done}
    assert [got[0], got[1]] == alone


def test_a_next_turn_from_the_prefix_cache_equals_a_fresh_prefill(trained: tuple[Engine, list[str]]) -> None:
    engine, (a, _) = trained
    cached, fresh = NativeBackend(engine), NativeBackend(engine, prefix_cache_bytes=0)
    turn1 = _ok(cached.generate([SampleRequest(a, PROMPTS[0], GREEDY)])[0]).sequences[0].tokens
    turn2 = SampleRequest(
        a, PROMPTS[0] + turn1 + [21, 22, 23], SamplingParams(max_tokens=8, temperature=1.0, seed=1, stop=[])
    )
    hit = _ok(cached.generate([turn2])[0])
    assert hit.prompt_cache_hit_tokens > 0
    ref = _ok(fresh.generate([turn2])[0])
    assert hit.sequences[0].tokens == ref.sequences[0].tokens
    assert_logprobs_close(torch.tensor(hit.sequences[0].logprobs), torch.tensor(ref.sequences[0].logprobs))


def test_save_load_is_exact_and_peft_export_matches(
    trained: tuple[Engine, list[str]], tmp_path: Path
) -> None:
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    engine, (a, _) = trained
    data = make_examples(3, engine.vocab_size, seed=9, min_len=12, max_len=13)
    before = engine.forward_backward(ForwardRequest(a, data, backward=False)).outputs
    loaded = engine.load_state(engine.save_state(a, tmp_path / "ck"))
    after = engine.forward_backward(ForwardRequest(loaded, data, backward=False)).outputs
    assert all(torch.equal(x["logprobs"], y["logprobs"]) for x, y in zip(before, after, strict=True))
    out = engine.export_peft(a, tmp_path / "peft")
    fresh = AutoModelForCausalLM.from_pretrained(engine.base.path, dtype=torch.float32).eval()
    model = peft.PeftModel.from_pretrained(fresh, str(out)).eval()
    x = torch.stack([e.tokens_T for e in data])
    with torch.no_grad():
        ref = model(input_ids=x).logits
        with engine.routing([a] * len(data)):
            ours = engine.base.model(input_ids=x).logits
    assert_logprobs_close(ours.log_softmax(-1).flatten(), ref.log_softmax(-1).flatten())


@pytest.fixture(scope="module", params=sorted(HYBRID_FAMILIES))
def hybrid(request: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Engine, list[str]]:
    """A hybrid family (Gated DeltaNet or Mamba2 layers beside attention), two trained adapters;
    its sampling is covered in tests/test_hybrid_sampling.py."""
    engine = Engine(load_base_model(family_model(tmp_path_factory.mktemp(request.param), request.param)))
    aid = engine.create_adapter(LoRAConfig(rank=4, seed=0))
    kinds = {engine.lora.groups[n].kind for n in engine.adapter_weights(aid).a}
    assert kinds == {"attn", "mlp", "unembed"} - ({"mlp"} if request.param == "nemotron_h" else set())
    for s in range(3):
        engine.forward_backward(ForwardRequest(aid, make_examples(4, engine.vocab_size, seed=20 + s)))
        engine.optim_step(aid, ADAM)
    return engine, [aid, aid]


def test_a_hybrid_family_saves_loads_and_exports_to_peft(
    hybrid: tuple[Engine, list[str]], tmp_path: Path
) -> None:
    test_save_load_is_exact_and_peft_export_matches(hybrid, tmp_path)
