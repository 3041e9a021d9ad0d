"""Ray for the server: start a local instance or join a cluster, and check what it can place.

:func:`connect` is the one place the package calls ``ray.init``. Its ``address``:

- ``None`` or ``"local"``: start a Ray instance on this machine (or use the one this process has
  already started or joined);
- ``"auto"``: join the Ray instance already running on this machine (``ray start --head``);
- ``"ray://HOST:PORT"`` (Ray Client) or ``"HOST:PORT"`` (a head node's GCS): join that cluster.
  The address is tried with a plain TCP connection first, so an address that does not answer is
  refused at once, naming it, instead of after Ray's own minute of retries.

What the cluster can place is worked out in one place, :func:`fit_error`: each worker must fit
on one node, and the workers of every kind asked for at once (rollout and trainer workers) must
fit together in what is free; a refusal names the CPUs (or GPUs) asked for per kind, their sum,
and what the cluster has. :func:`check_start` applies it to what a start places, before any actor
exists, so a ``serve --ray`` whose workers cannot all be placed fails at once instead of waiting
for resources that never come; :func:`check_fits` / :func:`check_fits_together` apply it to the
workers a scale adds. What the arithmetic cannot see (resources taken by someone else meanwhile,
workers fitting the cluster's sum but not its nodes) is caught by :func:`wait_placed`: an actor
Ray has not placed within the placement timeout fails its start, naming it.

A Ray instance started here runs its workers at the server's own priority
(:data:`LOCAL_SYSTEM_CONFIG`): Ray's default starts every worker process at nice 15, below any
other job on the machine, which would starve exactly the processes that do the work (a cluster
joined keeps its own setting; ``ray start --system-config='{"worker_niceness": 0}'`` sets it).

Every node of a joined cluster must have this package (and the base models) installed; workers
read checkpoints from the storage path they are given, which on a cluster is a shared directory.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

NAMESPACE = "opentinker"
TCP_PROBE_S = 5.0  # how long a joined cluster's address has to accept a TCP connection
_EPS = 1e-9
# how long a start waits for resources that fit the cluster in all but are not yet free (actors
# stopped just before give theirs back a moment later); resources it can never have: no wait
FREED_GRACE_S = 10.0
# how long a worker's actor may stay unplaced (no node or process given it) before its start is
# an error: Ray places an actor that fits within a second, and starting its process takes a few
# seconds even on a loaded machine; the base model's load afterwards has its own, longer bound
PLACEMENT_TIMEOUT_S = 60.0
# Ray's system config for an instance started here: worker processes at nice 0 (Ray's default is 15)
LOCAL_SYSTEM_CONFIG: dict[str, Any] = {"worker_niceness": 0}

_lock = threading.Lock()


class ClusterError(ValueError):
    """Ray could not be reached, or cannot place what was asked; the message says which and why."""


@dataclass(frozen=True)
class Cluster:
    address: str  # what was asked: "local", "auto", "ray://…" or "host:port"
    started: bool  # this process started the Ray instance (and stops it on shutdown)


def connect(address: str | None = None, *, num_cpus: int | None = None) -> Cluster:
    """Start or join Ray (see the module docstring); raises :class:`ClusterError`."""
    import ray

    asked = address or "local"
    with _lock:
        if ray.is_initialized():
            return Cluster(asked, started=False)
        if asked == "local":
            ray.init(
                num_cpus=num_cpus,
                include_dashboard=False,
                _system_config=LOCAL_SYSTEM_CONFIG,
                namespace=NAMESPACE,
                configure_logging=False,
                log_to_driver=False,
            )
            return Cluster(asked, started=True)
        if asked != "auto":
            _probe(asked)
        try:
            ray.init(address=asked, namespace=NAMESPACE, configure_logging=False, log_to_driver=False)
        except (ConnectionError, TimeoutError, RuntimeError, ValueError) as e:
            raise ClusterError(f"cannot join the Ray cluster at {asked!r}: {_first_line(e)}") from None
        return Cluster(asked, started=False)


def _probe(address: str) -> None:
    """A TCP connection to ``address``'s host and port, or :class:`ClusterError`."""
    rest = address.removeprefix("ray://")
    host, sep, port_text = rest.rpartition(":")
    if not sep:
        host, port_text = rest, "10001" if address.startswith("ray://") else "6379"
    try:
        port = int(port_text)
    except ValueError:
        raise ClusterError(
            f"{address!r} is not a Ray address (use auto, HOST:PORT or ray://HOST:PORT)"
        ) from None
    try:
        with socket.create_connection((host or "127.0.0.1", port), timeout=TCP_PROBE_S):
            pass
    except OSError as e:
        raise ClusterError(f"no Ray cluster answers at {address!r}: {e.strerror or e}") from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]


