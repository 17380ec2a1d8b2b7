from .forward_batch import ForwardBatch
from .qwen3 import Qwen3Model
from .qwen3_batch1 import Qwen3WithBatch1Decode

__all__ = ["ForwardBatch", "Qwen3Model", "Qwen3WithBatch1Decode"]
