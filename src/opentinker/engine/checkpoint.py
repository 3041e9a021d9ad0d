"""Durable adapter checkpoints: safetensors files + a manifest of their SHA-256, written atomically.

Layout of a checkpoint folder::

    adapter.safetensors     LoRA weights   (<group>.lora_A [L, r, in], <group>.lora_B [L, out, r])
    optimizer.safetensors   AdamW moments and step (only when saved with the optimizer)
    manifest.json           format, metadata (config, step, base model, lineage) and each file's sha256

Everything is written into a hidden sibling folder and renamed into place, and the manifest is the
last file written: a crash leaves either the old checkpoint or the new one, never a mix. Reading
verifies every checksum, so a torn or tampered file is reported instead of loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from opentinker.engine.types import EngineError

FORMAT = "opentinker-adapter-v1"
MANIFEST = "manifest.json"


class CheckpointError(EngineError):
    """A checkpoint that is missing, torn, or does not fit this engine."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_checkpoint(
    path: str | Path,
    files: dict[str, dict[str, torch.Tensor]],
    meta: dict[str, Any],
    *,
    overwrite: bool = False,
) -> Path:
    """Write ``files`` (filename -> tensors) and ``meta`` as one checkpoint folder at ``path``."""
    final = Path(path)
    if final.exists() and not overwrite:
        raise CheckpointError(f"a checkpoint already exists at {final}")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        sums = {}
        for name, tensors in files.items():
            contiguous = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
            save_file(contiguous, str(tmp / name))
            _fsync(tmp / name)
            sums[name] = _sha256(tmp / name)
        manifest = {"format": FORMAT, "files": sums, "meta": meta}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
        _fsync(tmp / MANIFEST)
        if final.exists():
            trash = final.with_name(f".{final.name}.old-{os.getpid()}")
            os.replace(final, trash)
            os.replace(tmp, final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def read_manifest(path: str | Path) -> dict[str, Any]:
    folder = Path(path)
    mf = folder / MANIFEST
    if not mf.exists():
        raise CheckpointError(f"no checkpoint at {folder} (missing {MANIFEST})")
    try:
        manifest = json.loads(mf.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{mf} is not valid JSON: {e}") from e
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{folder} is not an {FORMAT} checkpoint")
    return manifest


def read_checkpoint(
    path: str | Path, *, names: tuple[str, ...] | None = None
) -> tuple[dict[str, dict[str, torch.Tensor]], dict]:
    """Verify and load a checkpoint's files (all, or only ``names``); returns (files, meta)."""
    folder = Path(path)
    manifest = read_manifest(folder)
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, digest in manifest["files"].items():
        if names is not None and name not in names:
            continue
        f = folder / name
        if not f.exists():
            raise CheckpointError(f"checkpoint {folder} is missing {name}")
        if _sha256(f) != digest:
            raise CheckpointError(f"checkpoint file {f} does not match its checksum (torn or modified)")
        out[name] = load_file(str(f))
    return out, manifest["meta"]
