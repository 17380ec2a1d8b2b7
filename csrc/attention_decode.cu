// Paged decode attention: one query token per sequence, on tensor cores.
//
// The G query heads that share a KV head form the first G rows of one m16 tile, so each K and V row is read from
// memory once for all of them. Each sequence is cut into chunks whose length depends only on the sequence's own
// length (not on the batch: a request's result must not depend on what runs beside it), planned once per step by
// a small kernel into per-sequence split offsets in device memory. A persistent grid walks the (chunk, KV head)
// work items. A block streams K and V 64 tokens at a time through a 3-stage cp.async pipeline (the loop is bound by
// memory, so the point is many bytes in flight) that runs on across its items: the next item's first tiles (and
// its Q) load while the current one's last tiles are computed and merged. Its four warps take 16 tokens of each tile
// each, keep their own online softmax, and merge in shared memory at the end of an item. Chunks of a split sequence
// are merged by log-sum-exp in a second kernel.
#include <algorithm>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "attention.h"
#include "common.cuh"
#include "cuda_check.h"
#include "device_cache.h"
#include "dtype.h"
#include "kv_fp8.cuh"
#include "launch.cuh"
#include "mma.cuh"
#include "paged_kv.cuh"

namespace fastqwen {
namespace {
using namespace mma;

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kTile = kKVTile;  // the unit chunks are cut in (a stage holds one or two of them)
constexpr int kStages = 3;
// The work items' record ring (decode_kernel's rec_ring): a record is copied kRecAhead items ahead of its use, as many
// as the load calls that a wait of the pipeline lags behind; its slots hold those, the item in use, and the one before
// it (in the prologue, which has no barrier, a thread may still read that one while thread 0 refills the next).
constexpr int kRecAhead = kStages - 1;
constexpr int kRecRing = kRecAhead + 2;
constexpr int kChunks = kD / 8;
// Tokens; shorter sequences are not split. An FP8 chunk is four times as long: a work item then streams twice the
// bytes of a 16-bit one, so the per-item costs (pipeline fill, merge of the warps, partial write) weigh less beside
// the conversions the FP8 tiles add (measured on an H100 at batch 64 x 4,096: 72% of the copy bandwidth with 256-token
// FP8 chunks, 83% with 512, 87% with 1,024).
constexpr int kMinChunk = 256;
constexpr int kMinChunkFp8 = 4 * kMinChunk;
constexpr float kLog2e = 1.4426950408889634f;
// The minimum chunks in use, [kv_fp8]: the constants above unless a benchmark set others (see attention.h).
int g_min_chunk[2] = {kMinChunk, kMinChunkFp8};
// Whether a block's pipeline runs on across its items (set_paged_attention_decode_prefetch_next, for comparison).
bool g_prefetch_next = true;
// Whether the plan also writes each chunk's record (b, start, end, split and count), which the decode kernel's
// loading threads read from a ring in shared memory, copied there items ahead (set_paged_attention_decode_item_records;
// off: each item's sequence is searched in the offsets, for comparison). Measured on an H200 against the plan's former
// table of each chunk's sequence (one dependent load, then the offsets, the length and the page ids), in turns:
// 1.0-2.3% faster from 64 sequences up (bf16 512 x 640: 454.0 against 460.1 us; FP8 pool 237.5 against 242.2), level
// at one sequence.
bool g_item_records = true;
static_assert(kThreads == kKVTileThreads, "load_kv_tile splits a tile over 128 threads");

// The split limit set for benchmarks (set_paged_attention_decode_max_splits), or 0: decode_split_rule's.
int g_max_splits = 0;
// Chunks up to this many tokens keep a sequence within one work item per SM; a sequence that would need longer ones
// is cut into up to kDecodeMaxSplits chunks instead. Measured in the engine (random Qwen3-8B, batch 1, one H200; 8 KV
// heads, so 16 chunks a sequence within the SMs): cut into at most 16 against at most 32, in turns, the step took
// 4.18 / 4.52 ms at 4k of context, 4.74 / 4.92 at 16k, 5.43-5.46 / 5.41-5.42 at 32k (bf16 KV): the gap closes
// linearly to about 29k, past which 32 chunks' parallelism pays for the items outnumbering the SMs (the kernel alone,
// at 32k: 79% of the copy bandwidth in 32 chunks, 64% in 16).
constexpr int kLongChunk = 1792;

// How a sequence is cut (decode_split_rule): into at most max_splits chunks while they stay within long_chunk
// tokens, else (long_chunk > 0) into up to kDecodeMaxSplits.
struct SplitRule {
  int max_splits, long_chunk;
};

// The chunk length of a sequence of len tokens: a multiple of the tile, at least min_chunk (kMinChunk, or
// kMinChunkFp8 for an FP8 cache), and as the rule says (at most kDecodeMaxSplits chunks either way).
__device__ __forceinline__ int chunk_len(int len, int min_chunk, SplitRule rule) {
  int want = (len + rule.max_splits - 1) / rule.max_splits;
  if (rule.long_chunk > 0 && want > rule.long_chunk) want = (len + kDecodeMaxSplits - 1) / kDecodeMaxSplits;
  want = max(min_chunk, want);
  return (want + kTile - 1) / kTile * kTile;
}

// A chunk's record: its sequence, its first and end token, and its index in the sequence with the sequence's count
// of chunks (split | num_splits << 8; both at most kDecodeMaxSplits).
__device__ __forceinline__ int4 chunk_record(int b, int start, int end, int split, int num_splits) {
  return make_int4(b, start, end, split | (num_splits << 8));
}

// split_offsets[b] = chunks of the sequences before b; split_offsets[batch] = all chunks; chunk c's record at
// records[c] (records null: none). One block.
__global__ void plan_kernel(const int* __restrict__ kv_lens, int* __restrict__ split_offsets, int4* __restrict__ records,
                            int batch, int min_chunk, SplitRule rule) {
  __shared__ int warp_sums[32];
  __shared__ int carry;
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int base = 0; base < batch; base += blockDim.x) {
    const int b = base + threadIdx.x;
    const int len = b < batch ? max(kv_lens[b], 0) : 0;
    const int clen = chunk_len(len, min_chunk, rule);
    const int n = b < batch ? max(1, (len + clen - 1) / clen) : 0;
    int incl = n;  // inclusive scan over the block
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += v;
    }
    if (lane == 31) warp_sums[warp] = incl;
    __syncthreads();
    if (warp == 0) {
      const int num_warps = blockDim.x >> 5;
      int w = lane < num_warps ? warp_sums[lane] : 0;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, w, o);
        if (lane >= o) w += v;
      }
      if (lane < num_warps) warp_sums[lane] = w;  // inclusive over warps
    }
    __syncthreads();
    const int before = carry + (warp > 0 ? warp_sums[warp - 1] : 0) + incl - n;
    if (b < batch) {
      split_offsets[b] = before;
      if (records != nullptr) {
        for (int c = 0; c < n; ++c) records[before + c] = chunk_record(b, c * clen, min(len, c * clen + clen), c, n);
      }
    }
    __syncthreads();
    if (threadIdx.x == blockDim.x - 1) carry = before + n;
    __syncthreads();
  }
  if (threadIdx.x == 0) split_offsets[batch] = carry;
}

