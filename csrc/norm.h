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

}  // namespace fastqwen
