// The tensor-core GEMV of 2 to 8 tokens for FP8 weights, fed by bulk copies (sm_90): gemv_tc.cu's arithmetic, bit for
// bit, with the weights streamed into shared memory by one producer warp instead of loaded into the registers of the
// warps that multiply them.
//
// Why. gemv_tc.cu's warps each keep two or three 128-byte steps of 16 rows in flight in registers and stall on them in
// turn; its projections at 4 tokens run at 70-80% of the copy rate on an H100 (a Qwen3-8B layer's four FP8
// projections in 81 us against 64 us of weight bytes), where the one-token FMA kernel of gemv.cu reaches 97%. Here
// the copies are `cp.async.bulk` of whole 1,024-byte row pieces into a ring of shared-memory stages that complete on
// mbarriers: a block keeps up to kMaxStages x 16 KB in flight whatever its warps are doing, and its first stages
// load before the programmatic wait, under the kernel before it.
//
// Layout. One block per SM (persistent), tiles of 16 weight rows (with SILU_GATE_UP: 8 gate and the same 8 up rows)
// taken blockIdx.x, + gridDim.x, ... Each tile is streamed as k / 1,024 stages of 16 rows x 1,024 bytes (row pitch
// kRowPitch: 16 bytes of padding put rows g and g + 1 of one load in different banks). Consumer warp w multiplies
// step w of every stage (128 bytes of each row), so warp w reads the units w, w + 8, ... of a row as gemv_tc.cu's
// warp w does; lane (g, q) reads bytes 32q .. 32q + 32 of rows g and g + 8, the A fragments of the mmas, and token
// g's x at the same k from the copy of x in shared memory (one bulk copy per token after the programmatic wait). The
// sums, scales, the warps' reduction and the epilogue are gemv_tc.cu's pipelines that read x as it is (7..): the same
// bits.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>

#include "common.cuh"
#include "cuda_check.h"
#include "device_cache.h"
#include "gemv_tc_bulk.h"
#include "hopper.cuh"
#include "launch.cuh"
#include "mma.cuh"

