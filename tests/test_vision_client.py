"""Images through the embedded clients (the SDK's names and types, in-process) on a random 2-layer
Qwen2.5-VL (``tests/vision.py``): an image prompt as the prompt of an RL group (sample, then an
``importance_sampling`` step on prompt + samples, whose logprobs are the sampler's), prompt
logprobs (``compute_logprobs``) equal to ``forward``'s, and ``forward_backward_custom`` carrying
the images through its two passes.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from tinker import types

import opentinker
from opentinker.service.runtime import Runtime
from tests.tolerances import assert_logprobs_close
from tests.vision import SPECIAL, png, vl_model


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[opentinker.ServiceClient, str]]:
    folder = vl_model(tmp_path_factory.mktemp("qwen2_5_vl"), "qwen2_5_vl")
    runtime = Runtime(tmp_path_factory.mktemp("data"), dtype="float32")
    yield opentinker.ServiceClient(runtime=runtime), folder
    runtime.shutdown()


def image_prompt(folder: str, seed: int, tail: list[int]) -> types.ModelInput:
    from transformers import AutoTokenizer

    start, end = AutoTokenizer.from_pretrained(folder).convert_tokens_to_ids(SPECIAL[:2])
    image = types.ImageChunk(data=png(seed=seed), format="png", expected_tokens=4)
    return types.ModelInput(
        chunks=[
            types.EncodedTextChunk(tokens=[5, 6, start]),
            image,
            types.EncodedTextChunk(tokens=[end, *tail]),
        ]
    )


def test_an_image_prompt_as_an_rl_group(service: tuple[opentinker.ServiceClient, str]) -> None:
    svc, folder = service
    tc = svc.create_lora_training_client(base_model=folder, rank=4, seed=0)
    warm = image_prompt(folder, 1, [7, 8, 9])
    datum = types.Datum(
        model_input=warm, loss_fn_inputs={"target_tokens": [6] * warm.length, "weights": [1.0] * warm.length}
    )
    tc.forward_backward([datum], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = image_prompt(folder, 2, [7])
    params = types.SamplingParams(max_tokens=5, temperature=1.0, seed=1, stop=[])
    group = sampler.sample(prompt, 4, params).result()
    data = []
    for i, seq in enumerate(group.sequences):
        n = prompt.length + len(seq.tokens) - 1
        chunks = [
            *prompt.chunks[:-1],
            types.EncodedTextChunk(tokens=[*prompt.chunks[-1].tokens, *seq.tokens[:-1]]),
        ]  # type: ignore[union-attr]
        inputs = {
            "target_tokens": [0] * (prompt.length - 1) + seq.tokens,
            "logprobs": [0.0] * (prompt.length - 1) + list(seq.logprobs),
            "advantages": [0.0] * (prompt.length - 1) + [float(i) - 1.5] * len(seq.tokens),
        }
        data.append(types.Datum(model_input=types.ModelInput(chunks=chunks), loss_fn_inputs=inputs))  # type: ignore[arg-type]
        assert data[-1].model_input.length == n
    out = tc.forward_backward(data, "importance_sampling").result()
    for seq, row in zip(group.sequences, out.loss_fn_outputs, strict=True):
        lp = torch.tensor(row["logprobs"].data)[prompt.length - 1 :]
        assert_logprobs_close(lp, torch.tensor(seq.logprobs))  # the sampler's weights = the trainer's
    # prompt logprobs: what forward gives each prompt token (an image position's is its placeholder's)
    prompt_lps = sampler.compute_logprobs(prompt).result()
    ids = prompt_ids(folder, prompt)
    shifted = types.ModelInput(
        chunks=[*prompt.chunks[:-1], types.EncodedTextChunk(tokens=prompt.chunks[-1].tokens[:-1])]
    )  # type: ignore[union-attr]
    fwd = tc.forward(
        [types.Datum(model_input=shifted, loss_fn_inputs={"target_tokens": ids[1:]})], "cross_entropy"
    ).result()
    assert len(prompt_lps) == prompt.length and prompt_lps[0] is None
    assert_logprobs_close(torch.tensor(prompt_lps[1:]), torch.tensor(fwd.loss_fn_outputs[0]["logprobs"].data))


def prompt_ids(folder: str, prompt: types.ModelInput) -> list[int]:
    from transformers import AutoTokenizer

    image = AutoTokenizer.from_pretrained(folder).convert_tokens_to_ids(SPECIAL[2])
    return [
        t
        for c in prompt.chunks
        for t in (c.tokens if isinstance(c, types.EncodedTextChunk) else [image] * c.length)
    ]


def test_forward_backward_custom_keeps_the_images(service: tuple[opentinker.ServiceClient, str]) -> None:
    """Tinker's custom loss (a forward, the loss's gradient, a weighted cross-entropy step) on image
    data equals a cross_entropy step with the same weights: the images go through both passes."""
    svc, folder = service
    prompt = image_prompt(folder, 3, [7, 8, 9])
    ids = prompt_ids(folder, prompt)
    weights = [0.0 if t == ids[3] else 1.0 for t in ids[1:]]
    shifted = types.ModelInput(
        chunks=[*prompt.chunks[:-1], types.EncodedTextChunk(tokens=prompt.chunks[-1].tokens[:-1])]
    )  # type: ignore[union-attr]
    datum = types.Datum(model_input=shifted, loss_fn_inputs={"target_tokens": ids[1:], "weights": weights})
    a = svc.create_lora_training_client(base_model=folder, rank=4, seed=5)
    b = svc.create_lora_training_client(base_model=folder, rank=4, seed=5)

    def loss(data: list[types.Datum], logprobs: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        w = torch.tensor(data[0].loss_fn_inputs["weights"].data)
        return -(logprobs[0] * w).sum(), {}

    got = a.forward_backward_custom([datum], loss).result()
    want = b.forward_backward([datum], "cross_entropy").result()
    assert abs(got.metrics["loss:sum"] - want.metrics["loss:sum"]) <= 1e-4 * max(
        1.0, abs(want.metrics["loss:sum"])
    )
    a.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    b.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    la = a.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].data
    lb = b.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].data
    assert_logprobs_close(torch.tensor(la), torch.tensor(lb))


@pytest.mark.slow
def test_a_rollout_worker_process_samples_image_prompts_as_in_process(
    service: tuple[opentinker.ServiceClient, str], tmp_path: Path
) -> None:
    """The images travel to a rollout worker process with the request; its samples equal the
    in-process sampler's (same seed, same weights)."""
    svc, folder = service
    prompt = image_prompt(folder, 4, [7])
    params = types.SamplingParams(max_tokens=4, temperature=1.0, seed=2, stop=[])
    here = svc.create_sampling_client(base_model=folder).sample(prompt, 2, params).result()
    runtime = Runtime(tmp_path / "data", dtype="float32", rollout_workers=1)
    try:
        there = opentinker.ServiceClient(runtime=runtime).create_sampling_client(base_model=folder)
        out = there.sample(prompt, 2, params).result()
    finally:
        runtime.shutdown()
    for a, b in zip(here.sequences, out.sequences, strict=True):
        assert a.tokens == b.tokens
        assert_logprobs_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs))
