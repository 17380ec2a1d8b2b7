// The tensor-core GEMV for up to 8 tokens (gemv_tc.cu), behind gemv() of gemv.h: same arguments, same contract.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "gemv.h"

namespace fastqwen {

// Whether gemv_tc takes a call of m tokens and row length k: m <= kGemvTcMaxTokens, rows a multiple of 128 bytes
// (FP8 k % 128 == 0, dense k % 64 == 0), and with FP8, x staged as f16 within 100 KB of shared memory (8 warps times
// m times ceil(k / 1024) blocks of 128 halves: m * k <= 51,200 where k is a multiple of 1,024).
bool gemv_tc_applies(int64_t m, int64_t k, bool fp8);

// gemv() for a call that gemv_tc_applies takes (arguments already checked by gemv(); epilogue kGemvPlain).
void gemv_tc(const GemvArgs& args);

}  // namespace fastqwen
