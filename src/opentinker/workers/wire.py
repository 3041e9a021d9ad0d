"""The messages between a rollout worker and its pool, and a snapshot's tensors as bytes.

The sampling loop's messages (:mod:`opentinker.sampling.loop`: ``Sample``, ``Publish``,
``Retire``, ``Abort``, ``Done``; ``Tokens`` from :mod:`opentinker.sampling.types`), defined there
once, plus the few only a worker needs.
Inbound (pool → worker): :class:`Publish` ``[LoRABytes]`` (a policy version's LoRA tensors as
safetensors bytes, sent once per worker per version), :class:`Retire`, :class:`Sample`,
:class:`Cancel`, :class:`Abort` (its caller is gone: its rows leave the running batch),
:class:`Stop`. Outbound (worker → pool): :class:`Ready` / :class:`Failed` (the start-up
handshake), :class:`Published` (a snapshot arrived whole and is sampleable), :class:`Tokens` (a
streamed request's tokens as they decode), :class:`Rows` (the running batch changed),
:class:`Done` (a request's result or error). Every message is a plain picklable value (no tensors, no shared objects), so
any transport that moves bytes can carry them: a pipe to a process, an actor call.

A worker names a snapshot by its *wire id* ``<policy>#<n>``, where ``n`` numbers the weights in
the pool: a snapshot id released and reused for other weights gets a new wire id, so a worker
never samples stale weights under a reused name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from opentinker.lora import LoRAConfig, LoRAWeights
from opentinker.sampling.loop import Abort, Done, Publish, Retire, Sample
from opentinker.sampling.types import Tokens

__all__ = [
    "Abort",
    "Cancel",
    "Done",
    "Failed",
    "LoRABytes",
    "Publish",
    "Published",
    "Ready",
    "Retire",
    "Rows",
    "Sample",
    "Stop",
    "Tokens",
    "from_bytes",
    "to_bytes",
]


class LoRABytes(NamedTuple):
    """What a worker's :class:`Publish` carries: a snapshot's LoRA config (a plain dict) and its
    tensors as safetensors bytes (:func:`to_bytes`), or where the transport put those bytes (a Ray
    ``ObjectRef``). A worker's ``Sample`` names its policy by wire id."""

    config: dict
    data: Any


@dataclass(frozen=True)
class WorkerOptions:
    """What each worker of a pool is started with (the same for every worker; it travels to a
    process or an actor as is). ``dtype`` is the trainer's: its snapshots' logprobs must mean the
    same there. ``threads``: torch's intra-op threads in the worker (None: torch's default)."""

    base_model: str
    backend: str = "native"
    device: str = "cpu"
    dtype: str = "float32"
    max_rank: int = 128
    prefix_cache_bytes: int = 512 << 20
    max_rows: int = 256
    threads: int | None = None


@dataclass(frozen=True)
class Cancel:
    """Drop request ``rid`` if it has not been admitted (answered by a :class:`Done` with
    :class:`~opentinker.sampling.loop.SampleCancelled`); an admitted one runs on."""

    rid: int


@dataclass(frozen=True)
class Stop:
    """Finish: the worker exits (requests still running are not answered)."""


@dataclass(frozen=True)
class Ready:
    """The worker loaded its base model and serves; ``load_s``: seconds that load took."""

    worker: int
    pid: int
    load_s: float


@dataclass(frozen=True)
class Failed:
    """The worker could not start: ``reason`` says why."""

    worker: int
    reason: str


@dataclass(frozen=True)
class Published:
    """``policy_id`` arrived whole and is sampleable on this worker."""

    policy_id: str


@dataclass(frozen=True)
class Rows:
    """The worker's running batch now: rows decoding, requests waiting for room, decode steps run
    and requests aborted so far (sent when the rows, the waiting or the aborted change)."""

    live_rows: int
    waiting: int
    steps: int
    aborted: int


Inbound = Publish[LoRABytes] | Retire | Sample | Cancel | Abort | Stop
Outbound = Ready | Failed | Published | Tokens | Rows | Done


def to_bytes(weights: LoRAWeights) -> LoRABytes:
    """A snapshot's LoRA config (a plain dict) and its tensors as safetensors bytes."""
    tensors = {k: t.detach().cpu().contiguous() for k, t in weights.state_dict().items()}
    return LoRABytes(dataclasses.asdict(weights.config), st_save(tensors))


def from_bytes(config: dict, data: bytes, device: torch.device | str = "cpu") -> LoRAWeights:
    """The inverse of :func:`to_bytes` (tensors on ``device``, not requiring grad)."""
    return LoRAWeights.from_state_dict(LoRAConfig(**config), st_load(data), device=device)
