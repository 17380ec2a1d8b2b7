// The tensor-core GEMV fed by bulk copies (gemv_tc_bulk.cu), behind gemv_tc(): same arguments, same bits.
#pragma once

#include <cstdint>

#include "gemv.h"

namespace fastqwen {

// Whether gemv_tc_bulk takes a call of m tokens and row length k on the current device: FP8 weights, k a multiple of
// 1,024, x ([m, k]) within the shared memory that leaves at least three stages of weights, an sm_90 device and a
// build with its binary.
bool gemv_tc_bulk_applies(int64_t m, int64_t k, bool fp8);

// gemv_tc() for a call gemv_tc_bulk_applies takes (arguments already checked by gemv()).
void gemv_tc_bulk(const GemvArgs& args);

}  // namespace fastqwen
