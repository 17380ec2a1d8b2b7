from .forward_batch import ForwardBatch
from .qwen3 import DECODE_SPLITS, Qwen3Model

__all__ = ["DECODE_SPLITS", "ForwardBatch", "Qwen3Model"]
