"""Sampling a sharded base on its own group: the native sampler over the FSDP2-sharded model.

A base sharded over a group of K trainer workers (:mod:`opentinker.cluster.shard`) may fit no
single device, so no whole copy of it samples: not the front-end's engine, not a rollout worker.
With ``shard_sampling="group"`` (``--shard-sampling group``, the default of a sharded base) the
group samples its models' snapshots itself, and the front-end holds the base's config and
tokenizer only (:func:`front_base`: the model built on the meta device, no weight read), with the
snapshots' LoRA tensors as ever.

**One job, the leader decoding.** :class:`GroupSampling` (the front-end's
:class:`~opentinker.sampling.loop.SamplingService`) validates each request and pins it to its
snapshot's weights on the caller's thread, as the in-process loop does, and queues it; one thread
per group takes every request waiting (up to ``max_rows`` rows) as one :class:`SampleJob` and
sends it to a live group's leader (a lost group's threads serve through the others). The leader runs it in its scheduler's order, between training
ticks (a group gathers for one thing at a time): the native decoder over the HF forward (the lean
decode path reads weights directly, which a sharded model does not hold; FSDP's hooks gather each
layer for each forward), prefill then decode steps until every row has stopped, the whole batch
mixing snapshots and the bare base as in one process. The tokens, logprobs and seeds are the
single-process decoder's, so a seeded or greedy request samples what an unsharded native sampler
samples, within fp32 rounding.

**The other members replay the forwards.** FSDP needs every member in every all-gather, and only
the leader's forwards decide anything. Before each forward of the model the leader broadcasts
*go* over the group's process group (a forward pre-hook, first among the model's hooks); each
other member, in its own scheduler's order, answers each *go* with a forward of one token through
the same modules (the same all-gathers, a token's compute), and stops at the leader's *stop*. So
the members cannot diverge whatever the leader's rows draw, unseeded rows included, and they need
no snapshot: only the leader gets LoRA tensors. Each member counts its forwards, and the job
fails if a count differs from the leader's.

**Handoff** stays adapter-only: a job carries the LoRA tensors of each snapshot the leader does
not hold yet (once per group per version) and the names of those the front-end no longer serves,
which the leader drops.

Not served on a group: images (a VL model's vision tower is called outside the model's forward),
streaming (a streamed request's tokens come with its result), moving inflight requests to newer
weights mid-decode (they finish on the weights they started with, as on rollout workers).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from opentinker.engine import Engine, EngineError
from opentinker.lora import LoRAWeights
from opentinker.models.loader import BaseModel
from opentinker.sampling.decoder import Finished, Pinned
from opentinker.sampling.handles import RequestBook, SampleState
from opentinker.sampling.native import NativeBackend
from opentinker.sampling.types import SampleRequest, SampleResult

SAMPLE_QUEUE = "__shard_sample__"  # the leader's scheduler queue its sampling jobs run on
GO, STOP = 1, 0  # what the leader broadcasts before each forward, and after the last


@dataclass
class SampleJob:
    """One batch for a group's leader: ``rows`` (request id, request, the slot of its weights in
    the leader's table, None for the bare base), the weights to add to that table first
    (``publish``, slot -> CPU LoRA tensors) and the slots to drop (``retire``)."""

    rows: list[tuple[int, SampleRequest, str | None]]
    publish: dict[str, LoRAWeights] = field(default_factory=dict)
    retire: list[str] = field(default_factory=list)
    prefix_cache_bytes: int = 0


@dataclass
class JobResult:
    """What the leader answers: each request's result or error, the forwards every member ran
    (leader first) and the decode steps."""

    done: list[Finished]
    forwards: list[int]
    steps: int


# ---------------------------------------------------------------------- the front-end's base
def front_base(name: str, dtype: str) -> BaseModel:
    """``name``'s config and tokenizer with its model built on the meta device, as a group's
    members build theirs before filling their shards: everything the front-end's engine needs
    (LoRA layouts, limits, snapshots) and no weight. Its forward cannot run; nothing on the
    front-end runs it when the group samples."""
    from opentinker.models.loader import load_base_model

    return load_base_model(name, dtype=dtype, device="meta")


# ---------------------------------------------------------------------- a member's side
def _signal(value: int, device: torch.device) -> None:
    dist.broadcast(torch.tensor([value], dtype=torch.long, device=device), src=0)


def _receive(device: torch.device) -> int:
    t = torch.zeros(1, dtype=torch.long, device=device)
    dist.broadcast(t, src=0)
    return int(t.item())


def replay_forwards(model: Any, device: torch.device) -> int:
    """A member's part in its leader's job: one forward of one token for each *go* the leader
    broadcasts, until *stop*; returns how many."""
    token = torch.zeros(1, 1, dtype=torch.long, device=device)
    n = 0
    with torch.no_grad():
        while _receive(device) == GO:
            model(input_ids=token, use_cache=False, logits_to_keep=1)
            n += 1
    return n


class LeaderSampler:
    """The leader's snapshot table (slot -> LoRA weights on its device) and native backend."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.weights: dict[str, LoRAWeights] = {}
        self.backend: NativeBackend | None = None

    def prepare(self, job: SampleJob) -> list[tuple[int, Pinned]]:
        """Take ``job``'s handoff and pin its rows to the table's weights."""
        for slot in job.retire:
            self.weights.pop(slot, None)
        for slot, w in job.publish.items():
            self.weights[slot] = w.clone(device=self.engine.device)
        if self.backend is None or self.backend.prefix_cache.max_bytes != job.prefix_cache_bytes:
            self.backend = NativeBackend(
                self.engine, lean_decode=False, share_prefix=True, prefix_cache_bytes=job.prefix_cache_bytes
            )
        pinned = []
        for rid, req, slot in job.rows:
            if slot is not None and slot not in self.weights:
                raise EngineError(f"the sharded group's leader does not hold snapshot {req.policy!r}")
            pinned.append((rid, Pinned(req, None if slot is None else self.weights[slot])))
        return pinned

    def decode(self, items: list[tuple[int, Pinned]]) -> tuple[list[Finished], int]:
        """Every row of ``items`` decoded until it stops (the single-process decoder)."""
        assert self.backend is not None
        dec = self.backend.decoder()
        with torch.no_grad():
            done = dec.admit(items)
            while dec.live_rows:
                done += dec.step()
        return done, dec.steps


