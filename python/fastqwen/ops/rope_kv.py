"""Qwen3's attention input stage: per-head RMSNorm of q and k, NeoX RoPE, and the write of K and V into pages.

One op so that the CUDA version reads the fused qkv projection once and writes q, K and V once.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from ._native import check_tensors, dtype_code, kernel_applies, native, stream_of
from .kv_fp8 import is_fp8, store_rows
from .norm import rms_norm_reference

if TYPE_CHECKING:
    from ..config import YarnScaling


def rope_kv_kernel_applies(on_gpu: bool, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether qk_norm_rope_store_kv runs its CUDA kernel (else the reference) for qkv on the GPU or not, of this
    dtype and head size (csrc/rope_kv.h)."""
    return kernel_applies("qk_norm_rope_store_kv", on_gpu, dtype) and head_dim in native().ROPE_KV_HEAD_DIMS


def rope_cos_sin_cache(
    head_dim: int, max_positions: int, theta: float, device: torch.device, yarn: YarnScaling | None = None
) -> torch.Tensor:
    """[max_positions, head_dim] float32: cos of each frequency in the first half, sin in the second; with YaRN both
    times its attention factor, so the kernel and the reference need nothing more.

    inv_freq, the products and the attention factor are computed exactly as transformers' RoPE does, in float32.
    """
    inv_freq, attention_factor = rope_inv_freq(head_dim, theta, yarn, device)
    freqs = torch.arange(max_positions, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return (torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention_factor).contiguous()


def rope_inv_freq(
    head_dim: int, theta: float, yarn: YarnScaling | None, device: torch.device
) -> tuple[torch.Tensor, float]:
    """float32 inverse frequencies [head_dim / 2] and the factor cos and sin are multiplied by, as transformers'
    default and yarn RoPE compute them (modeling_rope_utils.py: _compute_default_rope_parameters,
    _compute_yarn_parameters), operation for operation so that the float32 roundings are the same."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    pos_freqs = theta**exponents
    if yarn is None:
        return 1.0 / pos_freqs, 1.0
    factor = yarn.factor
    if yarn.attention_factor is not None:
        attention_factor = yarn.attention_factor
    elif yarn.mscale and yarn.mscale_all_dim:
        attention_factor = _yarn_mscale(factor, yarn.mscale) / _yarn_mscale(factor, yarn.mscale_all_dim)
    else:
        attention_factor = _yarn_mscale(factor, 1.0)
    # The dimensions whose wavelength fits beta_fast times into the original length keep their frequency; those that
    # fit fewer than beta_slow times are interpolated (divided by factor); a linear ramp over the dimensions between.
    original = yarn.original_max_position_embeddings

    def dimension_turning(times: float) -> float:  # the (fractional) dimension that turns `times` over `original`
        return head_dim * math.log(original / (times * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension_turning(yarn.beta_fast), dimension_turning(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1).to(device)
    keep = 1 - ramp  # written as transformers writes it (1 - (1 - ramp) below is not ramp in float32)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    return inv_freq, float(attention_factor)


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope_reference(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D], cos_sin [T, D] (rows of the cache). HF rounds cos and sin to x's dtype first."""
    half = x.shape[-1] // 2
    cos = cos_sin[:, :half].repeat(1, 2).to(x.dtype)[:, None, :]
    sin = cos_sin[:, half:].repeat(1, 2).to(x.dtype)[:, None, :]
    return (x * cos) + (_rotate_half(x) * sin)


def qk_norm_rope_store_kv(
    qkv: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_slots: torch.Tensor,
    eps: float,
    q_out: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """qkv [T, (H + 2 * H_kv) * D] -> q_out [T, H, D] (normed, rotated); K (normed, rotated) and V to the caches.

    k_cache / v_cache are [num_pages, page_size, H_kv, D]; token t goes to flat slot out_slots[t]
    (page * page_size + offset); slot -1 marks padding and is not written. positions and out_slots are int64;
    cos_sin_cache is float32 [max_positions, D] from rope_cos_sin_cache. The caches hold qkv's dtype, or FP8 e4m3 of
    K / k_scale and V / v_scale (ops/kv_fp8.py: K rounded to qkv's dtype first, as it is for a 16-bit cache). Where
    rope_kv_kernel_applies (bf16 / fp16 CUDA tensors, head_dim 64, 128 or 256) this is one kernel launch
    (csrc/rope_kv.cu); otherwise the reference.

    q_weight = k_weight = None: no per-head norm (a Llama layer's attention, as the EAGLE-3 head's), in the kernel
    and the reference alike.
    """
    num_tokens = qkv.shape[0]
    if q_out.dim() != 3 or q_out.shape[0] != num_tokens:
        raise ValueError(f"qk_norm_rope_store_kv: q_out must be [{num_tokens}, H, D], got {tuple(q_out.shape)}")
    num_heads, head_dim = q_out.shape[1], q_out.shape[2]
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[3] != head_dim:
        raise ValueError(
            f"qk_norm_rope_store_kv: k_cache and v_cache must both be [pages, page_size, H_kv, {head_dim}], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    num_kv_heads = k_cache.shape[2]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != q_size + 2 * kv_size:
        raise ValueError(
            f"qk_norm_rope_store_kv: qkv must be [{num_tokens}, {q_size + 2 * kv_size}], got {tuple(qkv.shape)}"
        )
    normed = q_weight is not None
    if (k_weight is not None) != normed:
        raise ValueError("qk_norm_rope_store_kv: q_weight and k_weight are both given or both None")
    weights = (("q_weight", q_weight, (head_dim,)), ("k_weight", k_weight, (head_dim,))) if normed else ()
    for name, t, shape in (
        *weights,
        ("positions", positions, (num_tokens,)),
        ("out_slots", out_slots, (num_tokens,)),
    ):
        if tuple(t.shape) != shape:
            raise ValueError(f"qk_norm_rope_store_kv: {name} has shape {tuple(t.shape)}, expected {shape}")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != head_dim:
        raise ValueError(f"qk_norm_rope_store_kv: cos_sin_cache must be [max_positions, {head_dim}]")
    if k_cache.dtype != v_cache.dtype or not (k_cache.dtype == qkv.dtype or is_fp8(k_cache.dtype)):
        raise ValueError(
            f"qk_norm_rope_store_kv: the caches must both hold {qkv.dtype} or float8_e4m3fn, "
            f"not {k_cache.dtype} and {v_cache.dtype}"
        )
    if not (k_scale > 0 and v_scale > 0 and k_scale < float("inf") and v_scale < float("inf")):
        raise ValueError(
            f"qk_norm_rope_store_kv: k_scale and v_scale must be positive and finite, not {k_scale}, {v_scale}"
        )
    if rope_kv_kernel_applies(qkv.is_cuda, qkv.dtype, head_dim):
        norm_weights = {"q_weight": q_weight, "k_weight": k_weight} if normed else {}
        check_tensors(
            "qk_norm_rope_store_kv",
            qkv.device,
            qkv.dtype,
            qkv=qkv,
            **norm_weights,
            k_cache=(k_cache, None),
            v_cache=(v_cache, None),
            q_out=q_out,
            cos_sin_cache=(cos_sin_cache, torch.float32),
            positions=(positions, torch.int64),
            out_slots=(out_slots, torch.int64),
        )
        m = native()
        args = m.RopeKVArgs()
        args.qkv = qkv.data_ptr()
        if normed:  # (0 and 0: no per-head norm)
            args.q_weight, args.k_weight = q_weight.data_ptr(), k_weight.data_ptr()
        args.cos_sin, args.positions, args.out_slots = (
            cos_sin_cache.data_ptr(),
            positions.data_ptr(),
            out_slots.data_ptr(),
        )
        args.k_cache, args.v_cache, args.q_out = k_cache.data_ptr(), v_cache.data_ptr(), q_out.data_ptr()
        args.num_tokens, args.num_heads, args.num_kv_heads, args.head_dim = (
            num_tokens,
            num_heads,
            num_kv_heads,
            head_dim,
        )
        args.max_pos, args.num_slots = cos_sin_cache.shape[0], k_cache.shape[0] * k_cache.shape[1]
        args.eps, args.dtype, args.stream = eps, dtype_code(qkv.dtype), stream_of(qkv)
        args.kv_dtype, args.k_scale, args.v_scale = dtype_code(k_cache.dtype), k_scale, v_scale
        m.qk_norm_rope_store_kv(args)
        return q_out
    q = qkv[:, :q_size].reshape(num_tokens, num_heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].reshape(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, q_size + kv_size :].reshape(num_tokens, num_kv_heads, head_dim)
    cos_sin = cos_sin_cache[positions]
    if normed:
        q, k = rms_norm_reference(q, q_weight, eps), rms_norm_reference(k, k_weight, eps)
    q_out.copy_(apply_rope_reference(q, cos_sin))
    k = apply_rope_reference(k, cos_sin)
    valid = out_slots >= 0
    slots = out_slots[valid].long()
    store_rows(k_cache.view(-1, num_kv_heads, head_dim), slots, k[valid], k_scale)
    store_rows(v_cache.view(-1, num_kv_heads, head_dim), slots, v[valid], v_scale)
    return q_out
