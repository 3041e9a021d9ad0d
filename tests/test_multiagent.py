"""Multi-agent RL: games between agents with their own adapters (rl/multiagent.py, tasks/tictactoe.py)."""

from __future__ import annotations

import asyncio
import json
import random
import re
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from tinker import types

import opentinker
from opentinker.client import Runtime
from opentinker.renderers import Message, get_renderer
from opentinker.rl import RLConfig
from opentinker.rl.datums import trajectory_segments
from opentinker.rl.multiagent import (
    last_complete_checkpoint,
    per_move_datums,
    play_game,
    play_group,
    returns_to_go,
    run_multiagent,
)
from opentinker.rl.types import (
    GameGroupBuilder,
    MultiAgentDataset,
    MultiAgentEnv,
    MultiAgentTask,
    ScriptedPolicy,
    Trajectory,
    TrajectoryGroup,
    Transition,
)
from opentinker.tasks.tictactoe import (
    RandomMover,
    TicTacToeDataset,
    TicTacToeEnv,
    board_prompt,
    build,
    parse_move,
    random_opening,
    winner,
)
from tests.conftest import TEST_MODEL, SlowSampler
from tests.tolerances import assert_rel_close, assert_state_close


@pytest.fixture(scope="module")
def runtime(tmp_path_factory: pytest.TempPathFactory):
    rt = Runtime(tmp_path_factory.mktemp("data"))
    yield rt
    rt.shutdown()


@pytest.fixture(scope="module")
def service(runtime: Runtime):
    return opentinker.ServiceClient(runtime=runtime)


@pytest.fixture(scope="module")
def renderer(service):
    return get_renderer("auto", service.create_sampling_client(base_model=TEST_MODEL).get_tokenizer())


def _weights(runtime: Runtime, model_id: str) -> dict[str, torch.Tensor]:
    engine = runtime.base_stack(TEST_MODEL).engine
    return {k: v.detach().clone() for k, v in engine.adapter_weights(model_id).state_dict().items()}


