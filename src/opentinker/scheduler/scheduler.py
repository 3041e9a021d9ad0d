"""One scheduler thread per engine: per-model FIFO queues, fused ticks, fair admission.

Clients (any number, any threads) submit operations and get ``concurrent.futures.Future``s back.
A model's operations run strictly in submission order. One **tick** is:

1. every model at the head of its queue with a *call* (save, load, snapshot, ...) runs it;
2. every model at the head of its queue with a ``forward``/``forward_backward`` contributes that
   ONE request to a single fused ``Engine.forward_backward_many`` (one forward, one backward);
3. every model whose next operation (after that request, or at the head) is ``optim_step`` takes
   the step — so a client that pipelines ``forward_backward`` + ``optim_step`` before waiting
   gets both in the same tick.

**Sampling runs elsewhere.** ``submit_sample`` hands the request to the scheduler's
:class:`~opentinker.sampling.loop.SamplingService` (a
:class:`~opentinker.sampling.loop.SamplingLoop` on its own thread, a pool of rollout worker
processes, or a sharded group's sampler), which serves it with continuous batching, overlapped
with the ticks: this scheduler only decides when training runs. A client whose request is
sampling is not waited for by the batching window. A scheduler built without one (a trainer
worker's) refuses samples.

**Fairness.** Each model gets at most one forward/backward request and one optimizer step per
tick, whatever its queue holds. A tenant with huge batches (the SDK splits them into several
requests) therefore advances one request per tick, exactly like a tenant with tiny ones: it cannot
starve anybody, and every waiting model is served in every tick.

**Batching window.** Clients in a loop (sample, train, sample, ...) finish their previous operation
at nearly the same moment, but each needs a little Python time before submitting the next. So
before a tick the scheduler waits (at most ``max_gather_s``) until every client that had work in
the previous tick has queued its next operation: clients fall into lockstep and share every tick
instead of trailing into the next one. A lone client never waits (it is the only one expected)
unless its queue ends in a ``forward_backward``: then up to ``gather_s`` for a pipelined
``optim_step`` to join the same tick. A client that leaves costs the others one ``max_gather_s``, once. After an idle spell the expected
set is empty and the window is ``gather_s`` of quiet instead, to catch clients starting together.
A client is its training model: a sample request counts for the model its snapshot was taken from
(``<model>@v<n>``).

**Paging.** Under a memory budget (``engine/paging.py``) a tick is one scope of the engine's paged
table: its models stay resident while it runs, and the budget is fitted when it ends. A tick takes
models up to half the budget (the rest wait for the next tick, which starts where this one
stopped), and the models the next tick will take are paged in on a background thread while this
one computes (``TickStats.waited_ticks`` counts the ticks that still waited for a page-in).

The tick number is reported in each result's metrics as ``clock_cycle:unique``. The last
``TICK_LOG`` ticks are kept as :class:`TickRecord` records (wall-clock start and end, what ran in them),
so a request's trace can show the tick that ran it and the batch it was fused into
(:meth:`Scheduler.tick_record`).
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal

from opentinker.engine import AdamParams, Engine, ForwardRequest, Trainer
from opentinker.sampling import SampleRequest
from opentinker.sampling.handles import SampleHandle, SampleState, SamplingService

OpKind = Literal["forward", "optim", "call"]


@dataclass(frozen=True)
class ModelQueue:
    """The queue of training model ``model_id``: its operations in submission order (over trainer
    workers, run on the worker holding it)."""

    model_id: str

    def __str__(self) -> str:
        return self.model_id


@dataclass(frozen=True)
class VersionQueue:
    """The queue of policy version ``policy_id`` (a snapshot, a checkpoint's weights loaded for
    sampling or export): calls on the front-end's engine, which holds every version. ``owner``:
    the training model it comes from, the client the batching window counts it for ("": none)."""

    policy_id: str
    owner: str = ""

    def __str__(self) -> str:
        return self.policy_id


QueueKey = ModelQueue | VersionQueue


@dataclass
class _Op:
    kind: OpKind
    payload: Any
    future: Future
    submitted: float = field(default_factory=time.perf_counter)


TICK_LOG = 4096  # tick records kept, newest last


@dataclass(frozen=True)
class TickRecord:
    """One tick: its number, wall-clock start and end (``time.time()``), and what it ran."""

    tick: int
    start: float
    end: float
    fused_requests: int  # forward/backward requests in its one fused pass
    fused_rows: int  # their datums together
    optim_steps: int
    calls: int


@dataclass
class TickStats:
    ticks: int = 0
    fused_requests: int = 0
    fused_rows: int = 0  # examples (datums) in the fused forward/backward passes
    trained_tokens: int = 0  # their input tokens
    optim_steps: int = 0
    last_tick_seconds: float = 0.0
    tick_seconds: float = 0.0  # every tick's run time, summed (with ``ticks``: a mean, /metrics)
    waited_ticks: int = 0  # ticks that waited for a model's page-in


class Scheduler:
    def __init__(
        self,
        engine: Engine,
        rollout: SamplingService | None = None,
        *,
        gather_s: float = 0.002,
        max_gather_s: float = 0.02,
    ) -> None:
        self.engine = engine
        self.gather_s = gather_s
        self.max_gather_s = max_gather_s
        self._submissions = 0
        self.rollout = rollout  # None: no sampling here (a trainer worker's scheduler)
        self.stats = TickStats()
        self._tick_log: deque[TickRecord] = deque(maxlen=TICK_LOG)
        self._queues: dict[QueueKey, deque[_Op]] = {}
        self._cv = threading.Condition()
        self._last_sources: set[str] = set()  # the clients served by the previous tick
        self._cut: QueueKey | None = None  # where a tick full for the memory budget stopped
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="opentinker-scheduler", daemon=True)
        self._thread.start()
        # Stop the loop before the interpreter tears down: a daemon thread still inside torch at
        # exit aborts the process ("terminate called without an active exception").
        atexit.register(_stop_at_exit, weakref.ref(self))

    # ------------------------------------------------------------------ submission
    def submit_forward(self, model_id: str, req: ForwardRequest) -> Future:
        return self._submit(ModelQueue(model_id), _Op("forward", req, Future()))

    def submit_optim(self, model_id: str, params: AdamParams) -> Future:
        return self._submit(ModelQueue(model_id), _Op("optim", params, Future()))

    def submit_call(self, key: QueueKey, fn: Callable[[Trainer], Any]) -> Future:
        """Run ``fn(trainer)`` in this model's order (saves, loads, snapshots, deletes): here the
        trainer is :attr:`engine`; over trainer workers, the router's (``engine/trainer.py``)."""
        return self._submit(key, _Op("call", fn, Future()))

    def submit_sample(self, req: SampleRequest) -> SampleHandle:
        """Hand ``req`` to the sampling service: its handle (request id and future) says where it
        stands (:meth:`sample_state`) and cancels or aborts it."""
        rollout = self._sampling()
        with self._cv:
            self._check_open()
            # its client is sampling now: the next tick's window does not wait for it
            self._last_sources.discard(_sampling_client(req.policy))
        return rollout.submit(req)

    def sample_state(self, handle: SampleHandle) -> SampleState:
        return self._sampling().state(handle)

    def cancel_sample(self, handle: SampleHandle) -> bool:
        """Drop a sample request that the sampler has not taken yet (True), else False."""
        return self._sampling().cancel(handle)

    def abort_sample(self, handle: SampleHandle) -> bool:
        """Drop a sample request wherever it is, decoding included (its rows leave the running
        batch, in process or on the rollout worker decoding it: ``SamplingService.abort``). True
        if dropped."""
        return self._sampling().abort(handle)

    @property
    def max_sample_rows(self) -> int:
        """Sampled sequences its sampling service decodes together at most (per worker)."""
        return self._sampling().max_rows

    def _sampling(self) -> SamplingService:
        if self.rollout is None:
            raise RuntimeError("this scheduler serves no sampling (a trainer worker's)")
        return self.rollout

    def follow(self, group: str, policy_id: str) -> None:
        """Sample requests following training model ``group`` move to ``policy_id``'s weights
        mid-decode (:class:`~opentinker.sampling.loop.FollowInflight`), where the sampling service
        supports it (the in-process loop)."""
        if self.rollout is not None:
            self.rollout.follow(group, policy_id)

    def queue_depths(self) -> dict[str, int]:
        """Operations waiting per queue, by its model or version id (those of the tick now running
        are no longer counted)."""
        with self._cv:
            return {str(k): len(q) for k, q in self._queues.items() if q}

    def _submit(self, key: QueueKey, op: _Op) -> Future:
        with self._cv:
            self._check_open()
            self._queues.setdefault(key, deque()).append(op)
            self._submissions += 1
            self._cv.notify()
        return op.future

    def _check_open(self) -> None:
        if self._stopped:
            raise RuntimeError("the scheduler is shut down")

    def shutdown(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()
        self._thread.join(timeout=60)
        if self.rollout is not None:
            self.rollout.shutdown()

    # ------------------------------------------------------------------ the loop
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stopped and not any(self._queues.values()):
                    self._cv.wait()
                if self._stopped:
                    self._fail_pending(RuntimeError("the scheduler was shut down"))
                    return
                self._gather()
                calls, forwards, optims = self._take_tick()
                upcoming = self._upcoming()
            models = [str(m) for m, _ in optims] + [op.payload.policy for op in forwards]
            waited = self.engine.pages.stats.waited
            with self.engine.paged_tick([m for m in models if m], upcoming):
                self._run_tick(calls, forwards, optims)
            self.stats.waited_ticks += self.engine.pages.stats.waited > waited
            # drop this tick's work before waiting: finished requests must not pin their clients
            del calls, forwards, optims

    def _gather(self) -> None:
        """Batching window (caller holds the lock; see the module docstring): wait for every client
        of the previous tick to queue its next operation, or, after an idle spell, for ``gather_s``
        of quiet; then up to ``gather_s`` more while a queue ends in a forward/backward (its client
        may be about to pipeline the ``optim_step``); never longer than ``max_gather_s``."""
        if self.max_gather_s <= 0:
            return
        start = time.perf_counter()
        deadline = start + self.max_gather_s
        seen = self._submissions
        while not self._stopped:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                return
            if self._last_sources:
                if self._last_sources <= self._ready_sources():
                    break
                self._cv.wait(remaining)
                continue
            self._cv.wait(min(self.gather_s, remaining))
            if self._submissions == seen:
                break  # quiet for gather_s
            seen = self._submissions
        until = min(deadline, time.perf_counter() + self.gather_s)
        while not self._stopped and any(q and q[-1].kind == "forward" for q in self._queues.values()):
            remaining = until - time.perf_counter()
            if remaining <= 0:
                return
            self._cv.wait(remaining)

    def _ready_sources(self) -> set[str]:
        return {c for k, q in self._queues.items() if q and (c := _client(k))}

    def _take_tick(self) -> tuple[list[_Op], list[_Op], list[tuple[str, _Op]]]:
        """Pop this tick's work from the queues (caller holds the lock)."""
        calls: list[_Op] = []
        forwards: list[_Op] = []
        optims: list[tuple[str, _Op]] = []
        sources: set[str] = set()
        room = self._room()
        for key, q in self._rotated(consume=True):
            if not q:
                continue
            if room is not None and isinstance(key, ModelQueue) and q[0].kind != "call":
                need = self.engine.pages.nbytes(key.model_id)
                if need > room and (forwards or optims):
                    self._cut = key  # this tick is full: the next one starts here
                    break
                room -= need
            if client := _client(key):  # a version owned by no model is nobody's client
                sources.add(client)
            head = q[0]
            if head.kind == "call":
                calls.append(q.popleft())
                continue
            if head.kind == "forward":
                forwards.append(q.popleft())
            if q and q[0].kind == "optim":
                optims.append((str(key), q.popleft()))
        for key in [k for k, q in self._queues.items() if not q]:
            del self._queues[key]
        self._last_sources = sources
        return calls, forwards, optims

    def _room(self) -> int | None:
        """The bytes of model state a tick may use: half the memory budget, so that the next
        tick's models page in beside it (None: no budget)."""
        limit = self.engine.budget.limit
        return None if limit is None else limit // 2

    def _upcoming(self) -> list[str]:
        """The models the next tick will train, as the queues stand (for their page-ins to start
        now); none without a budget (nothing pages)."""
        room, out = self._room(), []
        if room is None:
            return out
        for key, q in self._rotated():
            if q and isinstance(key, ModelQueue) and q[0].kind != "call":
                need = self.engine.pages.nbytes(key.model_id)
                if need > room and out:
                    break
                room -= need
                out.append(key.model_id)
        return out

    def _rotated(self, consume: bool = False) -> list[tuple[QueueKey, deque[_Op]]]:
        """The queues, from the one the last tick that was full for the budget left out."""
        items = list(self._queues.items())
        cut = self._cut
        if consume:
            self._cut = None
        if cut is not None and cut in self._queues:
            at = next(i for i, (k, _) in enumerate(items) if k == cut)
            items = items[at:] + items[:at]
        return items

    def _run_tick(
        self,
        calls: list[_Op],
        forwards: list[_Op],
        optims: list[tuple[str, _Op]],
    ) -> None:
        t0, wall0 = time.perf_counter(), time.time()
        tick = self.stats.ticks + 1
        for op in calls:
            _settle(op.future, lambda op=op: op.payload(self.engine))
        if forwards:
            try:
                results: list[Any] = self.engine.forward_backward_many([op.payload for op in forwards])
            except Exception as e:  # an engine bug must fail the requests, never the thread
                results = [e] * len(forwards)
            for op, res in zip(forwards, results, strict=True):
                if isinstance(res, BaseException):
                    op.future.set_exception(res)
                else:
                    res.metrics["clock_cycle:unique"] = float(tick)
                    op.future.set_result(res)
        if optims:  # every model's step at once: each bitwise its own step, refused alone
            try:
                steps: list[Any] = self.engine.optim_step_many([(m, op.payload) for m, op in optims])
            except Exception as e:  # an engine bug must fail the requests, never the thread
                steps = [e] * len(optims)
            for (_, op), res in zip(optims, steps, strict=True):
                if isinstance(res, BaseException):
                    op.future.set_exception(res)
                else:
                    op.future.set_result({**res, "clock_cycle:unique": float(tick)})
        self.stats.ticks = tick
        self.stats.fused_requests += len(forwards)
        self.stats.fused_rows += sum(len(op.payload.examples) for op in forwards)
        self.stats.trained_tokens += sum(
            int(ex.tokens_T.numel()) for op in forwards for ex in op.payload.examples
        )
        self.stats.optim_steps += len(optims)
        self.stats.last_tick_seconds = time.perf_counter() - t0
        self.stats.tick_seconds += self.stats.last_tick_seconds
        rows = sum(len(op.payload.examples) for op in forwards)
        record = TickRecord(tick, wall0, time.time(), len(forwards), rows, len(optims), len(calls))
        self._tick_log.append(record)

    def tick_record(self, tick: int) -> TickRecord | None:
        """The record of tick number ``tick``, if it is among the last ``TICK_LOG``."""
        log = list(self._tick_log)  # a copy: the loop thread appends
        if not log or not log[0].tick <= tick <= log[-1].tick:
            return None
        found = log[tick - log[0].tick]
        return found if found.tick == tick else None

    def _fail_pending(self, err: BaseException) -> None:
        for q in self._queues.values():
            for op in q:
                op.future.set_exception(err)
        self._queues.clear()


def _client(key: QueueKey) -> str:
    """The client behind a queue: its model, or the model its version comes from."""
    return key.model_id if isinstance(key, ModelQueue) else key.owner


def _sampling_client(policy: str | None) -> str:
    """The client behind a sampled policy: a snapshot ``<model>@v<n>`` counts for its model; the
    bare base model for nobody in particular."""
    return "" if policy is None else policy.partition("@")[0]


def _stop_at_exit(ref: weakref.ref) -> None:
    scheduler = ref()
    if scheduler is not None:
        scheduler.shutdown()


def _settle(fut: Future, fn: Callable[[], Any]) -> None:
    try:
        fut.set_result(fn())
    except Exception as e:  # reported to the caller through its future, never kills the loop
        fut.set_exception(e)
