// Host-side declarations of the paged attention kernels (no CUDA headers needed).
#pragma once

#include <cstdint>

#include "dtype.h"

namespace fastqwen {

// The one head size the attention kernels are built for (any other takes the PyTorch reference).
constexpr int kAttentionHeadDim = 128;
// A decode sequence is cut into at most this many chunks (sizes the decode workspace).
constexpr int kDecodeMaxSplits = 32;

// What both kernels take, by name. Pointers are device addresses, stream a cudaStream_t.
// q, out: [tokens, H, 128]; k_cache, v_cache: [num_pages, page_size, H_kv, 128] of kv_dtype; page_table: int32 [B, max_pages];
// kv_lens: int32 [B], every cached token of sequence b including this step's.
struct PagedAttentionArgs {
  uintptr_t q = 0, out = 0, k_cache = 0, v_cache = 0, page_table = 0, kv_lens = 0;
  int64_t batch = 0, num_heads = 0, num_kv_heads = 0, head_dim = 0, page_size = 0, max_pages = 0, num_pages = 0;
  double scale = 0.0;
  int dtype = -1;  // a code of dtype.h: float16 or bfloat16 (q and out)
  // The caches' type: dtype, or float8_e4m3fn holding K / k_scale and V / v_scale (one scale per tensor, so per
  // layer). The FP8 path dequantizes in registers and runs the tensor cores in fp16, where every e4m3 value is exact.
  int kv_dtype = -1;
  double k_scale = 1.0, v_scale = 1.0;
  uintptr_t stream = 0;
};

// Decode: one query token per sequence. A sequence is cut into chunks whose length depends only on its own length,
// the cache's type and the model's KV heads on this GPU (at least 256 tokens, 1,024 for an FP8 cache, whose tiles
// hold twice the tokens; at most decode_max_splits(num_kv_heads) chunks); paged_attention_decode_plan writes the
// plan once per step, on the device, and paged_attention_decode reads it, so the pair can be captured in a CUDA graph.
// The plan (split_offsets, int32 [decode_plan_ints(B)]) holds the chunk offsets (sequence b's chunks are C_b ..
// C_{b+1} - 1, C_B all of them), then from decode_plan_record_offset(B) (unless
// set_paged_attention_decode_item_records(false)) each of the C_B chunks' record: int4 (b, first token, end token,
// split | chunks of b << 8). Split sequences leave per-chunk results in part_out (float32 [rows, 128]) and part_lse
// (float32 [rows]), rows >= B * H * kDecodeMaxSplits, merged by a second kernel.

// Where a plan for `batch` sequences keeps its chunk records, in int32s from its start: past the offsets, 16-byte
// aligned.
inline int64_t decode_plan_record_offset(int64_t batch) { return (batch + 1 + 3) / 4 * 4; }

// int32 entries of a plan for up to max_batch sequences (its offsets and records).
inline int64_t decode_plan_ints(int64_t max_batch) {
  return decode_plan_record_offset(max_batch) + 4 * max_batch * kDecodeMaxSplits;
}

struct DecodeArgs : PagedAttentionArgs {
  uintptr_t split_offsets = 0, part_out = 0, part_lse = 0;
  int64_t workspace_rows = 0;
  // Whether the plan may come from the kernel right before this call's (the kernel reads the plan before it waits for
  // that kernel, so it then starts only after it: no programmatic launch). ops.paged_attention_decode passes true
  // for the first decode after plan_decode (DecodeWorkspace.plan_fresh), false after that: in the engine, which plans
  // before the layers, only the first layer's decode is launched the ordinary way.
  bool plan_fresh = true;
};

// kv_fp8: whether the decode this plan is for reads an FP8 cache (its chunks are longer); num_kv_heads: its cache's
// KV heads (they bound the chunks a sequence is cut into: decode_max_splits).
void paged_attention_decode_plan(uintptr_t kv_lens, uintptr_t split_offsets, int64_t batch, bool kv_fp8,
                                 int64_t num_kv_heads, uintptr_t stream);

// The most chunks a sequence is cut into on the current GPU while its chunks stay within 1,792 tokens: one work item
// per SM over the KV heads (SMs / num_kv_heads, at most kDecodeMaxSplits); a sequence that would need longer chunks
// is cut into up to kDecodeMaxSplits (attention_decode.cu, kLongChunk). Unless
// set_paged_attention_decode_max_splits set a number, which then holds at every length. In the engine a batch-1 step
// whose items outnumber the SMs took 0.3-0.4 ms longer (random Qwen3-8B on an H200: 4.11 ms at 4,032 tokens of
// context in 16 chunks, 4.53 at 4,160 in 17), far more than the kernel alone shows.
int decode_max_splits(int64_t num_kv_heads);

// The most chunks a sequence is cut into, for benchmarks that compare split limits (1 .. kDecodeMaxSplits; 0 sets
// the rule of decode_max_splits): set it before planning, never between a plan and its decode.
void set_paged_attention_decode_max_splits(int64_t splits);

void paged_attention_decode(const DecodeArgs& args);

// The shortest chunk a sequence is split into (a multiple of 64 tokens; 256 for 16-bit caches, 1,024 for FP8 unless
// set; 0 sets the default). For benchmarks that compare chunk lengths: set it before planning, never between a plan and its decode.
void set_paged_attention_decode_min_chunk(bool kv_fp8, int64_t tokens);

// Whether a block's load pipeline runs on into its next work item while it finishes one (default), or starts afresh
// at each item (the kernel before), for benchmarks and tests; the results are the same bit for bit.
void set_paged_attention_decode_prefetch_next(bool prefetch_next);

// Whether the plan also writes each chunk's record, which the decode kernel copies into shared memory items ahead, so
// that moving on to a work item waits for no load (a lookup of the item's sequence, then its offsets and length, then
// its page ids were the largest stall in Nsight Compute's samples at 512 x 640), and the item's first page ids are
// asked into L1 a slot before their tile's load (default), or the kernel searches the chunk offsets for each item's
// sequence (about nine dependent loads), for benchmarks and tests. Set it before planning, as the chunk length. The
// results are the same bit for bit.
void set_paged_attention_decode_item_records(bool item_records);

// Several query tokens per sequence (prefill, or extend after a cached prefix), varlen-packed: sequence b's tokens
// are rows query_start[b] .. query_start[b + 1] (int32 [B + 1]) of q, the last tokens of its kv_lens[b] cached tokens
// (already written to the cache), so the causal mask is aligned to the end. max_query_len bounds query_start[b + 1]
// - query_start[b] (it sizes the grid).
struct PrefillArgs : PagedAttentionArgs {
  uintptr_t query_start = 0;
  int64_t max_query_len = 0;
  // Rows of q (the total of the query lengths): the Hopper kernel copies Q tiles by TMA only when it is given, since
  // a tile's box may reach past the last sequence. 0: not given.
  int64_t num_tokens = 0;
};

void paged_attention_prefill(const PrefillArgs& args);

// The same on Hopper (attention_prefill_hopper.cu: TMA, wgmma, warp-specialized), for 16-bit caches with pages of 16
// or more tokens; available on a compute capability 9.0 device when the extension was built for sm_90a.
bool paged_attention_prefill_hopper_available(int device);
void paged_attention_prefill_hopper(const PrefillArgs& args);
// Whether its grid is persistent (one block per SM looping over the work, the default) or one block per work item.
// For benchmarks that compare the two.
void set_paged_attention_prefill_hopper_persistent(bool persistent);
// Which pipeline, 0..kPrefillHopperVariants - 1 (bit 0: softmax overlapped with the previous tile's P V; bit 1:
// warpgroups take turns issuing; bit 2: three K/V stages instead of two; bit 3: work items fetched from a device
// counter instead of taken in a fixed stride; bit 4: Q tiles copied by the producer warp, for 16-bit caches, G
// dividing 128 and num_tokens given). Returns the one it replaces.
constexpr int kPrefillHopperVariants = 32;
int set_paged_attention_prefill_hopper_variant(int variant);

}  // namespace fastqwen
