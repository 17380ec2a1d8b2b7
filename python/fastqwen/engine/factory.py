"""make_engine: the engine a config asks for, the one call every entry point makes (the offline LLM, the server's
in-process thread, the engine-core process). Its own module because it sits above both kinds: LLMEngine
(llm_engine.py) and TensorParallelEngine (tensor_parallel.py, which builds on LLMEngine).
"""

from __future__ import annotations

from ..config import EngineConfig
from .llm_engine import LLMEngine
from .tensor_parallel import TensorParallelEngine


def make_engine(config: EngineConfig) -> LLMEngine | TensorParallelEngine:
    """The engine for a config: one LLMEngine, or rank 0 of tensor_parallel_size ranks."""
    if config.tensor_parallel_size > 1:
        return TensorParallelEngine(config)
    return LLMEngine(config)
