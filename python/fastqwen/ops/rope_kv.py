"""Qwen3's attention input stage: per-head RMSNorm of q and k, NeoX RoPE, and the write of K and V into pages.

One op so that the CUDA version reads the fused qkv projection once and writes q, K and V once.
"""

from __future__ import annotations

import torch

from .norm import rms_norm_reference


def rope_cos_sin_cache(head_dim: int, max_positions: int, theta: float, device: torch.device) -> torch.Tensor:
    """[max_positions, head_dim] float32: cos of each frequency in the first half, sin in the second.

    inv_freq and the products are computed exactly as transformers' default RoPE does, in float32.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    freqs = torch.arange(max_positions, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).contiguous()


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
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_slots: torch.Tensor,
    eps: float,
    q_out: torch.Tensor,
) -> torch.Tensor:
    """qkv [T, (H + 2 * H_kv) * D] -> q_out [T, H, D] (normed, rotated); K (normed, rotated) and V to the caches.

    k_cache / v_cache are [num_pages, page_size, H_kv, D]; token t goes to flat slot out_slots[t]
    (page * page_size + offset); slot -1 marks padding and is not written.
    """
    num_tokens = qkv.shape[0]
    num_heads, head_dim = q_out.shape[1], q_out.shape[2]
    num_kv_heads = k_cache.shape[2]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q = qkv[:, :q_size].reshape(num_tokens, num_heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].reshape(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, q_size + kv_size :].reshape(num_tokens, num_kv_heads, head_dim)
    cos_sin = cos_sin_cache[positions]
    q_out.copy_(apply_rope_reference(rms_norm_reference(q, q_weight, eps), cos_sin))
    k = apply_rope_reference(rms_norm_reference(k, k_weight, eps), cos_sin)
    valid = out_slots >= 0
    slots = out_slots[valid].long()
    k_cache.view(-1, num_kv_heads, head_dim)[slots] = k[valid].to(k_cache.dtype)
    v_cache.view(-1, num_kv_heads, head_dim)[slots] = v[valid].to(v_cache.dtype)
    return q_out