def run_job(sampler: LeaderSampler, engine: Any, job: SampleJob) -> JobResult:
    """``job`` on the group of ``engine`` (the leader's
    :class:`~opentinker.cluster.shard.ShardedEngine`), every other member replaying its forwards
    (module docstring). A lost member raises the group's
    :class:`~opentinker.cluster.shard.WorkerLostError`."""
    items = sampler.prepare(job)
    engine._check_group()
    model, device = engine.base.model, engine.device
    refs = [f.shard_replay.remote() for f in engine.followers]
    count = [0]

    def go(_module: Any, _args: Any) -> None:
        _signal(GO, device)
        count[0] += 1

    hook = model.register_forward_pre_hook(go, prepend=True)
    try:
        done, steps = sampler.decode(items)
        _signal(STOP, device)
    except Exception:
        try:
            _signal(STOP, device)
        finally:
            engine._await(refs)  # a lost member is the cause to name
        raise
    finally:
        hook.remove()
    counts = [count[0], *engine._await(refs)]
    if len(set(counts)) > 1:
        raise EngineError(f"the sharded group's members ran different forwards while sampling: {counts}")
    return JobResult(done, counts, steps)


class GroupSamplingMember:
    """The trainer worker's actor methods for sampling on its group (mixed into
    :class:`~opentinker.cluster.trainer_worker.TrainerWorker`)."""

    engine: Engine
    _group_sampler: LeaderSampler | None = None

    def _call(self, model_id: str, fn: Callable[[Engine], Any]) -> Any:
        raise NotImplementedError

    def shard_sample(self, job: SampleJob) -> JobResult:
        """Run ``job`` on this leader's group, in its scheduler's order (between ticks)."""
        from opentinker.cluster.shard import ShardedEngine

        eng = self.engine
        if not isinstance(eng, ShardedEngine) or not eng.followers:
            raise EngineError("only a sharded group's leader samples on its group")
        if self._group_sampler is None:
            self._group_sampler = LeaderSampler(eng)
        sampler = self._group_sampler
        return self._call(SAMPLE_QUEUE, lambda _: run_job(sampler, eng, job))

    def shard_replay(self) -> int:
        """This member's forwards for its leader's sampling job (:func:`replay_forwards`), in its
        scheduler's order with the leader's other calls."""
        return self._call("", lambda eng: replay_forwards(eng.base.model, eng.device))


