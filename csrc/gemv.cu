// Small-batch GEMV (1 to 16 tokens): out = x @ W^T for dense bf16/fp16 weights and for FP8 weight-only. The calls of
// 2 to 8 tokens that the tensor-core kernel takes run there instead (gemv_tc.cu, gemv_uses_tensor_cores()).
//
// Decode is bound by reading the weights, so the kernel streams each weight byte once: a block of kWarps warps owns
// kRows output rows, its warps split the row length (K) between them (split-K inside the block, so that layers with
// few output rows still fill the GPU), and each lane issues 16-byte loads of all kRows rows, kUnroll chunks ahead,
// bypassing L1 so that the activations x stay there for the other rows. FP8 weights are converted in registers
// (hardware e4m3x2 -> f16x2) and each 16-element chunk's dot product is multiplied by its block's scale; every
// product and sum is fp32. The warps' partial sums meet in shared memory; one rounding to the output type. One token
// of FP8 weights runs gemv_fp8_one_token_kernel, the same arithmetic with its loads kept in flight in a ring.
//
// One token, the RMSNorm between two projections rides on their GEMVs (gemv_norm): the projection before the norm
// adds its outputs into the residual in its epilogue (kGemvAddResidual), and the projection after it reads the
// residual as x, sums x^2 on the way and scales its dot products by 1/rms (kGemvNormXFolded where the norm's weight
// was multiplied into its columns at load; kGemvNormX multiplies each x by the weight as it loads it, a second load
// per chunk). Every block reads all of x anyway, so the norm costs no extra pass, no grid-wide step and no kernel between the two
// projections. Measured on the H100 (git show 1274b3f:bench/results/2026-11-24-h100-norm-in-gemv): batch-1 Qwen3-8B bf16 5.563 ->
// 5.470 ms a step at a 1,024-token prompt (folded), FP8 3.334 -> 3.309.
//
// With SILU_GATE_UP, W stacks the gate and up projections ([gate; up], 2d rows) and out is silu(gate) * up ([m, d]):
// a block takes kRows / 2 rows of each half and multiplies the two in its epilogue, rounded as silu_and_mul rounds,
// so the MLP's activation needs neither its own kernel nor the 2d-wide intermediate.
//
// On sm_90 the kernel is launched with programmatic dependent launch (launch.cuh): it may start while the kernel
// before it is still running, and loads its first weight chunks, which nothing before it writes, before
// griddep_wait(); x is read and out written only after. The start-up of each projection then hides under the end of
// the kernel before it.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "common.cuh"
#include "cuda_check.h"
#include "custom_all_reduce.h"
#include "device_cache.h"
#include "gemv.h"
#include "gemv_tc.h"
#include "kv_fp8.cuh"
#include "launch.cuh"

