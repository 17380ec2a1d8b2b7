"""Speculative decoding: drafters that propose tokens (n-gram prompt lookup, suffix decoding) and the speculator that
accepts them against the target's tokens. Token ids only: it must not import the engine, the scheduler, the model or
the ops; the scheduler asks it for drafts and the engine verifies them (engine/model_runner.py). The eagle3 method's
drafter reads the target's hidden states, so the engine builds it (engine/eagle3_drafter.py) and hands it in."""

from .config import SpeculativeConfig, SpeculativeConfigError
from .speculator import SpecDecodeStats, Speculator

__all__ = ["SpecDecodeStats", "SpeculativeConfig", "SpeculativeConfigError", "Speculator"]
