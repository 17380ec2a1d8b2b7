// The GEMV of 2 to 8 tokens on the tensor cores (gemv.cu sends it the calls it takes): out = x @ W^T for dense
// bf16/fp16 weights and for FP8 e4m3 weights with 128x128 block scales.
//
// Why tensor cores for a GEMV: decode is bound by reading the weights, but the arithmetic per weight byte of the
// FP8 kernel in gemv.cu (e4m3 -> f16 -> f32, one FMA per weight) is slow enough that it does not hide under the
// loads. On the H100, bench/dequant_rates.cu turns weight bytes from registers into dot products at 13.6 TB/s that
// way, at 21.9 TB/s with the hardware e4m3x2 -> f16x2 conversion feeding mma.sync m16n8k16, and bf16 weights at
// 22.7 TB/s with FMAs against 47.7 TB/s with the mma (git show 1274b3f:bench/results/2026-11-23-h100-gemv-tc). The token dimension
// of the mma (8 columns) carries up to 8 tokens at the cost of one, where gemv.cu's FMAs grow with each token.
//
// Layout. A block owns a tile of 16 weight rows (with SILU_GATE_UP: 8 gate rows and the same 8 up rows) and its
// kWarps warps take turns along the row in steps of 128 bytes (unit u goes to warp u % kWarps), kDepth steps in
// flight each. Lane (g, q) = (lane / 4, lane % 4) loads bytes [32q, 32q + 32) of the step from rows g and g + 8,
// which are exactly the A fragments of the step's mmas up to an order of k that the x fragments (B, column g = token
// g) follow: a dot product does not care in which order its k come. FP8: one step is 128 k, one scale block: eight
// mmas into a fresh sum that is then multiplied by the rows' scales. Dense: one step is 64 k, four mmas.
//
// Numerics. Products are exact and sums fp32, in the tensor cores. Dense weights multiply x as it is. FP8 weights
// are exact in f16, and so is x after each warp multiplies its share of a token by the power of two that puts the
// share's largest magnitude in [2^15, 2^16) (bf16 has 8 significant bits, f16 11): only values more than 2^29 times
// smaller than that largest one round (to f16 subnormals), by at most 2^-40 of it; the warp's sums are divided by
// the same power of two. The pipelines that read x as it is (7..) leave it as it is and bring the weights to its
// type instead (e4m3 is exact in bf16 and in f16): the same products. One rounding to the output type, as in gemv.cu.
//
// Programmatic dependent launch as in gemv.cu: the first kDepth steps of weights and scales load before
// griddep_wait(); x is read and out written after it.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

#include "common.cuh"
#include "cuda_check.h"
#include "device_cache.h"
#include "gemv_tc.h"
#include "launch.cuh"
#include "mma.cuh"

