"""Scale-out on Ray: trainer workers (a base-model replica, a shard of the adapters, its own
scheduler) and rollout workers as Ray actors on any node of a cluster, data parallelism over trainer
workers, and the routing of every model to the worker that holds it.

Nothing here is imported unless Ray is asked for (``Runtime(ray=...)``, ``trainer_workers``,
``opentinker serve --ray`` / ``--trainer-workers``); plain ``serve`` and the embedded mode never
import Ray. It needs the ``ray`` extra.
"""
