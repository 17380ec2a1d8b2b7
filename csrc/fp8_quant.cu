// Per-token FP8 activation quantization for the block-scaled FP8 GEMM: eight threads per (token, 128 columns), one pass
// over x instead of the half-dozen elementwise PyTorch ops it replaces (a launch each, per projection, per layer).
// The arithmetic is the PyTorch reference's (ops/linear.py quantize_activations): the same IEEE division and
// round-to-nearest-even conversion, so the results are identical.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdlib>
#include <stdexcept>
#include <string>

#include "common.cuh"
#include "cuda_check.h"
#include "fp8_quant.h"

namespace fastqwen {
namespace {

constexpr float kE4M3Max = 448.0f;
// Eight threads a group of 128 columns, 16 values each (two 16-byte loads: the group's two halves, so that each load
// instruction of a warp reads whole 128-byte lines), 8 groups a block of 64 threads (as many blocks as the first
// form's, which small batches need to fill the SMs). A thread keeps 32 bytes in flight: the first form (a warp a
// group, 8 bytes a thread) kept 8.
constexpr int kThreadsPerGroup = 8;
constexpr int kGroupsPerBlock = 8;
constexpr int kQuantThreads = kThreadsPerGroup * kGroupsPerBlock;

// q's 8 e4m3 values of f (scaled by 1 / scale with IEEE division and clamped to e4m3's range, as the reference).
__device__ __forceinline__ uint2 to_e4m3x8(const float (&f)[8], float scale) {
  uint32_t word[2] = {0u, 0u};
#pragma unroll
  for (int i = 0; i < 8; i += 2) {
    const float2 pair = make_float2(fminf(fmaxf(f[i] / scale, -kE4M3Max), kE4M3Max),
                                    fminf(fmaxf(f[i + 1] / scale, -kE4M3Max), kE4M3Max));
    const __nv_fp8x2_storage_t two = __nv_cvt_float2_to_fp8x2(pair, __NV_SATFINITE, __NV_E4M3);
    word[i / 4] |= static_cast<uint32_t>(two) << (8 * (i % 4));
  }
  return make_uint2(word[0], word[1]);
}

// Grid: x over blocks of kGroupsPerBlock column groups, y over padded rows. Thread t of a group holds columns
// 8 t .. 8 t + 7 and 64 + 8 t .. 64 + 8 t + 7 of it.
template <typename T>
__global__ void __launch_bounds__(kQuantThreads) quantize_kernel(uint8_t* __restrict__ q, float* __restrict__ scale_t,
                                                                 const T* __restrict__ x, int m, int padded_m, int k) {
  const int sub = threadIdx.x % kThreadsPerGroup;
  const int group = blockIdx.x * kGroupsPerBlock + threadIdx.x / kThreadsPerGroup;
  const int row = blockIdx.y;
  const int groups = k / kFp8QuantGroup;
  if (group >= groups) return;  // (whole groups: the 8 threads of a group leave together, shuffles stay in step)
  const int64_t offset = static_cast<int64_t>(row) * k + group * kFp8QuantGroup + sub * 8;
  constexpr int kHalf = kFp8QuantGroup / 2;
  uint2 lo = make_uint2(0u, 0u), hi = lo;
  float scale = 1.0f;
  if (row < m) {
    const Pack<T, 8> a = *reinterpret_cast<const Pack<T, 8>*>(x + offset);
    const Pack<T, 8> b = *reinterpret_cast<const Pack<T, 8>*>(x + offset + kHalf);
    float fa[8], fb[8];
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      fa[i] = Cvt<T>::to_f(a.v[i]);
      fb[i] = Cvt<T>::to_f(b.v[i]);
      amax = fmaxf(amax, fmaxf(fabsf(fa[i]), fabsf(fb[i])));
    }
    const unsigned mask = 0xFFu << (threadIdx.x % 32 / kThreadsPerGroup * kThreadsPerGroup);  // the group's lanes
#pragma unroll
    for (int o = kThreadsPerGroup / 2; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(mask, amax, o));
    scale = fmaxf(amax, 1e-12f) / kE4M3Max;
    lo = to_e4m3x8(fa, scale);
    hi = to_e4m3x8(fb, scale);
  }
  *reinterpret_cast<uint2*>(q + offset) = lo;
  *reinterpret_cast<uint2*>(q + offset + kHalf) = hi;
  if (sub == 0) scale_t[static_cast<int64_t>(group) * padded_m + row] = scale;
}

// EXPERIMENT: the first form, for the A/B (FASTQWEN_QUANT_V1=1)
constexpr int kV1WarpsPerBlock = 8;

// Grid: x over groups of kV1WarpsPerBlock column groups, y over padded rows. Each lane holds 4 values.
template <typename T>
__global__ void quantize_kernel_v1(uint8_t* __restrict__ q, float* __restrict__ scale_t, const T* __restrict__ x, int m,
                                int padded_m, int k) {
  const int lane = threadIdx.x & 31;
  const int group = blockIdx.x * kV1WarpsPerBlock + (threadIdx.x >> 5);
  const int row = blockIdx.y;
  const int groups = k / kFp8QuantGroup;
  if (group >= groups) return;
  const int64_t offset = static_cast<int64_t>(row) * k + group * kFp8QuantGroup + lane * 4;
  uint32_t packed = 0;
  float scale = 1.0f;
  if (row < m) {
    const Pack<T, 4> v = *reinterpret_cast<const Pack<T, 4>*>(x + offset);
    float f[4];
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      f[i] = Cvt<T>::to_f(v.v[i]);
      amax = fmaxf(amax, fabsf(f[i]));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    scale = fmaxf(amax, 1e-12f) / kE4M3Max;
    for (int i = 0; i < 4; i += 2) {
      const float2 pair = make_float2(fminf(fmaxf(f[i] / scale, -kE4M3Max), kE4M3Max),
                                      fminf(fmaxf(f[i + 1] / scale, -kE4M3Max), kE4M3Max));
      const __nv_fp8x2_storage_t two = __nv_cvt_float2_to_fp8x2(pair, __NV_SATFINITE, __NV_E4M3);
      packed |= static_cast<uint32_t>(two) << (8 * i);
    }
  }
  *reinterpret_cast<uint32_t*>(q + offset) = packed;
  if (lane == 0) scale_t[static_cast<int64_t>(group) * padded_m + row] = scale;
}

}  // namespace