struct Params {
  const void* q;
  const void* k_cache;
  const void* v_cache;
  const int* page_table;
  const int* kv_lens;
  const int* split_offsets;
  const int4* chunk_rec;  // the plan's chunk records (decode_plan_records), or null: item_of searches the offsets
  void* out;
  float* part_out;
  float* part_lse;
  int batch, num_heads, num_kv_heads, group, page_shift, max_pages;
  int64_t num_pages;
  float scale_log2;  // softmax scale * k_scale * log2(e)
  float v_scale;
  int min_chunk;     // as the plan was made with
  SplitRule split_rule;  // as the plan was made with
  bool plan_fresh;   // DecodeArgs::plan_fresh
  bool prefetch_next;  // the pipeline runs on into the next item (else it starts afresh at each item)
};

// One work item: a chunk of sequence b, for KV head kvh.
struct Item {
  int b, kvh, chunk_index, split, num_splits, start, end, n_tiles;
  const int* pages;
};

// The item from its chunk's record.
__device__ __forceinline__ Item item_of_record(const Params& p, int item, int4 rec, int tile) {
  Item it;
  it.chunk_index = item / p.num_kv_heads;
  it.kvh = item % p.num_kv_heads;
  it.b = rec.x;
  it.start = rec.y;
  it.end = rec.z;
  it.split = rec.w & 0xff;
  it.num_splits = rec.w >> 8;
  it.n_tiles = (max(it.end - it.start, 0) + tile - 1) / tile;
  it.pages = p.page_table + static_cast<int64_t>(it.b) * p.max_pages;
  return it;
}

// Chunk c's record as the plan writes it, worked out from the offsets (a binary search: about nine dependent loads)
// and the sequence's length, for a plan made without records.
__device__ __forceinline__ int4 searched_record(const Params& p, int c) {
  int lo = 0, hi = p.batch - 1;  // the sequence: last b with split_offsets[b] <= c
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (p.split_offsets[mid] <= c) lo = mid; else hi = mid - 1;
  }
  const int split = c - p.split_offsets[lo];
  const int len = max(p.kv_lens[lo], 0);
  const int clen = chunk_len(len, p.min_chunk, p.split_rule);  // as the plan cut it
  const int num_splits = p.split_offsets[lo + 1] - p.split_offsets[lo];
  return chunk_record(lo, split * clen, min(len, split * clen + clen), split, num_splits);
}

__device__ __forceinline__ Item item_of(const Params& p, int item, int tile) {
  const int c = item / p.num_kv_heads;
  return item_of_record(p, item, p.chunk_rec != nullptr ? p.chunk_rec[c] : searched_record(p, c), tile);
}

