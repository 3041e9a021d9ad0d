"""The paged model table: models' state held in memory up to a byte budget, the rest in a tier below.

An engine's models (each adapter's weights, accumulated gradients and AdamW moments) and snapshots
(their frozen weights) are the **pageable state**. :class:`PagedTable` keeps each entry either
*resident* (its tensors in memory, counted against a :class:`MemoryBudget`) or *paged out* (its
tensors in a :class:`Tier` below, here page files on disk: :class:`PageFiles`), and moves entries
between the two:

- **Page-in** happens on use (:meth:`PagedTable.get`), or ahead of use (:meth:`PagedTable.prefetch`,
  on a background thread, so that a scheduler can page in the models of queued requests while the
  current tick computes). A caller that needs an entry being paged in waits for it; its wait is
  counted (``wait_s``, ``waited``).
- **Page-out** happens when the resident bytes exceed the budget, at the end of an operation
  (:meth:`PagedTable.scope`): least recently used first, never an entry used inside a scope still
  open (the running tick's models) nor one that is *wanted* (prefetched for the next tick).
  So an operation's own entries stay resident while it runs, and the budget holds between them.
- **Bitwise.** A page-out writes the exact bytes of each flat buffer (``engine/optim.py`` keeps an
  adapter's weights, moments and gradients as one contiguous buffer each) and a page-in reads them
  back into fresh tensors of the same dtype, shape and order, so every later computation is the
  one it would have been had the entry stayed resident.
- **Faults.** Each buffer carries a CRC32, checked at page-in: a corrupt or missing page file fails
  that entry's use with :class:`PageError` naming the entry and the problem (it stays failed),
  and no other entry is touched. A page-out that cannot be written (a full disk, a file-size limit)
  leaves the entry resident, removes the partial file, and records the problem (:attr:`PagedTable.
  full`) so that the owner can refuse new models until a page-out succeeds again.

The tier is the only thing that knows where paged state lies. On a GPU the same table runs with
the device as the resident tier and a pinned-host :class:`Tier` below (whose own overflow would be
another table over page files); on a CPU, as here, resident is RAM and the tier is disk.

Thread rule: entries of kind ``"adapter"`` change in place (training), so they page out only at
the end of a scope (an engine operation, or the scheduler's tick), and never while any thread's
open scope has used them: every method that changes an adapter runs inside one. Entries of kind
``"snapshot"`` are immutable and may be paged out from any thread (the sampler's). A snapshot paged out while a running sample still
holds it stays alive through that reference and comes back from it (no read, no copy) if it is
used again before the sample ends.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import struct
import threading
import time
import weakref
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from opentinker.engine.types import EngineError

Buffers = dict[str, torch.Tensor]


class PageError(EngineError):
    """A paged-out entry cannot be paged in (its page file is corrupt or missing)."""


class PagingFull(EngineError):
    """Paged state cannot be written (the disk under the page files is full): new models are
    refused until a page-out succeeds again; ``retry_after`` in seconds."""

    retry_after = 30


@dataclass(frozen=True)
class Page:
    """Where one entry's buffers lie in a tier, and what they must read back as."""

    path: str
    nbytes: int
    checksums: dict[str, int]


class Tier(Protocol):
    """A place below the resident tier: ``put`` stores buffers (raising ``OSError`` if it cannot),
    ``get`` gives back exactly those bytes as fresh tensors on ``device`` (raising
    :class:`PageError` if it cannot), ``drop`` forgets them."""

    def put(self, key: str, buffers: Buffers) -> Page: ...

    def get(self, key: str, page: Page, device: torch.device) -> Buffers: ...

    def drop(self, page: Page) -> None: ...


def _crc(t: torch.Tensor) -> int:
    return zlib.crc32(_bytes(t))


def _bytes(t: torch.Tensor) -> memoryview:
    """A CPU tensor's memory as bytes (no copy when contiguous)."""
    return memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]


_DTYPES = {
    torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8",
}  # fmt: skip
_BY_NAME = {v: k for k, v in _DTYPES.items()}


