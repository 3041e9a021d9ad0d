"""A sharded model group: one copy of the frozen base split over K trainer workers with FSDP2.

``TrainerPool(..., shard_base=K)`` forms groups of K workers. In each group every worker's base
model is sharded with ``torch.distributed.fsdp.fully_shard`` over a K-member ``DeviceMesh``
(gloo on CPU, NCCL on GPU): each decoder layer is its own FSDP unit, then the root (embeddings,
final norm, unembedding), so every base weight is split K ways along its first dimension and
all-gathered one layer at a time for the forward and again for the backward.

**LoRA stays replicated.** The multi-LoRA layers wrap the base's ``Linear`` modules, but the
adapters' tensors are not module parameters: they live in each engine's adapter table and are
routed in per batch (:mod:`opentinker.lora.layers`). ``fully_shard`` shards the parameters it
finds under a module, so it takes only the frozen base weights (the wrapped ``Linear``'s own
weight included), and the LoRA weights, their Adam moments and gradients are plain, whole tensors
on every worker of the group: small (megabytes), and every worker holds every adapter.

**The group runs as one engine.** Worker 0 of a group (its *leader*) is the only one the router
sees: models are placed on it, and its scheduler fuses their ticks as on one worker. Its engine is
a :class:`ShardedEngine`, whose state-changing calls (create, load, fork, delete, snapshot,
pending gradients, lineage, optimizer steps) run on the other workers too, in the same order, so
every worker holds the same adapters. A fused tick's rows are split into K contiguous shares, one
per worker, run at once; each worker adds a one-row *idle* request (its own rank-1 adapter, zero
loss weights) so that every worker runs exactly one forward and, when the tick trains, one
backward through every layer: FSDP's all-gathers then meet, whatever rows a worker got (none
included). The new LoRA gradients of the tick are all-reduced (summed) over the group before
they are added to each adapter's accumulator, so every worker holds the whole batch's gradients
and takes the same AdamW step: the result is the unsharded one within fp32 rounding (rows summed
in another order). A loss or gradient that is not finite on any share refuses the adapter's
training in that tick on every worker alike. Shared-prefix training is off on a sharded engine
(its extra forwards depend on the rows a worker got).

**Loss.** A worker of the group that dies breaks the group: the call in flight and every later one
raise :class:`WorkerLostError` naming the group and the worker; the pool then stops the group's
other members, and auto-restore rebuilds it on fresh workers
(:meth:`~opentinker.cluster.trainer.TrainerPool.rebuild_group`). Each member loads only its
shard of the base (:mod:`opentinker.cluster.shard_load`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from opentinker.engine import Engine, EngineError, ForwardRequest, ForwardResult
from opentinker.engine.types import Example
from opentinker.engine.validate import validate_request
from opentinker.lora import LoRAConfig

IDLE = "__shard_idle__"  # each worker's own adapter for its idle row (never trained, never listed)
# Engine methods that change what a model is; the leader runs each on the other workers too
MIRRORED = frozenset(
    {
        "create_adapter", "fork_adapter", "delete_adapter", "load_state", "set_pending_gradients",
        "set_adapter_lineage", "snapshot", "release_snapshot", "add_snapshot", "load_snapshot",
        "optim_step_many",
    }
)  # fmt: skip


class WorkerLostError(EngineError):
    """The trainer worker that held a model is gone (or a member of its sharded group); the
    model's unsaved steps went with it."""

    worker: str = ""  # the lost worker's id, where known (a sharded group's member)


class ShardError(EngineError):
    """A sharded group that cannot be formed or has lost a worker."""


