"""Session traces (``RestClient.export_session_trace``): every request of a session on a timeline.

Each request an operation accepts gets a :class:`Span`: when it arrived, when it was handed to the
scheduler or the sampler (after its ``seq_id`` turn and the tenant's admission), the tick that ran
it (the tick number its result reports as ``clock_cycle:unique``) and when its result was ready.
A session keeps its last ``MAX_SPANS`` spans in memory (a restart forgets them). These spans are
the server's one record of requests: the console's session-trace page reads them too
(:meth:`SessionTraces.requests`), while :mod:`opentinker.server.history` keeps only what the
results said (loss, grad norm, learning rate per run).

``GET /sessions/<id>/trace_export`` writes the session's trace as a Chrome trace-event JSON file,
which https://ui.perfetto.dev (and ``chrome://tracing``) opens, and answers the SDK's poll format
``{"status": "ready", "url": …}`` at once: the URL is a signed download URL
(:mod:`opentinker.server.signing`) for ``tinker://<session>/traces/<export>`` served by the same
``/downloads`` route as external weights, for the session's tenant only, valid an hour. A trace
whose session has had no new span since the last export is not rebuilt.

The file: one process per session. Each model and each sampler is a thread (a track) with one
slice per request (name = the operation; args: ``request_id``, ``seq_id``, ``status``, ``tick``,
``queue_wait_ms``, ``run_ms``, the tick's fused batch), split into a ``wait`` child (arrival to
the start of its tick, or to its hand-off when it ran on no tick: ordering, admission and the
scheduler's queue) and a ``run`` child (from there to its result). One more track per base model
shows each tick that ran a request of the session, with its duration and what it fused.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from opentinker.server.errors import NotFound
from opentinker.server.signing import UrlSigner
from opentinker.service.runtime import TickRecord

MAX_SPANS = 20_000  # per session, newest kept
MAX_SESSIONS = 1_000  # sessions with spans in memory, least recently used dropped
KEEP_EXPORTS = 3  # per session: a URL handed out just before a re-export still works
KIND = "traces"
FILE = "trace.json"

TickLookup = Callable[[str, int], TickRecord | None]


@dataclass
class Span:
    request_id: str
    name: str  # the operation (forward_backward, optim_step, sample, ...)
    track: str  # the model or sampler it ran on
    base_model: str | None
    seq_id: int | None
    received: float  # time.time()
    submitted: float | None = None
    done: float | None = None
    tick: int | None = None
    error: str | None = None


class SessionTraces:
    def __init__(self, data_dir: str | Path, ticks: TickLookup) -> None:
        self.root = Path(data_dir) / KIND
        self._ticks = ticks
        self._spans: OrderedDict[str, deque[Span]] = OrderedDict()
        self._changed: dict[str, int] = {}  # session -> spans begun or finished (a version)
        self._exported: dict[str, tuple[int, str]] = {}  # session -> (version, export name)
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ recording
    def begin(
        self,
        session_id: str,
        request_id: str,
        name: str,
        track: str,
        base_model: str | None,
        seq_id: int | None,
    ) -> Span:
        span = Span(request_id, name, track, base_model, seq_id, time.time())
        with self._lock:
            spans = self._spans.get(session_id)
            if spans is None:
                spans = self._spans[session_id] = deque(maxlen=MAX_SPANS)
                while len(self._spans) > MAX_SESSIONS:
                    old, _ = self._spans.popitem(last=False)
                    self._changed.pop(old, None)
            self._spans.move_to_end(session_id)
            spans.append(span)
            self._bump(session_id)
        return span

    def _bump(self, session_id: str) -> None:
        self._changed[session_id] = self._changed.get(session_id, 0) + 1

    def submit(self, span: Span, submit: Callable[[], Future]) -> Callable[[], Future]:
        """``submit``, noting when it is called (the request's hand-off to the engine)."""

        def traced() -> Future:
            span.submitted = time.time()
            return submit()

        return traced

    def encode(self, span: Span, encode: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """``encode``, noting the tick the raw result reports."""

        def traced(result: Any) -> Any:
            metrics = getattr(result, "metrics", None)
            if isinstance(metrics, dict) and "clock_cycle:unique" in metrics:
                span.tick = int(metrics["clock_cycle:unique"])
            return encode(result)

        return traced

    def finish_with(self, session_id: str, span: Span, out: Future) -> None:
        def done(f: Future) -> None:
            span.done = time.time()
            exc = f.exception()
            if exc is not None:
                span.error = type(exc).__name__
            with self._lock:
                self._bump(session_id)

        out.add_done_callback(done)

    # ------------------------------------------------------------------ export
    def export(self, session_id: str, signer: UrlSigner, tenant: str, base_url: str) -> dict[str, Any]:
        """Write (unless up to date) the session's trace; the SDK's poll answer with its URL."""
        with self._lock:
            version = self._changed.get(session_id, 0)
            spans = list(self._spans.get(session_id, ()))
            last = self._exported.get(session_id)
        if last is not None and last[0] == version and (self.root / session_id / last[1] / FILE).exists():
            name = last[1]
        else:
            name = f"export-{time.time_ns()}"
            folder = self.root / session_id / name
            folder.mkdir(parents=True, exist_ok=True)
            tmp = folder / f".{FILE}.tmp"
            tmp.write_text(json.dumps(self.chrome_trace(session_id, spans), separators=(",", ":")))
            os.replace(tmp, folder / FILE)
            with self._lock:
                self._exported[session_id] = (version, name)
            self._prune(session_id)
        url = signer.sign(base_url, tenant, f"tinker://{session_id}/{KIND}/{name}", FILE)
        return {"status": "ready", "url": url}

    def _prune(self, session_id: str) -> None:
        folders = sorted((self.root / session_id).glob("export-*"), key=lambda p: int(p.name.split("-")[1]))
        for old in folders[:-KEEP_EXPORTS]:
            shutil.rmtree(old, ignore_errors=True)

    def file(self, session_id: str, name: str, file: str) -> Path:
        path = self.root / session_id / name / file
        if file != FILE or not name.startswith("export-") or "/" in session_id or not path.is_file():
            raise NotFound(f"tinker://{session_id}/{KIND}/{name} has no file {file!r}")
        return path

    # ------------------------------------------------------------------ reading
    def requests(
        self, session_id: str, offset: int = 0, limit: int = 500
    ) -> tuple[list[dict[str, Any]], int]:
        """A page of the session's requests, oldest first, with their timing (:func:`timing`), and
        how many it has: the console's session-trace page."""
        with self._lock:
            spans = list(self._spans.get(session_id, ()))
        now = time.time()
        out = []
        for s in spans[offset : offset + limit]:
            rec = self._tick_of(s)
            t = timing(s, rec, now)
            out.append(
                {
                    "request_id": s.request_id,
                    "kind": s.name,
                    "track": s.track,
                    "base_model": s.base_model,
                    "seq_id": s.seq_id,
                    "received": s.received,
                    "started": t.start,
                    "done": s.done,
                    "queue_wait_s": round(t.start - s.received, 6),
                    "run_s": round(t.end - t.start, 6),
                    "duration_s": round(t.end - s.received, 6),
                    "tick": s.tick,
                    "fused_requests": rec.fused_requests if rec is not None else None,
                    "fused_rows": rec.fused_rows if rec is not None else None,
                    "status": t.status,
                }
            )
        return out, len(spans)

    def _tick_of(self, s: Span) -> TickRecord | None:
        return self._ticks(s.base_model, s.tick) if s.base_model and s.tick is not None else None

    def chrome_trace(self, session_id: str, spans: list[Span]) -> dict[str, Any]:
        """The Chrome trace-event JSON of ``spans`` (times in µs since the epoch)."""
        now = time.time()
        pid = 1
        events: list[dict[str, Any]] = [_meta(pid, 0, "process_name", f"session {session_id}")]
        tids: dict[str, int] = {}

        def tid(track: str) -> int:
            if track not in tids:
                tids[track] = len(tids) + 1
                events.append(_meta(pid, tids[track], "thread_name", track))
            return tids[track]

        ticks: dict[tuple[str, int], TickRecord] = {}
        for s in spans:
            rec = self._tick_of(s)
            if rec is not None:
                ticks[(str(s.base_model), rec.tick)] = rec
            start, end, status = timing(s, rec, now)
            args: dict[str, Any] = {
                "request_id": s.request_id,
                "status": status,
                "queue_wait_ms": round((start - s.received) * 1e3, 3),
                "run_ms": round((end - start) * 1e3, 3),
            }
            if s.seq_id is not None:
                args["seq_id"] = s.seq_id
            if rec is not None:
                args |= {
                    "tick": rec.tick,
                    "tick_ms": round((rec.end - rec.start) * 1e3, 3),
                    "fused_requests": rec.fused_requests,
                    "fused_rows": rec.fused_rows,
                }
            t = tid(s.track)
            events.append(_slice(pid, t, s.name, s.received, end, args))
            events.append(_slice(pid, t, "wait", s.received, start, {}))
            events.append(_slice(pid, t, "run", start, end, {}))
        for (base, _), rec in sorted(ticks.items(), key=lambda kv: kv[1].start):
            args = {
                "fused_requests": rec.fused_requests,
                "fused_rows": rec.fused_rows,
                "optim_steps": rec.optim_steps,
                "calls": rec.calls,
            }
            events.append(_slice(pid, tid(f"ticks ({base})"), f"tick {rec.tick}", rec.start, rec.end, args))
        return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"session_id": session_id}}


