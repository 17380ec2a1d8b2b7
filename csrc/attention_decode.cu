// Paged decode attention: one block per (split, KV head, sequence) computes all G query heads that share the KV
// head, so each K and V row is read from memory once. A half-warp owns one token at a time (16 lanes x 16-byte
// packs = 128 dims), keeps an online softmax per head in fp32, and the block's eight half-warp states are merged
// in shared memory at the end. Long sequences with few blocks are split into chunks whose partial results are
// merged by log-sum-exp in a second small kernel.
#include <stdexcept>
#include <string>

#include "activation.h"
#include "attention.h"
#include "common.cuh"
#include "cuda_check.h"

namespace fastqwen {
namespace {

constexpr int kD = 128;
constexpr int kWarps = 4;
constexpr int kStates = kWarps * 2;  // half-warps per block
constexpr float kLog2e = 1.4426950408889634f;

// At most 128 registers per thread up to 4 query heads per KV head, so that four blocks (16 warps) fit on an SM:
// with 2 blocks (at 254 registers) the SM sat idle waiting on loads (ncu on H200: 12.5% occupancy, 28% of DRAM
// bandwidth).
template <typename T, int G>
__global__ void __launch_bounds__(kWarps * 32, G <= 4 ? 4 : 2)
    decode_kernel(const T* __restrict__ q, const T* __restrict__ k_cache, const T* __restrict__ v_cache,
                  const int* __restrict__ page_table, const int* __restrict__ kv_lens, T* __restrict__ out,
                  float* __restrict__ part_out, float* __restrict__ part_lse, int num_kv_heads, int page_shift,
                  int max_pages, int64_t num_pages, int num_splits, float scale_log2) {
  using P = Pack<T, 8>;
  // Tokens per half-warp per iteration, their loads issued together: the loop is bound by memory latency, so this
  // sets the bytes in flight. Fewer for large head groups, whose per-head state already takes many registers.
  constexpr int kUnroll = G <= 2 ? 4 : 2;
  const int split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int num_heads = num_kv_heads * G;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int sub = lane & 15;   // which 8 dims of the head this lane holds
  const int half = lane >> 4;  // which token of the warp's pair
  const int state = warp * 2 + half;

  const int len = max(kv_lens[b], 0);
  const int chunk = (len + num_splits - 1) / num_splits;
  const int start = split * chunk;
  const int end = min(len, start + chunk);

  float qf[G][8];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const P qp = reinterpret_cast<const P*>(q + (static_cast<int64_t>(b) * num_heads + kvh * G + g) * kD)[sub];
#pragma unroll
    for (int k = 0; k < 8; ++k) qf[g][k] = Cvt<T>::to_f(qp.v[k]) * scale_log2;  // scores in log2 units
  }
  float m[G], l[G], acc[G][8];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.0f;
#pragma unroll
    for (int k = 0; k < 8; ++k) acc[g][k] = 0.0f;
  }

  const int* pages = page_table + static_cast<int64_t>(b) * max_pages;
  const int page_mask = (1 << page_shift) - 1;
  // The loop is uniform over the warp (both halves run the same iterations): the shuffles below need every lane.
  for (int t0 = start + warp * 2; t0 < end; t0 += kStates * kUnroll) {
    P kp[kUnroll], vp[kUnroll];
    bool valid[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int t = t0 + half + u * kStates;
      valid[u] = t < end;
      kp[u] = P{};  // an invalid token's score is computed and then ignored: keep it finite
      vp[u] = P{};
      if (valid[u]) {
        const int64_t page = pages[t >> page_shift];
        const int64_t row = ((page << page_shift) + (t & page_mask)) * num_kv_heads + kvh;
        if (page >= 0 && page < num_pages) {
          kp[u] = reinterpret_cast<const P*>(k_cache + row * kD)[sub];
          vp[u] = reinterpret_cast<const P*>(v_cache + row * kD)[sub];
        } else {
          valid[u] = false;  // a corrupt page id never reads out of bounds
        }
      }
    }
    // Scores of the whole tile first (independent, so their shuffles and FMAs overlap), then one rescale per head
    // for the tile instead of one per token.
    float score[kUnroll][G];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      float kf[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) kf[k] = Cvt<T>::to_f(kp[u].v[k]);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        float s = 0.0f;
#pragma unroll
        for (int k = 0; k < 8; ++k) s += qf[g][k] * kf[k];
        score[u][g] = s;
      }
    }
