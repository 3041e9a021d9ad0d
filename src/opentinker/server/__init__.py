"""The Tinker-compatible HTTP service: the official ``tinker`` SDK is its client.

A thin layer above the embedded client API (:mod:`opentinker.client`): requests are decoded
(protobuf through the SDK's own schema, or JSON), mapped onto one shared runtime's
``ServiceClient`` / ``TrainingClient`` / ``SamplingClient`` objects, and their futures answered by
request id. Files, in the order a request meets them:

- ``main.py``        ``serve(argv)``: flags → :class:`ServerConfig` → uvicorn
- ``limits.py``      body-size limit (413) and zstd decoding, before any route
- ``app.py``         the FastAPI app: error answers, background sweeps, the route groups
- ``state.py``       ``Server``: everything one server process holds, built from its config
- ``deps.py``        the routes' ``X-API-Key`` and tenant dependencies
- ``routes.py``      the SDK's operation routes (service, sessions, training, sampling, futures)
- ``rest_routes.py`` the REST checkpoint routes; ``admin_routes.py`` the admin reads
- ``auth.py``        ``X-API-Key`` → tenant; ``keys_main`` (``opentinker keys …``)
- ``schemas.py``     JSON request bodies; ``wire.py`` protobuf bodies and results
- ``ops.py``         each operation mapped onto the embedded clients
- ``ordering.py``    per-model ``seq_id`` reorder buffer and idempotency
- ``registry.py``    resolves session, model and sampler ids per tenant (404 for others' ids);
  ``records.py`` makes what they name and writes it down (the lifecycle: ``service/lifecycle.py``)
- ``futures.py``     request id → future of the encoded result; long-poll; pending limits
- ``checkpoints.py`` the REST checkpoint routes' logic; re-indexing checkpoints at start-up
- ``store.py``       SQLite (WAL): tenants, keys, sessions, models, samplers, checkpoints
- ``usage.py``       the audit log and usage counters (``AdminClient``: audit, billing, storage)
- ``console.py``     the console pages at the paths the SDK's ``get_console_url()`` builds
- ``openai_routes.py`` ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models`` (``openai_*.py``)
- ``local.py``       run a server in a child process (tests, benchmarks)
"""

from opentinker.server.auth import keys_main
from opentinker.server.config import ServerConfig
from opentinker.server.main import serve

__all__ = ["ServerConfig", "keys_main", "serve"]
