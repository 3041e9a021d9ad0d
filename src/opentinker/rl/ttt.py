"""Test-time training: LoRA updates inside live episodes, on the episode's own text.

Each live episode gets its own adapter, forked from the policy's current weights: the policy is
saved once (:func:`fork_point`, a ``tinker://…/weights/…`` path) and every episode's adapter is
created from that path with ``create_training_client_from_state`` (no optimizer state: each fork
starts a fresh AdamW). The fork is made lazily, before the episode's second turn; the first turn
is sampled from the policy itself (the fork's weights are the same). Before every later turn the
episode's adapter takes ``steps`` (k) updates on the episode's text so far, then the turn is
sampled from a snapshot of the updated adapter. When an episode ends, its adapter goes back to
a pool (or, with ``keep``, its training client is kept for analysis: ``TTTStats.kept``); the next
episode that needs a fork resets a pooled one with ``load_state(fork path)`` (weights only and a
fresh optimizer, as a new fork) instead of creating a model; :meth:`TTTUpdates.close` drops the
pool (``delete_model``). That is where the client can release models
(``opentinker.client.ReleasesModels``: embedded): the Tinker SDK deprecates
``TrainingClient.load_state``, so against a server every episode's adapter is a new training
client from the fork path, freed with the server session. Only the client API is used, so this
runs embedded or against any Tinker server.

**Fused updates.** The live episodes (of one rollout, or of every rollout that shares a
:class:`TTTUpdates`: the RL loop shares one for all groups) wait for each other between turns:
the updates are released together once every live episode waits for one or has ended (or
``max_wait_s`` after the first began to wait). Each released episode then queues its k
``forward_backward`` + ``optim_step`` pairs and its snapshot at once, without waiting in between;
each is its own model and the scheduler takes one forward/backward and one optimizer step per
model per tick, so tick i runs step i of every released episode as one fused forward/backward.

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

**The update window** (``window`` = W, an option; None by default: all the text). With
``s = max(P, L - W)`` the trained targets are ``x_s … x_{L-1}`` (the last W, or fewer when the
text after the prompt is shorter), each with its raw weight above (the n-gram rule still reads the
whole text), divided by ``L - s``. The datum keeps the opening ``x_0 … x_{P-1}`` and then
``x_{s-1} … x_{L-1}``: the text between is left out of the input, so the model sees the task's
prompt followed by the window (``x_{s-1}``, the window's first context token, is not a target;
nothing is left out when ``s <= P + 1``). ``H`` gains only the window's n-grams. The update's
forward/backward then costs ``P + W`` tokens instead of ``L``, whatever the episode's length.
With ``window_prompt=False`` the opening is left out too: the datum is ``x_{s-1} … x_{L-1}``
alone (the same targets and weights), so the update costs ``W + 1`` tokens; the model then
learns the window's text without the task's prompt before it.

**Reusing the sampler's keys and values** (``reuse_kv``, an option; off by default). After an
update, a new snapshot has no cached prefix, so the next turn re-prefills the episode's whole
text. With ``reuse_kv`` each episode's adapter is saved with ``kind="inflight"``
(the SDK's contract; embedded: ``service/inflight.py``) and the episode samples all its later
turns through its first inflight session, whose KV-cache namespace outlives the saves: a turn
prefills only the text new since the last turn (the environment's reply), attending to the keys
and values of the earlier text as they were computed, under the adapter versions that sampled
those turns. The approximation: the turn's tokens are sampled from the updated adapter over
stale keys and values of its context (their logprobs, in the trajectory, are those of that
computation, not of a full prefill under the new weights); what is trained is unchanged.

**With RL.** The trajectories are ordinary :class:`~opentinker.rl.types.Trajectory` s: their
sampled logprobs are those of the adapter that sampled each turn, so the outer policy trains on
them as usual (``importance_sampling``, ``ppo``, … correct for the difference between the TTT
adapter and the policy). ``RLConfig.ttt`` switches it on in :func:`~opentinker.rl.loop.run_rl`.
"""