// The pipeline's shape for cache element type C. A stage holds 32 KB of K and V either way: 64 tokens of a 16-bit
// cache, 128 of an FP8 one, so both move as many bytes per stage and keep as many in flight.
template <typename C>
struct Shape {
  static constexpr bool kFp8 = kIsFp8<C>;
  static constexpr int kTile = kFp8 ? 2 * kKVTile : kKVTile;  // tokens per stage
  static constexpr int kWarpKeys = kTile / kWarps;             // 16 or 32: one or two m16n8k16 key steps
  static constexpr int kSteps = kWarpKeys / 16;
  static constexpr int kStageElems = 2 * kTile * kD;           // K and V of one stage
  static constexpr int kStageBytes = kStageElems * static_cast<int>(sizeof(C));
  // An item's Q rides with its first tile, in that stage's Q slot: 16 swizzled rows (rows >= G zero) for the 16-bit
  // path's ldmatrix, the G <= 8 rows as they are for the FP8 path (which converts them to fp16 fragments itself).
  static constexpr int kQSlotBytes = kFp8 ? 8 * kD * 2 : 16 * kD * 2;
  static constexpr size_t kSmemBytes = kStages * (kStageBytes + kQSlotBytes);
  // The merge of an item's four warps uses the stage its last tile was computed from (no load is in flight there).
  static_assert(kWarps * 16 * 2 * 4 + kWarps * 8 * kD * 4 <= kStageBytes, "the merge fits in a stage");
};

// Q of this lane for the FP8 path, as the A fragments of the 8 k-steps over the head (rows >= 8 are zero, G <= 8),
// from q_row, its head's row in the stage's Q slot.
// The B fragments come from e4m3 rows read by ldmatrix in 2-byte units, so lane (g, c) holds dims 4c .. 4c + 3 of
// each 16: k-step slot (2c, 2c + 1) is dims (4c, 4c + 1) and slot (2c + 8, 2c + 9) dims (4c + 2, 4c + 3). A dot
// product does not care in which order the dims are summed, so Q takes the same order.
template <typename T>
__device__ __forceinline__ void load_q_fp16(unsigned (&qa)[kD / 16][2], const T* q_row, bool valid, int lane) {
#pragma unroll
  for (int kk = 0; kk < kD / 16; ++kk) {
    qa[kk][0] = qa[kk][1] = 0u;
    if (valid) {
      const Pack<T, 4> v = *reinterpret_cast<const Pack<T, 4>*>(q_row + kk * 16 + (lane & 3) * 4);
      float x[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) x[e] = fminf(fmaxf(Cvt<T>::to_f(v.v[e]), -65504.0f), 65504.0f);  // fp16's range
      qa[kk][0] = Mma<__half>::pack(x[0], x[1]);
      qa[kk][1] = Mma<__half>::pack(x[2], x[3]);
    }
  }
}

