// How fast an SM can turn weight bytes into dot-product work, with no memory traffic: the arithmetic ceiling of a
// batch-1 GEMV's inner loop, per way of doing it, as "weight GB/s" to hold against the HBM bandwidth (about 3 TB/s
// copy on an H100). If a way's ceiling is near the memory rate, its arithmetic cannot hide under the loads.
//
//   nvcc -std=c++20 -O3 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a -Icsrc \
//     -o /tmp/dequant_rates bench/dequant_rates.cu
//   /tmp/dequant_rates
//
// Every way processes 32 weight bytes per thread and iteration (two 16-byte chunks, as a lane holds two rows of a
// tile), taken from registers that change every iteration (4 XORs, the same for all ways) so that nothing is hoisted:
//   fma_fp8    the GEMV of csrc/gemv.cu today: e4m3x2 -> f16x2 (hardware cvt), f16 -> f32, fp32 FMA with x
//   fma_bf16   the same with bf16 weights (bf16 -> f32 is a shift), 16 weights
//   mma_fp8_cvt   tensor cores, f16 mma: e4m3x2 -> f16x2 by the hardware cvt, 32 weights = 2 m16n8k16
//   mma_fp8_bits  tensor cores, bf16 mma: e4m3 -> bf16 by shifts and masks (value * 2^-120), 2 mma
//   mma_bf16      tensor cores, bf16 weights as they are: 16 weights = 1 mma
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#include "common.cuh"
#include "mma.cuh"

#define CK(x)                                                                              \
  do {                                                                                     \
    cudaError_t e = (x);                                                                   \
    if (e != cudaSuccess) {                                                                \
      std::printf("%s failed: %s\n", #x, cudaGetErrorString(e));                           \
      std::exit(1);                                                                        \
    }                                                                                      \
  } while (0)

// Bytes 1 and 3 of w as bf16x2 (value * 2^-120): sign in place, the 7 magnitude bits moved down by 4.
__device__ __forceinline__ unsigned fp8_hi_bf16x2(unsigned w) { return (w & 0x80008000u) | ((w >> 4) & 0x07f007f0u); }
__device__ __forceinline__ unsigned fp8_lo_bf16x2(unsigned w) { return fp8_hi_bf16x2(w << 8); }

// The kernels' own building blocks: common.cuh's e4m3 conversion, mma.cuh's m16n8k16 with fp32 sums.
using fastqwen::e4m3x2_lo;
using fastqwen::mma::Mma;

enum Way { kFmaFp8, kFmaBf16, kMmaFp8Cvt, kMmaFp8Bits, kMmaBf16, kWays };
const char* kNames[] = {"fma_fp8", "fma_bf16", "mma_fp8_cvt", "mma_fp8_bits", "mma_bf16"};

template <int W>
__global__ void __launch_bounds__(128, 8) rate_kernel(float* sink, int iters) {
  unsigned w[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) w[i] = (threadIdx.x * 0x01010101u + i * 0x11111111u) & 0x3b3b3b3bu;
  float xf[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) xf[i] = 0.001f * (threadIdx.x + i);
  const unsigned xb0 = 0x3c003c00u ^ threadIdx.x, xb1 = 0x3c003c00u + threadIdx.x;
  float acc[4][4] = {};
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int i = 0; i < 8; i += 2) w[i] ^= it;
    if constexpr (W == kFmaFp8) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const unsigned lo = e4m3x2_lo(w[4 * r + i]), hi = e4m3x2_lo(w[4 * r + i] >> 16);
          const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&lo));
          const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&hi));
          acc[r][0] = fmaf(a.x, xf[4 * i], acc[r][0]);
          acc[r][1] = fmaf(a.y, xf[4 * i + 1], acc[r][1]);
          acc[r][2] = fmaf(b.x, xf[4 * i + 2], acc[r][2]);
          acc[r][3] = fmaf(b.y, xf[4 * i + 3], acc[r][3]);
        }
      }
    } else if constexpr (W == kFmaBf16) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[4 * r + i]));
          acc[r][2 * (i & 1)] = fmaf(a.x, xf[2 * i], acc[r][2 * (i & 1)]);
          acc[r][2 * (i & 1) + 1] = fmaf(a.y, xf[2 * i + 1], acc[r][2 * (i & 1) + 1]);
        }
      }
    } else if constexpr (W == kMmaFp8Cvt || W == kMmaFp8Bits) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {  // one m16n8k16 per word pair (row g: w[j], row g + 8: w[4 + j])
        unsigned a[4];
        if constexpr (W == kMmaFp8Cvt) {
          a[0] = e4m3x2_lo(w[j]);
          a[1] = e4m3x2_lo(w[4 + j]);
          a[2] = e4m3x2_lo(w[j] >> 16);
          a[3] = e4m3x2_lo(w[4 + j] >> 16);
          Mma<__half>::run(acc[j], a, xb0, xb1);
        } else {
          a[0] = fp8_lo_bf16x2(w[j]);
          a[1] = fp8_lo_bf16x2(w[4 + j]);
          a[2] = fp8_hi_bf16x2(w[j]);
          a[3] = fp8_hi_bf16x2(w[4 + j]);
          Mma<__nv_bfloat16>::run(acc[j], a, xb0, xb1);
        }
      }
    } else {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const unsigned a[4] = {w[2 * j], w[4 + 2 * j], w[2 * j + 1], w[4 + 2 * j + 1]};
        Mma<__nv_bfloat16>::run(acc[j], a, xb0, xb1);
      }
    }
  }
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) s += acc[i][j];
  if (s == 12345.678f) sink[threadIdx.x] = s;  // never true; keeps the work
}

template <int W>
float time_way(float* sink, int blocks, int iters) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  float best = 1e30f;
  for (int rep = 0; rep < 7; ++rep) {
    CK(cudaEventRecord(a));
    rate_kernel<W><<<blocks, 128>>>(sink, iters);
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    CK(cudaGetLastError());
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    if (rep > 0 && ms < best) best = ms;  // rep 0 warms up; the least of the rest (no memory traffic to vary)
  }
  return best;
}

int main() {
  cudaDeviceProp p;
  CK(cudaGetDeviceProperties(&p, 0));
  float* sink;
  CK(cudaMalloc(&sink, 128 * sizeof(float)));
  const int blocks = p.multiProcessorCount * 8, iters = 4096;
  const double bytes = 32.0 * 128 * blocks * iters;  // weight bytes processed: 32 per thread and iteration
  float ms[kWays] = {time_way<0>(sink, blocks, iters), time_way<1>(sink, blocks, iters), time_way<2>(sink, blocks, iters),
                     time_way<3>(sink, blocks, iters), time_way<4>(sink, blocks, iters)};
  std::printf("%s, %d SMs; weight bytes processed per second from registers (no memory):\n", p.name,
              p.multiProcessorCount);
  for (int i = 0; i < kWays; ++i) std::printf("  %-14s %8.3f ms  %7.0f GB/s\n", kNames[i], ms[i], bytes / (ms[i] * 1e6));
  return 0;
}