def _delta(after: dict[str, torch.Tensor], before: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([(after[k] - before[k]).flatten() for k in sorted(before)])


class Moves(ScriptedPolicy):
    """Plays the given replies in order."""

    def __init__(self, replies: list[str]) -> None:
        self.replies = list(replies)

    async def reply(self, env: MultiAgentEnv, agent: str) -> str:
        return self.replies.pop(0)


def _game(renderer, x: list[str], o: list[str], opening: str = "." * 9) -> TicTacToeEnv:
    env = TicTacToeEnv(renderer, opening)
    asyncio.run(play_game(env, {"X": Moves(x), "O": Moves(o)}, types.SamplingParams(max_tokens=4)))
    return env


def test_tictactoe_rules_and_views(renderer) -> None:
    env = _game(renderer, ["5", "1", "9"], ["2", "3"])  # X: 5, 1, 9 (diagonal)
    assert env.result == "X" and env.rewards() == {"X": 1.0, "O": -1.0}
    assert env.metrics()["X_wins"] == 1 and env.metrics()["moves"] == 5
    env = _game(renderer, ["5", "5"], ["1"])  # X plays an occupied cell
    assert env.rewards() == {"X": -1.0, "O": 0.0} and env.metrics()["X_illegal"] == 1
    assert env.metrics()["O_wins"] == 0 and env.metrics()["illegal"] == 1
    env = _game(renderer, ["5"], ["I pass"])
    assert env.rewards() == {"X": 0.0, "O": -1.0} and env.metrics()["O_illegal"] == 1
    env = _game(renderer, ["1", "3", "4", "8", "9"], ["2", "5", "6", "7"])
    assert env.result == "draw" and env.rewards() == {"X": 0.0, "O": 0.0}
    assert parse_move("cell 10") is None and parse_move("7") == 6

    board = list("X.O.X....")
    assert board_prompt(board, "X").startswith("X.O\n.X.\n...\nYour move as X.")
    assert board_prompt(board, "O").startswith("O.X\n.O.\n...\nYour move as X.")
    env = TicTacToeEnv(renderer, "X.O.X..O.")  # O must see itself as X
    asyncio.run(env.reset())
    assert env.current_agent() == "X"
    assert env.observe("O")[0]["content"].startswith("O.X\n.O.\n.X.")
    rng = random.Random(0)
    for _ in range(50):
        op = random_opening(rng, 2)
        assert op.count("X") == op.count("O") <= 2 and winner(op) is None


def test_random_mover_plays_legal_games(renderer) -> None:
    params = types.SamplingParams(max_tokens=4)
    for i in range(30):
        env = TicTacToeEnv(renderer)
        pols = {"X": RandomMover(random.Random(i)), "O": RandomMover(random.Random(100 + i))}
        res = asyncio.run(play_game(env, pols, params))
        assert env.illegal_by is None and env.result in ("X", "O", "draw")
        assert all(not t.transitions for t in res.trajectories.values())  # scripted moves: not trained


def test_opponent_pool_groups_script_one_side(service, renderer) -> None:
    policy = service.create_sampling_client(base_model=TEST_MODEL)
    params = types.SamplingParams(max_tokens=4)
    assert all(b.random_side is None for b in TicTacToeDataset(renderer, 6, 2).batch(0))  # type: ignore[attr-defined]
    builders = TicTacToeDataset(renderer, 4, 3, random_frac=1.0).batch(0)
    assert {b.random_side for b in builders} <= {"X", "O"}  # type: ignore[attr-defined]
    for b in builders:
        side = b.random_side  # type: ignore[attr-defined]
        g = asyncio.run(play_group(b, {"X": policy, "O": policy}, params, seed=1))
        assert g.errors == 0 and len(g.games) == 3 and "vs_random" in g.tags
        assert all(not game.trajectories[side].transitions for game in g.games)  # scripted: not trained
        assert all(game.trajectories["O" if side == "X" else "X"].transitions for game in g.games)
        assert not g.trajectory_group(side).trajectories


def test_tictactoe_illegal_reward_side_share_and_shared_opponent(renderer) -> None:
    params = types.SamplingParams(max_tokens=4)
    env = TicTacToeEnv(renderer, illegal_reward=-2.0)
    asyncio.run(play_game(env, {"X": Moves(["5", "5"]), "O": Moves(["1"])}, params))
    assert env.rewards() == {"X": -2.0, "O": 0.0}  # an illegal move costs more than a loss
    env = TicTacToeEnv(renderer, illegal_reward=-2.0)
    asyncio.run(play_game(env, {"X": Moves(["5", "1", "9"]), "O": Moves(["2", "3"])}, params))
    assert env.rewards() == {"X": 1.0, "O": -1.0}  # a legal loss is still -1
    with pytest.raises(ValueError):
        TicTacToeEnv(renderer, illegal_reward=-0.5)
    builders = TicTacToeDataset(renderer, 8, 2, random_frac=1.0, random_x_share=1.0).batch(0)
    assert {b.random_side for b in builders} == {"X"}  # type: ignore[attr-defined]
    ds = TicTacToeDataset(renderer, 4, 3, random_frac=1.0, illegal_reward=-2.0, shared_opponent=True)
    for b in ds.batch(0):
        assert all(g.illegal_reward == -2.0 for g in asyncio.run(b.make_games()))  # type: ignore[attr-defined]
        side = b.random_side  # type: ignore[attr-defined]
        replies = [asyncio.run(b.scripted(i)[side].reply(TicTacToeEnv(renderer), side)) for i in range(3)]
        assert len(set(replies)) == 1  # one random opponent per group: same position, same move
    with pytest.raises(ValueError):
        TicTacToeDataset(renderer, 1, 1, random_x_share=1.5)
    env = TicTacToeEnv(renderer, "X........")  # an odd opening: O to move
    asyncio.run(env.reset())
    assert env.current_agent() == "O"
    with pytest.raises(ValueError):
        TicTacToeEnv(renderer, "XX.......")
    rng = random.Random(0)
    for _ in range(20):
        op = random_opening(rng, 2, odd=True)
        assert op.count("X") == op.count("O") + 1 <= 3 and winner(op) is None


def test_tictactoe_legal_bonus_and_move_rewards(renderer) -> None:
    params = types.SamplingParams(max_tokens=4)
    env = TicTacToeEnv(renderer, illegal_reward=-2.0, legal_bonus=0.25)
    asyncio.run(play_game(env, {"X": Moves(["5", "5"]), "O": Moves(["1"])}, params))
    assert env.rewards() == {"X": -1.75, "O": 0.25}  # X: 1 legal move then a forfeit; O: 1 legal move
    assert env.move_rewards("X") == [0.25, -2.0] and env.move_rewards("O") == [0.25]
    env = TicTacToeEnv(renderer, legal_bonus=0.25)
    asyncio.run(play_game(env, {"X": Moves(["5", "1", "9"]), "O": Moves(["2", "3"])}, params))
    assert env.rewards() == {"X": 1.75, "O": -0.5}  # the outcome still dominates: win > loss
    assert env.move_rewards("X") == [0.25, 0.25, 1.25] and env.move_rewards("O") == [0.25, -0.75]
    with pytest.raises(ValueError):
        TicTacToeEnv(renderer, legal_bonus=0.5)
    ds = TicTacToeDataset(renderer, 2, 2, legal_bonus=0.25)
    assert all(g.legal_bonus == 0.25 for b in ds.batch(0) for g in asyncio.run(b.make_games()))  # type: ignore[attr-defined]


def _traj(
    moves: list[tuple[list[int], list[int]]], split: list[float] | None, total: float = 0.0
) -> Trajectory:
    t = Trajectory([Transition(ob, ac, [-0.5] * len(ac)) for ob, ac in moves], final_reward=total)
    if split is not None:
        t.info["move_rewards"] = split
        t.final_reward = sum(split)
    return t


def test_per_move_advantages_land_on_their_moves() -> None:
    # a: two moves, each its own prompt (two segments); the 2nd move is a forfeit
    a = _traj([([1, 2], [10, 11]), ([3, 4], [12])], [0.1, -2.0])
    # b: three moves; the 2nd extends the 1st's context (one segment holding two moves)
    b = _traj([([1, 2], [20]), ([1, 2, 20, 5], [21, 22]), ([6], [23])], [0.1, 0.1, 0.9])
    c = _traj([([1, 2], [30])], None, total=-2.0)  # no split: the whole reward on its last move
    assert returns_to_go(a) == pytest.approx([-1.9, -2.0]) and returns_to_go(c) == [-2.0]
    assert returns_to_go(_traj([([1], [2]), ([3], [4])], None, total=1.0)) == [1.0, 1.0]
    cfg = RLConfig(drop_constant_groups=True)
    datums, m = per_move_datums([TrajectoryGroup([a, b, c])], cfg)
    # move 0: returns -1.9, 1.1, -2.0 (mean -0.9333); move 1: -2.0, 1.0 (mean -0.5); move 2: b alone
    assert m["groups/kept"] == 2 and m["groups/dropped_constant"] == 1 and m["train/action_tokens"] == 8
    assert len(datums) == 5  # a: 2 segments, b: 2, c: 1

    def adv(d: types.Datum) -> list[float]:
        return list(d.loss_fn_inputs["advantages"].data)  # aligned with the targets (tokens[1:])

    mean0 = (-1.9 + 1.1 - 2.0) / 3
    assert adv(datums[0]) == pytest.approx([0.0, -1.9 - mean0, -1.9 - mean0])  # targets 2, 10, 11
    assert adv(datums[1]) == pytest.approx([0.0, -1.5])  # a's forfeit: blamed more than its 1st move
    assert adv(datums[2]) == pytest.approx([0.0, 1.1 - mean0, 0.0, 1.5, 1.5])  # targets 2, 20, 5, 21, 22
    assert adv(datums[3]) == pytest.approx([0.0])  # b's 3rd move: nothing to compare it with
    assert adv(datums[4]) == pytest.approx([0.0, -2.0 - mean0])
    assert list(datums[2].loss_fn_inputs["target_tokens"].data) == [2, 20, 5, 21, 22]
    # all slots constant: no datums
    same = [_traj([([1], [2])], [1.0]), _traj([([1], [3])], [1.0])]
    assert per_move_datums([TrajectoryGroup(same)], cfg)[0] == []


class _Spy:
    """Wraps a ServiceClient: records the datums each training client (by model id) is sent."""

    def __init__(self, service: Any) -> None:
        self._service = service
        self.sent: dict[str, list[list[types.Datum]]] = {}
        self.calls: list[tuple[str, str]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._service, name)

    def create_lora_training_client(self, **kw: Any) -> Any:
        return _SpyTC(self._service.create_lora_training_client(**kw), self)


class _SpyTC:
    def __init__(self, tc: Any, spy: _Spy) -> None:
        self._tc, self._spy = tc, spy

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tc, name)

    def __await__(self):  # like the SDK's clients: also the (finished) future of itself
        async def ready() -> _SpyTC:
            return self

        return ready().__await__()

    def forward_backward(self, data, loss_fn, config=None):
        self._spy.sent.setdefault(self._tc.model_id, []).append(list(data))
        self._spy.calls.append(("fb", self._tc.model_id))
        return self._tc.forward_backward(data, loss_fn, config)

    def optim_step(self, params):
        self._spy.calls.append(("optim", self._tc.model_id))
        return self._tc.optim_step(params)


