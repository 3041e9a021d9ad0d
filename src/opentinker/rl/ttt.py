"""Test-time training: LoRA updates inside live episodes, on the episode's own text.

Each live episode gets its own adapter, forked from the policy's current weights: the policy is
saved once (:func:`fork_point`, a ``tinker://…/weights/…`` path) and every episode's adapter is
created from that path with ``create_training_client_from_state`` (no optimizer state: each fork
starts a fresh AdamW). The fork is made lazily, before the episode's second turn; the first turn
is sampled from the policy itself (the fork's weights are the same). Before every later turn the
episode's adapter takes ``steps`` (k) updates on the episode's text so far, then the turn is
sampled from a snapshot of the updated adapter. Once the group's episodes have ended, each
adapter is dropped (embedded: ``delete_model``; a server frees it with its session) or, with
``keep``, its training client is kept for analysis (``TTTStats.kept``). Only the client API is used, so this
runs embedded or against any Tinker server; all live episodes submit their updates concurrently,
and since each is its own model, the scheduler fuses them into the same ticks (one
forward/backward over every episode's adapter, then their optimizer steps).

**The update's data.** The episode's text so far is the observation the next turn will be
sampled from, ``x_0 … x_{L-1}`` (every earlier observation, action and environment reply: a
multi-turn observation extends the last one). One ``cross_entropy`` datum: input ``x_0 … x_{L-2}``,
target ``x_j`` at position ``j - 1`` for ``j = 1 … L-1``. The trained span is ``j >= P`` with
``P = len(first observation)`` (the task's opening prompt is the same in every episode and says
nothing about this one; ``train_prompt=True`` sets ``P = 1``).

**The repeated-n-gram down-weighting** (the exact rule). Let ``g_j = (x_{j-n+1}, …, x_j)`` be the
n-gram that ends at target ``j`` (defined for ``j >= n - 1``; it may reach back into the prompt),
and ``H`` the set of n-grams of the trained spans of this episode's earlier updates (empty at its
first update). The raw weight of target ``j`` is::

    0                   if j < P
    repeat_weight       if j >= n - 1 and (g_j in H or g_j = g_i for some P <= i < j)
    1                   otherwise

so the text new since the last update weighs 1 unless it repeats an n-gram seen before, in an
earlier update or earlier in this text, and text already trained on weighs ``repeat_weight``.
After the update ``H`` gains every ``g_j`` of the span. All k steps of one update use the same
weights. The datum's weights are the raw weights divided by the span's length ``L - P``, so the
loss is a per-token mean (the learning rate does not scale with the episode's length).
:func:`ngram_weights` computes the raw weights.

**With RL.** The trajectories are ordinary :class:`~opentinker.rl.types.Trajectory` s: their
sampled logprobs are those of the adapter that sampled each turn, so the outer policy trains on
them as usual (``importance_sampling``, ``ppo``, … correct for the difference between the TTT
adapter and the policy). ``RLConfig.ttt`` switches it on in :func:`~opentinker.rl.loop.run_rl`.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tinker import types

from opentinker.data.datum import datum_from_tokens
from opentinker.rl.rollout import SamplerError, gather_or_cancel, refused_for_its_prompt, rollout_group
from opentinker.rl.types import EnvGroupBuilder, TrajectoryGroup

NGram = tuple[int, ...]


@dataclass(frozen=True)
class TTTConfig:
    """``steps`` (k >= 1) updates before each turn after the first, AdamW at ``learning_rate``;
    n-grams of ``ngram`` (n >= 1) tokens; ``repeat_weight`` in [0, 1] on repeated ones; ``keep``:
    keep each episode's adapter when it ends instead of dropping it."""

    steps: int = 1
    learning_rate: float = 1e-3
    ngram: int = 3
    repeat_weight: float = 0.25
    train_prompt: bool = False
    keep: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"TTT steps (k) must be an integer >= 1, got {self.steps!r}")
        if isinstance(self.ngram, bool) or not isinstance(self.ngram, int) or self.ngram < 1:
            raise ValueError(f"TTT ngram size (n) must be an integer >= 1, got {self.ngram!r}")
        w = self.repeat_weight
        if isinstance(w, bool) or not isinstance(w, int | float) or not (math.isfinite(w) and 0 <= w <= 1):
            raise ValueError(f"TTT repeat_weight must be a number in [0, 1], got {w!r}")
        lr = self.learning_rate
        if isinstance(lr, bool) or not isinstance(lr, int | float) or not (math.isfinite(lr) and lr > 0):
            raise ValueError(f"TTT learning_rate must be a positive number, got {lr!r}")


def ngram_weights(
    tokens: Sequence[int], prompt_len: int, seen: set[NGram], n: int, repeat_weight: float
) -> tuple[list[float], set[NGram]]:
    """The raw weights of targets ``x_1 … x_{L-1}`` of ``tokens`` (the module docstring's rule),
    and the n-grams of the trained span (to add to ``seen`` for the next update)."""
    toks = [int(t) for t in tokens]
    start = max(1, prompt_len)
    weights: list[float] = []
    here: set[NGram] = set()
    for j in range(1, len(toks)):
        if j < start:
            weights.append(0.0)
            continue
        g = tuple(toks[j - n + 1 : j + 1]) if j >= n - 1 else None
        weights.append(repeat_weight if g is not None and (g in seen or g in here) else 1.0)
        if g is not None:
            here.add(g)
    return weights, here