namespace fastqwen {
namespace {

constexpr int kWarps = 4;
// Weight rows per block: 4, or 5 or 6 where that fills the grid's waves better (rows_per_block below). Loads go two
// chunks ahead for 4 bf16/fp16 rows and one otherwise: 6 rows must stay within the 64 registers of 8 blocks per SM,
// and FP8 chunks cost twice the arithmetic per byte, so an FP8 warp that waits for two chunks' loads and then
// converts them leaves that arithmetic exposed after the last bytes arrive (and spilled registers at two chunks). One
// chunk ahead still keeps 64 KB in flight per SM. Measured on an H100 at one token: FP8 o_proj 8.5 -> 7.2 us, gate_up
// with SiLU 39.8 -> 36.2 us, down 21.0 -> 19.6 us; batch-1 decode of Qwen3-8B FP8 3.51 -> 3.31 ms. (One FP8 token now
// runs gemv_fp8_one_token_kernel, which keeps those chunks in flight in a ring.)
template <bool FP8, int R>
constexpr int unroll_for_rows() {
  return R == 4 && !FP8 ? 2 : 1;
}

// Two e4m3 values (the low 16 bits) to floats.
__device__ __forceinline__ float2 fp8x2_to_float2(uint32_t bits) { return to_float2(fp8x2_to_half2(bits), __half{}); }

// 8 activations (one 16-byte load) as floats.
template <typename T>
__device__ __forceinline__ void load_x8(const T* p, float (&out)[8]) {
  const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = to_float2(words[i], T{});
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

// 8 of the GEMV's activations at element offset e: x as it is, or with kGemvNormX, x * g (fp32, not rounded) while
// sq sums x^2 (kGemvNormXFolded: x as it is, sq too).
template <int EPI, typename T>
__device__ __forceinline__ void load_x8_for(const T* x, const T* g, int64_t e, float (&out)[8], float& sq) {
  load_x8(x + e, out);
  if constexpr (EPI == kGemvNormX) {
    float gf[8];
    load_x8(g + e, gf);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      sq = fmaf(out[i], out[i], sq);
      out[i] *= gf[i];
    }
  }
  if constexpr (EPI == kGemvNormXFolded) {
#pragma unroll
    for (int i = 0; i < 8; ++i) sq = fmaf(out[i], out[i], sq);
  }
}

// kGemvAddResidual: the block's residual outputs into L1 before griddep_wait (a hint), so that the epilogue's read of
// them is not a round trip to L2 while the next projection's weights queue. The residual was written two or more kernels
// before (gemv_norm's contract), so it may be read before the wait.
template <int EPI, typename T>
__device__ __forceinline__ void prefetch_residual(const T* out, int out0) {
  if constexpr (EPI == kGemvAddResidual) {
    if (threadIdx.x == 0) asm volatile("prefetch.global.L1 [%0];" ::"l"(out + out0));
  }
}

// kGemvSend: the send target (written once, before any GEMV sends) into L1 before griddep_wait, so that the epilogue's
// only round trip is the read of the round's buffer (which must wait: the kernel before may be an all-reduce).
template <int EPI>
__device__ __forceinline__ void prefetch_send_target(const AllReduceSendTarget* send) {
  if constexpr (EPI == kGemvSend) {
    if (threadIdx.x == 0) asm volatile("prefetch.global.L1 [%0];" ::"l"(send));
  }
}

// Weight elements per 16-byte chunk.
template <bool FP8>
constexpr int chunk_elems() {
  return FP8 ? 16 : 8;
}

// acc[i][r] += dot(x[i, chunk c], W[row r, chunk c]) for the chunk's weights w[r] (already loaded).
template <typename T, bool FP8, int MT, int kRows, int EPI>
__device__ __forceinline__ void accumulate_chunk(const T* __restrict__ x, const T* __restrict__ g, int m, int k, int c,
                                                 const uint4 (&w)[kRows], const float (&scale)[kRows],
                                                 float (&acc)[MT][kRows], float& sq) {
  constexpr int E = chunk_elems<FP8>();
  float wf[kRows][E];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const uint32_t words[4] = {w[r].x, w[r].y, w[r].z, w[r].w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if constexpr (FP8) {
        const float2 lo = fp8x2_to_float2(words[i]);
        const float2 hi = fp8x2_to_float2(words[i] >> 16);
        wf[r][4 * i] = lo.x;
        wf[r][4 * i + 1] = lo.y;
        wf[r][4 * i + 2] = hi.x;
        wf[r][4 * i + 3] = hi.y;
      } else {
        const float2 f = to_float2(words[i], T{});
        wf[r][2 * i] = f.x;
        wf[r][2 * i + 1] = f.y;
      }
    }
  }
#pragma unroll
  for (int i = 0; i < MT; ++i) {
    if (i >= m) break;  // uniform across the block
    const int64_t xi = static_cast<int64_t>(i) * k + static_cast<int64_t>(c) * E;
    float part[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) part[r] = 0.0f;
#pragma unroll
    for (int h = 0; h < E / 8; ++h) {
      float xf[8];
      load_x8_for<EPI>(x, g, xi + 8 * h, xf, sq);
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
#pragma unroll
        for (int e = 0; e < 8; ++e) part[r] = fmaf(xf[e], wf[r][8 * h + e], part[r]);
      }
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) acc[i][r] = FP8 ? fmaf(scale[r], part[r], acc[i][r]) : acc[i][r] + part[r];
  }
}

// kGemvSend: output j into this rank's slot of every rank's receive buffer of the coming round (custom_all_reduce.cu:
// the buffer after the one its last round used), as custom_all_reduce's barrier-free kernels send: an element whose
// bits are all ones (a NaN, what an empty slot holds) goes as another NaN.
template <typename T>
__device__ __forceinline__ void send_output(const AllReduceSendTarget& send, int j, T y) {
  uint16_t bits = *reinterpret_cast<const uint16_t*>(&y);
  if (bits == 0xFFFFu) bits = 0xFFFEu;
  const int b = static_cast<int>((*send.third + 1) % 3);
  const int64_t at = (static_cast<int64_t>(b) * send.world + send.rank) * send.slot_elems + j;
  for (int p = 0; p < send.world; ++p) {
    asm volatile("st.volatile.global.u16 [%0], %1;" ::"l"(send.receive[p] + at), "h"(bits) : "memory");
  }
}

