// Paged prefill / extend attention for Hopper (sm_90a), in the manner of FlashAttention-3: a producer warp streams K
// and V tiles from the paged pool into a shared-memory ring with bulk tensor copies (TMA) that complete on mbarriers,
// and two consumer warpgroups run both matrix multiplies on wgmma, with the softmax in registers between them.
//
// A block owns 128 packed query rows of one (sequence, KV head): packed row r is query token r / G of head
// kvh * G + r % G (the G query heads of a KV head share every K/V tile, as in attention_prefill.cu). Consumer
// warpgroup c owns rows 64 c .. 64 c + 63. K/V tiles are 128 keys; a tile is 8 boxes of 16 keys, each inside one
// page (pages of 16 or more keys), read at (column half, kv head, pool slot) of the pool viewed as [slots, H_kv, 128].
// Keys past the sequence, or on a page id outside the pool, read as zeros (a box at an out-of-range slot), so a
// masked key never brings NaN in. The causal mask is aligned to the end of each sequence (the extend case: query i
// of n new tokens sits at kv_len - n + i); a block stops at the last tile its last row sees, and the tiles every
// row sees in full skip the mask. Work items are numbered in sections of two (sequence, KV head) pairs, whose K/V stay
// in L2 while the blocks read them, and within a section longest work first (the query tiles nearest each
// sequence's end, which see the most keys); one block per SM takes them in turn, by default from a device counter
// (the dynamic schedule: a block that drew short items takes more), so the causal triangle balances.
//
// Pipelines (template switches, chosen at run time by set_paged_attention_prefill_hopper_variant): the softmax of a
// tile overlapped with the previous tile's P V, the two warpgroups taking turns at the tensor cores (ping-pong), two
// or three K/V stages, a static or dynamic schedule, Q loaded by the consumers or by the producer. The default
// (overlap + ping-pong + dynamic, consumers' Q) is the best measured; the producer warpgroup's four warps issue the
// 16-bit copies (one warp issuing them all held every pipeline near 500 TFLOP/s on an H100).
//
// Q by the producer (16-bit caches, G dividing 128): producer warp 0 copies a work item's 128 packed query rows with
// two bulk tensor copies (q viewed as [tokens, H, 128]; packed row r of a tile is token r / G of head kvh * G + r % G,
// so the tile is one box of 128 / G tokens x G heads) as soon as both consumer warpgroups have completed their last
// S = Q K^T of the item before, so the next item's Q arrives while this item's last softmax, P V and stores run
// (FlashAttention-3 loads Q by TMA as well). Otherwise each warpgroup loads its 64 rows itself at the start of an
// item, a global-load latency per item that short items (chunked prefill of many short prompts) feel most.
//
// An FP8 (e4m3) cache: the copies bring the e4m3 tiles into a second ring, and the producer warpgroup's other three
// warps convert them to fp16 (exact: every e4m3 value is an fp16 value) in the layout the 16-bit copies write; the
// matrix multiplies then run in fp16 (q converted on its way into shared memory), k_scale folded into the softmax
// scale and v_scale into the output, as in attention_prefill.cu. Two stages only (three do not fit beside the ring).
//
// What this kernel does not cover (pages under 16 keys, GPUs without sm_90a) takes attention_prefill.cu;
// ops/attention.py holds the one rule that picks.
#include <cudaTypedefs.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <utility>

#include "attention.h"
#include "common.cuh"
#include "cuda_check.h"
#include "device_cache.h"
#include "dtype.h"
#include "hopper.cuh"
#include "kv_fp8.cuh"
#include "launch.cuh"
#include "paged_kv.cuh"

