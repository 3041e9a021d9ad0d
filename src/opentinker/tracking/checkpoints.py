"""A run folder's checkpoint index, ``checkpoints.jsonl``: one ``{"step", "path"}`` line per save.

Shared by the RL, SFT and DPO loops: :func:`open_training_client` gives a run its training client —
reloaded with its optimizer from the last saved checkpoint when resuming, else fresh (and a fresh
run in a used folder starts a new index, so a later ``--resume`` never continues an older run).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

INDEX = "checkpoints.jsonl"


async def open_training_client(
    service: Any, cfg: Any, log_dir: Path, *, resume: bool, training_client: Any | None = None
) -> tuple[Any, int]:
    """(training client, step to start at). ``cfg`` names the adapter: ``base_model``,
    ``lora_rank``, ``seed``, ``train_attn``, ``train_mlp``, ``train_unembed``."""
    index = Path(log_dir) / INDEX
    lines = index.read_text().split("\n") if resume and index.exists() else []
    lines = [line for line in lines if line.strip()]
    if lines:
        last = json.loads(lines[-1])
        return await service.create_training_client_from_state_with_optimizer(last["path"]), int(last["step"])
    index.unlink(missing_ok=True)
    if training_client is not None:
        return training_client, 0
    tc = await service.create_lora_training_client(
        base_model=cfg.base_model, rank=cfg.lora_rank, seed=cfg.seed, train_attn=cfg.train_attn,
        train_mlp=cfg.train_mlp, train_unembed=cfg.train_unembed,
    )  # fmt: skip
    return tc, 0


async def save_checkpoint(tc: Any, step: int, log_dir: Path) -> str:
    """``save_state`` (weights + optimizer) named after the run's folder and ``step`` (one training
    client may go through several runs, e.g. SFT then RL), appended to the index."""
    path = (await tc.save_state(f"{Path(log_dir).name}-step-{step:06d}")).path
    with (Path(log_dir) / INDEX).open("a") as f:
        f.write(json.dumps({"step": step, "path": path}) + "\n")
    return path