// The block's epilogue: each warp's sums acc (its share of every row's dot products) meet in shared memory, in a fixed
// order, and are rounded once to T (outputs out0 .. out0 + kOut of each token).
// kGemvNormX, kGemvNormXFolded: sq is the thread's sum of x^2, k the row length, eps the norm's.
template <typename T, int MT, bool SILU_GATE_UP, int kRows, int EPI = kGemvPlain>
__device__ __forceinline__ void write_outputs(const float (&acc)[MT][kRows], T* __restrict__ out,
                                              const T* __restrict__ bias, int m, int n_out, int out0, int warp,
                                              int lane, float sq = 0.0f, int k = 1, float eps = 0.0f,
                                              const AllReduceSendTarget* send = nullptr) {
  static_assert(EPI == kGemvPlain || MT == 1, "the norm rides on one-token GEMVs");
  static_assert((EPI != kGemvAddResidual && EPI != kGemvSend) || !SILU_GATE_UP,
                "the projection before a norm or an all-reduce has no SiLU epilogue");
  constexpr int kOut = SILU_GATE_UP ? kRows / 2 : kRows;
  __shared__ float partial[kWarps][MT * kRows];
#pragma unroll
  for (int i = 0; i < MT; ++i) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (i < m) {
        const float s = warp_sum(acc[i][r]);
        if (lane == 0) partial[warp][i * kRows + r] = s;
      }
    }
  }
  float inv_rms = 1.0f;
  if constexpr (EPI == kGemvNormX || EPI == kGemvNormXFolded) {
    inv_rms = rsqrtf(block_sum(sq) / static_cast<float>(k) + eps);  // (block_sum synchronizes the block)
  } else {
    __syncthreads();
  }
  for (int t = threadIdx.x; t < MT * kOut; t += blockDim.x) {
    const int i = t / kOut, o = t % kOut, j = out0 + o;
    if (i >= m || j >= n_out) continue;
    // The projection's outputs j (and, with SILU_GATE_UP, n_out + j), rounded to T as a separate GEMM would round.
    T y[kRows / kOut];
#pragma unroll
    for (int half = 0; half < kRows / kOut; ++half) {
      float s = 0.0f;
#pragma unroll
      for (int q = 0; q < kWarps; ++q) s += partial[q][i * kRows + half * kOut + o];
      if constexpr (EPI == kGemvNormX || EPI == kGemvNormXFolded) s *= inv_rms;
      if (bias != nullptr) s += Cvt<T>::to_f(bias[half * n_out + j]);
      y[half] = Cvt<T>::from_f(s);
    }
    if constexpr (SILU_GATE_UP) {
      out[static_cast<int64_t>(i) * n_out + j] = silu_mul(y[0], y[1]);
    } else if constexpr (EPI == kGemvAddResidual) {  // (one token)
      out[j] = Cvt<T>::from_f(Cvt<T>::to_f(y[0]) + Cvt<T>::to_f(out[j]));
    } else if constexpr (EPI == kGemvSend) {  // (one token; after the wait, so the round before has ended)
      send_output(*send, j, y[0]);
    } else {
      out[static_cast<int64_t>(i) * n_out + j] = y[0];
    }
  }
}

// The block's weight rows. Slot r is output out0 + r; with SILU_GATE_UP, slots kOut.. are the same outputs' up rows.
// Outputs past the end re-read the last one (their sums are dropped). The rows are one pointer and 32-bit offsets in
// 16-byte chunks, which spares registers (gemv() checks that the offsets fit); scale_off: each slot's row of FP8 block
// scales.
template <bool SILU_GATE_UP, int kRows>
struct BlockRows {
  const uint4* rows0;
  int row_off[kRows];
  int scale_off[kRows];

  __device__ __forceinline__ BlockRows(const uint8_t* w, int out0, int n_out, int row_chunks, int scale_cols) {
    constexpr int kOut = SILU_GATE_UP ? kRows / 2 : kRows;
    const int row0 = min(out0, n_out - 1);
    rows0 = reinterpret_cast<const uint4*>(w) + static_cast<int64_t>(row0) * row_chunks;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int row = min(out0 + r % kOut, n_out - 1) + (r / kOut) * n_out;
      row_off[r] = (row - row0) * row_chunks;
      scale_off[r] = (row / kGemvFp8Block) * scale_cols;
    }
  }
};

