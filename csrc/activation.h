// Host-side declarations of the activation kernels (no CUDA headers needed).
#pragma once

#include <cstdint>

#include "dtype.h"

namespace fastqwen {

// out[r, i] = silu(x[r, i]) * x[r, d + i] for r < num_rows, i < d.
// x: [num_rows, 2*d] contiguous, out: [num_rows, d] contiguous, both on the
// device of the current CUDA context; `stream` is a cudaStream_t as an integer.
// Throws std::invalid_argument for bad arguments, std::runtime_error for CUDA
// errors. No launch when num_rows == 0 or d == 0. dtype: a code of dtype.h, float32, float16 or bfloat16.
void silu_and_mul(uintptr_t x, uintptr_t out, int64_t num_rows, int64_t d, int dtype, uintptr_t stream);

}  // namespace fastqwen
