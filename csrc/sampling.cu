// The sampler: penalties, min_tokens blocking, logit bias, grammar masks, greedy / temperature / top-k / top-p / min-p with per-row
// counter-based randomness, the logprob of the drawn token and the top-N raw alternatives. Three kernels, all
// launched every call (graph-capturable, no host sync, scratch from a caller-allocated workspace):
//
// 1. scan: one pass over the logits. A row is cut into tiles of 1024 tokens; each warp takes a strided set of
//    tiles and keeps, per row mode: a running argmax (greedy), the race argmax over every token (sampled rows with
//    no filter), or the 64 best tokens by (logit desc, id asc) (filtered rows). The 64-lists reject almost every
//    token with one compare against a running threshold (each warp's first tile seeds it by bisection over lane
//    maxima; the warps of a block share the best one), so per tile the common cost is a max and a vote, and
//    sorting/merging runs only for the few admitted tokens. Per tile it writes (max, sum-exp)
//    partials, so the row's sums do not depend on how tiles are spread over warps (the grid grows as the batch
//    shrinks, and a row's result must not depend on the batch).
// 2. finalize: a warp per row merges the partial lists and sums, and decides the row from its 64 best tokens
//    whenever the kept set (a prefix of the sorted row, since top-k, top-p and min-p each keep a prefix) is
//    known to end inside them: always for top_k <= 64, and for top-p / min-p when their boundary falls inside.
//    The draw is the exponential race argmax(p_i / E_i) over the kept tokens, E_i ~ Exp(1) from Philox keyed by
//    (seed, step) and counted by token id, which samples the renormalized kept distribution exactly.
// 3. fallback: a block per row that finalize could not decide (large top_k with top_p, wide nuclei). Radix
//    selection over the row (8-bit digits of the 64-bit key, counts or fixed-point masses) finds the exact top-k
//    boundary, then the top-p boundary on the top-k-renormalized masses, the min-p boundary, then a race pass.
//
// Tokens are ranked by the penalized logit, ties by lower id (the reference ranks by probability; the two orders
// differ only where distinct logits round to the same probability).
#include <cuda_bf16.h>

#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "cuda_check.h"
#include "device_cache.h"
#include "dtype.h"
#include "sampling.h"