// Grid: one block per kOut outputs (kRows weight rows). MT: the token count rounded up to a power of two (loops stop
// at m). One token: at most 64 registers, so that 8 blocks fit on an SM and an 8B projection's blocks run in one wave.
template <typename T, bool FP8, int MT, bool SILU_GATE_UP, int kRows, int EPI = kGemvPlain>
__global__ void __launch_bounds__(kWarps * 32, MT == 1 ? 8 : 1) gemv_kernel(T* __restrict__ out, const T* __restrict__ x,
                                                           const uint8_t* __restrict__ w,
                                                           const float* __restrict__ scale,
                                                           const T* __restrict__ bias, int m, int n, int k,
                                                           const T* __restrict__ g, float eps,
                                                           const AllReduceSendTarget* __restrict__ send) {
  constexpr int E = chunk_elems<FP8>();
  constexpr int kRowBytesPerElem = FP8 ? 1 : sizeof(T);
  constexpr int kOut = SILU_GATE_UP ? kRows / 2 : kRows;  // outputs per block
  constexpr int kUnroll = unroll_for_rows<FP8, kRows>();
  const int n_out = SILU_GATE_UP ? n / 2 : n;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int out0 = blockIdx.x * kOut;
  const int num_chunks = k / E;
  const int scale_cols = (k + kGemvFp8Block - 1) / kGemvFp8Block;

  const BlockRows<SILU_GATE_UP, kRows> rows(w, out0, n_out, k * kRowBytesPerElem / 16, scale_cols);
  prefetch_residual<EPI>(out, out0);
  prefetch_send_target<EPI>(send);
  float acc[MT][kRows];
  float sq = 0.0f;  // (kGemvNormX, kGemvNormXFolded)
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int r = 0; r < kRows; ++r) acc[i][r] = 0.0f;

  // Chunk c = (step * kWarps + warp) * 32 + lane: the block's warps read one contiguous run of each row per step.
  constexpr int kStride = kWarps * 32;
  bool waited = false;  // for the kernel before (programmatic launch): only the weights may be read until then
  for (int base = warp * 32 + lane; base < num_chunks; base += kStride * kUnroll) {
    uint4 wv[kUnroll][kRows];
    float sv[kUnroll][kRows];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = base + u * kStride;
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        wv[u][r] = c < num_chunks ? load_stream(rows.rows0 + rows.row_off[r] + c) : make_uint4(0, 0, 0, 0);
        if constexpr (FP8) {
          sv[u][r] = c < num_chunks ? __ldg(scale + rows.scale_off[r] + c * E / kGemvFp8Block) : 0.0f;
        } else {
          sv[u][r] = 1.0f;
        }
      }
    }
    if (!waited) {
      griddep_wait();
      griddep_launch_dependents();  // (after the wait: see common.cuh)
      waited = true;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = base + u * kStride;
      if (c < num_chunks) accumulate_chunk<T, FP8, MT, kRows, EPI>(x, g, m, k, c, wv[u], sv[u], acc, sq);
    }
  }
  if (!waited) {  // (a lane with no chunk) before out is written
    griddep_wait();
    griddep_launch_dependents();
  }

  write_outputs<T, MT, SILU_GATE_UP, kRows, EPI>(acc, out, bias, m, n_out, out0, warp, lane, sq, k, eps, send);
}

