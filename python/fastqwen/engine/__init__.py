from .llm_engine import LLMEngine
from .messages import EngineInfo, EngineRequest, EngineStats, RequestDelta, StepOutput, TokenLogprobs
from .model_runner import ModelRunner

__all__ = [
    "EngineInfo", "EngineRequest", "EngineStats", "LLMEngine", "ModelRunner", "RequestDelta", "StepOutput", "TokenLogprobs",
]  # fmt: skip