def test_agents_train_their_own_adapters(runtime, service, renderer, tmp_path) -> None:
    """After one step, X's adapter moved exactly as X's datums dictate (same datums sent by hand to
    a fresh adapter with X's seed), O's as O's, and an unrelated adapter not at all."""
    lr = 1e-2
    bystander = service.create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=99)
    by_before = _weights(runtime, bystander.model_id)
    cfg = RLConfig(
        base_model=TEST_MODEL, log_dir=str(tmp_path / "run"), steps=1, groups_per_step=2, group_size=6,
        max_tokens=4, lora_rank=4, learning_rate=lr, seed=3, eval_every=0, progress=False,
    )  # fmt: skip
    task = build(renderer, cfg)
    task.evaluator = None
    spy = _Spy(service)
    res = asyncio.run(run_multiagent(cfg, spy, task))
    ids = {a: res.training_clients[a].model_id for a in ("X", "O")}
    assert set(spy.sent) == set(ids.values()) and all(len(v) == 1 for v in spy.sent.values())
    # every forward_backward is submitted before any optim_step (so the agents share one tick)
    assert [c for c, _ in spy.calls] == ["fb", "fb", "optim", "optim"]
    row = res.metrics[0]
    for a in ("X", "O"):
        assert row[f"{a}/train/datums"] == len(spy.sent[ids[a]][0]) > 0
    sent = {a: spy.sent[ids[a]][0] for a in ("X", "O")}
    # routing, independently of the spy: X's datums are X's moves (it moves when the marks are equal),
    # O's are O's (shown swapped, so its own "X" marks are one fewer than the opponent's)
    for a, diff in (("X", 0), ("O", 1)):
        for d in sent[a]:
            board = re.findall(
                r"([XO.]{3})\n([XO.]{3})\n([XO.]{3})\nYour move as X",
                renderer.decode(d.model_input.to_ints()),
            )
            cells = "".join(board[-1])
            assert cells.count("O") - cells.count("X") == diff, (a, cells)
    adam = types.AdamParams(learning_rate=lr)

    def reference(seed: int, data: list[types.Datum]) -> tuple[dict, dict]:
        tc = service.create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=seed, train_mlp=False, train_unembed=False)  # fmt: skip
        before = _weights(runtime, tc.model_id)
        tc.forward_backward(data, "importance_sampling")
        tc.optim_step(adam).result()
        return before, _weights(runtime, tc.model_id)

    for k, a in enumerate(("X", "O")):
        before, ref = reference(cfg.seed + k, sent[a])
        got = _weights(runtime, ids[a])
        d_ref = _delta(ref, before)
        assert float(d_ref.norm()) > 0
        assert_rel_close(_delta(got, before), d_ref)
        # the other agent's datums would have moved it elsewhere
        _, swapped = reference(cfg.seed + k, sent["O" if a == "X" else "X"])
        assert float((_delta(got, before) - _delta(swapped, before)).norm()) > 0.1 * float(d_ref.norm())
    assert float(_delta(_weights(runtime, bystander.model_id), by_before).norm()) == 0.0
    paths = [json.loads(x) for x in (tmp_path / "run" / "checkpoints.jsonl").read_text().splitlines()]
    assert sorted(p["agent"] for p in paths) == ["O", "X"] and set(res.final_paths) == {"X", "O"}


