"""Download URLs for external weights (``RestClient.get_external_weights_urls``) and serving them.

``GET /training_runs/<model>/checkpoints/external_weights/<name>/external_weights_urls`` answers
``{"urls": {file: url}, "expires": iso time}`` (the SDK's ``ExternalWeightsUrlsResponse``): one
signed URL per file of the export (see :mod:`opentinker.server.signing`), for the asking tenant,
which must own the export or find it published. ``GET /downloads/<model>/<kind>/<name>/<file>``
serves one file to whoever holds a valid URL, without an API key (``urllib.request.urlretrieve``,
as ``tinker_cookbook.weights.download`` does). A URL is refused (403, saying why) when its
signature does not match (changed or made up), when it has expired, or when the request carries
an API key of another tenant than the one the URL was made for; and (404) when the export was
deleted, expired, or is no longer readable by that tenant (unpublished).

Session traces (``export_session_trace``, :mod:`opentinker.server.traces`) go through the same
route as ``/downloads/<session>/traces/<export>/trace.json``, under the same rules, for the
session's tenant only.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from opentinker.server.checkpoints import CheckpointApi
from opentinker.server.errors import BadRequest, Forbidden, NotFound
from opentinker.server.signing import UrlSigner
from opentinker.server.store import Store
from opentinker.server.traces import KIND as TRACES
from opentinker.server.traces import SessionTraces
from opentinker.service.external import KIND as EXTERNAL
from opentinker.service.external import ExternalStore


class Downloads:
    def __init__(
        self,
        checkpoints: CheckpointApi,
        external: ExternalStore,
        signer: UrlSigner,
        traces: SessionTraces | None = None,
        store: Store | None = None,
    ) -> None:
        self.ckpts = checkpoints
        self.external = external
        self.signer = signer
        self.traces = traces
        self.store = store

    def trace_url(self, tenant: str, base_url: str, session_id: str) -> dict[str, Any]:
        """The session's trace, written now, and the SDK's poll answer with its signed URL."""
        if self.traces is None:
            return {"status": "failed", "error": "this server keeps no session traces"}
        return self.traces.export(session_id, self.signer, tenant, base_url)

    def urls(self, tenant: str, base_url: str, model_id: str, kind: str, name: str) -> dict[str, Any]:
        if kind != EXTERNAL:
            raise BadRequest(
                f"only external weights have download URLs (tinker://<run>/{EXTERNAL}/<name>), not {kind!r}"
            )
        path = self.ckpts.path_of(model_id, kind, name)
        self.ckpts.readable(tenant, path)
        rec = self.external.record(model_id, name)
        if rec is None:
            raise NotFound(f"unknown checkpoint {path!r}")
        expires = int(datetime.now(UTC).timestamp() + self.signer.ttl_s)
        urls = {f: self.signer.sign(base_url, tenant, path, f, expires=expires) for f in sorted(rec.files)}
        return {"urls": urls, "expires": datetime.fromtimestamp(expires, UTC).isoformat()}

    def file(
        self,
        model_id: str,
        kind: str,
        name: str,
        file: str,
        *,
        tenant: str,
        expires: str,
        sig: str,
        caller: str | None,
    ) -> Path:
        """The file a signed URL names, once the URL checks out (see the module docstring)."""
        if kind == TRACES and self.traces is not None and self.store is not None:
            self.signer.verify(tenant, f"tinker://{model_id}/{kind}/{name}", file, expires, sig)
            if caller is not None and caller != tenant:
                raise Forbidden("this download URL was made for another tenant")
            row = self.store.session(model_id)
            if row is None or row.tenant != tenant:
                raise NotFound(f"unknown session {model_id!r}")
            return self.traces.file(model_id, name, file)
        if kind != EXTERNAL:
            raise NotFound(f"no downloads under {kind!r}")
        path = self.ckpts.path_of(model_id, kind, name)
        self.signer.verify(tenant, path, file, expires, sig)
        if caller is not None and caller != tenant:
            raise Forbidden("this download URL was made for another tenant")
        self.ckpts.readable(tenant, path)  # deleted, expired or unpublished since: 404
        rec = self.external.record(model_id, name)
        if rec is None or file not in rec.files:
            raise NotFound(f"{path} has no file {file!r}")
        return rec.folder / file
