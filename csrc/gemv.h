// Host-side declaration of the small-batch GEMV kernel (no CUDA headers needed).
#pragma once

#include <cstdint>

#include "dtype.h"

namespace fastqwen {

// The most tokens (rows of x) one gemv call takes; the Python dispatch sends larger batches to cuBLAS.
constexpr int kGemvMaxTokens = 16;
// FP8 weights carry one float32 scale per kGemvFp8Block x kGemvFp8Block block of the weight.
constexpr int kGemvFp8Block = 128;

// out[i, j] = sum_c x[i, c] * W[j, c] (+ bias[j]) for i < m <= kGemvMaxTokens, j < n, c < k, accumulated in fp32.
// x: [m, k] and out: [m, n] of `dtype` (float16 or bfloat16); bias: [n] of dtype, or 0.
// W: [n, k] of dtype when !fp8; when fp8, float8_e4m3fn [n, k] with `scale` float32 [ceil(n/128), ceil(k/128)],
// W[j, c] = w[j, c] * scale[j / 128, c / 128]. k must be a multiple of 16 (fp8) or 8, every pointer 16-byte
// aligned. All buffers contiguous, on the current device; `stream` a cudaStream_t as an integer.
// silu_gate_up: W is the gate and up projections stacked (n even) and out [m, n / 2] = silu(gate) * up, as
// silu_and_mul of the plain result would give it, bit for bit.
// Throws std::invalid_argument for bad arguments, std::runtime_error for CUDA errors.
void gemv(uintptr_t out, uintptr_t x, uintptr_t w, uintptr_t scale, uintptr_t bias, int64_t m, int64_t n, int64_t k,
          int dtype, bool fp8, bool silu_gate_up, uintptr_t stream);

// Whether the decode step's kernels (GEMV, RMSNorm, q/k-norm + RoPE, decode attention and its merge, SiLU-and-mul)
// launch with programmatic dependent launch on devices that take it (compute capability 9.0+): each may then start
// while the kernel before it finishes (on by default; a process-wide switch, FASTQWEN_PDL=0 turns it off at import).
// Defined with the GEMV; the switch itself lives in launch.cuh.
void set_programmatic_launch(bool enabled);

}  // namespace fastqwen
