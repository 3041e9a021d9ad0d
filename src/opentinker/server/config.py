"""Server settings: what ``opentinker serve`` is started with (one frozen object, passed down)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ServerConfig:
    data_dir: Path
    base_models: tuple[str, ...] = ()
    # any key the SDK accepts (``tml-…``) is accepted; its tenant is derived from the key's hash
    dev: bool = False
    device: str = "cpu"
    # the frozen base models' dtype: "auto" (bf16 on a CUDA GPU that has it, else fp32: see
    # models/dtype.py), "float32" or "bfloat16"; LoRA weights and optimizer state are fp32 always
    dtype: str = "auto"
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
    # keys and values of finished sequences the sampler keeps for the next turn (0 = none)
    prefix_cache_bytes: int = 512 << 20
    # sampling served by this many worker processes per base model (0: a thread of this process)
    rollout_workers: int = 0
    # what samples: "native" (the engine's own decoder) or "vllm" (vLLM's engine, runtime LoRA)
    rollout_backend: str = "native"
    # with the vllm backend: the largest LoRA rank it serves (vLLM computes every adapter at this
    # rank; an adapter above it is refused, naming it)
    vllm_max_lora_rank: int = 32
    # rollout workers as Ray actors: None (processes), "local" (a Ray instance started here),
    # "auto" / "ray://HOST:PORT" / "HOST:PORT" (a cluster joined); each worker's CPUs and GPUs
    ray: str | None = None
    worker_cpus: float = 1.0
    worker_gpus: float = 0.0
    # train on this many Ray trainer workers per base model (0: in this process); each worker's
    # CPUs and GPUs; put the models of a lost worker back from their newest checkpoints
    trainer_workers: int = 0
    # every new model data-parallel over this many trainer workers (a model's user_metadata
    # {"data_parallel": "k"} overrides it)
    data_parallel: int = 1
    shard_base: int = 1  # trainer workers per sharded group: one FSDP-sharded copy of the base each
    trainer_cpus: float = 1.0
    trainer_gpus: float = 0.0
    auto_restore: bool = False
    # a Ray worker (rollout or trainer) not placed on a node within this many seconds fails the
    # start (or the scale) that asked for it, naming it, instead of waiting for resources forever
    placement_timeout_s: float = 60.0
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
