"""The server's state: :class:`Server`, everything one server process holds, built from its
config (and an optional runtime): the store, authentication, futures, the per-tenant registry,
the operations over the runtime, checkpoints, downloads, sessions, projects, the audit log,
the Prometheus metrics.

The app (:mod:`~opentinker.server.app`) makes one and hands it to every route group; the routes
only authenticate, parse and delegate to what it holds.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from opentinker.server.auth import Authenticator
from opentinker.server.checkpoints import CheckpointApi, is_public, reconcile
from opentinker.server.config import ServerConfig
from opentinker.server.downloads import Downloads
from opentinker.server.errors import Redactor
from opentinker.server.futures import FutureStore
from opentinker.server.lifecycle import Lifecycle
from opentinker.server.metrics import ServerMetrics
from opentinker.server.ops import Operations
from opentinker.server.ordering import Sequencer
from opentinker.server.projects import ProjectApi
from opentinker.server.registry import Registry
from opentinker.server.sessions import SessionApi
from opentinker.server.signing import UrlSigner
from opentinker.server.store import Store
from opentinker.server.tokens import TokenSigner, load_secret
from opentinker.server.traces import SessionTraces
from opentinker.server.usage import Ledger
from opentinker.server.weights_upload import WeightsUploads
from opentinker.service import Runtime
from opentinker.service.sessions import Sessions, session_of


class Server:
    """Everything one server process holds, built from its config (and an optional runtime)."""

    def __init__(self, config: ServerConfig, runtime: Runtime | None = None) -> None:
        self.config = config
        self.store = Store(config.data_dir)
        sessions = Sessions(self.store)  # the server's sessions outlive its process
        published = partial(is_public, self.store)  # published checkpoints: readable by all
        if runtime is None:
            runtime = Runtime(config.data_dir, config.runtime, sessions=sessions, is_public=published)
        else:  # a runtime made before the server (embedded_app): it serves the server's records now
            runtime.sessions, runtime.is_public = sessions, published
        self.runtime = runtime
        self.redact = Redactor([config.data_dir, self.runtime.data_dir])  # every message to a client
        signer = (
            TokenSigner(load_secret(config.data_dir), config.token_ttl_s) if config.token_ttl_s > 0 else None
        )
        self.auth = Authenticator(self.store, dev=config.dev, signer=signer)
        self.futures = FutureStore(
            max_pending=config.max_pending_per_tenant, result_ttl_s=config.result_ttl_s
        )
        self.sequencer = Sequencer()
        # every base model's Ray workers, all kinds together, before the first is placed
        self.runtime.scaleout.check_start(list(config.base_models))
        self.registry = Registry(self.runtime, self.store, self.sequencer, list(config.base_models))
        self.usage = Ledger(self.store.path, self.runtime.store)  # audit log and usage counters
        self.traces = SessionTraces(config.data_dir, self.runtime.tick_record)
        self.ops = Operations(config, self.registry, self.futures, self.sequencer, self.usage, self.traces)
        self.lifecycle = Lifecycle(config, self.registry, self.futures, self.ops)
        self.checkpoints = CheckpointApi(self.runtime.store, self.store, self.runtime.external)
        signer = UrlSigner(config.data_dir)
        self.downloads = Downloads(self.checkpoints, self.runtime.external, signer, self.traces, self.store)
        self.uploads = WeightsUploads(self.registry, signer, config.data_dir)  # SDK 0.39's uploads
        self.sessions = SessionApi(self.runtime.sessions, self.store, config.session_inactive_s)
        self.projects = ProjectApi(self.registry)
        reconcile(self.runtime.store, self.store, self.runtime.external)
        self.metrics = ServerMetrics(self)  # GET /metrics (operators): its own Prometheus registry

    def audit_when_done(self, tenant: str, request_id: str, event: str, **details: Any) -> None:
        """Record ``event`` in the audit log when the request succeeds, with what its result names."""

        def record(result: Any) -> None:
            found = {k: result[k] for k in ("model_id", "path", "sampling_session_id") if k in result}
            if event == "checkpoint_create" and "path" not in found:  # ephemeral sampler weights
                self.usage.record(
                    tenant, "sampler_create", sampler_id=found.get("sampling_session_id"), **details
                )
                return
            extra = {**details, **found}
            if "path" in extra:
                extra["tinker_path"] = extra.pop("path")
            if event == "checkpoint_create":
                row = self.store.checkpoint(extra["tinker_path"])
                if row is not None:
                    extra |= {"size_bytes": row.size_bytes, "base_model": row.meta.get("base_model")}
                    extra |= {"session_id": session_of(row.model_id)}
            self.usage.record(tenant, event, **extra)

        self.usage.after(f"{request_id}:{event}", self.futures.future_of(request_id), record)

    def close(self) -> None:
        self.runtime.shutdown()
        self.usage.close()
        self.store.close()
