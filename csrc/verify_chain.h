// Host-side declaration of the chained verify step's input kernel (no CUDA headers needed).
#pragma once

#include <cstdint>

namespace fastqwen {

// Speculative decoding with prompt lookup, one verify step after another with no host in between
// (engine/verify_chain.py): queued after a verify step of q = k + 1 positions a sequence, this makes the next step's
// inputs from that step's draws, in place in the buffers the verify CUDA graphs read. For each sequence b < batch:
//  1. acceptance n: the draft tokens input_ids[b*q + 1 + i] (i < k) accepted while each equals the draw tokens[b*q + i]
//     (speculative/speculator.py's rule); with synthetic > 0 (a benchmark's forced acceptance length L) instead the
//     speculator's arithmetic in double: credit[b] += L - 1, n = min(k, floor(credit[b])), credit[b] -= n;
//  2. the emitted tokens (drafts[:n], then tokens[b*q + n]) appended to history[b] (int32 [batch, stride]; lens[b]
//     its length, advanced);
//  3. the next draft: prompt lookup over history[b] as ngram_draft does (n_min..n_max), filled up to k with the last
//     token (the speculator fills a short draft so for the graphs);
//  4. the next step's inputs: input_ids (the last token, then the draft), positions from positions[b*q] + n + 1 on,
//     out_slots from page_table row b (page_size tokens a page; int32 [>= batch, width], written by the host before
//     this runs), kv_lens[b] = the last position + 1;
//  5. the sampler rows b*q .. b*q + q - 1 (int32 words [.., row_words]): their 64-bit step (words step_lo, step_hi)
//     advanced by n + 1, the tokens the step emitted;
//  6. report[b] = n and report[batch + b*q + i] = the new input_ids, for the host (int32 [batch * (q + 1)]).
// tokens, input_ids, positions, out_slots: int64; kv_lens, page_table, rows, history, lens, report: int32; credit:
// double. The caller guarantees room: lens[b] + q <= stride and pages for every position written. Throws
// std::invalid_argument for bad arguments.
struct VerifyChainArgs {
  uintptr_t tokens = 0, input_ids = 0, positions = 0, out_slots = 0, kv_lens = 0, page_table = 0, rows = 0;
  uintptr_t history = 0, lens = 0, credit = 0, report = 0;
  int64_t batch = 0, q = 2, width = 1, stride = 1, page_size = 16;
  int64_t row_words = 1, step_lo = 0, step_hi = 1, n_min = 1, n_max = 1;
  double synthetic = 0.0;
  uintptr_t stream = 0;
};
constexpr int64_t kVerifyChainMaxQ = 65;  // k <= 64, as ngram_draft allows
void verify_chain(const VerifyChainArgs& args);

}  // namespace fastqwen
