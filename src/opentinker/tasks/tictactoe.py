"""Tic-tac-toe between two trained policies: agents ``X`` and ``O``, one LoRA adapter each.

Each agent is prompted in the format ``opentinker/tiny`` was pretrained on: the board's three rows
of ``X``/``O``/``.`` then ``Your move as X. Answer with the cell number 1-9.`` The board is shown
from the mover's side: for ``O`` the marks are swapped, so every prompt says "Your move as X" and the
mover's own marks are the ``X``s. The first integer of the reply is the move (cell 1-9, row by row).

Rewards: win +1, loss -1, draw 0. An illegal move (no integer, a number outside 1-9, an occupied
cell) ends the game: the offender gets ``illegal_reward`` (default -1, the same as a loss;
``cfg.extra["illegal_reward"]`` below -1 makes a forfeit worse than a legal loss, so an agent whose
games all end in a loss or a forfeit still gets a signal for legality) and the other agent **0**
(it did nothing to earn a win: a +1 would credit its earlier moves with the opponent's blunder).
With ``cfg.extra["legal_bonus"] = b`` (default 0, below 0.5) each legal move an agent made adds b
to its reward, so a game that forfeits at the 3rd move scores more than one that forfeits at the
2nd (per-move credit for legality; win > draw > loss still).
Game metrics: ``X_wins``,
``O_wins``, ``draws``, ``illegal`` (a game ended by an illegal move), ``X_illegal``, ``O_illegal``,
``moves``.

Training groups: ``group_size`` games from one opening position (the empty board, or a random
position with 2 or 4 marks, X to move: ``cfg.extra["opening_pairs"]``, default 1, is the most
move pairs played at random; 0 = always the empty board; ``odd_frac``, default 0, is the share of
openings with one more random X mark, O to move). Self-play only by default; with
``cfg.extra["random_frac"] = f`` a share f of the groups has one side played by :class:`RandomMover`
(an opponent pool: the other agent trains on those games too; the scripted side's moves are never
trained on); the random side is X (so O trains) in a share ``random_x_share`` (default 0.5) of
them. With ``shared_opponent`` the random side of a group uses one seed in all the group's games,
so they follow one line until the trained agent's moves differ (a same-position baseline for the
group-relative advantages) instead of each game facing different random moves. Evaluation: each trained policy, greedy,
against :class:`RandomMover` (a uniformly random legal move) over ``eval_games`` fixed-seed games
from the empty board, playing its own side: ``<agent>/win_rate``, ``loss_rate``, ``draw_rate``,
``illegal_rate`` (illegal moves by the policy; they count as losses too).
"""

from __future__ import annotations

import asyncio
import math
import random
import re
from collections.abc import Sequence
from typing import Any

from tinker import types

from opentinker.renderers import Message, Renderer
from opentinker.rl.multiagent import play_game
from opentinker.rl.types import (
    GameGroupBuilder,
    MultiAgentDataset,
    MultiAgentEnv,
    MultiAgentTask,
    ScriptedPolicy,
)

LINES = [(0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6)]
EMPTY = "." * 9
INT = re.compile(r"-?\d+")
EVAL_SEED = 20_261_131
AGENTS = ("X", "O")


def other(agent: str) -> str:
    return "O" if agent == "X" else "X"


def winner(board: Sequence[str]) -> str | None:
    for i, j, k in LINES:
        if board[i] != "." and board[i] == board[j] == board[k]:
            return board[i]
    return None


def legal_moves(board: Sequence[str]) -> list[int]:
    """Empty cells, 0-based."""
    return [i for i, c in enumerate(board) if c == "."]


def board_prompt(board: Sequence[str], me: str = "X") -> str:
    """The position as ``me`` sees it (its marks shown as X), in the tiny model's format."""
    swap = {"X": "O", "O": "X", ".": "."} if me == "O" else {"X": "X", "O": "O", ".": "."}
    cells = [swap[c] for c in board]
    rows = "\n".join("".join(cells[r * 3 : r * 3 + 3]) for r in range(3))
    return f"{rows}\nYour move as X. Answer with the cell number 1-9."


