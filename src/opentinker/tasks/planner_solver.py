"""planner_solver: a multi-call agent with a scratchpad that is summarised between rounds.

The problem: add up ``terms`` numbers (default 3, each in [10, 99]). The agent works in rounds,
one per addition; each round makes three LLM calls of the same policy:

1. **planner**: prompted with the problem and the scratchpad (``Scratchpad: empty`` or
   ``Scratchpad: the sum so far is S``), it writes a plan (free text, not scored);
2. **solver**: the planner's context + plan + ``Solver: compute S + x. Answer with just the
   number.``: it writes a number;
3. **reviewer**: the solver's context + answer + ``Reviewer: check S + x and write the correct
   sum.``: its first number is the round's result.

Between rounds the scratchpad is *summarised*: the next round's prompt is rendered afresh from the
problem and ``the sum so far is R`` (R the reviewer's number), not appended to the chat. So the
three calls of a round form one timeline (each extends the previous call's context + output: the
solver and reviewer calls claim it through ``StepResult.extends``), and the rounds' timelines
share only the prompt's opening (the system turn and the problem), which the engine's
shared-prefix pass computes once. Trained call by call the same episode is 3 × rounds sequences,
each recomputing its round's context.

Reward: ``1 / rounds`` for each round whose reviewer number is the true running sum (on the
reviewer's call), so an episode scores 0..1. Metrics of the last call: ``success`` (the final
number is the total), ``rounds_right`` (fraction of right rounds).

Evaluation: one greedy episode per held-out problem (``eval_problems``, default 50): ``accuracy``
(= success) and ``rounds_right``.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from typing import Any

from tinker import types

from opentinker.renderers import Message, Renderer
from opentinker.rl.rollout import rollout_group
from opentinker.rl.types import Env, EnvGroupBuilder, RLDataset, StepResult

NUMBER = re.compile(r"-?\d+")
EVAL_SEED = 20_261_202
SYSTEM = (
    "You are a careful agent that adds numbers in rounds. A planner says what to add next, a solver "
    "computes it and a reviewer checks it. The scratchpad keeps the running sum between rounds."
)
ROLES = ("planner", "solver", "reviewer")


def first_number(text: str) -> int | None:
    m = NUMBER.search(text)
    return int(m.group()) if m is not None else None


def problem_text(terms: Sequence[int]) -> str:
    return "Add up " + " + ".join(str(x) for x in terms) + "."


def eval_problems(n: int = 50, terms: int = 3, seed: int = EVAL_SEED) -> list[tuple[int, ...]]:
    rng = random.Random(f"{seed}/{terms}")
    out: list[tuple[int, ...]] = []
    while len(out) < n:
        p = tuple(rng.randint(10, 99) for _ in range(terms))
        if p not in out:
            out.append(p)
    return out


class PlannerSolverEnv(Env):
    """One episode of the planner / solver / reviewer agent on ``terms``."""

    def __init__(self, renderer: Renderer, terms: Sequence[int]) -> None:
        if len(terms) < 2:
            raise ValueError(f"planner_solver needs at least 2 terms, got {len(terms)}")
        self.renderer = renderer
        self.stop = renderer.stop
        self.terms = list(terms)
        self.rounds = len(terms) - 1
        self.round = 0
        self.role = 0  # index into ROLES of the call being answered
        self.calls = 0  # calls made so far in the episode
        self.running: int | None = self.terms[0]  # the scratchpad's sum (None: unreadable)
        self.right = 0
        self._ctx: list[int] = []

    def _scratchpad(self) -> str:
        if self.round == 0:
            return "Scratchpad: empty. Start with the first number."
        shown = "unknown" if self.running is None else str(self.running)
        return f"Scratchpad: the sum so far is {shown}."

    def _round_prompt(self) -> list[int]:
        msgs: list[Message] = [
            {"role": "system", "content": SYSTEM},
            {
                "role": "user",
                "content": f"{problem_text(self.terms)} {self._scratchpad()} Planner: what next?",
            },
        ]
        return self.renderer.build_generation_prompt(msgs)

    def _shown(self) -> str:
        return "?" if self.running is None else str(self.running)

    async def initial_observation(self) -> list[int]:
        self._ctx = self._round_prompt()
        return self._ctx

    async def step(self, action: list[int]) -> StepResult:
        reply, ended = self.renderer.parse_response(action)
        call = self.calls
        self.calls += 1
        x = self.terms[self.round + 1]
        role = ROLES[self.role]
        if role in ("planner", "solver"):
            ask = (
                f"Solver: compute {self._shown()} + {x}. Answer with just the number."
                if role == "planner"
                else f"Reviewer: check {self._shown()} + {x} and write the correct sum."
            )
            self.role += 1
            self._ctx = (
                self._ctx
                + list(action)
                + self.renderer.next_turn_tokens(ended, [{"role": "user", "content": ask}])
            )
            return StepResult(0.0, False, self._ctx, extends=call)
        # the reviewer's number is the round's result; the scratchpad is summarised
        truth = sum(self.terms[: self.round + 2])
        got = first_number(reply["content"])
        ok = got == truth
        self.right += int(ok)
        reward = 1.0 / self.rounds if ok else 0.0
        self.running = got
        self.round += 1
        self.role = 0
        if self.round == self.rounds:
            metrics = {"success": float(ok), "rounds_right": self.right / self.rounds}
            return StepResult(reward, True, metrics=metrics)
        self._ctx = self._round_prompt()
        return StepResult(reward, False, self._ctx)


class PlannerSolverGroup(EnvGroupBuilder):
    def __init__(self, renderer: Renderer, problems: Sequence[Sequence[int]]) -> None:
        self.renderer, self.problems = renderer, problems

    async def make_envs(self) -> Sequence[Env]:
        return [PlannerSolverEnv(self.renderer, p) for p in self.problems]

    def tags(self) -> list[str]:
        return ["planner_solver"]


class PlannerSolverDataset(RLDataset):
    """``groups_per_step`` problems per step, ``group_size`` episodes of each (never a held-out one)."""

    def __init__(
        self, renderer: Renderer, groups_per_step: int, group_size: int, *, seed: int = 0, terms: int = 3
    ) -> None:
        self.renderer, self.n, self.size, self.seed, self.terms = (
            renderer, groups_per_step, group_size, seed, terms,
        )  # fmt: skip
        self.held_out = set(eval_problems(terms=terms))

    def batch(self, step: int) -> list[EnvGroupBuilder]:
        rng = random.Random(f"planner_solver/{self.seed}/{step}")
        out: list[EnvGroupBuilder] = []
        while len(out) < self.n:
            p = tuple(rng.randint(10, 99) for _ in range(self.terms))
            if p not in self.held_out:
                out.append(PlannerSolverGroup(self.renderer, [p] * self.size))
        return out


def make_evaluator(renderer: Renderer, n: int = 50, *, terms: int = 3, max_tokens: int = 16):
    greedy = types.SamplingParams(max_tokens=max_tokens, temperature=0.0)
    group = PlannerSolverGroup(renderer, eval_problems(n, terms))

    async def evaluate(policy: Any, step: int) -> dict[str, float]:
        g = await rollout_group(group, policy, greedy, seed=0)
        last = [t.transitions[-1].metrics for t in g.trajectories]

        def mean(key: str) -> float:
            return sum(m.get(key, 0.0) for m in last) / max(1, len(last))

        return {"accuracy": mean("success"), "rounds_right": mean("rounds_right"), "errors": float(g.errors)}

    return evaluate


def build(renderer: Renderer, cfg: Any) -> tuple[RLDataset, Any]:
    """Registry entry. ``cfg.extra``: ``terms`` (3), ``eval_problems`` (50)."""
    extra = getattr(cfg, "extra", None) or {}
    terms = int(extra.get("terms", 3))
    if terms < 2:
        raise ValueError(f"planner_solver: terms must be at least 2, got {terms}")
    dataset = PlannerSolverDataset(renderer, cfg.groups_per_step, cfg.group_size, seed=cfg.seed, terms=terms)
    n = int(extra.get("eval_problems", 50))
    return dataset, make_evaluator(renderer, n, terms=terms, max_tokens=cfg.max_tokens)
