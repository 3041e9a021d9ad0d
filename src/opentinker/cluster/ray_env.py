"""Ray for the server: start a local instance or join a cluster, and check what it can place.

:func:`connect` is the one place the package calls ``ray.init``. Its ``address``:

- ``None`` or ``"local"``: start a Ray instance on this machine (or use the one this process has
  already started or joined);
- ``"auto"``: join the Ray instance already running on this machine (``ray start --head``);
- ``"ray://HOST:PORT"`` (Ray Client) or ``"HOST:PORT"`` (a head node's GCS): join that cluster.
  The address is tried with a plain TCP connection first, so an address that does not answer is
  refused at once, naming it, instead of after Ray's own minute of retries.

:func:`check_fits` refuses, at once and naming the shortfall, a worker request the cluster can
never meet (more CPUs or GPUs per worker than any node has) or cannot meet now (more than is
free), so a ``serve --ray`` with impossible resources fails before any actor waits for placement;
:func:`check_fits_together` does it for workers of several kinds asked for at once (a scale of
rollout and trainer workers in one request), each kind fitting alone but not all together.

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
from dataclasses import dataclass
from typing import Any

NAMESPACE = "opentinker"
TCP_PROBE_S = 5.0  # how long a joined cluster's address has to accept a TCP connection
_EPS = 1e-9
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


def check_fits(workers: int, cpus: float, gpus: float, what: str = "rollout worker") -> None:
    """Raise :class:`ClusterError` unless ``workers`` actors of ``cpus`` CPUs and ``gpus`` GPUs
    each can be placed now (each on one node, all within what is free)."""
    check_fits_together([(workers, cpus, gpus, what)])


def check_fits_together(asks: list[tuple[int, float, float, str]]) -> None:
    """Raise :class:`ClusterError` unless every ask (``workers`` more actors of ``cpus`` CPUs and
    ``gpus`` GPUs each, and what they are) can be placed now, all of them at once: each actor on
    one node, their sum within what is free. The message names the kinds and their shares."""
    have = resources()
    asks = [a for a in asks if a[0] > 0]
    for kind in ("CPU", "GPU"):
        need: list[tuple[int, float, str]] = []
        for workers, cpus, gpus, what in asks:
            each = cpus if kind == "CPU" else gpus
            if each <= 0:
                continue
            largest = have["largest_node"][kind]
            if each > largest + _EPS:
                raise ClusterError(
                    f"a {what} asks for {each:g} {kind}s but the largest Ray node has {largest:g} "
                    f"(the cluster has {have['total'].get(kind, 0.0):g} {kind}s in all)"
                )
            need.append((workers, each, what))
        free, total = have["free"].get(kind, 0.0), have["total"].get(kind, 0.0)
        wanted = sum(n * each for n, each, _ in need)
        if wanted <= free + _EPS:
            continue
        if len(need) == 1:
            [(n, each, what)] = need
            raise ClusterError(
                f"{n} more {what}s of {each:g} {kind}s need {wanted:g} {kind}s, "
                f"but only {free:g} of the cluster's {total:g} are free"
            )
        shares = " and ".join(f"{n} more {what}s ({n * each:g} {kind}s)" for n, each, what in need)
        alone = all(n * each <= free + _EPS for n, each, _ in need)
        raise ClusterError(
            f"{shares} need {wanted:g} {kind}s together, but only {free:g} of the cluster's "
            f"{total:g} are free" + (" (each kind alone would fit)" if alone else "")
        )


def shutdown(cluster: Cluster | None) -> None:
    """Stop the Ray instance if this process started it."""
    if cluster is not None and cluster.started:
        import ray

        ray.shutdown()