class PageFiles:
    """Page files in one folder: one file per paged-out entry in the safetensors layout (a JSON
    header, then each buffer's bytes; each buffer's CRC32 in the header's metadata), written
    buffer by buffer from the tensors' own memory and read back into fresh tensors with one copy
    each; written to a temporary name and renamed, so a reader never sees half a file. Page files
    are not checkpoints: they live as long as their process (not fsynced; the folders of processes
    that are gone are removed, :func:`clear_stale_pages`)."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._names = itertools.count()

    def put(self, key: str, buffers: Buffers) -> Page:
        host = {k: v.detach().to("cpu").contiguous().reshape(-1) for k, v in buffers.items()}
        sums = {k: _crc(v) for k, v in host.items()}
        header: dict[str, Any] = {"__metadata__": {"entry": key, "crc32": json.dumps(sums)}}
        at = 0
        for k, v in buffers.items():
            n = v.numel() * v.element_size()
            header[k] = {"dtype": _DTYPES[v.dtype], "shape": list(v.shape), "data_offsets": [at, at + n]}
            at += n
        head = json.dumps(header, separators=(",", ":")).encode()
        head += b" " * (-len(head) % 8)
        path = self.folder / f"{next(self._names)}.pages"
        tmp = path.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(struct.pack("<Q", len(head)) + head)
                for v in host.values():
                    f.write(_bytes(v))
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return Page(str(path), at, sums)

    def get(self, key: str, page: Page, device: torch.device) -> Buffers:
        what = f"the paged-out state of {key!r}"
        try:
            out = _read_pages(page.path)
        except FileNotFoundError:
            raise PageError(f"{what} is missing (its page file was removed)") from None
        except Exception as e:
            raise PageError(f"{what} is corrupt (its page file cannot be read: {type(e).__name__})") from None
        if set(out) != set(page.checksums):
            raise PageError(f"{what} is corrupt (its page file holds other buffers than were written)")
        for k, t in out.items():
            if _crc(t) != page.checksums[k]:
                raise PageError(f"{what} is corrupt (buffer {k!r} fails its checksum)")
        return {k: t.to(device) for k, t in out.items()}

    def drop(self, page: Page) -> None:
        Path(page.path).unlink(missing_ok=True)


def _read_pages(path: str) -> Buffers:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        out: Buffers = {}
        for k, spec in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            t = torch.empty(spec["shape"], dtype=_BY_NAME[spec["dtype"]])
            view = _bytes(t)
            start, end = spec["data_offsets"]
            if end - start != view.nbytes or f.readinto(view) != view.nbytes:
                raise ValueError(f"buffer {k!r} is cut short")
            out[k] = t
        return out


def clear_stale_pages(root: str | Path) -> int:
    """Remove the page folders (``<root>/<pid>-<n>``) of processes that no longer run; returns how
    many. Their models' unsaved state went with their process; checkpoints are elsewhere."""
    removed = 0
    root = Path(root)
    if not root.is_dir():
        return 0
    for d in root.iterdir():
        pid = d.name.partition("-")[0]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        for f in d.glob("*"):
            f.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            d.rmdir()
            removed += 1
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_FOLDERS = itertools.count()


def page_folder(root: str | Path) -> Path:
    """A fresh page folder of this process under ``root`` (stale ones are cleared first)."""
    clear_stale_pages(root)
    return Path(root) / f"{os.getpid()}-{next(_FOLDERS)}"


class MemoryBudget:
    """The bytes of pageable state that may be resident, shared by every table of a process's
    engines (``limit`` None: no limit, nothing pages)."""

    def __init__(self, limit: int | None) -> None:
        if limit is not None and limit <= 0:
            raise ValueError(f"a memory budget must be positive, got {limit}")
        self.limit = limit
        self.resident = 0
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self.resident += n

    def over(self, room: int = 0) -> bool:
        return self.limit is not None and self.resident + room > self.limit


class Codec(Protocol):
    """How one kind of entry becomes buffers and back (the ``meta`` stays in memory)."""

    def pack(self, obj: Any) -> tuple[Buffers, dict[str, Any]]: ...

    def unpack(self, buffers: Buffers, meta: dict[str, Any]) -> Any: ...

    def nbytes(self, obj: Any) -> int: ...


@dataclass
class _Entry:
    key: str
    kind: str  # a codec's name: "adapter" (owner thread pages it out) or "snapshot"
    obj: Any | None
    nbytes: int = 0
    page: Page | None = None  # set while paged out (and kept while a snapshot's copy is valid)
    meta: dict[str, Any] = field(default_factory=dict)
    loading: Future[Any] | None = None
    error: str | None = None
    held: weakref.ref[Any] | None = None  # a paged-out snapshot still held by a running sample
    removed: bool = False


@dataclass
class PagingStats:
    page_ins: int = 0
    page_outs: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    prefetched: int = 0  # page-ins started ahead of use
    waited: int = 0  # uses that had to wait for a page-in
    wait_s: float = 0.0  # how long they waited, in all
    load_s: float = 0.0  # time spent paging in (reading, checking, rebuilding), waited for or not
    failed_outs: int = 0  # page-outs that could not be written

    def as_dict(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.__dict__.items()}


