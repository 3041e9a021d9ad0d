"""The embedded service: engines per base model, their models' records, checkpoints' tenancy.

One ``Runtime`` per process is created on first use (``default_runtime()``); every embedded
``ServiceClient`` shares it, so many clients in many threads share one base model and one batch
per base model. Its data dir defaults to ``$OPENTINKER_HOME`` or ``~/.cache/opentinker/data``.

Model creation (fresh or from a checkpoint), deletion, snapshots, and the rule "a tenant sees only
its own models and checkpoints" are written here once (when models leave memory: ``lifecycle.py``);
the embedded clients and the HTTP server both call them, never the engine. Engine work is queued on the
base model's scheduler in the model's order and comes back as a ``concurrent.futures.Future``:
the embedded clients wait on it, the server chains it to a request id.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from opentinker.engine import Engine, EngineError, SnapshotInfo, Trainer, UnknownPolicyError
from opentinker.engine.checkpoint import CheckpointError, read_manifest
from opentinker.engine.optim import check_optimizer_config
from opentinker.engine.paging import PageFiles, page_folder
from opentinker.lora import LoRAConfig
from opentinker.models import BUILTIN_MODELS, load_base_model
from opentinker.models.dtype import dtype_name, resolve_dtype
from opentinker.models.registry import canonical_name
from opentinker.models.vision import Vision
from opentinker.sampling import NativeBackend, SamplingBackend
from opentinker.sampling.decoder import Decoder
from opentinker.sampling.handles import SamplingService
from opentinker.sampling.loop import SamplingCore, SamplingLoop
from opentinker.sampling.routed import RoutedBackend, check_rollout_options
from opentinker.scheduler import ModelQueue, Scheduler, TickRecord, VersionQueue
from opentinker.service.checkpoints import CheckpointRef, CheckpointStore, parse_tinker_path
from opentinker.service.config import RuntimeConfig, default_data_dir, runtime_config, vllm_options
from opentinker.service.external import ExternalRecord, ExternalStore, parse_recipients
from opentinker.service.memory import memory_budget, vllm_cpu_loras
from opentinker.service.scaleout import ScaleOut, data_parallel_of
from opentinker.service.sessions import MemorySessionStore, Sessions, model_id_in

WEIGHTS_CACHE = 4  # checkpoints whose weights stay in memory for weight-only loads (per runtime)
LOCAL_TENANT = "local"  # the tenant of embedded clients, and of checkpoints that name none


@dataclass
class BaseStack:
    engine: Engine
    sampler: SamplingBackend
    scheduler: Scheduler


@dataclass
class ModelRecord:
    model_id: str
    base_model: str
    lora: LoRAConfig
    tenant: str
    parent: str | None = None  # tinker path of the checkpoint it was created from
    data_parallel: int = 1  # trainer workers it is replicated over (opentinker.cluster.dp)
    note: str | None = None  # why it is not at the degree its checkpoint records, if it is not
    user_metadata: dict[str, str] | None = None  # what its creator attached (SDK user_metadata)
    sampled_versions: set[str] = field(default_factory=set)  # its snapshots sampled since last save
    deleted: bool = False
    gone: str | None = None  # why it left memory (its later requests are refused saying so)


@dataclass(frozen=True)
class BaseModelInfo:
    """What callers above the engine may know about a loaded base model."""

    name: str  # canonical name, as models and checkpoints record it
    path: str  # local folder of its weights and tokenizer (what the SDK's get_tokenizer loads)
    model_type: str  # the HF architecture name, e.g. "llama"
    max_context: int
    vocab_size: int


class PolicyVersion(NamedTuple):
    """A sampleable policy: its base model and the engine's snapshot id (None = the bare base)."""

    base_model: str
    policy: str | None


def checkpoint_owner(meta: dict[str, Any]) -> str:
    """The tenant a checkpoint's manifest metadata names (checkpoints that name none are local)."""
    return str(meta.get("tenant", LOCAL_TENANT))