namespace fastqwen {
namespace {

constexpr int kWarps = 8;
constexpr int kStepBytes = 128;    // bytes of each row per step (FP8: one 128-wide scale block)
constexpr int kMaxSmem = 100 * 1024;  // FP8: x as f16, tokens x row length x 2 bytes
constexpr int kSmemPerSm = 228 * 1024;  // Hopper's shared memory per SM (what persistent grids are sized by)
constexpr int kStaticSmem = (kWarps * kGemvTcMaxTokens * 16 + kWarps * kGemvTcMaxTokens) * 4;  // partial, inv_up

// d += a (16 x 16, row) * b (16 x 8, col), fp32 accumulation (mma.cuh); f16 or bf16 operands.
template <typename In>
__device__ __forceinline__ void mma16816(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                                         unsigned b1) {
  const unsigned a[4] = {a0, a1, a2, a3};
  mma::Mma<In>::run(d, a, b0, b1);
}

// One step of weights: rows g and g + 8, 32 bytes each (lo0, lo1 of row g; hi0, hi1 of row g + 8), and with FP8 the
// two rows' scales for the step's 128-wide block.
struct Step {
  uint4 lo0, lo1, hi0, hi1;
  float scale_lo, scale_hi;
};

template <bool FP8>
__device__ __forceinline__ void load_step(Step& st, const uint8_t* row_lo, const uint8_t* row_hi, int unit,
                                          const float* scale_lo, const float* scale_hi) {
  const int off = unit * kStepBytes;
  st.lo0 = load_stream(row_lo + off);
  st.lo1 = load_stream(row_lo + off + 16);
  st.hi0 = load_stream(row_hi + off);
  st.hi1 = load_stream(row_hi + off + 16);
  if constexpr (FP8) {
    st.scale_lo = __ldg(scale_lo + unit);
    st.scale_hi = __ldg(scale_hi + unit);
  }
}

// Tiles of a call: 16 weight rows each, or 8 gate + 8 up rows with SILU (the grid, the persistent loop, kByGrid).
__host__ __device__ __forceinline__ int tile_count(int n, bool silu) { return silu ? (n / 2 + 7) / 8 : (n + 15) / 16; }

// FP8 staging of x (stage_x, stage_x_grouped): piece p (16 bytes, 8 values) of a token's share for this warp is unit
// warp + (p / 16) * kWarps, values (p % 16) * 8 ..
template <typename T>
__device__ __forceinline__ const uint4* x_piece(const T* xt, int warp, int p) {
  return reinterpret_cast<const uint4*>(xt + (warp + (p >> 4) * kWarps) * kStepBytes) + (p & 15);
}

// The largest of `big` and the magnitudes of a piece's 8 values.
template <typename T>
__device__ __forceinline__ float max_abs8(uint4 v, float big) {
  const unsigned words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = to_float2(words[i], T{});
    big = fmaxf(big, fmaxf(fabsf(f.x), fabsf(f.y)));
  }
  return big;
}

// The power of two (its exponent) that puts a share's largest magnitude `big` in [2^15, 2^16).
__device__ __forceinline__ int x_shift(float big) {
  int e = 16;  // zero, inf: no scaling
  if (big > 0.0f && big <= 3.0e38f) frexpf(big, &e);  // big in [2^(e-1), 2^e)
  return min(16 - e, 126);  // (2^126 and its inverse are normal floats)
}

// A piece's 8 values times `up`, as f16.
template <typename T>
__device__ __forceinline__ uint4 to_half8(uint4 v, float up) {
  const unsigned words[4] = {v.x, v.y, v.z, v.w};
  unsigned h[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = to_float2(words[i], T{});
    const __half2 c = __floats2half2_rn(f.x * up, f.y * up);
    h[i] = *reinterpret_cast<const unsigned*>(&c);
  }
  return make_uint4(h[0], h[1], h[2], h[3]);
}

// FP8: this warp's share of token t (its units) as f16 in shared memory, times the power of two that puts the share's
// largest magnitude in [2^15, 2^16); returns 1 / that power. xs: [units][128] halves for the token.
template <typename T>
__device__ __forceinline__ float stage_x(const T* __restrict__ xt, __half* xs, int warp, int units, int lane) {
  const int num = units * (kStepBytes / 8);  // pieces of the share
  float big = 0.0f;
  for (int p = lane; p < num; p += 32) big = max_abs8<T>(__ldg(x_piece(xt, warp, p)), big);
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) big = fmaxf(big, __shfl_xor_sync(0xffffffffu, big, offset));
  const int shift = x_shift(big);
  const float up = ldexpf(1.0f, shift);
  for (int p = lane; p < num; p += 32) reinterpret_cast<uint4*>(xs)[p] = to_half8<T>(__ldg(x_piece(xt, warp, p)), up);
  return ldexpf(1.0f, -shift);
}

