"""A VL base model never samples its image placeholder or vision markers, even where the model
puts nearly all its mass on them: a completion holding one could not go back into a datum as text.
The logprobs reported stay the trainer's (the unmasked distribution); text-only bases mask nothing."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from opentinker.engine import Engine, Example, ForwardRequest
from opentinker.models import load_base_model
from opentinker.models.registry import tiny_model_dir
from opentinker.sampling import NativeBackend, SampleRequest, SamplingParams
from opentinker.sampling.choice import Row, choose_tokens
from tests.tolerances import assert_logprobs_close
from tests.vision import SPECIAL, png, vl_model


@pytest.fixture(scope="module")
def biased(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    """A random Qwen2.5-VL whose logits are all near 0 but for the four vision ids: those are
    +-100 times two coordinates of the final norm's output, so one of them leads at every position."""
    engine = Engine(load_base_model(vl_model(tmp_path_factory.mktemp("vl"), "qwen2_5_vl")))
    vision = engine.base.vision
    assert vision is not None and len(vision.special_ids) == 4
    head = engine.base.model.get_output_embeddings().weight
    with torch.no_grad():
        head.mul_(0.01)
        for i, k, sign in zip(sorted(vision.special_ids), (0, 0, 1, 1), (1, -1, 1, -1), strict=True):
            head[i] = 0.0
            head[i, k] = 100.0 * sign
    return engine


def prompt_of(engine: Engine) -> tuple[list[int], Any]:
    vision = engine.base.vision
    assert vision is not None
    image = vision.encode(png(seed=5), "png")
    start, end = engine.base.tokenizer.convert_tokens_to_ids(SPECIAL[:2])
    return [5, 6, start, *[vision.image_token_id] * image.n_tokens, end, 7], (image,)


def trainer_logprobs(engine: Engine, tokens: list[int], images: Any) -> torch.Tensor:
    ex = Example(torch.tensor(tokens[:-1]), {"target_tokens": torch.tensor(tokens[1:])}, images)
    [out] = engine.forward_backward(ForwardRequest(None, [ex], backward=False)).outputs
    return out["logprobs"]


def test_vision_ids_are_never_sampled_and_logprobs_stay_the_trainers(biased: Engine) -> None:
    engine = biased
    vision = engine.base.vision
    assert vision is not None
    prompt, images = prompt_of(engine)
    # unmasked, the model would pick a vision id: the trainer's logprob of one is ~0 after the prompt
    best = max(trainer_logprobs(engine, [*prompt, i], images)[-1].item() for i in vision.special_ids)
    assert best > math.log(0.5)
    greedy = SamplingParams(max_tokens=5, temperature=0.0, stop=[])
    reqs = [SampleRequest(None, prompt, greedy, images=images)]
    reqs += [
        SampleRequest(None, prompt, SamplingParams(max_tokens=5, temperature=1.0, seed=s, stop=[], **kw),
                      num_samples=3, images=images)
        for s, kw in enumerate([{}, {"top_k": 3}, {"top_p": 0.9}])
    ]  # fmt: skip
    results = NativeBackend(engine).generate(reqs)
    for req, res in zip(reqs, results, strict=True):
        assert not isinstance(res, Exception), res
        for seq in res.sequences:
            assert len(seq.tokens) == 5 and not set(seq.tokens) & vision.special_ids
            # the sequence goes back into a datum, and its logprobs are the trainer's (unmasked)
            got = trainer_logprobs(engine, req.prompt + seq.tokens, images)[len(req.prompt) - 1 :]
            assert_logprobs_close(torch.tensor(seq.logprobs), got)
            assert max(seq.logprobs) < math.log(0.5)  # the masked mass is not renormalised away


def test_choose_tokens_masks_only_the_choice() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=gen)
    logits[:, 7] = 30.0  # almost all the mass
    banned = torch.tensor([7, 3])
    kinds = [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 5, 1.0), (1.0, 0, 0.5)]
    for temp, top_k, top_p in kinds:
        rows = [
            Row(0, None, SamplingParams(temperature=temp, top_k=top_k, top_p=top_p), 1,
                torch.Generator().manual_seed(j), frozenset(), ())
            for j in range(4)
        ]  # fmt: skip
        picked = choose_tokens(logits, rows, banned)
        logp = torch.log_softmax(logits / (temp or 1.0), -1)
        for j, (tok, lp) in enumerate(picked):
            assert tok not in (7, 3)
            assert lp == logp[j, tok].item()  # the unmasked distribution's
            if top_k:
                assert tok in torch.topk(logits[j].index_fill(0, banned, -math.inf), top_k).indices


def test_a_text_only_base_masks_nothing() -> None:
    backend = NativeBackend(Engine(load_base_model(str(tiny_model_dir()))))
    assert backend.engine.base.vision is None and backend.decoder()._banned is None