namespace fastqwen {
namespace {

constexpr int kConsumerWarps = 8;
constexpr int kThreads = (kConsumerWarps + 1) * 32;       // the producer is the last warp
constexpr int kStepBytes = 128;                           // a warp's share of a row per stage (one FP8 scale block)
constexpr int kChunkBytes = kConsumerWarps * kStepBytes;  // a row's bytes per stage
constexpr int kRowPitch = kChunkBytes + 16;
constexpr int kStageBytes = 16 * kRowPitch;
constexpr int kMinStages = 3, kMaxStages = 8;
constexpr int kSmemLimit = 227 * 1024;  // Hopper's most dynamic shared memory per block
constexpr int kPartialBytes = 2 * kConsumerWarps * kGemvTcMaxTokens * 16 * 4;  // two tiles' warp sums (float)

// Shared memory: [stages][16][kRowPitch] weights | [m][x_pitch] x | partial | mbarriers (full, empty per stage; x).
struct Smem {
  int stages = 0, x_pitch = 0, bytes = 0;
  __host__ __device__ int x_offset() const { return stages * kStageBytes; }
  __host__ __device__ int partial_offset(int m) const { return x_offset() + m * x_pitch; }
  __host__ __device__ int bars_offset(int m) const { return partial_offset(m) + kPartialBytes; }
};

__host__ __device__ inline Smem smem_layout(int m, int k, int elem_bytes) {
  Smem s;
  s.x_pitch = k * elem_bytes + 16;  // (16 bytes of padding: tokens g and g + 1 in different banks)
  const int fixed = m * s.x_pitch + kPartialBytes + (2 * kMaxStages + 1) * 8;
  const int fit = (kSmemLimit - fixed) / kStageBytes;
  s.stages = fit < kMaxStages ? fit : kMaxStages;
  s.bytes = s.stages * kStageBytes + fixed;
  return s;
}

__host__ __device__ __forceinline__ int tile_count(int n, bool silu) { return silu ? (n / 2 + 7) / 8 : (n + 15) / 16; }

// The weight row at row slot r (0..15) of a tile (rows past the end re-read the last one; their sums are dropped).
__host__ __device__ __forceinline__ int tile_row(int tile, int r, int n, bool silu) {
  if (silu) {
    const int n_out = n / 2, j0 = tile * 8 + (r & 7), j = j0 < n_out ? j0 : n_out - 1;
    return r < 8 ? j : n_out + j;
  }
  const int row = tile * 16 + r;
  return row < n ? row : n - 1;
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// `bytes` (a multiple of 16) from global memory to shared memory, completing on the mbarrier `bar`.
__device__ __forceinline__ void bulk_copy(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}
#endif

template <typename T, bool SILU_GATE_UP>
__global__ void __launch_bounds__(kThreads, 1)
    gemv_tc_bulk_kernel(T* __restrict__ out, const T* __restrict__ x, const uint8_t* __restrict__ w,
                        const float* __restrict__ scale, const T* __restrict__ bias, int m, int n, int k) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using hopper::mbar_arrive;
  using hopper::mbar_arrive_expect_tx;
  using hopper::mbar_wait;
  using hopper::smem_u32;
  extern __shared__ __align__(128) unsigned char smem[];
  const Smem layout = smem_layout(m, k, sizeof(T));
  const int stages = layout.stages;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int chunks = k / kChunkBytes, tiles = tile_count(n, SILU_GATE_UP);
  unsigned char* xs = smem + layout.x_offset();
  float* partial = reinterpret_cast<float*>(smem + layout.partial_offset(m));  // [2][warp][token][16]
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + layout.bars_offset(m));
  const uint32_t x_bar = smem_u32(bars + 2 * stages);
  auto full = [&](int s) { return smem_u32(bars + s); };
  auto empty = [&](int s) { return smem_u32(bars + stages + s); };
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      hopper::mbar_init(full(s), 1);
      hopper::mbar_init(empty(s), kConsumerWarps);
    }
    hopper::mbar_init(x_bar, 1);
    hopper::mbar_fence_init();
  }
  __syncthreads();
  const int my_tiles = (tiles - static_cast<int>(blockIdx.x) + gridDim.x - 1) / gridDim.x;
  const int total = my_tiles * chunks;  // stages this block streams, in order

  if (warp == kConsumerWarps) {  // the producer: stage `it` is chunk it % chunks of the block's tile it / chunks
    auto issue = [&](int it) {
      const int s = it % stages, c = it % chunks;
      const int tile = blockIdx.x + (it / chunks) * gridDim.x;
      if (lane == 0) mbar_arrive_expect_tx(full(s), 16 * kChunkBytes);
      __syncwarp();
      if (lane < 16) {
        const uint8_t* src = w + static_cast<int64_t>(tile_row(tile, lane, n, SILU_GATE_UP)) * k + c * kChunkBytes;
        bulk_copy(smem_u32(smem + s * kStageBytes + lane * kRowPitch), src, kChunkBytes, full(s));
      }
    };
    const int first = min(stages, total);
    for (int it = 0; it < first; ++it) issue(it);  // (the weights: nothing before this kernel writes them)
    griddep_wait();
    griddep_launch_dependents();  // (after the wait: see common.cuh)
    if (lane == 0) mbar_arrive_expect_tx(x_bar, static_cast<uint32_t>(m * k * sizeof(T)));
    __syncwarp();
    if (lane < m) {
      bulk_copy(smem_u32(xs + lane * layout.x_pitch), x + static_cast<int64_t>(lane) * k, k * sizeof(T), x_bar);
    }
    for (int it = first; it < total; ++it) {
      mbar_wait(empty(it % stages), ((it / stages) & 1) ^ 1);  // the consumers are done with the slot's last stage
      issue(it);
    }
    return;
  }

  griddep_wait();
  griddep_launch_dependents();
  const int g = lane >> 2, q = lane & 3;
  const bool has_token = g < m;
  // Token g's x at this lane's k: four 16-byte pieces; lanes q = 2, 3 load theirs rotated by two pieces, so that the
  // eight lanes of a load's phase read eight different bank groups.
  const int rot = (q >> 1) * 2;
  const unsigned char* x_lane = xs + g * layout.x_pitch + 64 * q;
  const int scale_cols = (k + kGemvFp8Block - 1) / kGemvFp8Block;
  mbar_wait(x_bar, 0);

  int it = 0;
  for (int ti = 0; ti < my_tiles; ++ti) {
    const int tile = blockIdx.x + ti * gridDim.x;
    const float* s_lo = scale + (tile_row(tile, g, n, SILU_GATE_UP) / kGemvFp8Block) * scale_cols + warp;
    const float* s_hi = scale + (tile_row(tile, g + 8, n, SILU_GATE_UP) / kGemvFp8Block) * scale_cols + warp;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // rows g, g + 8 x tokens 2q, 2q + 1
    for (int c = 0; c < chunks; ++c, ++it) {
      const int s = it % stages, unit = c * kConsumerWarps + warp;
      const float scale_lo = __ldg(s_lo + c * kConsumerWarps), scale_hi = __ldg(s_hi + c * kConsumerWarps);
      uint4 xv[4] = {};
      if (has_token) {
        const unsigned char* p = x_lane + unit * kStepBytes * static_cast<int>(sizeof(T));
        uint4 t[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) t[i] = *reinterpret_cast<const uint4*>(p + 16 * ((i + rot) & 3));
#pragma unroll
        for (int i = 0; i < 4; ++i) xv[i] = rot == 0 ? t[i] : t[(i + 2) & 3];
      }
      mbar_wait(full(s), (it / stages) & 1);
      const unsigned char* st = smem + s * kStageBytes + warp * kStepBytes + 32 * q;
      const uint4 lo0 = *reinterpret_cast<const uint4*>(st + g * kRowPitch);
      const uint4 lo1 = *reinterpret_cast<const uint4*>(st + g * kRowPitch + 16);
      const uint4 hi0 = *reinterpret_cast<const uint4*>(st + (g + 8) * kRowPitch);
      const uint4 hi1 = *reinterpret_cast<const uint4*>(st + (g + 8) * kRowPitch + 16);
      const unsigned lo[8] = {lo0.x, lo0.y, lo0.z, lo0.w, lo1.x, lo1.y, lo1.z, lo1.w};
      const unsigned hi[8] = {hi0.x, hi0.y, hi0.z, hi0.w, hi1.x, hi1.y, hi1.z, hi1.w};
      const unsigned xw[16] = {xv[0].x, xv[0].y, xv[0].z, xv[0].w, xv[1].x, xv[1].y, xv[1].z, xv[1].w,
                               xv[2].x, xv[2].y, xv[2].z, xv[2].w, xv[3].x, xv[3].y, xv[3].z, xv[3].w};
      float part[2][4] = {};
#pragma unroll
      for (int i = 0; i < 8; ++i) {  // word i: k = 32q + 4i .. + 4 of rows g, g + 8 (gemv_tc.cu's order)
        unsigned a[4];
        if constexpr (std::is_same_v<T, __nv_bfloat16>) {
          a[0] = e4m3x2_lo_bf16(lo[i]);
          a[1] = e4m3x2_lo_bf16(hi[i]);
          a[2] = e4m3x2_hi_bf16(lo[i]);
          a[3] = e4m3x2_hi_bf16(hi[i]);
        } else {
          a[0] = e4m3x2_lo(lo[i]);
          a[1] = e4m3x2_lo(hi[i]);
          a[2] = e4m3x2_hi(lo[i]);
          a[3] = e4m3x2_hi(hi[i]);
        }
        mma::Mma<T>::run(part[i & 1], a, xw[2 * i], xw[2 * i + 1]);
      }
      __syncwarp();  // (every lane's reads of the stage are done before the slot is handed back)
      if (lane == 0) mbar_arrive(empty(s));
      acc[0] = fmaf(scale_lo, part[0][0] + part[1][0], acc[0]);
      acc[1] = fmaf(scale_lo, part[0][1] + part[1][1], acc[1]);
      acc[2] = fmaf(scale_hi, part[0][2] + part[1][2], acc[2]);
      acc[3] = fmaf(scale_hi, part[0][3] + part[1][3], acc[3]);
    }

    // The warps' sums in a fixed order, as gemv_tc.cu; two buffers, so one barrier a tile among the consumers.
    float* sums = partial + (ti & 1) * (kConsumerWarps * kGemvTcMaxTokens * 16);
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int t = 2 * q + c;
      if (t < m) {
        sums[(warp * kGemvTcMaxTokens + t) * 16 + g] = acc[c];
        sums[(warp * kGemvTcMaxTokens + t) * 16 + g + 8] = acc[2 + c];
      }
    }
    hopper::named_barrier(1, kConsumerWarps * 32);
    constexpr int kOut = SILU_GATE_UP ? 8 : 16;
    const int n_out = SILU_GATE_UP ? n / 2 : n;
    if (threadIdx.x < m * kOut) {
      const int t = threadIdx.x / kOut, o = threadIdx.x % kOut, j = tile * kOut + o;
      if (j < n_out) {
        auto total_of = [&](int r) {
          float v = 0.0f;
#pragma unroll
          for (int wi = 0; wi < kConsumerWarps; ++wi) v += sums[(wi * kGemvTcMaxTokens + t) * 16 + r];
          return v;
        };
        if constexpr (SILU_GATE_UP) {
          float gate = total_of(o), up = total_of(o + 8);
          if (bias != nullptr) {
            gate += Cvt<T>::to_f(bias[j]);
            up += Cvt<T>::to_f(bias[n_out + j]);
          }
          out[static_cast<int64_t>(t) * n_out + j] = silu_mul(Cvt<T>::from_f(gate), Cvt<T>::from_f(up));
        } else {
          float v = total_of(o);
          if (bias != nullptr) v += Cvt<T>::to_f(bias[j]);
          out[static_cast<int64_t>(t) * n_out + j] = Cvt<T>::from_f(v);
        }
      }
    }
  }
