"""Vision-language base models in the engine: image rows in the fused forward and backward.

For each VL family of ``tests/vision.py`` (random 2-layer Qwen2.5-VL, Qwen3-VL, Qwen3.5 with its
vision tower, each with its image processor config saved beside it): the vision tower stays
frozen and unwrapped, an image changes the logprobs after it and not before, a mixed batch of
text and image rows across two adapters equals each request run alone (logprobs and gradients),
save/load is exact, and the PEFT export loads with ``peft`` on the VL model class and gives the
same logits on an image prompt.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from opentinker.engine import AdamParams, Engine, Example, ForwardRequest
from opentinker.lora import LoRAConfig
from opentinker.models import load_base_model
from tests.tolerances import assert_logprobs_close, assert_rel_close
from tests.vision import SPECIAL, VL_FAMILIES, TowerCalls, png, vl_model


@pytest.fixture(scope="module", params=sorted(VL_FAMILIES))
def vl(request: Any, tmp_path_factory: pytest.TempPathFactory) -> Engine:
    return Engine(load_base_model(vl_model(tmp_path_factory.mktemp(request.param), request.param)))


def image_example(engine: Engine, seed: int, text: list[int], tail: list[int]) -> Example:
    """``text <|vision_start|> image <|vision_end|> tail``, shifted for next-token targets; the
    image positions have target 0 and weight 0 (the cookbook's convention)."""
    vision = engine.base.vision
    assert vision is not None
    image = vision.encode(png(seed=seed), "png")
    start, end = engine.base.tokenizer.convert_tokens_to_ids(SPECIAL[:2])
    seq = [*text, start, *[vision.image_token_id] * image.n_tokens, end, *tail]
    weights = [0.0 if t == vision.image_token_id else 1.0 for t in seq[1:]]
    targets = [0 if t == vision.image_token_id else t for t in seq[1:]]
    return Example(
        torch.tensor(seq[:-1]),
        {"target_tokens": torch.tensor(targets), "weights": torch.tensor(weights)},
        (image,),
    )


def text_example(seq: list[int]) -> Example:
    return Example(
        torch.tensor(seq[:-1]), {"target_tokens": torch.tensor(seq[1:]), "weights": torch.ones(len(seq) - 1)}
    )


def test_vision_tower_is_frozen_and_has_no_lora(vl: Engine) -> None:
    model = vl.base.model
    assert all(not p.requires_grad for p in model.model.visual.parameters())
    paths = [p for g in vl.lora.groups.values() for p in g.paths]
    assert paths and all(".language_model." in p or p == "lm_head" for p in paths), paths
    assert not any(
        "visual" in name for name, _ in model.named_modules() if "lora" in type(_).__name__.lower()
    )
    aid = vl.create_adapter(LoRAConfig(rank=4, seed=0, train_mlp=False, train_unembed=False))
    kinds = {vl.lora.groups[n].kind for n in vl.adapter_weights(aid).a}
    assert kinds == {"attn"}
    before = {k: v.clone() for k, v in model.model.visual.state_dict().items()}
    vl.forward_backward(ForwardRequest(aid, [image_example(vl, 0, [5, 6, 7], [8, 9, 10])]))
    vl.optim_step(aid, AdamParams(learning_rate=1e-2))
    after = model.model.visual.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    vl.delete_adapter(aid)


def test_image_changes_logprobs_after_it_only(vl: Engine) -> None:
    a, b = image_example(vl, 0, [5, 6, 7], [8, 9, 10, 11]), image_example(vl, 1, [5, 6, 7], [8, 9, 10, 11])
    assert torch.equal(a.tokens_T, b.tokens_T)
    assert a.images[0].digest != b.images[0].digest
    [ra] = vl.forward_backward(ForwardRequest(None, [a], backward=False)).outputs
    [rb] = vl.forward_backward(ForwardRequest(None, [b], backward=False)).outputs
    first_image = int((a.tokens_T == vl.base.vision.image_token_id).nonzero()[0])  # type: ignore[union-attr]
    # positions before the first placeholder predict the same tokens from the same context
    assert_logprobs_close(ra["logprobs"][: first_image - 1], rb["logprobs"][: first_image - 1])
    tail = slice(-4, None)
    assert float((ra["logprobs"][tail] - rb["logprobs"][tail]).abs().max()) > 1e-3


def test_an_image_a_request_repeats_is_embedded_once(vl: Engine) -> None:
    """The same image twice in a datum and again in another datum, beside a second image: the
    tower embeds the two distinct images in one call, and the logprobs equal the plain HF forward
    that embeds every copy (``Vision.forward_kwargs``)."""
    vision = vl.base.vision
    assert vision is not None
    once, other = image_example(vl, 5, [5, 6], [7, 8]), image_example(vl, 6, [9], [10])
    image = once.images[0]
    twice_seq = [*once.tokens_T.tolist(), *other.tokens_T.tolist()[1:], 11, *once.tokens_T.tolist()[2:]]
    twice = Example(
        torch.tensor(twice_seq[:-1]),
        {"target_tokens": torch.tensor(twice_seq[1:])},
        (image, other.images[0], image),
    )
    again = Example(once.tokens_T, {"target_tokens": once.inputs["target_tokens"]}, once.images)
    with TowerCalls(vl) as tower:
        res = vl.forward_backward(ForwardRequest(None, [twice, again], backward=False))
    assert tower.calls == [2]  # three copies of one image and one other: two embedded, once each
    for ex, out in zip((twice, again), res.outputs, strict=True):
        x = ex.tokens_T[None]
        with torch.no_grad():
            logits = vl.base.model(input_ids=x, **vision.forward_kwargs(x, list(ex.images))).logits[0]
        want = logits.log_softmax(-1).gather(-1, ex.inputs["target_tokens"][:, None])[:, 0]
        assert_logprobs_close(out["logprobs"], want)


def test_shared_prefixes_are_bypassed_for_image_rows(vl: Engine) -> None:
    """Rows of one adapter with the same long tokens and different images: text rows like these
    would share their common prefix's forward (``engine/prefix.py``, keyed on tokens alone); with
    images the batch runs as one padded forward, so each row equals itself run alone."""
    assert vl.share_prefixes
    text = list(range(20, 36))  # 16 tokens of common prefix: what the prefix plan would share
    rows = [image_example(vl, seed, text, [7, 8, 9]) for seed in (7, 8, 7)]
    assert torch.equal(rows[0].tokens_T, rows[1].tokens_T)
    fused = vl.forward_backward(ForwardRequest(None, rows, backward=False)).outputs
    for row, out in zip(rows, fused, strict=True):
        [alone] = vl.forward_backward(ForwardRequest(None, [row], backward=False)).outputs
        assert_logprobs_close(out["logprobs"], alone["logprobs"])
    assert float((fused[0]["logprobs"][-3:] - fused[1]["logprobs"][-3:]).abs().max()) > 1e-3


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "importance_sampling"])
def test_mixed_text_and_image_batch_equals_separate_runs(vl: Engine, loss_fn: str) -> None:
    a = vl.create_adapter(LoRAConfig(rank=4, seed=1))
    b = vl.create_adapter(LoRAConfig(rank=4, seed=2))

    def loss_inputs(ex: Example) -> Example:
        if loss_fn == "cross_entropy":
            return ex
        n = ex.tokens_T.shape[0]
        extra = {"logprobs": -torch.ones(n), "advantages": torch.linspace(-1, 1, n) * ex.inputs["weights"]}
        return Example(ex.tokens_T, {"target_tokens": ex.inputs["target_tokens"], **extra}, ex.images)

    reqs = [
        ForwardRequest(a, [loss_inputs(image_example(vl, 0, [5, 6], [7, 8, 9])), loss_inputs(text_example([4, 9, 3, 3, 8]))], loss_fn),
        ForwardRequest(b, [loss_inputs(text_example([11, 12, 13])), loss_inputs(image_example(vl, 2, [9], [10, 11, 12, 13, 14, 15]))], loss_fn),
        ForwardRequest(b, [loss_inputs(image_example(vl, 3, [5, 6, 7, 8], [9]))], loss_fn, backward=False),
    ]  # fmt: skip
    fused = vl.forward_backward_many(reqs)
    fused_grads = {aid: vl.pending_gradients(aid) for aid in (a, b)}
    for aid in (a, b):
        vl.set_pending_gradients(aid, {k: torch.zeros_like(v) for k, v in fused_grads[aid].items()})  # type: ignore[union-attr]
    alone = [vl.forward_backward(r) for r in reqs]
    for f, s in zip(fused, alone, strict=True):
        assert not isinstance(f, Exception), f
        for x, y in zip(f.outputs, s.outputs, strict=True):
            assert_logprobs_close(x["logprobs"], y["logprobs"])
    for aid in (a, b):
        got, want = fused_grads[aid], vl.pending_gradients(aid)
        assert got is not None and want is not None
        for k in want:
            assert_rel_close(got[k], want[k])
    vl.delete_adapter(a)
    vl.delete_adapter(b)