#pragma unroll
    for (int offset = 8; offset > 0; offset >>= 1) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
        for (int g = 0; g < G; ++g) score[u][g] += __shfl_xor_sync(0xffffffffu, score[u][g], offset);
      }
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float m_tile = m[g];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) m_tile = valid[u] ? fmaxf(m_tile, score[u][g]) : m_tile;
      if (m_tile == -INFINITY) continue;  // nothing valid yet (uniform over the half-warp)
      const float corr = exp2f(m[g] - m_tile);
      l[g] *= corr;
#pragma unroll
      for (int k = 0; k < 8; ++k) acc[g][k] *= corr;
      m[g] = m_tile;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (!valid[u]) continue;
      float vf[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) vf[k] = Cvt<T>::to_f(vp[u].v[k]);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const float p = exp2f(score[u][g] - m[g]);
        l[g] += p;
#pragma unroll
        for (int k = 0; k < 8; ++k) acc[g][k] += p * vf[k];
      }
    }
  }

  // Merge the block's half-warp states, one (head, dim) per thread at a time.
  __shared__ float sm_m[kStates][G], sm_l[kStates][G];
  __shared__ float sm_acc[kStates][G][kD];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    if (sub == 0) {
      sm_m[state][g] = m[g];
      sm_l[state][g] = l[g];
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) sm_acc[state][g][sub * 8 + k] = acc[g][k];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < G * kD; i += blockDim.x) {
    const int g = i / kD, d = i % kD;
    float m_all = -INFINITY;
#pragma unroll
    for (int s = 0; s < kStates; ++s) m_all = fmaxf(m_all, sm_m[s][g]);
    float l_all = 0.0f, o = 0.0f;
    if (m_all != -INFINITY) {
#pragma unroll
      for (int s = 0; s < kStates; ++s) {
        const float w = exp2f(sm_m[s][g] - m_all);
        l_all += sm_l[s][g] * w;
        o += sm_acc[s][g][d] * w;
      }
    }
    const int h = kvh * G + g;
    const float result = l_all > 0.0f ? o / l_all : 0.0f;
    if (num_splits == 1) {
      out[(static_cast<int64_t>(b) * num_heads + h) * kD + d] = Cvt<T>::from_f(result);
    } else {
      const int64_t part = (static_cast<int64_t>(b) * num_heads + h) * num_splits + split;
      part_out[part * kD + d] = result;
      if (d == 0) part_lse[part] = l_all > 0.0f ? m_all + log2f(l_all) : -INFINITY;  // log2 units
    }
  }
}

// out[b, h] = sum over splits of part_out weighted by 2^(lse - max lse), normalized.
template <typename T>
__global__ void merge_kernel(const float* __restrict__ part_out, const float* __restrict__ part_lse,
                             T* __restrict__ out, int num_splits) {
  const int64_t bh = blockIdx.x;  // b * H + h
  const int d = threadIdx.x;
  float m_all = -INFINITY;
  for (int s = 0; s < num_splits; ++s) m_all = fmaxf(m_all, part_lse[bh * num_splits + s]);
  float w_sum = 0.0f, o = 0.0f;
  if (m_all != -INFINITY) {
    for (int s = 0; s < num_splits; ++s) {
      const float w = exp2f(part_lse[bh * num_splits + s] - m_all);
      w_sum += w;
      o += w * part_out[(bh * num_splits + s) * kD + d];
    }
  }
  out[bh * kD + d] = Cvt<T>::from_f(w_sum > 0.0f ? o / w_sum : 0.0f);
}

template <typename T, int G>
void launch(uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t pt, uintptr_t lens, uintptr_t out, uintptr_t part_out,
            uintptr_t part_lse, int64_t batch, int64_t kv_heads, int page_shift, int64_t max_pages, int64_t num_pages,
            int64_t splits, float scale_log2, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(splits), static_cast<unsigned>(kv_heads), static_cast<unsigned>(batch));
  decode_kernel<T, G><<<grid, kWarps * 32, 0, stream>>>(
      reinterpret_cast<const T*>(q), reinterpret_cast<const T*>(k), reinterpret_cast<const T*>(v),
      reinterpret_cast<const int*>(pt), reinterpret_cast<const int*>(lens), reinterpret_cast<T*>(out),
      reinterpret_cast<float*>(part_out), reinterpret_cast<float*>(part_lse), static_cast<int>(kv_heads), page_shift,
      static_cast<int>(max_pages), num_pages, static_cast<int>(splits), scale_log2);
  cuda_check_launch("paged_attention_decode kernel launch");
  if (splits > 1) {
    merge_kernel<T><<<static_cast<unsigned>(batch * kv_heads * G), kD, 0, stream>>>(
        reinterpret_cast<const float*>(part_out), reinterpret_cast<const float*>(part_lse), reinterpret_cast<T*>(out),
        static_cast<int>(splits));
    cuda_check_launch("paged_attention_decode merge launch");
  }
}