template <typename T, typename C>
__global__ void __launch_bounds__(kThreads, 2) decode_kernel(const Params p) {
  using S = Shape<C>;
  // The m16 tile's rows 8..15 (the accumulators' second half, h = 1) hold no query head: G <= 8
  // (check_paged_attention). Their scores are zero (zero Q rows) and nothing reads their outputs, so the softmax, the
  // rescale and the final merge skip them, and P's rows 8..15 go into the P V multiply as zeros. Measured on an H200
  // against the kernel that computed them (rows 0..7 are computed as before: an mma's rows do not mix): 1-3% faster in
  // every case of bench/kernels.py's (bf16 512 x 100..1,200 407 against 412 us, FP8 268 against 272).
  constexpr int kHalves = 1;
  using M = typename std::conditional<S::kFp8, __half, T>::type;  // the tensor cores' input type
  constexpr int kTile = S::kTile;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  C* sKV = reinterpret_cast<C*>(smem_raw);  // kStages stages of K then V
  unsigned char* sQ = smem_raw + kStages * S::kStageBytes;  // kStages Q slots
  const T* q = static_cast<const T*>(p.q);
  const C* k_cache = static_cast<const C*>(p.k_cache);
  const C* v_cache = static_cast<const C*>(p.v_cache);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int G = p.group;
  // The plan, kv_lens and the page table were written before the layers, so they may be read before the wait: the
  // first item's bounds, and its first tiles' page ids into L1, come off the path from the wait to the K/V loads.
  const int total_items = p.split_offsets[p.batch] * p.num_kv_heads;
  Item first{};
  // With records, the record of the block's item j waits in rec_ring[j % kRecRing] before the loading threads move
  // on to it: thread 0 copies it there with cp.async kRecAhead items ahead, inside that moment's load group, so no
  // thread waits for the record's load. (Held in registers one item ahead instead, the compiler moved each loaded
  // record into its loop registers right after the load, which waited for it: Nsight Compute put 11% of the bf16
  // kernel's stall samples at 512 x 640 on that move, 7% of the FP8 one's.) Item j + kRecAhead is moved on to at least
  // kRecAhead load calls after item j, and every call from the kStages-th on follows a wait that leaves only the
  // newest kStages - 2 groups in flight, then a barrier, so the copy has landed for every thread. Items 1 ..
  // kRecAhead are read here.
  __shared__ int4 rec_ring[kRecRing];
  const bool several_items = p.chunk_rec != nullptr && total_items > static_cast<int>(gridDim.x);  // (the same for all)
  if (several_items && tid >= 1 && tid <= kRecAhead && blockIdx.x + tid * gridDim.x < total_items) {
    rec_ring[tid] = p.chunk_rec[(blockIdx.x + tid * gridDim.x) / p.num_kv_heads];
  }
  if (blockIdx.x < total_items) {
    first = item_of(p, blockIdx.x, kTile);
    const int head = min(first.end, first.start + (kStages - 1) * kTile);  // the prologue's tokens
    const int lo_page = first.start >> p.page_shift;
    const int n_pages = head > first.start ? ((head - 1) >> p.page_shift) - lo_page + 1 : 0;
    for (int i = tid; i < n_pages && lo_page + i < p.max_pages; i += kThreads) {
      asm volatile("prefetch.global.L1 [%0];" ::"l"(first.pages + lo_page + i));
    }
  }
  if (several_items) __syncthreads();  // (rec_ring's first records; a block of one item or none never reads them)
  griddep_wait();               // q and the new token's K and V come from the kernel before (see common.cuh)
  griddep_launch_dependents();  // the merge may start (it waits for this kernel's end)

  // The loads: one stream of slots over the block's items (blockIdx.x, + gridDim.x, ...), each item taking
  // max(1, n_tiles) slots (an empty one loads nothing), slot L into stage L % kStages, kStages - 1 slots ahead of the
  // compute. An item's first slot also brings its Q into the stage's Q slot, and its Item into item_slot (thread 0;
  // read by the compute at that slot, after the barrier that follows the copy's wait). Unless p.prefetch_next, the
  // loads stop at the end of the item being computed and the next item starts them afresh (the kernel before).
  __shared__ Item item_slot[kStages];
  int load_item = blockIdx.x, load_t = 0, load_slot = 0, load_ord = 0;  // load_ord: load_item's place, j
  Item load_it = first;
  int compute_item = blockIdx.x;
  auto issue_load = [&]() {
    if (load_item < total_items && (p.prefetch_next || load_item == compute_item)) {
      const int stage = load_slot % kStages;
      if (load_t == 0) {
        const T* q_rows = q + (static_cast<int64_t>(load_it.b) * p.num_heads + load_it.kvh * G) * kD;
        T* dq = reinterpret_cast<T*>(sQ + stage * S::kQSlotBytes);
        if constexpr (!S::kFp8) {  // 16 rows of 16 chunks, rows >= G zero
          for (int c = tid; c < 16 * kChunks; c += kThreads) {
            const int row = c / kChunks, chunk = c % kChunks;
            const bool valid = row < G;
            cp_async16(dq + swz(row, chunk), valid ? q_rows + row * kD + chunk * 8 : q, valid);
          }
        } else {  // the G rows as they are
          for (int c = tid; c < G * kChunks; c += kThreads) cp_async16(dq + c * 8, q_rows + c * 8, true);
        }
        if (tid == 0) item_slot[stage] = load_it;
      }
      if (load_t < load_it.n_tiles) {
        C* dk = sKV + stage * S::kStageElems;
        load_kv_tile<kTile>(dk, dk + kTile * kD, k_cache, v_cache, load_it.pages, load_it.start + load_t * kTile,
                            load_it.end, p.page_shift, p.max_pages, p.num_pages, p.num_kv_heads, load_it.kvh, tid);
      }
      ++load_slot;
      if (++load_t >= max(1, load_it.n_tiles)) {
        load_item += gridDim.x;
        load_t = 0;
        if (load_item < total_items) {
          if (p.chunk_rec != nullptr) {
            ++load_ord;
            load_it = item_of_record(p, load_item, rec_ring[load_ord % kRecRing], kTile);
            const int ahead = load_item + kRecAhead * gridDim.x;
            if (tid == 0 && ahead < total_items) {
              cp_async16(&rec_ring[(load_ord + kRecAhead) % kRecRing], p.chunk_rec + ahead / p.num_kv_heads, true);
            }
            // its first tile's page ids into L1 while this slot is computed (the next call loads that tile)
            if (tid == 0 && load_it.n_tiles > 0 && (load_it.start >> p.page_shift) < p.max_pages) {
              asm volatile("prefetch.global.L1 [%0];" ::"l"(load_it.pages + (load_it.start >> p.page_shift)));
            }
          } else {
            load_it = item_of(p, load_item, kTile);
          }
        }
      }
    }
    cp_async_commit();  // (one group a call, empty or not: the waits count groups)
  };
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) issue_load();

  int slot = 0;  // the compute's slot in the stream
  for (; compute_item < total_items; compute_item += gridDim.x) {
    if (!p.prefetch_next && compute_item != static_cast<int>(blockIdx.x)) {
#pragma unroll
      for (int i = 0; i < kStages - 1; ++i) issue_load();  // this item's first slots, afresh
    }
    Item it{};
    int start = 0, end = 0, n_tiles = 0;
    float o[16][4];
#pragma unroll
    for (int d = 0; d < 16; ++d)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[d][e] = 0.0f;
    float m_run[kHalves] = {-INFINITY}, l_run[kHalves] = {0.0f};
    unsigned qa[kD / 16][4];   // 16-bit caches: Q's A fragments, from the Q slot at the first tile
    unsigned qa8[kD / 16][2];  // FP8: rows 0..7 of each A fragment (rows 8..15 are zero)

    for (int t = 0; t == 0 || t < n_tiles; ++t, ++slot) {
      cp_async_wait<kStages - 2>();  // slot `slot` (and with the item's first, its Q) landed for this thread
      __syncthreads();               // ... for every thread; and every warp is done with the slot before's stage
      const int stage = slot % kStages;
      if (t == 0) {
        it = item_slot[stage];
        start = it.start;
        end = it.end;
        n_tiles = it.n_tiles;
      }
      issue_load();
      if (n_tiles == 0) continue;  // (an empty item's one slot: nothing to compute)
      if (t == 0) {
        const T* dq = reinterpret_cast<const T*>(sQ + stage * S::kQSlotBytes);
        if constexpr (!S::kFp8) {
#pragma unroll
          for (int kk = 0; kk < kD / 16; ++kk) ldsm_x4(qa[kk], dq + swz(lane & 15, kk * 2 + (lane >> 4)));
        } else {
          const int row = lane >> 2;
          load_q_fp16(qa8, dq + min(row, G - 1) * kD, row < G, lane);
        }
      }
      const C* tk = sKV + stage * S::kStageElems + warp * S::kWarpKeys * kD;  // this warp's keys
      const C* tv = tk + kTile * kD;
      float s[2 * S::kSteps][4];
#pragma unroll
      for (int ni = 0; ni < 2 * S::kSteps; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[ni][e] = 0.0f;
      if constexpr (!S::kFp8) {
#pragma unroll
        for (int kk = 0; kk < kD / 16; ++kk) {
          unsigned bk[4];
          ldsm_x4(bk, tk + swz((lane & 7) + ((lane >> 4) << 3), kk * 2 + ((lane >> 3) & 1)));
          Mma<M>::run(s[0], qa[kk], bk[0], bk[1]);
          Mma<M>::run(s[1], qa[kk], bk[2], bk[3]);
        }
      } else {
        // e4m3 rows of 128 bytes. ldmatrix matrix i (lanes 8i .. 8i + 7 give its rows): keys (i & 1) * 8 + 0..7 of
        // the step, 16-byte chunk 2 jj + (i >> 1); each register is 4 e4m3 dims of one key: a k16 B fragment.
        const int key_in_step = ((lane >> 3) & 1) * 8 + (lane & 7);
#pragma unroll
        for (int step = 0; step < S::kSteps; ++step) {
          const int key = step * 16 + key_in_step;
#pragma unroll
          for (int jj = 0; jj < kD / 32; ++jj) {
            unsigned r[4];
            ldsm_x4(r, tk + key * kD + (((jj * 2 + (lane >> 4)) ^ (key & 7)) << 4));
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const unsigned a[4] = {qa8[jj * 2 + h][0], 0u, qa8[jj * 2 + h][1], 0u};
#pragma unroll
              for (int nt = 0; nt < 2; ++nt) {
                const unsigned x = r[2 * h + nt];
                Mma<M>::run(s[step * 2 + nt], a, e4m3x2_lo(x), e4m3x2_hi(x));
              }
            }
          }
        }
      }
      const int key0 = start + t * kTile + warp * S::kWarpKeys;
#pragma unroll
      for (int h = 0; h < kHalves; ++h) {
        float mx = -INFINITY;
#pragma unroll
        for (int ni = 0; ni < 2 * S::kSteps; ++ni) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float x = s[ni][h * 2 + e] * p.scale_log2;
            if (key0 + ni * 8 + (lane & 3) * 2 + e >= end) x = -INFINITY;
            s[ni][h * 2 + e] = x;
            mx = fmaxf(mx, x);
          }
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m_run[h], mx);
        const float m_use = m_new == -INFINITY ? 0.0f : m_new;
        const float alpha = fast_exp2(m_run[h] - m_use);
        m_run[h] = m_new;
        float sum = 0.0f;
#pragma unroll
        for (int ni = 0; ni < 2 * S::kSteps; ++ni) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float pv = fast_exp2(s[ni][h * 2 + e] - m_use);
            s[ni][h * 2 + e] = pv;
            sum += pv;
          }
        }
        l_run[h] = l_run[h] * alpha + sum;