# ---------------------------------------------------------------------- the front-end's side
@dataclass
class GroupSamplingStats:
    jobs: int = 0  # jobs run on the groups
    admitted: int = 0  # requests sent in them
    finished: int = 0  # requests answered
    max_rows: int = 0  # the most rows of one job
    steps: int = 0  # decode steps, summed over jobs
    forwards: int = 0  # forwards of the model per member, summed over jobs
    sampled_tokens: int = 0
    waiting: int = 0  # requests waiting for a group now
    live_rows: int = 0  # rows of the jobs running now
    aborted: int = 0


class GroupSampling(RequestBook[Future]):
    """Sampling served by a pool's sharded groups (module docstring): a
    :class:`~opentinker.sampling.loop.SamplingService` over ``pool``
    (:class:`~opentinker.cluster.trainer.TrainerPool`), one thread per group."""

    what = "the group sampler"

    def __init__(
        self, engine: Engine, pool: Any, *, prefix_cache_bytes: int = 0, max_rows: int = 256
    ) -> None:
        self.engine, self.pool = engine, pool
        self.prefix_cache_bytes, self.max_rows = prefix_cache_bytes, max_rows
        super().__init__()
        self._pin_policy = (
            NativeBackend(engine, lean_decode=False, prefix_cache_bytes=0).decoder(snapshots_only=True).pin
        )
        self.stats = GroupSamplingStats()
        self._waiting: deque[tuple[int, Pinned]] = deque()
        self._published: dict[str, set[str]] = {}  # leader -> the slots it holds
        self._leader_locks: dict[str, threading.Lock] = {}  # one job at a time per leader
        self._threads = [
            threading.Thread(target=self._serve, args=(i,), name=f"opentinker-group-sampler-{i}", daemon=True)
            for i in range(max(1, len(pool.workers)))
        ]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ the request book's hooks
    def _pin(self, req: SampleRequest) -> Pinned:
        if req.images:
            raise EngineError("images are not sampled on a sharded group (--shard-sampling group)")
        return self._pin_policy(req)

    def _enqueue(self, rid: int, pinned: Pinned, future: Future) -> Future:
        self._waiting.append((rid, pinned))
        self.stats.waiting = len(self._waiting)
        return future

    @staticmethod
    def _future(entry: Future) -> Future:
        return entry

    def _where(self, rid: int) -> SampleState:
        return "queued" if any(r == rid for r, _ in self._waiting) else "taken"

    def _unqueue(self, rid: int) -> bool:
        item = next((it for it in self._waiting if it[0] == rid), None)
        if item is None:
            return False
        self._waiting.remove(item)
        return True

    def _stop(self, rid: int) -> None:
        """A running one's job runs on; its answer is dropped."""
        self.stats.aborted += 1

    def follow(self, group: str, policy_id: str) -> None:
        """Inflight requests finish on the weights they started with (module docstring)."""

    def shutdown(self) -> None:
        with self._cv:
            futs = self._close()
            self._waiting.clear()
        for fut in futs:
            if not fut.done():
                fut.set_exception(RuntimeError("the group sampler was shut down"))

    # ------------------------------------------------------------------ a group's thread
    def _take(self) -> list[tuple[int, Pinned]] | None:
        """The requests of the next job (every one waiting, up to ``max_rows`` rows), or None
        once shut down."""
        with self._cv:
            while not self._stopped and not self._waiting:
                self._cv.wait()
            if self._stopped:
                return None
            batch, rows = [], 0
            while self._waiting and (
                not batch or rows + self._waiting[0][1].req.num_samples <= self.max_rows
            ):
                rid, pinned = self._waiting.popleft()
                batch.append((rid, pinned))
                rows += pinned.req.num_samples
            self.stats.waiting = len(self._waiting)
            return batch

    def _leader(self, i: int) -> Any:
        """Thread ``i``'s group now: the ``i``-th live leader (round the live ones), read afresh
        for each job (a group lost or made again changes the pool's leaders); none live: the
        ``i``-th, whose job then fails naming it."""
        leaders = list(self.pool.workers)
        live = [w for w in leaders if w.alive] or leaders
        return live[i % len(live)]

    def _serve(self, i: int) -> None:
        while (batch := self._take()) is not None:
            slot = self._leader(i)
            lock = self._leader_locks.setdefault(slot.worker_id, threading.Lock())
            try:
                with lock:  # its table's handoff bookkeeping goes one job at a time
                    out = self._run(slot, batch)
            except Exception as e:
                self._published.pop(slot.worker_id, None)  # what it holds is unknown now
                self._answer([(rid, e) for rid, _ in batch])
                continue
            self._answer(out.done)

    def _job(self, slot: Any, batch: list[tuple[int, Pinned]]) -> SampleJob:
        held = self._published.setdefault(slot.worker_id, set())
        job = SampleJob([], prefix_cache_bytes=self.prefix_cache_bytes)
        for rid, p in batch:
            key = None if p.weights is None else str(p.slot)
            if p.weights is not None and key is not None and key not in held:
                job.publish[key] = p.weights.clone(device="cpu")  # one tensor per weight when pickled
            job.rows.append((rid, p.req, key))
        needed = {key for _, _, key in job.rows if key is not None}
        served = set()
        for sid in self.engine.snapshot_ids():
            try:
                served.add(f"{sid}#{self.engine.adapter_weights(sid).uid}")
            except (KeyError, EngineError):  # released meanwhile
                continue
        job.retire = sorted(held - needed - served)
        return job

    def _run(self, slot: Any, batch: list[tuple[int, Pinned]]) -> JobResult:
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        from opentinker.cluster.shard import WorkerLostError

        if not slot.alive:
            raise WorkerLostError(f"{slot.label} was lost ({slot.lost_reason}); its models cannot sample")
        job = self._job(slot, batch)
        rows = sum(p.req.num_samples for _, p in batch)
        self.stats.live_rows += rows
        try:
            out: JobResult = ray.get(slot.actor.shard_sample.remote(job))
        except RayTaskError as e:  # the leader raised: its error (a lost member named)
            cause = e.cause if isinstance(e.cause, BaseException) else e
            raise cause from None
        except RayActorError as e:
            self.pool.mark_lost(slot, type(e).__name__)
            raise WorkerLostError(f"{slot.label} was lost while sampling; its models cannot sample") from None
        finally:
            self.stats.live_rows -= rows
        held = self._published.setdefault(slot.worker_id, set())
        held.difference_update(job.retire)
        held.update(job.publish)
        s = self.stats
        s.jobs += 1
        s.admitted += len(batch)
        s.max_rows = max(s.max_rows, rows)
        s.steps += out.steps
        s.forwards += out.forwards[0]
        return out

    def _answer(self, done: list[Finished]) -> None:
        with self._cv:
            futs = [(self._answered(rid), res) for rid, res in done]
        for fut, res in futs:
            if fut is None:  # aborted meanwhile
                continue
            if isinstance(res, SampleResult):
                self.stats.finished += 1
                self.stats.sampled_tokens += sum(len(seq.tokens) for seq in res.sequences)
                fut.set_result(res)
            else:
                fut.set_exception(res)