class PagedTable:
    """Pageable entries by key (see the module docstring). ``codecs`` maps each kind to its codec;
    ``device`` is where resident tensors live."""

    def __init__(
        self,
        budget: MemoryBudget,
        tier: Tier | Callable[[], Tier] | None,
        codecs: dict[str, Codec],
        device: torch.device,
    ) -> None:
        self.budget = budget
        self._tier = tier
        self.codecs = codecs
        self.device = device
        self.stats = PagingStats()
        self.full: str | None = None  # why the last page-out failed, until one succeeds
        self._entries: dict[str, _Entry] = {}
        self._resident: OrderedDict[str, None] = OrderedDict()  # least recently used first
        self.resident_bytes = 0
        self.paged_bytes = 0
        self._lock = threading.RLock()
        # per thread: the keys used inside each of its open scopes (outermost first)
        self._scopes: dict[int, list[set[str]]] = {}
        self.wanted: frozenset[str] = frozenset()
        self._prefetcher: ThreadPoolExecutor | None = None

    @property
    def tier(self) -> Tier:
        if self._tier is None:
            raise EngineError("this engine has no tier to page to")
        if not isinstance(self._tier, PageFiles) and callable(self._tier):
            self._tier = self._tier()  # made on first page-out: no folder for a table that never pages
        return self._tier  # type: ignore[return-value]

    # ------------------------------------------------------------------ entries
    def add(self, key: str, kind: str, obj: Any) -> None:
        """Hold ``obj`` (resident) as entry ``key``, replacing what the key held."""
        with self._lock:
            if key in self._entries:
                self.remove(key)
            e = _Entry(key, kind, obj, self.codecs[kind].nbytes(obj))
            self._entries[key] = e
            self._resident[key] = None
            self._count(e.nbytes, 0)
            self._touch(key)

    def remove(self, key: str) -> None:
        """Forget entry ``key`` and its page file (a page-in under way is discarded)."""
        with self._lock:
            e = self._entries.pop(key, None)
            if e is None:
                return
            e.removed = True
            if self._resident.pop(key, 0) is None:
                self._count(-e.nbytes, 0)
            elif e.obj is None:
                self._count(0, -e.nbytes)
            if e.page is not None:
                self._drop_page(e.page)
                e.page = None

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def nbytes(self, key: str) -> int:
        e = self._entries.get(key)
        return 0 if e is None else e.nbytes

    def is_resident(self, key: str) -> bool:
        return key in self._resident

    def get(self, key: str) -> Any:
        """Entry ``key``'s object, paged in first if it is out (waiting for a page-in under way).
        Raises ``KeyError`` for an unknown key, :class:`PageError` if it cannot be paged in."""
        with self._lock:
            e = self._entries[key]
            self._touch(key)
            if e.obj is not None:
                self._resident.move_to_end(key)
                return e.obj
            if e.error is not None:
                raise PageError(e.error)
            if e.held is not None and (obj := e.held()) is not None:
                self._install(e, obj)  # still alive in a running sample: no read
                return obj
            mine = e.loading is None
            if mine:
                e.loading = Future()
            fut = e.loading
        assert fut is not None
        if mine:
            self._load(e, fut)
        elif not fut.done():
            t0 = time.perf_counter()
            with contextlib.suppress(BaseException):
                fut.exception()
            self.stats.waited += 1
            self.stats.wait_s += time.perf_counter() - t0
        return fut.result()

    def _load(self, e: _Entry, fut: Future[Any], *, ahead: bool = False) -> None:
        t0 = time.perf_counter()
        try:
            assert e.page is not None
            buffers = self.tier.get(e.key, e.page, self.device)
            obj = self.codecs[e.kind].unpack(buffers, e.meta)
        except BaseException as err:
            msg = str(err) if isinstance(err, PageError) else f"paging in {e.key!r} failed: {err}"
            with self._lock:
                e.loading = None
                e.error = msg
            fut.set_exception(PageError(msg))
            return
        with self._lock:
            e.loading = None
            if not e.removed:
                self._install(e, obj)
                if e.kind == "adapter" and e.page is not None:  # it will change: the copy is stale
                    self._drop_page(e.page)
                    e.page = None
            self.stats.page_ins += 1
            self.stats.bytes_in += e.nbytes
            self.stats.load_s += time.perf_counter() - t0
            if not ahead:
                self.stats.waited += 1
                self.stats.wait_s += time.perf_counter() - t0
        fut.set_result(obj)

    def _install(self, e: _Entry, obj: Any) -> None:
        e.obj, e.held = obj, None
        self._resident[e.key] = None
        self._count(e.nbytes, -e.nbytes)

    def _count(self, resident: int, paged: int) -> None:
        self.resident_bytes += resident
        self.paged_bytes += paged
        self.budget.add(resident)

    def _touch(self, key: str) -> None:
        if (mine := self._scopes.get(threading.get_ident())) is not None:
            mine[-1].add(key)

    def _drop_page(self, page: Page) -> None:
        with contextlib.suppress(Exception):
            self.tier.drop(page)

    # ------------------------------------------------------------------ scopes and eviction
    @contextlib.contextmanager
    def scope(self, keys: Iterable[str] = ()) -> Iterator[None]:
        """An operation: ``keys`` and every entry it uses stay resident until it ends (whatever
        another thread pages out meanwhile); then entries it changed are re-measured and, over
        budget, the least recently used page out. Scopes nest per thread (an inner one's entries
        are kept until that thread's outermost one ends)."""
        me = threading.get_ident()
        with self._lock:
            self._scopes.setdefault(me, []).append(set(keys))
        try:
            yield
        finally:
            with self._lock:
                mine = self._scopes[me]
                used = mine.pop()
                if mine:
                    mine[-1] |= used
                else:
                    del self._scopes[me]
                    self._remeasure(used)
                    self.fit(kinds=None)

    def _remeasure(self, keys: Iterable[str]) -> None:
        for key in keys:
            e = self._entries.get(key)
            if e is not None and e.obj is not None:
                n = self.codecs[e.kind].nbytes(e.obj)
                self._count(n - e.nbytes, 0)
                e.nbytes = n

    def fit(
        self, kinds: tuple[str, ...] | None = ("snapshot",), keep: Iterable[str] = (), room: int = 0
    ) -> int:
        """Page out least recently used entries (of ``kinds``; None: all, which only a scope's
        thread may ask) until the budget holds, with ``room`` bytes to spare; returns how many
        paged out. Entries of open scopes, wanted ones and ``keep`` stay."""
        if not self.budget.over(room):
            return 0
        with self._lock:
            skip = set(keep) | self.wanted
            for stack in self._scopes.values():
                for used in stack:
                    skip |= used
            n = 0
            for key in list(self._resident):
                if not self.budget.over(room):
                    break
                e = self._entries[key]
                if key in skip or e.loading is not None or (kinds is not None and e.kind not in kinds):
                    continue
                n += self._page_out(e)
            return n

    def page_out(self, keys: Iterable[str]) -> int:
        """Page out ``keys`` now (those resident and not in use), budget or not: how a quiet
        session's models go first. Entries in an open scope stay."""
        with self._lock:
            skip = set(self.wanted).union(*(u for stack in self._scopes.values() for u in stack))
            n = 0
            for key in keys:
                e = self._entries.get(key)
                if e is not None and e.obj is not None and e.loading is None and key not in skip:
                    n += self._page_out(e)
            return n

    def _page_out(self, e: _Entry) -> int:
        obj = e.obj
        if e.page is None:
            buffers, meta = self.codecs[e.kind].pack(obj)
            try:
                e.page = self.tier.put(e.key, buffers)
            except OSError as err:
                self.full = f"{type(err).__name__}: {os.strerror(err.errno) if err.errno else err}"
                self.stats.failed_outs += 1
                return 0
            e.meta = meta
            self.full = None
            self.stats.bytes_out += e.page.nbytes
        self.stats.page_outs += 1
        e.obj = None
        if e.kind == "snapshot":
            e.held = weakref.ref(obj)
        del obj
        self._resident.pop(e.key, None)
        self._count(-e.nbytes, e.nbytes)
        return 1

    # ------------------------------------------------------------------ prefetch
    def prefetch(self, keys: Iterable[str]) -> int:
        """Start paging in ``keys`` on a background thread, and keep them resident (wanted) until
        the next call; returns how many page-ins started."""
        started = []
        with self._lock:
            self.wanted = frozenset(k for k in keys if k in self._entries)
            for key in self.wanted:
                e = self._entries[key]
                if e.obj is None and e.loading is None and e.error is None:
                    if e.held is not None and (obj := e.held()) is not None:
                        self._install(e, obj)
                        continue
                    e.loading = Future()
                    started.append((e, e.loading))
            if started and self._prefetcher is None:
                self._prefetcher = ThreadPoolExecutor(1, thread_name_prefix="opentinker-pagein")
        for e, fut in started:
            assert self._prefetcher is not None
            self._prefetcher.submit(self._load, e, fut, ahead=True)
        self.stats.prefetched += len(started)
        return len(started)

    # ------------------------------------------------------------------ what operators see
    def counts(self) -> dict[str, float]:
        with self._lock:
            return {
                "resident": float(len(self._resident)),
                "resident_bytes": float(self.resident_bytes),
                "paged_out": float(len(self._entries) - len(self._resident)),
                "paged_out_bytes": float(self.paged_bytes),
                **self.stats.as_dict(),
            }

    def close(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.shutdown(wait=True)
        with self._lock:
            for key in list(self._entries):
                self.remove(key)