from __future__ import annotations

import asyncio
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
    keep each episode's adapter when it ends instead of pooling it for reuse; ``max_wait_s``: how
    long an update waits at most for the other live episodes' (to fuse with them); ``window``: train
    on the last ``window`` (W >= 1) targets of the text only (None: all of it; the rule is in the
    module docstring); ``reuse_kv``: sample each episode through one ``kind="inflight"`` session, whose
    cached keys and values of earlier turns are reused after an update (the approximation is in the
    module docstring); ``window_prompt``: with a window, keep the task's opening prompt in front of
    it (True) or train on the window alone (False, about half the cost again)."""

    steps: int = 1
    learning_rate: float = 1e-3
    ngram: int = 3
    repeat_weight: float = 0.25
    train_prompt: bool = False
    keep: bool = False
    max_wait_s: float = 5.0
    window: int | None = None
    reuse_kv: bool = False
    window_prompt: bool = True

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
        mw = self.max_wait_s
        if isinstance(mw, bool) or not isinstance(mw, int | float) or not (math.isfinite(mw) and mw >= 0):
            raise ValueError(f"TTT max_wait_s must be a finite number >= 0, got {mw!r}")
        for name in ("reuse_kv", "window_prompt"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"TTT {name} must be True or False, got {getattr(self, name)!r}")
        win = self.window
        if win is not None and (isinstance(win, bool) or not isinstance(win, int) or win < 1):
            raise ValueError(f"TTT window (W) must be an integer >= 1 or None, got {win!r}")


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


def window_datum(
    tokens: Sequence[int], weights: Sequence[float], prompt_len: int, window: int, *, prompt: bool = True
) -> tuple[types.Datum, int]:
    """The update's datum under ``TTTConfig.window`` = W (the module docstring's rule): the
    opening ``P`` tokens (unless ``prompt`` is False), then ``x_{s-1} … x_{L-1}`` with
    ``s = max(P, L - W)``, the targets ``j >= s`` keeping their raw ``weights`` and divided by
    ``L - s``. Returns it and ``s``."""
    toks = [int(t) for t in tokens]
    if len(weights) != len(toks) - 1:
        raise ValueError(f"need one weight per target token ({len(toks) - 1}), got {len(weights)}")
    p = max(1, prompt_len)
    s = max(p, len(toks) - window)
    if not prompt:
        keep = list(range(s - 1, len(toks)))
    elif s <= p + 1:
        keep = list(range(len(toks)))
    else:
        keep = [*range(p), *range(s - 1, len(toks))]
    w = [0.0] + [float(weights[j - 1]) / max(1, len(toks) - s) if j >= s else 0.0 for j in keep[1:]]
    return datum_from_tokens([toks[j] for j in keep], weights=w), s


async def fork_point(training_client: Any, name: str) -> str:
    """Save the policy's current weights once, as the source every episode's adapter forks from."""
    return str((await training_client.save_state(name)).path)


@dataclass
class TTTStats:
    """What the test-time updates of a rollout did: updates taken, forks made (new adapters and
    reused ones), fused batches the updates were released in, mean loss."""

    updates: int = 0
    forks: int = 0
    reused: int = 0  # forks that reset an ended episode's adapter instead of making a new one
    gated: int = 0  # updates released from the gate
    fused_sum: int = 0  # over those, how many episodes each was released with (itself included)
    loss_sum: float = 0.0
    tokens: int = 0  # input tokens of the updates' forward/backward passes
    kept: list[Any] = field(default_factory=list)  # training clients kept (``keep=True``)

    def metrics(self) -> dict[str, float]:
        return {
            "ttt/updates": float(self.updates),
            "ttt/forks": float(self.forks),
            "ttt/reused": float(self.reused),
            "ttt/fused_mean": self.fused_sum / self.gated if self.gated else float("nan"),
            "ttt/loss": self.loss_sum / self.updates if self.updates else float("nan"),
        }


class TTTUpdates:
    """The live TTT episodes of one or more rollouts: the gate that releases their updates
    together, and the pool of ended episodes' adapters to reuse. One per rollout by default; the
    RL loop shares one across a run (every group of a step fuses, forks are reused across steps).
    :meth:`close` drops the pooled adapters."""

    def __init__(self, service: Any, cfg: TTTConfig) -> None:
        self.service, self.cfg = service, cfg
        self._live: set[TTTEpisode] = set()
        self._waiting: dict[TTTEpisode, asyncio.Future[int]] = {}
        self._check: asyncio.Handle | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._free: list[Any] = []  # training clients of ended episodes
        from opentinker.client import ReleasesModels  # the package root imports the client lazily

        # the SDK deprecates TrainingClient.load_state: against a server each episode forks anew
        self._pooled = isinstance(service, ReleasesModels)

    def episode(self, fork_path: str, prompt_len: int, policy: Any, stats: TTTStats) -> TTTEpisode:
        ep = TTTEpisode(self, fork_path, prompt_len, policy, stats)
        self._live.add(ep)
        return ep

    async def gate(self, ep: TTTEpisode) -> int:
        """Wait until every live episode waits here (or has ended), or ``max_wait_s`` after the
        first began to wait; returns how many episodes were released together."""
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._waiting[ep] = fut
        self._poke()
        try:
            return await fut
        finally:
            self._waiting.pop(ep, None)

    def ended(self, ep: TTTEpisode) -> None:
        """``ep``'s episode is over: its adapter goes to the pool (or is kept), the gate re-checks."""
        self._live.discard(ep)
        self._waiting.pop(ep, None)
        tc, ep.tc = ep.tc, None
        if tc is not None and self.cfg.keep:
            ep.stats.kept.append(tc)
        elif tc is not None and self._pooled:
            self._free.append(tc)
        self._poke()

    def _poke(self) -> None:
        if not self._waiting:
            if self._timer is not None:  # nobody waits any more (cancelled episodes)
                self._timer.cancel()
                self._timer = None
            return
        loop = asyncio.get_running_loop()
        if self._timer is None:
            self._timer = loop.call_later(self.cfg.max_wait_s, self._release)
        if self._check is None and len(self._waiting) >= len(self._live):
            # re-checked on the next round of the loop: episodes started in this round register first
            self._check = loop.call_soon(self._recheck)

    def _recheck(self) -> None:
        self._check = None
        if self._waiting and len(self._waiting) >= len(self._live):
            self._release()

    def _release(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        waiting = [f for f in self._waiting.values() if not f.done()]
        self._waiting.clear()
        for f in waiting:
            f.set_result(len(waiting))

    async def adapter(self, fork_path: str, stats: TTTStats) -> tuple[Any, Any]:
        """A training client forked from ``fork_path``: an ended episode's, reset with
        ``load_state`` (queued: the caller's next requests run after it), else a new one. Returns
        the client and the reset's future (None for a new client)."""
        stats.forks += 1
        if self._free:
            stats.reused += 1
            tc = self._free.pop()
            return tc, tc.load_state(fork_path)
        if self._pooled:  # embedded: its async form waits without holding the event loop
            return await self.service.create_training_client_from_state_async(fork_path), None
        return await self.service.create_training_client_from_state(fork_path), None  # a future

    async def close(self) -> None:
        """Drop the pooled adapters (embedded: ``delete_model``; a server frees them with its session)."""
        free, self._free = self._free, []
        await gather_or_cancel(*(self.service.delete_model_async(tc.model_id) for tc in free))


class TTTEpisode:
    """One episode's sampler: before each turn after the first, waits at the shared gate, takes
    its k updates on the text so far (forking its adapter at the first), then samples the turn
    from a snapshot of the updated adapter."""

    def __init__(
        self, updates: TTTUpdates, fork_path: str, prompt_len: int, policy: Any, stats: TTTStats
    ) -> None:
        self.updates, self.cfg, self.fork_path, self.prompt_len = updates, updates.cfg, fork_path, prompt_len
        self.sampler, self.stats = policy, stats
        self.tc: Any = None
        self.session: Any = None  # reuse_kv: the inflight sampling session of this episode
        self.seen: set[NGram] = set()
        self.trained_len = prompt_len

    async def _update(self, tokens: list[int]) -> None:
        cfg = self.cfg
        start = 1 if cfg.train_prompt else self.prompt_len
        weights, grams = ngram_weights(tokens, start, self.seen, cfg.ngram, cfg.repeat_weight)
        if cfg.window is None:
            datum = ttt_datum(tokens, weights, start)
        else:  # only the window's n-grams were trained on
            datum, s = window_datum(tokens, weights, start, cfg.window, prompt=cfg.window_prompt)
            n = cfg.ngram
            grams = {tuple(tokens[j - n + 1 : j + 1]) for j in range(max(s, n - 1), len(tokens))}
        adam = types.AdamParams(learning_rate=cfg.learning_rate)
        # the data is ready before the gate: once released, the episodes only submit
        together = await self.updates.gate(self)
        self.stats.gated += 1
        self.stats.fused_sum += together
        reset = None
        if self.tc is None:
            self.tc, reset = await self.updates.adapter(self.fork_path, self.stats)
        # all k steps and the snapshot are queued at once, in the model's order: step i of every
        # released episode runs in one tick, with no round trip to this loop in between
        steps = [
            (self.tc.forward_backward([datum], "cross_entropy"), self.tc.optim_step(adam))
            for _ in range(cfg.steps)
        ]
        snap = self.tc.save_weights_and_get_sampling_client(kind="inflight" if cfg.reuse_kv else "snapshot")
        if reset is not None:
            await reset
        for fb, opt in steps:
            out = await fb
            await opt
            self.stats.loss_sum += float(out.metrics.get("loss:sum", 0.0))
            self.stats.updates += 1
            self.stats.tokens += len(datum.model_input.to_ints())
        sampler = await snap
        if cfg.reuse_kv:  # the episode's first inflight session follows every later save
            self.session = self.session if self.session is not None else sampler
            sampler = self.session
        self.sampler = sampler
        self.seen |= grams
        self.trained_len = len(tokens)

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

    def close(self) -> None:
        self.updates.ended(self)


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
    updates: TTTUpdates | None = None,
) -> TrajectoryGroup:
    """:func:`~opentinker.rl.rollout.rollout_group` with test-time training in every episode:
    ``policy`` samples the first turns, each episode's own adapter (forked from ``fork_path``,
    see :func:`fork_point`) the later ones. Same seeds, same failure handling. ``updates``: a
    shared :class:`TTTUpdates` (its ``cfg`` is used), so that the episodes of concurrent rollouts
    fuse and forks are reused; by default one of this group's own, closed at its end."""
    stats = stats if stats is not None else TTTStats()
    own_updates = updates is None
    ttt = TTTUpdates(service, cfg) if updates is None else updates
    episodes: dict[int, TTTEpisode] = {}

    def own(i: int, first_ob: list[int]) -> TTTEpisode:
        episodes[i] = ep = ttt.episode(fork_path, len(first_ob), policy, stats)
        return ep

    def end(i: int) -> None:
        ep = episodes.pop(i, None)
        if ep is not None:
            ep.close()

    try:
        return await rollout_group(
            builder, policy, params, seed=seed, timeout_s=timeout_s, policy_version=policy_version,
            policy_for_episode=own, on_episode_end=end,
        )  # fmt: skip
    finally:
        for i in list(episodes):
            end(i)
        if own_updates:
            await ttt.close()