// One token, FP8 weights: the same arithmetic as gemv_kernel (bit for bit), with the loads in a ring. Each lane keeps
// one 16-byte chunk of every row in flight and, as soon as it has multiplied a row's chunk, issues that row's next
// one, so that the chunks of its other rows stay in flight while it converts and multiplies. gemv_kernel instead
// loads a chunk of every row, waits for all of them and computes them all before its next loads: nothing of the lane
// is in flight meanwhile, and in a one-wave grid every SM does that at about the same time. Measured on an H100
// (git show 1274b3f:bench/results/2026-11-23-h100-gemv-ring): o_proj 7.09 -> 6.90 us, qkv 10.53 -> 10.26; batch-1 decode of Qwen3-8B
// FP8 3.282 -> 3.256 ms (128-token prompt). The same ring for bf16 weights was faster in the decode step but slower
// alone (o_proj 12.36 -> 12.74 us), and two chunks deep was slower for both.
template <typename T, bool SILU_GATE_UP, int kRows, int EPI = kGemvPlain>
__global__ void __launch_bounds__(kWarps * 32, 8) gemv_fp8_one_token_kernel(T* __restrict__ out, const T* __restrict__ x,
                                                                           const uint8_t* __restrict__ w,
                                                                           const float* __restrict__ scale,
                                                                           const T* __restrict__ bias, int n, int k,
                                                                           const T* __restrict__ g, float eps,
                                                                           const AllReduceSendTarget* __restrict__ send) {
  constexpr int E = chunk_elems<true>();
  constexpr int kOut = SILU_GATE_UP ? kRows / 2 : kRows;
  constexpr int kStride = kWarps * 32;
  const int n_out = SILU_GATE_UP ? n / 2 : n;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int out0 = blockIdx.x * kOut;
  const int num_chunks = k / E;
  const int scale_cols = (k + kGemvFp8Block - 1) / kGemvFp8Block;
  const BlockRows<SILU_GATE_UP, kRows> rows(w, out0, n_out, num_chunks, scale_cols);
  prefetch_residual<EPI>(out, out0);
  prefetch_send_target<EPI>(send);
  int c = warp * 32 + lane;  // this lane's chunk of every row: c, c + kStride, ...
  uint4 wv[kRows];
  float sv[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    if (c < num_chunks) {
      wv[r] = load_stream(rows.rows0 + rows.row_off[r] + c);
      sv[r] = __ldg(scale + rows.scale_off[r] + c * E / kGemvFp8Block);
    }
  }
  griddep_wait();
  griddep_launch_dependents();  // (after the wait: see common.cuh)

  float acc[1][kRows];
  float sq = 0.0f;  // (kGemvNormX, kGemvNormXFolded)
#pragma unroll
  for (int r = 0; r < kRows; ++r) acc[0][r] = 0.0f;
  for (; c < num_chunks; c += kStride) {
    const int next = c + kStride;
    float part[kRows];
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // the chunk's halves: words 2h and 2h + 1, 8 weights
      float xf[8];
      load_x8_for<EPI>(x, g, static_cast<int64_t>(c) * E + 8 * h, xf, sq);
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const uint32_t lo = h == 0 ? wv[r].x : wv[r].z, hi = h == 0 ? wv[r].y : wv[r].w;
        const float2 w0 = fp8x2_to_float2(lo), w1 = fp8x2_to_float2(lo >> 16);
        const float2 w2 = fp8x2_to_float2(hi), w3 = fp8x2_to_float2(hi >> 16);
        const float wf[8] = {w0.x, w0.y, w1.x, w1.y, w2.x, w2.y, w3.x, w3.y};
        float p = h == 0 ? 0.0f : part[r];
#pragma unroll
        for (int e = 0; e < 8; ++e) p = fmaf(xf[e], wf[e], p);
        part[r] = p;
        if (h == 1) {
          acc[0][r] = fmaf(sv[r], p, acc[0][r]);
          if (next < num_chunks) {  // the row's chunk is used up: its next one goes out now
            wv[r] = load_stream(rows.rows0 + rows.row_off[r] + next);
            sv[r] = __ldg(scale + rows.scale_off[r] + next * E / kGemvFp8Block);
          }
        }
      }
    }
  }
  write_outputs<T, 1, SILU_GATE_UP, kRows, EPI>(acc, out, bias, 1, n_out, out0, warp, lane, sq, k, eps, send);
}

// Blocks of a kernel resident per SM, times the SMs (once per kernel and device).
template <auto Kernel>
int resident_blocks() {
  static PerDevice<int> slots;
  return slots.get([](int device) {
    int sms = 0, per_sm = 0;
    cuda_check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "gemv: cudaDeviceGetAttribute");
    cuda_check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, Kernel, kWarps * 32, 0), "gemv: occupancy");
    return std::max(1, sms * per_sm);
  });
}

// The kernel that takes a call of MT tokens at R rows a block.
template <typename T, bool FP8, int MT, bool SILU, int R>
constexpr auto kernel_for() {
  if constexpr (FP8 && MT == 1) {
    return gemv_fp8_one_token_kernel<T, SILU, R>;
  } else {
    return gemv_kernel<T, FP8, MT, SILU, R>;
  }
}

int g_rows_per_block = 0;  // set_gemv_rows_per_block(): 0 = the rule of rows_per_block
bool g_five_rows = true;   // set_gemv_five_rows(): whether that rule may choose 5

