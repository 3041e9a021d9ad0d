"""One rollout worker as a spawned process behind a duplex pipe (the process transport).

The pool's side is :class:`ProcessWorker`: :meth:`~ProcessWorker.start` spawns the process
(``spawn`` context: a forked child of a process that has run torch threads can deadlock) and
waits for its handshake, :class:`~opentinker.workers.wire.Ready` or
:class:`~opentinker.workers.wire.Failed`, at most ``startup_timeout`` seconds; a worker that
cannot start (unknown backend, import error, out of memory, a crash while loading) raises
:class:`WorkerStartError` naming the worker and the cause, never hangs.

The child's side is :func:`worker_main`: build a :class:`~opentinker.workers.worker.WorkerCore`,
then loop: read every message waiting (blocking only while idle), handle them, run one tick,
send the replies. When idle it waits ``gather_s`` for a quiet moment before its first prefill, so
requests sent together prefill together (as the in-process loop does).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

from opentinker.workers.wire import Failed, Inbound, Outbound, Ready, Stop, WorkerOptions


class WorkerStartError(RuntimeError):
    """A rollout worker could not start; the message names the worker and the cause."""


class WorkerDied(RuntimeError):
    """A rollout worker's process ended or its pipe broke."""


class ProcessWorker:
    """The pool's handle on one worker process (see the module docstring)."""

    def __init__(self, index: int, options: WorkerOptions, *, startup_timeout: float = 300.0) -> None:
        self.index = index
        self.options = options
        self.startup_timeout = startup_timeout
        self.conn: Connection | None = None
        self.proc: Any = None  # multiprocessing's SpawnProcess
        self.ready: Ready | None = None

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    @property
    def sentinel(self) -> Any:
        """Ready for :func:`~multiprocessing.connection.wait` once the process has ended."""
        return None if self.proc is None else self.proc.sentinel

    def start(self) -> Ready:
        """Spawn the process and wait for its handshake; raises :class:`WorkerStartError`."""
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe(duplex=True)
        proc = ctx.Process(
            target=worker_main,
            args=(self.index, self.options, child),
            name=f"opentinker-rollout-worker-{self.index}",
            daemon=True,
        )
        proc.start()
        child.close()
        self.conn, self.proc = parent, proc
        deadline = time.monotonic() + self.startup_timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                raise WorkerStartError(
                    f"rollout worker {self.index} did not start within {self.startup_timeout:.0f} s"
                )
            try:
                if not parent.poll(min(left, 0.5)):
                    if not proc.is_alive():
                        raise EOFError
                    continue
                msg = parent.recv()
            except (EOFError, OSError):
                proc.join(timeout=5)
                code = proc.exitcode
                self.kill()
                why = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
                raise WorkerStartError(
                    f"rollout worker {self.index} exited while starting ({why}; out of memory?)"
                ) from None
            if isinstance(msg, Failed):
                self.kill()
                raise WorkerStartError(f"rollout worker {self.index} could not start: {msg.reason}")
            if isinstance(msg, Ready):
                self.ready = msg
                return msg

    def send(self, msg: Inbound) -> None:
        """Send one message; raises :class:`WorkerDied` if the worker is gone."""
        if self.conn is None:
            raise WorkerDied(f"rollout worker {self.index} is not running")
        try:
            self.conn.send(msg)
        except (OSError, EOFError, BrokenPipeError) as e:
            raise WorkerDied(f"rollout worker {self.index}: {e}") from e

    def recv(self) -> Outbound:
        """One reply (call when :attr:`conn` is readable); raises :class:`WorkerDied`."""
        if self.conn is None:
            raise WorkerDied(f"rollout worker {self.index} is not running")
        try:
            return self.conn.recv()
        except (OSError, EOFError) as e:
            raise WorkerDied(f"rollout worker {self.index}: {e or 'its pipe closed'}") from e

    def alive(self) -> bool:
        return self.proc is not None and self.proc.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the worker to exit; kill it if it does not within ``timeout``."""
        if self.conn is not None:
            with contextlib.suppress(OSError, EOFError):
                self.conn.send(Stop())
        if self.proc is not None:
            self.proc.join(timeout=timeout)
        self.kill()

    def kill(self) -> None:
        """End the process now (if it runs) and close the pipe."""
        if self.proc is not None:
            if self.proc.is_alive():
                self.proc.kill()
            self.proc.join(timeout=10)
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def worker_main(index: int, options: WorkerOptions, conn: Connection) -> None:
    """The worker process: handshake, then serve messages until :class:`Stop` or the pipe closes."""
    try:
        if options.threads:
            import torch

            torch.set_num_threads(int(options.threads))
        from opentinker.workers.worker import WorkerCore

        core = WorkerCore(index, options)
    except BaseException as e:  # the handshake carries the cause; the pool raises it
        reason = f"{type(e).__name__}: {e}"
        if os.environ.get("OPENTINKER_DEBUG"):
            reason += "\n" + traceback.format_exc()
        conn.send(Failed(index, reason))
        conn.close()
        return
    conn.send(core.ready())
    gather_s, max_gather_s = 0.002, 0.02
    try:
        while True:
            if not core.busy:
                conn.poll(None)  # idle: wait for work
                deadline = time.perf_counter() + max_gather_s
                while time.perf_counter() < deadline and conn.poll(gather_s):
                    if _drain(core, conn):
                        return
            if _drain(core, conn):
                return
            done = core.tick()
            for d in done:
                _send_done(conn, d)
    except (EOFError, OSError):  # the pool is gone
        return


def _drain(core: Any, conn: Connection) -> bool:
    """Handle every message waiting; True on :class:`Stop`."""
    while conn.poll(0):
        msg = conn.recv()
        if isinstance(msg, Stop):
            return True
        for reply in core.handle(msg):
            _send_done(conn, reply)
    return False


def _send_done(conn: Connection, reply: Any) -> None:
    try:
        conn.send(reply)
    except Exception as e:  # an unpicklable error: send its text
        from opentinker.workers.wire import Done

        if isinstance(reply, Done) and reply.error is not None:
            conn.send(Done(reply.rid, error=RuntimeError(f"{type(reply.error).__name__}: {reply.error}")))
        else:
            raise e
