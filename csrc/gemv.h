// Host-side declaration of the small-batch GEMV kernel (no CUDA headers needed).
#pragma once

#include <cstdint>

#include "dtype.h"

namespace fastqwen {

// The most tokens (rows of x) one gemv call takes; the Python dispatch sends larger batches to cuBLAS.
constexpr int kGemvMaxTokens = 16;
// FP8 weights carry one float32 scale per kGemvFp8Block x kGemvFp8Block block of the weight.
constexpr int kGemvFp8Block = 128;
// The token counts gemv() runs on its tensor-core kernel (gemv_tc.cu, where it takes the shape); the FMA kernel
// (gemv.cu) the others. One token stays with the FMA kernel: on the H100 it was faster on Qwen3-8B's one-wave
// projections (o_proj FP8 8.7 against 10.6 us, qkv bf16 18.5 against 20.8; bench/results/2026-11-23-h100-gemv-tc,
// run 3). The tensor-core kernel's mma has 8 token columns.
constexpr int kGemvTcMinTokens = 2;
constexpr int kGemvTcMaxTokens = 8;

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

// One token, the RMSNorm between two projections carried by their GEMVs, so that no norm kernel runs between them
// (the decode step at batch 1). Shapes and the rest as for gemv with m = 1.
// kind 1, add (the projection before the norm; not silu_gate_up): out is the residual [1, n]; out := out + y, y =
//   x @ W^T (+ bias) rounded to dtype and the sum rounded, as fused_add_rms_norm adds. out may be read before the
//   kernel's programmatic wait: the kernel right before it must not have written it.
// kind 2, normalize (the projection after the norm): x is the residual h [1, k], norm_weight g [k] of dtype (16-byte
//   aligned); out = (sum_c h[c] g[c] W[j, c]) / rms(h) (+ bias), rms(h) = sqrt(mean(h^2) + eps), every product and
//   sum fp32, one rounding (silu_gate_up: both halves so, then as gemv). RMSNorm(h) @ W^T without rounding the
//   normalized row (fused_add_rms_norm then gemv round it to dtype twice).
// kind 3, normalize with the norm weight folded into W (W[j, c] already multiplied by g[c]): as kind 2 with g = 1
//   (norm_weight ignored).
void gemv_norm(int kind, uintptr_t out, uintptr_t x, uintptr_t w, uintptr_t scale, uintptr_t bias, int64_t n,
               int64_t k, int dtype, bool fp8, bool silu_gate_up, uintptr_t norm_weight, double eps, uintptr_t stream);

// Whether the decode step's kernels (GEMV, RMSNorm, q/k-norm + RoPE, decode attention and its merge, SiLU-and-mul)
// launch with programmatic dependent launch on devices that take it (compute capability 9.0+): each may then start
// while the kernel before it finishes (on by default; a process-wide switch, FASTQWEN_PDL=0 turns it off at import).
// Defined with the GEMV; the switch itself lives in launch.cuh.
void set_programmatic_launch(bool enabled);

// Whether gemv() sends the calls it can (2 to 8 tokens, rows a multiple of 128 bytes: gemv_tc.h) to the tensor-core
// kernel (gemv_tc.cu; on by default) rather than the kernel of gemv.cu; returns the setting before. For tests and
// benchmarks that compare the two; a process-wide switch, FASTQWEN_GEMV_TENSOR_CORES=0 turns it off at import.
bool set_gemv_tensor_cores(bool enabled);

// Whether gemv() runs a call of m tokens and row length k (dense or fp8 weights) on the tensor-core kernel now.
bool gemv_uses_tensor_cores(int64_t m, int64_t k, bool fp8);

}  // namespace fastqwen
