// Prompt lookup on the GPU (ngram_draft.h): one block per sequence. Every thread takes end positions e of earlier
// occurrences, measures how many tokens before e match the sequence's tail (up to n_max), and the block keeps the best
// (match length, e) pair, longest match first, then latest: the order in which NgramIndex.lookup tries its n-grams,
// each dictionary holding the latest occurrence. The scan costs len * n_max compares a sequence, a few microseconds
// at 8k tokens: what the host's incremental index saves does not matter on the device.
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "cuda_check.h"
#include "ngram_draft.h"

namespace fastqwen {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) ngram_draft_kernel(const int* __restrict__ history,
                                                               const int* __restrict__ lens, int* __restrict__ drafts,
                                                               int* __restrict__ counts, int64_t stride, int n_min,
                                                               int n_max, int k) {
  const int b = blockIdx.x;
  const int* tokens = history + b * stride;
  const int len = max(0, min(lens[b], static_cast<int>(stride)));
  const int longest = min(n_max, len - 1);  // the tail itself is never its own match
  // best = (match length << 32) | e, the largest over the block; 0 = no match of n_min tokens
  unsigned long long best = 0;
  for (int e = 1 + static_cast<int>(threadIdx.x); e <= len - 1; e += kThreads) {
    const int reach = min(longest, e);
    int n = 0;
    while (n < reach && tokens[e - 1 - n] == tokens[len - 1 - n]) ++n;
    if (n >= n_min) {
      const unsigned long long key = (static_cast<unsigned long long>(n) << 32) | static_cast<unsigned>(e);
      best = key > best ? key : best;
    }
  }
  __shared__ unsigned long long warp_best[kThreads / 32];
  for (int offset = 16; offset > 0; offset >>= 1) {
    const unsigned long long other = __shfl_xor_sync(0xffffffffu, best, offset);
    best = other > best ? other : best;
  }
  if ((threadIdx.x & 31) == 0) warp_best[threadIdx.x >> 5] = best;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreads / 32; ++w) best = warp_best[w] > best ? warp_best[w] : best;
    warp_best[0] = best;
  }
  __syncthreads();
  best = warp_best[0];
  const int e = static_cast<int>(best & 0xffffffffu);
  const int count = best == 0 ? 0 : min(k, len - e);
  for (int i = threadIdx.x; i < k; i += kThreads) drafts[b * k + i] = i < count ? tokens[e + i] : -1;
  if (threadIdx.x == 0) counts[b] = count;
}

}  // namespace

void ngram_draft(const NgramDraftArgs& a) {
  const std::string op = "ngram_draft: ";
  if (a.batch < 0 || a.batch > (int64_t{1} << 20)) throw std::invalid_argument(op + "batch out of range");
  if (a.stride < 1 || a.stride > (int64_t{1} << 30)) throw std::invalid_argument(op + "stride out of range");
  if (a.n_min < 1 || a.n_max < a.n_min || a.n_max > kNgramDraftMaxN) {
    throw std::invalid_argument(op + "need 1 <= n_min <= n_max <= " + std::to_string(kNgramDraftMaxN));
  }
  if (a.k < 1 || a.k > kNgramDraftMaxK) throw std::invalid_argument(op + "k must be in [1, " + std::to_string(kNgramDraftMaxK) + "]");
  for (uintptr_t ptr : {a.history, a.lens, a.drafts, a.counts}) {
    if (ptr == 0 || ptr % 4 != 0) throw std::invalid_argument(op + "history, lens, drafts and counts must be int32 buffers");
  }
  if (a.batch == 0) return;
  ngram_draft_kernel<<<static_cast<unsigned>(a.batch), kThreads, 0, reinterpret_cast<cudaStream_t>(a.stream)>>>(
      reinterpret_cast<const int*>(a.history), reinterpret_cast<const int*>(a.lens), reinterpret_cast<int*>(a.drafts),
      reinterpret_cast<int*>(a.counts), a.stride, static_cast<int>(a.n_min), static_cast<int>(a.n_max),
      static_cast<int>(a.k));
  cuda_check_launch("ngram_draft");
}

}  // namespace fastqwen
