from .llm_engine import LLMEngine, RequestOutput
from .model_runner import ModelRunner

__all__ = ["LLMEngine", "ModelRunner", "RequestOutput"]
