"""Check a request completely before anything runs, so bad input can never reach the weights.

Every check raises :class:`EngineError` with a message naming the datum and field at fault.
"""

from __future__ import annotations

import math

import torch

from opentinker.engine.losses import LOSSES
from opentinker.engine.types import EngineError, Example, ForwardRequest


def validate_request(
    req: ForwardRequest, *, vocab_size: int, max_context: int, max_batch_tokens: int
) -> None:
    if req.loss_fn == "custom":
        _validate_custom(req, vocab_size, max_context, max_batch_tokens)
        return
    spec = LOSSES.get(req.loss_fn)
    if spec is None:
        raise EngineError(f"unknown loss_fn {req.loss_fn!r}; known: {', '.join(sorted(LOSSES))}")
    for key, value in req.loss_fn_config.items():
        if key not in spec.config:
            allowed = ", ".join(sorted(spec.config)) or "none"
            raise EngineError(f"unknown loss_fn_config key {key!r} for {req.loss_fn} (allowed: {allowed})")
        if not isinstance(value, int | float) or not math.isfinite(float(value)):
            raise EngineError(f"loss_fn_config[{key!r}]={value!r} must be a finite number")
    if not req.examples:
        raise EngineError("the request has no data")
    total = 0
    for i, ex in enumerate(req.examples):
        total += _validate_example(i, ex, spec.required, spec.optional, vocab_size, max_context)
    if total > max_batch_tokens:
        raise EngineError(f"the request has {total} tokens, over the limit of {max_batch_tokens}")


def _validate_custom(req: ForwardRequest, vocab_size: int, max_context: int, max_batch_tokens: int) -> None:
    """A server-side custom loss: each datum has target_tokens, and every input the loss declares
    at its declared rank (the datum may carry other inputs, which the loss does not read)."""
    loss = req.custom_loss
    if loss is None:
        raise EngineError("loss_fn 'custom' needs a loss made by create_custom_loss (loss_fn_config loss_id)")
    if req.loss_fn_config:
        raise EngineError(
            f"loss_fn 'custom' takes no loss_fn_config besides loss_id, got {sorted(req.loss_fn_config)}"
        )
    if not req.examples:
        raise EngineError("the request has no data")
    total = 0
    for i, ex in enumerate(req.examples):
        read = {k: v for k, v in ex.inputs.items() if k in ("target_tokens", *loss.input_names)}
        n = _validate_example(
            i,
            Example(ex.tokens_T, read),
            ("target_tokens",),
            loss.input_names,
            vocab_size,
            max_context,
            custom=True,
        )
        loss.check_datum(f"datum {i}", tuple(read["target_tokens"].shape), read)
        total += n
    if total > max_batch_tokens:
        raise EngineError(f"the request has {total} tokens, over the limit of {max_batch_tokens}")


def _validate_example(
    i: int,
    ex: Example,
    required: tuple[str, ...],
    optional: tuple[str, ...],
    vocab_size: int,
    max_context: int,
    *,
    custom: bool = False,
) -> int:
    where = f"datum {i}"
    tokens = ex.tokens_T
    if tokens.dim() != 1 or tokens.dtype not in (torch.int64, torch.int32):
        raise EngineError(f"{where}: model_input must be a 1-D integer token list")
    n = int(tokens.shape[0])
    if n == 0:
        raise EngineError(f"{where}: model_input is empty")
    if n > max_context:
        raise EngineError(f"{where}: model_input has {n} tokens, over the context length {max_context}")
    _check_token_range(where, "model_input", tokens, vocab_size)
    for key in required:
        if key not in ex.inputs:
            raise EngineError(f"{where}: loss_fn_inputs is missing {key!r}")
    for key, t in ex.inputs.items():
        if key not in required and key not in optional:
            allowed = ", ".join((*required, *optional))
            raise EngineError(
                f"{where}: unknown loss_fn_inputs key {key!r} for this loss (allowed: {allowed})"
            )
        if custom and key != "target_tokens" and t.numel() == 1 and t.dim() <= 1:
            pass  # a scalar input of a custom loss (rank 0; its rank is checked by the loss)
        elif t.dim() == 0 or t.shape[0] != n:
            got = tuple(t.shape)
            raise EngineError(
                f"{where}: loss_fn_inputs[{key!r}] has shape {got}, but model_input has {n} tokens"
            )
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise EngineError(f"{where}: loss_fn_inputs[{key!r}] contains NaN or inf")
    targets = ex.inputs.get("target_tokens")
    if targets is not None:
        if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
            dtype = str(targets.dtype).removeprefix("torch.")
            raise EngineError(f"{where}: target_tokens must be integer token ids, got {dtype}")
        if targets.dim() not in (1, 2):
            raise EngineError(f"{where}: target_tokens must be [T] or [T, K]")
        _check_token_range(where, "target_tokens", targets, vocab_size)
        for key, t in ex.inputs.items():
            if key == "weights" and t.shape != targets.shape:
                raise EngineError(
                    f"{where}: weights has shape {tuple(t.shape)} but target_tokens has {tuple(targets.shape)}"
                )
            if key != "weights" and key != "target_tokens" and t.dim() != 1 and not custom:
                raise EngineError(f"{where}: loss_fn_inputs[{key!r}] must be 1-D [T]")
        if targets.dim() == 2 and set(ex.inputs) - {"target_tokens", "weights"} and not custom:
            raise EngineError(f"{where}: 2-D (soft) target_tokens are only supported by cross_entropy")
    return n


def _check_token_range(where: str, name: str, tokens: torch.Tensor, vocab_size: int) -> None:
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= vocab_size:
        bad = hi if hi >= vocab_size else lo
        raise EngineError(f"{where}: {name} has token id {bad} outside the vocabulary [0, {vocab_size})")
