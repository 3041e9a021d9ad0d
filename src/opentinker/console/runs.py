"""Local run folders as the console shows them: ``metrics.jsonl``, ``config.json``,
``checkpoints.jsonl`` and ``rollouts.jsonl`` under a runs directory.

A run is any folder (at any depth, up to :data:`MAX_DEPTH`) holding a ``metrics.jsonl``. Files are
read as they are now, so a run that is still going shows its newest lines. A malformed line is
skipped and reported as ``problems`` (file and line number, relative to the runs directory); the
rest of the file and every other run still show. Curves are downsampled to a fixed number of
points (min and max of each bucket kept, so spikes stay visible). A multi-agent run (its
``config.json`` lists ``agents``) shows its per-agent keys (``X/reward/mean``,
``eval/X/win_rate``) as one metric (``reward/mean``, ``eval/win_rate``) with a curve per agent. At most :data:`MAX_SERIES`
overlaid curves per metric come back unless the caller names which, and lists are paginated.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

MAX_DEPTH = 4
MAX_POINTS = 2000  # per curve, after downsampling
MAX_PAGE = 500  # items per page of any list
MAX_SERIES = 32  # curves per metric in one answer (a run's adapters or agents), unless named

# metrics a run's overview shows first, when it has them
PREFERRED_KEYS = (
    "reward/mean", "env/reward/mean", "loss", "train/loss", "kl", "lr", "optim/lr", "accuracy",
)  # fmt: skip


class RunsError(ValueError):
    """A request about local runs that cannot be answered (names the problem, never a server path)."""


@dataclass
class Problem:
    file: str  # relative to the runs directory
    line: int  # 1-based; 0 = the file as a whole
    message: str

    def json(self) -> dict[str, Any]:
        return {"file": self.file, "line": self.line, "message": self.message}


@dataclass
class JsonLines:
    rows: list[dict[str, Any]] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)


def read_jsonl(path: Path, shown_as: str) -> JsonLines:
    """Every JSON object line of ``path``; malformed lines become problems naming file and line."""
    out = JsonLines()
    try:
        text = path.read_text(errors="replace")
    except OSError as e:
        out.problems.append(Problem(shown_as, 0, f"cannot read: {e.strerror or type(e).__name__}"))
        return out
    lines = text.split("\n")
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if i == len(lines):  # a run still writing: its last line may be half written
                continue
            out.problems.append(Problem(shown_as, i, f"not JSON ({e.msg})"))
            continue
        if not isinstance(row, dict):
            out.problems.append(Problem(shown_as, i, f"a JSON {type(row).__name__}, not an object"))
            continue
        out.rows.append(row)
    return out


class RunsDir:
    """The runs under one directory (it may not exist yet: then there are none, and a problem)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def _names(self) -> list[str]:
        if not self.root.is_dir():
            return []
        found = []
        for p in sorted(self.root.rglob("metrics.jsonl")):
            rel = p.parent.relative_to(self.root)
            if len(rel.parts) <= MAX_DEPTH:
                found.append(rel.as_posix() if rel.parts else ".")
        return found

    def folder(self, name: str) -> Path:
        """The folder of run ``name``: only names :meth:`runs` lists (no path escapes the root)."""
        if name not in self._names():
            raise RunsError(f"unknown run {name!r}")
        return self.root / name

    def runs(self, offset: int = 0, limit: int = 100) -> dict[str, Any]:
        """A page of runs with their config, step count, metric keys and checkpoints, and every
        problem found reading them."""
        limit = _check_page(offset, limit)
        problems: list[Problem] = []
        if not self.root.is_dir():
            problems.append(Problem(str(self.root), 0, "the runs directory does not exist"))
        names = self._names()
        page = []
        for name in names[offset : offset + limit]:
            folder = self.root / name
            metrics = read_jsonl(folder / "metrics.jsonl", _rel(name, "metrics.jsonl"))
            problems += metrics.problems
            config, problem = self._config(name)
            if problem is not None:
                problems.append(problem)
            ckpts = read_jsonl(folder / "checkpoints.jsonl", _rel(name, "checkpoints.jsonl"))
            if (folder / "checkpoints.jsonl").exists():
                problems += ckpts.problems
            steps = [r["step"] for r in metrics.rows if isinstance(r.get("step"), int | float)]
            agents = agents_of(config)
            keys = metric_keys(metrics.rows, agents)
            series = agents or series_names(metrics.rows)
            page.append(
                {
                    "name": name,
                    "steps": len(metrics.rows),
                    "last_step": max(steps) if steps else None,
                    "keys": keys[:MAX_PAGE],
                    "keys_count": len(keys),
                    "series": series[:MAX_SERIES],
                    "series_count": len(series),
                    "config": config,
                    "checkpoints": ckpts.rows[-MAX_PAGE:],
                    "has_rollouts": (folder / "rollouts.jsonl").exists(),
                }
            )
        return {
            "runs": page,
            "cursor": {"offset": offset, "limit": limit, "total_count": len(names)},
            "problems": [p.json() for p in problems],
        }

    def _config(self, name: str) -> tuple[Any, Problem | None]:
        path = self.root / name / "config.json"
        if not path.exists():
            return None, None
        try:
            return json.loads(path.read_text(errors="replace")), None
        except json.JSONDecodeError as e:
            return None, Problem(_rel(name, "config.json"), e.lineno, f"not JSON ({e.msg})")

    def curves(
        self,
        name: str,
        keys: list[str],
        *,
        max_points: int = MAX_POINTS,
        series_by: str | None = None,
        series: list[str] | None = None,
    ) -> dict[str, Any]:
        """Run ``name``'s metrics ``keys`` against step, downsampled to ``max_points`` per curve.

        ``series_by`` splits the rows into one curve per value of that field (``adapter``,
        ``agent``): a multi-LoRA or multi-agent run's overlays; a run whose config names its
        ``agents`` gets one curve per agent from the agents' own keys (:func:`agent_key`). Of
        those, the ones named in ``series``, else the first :data:`MAX_SERIES` (``series_total``
        says how many there are)."""
        if not 2 <= max_points <= MAX_POINTS:
            raise RunsError(f"max_points must be in [2, {MAX_POINTS}], got {max_points}")
        if len(keys) > 32:
            raise RunsError(f"at most 32 keys at once, got {len(keys)}")
        if series is not None and len(series) > MAX_SERIES:
            raise RunsError(f"at most {MAX_SERIES} series at once, got {len(series)}")
        metrics = read_jsonl(self.folder(name) / "metrics.jsonl", _rel(name, "metrics.jsonl"))
        agents = agents_of(self._config(name)[0]) if series_by is None else []
        split = "agent" if agents else series_by or _default_series(metrics.rows)
        if agents:
            labels = sorted(agents)
        else:
            labels = sorted({str(r.get(split, "")) for r in metrics.rows}) if split else [""]
        shown = set(series) if series is not None else set(labels[:MAX_SERIES])
        out: dict[str, Any] = {}
        for key in keys:
            groups: dict[str, list[tuple[float, float]]] = {}
            for r in metrics.rows:
                x = r.get("step")
                if not _number(x):
                    continue
                if agents:  # each agent's own key for this metric
                    for a in agents:
                        y = r.get(agent_key(a, key))
                        if a in shown and _number(y):
                            groups.setdefault(a, []).append((float(x), float(y)))
                    if any(agent_key(a, key) in r for a in agents):
                        continue  # else a key of the whole game (game/..., time/...): below
                y = r.get(key)
                if _number(y):
                    label = str(r.get(split, "")) if split else ""
                    if agents or label in shown:
                        groups.setdefault(label, []).append((float(x), float(y)))
            out[key] = {label: downsample(sorted(pts), max_points) for label, pts in sorted(groups.items())}
        total = len(metrics.rows)
        return {
            "run": name,
            "rows": total,
            "series_by": split,
            "series_total": len(labels),
            "curves": out,
            "problems": [p.json() for p in metrics.problems],
        }

    def rollouts(
        self,
        name: str,
        *,
        step: int | None = None,
        series: str | None = None,
        min_reward: float | None = None,
        max_reward: float | None = None,
        offset: int = 0,
        limit: int = 20,
    ) -> dict[str, Any]:
        """A page of run ``name``'s logged episodes, newest step first, filtered by step, adapter or
        agent (``series``) and reward range; ``steps`` lists the steps that have any."""
        limit = _check_page(offset, limit)
        log = read_jsonl(self.folder(name) / "rollouts.jsonl", _rel(name, "rollouts.jsonl"))
        rows = log.rows

        def keep(r: dict[str, Any]) -> bool:
            reward = r.get("reward")
            if step is not None and r.get("step") != step:
                return False
            if series is not None and str(r.get("series", "")) != series:
                return False
            if min_reward is not None and not (_number(reward) and reward >= min_reward):
                return False
            return not (max_reward is not None and not (_number(reward) and reward <= max_reward))

        picked = [r for r in rows if keep(r)]
        picked.sort(key=lambda r: -(r.get("step") or 0))
        return {
            "run": name,
            "steps": sorted({r["step"] for r in rows if isinstance(r.get("step"), int)}),
            "series": sorted({str(r["series"]) for r in rows if r.get("series") is not None}),
            "episodes": picked[offset : offset + limit],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(picked)},
            "problems": [p.json() for p in log.problems],
        }


