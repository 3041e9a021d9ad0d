"""The checkpoint registry: ``tinker://<model_id>/(weights|sampler_weights)/<name>`` ↔ folders on disk.

Layout under the data dir: ``checkpoints/<model_id>/<kind>/<name>/`` holding an engine checkpoint
(safetensors + checksummed manifest, see :mod:`opentinker.engine.checkpoint`); opening the store
clears the hidden folders of writes that a crash interrupted. ``weights`` hold
weights and optimizer state (``save_state``); ``sampler_weights`` hold weights only
(``save_weights_for_sampler``). The manifest's metadata carries the lineage: the parent checkpoint,
the step, and the policy versions whose samples the model trained on since its last save.

Names and model ids become folder names, so every one that comes from a caller goes through
:func:`check_id` first: the *whole* string must match (``re.fullmatch``: ``^…$`` would let a
trailing newline through), at most :data:`MAX_ID_CHARS` long (well under the 255-byte file-name
limit, with room for the ``.<name>.tmp-…`` folder a write goes through), no control characters,
no ``..``. A refused id is a user error (:class:`EngineError`) that names what is wrong.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from opentinker.engine import EngineError
from opentinker.engine.checkpoint import MANIFEST, CheckpointError, clean_partial_writes, read_manifest

Kind = Literal["weights", "sampler_weights"]
KINDS: tuple[Kind, ...] = ("weights", "sampler_weights")
MAX_ID_CHARS = 128
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9:_.\-]*")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_PATH = re.compile(r"tinker://(?P<model>[^/]*)/(?P<kind>[^/]*)/(?P<name>.*)", re.DOTALL)


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


MIN_TTL_S = 3600  # 1 hour, the SDK's documented lower bound of a checkpoint's TTL
MAX_TTL_S = 315_576_000  # 10 years of 365.25 days, the documented upper bound


def check_id(value: object, what: str = "checkpoint name") -> str:
    """``value`` if it is a valid checkpoint name or model id, else an :class:`EngineError`."""
    if not isinstance(value, str):
        raise EngineError(f"{what} must be a string, got {type(value).__name__}")
    shown = repr(value if len(value) <= 80 else value[:80] + "…")
    if not value:
        raise EngineError(f"{what} is empty")
    if len(value) > MAX_ID_CHARS:
        raise EngineError(f"{what} {shown} is {len(value)} characters long; the limit is {MAX_ID_CHARS}")
    if _CONTROL.search(value):
        raise EngineError(f"{what} {shown} contains a control character (newline, tab, …)")
    if _ID.fullmatch(value) is None or ".." in value:
        raise EngineError(
            f"invalid {what} {shown}: use letters, digits, '.', '_', '-', ':' "
            "(starting with a letter or digit, no '..')"
        )
    return value


CHECKPOINT_TYPES = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}


def checkpoint_view(
    kind: str,
    name: str,
    created: float,
    tinker_path: str,
    size_bytes: int | None,
    *,
    public: bool = False,
    expires_at: float | None = None,
    user_metadata: dict[str, str] | None = None,
    base_model: str | None = None,
) -> dict[str, Any]:
    """A checkpoint as the SDK's ``Checkpoint`` reads it (JSON), embedded and over HTTP alike;
    ``user_metadata`` is what its save attached, ``base_model`` SDK 0.39's ``Checkpoint.base_model``."""
    return {
        "checkpoint_id": f"{kind}/{name}",
        "checkpoint_type": CHECKPOINT_TYPES.get(kind, "sampler"),
        "time": _iso(created),
        "tinker_path": tinker_path,
        "size_bytes": size_bytes,
        "public": public,
        "expires_at": None if expires_at is None else _iso(expires_at),
        "user_metadata": user_metadata,
        "base_model": base_model,
    }


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat()


class InvalidTTL(EngineError):
    """A checkpoint TTL outside the documented range (or not a whole number of seconds)."""


def check_ttl(ttl_seconds: object) -> int | None:
    """``ttl_seconds`` if it is None or an integer in [:data:`MIN_TTL_S`, :data:`MAX_TTL_S`],
    else :class:`InvalidTTL` naming the range."""
    if ttl_seconds is None:
        return None
    if isinstance(ttl_seconds, bool) or not isinstance(ttl_seconds, int):
        raise InvalidTTL(f"ttl_seconds must be an integer number of seconds, got {ttl_seconds!r}")
    if not MIN_TTL_S <= ttl_seconds <= MAX_TTL_S:
        raise InvalidTTL(
            f"ttl_seconds must be between {MIN_TTL_S} (1 hour) and {MAX_TTL_S} (10 years), got {ttl_seconds}"
        )
    return ttl_seconds


