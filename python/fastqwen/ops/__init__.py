"""One Python function per kernel: the CUDA kernel for GPU tensors where one exists, the PyTorch reference otherwise.

Every op writes into caller-provided outputs, so nothing allocates inside a step. Each op module also says when its
kernel applies (`*_kernel_applies`), so that code which must know ahead (CUDA graphs) asks instead of guessing.
"""

from ._native import has_cuda_kernels
from .activation import silu_and_mul, silu_and_mul_kernel_applies
from .attention import (
    DecodeWorkspace,
    attention_kernel_applies,
    decode_workspace,
    decode_workspace_bytes,
    paged_attention,
    paged_attention_decode,
    paged_attention_prefill,
    plan_decode,
)
from .kv_fp8 import FP8_KV_DTYPE, dequantize_kv, is_fp8, quantize_kv
from .linear import (
    LinearWeight,
    QuantizedRows,
    gemv_kernel_applies,
    linear,
    linear_add_residual,
    linear_reference,
    linear_send,
    linear_silu_and_mul,
    norm_in_gemv_applies,
    prepare_linear,
    quantized_input_applies,
    silu_and_mul_quantized,
)
from .norm import fused_add_rms_norm, fused_add_rms_norm_quantized, rms_norm, rms_norm_kernel_applies
from .rope_kv import qk_norm_rope_store_kv, rope_cos_sin_cache, rope_kv_kernel_applies
from .sampling import (
    apply_penalties,
    apply_token_bitmask,
    bias_tokens,
    block_tokens,
    compute_logprobs,
    draw_reference,
    pack_sampler_rows,
    sample,
    sample_kernel_applies,
    sampler_workspace,
)

__all__ = [
    "apply_penalties",
    "apply_token_bitmask",
    "attention_kernel_applies",
    "bias_tokens",
    "block_tokens",
    "compute_logprobs",
    "DecodeWorkspace",
    "decode_workspace",
    "decode_workspace_bytes",
    "dequantize_kv",
    "draw_reference",
    "FP8_KV_DTYPE",
    "fused_add_rms_norm",
    "fused_add_rms_norm_quantized",
    "has_cuda_kernels",
    "is_fp8",
    "linear",
    "linear_add_residual",
    "linear_send",
    "linear_reference",
    "linear_silu_and_mul",
    "LinearWeight",
    "QuantizedRows",
    "gemv_kernel_applies",
    "norm_in_gemv_applies",
    "prepare_linear",
    "quantized_input_applies",
    "silu_and_mul_quantized",
    "pack_sampler_rows",
    "paged_attention",
    "paged_attention_decode",
    "paged_attention_prefill",
    "plan_decode",
    "qk_norm_rope_store_kv",
    "quantize_kv",
    "rms_norm",
    "rms_norm_kernel_applies",
    "rope_cos_sin_cache",
    "rope_kv_kernel_applies",
    "sample",
    "sample_kernel_applies",
    "sampler_workspace",
    "silu_and_mul",
    "silu_and_mul_kernel_applies",
]
