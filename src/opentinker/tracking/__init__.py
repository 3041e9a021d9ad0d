"""Run logging: ``config.json``, ``metrics.jsonl``, a progress bar with the key numbers, a PNG plot."""

from opentinker.tracking.logger import RunLogger, read_metrics
from opentinker.tracking.plot import plot_metrics

__all__ = ["RunLogger", "plot_metrics", "read_metrics"]