def parse_move(text: str) -> int | None:
    """The 0-based cell of the first integer in ``text`` if it is 1..9, else None."""
    m = INT.search(text)
    if m is None:
        return None
    n = int(m.group())
    return n - 1 if 1 <= n <= 9 else None


def random_opening(rng: random.Random, max_pairs: int, odd: bool = False) -> str:
    """The empty board or a position after 1..``max_pairs`` random move pairs, no winner, X to move;
    with ``odd`` one more random X mark (O to move)."""
    while True:
        board = list(EMPTY)
        for t in range(2 * rng.randint(0, max_pairs) + int(odd)):
            board[rng.choice(legal_moves(board))] = "XO"[t % 2]
        if winner(board) is None:
            return "".join(board)


def random_move(board: Sequence[str], rng: random.Random) -> int:
    """A uniformly random legal move (0-based)."""
    return rng.choice(legal_moves(board))


class TicTacToeEnv(MultiAgentEnv):
    agents = AGENTS

    def __init__(
        self, renderer: Renderer, opening: str = EMPTY, illegal_reward: float = -1.0, legal_bonus: float = 0.0
    ) -> None:
        super().__init__(renderer)
        if not math.isfinite(illegal_reward) or illegal_reward > -1.0:
            raise ValueError(f"illegal_reward must be finite and at most -1 (a loss), got {illegal_reward}")
        if not 0.0 <= legal_bonus < 0.5:
            raise ValueError(f"legal_bonus must be in [0, 0.5) (a win stays above a draw), got {legal_bonus}")
        self.illegal_reward, self.legal_bonus = illegal_reward, legal_bonus
        if (
            len(opening) != 9
            or set(opening) - set("XO.")
            or opening.count("X") - opening.count("O") not in (0, 1)
        ):
            raise ValueError(f"opening must be 9 cells of X/O/. with X or O to move, got {opening!r}")
        self.opening = opening
        self.first = "X" if opening.count("X") == opening.count("O") else "O"
        self.board = list(opening)
        self.to_move = self.first
        self.result: str | None = None  # "X" / "O" (winner), "draw"
        self.illegal_by: str | None = None
        self.moves = 0
        self.legal: dict[str, int] = dict.fromkeys(AGENTS, 0)  # legal moves made by each agent

    async def reset(self) -> None:
        await super().reset()
        self.board, self.to_move, self.result, self.illegal_by, self.moves = (
            list(self.opening),
            self.first,
            None,
            None,
            0,
        )
        self.legal = dict.fromkeys(AGENTS, 0)

    def current_agent(self) -> str | None:
        return None if self.result is not None else self.to_move

    def observe(self, agent: str) -> list[Message]:
        return [{"role": "user", "content": board_prompt(self.board, agent)}]

    async def act(self, agent: str, reply: Message, ended: bool) -> dict[str, float]:
        if agent != self.to_move or self.result is not None:
            raise RuntimeError(f"{agent} moved out of turn")
        self.moves += 1
        cell = parse_move(reply["content"])
        if cell is None or self.board[cell] != ".":
            self.illegal_by, self.result = agent, other(agent)
            return {"illegal": 1.0}
        self.board[cell] = agent
        self.legal[agent] += 1
        if winner(self.board) == agent:
            self.result = agent
        elif not legal_moves(self.board):
            self.result = "draw"
        self.to_move = other(agent)
        return {"illegal": 0.0}

    def rewards(self) -> dict[str, float]:
        if self.result is None:
            raise RuntimeError("the game is not over")
        if self.result == "draw":
            out = {"X": 0.0, "O": 0.0}
        elif self.illegal_by:
            out = {self.result: 0.0, other(self.result): self.illegal_reward}
        else:
            out = {self.result: 1.0, other(self.result): -1.0}
        return {a: r + self.legal_bonus * self.legal[a] for a, r in out.items()}

    def move_rewards(self, agent: str) -> list[float]:
        """``legal_bonus`` on each legal move, the outcome (win/draw/loss/forfeit) on the last move."""
        n = self.legal[agent] + int(self.illegal_by == agent)
        if n == 0:
            return []
        out = [self.legal_bonus] * self.legal[agent] + [0.0] * int(self.illegal_by == agent)
        out[-1] += self.rewards()[agent] - self.legal_bonus * self.legal[agent]
        return out

    def metrics(self) -> dict[str, float]:
        won = None if self.illegal_by else self.result
        return {
            "X_wins": float(won == "X"),
            "O_wins": float(won == "O"),
            "draws": float(self.result == "draw"),
            "illegal": float(self.illegal_by is not None),
            "X_illegal": float(self.illegal_by == "X"),
            "O_illegal": float(self.illegal_by == "O"),
            "moves": float(self.moves),
        }


