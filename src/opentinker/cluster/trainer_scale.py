"""Elastic trainer workers: add and remove a running pool's workers, handing models over.

:func:`scale_trainers` brings one base model's pool (its :class:`~opentinker.cluster.trainer_router.RoutedScheduler`)
to ``workers`` live trainer workers while it serves:

- **adding**: new Ray actors with the same resources as the others start (the free resources are
  checked first; one that fails to start fails the call, the pool as it was) and join the
  placement: new models go to the least loaded worker, so to them first;
- **removing**: the least loaded workers (ties: the newest) are chosen, those holding no
  data-parallel replica first, and take no new model; each model on them is handed over
  (:meth:`RoutedScheduler.hand_over`): its new requests wait in its lane, in order, its
  requests in flight finish, its whole state (weights, Adam moments and step, the gradients
  accumulated since its last step, its snapshot count and lineage) is saved under ``folder``
  (storage every worker reads) and loaded on another worker, routing switches and the queued
  requests go on there. An emptied worker is then stopped. The training of a moved model is
  the training it would have had without the move: the same tensors, bit for bit, go on.

A data-parallel model with a replica on a leaving worker is handed over whole, once: replica
0's state and, as its pending gradients, the sum of every replica's (the all-reduce its next
optimizer step would have done) are saved, its replicas freed, and it is made again under the
same id at the same degree on workers that stay (a new process group of the new replicas),
replica 0 taking the summed gradients and the others none; so its next
step, and the training after, are the ones it would have had. A worker holding a replica is
chosen only where every data-parallel model on it can be made again so; a removal that cannot
be done so is refused before anything changes, naming the model and why.

A model whose handover fails stays on its worker(s), which are then kept (no longer draining):
the call raises ``RuntimeError`` naming the models and why, after the other moves are done (the
handover folder is then kept).
"""

from __future__ import annotations

import shutil
import uuid
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from opentinker.cluster.trainer_router import RoutedScheduler

HANDOVER_TIMEOUT_S = 600.0  # a model's in-flight requests, its save and its load


def check_scale(workers: Any) -> int:
    """``workers`` as a worker count, or ``ValueError`` (below one, not an integer)."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"trainer workers cannot be scaled below one, got {workers!r}")
    return workers


def scale_trainers(router: RoutedScheduler, workers: int, folder: str | Path) -> dict[str, Any]:
    """Bring ``router``'s pool to ``workers`` live trainer workers (module docstring); returns
    the workers added, removed and where each moved model went (and its step then)."""
    pool = router.pool
    live = pool.open_workers()
    out: dict[str, Any] = {"added": [], "removed": [], "moved": {}}
    if workers > len(live):
        out["added"] = [s.worker_id for s in pool.add_workers(workers - len(live))]
        return out
    if workers == len(live):
        return out
    leaving = pool.choose_leaving(len(live) - workers)
    moves: dict[str, tuple[str, Future]] = {}
    for worker_id, models in leaving.items():
        for model_id in models:
            if model_id in moves:  # a data-parallel model with replicas on several leaving workers
                moves[model_id] = (f"{moves[model_id][0]},{worker_id}", moves[model_id][1])
                continue
            handover = Path(folder) / f"{_safe(model_id)}-{uuid.uuid4().hex[:8]}"
            moves[model_id] = (worker_id, router.hand_over(model_id, str(handover)))
    failed: list[str] = []
    for model_id, (worker_id, fut) in moves.items():
        try:
            to = fut.result(timeout=HANDOVER_TIMEOUT_S)
        except Exception as e:
            failed.append(f"{model_id!r} on {worker_id}: {e}")
            continue
        if to is not None:
            out["moved"][model_id] = {"from": worker_id, "to": to[0], "at_step": to[1]}
    if not failed:
        shutil.rmtree(folder, ignore_errors=True)  # every moved model is live on its new worker(s)
    for worker_id in leaving:
        slot = pool.slot(worker_id)
        if slot.models:  # a handover failed: the worker stays and serves its models
            pool.undrain(slot)
            continue
        pool.retire(slot)
        out["removed"].append(worker_id)
    if failed:
        raise RuntimeError(f"trainer workers kept, models not handed over: {'; '.join(failed)}")
    return out


def _safe(model_id: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in model_id)