class _Boom(TicTacToeEnv):
    async def act(self, agent: str, reply: Message, ended: bool) -> dict[str, float]:
        if self.moves >= 1:
            raise RuntimeError("boom")
        return await super().act(agent, reply, ended)


class _BoomGroup(GameGroupBuilder):
    def __init__(self, renderer, n_ok: int, n_boom: int) -> None:
        self.renderer, self.n_ok, self.n_boom = renderer, n_ok, n_boom

    async def make_games(self) -> Sequence[MultiAgentEnv]:
        return [TicTacToeEnv(self.renderer) for _ in range(self.n_ok)] + [
            _Boom(self.renderer) for _ in range(self.n_boom)
        ]


class _BoomData(MultiAgentDataset):
    def __init__(self, renderer) -> None:
        self.renderer = renderer

    def batch(self, step: int) -> list[GameGroupBuilder]:
        return [_BoomGroup(self.renderer, 4, 2), _BoomGroup(self.renderer, 3, 1)]


def test_a_raising_game_is_counted_and_skipped(service, renderer, tmp_path) -> None:
    cfg = RLConfig(
        base_model=TEST_MODEL, log_dir=str(tmp_path / "run"), steps=2, max_tokens=4, lora_rank=4,
        learning_rate=1e-3, eval_every=0, progress=False, episode_timeout_s=30,
    )  # fmt: skip
    task = MultiAgentTask(("X", "O"), _BoomData(renderer))
    res = asyncio.run(run_multiagent(cfg, service, task))
    assert len(res.metrics) == 2
    for row in res.metrics:
        assert row["game/errors"] == 3 and row["game/count"] == 7
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["game/errors"] for r in rows] == [3, 3]


