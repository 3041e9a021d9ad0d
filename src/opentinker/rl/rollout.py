"""Rollouts: run a group's episodes against a policy (any Tinker ``SamplingClient``).

All episodes of all groups of a step run concurrently as coroutines, so their sample requests
reach the sampler together and share its batches. Environments of a group that open with the
same observation are sampled with one request of ``num_samples = n`` (the prompt is prefilled
once).

Two kinds of failure, told apart:

* **The environment's**: its reset or step raises or times out, it returns a non-finite reward
  or an observation that is not a list of token ids, or its context is one the sampler refuses
  (longer than the model's, a token outside the vocabulary). That episode fails alone: it is
  dropped from its group, counted (``env/errors``) and its error kept (``failures``: a run's
  loop writes them to ``errors.jsonl``, :func:`write_failures`); the run goes on.
* **The sampler's** (the infrastructure): the sample request fails for any other reason (the
  sampler is shut down, its weights are gone, the server is unreachable or failed internally),
  or it returns tokens without finite logprobs. No episode can be trusted then, and training on
  what is left would train on nothing: :class:`SamplerError` propagates and stops the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tinker import types

from opentinker.rl.types import Env, EnvGroupBuilder, Trajectory, TrajectoryGroup, Transition

log = logging.getLogger(__name__)

# HTTP statuses with which a Tinker server refuses a request because of what it contains
REQUEST_REFUSED = (400, 413, 422)


class SamplerError(RuntimeError):
    """The sampler (not an environment) failed; the run cannot go on."""


def refused_for_its_prompt(e: BaseException) -> bool:
    """Whether a failed sample request was refused for what it asked (the episode's context), not
    because the sampler failed. Embedded clients raise ``ValueError`` for a refused request (an
    unknown policy is a ``KeyError`` too: the sampler's weights are gone); the SDK raises an
    ``APIStatusError`` with a 4xx status."""
    if isinstance(e, KeyError):
        return False
    if isinstance(e, ValueError):
        return True
    return getattr(e, "status_code", None) in REQUEST_REFUSED


def failure(where: str, e: BaseException) -> str:
    """One line saying what failed: ``"<where>: <Error>: <message>"`` (the message cut at 300 chars)."""
    text = " ".join(str(e).split())
    return f"{where}: {type(e).__name__}: {text[:300]}" if text else f"{where}: {type(e).__name__}"


def write_failures(log_dir: str | Path, step: int, groups: Sequence[Any]) -> int:
    """Append the failures of step ``step``'s groups (:class:`TrajectoryGroup` or ``GameGroup``) to
    ``log_dir/errors.jsonl``, one ``{"step", "tags", "error"}`` row each; how many were written."""
    rows = [json.dumps({"step": step, "tags": list(g.tags), "error": f}) for g in groups for f in g.failures]
    if rows:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        with open(Path(log_dir) / "errors.jsonl", "a") as fh:
            fh.write("".join(r + "\n" for r in rows))
    return len(rows)


def token_ids(what: str, ob: Any) -> list[int]:
    """``ob`` as a list of token ids, or ``ValueError`` saying what the environment returned instead."""
    if isinstance(ob, str | bytes) or not isinstance(ob, Sequence):
        raise ValueError(f"environment's {what} is not a list of token ids (got {type(ob).__name__})")
    bad = next((x for x in ob if isinstance(x, bool) or not isinstance(x, int) or x < 0), None)
    if bad is not None:
        raise ValueError(f"environment's {what} holds {bad!r}, not a token id")
    return list(ob)


@dataclass
class Sampled:
    tokens_T: list[int]
    logprobs_T: list[float]
    stop_reason: str


async def gather_or_cancel(*aws: Any) -> list[Any]:
    """``asyncio.gather``, but the first failure cancels the rest (a dead sampler must not leave
    episodes running in the background)."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        raise


def _params(base: types.SamplingParams, env: Env, seed: int | None) -> types.SamplingParams:
    return base.model_copy(update={"stop": env.stop if env.stop is not None else base.stop, "seed": seed})


async def sample_tokens(policy: Any, ob_T: list[int], n: int, params: types.SamplingParams) -> list[Sampled]:
    """``n`` samples of a continuation of ``ob_T`` from any Tinker sampling client, with logprobs.
    A request refused for its prompt raises as it came; any other failure is a :class:`SamplerError`."""
    try:
        resp = await policy.sample(
            prompt=types.ModelInput.from_ints(ob_T), num_samples=n, sampling_params=params
        )
    except Exception as e:
        if refused_for_its_prompt(e):
            raise
        raise SamplerError(f"the sampler failed: {type(e).__name__}: {e}") from e
    out = []
    for s in resp.sequences:
        if s.logprobs is None or len(s.logprobs) != len(s.tokens):
            raise SamplerError("the sampler returned no logprob per sampled token")
        lps = [float(x) for x in s.logprobs]
        if not all(math.isfinite(x) for x in lps):
            raise SamplerError("the sampler returned a non-finite logprob")
        out.append(Sampled(list(s.tokens), lps, str(s.stop_reason)))
    return out


async def env_call(what: str, aw: Any, timeout_s: float | None) -> Any:
    """Await one environment call (reset or step) within ``timeout_s``: the limit is on the
    environment's own time, never on waiting for the sampler (a loaded machine slows that down)."""
    if not timeout_s:
        return await aw
    try:
        return await asyncio.wait_for(aw, timeout_s)
    except TimeoutError:
        raise TimeoutError(f"the environment's {what} took longer than {timeout_s:g} s") from None


async def blocking(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` (an environment library's blocking call) in a daemon thread of its
    own, awaited: the event loop goes on meanwhile, so :func:`env_call`'s timeout can cut a call
    that hangs. A cut call's thread is abandoned; being a daemon, it never holds up the process's
    exit (``asyncio.to_thread``'s executor threads are joined when ``asyncio.run`` ends)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Any] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not done.done():  # not cancelled (the episode timed out) meanwhile
            (done.set_result if ok else done.set_exception)(value)

    def run() -> None:
        try:
            out = (True, fn(*args, **kwargs))
        except BaseException as e:  # handed to the awaiting episode
            out = (False, e)
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(settle, *out)

    threading.Thread(target=run, name=f"env-{getattr(fn, '__name__', 'call')}", daemon=True).start()
    return await done


async def _episode(
    env: Env,
    policy: Any,
    params: types.SamplingParams,
    ob_T: list[int],
    first: Sampled,
    seed: int | None,
    timeout_s: float | None = None,
) -> Trajectory:
    traj = Trajectory()
    sampled = first
    turn = 0
    extends: int | None = None
    while True:
        res = await env_call("step", env.step(sampled.tokens_T), timeout_s)
        if not math.isfinite(res.reward):
            raise ValueError(f"environment returned a non-finite reward ({res.reward})")
        traj.transitions.append(
            Transition(
                ob_T, sampled.tokens_T, sampled.logprobs_T, float(res.reward), res.done, dict(res.metrics),
                extends,
            )
        )  # fmt: skip
        if res.done:
            return traj
        if not res.next_ob_T:
            raise ValueError("environment is not done but returned an empty next observation")
        ob_T = token_ids("next observation", res.next_ob_T)
        extends = res.extends
        turn += 1
        step_seed = None if seed is None else seed + 7919 * turn
        (sampled,) = await sample_tokens(policy, ob_T, 1, _params(params, env, step_seed))


async def rollout_group(
    builder: EnvGroupBuilder,
    policy: Any,
    params: types.SamplingParams,
    *,
    seed: int | None = None,
    timeout_s: float | None = None,
    policy_version: int = 0,
    policy_for_episode: Callable[[int, list[int]], Any] | None = None,
    on_episode_end: Callable[[int], None] | None = None,
) -> TrajectoryGroup:
    """Run every episode of one group to its end; see the module docstring for failure handling.

    The first turn of every episode is sampled from ``policy``; later turns from ``policy``, or
    from ``policy_for_episode(i, first_observation)`` (episode ``i``'s own sampler, e.g. the
    test-time-trained adapter of :mod:`opentinker.rl.ttt`) when given. ``on_episode_end(i)`` is
    called once episode ``i``'s run is over, however it ended (only for episodes that started)."""
    try:
        envs = list(await builder.make_envs())
    except Exception as e:  # a broken group is this group's failure alone
        log.warning("%s.make_envs failed: %r", type(builder).__name__, e)
        return TrajectoryGroup([], builder.tags(), errors=1, failures=[failure("make_envs", e)])
    group = _GroupRollout(
        envs, policy, params, seed, timeout_s, policy_version, policy_for_episode, on_episode_end
    )
    await group.reset()
    trajs = await group.episodes(await group.first_turns())
    trajs = group.add_group_rewards(builder, trajs)
    return TrajectoryGroup(trajs, builder.tags(), group.errors, group.failures)


class _GroupRollout:
    """The steps of :func:`rollout_group` over its environments; ``errors`` counts the failed episodes."""

    def __init__(
        self, envs: list[Env], policy: Any, params: types.SamplingParams, seed: int | None,
        timeout_s: float | None, policy_version: int, policy_for_episode: Callable[[int, list[int]], Any] | None,
        on_episode_end: Callable[[int], None] | None,
    ) -> None:  # fmt: skip
        self.envs, self.policy, self.params, self.seed, self.timeout_s = envs, policy, params, seed, timeout_s
        self.policy_version = policy_version
        self.policy_for_episode, self.on_episode_end = policy_for_episode, on_episode_end
        self.obs: list[list[int] | None] = []  # each environment's opening observation (None: it failed)
        self.errors = 0
        self.failures: list[str] = []

    def fail(self, n: int, where: str, e: BaseException) -> None:
        """Count ``n`` failed episodes and keep what they raised."""
        self.errors += n
        self.failures += [failure(where, e)] * n

    async def reset(self) -> None:
        """Every environment's opening observation, concurrently."""
        self.obs = list(await asyncio.gather(*(self.first_obs(e) for e in self.envs)))

    async def first_obs(self, env: Env) -> list[int] | None:
        try:
            return token_ids(
                "observation", await env_call("reset", env.initial_observation(), self.timeout_s)
            )
        except Exception as e:
            self.fail(1, f"{type(env).__name__} reset", e)
            log.warning("environment %s failed at reset: %r", type(env).__name__, e)
            return None

    async def first_turns(self) -> list[tuple[list[int], list[Sampled] | BaseException]]:
        """(episodes, their first turns): one request per distinct opening observation (and stop
        condition), all at once; a request refused for its context is that request's exception."""
        by_key: dict[tuple, list[int]] = {}
        for i, ob in enumerate(self.obs):
            if ob is not None:
                by_key.setdefault((tuple(ob), repr(self.envs[i].stop)), []).append(i)
        keys = list(by_key.values())
        firsts = await gather_or_cancel(*(self.first_samples(idx, k) for k, idx in enumerate(keys)))
        return list(zip(keys, firsts, strict=True))

    async def first_samples(self, idx: list[int], k: int) -> list[Sampled] | BaseException:
        env0 = self.envs[idx[0]]
        s = None if self.seed is None else self.seed + 104729 * k
        try:
            return await sample_tokens(
                self.policy, self.obs[idx[0]] or [], len(idx), _params(self.params, env0, s)
            )
        except SamplerError:
            raise
        except Exception as e:  # refused for the environment's context: those episodes' failure
            return e

    async def episodes(
        self, firsts: list[tuple[list[int], list[Sampled] | BaseException]]
    ) -> list[Trajectory]:
        """Every episode with a first turn, run to its end, concurrently; the failed ones dropped."""
        jobs = []
        for idx, got in firsts:
            if isinstance(got, BaseException):
                self.fail(len(idx), "first sample (the sampler refused the context)", got)
                log.warning("the sampler refused the first turn's context: %r", got)
                continue
            jobs += [self.episode(i, s) for i, s in zip(idx, got, strict=True)]
        return [t for t in await gather_or_cancel(*jobs) if t is not None]

    async def episode(self, i: int, sampled: Sampled) -> Trajectory | None:
        try:
            s = None if self.seed is None else self.seed + 15485863 * (i + 1)
            ob = self.obs[i] or []
            own = self.policy if self.policy_for_episode is None else self.policy_for_episode(i, ob)
            traj = await _episode(self.envs[i], own, self.params, ob, sampled, s, self.timeout_s)
            traj.policy_version = self.policy_version
            return traj
        except SamplerError:
            raise
        except Exception as e:
            self.fail(1, f"{type(self.envs[i]).__name__} episode", e)
            log.warning("episode of %s failed: %r", type(self.envs[i]).__name__, e)
            return None
        finally:
            if self.on_episode_end is not None:
                self.on_episode_end(i)

    def add_group_rewards(self, builder: EnvGroupBuilder, trajs: list[Trajectory]) -> list[Trajectory]:
        """``trajs`` with the builder's group rewards added; none if those fail (all counted)."""
        if not trajs:
            return trajs
        try:
            extra = builder.group_rewards(trajs)
            for t, r in zip(trajs, extra, strict=True):
                if not math.isfinite(r):
                    raise ValueError(f"group reward {r} is not finite")
                t.final_reward += float(r)
        except Exception as e:
            self.fail(len(trajs), "group_rewards", e)
            log.warning("group rewards failed: %r", e)
            return []
        return trajs


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def group_metrics(groups: list[TrajectoryGroup]) -> dict[str, float]:
    """A step's rollout metrics: mean reward, episodes, environment errors, lengths, the sampled
    tokens' mean negative logprob (``policy/nll_per_token``: at temperature 1 an estimate of the
    policy's entropy per token, which falls as it collapses onto few outputs), and the mean of each
    per-turn metric the environments reported (``env/<key>``)."""
    trajs = [t for g in groups for t in g.trajectories]
    lps = [lp for t in trajs for tr in t.transitions for lp in tr.logprobs_T]
    m: dict[str, float] = {
        "reward/mean": _mean([t.total_reward for t in trajs]),
        "env/episodes": float(len(trajs)),
        "env/errors": float(sum(g.errors for g in groups)),
        "tokens/action_mean": _mean([float(t.num_action_tokens) for t in trajs]),
        "env/turns_mean": _mean([float(len(t.transitions)) for t in trajs]),
        "policy/nll_per_token": -_mean(lps),
    }
    keys = {k for t in trajs for tr in t.transitions for k in tr.metrics}
    for k in sorted(keys):
        vals = [float(tr.metrics[k]) for t in trajs for tr in t.transitions if k in tr.metrics]
        m[f"env/{k}"] = _mean(vals)
    return m
