"""The running batch: rows that decode together, and the one way rows leave it or join it.

A :class:`RunningBatch` is the step-wise decoder's batch (:mod:`opentinker.sampling.decoder`), or
one admission's new rows before they merge into it. It holds the rows' forward (its keys and
values, one cache row per sampled row), the LoRA plan routing each row through its policy, the
rows in cache order and the weights their policies name. Rows leave only through
:meth:`RunningBatch.keep` (a request dropped, rows that stopped at a step or at their first
token), which moves the cache, the plan and the rows together; an admission joins through
:meth:`RunningBatch.join`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from opentinker.engine import Engine
from opentinker.engine.types import PolicyRef
from opentinker.lora import LoRABatch, LoRAWeights
from opentinker.sampling.choice import Row
from opentinker.sampling.forward import Forward, replan


@dataclass
class RunningBatch:
    """Rows decoding together (module docstring)."""

    engine: Engine
    model: Forward
    plan: LoRABatch | None
    rows: list[Row]
    weights: dict[PolicyRef, LoRAWeights | None]

    def keep(self, idx: list[int]) -> None:
        """Keep rows ``idx`` only, in that order (the cache rows move with them); the weights no
        kept row names are let go. All rows, in order: nothing moves."""
        if idx == list(range(len(self.rows))):
            return
        select = torch.tensor(idx, device=self.engine.device)
        self.model.select(select)
        self.plan = self.plan.select(select) if self.plan is not None else None
        self.rows = [self.rows[j] for j in idx]
        live = {row.policy for row in self.rows}
        self.weights = {p: w for p, w in self.weights.items() if p in live}

    def join(self, new: RunningBatch) -> None:
        """Append ``new``'s rows (an admission's) after these; the cache grows to the room the
        longest-running row needs, and the plan covers every row's policy."""
        self.weights.update(new.weights)
        self.rows = self.rows + new.rows
        ctx = self.engine.max_context
        room = max(min(row.params.max_tokens, ctx - row.prompt_len) - len(row.tokens) for row in self.rows)
        self.model.merge(new.model, room)
        self.plan = replan(self.engine, self.plan, [row.policy for row in self.rows], self.weights)