class RandomMover(ScriptedPolicy):
    """The random opponent: a uniformly random legal move, from its own seeded generator."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    async def reply(self, env: MultiAgentEnv, agent: str) -> str:
        assert isinstance(env, TicTacToeEnv)
        return str(random_move(env.board, self.rng) + 1)


class TicTacToeGroup(GameGroupBuilder):
    """``size`` games from ``opening``; with ``random_side`` that side is a :class:`RandomMover`."""

    def __init__(
        self,
        renderer: Renderer,
        opening: str,
        size: int,
        random_side: str | None = None,
        seed: int = 0,
        illegal_reward: float = -1.0,
        shared_opponent: bool = False,
        legal_bonus: float = 0.0,
    ) -> None:
        if random_side not in (None, *AGENTS):
            raise ValueError(f"random_side must be None, 'X' or 'O', got {random_side!r}")
        self.renderer, self.opening, self.size = renderer, opening, size
        self.random_side, self.seed, self.illegal_reward = random_side, seed, illegal_reward
        self.shared_opponent, self.legal_bonus = shared_opponent, legal_bonus

    async def make_games(self) -> Sequence[MultiAgentEnv]:
        return [
            TicTacToeEnv(self.renderer, self.opening, self.illegal_reward, self.legal_bonus)
            for _ in range(self.size)
        ]

    def scripted(self, game: int) -> dict[str, ScriptedPolicy]:
        if self.random_side is None:
            return {}
        k = 0 if self.shared_opponent else game
        return {self.random_side: RandomMover(random.Random(self.seed * 1_000_003 + k))}

    def tags(self) -> list[str]:
        return ["tictactoe", "selfplay" if self.random_side is None else "vs_random"]


class TicTacToeDataset(MultiAgentDataset):
    def __init__(
        self,
        renderer: Renderer,
        groups_per_step: int,
        group_size: int,
        *,
        seed: int = 0,
        opening_pairs: int = 1,
        random_frac: float = 0.0,
        random_x_share: float = 0.5,
        illegal_reward: float = -1.0,
        shared_opponent: bool = False,
        odd_frac: float = 0.0,
        legal_bonus: float = 0.0,
    ) -> None:
        for name, v in (
            ("random_frac", random_frac),
            ("random_x_share", random_x_share),
            ("odd_frac", odd_frac),
        ):
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {v}")
        self.renderer, self.n, self.size, self.seed = renderer, groups_per_step, group_size, seed
        self.opening_pairs, self.random_frac, self.random_x_share = opening_pairs, random_frac, random_x_share
        self.illegal_reward, self.shared_opponent, self.odd_frac = illegal_reward, shared_opponent, odd_frac
        self.legal_bonus = legal_bonus

    def batch(self, step: int) -> list[GameGroupBuilder]:
        rng = random.Random(f"tictactoe/{self.seed}/{step}")
        out: list[GameGroupBuilder] = []
        for _ in range(self.n):
            opening = random_opening(rng, self.opening_pairs, odd=rng.random() < self.odd_frac)
            side = None
            if rng.random() < self.random_frac:
                side = "X" if rng.random() < self.random_x_share else "O"
            out.append(
                TicTacToeGroup(
                    self.renderer, opening, self.size, side, seed=rng.randrange(1 << 30),
                    illegal_reward=self.illegal_reward, shared_opponent=self.shared_opponent,
                    legal_bonus=self.legal_bonus,
                )
            )  # fmt: skip
        return out


def make_evaluator(renderer: Renderer, *, games: int = 50, max_tokens: int = 4, seed: int = EVAL_SEED):
    """Each agent's policy (greedy) vs :class:`RandomMover` from the empty board, ``games`` games."""
    params = types.SamplingParams(max_tokens=max_tokens, temperature=0.0)

    async def evaluate(policies: dict[str, Any], step: int) -> dict[str, float]:
        async def one(agent: str, i: int) -> tuple[str | None, str | None] | None:
            env = TicTacToeEnv(renderer)
            pols = {agent: policies[agent], other(agent): RandomMover(random.Random(seed + 7 * i))}
            try:
                await play_game(env, pols, params, seed=0)
            except Exception:
                return None
            return env.result, env.illegal_by

        jobs = [(a, i) for a in AGENTS for i in range(games)]
        results = await asyncio.gather(*(one(a, i) for a, i in jobs))
        out: dict[str, float] = {}
        for agent in AGENTS:
            res = [r for (a, _), r in zip(jobs, results, strict=True) if a == agent and r is not None]
            n = max(1, len(res))
            out[f"{agent}/win_rate"] = sum(r == agent and i is None for r, i in res) / n
            out[f"{agent}/loss_rate"] = sum(r == other(agent) for r, _ in res) / n
            out[f"{agent}/draw_rate"] = sum(r == "draw" for r, _ in res) / n
            out[f"{agent}/illegal_rate"] = sum(i == agent for _, i in res) / n
            out[f"{agent}/errors"] = float(games - len(res))
        return out

    return evaluate


