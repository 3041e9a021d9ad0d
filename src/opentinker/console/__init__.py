"""The console: one web page of sessions, runs, adapters, checkpoints, live engine metrics and
rollouts, for a server (``opentinker serve``, at ``/``) or for local run folders
(``opentinker console --runs DIR``).

This package holds what the page is made of and the readers of its data, with no web framework:
:data:`STATIC_DIR` (plain HTML, CSS and JavaScript with no build step, and uPlot vendored under
``static/vendor/uplot`` at a pinned version with its licence) and :mod:`opentinker.console.runs`
(local run folders: curves downsampled, lists paginated, malformed lines named by file and line).
The server layer serves both (``opentinker.server.console_api``).
"""

from pathlib import Path

from opentinker.console.runs import RunsDir, RunsError, downsample

STATIC_DIR = Path(__file__).resolve().parent / "static"

__all__ = ["STATIC_DIR", "RunsDir", "RunsError", "downsample"]
