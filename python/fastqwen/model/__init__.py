from .forward_batch import ForwardBatch
from .qwen3 import Qwen3Model

__all__ = ["ForwardBatch", "Qwen3Model"]
