"""A sharded base (``shard_base=2``) sampled by vLLM (``rollout_backend="vllm"``,
``shard_sampling="front"``, tensor-parallel over 2): the group trains, vLLM loads its own copy of
the base and samples, and the front-end's base stays on the meta device (no weight of it loaded
there). What would need
the front-end's weights (the native fallback for a family or snapshot vLLM cannot serve, prompt
logprobs) is refused with a reason naming ``shard_sampling='group'``, never run on meta tensors.

The reference of the slow test is the group's own forward of the sampled tokens (sampler =
trainer), within ``LOGPROB_ATOL`` (tests/tolerances.py: vLLM's kernels and the sharded forward
round fp32 in another order).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tinker import types

import opentinker
from opentinker.engine import Engine
from opentinker.models import load_base_model
from opentinker.service.runtime import Runtime
from tests.conftest import TEST_MODEL
from tests.tolerances import assert_logprobs_close

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


def test_a_sharded_base_on_vllm_needs_front_and_a_family_vllm_cannot_serve_is_refused(
    tmp_path: Path,
) -> None:
    pytest.importorskip("vllm")
    from opentinker.sampling.routed import RoutedBackend
    from tests.families import family_model

    with pytest.raises(
        ValueError, match=r"rollout_backend='vllm' samples on vLLM's own copy .* give shard_sampling='front'"
    ):
        Runtime(tmp_path / "rt", trainer_workers=2, shard_base=2, rollout_backend="vllm")
    # a family vLLM-CPU cannot run (qwen3_moe, head_dim 8): the front-end has no copy to fall back on
    folder = family_model(tmp_path / "moe", "qwen3_moe")
    engine = Engine(load_base_model(folder, device="meta"))
    with pytest.raises(
        ValueError, match=r"\(qwen3_moe\) cannot be sampled by vLLM here: .*shard_sampling='group'"
    ):
        RoutedBackend.for_engine(engine)


@pytest.mark.slow  # Ray, two trainer workers forming a group, and a vLLM engine: ~2 min here
def test_vllm_samples_a_sharded_base_with_no_weight_on_the_front_end(tmp_path: Path) -> None:
    ray = pytest.importorskip("ray")
    pytest.importorskip("vllm")
    ray.init(num_cpus=2, object_store_memory=300 * 2**20, include_dashboard=False, log_to_driver=False)
    rt = Runtime(
        tmp_path, trainer_workers=2, shard_base=2, trainer_cpus=0.5, rollout_backend="vllm",
        shard_sampling="front", rollout_tensor_parallel=2, max_rank=16, rollout_options={"kv_cache_bytes": 1 << 28, "max_loras": 2},
    )  # fmt: skip
    try:
        client = opentinker.ServiceClient(runtime=rt)
        tc = client.create_lora_training_client(
            base_model=TEST_MODEL, rank=8, seed=0, train_unembed=False
        ).result()
        engine = rt.base_stack(TEST_MODEL).engine
        assert {p.device.type for p in engine.base.model.parameters()} == {"meta"}
        ids = [(i * 7) % 900 + 3 for i in range(24)]
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(ids[:-1]),
            loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},  # pyright: ignore[reportArgumentType]
        )
        tc.forward_backward([datum], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
        sampler = tc.save_weights_and_get_sampling_client()
        params = types.SamplingParams(max_tokens=8, temperature=0.0, stop=[])
        [seq] = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, params).result().sequences
        assert len(seq.tokens) == 8
        [placed] = rt.engine_stats()[0]["served_by"]
        assert placed["served_by"] == "vllm"
        # sampler = trainer: the group's forward of the sampled tokens (the snapshot's weights)
        full = [*PROMPT, *seq.tokens]
        scored = types.Datum(
            model_input=types.ModelInput.from_ints(full[:-1]),
            loss_fn_inputs={"target_tokens": full[1:], "weights": [1.0] * (len(full) - 1)},  # pyright: ignore[reportArgumentType]
        )
        out = tc.forward([scored], "cross_entropy").result()
        trainer = out.loss_fn_outputs[0]["logprobs"].tolist()[len(PROMPT) - 1 :]
        assert_logprobs_close(seq.logprobs, trainer)
        with pytest.raises(Exception, match=r"prompt logprobs .* shard_sampling='group'"):
            sampler.compute_logprobs(types.ModelInput.from_ints(PROMPT)).result()
        # a snapshot vLLM cannot serve (it trains lm_head) has no native fallback here
        tu = client.create_lora_training_client(
            base_model=TEST_MODEL, rank=4, seed=1, train_unembed=True
        ).result()
        with pytest.raises(Exception, match=r"lm_head.*no copy of it for the native sampler"):
            su = tu.save_weights_and_get_sampling_client()
            su.sample(types.ModelInput.from_ints(PROMPT), 1, params).result()
        assert {p.device.type for p in engine.base.model.parameters()} == {"meta"}
    finally:
        rt.shutdown()
        ray.shutdown()
