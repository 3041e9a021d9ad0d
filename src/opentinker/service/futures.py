"""Futures shaped like the SDK's: ``.result(timeout)``, ``await``, ``.result_async()``.

We reuse the SDK's own ``AwaitableConcurrentFuture`` for results, and give clients the SDK 0.38
"future of a client that is also the client" behaviour: :class:`ClientFuture` for a client that
is still being made (a snapshot queued behind a model's training), :class:`ReadyClient` for one
that exists already.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from concurrent.futures import Future, InvalidStateError
from typing import Any, Self, TypeVar

from tinker.lib.public_interfaces.api_future import AwaitableConcurrentFuture

T = TypeVar("T")
U = TypeVar("U")


def map_future(fut: Future, fn: Callable[[Any], U]) -> AwaitableConcurrentFuture[U]:
    """A future of ``fn(result)``; exceptions pass through unchanged."""
    out: Future = Future()

    def done(f: Future) -> None:
        try:
            value = fn(f.result())
        except BaseException as e:
            with contextlib.suppress(InvalidStateError):  # the caller cancelled ``out`` meanwhile
                out.set_exception(e)
            return
        with contextlib.suppress(InvalidStateError):
            out.set_result(value)

    fut.add_done_callback(done)
    return AwaitableConcurrentFuture(out)


class ClientFuture(AwaitableConcurrentFuture[T]):
    """A future of a client, as the SDK 0.38 returns from ``save_weights_and_get_sampling_client``.

    ``await`` it (the event loop stays free while the scheduler works) or call ``.result()``.
    Like the SDK's backcompat wrapper, calling a client method on the future itself waits for the
    client first, so code that treats the return value as the client keeps working.
    """

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # copy/pickle protocols look these up: never wait for them
            raise AttributeError(name)
        return getattr(self.result(), name)


def client_future(fut: Future, make: Callable[[Any], U]) -> ClientFuture[U]:
    """A :class:`ClientFuture` of ``make(result)``."""
    return ClientFuture(map_future(fut, make).future())


def ready(value: T) -> AwaitableConcurrentFuture[T]:
    f: Future = Future()
    f.set_result(value)
    return AwaitableConcurrentFuture(f)


class ReadyClient:
    """Mixin: a client usable directly, or as the (already finished) future the SDK returns."""

    def result(self, timeout: float | None = None) -> Self:
        return self

    async def result_async(self, timeout: float | None = None) -> Self:
        return self

    def __await__(self) -> Generator[Any, None, Self]:
        return self.result_async().__await__()