def decoder_layers(model: Any) -> list[torch.nn.Module]:
    """The model's decoder layers (the FSDP units), or :class:`ShardError` naming the family."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) == 0:
        kind = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        raise ShardError(f"model family {kind!r} has no decoder-layer list for --shard-base to shard")
    return list(layers)


def check_shardable(model: Any, k: int) -> None:
    """Refuse a degree the model's weights cannot be split by: every base weight is split along
    its first dimension, so each needs at least ``k`` rows (else a worker's share is empty)."""
    decoder_layers(model)
    for name, p in model.named_parameters():
        if p.dim() > 0 and p.shape[0] < k:
            raise ShardError(
                f"--shard-base {k} does not suit this model: weight {name!r} has {p.shape[0]} rows, "
                f"fewer than {k} (FSDP splits every base weight along its first dimension)"
            )


def check_shard_layout(base_model: str, k: int) -> None:
    """:func:`check_shardable` on ``base_model`` built from its config on the meta device (no
    weight is read): a refusal at start-up, before any worker loads it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from opentinker.models.registry import resolve_model_path

    config = AutoConfig.from_pretrained(resolve_model_path(base_model))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    check_shardable(model, k)


def shard_model(model: Any, k: int, device: str) -> None:
    """Shard ``model``'s frozen base over the default process group (K members) with FSDP2:
    each decoder layer, then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(torch.device(device).type, (k,))
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def shard_sizes(n: int, k: int) -> list[int]:
    """Sizes of k contiguous shards of n datums, as even as possible (the first ones larger)."""
    return [n // k + (1 if i < n % k else 0) for i in range(k)]


def merge_results(parts: list[ForwardResult], sizes: list[int]) -> ForwardResult:
    """The shards' results as one: outputs in order, ``:sum`` metrics summed, ``:mean`` ones
    weighted by datums, ``:max``/``:min`` reduced, ``:unique`` ones taken from the first shard."""
    outputs = [out for p in parts for out in p.outputs]
    total = max(sum(sizes), 1)
    metrics: dict[str, float] = {}
    for key in dict.fromkeys(k for p in parts for k in p.metrics):
        values = [(p.metrics[key], n) for p, n in zip(parts, sizes, strict=True) if key in p.metrics]
        reduction = key.rpartition(":")[2]
        if reduction == "mean":
            metrics[key] = sum(v * n for v, n in values) / total
        elif reduction == "max":
            metrics[key] = max(v for v, _ in values)
        elif reduction == "min":
            metrics[key] = min(v for v, _ in values)
        elif reduction == "unique":
            metrics[key] = values[0][0]
        else:  # sum, and what the engine sums (custom losses' metrics)
            metrics[key] = sum(v for v, _ in values)
    return ForwardResult(outputs, metrics)


def release_host_memory() -> None:
    """Hand freed host memory back to the system (glibc keeps freed heap pages otherwise, and
    the process's resident memory would count what is no longer held)."""
    import ctypes
    import ctypes.util
    import gc

    gc.collect()
    name = ctypes.util.find_library("c")
    if name is not None:
        libc = ctypes.CDLL(name)
        if hasattr(libc, "malloc_trim"):  # glibc's; other C libraries return memory themselves
            libc.malloc_trim(0)


def gather_seconds(model: Any, repeats: int) -> float:
    """Seconds one pass of all-gathers takes (every decoder layer, then the root, each unsharded
    and resharded: what a forward does; a backward gathers every layer once more), the median
    of ``repeats``. Every member of the group must call it at once (benchmarks read it)."""
    import statistics
    import time

    units = [*decoder_layers(model), model]
    times = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        for unit in units:
            unit.unshard()
            unit.reshard()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def split_rows(reqs: list[ForwardRequest], k: int) -> list[list[tuple[int, ForwardRequest]]]:
    """Each worker's share of a tick: the rows in order, cut into ``k`` contiguous pieces as even
    as possible, each piece as the requests it touches (request index, the request with those
    rows only)."""
    rows = [(i, j) for i, r in enumerate(reqs) for j in range(len(r.examples))]
    sizes = [len(rows) // k + (1 if w < len(rows) % k else 0) for w in range(k)]
    shares, start = [], 0
    for n in sizes:
        picked: dict[int, list[Example]] = {}
        for i, j in rows[start : start + n]:
            picked.setdefault(i, []).append(reqs[i].examples[j])
        shares.append([(i, dataclasses.replace(reqs[i], examples=ex)) for i, ex in picked.items()])
        start += n
    return shares


def merge_shares(n: int, shares: list[list[tuple[int, ForwardRequest]]], parts: list[list[Any]]) -> list[Any]:
    """Each of ``n`` requests' result from its pieces on the workers: outputs in row order,
    ``:sum`` metrics summed and ``:mean`` ones weighted by rows
    (:func:`merge_results`); an error on any piece is the request's."""
    pieces: dict[int, list[tuple[Any, int]]] = {}
    for share, results in zip(shares, parts, strict=True):
        for (i, sub), res in zip(share, results, strict=True):
            pieces.setdefault(i, []).append((res, len(sub.examples)))
    out: list[Any] = []
    for i in range(n):
        got = pieces.get(i, [])
        err = next((r for r, _ in got if isinstance(r, BaseException)), None)
        out.append(err if err is not None else merge_results([r for r, _ in got], [m for _, m in got]))
    return out


class ShardedEngine(Engine):
    """An engine whose base is one worker's shard of a group (module docstring). Made plain; the
    worker calls :meth:`join` once the group's process group is up. ``followers``: the other
    workers' actor handles, on the leader only."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.share_prefixes = False
        self.rank, self.world, self.group = 0, 1, ""
        self.worker_ids: list[str] = []
        self.followers: list[Any] = []
        self.broken: str | None = None  # the member lost, once one is
        self._tick: list[str] = []  # the adapters the running tick trains, in the group's order
        self._depth = 0  # > 0 inside a mirrored call (what it calls itself is not mirrored again)

    def join(self, rank: int, world: int, group: str, worker_ids: list[str], followers: list[Any]) -> None:
        self.rank, self.world, self.group = rank, world, group
        self.worker_ids, self.followers = worker_ids, followers
        self._local(super().create_adapter, LoRAConfig(rank=1, seed=0), IDLE)

    # ------------------------------------------------------------------ the group's calls
    def _local(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn`` here; the mirrored calls it makes itself (``load_state`` creates an adapter) are
        not mirrored on their own: the outer call is."""
        self._depth += 1
        try:
            return fn(*args, **kwargs)
        finally:
            self._depth -= 1

    def _mirror(self, method: str, *args: Any, **kwargs: Any) -> None:
        """Run ``method`` on every other worker of the group (the leader only), after it ran here."""
        if not self.followers or self._depth:
            return
        self._check_group()
        self._await([f.shard_call.remote(method, args, kwargs) for f in self.followers])

    def _await(self, refs: list[Any]) -> list[Any]:
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        out = []
        for ref, f_id in zip(refs, self.worker_ids[1:], strict=True):
            try:
                out.append(ray.get(ref))
            except RayActorError:
                self.broken = f_id
                self._check_group()
            except RayTaskError as e:
                cause = e.cause if isinstance(e.cause, BaseException) else e
                raise cause from None
        return out

    def _check_group(self) -> None:
        if self.broken is not None:
            err = WorkerLostError(
                f"sharded group {self.group} lost trainer worker {self.broken} (one of its {self.world}); "
                "every model of the group is lost with it: restore them from their newest checkpoints"
            )
            err.worker = self.broken
            raise err

    def adapter_ids(self) -> list[str]:
        return [a for a in super().adapter_ids() if a != IDLE]

    def create_adapter(self, config: LoRAConfig, adapter_id: str | None = None) -> str:
        aid = self._local(super().create_adapter, config, adapter_id)
        self._mirror("create_adapter", config, aid)
        return aid

    def fork_adapter(self, source: str, adapter_id: str | None = None, *, into: str | None = None, parent: str | None = None) -> str:  # fmt: skip
        aid = self._local(super().fork_adapter, source, adapter_id, into=into, parent=parent)
        self._mirror("fork_adapter", source, aid if into is None else None, into=into, parent=parent)
        return aid

    def delete_adapter(self, adapter_id: str) -> None:
        self._local(super().delete_adapter, adapter_id)
        self._mirror("delete_adapter", adapter_id)

    def load_state(self, path: Any, *, adapter_id: str | None = None, optimizer: bool = True, into: str | None = None) -> str:  # fmt: skip
        aid = self._local(super().load_state, path, adapter_id=adapter_id, optimizer=optimizer, into=into)
        self._mirror(
            "load_state", path, adapter_id=aid if into is None else None, optimizer=optimizer, into=into
        )
        return aid

    def set_pending_gradients(self, adapter_id: str, grads: dict[str, torch.Tensor]) -> None:
        self._local(super().set_pending_gradients, adapter_id, grads)
        self._mirror("set_pending_gradients", adapter_id, {k: v.detach().cpu() for k, v in grads.items()})

    def set_adapter_lineage(self, adapter_id: str, *, versions: int, parent: str | None) -> None:
        self._local(super().set_adapter_lineage, adapter_id, versions=versions, parent=parent)
        self._mirror("set_adapter_lineage", adapter_id, versions=versions, parent=parent)

    def snapshot(self, adapter_id: str) -> Any:
        info = self._local(super().snapshot, adapter_id)
        self._mirror("snapshot", adapter_id)
        return info

    def release_snapshot(self, snapshot_id: str) -> None:
        self._local(super().release_snapshot, snapshot_id)
        self._mirror("release_snapshot", snapshot_id)

    def add_snapshot(self, snapshot_id: str, weights: Any, *, adapter_id: str = "", step: int = 0) -> Any:
        info = self._local(super().add_snapshot, snapshot_id, weights, adapter_id=adapter_id, step=step)
        self._mirror(
            "add_snapshot", snapshot_id, weights.clone(device="cpu"), adapter_id=adapter_id, step=step
        )
        return info

    def load_snapshot(self, path: Any, snapshot_id: str) -> Any:
        info = self._local(super().load_snapshot, path, snapshot_id)
        self._mirror("load_snapshot", path, snapshot_id)
        return info

    def optim_step_many(self, items: list[Any]) -> list[Any]:
        if self.followers:  # every worker steps on the same summed gradients
            self._check_group()
            refs = [f.shard_call.remote("optim_step_many", (items,), {}) for f in self.followers]
            out = super().optim_step_many(items)
            self._await(refs)
            return out
        return super().optim_step_many(items)

    # ------------------------------------------------------------------ a fused tick over the group
    def forward_backward_many(self, reqs: list[ForwardRequest]) -> list[ForwardResult | EngineError]:
        if not self.followers:
            return super().forward_backward_many(reqs)
        self._check_group()
        results: list[Any] = [None] * len(reqs)
        valid: list[int] = []
        for i, req in enumerate(reqs):
            try:
                self._validate(req)
                valid.append(i)
            except EngineError as e:
                results[i] = e
        run = [reqs[i] for i in valid]
        need_grad = any(r.backward for r in run)
        tick = list(dict.fromkeys(str(r.policy) for r in run if r.backward))
        shares = split_rows(run, self.world)
        refs = [
            f.shard_forward.remote([sub for _, sub in share], tick, need_grad)
            for f, share in zip(self.followers, shares[1:], strict=True)
        ]
        try:
            mine = self.run_share([sub for _, sub in shares[0]], tick, need_grad)
        except Exception:
            self._await(refs)  # a lost peer is the cause to name
            raise
        parts = [mine, *self._await(refs)]
        for i, res in zip(valid, merge_shares(len(run), shares, parts), strict=True):
            results[i] = res
        return results

    def _validate(self, req: ForwardRequest) -> None:
        """What the engine checks of a request before running it, checked once for the group."""
        if req.custom_loss is not None:
            raise EngineError("custom losses are not served on a sharded base (--shard-base)")
        validate_request(
            req,
            vocab_size=self.vocab_size,
            max_context=self.max_context,
            max_batch_tokens=self.max_batch_tokens,
        )
        if req.backward and req.policy not in self._adapters:
            raise EngineError(f"forward_backward needs a live adapter, not {req.policy!r}")
        self._resolve(req.policy)

    def run_share(self, share: list[ForwardRequest], tick: list[str], need_grad: bool) -> list[Any]:
        """This worker's share of a tick, with its idle row: one forward, one backward if
        ``need_grad``; ``tick``: the adapters the whole tick trains (their gradients are summed)."""
        idle = ForwardRequest(IDLE, [_idle_example()], "cross_entropy", {}, backward=need_grad)
        self._tick = tick
        try:
            out = super().forward_backward_many([*share, idle])
        finally:
            self._tick = []
        return out[:-1]

    def _accumulate(self, reqs: list[ForwardRequest], train: list[int], per_req_loss: dict[int, torch.Tensor], results: list[Any]) -> None:  # fmt: skip
        """The tick's new LoRA gradients here, summed over the group (one flat all-reduce over
        every adapter the tick trains, zeros for those this share lacks, and one refusal count
        each), then added to each adapter's accumulator where every share's are finite."""
        import torch.distributed as dist

        params: list[torch.Tensor] = []
        for i in train:
            params.extend(self._adapters[str(reqs[i].policy)].weights.state_dict().values())
        total = torch.stack([per_req_loss[i] for i in train]).sum()
        grads = dict(zip(map(id, params), torch.autograd.grad(total, params, allow_unused=True), strict=True))
        flats: list[torch.Tensor] = []
        for aid in self._tick:
            a = self._adapters[aid]
            named = a.weights.state_dict()
            new = {
                n: g if (g := grads.get(id(p))) is not None else torch.zeros_like(p) for n, p in named.items()
            }
            flats.append(a.optimizer.flat_grads(new))
        refused = [
            float(
                any(reqs[i].policy == aid and isinstance(results[i], BaseException) for i in range(len(reqs)))
            )
            for aid in self._tick
        ]
        flat = torch.cat([*(f.reshape(-1) for f in flats), torch.tensor(refused, device=self.device)])
        dist.all_reduce(flat)
        counts = flat[-len(self._tick) :]
        offset = 0
        for n, (aid, f) in enumerate(zip(self._tick, flats, strict=True)):
            summed = flat[offset : offset + f.numel()].view_as(f)
            offset += f.numel()
            if counts[n] > 0 or not bool(torch.isfinite(summed).all()):
                for i in train:
                    if reqs[i].policy == aid:
                        results[i] = EngineError(
                            "the loss or gradient is NaN or inf for this data; nothing was updated"
                        )
                continue
            a = self._adapters[aid]
            a.grads = summed.clone() if a.grads is None else a.grads + summed


def _idle_example() -> Example:
    """One two-token row whose loss weights are zero: it runs through every layer, trains nothing."""
    zeros = torch.zeros(2, dtype=torch.long)
    return Example(zeros, {"target_tokens": zeros, "weights": torch.zeros(2)})
