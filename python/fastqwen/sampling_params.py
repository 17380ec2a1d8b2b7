"""Per-request sampling parameters, validated when they are made."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .config import GenerationDefaults


@dataclass
class SamplingParams:
    """How one request generates.

    temperature: 0 means greedy; None takes the checkpoint's generation_config.json default (1.0 if it has none).
    max_tokens: new tokens at most (generation also stops at the model's context length).
    ignore_eos: keep going past the model's EOS tokens.
    stop_token_ids: extra token ids that end generation (the token is kept in the output ids).
    """

    temperature: float | None = None
    max_tokens: int = 16
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.temperature is not None and not (0.0 <= self.temperature <= 100.0):
            raise ValueError(f"temperature must be in [0, 100], not {self.temperature}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, not {self.max_tokens!r}")
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]

    def with_defaults(self, defaults: GenerationDefaults) -> "SamplingParams":
        """A copy with unset fields filled from generation_config.json."""
        temperature = self.temperature
        if temperature is None:
            if defaults.do_sample is False:
                temperature = 0.0
            elif defaults.temperature is not None:
                temperature = float(defaults.temperature)
            else:
                temperature = 1.0
        return replace(self, temperature=temperature, stop_token_ids=list(self.stop_token_ids))
