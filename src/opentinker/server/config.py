"""Server settings: what ``opentinker serve`` is started with (one frozen object, passed down);
the runtime's own settings are its ``runtime`` field, a :class:`~opentinker.service.config.RuntimeConfig`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from opentinker.service.config import RuntimeConfig


@dataclass(frozen=True)
class ServerConfig:
    data_dir: Path
    base_models: tuple[str, ...] = ()
    # any key the SDK accepts (``tml-…``) is accepted; its tenant is derived from the key's hash
    dev: bool = False
    max_body_bytes: int = 64 << 20
    max_pending_per_tenant: int = 2048
    # of those, queued on the engines at once; the rest wait in the server (admission.py) and their
    # polls say paused_rate_limit. The scheduler serves one request per model per tick, so this
    # only binds a tenant with hundreds of models all busy
    max_running_per_tenant: int = 512
    # a long-poll of /retrieve_future answers try_again after this long (the SDK gives up at 45 s)
    poll_timeout_s: float = 25.0
    # a model's requests waiting this long for a lower seq_id that never came fail, naming it, and
    # the model goes on. A refused send's seq_id is skipped at once (ordering.py), so this only
    # covers a send that never reached the server. The SDK sends a model's next call only once the
    # previous send was answered (the chunks of one forward_backward go together, within
    # milliseconds), so a healthy client never leaves a gap this long; 10 s also covers the SDK's
    # first three resends (1 + 2 + 4 s backoff) of a chunk lost on the way, while a dead client
    # stalls its model for seconds, not for good.
    gap_timeout_s: float = 10.0
    # a finished result stays retrievable this long
    result_ttl_s: float = 1800.0
    max_num_samples: int = 256
    # tell the SDK to poll sampling results per session (/retrieve_futures) instead of per request;
    # off by default: the SDK's batch poller cannot learn that a request in flight at a server
    # crash is lost (completions.py), per-request polling is told so at once
    batch_polling: bool = False
    # expired checkpoints are deleted at start-up and then this often
    checkpoint_sweep_s: float = 60.0
    # lifetime of the signed tokens /auth/token gives for a key (the SDK refreshes at half of it);
    # 0 turns tokens off: /client/config then tells the SDK to send its key on every request
    token_ttl_s: float = 900.0
    # a session with no heartbeat and no request this long is inactive: its models' state is
    # saved to a checkpoint and they are evicted from memory (the SDK heartbeats every 10 s)
    session_inactive_s: float = 600.0
    # the OpenAI-compatible chat route's template (Jinja text; None: each base model's tokenizer's)
    chat_template: str | None = None
    # tenants whose keys see every tenant's sessions, runs and checkpoints in the console (read-only)
    operator_tenants: tuple[str, ...] = ()
    # the runtime's settings (device, dtype, workers, Ray, data parallelism, ...): their flags are
    # generated from it (service/config.py), under the same names
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
