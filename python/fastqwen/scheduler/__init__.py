from .request import FinishReason, Request, RequestState, SamplerState
from .scheduler import ScheduledBatch, ScheduledChunk, Scheduler

__all__ = ["FinishReason", "Request", "RequestState", "SamplerState", "ScheduledBatch", "ScheduledChunk", "Scheduler"]
