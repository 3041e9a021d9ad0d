"""Scale-out on Ray: rollout workers (and trainer workers) as Ray actors on any node of a cluster.

Nothing here is imported unless Ray is asked for (``Runtime(ray=...)``, ``opentinker serve
--ray``); plain ``serve`` and the embedded mode never import Ray.
"""
