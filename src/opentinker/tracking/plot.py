"""A PNG of a run's curves (reward, accuracy, loss, …) from its ``metrics.jsonl``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from opentinker.tracking.logger import read_metrics


def plot_metrics(
    runs: dict[str, str | Path | list[dict[str, Any]]],
    keys: list[str],
    out: str | Path,
    *,
    title: str = "",
    guides: dict[str, dict[str, float]] | None = None,
    log_y: tuple[str, ...] = (),
    labels: dict[str, str] | None = None,
    smooth: int = 1,
) -> Path:
    """One panel per metric key, one line per run; x is the step. Returns the PNG's path.

    ``guides[key][run]`` draws a dashed horizontal line in that run's colour on ``key``'s panel
    (a run's target, say); keys in ``log_y`` get a log y axis; ``labels[key]`` titles a panel.
    ``smooth`` > 1 draws each step as a faint dot and the line as the mean of the last ``smooth``
    steps (a few samples per step are noisy; the trend is what the eye should follow)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator, NullFormatter

    data = {name: (rows if isinstance(rows, list) else read_metrics(rows)) for name, rows in runs.items()}
    keys = [k for k in keys if any(k in r for rows in data.values() for r in rows)] or keys[:1]
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.2), squeeze=False)
    for ax, key in zip(axes[0], keys, strict=True):
        for name, rows in data.items():
            pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), int | float)]
            if pts:
                xs, ys = zip(*pts, strict=True)
                if smooth > 1:
                    trend = [
                        sum(ys[max(0, i - smooth + 1) : i + 1]) / len(ys[max(0, i - smooth + 1) : i + 1])
                        for i in range(len(ys))
                    ]
                    (line,) = ax.plot(xs, trend, label=name, linewidth=2)
                    ax.plot(xs, ys, ".", color=line.get_color(), alpha=0.35)
                else:
                    (line,) = ax.plot(xs, ys, marker="." if len(pts) < 40 else None, label=name)
                guide = (guides or {}).get(key, {}).get(name)
                if guide is not None:
                    ax.axhline(guide, color=line.get_color(), linestyle="--", linewidth=1, alpha=0.8)
        if key in log_y:
            ax.set_yscale("log")
            marks = sorted(set((guides or {}).get(key, {}).values()))
            if marks:  # label the guides themselves (the targets), as plain numbers
                ax.set_yticks(marks, [f"{m:g}" for m in marks])
                ax.yaxis.set_minor_formatter(NullFormatter())
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title((labels or {}).get(key, key))
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if len(data) > 1:
        axes[0][-1].legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
