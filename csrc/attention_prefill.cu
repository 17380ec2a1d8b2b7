// Paged prefill / extend attention on tensor cores (mma.sync m16n8k16, fp32 accumulate), FlashAttention-2 style.
//
// The G query heads that share a KV head are packed into the rows of one tile: packed row r of sequence b is query
// token r / G of head kvh * G + r % G, so a K/V tile loaded once serves all of them (and a 1-token sequence in a
// mixed batch fills G rows instead of one). A block owns 128 packed rows of one (sequence, KV head); its four warps
// own 32 rows each (two m16 tiles). K and V are gathered from their pages 64 tokens at a time with cp.async into
// double-buffered shared memory, so the next tile loads while this one is computed. The causal mask is aligned to
// the end of each sequence: query token i of n new tokens sits at position kv_len - n + i.
#include <algorithm>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "attention.h"
#include "common.cuh"
#include "cuda_check.h"
#include "device_cache.h"
#include "dtype.h"
#include "kv_fp8.cuh"
#include "mma.cuh"
#include "paged_kv.cuh"

namespace fastqwen {
namespace {
using namespace mma;

constexpr int kBM = 128;  // packed query rows per block
constexpr int kBN = kKVTile;  // keys per tile
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kChunks = kD / 8;  // 16-byte chunks per row
constexpr float kLog2e = 1.4426950408889634f;
static_assert(kThreads == kKVTileThreads, "load_kv_tile splits a tile over 128 threads");

struct Params {
  const void* q;
  const void* k_cache;
  const void* v_cache;
  const int* query_start;
  const int* page_table;
  const int* kv_lens;
  void* out;
  int num_heads, num_kv_heads, group, page_shift, max_pages;
  int64_t num_pages;
  float scale_log2;  // softmax scale * k_scale * log2(e)
  float v_scale;
};

// An e4m3 K or V tile (64 rows of 128 bytes, swizzled by load_kv_tile) to fp16 (swizzled [64][128]), by the block:
// each thread turns 8 bytes into one 16-byte chunk, 8 chunks of each tile. Every warp reads every key of a tile, so
// the block converts each once, here, rather than each warp in registers.
__device__ __forceinline__ void convert_fp8_tile(__half* dst, const Fp8E4M3* src, int tid) {
#pragma unroll
  for (int i = 0; i < kBN * kChunks / kThreads; ++i) {
    const int c = tid + i * kThreads;
    const int key = c / kChunks, chunk = c % kChunks;
    const uint2 raw = *reinterpret_cast<const uint2*>(src + key * kD + (((chunk >> 1) ^ (key & 7)) << 4) + (chunk & 1) * 8);
    const uint4 out = {fp8x2_to_half2(raw.x), fp8x2_to_half2(raw.x >> 16), fp8x2_to_half2(raw.y),
                       fp8x2_to_half2(raw.y >> 16)};
    *reinterpret_cast<uint4*>(dst + swz(key, chunk)) = out;
  }
}

// Shared memory: the Q tile and K, V in the tensor cores' type (double-buffered for 16-bit caches, which cp.async
// fills directly; single for FP8, converted from double-buffered e4m3 tiles).
template <typename C>
constexpr size_t smem_bytes() {
  return kIsFp8<C> ? (kBM + 2 * kBN) * kD * 2 + 4 * kBN * kD : (kBM + 4 * kBN) * kD * 2;
}

template <typename T, typename C>
__global__ void __launch_bounds__(kThreads, 2) prefill_kernel(const Params p) {
  constexpr bool kFp8 = kIsFp8<C>;
  using M = typename std::conditional<kFp8, __half, T>::type;  // the tensor cores' input type
  extern __shared__ __align__(128) unsigned char smem_raw[];
  M* sQ = reinterpret_cast<M*>(smem_raw);
  M* sK = sQ + kBM * kD;
  M* sV = sK + (kFp8 ? 1 : 2) * kBN * kD;
  C* rawK = reinterpret_cast<C*>(sV + (kFp8 ? 1 : 2) * kBN * kD);  // FP8: two e4m3 K tiles, then two V tiles
  C* rawV = rawK + 2 * kBN * kD;
  const T* q = static_cast<const T*>(p.q);
  const C* k_cache = static_cast<const C*>(p.k_cache);
  const C* v_cache = static_cast<const C*>(p.v_cache);
  T* out = static_cast<T*>(p.out);

  const int b = blockIdx.z, kvh = blockIdx.y;
  const int G = p.group;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int q0 = p.query_start[b];
  const int n_q = p.query_start[b + 1] - q0;
  const int rows = n_q * G;
  const int kv_len = p.kv_lens[b];
  const int prefix = kv_len - n_q;  // cached tokens before the first query; < 0 only on bad input
  const int* pages = p.page_table + static_cast<int64_t>(b) * p.max_pages;
  const int num_tiles = (rows + kBM - 1) / kBM;

  // The latest query tiles see the most keys: they go first, so the short ones fill in at the end.
  for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
    const int row0 = (num_tiles - 1 - t) * kBM;
    const int last_row = min(rows, row0 + kBM) - 1;
    const int kv_end = max(0, prefix + last_row / G + 1);  // keys the tile's last row sees
    const int full_end = prefix + row0 / G + 1;            // keys every row of the tile sees
    const int n_kv_tiles = (kv_end + kBN - 1) / kBN;

    // Q tile: 128 rows x 16 chunks, 16 per thread; rows past the sequence are zero. For FP8 caches Q goes to fp16
    // through registers (saturated to fp16's range).
#pragma unroll
    for (int i = 0; i < kBM * kChunks / kThreads; ++i) {
      const int c = tid + i * kThreads;
      const int row = c / kChunks, chunk = c % kChunks;
      const int pr = row0 + row;
      const bool valid = pr < rows;
      const T* src = q;
      if (valid) src = q + ((static_cast<int64_t>(q0) + pr / G) * p.num_heads + kvh * G + pr % G) * kD + chunk * 8;
      if constexpr (kFp8) {
        uint4 h = {0u, 0u, 0u, 0u};
        if (valid) {
          const Pack<T, 8> v = *reinterpret_cast<const Pack<T, 8>*>(src);
          unsigned w[4];
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            w[e] = Mma<__half>::pack(fminf(fmaxf(Cvt<T>::to_f(v.v[2 * e]), -65504.0f), 65504.0f),
                                     fminf(fmaxf(Cvt<T>::to_f(v.v[2 * e + 1]), -65504.0f), 65504.0f));
          }
          h = {w[0], w[1], w[2], w[3]};
        }
        *reinterpret_cast<uint4*>(sQ + swz(row, chunk)) = h;
      } else {
        cp_async16(sQ + swz(row, chunk), src, valid);
      }
    }
    // K and V tile j into buffer j & 1 (the e4m3 buffers for FP8 caches).
    auto load_kv = [&](int j) {
      if constexpr (kFp8) {
        load_kv_tile(rawK + (j & 1) * kBN * kD, rawV + (j & 1) * kBN * kD, k_cache, v_cache, pages, j * kBN, kv_end,
                     p.page_shift, p.max_pages, p.num_pages, p.num_kv_heads, kvh, tid);
      } else {
        load_kv_tile(sK + (j & 1) * kBN * kD, sV + (j & 1) * kBN * kD, k_cache, v_cache, pages, j * kBN, kv_end,
                     p.page_shift, p.max_pages, p.num_pages, p.num_kv_heads, kvh, tid);
      }
    };
    if (n_kv_tiles > 0) load_kv(0);
    cp_async_commit();

