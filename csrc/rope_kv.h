// Host-side declaration of Qwen3's attention input kernel (no CUDA headers needed).
#pragma once

#include <cstdint>

#include "dtype.h"

namespace fastqwen {

// The head sizes the kernel is built for (any other takes the PyTorch reference).
constexpr int kRopeKVHeadDims[] = {64, 128, 256};

// The arguments of qk_norm_rope_store_kv, by name (pointers are device addresses, stream a cudaStream_t).
struct RopeKVArgs {
  uintptr_t qkv = 0;        // [T, (H + 2 H_kv) * D]
  uintptr_t q_weight = 0;   // [D], or 0 with k_weight 0: no per-head norm
  uintptr_t k_weight = 0;   // [D]
  uintptr_t cos_sin = 0;    // float32 [max_pos, D]: cos in the first half, sin in the second
  uintptr_t positions = 0;  // int64 [T]
  uintptr_t k_cache = 0;    // [num_slots, H_kv, D]
  uintptr_t v_cache = 0;
  uintptr_t out_slots = 0;  // int64 [T], -1 = no KV write
  uintptr_t q_out = 0;      // [T, H, D]
  int64_t num_tokens = 0, num_heads = 0, num_kv_heads = 0, head_dim = 0, max_pos = 0, num_slots = 0;
  double eps = 0.0;
  int dtype = -1;  // a code of dtype.h: float16 or bfloat16
  // The caches' type: dtype, or float8_e4m3fn, written as K / k_scale and V / v_scale rounded to nearest even and
  // saturated to +-448 (csrc/kv_fp8.cuh).
  int kv_dtype = -1;
  double k_scale = 1.0, v_scale = 1.0;
  uintptr_t stream = 0;
};

// For every token t and head: per-head RMSNorm of q and k (weights q_weight, k_weight; none when both are 0), NeoX
// RoPE at positions[t]
// with cos/sin rows of cos_sin, q -> q_out; rotated k and v -> k_cache / v_cache at out_slots[t] (-1 = skip).
// Positions outside [0, max_pos) give NaN q and skip the K/V write; slots >= num_slots are skipped. head_dim: one
// of kRopeKVHeadDims. Throws std::invalid_argument for bad arguments.
void qk_norm_rope_store_kv(const RopeKVArgs& args);

}  // namespace fastqwen