def resources() -> dict[str, Any]:
    """The cluster's totals, what is free now and the largest node's CPUs and GPUs."""
    import ray

    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    return {
        "total": {k: float(v) for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU")},
        "free": {k: float(v) for k, v in ray.available_resources().items() if k in ("CPU", "GPU")},
        "largest_node": {
            "CPU": max((float(n.get("CPU", 0)) for n in nodes), default=0.0),
            "GPU": max((float(n.get("GPU", 0)) for n in nodes), default=0.0),
        },
    }


@dataclass(frozen=True)
class Ask:
    """``workers`` actors of one kind (``what``: "rollout worker"), ``cpus`` CPUs and ``gpus`` GPUs
    each; ``option`` is the serve option sizing them ("--worker": ``--worker-cpus``/``-gpus``),
    named in the advice of a refusal."""

    workers: int
    cpus: float
    gpus: float
    what: str
    option: str = ""


def _plural(n: float, word: str) -> str:
    return f"{n:g} {word}" if n == 1 else f"{n:g} {word}s"


def fit_error(asks: Sequence[Ask], have: Mapping[str, Mapping[str, float]], *, more: bool) -> str | None:
    """Why ``asks`` cannot all be placed at once on a cluster with ``have`` (:func:`resources`:
    its ``total``, ``free`` and ``largest_node``), or None: each actor must fit on one node, and
    their sum per kind in what is free. ``more``: the asks add to workers already running (a
    scale), else they are what a start places. The one place this arithmetic is done."""
    asks = [a for a in asks if a.workers > 0]
    for kind in ("CPU", "GPU"):
        need = [(a, a.cpus if kind == "CPU" else a.gpus) for a in asks]
        need = [(a, each) for a, each in need if each > 0]
        total, free = have["total"].get(kind, 0.0), have["free"].get(kind, 0.0)
        largest = have["largest_node"].get(kind, 0.0)
        for a, each in need:
            if each > largest + _EPS:
                return (
                    f"a {a.what} asks for {each:g} {kind}s but the largest Ray node has {largest:g} "
                    f"(the cluster has {total:g} {kind}s in all)"
                )
        wanted = sum(a.workers * each for a, each in need)
        if wanted <= free + _EPS:
            continue
        terms = " + ".join(
            f"{a.workers}{' more' if more else ''} "
            f"{a.what}{'' if a.workers == 1 else 's'} × {_plural(each, kind)}"
            for a, each in need
        )
        alone = len(need) > 1 and all(a.workers * each <= free + _EPS for a, each in need)
        options = " / ".join(dict.fromkeys(f"{a.option}-{kind.lower()}s" for a, _ in need if a.option))
        advice = (
            f"scale to fewer workers or free some of the cluster's {kind}s"
            if more
            else f"lower {options or 'the resources per worker'} or the worker counts"
        )
        return (
            f"{terms} = {_plural(wanted, kind)} asked, but the cluster has {free:g} {kind}s free "
            f"({total:g} in all{'; each kind alone would fit' if alone else ''}); {advice}"
        )
    return None


def check_fits(workers: int, cpus: float, gpus: float, what: str = "rollout worker") -> None:
    """Raise :class:`ClusterError` unless ``workers`` more actors of ``cpus`` CPUs and ``gpus``
    GPUs each can be placed now (each on one node, all within what is free)."""
    check_fits_together([Ask(workers, cpus, gpus, what)])


def check_fits_together(asks: Sequence[Ask]) -> None:
    """Raise :class:`ClusterError` unless every ask, added to the workers running, can be placed
    now, all of them at once (:func:`fit_error`); the message names the kinds and their shares."""
    why = fit_error(asks, resources(), more=True)
    if why is not None:
        raise ClusterError(why)


def check_start(asks: Sequence[Ask], grace_s: float = FREED_GRACE_S) -> None:
    """Raise :class:`ClusterError` unless the workers a start places (every kind of them at once)
    fit the cluster: at once where they exceed what it has in all. Where they fit in all but not
    in what is free, what is free is asked again for up to ``grace_s`` seconds first: actors
    stopped just before (a runtime shut down and another started) give their resources back to
    Ray a moment later, and a start must not be refused for that."""
    deadline = time.monotonic() + grace_s
    while True:
        have = resources()
        why = fit_error(asks, have, more=False)
        if why is None:
            return
        in_all = {**have, "free": have["total"]}
        if time.monotonic() >= deadline or fit_error(asks, in_all, more=False) is not None:
            raise ClusterError(why)
        time.sleep(0.2)


def wait_placed(actors: Mapping[str, Any], each: Ask, timeout: float = PLACEMENT_TIMEOUT_S) -> None:
    """Wait until Ray has placed every actor (named by what it is: "trainer worker trainer-1"),
    each asking for ``each``'s resources, at most ``timeout`` seconds; raise :class:`ClusterError`
    naming the ones still pending and what is free. The caller stops them. Where Ray's actor
    table cannot be read (a Ray Client connection), this returns at once: the start-up timeout
    of the caller still bounds the wait."""
    deadline = time.monotonic() + timeout
    pending = dict(actors)
    while True:
        pending = {name: a for name, a in pending.items() if _placed(a) is False}
        if not pending:
            return
        if time.monotonic() >= deadline:
            break
        time.sleep(0.25)
    have = resources()
    free, total = have["free"], have["total"]
    option = f"lower {each.option}-cpus / {each.option}-gpus or the worker counts, " if each.option else ""
    raise ClusterError(
        f"{', '.join(pending)} {'was' if len(pending) == 1 else 'were'} not placed within "
        f"{timeout:g} s: each asks for {_plural(each.cpus, 'CPU')} and {_plural(each.gpus, 'GPU')}, "
        f"the cluster has {free.get('CPU', 0.0):g} CPUs and {free.get('GPU', 0.0):g} GPUs free "
        f"({total.get('CPU', 0.0):g} and {total.get('GPU', 0.0):g} in all); {option}"
        "or raise --placement-timeout"
    )


def _placed(actor: Any) -> bool | None:
    """Whether Ray has given ``actor`` a node and a process (or it is already up, or dead); None
    where its actor table cannot be read. Ray's public state API needs the dashboard, which a
    local instance here runs without, so this reads the GCS's actor table directly."""
    import importlib

    try:
        info = importlib.import_module("ray._private.state").actors(actor._actor_id.hex())
    except Exception:
        return None
    if not isinstance(info, dict):
        return None
    return (
        info.get("State") not in ("DEPENDENCIES_UNREADY", "PENDING_CREATION") or int(info.get("Pid") or 0) > 0
    )


def shutdown(cluster: Cluster | None) -> None:
    """Stop the Ray instance if this process started it."""
    if cluster is not None and cluster.started:
        import ray

        ray.shutdown()
