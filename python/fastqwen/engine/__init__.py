from .llm_engine import LLMEngine, RequestOutput, RequestUpdate
from .model_runner import ModelRunner

__all__ = ["LLMEngine", "ModelRunner", "RequestOutput", "RequestUpdate"]
