"""The scheduler: queues work from many clients and decides *when* it runs, in ticks ("clock cycles")."""

from opentinker.scheduler.scheduler import (
    ModelQueue,
    QueueKey,
    Scheduler,
    TickRecord,
    TickStats,
    VersionQueue,
)

__all__ = ["ModelQueue", "QueueKey", "Scheduler", "TickRecord", "TickStats", "VersionQueue"]