class _Chat(MultiAgentEnv):
    """Two agents take turns in a running chat; each sees the other's last message as a user turn."""

    agents = ("A", "B")
    continue_chat = True

    def __init__(self, renderer) -> None:
        super().__init__(renderer)
        self.said: list[str] = []

    async def reset(self) -> None:
        await super().reset()
        self.said = []

    def current_agent(self) -> str | None:
        return None if len(self.said) >= 4 else "AB"[len(self.said) % 2]

    def observe(self, agent: str) -> list[Message]:
        last = self.said[-1] if self.said else "I'm thinking of a number between 1 and 100. Guess it."
        return [{"role": "user", "content": f"{last}"}]

    async def act(self, agent: str, reply: Message, ended: bool) -> dict[str, float]:
        self.said.append(reply["content"] or "?")
        return {}

    def rewards(self) -> dict[str, float]:
        return {"A": 1.0, "B": 0.0}


def test_continue_chat_makes_each_agent_one_sequence(service, renderer) -> None:
    policy = service.create_sampling_client(base_model=TEST_MODEL)
    env = _Chat(renderer)
    res = asyncio.run(play_game(env, {"A": policy, "B": policy}, types.SamplingParams(max_tokens=8), seed=1))
    for a in ("A", "B"):
        trs = res.trajectories[a].transitions
        assert len(trs) == 2 and trs[-1].done and not trs[0].done
        assert trs[1].ob_T[: len(trs[0].ob_T) + len(trs[0].ac_T)] == trs[0].ob_T + trs[0].ac_T
        assert len(trajectory_segments(res.trajectories[a])) == 1
    assert res.rewards == {"A": 1.0, "B": 0.0} and res.trajectories["A"].total_reward == 1.0