namespace fastqwen {
namespace {

constexpr unsigned kFull = 0xffffffffu;
constexpr int kTile = 1024;          // tokens per tile: 8 groups of 4 per lane
constexpr int kGroups = kTile / 128;  // groups of 4 consecutive tokens per lane per tile
constexpr int kWarps = 8;            // warps per scan block
constexpr int kList = 64;            // best tokens kept per filtered row
constexpr int kStage = 32 + 128;     // per-warp staging of candidates: a partial flush plus one group of the warp
constexpr int kMaxTop = kSamplerMaxTopN;
constexpr int kFinishThreads = 256;
constexpr float kMaxGumbel = 23.0f;  // -log(E) over every E the generator can produce is below 22.9

// ---- ordering keys: (logit desc, id asc) as one unsigned 64-bit compare; 0 = empty -------------------------------

__device__ __forceinline__ uint32_t ord_of(float x) {
  if (x == 0.0f) x = 0.0f;  // -0 ties with +0
  const uint32_t u = __float_as_uint(x);
  return u ^ ((u >> 31) ? 0xffffffffu : 0x80000000u);
}
__device__ __forceinline__ float float_of_ord(uint32_t o) {
  return __uint_as_float((o & 0x80000000u) ? (o ^ 0x80000000u) : ~o);
}
__device__ __forceinline__ uint64_t pack(float x, uint32_t id) {
  return (static_cast<uint64_t>(ord_of(x)) << 32) | (0xffffffffu - id);
}
__device__ __forceinline__ uint32_t id_of(uint64_t p) { return 0xffffffffu - static_cast<uint32_t>(p); }
__device__ __forceinline__ float x_of(uint64_t p) { return float_of_ord(static_cast<uint32_t>(p >> 32)); }
__device__ __forceinline__ uint64_t umax64(uint64_t a, uint64_t b) { return a > b ? a : b; }
__device__ __forceinline__ uint64_t umin64(uint64_t a, uint64_t b) { return a < b ? a : b; }

// ---- randomness -----------------------------------------------------------------------------------------------

// Philox4x32-10 (Salmon et al., SC'11).
__device__ __forceinline__ uint4 philox(uint32_t k0, uint32_t k1, uint4 c) {
#pragma unroll
  for (int r = 0; r < 10; ++r) {
    const uint32_t lo0 = 0xD2511F53u * c.x, hi0 = __umulhi(0xD2511F53u, c.x);
    const uint32_t lo1 = 0xCD9E8D57u * c.z, hi1 = __umulhi(0xCD9E8D57u, c.z);
    c = make_uint4(hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0);
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return c;
}

// Four random words for tokens 4q .. 4q+3 of draw `step` of a request: nothing else goes in, so a row's draws do not
// depend on the batch.
__device__ __forceinline__ uint4 words_of(uint32_t seed_lo, uint32_t seed_hi, uint32_t step_lo, uint32_t step_hi,
                                          uint32_t q) {
  return philox(seed_lo, seed_hi, make_uint4(q, step_lo, step_hi, 0x5A3D17C1u));
}
__device__ __forceinline__ uint32_t pick(uint4 w, uint32_t j) { return j == 0 ? w.x : j == 1 ? w.y : j == 2 ? w.z : w.w; }

// Exp(1) from 32 random bits with full relative precision at both ends: -log(u) for u < 1/2, -log1p(-(1 - u))
// above, so the small E that decide a race among many tokens are exact to float rounding.
__device__ __forceinline__ float exp1_of(uint32_t t) {
  constexpr float kScale = 2.3283064365386963e-10f;  // 2^-32
  if (t < 0x80000000u) return -logf((static_cast<float>(t) + 0.5f) * kScale);
  return -log1pf(-((static_cast<float>(0xffffffffu - t) + 0.5f) * kScale));
}

// ---- per-row view -----------------------------------------------------------------------------------------------

struct Row {
  SamplerRow p;
  int vocab;
  bool sampled, filtered, race, greedy, need_list, need_raw_list, need_z, need_lse, pen, blocking, masking;
  int k_eff;
  const int* counts;  // this row's counts, or null
  const int* blocked;
  const float* bias;      // this row's values for `blocked`, or null: bans
  const uint32_t* mask;   // this row's allowed-token bits, or null
  float inv_t;
};

// The per-row logit adjustments after the penalties: bans / biases (sparse ids) and grammar bitmasks.
struct Adjust {
  const int* blocked;
  const float* bias;
  int blocked_width;
  const uint32_t* mask;
  int mask_words;
};

__device__ __forceinline__ Row make_row(const SamplerRow* params, int row, int vocab, const int* counts,
                                        int64_t counts_rows, const Adjust& adj) {
  const int* blocked = adj.blocked;
  const int blocked_width = adj.blocked_width;
  Row r;
  r.p = params[row];
  r.vocab = vocab;
  const float t = r.p.temperature;
  r.sampled = t > 0.0f;  // NaN and <= 0: greedy
  r.k_eff = (r.p.top_k > 0 && r.p.top_k < vocab) ? r.p.top_k : vocab;
  r.filtered = r.sampled && (r.k_eff < vocab || r.p.top_p < 1.0f || r.p.min_p > 0.0f);
  r.race = r.sampled && !r.filtered;
  r.greedy = !r.sampled;
  r.pen = counts != nullptr && r.p.slot >= 0 && r.p.slot < counts_rows;
  r.counts = r.pen ? counts + static_cast<int64_t>(r.p.slot) * vocab : nullptr;
  const int nb = r.p.num_blocked < blocked_width ? r.p.num_blocked : blocked_width;
  r.blocking = blocked != nullptr && nb > 0;
  r.p.num_blocked = r.blocking ? nb : 0;
  r.blocked = r.blocking ? blocked + static_cast<int64_t>(row) * blocked_width : nullptr;
  r.bias = r.blocking && adj.bias != nullptr ? adj.bias + static_cast<int64_t>(row) * blocked_width : nullptr;
  r.masking = adj.mask != nullptr && r.p.masked != 0;
  r.mask = r.masking ? adj.mask + static_cast<int64_t>(row) * adj.mask_words : nullptr;
  if (r.p.top_n > kMaxTop) r.p.top_n = kMaxTop;
  const bool differs = r.pen || r.blocking || r.masking;
  r.need_lse = r.p.top_n >= 0;
  r.need_list = r.filtered || (r.p.top_n > 0 && !differs);
  r.need_raw_list = r.p.top_n > 0 && differs;
  r.need_z = r.filtered && r.k_eff == vocab && r.p.top_p < 1.0f;
  r.inv_t = r.sampled ? 1.0f / t : 1.0f;
  return r;
}

template <typename T>
__device__ __forceinline__ void load4(const T* row, int64_t id0, int vocab, bool vec_ok, float (&x)[4]);

template <>
__device__ __forceinline__ void load4<float>(const float* row, int64_t id0, int vocab, bool vec_ok, float (&x)[4]) {
  if (vec_ok && id0 + 3 < vocab) {
    const float4 v = __ldg(reinterpret_cast<const float4*>(row + id0));
    x[0] = v.x, x[1] = v.y, x[2] = v.z, x[3] = v.w;
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) x[j] = id0 + j < vocab ? __ldg(row + id0 + j) : -INFINITY;
  }
}

__device__ __forceinline__ float bf16_bits(uint32_t h) { return __uint_as_float(h << 16); }

template <>
__device__ __forceinline__ void load4<__nv_bfloat16>(const __nv_bfloat16* row, int64_t id0, int vocab, bool vec_ok,
                                                     float (&x)[4]) {
  if (vec_ok && id0 + 3 < vocab) {
    const uint2 v = __ldg(reinterpret_cast<const uint2*>(row + id0));
    x[0] = bf16_bits(v.x & 0xffffu), x[1] = bf16_bits(v.x >> 16), x[2] = bf16_bits(v.y & 0xffffu),
    x[3] = bf16_bits(v.y >> 16);
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) x[j] = id0 + j < vocab ? __bfloat162float(row[id0 + j]) : -INFINITY;
  }
}

template <typename T>
__device__ __forceinline__ float load1(const T* p) {
  if constexpr (sizeof(T) == 4) {
    return __ldg(reinterpret_cast<const float*>(p));
  } else {
    return __bfloat162float(*p);
  }
}

// The reference's penalties, rounding step by step as PyTorch does (no fused multiply-adds).
__device__ __forceinline__ float penalize(float x, int v, const SamplerRow& p) {
  const int c = v & kCountMask;
  if (p.repetition != 1.0f && v != 0) x = x > 0.0f ? __fdiv_rn(x, p.repetition) : __fmul_rn(x, p.repetition);
  if (p.presence != 0.0f || p.frequency != 0.0f) {
    const float sub = __fadd_rn(__fmul_rn(p.frequency, static_cast<float>(c)), c > 0 ? p.presence : 0.0f * p.presence);
    x = __fsub_rn(x, sub);
  }
  return x;
}

// Raw logits of 4 tokens -> the logits the row samples from (penalties, then blocked tokens).
__device__ __forceinline__ void process4(const Row& r, int64_t id0, bool counts_vec, float (&x)[4]) {
  if (r.pen) {
    int c[4];
    if (counts_vec && id0 + 3 < r.vocab) {
      const int4 v = __ldg(reinterpret_cast<const int4*>(r.counts + id0));
      c[0] = v.x, c[1] = v.y, c[2] = v.z, c[3] = v.w;
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) c[j] = id0 + j < r.vocab ? __ldg(r.counts + id0 + j) : 0;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) x[j] = penalize(x[j], c[j], r.p);
  }
  if (r.blocking) {
    for (int b = 0; b < r.p.num_blocked; ++b) {
      const int64_t off = static_cast<int64_t>(__ldg(r.blocked + b)) - id0;
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (off == j) x[j] = r.bias ? __fadd_rn(x[j], __ldg(r.bias + b)) : -INFINITY;
    }
  }
  if (r.masking && id0 < r.vocab) {
    // id0 is a multiple of 4: the 4 tokens' bits are in one word.
    const uint32_t bits = __ldg(r.mask + (id0 >> 5)) >> (id0 & 31);
#pragma unroll
    for (int j = 0; j < 4; ++j)
      if (!((bits >> j) & 1u)) x[j] = -INFINITY;
  }
}

// ---- warp-wide sorted list of the 64 best keys: entry i in lane i % 32, a = entries 0..31, b = 32..63 ----------------

__device__ __forceinline__ uint64_t bitonic_clean_desc(uint64_t v, int lane) {
#pragma unroll
  for (int j = 16; j > 0; j >>= 1) {
    const uint64_t o = __shfl_xor_sync(kFull, v, j);
    v = (lane & j) ? umin64(v, o) : umax64(v, o);
  }
  return v;
}

__device__ __forceinline__ uint64_t warp_sort_desc(uint64_t v, int lane) {
#pragma unroll
  for (int k = 2; k <= 32; k <<= 1) {
#pragma unroll
    for (int j = k >> 1; j > 0; j >>= 1) {
      const uint64_t o = __shfl_xor_sync(kFull, v, j);
      const bool keep_max = ((lane & j) == 0) == ((lane & k) == 0);
      v = keep_max ? umax64(v, o) : umin64(v, o);
    }
  }
  return v;
}

struct WarpList {
  uint64_t a = 0, b = 0;
  uint64_t thr = 0;  // the 64th entry: what a new key must beat
  float thr_x = -INFINITY;
  int cnt = 0;  // staged keys

