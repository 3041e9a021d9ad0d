"""Image prompts in the native sampler (``sampling/vision.py``), for each VL family of
``tests/vision.py``: sampler = trainer on image prompts (invariant 3's bound) in a batch mixing
image and text rows of two adapters; a request joining a running batch mid-decode; the vision
tower runs once per request (counted by a forward hook on the real tower: never per decode step,
never per sample); the prefix cache is keyed by image content (the same tokens with another image
never hit, the same image does).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from opentinker.engine import AdamParams, Engine, Example, ForwardRequest
from opentinker.lora import LoRAConfig
from opentinker.models import load_base_model
from opentinker.models.vision import Image
from opentinker.sampling import NativeBackend, SampleRequest, SamplingParams
from opentinker.sampling.decoder import run_to_completion
from tests.tolerances import assert_logprobs_close
from tests.vision import SPECIAL, VL_FAMILIES, TowerCalls, png, vl_model


@pytest.fixture(scope="module", params=sorted(VL_FAMILIES))
def trained(request: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Engine, list[str]]:
    """A VL engine and two snapshots of adapters trained one step on an image datum."""
    engine = Engine(load_base_model(vl_model(tmp_path_factory.mktemp(request.param), request.param)))
    snaps = []
    for seed in (1, 2):
        aid = engine.create_adapter(LoRAConfig(rank=4, seed=seed))
        prompt, images = image_prompt(engine, seed, [5, 6], [7, 8, 9, 10])
        pad = engine.base.vision.image_token_id  # type: ignore[union-attr]
        targets = torch.tensor([0 if t == pad else t for t in prompt[1:]])  # the cookbook's: image
        inputs = {"target_tokens": targets, "weights": (targets != 0).float()}  # targets 0, weight 0
        ex = Example(torch.tensor(prompt[:-1]), inputs, images)
        engine.forward_backward(ForwardRequest(aid, [ex]))
        engine.optim_step(aid, AdamParams(learning_rate=5e-2))
        snaps.append(engine.snapshot(aid).snapshot_id)
    return engine, snaps


def image_prompt(
    engine: Engine, seed: int, text: list[int], tail: list[int]
) -> tuple[list[int], tuple[Image, ...]]:
    vision = engine.base.vision
    assert vision is not None
    image = vision.encode(png(seed=seed), "png")
    start, end = engine.base.tokenizer.convert_tokens_to_ids(SPECIAL[:2])
    return [*text, start, *[vision.image_token_id] * image.n_tokens, end, *tail], (image,)


def assert_matches_trainer(engine: Engine, req: SampleRequest, result: Any) -> None:
    """Every sampled token's logprob equals the trainer's forward on prompt + sample (T = 1)."""
    assert not isinstance(result, Exception), result
    for seq in result.sequences:
        tokens = req.prompt + seq.tokens
        ex = Example(torch.tensor(tokens[:-1]), {"target_tokens": torch.tensor(tokens[1:])}, req.images)
        [out] = engine.forward_backward(ForwardRequest(req.policy, [ex], backward=False)).outputs
        assert_logprobs_close(torch.tensor(seq.logprobs), out["logprobs"][len(req.prompt) - 1 :])


def params(seed: int, n: int = 6) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=1.0, seed=seed, stop=[])


def test_sampler_equals_trainer_on_mixed_image_and_text_rows(trained: tuple[Engine, list[str]]) -> None:
    engine, (s1, s2) = trained
    backend = NativeBackend(engine)
    p1, i1 = image_prompt(engine, 3, [5, 6], [7, 8])
    p2, i2 = image_prompt(engine, 4, [9], [10, 11, 12])
    reqs = [
        SampleRequest(s1, p1, params(0), num_samples=3, images=i1),
        SampleRequest(s2, [4, 5, 6, 7], params(1), num_samples=2),
        SampleRequest(s2, p2, params(2), num_samples=2, images=i2),
        SampleRequest(None, p1, params(3), images=i1),
    ]
    with TowerCalls(engine) as tower:
        results = backend.generate(reqs)
    # each distinct image embedded exactly once: i1, in two requests, once (one prefill; a
    # recurrent family prefills by length groups, and p1's two rows are of one length)
    assert sum(tower.calls) == 2 and len(tower.calls) <= 2
    for req, res in zip(reqs, results, strict=True):
        assert_matches_trainer(engine, req, res)
    assert results[0].sequences[0].tokens != results[3].sequences[0].tokens  # type: ignore[union-attr]


def test_an_image_a_prompt_repeats_is_embedded_once(trained: tuple[Engine, list[str]]) -> None:
    engine, (s1, _) = trained
    prompt, images = image_prompt(engine, 11, [5, 6], [7])
    again = prompt[2:]  # <|vision_start|> image <|vision_end|> 7
    req = SampleRequest(s1, prompt + again, params(11), num_samples=2, images=images * 2)
    with TowerCalls(engine) as tower:
        [res] = NativeBackend(engine, prefix_cache_bytes=0).generate([req])
    assert tower.calls == [1]  # one distinct image: embedded once, for both samples
    assert_matches_trainer(engine, req, res)


def test_the_shared_prefix_prefill_is_bypassed_for_image_prompts(trained: tuple[Engine, list[str]]) -> None:
    """Two prompts of one policy, the same long tokens, different images: a batch of text prompts
    like these would prefill their common prefix once (``common_prompt_prefix``), which keys on
    tokens alone; with images each row prefills its own, so each is its own trainer's."""
    engine, (s1, _) = trained
    text = list(range(20, 36))  # 16 tokens: over the shared-prefix minimum
    (pa, ia), (pb, ib) = (image_prompt(engine, seed, text, [7, 8]) for seed in (12, 13))
    assert pa == pb and ia[0].digest != ib[0].digest
    reqs = [SampleRequest(s1, pa, params(12), images=ia), SampleRequest(s1, pb, params(12), images=ib)]
    results = NativeBackend(engine, prefix_cache_bytes=0).generate(reqs)
    for req, res in zip(reqs, results, strict=True):
        assert_matches_trainer(engine, req, res)
    assert results[0].sequences[0].logprobs != results[1].sequences[0].logprobs  # type: ignore[union-attr]


