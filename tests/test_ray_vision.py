"""Image rows on Ray trainer workers: a random 2-layer Qwen3-VL (``tests/vision.py``) served by a
pool of two trainer actors on one local Ray instance. A model of data-parallel degree 1 (one
worker) and one of degree 2 (the batch split over both, LoRA gradients all-reduced) train on
batches mixing image and text rows (the images travel inside the datums, through Ray's object
store) and must equal a plain in-process :class:`~opentinker.engine.Engine` running each whole
batch: losses, per-token logprobs and the updated weights. The two replicas of degree 2 hold the
same weights bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from opentinker.engine import AdamParams, Engine, Example, ForwardRequest
from opentinker.lora import LoRAConfig
from opentinker.models import load_base_model
from tests.tolerances import (
    REL,
    TRAJECTORY_REL,
    assert_logprobs_close,
    assert_scalar_close,
    assert_state_close,
)
from tests.vision import SPECIAL, png, vl_model

ray = pytest.importorskip("ray")

from opentinker.cluster.dp import DataParallelModel  # noqa: E402
from opentinker.cluster.trainer import TrainerPool  # noqa: E402

pytestmark = pytest.mark.slow  # Ray start-up and two worker processes: about a minute here

CONFIG = LoRAConfig(rank=4, seed=7)
ADAM = AdamParams(learning_rate=2e-2)
STEPS = 2


def _batch(engine: Engine, step: int) -> list[Example]:
    """Four image rows (one image repeated across two of them) and two text rows."""
    vision = engine.base.vision
    assert vision is not None
    start, end = engine.base.tokenizer.convert_tokens_to_ids(SPECIAL[:2])
    out = []
    for row, seed in enumerate((step, step + 10, step, step + 20)):
        image = vision.encode(png(seed=seed), "png")
        seq = [5 + row, start, *[vision.image_token_id] * image.n_tokens, end, 7, 8 + row, 9 + step]
        targets = [0 if t == vision.image_token_id else t for t in seq[1:]]
        weights = [0.0 if t == vision.image_token_id else 1.0 for t in seq[1:]]
        inputs = {"target_tokens": torch.tensor(targets), "weights": torch.tensor(weights)}
        out.append(Example(torch.tensor(seq[:-1]), inputs, (image,)))
    for row in range(2):
        seq = [11 + row, 12, 13 + step, 14, 15 + row]
        out.append(Example(torch.tensor(seq[:-1]), {"target_tokens": torch.tensor(seq[1:])}))
    return out


def test_image_batches_on_ray_trainer_workers_equal_one_process(tmp_path: Path) -> None:
    folder = vl_model(tmp_path / "qwen3-vl", "qwen3_vl")
    ref = Engine(load_base_model(folder))
    data = [_batch(ref, s) for s in range(STEPS)]
    aid = ref.create_adapter(CONFIG, "ref")
    want = []
    for examples in data:
        res = ref.forward_backward(ForwardRequest(aid, examples, "cross_entropy"))
        ref.optim_step(aid, ADAM)
        weights = {k: v.detach().clone() for k, v in ref.adapter_weights(aid).state_dict().items()}
        want.append((res.metrics["loss:sum"], [o["logprobs"] for o in res.outputs], weights))
    ray.init(num_cpus=2, object_store_memory=300 * 2**20, include_dashboard=False, log_to_driver=False)
    try:
        pool = TrainerPool(folder, workers=2, worker_cpus=1)
        try:
            for k in (1, 2):
                model = DataParallelModel(pool, f"vl-k{k}", CONFIG, degree=k)
                assert model.degree == k
                for step, examples in enumerate(data):
                    res = model.forward_backward(examples, "cross_entropy")
                    model.optim_step(ADAM)
                    loss, lps, weights = want[step]
                    assert_scalar_close(res.metrics["loss:sum"], loss)
                    for got, exp in zip((o["logprobs"] for o in res.outputs), lps, strict=True):
                        assert_logprobs_close(got, exp)
                    ours = model.weights(0)
                    assert_state_close(ours, weights, REL if step == 0 else TRAJECTORY_REL)
                if k == 2:  # both replicas stepped on the same summed gradients
                    other = model.weights(1)
                    assert all(torch.equal(other[n], ours[n]) for n in other)
                model.delete()
        finally:
            pool.shutdown()
    finally:
        ray.shutdown()
