// Host-side declaration of the FP8 activation quantizer (no CUDA headers needed).
#pragma once

#include <cstdint>

#include "dtype.h"

namespace fastqwen {

// Activations are quantized per token in groups of kFp8QuantGroup consecutive columns.
constexpr int kFp8QuantGroup = 128;

// For rows i < m of x [m, k] (float16 or bfloat16, contiguous, k a multiple of 128), each group g of 128 columns:
// scale = max(|x[i, group]|, 1e-12) / 448, q[i, group] = e4m3(x / scale) (saturating, round to nearest even), and
// scale_t[g * padded_m + i] = scale (scales column-major, the layout cuBLASLt's block-scaled GEMM takes). Rows
// m <= i < padded_m of q are zero with scale 1. q: [padded_m, k] bytes; scale_t: float32 [k / 128, padded_m].
// silu_gate_up: x is [m, 2k], the gate and up projections' outputs side by side (as silu_and_mul takes them), and the
// values quantized are silu_and_mul's [m, k] outputs (rounded to dtype as it rounds them), never written out: bit for
// bit the quantization of silu_and_mul(x), in one pass (the down projection's input).
void quantize_fp8_tokens(uintptr_t q, uintptr_t scale_t, uintptr_t x, int64_t m, int64_t padded_m, int64_t k,
                         int dtype, uintptr_t stream, bool silu_gate_up = false);

}  // namespace fastqwen
