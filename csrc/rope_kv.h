// Host-side declaration of Qwen3's attention input kernel (no CUDA headers needed).
#pragma once

#include <cstdint>

namespace fastqwen {

// For every token t and head: per-head RMSNorm of q and k (weights q_weight, k_weight, [head_dim]), NeoX RoPE at
// positions[t] with cos/sin rows of cos_sin [max_pos, head_dim] (float32: cos in the first half, sin in the second),
// q -> q_out [T, H, D]; rotated k and v -> k_cache / v_cache [num_slots, H_kv, D] at out_slots[t] (-1 = skip).
// qkv: [T, (H + 2 H_kv) * D]. positions / out_slots: int64 [T]. Positions outside [0, max_pos) give NaN q and
// skip the K/V write; slots >= num_slots are skipped. head_dim: 64, 128 or 256. dtype: 1 = fp16, 2 = bf16.
void qk_norm_rope_store_kv(uintptr_t qkv, uintptr_t q_weight, uintptr_t k_weight, uintptr_t cos_sin,
                           uintptr_t positions, uintptr_t k_cache, uintptr_t v_cache, uintptr_t out_slots,
                           uintptr_t q_out, int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads,
                           int64_t head_dim, int64_t max_pos, int64_t num_slots, double eps, int dtype,
                           uintptr_t stream);

}  // namespace fastqwen
