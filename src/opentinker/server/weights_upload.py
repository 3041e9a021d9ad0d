"""Uploading external weights, as the Tinker SDK 0.39 documents it: ``RestClient.
external_weights_upload_start`` / ``external_weights_upload_finish``.

- ``POST /api/v1/external_weights_upload_start`` (``base_model``, ``lora_config``,
  ``destination_project_id``): a base model this server serves, a LoRA config it can hold; answers
  ``upload_id``, ``urls`` (a signed PUT URL per file, ``adapter_model.safetensors`` and
  ``adapter_config.json``) and ``expires`` (an hour).
- ``PUT <url>``: the file's bytes (no API key: the signature binds the tenant, the upload, the file
  and the expiry; :mod:`~opentinker.server.signing`). Up to the server's request-size limit
  (``--max-body-bytes``).
- ``POST /api/v1/external_weights_upload_finish`` (``upload_id``): the files are checked against
  the layout this server writes for that base and config (:mod:`opentinker.service.uploads`); a
  refusal (400) names the tensor or field and discards the upload, storing nothing. What passes
  becomes ``tinker://<model>/external_weights/uploaded``, the model a new finished session's (in
  ``destination_project_id``, else the default project), listed and downloadable like
  ``save_weights_external``'s.

An upload is its tenant's alone: another tenant's upload id is unknown (404), at every step.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from tinker.types import LoraConfig

from opentinker.server.checkpoints import external_row
from opentinker.server.errors import BadRequest, NotFound, UserError
from opentinker.server.projects import check_project
from opentinker.server.registry import Registry
from opentinker.server.signing import UrlSigner, upload_path
from opentinker.server.store import ModelRow
from opentinker.service import LoRAConfig, sessions
from opentinker.service.uploads import (
    UPLOAD_FILES,
    UnknownUpload,
    Upload,
    UploadError,
    UploadStore,
    check_upload,
    upload_layout,
)

NAME = "uploaded"  # the external weights' name in the new model


class UploadStartRequest(BaseModel):
    """``ExternalWeightsUploadStartRequest`` (SDK 0.39)."""

    model_config = ConfigDict(extra="forbid")
    base_model: str = Field(min_length=1, max_length=512)
    lora_config: LoraConfig
    destination_project_id: str | None = None


class UploadFinishRequest(BaseModel):
    """``ExternalWeightsUploadFinishRequest`` (SDK 0.39)."""

    model_config = ConfigDict(extra="forbid")
    upload_id: str = Field(min_length=1, max_length=128)


class WeightsUploads:
    def __init__(self, registry: Registry, signer: UrlSigner, data_dir: str | Path) -> None:
        self.reg = registry
        self.signer = signer
        self.uploads = UploadStore(data_dir)
        self.uploads.clear()

    def start(self, tenant: str, base_url: str, req: UploadStartRequest) -> dict[str, Any]:
        try:
            base = self.reg.base_model(req.base_model)
        except UserError as e:
            raise BadRequest(f"base_model: {e}") from None
        if req.destination_project_id is not None:
            check_project(req.destination_project_id)
        lc = req.lora_config
        if lc.rank < 1:
            raise BadRequest(f"lora_config.rank must be at least 1, got {lc.rank}")
        lora = LoRAConfig(
            rank=lc.rank, train_attn=lc.train_attn, train_mlp=lc.train_mlp, train_unembed=lc.train_unembed
        )
        upload = self.uploads.start(tenant, base, lora, req.destination_project_id)
        try:
            self._expected(upload)  # a config this base cannot hold is refused now, not at finish
        except BadRequest:
            self.uploads.discard(upload)
            raise
        expires = int(upload.expires)
        urls = {f: self.signer.sign_upload(base_url, tenant, upload.id, f, expires) for f in UPLOAD_FILES}
        return {
            "upload_id": upload.id,
            "urls": urls,
            "expires": datetime.fromtimestamp(expires, UTC).isoformat(),
        }

    def put(self, upload_id: str, file: str, tenant: str, expires: str, sig: str, body: bytes) -> None:
        self.signer.verify(tenant, upload_path(upload_id), file, expires, sig, what="upload")
        upload = self._upload(tenant, upload_id)
        try:
            self.uploads.put(upload, file, body)
        except UploadError as e:
            raise BadRequest(str(e)) from None

    def finish(self, tenant: str, req: UploadFinishRequest) -> dict[str, Any]:
        upload = self._upload(tenant, req.upload_id)
        try:
            check_upload(upload, self._expected(upload))
        except (UploadError, BadRequest) as e:
            self.uploads.discard(upload)
            raise BadRequest(f"upload {upload.id} refused, nothing stored: {e}") from None
        try:
            return {"tinker_path": self._store(upload)}
        finally:
            self.uploads.discard(upload)

    def _upload(self, tenant: str, upload_id: str) -> Upload:
        try:
            return self.uploads.get(tenant, upload_id)
        except UnknownUpload as e:
            raise NotFound(str(e)) from None

    def _expected(self, upload: Upload) -> dict[str, tuple[int, ...]]:
        try:
            return upload_layout(self.reg.runtime, upload.base_model, upload.lora)
        except UploadError as e:
            raise BadRequest(f"lora_config: {e}") from None

    def _store(self, upload: Upload) -> str:
        """The checked files as external weights of a new model in a new, finished session."""
        meta = {"created_by": "external_weights_upload"}
        if upload.project_id is not None:
            meta["project_id"] = upload.project_id
        sess = self.reg.create_session(upload.tenant, meta)
        self.reg.finish_session(sess, "success")  # it only holds the upload: nothing runs in it
        model_id = sessions.model_id_in(sess.id, 0)
        lora = dataclasses.asdict(upload.lora)
        record_meta = {"tenant": upload.tenant, "model_id": model_id, "base_model": upload.base_model}
        record_meta |= {"lora": lora, "parent": None, "uploaded": True}

        def copy(folder: Path) -> None:
            for f in UPLOAD_FILES:
                shutil.copyfile(upload.folder / f, folder / f)

        rec = self.reg.runtime.external.write(model_id, NAME, copy, record_meta)
        now = time.time()
        row = ModelRow(model_id, upload.tenant, sess.id, upload.base_model, lora, None, now, now, None)
        self.reg.store.add_model(row)
        self.reg.store.add_checkpoint(external_row(rec))
        return rec.tinker_path