namespace fastqwen {
namespace {

constexpr int kD = kAttentionHeadDim;
constexpr int kBM = 128;        // packed query rows per block (two consumer warpgroups of 64)
constexpr int kBN = 128;        // keys per K/V tile
constexpr int kMaxStages = 3;   // K/V tiles in flight: 2 or 3 (a template parameter; 3 fill shared memory)
constexpr int kBoxKeys = 16;    // keys per bulk copy (within one page)
constexpr int kThreads = 384;   // warpgroup 0: producer; 1 and 2: consumers
constexpr int kHalfBytes = kBN * 128;              // one 64-column half of a K or V tile (128-byte rows)
constexpr int kTileBytes = 2 * kHalfBytes;         // a K or V tile: 32 KB
constexpr int kQBytes = 2 * kBM * 128;             // the Q tile: 32 KB
constexpr int kRawTileBytes = kBN * kD;            // an e4m3 K or V tile as copied (16 KB, rows of 128 bytes)
constexpr int kConverterThreads = 96;              // FP8: warps 1..3 of the producer warpgroup
constexpr int kIssueWarps = 4;                     // 16-bit caches: the producer warps that issue the copies
constexpr int kVariantTmaQ = 16;                   // set_paged_attention_prefill_hopper_variant's bit for Q by the producer
static_assert(kPrefillHopperVariants == 2 * kVariantTmaQ, "attention.h's variant count: bits 0..4");
template <int kStages, bool kFp8>
constexpr int kSmemBytes = kQBytes + kStages * (2 * kTileBytes + (kFp8 ? 2 * kRawTileBytes : 0)) + 1024 /* barriers */ +
                           1024 /* alignment */;
constexpr int kMaxSmemBytes = 227 * 1024;
static_assert(kSmemBytes<kMaxStages, false> <= kMaxSmemBytes && kSmemBytes<2, true> <= kMaxSmemBytes,
              "beyond an SM's shared memory");
constexpr float kLog2e = 1.4426950408889634f;
// Registers per thread after setmaxnreg. The block's pool is what it launched with (__launch_bounds__(384, 1): 168
// each), and an increase that the pool cannot cover waits forever, so the split must fit in it.
// FP8 caches: the producer warpgroup converts tiles too and keeps more (24 spilled 80 bytes there). The 16-bit
// issuing warps spill up to 88 bytes at 24 (kept: they wait on barriers most of the time; the overlapped consumers
// need their 240).
constexpr int kLaunchRegs = 168;
template <bool kFp8>
constexpr int kProducerRegs = kFp8 ? 40 : 24;
template <bool kFp8>
constexpr int kConsumerRegs = kFp8 ? 232 : 240;
static_assert(128 * kProducerRegs<false> + 256 * kConsumerRegs<false> <= kThreads * kLaunchRegs &&
                  128 * kProducerRegs<true> + 256 * kConsumerRegs<true> <= kThreads * kLaunchRegs,
              "setmaxnreg beyond the pool");

struct Params {
  const void* q;
  const int* query_start;
  const int* page_table;
  const int* kv_lens;
  void* out;
  int batch, num_heads, num_kv_heads, group, page_shift, max_pages;
  int total_slots;  // num_pages * page_size: a box at this slot is out of range and reads zeros
  int num_pages;
  int m_tiles;      // query tiles of the longest sequence
  float scale_log2;  // softmax scale * k_scale * log2(e)
  float v_scale;     // 1 for 16-bit caches
  int section_pairs;  // work items are numbered section by section of this many (sequence, KV head) pairs
};

// The (sequence, KV head) pairs whose work items are numbered together (work_of): the blocks running at once then read
// the K/V of about two heads, which stay in L2 (a 16k prompt's eight heads hold 64 MB of K/V, 32k's 128 MB, beyond
// the 50 MB L2). H100, 2026-11-27, variant 11, sections of 1 / 2 / 4 / all 8 pairs: 622 / 620 / 621 / 613 TFLOP/s at
// 8k, 596 / 610 / 595 / 575 at 16k, 607 / 603 / 597 / 597 at 32k, 538 / 531 / 530 / 516 at 4 x 4k.
constexpr int kSectionPairs = 2;

// Shared memory, from a 1,024-aligned base: Q (two 64-column halves of 128 rows), then per stage K and V (two halves
// of 128 keys each), then (FP8) per stage the e4m3 K and V tiles as copied, then the barriers. Addresses are computed
// from the stage, not held in arrays: a stage chosen at run time would index such an array in local memory.
// full_k/full_v: a stage's 16-bit K/V tiles are ready (the copies' bytes, after the two issuing warps' arrivals of
// each; FP8: the three converter warps' arrivals);
// empty_k/empty_v: the 8 consumer warps are done with its K tile (once S = Q K^T has completed) or its V tile (once
// P V has): K is released a P V earlier than V, so the next K tile streams in while this tile's softmax and P V
// run, as FlashAttention-3 releases its K and V pipelines apart; raw_full_k/raw_full_v, raw_empty: the e4m3 ring.
template <int kStages, bool kFp8>
struct Smem {
  uint32_t q;
  __device__ explicit Smem(uint32_t base) : q(base) {}
  __device__ uint32_t k(int s) const { return q + kQBytes + s * 2 * kTileBytes; }
  __device__ uint32_t v(int s) const { return k(s) + kTileBytes; }
  __device__ uint32_t raw_k(int s) const { return q + kQBytes + kStages * 2 * kTileBytes + s * 2 * kRawTileBytes; }
  __device__ uint32_t raw_v(int s) const { return raw_k(s) + kRawTileBytes; }
  __device__ uint32_t bars() const { return q + kQBytes + kStages * (2 * kTileBytes + (kFp8 ? 2 * kRawTileBytes : 0)); }
  __device__ uint32_t full_k(int s) const { return bars() + 8 * s; }
  __device__ uint32_t full_v(int s) const { return bars() + 8 * (kStages + s); }
  __device__ uint32_t empty_k(int s) const { return bars() + 8 * (2 * kStages + s); }
  __device__ uint32_t raw_full_k(int s) const { return bars() + 8 * (3 * kStages + s); }
  __device__ uint32_t raw_full_v(int s) const { return bars() + 8 * (4 * kStages + s); }
  __device__ uint32_t raw_empty(int s) const { return bars() + 8 * (5 * kStages + s); }
  __device__ uint32_t empty_v(int s) const { return bars() + 8 * (6 * kStages + s); }
  // Dynamic schedule: slot i (of 2) holds a work item id, item_full(i) says it is written, item_empty(i) that every
  // warp that reads it (8 consumer warps, FP8's 3 converter warps) has.
  __device__ uint32_t item_full(int i) const { return bars() + 8 * (7 * kStages + i); }
  __device__ uint32_t item_empty(int i) const { return bars() + 8 * (7 * kStages + 2 + i); }
  __device__ uint32_t item_slot(int i) const { return bars() + 8 * (7 * kStages + 4) + 4 * i; }
  // Q by the producer: q_full, the Q tile of the current work item has arrived; q_empty, the 8 consumer warps have
  // completed their last S of the work item before (the tile may be overwritten).
  __device__ uint32_t q_full() const { return bars() + 8 * (7 * kStages + 5); }
  __device__ uint32_t q_empty() const { return bars() + 8 * (7 * kStages + 6); }
};
static_assert(8 * (7 * kMaxStages + 7) <= 1024, "the barriers' space");

// The dynamic schedule's counter of fetched work items on this device (zero between launches: the block that fetches
// last, grid + items - 1, puts it back). So launches of this kernel on one device must not overlap in time (one
// stream, as the engine runs its layers).
__device__ int dynamic_item_counter = 0;

// The work items a block takes, k = 0, 1, ...: statically blockIdx.x + k gridDim.x, or (kDynamic) whatever the
// device counter hands out when the producer warp asks, so that a block that drew short items takes more (the
// hardware's in-order dispatch of a grid of one block per item does the same, without the persistent prologue).
// The producer warp fetches and writes the id to a two-slot ring; the warps that follow it read it there.
template <bool kDynamic, int kStages, bool kFp8>
__device__ __forceinline__ int producer_next_item(const Smem<kStages, kFp8>& sm, int k, int items, int lane) {
  if constexpr (!kDynamic) {
    return blockIdx.x + k * gridDim.x;
  } else {
    int item = 0;
    if (lane == 0) {
      item = atomicAdd(&dynamic_item_counter, 1);
      if (item == items + static_cast<int>(gridDim.x) - 1) atomicExch(&dynamic_item_counter, 0);  // the last fetch
    }
    item = __shfl_sync(0xffffffffu, item, 0);
    hopper::mbar_wait(sm.item_empty(k % 2), ((k / 2) & 1) ^ 1);
    if (lane == 0) {
      asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(sm.item_slot(k % 2)), "r"(item) : "memory");
      hopper::mbar_arrive(sm.item_full(k % 2));
    }
    return item;
  }
}
template <bool kDynamic, int kStages, bool kFp8>
__device__ __forceinline__ int follower_next_item(const Smem<kStages, kFp8>& sm, int k, int lane) {
  if constexpr (!kDynamic) {
    return blockIdx.x + k * gridDim.x;
  } else {
    hopper::mbar_wait(sm.item_full(k % 2), (k / 2) & 1);
    int item;
    asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(item) : "r"(sm.item_slot(k % 2)) : "memory");
    __syncwarp();
    if (lane == 0) hopper::mbar_arrive(sm.item_empty(k % 2));
    return item;
  }
}

// FP8: an e4m3 tile as copied (key r's 128 bytes at r * 128) to fp16 in the 16-bit tiles' layout (two 64-column
// halves, 128-byte rows, 16-byte chunk c of row r at c ^ (r % 8)), by the converter threads (t < 96).
__device__ __forceinline__ void convert_fp8_tile(uint32_t raw, uint32_t dst, int t) {
  for (int chunk = t; chunk < kBN * 8; chunk += kConverterThreads) {  // chunk: 16 e4m3 values, columns 16 (chunk % 8)
    const int key = chunk / 8, cc = chunk % 8;
    uint32_t x, y, z, w;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(x), "=r"(y), "=r"(z), "=r"(w) : "r"(raw + chunk * 16));
    const uint32_t row = dst + (cc / 4) * kHalfBytes + key * 128;
    const int c0 = (cc % 4) * 2;  // the first of its two 16-byte fp16 chunks in the half
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(row + ((c0 ^ (key % 8)) << 4)),
                 "r"(fp8x2_to_half2(x)), "r"(fp8x2_to_half2(x >> 16)), "r"(fp8x2_to_half2(y)),
                 "r"(fp8x2_to_half2(y >> 16)));
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(row + (((c0 + 1) ^ (key % 8)) << 4)),
                 "r"(fp8x2_to_half2(z)), "r"(fp8x2_to_half2(z >> 16)), "r"(fp8x2_to_half2(w)),
                 "r"(fp8x2_to_half2(w >> 16)));
  }
}

