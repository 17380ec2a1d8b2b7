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
// projections (o_proj FP8 8.7 against 10.6 us, qkv bf16 18.5 against 20.8; git show 1274b3f:bench/results/2026-11-23-h100-gemv-tc,
// run 3). The tensor-core kernel's mma has 8 token columns.
constexpr int kGemvTcMinTokens = 2;
constexpr int kGemvTcMaxTokens = 8;

// What the one-token GEMV does besides out = x @ W^T (gemv_norm below): the RMSNorm between two projections carried
// by their GEMVs. Exported to Python by name (_C.GemvEpilogue).
enum GemvEpilogue : int {
  kGemvPlain = 0,        // out = x @ W^T (+ bias): gemv()
  kGemvAddResidual = 1,  // the projection before the norm adds into the residual
  kGemvNormX = 2,        // the projection after the norm normalizes x (the residual) as it reads it
  kGemvNormXFolded = 3,  // the same with the norm's weight already multiplied into W's columns
  kGemvSend = 4,         // the projection before a tensor-parallel all-reduce stores its output into the ranks' buffers
};

// What gemv() and gemv_norm() take, by name. Pointers are device addresses, stream a cudaStream_t.
// out[i, j] = sum_c x[i, c] * W[j, c] (+ bias[j]) for i < m <= kGemvMaxTokens, j < n, c < k, accumulated in fp32.
// x: [m, k] and out: [m, n] of `dtype` (float16 or bfloat16); bias: [n] of dtype, or 0.
// w: [n, k] of dtype when !fp8; when fp8, float8_e4m3fn [n, k] with `scale` float32 [ceil(n/128), ceil(k/128)],
// W[j, c] = w[j, c] * scale[j / 128, c / 128]. k must be a multiple of 16 (fp8) or 8, every pointer 16-byte
// aligned. All buffers contiguous, on the current device.
// silu_gate_up: W is the gate and up projections stacked (n even) and out [m, n / 2] = silu(gate) * up, as
// silu_and_mul of the plain result would give it, bit for bit.
struct GemvArgs {
  uintptr_t out = 0, x = 0, w = 0, scale = 0, bias = 0;
  int64_t m = 0, n = 0, k = 0;
  int dtype = -1;  // a code of dtype.h
  bool fp8 = false;
  bool silu_gate_up = false;
  // gemv_norm only: its epilogue, and for kGemvNormX / kGemvNormXFolded the norm's eps (and kGemvNormX its weight).
  GemvEpilogue epilogue = kGemvPlain;
  uintptr_t norm_weight = 0;
  double eps = 0.0;
  // kGemvSend only: a device AllReduceSendTarget (custom_all_reduce.h), and the elements its slots hold.
  uintptr_t send = 0;
  int64_t send_capacity = 0;
  uintptr_t stream = 0;
};

// The GEMV with epilogue kGemvPlain (any other is gemv_norm's). Throws std::invalid_argument for bad arguments,
// std::runtime_error for CUDA errors.
void gemv(const GemvArgs& args);

// One token (m = 1), the RMSNorm between two projections carried by their GEMVs, so that no norm kernel runs between
// them (the decode step at batch 1). Shapes and the rest as for gemv.
// kGemvAddResidual (the projection before the norm; not silu_gate_up): out is the residual [1, n]; out := out + y,
//   y = x @ W^T (+ bias) rounded to dtype and the sum rounded, as fused_add_rms_norm adds. out may be read before
//   the kernel's programmatic wait: the kernel right before it must not have written it.
// kGemvNormX (the projection after the norm): x is the residual h [1, k], norm_weight g [k] of dtype (16-byte
//   aligned); out = (sum_c h[c] g[c] W[j, c]) / rms(h) (+ bias), rms(h) = sqrt(mean(h^2) + eps), every product and
//   sum fp32, one rounding (silu_gate_up: both halves so, then as gemv). RMSNorm(h) @ W^T without rounding the
//   normalized row (fused_add_rms_norm then gemv round it to dtype twice).
// kGemvNormXFolded (W[j, c] already multiplied by g[c]): as kGemvNormX with g = 1 (norm_weight ignored).
// kGemvSend (not silu_gate_up; n at most send_capacity): y, rounded as gemv rounds it, is not written to out but
//   stored into this rank's slot of every rank's receive buffer of the coming round (custom_all_reduce.h's
//   AllReduceSendTarget at `send`), for custom_all_reduce_add_rms_norm with `sent` to sum next.
void gemv_norm(const GemvArgs& args);

// Whether the decode step's kernels (GEMV, RMSNorm, q/k-norm + RoPE, decode attention and its merge, SiLU-and-mul)
// launch with programmatic dependent launch on devices that take it (compute capability 9.0+): each may then start
// while the kernel before it finishes (on by default; a process-wide switch, FASTQWEN_PDL=0 turns it off at import).
// Defined with the GEMV; the switch itself lives in launch.cuh.
void set_programmatic_launch(bool enabled);

// Whether gemv() sends the calls it can (2 to 8 tokens, rows a multiple of 128 bytes: gemv_tc.h) to the tensor-core
// kernel (gemv_tc.cu; on by default) rather than the kernel of gemv.cu; returns the setting before. For tests and
// benchmarks that compare the two; a process-wide switch, FASTQWEN_GEMV_TENSOR_CORES=0 turns it off at import.
bool set_gemv_tensor_cores(bool enabled);

// Weight rows a block of the one-token FMA kernel takes: 0 (the default) chooses 4, 5 or 6 by how full the grid's waves
// are (gemv.cu rows_per_block); 4, 5 or 6 forces it (5 not with the SiLU epilogue, and FP8 normalizing x keeps 4),
// for benchmarks comparing them. Read at launch (a CUDA graph keeps it). Returns the setting before.
int set_gemv_rows_per_block(int rows);

// Whether that default rule may choose 5 rows (default on; FASTQWEN_GEMV_FIVE_ROWS=0 turns it off at import, the rule
// of 4 or 6 before 2026-11-28, for comparison). Returns the setting before.
bool set_gemv_five_rows(bool enabled);

// The tensor-core kernel's FP8 pipeline (gemv_tc.cu: kFp8Pipelines; 0: two steps of weights in flight per warp at 3
// blocks per SM; 1: four at 2; 2: three at 2; 3 and 4: two and three at 2 with up to four tokens of x loaded at once;
// 5 and 6: 3 and 0 with persistent blocks, x staged once per block; 7 to 11: x read as it is; 12 (the default): one
// of 7, 8 and 11 per call, by the grid), for benchmarks and tests; returns the previous one. std::invalid_argument
// outside 0 .. gemv_tc_fp8_pipelines() - 1.
int set_gemv_tc_fp8_variant(int variant);
int gemv_tc_fp8_pipelines();

// Whether gemv() runs a call of m tokens and row length k (dense or fp8 weights) on the tensor-core kernel now.
bool gemv_uses_tensor_cores(int64_t m, int64_t k, bool fp8);

}  // namespace fastqwen
