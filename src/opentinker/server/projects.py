"""Projects: ``project_id`` on sessions, ``assign_session_project``, and ``copy_weights``.

A project here is a name a tenant files its sessions under; it exists by being used (sessions
made without one are in ``default``). ``project_id`` on ``create_session`` places the session,
``PUT /sessions/{id}/project`` moves it (and with it its training runs, which
``list_training_runs(project_id=…)`` filters by); a project cannot be cleared, as the SDK documents.

``copy_weights`` (``POST /copy_weights``) copies one of the tenant's checkpoints into a project,
as the SDK documents it: the copy keeps the source's kind and name and belongs to a new training
run that cannot be trained on — ``<new session>:train:0`` in a new, finished session of the
destination project, or ``<session_id>:train:<model_seq_id>`` in a live session of the caller's
(then it is in that session's project). Storage is shared: the copy's tensor files are hard links
to the source's, so no bytes are duplicated and deleting either leaves the other intact; only the
manifest is new (its metadata names the copy, its owner and ``copied_from``). The SDK's
``X-Idempotency-Key`` makes a retried copy answer the first copy's path.
"""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from opentinker.server.errors import BadRequest, NotFound
from opentinker.server.registry import Registry
from opentinker.server.schemas import MAX_SEQ
from opentinker.server.store import ModelRow
from opentinker.service import sessions
from opentinker.service.checkpoints import CheckpointRef, check_ttl


def check_project(value: object) -> str:
    """``value`` if it is a valid project id, else a :class:`BadRequest` naming the rule."""
    try:
        return sessions.check_project(value)
    except sessions.InvalidProject as e:
        raise BadRequest(str(e)) from None


class AssignProjectRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    project_id: str | None = None


class CopyWeightsRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())
    source_path: str = Field(max_length=1000)
    destination_project_id: str | None = None
    session_id: str | None = Field(default=None, max_length=256)
    model_seq_id: int | None = Field(default=None, ge=0, le=MAX_SEQ)
    ttl_seconds: int | None = None
    weights_access_token: str | None = None


def copy_meta(source_meta: dict[str, Any], tenant: str, src: CheckpointRef, dst: CheckpointRef,
              ttl_seconds: int | None) -> dict[str, Any]:  # fmt: skip
    meta = dict(source_meta)
    meta.update(
        tenant=tenant,
        tinker_path=dst.tinker_path,
        model_id=dst.model_id,
        parent=src.tinker_path,
        copied_from=src.tinker_path,
        sampler_versions=[],
    )
    meta.pop("expires_at", None)  # "source expiry is not inherited"
    if ttl_seconds is not None:
        meta["ttl_seconds"] = ttl_seconds
        meta["expires_at"] = time.time() + ttl_seconds
    return meta


def copy_model_row(model_id: str, tenant: str, session_id: str, meta: dict[str, Any]) -> ModelRow:
    now = time.time()
    return ModelRow(
        model_id,
        tenant,
        session_id,
        str(meta.get("base_model", "")),
        dict(meta.get("lora", {})),
        str(meta["copied_from"]),
        now,
        now,
        None,
    )


class ProjectApi:
    def __init__(self, registry: Registry) -> None:
        self.reg = registry
        self.store = registry.store
        self._copies: dict[tuple[str, str], dict[str, Any]] = {}  # (tenant, idempotency key) -> answer

    def assign(self, tenant: str, session_id: str, req: AssignProjectRequest) -> None:
        try:
            row = self.reg.runtime.sessions.get(tenant, session_id)
        except sessions.UnknownSession as e:
            raise NotFound(str(e)) from None
        if not req.project_id:
            raise BadRequest("project_id is missing: a session can be moved to a project, not out of one")
        self.store.set_session_project(row.id, check_project(req.project_id))

    def copy_weights(
        self, tenant: str, req: CopyWeightsRequest, idempotency_key: str | None
    ) -> dict[str, Any]:
        key = None if idempotency_key is None else (tenant, idempotency_key[:200])
        if key is not None and key in self._copies:
            return self._copies[key]
        check_ttl(req.ttl_seconds)
        if req.weights_access_token is not None:
            raise BadRequest(
                "weights_access_token is not supported by this server: copy your own checkpoints"
            )
        in_session = req.session_id is not None or req.model_seq_id is not None
        if in_session and (req.session_id is None or req.model_seq_id is None):
            raise BadRequest("copy_weights into a session needs both session_id and model_seq_id")
        if not in_session:
            if req.destination_project_id is None:
                raise BadRequest("copy_weights needs destination_project_id, or session_id and model_seq_id")
            check_project(req.destination_project_id)
        src, meta = self.reg.checkpoint(tenant, req.source_path)  # another tenant's: 404
        if in_session:
            assert req.session_id is not None and req.model_seq_id is not None
            sess = self.reg.session(tenant, req.session_id)
            model_id = sessions.model_id_in(sess.id, req.model_seq_id)
            if model_id in self.reg.runtime.models or self.store.model(model_id) is not None:
                raise BadRequest(
                    f"model {model_id!r} already exists (model_seq_id {req.model_seq_id} was used)"
                )
        else:
            project = req.destination_project_id
            sess = self.reg.create_session(tenant, {"project_id": project, "created_by": "copy_weights"})
            self.reg.finish_session(sess, "success")  # it only holds the copy: nothing runs in it
            model_id = sessions.model_id_in(sess.id, 0)
        dst = CheckpointRef(model_id, src.kind, src.name)
        new_meta = copy_meta(meta, tenant, src, dst, req.ttl_seconds)
        self.reg.runtime.store.link(src, dst, new_meta)
        self.store.add_model(copy_model_row(model_id, tenant, sess.id, new_meta))
        self.reg.record_checkpoint(tenant, dst.tinker_path, ttl_seconds=req.ttl_seconds)  # listings, sweep
        answer = {"tinker_path": dst.tinker_path}
        if key is not None:
            self._copies[key] = answer
        return answer
