"""The sampling loop: sampling served on its own thread, with continuous batching.

Sampling is a service of its own, separate from the training scheduler (which only decides when
training runs). :class:`SamplingCore` owns a :class:`~opentinker.sampling.decoder.StepDecoder` and
runs one **tick** at a time: admit every waiting request that fits (prefill the newcomers, merge
them into the running batch), then one decode step of all running rows. A request that arrives
while a batch decodes therefore joins it at the next step, and a request whose rows stop is
answered at once, not when the batch ends. ``continuous=False`` admits only into an empty batch
(each batch runs to completion, as ``generate`` does): the reference the benchmarks compare with.

**Messages, not shared objects.** The core speaks a small protocol: :class:`Sample` (a request
and its id), :class:`Publish` / :class:`Retire` (a policy version's weights in, out) in;
:class:`Done` (a request's result or error) out. :class:`SamplingLoop` drives it on a thread in
this process, resolving ``Future``s from the ``Done``s; a worker process (or actor) holding its own
base model runs the same core on the same messages (:mod:`opentinker.workers.wire` adds its own
few), a ``Publish`` carrying the weights' bytes instead of the tensors.

**Policy versions, exactly.** A request is *pinned* to the weights its policy names when it enters
(:meth:`StepDecoder.pin`); in this process that is at :meth:`SamplingLoop.submit`, on the caller's
thread, against the engine's snapshots. The rows hold those weights until they stop, so:

* a request pinned to snapshot ``m@v3`` samples ``m@v3``, whatever is published after it;
* a snapshot is never seen half-published: the engine builds the copy first and registers it with
  one dict assignment (atomic under the GIL), and a request that finds no snapshot fails with the
  usual unknown-policy error;
* retiring a snapshot with requests in flight: the requests already submitted finish on its
  weights (their rows keep the tensors alive; they are freed when the last one stops); requests
  submitted after the retire fail with the unknown-policy error.

**Streamed requests.** A request with a ``stream`` sink (:class:`~opentinker.sampling.types.TokenSink`)
gets its samples' new tokens after every tick (:meth:`SamplingCore.progress`: what the tick's
prefill and step added, as :class:`~opentinker.sampling.types.Tokens`), on the loop's thread, while
its rows decode; the tokens of the step that finishes it come only with its result. A worker sends
them to its pool as messages. A row decoding on vLLM (``--rollout-backend vllm``) hands its tokens
over when it finishes (vLLM returns a request's output whole): a sample at a time there, every
step on the native fallback beside it.

**Inflight requests switch weights mid-decode.** A request with ``follow`` set (a
``kind="inflight"`` sampler's) is pinned like any other, but a :class:`FollowInflight` for its group moves
it to newer weights in place: rows decoding switch at the next decode step, keeping their keys and
values (the rule: :meth:`StepDecoder.switch`); rows waiting for admission prefill on the new ones.
Pinned requests in the same batch are untouched. Rows decoding on vLLM (it cannot change a
running request's adapter) and on rollout workers finish on the weights they started with; the
native fallback's rows beside them switch.

**Threads and data races.** The loop thread reads: the frozen base weights (never written after
load; the lean decoder's fused copies are built before the thread starts), snapshot weights
(immutable copies: ``Engine.snapshot`` clones under the scheduler thread before publishing) and
its own KV caches. The training thread writes adapters in place (``optim_step``) — tensors the
loop never reads, because it refuses requests that name a live adapter (``snapshots_only``).
The only shared mutable state is the engine's snapshot and adapter dicts (single lookups and
assignments, atomic) and the LoRA routing of the HF forward, which is per thread
(``MultiLoRA.batch``). torch ops release the GIL, so a decode step and a training step run on
the machine's cores at once (benchmarks/p10_long_tail.py measures it).
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Generic, TypeVar

from opentinker.engine import EngineError
from opentinker.lora import LoRAWeights
from opentinker.sampling.backend import Mismatch, SamplingBackend
from opentinker.sampling.decoder import Decoder, Pinned
from opentinker.sampling.handles import RequestBook, SampleState
from opentinker.sampling.types import SampleRequest, SampleResult, SamplingParams, Tokens, TokenSink

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sample:
    """Sample ``request``; answered by a :class:`Done` with the same ``rid``."""

    rid: int
    request: SampleRequest
    # in-process only: the request already pinned by the submitter (a worker pins on receipt)
    pinned: Pinned | None = field(default=None, compare=False)


W = TypeVar("W")


@dataclass(frozen=True)
class Publish(Generic[W]):
    """Make ``weights`` sampleable as ``policy_id``: in this process the
    :class:`~opentinker.lora.LoRAWeights` themselves; to a worker, their bytes
    (:class:`opentinker.workers.wire.LoRABytes`)."""

    policy_id: str
    weights: W


@dataclass(frozen=True)
class Retire:
    """Stop serving ``policy_id`` (requests already pinned to it finish)."""

    policy_id: str


@dataclass(frozen=True)
class FollowInflight:
    """Requests following training model ``group`` (``SampleRequest.follow``: a ``kind="inflight"``
    sampler's) move to ``policy_id``'s weights: those decoding from their next step on, with their
    keys and values kept (:meth:`StepDecoder.switch` states the exact rule), those still waiting
    for admission before their prefill. Unknown weights leave them as they are."""

    group: str
    policy_id: str


@dataclass(frozen=True)
class Abort:
    """Drop request ``rid`` wherever it is (its caller is gone and was answered already): still
    waiting, or decoding, when its rows leave the running batch before the next decode step
    (:meth:`Decoder.drop`: on vLLM, its requests aborted there)."""

    rid: int


@dataclass(frozen=True)
class Done:
    """The answer to :class:`Sample` ``rid``: its result, or the error that refused or failed it."""

    rid: int
    result: SampleResult | None = None
    error: Exception | None = None


Inbound = Sample | Publish[LoRAWeights] | Retire | FollowInflight | Abort


@dataclass
class _Streamed:
    """A streamed request's sink, and how many tokens of each sample it has been sent."""

    sink: TokenSink
    sent: list[int]


@dataclass
class SamplingStats:
    steps: int = 0  # decode steps run
    admitted: int = 0  # requests admitted
    joined: int = 0  # requests admitted into a batch that was already decoding
    max_rows: int = 0  # the most rows decoded at once
    # sampler–trainer logprob mismatch (backends whose numerics differ from the trainer's):
    # of the last batch that finished rows, and of every batch so far
    mismatch_last: Mismatch | None = None
    mismatch: Mismatch | None = None
    live_rows: int = 0  # rows decoding after the last step
    waiting: int = 0  # requests waiting for admission after the last step
    prefill_tokens: int = 0  # prompt tokens of admitted requests (before the prefix cache)
    sampled_tokens: int = 0  # tokens of finished sequences
    finished: int = 0  # requests answered
    aborted: int = 0  # requests dropped mid-decode, their callers gone (Abort)


class SamplingCore:
    """One decoder, its waiting requests and the admission rule (see the module docstring)."""

    def __init__(
        self,
        decoder: Decoder,
        backend: SamplingBackend,
        *,
        continuous: bool = True,
        max_rows: int = 256,
    ) -> None:
        self.decoder = decoder
        self.backend = backend
        self.continuous = continuous
        self.max_rows = max_rows
        self.stats = SamplingStats()
        self._waiting: deque[tuple[int, Pinned]] = deque()
        self._streams: dict[int, _Streamed] = {}  # streamed requests not yet answered
        # guards _waiting: other threads ask whether a request still waits, and cancel it
        self._lock = threading.Lock()

    @property
    def busy(self) -> bool:
        return bool(self._waiting) or self.decoder.live_rows > 0

    def handle(self, msg: Inbound) -> list[Done]:
        """Take one message; returns what it answers at once (a refused request)."""
        try:
            if isinstance(msg, Sample):
                pinned = msg.pinned or self.decoder.pin(msg.request)
                with self._lock:
                    self._waiting.append((msg.rid, pinned))
                if msg.request.stream is not None:
                    self._streams[msg.rid] = _Streamed(msg.request.stream, [0] * msg.request.num_samples)
            elif isinstance(msg, Publish):
                self.backend.publish(msg.policy_id, msg.weights)
            elif isinstance(msg, FollowInflight):
                self._follow(msg)
            elif isinstance(msg, Abort):
                self._abort(msg.rid)
            else:
                self.backend.retire(msg.policy_id)
        except EngineError as e:
            return [Done(msg.rid, error=e)] if isinstance(msg, Sample) else []
        return []

    def _abort(self, rid: int) -> None:
        self._streams.pop(rid, None)
        if self.cancel(rid):
            return
        if self.decoder.drop(rid):
            self.stats.aborted += 1
            self.stats.live_rows = self.decoder.live_rows

    def _follow(self, msg: FollowInflight) -> None:
        # the weights, resolved (and checked: a snapshot, never a live adapter) as a request's are
        carrier = self.decoder.pin(SampleRequest(msg.policy_id, [0], SamplingParams(max_tokens=1)))
        self.decoder.switch(msg.group, carrier)
        with self._lock:
            self._waiting = deque(
                (
                    rid,
                    Pinned(replace(p.req, policy=msg.policy_id), carrier.weights)
                    if p.req.follow == msg.group
                    else p,
                )
                for rid, p in self._waiting
            )

    def tick(self) -> list[Done]:
        """Admit what may join, then one decode step; returns the requests that finished."""
        dec, stats = self.decoder, self.stats
        live = dec.live_rows
        take: list[tuple[int, Pinned]] = []
        if self.continuous or live == 0:
            rows = live
            with self._lock:
                while self._waiting and (
                    rows == 0 or rows + self._waiting[0][1].req.num_samples <= self.max_rows
                ):
                    rid, pinned = self._waiting.popleft()
                    take.append((rid, pinned))
                    rows += pinned.req.num_samples
        finished = dec.admit(take) if take else []
        stats.admitted += len(take)
        stats.prefill_tokens += sum(len(p.req.prompt) for _, p in take)
        if live:
            stats.joined += len(take)
        stats.max_rows = max(stats.max_rows, dec.live_rows)
        if dec.live_rows:
            finished += dec.step()
            stats.steps = dec.steps
            stats.mismatch_last = self.backend.mismatch_last
            stats.mismatch = self.backend.mismatch_total
        stats.live_rows = dec.live_rows
        stats.waiting = len(self._waiting)
        stats.finished += len(finished)
        for rid, _ in finished:
            self._streams.pop(rid, None)
        stats.sampled_tokens += sum(
            len(seq.tokens) for _, res in finished if isinstance(res, SampleResult) for seq in res.sequences
        )
        return [_done(rid, res) for rid, res in finished]

    def progress(self) -> list[tuple[Tokens, TokenSink]]:
        """The tokens streamed requests decoded since the last call (after :meth:`tick`: those
        its step added), each with the sink it goes to. A request answered by the tick sends
        nothing more: its result holds every token."""
        if not self._streams:
            return []
        out: list[tuple[Tokens, TokenSink]] = []
        rids = list(self._streams)  # a snapshot: cancel (another thread) may remove one
        found = self.decoder.progress(rids)
        if len(found) < len(rids):  # a request failed outside a tick's answers: forget it
            with self._lock:
                waiting = {r for r, _ in self._waiting}
            for rid in rids:
                if rid not in found and rid not in waiting:
                    self._streams.pop(rid, None)
        for rid, samples in found.items():
            s = self._streams.get(rid)
            if s is None:
                continue
            for k, (tokens, logprobs, top) in enumerate(samples):
                start, n = s.sent[k], len(tokens)
                if n > start:
                    piece = Tokens(
                        rid,
                        k,
                        start,
                        tokens[start:n],
                        logprobs[start:n],
                        None if top is None else top[start:n],
                    )
                    out.append((piece, s.sink))
                    s.sent[k] = n
        return out

    def is_waiting(self, rid: int) -> bool:
        """Whether request ``rid`` waits for room in the batch (a tick ran without it)."""
        with self._lock:
            return any(r == rid for r, _ in self._waiting)

    def cancel(self, rid: int) -> bool:
        """Drop request ``rid`` if it still waits (True); an admitted one runs on (False)."""
        with self._lock:
            for item in self._waiting:
                if item[0] == rid:
                    self._waiting.remove(item)
                    self._streams.pop(rid, None)
                    return True
        return False


def _done(rid: int, res: SampleResult | Exception) -> Done:
    return Done(rid, error=res) if isinstance(res, Exception) else Done(rid, result=res)


class SamplingLoop(RequestBook[Future]):
    """A :class:`SamplingCore` on its own thread in this process: ``submit`` returns a
    :class:`~opentinker.sampling.handles.SampleHandle`."""

    what = "the sampling loop"

    def __init__(
        self,
        core: SamplingCore,
        *,
        gather_s: float = 0.002,
        max_gather_s: float = 0.02,
        name: str = "opentinker-rollout",
    ) -> None:
        """``gather_s``: when idle, how long the loop waits for a quiet moment before its first
        prefill, so that requests submitted together (an RL step's prompts) prefill together
        (never longer than ``max_gather_s``)."""
        super().__init__()
        self.core = core
        self.gather_s = gather_s
        self.max_gather_s = max_gather_s
        self._inbox: deque[Inbound] = deque()
        self._received = 0
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()
        atexit.register(_stop_at_exit, weakref.ref(self))

    @property
    def stats(self) -> SamplingStats:
        return self.core.stats

    @property
    def max_rows(self) -> int:
        return self.core.max_rows

    # ------------------------------------------------------------------ the request book's hooks
    def _pin(self, req: SampleRequest) -> Pinned:
        return self.core.decoder.pin(req)

    def _enqueue(self, rid: int, pinned: Pinned, future: Future) -> Future:
        self._inbox.append(Sample(rid, pinned.req, pinned))
        self._received += 1
        return future

    @staticmethod
    def _future(entry: Future) -> Future:
        return entry

    def _queued(self, rid: int) -> Sample | None:
        return next((m for m in self._inbox if isinstance(m, Sample) and m.rid == rid), None)

    def _where(self, rid: int) -> SampleState:
        """``held_back``: waiting in the core for room in the running batch."""
        if self._queued(rid) is not None:
            return "queued"
        return "held_back" if self.core.is_waiting(rid) else "taken"

    def _unqueue(self, rid: int) -> bool:
        queued = self._queued(rid)
        if queued is None:
            return self.core.cancel(rid)
        self._inbox.remove(queued)
        return True

    def _stop(self, rid: int) -> None:
        """Its rows leave the running batch before the next decode step (:class:`Abort`)."""
        self._inbox.append(Abort(rid))

    def send(self, msg: Publish[LoRAWeights] | Retire | FollowInflight) -> None:
        """Queue a publish, retire or follow, run on the loop's thread in order with the requests."""
        with self._cv:
            self._check_open()
            self._inbox.append(msg)
            self._cv.notify()

    def follow(self, group: str, policy_id: str) -> None:
        """Requests following ``group`` move to ``policy_id``'s weights (see :class:`FollowInflight`)."""
        self.send(FollowInflight(group, policy_id))

    def _check_open(self) -> None:
        if self._stopped:
            raise RuntimeError("the sampling loop is shut down")

    def shutdown(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=60)

    def _loop(self) -> None:
        core = self.core
        while True:
            with self._cv:
                while not self._stopped and not self._inbox and not core.busy:
                    self._cv.wait()
                if self._stopped:
                    self._fail_pending()
                    return
                if not core.busy:
                    self._gather()
                msgs = list(self._inbox)
                self._inbox.clear()
            done: list[Done] = []
            for msg in msgs:
                done += core.handle(msg)
            try:
                done += core.tick()
                self._stream(core.progress())
            except Exception as e:  # a bug must fail the requests it touched, never the thread
                done += [Done(rid, error=e) for rid in core.decoder.running()]
            self._resolve(done)
            del msgs, done

    def _gather(self) -> None:
        """Idle: wait (lock held) until no request arrived for ``gather_s``, at most ``max_gather_s``."""
        deadline = time.perf_counter() + self.max_gather_s
        seen = self._received
        while not self._stopped:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                return
            self._cv.wait(min(self.gather_s, remaining))
            if self._received == seen:
                return
            seen = self._received

    @staticmethod
    def _stream(pieces: list[tuple[Tokens, TokenSink]]) -> None:
        for piece, sink in pieces:
            try:
                sink(piece)
            except Exception:  # a sink's failure is its reader's, never the loop's
                log.exception("a token sink failed")

    def _resolve(self, done: list[Done]) -> None:
        with self._cv:
            futs = [(self._answered(d.rid), d) for d in done]
        for fut, d in futs:
            if fut is None:
                continue
            if d.error is not None:
                fut.set_exception(d.error)
            else:
                fut.set_result(d.result)

    def _fail_pending(self) -> None:
        err = RuntimeError("the sampling loop was shut down")
        with self._cv:
            left = self._close()
            self._inbox.clear()
        for fut in left:
            fut.set_exception(err)


def _stop_at_exit(ref: weakref.ref) -> None:
    loop = ref()
    if loop is not None:
        loop.shutdown()