  // thr never falls: it is the larger of the list's 64th entry and the floor set by seed() (the 64th entry only
  // rises, so the running maximum is exactly that).
  __device__ __forceinline__ void refresh() {
    thr = umax64(thr, __shfl_sync(kFull, b, 31));
    thr_x = (thr >> 32) == 0 ? -INFINITY : x_of(thr);
  }
  // Top 64 of this list and another sorted one (na, nb): max(L[i], N[63 - i]) is bitonic and holds them.
  __device__ __forceinline__ void merge(uint64_t na, uint64_t nb, int lane) {
    const uint64_t lo = umax64(a, __shfl_sync(kFull, nb, 31 - lane));
    const uint64_t hi = umax64(b, __shfl_sync(kFull, na, 31 - lane));
    a = bitonic_clean_desc(umax64(lo, hi), lane);
    b = bitonic_clean_desc(umin64(lo, hi), lane);
    refresh();
  }
  // Merge up to 32 staged keys (the last ones) into the list.
  __device__ __forceinline__ void flush(uint64_t* stage, int lane) {
    const int take = cnt < 32 ? cnt : 32;
    const int start = cnt - take;
    uint64_t v = lane < take ? stage[start + lane] : 0;
    __syncwarp();
    cnt = start;
    v = warp_sort_desc(v, lane);
    merge(v, 0, lane);  // a sorted 32 is a sorted 64 padded with empties
  }
  __device__ __forceinline__ bool admits(float x, uint32_t id) const {
    return x > thr_x || (x == thr_x && pack(x, id) > thr);
  }
  // A first threshold from the warp's first tile, before any of it is offered: with m the 128 maxima of 8 tokens
  // (two groups of 4 per lane), a value t that at least 64 of them reach is reached by at least 64 distinct tokens
  // of the tile, so no token below t can be among the 64 best and the list starts by admitting only x >= t (about
  // 8% of random logits instead of the whole tile). t is found by bisection with exact counts, so it is always
  // valid; out-of-vocabulary and NaN tokens only ever count as -inf, which can only lower t to -inf (no filter).
  __device__ __forceinline__ void seed(const float (&x)[kGroups][4]) {
    uint32_t m[kGroups / 2];
#pragma unroll
    for (int h = 0; h < kGroups / 2; ++h) {
      float v = -INFINITY;
#pragma unroll
      for (int g = 2 * h; g < 2 * h + 2; ++g)
#pragma unroll
        for (int j = 0; j < 4; ++j) v = fmaxf(v, x[g][j]);
      m[h] = ord_of(v);
    }
    uint32_t mn = m[0], mx = m[0];
#pragma unroll
    for (int h = 1; h < kGroups / 2; ++h) mn = min(mn, m[h]), mx = max(mx, m[h]);
    float lo = float_of_ord(__reduce_min_sync(kFull, mn));
    float hi = float_of_ord(__reduce_max_sync(kFull, mx));
    if (isfinite(lo) && isfinite(hi)) {
#pragma unroll 1
      for (int it = 0; it < 8 && lo < hi; ++it) {
        const float mid = 0.5f * lo + 0.5f * hi;
        const uint32_t om = ord_of(mid);
        unsigned c = 0;
#pragma unroll
        for (int h = 0; h < kGroups / 2; ++h) c += m[h] >= om ? 1u : 0u;
        if (__reduce_add_sync(kFull, c) >= kList) lo = mid;
        else hi = mid;
      }
    }
    // The lowest-ranked key of value lo: every token with x >= lo beats it.
    thr = umax64(thr, pack(lo, 0xffffffffu));
    thr_x = x_of(thr);
  }
  // Offer a whole tile (lane values x[g][j] = token base + (g * 32 + lane) * 4 + j). Most tiles are rejected by the
  // lane maximum against the running threshold and one vote. The rest stage every in-vocabulary token with
  // x >= thr_x at ballot offsets, one compare per token: a superset of what admits() takes (the extra keys tie with
  // the threshold's value, rank below it and fall out at the merge), or, when they are too many for the stage (ties,
  // adversarial rows), offer group by group with the exact test.
  //
  // `shared` is the block's threshold for this list, the largest any of its warps has reached: each is reached by
  // 64 distinct tokens of the block, so a token below it cannot be among the block's 64 best, and the block's
  // merged list (what is written out) is the same whatever the warps' timing.
  __device__ __forceinline__ void offer_tile(const float (&x)[kGroups][4], int64_t base, int vocab, uint64_t* stage,
                                             unsigned long long* shared, int lane) {
    const uint64_t s = *reinterpret_cast<volatile unsigned long long*>(shared);
    if (s > thr) thr = s, thr_x = x_of(s);
    float gm[kGroups];
#pragma unroll
    for (int g = 0; g < kGroups; ++g) gm[g] = fmaxf(fmaxf(x[g][0], x[g][1]), fmaxf(x[g][2], x[g][3]));
    const float mx = fmaxf(fmaxf(fmaxf(gm[0], gm[1]), fmaxf(gm[2], gm[3])), fmaxf(fmaxf(gm[4], gm[5]), fmaxf(gm[6], gm[7])));
    if (!__any_sync(kFull, mx >= thr_x)) return;  // NaN never passes, as in admits()
    uint32_t mask = 0;  // bit 4g + j: token (g, j) is staged
#pragma unroll
    for (int g = 0; g < kGroups; ++g)
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (x[g][j] >= thr_x) mask |= 1u << (4 * g + j);
    if (base + kTile > vocab) {
#pragma unroll
      for (int g = 0; g < kGroups; ++g)
#pragma unroll
        for (int j = 0; j < 4; ++j)
          if (base + (g * 32 + lane) * 4 + j >= vocab) mask &= ~(1u << (4 * g + j));
    }
    // Offsets: the exclusive prefix sum of the lanes' counts, bit by bit with ballots.
    const int n = __popc(mask);
    const unsigned below = (1u << lane) - 1u;
    int before = 0, total = 0;
#pragma unroll
    for (int k = 0; k < 6; ++k) {
      const unsigned v = __ballot_sync(kFull, (n >> k) & 1);
      before += __popc(v & below) << k;
      total += __popc(v) << k;
    }
    if (cnt + total > kStage) {
#pragma unroll
      for (int g = 0; g < kGroups; ++g)
        offer(x[g], static_cast<uint32_t>(base + (g * 32 + lane) * 4), vocab, stage, lane);
    } else {
      int pos = cnt + before;
#pragma unroll
      for (int g = 0; g < kGroups; ++g) {
        if (!__any_sync(kFull, (mask >> (4 * g)) & 15u)) continue;
        const uint32_t id0 = static_cast<uint32_t>(base + (g * 32 + lane) * 4);
#pragma unroll
        for (int j = 0; j < 4; ++j)
          if ((mask >> (4 * g + j)) & 1u) stage[pos++] = pack(x[g][j], id0 + j);
      }
      cnt += total;
      __syncwarp();
      while (cnt >= 32) flush(stage, lane);
    }
    if (lane == 0 && thr > s) atomicMax(shared, static_cast<unsigned long long>(thr));
  }
  // Offer 4 consecutive tokens of each lane (id0 .. id0+3); ids >= vocab are not offered.
  __device__ __forceinline__ void offer(const float (&x)[4], uint32_t id0, int vocab, uint64_t* stage, int lane) {
    int n = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) n += (static_cast<int>(id0) + j < vocab && admits(x[j], id0 + j)) ? 1 : 0;
    if (!__any_sync(kFull, n > 0)) return;
    int incl = n;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int o = __shfl_up_sync(kFull, incl, d);
      if (lane >= d) incl += o;
    }
    const int total = __shfl_sync(kFull, incl, 31);
    int pos = cnt + incl - n;