    // This thread's four rows: m16 tile mi, row g (h = 0) or g + 8 (h = 1) of it.
    int row_pos[2][2];
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
      for (int h = 0; h < 2; ++h) row_pos[mi][h] = prefix + (row0 + warp * 32 + mi * 16 + (lane >> 2) + h * 8) / G;

    float o[2][16][4];
    float m_run[2][2], l_run[2][2];
#pragma unroll
    for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
      for (int d = 0; d < 16; ++d)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[mi][d][e] = 0.0f;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        m_run[mi][h] = -INFINITY;
        l_run[mi][h] = 0.0f;
      }
    }

    for (int j = 0; j < n_kv_tiles; ++j) {
      cp_async_wait_all();
      __syncthreads();  // tile j (and Q) visible to all; every warp is done with the buffer tile j + 1 overwrites
      if (j + 1 < n_kv_tiles) load_kv(j + 1);
      cp_async_commit();
      const M* tk = sK;
      const M* tv = sV;
      if constexpr (kFp8) {
        convert_fp8_tile(sK, rawK + (j & 1) * kBN * kD, tid);
        convert_fp8_tile(sV, rawV + (j & 1) * kBN * kD, tid);
        __syncthreads();  // the fp16 tiles are whole (the next loop top keeps them until every warp is done)
      } else {
        tk += (j & 1) * kBN * kD;
        tv += (j & 1) * kBN * kD;
      }

      // S = Q K^T for this warp's 32 rows x 64 keys.
      float s[2][8][4];
#pragma unroll
      for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int ni = 0; ni < 8; ++ni)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[mi][ni][e] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < kD / 16; ++kk) {
        unsigned a[2][4];
#pragma unroll
        for (int mi = 0; mi < 2; ++mi) ldsm_x4(a[mi], sQ + swz(warp * 32 + mi * 16 + (lane & 15), kk * 2 + (lane >> 4)));
#pragma unroll
        for (int np = 0; np < kBN / 16; ++np) {
          unsigned bk[4];
          ldsm_x4(bk, tk + swz(np * 16 + (lane & 7) + ((lane >> 4) << 3), kk * 2 + ((lane >> 3) & 1)));
#pragma unroll
          for (int mi = 0; mi < 2; ++mi) {
            Mma<M>::run(s[mi][2 * np], a[mi], bk[0], bk[1]);
            Mma<M>::run(s[mi][2 * np + 1], a[mi], bk[2], bk[3]);
          }
        }
      }

      // Online softmax in log2 units; only tiles that reach past full_end need the causal mask.
      const bool masked = (j + 1) * kBN > full_end;
