"""fastqwen: a readable, fast Qwen3 inference engine."""

from .frontend import RequestOutput, RequestUpdate
from .errors import InvalidRequestError
from .llm import LLM
from .sampling_params import SamplingParams

__all__ = ["InvalidRequestError", "LLM", "RequestOutput", "RequestUpdate", "SamplingParams"]
__version__ = "0.1.0"
