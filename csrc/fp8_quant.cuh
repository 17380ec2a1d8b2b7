// The per-token activation quantizer's arithmetic (fp8_quant.h: groups of kFp8QuantGroup columns, scale = amax / 448,
// values divided by it in IEEE float32 and rounded to e4m3), written once for the quantizer (fp8_quant.cu) and for the
// kernels that quantize their own output for the FP8 GEMM (norm.cu's residual add + RMSNorm).
#pragma once

#include <cuda_fp8.h>

#include <cstdint>

#include "fp8_quant.h"

namespace fastqwen {

constexpr float kE4M3Max = 448.0f;

// The scale of a group whose largest magnitude is amax.
__device__ __forceinline__ float group_scale(float amax) { return fmaxf(amax, 1e-12f) / kE4M3Max; }

// Two values as e4m3 (divided by scale in IEEE float32 and clamped to e4m3's range, as the reference), in 16 bits.
__device__ __forceinline__ uint32_t to_e4m3x2(float a, float b, float scale) {
  const float2 pair = make_float2(fminf(fmaxf(a / scale, -kE4M3Max), kE4M3Max),
                                  fminf(fmaxf(b / scale, -kE4M3Max), kE4M3Max));
  return static_cast<uint32_t>(__nv_cvt_float2_to_fp8x2(pair, __NV_SATFINITE, __NV_E4M3));
}

// Where a kernel writes its output quantized (rows of `hidden` columns): q [padded, hidden] e4m3, scale_t float32
// [hidden / kFp8QuantGroup, padded] (column-major, as the GEMM reads it); rows from `rows` to `padded` zero with
// scale 1. q == nullptr: the kernel writes its output as it is.
struct Fp8Rows {
  uint8_t* q = nullptr;
  float* scale_t = nullptr;
  int rows = 0;
  int padded = 0;
};

}  // namespace fastqwen
