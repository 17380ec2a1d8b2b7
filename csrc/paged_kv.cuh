// Walking the paged KV cache ([num_pages, page_size, H_kv, 128], page_size a power of two), shared by the attention
// kernels: the host-side checks of that geometry, and the copy of one 64-token K/V tile into shared memory.
#pragma once

#include <stdexcept>
#include <string>

#include "attention.h"
#include "dtype.h"
#include "kv_fp8.cuh"
#include "mma.cuh"

namespace fastqwen {

static_assert(mma::kD == kAttentionHeadDim, "the tiles are as wide as the head size the host checks");

constexpr int kKVTile = 64;  // tokens per K/V tile
constexpr int kKVTileThreads = 128;

// Throws std::invalid_argument (prefixed by op) unless head_dim is 128, 1 to 8 query heads share a KV head, page_size
// is a power of two up to 1024, the page table and pool are non-empty, dtype is fp16 or bf16, the caches hold dtype
// or fp8 e4m3 and the scales are positive and finite. Returns log2(page_size).
inline int check_paged_attention(const std::string& op, const PagedAttentionArgs& a) {
  const int64_t head_dim = a.head_dim, num_heads = a.num_heads, num_kv_heads = a.num_kv_heads;
  const int64_t page_size = a.page_size, max_pages = a.max_pages, num_pages = a.num_pages;
  if (head_dim != kAttentionHeadDim) throw std::invalid_argument(op + "head_dim must be 128, got " + std::to_string(head_dim));
  if (num_kv_heads < 1 || num_heads % num_kv_heads != 0 || num_heads / num_kv_heads > 8) {
    throw std::invalid_argument(op + "num_heads must be 1 to 8 times num_kv_heads");
  }
  if (page_size < 1 || (page_size & (page_size - 1)) != 0 || page_size > 1024) {
    throw std::invalid_argument(op + "page_size must be a power of two up to 1024");
  }
  if (max_pages < 1 || num_pages < 1) throw std::invalid_argument(op + "max_pages and num_pages must be >= 1");
  check_dtype(op, a.dtype, kHalfTypes);
  check_kv_cache(op, a.dtype, a.kv_dtype, a.k_scale, a.v_scale);
  int shift = 0;
  while ((int64_t{1} << shift) < page_size) ++shift;
  return shift;
}

// a * b + c, the product of two 32-bit ints taken whole (one instruction, where 64-bit operands take several).
__device__ __forceinline__ int64_t mad_wide(int a, int b, int c) {
  int64_t r;
  asm("mad.wide.s32 %0, %1, %2, %3;" : "=l"(r) : "r"(a), "r"(b), "l"(static_cast<int64_t>(c)));
  return r;
}

// How load_kv_tile splits a tile of kKeys keys of cache type C over the block: each thread copies kLoads 16-byte
// chunks of K (and as many of V), chunk c = tid + i * kKVTileThreads of the tile: key c / kChunks = key0 + i * kKeyStep,
// its chunk c % kChunks (the same for all i).
template <int kKeys, typename C>
struct KVTileSplit {
  static constexpr int kPerChunk = 16 / sizeof(C);  // elements per 16-byte chunk
  static constexpr int kChunks = mma::kD / kPerChunk;
  static constexpr int kLoads = kKeys * kChunks / kKVTileThreads;
  static constexpr int kKeyStep = kKVTileThreads / kChunks;  // keys between a thread's chunks: 8 (16-bit), 16 (FP8)
  static_assert(kKeys * kChunks % kKVTileThreads == 0, "whole chunks per thread");
  // (so a thread's keys share their row's swizzle, key % 8: see copy_kv_tile)
  static_assert(kKVTileThreads % kChunks == 0 && kKeyStep % 8 == 0, "a thread's keys 8 apart or more");
};

// The page ids of this thread's keys of the tile [first, first + kKeys) (-1 at or past `end`, or past the table), for
// copy_kv_tile. (Read a slot ahead of the copies, they bought the decode kernel 0-2% and its engine step nothing:
// docs/experiments.md.)
template <int kKeys, typename C>
__device__ __forceinline__ void kv_tile_page_ids(int (&ids)[KVTileSplit<kKeys, C>::kLoads], const int* pages, int first,
                                                 int end, int page_shift, int max_pages, int tid) {
  using Split = KVTileSplit<kKeys, C>;
  const int pos0 = first + tid / Split::kChunks;
#pragma unroll
  for (int i = 0; i < Split::kLoads; ++i) {
    const int pos = pos0 + i * Split::kKeyStep;
    const int page_index = pos >> page_shift;
    ids[i] = pos < end && page_index < max_pages ? pages[page_index] : -1;
  }
}

// Keys [first, first + kKeys) of KV head kvh, K into dk and V into dv (swizzled tiles of kKeys rows of 128 elements:
// row r's 16-byte chunk c sits at chunk c ^ (r % 8)), by a 128-thread block with cp.async, from the page ids
// kv_tile_page_ids gave. Keys whose page id is negative or outside the pool are zero-filled: masked by the caller
// anyway, and a zero V row keeps 0 * garbage from making NaN. The address arithmetic is most of what the decode
// kernel issues besides its matrix work (Nsight Compute, FP8 pool at 512 x 640: about a third of all instructions
// with 64-bit products per chunk), so what does not change with i is worked out once, and a page's offset is one
// 32 x 32 -> 64-bit product (a page holds at most 1,024 x 1,024 x 128 elements: its size fits 32 bits).
template <int kKeys, typename C>
__device__ __forceinline__ void copy_kv_tile(C* dk, C* dv, const C* k_cache, const C* v_cache,
                                             const int (&ids)[KVTileSplit<kKeys, C>::kLoads], int first,
                                             int page_shift, int64_t num_pages, int num_kv_heads, int kvh, int tid) {
  using Split = KVTileSplit<kKeys, C>;
  const int key0 = tid / Split::kChunks, chunk = tid % Split::kChunks;
  const int row = num_kv_heads * mma::kD;       // elements from one token's slot to the next
  const int page_elems = row << page_shift;     // elements of a page
  const int slot_mask = (1 << page_shift) - 1;
  // page >= 0 && page < num_pages, as one unsigned comparison (a page id is an int32)
  const unsigned page_limit = static_cast<unsigned>(num_pages < (int64_t{1} << 31) ? num_pages : int64_t{1} << 31);
  const int head_offset = kvh * mma::kD + chunk * Split::kPerChunk;
  const C* k_head = k_cache + head_offset;
  const C* v_head = v_cache + head_offset;
  const int dst0 = key0 * mma::kD + ((chunk ^ (key0 & 7)) * Split::kPerChunk);  // key0 + i * kKeyStep: same swizzle
#pragma unroll
  for (int i = 0; i < Split::kLoads; ++i) {
    const int pos = first + key0 + i * Split::kKeyStep;
    const int page = ids[i];
    const bool valid = static_cast<unsigned>(page) < page_limit;
    // (selects, not a branch: a zero-filled chunk reads nothing, from the head's first slot)
    const int64_t offset = mad_wide(valid ? page : 0, page_elems, valid ? (pos & slot_mask) * row : 0);
    const int dst = dst0 + i * Split::kKeyStep * mma::kD;
    mma::cp_async16(dk + dst, k_head + offset, valid);
    mma::cp_async16(dv + dst, v_head + offset, valid);
  }
}

// The tile's page ids, then its copy (tokens at or past `end`, and page ids outside the table or the pool, are
// zero-filled).
template <int kKeys = kKVTile, typename C>
__device__ __forceinline__ void load_kv_tile(C* dk, C* dv, const C* k_cache, const C* v_cache, const int* pages,
                                             int first, int end, int page_shift, int max_pages, int64_t num_pages,
                                             int num_kv_heads, int kvh, int tid) {
  int ids[KVTileSplit<kKeys, C>::kLoads];
  kv_tile_page_ids<kKeys, C>(ids, pages, first, end, page_shift, max_pages, tid);
  copy_kv_tile<kKeys, C>(dk, dv, k_cache, v_cache, ids, first, page_shift, num_pages, num_kv_heads, kvh, tid);
}

}  // namespace fastqwen
