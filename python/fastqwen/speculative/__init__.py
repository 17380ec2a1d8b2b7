"""Speculative decoding: drafters that propose tokens (n-gram prompt lookup, suffix decoding, an EAGLE-3 head) and the
speculator that accepts them against the target's tokens. Token ids only, but for eagle3.py (the head's drafter,
imported only when that method is on, reads the target's hidden states through model/eagle3.py): it must not import
the engine or the scheduler; the scheduler asks it for drafts and the engine verifies them (engine/model_runner.py)."""

from .config import SpeculativeConfig, SpeculativeConfigError
from .speculator import SpecDecodeStats, Speculator

__all__ = ["SpecDecodeStats", "SpeculativeConfig", "SpeculativeConfigError", "Speculator"]
