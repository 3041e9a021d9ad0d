"""The checkpoint registry: ``tinker://<model_id>/(weights|sampler_weights)/<name>`` ↔ folders on disk.

Layout under the data dir: ``checkpoints/<model_id>/<kind>/<name>/`` holding an engine checkpoint
(safetensors + checksummed manifest, see :mod:`opentinker.engine.checkpoint`). ``weights`` hold
weights and optimizer state (``save_state``); ``sampler_weights`` hold weights only
(``save_weights_for_sampler``). The manifest's metadata carries the lineage: the parent checkpoint,
the step, and the policy versions whose samples the model trained on since its last save.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from opentinker.engine import EngineError
from opentinker.engine.checkpoint import CheckpointError, read_manifest

Kind = Literal["weights", "sampler_weights"]
_ID = r"[A-Za-z0-9][A-Za-z0-9:_.\-]*"
_PATH = re.compile(rf"^tinker://(?P<model>{_ID})/(?P<kind>weights|sampler_weights)/(?P<name>{_ID})$")
_NAME = re.compile(rf"^{_ID}$")


@dataclass(frozen=True)
class CheckpointRef:
    model_id: str
    kind: Kind
    name: str

    @property
    def tinker_path(self) -> str:
        return f"tinker://{self.model_id}/{self.kind}/{self.name}"


@dataclass(frozen=True)
class CheckpointRecord:
    ref: CheckpointRef
    folder: Path
    time: datetime
    size_bytes: int
    meta: dict[str, Any]


def parse_tinker_path(path: str) -> CheckpointRef:
    m = _PATH.match(path) if isinstance(path, str) else None
    if m is None or ".." in path:
        raise EngineError(
            f"malformed checkpoint path {path!r}: expected tinker://<model_id>/weights/<name> "
            "or tinker://<model_id>/sampler_weights/<name>"
        )
    return CheckpointRef(m["model"], m["kind"], m["name"])  # type: ignore[arg-type]


def check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name) or ".." in name:
        raise EngineError(f"invalid checkpoint name {name!r}: use letters, digits, '.', '_', '-', ':'")
    return name


class CheckpointStore:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root) / "checkpoints"
        self.root.mkdir(parents=True, exist_ok=True)

    def folder(self, ref: CheckpointRef) -> Path:
        return self.root / ref.model_id / ref.kind / ref.name

    def exists(self, ref: CheckpointRef) -> bool:
        return (self.folder(ref) / "manifest.json").exists()

    def record(self, ref: CheckpointRef) -> CheckpointRecord:
        folder = self.folder(ref)
        if not folder.exists():
            raise CheckpointError(f"no checkpoint at {ref.tinker_path}")
        manifest = read_manifest(folder)
        mf = folder / "manifest.json"
        size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
        return CheckpointRecord(
            ref, folder, datetime.fromtimestamp(mf.stat().st_mtime, UTC), size, manifest["meta"]
        )

    def list(self, model_id: str | None = None) -> list[CheckpointRecord]:
        out = []
        models = [self.root / model_id] if model_id else sorted(p for p in self.root.iterdir() if p.is_dir())
        for mdir in models:
            for kind in ("weights", "sampler_weights"):
                kdir = mdir / kind
                if not kdir.is_dir():
                    continue
                for cdir in sorted(kdir.iterdir()):
                    if cdir.name.startswith(".") or not (cdir / "manifest.json").exists():
                        continue
                    try:
                        out.append(self.record(CheckpointRef(mdir.name, kind, cdir.name)))  # type: ignore[arg-type]
                    except CheckpointError:
                        continue  # a torn checkpoint is not listed; loading it names the problem
        return sorted(out, key=lambda r: r.time)

    def model_ids(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if p.is_dir())

    def delete(self, ref: CheckpointRef) -> None:
        folder = self.folder(ref)
        if not folder.exists():
            raise CheckpointError(f"no checkpoint at {ref.tinker_path}")
        shutil.rmtree(folder)
