"""The frozen base model's dtype: ``float32`` or ``bfloat16``, chosen per device when not given.

Only the frozen base weights (and so its activations and KV cache) take this dtype. LoRA weights,
their gradients and the optimizer state are always fp32 (the LoRA layers cast A and B to the
activation dtype inside the forward, so gradients flow back into the fp32 tensors), and every loss
and logprob is computed in fp32 from the logits.

``auto`` (the default of ``serve``, ``Runtime`` and the CLI) picks, from measurement
(``benchmarks/p_bf16.py``; numbers in ``benchmarks/RESULTS.md``):

- CUDA: ``bfloat16`` where the GPU computes it natively (compute capability >= 8.0), else
  ``float32``;
- CPU: ``float32``. On an AVX512-BF16 CPU a bf16 base trains SmolLM2-135M 1.5-2.1x faster and
  samples it 1.4-1.6x faster, but samples the tiny model at 0.57x, and it widens the
  sampler–trainer gap that RL's importance ratios see from a mean |Δlogprob| of 5e-6 to 0.06 on
  SmolLM2 (max 0.35, ``kl_sample_train_v1`` -3e-3: fifteen times what Tinker reports for a 27B
  dense model); fp32 keeps invariant 3's 1e-4 (docs/DESIGN.md). Speed is one flag away
  (``--dtype bfloat16``); agreement is the default.

An explicit ``bfloat16`` on a device that cannot run it: on a GPU without bf16 support, an error
(``ValueError``) at start-up; on a CPU without native bf16 instructions (no AVX512-BF16 nor AMX),
where torch would emulate bf16 at a fraction of fp32's speed, the base falls back to ``float32``
and a warning is logged saying so.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DTYPE_CHOICES = ("auto", *DTYPES)
_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16"}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``"bfloat16"`` (the spelling of ``--dtype`` and of vLLM's option)."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(value: str | torch.dtype | None) -> str:
    """``"auto"`` or the canonical name of a supported base dtype; anything else is refused with
    a ``ValueError`` naming the choices (an invalid ``--dtype`` fails at start-up)."""
    if value is None:
        return "auto"
    if isinstance(value, torch.dtype):
        name = dtype_name(value)
    elif isinstance(value, str):
        name = _ALIASES.get(value.strip().lower(), value.strip().lower())
    else:
        raise ValueError(f"dtype must be a string or a torch.dtype, got {type(value).__name__}")
    if name not in DTYPE_CHOICES:
        raise ValueError(f"unsupported base-model dtype {value!r}; choose one of {', '.join(DTYPE_CHOICES)}")
    return name


def bf16_unsupported(device: str | torch.device) -> str | None:
    """Why ``device`` cannot run a bf16 base at native speed, or None if it can."""
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return "torch sees no CUDA device"
        if not torch.cuda.is_bf16_supported(including_emulation=False):
            major, minor = torch.cuda.get_device_capability(dev)
            return f"{torch.cuda.get_device_name(dev)} (compute capability {major}.{minor}) has no bfloat16 support"
        return None
    if dev.type == "cpu":
        native = (
            getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()
            or getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
        )
        return None if native else "this CPU has no native bfloat16 instructions (AVX512-BF16 or AMX)"
    return None  # other accelerators: let torch say if it cannot


def default_dtype(device: str | torch.device) -> torch.dtype:
    """What ``auto`` means on ``device`` (see the module docstring for the measurement)."""
    dev = torch.device(device)
    if dev.type == "cuda" and bf16_unsupported(dev) is None:
        return torch.bfloat16
    return torch.float32


def resolve_dtype(value: str | torch.dtype | None, device: str | torch.device) -> torch.dtype:
    """The base dtype to load on ``device`` for a requested ``value`` (``auto``/None, a name or a
    torch dtype): ``ValueError`` for an invalid value or a GPU without bf16; on a CPU without
    native bf16, ``float32`` with a logged warning (the module docstring)."""
    name = parse_dtype(value)
    if name == "auto":
        return default_dtype(device)
    dtype = DTYPES[name]
    if dtype == torch.bfloat16:
        why = bf16_unsupported(device)
        if why is not None:
            if torch.device(device).type != "cpu":
                raise ValueError(f"cannot load the base model in bfloat16 on {device}: {why}; use float32")
            log.warning("bfloat16 requested on %s but %s: loading the base model in float32", device, why)
            return torch.float32
    return dtype
