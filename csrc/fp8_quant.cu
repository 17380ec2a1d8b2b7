// Per-token FP8 activation quantization for the block-scaled FP8 GEMM: 32 or 8 threads per (token, 128 columns), one
// pass over x instead of the half-dozen elementwise PyTorch ops it replaces (a launch each, per projection, per layer).
// The arithmetic is the PyTorch reference's (ops/linear.py quantize_activations): the same IEEE division and
// round-to-nearest-even conversion, so the results are identical.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>
#include <type_traits>

#include "common.cuh"
#include "cuda_check.h"
#include "fp8_quant.cuh"
#include "fp8_quant.h"

namespace fastqwen {
namespace {

constexpr int kGroupsPerBlock = 8;
// Two forms of one kernel, by how many values of a group a thread holds (kPerThread): 4 (a warp a group, 8 bytes a
// thread) or 16 (eight threads a group, two 16-byte loads each, the group's two halves, so that each load instruction
// of a warp reads whole 128-byte lines). 16 keeps four times the bytes in flight and is faster on large inputs; 4
// puts more threads on small ones, whose time is latency. On an H200 (bench_gemm_fp8.py, us, 4 against 16 values):
// [512, 12288] 8.8 against 6.5, [512, 4096] 3.7 against 3.3, [256, 12288] 4.7 against 3.9; [256, 4096] 2.5 against
// 2.7, [64, 4096] 1.9 against 2.2, [16, 4096] 1.65 against 1.93. kLargeInput: from how many elements the 16 run.
constexpr int64_t kLargeInput = int64_t{1} << 21;

// Threads a block of the form of kPerThread values a thread.
constexpr int quant_threads(int per_thread) { return kGroupsPerBlock * kFp8QuantGroup / per_thread; }

// Grid: x over blocks of kGroupsPerBlock column groups, y over padded rows. A thread loads kLoads packs of kWidth
// values: columns sub * kWidth + l * (128 / kLoads) of its group, l < kLoads. SILU: each value is silu_mul of the
// gate's and the up projection's at that column (x's rows are 2k long: gate, then up).
template <typename T, int kPerThread, bool SILU>
__global__ void __launch_bounds__(quant_threads(kPerThread))
    quantize_kernel(uint8_t* __restrict__ q, float* __restrict__ scale_t, const T* __restrict__ x, int m, int padded_m,
                    int k) {
  constexpr int kThreadsPerGroup = kFp8QuantGroup / kPerThread;
  constexpr int kWidth = kPerThread < 8 ? kPerThread : 8;  // values a load (8 or 16 bytes)
  constexpr int kLoads = kPerThread / kWidth;
  constexpr int kStride = kFp8QuantGroup / kLoads;  // columns between a thread's loads
  using Bits = typename std::conditional<kWidth == 8, uint2, uint32_t>::type;  // kWidth e4m3 values
  const int sub = threadIdx.x % kThreadsPerGroup;
  const int group = blockIdx.x * kGroupsPerBlock + threadIdx.x / kThreadsPerGroup;
  const int row = blockIdx.y;
  const int groups = k / kFp8QuantGroup;
  if (group >= groups) return;  // (whole groups: a group's threads leave together, its shuffles stay in step)
  const int column = group * kFp8QuantGroup + sub * kWidth;
  const int64_t offset = static_cast<int64_t>(row) * k + column;  // in q
  uint32_t words[kPerThread / 4] = {};
  float scale = 1.0f;
  if (row < m) {
    const T* in = x + static_cast<int64_t>(row) * (SILU ? 2 * k : k) + column;
    float f[kPerThread];
    float amax = 0.0f;
#pragma unroll
    for (int l = 0; l < kLoads; ++l) {
      Pack<T, kWidth> v = *reinterpret_cast<const Pack<T, kWidth>*>(in + l * kStride);
      if constexpr (SILU) {
        const Pack<T, kWidth> up = *reinterpret_cast<const Pack<T, kWidth>*>(in + k + l * kStride);
#pragma unroll
        for (int i = 0; i < kWidth; ++i) v.v[i] = silu_mul(v.v[i], up.v[i]);
      }
#pragma unroll
      for (int i = 0; i < kWidth; ++i) {
        f[l * kWidth + i] = Cvt<T>::to_f(v.v[i]);
        amax = fmaxf(amax, fabsf(f[l * kWidth + i]));
      }
    }
    constexpr unsigned kGroupLanes = kThreadsPerGroup == 32 ? 0xFFFFFFFFu : (1u << kThreadsPerGroup) - 1u;
    const unsigned mask = kGroupLanes << (threadIdx.x % 32 / kThreadsPerGroup * kThreadsPerGroup);
#pragma unroll
    for (int o = kThreadsPerGroup / 2; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(mask, amax, o));
    scale = group_scale(amax);
#pragma unroll
    for (int i = 0; i < kPerThread; i += 2) words[i / 4] |= to_e4m3x2(f[i], f[i + 1], scale) << (8 * (i % 4));
  }
#pragma unroll
  for (int l = 0; l < kLoads; ++l) {
    *reinterpret_cast<Bits*>(q + offset + l * kStride) = reinterpret_cast<const Bits*>(words)[l];
  }
  if (sub == 0) scale_t[static_cast<int64_t>(group) * padded_m + row] = scale;
}

}  // namespace

void quantize_fp8_tokens(uintptr_t q, uintptr_t scale_t, uintptr_t x, int64_t m, int64_t padded_m, int64_t k,
                         int dtype, uintptr_t stream, bool silu_gate_up) {
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
  if (silu_gate_up && 2 * k > (1 << 30)) throw std::invalid_argument(op + "2k beyond 2^30 (silu_gate_up)");
  const bool large = padded_m * k >= kLargeInput;
  FASTQWEN_DISPATCH_DTYPE(op.c_str(), dtype, kHalfTypes, T, {
    auto* out = reinterpret_cast<uint8_t*>(q);
    auto* scales = reinterpret_cast<float*>(scale_t);
    const auto* in = reinterpret_cast<const T*>(x);
    const int rows = static_cast<int>(m), padded = static_cast<int>(padded_m), cols = static_cast<int>(k);
    auto run = [&](auto per_thread, auto silu) {
      constexpr int kPer = decltype(per_thread)::value;
      quantize_kernel<T, kPer, decltype(silu)::value><<<grid, quant_threads(kPer), 0, s>>>(out, scales, in, rows,
                                                                                            padded, cols);
    };
    using Sixteen = std::integral_constant<int, 16>;
    using Four = std::integral_constant<int, 4>;
    if (silu_gate_up) {
      large ? run(Sixteen{}, std::true_type{}) : run(Four{}, std::true_type{});
    } else {
      large ? run(Sixteen{}, std::false_type{}) : run(Four{}, std::false_type{});
    }
  });
  cuda_check_launch("quantize_fp8_tokens kernel launch");
}

}  // namespace fastqwen