// Two q values (a 32-bit pair of T) as the matrix multiplies' type C (fp16 for FP8 caches).
template <typename T, typename C>
__device__ __forceinline__ uint32_t q_pair_as(uint32_t v) {
  if constexpr (std::is_same<T, C>::value) {
    return v;
  } else {
    const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v));
    return mma::Mma<C>::pack(f.x, f.y);
  }
}

// One query tile of one (sequence, KV head), and how many K/V tiles its rows see.
struct Work {
  int b, kvh, row0, rows, q0, prefix, kv_len, n_tiles;
};

// Work item i (i < m_tiles * B * H_kv) belongs to section i / (m_tiles * section_pairs) of section_pairs pairs (b, kvh)
// (the last may hold fewer), and within it is query tile `from_end` (counted from its sequence's end) of one of them:
// within a section the tiles that see the most keys come first. The same item also owns the tiles from_end +
// m_tiles, + 2 m_tiles, ... (only when max_query_len understated a sequence: never in the engine).
__device__ __forceinline__ Work work_of(const Params& p, int item, int round) {
  const int pairs = p.batch * p.num_kv_heads;  // (b, kvh) = (rest / H_kv, rest % H_kv)
  const int per_section = p.m_tiles * p.section_pairs;
  const int section = item / per_section;
  const int first = section * p.section_pairs;
  const int width = min(p.section_pairs, pairs - first);
  const int r = item - section * per_section;
  const int from_end = r / width + round * p.m_tiles;
  const int rest = first + r % width;
  Work w;
  w.kvh = rest % p.num_kv_heads;
  w.b = rest / p.num_kv_heads;
  w.q0 = p.query_start[w.b];
  const int n_q = p.query_start[w.b + 1] - w.q0;
  w.rows = n_q * p.group;
  const int tiles = (w.rows + kBM - 1) / kBM;
  w.row0 = (tiles - 1 - from_end) * kBM;  // < 0: this sequence has no such tile
  w.kv_len = p.kv_lens[w.b];
  w.prefix = w.kv_len - n_q;
  const int last_row = min(w.rows, w.row0 + kBM) - 1;
  const int kv_end = max(0, min(w.kv_len, w.prefix + last_row / p.group + 1));
  w.n_tiles = (kv_end + kBN - 1) / kBN;
  return w;
}

// Named barriers: 1 + c, warpgroup c's Q tile is written; 3 + c, warpgroup c may issue its matrix multiplies.
constexpr int kQReadyBarrier = 1, kIssueBarrier = 3;

// The two consumer warpgroups take turns issuing their matrix multiplies (ping-pong), so that one's softmax runs
// while the tensor cores work through the other's: warpgroup c waits on its barrier (which the other's arrival
// completes), issues, then arrives on the other's.
template <bool kPingpong>
__device__ __forceinline__ void issue_turn_begin(int c) {
  if constexpr (kPingpong) hopper::named_barrier(kIssueBarrier + c, 256);
}
template <bool kPingpong>
__device__ __forceinline__ void issue_turn_end(int c) {
  if constexpr (kPingpong) asm volatile("bar.arrive %0, 256;\n" ::"r"(kIssueBarrier + (c ^ 1)) : "memory");
}

// Online softmax of one S tile (raw scores) for this thread's two rows, in place: the probabilities relative to the
// new running max (log2 units, one FFMA and one exp2 per score). Returns each row's rescale factor of O and l.
// The maxima are a tree per row (31 FMNMX, depth 5) with both rows interleaved, and the sums run in kChains chains per
// row: written as one running value each was a chain of 32 dependent FMNMX or FADD (seen in the SASS), whose latency
// the warpgroup's one warp per scheduler cannot hide while the other warpgroup waits on its matrix multiplies. The
// maxima are the same whatever the order; the sums' order changes their last bits.
constexpr int kChains = 4;
template <bool kMasked>
__device__ __forceinline__ void softmax_tile(float (&sc)[64], float (&m_run)[2], float (&l_run)[2], float (&alpha)[2],
                                             const int (&row_pos)[2], int key0, int lane, float scale_log2) {
  if constexpr (kMasked) {
    // Column nb * 8 + e of this thread is key key0 + 2 (lane % 4) + nb * 8 + e: compared with a constant (a per-key
    // bound would be hoisted out of the loop into 64 registers).
    int limit[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) limit[h] = row_pos[h] - key0 - (lane % 4) * 2;
#pragma unroll
    for (int nb = 0; nb < 16; ++nb) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          if (nb * 8 + e > limit[h]) sc[nb * 4 + h * 2 + e] = -INFINITY;
        }
      }
    }
  }
  float t[2][16];
#pragma unroll
  for (int i = 0; i < 16; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) t[h][i] = fmaxf(sc[i * 4 + h * 2], sc[i * 4 + h * 2 + 1]);
  }
  // Widths 8, 4, 2, 1, each level written out (as a loop over the width the compiler kept t in local memory).
#pragma unroll
  for (int i = 0; i < 8; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) t[h][i] = fmaxf(t[h][i], t[h][i + 8]);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) t[h][i] = fmaxf(t[h][i], t[h][i + 4]);
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) t[h][i] = fmaxf(t[h][i], t[h][i + 2]);
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) t[h][0] = fmaxf(t[h][0], t[h][1]);
  float m[2] = {t[0][0], t[1][0]};
#pragma unroll
  for (int step = 0; step < 2; ++step) {  // the quad's four threads share a row
    const int mask = 1 << step;
    float other[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) other[h] = __shfl_xor_sync(0xffffffffu, m[h], mask);
#pragma unroll
    for (int h = 0; h < 2; ++h) m[h] = fmaxf(m[h], other[h]);
  }
  float m_scaled[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float m_new = fmaxf(m_run[h], m[h]);
    m_scaled[h] = m_new == -INFINITY ? 0.0f : m_new * scale_log2;  // a row with no key yet stays at zero
    // A tile that raises no maximum leaves O and l exactly as they were: m_run * scale - m_scaled contracts into an
    // FMA whose result is the product's rounding error, not 0, so alpha would miss 1 by an ulp, and a query's output
    // would depend on how many tiles wholly masked for it its step reads (a verify step's row 0 against the same
    // position as row 3 of a later step: greedy replays under speculative decoding drifted apart).
    alpha[h] = m_new == m_run[h] ? 1.0f : mma::fast_exp2(m_run[h] * scale_log2 - m_scaled[h]);
    m_run[h] = m_new;
  }
  float sum[2][kChains];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int c = 0; c < kChains; ++c) sum[h][c] = 0.0f;
  }
