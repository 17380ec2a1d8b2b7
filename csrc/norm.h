// Host-side declarations of the RMSNorm kernels (no CUDA headers needed).
#pragma once

#include <cstdint>

namespace fastqwen {

// out[r] = weight * RMSNorm(x[r]) for r < num_rows; x, out: [num_rows, hidden] contiguous, weight: [hidden].
// Rounds where Hugging Face's Qwen3RMSNorm rounds: normalize in fp32, round to the dtype, multiply by the weight.
// dtype: a code of dtype.h, float16 or bfloat16. Throws std::invalid_argument for bad arguments.
void rms_norm(uintptr_t out, uintptr_t x, uintptr_t weight, int64_t num_rows, int64_t hidden, double eps, int dtype,
              uintptr_t stream);

// In place: residual[r] = round(x[r] + residual[r]); x[r] = weight * RMSNorm(residual[r]).
void fused_add_rms_norm(uintptr_t x, uintptr_t residual, uintptr_t weight, int64_t num_rows, int64_t hidden, double eps,
                        int dtype, uintptr_t stream);

// fused_add_rms_norm with its output quantized for the block-scaled FP8 GEMM instead of written: residual as
// fused_add_rms_norm leaves it; the rows it would write into x quantized as quantize_fp8_tokens (fp8_quant.h) would
// quantize them, bit for bit, into q [padded_rows, hidden] (e4m3) and scale_t float32 [hidden / 128, padded_rows]
// (rows from num_rows on: zeros, scale 1). x is left as it was. float16 or bfloat16; hidden a multiple of 128, at
// most 8 16-byte packs a thread; x, residual, weight 16-byte aligned; 1 <= num_rows <= padded_rows <= 65535.
void fused_add_rms_norm_fp8(uintptr_t x, uintptr_t residual, uintptr_t weight, int64_t num_rows, int64_t hidden,
                            double eps, int dtype, uintptr_t q, uintptr_t scale_t, int64_t padded_rows,
                            uintptr_t stream);

}  // namespace fastqwen
