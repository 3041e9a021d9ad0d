"""skyrl-gym environments as a task: ``skyrl_gym:<env_id>[?data=FILE&max_turns=N&...]``.

One episode is one data row in SkyRL's format — ``{"prompt": [messages], "reward_spec":
{"ground_truth": ...}, "extra_info": {...}}`` — and one environment made for it by
``skyrl_gym.make(env_id, env_config=..., extras=row)``. Its ``init(prompt)`` gives the opening
messages; each reply goes to its ``step(text)``, whose reward is that turn's reward, whose
``observations`` are the next turn's messages, until ``done``. Numeric ``metadata`` are logged as
``env/<key>``. ``step`` runs in a worker thread, so an environment that blocks (a tool call, a
database) is cut by the episode timeout like any other.

``data`` is a JSONL or Parquet file of rows (read with ``datasets``; a row's ``reward_spec`` and
``extra_info`` may be JSON strings, as SkyRL's own parquet files hold them). Without it,
``gsm8k`` and ``gsm8k_multi_turn`` get grade-school word problems from reasoning-gym's
``gsm_symbolic`` generator (offline: GSM8K itself is a download), with SkyRL's ``#### ANSWER``
instruction. Other options (``max_turns``, ...) are put into each row's ``extras``. Evaluation:
``eval_problems`` (default 50) rows, greedy: ``eval/reward`` (mean return) and ``eval/accuracy``
(share whose last turn scored 1).
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Sequence
from typing import Any

import skyrl_gym
from tinker import types

from opentinker.renderers import Message, Renderer
from opentinker.rl.rollout import blocking
from opentinker.rl.types import Env, EnvGroupBuilder, MessageEnv, Reply, RLDataset

INSTRUCTION = "Let's think step by step and output the final answer after '####'."
GENERATED = ("gsm8k", "gsm8k_multi_turn")  # ids whose problems are generated when no data is given
EVAL_SEED_OFFSET = 1_000_003


def _row(raw: dict[str, Any], where: str) -> dict[str, Any]:
    row = dict(raw)
    for key in ("reward_spec", "extra_info"):
        if isinstance(row.get(key), str):
            row[key] = json.loads(row[key])
    prompt = row.get("prompt")
    if not isinstance(prompt, list) or not prompt or not all(isinstance(m, dict) for m in prompt):
        raise ValueError(f"{where}: 'prompt' must be a non-empty list of messages")
    row.setdefault("extra_info", {})
    return row


def read_rows(path: str) -> list[dict[str, Any]]:
    """SkyRL-format rows from a JSONL or Parquet file (errors name the file, not the reader)."""
    import datasets

    kind = "parquet" if path.endswith(".parquet") else "json"
    try:
        ds = datasets.load_dataset(kind, data_files=path, split="train")
    except FileNotFoundError:
        raise ValueError(f"skyrl_gym: no such data file {path!r}") from None
    except Exception as e:
        raise ValueError(f"skyrl_gym: cannot read {path!r}: {type(e).__name__}") from None
    return [_row(dict(r), f"{path}, row {i + 1}") for i, r in enumerate(ds)]  # type: ignore[arg-type]


def generated_rows(n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` GSM8K-style rows: reasoning-gym's gsm_symbolic problems, SkyRL's prompt and reward_spec."""
    import reasoning_gym

    ds = reasoning_gym.create_dataset("gsm_symbolic", size=n, seed=seed)
    return [
        {
            "prompt": [{"role": "user", "content": f"{e['question']} {INSTRUCTION}"}],
            "reward_spec": {"method": "rule", "ground_truth": str(e["answer"])},
            "extra_info": {},
        }
        for e in ds
    ]


class SkyRLEnv(MessageEnv):
    """One episode of a skyrl-gym text environment on one data row."""

    def __init__(
        self, renderer: Renderer, env_id: str, row: dict[str, Any], env_config: dict[str, Any]
    ) -> None:
        super().__init__(renderer)
        self.env_id, self.row, self.env_config = env_id, row, env_config
        self.env: Any = None

    def initial_messages(self) -> list[Message]:
        self.env = skyrl_gym.make(self.env_id, env_config=self.env_config, extras=self.row)
        prompt, _ = self.env.init(self.row["prompt"])
        return [{"role": m["role"], "content": m["content"]} for m in prompt]

    async def respond(self, reply: Message, ended: bool) -> Reply:
        out = await blocking(self.env.step, reply["content"])
        meta = out.get("metadata") or {}
        metrics = {
            k: float(v) for k, v in meta.items() if isinstance(v, int | float) and not isinstance(v, bool)
        }
        done = bool(out["done"])
        if done:
            self.env.close()
        messages = [{"role": m["role"], "content": m["content"]} for m in out["observations"] or []]
        if not done and not messages:
            raise ValueError(f"skyrl_gym {self.env_id}: not done but no observation")
        return Reply(float(out["reward"]), done, messages, metrics)  # type: ignore[arg-type]