def test_tictactoe_smoke_with_eval_vs_random(service, renderer, tmp_path) -> None:
    cfg = RLConfig(
        base_model=TEST_MODEL, log_dir=str(tmp_path / "ttt"), steps=3, groups_per_step=2, group_size=4,
        max_tokens=4, lora_rank=4, learning_rate=2e-3, eval_every=2, progress=False,
        extra={"eval_games": 8},
    )  # fmt: skip
    task = build(renderer, cfg)
    assert isinstance(task.dataset, TicTacToeDataset) and task.agents == ("X", "O")
    res = asyncio.run(run_multiagent(cfg, service, task))
    rows = [json.loads(x) for x in (tmp_path / "ttt" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and len(res.metrics) == 3
    for r in rows:
        assert r["game/count"] == 8 and r["game/errors"] == 0
        assert r["game/X_wins"] + r["game/O_wins"] + r["game/draws"] + r["game/illegal"] == pytest.approx(1.0)
        for a in ("X", "O"):
            assert -1 <= r[f"{a}/reward/mean"] <= 1 and f"{a}/groups/kept" in r
    for r in rows:  # evaluated before step 0, after 2 steps (eval_every) and at the end
        for a in ("X", "O"):
            rates = [r[f"eval/{a}/{k}"] for k in ("win_rate", "loss_rate", "draw_rate")]
            assert sum(rates) == pytest.approx(1.0) and 0 <= r[f"eval/{a}/illegal_rate"] <= rates[1]
    assert (tmp_path / "ttt" / "curves.png").exists()


def test_resume_continues_identically(runtime, service, renderer, tmp_path) -> None:
    """A run stopped after its step-2 checkpoint and resumed to step 4 plays the same games and
    ends with both agents' weights equal to an uninterrupted 4-step run's; metrics.jsonl keeps one
    line per step; a resume without a complete checkpoint (or a fresh run in a used folder) starts
    over."""

    def cfg(name: str, steps: int) -> RLConfig:
        return RLConfig(
            base_model=TEST_MODEL, log_dir=str(tmp_path / name), steps=steps, save_every=2,
            groups_per_step=2, group_size=4, max_tokens=4, lora_rank=4, learning_rate=2e-3,
            eval_every=0, progress=False,
        )  # fmt: skip

    full = asyncio.run(run_multiagent(cfg("full", 4), service, build(renderer, cfg("full", 4))))
    asyncio.run(run_multiagent(cfg("cut", 2), service, build(renderer, cfg("cut", 2))))
    index = tmp_path / "cut" / "checkpoints.jsonl"
    assert last_complete_checkpoint(index, ("X", "O"))[0] == 2
    resumed = asyncio.run(run_multiagent(cfg("cut", 4), service, build(renderer, cfg("cut", 4)), resume=True))
    assert [r["step"] for r in resumed.metrics] == [2, 3]
    rows = [json.loads(x) for x in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for want, got in zip(full.metrics[2:], resumed.metrics, strict=True):
        for key in ("game/X_wins", "game/illegal", "X/reward/mean", "O/reward/mean"):
            assert got[key] == want[key]
    for a in ("X", "O"):
        w_full = _weights(runtime, full.training_clients[a].model_id)
        w_res = _weights(runtime, resumed.training_clients[a].model_id)
        assert_state_close(w_res, w_full)
    # only one agent saved at the last step: the last step both were saved at counts
    with index.open("a") as f:
        f.write(json.dumps({"step": 6, "agent": "X", "path": "tinker://nowhere"}) + "\n")
    assert last_complete_checkpoint(index, ("X", "O"))[0] == 4
    assert last_complete_checkpoint(tmp_path / "none.jsonl", ("X", "O")) == (0, {})


def test_tictactoe_per_move_advantages_run(service, renderer, tmp_path) -> None:
    cfg = RLConfig(
        base_model=TEST_MODEL, log_dir=str(tmp_path / "pm"), steps=1, groups_per_step=2, group_size=6,
        max_tokens=4, lora_rank=4, learning_rate=1e-3, eval_every=0, progress=False,
        extra={"per_move": True, "legal_bonus": 0.2, "illegal_reward": -2.0},
    )  # fmt: skip
    task = build(renderer, cfg)
    task.evaluator = None
    assert task.per_move_advantages
    spy = _Spy(service)
    res = asyncio.run(run_multiagent(cfg, spy, task))
    sent = [d for batches in spy.sent.values() for d in batches[0]]
    assert sent and sum(res.metrics[0][f"{a}/train/datums"] for a in ("X", "O")) == len(sent)
    for d in sent:  # one move per datum (each move's prompt is rendered afresh): one advantage on it
        w = list(d.loss_fn_inputs["logprobs"].data)
        advs = {round(a, 9) for a, lp in zip(d.loss_fn_inputs["advantages"].data, w, strict=True) if lp != 0}
        assert len(advs) == 1


class _SlowChat(_Chat):
    """``_Chat`` whose moves take ``delay`` seconds of the game's own time."""

    def __init__(self, renderer, delay: float) -> None:
        super().__init__(renderer)
        self.delay = delay

    async def act(self, agent: str, reply: Message, ended: bool) -> dict[str, float]:
        await asyncio.sleep(self.delay)
        return await super().act(agent, reply, ended)


class _SlowChatGroup(GameGroupBuilder):
    def __init__(self, renderer, delays: list[float]) -> None:
        self.renderer, self.delays = renderer, delays

    async def make_games(self) -> Sequence[MultiAgentEnv]:
        return [_SlowChat(self.renderer, d) for d in self.delays]


def test_game_timeout_counts_the_game_not_the_sampler(service, renderer, caplog) -> None:
    """Four sampled moves at 0.2 s each (0.8 s > the 0.3 s limit) never fail a game; a move that
    takes the game itself longer than the limit fails that game alone, with a message saying so."""
    policy = SlowSampler(service.create_sampling_client(base_model=TEST_MODEL), 0.2)
    params = types.SamplingParams(max_tokens=4)
    group = _SlowChatGroup(renderer, [0.0, 0.0, 1.0])
    g = asyncio.run(play_group(group, {"A": policy, "B": policy}, params, seed=0, timeout_s=0.3))
    assert g.errors == 1 and len(g.games) == 2
    assert "the environment's move took longer than 0.3 s" in caplog.text


def test_tictactoe_recipe_and_reevaluation_smoke(tmp_path) -> None:
    """recipes/tictactoe/run.py (the measured command's options, 1 step), then evaluate.py on its
    checkpoints from another process (the embedded data dir is shared through OPENTINKER_HOME)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENTINKER_HOME": str(tmp_path / "home")}
    run = tmp_path / "run"
    subprocess.run(
        [sys.executable, str(root / "recipes/tictactoe/run.py"), "--steps", "1", "--groups", "2",
         "--group-size", "2", "--eval-games", "2", "--eval-every", "1", "--illegal-reward", "-2",
         "--random-frac", "1.0", "--random-x-share", "0.75", "--legal-bonus", "0.2", "--per-move",
         "--opening-pairs", "0", "--no-progress", "--log-dir", str(run)],
        check=True, capture_output=True, timeout=600, env=env,
    )  # fmt: skip
    out = subprocess.run(
        [sys.executable, str(root / "recipes/tictactoe/evaluate.py"), "--games", "3", str(run)],
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    rows = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    assert [r["run"] for r in rows] == [str(run), "untrained"]
    for r in rows:
        for a in ("X", "O"):
            rates = [r[f"{a}/{k}_rate"] for k in ("win", "loss", "draw")]
            assert abs(sum(rates) - 1) < 1e-9 and r[f"{a}/errors"] == 0


def test_each_agents_episodes_go_to_rollouts_jsonl_and_the_console_filters_them(
    service, renderer, tmp_path
) -> None:
    """rollouts.jsonl of a multi-agent run: ``rollouts_per_step`` episodes per agent and step, each
    under its agent's name, with that agent's own prompts (X moves on an even board; O sees the
    board swapped, one mark behind) and its sampled tokens; the console lists and filters them,
    and overlays each per-agent metric's curves, one per agent."""
    from fastapi.testclient import TestClient

    from opentinker.server.console_api import create_runs_app

    cfg = RLConfig(
        base_model=TEST_MODEL, log_dir=str(tmp_path / "ttt"), steps=2, groups_per_step=2, group_size=4,
        max_tokens=4, lora_rank=4, learning_rate=2e-3, eval_every=0, progress=False, rollouts_per_step=3,
    )  # fmt: skip
    task = build(renderer, cfg)
    task.evaluator = None
    asyncio.run(run_multiagent(cfg, service, task))
    eps = [json.loads(x) for x in (tmp_path / "ttt" / "rollouts.jsonl").read_text().splitlines()]
    counts: dict[tuple[int, str], int] = {}
    for e in eps:
        counts[e["step"], e["series"]] = counts.get((e["step"], e["series"]), 0) + 1
    assert counts == {(s, a): 3 for s in (0, 1) for a in ("X", "O")}
    for e in eps:
        diff = 0 if e["series"] == "X" else 1
        first = e["turns"][0]
        assert first["kind"] == "prompt"
        board = re.findall(r"([XO.]{3})\n([XO.]{3})\n([XO.]{3})\nYour move as X", first["text"])
        cells = "".join(board[-1])
        assert cells.count("O") - cells.count("X") == diff, (e["series"], cells)
        actions = [t for t in e["turns"] if t["kind"] == "action"]
        assert actions and all(len(t["tokens"]) == len(t["logprobs"]) > 0 for t in actions)
        assert -1.0 <= e["reward"] <= 1.0 and e["policy_version"] == e["step"]
    client = TestClient(create_runs_app(tmp_path))
    (run,) = client.get("/console/api/runs").json()["runs"]
    assert run["name"] == "ttt" and run["has_rollouts"]
    page = client.get("/console/api/runs/rollouts", params={"run": "ttt", "limit": 100}).json()
    assert page["series"] == ["O", "X"] and page["steps"] == [0, 1] and page["problems"] == []
    only_o = client.get("/console/api/runs/rollouts", params={"run": "ttt", "series": "O", "step": 1}).json()
    assert [e["series"] for e in only_o["episodes"]] == ["O"] * 3
    mine = [json.dumps(e, sort_keys=True) for e in eps if e["series"] == "O" and e["step"] == 1]
    assert sorted(json.dumps(e, sort_keys=True) for e in only_o["episodes"]) == sorted(mine)
    # the curves: one per agent for each per-agent metric, the game's own keys as one curve
    assert run["series"] == ["X", "O"] and run["keys"][0] == "reward/mean" and "game/draws" in run["keys"]
    rows = [json.loads(x) for x in (tmp_path / "ttt" / "metrics.jsonl").read_text().splitlines()]
    curves = client.get(
        "/console/api/runs/curves", params={"run": "ttt", "keys": ["reward/mean", "game/draws"]}
    ).json()
    assert curves["series_by"] == "agent"
    for a in ("X", "O"):
        assert curves["curves"]["reward/mean"][a] == [[float(r["step"]), r[f"{a}/reward/mean"]] for r in rows]
    assert curves["curves"]["game/draws"] == {"": [[float(r["step"]), r["game/draws"]] for r in rows]}