#pragma unroll
    for (int j = 0; j < 4; ++j)
      if (static_cast<int>(id0) + j < vocab && admits(x[j], id0 + j)) stage[pos++] = pack(x[j], id0 + j);
    cnt += total;
    __syncwarp();
    while (cnt >= 32) flush(stage, lane);
  }
};

// (max, sum of exp((x - max) * scale)) pairs; an empty part is (-inf, 0).
__device__ __forceinline__ void lse_combine(float& m, float& s, float m2, float s2, float scale) {
  const float mn = fmaxf(m, m2);
  if (mn == -INFINITY) return;
  s = (m == -INFINITY ? 0.0f : s * expf((m - mn) * scale)) + (m2 == -INFINITY ? 0.0f : s2 * expf((m2 - mn) * scale));
  m = mn;
}

// Sum-exp partial of one tile (lane values x[kGroups][4]) reduced over the warp; lane 0's result is written.
__device__ __forceinline__ void tile_lse(const float (&x)[kGroups][4], float scale, float2* out, int lane) {
  float m = -INFINITY;
#pragma unroll
  for (int g = 0; g < kGroups; ++g)
#pragma unroll
    for (int j = 0; j < 4; ++j) m = fmaxf(m, x[g][j]);
  float s = 0.0f;
  if (m != -INFINITY) {
#pragma unroll
    for (int g = 0; g < kGroups; ++g)
#pragma unroll
      for (int j = 0; j < 4; ++j) s += expf((x[g][j] - m) * scale);
  }
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) {
    const float m2 = __shfl_xor_sync(kFull, m, d), s2 = __shfl_xor_sync(kFull, s, d);
    lse_combine(m, s, m2, s2, scale);
  }
  if (lane == 0) *out = make_float2(m, s);
}

// ---- workspace ----------------------------------------------------------------------------------------------------

struct RowState {
  int fallback;
  float x_max;  // the largest penalized logit
  float lse;    // log-sum-exp of the raw logits
  int pad;
};

struct Workspace {
  uint64_t* cand;      // [rows, max_ctas, 64]
  uint64_t* raw_cand;  // [rows, max_ctas, 64]
  uint64_t* best;      // [rows, max_ctas]: greedy argmax or race winner
  float2* z_stats;     // [rows, tiles]
  float2* raw_stats;   // [rows, tiles]
  RowState* state;     // [rows]
  int tiles, max_ctas;
};

inline int64_t align16(int64_t v) { return (v + 15) / 16 * 16; }

Workspace layout(uintptr_t base, int64_t rows, int64_t vocab, int64_t* total) {
  Workspace w;
  w.tiles = static_cast<int>((vocab + kTile - 1) / kTile);
  w.max_ctas = (w.tiles + kWarps - 1) / kWarps;
  int64_t off = 0;
  auto take = [&](int64_t bytes) {
    const int64_t at = off;
    off += align16(bytes);
    return base + at;
  };
  w.cand = reinterpret_cast<uint64_t*>(take(rows * w.max_ctas * kList * 8));
  w.raw_cand = reinterpret_cast<uint64_t*>(take(rows * w.max_ctas * kList * 8));
  w.best = reinterpret_cast<uint64_t*>(take(rows * w.max_ctas * 8));
  w.z_stats = reinterpret_cast<float2*>(take(rows * w.tiles * 8));
  w.raw_stats = reinterpret_cast<float2*>(take(rows * w.tiles * 8));
  w.state = reinterpret_cast<RowState*>(take(rows * sizeof(RowState)));
  if (total) *total = off;
  return w;
}

// Flush a warp's staged keys, merge the block's warp lists (tree over shared memory), write the block's 64.
__device__ __forceinline__ void block_merge_out(WarpList& l, uint64_t* stage, uint64_t (*lists)[kList], uint64_t* out,
                                                int row, int cta, int max_ctas, int warp, int lane) {
  while (l.cnt > 0) l.flush(stage, lane);
  const int warps = blockDim.x >> 5;
  for (int half = warps >> 1; half > 0; half >>= 1) {
    if (warp >= half && warp < 2 * half) lists[warp][lane] = l.a, lists[warp][32 + lane] = l.b;
    __syncthreads();
    if (warp < half) l.merge(lists[warp + half][lane], lists[warp + half][32 + lane], lane);
    __syncthreads();
  }
  if (warp == 0) {
    uint64_t* o = out + (static_cast<int64_t>(row) * max_ctas + cta) * kList;
    o[lane] = l.a;
    o[32 + lane] = l.b;
  }
}

// Asynchronous 16-byte global -> shared copies (cp.async): the next tile streams in while this one is processed, and
// the compiler cannot sink the loads to their uses as it may do with register loads under register pressure.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_one() { asm volatile("cp.async.wait_group 1;\n" ::: "memory"); }

template <typename T>
__device__ __forceinline__ void lds4(const T* p, float (&x)[4]) {
  if constexpr (sizeof(T) == 4) {
    const float4 v = *reinterpret_cast<const float4*>(p);
    x[0] = v.x, x[1] = v.y, x[2] = v.z, x[3] = v.w;
  } else {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    x[0] = bf16_bits(v.x & 0xffffu), x[1] = bf16_bits(v.x >> 16), x[2] = bf16_bits(v.y & 0xffffu),
    x[3] = bf16_bits(v.y >> 16);
  }
}

template <typename T>
constexpr int scan_smem_bytes() {
  return kWarps * 2 * kTile * static_cast<int>(sizeof(T));
}

// ---- kernel 1: one pass over the logits ----------------------------------------------------------------------------

