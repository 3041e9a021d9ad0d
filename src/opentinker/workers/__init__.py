"""The rollout service out of process: worker processes, each with its own copy of the base model,
serving published snapshots that reach them as bytes (:mod:`~opentinker.workers.wire`).

- :mod:`~opentinker.workers.worker`: :class:`WorkerCore`, transport-agnostic: it takes messages
  and returns replies around the same continuous-batching core as the in-process loop;
- :mod:`~opentinker.workers.process`: one worker as a spawned process behind a pipe;
- :mod:`~opentinker.workers.transport`: the seam between the pool and how it reaches a worker
  (processes here; Ray actors in ``opentinker.cluster.ray_rollout``);
- :mod:`~opentinker.workers.pool`: :class:`WorkerPool`, the service the scheduler hands samples
  to: snapshot handoff, least-outstanding-rows and prefix-aware routing, re-runs;
- :mod:`~opentinker.workers.lifecycle`: the pool's workers starting, scaling, draining, dying
  and restarting.

Nothing here is imported by the package root: a worker process imports only what it runs.
"""