def agents_of(config: Any) -> list[str]:
    """The agents a multi-agent run's ``config.json`` names (none for other runs)."""
    agents = config.get("agents") if isinstance(config, dict) else None
    if not isinstance(agents, list) or not all(isinstance(a, str) and a for a in agents):
        return []
    return list(dict.fromkeys(agents))


def agent_key(agent: str, key: str) -> str:
    """Where a multi-agent run logs ``agent``'s ``key``: ``X/reward/mean``, ``eval/X/win_rate``."""
    return f"eval/{agent}/{key[5:]}" if key.startswith("eval/") else f"{agent}/{key}"


def _agent_metric(key: str, agents: list[str]) -> str:
    """``key`` without its agent (``X/reward/mean`` -> ``reward/mean``); other keys as they are."""
    for a in agents:
        if key.startswith(f"{a}/"):
            return key[len(a) + 1 :]
        if key.startswith(f"eval/{a}/"):
            return "eval/" + key[len(a) + 6 :]
    return key


def metric_keys(rows: list[dict[str, Any]], agents: list[str] | None = None) -> list[str]:
    """The numeric metric keys of ``rows`` (not ``step``), preferred ones first; a multi-agent
    run's per-agent keys as one key each (:func:`agent_key`)."""
    seen: dict[str, None] = {}
    for r in rows[:2000]:
        for k, v in r.items():
            if k != "step" and _number(v):
                seen.setdefault(_agent_metric(k, agents or []), None)
    first = [k for k in PREFERRED_KEYS if k in seen]
    return first + sorted(k for k in seen if k not in first)