#pragma unroll
      for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float mx = -INFINITY;
#pragma unroll
          for (int ni = 0; ni < 8; ++ni) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              float x = s[mi][ni][h * 2 + e] * p.scale_log2;
              if (masked && j * kBN + ni * 8 + (lane & 3) * 2 + e > row_pos[mi][h]) x = -INFINITY;
              s[mi][ni][h * 2 + e] = x;
              mx = fmaxf(mx, x);
            }
          }
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
          const float m_new = fmaxf(m_run[mi][h], mx);
          const float m_use = m_new == -INFINITY ? 0.0f : m_new;  // a row with no key yet stays at zero
          const float alpha = fast_exp2(m_run[mi][h] - m_use);
          m_run[mi][h] = m_new;
          float sum = 0.0f;
#pragma unroll
          for (int ni = 0; ni < 8; ++ni) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const float pv = fast_exp2(s[mi][ni][h * 2 + e] - m_use);
              s[mi][ni][h * 2 + e] = pv;
              sum += pv;
            }
          }
          l_run[mi][h] = l_run[mi][h] * alpha + sum;  // this thread's share; the quad is summed at the end
#pragma unroll
          for (int d = 0; d < 16; ++d) {
            o[mi][d][h * 2] *= alpha;
            o[mi][d][h * 2 + 1] *= alpha;
          }
        }
      }

      // O += P V: the S accumulators of two adjacent key n-tiles are exactly an m16k16 A fragment.
#pragma unroll
      for (int kk = 0; kk < kBN / 16; ++kk) {
        unsigned a[2][4];
#pragma unroll
        for (int mi = 0; mi < 2; ++mi) {
          a[mi][0] = Mma<M>::pack(s[mi][2 * kk][0], s[mi][2 * kk][1]);
          a[mi][1] = Mma<M>::pack(s[mi][2 * kk][2], s[mi][2 * kk][3]);
          a[mi][2] = Mma<M>::pack(s[mi][2 * kk + 1][0], s[mi][2 * kk + 1][1]);
          a[mi][3] = Mma<M>::pack(s[mi][2 * kk + 1][2], s[mi][2 * kk + 1][3]);
        }
#pragma unroll
        for (int dp = 0; dp < kD / 16; ++dp) {
          unsigned bv[4];
          ldsm_x4_trans(bv, tv + swz(kk * 16 + (lane & 7) + (((lane >> 3) & 1) << 3), dp * 2 + (lane >> 4)));
#pragma unroll
          for (int mi = 0; mi < 2; ++mi) {
            Mma<M>::run(o[mi][2 * dp], a[mi], bv[0], bv[1]);
            Mma<M>::run(o[mi][2 * dp + 1], a[mi], bv[2], bv[3]);
          }
        }
      }
    }

    // Normalize and store this thread's rows (pairs of adjacent dims, 4 bytes at a time).
