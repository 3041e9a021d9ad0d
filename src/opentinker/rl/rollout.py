"""Rollouts: run a group's episodes against a policy (any Tinker ``SamplingClient``).

All episodes of all groups of a step run concurrently as coroutines, so their sample requests
reach the sampler together and share its batches. Environments of a group that open with the
same observation are sampled with one request of ``num_samples = n`` (the prompt is prefilled
once). An episode whose environment raises, times out, or whose context outgrows the model fails
alone: it is dropped from its group, counted (``env/errors``) and logged; the run goes on.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass, field
from typing import Any

from tinker import types

from opentinker.data import Trajectory, Transition
from opentinker.rl.env import Env, EnvGroupBuilder

log = logging.getLogger(__name__)


@dataclass
class TrajectoryGroup:
    trajectories: list[Trajectory]
    tags: list[str] = field(default_factory=list)
    errors: int = 0

    @property
    def rewards(self) -> list[float]:
        return [t.total_reward for t in self.trajectories]


@dataclass
class Sampled:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str


def _params(base: types.SamplingParams, env: Env, seed: int | None) -> types.SamplingParams:
    return base.model_copy(update={"stop": env.stop if env.stop is not None else base.stop, "seed": seed})


async def sample_tokens(policy: Any, ob: list[int], n: int, params: types.SamplingParams) -> list[Sampled]:
    """``n`` samples of a continuation of ``ob`` from any Tinker sampling client, with logprobs."""
    resp = await policy.sample(prompt=types.ModelInput.from_ints(ob), num_samples=n, sampling_params=params)
    out = []
    for s in resp.sequences:
        if s.logprobs is None or len(s.logprobs) != len(s.tokens):
            raise RuntimeError("the sampler returned no logprob per sampled token")
        out.append(Sampled(list(s.tokens), [float(x) for x in s.logprobs], str(s.stop_reason)))
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


async def _episode(
    env: Env,
    policy: Any,
    params: types.SamplingParams,
    ob: list[int],
    first: Sampled,
    seed: int | None,
    timeout_s: float | None = None,
) -> Trajectory:
    traj = Trajectory()
    sampled = first
    turn = 0
    while True:
        if any(not math.isfinite(x) for x in sampled.logprobs):
            raise RuntimeError("non-finite sampler logprob")
        res = await env_call("step", env.step(sampled.tokens), timeout_s)
        if not math.isfinite(res.reward):
            raise ValueError(f"environment returned a non-finite reward ({res.reward})")
        traj.transitions.append(
            Transition(ob, sampled.tokens, sampled.logprobs, float(res.reward), res.done, dict(res.metrics))
        )
        if res.done:
            return traj
        if not res.next_ob:
            raise ValueError("environment is not done but returned an empty next observation")
        ob = list(res.next_ob)
        turn += 1
        step_seed = None if seed is None else seed + 7919 * turn
        (sampled,) = await sample_tokens(policy, ob, 1, _params(params, env, step_seed))


async def rollout_group(
    builder: EnvGroupBuilder,
    policy: Any,
    params: types.SamplingParams,
    *,
    seed: int | None = None,
    timeout_s: float | None = None,
    policy_version: int = 0,
) -> TrajectoryGroup:
    """Run every episode of one group to its end; see the module docstring for failure handling."""
    try:
        envs = list(await builder.make_envs())
    except Exception as e:  # a broken group is this group's failure alone
        log.warning("%s.make_envs failed: %r", type(builder).__name__, e)
        return TrajectoryGroup([], builder.tags(), errors=1)
    errors = 0

    async def first_obs(env: Env) -> list[int] | None:
        nonlocal errors
        try:
            return list(await env_call("reset", env.initial_observation(), timeout_s))
        except Exception as e:
            errors += 1
            log.warning("environment %s failed at reset: %r", type(env).__name__, e)
            return None

    obs = await asyncio.gather(*(first_obs(e) for e in envs))
    live = [i for i, ob in enumerate(obs) if ob is not None]

    # one request per distinct opening observation (and stop condition)
    by_key: dict[tuple, list[int]] = {}
    for i in live:
        by_key.setdefault((tuple(obs[i] or ()), repr(envs[i].stop)), []).append(i)

    async def first_samples(idx: list[int], k: int) -> list[Sampled] | BaseException:
        env0 = envs[idx[0]]
        s = None if seed is None else seed + 104729 * k
        try:
            return await sample_tokens(policy, obs[idx[0]] or [], len(idx), _params(params, env0, s))
        except Exception as e:
            return e

    keys = list(by_key.values())
    firsts = await asyncio.gather(*(first_samples(idx, k) for k, idx in enumerate(keys)))

    async def run(i: int, sampled: Sampled) -> Trajectory | None:
        nonlocal errors
        try:
            s = None if seed is None else seed + 15485863 * (i + 1)
            traj = await _episode(envs[i], policy, params, obs[i] or [], sampled, s, timeout_s)
            traj.policy_version = policy_version
            return traj
        except Exception as e:
            errors += 1
            log.warning("episode of %s failed: %r", type(envs[i]).__name__, e)
            return None

    jobs = []
    for idx, got in zip(keys, firsts, strict=True):
        if isinstance(got, BaseException):
            errors += len(idx)
            log.warning("sampling the first turn failed: %r", got)
            continue
        jobs += [run(i, s) for i, s in zip(idx, got, strict=True)]
    trajs = [t for t in await asyncio.gather(*jobs) if t is not None]
    if trajs:
        try:
            extra = builder.group_rewards(trajs)
            for t, r in zip(trajs, extra, strict=True):
                if not math.isfinite(r):
                    raise ValueError(f"group reward {r} is not finite")
                t.final_reward += float(r)
        except Exception as e:
            errors += len(trajs)
            log.warning("group rewards failed: %r", e)
            trajs = []
    return TrajectoryGroup(trajs, builder.tags(), errors)
