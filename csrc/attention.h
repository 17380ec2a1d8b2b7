// Host-side declarations of the paged attention kernels (no CUDA headers needed).
#pragma once

#include <cstdint>

namespace fastqwen {

// Decode attention: one query token per sequence over its paged KV cache.
// q, out: [B, H, 128]; k_cache, v_cache: [num_pages, page_size, H_kv, 128]; page_table: int32 [B, max_pages];
// kv_lens: int32 [B]. A sequence is cut into chunks whose length depends only on its own length (at most
// kDecodeMaxSplits); paged_attention_decode_plan writes the chunk offsets (int32 [B + 1]) once per step, on the
// device, and paged_attention_decode reads them, so the pair can be captured in a CUDA graph. Split sequences leave
// per-chunk results in part_out (float32 [rows, 128]) and part_lse (float32 [rows]), rows >= B * H *
// kDecodeMaxSplits, merged by a second kernel. dtype: 1 = fp16, 2 = bf16.
constexpr int kDecodeMaxSplits = 32;

void paged_attention_decode_plan(uintptr_t kv_lens, uintptr_t split_offsets, int64_t batch, uintptr_t stream);

void paged_attention_decode(uintptr_t q, uintptr_t k_cache, uintptr_t v_cache, uintptr_t page_table,
                            uintptr_t kv_lens, uintptr_t split_offsets, uintptr_t out, uintptr_t part_out,
                            uintptr_t part_lse, int64_t workspace_rows, int64_t batch, int64_t num_heads,
                            int64_t num_kv_heads, int64_t head_dim, int64_t page_size, int64_t max_pages,
                            int64_t num_pages, double scale, int dtype, uintptr_t stream);

// Several query tokens per sequence (prefill, or extend after a cached prefix), varlen-packed.
// q, out: [T, H, 128] with sequence b's tokens at rows query_start[b] .. query_start[b + 1] (int32 [B + 1]); they
// are the last tokens of its kv_lens[b] cached tokens (already written to the cache), so the causal mask is
// aligned to the end. max_query_len bounds query_start[b + 1] - query_start[b] (it sizes the grid).
void paged_attention_prefill(uintptr_t q, uintptr_t k_cache, uintptr_t v_cache, uintptr_t query_start,
                             uintptr_t page_table, uintptr_t kv_lens, uintptr_t out, int64_t batch,
                             int64_t max_query_len, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                             int64_t page_size, int64_t max_pages, int64_t num_pages, double scale, int dtype,
                             uintptr_t stream);

}  // namespace fastqwen