template <typename T>
void dispatch_group(int64_t group, uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t pt, uintptr_t lens, uintptr_t out,
                    uintptr_t po, uintptr_t pl, int64_t batch, int64_t kv_heads, int shift, int64_t max_pages,
                    int64_t num_pages, int64_t splits, float sl, cudaStream_t s) {
  switch (group) {
    case 1: launch<T, 1>(q, k, v, pt, lens, out, po, pl, batch, kv_heads, shift, max_pages, num_pages, splits, sl, s); break;
    case 2: launch<T, 2>(q, k, v, pt, lens, out, po, pl, batch, kv_heads, shift, max_pages, num_pages, splits, sl, s); break;
    case 3: launch<T, 3>(q, k, v, pt, lens, out, po, pl, batch, kv_heads, shift, max_pages, num_pages, splits, sl, s); break;
    case 4: launch<T, 4>(q, k, v, pt, lens, out, po, pl, batch, kv_heads, shift, max_pages, num_pages, splits, sl, s); break;
    case 5: launch<T, 5>(q, k, v, pt, lens, out, po, pl, batch, kv_heads, shift, max_pages, num_pages, splits, sl, s); break;
    case 6: launch<T, 6>(q, k, v, pt, lens, out, po, pl, batch, kv_heads, shift, max_pages, num_pages, splits, sl, s); break;
    case 7: launch<T, 7>(q, k, v, pt, lens, out, po, pl, batch, kv_heads, shift, max_pages, num_pages, splits, sl, s); break;
    default: launch<T, 8>(q, k, v, pt, lens, out, po, pl, batch, kv_heads, shift, max_pages, num_pages, splits, sl, s); break;
  }
}

}  // namespace

void paged_attention_decode(uintptr_t q, uintptr_t k_cache, uintptr_t v_cache, uintptr_t page_table,
                            uintptr_t kv_lens, uintptr_t out, uintptr_t part_out, uintptr_t part_lse,
                            int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                            int64_t page_size, int64_t max_pages, int64_t num_pages, int64_t num_splits, double scale,
                            int dtype, uintptr_t stream) {
  const std::string op = "paged_attention_decode: ";
  if (head_dim != kD) throw std::invalid_argument(op + "head_dim must be 128, got " + std::to_string(head_dim));
  if (num_kv_heads < 1 || num_heads % num_kv_heads != 0 || num_heads / num_kv_heads > 8) {
    throw std::invalid_argument(op + "num_heads must be 1 to 8 times num_kv_heads");
  }
  if (page_size < 1 || (page_size & (page_size - 1)) != 0 || page_size > 1024) {
    throw std::invalid_argument(op + "page_size must be a power of two up to 1024");
  }
  if (batch < 0 || batch > 65535 || num_kv_heads > 65535) throw std::invalid_argument(op + "batch or heads out of range");
  if (num_splits < 1 || num_splits > 1024) throw std::invalid_argument(op + "num_splits must be in [1, 1024]");
  if (max_pages < 1 || num_pages < 1) throw std::invalid_argument(op + "max_pages and num_pages must be >= 1");
  if (dtype != kF16 && dtype != kBF16) throw std::invalid_argument(op + "dtype must be float16 or bfloat16");
  if (batch == 0) return;
  for (uintptr_t p : {q, k_cache, v_cache, out}) {
    if (p == 0 || !aligned16(p)) throw std::invalid_argument(op + "q, caches and out must be 16-byte aligned");
  }
  if (page_table == 0 || kv_lens == 0 || page_table % 4 != 0 || kv_lens % 4 != 0) {
    throw std::invalid_argument(op + "page_table and kv_lens must be int32 buffers");
  }
  if (num_splits > 1 && (part_out == 0 || part_lse == 0)) throw std::invalid_argument(op + "splitting needs a workspace");
  int shift = 0;
  while ((int64_t{1} << shift) < page_size) ++shift;
  const float scale_log2 = static_cast<float>(scale) * kLog2e;
  auto s = reinterpret_cast<cudaStream_t>(stream);
  const int64_t group = num_heads / num_kv_heads;
  if (dtype == kF16) {
    dispatch_group<__half>(group, q, k_cache, v_cache, page_table, kv_lens, out, part_out, part_lse, batch,
                           num_kv_heads, shift, max_pages, num_pages, num_splits, scale_log2, s);
  } else {
    dispatch_group<__nv_bfloat16>(group, q, k_cache, v_cache, page_table, kv_lens, out, part_out, part_lse, batch,
                                  num_kv_heads, shift, max_pages, num_pages, num_splits, scale_log2, s);
  }
}

}  // namespace fastqwen
