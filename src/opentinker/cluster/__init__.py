"""Scale-out on Ray: trainer workers (a base-model replica, a shard of the adapters, its own
scheduler) and rollout workers as Ray actors, data parallelism over trainer workers, and the
routing of every model to the worker that holds it. Plain ``opentinker serve`` and the embedded
clients never import this package; it needs the ``ray`` extra."""