// FP8: stage_x for every token (the same halves and powers of two, bit for bit: fmaxf's maximum does not depend on the
// order), with the loads of up to kGroup tokens in flight together; stage_x waits for one token's loads before the
// next token's start. inv_up[t]: 1 / token t's power of two.
template <typename T>
__device__ __forceinline__ void stage_x_grouped(const T* __restrict__ x, int m, int k, __half* xs, int per_warp,
                                                int warp, int units, int lane, float* inv_up) {
  constexpr int kGroup = 4;
  const int num = units * (kStepBytes / 8);  // pieces of a token's share
  for (int t0 = 0; t0 < m; t0 += kGroup) {
    auto load = [&](uint4 (&v)[kGroup], int p) {  // piece p of every token of the group, all in flight at once
#pragma unroll
      for (int j = 0; j < kGroup; ++j) {
        if (t0 + j < m) v[j] = __ldg(x_piece(x + static_cast<int64_t>(t0 + j) * k, warp, p));
      }
    };
    float big[kGroup], up[kGroup];
#pragma unroll
    for (int j = 0; j < kGroup; ++j) big[j] = 0.0f;
    for (int p = lane; p < num; p += 32) {
      uint4 v[kGroup];
      load(v, p);
#pragma unroll
      for (int j = 0; j < kGroup; ++j) {
        if (t0 + j < m) big[j] = max_abs8<T>(v[j], big[j]);
      }
    }
#pragma unroll
    for (int j = 0; j < kGroup; ++j) {
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) big[j] = fmaxf(big[j], __shfl_xor_sync(0xffffffffu, big[j], offset));
      const int shift = x_shift(big[j]);
      up[j] = ldexpf(1.0f, shift);
      if (lane == 0 && t0 + j < m) inv_up[t0 + j] = ldexpf(1.0f, -shift);
    }
    for (int p = lane; p < num; p += 32) {  // (these loads hit L1)
      uint4 v[kGroup];
      load(v, p);
#pragma unroll
      for (int j = 0; j < kGroup; ++j) {
        if (t0 + j < m) reinterpret_cast<uint4*>(xs)[(t0 + j) * per_warp * (kStepBytes / 8) + p] = to_half8<T>(v[j], up[j]);
      }
    }
  }
}

// Grid: one block per tile (16 rows, or 8 gate + 8 up rows). m: 1 to 8 tokens. Dynamic shared memory (FP8 only):
// kWarps x m x units-per-warp x 128 halves.
// kDepth: steps of weights in flight per warp; kMinBlocks: blocks per SM the registers must allow (3: 80 registers a
// thread, 2: 128); kGroupedX: x staged by stage_x_grouped. FP8 pipelines (set_gemv_tc_fp8_variant): at k = 4,096 a
// warp has 4 steps in all, so pipeline 0's two-deep ring holds half of them while x is staged one token after the
// other (an H100's FP8 o_proj: 13.9 us at 4 tokens, 6.1 at 1); the others keep more weights or more of x in flight
// at fewer blocks per SM (each compiles without spills). Pipeline 3 (x staged four tokens at a time, 2 blocks per SM)
// was the fastest in the whole engine: FP8 speculation at k = 3 on an H200, 2.38 ms a token through HTTP against 2.53
// with pipeline 0. Pipeline 5 is 3 with persistent blocks: a layer's four FP8 projections on an H100 in 83.8 /
// 88.3 / 92.9 us at 2 / 3 / 4 tokens against 3's 89.8 / 98.3 / 106.8 (gate_up at 4 tokens: 38.0 against 50.2). The
// default is kByGrid (below): 79.6 / 79.9 / 80.9 us on the same H100 against 5's 83.8 / 85.8 / 92.9
// (bench/results/current/speculative.md).
// kPersistent (pipelines 5, 6): a grid of as many blocks as the SMs hold at once, each staging x once and then taking
// tiles blockIdx.x, + gridDim.x, ... (the next tile's first weight steps load while this tile's sums are reduced):
// every block of the others stages all of x again (two passes over m x k values, two round trips to memory before its
// first mma), and gate_up's 1,536 tiles are several waves of blocks. The same arithmetic, bit for bit.
// kDirectX (pipelines 7..): no staging. x is read from memory as it is, like the dense kernel's, and the weights are
// brought to x's type: f16 by the hardware conversion for fp16 models, bf16 by placing the bits (common.cuh's
// e4m3x2_lo_bf16) for bf16 ones, so products stay exact and the only cost that grows with the tokens is x's loads
// (L1 hits). No shared memory: more blocks per SM and no round trips before the first mma. The sums are the staged
// pipelines' scaled by powers of two that cancel, the same bits wherever the staging's f16 did not round (values
// 2^29 times smaller than their share's largest).
struct Fp8Pipeline {
  int depth, min_blocks;
  bool grouped_x;   // x staged by stage_x_grouped (up to four tokens' loads in flight together) instead of stage_x
  bool persistent;  // blocks take tiles in turn, x staged once per block
  bool direct_x = false;  // x read as it is, the weights converted to its type (no staging)
};
constexpr Fp8Pipeline kFp8Pipelines[] = {
    {2, 3, false, false},       {4, 2, false, false},       {3, 2, false, false},       {2, 2, true, false},
    {3, 2, true, false},        {2, 2, true, true},         {2, 3, false, true},        {2, 3, false, false, true},
    {3, 2, false, false, true}, {4, 2, false, false, true}, {2, 3, false, true, true},  {3, 2, false, true, true}};
