"""``rollouts.jsonl``: a small sample of each step's episodes, for the console's rollout viewer.

One JSON line per episode: ``step``, ``series`` (the adapter's or agent's name), ``group``,
``reward``, ``advantage`` (group-relative, as the RL loss uses it), ``policy_version`` and
``turns``: the rendered conversation in order, each ``{"kind": "prompt" | "env" | "action",
"text"}``; an action also carries its ``tokens`` (each token's text) and the sampler's
``logprobs``. The file stops growing at ``max_bytes`` (its last line then says so), so a long run
cannot fill the disk.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

FILE = "rollouts.jsonl"
DEFAULT_PER_STEP = 4  # episodes logged per step
DEFAULT_MAX_BYTES = 32 << 20


class RolloutLog:
    def __init__(
        self,
        log_dir: str | Path,
        tokenizer: Any,
        *,
        series: str = "",
        per_step: int = DEFAULT_PER_STEP,
        max_bytes: int = DEFAULT_MAX_BYTES,
        start_step: int = 0,
    ) -> None:
        self.path = Path(log_dir) / FILE
        self.tokenizer = tokenizer
        self.series = series
        self.per_step = per_step
        self.max_bytes = max_bytes
        if self.path.exists():  # on resume, drop the steps that will run again
            kept = [line for line in self.path.read_text().splitlines() if _step(line) < start_step]
            self.path.write_text("".join(line + "\n" for line in kept))
        self.size = self.path.stat().st_size if self.path.exists() else 0
        self.full = self.size >= max_bytes

    def log(self, step: int, episodes: Sequence[tuple[int, Any, float]], *, series: str | None = None) -> int:
        """Log up to ``per_step`` of ``episodes`` (group index, trajectory, advantage) of ``step``:
        spread over the groups, highest and lowest reward first. Returns how many were written.
        ``series`` names whose episodes they are (default: the log's own ``series``); a multi-agent
        run logs each agent's under its name, ``per_step`` each."""
        if self.full or self.per_step <= 0 or not episodes:
            return 0
        ranked = sorted(episodes, key=lambda e: e[1].total_reward)
        picked: list[tuple[int, Any, float]] = []
        while ranked and len(picked) < self.per_step:  # alternately the best and the worst
            picked.append(ranked.pop(-1 if len(picked) % 2 == 0 else 0))
        lines = [json.dumps(self.record(step, g, traj, adv, series=series)) + "\n" for g, traj, adv in picked]
        written = 0
        with self.path.open("a") as f:
            for line in lines:
                if self.size + len(line) > self.max_bytes:
                    note = json.dumps(
                        {"step": step, "note": f"rollouts.jsonl reached its {self.max_bytes} byte budget"}
                    )
                    f.write(note + "\n")
                    self.full = True
                    break
                f.write(line)
                self.size += len(line)
                written += 1
        return written

    def record(
        self, step: int, group: int, traj: Any, advantage: float, *, series: str | None = None
    ) -> dict[str, Any]:
        turns: list[dict[str, Any]] = []
        seen: list[int] = []
        for t in traj.transitions:
            ob, ac = list(t.ob_T), list(t.ac_T)
            new = ob[len(seen) :] if ob[: len(seen)] == seen else ob
            if new:
                turns.append({"kind": "env" if turns else "prompt", "text": self._text(new)})
            turns.append(
                {
                    "kind": "action",
                    "text": self._text(ac),
                    "tokens": [self._text([tok]) for tok in ac],
                    "logprobs": [round(float(lp), 4) for lp in t.logprobs_T],
                    "reward": t.reward,
                }
            )
            seen = ob + ac
        return {
            "step": step,
            "series": self.series if series is None else series,
            "group": group,
            "reward": traj.total_reward,
            "advantage": advantage,
            "policy_version": traj.policy_version,
            "turns": turns,
        }

    def _text(self, tokens: list[int]) -> str:
        return str(self.tokenizer.decode(tokens, skip_special_tokens=False))


def _step(line: str) -> int:
    try:
        return int(json.loads(line).get("step", -1))
    except (ValueError, AttributeError, TypeError):
        return -1