#pragma unroll
  for (int nb = 0; nb < 16; ++nb) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float& x = sc[nb * 4 + h * 2 + e];
        x = mma::fast_exp2(fmaf(x, scale_log2, -m_scaled[h]));
        sum[h][nb % kChains] += x;
      }
    }
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {  // this thread's share; the quad is summed at the end
    l_run[h] = l_run[h] * alpha[h] + ((sum[h][0] + sum[h][1]) + (sum[h][2] + sum[h][3]));
  }
}
static_assert(kChains == 4, "softmax_tile combines four chains");

// kOverlap: the softmax of tile j runs while P_{j-1} V_{j-1} does (else S, softmax, P V in turn). kPingpong: the
// warpgroups take turns issuing. kStages: K/V tiles in flight. kDynamic: the schedule of work items. kTmaQ: the
// producer copies each work item's Q tile (q_map; unused otherwise). set_paged_attention_prefill_hopper_variant picks
// them (kernel_variant below holds the default, the best measured).
template <typename T, typename Kv, bool kOverlap, bool kPingpong, int kStages, bool kDynamic, bool kTmaQ>
__global__ void __launch_bounds__(kThreads, 1)
    prefill_hopper_kernel(const __grid_constant__ CUtensorMap k_map, const __grid_constant__ CUtensorMap v_map,
                          const __grid_constant__ CUtensorMap q_map, const Params p) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace hopper;
  extern __shared__ unsigned char smem_raw[];
  const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
  constexpr bool kFp8 = kIsFp8<Kv>;
  static_assert(!(kFp8 && kTmaQ), "an FP8 cache's Q is converted to fp16 on its way into shared memory");
  using C = std::conditional_t<kFp8, __half, T>;  // the matrix multiplies' type
  const Smem<kStages, kFp8> sm(base);
  const int tid = threadIdx.x;
  const int warpgroup = tid / 128;
  const int items = p.m_tiles * p.batch * p.num_kv_heads;

  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      mbar_init(sm.full_k(s), kFp8 ? kConverterThreads / 32 : kIssueWarps / 2);  // (two warps copy each tile)
      mbar_init(sm.full_v(s), kFp8 ? kConverterThreads / 32 : kIssueWarps / 2);  // (two warps copy each tile)
      mbar_init(sm.empty_k(s), 8);  // one arrival per consumer warp
      mbar_init(sm.empty_v(s), 8);
      if constexpr (kFp8) {
        mbar_init(sm.raw_full_k(s), 1);
        mbar_init(sm.raw_full_v(s), 1);
        mbar_init(sm.raw_empty(s), kConverterThreads / 32);
      }
    }
    if constexpr (kDynamic) {
      for (int i = 0; i < 2; ++i) {
        mbar_init(sm.item_full(i), 1);
        mbar_init(sm.item_empty(i), 8 + (kFp8 ? kConverterThreads / 32 : kIssueWarps - 1));
      }
    }
    if constexpr (kTmaQ) {
      mbar_init(sm.q_full(), 1);
      mbar_init(sm.q_empty(), 8);  // one arrival per consumer warp
    }
    mbar_fence_init();
  }
  __syncthreads();
  // Programmatic dependent launch (launch.cuh): the set-up above may overlap the kernel before, which writes q and
  // the new keys and values (the page table, lengths and tensor maps were written before it); the kernel after may
  // start once every block is past this point (a verify step's o_proj streams its weights on the SMs the few items
  // of a short attention leave free).
  griddep_wait();
  griddep_launch_dependents();

  if (warpgroup == 0) {
    // Producer. 16-bit caches: warp q copies half q % 2 of every K (q < 2) or V tile, lane i its 16-key box i (the
    // page ids load in parallel). One warp issuing all 32 boxes of a tile was the kernel's limit once the softmax
    // overlapped P V: a bulk copy whose operands differ by lane is issued one lane at a time (elect, operands into
    // uniform registers, the copy, a branch back), about 80 cycles each, 2,500 of a tile's 3,400 (Nsight's stall
    // samples, H100). FP8 caches: warp 0 copies the e4m3 tiles and warps 1..3 convert them. The warpgroup gives its
    // registers to the consumers.
    regs_dec<kProducerRegs<kFp8>>();
    if constexpr (kFp8) {
      if (tid >= 32) {
        const int t = tid - 32;
        int it = 0;  // as the producer's
        for (int k = 0;; ++k) {
          const int item = follower_next_item<kDynamic>(sm, k, t % 32);
          if (item >= items) break;
          for (int round = 0;; ++round) {
            const Work w = work_of(p, item, round);
            if (w.row0 < 0) break;
            for (int j = 0; j < w.n_tiles; ++j, ++it) {
              const int s = it % kStages;
              const uint32_t phase = (it / kStages) & 1;
              mbar_wait(sm.empty_k(s), phase ^ 1);  // the consumers are done with this stage's fp16 K tile
              mbar_wait(sm.raw_full_k(s), phase);
              convert_fp8_tile(sm.raw_k(s), sm.k(s), t);
              fence_async_shared();  // the fp16 tiles are read by wgmma (the async proxy)
              __syncwarp();
              if (t % 32 == 0) mbar_arrive(sm.full_k(s));
              mbar_wait(sm.empty_v(s), phase ^ 1);
              mbar_wait(sm.raw_full_v(s), phase);
              convert_fp8_tile(sm.raw_v(s), sm.v(s), t);
              fence_async_shared();
              __syncwarp();
              if (t % 32 == 0) {
                mbar_arrive(sm.full_v(s));
                mbar_arrive(sm.raw_empty(s));
              }
            }
          }
        }
        return;
      }
    }
    const int lane = tid % 32;
    const int pw = tid / 32;  // the issuing warp (0 for FP8 caches)
    if (tid == 0) {
      prefetch_tensor_map(&k_map);
      prefetch_tensor_map(&v_map);
      if constexpr (kTmaQ) prefetch_tensor_map(&q_map);
    }
    const int page_mask = (1 << p.page_shift) - 1;
    int it = 0;  // K/V tiles loaded so far: stage it % kStages, its use (it / kStages)
    int qi = 0;  // work items (item, round) whose Q tile was copied
    for (int k = 0;; ++k) {
      const int item =
          pw == 0 ? producer_next_item<kDynamic>(sm, k, items, lane) : follower_next_item<kDynamic>(sm, k, lane);
      if (item >= items) break;
      for (int round = 0;; ++round) {
        const Work w = work_of(p, item, round);
        if (w.row0 < 0) break;
        // Q by the producer: after the work's first K tile (which may stream in while the work before still runs),
        // once the consumers have completed the last S that reads the work before's Q.
        auto load_q = [&] {
          if constexpr (kTmaQ) {
            mbar_wait(sm.q_empty(), (qi & 1) ^ 1);
            if (lane == 0) {
              const int token = w.q0 + w.row0 / p.group;  // (G divides the tile's 128 rows)
              mbar_arrive_expect_tx(sm.q_full(), kQBytes);
              tma_load_3d(sm.q, &q_map, sm.q_full(), 0, w.kvh * p.group, token);
              tma_load_3d(sm.q + kBM * 128, &q_map, sm.q_full(), 64, w.kvh * p.group, token);
            }
            __syncwarp();
            ++qi;
          }
        };
        if (w.n_tiles == 0 && pw == 0) load_q();
        const int* pages = p.page_table + static_cast<int64_t>(w.b) * p.max_pages;
        for (int j = 0; j < w.n_tiles; ++j, ++it) {
          const int s = it % kStages;
          int slot = p.total_slots;
          if (lane < kBN / kBoxKeys) {
            const int pos = j * kBN + lane * kBoxKeys;
            const int page_index = pos >> p.page_shift;
            int page = -1;
            if (pos < w.kv_len && page_index < p.max_pages) page = pages[page_index];
            if (page >= 0 && page < p.num_pages) slot = (page << p.page_shift) + (pos & page_mask);
          }
          if constexpr (kFp8) {  // into the e4m3 ring: one 128-byte-wide box per 16 keys
            mbar_wait(sm.raw_empty(s), ((it / kStages) & 1) ^ 1);
            if (lane == 0) {
              mbar_arrive_expect_tx(sm.raw_full_k(s), kRawTileBytes);
              mbar_arrive_expect_tx(sm.raw_full_v(s), kRawTileBytes);
            }
            __syncwarp();
            if (lane < kBN / kBoxKeys) {
              const uint32_t offset = lane * kBoxKeys * kD;
              tma_load_3d(sm.raw_k(s) + offset, &k_map, sm.raw_full_k(s), 0, w.kvh, slot);
              tma_load_3d(sm.raw_v(s) + offset, &v_map, sm.raw_full_v(s), 0, w.kvh, slot);
            }
          } else {  // warp pw copies half pw % 2 of the K (pw < 2) or V tile as soon as its stage's K or V is released
            const bool is_v = pw >= 2;
            const int half = pw % 2;
            const uint32_t full = is_v ? sm.full_v(s) : sm.full_k(s);
            mbar_wait(is_v ? sm.empty_v(s) : sm.empty_k(s), ((it / kStages) & 1) ^ 1);
            if (lane == 0) mbar_arrive_expect_tx(full, kTileBytes / 2);
            __syncwarp();
            if (lane < kBN / kBoxKeys) {
              tma_load_3d((is_v ? sm.v(s) : sm.k(s)) + half * kHalfBytes + lane * kBoxKeys * 128, is_v ? &v_map : &k_map,
                          full, half * 64, w.kvh, slot);
            }
            if (j == 0 && pw == 0) load_q();
          }
        }
      }
    }
    return;
  }

  // Consumers.
  regs_inc<kConsumerRegs<kFp8>>();
  const int c = warpgroup - 1;             // 0 or 1: rows 64 c ..
  const int ctid = tid - 128 * warpgroup;  // 0..127 within the warpgroup
  const int warp = ctid / 32, lane = ctid % 32;
  const int G = p.group;
  const uint32_t q_rows = sm.q + c * 64 * 128;
  T* out = static_cast<T*>(p.out);
  if (c == 1) issue_turn_end<kPingpong>(c);  // warpgroup 0 issues first

  int it = 0;  // as the producer's
  int qi = 0;  // as the producer's
  for (int k = 0;; ++k) {
    const int item = follower_next_item<kDynamic>(sm, k, lane);
    if (item >= items) break;
    for (int round = 0;; ++round) {
      const Work w = work_of(p, item, round);
      if (w.row0 < 0) break;

      if constexpr (kTmaQ) {  // the producer's copy (rows past the sequence: the next sequence's, or zeros)
        mbar_wait(sm.q_full(), qi & 1);
        ++qi;
      } else {
        // Q: this warpgroup's 64 rows into the swizzled halves (rows past the sequence are zero). Its previous tile's
        // matrix multiplies have all completed, so the rows are free.
        const T* q = static_cast<const T*>(p.q);
#pragma unroll
        for (int i = 0; i < 64 * 16 / 128; ++i) {
          const int chunk_id = ctid + i * 128;
          const int r = chunk_id / 16, chunk = chunk_id % 16;  // chunk: 16 bytes = 8 elements of the 128
          const int row = c * 64 + r;
          const int pr = w.row0 + row;
          uint4 v = {0u, 0u, 0u, 0u};
          if (pr < w.rows) {
            v = __ldg(reinterpret_cast<const uint4*>(
                q + ((static_cast<int64_t>(w.q0) + pr / G) * p.num_heads + w.kvh * G + pr % G) * kD + chunk * 8));
          }
          const uint32_t dst = sm.q + (chunk / 8) * (kBM * 128) + row * 128 + (((chunk % 8) ^ (row % 8)) << 4);
          asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(dst), "r"(q_pair_as<T, C>(v.x)),
                       "r"(q_pair_as<T, C>(v.y)), "r"(q_pair_as<T, C>(v.z)), "r"(q_pair_as<T, C>(v.w)));
        }
        fence_async_shared();
        named_barrier(kQReadyBarrier + c, 128);
      }

      // This thread's two rows (h = 0: warp row lane / 4, h = 1: + 8) and their positions.
      int row_pos[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) row_pos[h] = w.prefix + (w.row0 + c * 64 + warp * 16 + lane / 4 + h * 8) / G;
      // Tiles every row of this warpgroup sees in full need no mask; tiles past its last row's keys are only
      // waited for and released (every warp takes part in every tile's barriers, in order).
      const int wg_first_row = w.row0 + c * 64;
      const int full_end = w.prefix + wg_first_row / G + 1;
      const int wg_last_row = min(w.rows, wg_first_row + 64) - 1;
      const int wg_end = wg_last_row < wg_first_row ? 0 : max(0, min(w.kv_len, w.prefix + wg_last_row / G + 1));
      const int n = w.n_tiles;
      const int n_wg = (wg_end + kBN - 1) / kBN;  // <= n

      float o[64];
#pragma unroll
      for (int i = 0; i < 64; ++i) o[i] = 0.0f;
      float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};
      unsigned a[8][4];  // P of the latest tile, the A operand of its P V
      float sc[64];

      auto stage = [&](int j) { return (it + j) % kStages; };
      auto parity = [&](int j) { return static_cast<uint32_t>(((it + j) / kStages) & 1); };
      auto issue_s = [&](int j) {
        const uint64_t q_desc = desc_at(sw128_desc(q_rows, 16, 1024));
        const uint64_t k_desc = desc_at(sw128_desc(sm.k(stage(j)), 16, 1024));
#pragma unroll
        for (int kk = 0; kk < kD / 16; ++kk) {  // the first 4 k16 steps in the low column half, the rest high
          const uint32_t off = (kk % 4) * 32;     // the k16 slice inside the 128-byte rows
          const uint64_t da = desc_plus(q_desc, ((kk / 4) * (kBM * 128) + off) >> 4);
          const uint64_t db = desc_plus(k_desc, ((kk / 4) * kHalfBytes + off) >> 4);
          if (kk == 0) {
            Wgmma<C>::ss_first(sc, da, db);
          } else {
            Wgmma<C>::ss(sc, da, db, 1);
          }
        }
        wgmma_commit();
      };
      // P's accumulators of n8 blocks 2 kk and 2 kk + 1 are the A fragment of k16 step kk; V is read MN-major (its
      // rows are keys, its 128 columns two 64-column halves kHalfBytes apart).
      auto issue_pv = [&](int j) {
        const uint64_t v_desc = desc_at(sw128_desc(sm.v(stage(j)), kHalfBytes, 1024));
#pragma unroll
        for (int kk = 0; kk < kBN / 16; ++kk) {
          Wgmma<C>::rs(o, a[kk], desc_plus(v_desc, (kk * 16 * 128) >> 4));
        }
        wgmma_commit();
      };
      auto softmax = [&](int j, float (&alpha)[2]) {
        fence_regs(sc);
        if ((j + 1) * kBN > full_end) {
          softmax_tile<true>(sc, m_run, l_run, alpha, row_pos, j * kBN, lane, p.scale_log2);
        } else {
          softmax_tile<false>(sc, m_run, l_run, alpha, row_pos, j * kBN, lane, p.scale_log2);
        }
      };
      // O's rows to the new running max. The fence keeps the 64 multiplies here: the compiler otherwise sinks them
      // to just before the P V they feed, past the ping-pong barrier, where they delay the issue that the other
      // warpgroup's turn waits on (seen in the SASS: 64 FMULs after BAR.SYNC).
      auto rescale_o = [&](const float (&alpha)[2]) {
#pragma unroll
        for (int nb = 0; nb < 16; ++nb) {
          o[nb * 4 + 0] *= alpha[0];
          o[nb * 4 + 1] *= alpha[0];
          o[nb * 4 + 2] *= alpha[1];
          o[nb * 4 + 3] *= alpha[1];
        }
        fence_regs(o);
      };
      auto pack_p = [&] {
#pragma unroll
        for (int kk = 0; kk < kBN / 16; ++kk) {
          a[kk][0] = mma::Mma<C>::pack(sc[8 * kk + 0], sc[8 * kk + 1]);
          a[kk][1] = mma::Mma<C>::pack(sc[8 * kk + 2], sc[8 * kk + 3]);
          a[kk][2] = mma::Mma<C>::pack(sc[8 * kk + 4], sc[8 * kk + 5]);
          a[kk][3] = mma::Mma<C>::pack(sc[8 * kk + 6], sc[8 * kk + 7]);
        }
      };
      auto release_k = [&](int j) {
        if (lane == 0) mbar_arrive(sm.empty_k(stage(j)));  // this warp is done with K tile j
      };
      auto release_v = [&](int j) {
        if (lane == 0) mbar_arrive(sm.empty_v(stage(j)));  // and with V tile j
      };
      // Q by the producer: this warp's last S of the work item has completed (or it has none), so the next item's Q
      // may overwrite the tile.
      auto release_q = [&] {
        if constexpr (kTmaQ) {
          if (lane == 0) mbar_arrive(sm.q_empty());
        }
      };
      auto s_done = [&](int j) {  // S_j has completed: its K tile is free, and after the last S the Q tile too
        release_k(j);
        if (j == n_wg - 1) release_q();
      };
      if (n_wg == 0) release_q();

      // n + 1 turns per tile for both warpgroups: S_0; then S_j with P_{j-1} V_{j-1} (the softmax of S_j runs while
      // P V does; O is rescaled after it); then the last P V; then the tiles this warpgroup's rows do not see.
      if constexpr (!kOverlap) {
        for (int j = 0; j < n_wg; ++j) {
          mbar_wait(sm.full_k(stage(j)), parity(j));
          issue_turn_begin<kPingpong>(c);
          wgmma_fence();
          issue_s(j);
          issue_turn_end<kPingpong>(c);
          wgmma_wait<0>();
          s_done(j);
          float alpha[2];
          softmax(j, alpha);
          rescale_o(alpha);
          pack_p();
          mbar_wait(sm.full_v(stage(j)), parity(j));
          issue_turn_begin<kPingpong>(c);
          wgmma_fence();
          issue_pv(j);
          issue_turn_end<kPingpong>(c);
          wgmma_wait<0>();
          fence_regs(o);
          release_v(j);
        }
        for (int j = n_wg; j < n; ++j) {  // two turns per tile, as above
          mbar_wait(sm.full_k(stage(j)), parity(j));
          release_k(j);
          mbar_wait(sm.full_v(stage(j)), parity(j));
          issue_turn_begin<kPingpong>(c);
          issue_turn_end<kPingpong>(c);
          issue_turn_begin<kPingpong>(c);
          issue_turn_end<kPingpong>(c);
          release_v(j);
        }
      } else {
        if (n_wg > 0) {
          mbar_wait(sm.full_k(stage(0)), parity(0));
          issue_turn_begin<kPingpong>(c);
          wgmma_fence();
          issue_s(0);
          issue_turn_end<kPingpong>(c);
          wgmma_wait<0>();
          s_done(0);
          float alpha[2];
          softmax(0, alpha);
          pack_p();
          for (int j = 1; j < n_wg; ++j) {
            mbar_wait(sm.full_k(stage(j)), parity(j));
            mbar_wait(sm.full_v(stage(j - 1)), parity(j - 1));
            issue_turn_begin<kPingpong>(c);
            wgmma_fence();
            issue_s(j);
            issue_pv(j - 1);
            issue_turn_end<kPingpong>(c);
            wgmma_wait<1>();  // S_j (committed first) has completed
            s_done(j);
            softmax(j, alpha);
            wgmma_wait<0>();
            fence_regs(o);
            release_v(j - 1);
            rescale_o(alpha);
            pack_p();
          }
          mbar_wait(sm.full_v(stage(n_wg - 1)), parity(n_wg - 1));
          issue_turn_begin<kPingpong>(c);
          wgmma_fence();
          issue_pv(n_wg - 1);
          issue_turn_end<kPingpong>(c);
          wgmma_wait<0>();
          fence_regs(o);
          release_v(n_wg - 1);
        } else {
          issue_turn_begin<kPingpong>(c);
          issue_turn_end<kPingpong>(c);
        }
        for (int j = n_wg; j < n; ++j) {  // every warp waits for every tile, in order, and releases it
          mbar_wait(sm.full_k(stage(j)), parity(j));
          release_k(j);
          mbar_wait(sm.full_v(stage(j)), parity(j));
          issue_turn_begin<kPingpong>(c);
          issue_turn_end<kPingpong>(c);
          release_v(j);
        }
      }
      it += n;

      // Normalize and store this thread's two rows (pairs of adjacent dims).
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float l = l_run[h];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const float inv = l > 0.0f ? p.v_scale / l : 0.0f;
        const int pr = w.row0 + c * 64 + warp * 16 + lane / 4 + h * 8;
        if (pr < w.rows) {
          T* dst = out + ((static_cast<int64_t>(w.q0) + pr / G) * p.num_heads + w.kvh * G + pr % G) * kD + (lane % 4) * 2;
#pragma unroll
          for (int nb = 0; nb < 16; ++nb) {
            *reinterpret_cast<unsigned*>(dst + nb * 8) = mma::Mma<T>::pack(o[nb * 4 + h * 2] * inv, o[nb * 4 + h * 2 + 1] * inv);
          }
        }
      }
    }
  }
  if (c == 0) issue_turn_begin<kPingpong>(c);  // matches warpgroup 1's last arrival (barriers end balanced)
