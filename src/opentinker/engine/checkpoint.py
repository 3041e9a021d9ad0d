"""Durable adapter checkpoints: safetensors files + a manifest of their SHA-256, written atomically.

Layout of a checkpoint folder::

    adapter.safetensors     LoRA weights   (<group>.lora_A [L, r, in], <group>.lora_B [L, out, r])
    optimizer.safetensors   AdamW moments and step (only when saved with the optimizer)
    manifest.json           format, metadata (config, step, base model, lineage) and each file's sha256

Everything is written into a hidden sibling folder (``.<name>.tmp-<pid>-…``) and renamed into
place, and the manifest is the last file written: a crash leaves either the old checkpoint or the
new one, never a mix. Overwriting moves the old folder aside (``.<name>.old-<pid>``) for the moment
between the two renames. Reading verifies every checksum, so a torn or tampered file is reported
instead of loaded. :func:`clean_partial_writes` clears what a crashed writer left behind: it puts a
complete new (or else old) checkpoint back in place if the crash came between the two renames,
and removes the rest — never the folders of a writer that is still running.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from opentinker.engine.types import EngineError
from opentinker.lora import LoRAConfig, LoRAWeights, TargetGroup

FORMAT = "opentinker-adapter-v1"
ADAPTER_FILE = "adapter.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
MANIFEST = "manifest.json"
# a writer's hidden folders: .<name>.tmp-<pid>-<random> (new) and .<name>.old-<pid> (replaced);
# earlier versions wrote .<name>.tmp-<random>, with no pid: those writers are gone
_PARTIAL = re.compile(r"\.(?P<name>.+)\.(?P<kind>tmp|old)-(?:(?P<pid>\d+)(?=-|$))?.*", re.DOTALL)

log = logging.getLogger(__name__)


class CheckpointError(EngineError):
    """A checkpoint that is missing, torn, or does not fit this engine."""


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file's bytes (hex), read in 1 MiB blocks."""
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
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-{os.getpid()}-", dir=final.parent))
    try:
        sums = {}
        for name, tensors in files.items():
            contiguous = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
            save_file(contiguous, str(tmp / name))
            _fsync(tmp / name)
            sums[name] = file_sha256(tmp / name)
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
        if file_sha256(f) != digest:
            raise CheckpointError(f"checkpoint file {f} does not match its checksum (torn or modified)")
        out[name] = load_file(str(f))
    return out, manifest["meta"]


def read_adapter(
    path: str | Path,
    *,
    base_model: str,
    groups: dict[str, TargetGroup],
    device: torch.device,
    check_config: Callable[[LoRAConfig], None],
) -> tuple[LoRAWeights, dict[str, Any], dict[str, dict[str, torch.Tensor]]]:
    """A verified checkpoint's LoRA weights (on ``device``, trainable), its meta and its files,
    checked against an engine: trained on ``base_model``, a config ``check_config`` accepts, and
    exactly the target ``groups`` its config trains, each of its shape. Changes nothing; any mismatch is a :class:`CheckpointError` naming it."""
    files, meta = read_checkpoint(path)
    if meta.get("base_model") != base_model:
        raise CheckpointError(
            f"checkpoint {path} was trained on {meta.get('base_model')!r}, not on this engine's {base_model!r}"
        )
    config = LoRAConfig(**meta["lora"])
    check_config(config)
    try:
        loaded = LoRAWeights.from_state_dict(
            config, files[ADAPTER_FILE], groups, device=device, requires_grad=True
        )
    except ValueError as e:
        raise CheckpointError(f"checkpoint {path}: {e}") from None
    return loaded, meta, files


def clean_partial_writes(parent: str | Path) -> list[str]:
    """Clear the hidden folders that writers which are no longer running left in ``parent``.

    A checkpoint whose folder is missing is put back from a complete leftover (the new one first,
    else the old one: a crash between the two renames of an overwrite). Returns the names of the
    checkpoints put back.
    """
    folder = Path(parent)
    if not folder.is_dir():
        return []
    leftovers: dict[str, list[tuple[str, Path]]] = {}
    for entry in folder.iterdir():
        m = _PARTIAL.fullmatch(entry.name)
        if m is None or not entry.is_dir() or (m["pid"] is not None and _alive(int(m["pid"]))):
            continue
        leftovers.setdefault(m["name"], []).append((m["kind"], entry))
    restored = []
    for name, entries in leftovers.items():
        final = folder / name
        if not final.exists():
            for _, entry in sorted(entries, key=lambda e: e[0] != "tmp"):  # new before old
                if _complete(entry):
                    os.replace(entry, final)
                    restored.append(name)
                    log.warning("put checkpoint %s back from an interrupted write", name)
                    break
        for _, entry in entries:
            if entry.exists():
                shutil.rmtree(entry, ignore_errors=True)
    return restored


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except PermissionError:
        return True  # it exists, as another user's process
    except (ProcessLookupError, OverflowError):
        return False
    return True


def _complete(folder: Path) -> bool:
    """A folder holding a whole checkpoint: a manifest (written last) and every file it names."""
    try:
        manifest = read_manifest(folder)
        return all(
            (folder / n).is_file() and file_sha256(folder / n) == d for n, d in manifest["files"].items()
        )
    except (CheckpointError, OSError, KeyError, AttributeError):
        return False
