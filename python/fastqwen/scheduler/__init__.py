from .request import FinishReason, Request, RequestState, TokenLogprobs
from .scheduler import ScheduledBatch, ScheduledChunk, Scheduler

__all__ = ["FinishReason", "Request", "RequestState", "TokenLogprobs", "ScheduledBatch", "ScheduledChunk", "Scheduler"]