// The grid's waves: full waves stream at the full rate, a partial last wave at a fraction of it. 5 or 6 rows a block
// where that makes the waves fuller than 4 do: Qwen3-8B's qkv, 6,144 rows on an H100: 1,536 blocks of 4 are 1.45
// waves of 1,056, 1,024 blocks of 6 are one; Qwen3-32B's 5,120-row projections at TP=2: 1.21 waves of 4, 0.81 of 6,
// 0.97 of 5 (measured on an H200 at one token, blocks of 5 against the rule's 6: bf16 qkv 14.16 -> 12.63 us, down
// 34.82 -> 31.16; FP8 qkv 8.54 -> 7.67, down 18.36 -> 17.09).
template <typename T, bool FP8, int MT, bool SILU>
int rows_per_block(int weight_rows, int epilogue) {
  if (MT != 1) return 4;  // (more tokens: fewer blocks per SM, and 4 rows already fill them)
  // FP8 normalizing x: the sum of squares (and the norm weight's load beside x's) take registers, and 6 rows spilled
  // (16 to 24 bytes). 4 rows were faster on the H100 despite the extra wave: batch-1 Qwen3-8B FP8 3.330 -> 3.303 ms at
  // a 1,024-token prompt.
  if (FP8 && (epilogue == kGemvNormX || epilogue == kGemvNormXFolded)) return 4;
  // A benchmark's choice (5 only without the SiLU epilogue, whose blocks take as many gate rows as up rows).
  if (g_rows_per_block != 0 && !(SILU && g_rows_per_block == 5)) return g_rows_per_block;
  auto fill = [weight_rows](int rows, int slots) {
    const double waves = static_cast<double>((weight_rows + rows - 1) / rows) / slots;
    return waves / std::ceil(waves);
  };
  // 4 unless another fills the waves by more than 5% of a wave; the fullest of those
  int best = 4;
  double best_fill = fill(4, resident_blocks<kernel_for<T, FP8, MT, SILU, 4>()>()) + 0.05;
  const double fill6 = fill(6, resident_blocks<kernel_for<T, FP8, MT, SILU, 6>()>());
  if (fill6 > best_fill) best = 6, best_fill = fill6;
  if constexpr (MT == 1 && !SILU) {  // (the SiLU epilogue takes rows in gate/up pairs)
    if (g_five_rows && fill(5, resident_blocks<kernel_for<T, FP8, MT, SILU, 5>()>()) > best_fill) best = 5;
  }
  return best;
}

// Runtime values to template arguments: f(std::integral_constant<...>{}) for the value at hand (as FlashAttention's
// static_switch.h). A call of m tokens runs the kernel of MT = m rounded up to a power of two (its loops stop at m).
template <typename F>
void bool_switch(bool value, F&& f) {
  if (value) return f(std::true_type{});
  f(std::false_type{});
}

template <typename F>
void tokens_switch(int m, F&& f) {
  if (m <= 1) return f(std::integral_constant<int, 1>{});
  if (m <= 2) return f(std::integral_constant<int, 2>{});
  if (m <= 4) return f(std::integral_constant<int, 4>{});
  if (m <= 8) return f(std::integral_constant<int, 8>{});
  f(std::integral_constant<int, 16>{});
}

template <int MT, bool SILU, typename F>
void rows_switch(int rows, F&& f) {
  if (rows == 6) return f(std::integral_constant<int, 6>{});
  if constexpr (MT == 1 && !SILU) {  // (5 rows only where rows_per_block may give them)
    if (rows == 5) return f(std::integral_constant<int, 5>{});
  }
  f(std::integral_constant<int, 4>{});
}

// The epilogues compiled for a kernel: the plain one always; at one token, adding into the residual (without the SiLU
// epilogue: the projection before a norm is o_proj or down) and normalizing x (FP8 at 4 rows only: rows_per_block).
template <bool FP8, int MT, bool SILU, int R>
constexpr bool epilogue_compiled(int epilogue) {
  if (epilogue == kGemvPlain) return true;
  if (epilogue == kGemvAddResidual || epilogue == kGemvSend) return MT == 1 && !SILU;
  return MT == 1 && !(FP8 && R != 4) && (epilogue == kGemvNormX || epilogue == kGemvNormXFolded);
}

