"""Multi-agent RL: several named agents, one LoRA adapter (one policy) each, trained on their own moves.

**The game** (:class:`MultiAgentEnv`): a coordinator (:meth:`~MultiAgentEnv.current_agent`) says whose
turn it is; that agent sees its own observation (:meth:`~MultiAgentEnv.observe`, chat messages rendered
by the renderer: each agent may see the game differently), answers with one message
(:meth:`~MultiAgentEnv.act`), and so on until the coordinator says the game is over; then
:meth:`~MultiAgentEnv.rewards` gives each agent its reward. By default every turn's prompt is
rendered afresh (a board game: each move's prompt is the position); with ``continue_chat = True`` an
agent's turns form one conversation (its previous prompt + its reply + the new messages), so its
whole game is one token sequence, as in :class:`~opentinker.rl.types.MessageEnv`. The game's
contract (:class:`~opentinker.rl.types.MultiAgentEnv`, its builders and results) is in rl/types.py.

**Rollouts** (:func:`play_game`, :func:`play_group`): each agent's turn is sampled from *its own*
policy (a Tinker ``SamplingClient``), or answered by a :class:`ScriptedPolicy` (e.g. a random
opponent, never trained; a group may script an agent in some of its games:
:meth:`GameGroupBuilder.scripted`). A game yields one :class:`~opentinker.rl.types.Trajectory` per
agent (its own prompts and actions, the game's reward for it as ``final_reward``). All games of a
step run concurrently, so the sample requests of all agents reach the sampler together and share
its batches. A game whose environment raises (or times out) is counted (``game/errors``) and
skipped; a failing sampler stops the run (:class:`~opentinker.rl.rollout.SamplerError`).

**Training** (:func:`run_multiagent`): one training client per agent. Each step: a sampling client
per agent from its current weights, ``groups_per_step`` groups of ``group_size`` games (a group's
games start from the same position), group-relative advantages *per agent* (an agent's trajectories
in a group are compared with each other; an agent that did not move in a game has no trajectory
there), then each agent's update through the single-agent loop's own
:func:`~opentinker.rl.train_step.train_steps` (datums, ``forward_backward``, ``optim_step``, metrics),
every agent's requests submitted before any is awaited, so the agents' updates fuse into one
scheduler tick. Metrics go to ``cfg.log_dir/metrics.jsonl`` with per-agent keys
``<agent>/reward/mean``, ``<agent>/loss/per_token``, ... and game keys ``game/<metric>``; the
evaluator's keys under ``eval/``; ``curves.png`` has one line per agent, and ``config.json`` lists
the ``agents`` (so the console overlays each metric's per-agent curves). As in the single-agent
loop, ``cfg.rollouts_per_step`` episodes per agent and step go to ``cfg.log_dir/rollouts.jsonl``
(:class:`~opentinker.tracking.RolloutLog`, within ``cfg.rollouts_max_bytes``), each with its
agent's name as its ``series`` and its group-relative advantage among that agent's trajectories
in the group (its whole game's: per-move advantages are not logged), for the console's viewer.

Of :class:`~opentinker.rl.loop.RLConfig`, the sync mode is implemented (``mode="sync"``), with
``substeps``, ``step_on_empty``, ``kl_coef``, ``drop_constant_groups``, ``normalize_std``,
``lr_schedule``, ``save_every``, and resume (``resume=True``: every agent reloads, with its optimizer, from the last
step at which all of them were saved, and the run continues from there on the same data); not
(yet) the async mode, success replay, ``stop_when``, ``max_train_s``.

**Per-move advantages** (``MultiAgentTask.per_move_advantages``, default off): instead of one
advantage for all of an agent's moves, move *k* gets the return-to-go of its game from move *k* on
(the per-move rewards of :meth:`MultiAgentEnv.move_rewards`; without them the whole reward sits on
the last move) minus the mean return-to-go at move *k* over the group's games in which the agent
made a *k*-th move (:func:`per_move_datums`): e.g. an illegal move is blamed more than the legal
moves before it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tinker import types

from opentinker.rl.advantages import group_advantages, is_constant
from opentinker.rl.datums import rl_datums
from opentinker.rl.loop import RLConfig, learning_rate_at
from opentinker.rl.rollout import (
    SamplerError,
    env_call,
    failure,
    gather_or_cancel,
    group_metrics,
    sample_tokens,
    write_failures,
)
from opentinker.rl.timeline import OBSERVATION, merge_timelines
from opentinker.rl.train_step import Learner, train_steps
from opentinker.rl.types import (
    GameGroup,
    GameGroupBuilder,
    GameResult,
    MultiAgentEnv,
    MultiAgentTask,
    ScriptedPolicy,
    Trajectory,
    TrajectoryGroup,
    Transition,
)
from opentinker.tracking import RolloutLog, plot_metrics, read_metrics
from opentinker.tracking.checkpoints import newest_checkpoint
from opentinker.tracking.run import Run, open_run

log = logging.getLogger(__name__)


async def play_game(
    env: MultiAgentEnv,
    policies: Mapping[str, Any],
    params: types.SamplingParams,
    *,
    seed: int | None = None,
    max_moves: int = 1000,
    policy_versions: Mapping[str, int] | None = None,
    timeout_s: float | None = None,
) -> GameResult:
    """Play one game to its end: each agent's turns are sampled from ``policies[agent]`` (a
    ``SamplingClient``) or answered by a :class:`ScriptedPolicy`. ``timeout_s`` limits each call
    into the game (reset, a move, a scripted reply), never the wait for a sampler."""
    await env_call("reset", env.reset(), timeout_s)
    trajs = {a: Trajectory(policy_version=(policy_versions or {}).get(a, 0)) for a in env.agents}
    moves = 0
    while (agent := env.current_agent()) is not None:
        if agent not in trajs or agent not in policies:
            raise KeyError(f"the coordinator named {agent!r}, not one of the agents {sorted(policies)}")
        moves += 1
        if moves > max_moves:
            raise RuntimeError(f"the game did not end within {max_moves} moves")
        policy = policies[agent]
        if isinstance(policy, ScriptedPolicy):
            text = await env_call("scripted reply", policy.reply(env, agent), timeout_s)
            await env_call("move", env.act(agent, {"role": "assistant", "content": text}, True), timeout_s)
            continue
        ob_T = list(env.observation(agent))
        s = None if seed is None else seed + 7919 * moves
        (sampled,) = await sample_tokens(
            policy, ob_T, 1, params.model_copy(update={"stop": env.stop, "seed": s})
        )
        m = await env_call("move", env.step(agent, sampled.tokens_T), timeout_s)
        # with continue_chat an agent's next prompt is its previous prompt + reply + new messages
        calls = trajs[agent].transitions
        extends = len(calls) - 1 if env.continue_chat and calls else None
        calls.append(
            Transition(ob_T, sampled.tokens_T, sampled.logprobs_T, 0.0, False, dict(m or {}), extends)
        )
    rewards = {a: float(r) for a, r in env.rewards().items()}
    for a, t in trajs.items():
        if a not in rewards or not math.isfinite(rewards[a]):
            raise ValueError(f"no finite reward for agent {a!r}: {rewards}")
        t.final_reward = rewards[a]
        if t.transitions:
            t.transitions[-1].done = True
            split = env.move_rewards(a)
            if split is not None:
                if len(split) != len(t.transitions) or abs(sum(split) - rewards[a]) > 1e-6:
                    raise ValueError(
                        f"move_rewards({a!r}) = {split} does not split {rewards[a]} over its moves"
                    )
                t.info["move_rewards"] = [float(r) for r in split]
    return GameResult(trajs, rewards, {k: float(v) for k, v in env.metrics().items()})


async def play_group(
    builder: GameGroupBuilder,
    policies: Mapping[str, Any],
    params: types.SamplingParams,
    *,
    seed: int | None = None,
    timeout_s: float | None = None,
    policy_versions: Mapping[str, int] | None = None,
) -> GameGroup:
    """All games of one group, concurrently; a game that raises or times out is counted and skipped."""
    try:
        games = list(await builder.make_games())
    except Exception as e:
        log.warning("making a group's games failed: %r", e)
        return GameGroup([], builder.tags(), 1, [failure("make_games", e)])
    errors = 0
    failures: list[str] = []

    async def one(i: int, env: MultiAgentEnv) -> GameResult | None:
        nonlocal errors
        s = None if seed is None else seed + 15485863 * (i + 1)
        try:
            pols = {**policies, **builder.scripted(i)}
            return await play_game(
                env, pols, params, seed=s, policy_versions=policy_versions, timeout_s=timeout_s
            )
        except SamplerError:
            raise
        except Exception as e:
            errors += 1
            failures.append(failure(f"{type(env).__name__} game", e))
            log.warning("game %s failed: %r", type(env).__name__, e)
            return None

    results = await gather_or_cancel(*(one(i, g) for i, g in enumerate(games)))
    return GameGroup([r for r in results if r is not None], builder.tags(), errors, failures)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def game_metrics(groups: list[GameGroup]) -> dict[str, float]:
    games = [g for grp in groups for g in grp.games]
    m = {
        "game/count": float(len(games)),
        "game/errors": float(sum(grp.errors for grp in groups)),
        "game/moves_mean": _mean([float(sum(len(t.transitions) for t in g.trajectories.values())) for g in games]),
    }  # fmt: skip
    for k in sorted({k for g in games for k in g.metrics}):
        m[f"game/{k}"] = _mean([g.metrics[k] for g in games if k in g.metrics])
    return m


def returns_to_go(traj: Trajectory) -> list[float]:
    """Per move: the trajectory's reward from that move on (``info["move_rewards"]`` when the game
    split it over the moves, else the whole reward on the last move)."""
    n = len(traj.transitions)
    split = traj.info.get("move_rewards")
    if split is None:
        split = [0.0] * (n - 1) + [traj.total_reward] if n else []
    out, acc = [0.0] * n, 0.0
    for k in range(n - 1, -1, -1):
        acc += split[k]
        out[k] = acc
    return out


def move_token_advantages(traj: Trajectory, advs: Sequence[float]) -> list[list[float]]:
    """Per segment of :func:`~opentinker.rl.datums.trajectory_segments`, per token: the advantage of the
    move that sampled the token, 0 elsewhere."""
    if len(advs) != len(traj.transitions):
        raise ValueError(f"{len(advs)} advantages for {len(traj.transitions)} moves")
    return [
        [advs[c] if c != OBSERVATION else 0.0 for c in tl.call_T] for tl in merge_timelines(traj.transitions)
    ]


def per_move_datums(
    groups: list[TrajectoryGroup], cfg: RLConfig
) -> tuple[list[types.Datum], dict[str, float]]:
    """Datums with per-move advantages: move *k*'s return-to-go minus the mean return-to-go of the
    group's trajectories that have a move *k* (a (group, move) slot whose returns are all equal
    carries no signal and is skipped with ``cfg.drop_constant_groups``)."""
    datums: list[types.Datum] = []
    kept = dropped = 0
    for g in groups:
        rtg = [returns_to_go(t) for t in g.trajectories]
        advs = [[0.0] * len(r) for r in rtg]
        for k in range(max((len(r) for r in rtg), default=0)):
            idx = [i for i, r in enumerate(rtg) if len(r) > k]
            vals = [rtg[i][k] for i in idx]
            if cfg.drop_constant_groups and is_constant(vals):
                dropped += 1
                continue
            kept += 1
            for i, a in zip(idx, group_advantages(vals, normalize_std=cfg.normalize_std), strict=True):
                advs[i][k] = a
        for t, a in zip(g.trajectories, advs, strict=True):
            if any(a):
                datums += rl_datums(t, 0.0, move_token_advantages(t, a))
    n_tok = sum(t.num_action_tokens for g in groups for t in g.trajectories) if datums else 0
    return datums, {
        "groups/kept": float(kept),
        "groups/dropped_constant": float(dropped),
        "train/action_tokens": float(n_tok),
    }


@dataclass
class MultiAgentResult:
    training_clients: dict[str, Any]
    metrics: list[dict[str, Any]]
    final_paths: dict[str, str]


async def run_multiagent(
    cfg: RLConfig,
    service: Any,
    task: MultiAgentTask,
    *,
    training_clients: Mapping[str, Any] | None = None,
    resume: bool = False,
) -> MultiAgentResult:
    """Train one adapter per agent of ``task``; see the module docstring. Agent *k*'s adapter is
    created with seed ``cfg.seed + k`` (unless ``training_clients`` are given, or the run resumes
    from ``cfg.log_dir``'s checkpoints: the run scaffold, :func:`~opentinker.tracking.run.open_run`)."""
    agents = _checked_agents(cfg, task)
    async with open_run(
        cfg, service, total_steps=cfg.steps, resume=resume, agents=agents, training_clients=training_clients,
        config={**dataclasses.asdict(cfg), "agents": list(agents)},  # the console overlays their curves
        show=tuple(task.show_keys) or tuple(f"{a}/reward/mean" for a in agents[:1]),
        plot=lambda run: plot_agents(
            read_metrics(run.log_dir), agents, run.log_dir / "curves.png", task.plot_keys, title=run.name
        ),
    ) as run:  # fmt: skip
        games = _AgentsLoop(cfg, service, task, run, agents)
        pending_eval = await games.begin()
        for step in range(run.start, cfg.steps):
            m = await games.step(step)
            await run.maybe_checkpoint(step + 1)
            if task.evaluator is not None and (
                step + 1 == cfg.steps or (cfg.eval_every and (step + 1) % cfg.eval_every == 0)
            ):
                m.update(await games.evaluate(step + 1))
            run.log(step, {**pending_eval, **m})
            pending_eval = {}
    return MultiAgentResult(dict(run.clients), run.rows, run.final_paths)


def _checked_agents(cfg: RLConfig, task: MultiAgentTask) -> tuple[str, ...]:
    """``task``'s agents, once ``cfg`` and ``task`` are known to be a run :func:`run_multiagent` can do."""
    cfg.check()
    if cfg.mode != "sync":
        raise ValueError(f"run_multiagent supports mode='sync' only, got {cfg.mode!r}")
    if task.per_move_advantages and cfg.kl_coef > 0:
        raise ValueError("per-move advantages do not support kl_coef > 0")
    agents = tuple(task.agents)
    if not agents or len(set(agents)) != len(agents):
        raise ValueError(f"a multi-agent task needs distinct agent names, got {agents}")
    return agents


class _AgentsLoop:
    """The steps of :func:`run_multiagent`: every agent's current policy, a step's games and
    updates, the evaluation."""

    def __init__(
        self, cfg: RLConfig, service: Any, task: MultiAgentTask, run: Run, agents: tuple[str, ...]
    ) -> None:
        self.cfg, self.task, self.run, self.agents, self.tcs = cfg, task, run, agents, run.clients
        self.base_policy = (
            service.create_sampling_client(base_model=cfg.base_model) if cfg.kl_coef > 0 else None
        )
        self.params = types.SamplingParams(max_tokens=cfg.max_tokens, temperature=cfg.temperature)
        self.rollout_log = (
            RolloutLog(
                run.log_dir, self.tcs[agents[0]].get_tokenizer(), per_step=cfg.rollouts_per_step,
                max_bytes=cfg.rollouts_max_bytes, start_step=run.start,
            )
            if cfg.rollouts_per_step > 0
            else None
        )  # fmt: skip
        self.policies: dict[str, Any] = {}
        self.version = run.start
        self.t_start = time.monotonic()

    async def policies_now(self) -> dict[str, Any]:
        return {a: await self.tcs[a].save_weights_and_get_sampling_client() for a in self.agents}

    async def begin(self) -> dict[str, float]:
        """The starting policies; the start's evaluation (logged with the first row)."""
        self.policies = await self.policies_now()
        self.t_start = time.monotonic()
        return await self.evaluate(self.run.start)

    async def evaluate(self, step: int) -> dict[str, float]:
        if self.task.evaluator is None:
            return {}
        t = time.monotonic()
        out = {f"eval/{k}": float(v) for k, v in (await self.task.evaluator(self.policies, step)).items()}
        out["time/eval_s"] = time.monotonic() - t
        return out

    async def step(self, step: int) -> dict[str, float]:
        """Play step ``step``'s games, train every agent on its own moves, move the policies on."""
        cfg, agents = self.cfg, self.agents
        t0 = time.monotonic()
        groups = await self.play(step)
        t1 = time.monotonic()
        write_failures(self.cfg.log_dir, step, groups)
        m: dict[str, float] = game_metrics(groups)
        tgroups = {a: [g.trajectory_group(a) for g in groups] for a in agents}
        if self.rollout_log is not None:
            for a in agents:
                self.rollout_log.log(step, agent_episodes(tgroups[a]), series=a)
        lr = learning_rate_at(cfg, step, t1 - self.t_start)
        datums_fn = per_move_datums if self.task.per_move_advantages else None
        # every agent's update is submitted before any is awaited: they share scheduler ticks
        updates = await train_steps(
            {a: Learner(self.tcs[a], tgroups[a]) for a in agents}, cfg, learning_rate=lr, step=step,
            base_policy=self.base_policy, datums_fn=datums_fn,
        )  # fmt: skip
        for a, um in updates.items():
            am = group_metrics(tgroups[a])
            am.pop("env/errors", None)  # game errors are counted once, in game/errors
            m.update({f"{a}/{k}": v for k, v in {**am, **um}.items()})
        t2 = time.monotonic()
        self.policies = await self.policies_now()
        self.version += 1
        m.update({"time/sample_s": t1 - t0, "time/train_s": t2 - t1, "policy/version": float(self.version)})
        return m

    async def play(self, step: int) -> list[GameGroup]:
        """Every group of step ``step``, concurrently, with the current policies."""
        cfg = self.cfg
        seed = cfg.seed * 1_000_003 + step * 10_007
        versions = dict.fromkeys(self.agents, self.version)
        return await gather_or_cancel(
            *(
                play_group(b, self.policies, self.params, seed=seed + 31 * k, timeout_s=cfg.episode_timeout_s, policy_versions=versions)
                for k, b in enumerate(self.task.dataset.batch(step))
            )
        )  # fmt: skip


def agent_episodes(groups: Sequence[TrajectoryGroup]) -> list[tuple[int, Trajectory, float]]:
    """(group index, trajectory, group-relative advantage of its reward) of one agent's groups."""
    out: list[tuple[int, Trajectory, float]] = []
    for gi, g in enumerate(groups):
        advs = group_advantages([t.total_reward for t in g.trajectories])
        out += [(gi, t, a) for t, a in zip(g.trajectories, advs, strict=True)]
    return out


def last_complete_checkpoint(index: Path, agents: tuple[str, ...]) -> tuple[int, dict[str, str]]:
    """(the last step at which every agent was saved, each agent's checkpoint path there), from a
    run's ``checkpoints.jsonl``; (0, {}) if there is none."""
    return newest_checkpoint(index, agents)


def agent_rows(rows: list[dict[str, Any]], agent: str) -> list[dict[str, Any]]:
    """``agent``'s metrics with its prefix removed (``X/reward/mean`` -> ``reward/mean``,
    ``eval/X/win_rate`` -> ``eval/win_rate``); game-level keys are kept as they are."""
    out = []
    for r in rows:
        row: dict[str, Any] = {"step": r["step"]}
        for k, v in r.items():
            if k.startswith(f"{agent}/"):
                row[k[len(agent) + 1 :]] = v
            elif k.startswith(f"eval/{agent}/"):
                row["eval/" + k[len(agent) + 6 :]] = v
            elif k.startswith("game/"):
                row[k] = v
        out.append(row)
    return out


def plot_agents(
    rows: list[dict[str, Any]],
    agents: Sequence[str],
    out: str | Path,
    keys: Sequence[str] = (),
    *,
    title: str = "",
) -> Path:
    """One panel per metric, one line per agent."""
    panels = ["reward/mean", *keys, "loss/per_token"]
    return plot_metrics(
        {a: agent_rows(rows, a) for a in agents}, list(dict.fromkeys(panels)), out, title=title
    )
