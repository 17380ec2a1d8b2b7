from .request import FinishReason, Request, RequestState
from .scheduler import ScheduledBatch, ScheduledChunk, Scheduler

__all__ = ["FinishReason", "Request", "RequestState", "ScheduledBatch", "ScheduledChunk", "Scheduler"]