#pragma unroll
        for (int d = 0; d < 16; ++d) {
          o[d][h * 2] *= alpha;
          o[d][h * 2 + 1] *= alpha;
        }
      }
#pragma unroll
      for (int step = 0; step < S::kSteps; ++step) {
        unsigned pa[4] = {Mma<M>::pack(s[2 * step][0], s[2 * step][1]),
                          0u,  // (rows 8..15: no head)
                          Mma<M>::pack(s[2 * step + 1][0], s[2 * step + 1][1]),
                          0u};
        if constexpr (!S::kFp8) {
#pragma unroll
          for (int dp = 0; dp < kD / 16; ++dp) {
            unsigned bv[4];
            ldsm_x4_trans(bv, tv + swz((lane & 7) + (((lane >> 3) & 1) << 3), dp * 2 + (lane >> 4)));
            Mma<M>::run(o[2 * dp], pa, bv[0], bv[1]);
            Mma<M>::run(o[2 * dp + 1], pa, bv[2], bv[3]);
          }
        } else {
          // Transposed, in 2-byte units: a register holds keys 2c and 2c + 1 at dims 2g and 2g + 1 of a 16-dim
          // chunk; regrouped by dim, each half is a B fragment. Output n-tile 2 blk + par holds dims 2n + par of
          // chunk blk (see out_dim below).
          const int key = step * 16 + ((lane >> 3) & 1) * 8 + (lane & 7);
#pragma unroll
          for (int jj = 0; jj < kD / 32; ++jj) {
            unsigned r[4];
            ldsm_x4_trans(r, tv + key * kD + (((jj * 2 + (lane >> 4)) ^ (key & 7)) << 4));
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const int blk = jj * 2 + h;
              const unsigned lo_keys = __byte_perm(r[2 * h], 0u, 0x3120);      // keys 2c, 2c + 1
              const unsigned hi_keys = __byte_perm(r[2 * h + 1], 0u, 0x3120);  // keys 2c + 8, 2c + 9
              Mma<M>::run(o[2 * blk], pa, e4m3x2_lo(lo_keys), e4m3x2_lo(hi_keys));
              Mma<M>::run(o[2 * blk + 1], pa, e4m3x2_hi(lo_keys), e4m3x2_hi(hi_keys));
            }
          }
        }
      }
    }
    __syncthreads();  // every warp is done with the item's last stage: the merge of the four warps uses it
    const int b = it.b, kvh = it.kvh, chunk_index = it.chunk_index, num_splits = it.num_splits;

    // The head dim of accumulator o[d][e] (e = 0, 1; rows g and g + 8 alike).
    auto out_dim = [&](int d, int e) {
      return S::kFp8 ? (d >> 1) * 16 + (lane & 3) * 4 + e * 2 + (d & 1) : d * 8 + (lane & 3) * 2 + e;
    };
    // Per warp and row: the running max and sum (quad-reduced), and the unnormalized output of rows < G.
    float* sm_m = reinterpret_cast<float*>(sKV + ((slot - 1) % kStages) * S::kStageElems);  // [kWarps][16]
    float* sm_l = sm_m + kWarps * 16;                   // [kWarps][16]
    float* sm_o = sm_l + kWarps * 16;                   // [kWarps][8][kD]
