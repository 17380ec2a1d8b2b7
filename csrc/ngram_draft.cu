// Prompt lookup on the GPU (ngram_draft.h): one block per sequence, searching as ngram_match.cuh says (longest match
// first, then latest: the order in which NgramIndex.lookup tries its n-grams, each dictionary holding the latest
// occurrence). The scan costs len * n_max compares a sequence, a few microseconds
// at 8k tokens: what the host's incremental index saves does not matter on the device.
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "cuda_check.h"
#include "ngram_draft.h"
#include "ngram_match.cuh"

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
  __shared__ unsigned long long scratch[kThreads / 32];
  const int e = ngram_match_end<kThreads>(tokens, len, n_min, n_max, scratch);
  const int count = e == 0 ? 0 : min(k, len - e);
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