constexpr int kNumFp8Pipelines = sizeof(kFp8Pipelines) / sizeof(kFp8Pipelines[0]);
// One more variant number, kByGrid, picks a pipeline per call from the grid: a grid that one wave of blocks holds
// at 2 blocks per SM takes the deepest ring (8: 3 steps), one that 3 per SM hold takes 7 (2 steps, 3 blocks per SM),
// a larger one the persistent blocks of 11. On an H100 at 4 tokens (bench_gemv): o_proj and down (256 tiles) 8.88 and
// 20.99 us with 8 against 11.15 and 26.68 with 7; qkv (384 tiles) 11.93 with 7 against 13.31 with 8, whose 264 blocks
// leave a second, partial wave.
constexpr int kByGrid = kNumFp8Pipelines;
constexpr int kDefaultFp8Pipeline = kByGrid;
int g_fp8_pipeline = kDefaultFp8Pipeline;

static_assert(kFp8Pipelines[7].direct_x && kFp8Pipelines[8].direct_x && kFp8Pipelines[11].direct_x &&
                  kFp8Pipelines[8].depth == 3 && kFp8Pipelines[11].persistent,
              "fp8_pipeline_for names pipelines by number");
int fp8_pipeline_for(int tiles, int num_sms) {
  if (tiles <= 2 * num_sms) return 8;
  if (tiles <= 3 * num_sms) return 7;
  return 11;
}

template <typename T, bool FP8, bool SILU_GATE_UP, int kDepth = 2, int kMinBlocks = 3, bool kGroupedX = false,
          bool kPersistent = false, bool kDirectX = false>