template <typename T, bool ASYNC>
__global__ void __launch_bounds__(kWarps * 32) scan_kernel(const T* __restrict__ logits, const SamplerRow* params,
                                                          int vocab, bool vec_ok, const int* counts,
                                                          int64_t counts_rows, bool counts_vec, Adjust adj,
                                                          Workspace ws) {
  __shared__ uint64_t stage[2][kWarps][kStage];
  __shared__ uint64_t lists[kWarps][kList];
  __shared__ uint64_t best_smem;
  __shared__ unsigned long long block_thr[2];  // the block's thresholds of list and raw_list (see offer_tile)
  const int row = blockIdx.y, cta = blockIdx.x;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const Row r = make_row(params, row, vocab, counts, counts_rows, adj);
  const T* x_row = logits + static_cast<int64_t>(row) * vocab;
  if (threadIdx.x == 0) best_smem = 0, block_thr[0] = 0, block_thr[1] = 0;
  __syncthreads();

  WarpList list, raw_list;
  float best_x = -INFINITY, best_s = -INFINITY;
  uint32_t best_id = 0xffffffffu;
  const int stride = gridDim.x * kWarps;
  // Per warp, two tile buffers: tile i is read from one while tile i + stride lands in the other.
  extern __shared__ __align__(16) unsigned char tile_smem[];
  unsigned char* my_tiles = tile_smem + warp * 2 * kTile * sizeof(T);
  const bool async_ok = ASYNC && vec_ok && (reinterpret_cast<uintptr_t>(x_row) & 15) == 0;
  auto full = [&](int t) { return static_cast<int64_t>(t + 1) * kTile <= vocab; };
  auto issue = [&](int t, int slot) {
    if (async_ok && t < ws.tiles && full(t)) {
      const unsigned char* src = reinterpret_cast<const unsigned char*>(x_row + static_cast<int64_t>(t) * kTile);
      unsigned char* dst = my_tiles + slot * kTile * sizeof(T);
#pragma unroll
      for (int c = 0; c < static_cast<int>(kTile * sizeof(T) / 512); ++c)
        cp_async16(dst + (c * 32 + lane) * 16, src + (c * 32 + lane) * 16);
    }
    cp_async_commit();
  };
  int slot = 0;
  if (ASYNC) issue(cta * kWarps + warp, 0);
  for (int tile = cta * kWarps + warp; tile < ws.tiles; tile += stride, slot ^= 1) {
    const int64_t base = static_cast<int64_t>(tile) * kTile;
    float x[kGroups][4];
    if (ASYNC) {
      issue(tile + stride, slot ^ 1);
      cp_async_wait_one();
      __syncwarp();
    }
    if (async_ok && full(tile)) {
      const T* b = reinterpret_cast<const T*>(my_tiles + slot * kTile * sizeof(T));
#pragma unroll
      for (int g = 0; g < kGroups; ++g) lds4<T>(b + (g * 32 + lane) * 4, x[g]);
    } else if (vec_ok && base + kTile <= vocab) {  // a full tile: every load issued before any is used
#pragma unroll
      for (int g = 0; g < kGroups; ++g) load4<T>(x_row, base + (g * 32 + lane) * 4, vocab, true, x[g]);
    } else {
#pragma unroll
      for (int g = 0; g < kGroups; ++g) load4<T>(x_row, base + (g * 32 + lane) * 4, vocab, vec_ok, x[g]);
    }
    if (r.need_lse) tile_lse(x, 1.0f, ws.raw_stats + static_cast<int64_t>(row) * ws.tiles + tile, lane);
    const bool first = tile == cta * kWarps + warp;
    if (r.need_raw_list) {
      if (first) raw_list.seed(x);
      raw_list.offer_tile(x, base, vocab, stage[1][warp], &block_thr[1], lane);
    }
    if (r.pen || r.blocking || r.masking) {
#pragma unroll
      for (int g = 0; g < kGroups; ++g) process4(r, base + (g * 32 + lane) * 4, counts_vec, x[g]);
    }
    if (r.need_z) tile_lse(x, r.inv_t, ws.z_stats + static_cast<int64_t>(row) * ws.tiles + tile, lane);
    if (r.need_list) {
      if (first) list.seed(x);
      list.offer_tile(x, base, vocab, stage[0][warp], &block_thr[0], lane);
    }
    if (r.greedy) {
      // Per lane, ids rise with g and j: a strict > keeps the lowest id of equal maxima.
#pragma unroll
      for (int g = 0; g < kGroups; ++g)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int64_t id = base + (g * 32 + lane) * 4 + j;
          if (id < vocab && (x[g][j] > best_x || best_id == 0xffffffffu)) best_x = x[g][j], best_id = id;
        }
    }
    if (r.race) {
      // argmax over every token of x / T - log(E); tokens that cannot beat this lane's best skip the generator.
#pragma unroll
      for (int g = 0; g < kGroups; ++g) {
        const int64_t id0 = base + (g * 32 + lane) * 4;
        float key[4];
        bool any = false;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          key[j] = __fdiv_rn(x[g][j], r.p.temperature);
          any |= id0 + j < vocab && key[j] + kMaxGumbel >= best_s && key[j] != -INFINITY;
        }
        if (any) {
          const uint4 w = words_of(r.p.seed_lo, r.p.seed_hi, r.p.step_lo, r.p.step_hi, static_cast<uint32_t>(id0 >> 2));
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            if (id0 + j >= vocab || key[j] == -INFINITY) continue;
            const float s = key[j] - logf(exp1_of(pick(w, j)));
            if (s > best_s) best_s = s, best_id = static_cast<uint32_t>(id0 + j);
          }
        }
      }
    }
    if (ASYNC) __syncwarp();  // every lane is done with this buffer before it is refilled
  }

  // Block results: merged 64-lists, and the best greedy / race key.
  if (r.greedy || r.race) {
    uint64_t mine = best_id == 0xffffffffu ? 0 : pack(r.greedy ? best_x : best_s, best_id);
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) mine = umax64(mine, __shfl_xor_sync(kFull, mine, d));
    __syncthreads();
    if (lane == 0) atomicMax(reinterpret_cast<unsigned long long*>(&best_smem), mine);
    __syncthreads();
    if (threadIdx.x == 0) ws.best[static_cast<int64_t>(row) * ws.max_ctas + cta] = best_smem;
  }
  if (r.need_list) block_merge_out(list, stage[0][warp], lists, ws.cand, row, cta, ws.max_ctas, warp, lane);
  if (r.need_raw_list) block_merge_out(raw_list, stage[1][warp], lists, ws.raw_cand, row, cta, ws.max_ctas, warp, lane);
}

// ---- shared tail: write the token, its logprob, count it ------------------------------------------------------

template <typename T>
__device__ __forceinline__ void emit(const Row& r, int row, uint32_t token, float lse, const T* logits,
                                     int64_t* tokens, float* logprobs) {
  tokens[row] = token;
  if (r.need_lse && logprobs != nullptr)
    logprobs[row] = load1(logits + static_cast<int64_t>(row) * r.vocab + token) - lse;
  if (r.pen) const_cast<int*>(r.counts)[token] += 1;  // one row per slot: no other writer
}

__device__ __forceinline__ float warp_incl_scan(float v, int lane) {
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const float o = __shfl_up_sync(kFull, v, d);
    if (lane >= d) v += o;
  }
  return v;
}

// Reduce a row's tile partials in a fixed order (independent of the scan's grid).
__device__ __forceinline__ void reduce_tiles(const float2* stats, int tiles, float scale, int lane, float& m,
                                             float& s) {
  m = -INFINITY, s = 0.0f;
  for (int t = lane; t < tiles; t += 32) lse_combine(m, s, stats[t].x, stats[t].y, scale);
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) {
    const float m2 = __shfl_xor_sync(kFull, m, d), s2 = __shfl_xor_sync(kFull, s, d);
    lse_combine(m, s, m2, s2, scale);
  }
  m = __shfl_sync(kFull, m, 0);
  s = __shfl_sync(kFull, s, 0);
}