def _content_id(folder: Path) -> str:
    """A short id of a checkpoint's content: the digest of its manifest's file checksums."""
    files = read_manifest(folder)["files"]
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:16]


def _str_dict(d: Mapping[str, Any] | None) -> dict[str, str] | None:
    return None if d is None else {str(k): str(v) for k, v in d.items()}


class Runtime:
    def __init__(
        self,
        data_dir: str | Path | None = None,
        config: RuntimeConfig | None = None,
        *,
        sessions: Sessions | None = None,
        is_public: Callable[[str], bool] | None = None,
        **settings: Any,
    ) -> None:
        """A runtime over ``data_dir`` (default :func:`default_data_dir`) with ``config`` (default:
        every :class:`~opentinker.service.config.RuntimeConfig` default), its fields named in
        ``settings`` replaced: ``Runtime(dir, trainer_workers=2, data_parallel=2)``. An unknown
        setting raises ``TypeError``; settings that cannot work together, a ``dtype`` the device
        has not, or workers the cluster cannot meet raise ``ValueError`` here
        (:class:`~opentinker.service.scaleout.ScaleOut`)."""
        cfg = self.config = runtime_config(config, settings)
        self.dtype = dtype_name(resolve_dtype(cfg.dtype, cfg.device))  # a name: it travels to workers as is
        check_rollout_options(cfg.rollout_workers, cfg.rollout_backend, vllm_options(self.config))
        self.data_dir = Path(data_dir) if data_dir is not None else default_data_dir()
        # the server passes its store's published check and its durable sessions
        self.is_public: Callable[[str], bool] = is_public or (lambda path: False)
        self.sessions = sessions or Sessions(MemorySessionStore())
        self.models: dict[str, ModelRecord] = {}
        self._stacks: dict[str, BaseStack] = {}
        self._lock = threading.RLock()
        self._model_seq = itertools.count(1)
        # (base model, tinker path) -> (manifest digests, snapshot id): see _weights_source
        self._weight_sources: OrderedDict[tuple[str, str], tuple[str, str]] = OrderedDict()
        # checked (and Ray connected) before anything is written: a refused start leaves no data dir
        self.scaleout = ScaleOut(
            cfg,
            dtype=self.dtype,
            data_dir=self.data_dir,
            checkpoints=lambda: self.store,
            models=self.models,
            stacks=self._loaded,
        )
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.budget = memory_budget(cfg.memory_budget, self.data_dir / "pages")
        self.store = CheckpointStore(self.data_dir)
        self.external = ExternalStore(self.data_dir)

    def _loaded(self) -> dict[str, BaseStack]:
        with self._lock:
            return dict(self._stacks)

    def base_stack(self, base_model: str) -> BaseStack:
        """The engine, sampler and scheduler of ``base_model``, loaded on first use. The clients
        queue their work on its scheduler; callers above the service layer use the accessors below."""
        name = canonical_name(base_model)
        with self._lock:
            b = self._stacks.get(name)
            if b is None:
                base = self.scaleout.front_base(name) or load_base_model(
                    name, dtype=self.dtype, device=self.config.device
                )
                pages = self.data_dir / "pages"
                engine = Engine(
                    base, max_rank=self.config.max_rank, device=self.config.device, budget=self.budget,
                    pages=lambda: PageFiles(page_folder(pages)),
                )  # fmt: skip
                sampler, decoder = self._sampler(engine)

                # sampling on its own thread, continuous batching
                def loop() -> SamplingService:
                    return SamplingLoop(SamplingCore(decoder(), sampler))

                b = BaseStack(engine, sampler, self.scaleout.scheduler_for(name, engine, loop))
                self._stacks[name] = b
            return b

    def _sampler(self, engine: Engine) -> tuple[SamplingBackend, Callable[[], Decoder]]:
        """The rollout backend over ``engine`` and how to make its loop's decoder."""
        cache = self.config.prefix_cache_bytes  # per base model's sampler
        if self.config.rollout_backend == "vllm":  # vLLM, and the native backend where vLLM cannot serve
            opts = vllm_options(self.config)
            lora_bytes = engine.state_bytes(LoRAConfig(rank=opts["max_lora_rank"])) // 4  # weights only
            cpu = vllm_cpu_loras(self.budget.limit, lora_bytes, int(opts.get("max_loras", 16)))
            opts.setdefault("max_cpu_loras", cpu)
            rb = RoutedBackend.for_engine(engine, prefix_cache_bytes=cache, **opts)
            return rb, rb.decoder
        nb = NativeBackend(engine, prefix_cache_bytes=cache)
        return nb, lambda: nb.decoder(snapshots_only=True)

    def loaded_base_models(self) -> list[str]:
        return list(self._stacks)

    def supported_models(self) -> list[str]:
        """The base models it can serve: those loaded, then the built-in names."""
        return list(dict.fromkeys([*self.loaded_base_models(), *BUILTIN_MODELS]))

    def base_model_info(self, base_model: str) -> BaseModelInfo:
        """Name, folder, architecture and limits of ``base_model`` (loaded on first use)."""
        engine = self.base_stack(base_model).engine
        base = engine.base
        return BaseModelInfo(base.name, base.path, base.model_type, engine.max_context, engine.vocab_size)

    def tokenizer(self, base_model: str) -> Any:
        """The base model's tokenizer (a ``transformers`` tokenizer), shared by all its adapters."""
        return self.base_stack(base_model).engine.base.tokenizer

    def vision(self, base_model: str) -> Vision | None:
        """A vision-language base model's image side (None: text-only)."""
        return self.base_stack(base_model).engine.base.vision

    def tick_record(self, base_model: str, tick: int) -> TickRecord | None:
        """When tick ``tick`` of ``base_model``'s scheduler ran and what it fused (recent ticks)."""
        with self._lock:
            b = self._stacks.get(canonical_name(base_model))
        return None if b is None else b.scheduler.tick_record(tick)

    def new_model_id(self, session_id: str) -> str:
        return model_id_in(session_id, next(self._model_seq))

    # ------------------------------------------------------------------ models
    def model(self, model_id: str, tenant: str | None = None) -> ModelRecord:
        """The live model ``model_id``; another tenant's model is unknown, a deleted one refused."""
        rec = self.models.get(model_id)
        if rec is None or (tenant is not None and rec.tenant != tenant):
            raise UnknownPolicyError(f"unknown model {model_id!r}")
        if rec.deleted:
            raise EngineError(rec.gone or f"model {model_id!r} was deleted")
        return rec

    def create_model(
        self,
        model_id: str,
        base_model: str,
        config: LoRAConfig,
        *,
        tenant: str,
        optimizer_type: str = "adamw",
        on_created: Callable[[ModelRecord], None] | None = None,
        user_metadata: Mapping[str, Any] | None = None,
    ) -> Future[ModelRecord]:
        """A fresh adapter ``model_id`` on ``base_model``, owned by ``tenant`` (queued), with the
        SDK's ``user_metadata`` on its record; data-parallel over the trainer workers its
        ``{"data_parallel": "k"}`` asks for (default: the runtime's ``data_parallel``), a degree
        it cannot serve refused here (``ValueError``, nothing queued).

        ``on_created`` runs on the scheduler thread right after the model is registered, before
        any later request for it can run (the server records it durably there)."""
        check_optimizer_config({"type": optimizer_type})
        degree = self.scaleout.check_data_parallel(self.asked_data_parallel(user_metadata))
        meta = _str_dict(user_metadata)
        self._check_new(model_id)
        backend = self.base_stack(base_model)

        def make(eng: Trainer) -> ModelRecord:
            self.scaleout.create_adapter(eng, config, model_id, degree)
            rec = ModelRecord(
                model_id, eng.base.name, config, tenant, data_parallel=degree, user_metadata=meta
            )
            return self._register(rec, on_created)

        return backend.scheduler.submit_call(ModelQueue(model_id), make)

    def create_model_from_checkpoint(
        self,
        model_id: str,
        path: str,
        *,
        tenant: str,
        optimizer: bool,
        base_model: str | None = None,
        on_created: Callable[[ModelRecord], None] | None = None,
        user_metadata: Mapping[str, Any] | None = None,
    ) -> Future[ModelRecord]:
        """A model ``model_id`` loaded from ``tenant``'s checkpoint at ``path`` (with its optimizer
        state if ``optimizer``), on the base model it was trained on (queued), with
        ``user_metadata`` on its record; data-parallel over the trainer workers its
        ``{"data_parallel": "k"}`` asks for, by default the degree the checkpoint records where the
        workers can hold it (else one, the record's ``note`` says why: ``ScaleOut.checkpoint_degree``)."""
        asked = self.asked_data_parallel(user_metadata)
        meta_in = _str_dict(user_metadata)
        ref, meta = self.checkpoint(path, tenant)
        ckpt_base = str(meta.get("base_model", ""))
        if base_model is not None and canonical_name(base_model) != ckpt_base:
            raise CheckpointError(f"checkpoint {path} was trained on {ckpt_base!r}, not on {base_model!r}")
        self._check_new(model_id)
        backend = self.base_stack(ckpt_base)
        folder = self.store.folder(ref)

        def make(eng: Trainer) -> ModelRecord:
            degree, note = self.scaleout.checkpoint_degree(eng, asked, meta)
            if degree > 1:  # every replica reads the checkpoint (storage every worker reads)
                data_parallel_of(eng).load_data_parallel(folder, model_id, degree, optimizer=optimizer)
            elif optimizer:
                eng.load_state(folder, adapter_id=model_id, optimizer=True)
            else:  # weights only: a copy of the checkpoint's weights, read from disk once
                eng.fork_adapter(self._weights_source(eng, ref), model_id, parent=str(folder))
            config = eng.adapter_config(model_id)
            rec = ModelRecord(
                model_id, eng.base.name, config, tenant, ref.tinker_path, data_parallel=degree, note=note,
                user_metadata=meta_in,
            )  # fmt: skip
            return self._register(rec, on_created)

        return backend.scheduler.submit_call(ModelQueue(model_id), make)

    def asked_data_parallel(self, user_metadata: Mapping[str, Any] | None) -> int | None:
        """The data-parallel degree a new model's ``user_metadata`` asks for (its
        ``"data_parallel"``, an integer or its text; None: it asks for none), checked against the
        trainer workers: ``ValueError`` naming the value and the workers."""
        value = (user_metadata or {}).get("data_parallel")
        return None if value is None else self.scaleout.data_parallel_degree(value)

    def load_checkpoint_into(self, model_id: str, path: str, *, optimizer: bool) -> Future[None]:
        """Replace live model ``model_id``'s weights (and optimizer state) with those of a
        checkpoint its tenant owns, in the model's order."""
        rec = self.model(model_id)
        ref, _ = self.checkpoint(path, rec.tenant)
        folder = self.store.folder(ref)

        def load(eng: Trainer) -> None:
            if optimizer:
                eng.load_state(folder, optimizer=True, into=model_id)
            else:  # weights only: a copy of the checkpoint's weights, read from disk once
                source = self._weights_source(eng, ref)
                have, want = eng.adapter_weights(source).config, eng.adapter_config(model_id)
                if not want.same_layout(have):
                    raise CheckpointError(
                        f"checkpoint {ref.tinker_path} has LoRA config {have}, model {model_id!r} has {want}"
                    )
                eng.fork_adapter(source, into=model_id, parent=str(folder))
            rec.parent = ref.tinker_path

        return self.base_stack(rec.base_model).scheduler.submit_call(ModelQueue(model_id), load)

    def delete_model(
        self, model_id: str, tenant: str | None = None, *, why: str | None = None
    ) -> Future[None]:
        """Drop model ``model_id``: refused from now on (saying ``why``, default "was deleted"), its
        adapter freed after the requests already queued for it. Its checkpoints stay."""
        rec = self.model(model_id, tenant)
        rec.deleted, rec.gone = True, why
        return self.base_stack(rec.base_model).scheduler.submit_call(
            ModelQueue(model_id), lambda eng: eng.delete_adapter(model_id)
        )

    def _weights_source(self, eng: Trainer, ref: CheckpointRef) -> str:
        """The snapshot holding checkpoint ``ref``'s weights, loaded on first use and kept for the
        next weight-only load of the same checkpoint (many models forked from one policy save:
        test-time training's one adapter per episode). Runs on the scheduler's thread. The key is
        the manifest's file digests, so an overwritten checkpoint is read again; the
        :data:`WEIGHTS_CACHE` most recently used checkpoints stay in memory."""
        folder = self.store.folder(ref)
        stamp = json.dumps(read_manifest(folder).get("files", {}), sort_keys=True)
        key = (eng.base.name, ref.tinker_path)
        with self._lock:
            hit = self._weight_sources.get(key)
            if hit is not None and hit[0] == stamp and hit[1] in eng.snapshot_ids():
                self._weight_sources.move_to_end(key)
                return hit[1]
        sid = f"checkpoint-weights:{ref.tinker_path}#{next(self._model_seq)}"
        eng.load_snapshot(folder, sid)
        evicted: list[str] = []
        with self._lock:
            old = self._weight_sources.pop(key, None)
            if old is not None:
                evicted.append(old[1])
            self._weight_sources[key] = (stamp, sid)
            while len(self._weight_sources) > WEIGHTS_CACHE:
                k, (_, s) = next(iter(self._weight_sources.items()))
                if k[0] != eng.base.name:  # another base model's: freed on its own thread
                    self._weight_sources.move_to_end(k)
                    break
                del self._weight_sources[k]
                evicted.append(s)
        for s in evicted:
            with contextlib.suppress(UnknownPolicyError):
                eng.release_snapshot(s)
        return sid

    def _check_new(self, model_id: str) -> None:
        if model_id in self.models:
            raise EngineError(f"model {model_id!r} already exists")

    def _register(self, rec: ModelRecord, on_created: Callable[[ModelRecord], None] | None) -> ModelRecord:
        self.models[rec.model_id] = rec
        if on_created is not None:
            on_created(rec)
        return rec

    # ------------------------------------------------------------------ policy versions
    def snapshot(self, model_id: str) -> Future[SnapshotInfo]:
        """An immutable, sampleable copy of the model's weights, taken in the model's order."""
        rec = self.model(model_id)
        return self.base_stack(rec.base_model).scheduler.submit_call(
            ModelQueue(model_id), lambda eng: eng.snapshot(model_id)
        )

    def release_snapshot(self, base_model: str, snapshot_id: str, *, queue: str | None = None) -> None:
        """Free a snapshot's weights, queued after the requests already on model ``queue``'s
        queue (default: the snapshot's own). Nothing to do once the runtime is shut down."""
        backend = self._stacks.get(canonical_name(base_model))
        if backend is None:
            return
        with contextlib.suppress(RuntimeError):  # a shut-down scheduler has nothing left to free
            key = ModelQueue(queue) if queue else VersionQueue(snapshot_id)
            backend.scheduler.submit_call(key, lambda eng: eng.release_snapshot(snapshot_id))

    def follow_inflight(self, base_model: str, model_id: str, snapshot_id: str) -> None:
        """``model_id``'s inflight sample requests move to snapshot ``snapshot_id`` mid-decode."""
        backend = self._stacks.get(canonical_name(base_model))
        if backend is not None:
            with contextlib.suppress(RuntimeError):  # shut down: nothing is decoding
                backend.scheduler.follow(model_id, snapshot_id)

    def note_sampled(self, base_model: str, policy: str, version: str) -> None:
        """Lineage: data may now come from ``version``; remember it on the model it was taken from."""
        backend = self._stacks.get(canonical_name(base_model))
        if backend is None:
            return
        try:
            owner = backend.engine.snapshot_info(policy).adapter_id
        except KeyError:
            return
        rec = self.models.get(owner)
        if rec is not None:
            rec.sampled_versions.add(version)

    def load_checkpoint_policy(self, path: str, tenant: str) -> Future[PolicyVersion]:
        """Serve ``tenant``'s saved checkpoint (weights or sampler_weights) as a policy version,
        loaded once; queued on its model's order when that model is live here."""
        ref, meta = self.checkpoint(path, tenant)
        base = str(meta.get("base_model", ""))
        backend = self.base_stack(base)
        folder = self.store.folder(ref)

        def load(eng: Trainer) -> PolicyVersion:
            # keyed by content as well as path: a checkpoint saved again under the same name
            # (overwrite) is a new policy version, while samplers made earlier keep the old one
            policy = f"{ref.tinker_path}@{_content_id(folder)}"
            if policy not in eng.snapshot_ids():
                eng.load_snapshot(folder, policy)
            return PolicyVersion(eng.base.name, policy)

        return backend.scheduler.submit_call(ModelQueue(ref.model_id), load)

    def export_checkpoint_peft(self, path: str, tenant: str, out_dir: str | Path) -> Future[Path]:
        """Write ``tenant``'s checkpoint at ``path`` (weights or sampler_weights) to ``out_dir`` as a
        PEFT adapter folder, loaded as a temporary snapshot (released after), in its model's order."""
        ref, meta = self.checkpoint(path, tenant)
        backend = self.base_stack(str(meta.get("base_model", "")))
        folder = self.store.folder(ref)
        snapshot_id = f"export-{uuid.uuid4().hex}"

        def export(eng: Trainer) -> Path:
            eng.load_snapshot(folder, snapshot_id)
            try:
                return eng.export_peft(snapshot_id, out_dir)
            finally:
                eng.release_snapshot(snapshot_id)

        return backend.scheduler.submit_call(ModelQueue(ref.model_id), export)

    def save_external(
        self, model_id: str, name: str, *, recipients: list[str] | None = None
    ) -> Future[ExternalRecord]:
        """Export live model ``model_id`` in hosted Tinker's adapter layout (what the cookbook's
        ``weights`` converters read; :mod:`opentinker.engine.tinker_format`) to
        ``tinker://<model_id>/external_weights/<name>`` (encrypted to ``recipients`` if given), in
        the model's order."""
        rec = self.model(model_id)
        parsed = parse_recipients(recipients)  # a bad recipient is refused before anything is queued
        if self.external.exists(model_id, name):
            raise CheckpointError(
                f"external weights tinker://{model_id}/external_weights/{name} already exist"
            )
        meta = {
            "tenant": rec.tenant,
            "model_id": model_id,
            "base_model": rec.base_model,
            "lora": dataclasses.asdict(rec.lora),
            "parent": rec.parent,
        }

        def export(eng: Trainer) -> ExternalRecord:
            return self.external.write(
                model_id, name, lambda folder: eng.export_tinker(model_id, folder), meta, parsed
            )

        return self.base_stack(rec.base_model).scheduler.submit_call(ModelQueue(model_id), export)

    # ------------------------------------------------------------------ tenancy of checkpoints
    def checkpoint(self, path: str, tenant: str) -> tuple[CheckpointRef, dict[str, Any]]:
        """The checkpoint at ``path`` and its manifest metadata, if ``tenant`` may use it: it is
        theirs, or :attr:`is_public` says it is published.

        Raises ``EngineError`` for a malformed path, ``CheckpointError`` when nothing usable is
        there, and ``UnknownPolicyError`` for another tenant's: to them it does not exist.
        """
        ref = parse_tinker_path(path)
        folder = self.store.folder(ref)
        try:
            meta: dict[str, Any] = read_manifest(folder)["meta"]
        except CheckpointError as e:  # the reason, with the tinker path in place of the folder
            reason = str(e).replace(str(folder), ref.tinker_path)
            raise CheckpointError(f"no usable checkpoint at {ref.tinker_path}: {reason}") from e
        if checkpoint_owner(meta) != tenant and not self.is_public(ref.tinker_path):
            raise UnknownPolicyError(f"unknown checkpoint {path!r}")
        return ref, meta

    def owns(self, meta: dict[str, Any], tenant: str) -> bool:
        """Whether checkpoint metadata (a manifest's ``meta``) belongs to ``tenant``."""
        return checkpoint_owner(meta) == tenant

    def engine_stats(self, *, trainers: bool = True) -> list[dict[str, Any]]:
        """Per loaded base model, the engine's counters since start-up (cumulative; a reader
        takes rates from two readings) and what is queued now: the console's live page
        (``trainers=False``: without asking each Ray trainer worker for its own)."""
        with self._lock:
            backends = dict(self._stacks)
        out = []
        for name, b in backends.items():
            sched, cache = b.scheduler, getattr(b.sampler, "prefix_cache", None)  # vLLM keeps its own
            rollout = getattr(sched.rollout, "stats", None)  # the loop's, or the worker pool's
            out.append(
                {
                    "base_model": name,
                    "time": time.time(),
                    "ticks": dataclasses.asdict(sched.stats),
                    "queue_depths": sched.queue_depths(),
                    "rollout": None if rollout is None else dataclasses.asdict(rollout),
                    "prefix_cache": None
                    if cache is None
                    else {
                        "lookups": cache.lookups,
                        "hits": cache.hits,
                        "reused_tokens": cache.reused_tokens,
                        "bytes": cache.nbytes,
                    },
                    "models": sum(1 for r in self.models.values() if r.base_model == name and not r.deleted),
                    "paging": {**b.engine.pages.counts(), "budget": self.budget.limit},
                }
            )
            if isinstance(b.sampler, RoutedBackend):  # vLLM with its native fallback
                out[-1]["served_by"] = [
                    {**s, "model_id": self._snapshot_owner(b, s["snapshot"])} for s in b.sampler.served_by()
                ]
                out[-1]["base_served_by"] = b.sampler.base_served_by()
            if trainers:
                out[-1].update(self.scaleout.trainer_stats(name))  # trained on Ray trainer workers
        return out

    def snapshot_ids(self, base_model: str) -> list[str]:
        """The snapshots ``base_model``'s engine holds now (``<model>@v<n>``, loaded checkpoints)."""
        return self.base_stack(base_model).engine.snapshot_ids()

    def _snapshot_owner(self, b: BaseStack, policy: str) -> str | None:
        """The model a snapshot was taken from (a loaded checkpoint's: the model it was saved from)."""
        if policy.startswith("tinker://"):
            with contextlib.suppress(EngineError):
                return parse_tinker_path(policy.rsplit("@", 1)[0]).model_id
            return None
        with contextlib.suppress(KeyError, EngineError):
            return b.engine.snapshot_info(policy).adapter_id
        return None

    def shutdown(self) -> None:
        with self._lock:
            for b in self._stacks.values():
                b.scheduler.shutdown()
                close = getattr(b.sampler, "close", None)
                if callable(close):
                    close()
                b.engine.pages.close()  # page files are not checkpoints: they go with the runtime
            self._stacks.clear()
        self.scaleout.shutdown()


_default: Runtime | None = None
_default_lock = threading.Lock()


def default_runtime() -> Runtime:
    global _default
    with _default_lock:
        if _default is None:
            _default = Runtime()
        return _default
