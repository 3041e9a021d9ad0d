"""The one data path: token sequences with per-token masks -> ``tinker.types.Datum``.

Tinker's convention (docs/DESIGN.md, "Data path"): the model input is ``tokens[:-1]`` and position *i* predicts
``tokens[i + 1]``; every per-token field has the targets' length. SFT puts its weights on the
tokens to learn; RL (``opentinker.rl.datums``, from trajectories) puts the advantage and the
sampler's logprob on the action tokens and 0 on everything the policy did not generate.
"""

from __future__ import annotations

import math

from tinker import types


def datum_from_tokens(tokens: list[int], **per_token: list[float]) -> types.Datum:
    """A Datum from the full token sequence and per-token fields aligned with ``tokens``
    (the value at a token is what is used when that token is the target)."""
    if len(tokens) < 2:
        raise ValueError(f"a datum needs at least 2 tokens, got {len(tokens)}")
    for name, vals in per_token.items():
        if len(vals) != len(tokens):
            raise ValueError(f"{name}: {len(vals)} values for {len(tokens)} tokens")
        bad = next((i for i, v in enumerate(vals) if not math.isfinite(v)), None)
        if bad is not None:
            raise ValueError(f"{name}[{bad}] is {vals[bad]}: per-token values must be finite")
    inputs: dict[str, list[int] | list[float]] = {"target_tokens": list(tokens[1:])}
    inputs.update({name: list(vals[1:]) for name, vals in per_token.items()})
    return types.Datum(model_input=types.ModelInput.from_ints(list(tokens[:-1])), loss_fn_inputs=inputs)  # type: ignore[arg-type]


def supervised_datum(tokens: list[int], weights: list[float]) -> types.Datum:
    """SFT: cross-entropy ``weights`` per token (0 = context, not learned)."""
    return datum_from_tokens(tokens, weights=weights)
