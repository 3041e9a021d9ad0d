"""How close two fp32 computation paths must agree: every tolerance of the test suite, stated once.

Two paths that compute the same function (a mixed batch vs each adapter alone, the lean decode vs
the HF forward, a prefix-cache hit vs a whole prefill, the sampler vs ``forward``) run different
kernels: another batch size, another fusion or another CPU picks another blocking of each K-term
dot product, so the terms are summed in another order. In fp32 (unit roundoff ``EPS32`` = 2^-23 ≈
1.19e-7) one K-term reduction then differs by about ``sqrt(K) * EPS32 * sum|terms|`` (rounding
errors of a reordered sum behave like a random walk), and a forward chains ``n`` such reductions
(per layer: attention and MLP; then the unembedding), so the relative difference of a logit is
about ``sqrt(n * K) * EPS32``. For the tiny test model (hidden 128, MLP 352, 4 layers, ~10
reductions): ``sqrt(10 * 352) * EPS32 ≈ 7e-6`` relative, times |logit| (3 on average, up to 20
on this model) → ~2e-5 absolute on a logprob, ~1.4e-4 at the largest logits. What is seen fits:
1.5e-5 between the lean and HF decoders on an
AVX-512/AMX Xeon (oneDNN/MKL choose AVX-512 or AMX kernels there, AVX2 ones elsewhere; thread
count changes the split of the reductions too), so the suite's former 1e-5 only held on some CPUs.

The bounds, each several times the largest difference measured and still orders of magnitude
below what a real bug does (the tests' adapters change logprobs by 1-30 nats, ~1 relative in norm,
so a row routed to the wrong adapter, a dropped LoRA term or a wrong position is far outside them):

- ``LOGPROB_ATOL = 1e-4``: one token's logprob, absolute (docs/DESIGN.md invariants 3 and 5's own
  bound; the estimate for the largest logits, 4x the largest difference measured).
- ``REL = 1e-4``: whole tensors (a batch's logprobs or losses, gradients, layer outputs, weights
  after one step), relative in norm, ``||a - b|| <= REL * ||b||``. Per element a relative bound
  fails on values that are themselves ~0 (a gradient coordinate, a LoRA delta at B ≈ 0); in norm
  the estimate above holds. Differences of ~1e-5 are what invariant 1 (docs/DESIGN.md) usually
  shows, but that is not a bound fp32 guarantees (the scalar kernels reach 1.45e-5, below).
- ``ELEMENTWISE_REL = 1e-6``: elementwise arithmetic only (an optimizer step against
  ``torch.optim.AdamW`` on the same gradients, a resumed run against an uninterrupted one): no
  reduction is reordered, at most fused (FMA, foreach kernels): a few ulps (``EPS32``) per element.
- ``SCALAR_REL = 1e-4``: a sum of per-token values (``loss:sum``), relative to max(|value|, 1).
- ``TRAJECTORY_REL = 1e-3``: several optimizer steps apart. AdamW with Tinker's eps 1e-12 divides
  each gradient coordinate by its own magnitude, so a coordinate whose gradient is near 0 takes a
  full-size step whose sign is set by rounding, and two paths' weights can drift apart by much
  more than one step's rounding (the losses of 8 clients' 3 steps, fused vs alone, differ by
  3.8e-7 here, but one sign flip on a near-zero coordinate moves that weight by 2 * lr), so
  bounded here, not zero. Their logits then differ by up to
  ``TRAJECTORY_LOGIT_ATOL = 1e-2`` (TRAJECTORY_REL times |logit| ≲ 10), so greedy tokens after
  training are compared only up to the first near tie (``assert_greedy_equal(gaps=...)``).

Measured (``OPENTINKER_TOL_REPORT=<file>``: each comparison appends its error and bound as a JSON
line) over the engine-level tests, largest difference seen:

=====================================================  ===========  =============
kernels                                                logprob abs  rel (in norm)
=====================================================  ===========  =============
AVX-512/AMX Xeon, native, 1 and 2 threads              2.4e-5       4.8e-6
same CPU, ATEN_CPU_CAPABILITY=avx2, MKL AVX2, 2 thr.   8.6e-6       4.7e-6
same CPU, ATEN_CPU_CAPABILITY=default (scalar), 2 thr  1.3e-5       1.45e-5
NVIDIA H200, TF32 off, SmolLM2-135M shape (30 layers)  1.9e-6       7.5e-6
=====================================================  ===========  =============

(the AVX2 row also sets ``MKL_ENABLE_INSTRUCTIONS=AVX2``, the scalar row ``=SSE4_2``, both
``ONEDNN_MAX_CPU_ISA=AVX2``; the H200 row is the earlier GPU run kept in
``benchmarks/results/gpu_check_h200.json``.) So the former 1e-5
held on AVX2 kernels only: AVX-512/AMX broke it for logprobs, the scalar kernels for tensors.
With TF32 or bf16 on a GPU none of these hold; the device tests turn TF32 off (tests/conftest.py).
A model much larger than SmolLM2-135M may need larger bounds (the estimate grows as
sqrt(layers * width)).

**A bf16 base** (``tests/test_dtype.py``; docs/DESIGN.md invariant 11). The base's weights, its
activations, its KV cache and its logits are bf16 (unit roundoff ``EPS_BF16 / 2`` = 2^-8 ≈ 3.9e-3,
65536 times fp32's); LoRA weights, gradients and optimizer state stay fp32, and logprobs are taken
in fp32 from the bf16 logits. Matmuls accumulate in fp32 inside the kernel, so what differs
between two paths is where each op's output is rounded to bf16: two paths whose values differ
by a hair round them to neighbouring bf16 numbers. The largest single term is the logits' own
rounding: the tiny model's logits reach ~20, where bf16 numbers are 2^-3 = 0.125 apart, so one
token's logprob can differ by one spacing from that alone. Measured on the tiny model (AVX512-BF16
CPU, 1 and 2 threads), largest seen, and the bounds:

- ``BF16_LOGPROB_ATOL = 0.25`` (one token, absolute: two spacings at |logit| < 32): sampler vs
  trainer 0.12 (lean and HF decode), mixed batch vs alone 0.047.
- ``BF16_LOGPROB_MEAN = 0.05`` (mean |difference| over a batch's tokens): sampler vs trainer 0.019.
  Most logits are far smaller than the largest, so most tokens differ by much less than a spacing.
- ``BF16_KL_V1 = 1e-2``: the tinker-cookbook's ``kl_sample_train_v1`` (the *signed* mean of sampler
  minus trainer logprob). Rounding differences are about as often positive as negative, so over
  ``n`` tokens of rms difference ``r`` it is ~``r / sqrt(n)``: 0.032 / sqrt(192) = 2.3e-3; seen
  3.7e-3 (1.6 sigma); bounded at ~4 sigma.
- ``BF16_REL = 0.1`` (gradients of a mixed batch vs each adapter alone, relative in norm): 0.030
  seen. A LoRA gradient is a sum over tokens and positions of products of bf16-rounded activations
  whose terms partly cancel, so the few-u relative error of each term is a few percent of the sum.
- ``BF16_CROSS_DTYPE_ATOL = 0.3``, ``BF16_CROSS_DTYPE_MEAN = 0.08``: the same fp32 LoRA weights on a
  bf16 and on an fp32 base (a checkpoint moved between them): 0.14 and 0.031 seen. This is the bf16
  path's whole rounding error against (near) exact, not two roundings of nearly equal values.

A real bug still stands far outside these: the tests' adapters move logprobs by 1-30 nats, so a row
on the wrong adapter or a dropped LoRA term changes the mean difference by ~1 and gradients by ~100%.
SmolLM2-135M (30 layers, larger logits) gives larger figures (``benchmarks/p_bf16.py``: sampler vs
trainer mean 0.06, max 0.35); these bounds are the tiny model's.

Greedy tokens are compared exactly where the weights are the same: two paths whose logits differ by
~1e-5 pick different argmaxes only where the top-2 logits are that close, which no greedy row of
these tests hits on any of the kernels above (``assert_greedy_equal`` names the position if one
ever does). After training on two paths (drifted weights) only up to the first near tie.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence

import torch

EPS32 = torch.finfo(torch.float32).eps
LOGPROB_ATOL = 1e-4
REL = 1e-4
ELEMENTWISE_REL = 1e-6
SCALAR_REL = 1e-4
TRAJECTORY_REL = 1e-3
TRAJECTORY_LOGIT_ATOL = 1e-2
BF16_LOGPROB_ATOL = 0.25
BF16_LOGPROB_MEAN = 0.05
BF16_KL_V1 = 1e-2
BF16_REL = 0.1
BF16_CROSS_DTYPE_ATOL = 0.3
BF16_CROSS_DTYPE_MEAN = 0.08

Values = torch.Tensor | Sequence[float | None]


def _tensor(x: Values) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", torch.float64)
    return torch.tensor([math.nan if v is None else float(v) for v in x], dtype=torch.float64)


def _record(kind: str, err: float, tol: float) -> None:
    """Append the error and the bound to $OPENTINKER_TOL_REPORT (how the bounds were measured)."""
    path = os.environ.get("OPENTINKER_TOL_REPORT")
    if path:
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
        with open(path, "a") as f:
            f.write(json.dumps({"test": test, "kind": kind, "err": err, "tol": tol}) + "\n")


def assert_logprobs_close(actual: Values, expected: Values, atol: float = LOGPROB_ATOL) -> None:
    """Per-token logprobs of two paths: equal shapes, max |difference| <= ``atol``."""
    a, e = _tensor(actual), _tensor(expected)
    assert a.shape == e.shape, f"shapes differ: {tuple(a.shape)} vs {tuple(e.shape)}"
    if a.numel() == 0:
        return
    err = float((a - e).abs().max())
    _record("logprob", err, atol)
    assert err <= atol, f"max |logprob difference| {err:.3g} > {atol}"


def assert_mean_abs_close(diff: Values, atol: float) -> None:
    """Many tokens' differences of two paths: their mean absolute value is <= ``atol``."""
    d = _tensor(diff)
    err = float(d.abs().mean()) if d.numel() else 0.0
    _record("mean_abs", err, atol)
    assert err <= atol, f"mean |difference| {err:.3g} > {atol}"


def assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, rel: float = REL) -> None:
    """Whole tensors: ``||actual - expected|| <= rel * ||expected||`` (see the module docstring)."""
    a, e = _tensor(actual), _tensor(expected)
    assert a.shape == e.shape, f"shapes differ: {tuple(a.shape)} vs {tuple(e.shape)}"
    err = float((a - e).norm()) / max(float(e.norm()), 1e-30)
    _record("rel", err, rel)
    assert err <= rel, f"relative error {err:.3g} > {rel}"


def assert_state_close(
    actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], rel: float = REL
) -> None:
    """Two state dicts (adapter weights, gradients): the same keys, each tensor ``assert_rel_close``."""
    assert sorted(actual) == sorted(expected)
    for k in expected:
        assert_rel_close(actual[k], expected[k], rel)


def assert_scalar_close(actual: float, expected: float, rel: float = SCALAR_REL) -> None:
    """A sum of per-token values (``loss:sum``): ``|actual - expected| <= rel * max(|expected|, 1)``."""
    err = abs(float(actual) - float(expected)) / max(abs(float(expected)), 1.0)
    _record("scalar", err, rel)
    assert err <= rel, f"{actual} vs {expected}: relative error {err:.3g} > {rel}"


def assert_greedy_equal(
    actual: Sequence[int],
    expected: Sequence[int],
    what: str = "",
    *,
    gaps: Sequence[float] | None = None,
    gap_tol: float = 0.0,
) -> None:
    """Greedy tokens of two paths are identical (an exact invariant: see the module docstring).

    With ``gaps`` (``expected``'s top-1 minus top-2 logprob at each position) the tokens are
    compared up to and including the first position whose gap is below ``gap_tol``: where the
    two paths' logits may differ by ``gap_tol``, the argmax there is a tie and the rest is free."""
    n = max(len(actual), len(expected))
    if gaps is not None:
        near = [i for i, g in enumerate(gaps) if g < gap_tol]
        if near:
            n = near[0] + 1
    got, want = list(actual)[:n], list(expected)[:n]
    if got != want:
        pos = next(
            (i for i, (x, y) in enumerate(zip(got, want, strict=False)) if x != y), min(len(got), len(want))
        )
        gap = f" (top-2 gap there {gaps[pos]:.3g})" if gaps is not None and pos < len(gaps) else ""
        raise AssertionError(f"greedy tokens differ {what} at position {pos}{gap}: {actual} vs {expected}")