#else
  __trap();  // (gemv_tc_bulk_applies is false for devices below sm_90)
#endif
}

template <typename T, bool SILU>
void launch(const GemvArgs& a) {
  const int m = static_cast<int>(a.m), n = static_cast<int>(a.n), k = static_cast<int>(a.k);
  auto kernel = gemv_tc_bulk_kernel<T, SILU>;
  static PerDevice<int> opted_in;  // shared memory above 48 KB, once per device
  opted_in.get([&](int) {
    cuda_check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemLimit),
               "gemv_tc_bulk: cudaFuncSetAttribute");
    return 1;
  });
  const Smem layout = smem_layout(m, k, sizeof(T));
  const int grid = std::min(tile_count(n, SILU), sm_count());
  launch_programmatic(kernel, dim3(static_cast<unsigned>(grid)), dim3(kThreads), layout.bytes,
                      reinterpret_cast<cudaStream_t>(a.stream), "gemv_tc_bulk kernel launch",
                      reinterpret_cast<T*>(a.out), reinterpret_cast<const T*>(a.x),
                      reinterpret_cast<const uint8_t*>(a.w), reinterpret_cast<const float*>(a.scale),
                      reinterpret_cast<const T*>(a.bias), m, n, k);
}

// Whether this build has the kernel for the current device (sm_90: its binary, not a trap).
bool device_takes_bulk() {
  static PerDevice<bool> takes;
  return takes.get([](int device) {
    int major = 0;
    cuda_check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), "gemv_tc_bulk: capability");
    if (major != 9) return false;
    cudaFuncAttributes attr{};
    if (cudaFuncGetAttributes(&attr, gemv_tc_bulk_kernel<__nv_bfloat16, false>) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    return attr.binaryVersion >= 90;
  });
}

}  // namespace

bool gemv_tc_bulk_applies(int64_t m, int64_t k, bool fp8) {
  if (!fp8 || m < 1 || m > kGemvTcMaxTokens || k <= 0 || k % kChunkBytes != 0 || k > (1 << 20)) return false;
  if (smem_layout(static_cast<int>(m), static_cast<int>(k), 2).stages < kMinStages) return false;
  return device_takes_bulk();
}

void gemv_tc_bulk(const GemvArgs& a) {
  FASTQWEN_DISPATCH_DTYPE("gemv: ", a.dtype, kHalfTypes, T, {
    if (a.silu_gate_up) return launch<T, true>(a);
    launch<T, false>(a);
  });
}

}  // namespace fastqwen