#endif
}

using EncodeTiled = PFN_cuTensorMapEncodeTiled_v12000;

EncodeTiled encode_tiled() {
  static EncodeTiled fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult found{};
    cuda_check(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &found),
               "paged_attention_prefill_hopper: cudaGetDriverEntryPointByVersion");
    if (found != cudaDriverEntryPointSuccess || ptr == nullptr) {
      throw std::runtime_error("paged_attention_prefill_hopper: the driver has no cuTensorMapEncodeTiled");
    }
    return reinterpret_cast<EncodeTiled>(ptr);
  }();
  return fn;
}

// The pool [slots, H_kv, 128] as a tensor map whose box is 16 slots x 1 head x 128 bytes: 64 columns swizzled for
// 16-bit caches (the layout wgmma reads), all 128 e4m3 columns unswizzled for FP8 ones (the converters' input).
CUtensorMap pool_map(const void* pool, int kv_dtype, int64_t slots, int64_t num_kv_heads) {
  CUtensorMap map;
  const bool fp8 = kv_dtype == kFP8E4M3;
  const cuuint64_t bytes = fp8 ? 1 : 2;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(kD), static_cast<cuuint64_t>(num_kv_heads),
                              static_cast<cuuint64_t>(slots)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(kD * bytes), static_cast<cuuint64_t>(num_kv_heads * kD * bytes)};
  const cuuint32_t box[3] = {fp8 ? 128u : 64u, 1, kBoxKeys};
  const cuuint32_t element_strides[3] = {1, 1, 1};
  const CUtensorMapDataType type = fp8 ? CU_TENSOR_MAP_DATA_TYPE_UINT8
                                   : kv_dtype == kBF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                                       : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  const CUresult r = encode_tiled()(
      &map, type, 3, const_cast<void*>(pool), dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
      fp8 ? CU_TENSOR_MAP_SWIZZLE_NONE : CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    throw std::runtime_error("paged_attention_prefill_hopper: cuTensorMapEncodeTiled failed (" + std::to_string(r) + ")");
  }
  return map;
}