def series_names(rows: list[dict[str, Any]]) -> list[str]:
    split = _default_series(rows)
    return sorted({str(r.get(split)) for r in rows if r.get(split) is not None}) if split else []


def _default_series(rows: list[dict[str, Any]]) -> str | None:
    for field_name in ("adapter", "agent", "run"):
        if any(field_name in r for r in rows[:1000]):
            return field_name
    return None


def downsample(points: list[tuple[float, float]], max_points: int) -> list[list[float]]:
    """At most ``max_points`` of ``points`` (sorted by x): all of them if few enough, else for
    each of ``max_points // 2`` equal buckets its lowest and highest point, in x order."""
    if len(points) <= max_points:
        return [[x, y] for x, y in points]
    buckets = max(1, max_points // 2)
    size = len(points) / buckets
    out: list[list[float]] = []
    for b in range(buckets):
        chunk = points[int(b * size) : int((b + 1) * size)]
        if not chunk:
            continue
        lo = min(chunk, key=lambda p: p[1])
        hi = max(chunk, key=lambda p: p[1])
        for x, y in sorted({lo, hi}):
            out.append([x, y])
    return out


def _check_page(offset: int, limit: int) -> int:
    if offset < 0:
        raise RunsError(f"offset must be >= 0, got {offset}")
    if not 1 <= limit <= MAX_PAGE:
        raise RunsError(f"limit must be in [1, {MAX_PAGE}], got {limit}")
    return limit


def _number(v: Any) -> TypeGuard[float]:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _rel(name: str, file: str) -> str:
    return file if name == "." else f"{name}/{file}"