class SkyRLGroup(EnvGroupBuilder):
    def __init__(
        self, renderer: Renderer, env_id: str, row: dict[str, Any], env_config: dict[str, Any], size: int
    ) -> None:
        self.renderer, self.env_id, self.row, self.env_config, self.size = (
            renderer,
            env_id,
            row,
            env_config,
            size,
        )

    async def make_envs(self) -> Sequence[Env]:
        return [SkyRLEnv(self.renderer, self.env_id, self.row, self.env_config) for _ in range(self.size)]

    def tags(self) -> list[str]:
        return [self.env_id]


class SkyRLDataset(RLDataset):
    def __init__(self, renderer: Renderer, env_id: str, rows: list[dict[str, Any]], env_config: dict[str, Any],
                 groups_per_step: int, group_size: int, seed: int) -> None:  # fmt: skip
        self.renderer, self.env_id, self.rows, self.env_config = renderer, env_id, rows, env_config
        self.n, self.size = groups_per_step, group_size
        self.order = list(range(len(rows)))
        random.Random(f"skyrl_gym/{env_id}/{seed}").shuffle(self.order)

    def batch(self, step: int) -> list[EnvGroupBuilder]:
        at = step * self.n
        rows = [self.rows[self.order[(at + k) % len(self.order)]] for k in range(self.n)]
        return [SkyRLGroup(self.renderer, self.env_id, r, self.env_config, self.size) for r in rows]


async def play(env: SkyRLEnv, policy: Any, params: types.SamplingParams) -> tuple[float, float]:
    """(return, last turn's reward) of one greedy episode."""
    ob = await env.initial_observation()
    total = 0.0
    while True:
        resp = await policy.sample(
            prompt=types.ModelInput.from_ints(ob), num_samples=1, sampling_params=params
        )
        res = await env.step(list(resp.sequences[0].tokens))
        total += res.reward
        if res.done:
            return total, res.reward
        ob = res.next_ob_T


def make_evaluator(
    renderer: Renderer, env_id: str, rows: list[dict[str, Any]], env_config: dict[str, Any], max_tokens: int
):
    params = types.SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=renderer.stop)

    async def evaluate(policy: Any, step: int) -> dict[str, float]:
        out = await asyncio.gather(
            *(play(SkyRLEnv(renderer, env_id, r, env_config), policy, params) for r in rows)
        )
        return {
            "reward": sum(t for t, _ in out) / len(out),
            "accuracy": sum(last == 1.0 for _, last in out) / len(out),
        }

    return evaluate


def build(
    renderer: Renderer, cfg: Any, *, environment: str, options: dict[str, Any]
) -> tuple[RLDataset, Any]:
    """Registry entry (``skyrl_gym:<env_id>?<options>``): the rows, the environments, the evaluator."""
    if environment not in skyrl_gym.registry:
        raise ValueError(
            f"skyrl_gym has no environment {environment!r}; it has {', '.join(sorted(skyrl_gym.registry))}"
        )
    options = dict(options)
    data = options.pop("data", None)
    n_eval = int(cfg.extra.get("eval_problems", 50))
    if n_eval < 1:
        raise ValueError(f"eval_problems must be >= 1, got {n_eval}")
    if data is not None:
        rows = read_rows(str(data))
        if len(rows) < 2:
            raise ValueError(f"skyrl_gym: {data!r} needs at least 2 rows (training and held out)")
        n_eval = min(n_eval, len(rows) // 2)
        train, held = rows[n_eval:], rows[:n_eval]
    elif environment in GENERATED:
        size = int(options.pop("size", 500))
        train, held = generated_rows(size, cfg.seed), generated_rows(n_eval, cfg.seed + EVAL_SEED_OFFSET)
    else:
        raise ValueError(f"skyrl_gym:{environment} needs its data: add ?data=<rows.jsonl or .parquet>")
    for r in train + held:
        r.update(options)  # e.g. max_turns: the environments read them from their extras
    env_config = dict(cfg.extra.get("env_config", {}))
    return (
        SkyRLDataset(renderer, environment, train, env_config, cfg.groups_per_step, cfg.group_size, cfg.seed),
        make_evaluator(renderer, environment, held, env_config, cfg.max_tokens),
    )