#pragma unroll
    for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float l = l_run[mi][h];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const float inv = l > 0.0f ? 1.0f / l * p.v_scale : 0.0f;
        const int pr = row0 + warp * 32 + mi * 16 + (lane >> 2) + h * 8;
        if (pr < rows) {
          T* dst = out + ((static_cast<int64_t>(q0) + pr / G) * p.num_heads + kvh * G + pr % G) * kD + (lane & 3) * 2;
#pragma unroll
          for (int d = 0; d < 16; ++d) {
            *reinterpret_cast<unsigned*>(dst + d * 8) = Mma<T>::pack(o[mi][d][h * 2] * inv, o[mi][d][h * 2 + 1] * inv);
          }
        }
      }
    }
    __syncthreads();  // the next tile's Q load reuses shared memory
  }
}

template <typename T, typename C>
void launch(const Params& p, int64_t batch, int64_t grid_x, cudaStream_t stream) {
  constexpr size_t kSmemBytes = smem_bytes<C>();
  static PerDevice<bool> configured;  // the opt-in to more than 48 KB of dynamic shared memory, per kernel and device
  configured.get([](int) {
    cuda_check(cudaFuncSetAttribute(prefill_kernel<T, C>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(kSmemBytes)),
               "paged_attention_prefill: cudaFuncSetAttribute");
    return true;
  });
  const dim3 grid(static_cast<unsigned>(grid_x), static_cast<unsigned>(p.num_kv_heads), static_cast<unsigned>(batch));
  prefill_kernel<T, C><<<grid, kThreads, kSmemBytes, stream>>>(p);
  cuda_check_launch("paged_attention_prefill kernel launch");
}

}  // namespace

void paged_attention_prefill(const PrefillArgs& a) {
  const std::string op = "paged_attention_prefill: ";
  const int shift = check_paged_attention(op, a);
  if (a.batch < 0 || a.batch > 65535 || a.num_kv_heads > 65535) throw std::invalid_argument(op + "batch or heads out of range");
  if (a.max_query_len < 0 || a.max_query_len > (int64_t{1} << 24)) {
    throw std::invalid_argument(op + "max_query_len out of range");
  }
  if (a.batch == 0 || a.max_query_len == 0) return;
  for (uintptr_t ptr : {a.q, a.k_cache, a.v_cache, a.out}) {
    if (ptr == 0 || !aligned16(ptr)) throw std::invalid_argument(op + "q, caches and out must be 16-byte aligned");
  }
  for (uintptr_t ptr : {a.query_start, a.page_table, a.kv_lens}) {
    if (ptr == 0 || ptr % 4 != 0) throw std::invalid_argument(op + "query_start, page_table and kv_lens must be int32");
  }
  const int64_t group = a.num_heads / a.num_kv_heads;
  const bool fp8 = a.kv_dtype == kFP8E4M3;
  Params p{reinterpret_cast<const void*>(a.q), reinterpret_cast<const void*>(a.k_cache),
           reinterpret_cast<const void*>(a.v_cache), reinterpret_cast<const int*>(a.query_start),
           reinterpret_cast<const int*>(a.page_table), reinterpret_cast<const int*>(a.kv_lens),
           reinterpret_cast<void*>(a.out), static_cast<int>(a.num_heads), static_cast<int>(a.num_kv_heads),
           static_cast<int>(group), shift, static_cast<int>(a.max_pages), a.num_pages,
           static_cast<float>(a.scale * (fp8 ? a.k_scale : 1.0)) * kLog2e, static_cast<float>(fp8 ? a.v_scale : 1.0)};
  // Enough blocks for the longest sequence's tiles; each block loops if a sequence has more (bad max_query_len).
  const int64_t grid_x = std::min<int64_t>((a.max_query_len * group + kBM - 1) / kBM, 65535);
  auto s = reinterpret_cast<cudaStream_t>(a.stream);
  FASTQWEN_DISPATCH_DTYPE("paged_attention_prefill: ", a.dtype, kHalfTypes, T,
                          fp8 ? launch<T, Fp8E4M3>(p, a.batch, grid_x, s) : launch<T, T>(p, a.batch, grid_x, s));
}

}  // namespace fastqwen