__global__ void __launch_bounds__(kWarps * 32, kMinBlocks)
    gemv_tc_kernel(T* __restrict__ out, const T* __restrict__ x, const uint8_t* __restrict__ w,
                   const float* __restrict__ scale, const T* __restrict__ bias, int m, int n, int k) {
  // f16 operands for staged FP8 (the hardware conversion's output) and for fp16 models; otherwise x's type.
  constexpr bool kStaged = FP8 && !kDirectX;
  using In = std::conditional_t<kStaged, __half, T>;
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ float partial[kWarps][kGemvTcMaxTokens][16];
  __shared__ float inv_up[kWarps][kGemvTcMaxTokens];  // FP8: 1 / each token's power of two (this warp's share)
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
  const int row_bytes = FP8 ? k : k * static_cast<int>(sizeof(T));
  const int units = row_bytes / kStepBytes;
  const int my_units = (units - warp + kWarps - 1) / kWarps;  // units warp, warp + kWarps, ...
  const int per_warp = (units + kWarps - 1) / kWarps;

  // Rows g and g + 8 of a tile; rows past the end re-read the last one (their sums are dropped).
  const int tiles = tile_count(n, SILU_GATE_UP);
  const int scale_cols = (k + kGemvFp8Block - 1) / kGemvFp8Block;
  const uint8_t *w_lo, *w_hi;
  const float *s_lo = nullptr, *s_hi = nullptr;
  auto point_at = [&](int tile) {
    int row_lo, row_hi;
    if constexpr (SILU_GATE_UP) {
      const int n_out = n / 2, j = min(tile * 8 + g, n_out - 1);
      row_lo = j;
      row_hi = n_out + j;
    } else {
      row_lo = min(tile * 16 + g, n - 1);
      row_hi = min(tile * 16 + 8 + g, n - 1);
    }
    w_lo = w + static_cast<int64_t>(row_lo) * row_bytes + 32 * q + warp * kStepBytes;
    w_hi = w + static_cast<int64_t>(row_hi) * row_bytes + 32 * q + warp * kStepBytes;
    if constexpr (FP8) {
      s_lo = scale + (row_lo / kGemvFp8Block) * scale_cols + warp;
      s_hi = scale + (row_hi / kGemvFp8Block) * scale_cols + warp;
    }
  };

  // Step s of this warp is unit warp + s * kWarps: offsets below are relative to the warp's first unit.
  Step ring[kDepth];
  auto prefetch = [&] {  // a tile's first kDepth steps
#pragma unroll
    for (int d = 0; d < kDepth; ++d) {
      if (d < my_units) load_step<FP8>(ring[d], w_lo, w_hi, d * kWarps, s_lo, s_hi);
    }
  };
  int tile = blockIdx.x;
  point_at(tile);
  prefetch();
  griddep_wait();
  griddep_launch_dependents();  // (after the wait: see common.cuh)

  __half* xs = reinterpret_cast<__half*>(smem) + static_cast<int64_t>(warp) * m * per_warp * kStepBytes;
  for (int t = lane; t < kGemvTcMaxTokens; t += 32) inv_up[warp][t] = 1.0f;
  if constexpr (kStaged && kGroupedX) {
    stage_x_grouped<T>(x, m, k, xs, per_warp, warp, my_units, lane, inv_up[warp]);
  } else if constexpr (kStaged) {
    for (int t = 0; t < m; ++t) {
      const float inv = stage_x<T>(x + static_cast<int64_t>(t) * k, xs + t * per_warp * kStepBytes, warp, my_units, lane);
      if (lane == 0) inv_up[warp][t] = inv;
    }
  }
  __syncwarp();

  for (;;) {
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // rows g, g + 8 x tokens 2q, 2q + 1
    const bool has_token = g < m;
    for (int s0 = 0; s0 < my_units; s0 += kDepth) {
#pragma unroll
      for (int d = 0; d < kDepth; ++d) {
        const int s = s0 + d;
        if (s >= my_units) break;
        const Step& st = ring[d];
        const unsigned lo[8] = {st.lo0.x, st.lo0.y, st.lo0.z, st.lo0.w, st.lo1.x, st.lo1.y, st.lo1.z, st.lo1.w};
        const unsigned hi[8] = {st.hi0.x, st.hi0.y, st.hi0.z, st.hi0.w, st.hi1.x, st.hi1.y, st.hi1.z, st.hi1.w};
        if constexpr (FP8) {
          // x of token g at this step's k (32q .. 32q + 32): 16 pairs, staged f16 from shared memory or x itself.
          uint4 xv[4] = {};
          if (has_token) {
            if constexpr (kStaged) {
              const uint4* p = reinterpret_cast<const uint4*>(xs + (g * per_warp + s) * kStepBytes + 32 * q);
#pragma unroll
              for (int i = 0; i < 4; ++i) xv[i] = p[i];
            } else {
              const uint4* p = reinterpret_cast<const uint4*>(x + static_cast<int64_t>(g) * k +
                                                              (warp + s * kWarps) * kStepBytes + 32 * q);
#pragma unroll
              for (int i = 0; i < 4; ++i) xv[i] = __ldg(p + i);
            }
          }
          const unsigned xw[16] = {xv[0].x, xv[0].y, xv[0].z, xv[0].w, xv[1].x, xv[1].y, xv[1].z, xv[1].w,
                                   xv[2].x, xv[2].y, xv[2].z, xv[2].w, xv[3].x, xv[3].y, xv[3].z, xv[3].w};
          float part[2][4] = {};
#pragma unroll
          for (int i = 0; i < 8; ++i) {  // word i: k = 32q + 4i .. + 4 of rows g, g + 8
            if constexpr (std::is_same_v<In, __nv_bfloat16>) {
              mma16816<In>(part[i & 1], e4m3x2_lo_bf16(lo[i]), e4m3x2_lo_bf16(hi[i]), e4m3x2_hi_bf16(lo[i]),
                           e4m3x2_hi_bf16(hi[i]), xw[2 * i], xw[2 * i + 1]);
            } else {
              mma16816<In>(part[i & 1], e4m3x2_lo(lo[i]), e4m3x2_lo(hi[i]), e4m3x2_hi(lo[i]), e4m3x2_hi(hi[i]),
                           xw[2 * i], xw[2 * i + 1]);
            }
          }
          acc[0] = fmaf(st.scale_lo, part[0][0] + part[1][0], acc[0]);
          acc[1] = fmaf(st.scale_lo, part[0][1] + part[1][1], acc[1]);
          acc[2] = fmaf(st.scale_hi, part[0][2] + part[1][2], acc[2]);
          acc[3] = fmaf(st.scale_hi, part[0][3] + part[1][3], acc[3]);
        } else {
          // x of token g at this step's k (16q .. 16q + 16 elements): 8 pairs straight from global memory (L1).
          uint4 xv[2] = {};
          if (has_token) {
            const uint4* p = reinterpret_cast<const uint4*>(
                x + static_cast<int64_t>(g) * k + (warp + s * kWarps) * (kStepBytes / 2) + 16 * q);
            xv[0] = __ldg(p);
            xv[1] = __ldg(p + 1);
          }
          const unsigned xw[8] = {xv[0].x, xv[0].y, xv[0].z, xv[0].w, xv[1].x, xv[1].y, xv[1].z, xv[1].w};
          float part[2][4] = {};
#pragma unroll
          for (int j = 0; j < 4; ++j) {  // words 2j, 2j + 1: k = 16q + 4j .. + 4 of rows g, g + 8
            mma16816<In>(part[j & 1], lo[2 * j], hi[2 * j], lo[2 * j + 1], hi[2 * j + 1], xw[2 * j], xw[2 * j + 1]);
          }
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[i] += part[0][i] + part[1][i];
        }
        if (s + kDepth < my_units) load_step<FP8>(ring[d], w_lo, w_hi, (s + kDepth) * kWarps, s_lo, s_hi);
      }
    }
    // The next tile's first steps load while this tile's sums are reduced and written.
    const int next = kPersistent ? tile + static_cast<int>(gridDim.x) : tiles;
    if (next < tiles) {
      point_at(next);
      prefetch();
    }

#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int t = 2 * q + c;
      if (t < m) {
        partial[warp][t][g] = acc[c] * inv_up[warp][t];
        partial[warp][t][g + 8] = acc[2 + c] * inv_up[warp][t];
      }
    }
    __syncthreads();
    constexpr int kOut = SILU_GATE_UP ? 8 : 16;
    const int n_out = SILU_GATE_UP ? n / 2 : n;
    if (threadIdx.x < m * kOut) {
      const int t = threadIdx.x / kOut, o = threadIdx.x % kOut, j = tile * kOut + o;
      if (j < n_out) {
        auto total = [&](int r) {  // the warps' sums in a fixed order
          float v = 0.0f;
#pragma unroll
          for (int wi = 0; wi < kWarps; ++wi) v += partial[wi][t][r];
          return v;
        };
        if constexpr (SILU_GATE_UP) {
          float gate = total(o), up = total(o + 8);
          if (bias != nullptr) {
            gate += Cvt<T>::to_f(bias[j]);
            up += Cvt<T>::to_f(bias[n_out + j]);
          }
          out[static_cast<int64_t>(t) * n_out + j] = silu_mul(Cvt<T>::from_f(gate), Cvt<T>::from_f(up));
        } else {
          float v = total(o);
          if (bias != nullptr) v += Cvt<T>::to_f(bias[j]);
          out[static_cast<int64_t>(t) * n_out + j] = Cvt<T>::from_f(v);
        }
      }
    }
    if (next >= tiles) break;
    __syncthreads();  // partial[] is read by the reduction above before the next tile writes it
    tile = next;
  }
}

