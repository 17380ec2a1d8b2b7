"""fastqwen: a readable, fast Qwen3 inference engine."""

from .engine import RequestOutput
from .llm import LLM
from .sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
