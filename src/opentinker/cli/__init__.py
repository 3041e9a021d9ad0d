"""Command line: ``opentinker prepare`` (offline model set-up) and ``opentinker demo`` (the main job)."""

from opentinker.cli.main import main

__all__ = ["main"]