#pragma unroll
    for (int h = 0; h < kHalves; ++h) {
      float l = l_run[h];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      const int row = (lane >> 2) + h * 8;
      if ((lane & 3) == 0) {
        sm_m[warp * 16 + row] = m_run[h];
        sm_l[warp * 16 + row] = l;
      }
      if (row < G) {
#pragma unroll
        for (int d = 0; d < 16; ++d) {
          sm_o[(warp * 8 + row) * kD + out_dim(d, 0)] = o[d][h * 2];
          sm_o[(warp * 8 + row) * kD + out_dim(d, 1)] = o[d][h * 2 + 1];
        }
      }
    }
    __syncthreads();
    for (int i = tid; i < G * kD; i += kThreads) {
      const int row = i / kD, d = i % kD;
      float m_all = -INFINITY;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) m_all = fmaxf(m_all, sm_m[w * 16 + row]);
      float l_all = 0.0f, acc = 0.0f;
      if (m_all != -INFINITY) {
#pragma unroll
        for (int w = 0; w < kWarps; ++w) {
          const float scale = fast_exp2(sm_m[w * 16 + row] - m_all);
          l_all += sm_l[w * 16 + row] * scale;
          acc += sm_o[(w * 8 + row) * kD + d] * scale;
        }
      }
      const float result = l_all > 0.0f ? acc / l_all * p.v_scale : 0.0f;
      const int64_t head_row = static_cast<int64_t>(b) * p.num_heads + kvh * G + row;
      if (num_splits == 1) {
        static_cast<T*>(p.out)[head_row * kD + d] = Cvt<T>::from_f(result);
      } else {
        const int64_t part = static_cast<int64_t>(chunk_index) * p.num_heads + kvh * G + row;
        p.part_out[part * kD + d] = result;
        if (d == 0) p.part_lse[part] = l_all > 0.0f ? m_all + log2f(l_all) : -INFINITY;  // log2 units
      }
    }
    __syncthreads();  // shared memory is reused by the next item
  }
  cp_async_wait<0>();  // (only empty groups can be left)
}

