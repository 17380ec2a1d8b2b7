// Host-side declarations of the sampler (no CUDA headers needed). The layouts here (SamplerRow's fields, the counts
// table's bits) are exported to Python by the native module (csrc/bindings.cpp), which packs rows by them.
#pragma once

#include <cstdint>

#include "dtype.h"

namespace fastqwen {

// Per-row parameters, 16 32-bit words, filled by the host (python/fastqwen/ops/sampling.py packs them).
struct SamplerRow {
  float temperature;  // <= 0: greedy (argmax of the penalized logits)
  int32_t top_k;      // <= 0 or >= vocab: off
  float top_p;        // >= 1: off
  float min_p;        // <= 0: off
  uint32_t seed_lo, seed_hi;  // the request's seed
  uint32_t step_lo, step_hi;  // index of this draw within the request
  int32_t slot;       // row of the counts table, -1: no penalties
  float repetition, presence, frequency;
  int32_t num_blocked;  // first num_blocked entries of this row of `blocked`: banned (-inf), or biased by `bias`
  int32_t top_n;        // -1: no logprobs; 0..kSamplerMaxTopN: logprob of the token and the top_n alternatives
  int32_t masked;       // non-zero: only the tokens whose bit is set in this row of `mask` can be drawn (grammar)
  int32_t reserved;
};
static_assert(sizeof(SamplerRow) == 64, "SamplerRow is 16 words");

constexpr int kSamplerMaxTopN = 64;  // most alternatives a row can ask for
// The counts table: a row per request with penalties, a word per token: bits 0..29 count the token in the output,
// kPromptBit says it is in the prompt.
constexpr int32_t kCountMask = (1 << 30) - 1;
constexpr int32_t kPromptBit = 1 << 30;
constexpr unsigned kSamplerLogitTypes = dtype_bit(kF32) | dtype_bit(kBF16);

// The arguments of sample(), by name. Pointers are device addresses (0 = absent), stream a cudaStream_t.
struct SampleArgs {
  uintptr_t logits = 0;  // [rows, vocab], float32 or bfloat16 (dtype: a code of dtype.h)
  int dtype = -1;
  int64_t rows = 0, vocab = 0;
  uintptr_t params = 0;        // SamplerRow [rows]
  uintptr_t tokens = 0;        // int64 [rows]
  uintptr_t logprobs = 0;      // float32 [rows]
  uintptr_t top_ids = 0;       // int64 [rows, top_width]
  uintptr_t top_logprobs = 0;  // float32 [rows, top_width]
  int64_t top_width = 0;
  uintptr_t counts = 0;  // int32 [counts_rows, vocab]
  int64_t counts_rows = 0;
  uintptr_t blocked = 0;  // int32 [rows, blocked_width]: token ids
  int64_t blocked_width = 0;
  uintptr_t bias = 0;  // float32 [rows, blocked_width]: added to the logit of each `blocked` entry (0 = absent: -inf)
  uintptr_t mask = 0;  // int32 [rows, mask_words]: bit (t % 32) of word t / 32 allows token t (rows with `masked`)
  int64_t mask_words = 0;  // (vocab + 31) / 32 when mask is given
  uintptr_t workspace = 0;
  int64_t workspace_bytes = 0;
  uintptr_t stream = 0;
};

// Bytes of scratch memory sample() needs for up to max_rows rows of the given vocabulary size.
int64_t sampler_workspace_bytes(int64_t max_rows, int64_t vocab);

// One token per row of logits from the rows' parameters. Writes tokens; when a row's top_n >= 0, its logprob (log
// softmax of the raw logits at the token) and the top_n first entries of its top_ids / top_logprobs row (the most
// likely raw tokens). The sampled token of a row with a counts slot is counted in the table; a row's first
// num_blocked ids of `blocked` cannot be drawn (or, with `bias`, get its value added after the penalties); a row
// with `masked` draws only tokens its mask row allows. Logprobs stay those of the raw logits. No host synchronization and no allocation: capturable in a CUDA
// graph. Throws std::invalid_argument for bad arguments.
void sample(const SampleArgs& args);

}  // namespace fastqwen
