// Host-side declaration of prompt lookup on the GPU (no CUDA headers needed).
#pragma once

#include <cstdint>

namespace fastqwen {

// Prompt lookup (speculative/ngram.py's NgramIndex, the same drafts) for B sequences at once, on the device, so that a
// verify step's next draft can be made without the host. history: int32 [B, stride], sequence b's tokens in its
// first lens[b] entries. For each b: the longest n in [n_min, min(n_max, len - 1)] whose tail tokens[len - n : len]
// occurs earlier, ending at some e <= len - 1 (followed by a token); of those occurrences the latest e; then
// drafts[b, :count] = tokens[e : e + count] with count = min(k, len - e) (0 without a match), the rest of the row -1.
// drafts: int32 [B, k]; counts: int32 [B]. Throws std::invalid_argument for bad arguments.
struct NgramDraftArgs {
  uintptr_t history = 0, lens = 0, drafts = 0, counts = 0;
  int64_t batch = 0, stride = 0;
  int64_t n_min = 1, n_max = 1, k = 1;
  uintptr_t stream = 0;
};
constexpr int64_t kNgramDraftMaxN = 64;  // as the config allows (speculative/config.py)
constexpr int64_t kNgramDraftMaxK = 64;
void ngram_draft(const NgramDraftArgs& args);

}  // namespace fastqwen
