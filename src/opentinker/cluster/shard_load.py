"""A sharded group's member loads only its own shard of the base weights.

A member builds its base on the meta device (``load_base_model(..., device="meta")``: parameter
shapes and dtypes without storage; buffers such as the rotary frequencies computed on the host;
tied weights tied), wraps it with the LoRA layers, and lets
:func:`~opentinker.cluster.shard.shard_model` shard it (FSDP2 on meta parameters allocates
nothing). :func:`materialise` then gives every parameter storage for its local shard only
(``to_empty`` on the mesh's device) and fills it from the model folder's safetensors files with
sliced reads (``safe_open(...).get_slice``): the rows of the shard, nothing else. So no process
of the group ever holds the whole base; the peak is one member's shard plus one weight's slice.

Names: the weights are named as the checkpoint names them, recorded by :func:`checkpoint_names`
before the LoRA layers wrap the projections (a wrapped ``Linear`` keeps its own module, one level
down, so each entry is the module and its attribute, not a dotted path). A tied weight (the
unembedding sharing the embedding's matrix) is one parameter under two names: it is read once,
under the name the files hold. Buffers are not sharded: every member keeps its own whole copy
(they are computed, not read). A weight the files lack, or of another shape, refuses the group's
start naming it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from opentinker.engine import EngineError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


@dataclass(frozen=True)
class WeightName:
    """One parameter of the base as the checkpoint names it: ``module``'s attribute ``attr``."""

    module: torch.nn.Module
    attr: str
    name: str


def checkpoint_names(model: torch.nn.Module) -> list[WeightName]:
    """Every parameter of ``model`` under every name it has (a tied one under each), recorded
    before any module is wrapped."""
    return [
        WeightName(module, attr, f"{prefix}.{attr}" if prefix else attr)
        for prefix, module in model.named_modules(remove_duplicate=False)
        for attr, p in module._parameters.items()
        if p is not None
    ]


def weight_files(folder: str | Path) -> dict[str, Path]:
    """Which safetensors file of ``folder`` holds each weight (its index, or its one file)."""
    folder = Path(folder)
    index = folder / INDEX_FILE
    if index.is_file():
        mapping = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return {name: folder / file for name, file in mapping.items()}
    single = folder / SINGLE_FILE
    if not single.is_file():
        raise EngineError(f"the model folder {folder.name!r} has no safetensors weights to shard")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def materialise(model: torch.nn.Module, names: list[WeightName], folder: str | Path, device: str) -> int:
    """Give ``model`` (sharded on the meta device) storage on ``device`` for this member's
    shards and fill them from ``folder``'s weights; the buffers keep their computed values, a
    tied weight stays one parameter. Returns the bytes read."""
    files = weight_files(folder)
    tied: dict[int, list[WeightName]] = {}  # one parameter -> its names (two for a tied one)
    for w in names:
        tied.setdefault(id(w.module._parameters[w.attr]), []).append(w)
    buffers = [
        (m, n, b) for m in model.modules() for n, b in m._buffers.items() if b is not None and not b.is_meta
    ]
    model.to_empty(device=device)  # each module's parameters anew: a tied one becomes two
    for m, n, b in buffers:
        m._buffers[n] = b.to(device)
    read = 0
    for aliases in tied.values():
        first = aliases[0]
        param = first.module._parameters[first.attr]
        assert param is not None
        for w in aliases[1:]:
            w.module._parameters[w.attr] = param
        name = next((w.name for w in aliases if w.name in files), None)
        if name is None:
            raise EngineError(f"the base model's weights have no {first.name!r} to shard")
        read += _fill(param, name, files[name])
    return read


def _fill(param: torch.Tensor, name: str, file: Path) -> int:
    """Copy this member's rows of weight ``name`` (in safetensors ``file``) into ``param`` (a
    sharded parameter, or a whole one); returns the bytes read. The file is opened for this
    weight alone: its pages read stay mapped (and resident) only while it is copied."""
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        return _copy_rows(param, name, f.get_slice(name))


def _copy_rows(param: torch.Tensor, name: str, source: Any) -> int:
    from torch.distributed.tensor import DTensor, Shard

    full = tuple(source.get_shape())
    if tuple(param.shape) != full:
        raise EngineError(
            f"the base model's weight {name!r} is {list(full)} in its files, not {list(param.shape)}"
        )
    local = param.to_local() if isinstance(param, DTensor) else param
    start = 0
    if isinstance(param, DTensor):
        if tuple(param.placements) != (Shard(0),):
            raise EngineError(f"weight {name!r} is placed {param.placements}, not split along its rows")
        mesh = param.device_mesh
        chunk = -(-full[0] // mesh.size()) if full else 0
        start = min(mesh.get_local_rank() * chunk, full[0]) if full else 0
    rows = local.shape[0] if local.dim() else 0
    data = source[start : start + rows] if local.dim() else source[:]
    with torch.no_grad():
        local.copy_(data.to(dtype=local.dtype))
    return data.numel() * data.element_size()
