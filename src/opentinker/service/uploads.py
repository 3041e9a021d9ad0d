"""External weights uploaded by a tenant (SDK 0.39's ``external_weights_upload_start`` / ``_finish``).

An upload is started for a base model and a LoRA config; its files (``adapter_model.safetensors``
and ``adapter_config.json``, hosted Tinker's adapter layout, :mod:`opentinker.engine.tinker_format`)
are PUT into ``<data-dir>/uploads/<upload id>/``, and finishing it checks them against the layout
this server itself would write for that base and config (:func:`expected_layout`): every tensor
must be one of its keys, with its shape, floating point and finite, and every key must be there;
``adapter_config.json`` must give the config's ``r`` (and ``lora_alpha``, if it names one). A
refusal names the tensor or field, and the upload is discarded: nothing is stored. What passes
becomes external weights like ``save_weights_external``'s (the server indexes them).

Uploads live in this process (an hour by default, :data:`UPLOAD_TTL_S`); a restart discards what
was not finished (:meth:`UploadStore.clear`).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import safe_open

from opentinker.engine import EngineError
from opentinker.engine.tinker_format import CONFIG_FILE, WEIGHTS_FILE, tinker_tensors
from opentinker.lora import LoRAConfig, init_lora_weights

if TYPE_CHECKING:
    from opentinker.service.runtime import Runtime

UPLOAD_FILES = (WEIGHTS_FILE, CONFIG_FILE)
UPLOAD_TTL_S = 3600  # the signed PUT URLs' life, as the download URLs'
FLOAT_DTYPES = frozenset({"F32", "F16", "BF16", "F64"})


class UploadError(EngineError):
    """An upload that cannot become external weights (a user error, naming why)."""


class UnknownUpload(EngineError):
    """No such upload for this tenant (or it expired): to them it does not exist."""


@dataclass(frozen=True)
class Upload:
    id: str
    tenant: str
    base_model: str
    lora: LoRAConfig
    project_id: str | None
    expires: float
    folder: Path


class UploadStore:
    def __init__(self, data_dir: str | Path) -> None:
        self.root = Path(data_dir) / "uploads"
        self._open: dict[str, Upload] = {}
        self._lock = threading.Lock()

    def clear(self) -> None:
        """Discard every unfinished upload's files (at start-up: their records were in memory)."""
        shutil.rmtree(self.root, ignore_errors=True)

    def start(
        self,
        tenant: str,
        base_model: str,
        lora: LoRAConfig,
        project_id: str | None,
        ttl_s: float = UPLOAD_TTL_S,
    ) -> Upload:
        upload_id = f"upl-{uuid.uuid4().hex}"
        folder = self.root / upload_id
        upload = Upload(upload_id, tenant, base_model, lora, project_id, time.time() + ttl_s, folder)
        folder.mkdir(parents=True)
        with self._lock:
            self._open[upload.id] = upload
        return upload

    def get(self, tenant: str, upload_id: str) -> Upload:
        with self._lock:
            upload = self._open.get(upload_id)
        if upload is None or upload.tenant != tenant or upload.expires <= time.time():
            raise UnknownUpload(f"unknown upload {upload_id!r} (or it expired: start a new one)")
        return upload

    def put(self, upload: Upload, file: str, data: bytes) -> None:
        """Write one of the upload's files (replacing an earlier PUT of it), atomically."""
        if file not in UPLOAD_FILES:
            raise UploadError(f"{file!r} is not a file of an upload; upload {' and '.join(UPLOAD_FILES)}")
        tmp = upload.folder / f".{file}.{uuid.uuid4().hex[:8]}"
        tmp.write_bytes(data)
        os.replace(tmp, upload.folder / file)

    def discard(self, upload: Upload) -> None:
        with self._lock:
            self._open.pop(upload.id, None)
        shutil.rmtree(upload.folder, ignore_errors=True)


def upload_layout(runtime: Runtime, base_model: str, lora: LoRAConfig) -> dict[str, tuple[int, ...]]:
    """:func:`expected_layout` on the engine of ``base_model`` (loaded on first use)."""
    return expected_layout(runtime.base_stack(base_model).engine, lora)


def expected_layout(engine: Any, lora: LoRAConfig) -> dict[str, tuple[int, ...]]:
    """Key -> shape of the ``adapter_model.safetensors`` this server writes for ``lora`` on
    ``engine``'s base (its ``export_tinker`` of a fresh adapter)."""
    weights = init_lora_weights(lora, engine.lora.groups)
    if not weights.a:
        raise UploadError("lora_config trains nothing this base model has")
    tensors = tinker_tensors(weights, engine.lora.groups, engine.base.model)
    return {k: tuple(t.shape) for k, t in tensors.items()}


def check_upload(upload: Upload, expected: dict[str, tuple[int, ...]]) -> None:
    """Refuse (``UploadError`` naming the file, field or tensor) what does not fit ``expected``."""
    for f in UPLOAD_FILES:
        if not (upload.folder / f).is_file():
            raise UploadError(f"{f} was not uploaded")
    _check_config(upload)
    try:
        with safe_open(str(upload.folder / WEIGHTS_FILE), framework="pt") as f:
            keys = sorted(f.keys())
            slices = {k: f.get_slice(k) for k in keys}
            shapes = {k: tuple(s.get_shape()) for k, s in slices.items()}
            dtypes = {k: s.get_dtype() for k, s in slices.items()}
            for k in keys:
                if k not in expected:
                    raise UploadError(
                        f"tensor {k!r} is not a LoRA weight of {upload.base_model} with this lora_config "
                        "(another base model's layout, or a module it does not train)"
                    )
                if shapes[k] != expected[k]:
                    raise UploadError(f"tensor {k!r} has shape {shapes[k]}, expected {expected[k]}")
                if dtypes[k] not in FLOAT_DTYPES:
                    raise UploadError(f"tensor {k!r} has dtype {dtypes[k]}, not a floating-point one")
                if not bool(f.get_tensor(k).float().isfinite().all()):
                    raise UploadError(f"tensor {k!r} holds NaN or infinite values")
    except UploadError:
        raise
    except Exception:  # safetensors' own errors for a file that is not one
        raise UploadError(f"{WEIGHTS_FILE} is not a safetensors file") from None
    missing = sorted(set(expected) - set(keys))
    if missing:
        raise UploadError(f"tensor {missing[0]!r} is missing ({len(missing)} of {len(expected)} missing)")


def _check_config(upload: Upload) -> None:
    try:
        config = json.loads((upload.folder / CONFIG_FILE).read_text())
    except (ValueError, UnicodeDecodeError):
        raise UploadError(f"{CONFIG_FILE} is not JSON") from None
    if not isinstance(config, dict):
        raise UploadError(f"{CONFIG_FILE} is not a JSON object")
    r = config.get("r")
    if r != upload.lora.rank:
        raise UploadError(f"{CONFIG_FILE}: r is {r!r}, the upload's lora_config has rank {upload.lora.rank}")
    alpha = config.get("lora_alpha")
    if alpha is not None and (
        not isinstance(alpha, (int, float)) or not math.isclose(float(alpha), upload.lora.alpha)
    ):
        raise UploadError(f"{CONFIG_FILE}: lora_alpha is {alpha!r}, this server's is {upload.lora.alpha}")