// q [tokens, H, 128] as a tensor map whose box is one work item's Q tile half: 64 columns (swizzled as the K tiles) x
// G heads x 128 / G tokens, i.e. packed rows 0..127 of the tile in order.
CUtensorMap q_tile_map(const void* q, int dtype, int64_t tokens, int64_t num_heads, int64_t group) {
  CUtensorMap map;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(kD), static_cast<cuuint64_t>(num_heads),
                              static_cast<cuuint64_t>(tokens)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(kD * 2), static_cast<cuuint64_t>(num_heads * kD * 2)};
  const cuuint32_t box[3] = {64, static_cast<cuuint32_t>(group), static_cast<cuuint32_t>(kBM / group)};
  const cuuint32_t element_strides[3] = {1, 1, 1};
  const CUresult r = encode_tiled()(
      &map, dtype == kBF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 3,
      const_cast<void*>(q), dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
      CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    throw std::runtime_error("paged_attention_prefill_hopper: cuTensorMapEncodeTiled (q) failed (" + std::to_string(r) +
                             ")");
  }
  return map;
}

bool persistent_grid = true;  // set_paged_attention_prefill_hopper_persistent (benchmarks)
// set_paged_attention_prefill_hopper_variant: bits 0 overlap, 1 ping-pong, 2 three stages, 3 dynamic, 4 Q by the
// producer (16-bit caches with G dividing 128; else the consumers load it). The default: the softmax overlapped with
// the previous tile's P V, ping-pong, the dynamic schedule, two stages (FlashAttention-3's pipeline). Once four warps
// issue the copies it is the fastest (H100, 2026-11-27: 588 / 586 / 581 TFLOP/s at 8k / 16k / 32k against 549 / 527 /
// 526 for ping-pong without the overlap, variant 10, the default before; cuDNN 614 / 581 / 616 in the same run).
// FP8 caches run its ping-pong and schedule without the overlap (launch below).
int kernel_variant = 11;

