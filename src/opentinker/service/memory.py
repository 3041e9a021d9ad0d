"""The memory budget of models' state: parsing ``--memory-budget``, and its default.

The budget bounds the bytes of models' and snapshots' state held in memory (``engine/paging.py``);
the rest is paged out to page files under the data dir. Its default is a share of the memory this
process may use: the smallest of the machine's RAM and the memory limits of the cgroups it runs in
(v2 ``memory.max``, v1 ``memory.limit_in_bytes``, up to the root), so that a server in a container
or a memory cgroup holds any number of models without being OOM-killed. The rest of that memory is
left to the base models, activations, KV and prefix caches and the Python heap.
"""

from __future__ import annotations

import argparse
import logging
import re
from pathlib import Path

from opentinker.engine.paging import MemoryBudget, clear_stale_pages

log = logging.getLogger(__name__)

DEFAULT_SHARE = 0.4  # of the memory the process may use: the rest is the base's and the caches'
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30,
          "t": 1 << 40, "tib": 1 << 40, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}  # fmt: skip


def memory_budget_arg(text: str) -> int | str:
    """``--memory-budget``'s value: a size (``64MiB``, ``2GiB``, ``1.5G``, bytes), ``auto`` or ``off``."""
    word = text.strip().lower()
    if word in ("auto", "off"):
        return word
    m = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)\s*([a-z]*)", word)
    if m is None or m.group(2) not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"a memory budget is a size such as 64MiB or 2GiB, 'auto' or 'off'; got {text!r}"
        )
    value = int(float(m.group(1)) * _UNITS[m.group(2)])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"a memory budget must be positive, got {text!r}")
    return value


def process_memory_limit(cgroup_root: str | Path = "/sys/fs/cgroup", proc: str | Path = "/proc") -> int:
    """The bytes this process may use: RAM, or less where one of its cgroups is limited."""
    limits = [_mem_total(Path(proc))]
    root = Path(cgroup_root)
    try:
        lines = (Path(proc) / "self" / "cgroup").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one hierarchy
            files = [(root, "memory.max")]
        elif "memory" in controllers.split(","):
            files = [(root / "memory", "memory.limit_in_bytes")]
        else:
            continue
        for base, name in files:
            here = base / path.lstrip("/")
            while True:  # every ancestor's limit applies
                limits.append(_read_limit(here / name))
                if here == base or base not in here.parents:
                    break
                here = here.parent
    return min(x for x in limits if x is not None)


def _mem_total(proc: Path) -> int | None:
    try:
        for line in (proc / "meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _read_limit(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text or text == "max":
        return None
    value = int(text)
    return None if value >= 1 << 60 else value  # v1's "no limit" is a huge number


def resolve_memory_budget(setting: int | str) -> int | None:
    """The budget in bytes a setting means (None: ``off``, no limit)."""
    if setting == "off":
        return None
    if setting == "auto":
        return int(DEFAULT_SHARE * process_memory_limit())
    if isinstance(setting, int) and setting > 0:
        return setting
    raise ValueError(f"memory_budget must be a positive number of bytes, 'auto' or 'off'; got {setting!r}")


def memory_budget(setting: int | str, pages: Path) -> MemoryBudget:
    """A runtime's budget for ``setting``, logged; the page files of processes gone are removed."""
    budget = MemoryBudget(resolve_memory_budget(setting))
    if budget.limit is None:
        log.info("memory budget for models' state: off (every model stays in memory)")
    else:
        log.info(
            "memory budget for models' state: %.0f MiB (%s); the rest pages to %s",
            budget.limit / 2**20, setting, pages,
        )  # fmt: skip
    if (stale := clear_stale_pages(pages)) > 0:
        log.info("removed the page files of %d process(es) that are gone", stale)
    return budget


VLLM_SHARE = 0.25  # of the budget, for vLLM's host copies of adapters (its max_cpu_loras)


def vllm_cpu_loras(budget: int | None, lora_bytes: int, max_loras: int) -> int | None:
    """How many adapters vLLM keeps on the host (``max_cpu_loras``) under a memory budget: a
    quarter of it over one adapter's bytes at vLLM's ``max_lora_rank``, never fewer than
    ``max_loras`` (those on the device); None without a budget (vLLM's default)."""
    if budget is None:
        return None
    return max(max_loras, int(VLLM_SHARE * budget) // max(1, lora_bytes))
