"""External weights: an adapter exported in hosted Tinker's layout, for tools other than this service.

``save_weights_external(name)`` writes ``tinker://<model_id>/external_weights/<name>``, a folder
``checkpoints/<model_id>/external_weights/<name>/`` beside the model's engine checkpoints, holding

- ``adapter_model.safetensors`` + ``adapter_config.json`` in hosted Tinker's adapter layout
  (:mod:`opentinker.engine.tinker_format`), what ``tinker_cookbook.weights.build_lora_adapter`` (to
  PEFT's format, for ``peft`` and vLLM) and ``build_hf_model`` (a merged model) read; each with an
  ``.age`` suffix instead when the save named
  ``age_encryption_recipients`` (encrypted to all of them with ``pyrage``, as the SDK documents);
- ``.external.json``: who owns it (tenant), its base model and LoRA config, which files it has
  (name, bytes, sha256). Hidden: it is not one of the checkpoint's downloadable files.

A folder is written under a hidden temporary name and renamed into place, so a crash never leaves
a half-written export that is listed; :meth:`ExternalStore.clean_partial_writes` clears what such
a crash left.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opentinker.engine import EngineError
from opentinker.engine.checkpoint import file_sha256
from opentinker.service.checkpoints import check_id, check_name

KIND = "external_weights"
META_FILE = ".external.json"
AGE_SUFFIX = ".age"
MAX_RECIPIENTS = 10  # the SDK's documented limit


@dataclass(frozen=True)
class ExternalRecord:
    model_id: str
    name: str
    folder: Path
    meta: dict[str, Any]

    @property
    def tinker_path(self) -> str:
        return external_path(self.model_id, self.name)

    @property
    def tenant(self) -> str:
        return str(self.meta.get("tenant", "local"))

    @property
    def files(self) -> dict[str, dict[str, Any]]:
        """File name (relative to the export's root) -> {"size": bytes, "sha256": hex}."""
        return dict(self.meta.get("files", {}))

    @property
    def created(self) -> float:
        return float(self.meta.get("created", 0.0))

    @property
    def size_bytes(self) -> int:
        return sum(int(f["size"]) for f in self.files.values())


def external_path(model_id: str, name: str) -> str:
    return f"tinker://{model_id}/{KIND}/{name}"


def parse_recipients(recipients: list[str] | None) -> list[Any]:
    """age recipients (``age1…`` keys or SSH public keys) as ``pyrage`` objects; a user error
    naming the bad one otherwise."""
    if not recipients:
        return []
    if len(recipients) > MAX_RECIPIENTS:
        raise EngineError(f"at most {MAX_RECIPIENTS} age_encryption_recipients, got {len(recipients)}")
    pyrage = _pyrage()
    out = []
    for i, text in enumerate(recipients):
        if not isinstance(text, str) or not text.strip():
            raise EngineError(f"age_encryption_recipients[{i}] is empty")
        kind = pyrage.ssh if text.startswith(("ssh-", "ecdsa-", "sk-")) else pyrage.x25519
        try:
            out.append(kind.Recipient.from_str(text.strip()))
        except Exception as e:
            shown = text if len(text) <= 40 else text[:40] + "…"
            raise EngineError(
                f"age_encryption_recipients[{i}] {shown!r} is not an age (age1…) or SSH public key: {e}"
            ) from None
    return out


def _pyrage() -> Any:
    """The ``pyrage`` module (untyped: an extension module without stubs)."""
    try:
        return importlib.import_module("pyrage")
    except ImportError:  # pragma: no cover - pyrage is installed with the dev extra
        raise EngineError(
            "age encryption is not available on this server (pyrage is not installed)"
        ) from None


class ExternalStore:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root) / "checkpoints"
        self.root.mkdir(parents=True, exist_ok=True)

    def folder(self, model_id: str, name: str) -> Path:
        return self.root / check_id(model_id, "model id") / KIND / check_name(name)

    def exists(self, model_id: str, name: str) -> bool:
        return (self.folder(model_id, name) / META_FILE).exists()

    def write(
        self,
        model_id: str,
        name: str,
        export: Callable[[Path], object],
        meta: dict[str, Any],
        recipients: list[Any] | None = None,
    ) -> ExternalRecord:
        """Run ``export(folder)`` into a fresh hidden folder, encrypt its files to ``recipients``
        (if any), record them, and move it into place. Refused if the name is taken."""
        final = self.folder(model_id, name)
        if final.exists():
            raise EngineError(
                f"external weights {external_path(model_id, name)} already exist; pick another name"
            )
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".{name}.tmp-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            export(tmp)
            if recipients:
                pyrage = _pyrage()
                for f in sorted(p for p in tmp.iterdir() if p.is_file()):
                    pyrage.encrypt_file(str(f), str(f) + AGE_SUFFIX, recipients)
                    f.unlink()
            files = {
                f.name: {"size": f.stat().st_size, "sha256": file_sha256(f)}
                for f in sorted(tmp.iterdir())
                if f.is_file() and not f.name.startswith(".")
            }
            record = {**meta, "created": time.time(), "encrypted": bool(recipients), "files": files}
            (tmp / META_FILE).write_text(json.dumps(record, indent=2))
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return ExternalRecord(model_id, name, final, record)

    def record(self, model_id: str, name: str) -> ExternalRecord | None:
        folder = self.folder(model_id, name)
        try:
            meta = json.loads((folder / META_FILE).read_text())
        except (OSError, ValueError):
            return None
        return ExternalRecord(model_id, name, folder, meta)

    def list(self) -> list[ExternalRecord]:
        out = []
        for mdir in sorted(p for p in self.root.iterdir() if p.is_dir()):
            kdir = mdir / KIND
            if not kdir.is_dir():
                continue
            for cdir in sorted(kdir.iterdir()):
                if cdir.name.startswith("."):
                    continue
                try:
                    rec = self.record(mdir.name, cdir.name)
                except EngineError:  # a folder no valid name leads to
                    continue
                if rec is not None:
                    out.append(rec)
        return out

    def delete(self, model_id: str, name: str) -> None:
        folder = self.folder(model_id, name)
        if folder.exists():
            shutil.rmtree(folder)

    def clean_partial_writes(self) -> int:
        """Remove the hidden folders of exports a crash interrupted; returns how many."""
        n = 0
        for mdir in self.root.iterdir():
            kdir = mdir / KIND
            if not kdir.is_dir():
                continue
            for tmp in kdir.glob(".*.tmp-*"):
                shutil.rmtree(tmp, ignore_errors=True)
                n += 1
        return n