template <bool FP8, int MT, bool SILU, int R, typename F>
void epilogue_switch(int epilogue, F&& f) {
  auto run = [&](auto epi) {
    if constexpr (epilogue_compiled<FP8, MT, SILU, R>(decltype(epi)::value)) {
      f(epi);
    } else {  // (gemv_norm's checks and rows_per_block leave no such call)
      throw std::logic_error("gemv: no kernel compiled for epilogue " + std::to_string(epilogue) + " at " +
                             std::to_string(MT) + " tokens, " + std::to_string(R) + " rows a block");
    }
  };
  switch (epilogue) {
    case kGemvPlain: return run(std::integral_constant<int, kGemvPlain>{});
    case kGemvAddResidual: return run(std::integral_constant<int, kGemvAddResidual>{});
    case kGemvNormX: return run(std::integral_constant<int, kGemvNormX>{});
    case kGemvNormXFolded: return run(std::integral_constant<int, kGemvNormXFolded>{});
    case kGemvSend: return run(std::integral_constant<int, kGemvSend>{});
    default: throw std::logic_error("gemv: unknown epilogue " + std::to_string(epilogue));
  }
}

// Every launch decision of a checked call (gemv() and gemv_norm() check it first), in one place:
// - 2 to 8 tokens with the plain epilogue go to the tensor-core kernel where it takes them (gemv_tc.cu);
// - otherwise the FMA kernel for MT = m rounded up to a power of two, at 4, 5 or 6 weight rows a block
//   (rows_per_block), one block per R (SiLU: R / 2) outputs, kWarps warps; one token of FP8 weights runs its
//   ring-load variant (gemv_fp8_one_token_kernel), everything else gemv_kernel; the epilogue is a template argument.
void launch(const GemvArgs& a) {
  if (a.epilogue == kGemvPlain && gemv_uses_tensor_cores(a.m, a.k, a.fp8)) return gemv_tc(a);
  const int m = static_cast<int>(a.m), n = static_cast<int>(a.n), k = static_cast<int>(a.k);
  cudaStream_t stream = reinterpret_cast<cudaStream_t>(a.stream);
  FASTQWEN_DISPATCH_DTYPE("gemv: ", a.dtype, kHalfTypes, T, {
    bool_switch(a.fp8, [&](auto fp8) {
      constexpr bool FP8 = decltype(fp8)::value;
      tokens_switch(m, [&](auto tokens) {
        constexpr int MT = decltype(tokens)::value;
        bool_switch(a.silu_gate_up, [&](auto silu) {
          constexpr bool SILU = decltype(silu)::value;
          rows_switch<MT, SILU>(rows_per_block<T, FP8, MT, SILU>(n, a.epilogue), [&](auto rows) {
            constexpr int R = decltype(rows)::value;
            const int outputs_per_block = SILU ? R / 2 : R;
            const int n_out = SILU ? n / 2 : n;
            const dim3 grid(static_cast<unsigned>((n_out + outputs_per_block - 1) / outputs_per_block));
            const dim3 block(kWarps * 32);
            epilogue_switch<FP8, MT, SILU, R>(a.epilogue, [&](auto epilogue) {
              constexpr int EPI = decltype(epilogue)::value;
              T* out = reinterpret_cast<T*>(a.out);
              const T* x = reinterpret_cast<const T*>(a.x);
              const uint8_t* w = reinterpret_cast<const uint8_t*>(a.w);
              const float* scale = reinterpret_cast<const float*>(a.scale);
              const T* bias = reinterpret_cast<const T*>(a.bias);
              const T* g = EPI == kGemvNormX ? reinterpret_cast<const T*>(a.norm_weight) : nullptr;
              const float eps = EPI == kGemvNormX || EPI == kGemvNormXFolded ? static_cast<float>(a.eps) : 0.0f;
              const auto* send = reinterpret_cast<const AllReduceSendTarget*>(a.send);
              if constexpr (FP8 && MT == 1) {
                launch_programmatic(gemv_fp8_one_token_kernel<T, SILU, R, EPI>, grid, block, 0, stream,
                                    "gemv kernel launch", out, x, w, scale, bias, n, k, g, eps, send);
              } else {
                launch_programmatic(gemv_kernel<T, FP8, MT, SILU, R, EPI>, grid, block, 0, stream,
                                    "gemv kernel launch", out, x, w, scale, bias, m, n, k, g, eps, send);
              }
            });
          });
        });
      });
    });
  });
}

