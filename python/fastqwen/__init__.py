"""fastqwen: a readable, fast Qwen3 inference engine."""

from .errors import InvalidRequestError
from .frontend import RequestOutput, RequestUpdate
from .llm import LLM
from .sampling_params import SamplingParams

__all__ = ["InvalidRequestError", "LLM", "RequestOutput", "RequestUpdate", "SamplingParams"]
__version__ = "0.1.0"