def check_name(name: str) -> str:
    return check_id(name, "checkpoint name")


def checkpoint_ref(model_id: str, kind: str, name: str) -> CheckpointRef:
    """A reference built from caller-given parts, each checked by :func:`check_id`."""
    if kind not in KINDS:
        raise EngineError(f"unknown checkpoint kind {kind!r} (weights or sampler_weights)")
    return CheckpointRef(check_id(model_id, "model id"), kind, check_name(name))  # type: ignore[arg-type]


def parse_tinker_path(path: str) -> CheckpointRef:
    """``tinker://<model_id>/(weights|sampler_weights)/<name>``, every part checked."""
    m = _PATH.fullmatch(path) if isinstance(path, str) else None
    shown = repr(path if not isinstance(path, str) or len(path) <= 200 else path[:200] + "…")
    if m is None:
        raise EngineError(
            f"malformed checkpoint path {shown}: expected tinker://<model_id>/weights/<name> "
            "or tinker://<model_id>/sampler_weights/<name>"
        )
    try:
        return checkpoint_ref(m["model"], m["kind"], m["name"])
    except EngineError as e:
        raise EngineError(f"malformed checkpoint path {shown}: {e}") from None


class CheckpointStore:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root) / "checkpoints"
        self.root.mkdir(parents=True, exist_ok=True)
        self.clean_partial_writes()

    def clean_partial_writes(self) -> list[str]:
        """Clear what writers that crashed left behind (their ``.<name>.tmp-*`` folders), putting
        back a checkpoint a crash took out mid-overwrite; returns the tinker paths put back.
        Folders of writers still running (another process on this data dir) are left alone."""
        restored = []
        for mdir in self.root.iterdir():
            for kind in KINDS:
                for name in clean_partial_writes(mdir / kind):
                    restored.append(f"tinker://{mdir.name}/{kind}/{name}")
        return restored

    def folder(self, ref: CheckpointRef) -> Path:
        """Where ``ref`` lives; refused (:class:`EngineError`) unless each part is a valid id, so
        no reference can point outside the store or at a name the filesystem cannot hold."""
        return self.root / check_id(ref.model_id, "model id") / ref.kind / check_name(ref.name)

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
        if model_id is not None:
            check_id(model_id, "model id")
        models = [self.root / model_id] if model_id else sorted(p for p in self.root.iterdir() if p.is_dir())
        for mdir in models:
            for kind in KINDS:
                kdir = mdir / kind
                if not kdir.is_dir():
                    continue
                for cdir in sorted(kdir.iterdir()):
                    if cdir.name.startswith(".") or not (cdir / "manifest.json").exists():
                        continue
                    try:
                        out.append(self.record(CheckpointRef(mdir.name, kind, cdir.name)))  # type: ignore[arg-type]
                    except EngineError:
                        # torn (loading it names the problem), or a folder no valid name leads to
                        continue
        return sorted(out, key=lambda r: r.time)

    def model_ids(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if p.is_dir())

    def link(self, src: CheckpointRef, dst: CheckpointRef, meta: dict[str, Any]) -> None:
        """Make ``dst`` a checkpoint sharing ``src``'s tensor files (hard links: no bytes copied,
        and deleting either leaves the other whole), with its own manifest carrying ``meta``.
        It appears whole or not at all: written aside, then renamed into place."""
        source, final = self.folder(src), self.folder(dst)
        manifest = read_manifest(source)
        if final.exists():
            raise CheckpointError(f"checkpoint {dst.tinker_path} already exists")
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-{os.getpid()}-", dir=final.parent))
        try:
            for name in manifest["files"]:
                try:
                    os.link(source / name, tmp / name)
                except OSError:  # a filesystem without hard links: a plain copy still works
                    shutil.copy2(source / name, tmp / name)
            manifest["meta"] = meta
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
            os.replace(tmp, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)

    def delete(self, ref: CheckpointRef) -> None:
        folder = self.folder(ref)
        if not folder.exists():
            raise CheckpointError(f"no checkpoint at {ref.tinker_path}")
        shutil.rmtree(folder)
