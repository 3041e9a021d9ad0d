"""A run folder's checkpoint index, ``checkpoints.jsonl``: one ``{"step", "path"}`` line per save
(a multi-agent run adds ``"agent"``: one line per agent and save).

:func:`open_training_clients` gives a run its training clients: reloaded with their optimizers
from the newest checkpoint when resuming, else fresh (and a fresh run in a used folder starts a
new index, so a later ``--resume`` never continues an older run). :func:`save_checkpoints` saves
every client and appends to the index. The run scaffold (:mod:`opentinker.tracking.run`) drives both.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

INDEX = "checkpoints.jsonl"
SINGLE = ""  # the agent name of a one-adapter run: its index lines carry no "agent"


class AdapterConfig(Protocol):
    """What a new adapter is created with (agent *k* of a run gets seed ``seed + k``)."""

    base_model: str
    lora_rank: int
    seed: int
    train_attn: bool
    train_mlp: bool
    train_unembed: bool


def newest_checkpoint(index: Path, agents: Sequence[str] = (SINGLE,)) -> tuple[int, dict[str, str]]:
    """(the last step at which every one of ``agents`` was saved, each one's checkpoint path there)
    from a run's ``checkpoints.jsonl``; (0, {}) if there is none."""
    by_step: dict[int, dict[str, str]] = {}
    lines = index.read_text().splitlines() if index.exists() else []
    for line in lines:
        row = json.loads(line) if line.strip() else {}
        if "step" in row:
            by_step.setdefault(int(row["step"]), {})[row.get("agent", SINGLE)] = row["path"]
    complete = [step for step, saved in by_step.items() if all(a in saved for a in agents)]
    if not complete:
        return 0, {}
    step = max(complete)
    return step, {a: by_step[step][a] for a in agents}


async def open_training_clients(
    service: Any,
    cfg: AdapterConfig,
    log_dir: Path,
    agents: Sequence[str] = (SINGLE,),
    *,
    resume: bool,
    given: Mapping[str, Any] | None = None,
) -> tuple[dict[str, Any], int, dict[str, str]]:
    """(agent -> training client, step to start at, agent -> the checkpoint it was reloaded from).

    Resuming with a checkpoint in the index reloads every agent from the newest step all of them
    were saved at; otherwise the index is removed and the clients are ``given`` or created."""
    index = Path(log_dir) / INDEX
    start, paths = newest_checkpoint(index, agents) if resume else (0, {})
    if paths:
        reloaded = await asyncio.gather(
            *(service.create_training_client_from_state_with_optimizer(paths[a]) for a in agents)
        )
        return dict(zip(agents, reloaded, strict=True)), start, paths
    index.unlink(missing_ok=True)
    if given is not None:
        return {a: given[a] for a in agents}, 0, {}
    created = await asyncio.gather(
        *(
            service.create_lora_training_client(
                base_model=cfg.base_model, rank=cfg.lora_rank, seed=cfg.seed + k, train_attn=cfg.train_attn,
                train_mlp=cfg.train_mlp, train_unembed=cfg.train_unembed,
            )
            for k in range(len(agents))
        )
    )  # fmt: skip
    return dict(zip(agents, created, strict=True)), 0, {}


async def save_checkpoints(clients: Mapping[str, Any], step: int, log_dir: Path) -> dict[str, str]:
    """``save_state`` (weights + optimizer) of every client, all submitted before any is awaited,
    appended to the index; returns agent -> path. A checkpoint is named after its agent, or for a
    one-adapter run after the run's folder (one training client may go through several runs, e.g.
    SFT then RL), and ``step``."""
    futs = {a: tc.save_state(f"{a or Path(log_dir).name}-step-{step:06d}") for a, tc in clients.items()}
    paths: dict[str, str] = {}
    with (Path(log_dir) / INDEX).open("a") as f:
        for a, fut in futs.items():
            paths[a] = (await fut).path
            line = (
                {"step": step, "path": paths[a]}
                if a == SINGLE
                else {"step": step, "agent": a, "path": paths[a]}
            )
            f.write(json.dumps(line) + "\n")
    return paths