def build(renderer: Renderer, cfg: Any) -> MultiAgentTask:
    """Registry entry (``kind="multiagent"``). ``cfg.extra``: ``opening_pairs`` (1), ``random_frac``
    (0: the share of groups in which one side is a :class:`RandomMover`), ``random_x_share`` (0.5),
    ``shared_opponent`` (False), ``odd_frac`` (0), ``illegal_reward`` (-1), ``legal_bonus`` (0),
    ``per_move`` (False: per-move advantages, see :func:`opentinker.rl.multiagent.per_move_datums`),
    ``eval_games`` (50)."""
    extra = getattr(cfg, "extra", None) or {}
    dataset = TicTacToeDataset(
        renderer, cfg.groups_per_step, cfg.group_size, seed=cfg.seed,
        opening_pairs=int(extra.get("opening_pairs", 1)), random_frac=float(extra.get("random_frac", 0.0)),
        random_x_share=float(extra.get("random_x_share", 0.5)),
        illegal_reward=float(extra.get("illegal_reward", -1.0)),
        shared_opponent=bool(extra.get("shared_opponent", False)), odd_frac=float(extra.get("odd_frac", 0.0)),
        legal_bonus=float(extra.get("legal_bonus", 0.0)),
    )  # fmt: skip
    evaluator = make_evaluator(renderer, games=int(extra.get("eval_games", 50)), max_tokens=cfg.max_tokens)
    return MultiAgentTask(
        AGENTS,
        dataset,
        evaluator,
        plot_keys=("eval/win_rate", "eval/illegal_rate"),
        show_keys=("eval/X/win_rate", "game/draws", "game/illegal"),
        per_move_advantages=bool(extra.get("per_move", False)),
    )