__device__ __forceinline__ float race_score(const Row& r, float key, uint32_t id) {
  const uint4 w = words_of(r.p.seed_lo, r.p.seed_hi, r.p.step_lo, r.p.step_hi, id >> 2);
  return key - logf(exp1_of(pick(w, id & 3)));
}

// ---- kernel 2, part 1: a row's decision by its first warp, from the merged lists --------------------------------

template <typename T>
__device__ void decide_row(const Row& r, int row, int vocab, int ctas, const T* logits, const Workspace& ws,
                           int64_t* tokens, float* logprobs, int64_t* top_ids, float* top_logprobs, int top_width,
                           const WarpList& list, const WarpList& raw_list) {
  const int lane = threadIdx.x & 31;
  RowState* st = ws.state + row;
  float lse = 0.0f;
  if (r.need_lse) {
    float m, s;
    reduce_tiles(ws.raw_stats + static_cast<int64_t>(row) * ws.tiles, ws.tiles, 1.0f, lane, m, s);
    lse = m + logf(s);
  }
  // Top-N alternatives come from the raw list when penalties or blocking changed the logits, else the other.
  if (r.p.top_n > 0 && top_ids != nullptr && top_logprobs != nullptr) {
    const WarpList& l = r.need_raw_list ? raw_list : list;
    const int n = r.p.top_n < top_width ? r.p.top_n : top_width;
    for (int half = 0; half < 2; ++half) {
      const int i = half * 32 + lane;
      const uint64_t v = half ? l.b : l.a;
      if (i < n) {
        top_ids[static_cast<int64_t>(row) * top_width + i] = v ? static_cast<int64_t>(id_of(v)) : int64_t{-1};
        top_logprobs[static_cast<int64_t>(row) * top_width + i] = v ? x_of(v) - lse : -INFINITY;
      }
    }
  }

  if (!r.filtered) {
    uint64_t best = 0;
    for (int c = lane; c < ctas; c += 32) best = umax64(best, ws.best[static_cast<int64_t>(row) * ws.max_ctas + c]);
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) best = umax64(best, __shfl_xor_sync(kFull, best, d));
    if (lane == 0) {
      st->fallback = 0;
      emit<T>(r, row, best ? id_of(best) : 0u, lse, logits, tokens, logprobs);
    }
    return;
  }

  // Filtered: the kept set is a prefix of the sorted row; decide it from the 64 best when it ends inside them.
  const float t = r.p.temperature;
  const bool va = list.a != 0, vb = list.b != 0;
  const float xa = x_of(list.a), xb = x_of(list.b);
  const float ka = va ? __fdiv_rn(xa, t) : -INFINITY, kb = vb ? __fdiv_rn(xb, t) : -INFINITY;
  const float k0 = __shfl_sync(kFull, ka, 0);
  const float x0 = __shfl_sync(kFull, xa, 0);
  float ea, eb;
  if (k0 == -INFINITY) {  // every logit -inf: only the first token carries weight
    ea = lane == 0 ? 1.0f : 0.0f, eb = 0.0f;
  } else {
    ea = va ? expf(ka - k0) : 0.0f, eb = vb ? expf(kb - k0) : 0.0f;
  }
  const int i_a = lane, i_b = 32 + lane;
  const bool in_a = i_a < r.k_eff, in_b = i_b < r.k_eff;
  const float wa = in_a ? ea : 0.0f, wb = in_b ? eb : 0.0f;
  const float ca = warp_incl_scan(wa, lane);
  const float cb = __shfl_sync(kFull, ca, 31) + warp_incl_scan(wb, lane);
  const float sum64 = __shfl_sync(kFull, cb, 31);
  bool z_known = true;
  float zk = sum64;
  if (r.k_eff > kList) {
    if (r.need_z) {
      float m, s;
      reduce_tiles(ws.z_stats + static_cast<int64_t>(row) * ws.tiles, ws.tiles, r.inv_t, lane, m, s);
      zk = s * expf((m - x0) * r.inv_t);  // relative to the largest probability
    } else {
      z_known = false;
    }
  }
  const bool p_off = r.p.top_p >= 1.0f;
  const bool pa = p_off || (z_known && __fdiv_rn(ca - wa, zk) < r.p.top_p);
  const bool pb = p_off || (z_known && __fdiv_rn(cb - wb, zk) < r.p.top_p);
  const bool keep_a = va && in_a && pa && ea >= r.p.min_p;
  const bool keep_b = vb && in_b && pb && eb >= r.p.min_p;
  const int kept = __popc(__ballot_sync(kFull, keep_a)) + __popc(__ballot_sync(kFull, keep_b));
  bool resolved;
  if (r.k_eff <= kList) {
    resolved = true;
  } else if (r.k_eff == vocab) {
    resolved = kept < kList;  // top-p (on the full row) or min-p ended inside the 64
  } else {
    resolved = p_off && kept < kList;  // min-p ended inside; top-p would need the top-k mass
  }
  if (!resolved) {
    if (lane == 0) *st = RowState{1, x0, lse, 0};
    return;
  }
  uint64_t best = 0;
  if (keep_a) best = umax64(best, pack(race_score(r, ka, id_of(list.a)), id_of(list.a)));
  if (keep_b) best = umax64(best, pack(race_score(r, kb, id_of(list.b)), id_of(list.b)));
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) best = umax64(best, __shfl_xor_sync(kFull, best, d));
  if (lane == 0) {
    st->fallback = 0;
    emit<T>(r, row, best ? id_of(best) : id_of(list.a), lse, logits, tokens, logprobs);
  }
}

// ---- exact selection over the whole row, for rows the 64 best cannot decide --------------------------------------

struct SelectSmem {
  unsigned long long cnt[256];
  unsigned long long mass[256];
  unsigned long long elem[256];
  unsigned long long scalar;
  unsigned long long found, prefix, remaining;
  int done;
};

template <typename T>
struct RowReader {
  const Row& r;
  const T* x_row;
  bool vec_ok, counts_vec;
  float k0;  // x_max / T

  // Calls f(packed key, penalized logit) for every token of the row, threads strided over groups of 4.
  template <typename F>
  __device__ __forceinline__ void for_each(F f) const {
    const int groups = (r.vocab + 3) / 4;
    for (int g = threadIdx.x; g < groups; g += blockDim.x) {
      float x[4];
      const int64_t id0 = static_cast<int64_t>(g) * 4;
      load4<T>(x_row, id0, r.vocab, vec_ok, x);
      process4(r, id0, counts_vec, x);
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (id0 + j < r.vocab) f(pack(x[j], static_cast<uint32_t>(id0 + j)), x[j]);
    }
  }
  // exp(x / T - x_max / T) in units of 2^-40: exact integer sums, the same in any order.
  __device__ __forceinline__ unsigned long long fixed_mass(float x) const {
    const float e = k0 == -INFINITY ? 0.0f : expf(__fdiv_rn(x, r.p.temperature) - k0);
    return __float2ull_rn(e * 1099511627776.0f);
  }
};