// out[b, h] = the chunks' outputs weighted by 2^(lse - max lse), normalized; single-chunk sequences were written
// directly by the decode kernel.
template <typename T>
__global__ void merge_kernel(const float* __restrict__ part_out, const float* __restrict__ part_lse,
                             const int* __restrict__ split_offsets, T* __restrict__ out, int num_heads) {
  const int b = blockIdx.x / num_heads, h = blockIdx.x % num_heads;
  const int first = split_offsets[b], n = split_offsets[b + 1] - first;  // the plan came before the layers
  griddep_wait();               // the chunks' results come from the decode kernel (see common.cuh)
  griddep_launch_dependents();  // o_proj's GEMV may start streaming its weights
  if (n <= 1) return;
  // One round trip to L2 whatever the number of chunks (a loop of loads would wait for each in turn, and holding all
  // 32 in registers would halve the blocks in flight of a large batch): each thread prefetches its dim of every
  // chunk's output into L1 while warp 0 turns the chunks' log-sum-exps (one a lane) into weights; the sum then reads L1.
  static_assert(kDecodeMaxSplits <= 32, "one lane per chunk");
  __shared__ float weight[kDecodeMaxSplits];
  __shared__ float weight_sum;
  const int d = threadIdx.x;
  const float* part = part_out + (static_cast<int64_t>(first) * num_heads + h) * kD + d;  // chunk s at s * stride
  const int64_t stride = static_cast<int64_t>(num_heads) * kD;
  for (int s = 0; s < n; ++s) asm volatile("prefetch.global.L1 [%0];" ::"l"(part + s * stride));
  if (d < 32) {
    const float lse = d < n ? part_lse[static_cast<int64_t>(first + d) * num_heads + h] : -INFINITY;
    float m = lse;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    const float w = m != -INFINITY && d < n ? exp2f(lse - m) : 0.0f;  // log2 units
    if (d < kDecodeMaxSplits) weight[d] = w;
    const float sum = warp_sum(w);
    if (d == 0) weight_sum = sum;
  }
  __syncthreads();
  float o = 0.0f;
  for (int s = 0; s < n; ++s) o += weight[s] * part[s * stride];
  out[static_cast<int64_t>(blockIdx.x) * kD + d] = Cvt<T>::from_f(weight_sum > 0.0f ? o / weight_sum : 0.0f);
}

template <typename T, typename C>
void launch(const Params& p, cudaStream_t stream) {
  // Persistent grid: as many blocks as fit on the device at once, found once per kernel and device (the opt-in to
  // large shared memory is per device too).
  constexpr size_t kSmemBytes = Shape<C>::kSmemBytes;
  static PerDevice<int> grids;
  const int grid = grids.get([](int device) {
    cuda_check(cudaFuncSetAttribute(decode_kernel<T, C>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(kSmemBytes)),
               "paged_attention_decode: cudaFuncSetAttribute");
    int sms = 0, per_sm = 0;
    cuda_check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device),
               "paged_attention_decode: cudaDeviceGetAttribute");
    cuda_check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, decode_kernel<T, C>, kThreads, kSmemBytes),
               "paged_attention_decode: occupancy");
    return std::max(1, sms * per_sm);
  });
  if (p.plan_fresh) {  // the kernel reads the plan before its griddep wait: the plan's kernel must have completed
    decode_kernel<T, C><<<grid, kThreads, kSmemBytes, stream>>>(p);
    cuda_check_launch("paged_attention_decode kernel launch");
  } else {
    launch_programmatic(decode_kernel<T, C>, dim3(grid), dim3(kThreads), kSmemBytes, stream,
                        "paged_attention_decode kernel launch", p);
  }
  launch_programmatic(merge_kernel<T>, dim3(static_cast<unsigned>(p.batch * p.num_heads)), dim3(kD), 0, stream,
                      "paged_attention_decode merge launch", p.part_out, p.part_lse, p.split_offsets,
                      static_cast<T*>(p.out), p.num_heads);
}

}  // namespace

namespace {
// The plan's chunk records (attention.h: decode_plan_record_offset), or null while they are off.
int4* decode_plan_records(uintptr_t split_offsets, int64_t batch) {
  if (!g_item_records) return nullptr;
  return reinterpret_cast<int4*>(reinterpret_cast<int*>(split_offsets) + decode_plan_record_offset(batch));
}

// The plan's and the kernel's rule (they must agree): a benchmark's limit alone, or one work item per SM while the
// chunks stay within kLongChunk tokens.
SplitRule decode_split_rule(int64_t num_kv_heads) {
  if (g_max_splits != 0) return {g_max_splits, 0};
  return {decode_max_splits(num_kv_heads), kLongChunk};
}
}  // namespace

int decode_max_splits(int64_t num_kv_heads) {
  if (num_kv_heads < 1) throw std::invalid_argument("decode_max_splits: num_kv_heads must be positive");
  if (g_max_splits != 0) return g_max_splits;
  return static_cast<int>(std::clamp<int64_t>(sm_count() / num_kv_heads, 1, kDecodeMaxSplits));
}

