// The chained verify step's inputs (verify_chain.h): one block per sequence. Thread 0 decides the acceptance and
// appends the emitted tokens; the block searches the history for the next draft (ngram_match.cuh); then each of the
// q positions' inputs and sampler row is written by a thread of its own.
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "cuda_check.h"
#include "ngram_draft.h"
#include "ngram_match.cuh"
#include "verify_chain.h"

namespace fastqwen {
namespace {

constexpr int kThreads = 256;

struct ChainPointers {
  const int64_t* tokens;
  int64_t* input_ids;
  int64_t* positions;
  int64_t* out_slots;
  int* kv_lens;
  const int* page_table;
  unsigned* rows;
  int* history;
  int* lens;
  double* credit;
  int* report;
};

__global__ void __launch_bounds__(kThreads) verify_chain_kernel(ChainPointers p, int batch, int q, int64_t width,
                                                                int64_t stride, int page_size, int row_words,
                                                                int step_lo, int step_hi, int n_min, int n_max,
                                                                double synthetic) {
  const int b = blockIdx.x;
  const int k = q - 1;
  const int64_t first = static_cast<int64_t>(b) * q;
  int* tokens = p.history + b * stride;
  __shared__ int accepted, last;
  __shared__ int64_t start;
  __shared__ unsigned long long scratch[kThreads / 32];
  if (threadIdx.x == 0) {
    int n = 0;
    if (synthetic > 0.0) {
      double credit = p.credit[b] + (synthetic - 1.0);
      n = min(k, static_cast<int>(credit));
      p.credit[b] = credit - n;
    } else {
      while (n < k && p.input_ids[first + 1 + n] == p.tokens[first + n]) ++n;
    }
    int len = p.lens[b];
    for (int i = 0; i <= n && len < stride; ++i, ++len) {
      tokens[len] = static_cast<int>(i < n ? p.input_ids[first + 1 + i] : p.tokens[first + n]);
    }
    p.lens[b] = len;
    accepted = n;
    last = static_cast<int>(p.tokens[first + n]);
    start = p.positions[first] + n + 1;
  }
  __syncthreads();
  const int len = p.lens[b];
  const int e = ngram_match_end<kThreads>(tokens, len, n_min, n_max, scratch);
  const int count = e == 0 ? 0 : min(k, len - e);
  for (int i = threadIdx.x; i < q; i += kThreads) {
    const int64_t row = first + i;
    const int64_t pos = start + i;
    p.input_ids[row] = i == 0 ? last : (i - 1 < count ? tokens[e + i - 1] : last);
    p.positions[row] = pos;
    p.out_slots[row] = static_cast<int64_t>(p.page_table[b * width + pos / page_size]) * page_size + pos % page_size;
    unsigned* words = p.rows + row * row_words;
    const unsigned long long step =
        ((static_cast<unsigned long long>(words[step_hi]) << 32) | words[step_lo]) + accepted + 1;
    words[step_lo] = static_cast<unsigned>(step & 0xffffffffu);
    words[step_hi] = static_cast<unsigned>(step >> 32);
    p.report[batch + row] = static_cast<int>(p.input_ids[row]);
  }
  if (threadIdx.x == 0) {
    p.kv_lens[b] = static_cast<int>(start + q);
    p.report[b] = accepted;
  }
}

}  // namespace

void verify_chain(const VerifyChainArgs& a) {
  const std::string op = "verify_chain: ";
  if (a.batch < 0 || a.batch > 4096) throw std::invalid_argument(op + "batch out of range");
  if (a.q < 2 || a.q > kVerifyChainMaxQ) throw std::invalid_argument(op + "q must be in [2, " + std::to_string(kVerifyChainMaxQ) + "]");
  if (a.stride < a.q || a.stride > (int64_t{1} << 30)) throw std::invalid_argument(op + "stride out of range");
  if (a.width < 1 || a.page_size < 1) throw std::invalid_argument(op + "width and page_size must be positive");
  if (a.row_words < 1 || a.step_lo < 0 || a.step_hi < 0 || a.step_lo >= a.row_words || a.step_hi >= a.row_words) {
    throw std::invalid_argument(op + "the step words must lie in a sampler row");
  }
  if (a.n_min < 1 || a.n_max < a.n_min || a.n_max > kNgramDraftMaxN) {
    throw std::invalid_argument(op + "need 1 <= n_min <= n_max <= " + std::to_string(kNgramDraftMaxN));
  }
  for (uintptr_t ptr : {a.tokens, a.input_ids, a.positions, a.out_slots, a.credit}) {
    if (ptr == 0 || ptr % 8 != 0) throw std::invalid_argument(op + "tokens, input_ids, positions, out_slots and credit must be 64-bit buffers");
  }
  for (uintptr_t ptr : {a.kv_lens, a.page_table, a.rows, a.history, a.lens, a.report}) {
    if (ptr == 0 || ptr % 4 != 0) throw std::invalid_argument(op + "kv_lens, page_table, rows, history, lens and report must be int32 buffers");
  }
  if (a.batch == 0) return;
  ChainPointers p{reinterpret_cast<const int64_t*>(a.tokens), reinterpret_cast<int64_t*>(a.input_ids),
                  reinterpret_cast<int64_t*>(a.positions),    reinterpret_cast<int64_t*>(a.out_slots),
                  reinterpret_cast<int*>(a.kv_lens),          reinterpret_cast<const int*>(a.page_table),
                  reinterpret_cast<unsigned*>(a.rows),        reinterpret_cast<int*>(a.history),
                  reinterpret_cast<int*>(a.lens),             reinterpret_cast<double*>(a.credit),
                  reinterpret_cast<int*>(a.report)};
  verify_chain_kernel<<<static_cast<unsigned>(a.batch), kThreads, 0, reinterpret_cast<cudaStream_t>(a.stream)>>>(
      p, static_cast<int>(a.batch), static_cast<int>(a.q), a.width, a.stride, static_cast<int>(a.page_size),
      static_cast<int>(a.row_words), static_cast<int>(a.step_lo), static_cast<int>(a.step_hi),
      static_cast<int>(a.n_min), static_cast<int>(a.n_max), a.synthetic);
  cuda_check_launch("verify_chain");
}

}  // namespace fastqwen
