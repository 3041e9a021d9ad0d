"""The embedded service: engines per base model, their schedulers and samplers, models, checkpoints.

One ``Runtime`` per process is created on first use (``default_runtime()``); every embedded
``ServiceClient`` shares it, so many clients in many threads share one base model and one batch
per base model. Its data dir defaults to ``$OPENTINKER_HOME`` or ``~/.cache/opentinker/data``.
"""

from __future__ import annotations

import itertools
import os
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from opentinker.client.checkpoints import CheckpointStore
from opentinker.engine import Engine, EngineError, UnknownPolicyError
from opentinker.lora import LoRAConfig
from opentinker.models import load_base_model
from opentinker.models.registry import cache_dir, canonical_name
from opentinker.sampling import NativeBackend
from opentinker.sampling.native import DEFAULT_PREFIX_CACHE_BYTES
from opentinker.scheduler import Scheduler


@dataclass
class Backend:
    engine: Engine
    sampler: NativeBackend
    scheduler: Scheduler


@dataclass
class ModelRecord:
    model_id: str
    base_model: str
    lora: LoRAConfig
    tenant: str
    parent: str | None = None  # tinker path of the checkpoint it was created from
    sampled_versions: set[str] = field(default_factory=set)  # its snapshots sampled since last save
    deleted: bool = False


def default_data_dir() -> Path:
    env = os.environ.get("OPENTINKER_HOME")
    return Path(env) if env else cache_dir() / "data"


class Runtime:
    def __init__(
        self,
        data_dir: str | Path | None = None,
        *,
        max_rank: int = 128,
        device: str = "cpu",
        prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES,
    ) -> None:
        self.data_dir = Path(data_dir) if data_dir is not None else default_data_dir()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.store = CheckpointStore(self.data_dir)
        self.max_rank = max_rank
        self.device = device
        self.prefix_cache_bytes = prefix_cache_bytes  # per base model's sampler
        self.models: dict[str, ModelRecord] = {}
        self._backends: dict[str, Backend] = {}
        self._lock = threading.RLock()
        self._model_seq = itertools.count(1)

    def backend(self, base_model: str) -> Backend:
        name = canonical_name(base_model)
        with self._lock:
            b = self._backends.get(name)
            if b is None:
                engine = Engine(
                    load_base_model(name, device=self.device), max_rank=self.max_rank, device=self.device
                )
                sampler = NativeBackend(engine, prefix_cache_bytes=self.prefix_cache_bytes)
                b = Backend(engine, sampler, Scheduler(engine, sampler))
                self._backends[name] = b
            return b

    def loaded_base_models(self) -> list[str]:
        return list(self._backends)

    def new_session(self) -> str:
        return f"sess-{uuid.uuid4().hex[:12]}"

    def new_model_id(self, session_id: str) -> str:
        return f"{session_id}:train:{next(self._model_seq)}"

    def model(self, model_id: str, tenant: str | None = None) -> ModelRecord:
        rec = self.models.get(model_id)
        if rec is None or (tenant is not None and rec.tenant != tenant):
            raise UnknownPolicyError(f"unknown model {model_id!r}")
        if rec.deleted:
            raise EngineError(f"model {model_id!r} was deleted")
        return rec

    def shutdown(self) -> None:
        with self._lock:
            for b in self._backends.values():
                b.scheduler.shutdown()
            self._backends.clear()


_default: Runtime | None = None
_default_lock = threading.Lock()


def default_runtime() -> Runtime:
    global _default
    with _default_lock:
        if _default is None:
            _default = Runtime()
        return _default