// The maps of one launch: the pool's K and V, and q's (Q by the producer; else k's, unused).
struct Maps {
  CUtensorMap k, v, q;
};

template <typename T, typename Kv, bool kOverlap, bool kPingpong, int kStages, bool kDynamic, bool kTmaQ>
void launch_variant(const Maps& maps, const Params& p, int64_t items, cudaStream_t stream) {
  auto kernel = prefill_hopper_kernel<T, Kv, kOverlap, kPingpong, kStages, kDynamic, kTmaQ>;
  constexpr int smem_bytes = kSmemBytes<kStages, kIsFp8<Kv>>;
  static PerDevice<bool> configured;
  configured.get([&](int) {
    cuda_check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes),
               "paged_attention_prefill_hopper: cudaFuncSetAttribute");
    return true;
  });
  const int num_sms = sm_count();
  // Persistent: one block per SM (its shared memory allows no second), each taking work items in turn.
  const int64_t grid = persistent_grid ? std::min<int64_t>(items, num_sms) : items;
  launch_programmatic(kernel, dim3(static_cast<unsigned>(grid)), dim3(kThreads), smem_bytes, stream,
                      "paged_attention_prefill_hopper kernel launch", maps.k, maps.v, maps.q, p);
}

// The pipeline of variant bits 0..2 with a static or dynamic schedule, Q loaded by the consumers or the producer.
template <typename T, typename Kv, bool kDynamic, bool kTmaQ>
void launch_pipeline(int variant, const Maps& maps, const Params& p, int64_t items, cudaStream_t stream) {
  if constexpr (!kIsFp8<Kv>) {
    switch (variant) {
      case 1: return launch_variant<T, Kv, true, false, 2, kDynamic, kTmaQ>(maps, p, items, stream);
      case 3: return launch_variant<T, Kv, true, true, 2, kDynamic, kTmaQ>(maps, p, items, stream);
      case 4: return launch_variant<T, Kv, false, false, 3, kDynamic, kTmaQ>(maps, p, items, stream);
      case 5: return launch_variant<T, Kv, true, false, 3, kDynamic, kTmaQ>(maps, p, items, stream);
      case 6: return launch_variant<T, Kv, false, true, 3, kDynamic, kTmaQ>(maps, p, items, stream);
      case 7: return launch_variant<T, Kv, true, true, 3, kDynamic, kTmaQ>(maps, p, items, stream);
      default: break;
    }
  }
  if (variant == 2) return launch_variant<T, Kv, false, true, 2, kDynamic, kTmaQ>(maps, p, items, stream);
  return launch_variant<T, Kv, false, false, 2, kDynamic, kTmaQ>(maps, p, items, stream);
}

