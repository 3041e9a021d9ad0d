"""Task registry: a name -> how to build its environments/data, with the settings it wants.

A task module exposes one builder; the registry imports it lazily by name:

* ``kind="rl"``: ``build(renderer, cfg: RLConfig) -> (RLDataset, evaluator | None)``, trained by
  :func:`opentinker.rl.loop.run_rl`;
* ``kind="multiagent"``: ``build(renderer, cfg: RLConfig) -> MultiAgentTask``, trained by
  :func:`opentinker.rl.multiagent.run_multiagent`;
* ``kind="sft"``: ``build(renderer, cfg: SFTConfig) -> (train examples, eval examples)``, trained by
  :func:`opentinker.sft.loop.run_sft`.

``defaults`` are config fields the task sets unless the user overrides them.

Environments of other libraries are tasks too, named ``<library>:<environment>[?key=value&...]``
(``reasoning_gym:basic_arithmetic?size=200&seed=3``): each library's adapter module parses the
rest of the name (:data:`ECOSYSTEM`); the library itself is an optional extra, imported only when
one of its tasks is built.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import parse_qsl

Kind = Literal["rl", "multiagent", "sft"]


@dataclass(frozen=True)
class TaskSpec:
    name: str
    kind: Kind
    module: str
    builder: str
    description: str
    defaults: dict[str, Any] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)  # keyword arguments the builder is given

    def build(self) -> Callable[..., Any]:
        fn = getattr(importlib.import_module(self.module), self.builder)
        return functools.partial(fn, **self.params) if self.params else fn

    @property
    def slug(self) -> str:
        """The name as a folder name (an ecosystem task's ``:``, ``?``, ``&`` and ``=`` replaced)."""
        return re.sub(r"[^A-Za-z0-9_.-]+", "_", self.name).strip("_")


TASKS: dict[str, TaskSpec] = {
    t.name: t
    for t in [
        TaskSpec(
            "addition", "rl", "opentinker.tasks.arithmetic", "build",
            "2-digit addition, exact-match reward on the first integer (single-turn)",
            # 8 problems x 8 samples at 4e-4: every seed measured reaches 0.80 held-out in 15
            # CPU-minutes (recipes/addition/README.md); 4 x 8 at 3e-4 left it to the seed
            {"max_tokens": 8, "group_size": 8, "groups_per_step": 8, "eval_every": 20, "learning_rate": 4e-4},
        ),
        TaskSpec(
            "addition_retry", "rl", "opentinker.tasks.addition_retry", "build",
            "2-digit addition with 'not correct' feedback and up to 3 attempts (multi-turn)",
            {"max_tokens": 8, "group_size": 8, "groups_per_step": 4, "eval_every": 20, "learning_rate": 3e-4},
        ),
        TaskSpec(
            "calculator", "rl", "opentinker.tasks.calculator", "build",
            "3-digit x 2-digit multiplication with a calculator tool the environment runs (multi-turn)",
            {"max_tokens": 16, "group_size": 8, "groups_per_step": 4, "eval_every": 10, "learning_rate": 3e-4},
        ),
        TaskSpec(
            "reply_length", "rl", "opentinker.tasks.reply_length", "build",
            "reply with a target number of words (dense reward; extra target_words, default 5)",
            {"max_tokens": 32, "group_size": 4, "groups_per_step": 2, "eval_every": 5, "learning_rate": 2e-3},
        ),
        TaskSpec(
            "guess_number", "rl", "opentinker.tasks.guess_number", "build",
            "guess a number in 1..100 with higher/lower feedback (multi-turn)",
            {"max_tokens": 12, "group_size": 8, "groups_per_step": 4, "eval_every": 10},
        ),
        TaskSpec(
            "planner_solver", "rl", "opentinker.tasks.planner_solver", "build",
            "add up numbers in rounds of planner / solver / reviewer calls; the scratchpad is summarised between rounds (multi-call)",
            {"max_tokens": 16, "group_size": 8, "groups_per_step": 4, "eval_every": 10, "learning_rate": 3e-4},
        ),
        TaskSpec(
            "guess_number_long", "rl", "opentinker.tasks.guess_number_long", "build",
            "guess a number in 1..1000 in up to 12 guesses (long-horizon; extra high, max_turns, informative)",
            {"max_tokens": 12, "group_size": 8, "groups_per_step": 4, "eval_every": 0},
        ),
        TaskSpec(
            "tictactoe", "multiagent", "opentinker.tasks.tictactoe", "build",
            "tic-tac-toe between two policies (two adapters), each trained on its own moves",
            {"max_tokens": 4, "group_size": 8, "groups_per_step": 4, "eval_every": 10},
        ),
        TaskSpec(
            "chat_sft", "sft", "opentinker.tasks.chat", "build",
            "supervised fine-tuning on a chat JSONL (default: the bundled arithmetic-chat set)",
            {},
        ),
    ]
}  # fmt: skip


@dataclass(frozen=True)
class Library:
    """An environment library whose environments are tasks ``<prefix>:<environment>[?query]``."""

    prefix: str
    kind: Kind
    module: str  # our adapter module; its ``build(renderer, cfg, environment=..., options=...)``
    package: str  # the library's import name
    extra: str  # the optional extra that installs it (pip install 'opentinker[<extra>]')
    form: str  # how an environment is named, for --list-tasks
    description: str
    defaults: dict[str, Any] = field(default_factory=dict)

    def installed(self) -> bool:
        return importlib.util.find_spec(self.package) is not None


ECOSYSTEM: dict[str, Library] = {
    lib.prefix: lib
    for lib in [
        Library(
            "reasoning_gym", "rl", "opentinker.tasks.reasoning_gym_task", "reasoning_gym", "reasoning-gym",
            "reasoning_gym:<dataset>[?size=N&seed=S&<dataset option>=V...]",
            "a reasoning-gym procedural dataset, scored by its own score_answer (single-turn)",
            {"max_tokens": 16, "group_size": 8, "groups_per_step": 4, "eval_every": 10, "learning_rate": 3e-4},
        ),
        Library(
            "verifiers", "rl", "opentinker.tasks.verifiers_task", "verifiers", "verifiers",
            "verifiers:<env_id>[?<load_environment argument>=V...]",
            "a verifiers environment (single- or multi-turn), its rubric as the reward",
            {"max_tokens": 32, "group_size": 8, "groups_per_step": 4, "eval_every": 10, "learning_rate": 3e-4},
        ),
        Library(
            "skyrl_gym", "rl", "opentinker.tasks.skyrl_task", "skyrl_gym", "skyrl-gym",
            "skyrl_gym:<env_id>[?data=<rows.jsonl|.parquet>&max_turns=N...]",
            "a skyrl-gym text environment (multi-turn, its step's rewards); gsm8k ones generate their problems",
            {"max_tokens": 64, "group_size": 8, "groups_per_step": 4, "eval_every": 10, "learning_rate": 3e-4},
        ),
        Library(
            "textarena", "multiagent", "opentinker.tasks.textarena_task", "textarena", "textarena",
            "textarena:<env_id>[?players=N&<game argument>=V...]",
            "a textarena game (e.g. TicTacToe-v0), each player its own adapter",
            {"max_tokens": 16, "group_size": 4, "groups_per_step": 4, "eval_every": 10, "learning_rate": 3e-4},
        ),
    ]
}  # fmt: skip


def parse_options(query: str) -> dict[str, Any]:
    """``a=1&b=x`` -> ``{"a": 1, "b": "x"}``: a value is an int, a float, true/false, or a string."""
    out: dict[str, Any] = {}
    for key, value in parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)):
        if key in out:
            raise ValueError(f"option {key!r} is given twice")
        out[key] = _value(value)
    return out