def test_an_image_request_joins_a_running_batch(trained: tuple[Engine, list[str]]) -> None:
    engine, (s1, s2) = trained
    dec = NativeBackend(engine, prefix_cache_bytes=0).decoder()
    p1, i1 = image_prompt(engine, 5, [5, 6, 7], [8])
    first = SampleRequest(s1, p1, params(4, 12), num_samples=2, images=i1)
    p2, i2 = image_prompt(engine, 6, [9, 10], [11, 12, 13])
    # seeds whose samples hold no image placeholder id (a random model samples near-uniformly, and
    # a sampled placeholder cannot go back into a datum as text: the trainer check would refuse it)
    later = [
        SampleRequest(s2, p2, params(15, 6), num_samples=3, images=i2),
        SampleRequest(s1, [3, 4, 5], params(6, 5)),
    ]
    done: dict[int, Any] = {}
    with TowerCalls(engine) as tower:
        done.update(dec.admit([(0, dec.pin(first))]))
        for _ in range(3):
            done.update(dec.step())
        done.update(dec.admit([(1, dec.pin(later[0])), (2, dec.pin(later[1]))]))
        while dec.live_rows:
            done.update(dec.step())
    assert tower.calls == [1, 1] and dec.steps >= 11  # once per request, never per step or sample
    for rid, req in enumerate([first, *later]):
        assert_matches_trainer(engine, req, done[rid])


def test_prefix_cache_is_keyed_by_image_content(trained: tuple[Engine, list[str]]) -> None:
    engine, (s1, _) = trained
    backend = NativeBackend(engine)
    prompt, image_a = image_prompt(engine, 7, [5], [6, 7, 8, 9, 10, 11, 12])
    _, image_b = image_prompt(engine, 8, [5], [6, 7, 8, 9, 10, 11, 12])
    [first] = backend.generate([SampleRequest(s1, prompt, params(7), images=image_a)])
    assert not isinstance(first, Exception)
    turn = prompt + first.sequences[0].tokens + [13, 14]
    with TowerCalls(engine) as tower:
        [other] = backend.generate([SampleRequest(s1, turn, params(8), images=image_b)])
        [same] = backend.generate([SampleRequest(s1, turn, params(8), images=image_a)])
    assert not isinstance(other, Exception) and not isinstance(same, Exception)
    assert other.prompt_cache_hit_tokens == 0  # the same tokens, another image: no entry is shared
    assert same.prompt_cache_hit_tokens == len(prompt) + len(first.sequences[0].tokens) - 1
    assert tower.calls == [1]  # the hit skipped the image: the tower did not run for it
    assert_matches_trainer(engine, SampleRequest(s1, turn, params(8), images=image_b), other)
    assert_matches_trainer(engine, SampleRequest(s1, turn, params(8), images=image_a), same)
    assert other.sequences[0].logprobs != same.sequences[0].logprobs


def test_bad_image_prompts_are_refused(trained: tuple[Engine, list[str]]) -> None:
    engine, (s1, _) = trained
    backend = NativeBackend(engine)
    prompt, images = image_prompt(engine, 9, [5], [6])
    results = run_to_completion(
        backend.decoder(),
        [SampleRequest(s1, prompt, params(9)), SampleRequest(s1, prompt, params(9), images=images)],
    )
    assert isinstance(results[0], Exception) and "image placeholder" in str(results[0])
    assert not isinstance(results[1], Exception)