// The key t with W(keys > t) < target <= W(keys >= t) over keys >= lower, W = count (MASS false) or fixed mass.
template <typename T, bool MASS>
__device__ uint64_t radix_select(const RowReader<T>& rd, SelectSmem& sm, uint64_t lower, unsigned long long target) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (threadIdx.x == 0) sm.prefix = 0, sm.remaining = target, sm.done = 0, sm.found = lower;
  __syncthreads();
  for (int shift = 56; shift >= 0; shift -= 8) {
    for (int i = threadIdx.x; i < 256; i += blockDim.x) sm.cnt[i] = 0, sm.mass[i] = 0;
    __syncthreads();
    const uint64_t prefix = sm.prefix;
    const uint64_t hi_mask = shift == 56 ? 0 : ~0ull << (shift + 8);
    rd.for_each([&](uint64_t p, float x) {
      if (p < lower || ((p ^ prefix) & hi_mask) != 0) return;
      const int d = static_cast<int>((p >> shift) & 255);
      atomicAdd(&sm.cnt[d], 1ull);
      if (MASS) atomicAdd(&sm.mass[d], rd.fixed_mass(x));
      sm.elem[d] = p;  // read only where the digit holds one key
    });
    __syncthreads();
    if (warp == 0) {
      // Lane l holds digits 255 - 8l .. 248 - 8l, highest first.
      unsigned long long w[8], local = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int d = 255 - 8 * lane - j;
        w[j] = MASS ? sm.mass[d] : sm.cnt[d];
        local += w[j];
      }
      unsigned long long incl = local;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const unsigned long long v = __shfl_up_sync(kFull, incl, o);
        if (lane >= o) incl += v;
      }
      const unsigned long long rem = sm.remaining;
      unsigned long long acc = incl - local;
      const bool mine = acc < rem && rem <= incl;
      const unsigned who = __ballot_sync(kFull, mine);
      if (who == 0) {
        if (lane == 0) sm.done = 1;  // fewer than target (rounding): keep everything from `lower` on
      } else if (mine) {
        int j = 0;
        while (j < 7 && acc + w[j] < rem) acc += w[j++];
        const int d = 255 - 8 * lane - j;
        sm.prefix = prefix | (static_cast<uint64_t>(d) << shift);
        sm.remaining = rem - acc;
        if (sm.cnt[d] == 1) sm.found = sm.elem[d], sm.done = 1;
        else if (shift == 0) sm.found = sm.prefix, sm.done = 1;
      }
    }
    __syncthreads();
    if (sm.done) break;
  }
  const uint64_t result = sm.found;
  __syncthreads();
  return result;
}

// The 64 best of a row over its scan blocks' lists: each warp merges a strided subset, then a tree over warps.
__device__ __forceinline__ WarpList merge_row_lists(const uint64_t* src, int ctas, uint64_t (*lists)[kList], int warp,
                                                    int lane) {
  WarpList l;
  const int warps = blockDim.x >> 5;
  for (int c = warp; c < ctas; c += warps) l.merge(src[c * kList + lane], src[c * kList + 32 + lane], lane);
  for (int half = warps >> 1; half > 0; half >>= 1) {
    if (warp >= half && warp < 2 * half) lists[warp][lane] = l.a, lists[warp][32 + lane] = l.b;
    __syncthreads();
    if (warp < half) l.merge(lists[warp + half][lane], lists[warp + half][32 + lane], lane);
    __syncthreads();
  }
  return l;  // valid in warp 0
}

// ---- kernel 2: a block per row: merge, decide, and for rows the 64 best cannot decide, select over the row ------

template <typename T>
__global__ void __launch_bounds__(kFinishThreads) finish_kernel(
    const T* __restrict__ logits, const SamplerRow* params, int vocab, int ctas, bool vec_ok, const int* counts,
    int64_t counts_rows, bool counts_vec, Adjust adj, Workspace ws, int64_t* tokens,
    float* logprobs, int64_t* top_ids, float* top_logprobs, int top_width) {
  __shared__ SelectSmem sm;
  __shared__ uint64_t lists[kFinishThreads / 32][kList];
  const int row = blockIdx.x;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const Row r = make_row(params, row, vocab, counts, counts_rows, adj);
  WarpList list, raw_list;
  const int64_t at = static_cast<int64_t>(row) * ws.max_ctas * kList;
  if (r.need_list) list = merge_row_lists(ws.cand + at, ctas, lists, warp, lane);
  if (r.need_raw_list) raw_list = merge_row_lists(ws.raw_cand + at, ctas, lists, warp, lane);
  if (warp == 0)
    decide_row<T>(r, row, vocab, ctas, logits, ws, tokens, logprobs, top_ids, top_logprobs, top_width, list,
                  raw_list);
  __syncthreads();
  const RowState st = ws.state[row];
  if (!st.fallback) return;
  const float t = r.p.temperature;
  const RowReader<T> rd{r, logits + static_cast<int64_t>(row) * vocab, vec_ok, counts_vec,
                        st.x_max == -INFINITY ? -INFINITY : __fdiv_rn(st.x_max, t)};

  uint64_t tau = 0;
  uint64_t tau_k = 0;
  if (r.k_eff < vocab) tau_k = radix_select<T, false>(rd, sm, 0, static_cast<unsigned long long>(r.k_eff));
  tau = tau_k;
  if (r.p.min_p > 0.0f) {
    if (threadIdx.x == 0) sm.scalar = ~0ull;
    __syncthreads();
    unsigned long long mine = ~0ull;
    rd.for_each([&](uint64_t p, float x) {
      const float e = rd.k0 == -INFINITY ? 0.0f : expf(__fdiv_rn(x, t) - rd.k0);
      if (e >= r.p.min_p && p < mine) mine = p;
    });
    atomicMin(&sm.scalar, mine);
    __syncthreads();
    tau = umax64(tau, sm.scalar == ~0ull ? 0 : sm.scalar);
    __syncthreads();
  }
  if (r.p.top_p < 1.0f) {
    if (threadIdx.x == 0) sm.scalar = 0;
    __syncthreads();
    unsigned long long mine = 0;
    rd.for_each([&](uint64_t p, float x) {
      if (p >= tau_k) mine += rd.fixed_mass(x);
    });
    atomicAdd(&sm.scalar, mine);
    __syncthreads();
    const unsigned long long zk = sm.scalar;
    __syncthreads();
    // Kept: tokens whose mass above them is below top_p * Zk, i.e. up to the one where the running sum reaches it.
    unsigned long long target = static_cast<unsigned long long>(ceil(static_cast<double>(r.p.top_p) * zk));
    if (target == 0) target = 1;
    tau = umax64(tau, radix_select<T, true>(rd, sm, tau_k, target));
  }
  // The race over the kept tokens.
  if (threadIdx.x == 0) sm.scalar = 0;
  __syncthreads();
  float best_s = -INFINITY;
  uint32_t best_id = 0xffffffffu;
  rd.for_each([&](uint64_t p, float x) {
    if (p < tau) return;
    const float key = __fdiv_rn(x, t);
    if (key == -INFINITY || key + kMaxGumbel < best_s) return;
    const float s = race_score(r, key, id_of(p));
    if (s > best_s || (s == best_s && id_of(p) < best_id)) best_s = s, best_id = id_of(p);
  });
  if (best_id != 0xffffffffu) atomicMax(&sm.scalar, static_cast<unsigned long long>(pack(best_s, best_id)));
  __syncthreads();
  if (threadIdx.x == 0) {
    const uint64_t b = sm.scalar;
    emit<T>(r, row, b ? id_of(b) : (tau ? id_of(tau) : 0u), st.lse, logits, tokens, logprobs);
  }
}