void paged_attention_decode_plan(uintptr_t kv_lens, uintptr_t split_offsets, int64_t batch, bool kv_fp8,
                                 int64_t num_kv_heads, uintptr_t stream) {
  if (batch < 0 || batch > (int64_t{1} << 20)) throw std::invalid_argument("paged_attention_decode_plan: bad batch");
  if (num_kv_heads < 1 || num_kv_heads > 1024) {
    throw std::invalid_argument("paged_attention_decode_plan: num_kv_heads out of range");
  }
  if (kv_lens == 0 || split_offsets == 0 || kv_lens % 4 != 0 || split_offsets % 4 != 0) {
    throw std::invalid_argument("paged_attention_decode_plan: kv_lens and split_offsets must be int32 buffers");
  }
  plan_kernel<<<1, 1024, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      reinterpret_cast<const int*>(kv_lens), reinterpret_cast<int*>(split_offsets),
      decode_plan_records(split_offsets, batch), static_cast<int>(batch), g_min_chunk[kv_fp8 ? 1 : 0],
      decode_split_rule(num_kv_heads));
  cuda_check_launch("paged_attention_decode_plan launch");
}

void set_paged_attention_decode_max_splits(int64_t splits) {
  if (splits < 0 || splits > kDecodeMaxSplits) {
    throw std::invalid_argument("set_paged_attention_decode_max_splits: splits must be in [0, " +
                                std::to_string(kDecodeMaxSplits) + "] (0: the rule)");
  }
  g_max_splits = static_cast<int>(splits);
}

void set_paged_attention_decode_min_chunk(bool kv_fp8, int64_t tokens) {
  if (tokens == 0) tokens = kv_fp8 ? kMinChunkFp8 : kMinChunk;
  if (tokens < kTile || tokens > (int64_t{1} << 16) || tokens % kTile != 0) {
    throw std::invalid_argument("set_paged_attention_decode_min_chunk: tokens must be a multiple of " +
                                std::to_string(kTile) + " in [" + std::to_string(kTile) + ", 65536]");
  }
  g_min_chunk[kv_fp8 ? 1 : 0] = static_cast<int>(tokens);
}

void set_paged_attention_decode_prefetch_next(bool prefetch_next) { g_prefetch_next = prefetch_next; }

void set_paged_attention_decode_item_records(bool item_records) { g_item_records = item_records; }

void paged_attention_decode(const DecodeArgs& a) {
  const std::string op = "paged_attention_decode: ";
  const int shift = check_paged_attention(op, a);
  if (a.batch < 0 || a.batch > (int64_t{1} << 20) || a.num_heads > 1024) {
    throw std::invalid_argument(op + "batch or heads out of range");
  }
  if (a.workspace_rows < a.batch * a.num_heads * kDecodeMaxSplits) {
    throw std::invalid_argument(op + "the workspace needs batch * num_heads * " + std::to_string(kDecodeMaxSplits) +
                                " rows");
  }
  if (a.batch == 0) return;
  for (uintptr_t ptr : {a.q, a.k_cache, a.v_cache, a.out, a.part_out}) {
    if (ptr == 0 || !aligned16(ptr)) throw std::invalid_argument(op + "q, caches, out and workspace must be 16-byte aligned");
  }
  for (uintptr_t ptr : {a.page_table, a.kv_lens, a.split_offsets, a.part_lse}) {
    if (ptr == 0 || ptr % 4 != 0) throw std::invalid_argument(op + "page_table, kv_lens and split_offsets must be int32");
  }
  const bool fp8 = a.kv_dtype == kFP8E4M3;
  Params p{reinterpret_cast<const void*>(a.q), reinterpret_cast<const void*>(a.k_cache),
           reinterpret_cast<const void*>(a.v_cache), reinterpret_cast<const int*>(a.page_table),
           reinterpret_cast<const int*>(a.kv_lens), reinterpret_cast<const int*>(a.split_offsets),
           decode_plan_records(a.split_offsets, a.batch),
           reinterpret_cast<void*>(a.out), reinterpret_cast<float*>(a.part_out), reinterpret_cast<float*>(a.part_lse),
           static_cast<int>(a.batch), static_cast<int>(a.num_heads), static_cast<int>(a.num_kv_heads),
           static_cast<int>(a.num_heads / a.num_kv_heads), shift, static_cast<int>(a.max_pages), a.num_pages,
           static_cast<float>(a.scale * (fp8 ? a.k_scale : 1.0)) * kLog2e, static_cast<float>(fp8 ? a.v_scale : 1.0),
           g_min_chunk[fp8 ? 1 : 0], decode_split_rule(a.num_kv_heads), a.plan_fresh, g_prefetch_next};
  auto s = reinterpret_cast<cudaStream_t>(a.stream);
  FASTQWEN_DISPATCH_DTYPE("paged_attention_decode: ", a.dtype, kHalfTypes, T,
                          fp8 ? launch<T, Fp8E4M3>(p, s) : launch<T, T>(p, s));
}

}  // namespace fastqwen
