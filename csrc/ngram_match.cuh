// Prompt lookup's search, shared by ngram_draft.cu and verify_chain.cu: the block finds, in tokens[0:len], the
// occurrence that speculative/ngram.py's NgramIndex.lookup would take (longest tail match first, then latest).
#pragma once

namespace fastqwen {

// Called by every thread of a block of kThreads; returns to all of them the end e of the chosen earlier occurrence
// (its draft is tokens[e : e + k]) or 0 when no tail of n_min..n_max tokens occurs earlier. Every thread takes end
// positions e of earlier occurrences (each followed by a token: e <= len - 1), measures how many tokens before e
// match the sequence's tail, and the block keeps the best (match length, e) pair. `scratch`: kThreads / 32 entries
// of shared memory.
template <int kThreads>
__device__ int ngram_match_end(const int* __restrict__ tokens, int len, int n_min, int n_max,
                               unsigned long long* scratch) {
  const int longest = min(n_max, len - 1);  // the tail itself is never its own match
  unsigned long long best = 0;  // (match length << 32) | e; 0 = no match of n_min tokens
  for (int e = 1 + static_cast<int>(threadIdx.x); e <= len - 1; e += kThreads) {
    const int reach = min(longest, e);
    int n = 0;
    while (n < reach && tokens[e - 1 - n] == tokens[len - 1 - n]) ++n;
    if (n >= n_min) {
      const unsigned long long key = (static_cast<unsigned long long>(n) << 32) | static_cast<unsigned>(e);
      best = key > best ? key : best;
    }
  }
  for (int offset = 16; offset > 0; offset >>= 1) {
    const unsigned long long other = __shfl_xor_sync(0xffffffffu, best, offset);
    best = other > best ? other : best;
  }
  __syncthreads();  // (scratch may still be read by a previous call)
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = best;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreads / 32; ++w) best = scratch[w] > best ? scratch[w] : best;
    scratch[0] = best;
  }
  __syncthreads();
  best = scratch[0];
  return best == 0 ? 0 : static_cast<int>(best & 0xffffffffu);
}

}  // namespace fastqwen