def _value(text: str) -> Any:
    if text in ("true", "false"):
        return text == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def ecosystem_task(name: str) -> TaskSpec:
    """The task of an ecosystem name ``<prefix>:<environment>[?query]``."""
    prefix, _, rest = name.partition(":")
    lib = ECOSYSTEM[prefix]
    environment, _, query = rest.partition("?")
    if not environment:
        raise ValueError(f"task {name!r} names no environment; the form is {lib.form}")
    try:
        options = parse_options(query)
    except ValueError as e:
        raise ValueError(f"task {name!r}: bad options {query!r} ({e})") from None
    if not lib.installed():
        raise ValueError(
            f"task {name!r} needs the {lib.package} package: pip install 'opentinker[{lib.extra}]'"
        )
    return TaskSpec(
        name, lib.kind, lib.module, "build", lib.description, dict(lib.defaults),
        {"environment": environment, "options": options},
    )  # fmt: skip


def get_task(name: str) -> TaskSpec:
    if name in TASKS:
        return TASKS[name]
    if name.partition(":")[0] in ECOSYSTEM and ":" in name:
        return ecosystem_task(name)
    libs = ", ".join(f"{p}:..." for p in ECOSYSTEM)
    raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}, {libs}")


def list_tasks() -> str:
    """What ``opentinker train rl --list-tasks`` prints: every task, then every library's form
    and whether it is installed."""
    lines = ["tasks:"]
    width = max(len(n) for n in TASKS)
    lines += [f"  {t.name:<{width}}  {t.kind:<10}  {t.description}" for t in TASKS.values()]
    lines.append("environment libraries (optional extras):")
    for lib in ECOSYSTEM.values():
        state = "installed" if lib.installed() else f"not installed: pip install 'opentinker[{lib.extra}]'"
        lines.append(f"  {lib.form}  {lib.kind}  ({state})")
        lines.append(f"      {lib.description}")
    return "\n".join(lines)