// The checks both entry points make (op: "gemv: " or "gemv_norm: ").
void check_args(const std::string& op, const GemvArgs& a) {
  check_dtype(op, a.dtype, kHalfTypes);
  const int64_t m = a.m, n = a.n, k = a.k;
  if (m < 1 || m > kGemvMaxTokens) {
    throw std::invalid_argument(op + "m must be 1 to " + std::to_string(kGemvMaxTokens) + ", got " + std::to_string(m));
  }
  if (n < 1 || k < 1 || n > (1 << 30) || k > (1 << 30)) {
    throw std::invalid_argument(op + "bad shape n=" + std::to_string(n) + " k=" + std::to_string(k));
  }
  if (n * k * (a.fp8 ? 1 : 2) / 16 >= (int64_t{1} << 31)) {  // (row offsets are 32-bit counts of 16-byte chunks)
    throw std::invalid_argument(op + "weight of " + std::to_string(n) + "x" + std::to_string(k) + " too large");
  }
  const int multiple = a.fp8 ? 16 : 8;
  if (k % multiple != 0) {
    throw std::invalid_argument(op + "k must be a multiple of " + std::to_string(multiple) + ", got " + std::to_string(k));
  }
  if (a.silu_gate_up && n % 2 != 0) {
    throw std::invalid_argument(op + "silu_gate_up needs the gate and up rows stacked (n even), got n=" + std::to_string(n));
  }
  if (a.out == 0 || a.x == 0 || a.w == 0 || (a.fp8 && a.scale == 0)) throw std::invalid_argument(op + "null data pointer");
  if (!aligned16(a.x) || !aligned16(a.w)) throw std::invalid_argument(op + "x and the weight must be 16-byte aligned");
}

}  // namespace

void set_programmatic_launch(bool enabled) { g_programmatic_launch = enabled; }

namespace {
bool g_gemv_tensor_cores = true;
}  // namespace

bool set_gemv_tensor_cores(bool enabled) {
  const bool before = g_gemv_tensor_cores;
  g_gemv_tensor_cores = enabled;
  return before;
}

int set_gemv_rows_per_block(int rows) {
  if (rows != 0 && (rows < 4 || rows > 6)) {
    throw std::invalid_argument("set_gemv_rows_per_block: 0 (the default rule), 4, 5 or 6, got " + std::to_string(rows));
  }
  const int before = g_rows_per_block;
  g_rows_per_block = rows;
  return before;
}

bool set_gemv_five_rows(bool enabled) {
  const bool before = g_five_rows;
  g_five_rows = enabled;
  return before;
}

bool gemv_uses_tensor_cores(int64_t m, int64_t k, bool fp8) {
  return g_gemv_tensor_cores && m >= kGemvTcMinTokens && gemv_tc_applies(m, k, fp8);
}

void gemv(const GemvArgs& args) {
  const std::string op = "gemv: ";
  if (args.epilogue != kGemvPlain) {
    throw std::invalid_argument(op + "epilogue " + std::to_string(args.epilogue) + " is gemv_norm's; gemv takes "
                                "kGemvPlain (0)");
  }
  check_args(op, args);
  launch(args);
}

void gemv_norm(const GemvArgs& args) {
  const std::string op = "gemv_norm: ";
  const int kind = args.epilogue;
  if (kind == kGemvAddResidual) {
    if (args.silu_gate_up) throw std::invalid_argument(op + "the projection before a norm has no SiLU epilogue");
  } else if (kind == kGemvNormX || kind == kGemvNormXFolded) {
    if (kind == kGemvNormX && args.norm_weight == 0) throw std::invalid_argument(op + "null norm weight");
    if (kind == kGemvNormX && !aligned16(args.norm_weight)) {
      throw std::invalid_argument(op + "the norm weight must be 16-byte aligned");
    }
    if (!(args.eps >= 0.0)) throw std::invalid_argument(op + "eps must be >= 0, got " + std::to_string(args.eps));
  } else if (kind == kGemvSend) {
    if (args.silu_gate_up) throw std::invalid_argument(op + "the projection before an all-reduce has no SiLU epilogue");
    if (args.send == 0 || args.send % 8) throw std::invalid_argument(op + "send must be a non-null, 8-byte aligned target");
    if (args.n > args.send_capacity) {
      throw std::invalid_argument(op + "n=" + std::to_string(args.n) + " exceeds the send target's slots of " +
                                  std::to_string(args.send_capacity));
    }
  } else {
    throw std::invalid_argument(op + "epilogue must be kGemvAddResidual (1), kGemvNormX (2), kGemvNormXFolded (3) "
                                "or kGemvSend (4), got " + std::to_string(kind));
  }
  if (args.m != 1) throw std::invalid_argument(op + "one token: m must be 1, got " + std::to_string(args.m));
  check_args(op, args);
  launch(args);
}

}  // namespace fastqwen