class Timing(NamedTuple):
    start: float  # the end of its wait: the start of the tick that ran it, else its hand-off
    end: float  # its result (now, while it runs)
    status: str  # running, done, failed: <error type>


def timing(s: Span, rec: TickRecord | None, now: float) -> Timing:
    """Where ``s``'s wait ends and its run begins: the start of the tick that ran it (``rec``), or
    its hand-off to the scheduler or sampler when no tick reports it (clamped into the span)."""
    end = s.done if s.done is not None else now
    start = rec.start if rec is not None else (s.submitted if s.submitted is not None else end)
    start = min(max(start, s.received), end)
    status = "running" if s.done is None else ("failed: " + s.error if s.error else "done")
    return Timing(start, end, status)


def _meta(pid: int, tid: int, what: str, name: str) -> dict[str, Any]:
    return {"ph": "M", "pid": pid, "tid": tid, "name": what, "args": {"name": name}}


def _slice(pid: int, tid: int, name: str, start: float, end: float, args: dict[str, Any]) -> dict[str, Any]:
    ts = round(start * 1e6, 3)
    return {
        "ph": "X",
        "pid": pid,
        "tid": tid,
        "name": name,
        "ts": ts,
        "dur": round(end * 1e6 - ts, 3),
        "args": args,
    }


__all__ = ["FILE", "KIND", "SessionTraces", "Span", "Timing", "timing"]