int smem_bytes(bool staged, int m, int k) {  // staged: FP8 with x staged (not kDirectX)
  if (!staged) return 0;
  const int units = k / kStepBytes, per_warp = (units + kWarps - 1) / kWarps;
  return kWarps * m * per_warp * kStepBytes * static_cast<int>(sizeof(__half));
}

template <typename T, bool FP8, bool SILU, int kDepth = 2, int kMinBlocks = 3, bool kGroupedX = false,
          bool kPersistent = false, bool kDirectX = false>
void launch(uintptr_t out, uintptr_t x, uintptr_t w, uintptr_t scale, uintptr_t bias, int m, int n, int k,
            cudaStream_t stream) {
  constexpr bool kStaged = FP8 && !kDirectX;
  auto kernel = gemv_tc_kernel<T, FP8, SILU, kDepth, kMinBlocks, kGroupedX, kPersistent, kDirectX>;
  if constexpr (kStaged) {
    static PerDevice<int> opted_in;  // shared memory above 48 KB, once per device
    opted_in.get([&](int) {
      cuda_check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxSmem),
                 "gemv_tc: cudaFuncSetAttribute");
      return 1;
    });
  }
  const int tiles = tile_count(n, SILU);
  const int smem = smem_bytes(kStaged, m, k);
  int grid = tiles;
  if constexpr (kPersistent) {  // the blocks the SMs hold at once: kMinBlocks, fewer where x's shared memory is large
    const int num_sms = sm_count();
    const int per_block = smem + kStaticSmem + 1024;  // (1 KB: the system's share per block)
    const int per_sm = std::max(1, std::min(kMinBlocks, kSmemPerSm / per_block));
    grid = std::min(tiles, num_sms * per_sm);
  }
  launch_programmatic(kernel, dim3(static_cast<unsigned>(grid)), dim3(kWarps * 32), smem, stream,
                      "gemv_tc kernel launch", reinterpret_cast<T*>(out), reinterpret_cast<const T*>(x),
                      reinterpret_cast<const uint8_t*>(w), reinterpret_cast<const float*>(scale),
                      reinterpret_cast<const T*>(bias), m, n, k);
}