template <typename T, typename Kv, bool kTmaQ>
void launch_schedule(int variant, const Maps& maps, const Params& p, int64_t items, cudaStream_t stream) {
  if (variant & 8) return launch_pipeline<T, Kv, true, kTmaQ>(variant & 7, maps, p, items, stream);
  return launch_pipeline<T, Kv, false, kTmaQ>(variant & 7, maps, p, items, stream);
}

// FP8 caches take two stages and no overlap whatever the variant says: a third stage does not fit beside the e4m3
// ring, and the overlap's registers (240) do not fit beside the converters' (40; the overlap spills at 232); and
// their Q is converted on its way into shared memory, so the consumers load it. tma_q: bit 4 set and q's tile is
// one box (G divides the 128 rows).
template <typename T, typename Kv>
void launch(const Maps& maps, bool tma_q, const Params& p, int64_t items, cudaStream_t stream) {
  if constexpr (kIsFp8<Kv>) {
    return launch_schedule<T, Kv, false>(kernel_variant & (2 | 8), maps, p, items, stream);
  } else {
    if (tma_q) return launch_schedule<T, Kv, true>(kernel_variant & 15, maps, p, items, stream);
    return launch_schedule<T, Kv, false>(kernel_variant & 15, maps, p, items, stream);
  }
}

}  // namespace

void set_paged_attention_prefill_hopper_persistent(bool persistent) { persistent_grid = persistent; }
int set_paged_attention_prefill_hopper_variant(int variant) {
  if (variant < 0 || variant >= kPrefillHopperVariants) {
    throw std::invalid_argument("set_paged_attention_prefill_hopper_variant: variant must be 0.." +
                                std::to_string(kPrefillHopperVariants - 1));
  }
  return std::exchange(kernel_variant, variant);
}

bool paged_attention_prefill_hopper_available(int device) {
  static PerDevice<bool> available;
  int current = 0;
  cuda_check(cudaGetDevice(&current), "cudaGetDevice");
  if (current != device) cuda_check(cudaSetDevice(device), "cudaSetDevice");
  const bool result = available.get([](int dev) {
    cudaDeviceProp prop{};
    cuda_check(cudaGetDeviceProperties(&prop, dev), "cudaGetDeviceProperties");
    if (prop.major != 9 || prop.minor != 0) return false;
    // Built for sm_90a: the kernel's binary is Hopper's own (else this file compiled to an empty body).
    cudaFuncAttributes attr{};
    if (cudaFuncGetAttributes(&attr, prefill_hopper_kernel<__nv_bfloat16, __nv_bfloat16, false, false, 2, false, false>) !=
        cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    return attr.binaryVersion == 90;
  });
  if (current != device) cuda_check(cudaSetDevice(current), "cudaSetDevice");
  return result;
}

void paged_attention_prefill_hopper(const PrefillArgs& a) {
  const std::string op = "paged_attention_prefill_hopper: ";
  const int shift = check_paged_attention(op, a);
  if (a.page_size < kBoxKeys) throw std::invalid_argument(op + "page_size must be at least 16");
  if (a.batch < 0 || a.num_kv_heads > 65535) throw std::invalid_argument(op + "batch or heads out of range");
  if (a.max_query_len < 0 || a.max_query_len > (int64_t{1} << 24)) throw std::invalid_argument(op + "max_query_len out of range");
  if (a.num_pages * a.page_size >= (int64_t{1} << 31) - 1) throw std::invalid_argument(op + "the pool has too many slots");
  if (a.num_tokens < 0 || a.num_tokens >= (int64_t{1} << 31)) throw std::invalid_argument(op + "num_tokens out of range");
  if (a.batch == 0 || a.max_query_len == 0) return;
  for (uintptr_t ptr : {a.q, a.k_cache, a.v_cache, a.out}) {
    if (ptr == 0 || !aligned16(ptr)) throw std::invalid_argument(op + "q, caches and out must be 16-byte aligned");
  }
  for (uintptr_t ptr : {a.query_start, a.page_table, a.kv_lens}) {
    if (ptr == 0 || ptr % 4 != 0) throw std::invalid_argument(op + "query_start, page_table and kv_lens must be int32");
  }
  const bool fp8 = a.kv_dtype == kFP8E4M3;  // check_paged_attention: q's dtype or e4m3 with positive scales
  const int64_t group = a.num_heads / a.num_kv_heads;
  const int64_t slots = a.num_pages * a.page_size;
  const int64_t m_tiles = (a.max_query_len * group + kBM - 1) / kBM;
  const int64_t blocks = m_tiles * a.batch * a.num_kv_heads;  // work items
  if (blocks > (int64_t{1} << 31) - 1) throw std::invalid_argument(op + "too many query tiles");
  Params p{reinterpret_cast<const void*>(a.q), reinterpret_cast<const int*>(a.query_start),
           reinterpret_cast<const int*>(a.page_table), reinterpret_cast<const int*>(a.kv_lens),
           reinterpret_cast<void*>(a.out), static_cast<int>(a.batch), static_cast<int>(a.num_heads),
           static_cast<int>(a.num_kv_heads), static_cast<int>(group), shift, static_cast<int>(a.max_pages),
           static_cast<int>(slots), static_cast<int>(a.num_pages), static_cast<int>(m_tiles),
           static_cast<float>(a.scale * (fp8 ? a.k_scale : 1.0)) * kLog2e, static_cast<float>(fp8 ? a.v_scale : 1.0), 0};
  p.section_pairs = static_cast<int>(std::min<int64_t>(kSectionPairs, a.batch * a.num_kv_heads));
  Maps maps;
  maps.k = pool_map(reinterpret_cast<const void*>(a.k_cache), a.kv_dtype, slots, a.num_kv_heads);
  maps.v = pool_map(reinterpret_cast<const void*>(a.v_cache), a.kv_dtype, slots, a.num_kv_heads);
  // Q by the producer needs q's row count (0: not given): its map's bounds, past which a box reads zeros.
  const bool tma_q = (kernel_variant & kVariantTmaQ) && !fp8 && kBM % group == 0 && a.num_tokens > 0;
  maps.q = tma_q ? q_tile_map(reinterpret_cast<const void*>(a.q), a.dtype, a.num_tokens, a.num_heads, group) : maps.k;
  auto s = reinterpret_cast<cudaStream_t>(a.stream);
  FASTQWEN_DISPATCH_DTYPE("paged_attention_prefill_hopper: ", a.dtype, kHalfTypes, T,
                          fp8 ? launch<T, Fp8E4M3>(maps, false, p, blocks, s) : launch<T, T>(maps, tma_q, p, blocks, s));
}

}  // namespace fastqwen
