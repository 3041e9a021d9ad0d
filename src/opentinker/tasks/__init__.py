"""Validation tasks (docs/DESIGN.md, "Validation tasks"): environments and datasets, looked up by name."""

from opentinker.tasks.registry import TASKS, TaskSpec, get_task

__all__ = ["TASKS", "TaskSpec", "get_task"]
