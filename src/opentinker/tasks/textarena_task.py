"""textarena games as a multi-agent task: ``textarena:<env_id>[?players=N&<game argument>=V...]``
(e.g. ``textarena:TicTacToe-v0``). Each player is its own agent (``player0``, ``player1``, ...),
trained as its own adapter (:func:`opentinker.rl.multiagent.run_multiagent`).

A game is ``textarena.make(env_id, **arguments)`` reset with ``num_players`` and a seed. Its
coordinator is textarena's: ``get_observation()`` says whose turn it is and what that player sees
(the game's text so far, as its observation wrappers build it: one user message, rendered afresh
each turn); the player's reply goes to ``step(text)`` (in a worker thread, so a game that blocks is
cut by the episode timeout); at the end ``close()`` gives each player's reward. A reply the game
refuses (textarena's invalid move) is the game's to judge, as it does for any player; such moves
are counted as ``game/invalid_moves``.

Games whose set-up downloads data (nltk word lists for the word games) need it present; board and
number games (TicTacToe, ConnectFour, Nim, GuessTheNumber, ...) run offline.

Evaluation: ``eval_games`` (default 20) greedy games between the current policies:
``eval/<player>/reward`` (mean) and ``eval/<player>/win_rate`` (share with a reward > 0).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from typing import Any

import textarena as ta
from tinker import types

from opentinker.renderers import Message, Renderer
from opentinker.rl.multiagent import play_game
from opentinker.rl.rollout import blocking
from opentinker.rl.types import GameGroupBuilder, MultiAgentDataset, MultiAgentEnv, MultiAgentTask

EVAL_SEED = 20_261_207


class TextArenaGame(MultiAgentEnv):
    """One textarena game; textarena decides whose turn it is and what each player sees."""

    def __init__(
        self, renderer: Renderer, env_id: str, players: int, seed: int, arguments: dict[str, Any]
    ) -> None:
        super().__init__(renderer)
        self.env_id, self.players, self.seed, self.arguments = env_id, players, seed, arguments
        self.agents = tuple(f"player{i}" for i in range(players))
        self.env: Any = None
        self.turn: tuple[int, str] | None = None  # (player id, its observation) while the game runs
        self.result: dict[str, float] = {}
        self.info: dict[Any, Any] = {}
        self.invalid = 0

    async def reset(self) -> None:
        await super().reset()
        self.env = ta.make(self.env_id, **self.arguments)
        await blocking(self.env.reset, num_players=self.players, seed=self.seed)
        self.turn, self.result, self.invalid = self._observe(), {}, 0

    def _observe(self) -> tuple[int, str]:
        pid, ob = self.env.get_observation()
        if not isinstance(pid, int) or not 0 <= pid < self.players:
            raise ValueError(f"textarena {self.env_id}: turn of player {pid!r} of {self.players}")
        return pid, ob if isinstance(ob, str) else str(ob)

    def current_agent(self) -> str | None:
        return None if self.turn is None else self.agents[self.turn[0]]

    def observe(self, agent: str) -> list[Message]:
        assert self.turn is not None
        return [{"role": "user", "content": self.turn[1]}]

    async def act(self, agent: str, reply: Message, ended: bool) -> dict[str, float]:
        done, _ = await blocking(self.env.step, reply["content"])
        if not done:
            self.turn = self._observe()
            return {}
        self.turn = None
        rewards, self.info = self.env.close()
        self.result = {self.agents[int(p)]: float(r) for p, r in rewards.items()}
        self.invalid = sum(bool(i.get("invalid_move")) for i in self.info.values() if isinstance(i, dict))
        return {}

    def rewards(self) -> dict[str, float]:
        return {a: self.result.get(a, 0.0) for a in self.agents}

    def metrics(self) -> dict[str, float]:
        r = list(self.rewards().values())
        return {"invalid_moves": float(self.invalid), "draws": float(len(set(r)) == 1)}


class TextArenaGroup(GameGroupBuilder):
    def __init__(
        self, renderer: Renderer, env_id: str, players: int, seed: int, arguments: dict[str, Any], size: int
    ) -> None:
        self.renderer, self.env_id, self.players, self.seed = renderer, env_id, players, seed
        self.arguments, self.size = arguments, size

    async def make_games(self) -> Sequence[MultiAgentEnv]:
        # one seed per group: its games start alike, so their outcomes compare the players' moves
        return [
            TextArenaGame(self.renderer, self.env_id, self.players, self.seed, self.arguments)
            for _ in range(self.size)
        ]

    def tags(self) -> list[str]:
        return [self.env_id]


class TextArenaDataset(MultiAgentDataset):
    def __init__(self, renderer: Renderer, env_id: str, players: int, arguments: dict[str, Any],
                 groups_per_step: int, group_size: int, seed: int) -> None:  # fmt: skip
        self.renderer, self.env_id, self.players, self.arguments = renderer, env_id, players, arguments
        self.n, self.size, self.seed = groups_per_step, group_size, seed

    def batch(self, step: int) -> list[GameGroupBuilder]:
        rng = random.Random(f"textarena/{self.env_id}/{self.seed}/{step}")
        return [
            TextArenaGroup(
                self.renderer, self.env_id, self.players, rng.randrange(1 << 30), self.arguments, self.size
            )
            for _ in range(self.n)
        ]


def make_evaluator(
    renderer: Renderer, env_id: str, players: int, arguments: dict[str, Any], games: int, max_tokens: int
):
    params = types.SamplingParams(max_tokens=max_tokens, temperature=0.0)
    agents = tuple(f"player{i}" for i in range(players))

    async def evaluate(policies: dict[str, Any], step: int) -> dict[str, float]:
        async def one(i: int) -> dict[str, float]:
            game = TextArenaGame(renderer, env_id, players, EVAL_SEED + i, arguments)
            return (await play_game(game, policies, params, seed=0)).rewards

        results = await asyncio.gather(*(one(i) for i in range(games)))
        out: dict[str, float] = {}
        for a in agents:
            out[f"{a}/reward"] = sum(r[a] for r in results) / len(results)
            out[f"{a}/win_rate"] = sum(r[a] > 0 for r in results) / len(results)
        return out

    return evaluate


def build(renderer: Renderer, cfg: Any, *, environment: str, options: dict[str, Any]) -> MultiAgentTask:
    """Registry entry (``textarena:<env_id>?players=N&<arguments>``), ``kind="multiagent"``."""
    from textarena.envs.registration import ENV_REGISTRY

    if environment not in ENV_REGISTRY:
        import difflib

        near = difflib.get_close_matches(environment, list(ENV_REGISTRY), n=3)
        hint = f" (did you mean {', '.join(near)}?)" if near else ""
        raise ValueError(f"textarena has no game {environment!r}{hint}")
    arguments = dict(options)
    players = int(arguments.pop("players", 2))
    if players < 1:
        raise ValueError(f"players must be >= 1, got {players}")
    try:  # a game that refuses its arguments or its number of players says so here, not mid-run
        ta.make(environment, **arguments).reset(num_players=players, seed=0)
    except (TypeError, ValueError, AssertionError) as e:
        raise ValueError(f"textarena:{environment}: {players} players, arguments {arguments}: {e}") from None
    games = int(cfg.extra.get("eval_games", 20))
    agents = tuple(f"player{i}" for i in range(players))
    return MultiAgentTask(
        agents,
        TextArenaDataset(
            renderer, environment, players, arguments, cfg.groups_per_step, cfg.group_size, cfg.seed
        ),
        make_evaluator(renderer, environment, players, arguments, games, cfg.max_tokens)
        if games > 0
        else None,
        plot_keys=("eval/reward", "eval/win_rate"),
        show_keys=("game/invalid_moves", "game/draws"),
    )