// f(std::integral_constant<int, variant>): the pipeline chosen at run time as a compile-time constant.
template <typename F, int... I>
void for_pipeline(int variant, F&& f, std::integer_sequence<int, I...>) {
  ((variant == I ? (f(std::integral_constant<int, I>{}), true) : false) || ...);
}

}  // namespace

bool gemv_tc_applies(int64_t m, int64_t k, bool fp8) {
  const int64_t row_bytes = fp8 ? k : k * 2;
  return m >= 1 && m <= kGemvTcMaxTokens && row_bytes % kStepBytes == 0 &&
         smem_bytes(fp8, static_cast<int>(m), static_cast<int>(k)) <= kMaxSmem;  // (one rule for every pipeline)
}

int gemv_tc_fp8_pipelines() { return kNumFp8Pipelines + 1; }  // (and kByGrid)

int set_gemv_tc_fp8_variant(int variant) {
  if (variant < 0 || variant > kByGrid) {
    throw std::invalid_argument("set_gemv_tc_fp8_variant: variant " + std::to_string(variant) + " is not in 0.." +
                                std::to_string(kByGrid));
  }
  const int before = g_fp8_pipeline;
  g_fp8_pipeline = variant;
  return before;
}

void gemv_tc(const GemvArgs& a) {
  const int m = static_cast<int>(a.m), n = static_cast<int>(a.n), k = static_cast<int>(a.k);
  cudaStream_t stream = reinterpret_cast<cudaStream_t>(a.stream);
  FASTQWEN_DISPATCH_DTYPE("gemv: ", a.dtype, kHalfTypes, T, {
    if (a.fp8) {
      auto fp8 = [&](auto pipeline) {
        constexpr Fp8Pipeline p = kFp8Pipelines[decltype(pipeline)::value];
        if (a.silu_gate_up) {
          return launch<T, true, true, p.depth, p.min_blocks, p.grouped_x, p.persistent, p.direct_x>(
              a.out, a.x, a.w, a.scale, a.bias, m, n, k, stream);
        }
        launch<T, true, false, p.depth, p.min_blocks, p.grouped_x, p.persistent, p.direct_x>(a.out, a.x, a.w, a.scale,
                                                                                             a.bias, m, n, k, stream);
      };
      int pipeline = g_fp8_pipeline;
      if (pipeline == kByGrid) {
        pipeline = fp8_pipeline_for(tile_count(n, a.silu_gate_up), sm_count());
      }
      return for_pipeline(pipeline, fp8, std::make_integer_sequence<int, kNumFp8Pipelines>{});
    }
    if (a.silu_gate_up) return launch<T, false, true>(a.out, a.x, a.w, a.scale, a.bias, m, n, k, stream);
    launch<T, false, false>(a.out, a.x, a.w, a.scale, a.bias, m, n, k, stream);
  });
}

}  // namespace fastqwen
