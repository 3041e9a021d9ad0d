"""The scheduler: queues work from many clients and decides *when* it runs, in ticks ("clock cycles")."""

from opentinker.scheduler.scheduler import Scheduler, TickRecord, TickStats

__all__ = ["Scheduler", "TickRecord", "TickStats"]
