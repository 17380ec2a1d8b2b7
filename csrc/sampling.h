// Host-side declarations of the sampler (no CUDA headers needed).
#pragma once

#include <cstdint>

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
  int32_t num_blocked;  // first num_blocked entries of this row of `blocked` are set to -inf (min_tokens)
  int32_t top_n;        // -1: no logprobs; 0..64: logprob of the token and the top_n alternatives
  int32_t reserved[2];
};
static_assert(sizeof(SamplerRow) == 64, "SamplerRow is 16 words");

// Bytes of scratch memory sample() needs for up to max_rows rows of the given vocabulary size.
int64_t sampler_workspace_bytes(int64_t max_rows, int64_t vocab);

// One token per row of logits [rows, vocab] (dtype 0 = float32, 2 = bfloat16), from rows' parameters
// (device array of SamplerRow). Writes tokens [rows] int64; when a row's top_n >= 0, logprobs [rows] float32 (log
// softmax of the raw logits at the token) and the top_n first entries of top_ids / top_logprobs [rows, top_width]
// (int64 / float32, the most likely raw tokens). counts [counts_rows, vocab] int32: output-token count of each slot
// in bits 0..29, bit 30 = the token is in the prompt; the sampled token of a row with a slot is counted. blocked
// [rows, blocked_width] int32. No host synchronization and no allocation: capturable in a CUDA graph.
// Throws std::invalid_argument for bad arguments.
void sample(uintptr_t logits, int dtype, int64_t rows, int64_t vocab, uintptr_t params, uintptr_t tokens,
            uintptr_t logprobs, uintptr_t top_ids, uintptr_t top_logprobs, int64_t top_width, uintptr_t counts,
            int64_t counts_rows, uintptr_t blocked, int64_t blocked_width, uintptr_t workspace,
            int64_t workspace_bytes, uintptr_t stream);

}  // namespace fastqwen
