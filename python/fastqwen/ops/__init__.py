"""One Python function per kernel: the CUDA kernel for GPU tensors where one exists, the PyTorch reference otherwise.

Every op writes into caller-provided outputs, so nothing allocates inside a step.
"""

from .activation import silu_and_mul
from .attention import DecodeWorkspace, decode_workspace, paged_attention_decode, paged_attention_prefill, plan_decode
from .norm import fused_add_rms_norm, rms_norm
from .rope_kv import qk_norm_rope_store_kv, rope_cos_sin_cache
from .sampling import apply_penalties, block_tokens, compute_logprobs, sample

__all__ = [
    "apply_penalties",
    "block_tokens",
    "compute_logprobs",
    "DecodeWorkspace",
    "decode_workspace",
    "fused_add_rms_norm",
    "paged_attention_decode",
    "paged_attention_prefill",
    "plan_decode",
    "qk_norm_rope_store_kv",
    "rms_norm",
    "rope_cos_sin_cache",
    "sample",
    "silu_and_mul",
]