void quantize_fp8_tokens(uintptr_t q, uintptr_t scale_t, uintptr_t x, int64_t m, int64_t padded_m, int64_t k,
                         int dtype, uintptr_t stream) {
  const std::string op = "quantize_fp8_tokens: ";
  check_dtype(op, dtype, kHalfTypes);
  if (m < 0 || padded_m < m || padded_m > 65535 || k < 0 || k % kFp8QuantGroup != 0 || k > (1 << 30)) {
    throw std::invalid_argument(op + "bad shape m=" + std::to_string(m) + " padded_m=" + std::to_string(padded_m) +
                                " k=" + std::to_string(k) + " (k a multiple of 128, m <= padded_m <= 65535)");
  }
  if (padded_m == 0 || k == 0) return;
  if (q == 0 || scale_t == 0 || (m > 0 && x == 0)) throw std::invalid_argument(op + "null data pointer");
  if (q % 8 != 0 || x % 16 != 0) throw std::invalid_argument(op + "q must be 8-byte and x 16-byte aligned");
  const int groups = static_cast<int>(k / kFp8QuantGroup);
  const dim3 grid((groups + kGroupsPerBlock - 1) / kGroupsPerBlock, static_cast<unsigned>(padded_m));
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  FASTQWEN_DISPATCH_DTYPE(op.c_str(), dtype, kHalfTypes, T, {
    static const bool v1 = std::getenv("FASTQWEN_QUANT_V1") != nullptr;
    if (v1) {
      const dim3 grid1((groups + kV1WarpsPerBlock - 1) / kV1WarpsPerBlock, static_cast<unsigned>(padded_m));
      quantize_kernel_v1<T><<<grid1, kV1WarpsPerBlock * 32, 0, s>>>(reinterpret_cast<uint8_t*>(q),
                                                             reinterpret_cast<float*>(scale_t),
                                                             reinterpret_cast<const T*>(x), static_cast<int>(m),
                                                             static_cast<int>(padded_m), static_cast<int>(k));
    } else
    quantize_kernel<T><<<grid, kQuantThreads, 0, s>>>(reinterpret_cast<uint8_t*>(q),
                                                             reinterpret_cast<float*>(scale_t),
                                                             reinterpret_cast<const T*>(x), static_cast<int>(m),
                                                             static_cast<int>(padded_m), static_cast<int>(k));
  });
  cuda_check_launch("quantize_fp8_tokens kernel launch");
}

}  // namespace fastqwen
