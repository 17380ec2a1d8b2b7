"""The engine: LLMEngine (the step), ModelRunner, samplers, CUDA graphs, and its boundary.

This package's namespace holds only the boundary's message types (messages.py), as vLLM v1's engine package does:
the frontend and the server import them (and client.py) without loading the engine core, the model or torch. Import
the engine itself from its module: `from fastqwen.engine.llm_engine import LLMEngine`.
"""

from .messages import EngineInfo, EngineRequest, EngineStats, RequestDelta, StepOutput, TokenLogprobs

__all__ = ["EngineInfo", "EngineRequest", "EngineStats", "RequestDelta", "StepOutput", "TokenLogprobs"]