def test_bad_image_rows_are_refused_alone(vl: Engine) -> None:
    a = vl.create_adapter(LoRAConfig(rank=4, seed=0))
    good = image_example(vl, 0, [5, 6], [7, 8])
    missing = Example(good.tokens_T, good.inputs)  # placeholders without their image
    typed = text_example([5, vl.base.vision.image_token_id, 6])  # type: ignore[union-attr]
    out = vl.forward_backward_many(
        [ForwardRequest(a, [missing], backward=False), ForwardRequest(a, [typed], backward=False),
         ForwardRequest(a, [good], backward=False)]
    )  # fmt: skip
    assert "image placeholder" in str(out[0]) and "0 image(s)" not in str(out[0])
    assert "image placeholder" in str(out[1]) and "ImageChunks" in str(out[1])
    assert not isinstance(out[2], Exception)
    vl.delete_adapter(a)


def test_save_load_and_peft_export_on_an_image_prompt(vl: Engine, tmp_path: Path) -> None:
    import peft
    from transformers import AutoModelForImageTextToText

    a = vl.create_adapter(LoRAConfig(rank=4, seed=3))
    data = [image_example(vl, 4, [5, 6], [7, 8, 9, 10])]
    vl.forward_backward(ForwardRequest(a, data))
    vl.optim_step(a, AdamParams(learning_rate=1e-2))
    before = vl.forward_backward(ForwardRequest(a, data, backward=False)).outputs
    loaded = vl.load_state(vl.save_state(a, tmp_path / "ck"))
    after = vl.forward_backward(ForwardRequest(loaded, data, backward=False)).outputs
    assert torch.equal(before[0]["logprobs"], after[0]["logprobs"])
    out = vl.export_peft(a, tmp_path / "peft")
    fresh = AutoModelForImageTextToText.from_pretrained(vl.base.path, dtype=torch.float32).eval()
    model = peft.PeftModel.from_pretrained(fresh, str(out)).eval()
    assert not [n for n, _ in model.named_modules() if ".visual." in n and "lora_" in n]
    vision = vl.base.vision
    assert vision is not None
    x = data[0].tokens_T[None]
    kwargs = vision.forward_kwargs(x, list(data[0].images))
    with torch.no_grad():
        ref = model(input_ids=x, **kwargs).logits
        with vl.routing([a]):
            ours = vl.base.model(input_ids=x, **kwargs).logits
    assert_logprobs_close(ours.log_softmax(-1).flatten(), ref.log_softmax(-1).flatten())
    vl.delete_adapter(a)
    vl.delete_adapter(loaded)
