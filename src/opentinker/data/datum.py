"""The one data path: token sequences with per-token masks -> ``tinker.types.Datum``.

Tinker's convention (DESIGN.md §3): the model input is ``tokens[:-1]`` and position *i* predicts
``tokens[i + 1]``; every per-token field has the targets' length. SFT puts its weights on the
tokens to learn; RL puts the trajectory's advantage (and the sampler's logprob) on the action tokens
and 0 on everything the policy did not generate (context, environment observations).
"""

from __future__ import annotations

import math

from tinker import types

from opentinker.data.trajectory import Trajectory


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


def trajectory_segments(traj: Trajectory) -> list[tuple[list[int], list[float], list[bool]]]:
    """Split a trajectory into full sequences: consecutive turns whose observation extends the
    previous observation + action are merged into one sequence (a multi-turn chat is one datum);
    a turn whose context was rewritten starts a new one. Each segment: (tokens, sampler logprob per
    token, is-action per token)."""
    segs: list[tuple[list[int], list[float], list[bool]]] = []
    tokens: list[int] = []
    lps: list[float] = []
    act: list[bool] = []
    for t in traj.transitions:
        if tokens and t.ob[: len(tokens)] == tokens:
            new_ob = t.ob[len(tokens) :]
        else:
            if tokens:
                segs.append((tokens, lps, act))
            tokens, lps, act = [], [], []
            new_ob = t.ob
        tokens = tokens + list(new_ob) + list(t.ac)
        lps = lps + [0.0] * len(new_ob) + list(t.ac_logprobs)
        act = act + [False] * len(new_ob) + [True] * len(t.ac)
    if tokens:
        segs.append((tokens, lps, act))
    return segs


def rl_datums(
    traj: Trajectory, advantage: float, token_advantages: list[list[float]] | None = None
) -> list[types.Datum]:
    """RL: advantages on the action tokens (``advantage``, plus per-token shaping such as a KL
    penalty in ``token_advantages``, one list per segment), sampler ``logprobs`` on them, 0 on
    everything else."""
    out = []
    for k, (tokens, lps, act) in enumerate(trajectory_segments(traj)):
        extra = token_advantages[k] if token_advantages is not None else [0.0] * len(tokens)
        adv = [(advantage + e) if a else 0.0 for a, e in zip(act, extra, strict=True)]
        out.append(
            datum_from_tokens(
                tokens, advantages=adv, logprobs=[lp if a else 0.0 for lp, a in zip(lps, act, strict=False)]
            )
        )
    return out
