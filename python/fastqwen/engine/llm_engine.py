"""LLMEngine: loads a checkpoint (or dummy weights), sizes the KV pool, and runs scheduler steps."""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

import torch

from ..config import is_preset, load_model_config, resolve_dtype
from ..kvcache import KVPool
from ..model import Qwen3Model
from ..sampling_params import SamplingParams
from ..scheduler import Request, Scheduler
from ..tokenizer import Tokenizer
from ..weights import dummy_weights, load_weights
from .model_runner import ModelRunner

# KV pool size on the CPU reference path when num_pages is not given.
_CPU_KV_BYTES = 1 << 30


@dataclass
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str
    num_prompt_tokens: int
    num_completion_tokens: int


class LLMEngine:
    def __init__(
        self,
        model: str,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device | None = None,
        page_size: int = 16,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        num_pages: int | None = None,
        max_model_len: int | None = None,
        load_format: str = "auto",
        gpu_memory_utilization: float = 0.85,
        seed: int = 0,
    ):
        if load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(f"load_format must be 'auto', 'safetensors' or 'dummy', not {load_format!r}")
        if is_preset(model) and load_format != "dummy":
            raise ValueError(f"{model!r} is a shape preset with no weights on disk: pass load_format='dummy'")
        self.device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        self.config, self.generation_defaults = load_model_config(model)
        self.dtype = resolve_dtype(dtype, self.config, self.device)
        self.max_model_len = max_model_len or self.config.max_position_embeddings
        if self.max_model_len < 2:
            raise ValueError("max_model_len must be at least 2")

        folder = model if os.path.isdir(model) else os.path.dirname(model)
        self.tokenizer = Tokenizer.from_folder(folder) if folder else None
        if load_format == "dummy":
            weights = dummy_weights(self.config, self.dtype, self.device, seed)
        else:
            weights = load_weights(folder, self.config, self.dtype, self.device)
        self.model = Qwen3Model(self.config, weights, self.max_model_len)

        cfg = self.config
        page_bytes = KVPool.bytes_per_page(cfg.num_layers, page_size, cfg.num_kv_heads, cfg.head_dim, self.dtype)
        if num_pages is None:
            num_pages = self._default_num_pages(page_bytes, max_num_batched_tokens, max_num_seqs, gpu_memory_utilization)
        self.kv = KVPool(cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim, self.dtype, self.device)
        self.scheduler = Scheduler(
            self.kv.allocator,
            page_size,
            max_num_seqs,
            max_num_batched_tokens,
            self.max_model_len,
            self.generation_defaults.eos_token_ids,
        )
        self.runner = ModelRunner(self.model, self.kv, seed)
        self._ids = itertools.count()
        self._arrivals = itertools.count()

    def _default_num_pages(self, page_bytes: int, max_tokens: int, max_seqs: int, utilization: float) -> int:
        cfg = self.config
        if self.device.type != "cuda":
            return max(1, _CPU_KV_BYTES // page_bytes)
        torch.cuda.synchronize(self.device)
        free, _ = torch.cuda.mem_get_info(self.device)
        # Activations of the largest step: hidden states, qkv, gate/up, and float32 logits of every sequence.
        width = 4 * cfg.hidden_size + 2 * (cfg.q_size + 2 * cfg.kv_size) + 3 * cfg.intermediate_size
        activations = max_tokens * width * 2 + max_seqs * cfg.vocab_size * 4 * 3
        budget = int(free * utilization) - activations
        if budget < page_bytes:
            raise RuntimeError(
                f"no GPU memory left for the KV cache ({free / 2**30:.1f} GiB free after loading weights); "
                "lower max_num_batched_tokens or use a smaller model"
            )
        return budget // page_bytes

    # ---- requests ------------------------------------------------------------------------------------------

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer.json: pass prompts as lists of token ids")
            return self.tokenizer.encode(prompt)
        ids = [int(t) for t in prompt]
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.config.vocab_size})")
        return ids

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None) -> int:
        """Validate and queue a request; returns its id. Raises ValueError for a request that cannot run."""
        ids = self.encode(prompt)
        params = (params or SamplingParams()).with_defaults(self.generation_defaults)
        request = Request(rid=next(self._ids), prompt_ids=ids, params=params, arrival=next(self._arrivals))
        self.scheduler.add(request)
        return request.rid

    def abort(self, rid: int) -> bool:
        return self.scheduler.abort(rid) is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        """One scheduler step: schedule, run the model, sample, record. Returns the requests that finished."""
        scheduled = self.scheduler.schedule()
        sampled = self.runner.step(scheduled)
        finished = self.scheduler.update(scheduled, sampled)
        return [self._output(r) for r in finished]

    def _output(self, request: Request) -> RequestOutput:
        text = self.tokenizer.decode(request.output_ids) if self.tokenizer is not None else None
        return RequestOutput(
            request_id=request.rid,
            prompt_token_ids=request.prompt_ids,
            token_ids=request.output_ids,
            text=text,
            finish_reason=request.finish_reason.value,
            num_prompt_tokens=request.num_prompt_tokens,
            num_completion_tokens=request.num_output_tokens,
        )
