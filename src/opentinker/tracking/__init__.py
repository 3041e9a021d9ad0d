"""Run logging: ``config.json``, ``metrics.jsonl`` (and TensorBoard / W&B sinks), a sample of
each step's episodes in ``rollouts.jsonl``, a progress bar with the key numbers, a PNG plot."""

from opentinker.tracking.logger import RunLogger, read_metrics
from opentinker.tracking.plot import plot_metrics
from opentinker.tracking.rollouts import RolloutLog
from opentinker.tracking.sinks import set_default_sinks

__all__ = ["RolloutLog", "RunLogger", "plot_metrics", "read_metrics", "set_default_sinks"]
