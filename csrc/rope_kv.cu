// qk-norm + NeoX RoPE + paged KV write: one warp per token and group of 4 heads. A q head
// is normed (unless no norm weights are given: a Llama layer's attention, as the EAGLE-3
// head's), rotated and written to q_out; a KV head's k is normed, rotated
// and written to its slot, and its v copied there. Each lane holds D/32
// consecutive elements, so the rotation partner (element +- D/2) sits in lane
// ^ 16. Rounds where HF rounds: after the norm, after the weight, after each
// product with the dtype-rounded cos and sin, and after their sum.
#include <stdexcept>
#include <string>

#include "common.cuh"
#include "cuda_check.h"
#include "dtype.h"
#include "kv_fp8.cuh"
#include "launch.cuh"
#include "rope_kv.h"

namespace fastqwen {
namespace {

constexpr int kWarpsPerBlock = 8;
// Heads per warp: at large batches 4, so that each warp has 4 heads' loads in flight and reads cos/sin once for
// them; at small batches 1, so that the few heads there are spread over more warps and finish sooner.
// The caches hold T, or e4m3 of the value divided by the tensor's scale (csrc/kv_fp8.cuh).
template <typename T, typename C, int kEpl>
__device__ __forceinline__ void store_kv(C* dst, const Pack<T, kEpl>& x, float scale) {
  if constexpr (kIsFp8<C>) {
    Pack<uint16_t, kEpl / 2> q;  // pairs of e4m3 bytes, low byte first
#pragma unroll
    for (int k = 0; k < kEpl / 2; ++k) {
      q.v[k] = static_cast<uint16_t>(fp8_from_float(Cvt<T>::to_f(x.v[2 * k]) / scale).bits |
                                     (fp8_from_float(Cvt<T>::to_f(x.v[2 * k + 1]) / scale).bits << 8));
    }
    *reinterpret_cast<Pack<uint16_t, kEpl / 2>*>(dst) = q;
  } else {
    *reinterpret_cast<Pack<T, kEpl>*>(dst) = x;
  }
}

template <typename T, typename C, int D, int kHeadsPerWarp>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    qk_norm_rope_kernel(const T* __restrict__ qkv, const T* __restrict__ q_weight, const T* __restrict__ k_weight,
                        const float* __restrict__ cos_sin, const int64_t* __restrict__ positions,
                        C* __restrict__ k_cache, C* __restrict__ v_cache, const int64_t* __restrict__ out_slots,
                        T* __restrict__ q_out, int num_tokens, int num_heads, int num_kv_heads, int64_t max_pos,
                        int64_t num_slots, float eps, float k_scale, float v_scale) {
  constexpr int kEpl = D / 32;  // elements per lane
  constexpr int kHalf = D / 2;
  using P = Pack<T, kEpl>;
  const int lane = threadIdx.x & 31;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int heads = num_heads + num_kv_heads;
  const int groups = (heads + kHeadsPerWarp - 1) / kHeadsPerWarp;
  if (warp >= static_cast<int64_t>(num_tokens) * groups) return;
  const int t = static_cast<int>(warp / groups);
  const int h0 = static_cast<int>(warp % groups) * kHeadsPerWarp;
  const T* row = qkv + static_cast<int64_t>(t) * (num_heads + 2 * num_kv_heads) * D;
  const int64_t slot = out_slots[t];
  const bool slot_ok = slot >= 0 && slot < num_slots;
  const int64_t pos = positions[t];
  const bool pos_ok = pos >= 0 && pos < max_pos;
  griddep_wait();               // qkv comes from the kernel before (the step's slots and positions did not)
  griddep_launch_dependents();  // (see common.cuh)

  // Issue every load first: the heads' inputs (k heads are skipped when their token writes no KV), v, weights.
  P in[kHeadsPerWarp], v[kHeadsPerWarp];
  bool active[kHeadsPerWarp];
#pragma unroll
  for (int i = 0; i < kHeadsPerWarp; ++i) {
    const int h = h0 + i;
    active[i] = h < heads && (h < num_heads || (slot_ok && pos_ok));
    if (active[i]) {
      in[i] = reinterpret_cast<const P*>(row + static_cast<int64_t>(h) * D)[lane];  // k heads follow the q heads
      if (h >= num_heads) v[i] = reinterpret_cast<const P*>(row + static_cast<int64_t>(h + num_kv_heads) * D)[lane];
    }
  }
  const bool normed = q_weight != nullptr;  // (both weights or neither: qk_norm_rope_store_kv checks)
  P qw{}, kw{};
  if (normed) {
    qw = reinterpret_cast<const P*>(q_weight)[lane];
    kw = reinterpret_cast<const P*>(k_weight)[lane];
  }
  const float* cs = cos_sin + (pos_ok ? pos : 0) * D;
  float c[kEpl], s[kEpl];
#pragma unroll
  for (int k = 0; k < kEpl; ++k) {
    const int f = (lane * kEpl + k) % kHalf;
    c[k] = round_to<T>(cs[f]);
    s[k] = round_to<T>(cs[kHalf + f]);
  }
  const bool first_half = lane < 16;

#pragma unroll
  for (int i = 0; i < kHeadsPerWarp; ++i) {
    if (!active[i]) continue;  // warp-uniform
    const int h = h0 + i;
    const bool is_q = h < num_heads;
    float x[kEpl];
    float sum_sq = 0.0f;
#pragma unroll
    for (int k = 0; k < kEpl; ++k) {
      x[k] = Cvt<T>::to_f(in[i].v[k]);
      sum_sq += x[k] * x[k];
    }
    if (normed) {  // (warp-uniform; without weights q and k are rotated as they are, a Llama layer's attention)
      const float inv_rms = rsqrtf(warp_sum(sum_sq) / static_cast<float>(D) + eps);
#pragma unroll
      for (int k = 0; k < kEpl; ++k) {
        const float w = Cvt<T>::to_f(is_q ? qw.v[k] : kw.v[k]);  // by value: a reference would push both to memory
        x[k] = round_to<T>(w * round_to<T>(x[k] * inv_rms));
      }
    }
    P out;
#pragma unroll
    for (int k = 0; k < kEpl; ++k) {
      const float partner = __shfl_xor_sync(0xffffffffu, x[k], 16);
      const float rotated = first_half ? -partner : partner;
      const float r = round_to<T>(round_to<T>(x[k] * c[k]) + round_to<T>(rotated * s[k]));
      out.v[k] = Cvt<T>::from_f(pos_ok ? r : __int_as_float(0x7fc00000));
    }
    if (is_q) {
      reinterpret_cast<P*>(q_out + (static_cast<int64_t>(t) * num_heads + h) * D)[lane] = out;
    } else {
      const int64_t dst = (slot * num_kv_heads + (h - num_heads)) * D + lane * kEpl;
      store_kv(k_cache + dst, out, k_scale);
      store_kv(v_cache + dst, v[i], v_scale);
    }
  }
}

// The scalars every launcher passes on.
struct Scalars {
  int64_t tokens, heads, kv_heads, max_pos, num_slots;
  float eps, k_scale, v_scale;
};

template <typename T, typename C, int D, int kHeadsPerWarp>
void launch_hpw(uintptr_t qkv, uintptr_t qw, uintptr_t kw, uintptr_t cos_sin, uintptr_t positions, uintptr_t k_cache,
                uintptr_t v_cache, uintptr_t slots, uintptr_t q_out, const Scalars& n, cudaStream_t stream) {
  const int64_t tokens = n.tokens, heads = n.heads, kv_heads = n.kv_heads;
  const int64_t groups = (heads + kv_heads + kHeadsPerWarp - 1) / kHeadsPerWarp;
  const int64_t blocks = (tokens * groups + kWarpsPerBlock - 1) / kWarpsPerBlock;
  launch_programmatic(
      qk_norm_rope_kernel<T, C, D, kHeadsPerWarp>, dim3(static_cast<unsigned>(blocks)), dim3(kWarpsPerBlock * 32), 0,
      stream, "qk_norm_rope_store_kv kernel launch", reinterpret_cast<const T*>(qkv), reinterpret_cast<const T*>(qw),
      reinterpret_cast<const T*>(kw),
      reinterpret_cast<const float*>(cos_sin), reinterpret_cast<const int64_t*>(positions),
      reinterpret_cast<C*>(k_cache), reinterpret_cast<C*>(v_cache), reinterpret_cast<const int64_t*>(slots),
      reinterpret_cast<T*>(q_out), static_cast<int>(tokens), static_cast<int>(heads), static_cast<int>(kv_heads),
      n.max_pos, n.num_slots, n.eps, n.k_scale, n.v_scale);
}

template <typename T, typename C, int D>
void launch(uintptr_t qkv, uintptr_t qw, uintptr_t kw, uintptr_t cos_sin, uintptr_t positions, uintptr_t k_cache,
            uintptr_t v_cache, uintptr_t slots, uintptr_t q_out, const Scalars& n, cudaStream_t stream) {
  // Below about 32 warps per SM (H100: 132 SMs) one head per warp; above, four.
  if (n.tokens * (n.heads + n.kv_heads) < 4096) {
    launch_hpw<T, C, D, 1>(qkv, qw, kw, cos_sin, positions, k_cache, v_cache, slots, q_out, n, stream);
  } else {
    launch_hpw<T, C, D, 4>(qkv, qw, kw, cos_sin, positions, k_cache, v_cache, slots, q_out, n, stream);
  }
}

template <typename T, typename C>
void dispatch_dim(int64_t head_dim, uintptr_t qkv, uintptr_t qw, uintptr_t kw, uintptr_t cos_sin, uintptr_t positions,
                  uintptr_t k_cache, uintptr_t v_cache, uintptr_t slots, uintptr_t q_out, const Scalars& n,
                  cudaStream_t s) {
  switch (head_dim) {
    case 64: launch<T, C, 64>(qkv, qw, kw, cos_sin, positions, k_cache, v_cache, slots, q_out, n, s); break;
    case 128: launch<T, C, 128>(qkv, qw, kw, cos_sin, positions, k_cache, v_cache, slots, q_out, n, s); break;
    default: launch<T, C, 256>(qkv, qw, kw, cos_sin, positions, k_cache, v_cache, slots, q_out, n, s); break;
  }
}

}  // namespace

void qk_norm_rope_store_kv(const RopeKVArgs& a) {
  const std::string op = "qk_norm_rope_store_kv: ";
  if (a.num_tokens < 0) throw std::invalid_argument(op + "num_tokens must be >= 0");
  if (a.num_heads < 1 || a.num_kv_heads < 1 || a.num_heads % a.num_kv_heads != 0) {
    throw std::invalid_argument(op + "num_heads must be a positive multiple of num_kv_heads");
  }
  bool dim_ok = false;
  for (int d : kRopeKVHeadDims) dim_ok = dim_ok || a.head_dim == d;
  if (!dim_ok) {
    throw std::invalid_argument(op + "head_dim must be 64, 128 or 256, got " + std::to_string(a.head_dim));
  }
  if (a.max_pos < 1 || a.num_slots < 0) throw std::invalid_argument(op + "max_pos must be >= 1 and num_slots >= 0");
  check_dtype(op, a.dtype, kHalfTypes);
  check_kv_cache(op, a.dtype, a.kv_dtype, a.k_scale, a.v_scale);
  if (!(a.eps >= 0.0)) throw std::invalid_argument(op + "eps must be >= 0");
  if (a.num_tokens * (a.num_heads + a.num_kv_heads) > (int64_t{1} << 31) * kWarpsPerBlock) {
    throw std::invalid_argument(op + "too many tokens");
  }
  if (a.num_tokens == 0) return;
  for (uintptr_t p : {a.qkv, a.cos_sin, a.positions, a.k_cache, a.v_cache, a.out_slots, a.q_out}) {
    if (p == 0) throw std::invalid_argument(op + "null data pointer");
  }
  if ((a.q_weight == 0) != (a.k_weight == 0)) {
    throw std::invalid_argument(op + "q_weight and k_weight are both given or both 0 (no per-head norm)");
  }
  // Each lane moves head_dim / 32 elements of 2 bytes (1 in an FP8 cache) at once; the index arrays are read as
  // int64, cos/sin as fp32.
  const bool fp8 = a.kv_dtype == kFP8E4M3;
  const uintptr_t pack = static_cast<uintptr_t>(a.head_dim / 32 * 2);
  const uintptr_t cache_pack = fp8 ? pack / 2 : pack;
  for (uintptr_t p : {a.qkv, a.q_weight, a.k_weight, a.q_out}) {
    if (p % pack != 0) throw std::invalid_argument(op + "q/k/v buffers must be aligned to " + std::to_string(pack) + " bytes");
  }
  for (uintptr_t p : {a.k_cache, a.v_cache}) {
    if (p % cache_pack != 0) {
      throw std::invalid_argument(op + "the caches must be aligned to " + std::to_string(cache_pack) + " bytes");
    }
  }
  if (a.positions % 8 != 0 || a.out_slots % 8 != 0 || a.cos_sin % 4 != 0) {
    throw std::invalid_argument(op + "positions / out_slots must be 8-byte and cos_sin 4-byte aligned");
  }
  auto s = reinterpret_cast<cudaStream_t>(a.stream);
  const Scalars n{a.num_tokens, a.num_heads, a.num_kv_heads, a.max_pos, a.num_slots, static_cast<float>(a.eps),
                  static_cast<float>(fp8 ? a.k_scale : 1.0), static_cast<float>(fp8 ? a.v_scale : 1.0)};
  FASTQWEN_DISPATCH_DTYPE("qk_norm_rope_store_kv: ", a.dtype, kHalfTypes, T,
                          fp8 ? dispatch_dim<T, Fp8E4M3>(a.head_dim, a.qkv, a.q_weight, a.k_weight, a.cos_sin,
                                                         a.positions, a.k_cache, a.v_cache, a.out_slots, a.q_out, n, s)
                              : dispatch_dim<T, T>(a.head_dim, a.qkv, a.q_weight, a.k_weight, a.cos_sin, a.positions,
                                                   a.k_cache, a.v_cache, a.out_slots, a.q_out, n, s));
}

}  // namespace fastqwen
