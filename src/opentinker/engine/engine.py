"""The engine: one frozen base model, many LoRA adapters, fused training across adapters.

Pure compute and state — no HTTP, no threads. Whoever owns an ``Engine`` (the scheduler) calls it
from one thread at a time. The API, in the order an adapter's life uses it::

    eng = Engine("opentinker/tiny")
    aid = eng.create_adapter(LoRAConfig(rank=8, seed=0))          # any time; capacity is not fixed
    [res] = eng.forward_backward_many([ForwardRequest(aid, examples, "cross_entropy")])
    eng.optim_step(aid, AdamParams(learning_rate=1e-4))            # this adapter only
    snap = eng.snapshot(aid)                                       # immutable policy version
    eng.save_state(aid, path) / eng.load_state(path)               # weights + optimizer, checksummed
    eng.export_peft(aid, out_dir)                                  # PEFT / vLLM format
    eng.export_merged(aid, out_dir)                                # full HF model, adapter merged
    with eng.routing([aid, snap.snapshot_id, None]): model(...)    # per-row policies, for samplers

``forward_backward_many`` is the "clock cycle": all requests — any adapters, snapshots, losses,
forward-only or not — share ONE forward pass over one padded batch and ONE backward. Each datum
is self-contained (losses are sums; base weights are frozen), so batching changes nobody's
gradient. Gradients are taken with ``torch.autograd.grad`` into per-adapter accumulators and
checked for NaN/inf per adapter before they are added, so a bad request cannot poison state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from opentinker.engine.checkpoint import (
    ADAPTER_FILE,
    OPTIMIZER_FILE,
    CheckpointError,
    read_adapter,
    write_checkpoint,
)
from opentinker.engine.custom_loss import reduce_metrics
from opentinker.engine.exports import EngineExports
from opentinker.engine.images import check_images
from opentinker.engine.losses import LOSSES, resolve_config
from opentinker.engine.model_state import (
    CODECS,
    AdapterRecord,
    AdapterState,
    _paged,
    check_config,
    check_room,
    state_bytes,
)
from opentinker.engine.optim import AdapterOptimizer, finite_each, step_many
from opentinker.engine.paging import MemoryBudget, PagedTable, PageFiles, Tier
from opentinker.engine.passes import fused_logprobs
from opentinker.engine.types import (
    AdamParams,
    EngineError,
    ForwardRequest,
    ForwardResult,
    PolicyRef,
    SnapshotInfo,
    UnknownPolicyError,
)
from opentinker.engine.validate import validate_request
from opentinker.lora import LoRABatch, LoRAConfig, LoRAWeights, MultiLoRA, init_lora_weights
from opentinker.models import BaseModel, load_base_model


class Engine(EngineExports):
    data_parallel: None = None  # a Trainer: every model trains in this process (engine/trainer.py)

    def __init__(
        self,
        base_model: str | BaseModel = "opentinker/tiny",
        *,
        max_rank: int = 128,
        max_batch_tokens: int = 1 << 17,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = torch.float32,  # the base's, when loaded here
        share_prefixes: bool = True,
        budget: MemoryBudget | None = None,
        pages: Tier | Callable[[], Tier] | str | Path | None = None,
    ) -> None:
        """``budget``: bytes of models' state kept in memory (shared; default no limit), the rest
        paged to ``pages`` (a :class:`Tier` or a folder of page files: ``engine/paging.py``)."""
        self.share_prefixes = share_prefixes  # compute prefixes shared by rows once (engine/prefix.py)
        self.base = (
            base_model
            if isinstance(base_model, BaseModel)
            else load_base_model(base_model, dtype=dtype, device=device or "cpu")
        )
        # a loaded base model brings its device (an engine on another device than its base can't run)
        self.device = (
            torch.device(device) if device is not None else next(self.base.model.parameters()).device
        )
        self.max_rank = max_rank
        self.max_batch_tokens = max_batch_tokens
        self.lora = MultiLoRA.attach(self.base.model)
        self.budget = budget or MemoryBudget(None)
        tier = PageFiles(pages) if isinstance(pages, (str, Path)) else pages
        self.pages = PagedTable(self.budget, tier, CODECS, self.device)  # every model's state
        self._adapters: dict[str, AdapterRecord] = {}  # always resident; their state pages
        self._snapshots: dict[str, SnapshotInfo] = {}  # their weights page (entry = snapshot id)
        self._ids = itertools.count()

    # ------------------------------------------------------------------ paging
    def paged_tick(self, models: list[str], upcoming: list[str]) -> contextlib.AbstractContextManager[None]:
        """One tick's scope: ``models`` (and what it uses) stay resident until it ends, when the budget
        is fitted; ``upcoming`` (the next tick's) page in meanwhile, in the background, and stay."""
        if self.budget.limit is not None:
            self.pages.prefetch(upcoming)
        return self.pages.scope(models)

    # ------------------------------------------------------------------ adapters
    @property
    def vocab_size(self) -> int:
        return self.base.vocab_size

    @property
    def max_context(self) -> int:
        return self.base.max_context

    @_paged
    def create_adapter(self, config: LoRAConfig, adapter_id: str | None = None) -> str:
        self._check_config(config)
        if adapter_id is None:
            adapter_id = f"adapter-{next(self._ids)}"
            while adapter_id in self._adapters:
                adapter_id = f"adapter-{next(self._ids)}"
        elif adapter_id in self._adapters or "@" in adapter_id:
            raise EngineError(f"adapter id {adapter_id!r} is taken or contains '@'")
        check_room(self.pages, self.state_bytes(config), config.rank)
        weights = init_lora_weights(config, self.lora.groups, device=self.device)
        self._adapters[adapter_id] = AdapterRecord(adapter_id, config, self.pages)
        self.pages.add(adapter_id, "adapter", AdapterState(weights, AdapterOptimizer(weights)))
        return adapter_id

    def state_bytes(self, config: LoRAConfig) -> int:
        """The most memory one adapter of ``config`` holds: weights, gradients, two moments, step."""
        return state_bytes(config, self.lora.groups)

    def check_room(self, config: LoRAConfig) -> None:
        """Raise what ``create_adapter(config)`` would for memory (larger than the budget; no room while
        page files cannot be written: ``PagingFull``), from any thread, changing nothing."""
        check_room(self.pages, self.state_bytes(config), config.rank, fit=False)

    def _check_config(self, config: LoRAConfig) -> None:
        check_config(config, self.lora, self.max_rank)

    @_paged
    def fork_adapter(
        self,
        source: str,
        adapter_id: str | None = None,
        *,
        into: str | None = None,
        parent: str | None = None,
    ) -> str:
        """A new adapter (or adapter ``into``, overwritten) whose weights are a copy of adapter or
        snapshot ``source``'s, with a fresh optimizer: an in-memory copy, no file read. The copy
        owns its tensors, so training it leaves ``source`` bitwise unchanged (and vice versa)."""
        src = self.adapter_weights(source)
        step = self._adapters[source].step if source in self._adapters else self.snapshot_info(source).step
        if into is not None:
            target = self._adapter(into)
            if not target.config.same_layout(src.config):
                raise EngineError(
                    f"{source!r} has LoRA config {src.config}, adapter {into!r} has {target.config}"
                )
            aid = into
        else:
            aid = self.create_adapter(src.config, adapter_id)
        weights = src.clone(requires_grad=True)
        a = self._adapters[aid]
        a.replace(weights, AdapterOptimizer(weights))
        a.parent, a.step = parent or source, step
        return aid

    def delete_adapter(self, adapter_id: str) -> None:
        """Forget an adapter (its snapshots stay until released: pinned samplers keep working)."""
        self._adapter(adapter_id)
        del self._adapters[adapter_id]
        self.pages.remove(adapter_id)

    def adapter_ids(self) -> list[str]:
        return list(self._adapters)

    def has_adapter(self, adapter_id: str) -> bool:
        return adapter_id in self._adapters

    def adapter_config(self, adapter_id: str) -> LoRAConfig:
        return self._adapter(adapter_id).config

    def adapter_step(self, adapter_id: str) -> int:
        return self._adapter(adapter_id).step

    def adapter_weights(self, ref: PolicyRef) -> LoRAWeights:
        """The live weights of an adapter, or a snapshot's. Treat as read-only."""
        w = self._resolve(ref)
        if w is None:
            raise UnknownPolicyError("the base model has no LoRA weights")
        return w

    @_paged
    def optimizer_state(self, adapter_id: str) -> dict[str, torch.Tensor]:
        return self._adapter(adapter_id).optimizer.state_tensors()

    def adapter_lineage(self, adapter_id: str) -> dict[str, Any]:
        """What an adapter's history holds beyond its weights, optimizer and step: the snapshots
        taken (its next policy version is ``versions + 1``) and the checkpoint it came from."""
        a = self._adapter(adapter_id)
        return {"versions": a.versions, "parent": a.parent}

    def set_adapter_lineage(self, adapter_id: str, *, versions: int, parent: str | None) -> None:
        """Put back an adapter's lineage (a model moved to another engine numbers on as before)."""
        a = self._adapter(adapter_id)
        a.versions, a.parent = int(versions), parent

    def _adapter(self, adapter_id: str) -> AdapterRecord:
        a = self._adapters.get(adapter_id)
        if a is None:
            raise UnknownPolicyError(f"unknown adapter {adapter_id!r}")
        return a

    def _resolve(self, ref: PolicyRef) -> LoRAWeights | None:
        if ref is None:
            return None
        if (a := self._adapters.get(ref)) is not None:
            return a.weights
        if ref in self._snapshots:
            w = self.pages.get(ref)
            self.pages.fit(keep=[ref])  # snapshots only: safe from the sampler's thread too
            return w
        raise UnknownPolicyError(f"unknown adapter or snapshot {ref!r}")

    # ------------------------------------------------------------------ compute
    def plan_routing(self, policies: list[PolicyRef]) -> LoRABatch | None:
        """Stack the distinct policies of a batch once; reuse (and ``.select`` rows of) the plan
        across many forwards, e.g. every decode step of a sampling batch."""
        order: dict[PolicyRef, int] = {}
        for p in policies:
            order.setdefault(p, len(order))
        entries = [self._resolve(p) for p in order]
        rows = torch.tensor([order[p] for p in policies], dtype=torch.long, device=self.device)
        return self.lora.make_batch(entries, rows)

    @contextmanager
    def routing(self, policies: list[PolicyRef] | LoRABatch | None) -> Iterator[None]:
        """Run the base model with row ``i`` going through ``policies[i]`` (or a prepared plan)."""
        plan = self.plan_routing(policies) if isinstance(policies, list) else policies
        with self.lora.use(plan):
            yield

    def forward_backward(self, req: ForwardRequest) -> ForwardResult:
        """One request on its own; raises :class:`EngineError` if it is refused."""
        [res] = self.forward_backward_many([req])
        if isinstance(res, Exception):
            raise res
        return res

    @_paged
    def forward_backward_many(self, reqs: list[ForwardRequest]) -> list[ForwardResult | EngineError]:
        """Run all requests in one fused forward (and one backward); a refused one fails alone."""
        results: list[ForwardResult | EngineError | None] = [None] * len(reqs)
        valid: list[int] = []
        for i, req in enumerate(reqs):
            try:
                validate_request(
                    req,
                    vocab_size=self.vocab_size,
                    max_context=self.max_context,
                    max_batch_tokens=self.max_batch_tokens,
                )
                check_images(req, self.base.vision)
                if req.backward and req.policy is None:
                    raise EngineError("cannot train the base model: forward_backward needs a live adapter")
                if req.backward and req.policy not in self._adapters:
                    raise UnknownPolicyError(
                        f"unknown adapter {req.policy!r}: forward_backward needs a live adapter, not a snapshot"
                    )
                self._resolve(req.policy)
                valid.append(i)
            except EngineError as e:
                results[i] = e
        if valid:
            self._run_fused(reqs, valid, results)
        return [r if r is not None else EngineError("request was not run") for r in results]

    def _run_fused(
        self, reqs: list[ForwardRequest], valid: list[int], results: list[ForwardResult | EngineError | None]
    ) -> None:
        policies: list[PolicyRef] = []
        rows: list[tuple[int, int]] = []  # (request index, example index) per batch row
        for i in valid:
            for j in range(len(reqs[i].examples)):
                policies.append(reqs[i].policy)
                rows.append((i, j))
        lengths = [int(reqs[i].examples[j].tokens_T.shape[0]) for i, j in rows]
        need_grad = any(reqs[i].backward for i in valid)
        with torch.set_grad_enabled(need_grad):
            lp_rows = self._row_logprobs(reqs, rows, policies, lengths)
            per_req_loss: dict[int, torch.Tensor] = {}
            per_req_out: dict[int, list[dict[str, torch.Tensor]]] = {i: [] for i in valid}
            per_req_metrics: dict[int, list[dict[str, torch.Tensor]]] = {}  # custom losses' own
            for b, (i, j) in enumerate(rows):
                req, ex = reqs[i], reqs[i].examples[j]
                inputs = {k: v.to(self.device) for k, v in ex.inputs.items()}
                targets = inputs["target_tokens"]
                lp = lp_rows[b].reshape(targets.shape)
                inputs = {k: (v if k == "target_tokens" else v.float()) for k, v in inputs.items()}
                if req.custom_loss is not None:  # a scalar per datum (engine/custom_loss.py)
                    try:
                        loss, metrics = req.custom_loss(lp, inputs)
                    except EngineError as e:
                        results[i] = e
                        continue
                    per_req_metrics.setdefault(i, []).append(metrics)
                    per_req_out[i].append({"logprobs": lp.detach()})
                else:
                    elementwise = LOSSES[req.loss_fn].fn(
                        lp, inputs, resolve_config(req.loss_fn, req.loss_fn_config)
                    )
                    loss = elementwise.sum()
                    per_req_out[i].append({"logprobs": lp.detach(), "elementwise_loss": elementwise.detach()})
                prev = per_req_loss.get(i)
                per_req_loss[i] = loss if prev is None else prev + loss
        ok: list[int] = []
        for i in valid:
            if results[i] is not None:  # its custom loss failed on this data
                continue
            if torch.isfinite(per_req_loss[i]).item():
                ok.append(i)
            else:
                results[i] = EngineError("the loss is NaN or inf for this data; nothing was updated")
        train = [i for i in ok if reqs[i].backward]
        if train:
            self._accumulate(reqs, train, per_req_loss, results)
        for i in ok:
            if results[i] is None:
                metrics = reduce_metrics(per_req_metrics.get(i, []))
                results[i] = ForwardResult(
                    per_req_out[i], {**metrics, "loss:sum": float(per_req_loss[i].detach())}
                )

    def _row_logprobs(
        self,
        reqs: list[ForwardRequest],
        rows: list[tuple[int, int]],
        policies: list[PolicyRef],
        lengths: list[int],
    ) -> list[torch.Tensor]:
        """Each row's logprobs of its targets, ``[T, K]``: with shared prefixes computed once when
        that saves enough (see ``engine/prefix.py``), else in one right-padded forward, rows of very
        different lengths in separate passes (``engine/passes.py``)."""
        examples = [reqs[i].examples[j] for i, j in rows]
        targets = [
            ex.inputs["target_tokens"].long().reshape(n, -1).to(self.device)
            for ex, n in zip(examples, lengths, strict=False)
        ]
        return fused_logprobs(
            self.base.model,
            self.routing,
            self.base.vision,
            list(policies),
            examples,
            targets,
            self.share_prefixes,
        )

    def _accumulate(
        self,
        reqs: list[ForwardRequest],
        train: list[int],
        per_req_loss: dict[int, torch.Tensor],
        results: list[ForwardResult | EngineError | None],
    ) -> None:
        adapters = list(dict.fromkeys(reqs[i].policy for i in train))
        params: list[torch.Tensor] = []
        owners: list[tuple[str, str]] = []
        for aid in adapters:
            assert aid is not None
            for name, p in self._adapters[aid].weights.state_dict().items():
                params.append(p)
                owners.append((aid, name))
        total = torch.stack([per_req_loss[i] for i in train]).sum()
        grads = torch.autograd.grad(total, params, allow_unused=True)
        full = [g if g is not None else torch.zeros_like(p) for p, g in zip(params, grads, strict=True)]
        by_adapter: dict[str, dict[str, torch.Tensor]] = {aid: {} for aid in adapters if aid is not None}
        for (aid, name), g in zip(owners, full, strict=True):
            by_adapter[aid][name] = g
        flat = {aid: self._adapters[aid].optimizer.flat_grads(new) for aid, new in by_adapter.items()}
        for (aid, new), ok in zip(flat.items(), finite_each(list(flat.values())), strict=True):
            if not ok:
                for i in train:
                    if reqs[i].policy == aid:
                        results[i] = EngineError(
                            "the gradient is NaN or inf for this data; nothing was updated"
                        )
                continue
            a = self._adapters[aid]
            if a.grads is None:
                a.grads = new
            else:
                a.grads += new

    def optim_step(self, adapter_id: str, params: AdamParams) -> dict[str, float]:
        """AdamW on one adapter with its accumulated gradients (zeros if none), then clear them."""
        [res] = self.optim_step_many([(adapter_id, params)])
        if isinstance(res, EngineError):
            raise res
        return res

    @_paged
    def optim_step_many(self, items: list[tuple[str, AdamParams]]) -> list[dict[str, float] | EngineError]:
        """Several adapters' ``optim_step`` at once (a tick's): each result, weights and moments
        bitwise what its own ``optim_step`` gives (``engine/optim.py`` ``step_many``); a refused
        one is an :class:`EngineError` in its place and changes nothing of that adapter."""
        ids = [aid for aid, _ in items]
        if len(set(ids)) != len(ids):  # one adapter twice: its steps in order, one at a time
            return [self.optim_step_many([item])[0] for item in items]
        out: list[dict[str, float] | EngineError | None] = [None] * len(items)
        batch, where = [], []
        for i, (aid, params) in enumerate(items):
            try:
                a = self._adapter(aid)
            except EngineError as e:
                out[i] = e
                continue
            grads = a.grads if a.grads is not None else torch.zeros_like(a.optimizer.flat)
            batch.append((a.optimizer, grads, params))
            where.append(i)
        for i, res in zip(where, step_many(batch), strict=True):
            if not isinstance(res, EngineError):
                a = self._adapters[items[i][0]]
                a.grads = None
                a.step += 1
            out[i] = res
        return [r if r is not None else EngineError("optimizer step was not run") for r in out]

    @_paged
    def pending_gradients(self, adapter_id: str) -> dict[str, torch.Tensor] | None:
        """Gradients accumulated since the adapter's last ``optim_step`` (None if none), by weight
        name. Read-only."""
        a = self._adapter(adapter_id)
        return None if a.grads is None else a.optimizer.views(a.grads)

    @_paged
    def set_pending_gradients(self, adapter_id: str, grads: dict[str, torch.Tensor]) -> None:
        """Replace the adapter's accumulated gradients by ``grads`` (copied): how data-parallel
        replicas put in the sum of every replica's gradients before their optimizer steps. Every
        tensor is checked (names, shapes, finite) before any is set; a mismatch changes nothing."""
        a = self._adapter(adapter_id)
        named = a.weights.state_dict()
        if set(grads) != set(named):
            missing, extra = sorted(set(named) - set(grads)), sorted(set(grads) - set(named))
            raise EngineError(f"gradients for adapter {adapter_id!r} lack {missing} / have unknown {extra}")
        for name, p in named.items():
            g = grads[name]
            if tuple(g.shape) != tuple(p.shape):
                raise EngineError(f"gradient {name!r} has shape {tuple(g.shape)}, expected {tuple(p.shape)}")
            if not bool(torch.isfinite(g).all()):
                raise EngineError(f"gradient {name!r} is NaN or inf; nothing was updated")
        a.grads = a.optimizer.flat_grads(
            {n: grads[n].detach().to(p.device, p.dtype) for n, p in named.items()}
        )

    # ------------------------------------------------------------------ snapshots
    @_paged
    def snapshot(self, adapter_id: str) -> SnapshotInfo:
        """Copy the adapter's current weights into an immutable, sampleable policy version."""
        a = self._adapter(adapter_id)
        a.versions += 1
        weights = a.weights.clone(requires_grad=False)
        info = SnapshotInfo(f"{adapter_id}@v{a.versions}", adapter_id, a.versions, a.step, weights.nbytes())
        self._snapshots[info.snapshot_id] = info
        self.pages.add(info.snapshot_id, "snapshot", weights)
        return info

    def snapshot_info(self, snapshot_id: str) -> SnapshotInfo:
        s = self._snapshots.get(snapshot_id)
        if s is None:
            raise UnknownPolicyError(f"unknown snapshot {snapshot_id!r}")
        return s

    def release_snapshot(self, snapshot_id: str) -> None:
        if self._snapshots.pop(snapshot_id, None) is None:
            raise UnknownPolicyError(f"unknown snapshot {snapshot_id!r}")
        self.pages.remove(snapshot_id)

    def snapshot_ids(self) -> list[str]:
        return list(self._snapshots)

    # ------------------------------------------------------------------ checkpoints
    @_paged
    def save_state(
        self,
        ref: PolicyRef,
        path: str | Path,
        *,
        optimizer: bool = True,
        meta: dict[str, Any] | None = None,
        overwrite: bool = False,
    ) -> Path:
        """Write weights (and, for a live adapter, optimizer state) as a checksummed checkpoint."""
        weights = self.adapter_weights(ref)
        files = {ADAPTER_FILE: weights.state_dict()}
        record: dict[str, Any] = {"base_model": self.base.name, "lora": dataclasses.asdict(weights.config)}
        live = self._adapters.get(ref) if ref is not None else None
        if live is not None:
            record.update(step=live.step, parent=live.parent, source=ref)
            if optimizer:
                files[OPTIMIZER_FILE] = live.optimizer.state_tensors()
        else:
            info = self.snapshot_info(str(ref))
            record.update(
                step=info.step,
                parent=self._adapters[info.adapter_id].parent if info.adapter_id in self._adapters else None,
                source=ref,
            )
        record["has_optimizer"] = OPTIMIZER_FILE in files
        record.update(meta or {})
        return write_checkpoint(path, files, record, overwrite=overwrite)

    def _read_weights(
        self, path: str | Path
    ) -> tuple[LoRAWeights, dict[str, Any], dict[str, dict[str, torch.Tensor]]]:
        """Read and check a checkpoint's weights against this engine; changes no state."""
        return read_adapter(
            path, base_model=self.base.name, groups=self.lora.groups, device=self.device,
            check_config=self._check_config,
        )  # fmt: skip

    @_paged
    def load_state(
        self,
        path: str | Path,
        *,
        adapter_id: str | None = None,
        optimizer: bool = True,
        into: str | None = None,
    ) -> str:
        """Create an adapter from a checkpoint (or overwrite adapter ``into``); returns its id.

        Everything is read and checked before any state changes; a mismatch leaves all as it was.
        """
        loaded, meta, files = self._read_weights(path)
        config = loaded.config
        opt_tensors = files.get(OPTIMIZER_FILE) if optimizer else None
        new_opt = AdapterOptimizer(loaded)
        if opt_tensors:
            new_opt.load_state_tensors(opt_tensors)
        if into is not None:
            target = self._adapter(into)
            if not target.config.same_layout(config):
                raise CheckpointError(
                    f"checkpoint {path} has LoRA config {config}, adapter {into!r} has {target.config}"
                )
            target.replace(loaded, new_opt)
            target.parent = str(path)
            target.step = int(meta.get("step", 0))
            return into
        aid = self.create_adapter(config, adapter_id)
        a = self._adapters[aid]
        a.replace(loaded, new_opt)
        a.parent, a.step = str(path), int(meta.get("step", 0))
        return aid

    @_paged
    def load_snapshot(self, path: str | Path, snapshot_id: str) -> SnapshotInfo:
        """Serve a saved checkpoint's weights as an immutable snapshot (named sampler weights)."""
        loaded, meta, _ = self._read_weights(path)
        return self.add_snapshot(
            snapshot_id, loaded, adapter_id=str(meta.get("source") or ""), step=int(meta.get("step", 0))
        )

    @_paged
    def add_snapshot(
        self, snapshot_id: str, weights: LoRAWeights, *, adapter_id: str = "", step: int = 0
    ) -> SnapshotInfo:
        """Register ``weights`` (copied) as an immutable, sampleable snapshot ``snapshot_id``."""
        if snapshot_id in self._snapshots or snapshot_id in self._adapters:
            raise EngineError(f"policy id {snapshot_id!r} is already in use")
        groups, r = self.lora.groups, weights.rank
        for name in {*weights.a, *weights.b}:
            g = groups.get(name)
            a, b = weights.a.get(name), weights.b.get(name)
            if g is None or a is None or b is None or a.shape != g.a_shape(r) or b.shape != g.b_shape(r):
                raise EngineError(f"snapshot weights for {name!r} do not fit this base model")
        frozen = weights.clone(requires_grad=False)
        info = SnapshotInfo(snapshot_id, adapter_id, 0, step, frozen.nbytes())
        self._snapshots[snapshot_id] = info
        self.pages.add(snapshot_id, "snapshot", frozen)
        return info

    def check_policy(self, ref: PolicyRef) -> None:
        """Raise ``UnknownPolicyError`` unless ``ref`` is None, a live adapter or a snapshot."""
        self._resolve(ref)
