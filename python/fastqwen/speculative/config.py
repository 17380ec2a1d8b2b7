"""`--speculative-config`: which drafter proposes tokens, how many, and when speculation steps aside.

The JSON object vLLM and SGLang users write (`{"method": "ngram", "num_speculative_tokens": 3}`), parsed once at
start. Standard library only: fastqwen/config.py validates it while building the EngineConfig.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "suffix", "eagle3")
# The architecture name the published EAGLE-3 heads (SpecForge, AngelSlim) carry in their config.json.
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3",)
# Drafts of up to 7 tokens: a verify step computes 1 + k positions per sequence, and the tensor-core GEMV that streams
# the weights once for all of them takes at most 8 tokens.
MAX_SPECULATIVE_TOKENS = 7


class SpeculativeConfigError(ValueError):
    """A bad --speculative-config; `key` names the entry."""

    def __init__(self, message: str, key: str):
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int = 3
    # eagle3: the draft head's folder (config.json + safetensors, the published EAGLE-3 layout).
    model: str | None = None
    # eagle3: "fp8" quantizes the head's projections and LM head on load (FP8 e4m3, 128x128 block scales, as
    # --quantization fp8 does the target's): about half the head's weight reads a step; None keeps the checkpoint's.
    quantization: str | None = None
    # ngram (prompt lookup): the longest and shortest tail of the sequence looked up in its own earlier tokens.
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    # suffix (suffix decoding): the depth of the suffix trees, how many finished requests the global tree keeps, how
    # many tokens a match of length m may draft (factor x m, adaptive), and the least probability of a drafted path.
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # Speculation steps aside when more sequences than this decode at once (the batch is compute-bound there and
    # verifying drafts costs more than it saves), and for a request whose recent drafts were mostly rejected. 32:
    # on an H100 (random Qwen3-8B, acceptance length 2.0, k = 3, 128 in / 512 out) speculation kept on gave 1.58x at
    # 32 in flight and 0.93x at 128 (bench/results/current/speculative.md).
    max_batch_size: int = 32
    min_acceptance_rate: float = 0.1
    # Benchmark only: every verify step accepts this many tokens on average (1 + accepted drafts), whatever the
    # target samples, so that random weights exercise the verify path. Outputs are not the model's.
    synthetic_acceptance_length: float | None = None

    @classmethod
    def parse(cls, value: str | dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """From the flag's JSON text or a dict (LLM(..., speculative_config={...})); None stays None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise SpeculativeConfigError(f"speculative_config is not valid JSON: {error}", "") from None
        if not isinstance(value, dict):
            raise SpeculativeConfigError("speculative_config must be a JSON object", "")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise SpeculativeConfigError(
                f"speculative_config: unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})", unknown[0]
            )
        if "method" not in value:
            raise SpeculativeConfigError(f"speculative_config needs a method ({', '.join(METHODS)})", "method")
        config = cls(**value)
        config.check()
        return config

    def check(self) -> None:
        def need(ok: bool, key: str, what: str) -> None:
            if not ok:
                raise SpeculativeConfigError(
                    f"speculative_config.{key} must be {what}, not {getattr(self, key)!r}", key
                )

        need(self.method in METHODS, "method", "one of " + ", ".join(map(repr, METHODS)))
        need(
            _int_in(self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS),
            "num_speculative_tokens",
            f"an integer from 1 to {MAX_SPECULATIVE_TOKENS}",
        )
        if self.method == "eagle3":
            self._check_eagle3_folder()
            need(self.quantization in (None, "fp8"), "quantization", "'fp8' or unset")
        else:
            need(self.model is None, "model", f"unset for method {self.method!r} (only eagle3 loads a draft model)")
            need(self.quantization is None, "quantization", f"unset for method {self.method!r} (no draft model)")
        need(_int_in(self.prompt_lookup_min, 1, 64), "prompt_lookup_min", "an integer from 1 to 64")
        need(
            _int_in(self.prompt_lookup_max, self.prompt_lookup_min, 64),
            "prompt_lookup_max",
            "an integer from prompt_lookup_min to 64",
        )
        need(_int_in(self.suffix_decoding_max_tree_depth, 2, 256), "suffix_decoding_max_tree_depth", "2 to 256")
        need(
            _int_in(self.suffix_decoding_max_cached_requests, 0, 1 << 20),
            "suffix_decoding_max_cached_requests",
            "an integer >= 0",
        )
        need(
            _number(self.suffix_decoding_max_spec_factor) and self.suffix_decoding_max_spec_factor > 0,
            "suffix_decoding_max_spec_factor",
            "a positive number",
        )
        need(
            _number(self.suffix_decoding_min_token_prob) and 0 <= self.suffix_decoding_min_token_prob <= 1,
            "suffix_decoding_min_token_prob",
            "in [0, 1]",
        )
        need(_int_in(self.max_batch_size, 0, 1 << 16), "max_batch_size", "an integer >= 0 (0: never speculate)")
        need(
            _number(self.min_acceptance_rate) and 0 <= self.min_acceptance_rate < 1,
            "min_acceptance_rate",
            "in [0, 1)",
        )
        length = self.synthetic_acceptance_length
        need(
            length is None or (_number(length) and 1 <= length <= self.num_speculative_tokens + 1),
            "synthetic_acceptance_length",
            "a number from 1 to num_speculative_tokens + 1",
        )

    def _check_eagle3_folder(self) -> None:
        """The head's folder exists and its config.json names the EAGLE-3 architecture (the shapes are checked
        against the target when the engine loads it: model/eagle3.py)."""
        folder = self.model
        if not isinstance(folder, str) or not folder:
            raise SpeculativeConfigError(
                "speculative_config.model must name the EAGLE-3 draft head's folder for method 'eagle3'", "model"
            )
        config_path = os.path.join(folder, "config.json")
        if not os.path.isfile(config_path):
            what = "has no config.json" if os.path.isdir(folder) else "is not a folder"
            raise SpeculativeConfigError(f"speculative_config.model {folder!r} {what}", "model")
        try:
            with open(config_path) as f:
                head = json.load(f)
        except (OSError, json.JSONDecodeError) as error:
            raise SpeculativeConfigError(
                f"speculative_config.model: {config_path} is unreadable: {error}", "model"
            ) from None
        architectures = head.get("architectures") if isinstance(head, dict) else None
        if not isinstance(architectures, list) or not set(architectures) & set(EAGLE3_ARCHITECTURES):
            raise SpeculativeConfigError(
                f"speculative_config.model {folder!r} is not an EAGLE-3 head: its config.json has architectures "
                f"{architectures!r}, expected {list(EAGLE3_ARCHITECTURES)!r}",
                "model",
            )


def _int_in(value: Any, lo: int, hi: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