def ttt_datum(tokens: Sequence[int], weights: Sequence[float], prompt_len: int) -> types.Datum:
    """The update's ``cross_entropy`` datum: the raw ``weights`` divided by the trained span's
    length ``L - P`` (``P = max(1, prompt_len)``)."""
    toks = [int(t) for t in tokens]
    if len(weights) != len(toks) - 1:
        raise ValueError(f"need one weight per target token ({len(toks) - 1}), got {len(weights)}")
    span = max(1, len(toks) - max(1, prompt_len))
    return datum_from_tokens(toks, weights=[0.0, *(float(w) / span for w in weights)])


async def fork_point(training_client: Any, name: str) -> str:
    """Save the policy's current weights once, as the source every episode's adapter forks from."""
    return str((await training_client.save_state(name)).path)


@dataclass
class TTTStats:
    """What the test-time updates of a rollout did: updates taken, forks made, mean loss."""

    updates: int = 0
    forks: int = 0
    loss_sum: float = 0.0
    tokens: int = 0
    kept: list[Any] = field(default_factory=list)  # training clients kept (``keep=True``)

    def metrics(self) -> dict[str, float]:
        return {
            "ttt/updates": float(self.updates),
            "ttt/forks": float(self.forks),
            "ttt/loss": self.loss_sum / self.updates if self.updates else float("nan"),
        }


class TTTEpisode:
    """One episode's sampler: forks its own adapter, trains it on the text so far before each
    turn, then samples that turn from it."""

    def __init__(
        self, service: Any, fork_path: str, cfg: TTTConfig, prompt_len: int, policy: Any, stats: TTTStats
    ) -> None:
        self.service, self.fork_path, self.cfg, self.prompt_len = service, fork_path, cfg, prompt_len
        self.sampler, self.stats = policy, stats
        self.tc: Any = None
        self.seen: set[NGram] = set()
        self.trained_len = prompt_len

    async def _update(self, tokens: list[int]) -> None:
        if self.tc is None:
            tc = self.service.create_training_client_from_state(self.fork_path)
            self.tc = await tc if inspect.isawaitable(tc) else tc  # the SDK's is a future
            self.stats.forks += 1
        cfg = self.cfg
        start = 1 if cfg.train_prompt else self.prompt_len
        weights, grams = ngram_weights(tokens, start, self.seen, cfg.ngram, cfg.repeat_weight)
        datum = ttt_datum(tokens, weights, start)
        adam = types.AdamParams(learning_rate=cfg.learning_rate)
        for _ in range(cfg.steps):  # submit both, then wait: they run in one tick
            fb = self.tc.forward_backward([datum], "cross_entropy")
            opt = self.tc.optim_step(adam)
            out = await fb
            await opt
            self.stats.loss_sum += float(out.metrics.get("loss:sum", 0.0))
            self.stats.updates += 1
        self.seen |= grams
        self.trained_len = len(tokens)
        self.sampler = await self.tc.save_weights_and_get_sampling_client()

    async def sample(self, prompt: types.ModelInput, num_samples: int, sampling_params: Any) -> Any:
        tokens = list(prompt.to_ints())
        if len(tokens) > self.trained_len:
            try:
                await self._update(tokens)
            except Exception as e:
                if refused_for_its_prompt(e):
                    raise  # the episode's text is what was refused: this episode fails alone
                raise SamplerError(f"the test-time update failed: {type(e).__name__}: {e}") from e
        return await self.sampler.sample(
            prompt=prompt, num_samples=num_samples, sampling_params=sampling_params
        )

    async def close(self) -> None:
        if self.tc is None:
            return
        if self.cfg.keep:
            self.stats.kept.append(self.tc)
            return
        drop = getattr(self.service, "delete_model", None)  # embedded; a server frees it with the session
        if drop is not None:
            drop(self.tc.model_id)
        self.tc = None


async def ttt_rollout_group(
    builder: EnvGroupBuilder,
    policy: Any,
    params: types.SamplingParams,
    *,
    service: Any,
    fork_path: str,
    cfg: TTTConfig,
    seed: int | None = None,
    timeout_s: float | None = None,
    policy_version: int = 0,
    stats: TTTStats | None = None,
) -> TrajectoryGroup:
    """:func:`~opentinker.rl.rollout.rollout_group` with test-time training in every episode:
    ``policy`` samples the first turns, each episode's own adapter (forked from ``fork_path``,
    see :func:`fork_point`) the later ones. Same seeds, same failure handling."""
    stats = stats if stats is not None else TTTStats()
    episodes: list[TTTEpisode] = []

    def own(i: int, first_ob: list[int]) -> TTTEpisode:
        ep = TTTEpisode(service, fork_path, cfg, len(first_ob), policy, stats)
        episodes.append(ep)
        return ep

    try:
        return await rollout_group(
            builder, policy, params, seed=seed, timeout_s=timeout_s, policy_version=policy_version,
            policy_for_episode=own,
        )  # fmt: skip
    finally:
        await gather_or_cancel(*(ep.close() for ep in episodes))