struct DeviceInfo {
  int sms = 0;
  int occupancy[3] = {0, 0, 0};
};

// The cp.async scan (default) or plain register loads (FASTQWEN_SAMPLER_ASYNC=0), for comparison.
inline bool use_async() {
  static const bool on = [] {
    const char* v = std::getenv("FASTQWEN_SAMPLER_ASYNC");
    return v == nullptr || std::string(v) != "0";
  }();
  return on;
}

template <typename T>
void setup_scan(int dtype, DeviceInfo& d) {
  if (use_async()) {
    FASTQWEN_CUDA_CHECK(cudaFuncSetAttribute(scan_kernel<T, true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             scan_smem_bytes<T>()));
    FASTQWEN_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&d.occupancy[dtype], scan_kernel<T, true>,
                                                                      kWarps * 32, scan_smem_bytes<T>()));
  } else {
    FASTQWEN_CUDA_CHECK(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&d.occupancy[dtype], scan_kernel<T, false>, kWarps * 32, 0));
  }
}

const DeviceInfo& device_info() {
  static PerDevice<DeviceInfo> info;
  return info.get([](int device) {
    DeviceInfo d;
    FASTQWEN_CUDA_CHECK(cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, device));
    setup_scan<float>(kF32, d);
    setup_scan<__nv_bfloat16>(kBF16, d);
    return d;
  });
}

template <typename T>
void launch(const T* logits, int rows, int vocab, const SamplerRow* params, int64_t* tokens, float* logprobs,
            int64_t* top_ids, float* top_logprobs, int top_width, const int* counts, int64_t counts_rows,
            const Adjust& adj, const Workspace& ws, cudaStream_t stream, int dtype) {
  const DeviceInfo& info = device_info();
  // At most one wave of scan blocks (a partial second wave would cost as much as the first); a row's result does
  // not depend on this (see the file comment).
  const int wave = info.sms * (info.occupancy[dtype] > 0 ? info.occupancy[dtype] : 1);
  int ctas = wave / rows;
  ctas = ctas < 1 ? 1 : ctas > ws.max_ctas ? ws.max_ctas : ctas;
  const bool vec_ok = vocab % 4 == 0 && (reinterpret_cast<uintptr_t>(logits) % (4 * sizeof(T))) == 0;
  const bool counts_vec = counts != nullptr && vocab % 4 == 0 && (reinterpret_cast<uintptr_t>(counts) % 16) == 0;
  if (use_async()) {
    scan_kernel<T, true><<<dim3(ctas, rows), kWarps * 32, scan_smem_bytes<T>(), stream>>>(
        logits, params, vocab, vec_ok, counts, counts_rows, counts_vec, adj, ws);
  } else {
    scan_kernel<T, false><<<dim3(ctas, rows), kWarps * 32, 0, stream>>>(
        logits, params, vocab, vec_ok, counts, counts_rows, counts_vec, adj, ws);
  }
  cuda_check_launch("sample (scan)");
  finish_kernel<T><<<rows, kFinishThreads, 0, stream>>>(logits, params, vocab, ctas, vec_ok, counts, counts_rows,
                                                         counts_vec, adj, ws, tokens, logprobs,
                                                         top_ids, top_logprobs, top_width);
  cuda_check_launch("sample (finish)");
}

void require(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("sample: " + what);
}

}  // namespace

int64_t sampler_workspace_bytes(int64_t max_rows, int64_t vocab) {
  require(max_rows >= 0, "max_rows must be >= 0");
  require(vocab >= 1 && vocab < (int64_t{1} << 31), "vocab must be in [1, 2^31)");
  int64_t total = 0;
  layout(0, max_rows, vocab, &total);
  return total;
}

void sample(const SampleArgs& a) {
  check_dtype("sample: logits: ", a.dtype, kSamplerLogitTypes);
  require(a.rows >= 0 && a.rows < (int64_t{1} << 20), "rows must be in [0, 2^20)");
  require(a.vocab >= 1 && a.vocab < (int64_t{1} << 31), "vocab must be in [1, 2^31)");
  require(a.top_width >= 0 && a.top_width <= kMaxTop, "top_width must be in [0, " + std::to_string(kMaxTop) + "]");
  require(a.blocked_width >= 0 && a.blocked_width < (int64_t{1} << 31), "blocked_width must be in [0, 2^31)");
  require(a.counts_rows >= 0, "counts_rows must be >= 0");
  require(a.mask == 0 || a.mask_words == (a.vocab + 31) / 32, "mask_words must be (vocab + 31) / 32");
  require(a.mask % 4 == 0 && a.bias % 4 == 0, "mask and bias must be 4-byte aligned");
  require(a.rows == 0 || (a.logits && a.params && a.tokens && a.workspace),
          "logits, params, tokens and workspace are required");
  require(a.top_width == 0 || (a.top_ids && a.top_logprobs), "top_ids and top_logprobs are required when top_width > 0");
  require(a.params % alignof(SamplerRow) == 0 && a.workspace % 16 == 0, "params and workspace must be 16-byte aligned");
  int64_t need = 0;
  const Workspace ws = layout(a.workspace, a.rows, a.vocab, &need);
  require(a.workspace_bytes >= need, "workspace has " + std::to_string(a.workspace_bytes) + " bytes, needs " +
                                         std::to_string(need));
  if (a.rows == 0) return;
  auto* s = reinterpret_cast<cudaStream_t>(a.stream);
  const int* c = a.counts_rows > 0 ? reinterpret_cast<const int*>(a.counts) : nullptr;
  const int* b = a.blocked_width > 0 ? reinterpret_cast<const int*>(a.blocked) : nullptr;
  const Adjust adj{b, b ? reinterpret_cast<const float*>(a.bias) : nullptr, static_cast<int>(a.blocked_width),
                   reinterpret_cast<const uint32_t*>(a.mask), static_cast<int>(a.mask_words)};
  FASTQWEN_DISPATCH_DTYPE("sample: logits: ", a.dtype, kSamplerLogitTypes, T,
                          launch(reinterpret_cast<const T*>(a.logits), static_cast<int>(a.rows),
                                 static_cast<int>(a.vocab), reinterpret_cast<const SamplerRow*>(a.params),
                                 reinterpret_cast<int64_t*>(a.tokens), reinterpret_cast<float*>(a.logprobs),
                                 reinterpret_cast<int64_t*>(a.top_ids), reinterpret_cast<float*>(a.top_logprobs),
                                 static_cast<int>(a.top_width), c, a.counts_rows, adj, ws, s, a.dtype));
}

}  // namespace fastqwen
