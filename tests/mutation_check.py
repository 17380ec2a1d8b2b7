"""Do the tests fail where the bugs would be? Builds mutants of the package (one deliberate bug each) and runs the tests
that should catch each one against it; a mutant "survives" when they all pass.

    python tests/mutation_check.py --build-dir BUILD [--only gpu|cpu] [--names A,B] [--jobs N] [--out DIR]

Each mutant is a copy of the installed package (or of the one on PYTHONPATH) with one exact-string edit: a Python
file edited in the copy, or a native file (csrc/: a CUDA or C++ source, or a header with the sources that include
it) recompiled into the copy's _C module. For the native ones, BUILD is the CMake build directory of that package
(`pip install --no-build-isolation --no-deps -Cbuild-dir=BUILD .`; a host-only build, without CUDA, serves the C++
mutants whose tests run on the CPU): only the mutated sources are recompiled, with the build's own compile and link
commands (`ninja -t commands`). Nothing in the source tree is changed.

--only gpu / cpu picks the mutants whose tests need a GPU / run on the CPU. A mutant whose tests need more GPUs than
the machine has (the custom all-reduce's: two) is reported as NOT RUN, neither caught nor survived. The builds run
in parallel (as many as there are cores); --jobs N runs N mutants' tests at once (they share the GPU). Exit status 0
when every mutant that ran was caught.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HEADERS = (".h", ".cuh")


@dataclass
class Mutation:
    name: str
    path: str  # repository path of the file to edit
    edits: list[tuple[str, str]]  # (exact text, its replacement); each text must occur exactly once
    tests: list[str]  # pytest node ids that must fail
    why: str
    rebuild: tuple[str, ...] = ()  # a header's mutant: the csrc/ sources recompiled with it (each includes it)
    gpus: int | None = None  # GPUs its tests need; None: one for a CUDA file or header, none otherwise

    def __post_init__(self):
        if self.gpus is None:
            self.gpus = 1 if self.path.endswith((".cu", ".cuh")) else 0

    @property
    def native(self) -> bool:
        """Compiled into _C: a source or header under csrc/."""
        return self.path.startswith("csrc/")

    @property
    def sources(self) -> tuple[str, ...]:
        """The csrc/ sources (file names) that the mutant recompiles."""
        return self.rebuild if self.path.endswith(HEADERS) else (Path(self.path).name,)


KERNEL_LIBRARY = "libfastqwen_kernels.a"  # CMakeLists.txt's fastqwen_kernels target
DECODE = "csrc/attention_decode.cu"
PREFILL = "csrc/attention_prefill.cu"
DECODE_TESTS = ["tests/test_attention_gpu.py::test_decode_every_chunk_counts"]
PREFILL_TESTS = ["tests/test_attention_gpu.py::test_prefill_every_tile_counts"]
PREFILL_HOPPER = "csrc/attention_prefill_hopper.cu"
PREFILL_HOPPER_TESTS = [  # both run each prefill case on both kernels (the fixture prefill_kernel)
    "tests/test_attention_gpu.py::test_prefill_every_tile_counts",
    "tests/test_attention_gpu.py::test_prefill_long_and_wide",
    "tests/test_engine_gpu.py::test_hopper_prefill_engine_matches_the_tensor_core_prefill_engine",
]

# The every-pipeline test at the default pipeline with Q copied by the producer (bit 4: 10 + 16) and at the overlap
# with ping-pong and the dynamic schedule (11 + 16).
PREFILL_HOPPER_TMA_Q_TESTS = [
    "tests/test_attention_gpu.py::test_hopper_prefill_every_pipeline_matches_reference[26]",
    "tests/test_attention_gpu.py::test_hopper_prefill_every_pipeline_matches_reference[27]",
]

EAGLE3_DRAFTER = "python/fastqwen/engine/eagle3_drafter.py"
EAGLE3_DRAFTS = "tests/test_eagle3_batched.py::test_batched_drafts_equal_the_per_request_float64_reference[0]"

MUTATIONS = [
    Mutation(
        "decode_skips_first_chunk",
        DECODE,
        [
            (
                "  it.n_tiles = (max(it.end - it.start, 0) + tile - 1) / tile;",
                "  it.n_tiles = it.split == 0 && it.num_splits > 1 ? 0 : (max(it.end - it.start, 0) + tile - 1) / tile;",
            )
        ],
        DECODE_TESTS,
        "the first chunk of a split sequence computes nothing (its keys are dropped)",
    ),
    Mutation(
        "decode_q_in_the_next_stage_slot",
        DECODE,
        [
            (
                "        T* dq = reinterpret_cast<T*>(sQ + stage * S::kQSlotBytes);",
                "        T* dq = reinterpret_cast<T*>(sQ + (stage + 1) % kStages * S::kQSlotBytes);",
            )
        ],
        DECODE_TESTS,
        "an item's Q is copied into the next stage's Q slot (the compute reads its own stage's: another item's or none)",
    ),
    Mutation(
        "decode_merge_in_the_stage_loading",
        DECODE,
        [
            (
                "    float* sm_m = reinterpret_cast<float*>(sKV + ((slot - 1) % kStages) * S::kStageElems);",
                "    float* sm_m = reinterpret_cast<float*>(sKV + (slot % kStages) * S::kStageElems);",
            )
        ],
        [
            "tests/test_attention_gpu.py::test_decode_pipeline_across_items_is_bitwise_the_pipeline_started_afresh",
        ],
        "the warps merge in the stage the next item's tile is loading into, not in the one their last tile came from",
    ),
    Mutation(
        "decode_kernel_cuts_with_the_old_split_limit",
        DECODE,
        [
            (
                "           g_min_chunk[fp8 ? 1 : 0], decode_split_rule(a.num_kv_heads), a.plan_fresh, g_prefetch_next};",
                "           g_min_chunk[fp8 ? 1 : 0], SplitRule{kDecodeMaxSplits, 0}, a.plan_fresh, g_prefetch_next};",
            )
        ],
        [
            "tests/test_attention_gpu.py::test_decode_every_chunk_counts[dtype5-4-8-True]",
        ],
        "the decode kernel, searching the offsets (no records), cuts the chunks into up to 32 a sequence while the plan "
        "cut them by SMs / KV heads",
    ),
    Mutation(
        "decode_record_ring_filled_one_item_short",
        DECODE,
        [
            (
                "            const int ahead = load_item + kRecAhead * gridDim.x;",
                "            const int ahead = load_item + (kRecAhead - 1) * gridDim.x;",
            )
        ],
        [
            "tests/test_attention_gpu.py::test_decode_with_item_records_is_bitwise_the_search",
        ],
        "thread 0 copies into the record ring's slot for the item kRecAhead ahead the record of the item one closer",
    ),
    Mutation(
        "decode_running_max_stays_at_the_first_tiles",
        DECODE,
        [
            (
                "        const float m_new = fmaxf(m_run[h], mx);",
                "        const float m_new = m_run[h] == -INFINITY ? mx : m_run[h];",
            )
        ],
        [
            "tests/test_attention_gpu.py::test_decode_running_max_grows_along_the_keys",
        ],
        "the running max is set by a row's first tile and never moves: later, larger scores overflow the weights",
    ),
    Mutation(
        "decode_rescale_leaves_the_sum",
        DECODE,
        [("        l_run[h] = l_run[h] * alpha + sum;", "        l_run[h] = l_run[h] + sum;")],
        [
            "tests/test_attention_gpu.py::test_decode_running_max_grows_along_the_keys",
        ],
        "when the running max moves, the output accumulators are rescaled but the running sum is not",
    ),
    Mutation(
        "kv_tile_copy_reads_the_next_slot",
        "csrc/paged_kv.cuh",
        [
            (
                "    const int64_t offset = mad_wide(valid ? page : 0, page_elems, valid ? (pos & slot_mask) * row : 0);",
                "    const int64_t offset = mad_wide(valid ? page : 0, page_elems, valid ? ((pos + 1) & slot_mask) * row : 0);",
            )
        ],
        DECODE_TESTS,
        "the K/V tile copy reads each key from the next token's slot of its page",
        rebuild=("attention_decode.cu", "attention_prefill.cu", "attention_prefill_hopper.cu"),
    ),
    Mutation(
        "decode_item_record_ends_a_tile_early",
        DECODE,
        [
            (
                "        for (int c = 0; c < n; ++c) records[before + c] = chunk_record(b, c * clen, min(len, c * clen + clen), c, n);",
                "        for (int c = 0; c < n; ++c) records[before + c] = chunk_record(b, c * clen, min(len, c * clen + clen - kTile), c, n);",
            )
        ],
        [
            "tests/test_attention_gpu.py::test_decode_plan_writes_the_record_of_every_chunk",
            "tests/test_attention_gpu.py::test_decode_with_item_records_is_bitwise_the_search",
        ],
        "a chunk's record ends one tile before the chunk does",
    ),
    Mutation(
        "decode_merge_skips_last_chunk",
        DECODE,
        [
            (
                "  for (int s = 0; s < n; ++s) o += weight[s] * part[s * stride];",
                "  for (int s = 0; s < n - 1; ++s) o += weight[s] * part[s * stride];",
            )
        ],
        DECODE_TESTS,
        "the merge leaves out the last chunk's output (its weight still counts in the sum)",
    ),
    Mutation(
        "decode_merge_equal_weights",
        DECODE,
        [
            (
                "    const float w = m != -INFINITY && d < n ? exp2f(lse - m) : 0.0f;  // log2 units",
                "    const float w = m != -INFINITY && d < n ? 1.0f : 0.0f;",
            )
        ],
        DECODE_TESTS,
        "chunks merged with equal weights instead of their softmax mass",
    ),
    Mutation(
        "decode_ignores_split_limit",
        DECODE,
        [
            (
                "  want = max(min_chunk, want);\n",
                "  want = min_chunk;\n",
            ),
            (
                "    const int n = b < batch ? max(1, (len + clen - 1) / clen) : 0;",
                "    const int n = b < batch ? max(1, min(kDecodeMaxSplits, (len + clen - 1) / clen)) : 0;",
            ),
        ],
        DECODE_TESTS,
        "chunks stay at the minimum length and are capped at 32: keys past 32 chunks are dropped",
    ),
    Mutation(
        "prefill_skips_first_tile",
        PREFILL,
        [
            (
                "              if (masked && j * kBN + ni * 8 + (lane & 3) * 2 + e > row_pos[mi][h]) x = -INFINITY;",
                "              if (masked && j * kBN + ni * 8 + (lane & 3) * 2 + e > row_pos[mi][h]) x = -INFINITY;\n"
                "              if (j == 0 && n_kv_tiles > 1) x = -INFINITY;",
            )
        ],
        PREFILL_TESTS,
        "the first 64-key tile is masked out whenever there is more than one",
    ),
    Mutation(
        "prefill_hopper_drops_the_last_partial_tile",
        PREFILL_HOPPER,
        [
            (
                "      const int n_wg = (wg_end + kBN - 1) / kBN;  // <= n",
                "      const int n_wg = wg_end / kBN;  // <= n",
            )
        ],
        PREFILL_HOPPER_TESTS,
        "the Hopper kernel's warpgroups skip the last K/V tile their rows see when it is not full",
    ),
    Mutation(
        "prefill_hopper_v_high_half_copied_from_the_low_columns",
        PREFILL_HOPPER,
        [
            (
                "                          full, half * 64, w.kvh, slot);",
                "                          full, is_v ? 0 : half * 64, w.kvh, slot);",
            )
        ],
        PREFILL_HOPPER_TESTS,
        "the warp that copies the V tiles' second 64-column half (16-bit caches) reads the first half's columns",
    ),
    Mutation(
        "prefill_hopper_causal_offset_ignores_the_prefix",
        PREFILL_HOPPER,
        [
            (
                "for (int h = 0; h < 2; ++h) row_pos[h] = w.prefix + (w.row0 + c * 64 + warp * 16 + lane / 4 + h * 8) / G;",
                "for (int h = 0; h < 2; ++h) row_pos[h] = (w.row0 + c * 64 + warp * 16 + lane / 4 + h * 8) / G;",
            )
        ],
        PREFILL_HOPPER_TESTS,
        "the Hopper kernel's causal mask puts query i at position i, not after the cached prefix (extend)",
    ),
    Mutation(
        "prefill_hopper_tma_q_one_token_late",
        PREFILL_HOPPER,
        [
            (
                "const int token = w.q0 + w.row0 / p.group;  // (G divides the tile's 128 rows)",
                "const int token = w.q0 + w.row0 / p.group + 1;  // (G divides the tile's 128 rows)",
            )
        ],
        PREFILL_HOPPER_TMA_Q_TESTS,
        "the producer's copy of a work item's Q tile (variant bit 4) starts one token late",
    ),
    Mutation(
        "prefill_hopper_tma_q_released_after_the_first_s",
        PREFILL_HOPPER,
        [("        if (j == n_wg - 1) release_q();", "        if (j == 0) release_q();")],
        PREFILL_HOPPER_TMA_Q_TESTS,
        "the consumers let the producer overwrite Q after a work item's first S instead of its last (variant bit 4)",
    ),
    Mutation(
        "prefill_hopper_rescales_by_an_fma_residue",
        PREFILL_HOPPER,
        [
            (
                "    alpha[h] = m_new == m_run[h] ? 1.0f : mma::fast_exp2(m_run[h] * scale_log2 - m_scaled[h]);",
                "    alpha[h] = mma::fast_exp2(m_run[h] * scale_log2 - m_scaled[h]);",
            )
        ],
        [  # (caught on an H100 by [hopper-386] alone, with 1 of its 512,000 elements: each length is another chance)
            "tests/test_attention_gpu.py::test_prefill_query_rows_do_not_depend_on_the_rows_after_them[hopper-257]",
            "tests/test_attention_gpu.py::test_prefill_query_rows_do_not_depend_on_the_rows_after_them[hopper-386]",
            "tests/test_attention_gpu.py::test_prefill_query_rows_do_not_depend_on_the_rows_after_them[hopper-4098]",
        ],
        "a tile that raises no maximum rescales O and l by exp2 of an FMA's rounding residue instead of exactly 1",
    ),
    Mutation(
        "prefill_hopper_fp8_ignores_v_scale",
        PREFILL_HOPPER,
        [
            (
                "        const float inv = l > 0.0f ? p.v_scale / l : 0.0f;",
                "        const float inv = l > 0.0f ? 1.0f / l : 0.0f;",
            )
        ],
        ["tests/test_fp8_kv_gpu.py::test_prefill_fp8", "tests/test_fp8_kv_gpu.py::test_prefill_fp8_long_extends"],
        "the Hopper kernel reads an FP8 cache's V without its scale",
    ),
    Mutation(
        "prefill_hopper_fp8_converts_unswizzled",
        PREFILL_HOPPER,
        [
            (
                "    const int c0 = (cc % 4) * 2;  // the first",
                "    const int c0 = ((cc % 4) * 2) ^ (key % 8);  // the first",
            )
        ],
        ["tests/test_fp8_kv_gpu.py::test_prefill_fp8", "tests/test_fp8_kv_gpu.py::test_prefill_fp8_long_extends"],
        "the FP8 converters write fp16 chunks where the 128-byte swizzle does not put them (wgmma reads other columns)",
    ),
    Mutation(
        "prefill_no_rescale",
        PREFILL,
        [("          const float alpha = fast_exp2(m_run[mi][h] - m_use);", "          const float alpha = 1.0f;")],
        PREFILL_TESTS,
        "earlier tiles are not rescaled when the running max grows (tiles merged with wrong weights)",
    ),
    Mutation(
        "gemv_fp8_ring_reloads_its_chunk",
        "csrc/gemv.cu",
        [
            (
                "            wv[r] = load_stream(rows.rows0 + rows.row_off[r] + next);",
                "            wv[r] = load_stream(rows.rows0 + rows.row_off[r] + c);",
            )
        ],
        ["tests/test_gemv_gpu.py::test_gemv_matches_reference_on_qwen3_shapes[Qwen3-8B-fp8]"],
        "the one-token FP8 GEMV multiplies each lane's first chunk of a row again in place of the later ones",
    ),
    Mutation(
        "gemv_block_of_5_reads_the_next_row_for_its_last",
        "csrc/gemv.cu",
        [
            (
                "      row_off[r] = (row - row0) * row_chunks;",
                "      row_off[r] = (row - row0 + (kRows == 5 && r == 4 ? 1 : 0)) * row_chunks;",
            )
        ],
        ["tests/test_gemv_gpu.py::test_gemv_blocks_of_4_5_and_6_rows_agree_bit_for_bit[bf16]"],
        "blocks of 5 weight rows (set_gemv_rows_per_block) multiply the row after their last in its place",
    ),
    Mutation(
        "gemv_norm_sums_squares_of_weighted_x",
        "csrc/gemv.cu",
        [
            (
                "      sq = fmaf(out[i], out[i], sq);\n      out[i] *= gf[i];",
                "      out[i] *= gf[i];\n      sq = fmaf(out[i], out[i], sq);",
            )
        ],
        ["tests/test_gemv_gpu.py::test_norm_in_gemv_matches_float64_and_the_norm_kernel[8B-bf16]"],
        "the GEMV that finishes an RMSNorm takes the rms of x * weight instead of x's",
    ),
    Mutation(
        "fold_norm_keeps_the_norm_weight",
        "python/fastqwen/weights.py",
        [("    norm_weight.fill_(1)\n", "")],
        ["tests/test_gemv_gpu.py::test_engine_norms_in_gemv_match_the_norm_kernels[none]"],
        "the norm weight goes into the projection's columns but the norm kernels (prefill, batches) still apply it too",
        gpus=1,
    ),
    Mutation(
        "tp_fp8_scale_blocks_of_the_rank_before",
        "python/fastqwen/weights.py",
        [
            (
                "        return first // FP8_BLOCK, _blocks(end)\n",
                "        return first // FP8_BLOCK - (shard.rank == 1), _blocks(end) - (shard.rank == 1)\n",
            )
        ],
        [
            "tests/test_tensor_parallel_fp8.py::test_fp8_checkpoint_shards_take_their_scale_blocks[2]",
            "tests/test_tensor_parallel_fp8.py::test_tp2_fp8_checkpoint_matches_tp1_teacher_forced",
        ],
        "tensor-parallel rank 1 takes its FP8 weights' rows and columns with the scale blocks of the rows or columns "
        "before them (rank 0's at TP=2)",
    ),
    Mutation(
        "tp_rank_1_skips_its_row_parallel_shard",
        "python/fastqwen/weights.py",
        [
            (
                "        loaded = [get_part(prefix, shape, dim, span) for prefix, shape, span in parts]\n",
                "        loaded = [get_part(prefix, shape, dim, (0, s[1] - s[0]) if dim == cols and shard.rank == 1 else s) "
                "for prefix, shape, s in parts]\n",
            )
        ],
        [
            "tests/test_tensor_parallel_fp8.py::test_fp8_checkpoint_shards_take_their_scale_blocks[2]",
            "tests/test_tensor_parallel_fp8.py::test_online_quantization_is_per_shard_and_equals_the_whole_models[checkpoint]",
            "tests/test_tensor_parallel_fp8.py::test_tp2_fp8_checkpoint_matches_tp1_teacher_forced",
        ],
        "tensor-parallel rank 1 skips its own columns of o_proj and down and loads rank 0's again",
    ),
    Mutation(
        "tp_fp8_dummy_rank_1_left_unquantized",
        "python/fastqwen/weights.py",
        [
            (
                "        return _quantized(layer) if fp8 else layer\n",
                "        return _quantized(layer) if fp8 and shard.rank != 1 else layer\n",
            )
        ],
        ["tests/test_tensor_parallel_fp8.py::test_online_quantization_is_per_shard_and_equals_the_whole_models[dummy]"],
        "random weights with fp8 under tensor parallelism: rank 1 keeps its shard dense",
    ),
    Mutation(
        "tp_fp8_split_scale_block_not_refused",
        "python/fastqwen/weights.py",
        [("    if first % FP8_BLOCK == 0 and (end % FP8_BLOCK == 0 or end == shape[dim]):\n", "    if True:\n")],
        ["tests/test_tensor_parallel_fp8.py::test_a_split_that_cuts_a_scale_block_is_refused_naming_the_projection"],
        "a tensor-parallel split that cuts an FP8 scale block in two loads (each rank scaling its rows by blocks that "
        "are not theirs) instead of being refused",
    ),
    Mutation(
        "yarn_attention_factor_left_out",
        "python/fastqwen/ops/rope_kv.py",
        [
            (
                "torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention_factor",
                "torch.cat([freqs.cos(), freqs.sin()], dim=-1)",
            )
        ],
        [
            "tests/test_rope_scaling.py::test_cos_sin_cache_matches_yarn_in_float64[qwen3]",
            "tests/test_rope_scaling.py::test_greedy_matches_hf_past_the_original_context",
        ],
        "YaRN's cos and sin are not multiplied by its attention factor (0.1 ln(factor) + 1)",
    ),
    Mutation(
        "prefix_cache_evicts_most_recent",
        "python/fastqwen/kvcache/radix_cache.py",
        [
            ("(n.last_access, id(n), n)", "(-n.last_access, id(n), n)"),
            ("(parent.last_access, id(parent), parent)", "(-parent.last_access, id(parent), parent)"),
        ],
        ["tests/test_prefix_cache.py::test_eviction_takes_the_least_recently_used_prefix"],
        "eviction takes the most recently used prefix first",
    ),
    Mutation(
        "kv_written_through_e5m2",
        "python/fastqwen/ops/kv_fp8.py",
        [
            (
                "    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE)\n",
                "    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e5m2).float().to(FP8_KV_DTYPE)\n",
            )
        ],
        ["tests/test_fp8_kv.py::test_fp8_weights_with_fp8_pool_follow_float32_truth"],
        "the reference FP8 KV write rounds to e5m2 (two mantissa bits) before e4m3: twice the rounding error",
    ),
    Mutation(
        "batch_limit_ignores_a_short_context",
        "python/fastqwen/engine/batch_limit.py",
        [("    typical = min(TYPICAL_SEQUENCE_TOKENS, max_model_len)\n", "    typical = TYPICAL_SEQUENCE_TOKENS\n")],
        [
            "tests/test_batch_limit.py::test_the_default_limit_follows_the_pool[120000-300-400]",
            "tests/test_batch_limit.py::test_a_batch_above_256_replays_a_graph",
        ],
        "the default batch limit counts 1,024 tokens a sequence even where the context is shorter (the pool of 512 "
        "sequences of a 512-token context gets 256)",
    ),
    Mutation(
        "graphs_stop_at_256",
        "python/fastqwen/engine/cuda_graph.py",
        [("*range(80, max_bs + 1, 16), max_bs}", "*range(80, min(max_bs, 256) + 1, 16), max_bs}")],
        [
            "tests/test_batch_limit.py::test_the_engine_sizes_everything_from_the_limit",
            "tests/test_cuda_graph_gpu.py::test_graph_decode_matches_eager_at_the_sizes_above_256",
        ],
        "no graph sizes between 256 and the largest: batches of 257 and more pad to the largest graph",
        gpus=1,
    ),
    Mutation(
        "sampler_rows_uploaded_up_to_256",
        "python/fastqwen/engine/sampler.py",
        [("        rows = max(n, pad_to)\n", "        rows = min(max(n, pad_to), 256)\n")],
        ["tests/test_sampler_gpu.py::test_engine_sampler_at_512_rows_matches_the_reference_sampler"],
        "GpuSampler.prepare uploads the parameters of the first 256 rows only: rows past them draw with stale ones",
        gpus=1,
    ),
    Mutation(
        "batch_limit_from_all_the_free_memory",
        "python/fastqwen/engine/llm_engine.py",
        [
            (
                "                config.gpu_memory_utilization,\n                cfg,\n",
                "                1.0,\n                cfg,\n",
            )
        ],
        ["tests/test_cuda_graph_gpu.py::test_the_default_limit_from_free_memory"],
        "the default batch limit is chosen from a pool of all the free memory, not its --kv-cache-memory-fraction",
        gpus=1,
    ),
    Mutation(
        "spec_logprobs_of_the_runs_first_position",
        "python/fastqwen/engine/llm_engine.py",
        [("new_logprobs = logprobs[row : row + kept]", "new_logprobs = [logprobs[row]] * kept")],
        [
            "tests/test_speculative.py::test_logprobs_are_the_targets_under_speculation[reference]",
            "tests/test_speculative.py::test_logprobs_are_the_targets_under_speculation[gpu-graphs]",
        ],
        "every token of an accepted run gets the logprobs of the run's first verified position",
    ),
    Mutation(
        "spec_verify_steps_never_launched_early",
        "python/fastqwen/engine/llm_engine.py",
        [("            if self._chooses_next_now():\n", "            if False:\n")],
        ["tests/test_speculative.py::test_verify_steps_are_launched_before_the_step_returns"],
        "the next verify step is chosen and launched only at the next call (the GPU idles while the caller works)",
    ),
    Mutation(
        "spec_chosen_step_keeps_aborted_requests",
        "python/fastqwen/engine/llm_engine.py",
        [("[c for c in scheduled.chunks if not c.request.finished]", "list(scheduled.chunks)")],
        ["tests/test_speculative.py::test_stop_strings_while_the_next_verify_step_is_launched"],
        "a step chosen by the last call runs the chunks of requests aborted since (their pages are released)",
    ),
    Mutation(
        "spec_aborted_drafts_counted",
        "python/fastqwen/engine/verify.py",
        [
            (
                "n = 0 if chunk.request.finished or not real else speculator.accepted(",
                "n = 0 if not real else speculator.accepted(",
            )
        ],
        ["tests/test_speculative.py::test_stop_strings_while_the_next_verify_step_is_launched"],
        "the draft of a request aborted while its verify step ran is counted in the spec_decode metrics",
    ),
    Mutation(
        "json_response_in_one_dumps",
        "python/fastqwen/server/serving.py",
        [("    out: list[str] = []\n    _encode_pieces(payload, out)\n", "    out: list[str] = [_dumps(payload)]\n")],
        ["tests/test_amplification.py::test_health_answers_while_a_large_echo_response_is_built"],
        "a large JSON response is encoded by one json.dumps, which holds the GIL and stalls the event loop",
    ),
    Mutation(
        "spec_fillers_counted",
        "python/fastqwen/engine/verify.py",
        [("        real = chunk.real_draft\n", "        real = chunk.draft\n")],
        ["tests/test_speculative.py::test_requests_paused_for_low_acceptance_keep_the_verify_graphs"],
        "a draft's filler is counted (and may be accepted) like real draft tokens",
    ),
    Mutation(
        "host_gate_opened_without_the_inputs",
        "python/fastqwen/engine/model_runner.py",
        [
            (
                "        self._fill_verify_inputs(views, scheduled, gated.size)\n        self._gate.open()",
                "        self._gate.open()",
            )
        ],
        ["tests/test_speculative.py::test_verify_steps_queued_behind_the_host_gate"],
        "a gated verify step is opened with the step before's inputs still in the pinned buffer",
    ),
    Mutation(
        "host_gate_timeout_not_relaunched",
        "python/fastqwen/engine/model_runner.py",
        [("            if pending.gate and not self._gate.opened(pending.gate):", "            if False:")],
        ["tests/test_speculative.py::test_verify_steps_queued_behind_the_host_gate"],
        "a gated step that ran on padding (the gate opened past its timeout) is taken for the real one",
    ),
    Mutation(
        "host_gate_armed_whatever_it_cost",
        "python/fastqwen/engine/llm_engine.py",
        [
            (
                "        if not self._gate_credit.allows(runner):\n            return",
                "        self._gate_credit.allows(runner)",
            )
        ],
        ["tests/test_speculative.py::test_the_host_gate_backs_off_when_its_guesses_fail"],
        "the gate is armed for every verify step however often its guesses fail (each failure wastes a step)",
    ),
    Mutation(
        "host_gate_armed_under_tensor_parallelism",
        "python/fastqwen/engine/llm_engine.py",
        [("        if not self.parallel.single or not runner.can_arm_verify", "        if not runner.can_arm_verify")],
        ["tests/test_speculative.py::test_the_host_gate_is_not_armed_under_tensor_parallelism"],
        "ranks arm their gates, and one that times out runs padding while the others' collectives wait for its step",
    ),
    Mutation(
        "eagle3_graph_steps_one_position_late",
        "python/fastqwen/engine/eagle3_graphs.py",
        [
            (
                "                wide[i * 2 * b + r] = position + i\n",
                "                wide[i * 2 * b + r] = position + i + 1\n",
            )
        ],
        ["tests/test_eagle3_batched.py::test_graphed_draft_steps_equal_the_eager_ones[5]"],
        "the graphed draft steps rotate each row one position past its own: the drafts leave the reference's",
    ),
    Mutation(
        "host_gate_armed_for_device_drafts",
        "python/fastqwen/engine/llm_engine.py",
        [('        if getattr(self.speculator.drafter, "drafts_on_device", False):', "        if False:")],
        ["tests/test_speculative.py::test_the_host_gate_is_not_armed_for_drafts_made_on_the_gpu"],
        "the gate is armed before an EAGLE-3 head's drafts, whose kernels then wait behind the gated step",
    ),
    Mutation(
        "host_gate_rows_a_step_behind",
        "python/fastqwen/engine/sampler.py",
        [("            step = r.num_output_tokens\n", "            step = r.num_output_tokens - 1\n")],
        ["tests/test_speculative.py::test_sampled_tokens_are_the_same_behind_the_host_gate"],
        "a gated step's sampler rows carry the step before's number: its seeded draws repeat the last step's",
    ),
    Mutation(
        "host_gate_cancelled_by_arrivals",
        "python/fastqwen/engine/llm_engine.py",
        [
            (
                "        if scheduler.admission.might_admit() and not self.runner.gate_armed:",
                "        if scheduler.admission.might_admit():",
            )
        ],
        ["tests/test_speculative.py::test_an_arrival_waits_one_step_behind_an_armed_gate"],
        "an arrival cancels the armed gate (a verify step run on padding) instead of joining one step later",
    ),
    Mutation(
        "host_gate_ignores_its_flag",
        "csrc/host_gate.cu",
        [("      if (v == expect) {", "      if (true) {")],
        ["tests/test_host_gate_gpu.py::test_work_behind_an_open_gate_reads_what_the_host_wrote_after"],
        "the gate copies the host buffers at once, before the host has written them",
    ),
    Mutation(
        "host_gate_wait_not_measured",
        "csrc/host_gate.cu",
        [
            (
                "    if (waited_ns != nullptr) *waited_ns = global_ns() - start;",
                "    if (waited_ns != nullptr) *waited_ns = 0;",
            )
        ],
        ["tests/test_host_gate_gpu.py::test_the_gate_measures_how_long_the_gpu_waited"],
        "the gate reports no wait (profile_step's gate_path_ms would show the host's path as free)",
    ),
    Mutation(
        "ngram_draft_earliest_occurrence",
        "csrc/ngram_match.cuh",
        [
            (
                "(static_cast<unsigned long long>(n) << 32) | static_cast<unsigned>(e);",
                "(static_cast<unsigned long long>(n) << 32) | static_cast<unsigned>(len - e);",
            )
        ],
        [
            "tests/test_ngram_draft.py::test_kernel_drafts_what_the_reference_drafts[2-4-3]",
            "tests/test_verify_chain.py::test_the_kernel_makes_what_the_host_makes[4-None]",
        ],
        "the device drafts from the earliest occurrence of the tail instead of the latest",
        rebuild=("ngram_draft.cu", "verify_chain.cu"),
    ),
    Mutation(
        "verify_chain_step_not_advanced",
        "csrc/verify_chain.cu",
        [
            (
                "((static_cast<unsigned long long>(words[step_hi]) << 32) | words[step_lo]) + accepted + 1;",
                "((static_cast<unsigned long long>(words[step_hi]) << 32) | words[step_lo]) + accepted;",
            )
        ],
        ["tests/test_verify_chain.py::test_the_kernel_makes_what_the_host_makes[4-None]"],
        "a chained step's sampler rows draw with the seed step of the rejected position, not the next one",
    ),
    Mutation(
        "eagle3_advance_graph_reads_the_first_kept_row",
        "python/fastqwen/engine/eagle3_graphs.py",
        [("            wide[3 * t + r] = lo + kept - 1", "            wide[3 * t + r] = lo")],
        [
            "tests/test_eagle3_batched.py::test_graphed_draft_steps_equal_the_eager_ones[5]",
            "tests/test_eagle3_batched.py::test_graphed_draft_steps_equal_the_eager_ones[6]",
        ],
        "the graphed advance takes the head's prediction at each request's first kept row instead of its last",
    ),
    Mutation(
        "eagle3_fp8_head_lm_head_left_dense",
        "python/fastqwen/model/eagle3.py",
        [
            (
                'for name in ("fc", "qkv", "o_proj", "gate_up", "down", "lm_head")}',
                'for name in ("fc", "qkv", "o_proj", "gate_up", "down")}',
            )
        ],
        ["tests/test_speculative_eagle3.py::test_an_fp8_head_drafts_what_its_fp8_weights_give"],
        "speculative_config.quantization fp8 leaves the head's LM head in the checkpoint's dtype",
    ),
    Mutation(
        "spec_filler_masks_follow_the_filler",
        "python/fastqwen/engine/verify.py",
        [
            (
                "DraftRow(chunk.request, chunk.draft[:i], chunk.draft[: min(i, real)])",
                "DraftRow(chunk.request, chunk.draft[:i])",
            )
        ],
        ["tests/test_speculative.py::test_grammar_cut_drafts_keep_the_verify_graphs"],
        "a filler position's grammar mask is asked for the state after the filler tokens the grammar never allowed",
    ),
    Mutation(
        "spec_paused_requests_without_fillers",
        "python/fastqwen/scheduler/scheduler.py",
        [("            self._fill_drafts(chunks, budget)\n", "            pass\n")],
        ["tests/test_speculative.py::test_requests_paused_for_low_acceptance_keep_the_verify_graphs"],
        "a step where a paused request decodes beside drafting ones runs eagerly instead of replaying the verify graphs",
    ),
    Mutation(
        "spec_short_drafts_not_filled",
        "python/fastqwen/scheduler/scheduler.py",
        [("            if short <= 0 or budget < short", "            if chunk.draft or budget < short")],
        [
            "tests/test_speculative.py::test_requests_near_max_tokens_keep_the_verify_graphs",
            "tests/test_speculative.py::test_grammar_cut_drafts_keep_the_verify_graphs",
        ],
        "a draft cut short near max_tokens or by its grammar is left short, so its batch's verify step runs eagerly",
    ),
    Mutation(
        "tp_close_aborts_before_the_graphs_go",
        "python/fastqwen/engine/tensor_parallel.py",
        [
            (
                "            engine.runner.release_graphs()\n        if parallel is not None:\n            parallel.abort_device_group()",
                "            pass\n        if parallel is not None:\n            parallel.abort_device_group()\n        if engine is not None:\n            engine.runner.release_graphs()",
            ),
        ],
        ["tests/test_tensor_parallel.py::test_tp2_matches_hf_and_one_rank"],
        "rank 0 aborts its NCCL communicator while the CUDA graphs that captured its collectives live (hangs on GPUs)",
    ),
    Mutation(
        "spec_failed_early_launch_drops_the_step",
        "python/fastqwen/engine/llm_engine.py",
        [("return StepOutput(output.deltas + failed.deltas, failed.time, output.num_tokens)", "return failed")],
        ["tests/test_speculative.py::test_a_failed_early_launch_fails_only_the_next_steps_requests"],
        "when launching the next step fails, the deltas of the step just recorded are lost (a finished request hangs)",
    ),
    Mutation(
        "eagle3_draft_kv_not_rolled_back",
        EAGLE3_DRAFTER,
        [("            state.num_entries = kept[id(state)]\n", "")],
        [EAGLE3_DRAFTS],
        "the head's KV of its draft positions stays after drafting (the next positions attend to unverified drafts)",
    ),
    Mutation(
        "eagle3_rows_read_another_requests_pages",
        EAGLE3_DRAFTER,
        [("            tables.append(state.pages)", "            tables.append(rows[0][0].pages)")],
        [EAGLE3_DRAFTS],
        "every request of the head's batch attends through the first request's page table",
    ),
    Mutation(
        "eagle3_preempted_request_keeps_head_pages",
        "python/fastqwen/scheduler/scheduler.py",
        [("            self.speculator.preempt(request)", "            pass")],
        ["tests/test_eagle3_batched.py::test_greedy_output_with_batched_drafts_equals_speculation_off"],
        "a preempted request's pages in the EAGLE-3 head's pool are not given back while it waits",
    ),
    Mutation(
        "eagle3_graph_steps_give_no_hidden_states",
        "python/fastqwen/engine/model_runner.py",
        [("return graphs.aux[:num_rows].clone() if self.capture_aux else None", "return None")],
        ["tests/test_speculative_eagle3.py::test_verify_graphs_stay_on_with_eagle3"],
        "steps that replay CUDA graphs hand the EAGLE-3 drafter no hidden states (it drafts from stale ones, or not)",
    ),
    Mutation(
        "eagle3_captured_forward_writes_no_hidden_states",
        "python/fastqwen/engine/cuda_graph.py",
        [("aux = self.aux[:rows] if self.aux is not None else None", "aux = None")],
        ["tests/test_speculative_gpu.py::test_eagle3_drafts_from_the_verify_graphs_hidden_states[None]"],
        "the captured graphs do not write the target's hidden states at the head's layers (the buffer stays unset)",
        gpus=1,
    ),
]


SAMPLER = "csrc/sampling.cu"
SAMPLER_DRAWS = "tests/test_sampler_gpu.py::test_draws_stay_in_the_reference_set_and_match_its_distribution"
ROPE_KV = "csrc/rope_kv.cu"
ROPE_KV_TESTS = [  # 33 tokens: a head per warp; 257: four
    "tests/test_kernels_gpu.py::test_qk_norm_rope_store_kv[33-16-32-8-dtype0]",
    "tests/test_kernels_gpu.py::test_qk_norm_rope_store_kv[257-16-32-8-dtype0]",
]
NORM = "csrc/norm.cu"
ACTIVATION = "csrc/activation.cu"
SILU_TESTS = ["tests/test_silu_and_mul.py::test_kernel_matches_reference[4096-7-dtype0]"]
GEMV_TC = "csrc/gemv_tc.cu"
FP8_QUANT = "csrc/fp8_quant.cu"
FP8_QUANT_TESTS = [
    "tests/test_gemv_gpu.py::test_fp8_activation_quantizer_matches_reference[17-1024]",
    "tests/test_gemv_gpu.py::test_fp8_activation_quantizer_matches_reference[17-12416]",
    "tests/test_gemv_gpu.py::test_fp8_activation_quantizer_matches_reference[333-12416]",  # (the form for large inputs)
]
ALLOCATOR = "csrc/page_allocator.cpp"

# The kernel families beside attention and the one-token GEMV (issue 43): the sampler, RoPE + KV write, the norms,
# SiLU-and-mul, the tensor-core GEMV, FP8 quantization, e4m3 conversion, the custom all-reduce, the page allocator.
MUTATIONS += [
    Mutation(
        "sampler_top_p_drops_the_crossing_token",
        SAMPLER,
        [
            (
                "  const bool pa = p_off || (z_known && __fdiv_rn(ca - wa, zk) < r.p.top_p);",
                "  const bool pa = p_off || (z_known && __fdiv_rn(ca, zk) < r.p.top_p);",
            ),
            (
                "  const bool pb = p_off || (z_known && __fdiv_rn(cb - wb, zk) < r.p.top_p);",
                "  const bool pb = p_off || (z_known && __fdiv_rn(cb, zk) < r.p.top_p);",
            ),
        ],
        [f"{SAMPLER_DRAWS}[case0-dtype0]", f"{SAMPLER_DRAWS}[case6-dtype0]"],
        "top-p keeps a token when the mass up to and including it is below top_p, so the token that crosses top_p "
        "(which the nucleus includes) is never drawn",
    ),
    Mutation(
        "sampler_min_p_against_the_probability",
        SAMPLER,
        [
            (
                "  const bool keep_a = va && in_a && pa && ea >= r.p.min_p;",
                "  const bool keep_a = va && in_a && pa && ea >= r.p.min_p * sum64;",
            ),
            (
                "  const bool keep_b = vb && in_b && pb && eb >= r.p.min_p;",
                "  const bool keep_b = vb && in_b && pb && eb >= r.p.min_p * sum64;",
            ),
        ],
        ["tests/test_sampler_gpu.py::test_min_p_keeps_tokens_by_their_ratio_to_the_top"],
        "min-p compares a token's probability (over the 64 best) with min_p instead of its ratio to the top token's",
    ),
    Mutation(
        "sampler_reads_row_lists_at_the_grid_stride",
        SAMPLER,
        [
            (
                "  const int64_t at = static_cast<int64_t>(row) * ws.max_ctas * kList;",
                "  const int64_t at = static_cast<int64_t>(row) * ctas * kList;",
            )
        ],
        [
            "tests/test_sampler_gpu.py::test_logprobs_of_sampled_rows_and_bf16",
            "tests/test_sampler_gpu.py::test_same_seed_and_step_give_the_same_token_whatever_the_batch",
        ],
        "the finish kernel finds a row's candidate lists at row * (scan blocks launched) where the scan wrote them at "
        "row * (blocks the workspace holds): in batches of more than a few rows, a row decides from another row's list",
    ),
    Mutation(
        "rope_rotates_the_wrong_way",
        ROPE_KV,
        [
            (
                "      const float rotated = first_half ? -partner : partner;",
                "      const float rotated = first_half ? partner : -partner;",
            )
        ],
        ROPE_KV_TESTS,
        "rotate_half's sign on the wrong half: q and k turned by -position",
    ),
    Mutation(
        "rope_without_weights_normed_anyway",
        ROPE_KV,
        [
            (
                "    if (normed) {  // (warp-uniform; without weights q and k are rotated as they are",
                "    if (true) {  // (warp-uniform; without weights q and k are rotated as they are",
            )
        ],
        ["tests/test_kernels_gpu.py::test_rope_store_kv_without_norms_runs_the_kernel[33-dtype0]"],
        "without norm weights (the EAGLE-3 head's layer) q and k still go through the norm, with zero weights",
    ),
    Mutation(
        "rope_row_of_the_token_index",
        ROPE_KV,
        [
            (
                "  const float* cs = cos_sin + (pos_ok ? pos : 0) * D;",
                "  const float* cs = cos_sin + (pos_ok ? t : 0) * D;",
            )
        ],
        ROPE_KV_TESTS,
        "cos and sin read at the token's index in the batch instead of its position",
    ),
    Mutation(
        "kv_write_leaves_out_the_q_heads",
        ROPE_KV,
        [
            (
                "      const int64_t dst = (slot * num_kv_heads + (h - num_heads)) * D + lane * kEpl;",
                "      const int64_t dst = (slot * num_kv_heads + h) * D + lane * kEpl;",
            )
        ],
        ROPE_KV_TESTS,
        "a KV head's slot offset counts the q heads before it (h, not h - num_heads): K and V land in later slots",
    ),
    Mutation(
        "kv_fp8_k_written_with_v_scale",
        ROPE_KV,
        [("      store_kv(k_cache + dst, out, k_scale);", "      store_kv(k_cache + dst, out, v_scale);")],
        ["tests/test_fp8_kv_gpu.py::test_rope_kv_writes_fp8[128-dtype0]"],
        "K is divided by V's scale on its way into an FP8 cache",
    ),
    Mutation(
        "norm_eps_left_out",
        NORM,
        [
            (
                "  const float inv_rms = rsqrtf(block_sum(sum_sq) / static_cast<float>(hidden) + eps);\n  P* orow",
                "  const float inv_rms = rsqrtf(block_sum(sum_sq) / static_cast<float>(hidden));\n  P* orow",
            )
        ],
        ["tests/test_kernels_gpu.py::test_norms_where_eps_counts[1e-06]"],
        "the one-pass RMSNorm leaves eps out of the rsqrt (rows whose mean square is near eps, and rows of zeros)",
    ),
    Mutation(
        "fused_norm_leaves_the_residual_unwritten",
        NORM,
        [("        rrow[v] = vals[i];\n", "")],
        ["tests/test_kernels_gpu.py::test_rms_norm_and_fused_add[17-4096-dtype0]"],
        "the one-pass residual-add + RMSNorm normalizes x + residual but does not store the sum as the new residual",
    ),
    Mutation(
        "fused_norm_two_pass_normalizes_the_input",
        NORM,
        [("  const T* src = FUSED ? residual : x;", "  const T* src = x;")],
        ["tests/test_kernels_gpu.py::test_norms_on_misaligned_rows"],
        "the two-pass residual-add + RMSNorm (any size or alignment) scales x instead of x + residual in its second pass",
    ),
    Mutation(
        "silu_of_up_times_gate",
        ACTIVATION,
        [
            (
                "    for (int k = 0; k < VEC; ++k) r.v[k] = silu_mul(g.v[k], u.v[k]);",
                "    for (int k = 0; k < VEC; ++k) r.v[k] = silu_mul(u.v[k], g.v[k]);",
            )
        ],
        SILU_TESTS,
        "the halves swapped: silu(up) * gate",
    ),
    Mutation(
        "silu_rows_strided_by_d",
        ACTIVATION,
        [
            (
                "    const P* gate = reinterpret_cast<const P*>(x + row * 2 * d);\n"
                "    const P* up = reinterpret_cast<const P*>(x + row * 2 * d + d);",
                "    const P* gate = reinterpret_cast<const P*>(x + row * d);\n"
                "    const P* up = reinterpret_cast<const P*>(x + row * d + d);",
            )
        ],
        SILU_TESTS,
        "input rows taken d apart instead of 2 * d (the output's row length): every row past the first reads the wrong "
        "gate and up",
    ),
    Mutation(
        "gemv_tc_warp_drops_its_last_step",
        GEMV_TC,
        [
            (
                "  const int my_units = (units - warp + kWarps - 1) / kWarps;",
                "  const int my_units = (units - warp) / kWarps;",
            )
        ],
        ["tests/test_gemv_gpu.py::test_gemv_matches_reference_on_qwen3_shapes[Qwen3-0.6B-bf16]"],
        "a warp's count of 128-byte steps rounded down: warps 1 to 7 skip their last k-chunk of every row",
    ),
    Mutation(
        "gemv_tc_last_partial_tile_dropped",
        GEMV_TC,
        [
            (
                "return silu ? (n / 2 + 7) / 8 : (n + 15) / 16; }",
                "return silu ? (n / 2 + 7) / 8 : n / 16; }",
            )
        ],
        ["tests/test_gemv_gpu.py::test_gemv_lm_head_odd_rows_bias_and_fp16[bf16]"],
        "the grid has n / 16 row tiles, rounded down: the rows past the last multiple of 16 are never computed",
    ),
    Mutation(
        "fp8_quant_scale_inverted",
        "csrc/fp8_quant.cuh",
        [
            (
                "float group_scale(float amax) { return fmaxf(amax, 1e-12f) / kE4M3Max; }",
                "float group_scale(float amax) { return kE4M3Max / fmaxf(amax, 1e-12f); }",
            )
        ],
        FP8_QUANT_TESTS + ["tests/test_gemv_gpu.py::test_norm_quantized_in_one_pass_is_the_quantized_norm[4096-bf16]"],
        "the activation scale is 448 / amax instead of amax / 448 (the quantizer's and the quantizing norm's)",
        rebuild=("fp8_quant.cu", "norm.cu"),
    ),
    Mutation(
        "fp8_quant_scales_row_major",
        FP8_QUANT,
        [
            (
                "  if (sub == 0) scale_t[static_cast<int64_t>(group) * padded_m + row] = scale;",
                "  if (sub == 0) scale_t[static_cast<int64_t>(row) * groups + group] = scale;",
            )
        ],
        FP8_QUANT_TESTS,
        "the scales written token-major where the GEMM reads them column-major (group * padded rows + row)",
    ),
    Mutation(
        "fp8_quant_group_max_over_half_its_threads",
        FP8_QUANT,
        [
            (
                "    for (int o = kThreadsPerGroup / 2; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(mask, amax, o));",
                "    for (int o = kThreadsPerGroup / 4; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(mask, amax, o));",
            )
        ],
        FP8_QUANT_TESTS,
        "a group's largest value is reduced over 4 of its 8 threads: half its columns scaled by another half's amax",
    ),
    Mutation(
        "fp8_quant_last_block_of_a_row_dropped",
        FP8_QUANT,
        [
            (
                "  const dim3 grid((groups + kGroupsPerBlock - 1) / kGroupsPerBlock, static_cast<unsigned>(padded_m));",
                "  const dim3 grid(groups / kGroupsPerBlock > 0 ? groups / kGroupsPerBlock : 1, static_cast<unsigned>(padded_m));",
            )
        ],
        FP8_QUANT_TESTS,
        "the grid rounds a row's blocks down: the groups past the last multiple of 8 are never quantized",
    ),
    Mutation(
        "fp8_quant_silu_takes_the_gate_for_up",
        FP8_QUANT,
        [
            (
                "        const Pack<T, kWidth> up = *reinterpret_cast<const Pack<T, kWidth>*>(in + k + l * kStride);",
                "        const Pack<T, kWidth> up = *reinterpret_cast<const Pack<T, kWidth>*>(in + l * kStride);",
            )
        ],
        [
            "tests/test_gemv_gpu.py::test_silu_activation_quantized_in_one_pass_is_the_quantized_silu_and_mul[small-bf16]",
            "tests/test_gemv_gpu.py::test_silu_activation_quantized_in_one_pass_is_the_quantized_silu_and_mul[large-bf16]",
        ],
        "the fused SiLU quantization multiplies silu(gate) by the gate instead of the up projection",
    ),
    Mutation(
        "norm_fp8_group_max_over_half_its_lanes",
        "csrc/norm.cu",
        [
            (
                "      for (int off = 8; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));",
                "      for (int off = 4; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));",
            )
        ],
        [
            "tests/test_gemv_gpu.py::test_norm_quantized_in_one_pass_is_the_quantized_norm[4096-bf16]",
            "tests/test_gemv_gpu.py::test_norm_quantized_in_one_pass_is_the_quantized_norm[5120-bf16]",
        ],
        "the quantizing norm reduces a group's largest value over 8 of its 16 lanes: half of each group scaled apart",
    ),
    Mutation(
        "fp8_quant_second_load_at_the_wrong_columns",
        FP8_QUANT,
        [
            (
                "  constexpr int kStride = kFp8QuantGroup / kLoads;  // columns between a thread's loads",
                "  constexpr int kStride = kFp8QuantGroup / 4;  // columns between a thread's loads",
            )
        ],
        FP8_QUANT_TESTS,
        "the large inputs' form reads and writes its second pack 32 columns on instead of 64: half of each group twice",
    ),
    Mutation(
        "e4m3_read_as_e5m2",
        "csrc/kv_fp8.cuh",
        [
            (
                "__nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(v & 0xffffu), __NV_E4M3);",
                "__nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(v & 0xffffu), __NV_E5M2);",
            )
        ],
        [
            "tests/test_fp8_kv_gpu.py::test_decode_fp8[16-4-dtype0]",
            "tests/test_fp8_kv_gpu.py::test_prefill_fp8[hopper-64-4-dtype0]",
            "tests/test_fp8_kv_gpu.py::test_prefill_fp8[tensor_cores-64-4-dtype0]",
            "tests/test_gemv_gpu.py::test_gemv_matches_reference_on_qwen3_shapes[Qwen3-0.6B-fp8]",
            "tests/test_fp8_kv_gpu.py::test_engine_fp8_weights_and_fp8_kv_match_the_reference_ops",
        ],
        "fp8x2_to_half2 decodes the bytes as e5m2 (5 exponent bits, bias 15) instead of e4m3 (4, bias 7): the FP8 KV "
        "cache's reads in decode and prefill attention (both prefill kernels), and the one-token FP8 GEMV's weights",
        rebuild=("attention_decode.cu", "attention_prefill.cu", "attention_prefill_hopper.cu", "gemv.cu"),
    ),
    Mutation(
        "e4m3_high_pair_from_the_low_bytes",
        "csrc/common.cuh",
        [
            (
                '  asm("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, %1; cvt.rn.f16x2.e4m3x2 %0, hi; }" : "=r"(out) : "r"(bits));',
                '  asm("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, %1; cvt.rn.f16x2.e4m3x2 %0, lo; }" : "=r"(out) : "r"(bits));',
            )
        ],
        [
            "tests/test_gemv_gpu.py::test_gemv_matches_reference_on_qwen3_shapes[Qwen3-0.6B-fp8]",
            "tests/test_fp8_kv_gpu.py::test_decode_fp8[16-4-dtype0]",
        ],
        "e4m3x2_hi converts the low two bytes: the tensor-core FP8 GEMV uses half of each word's weights twice, and "
        "decode attention half of each FP8 K and V word",
        rebuild=("gemv_tc.cu", "attention_decode.cu"),
    ),
    Mutation(
        "e4m3_bf16_high_pair_swapped",
        "csrc/common.cuh",
        [("return e4m3x2_bf16(bits, 0x3424u);", "return e4m3x2_bf16(bits, 0x2434u);")],
        [
            "tests/test_gemv_gpu.py::test_tensor_core_fp8_pipelines_read_every_e4m3_value_exactly[bf16-7]",
            "tests/test_gemv_gpu.py::test_tensor_core_fp8_pipelines_equal_the_first_bit_for_bit[7]",
        ],
        "e4m3x2_hi_bf16 swaps the word's two high bytes: the bf16 FP8 GEMV pipelines pair weights with the wrong x",
        rebuild=("gemv_tc.cu",),
    ),
    Mutation(
        "e4m3_bf16_subnormals_as_normals",
        "csrc/common.cuh",
        [
            (
                '  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(out) : "r"(placed), "r"(0x7b807b80u), "r"(0x80008000u));',
                "  out = placed + 0x3c003c00u;",
            )
        ],
        ["tests/test_gemv_gpu.py::test_tensor_core_fp8_pipelines_read_every_e4m3_value_exactly[bf16-7]"],
        "e4m3x2_bf16 adds the exponent bias as an integer instead of multiplying: right for normal values, wrong for "
        "e4m3 subnormals (read as 2^-7 (1 + m/8) instead of 2^-6 m/8)",
        rebuild=("gemv_tc.cu",),
    ),
    Mutation(
        "e4m3_write_without_saturation",
        "csrc/kv_fp8.cuh",
        [("__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3)", "__nv_cvt_float_to_fp8(x, __NV_NOSAT, __NV_E4M3)")],
        ["tests/test_fp8_kv_gpu.py::test_rope_kv_writes_fp8[128-dtype0]"],
        "the FP8 KV write does not saturate: values past 448 become NaN instead of 448",
        rebuild=("rope_kv.cu",),
    ),
    Mutation(
        "all_reduce_drops_the_last_rank",
        "csrc/custom_all_reduce.cu",
        [
            (
                "  for (int p = 0; p < WORLD; ++p) {  // rank order on every rank",
                "  for (int p = 0; p < WORLD - 1; ++p) {  // rank order on every rank",
            )
        ],
        [
            "tests/test_tensor_parallel_gpu.py::test_custom_all_reduce_matches_the_sum_and_nccl[2]",
            "tests/test_tensor_parallel_gpu.py::test_one_barrier_all_reduce_matches_the_sum_and_nccl[2]",
        ],
        "the all-reduce (one barrier or none: they share sum_in_rank_order) sums every rank's vector but the last one's",
        gpus=2,
    ),
    Mutation(
        "barrier_free_all_reduce_leaves_the_previous_buffer_full",
        "csrc/custom_all_reduce.cu",
        [
            (
                "  if (slot_vecs == 0) return;\n  const int previous",
                "  if (slot_vecs >= 0) return;\n  const int previous",
            )
        ],
        ["tests/test_tensor_parallel_gpu.py::test_custom_all_reduce_matches_the_sum_and_nccl[2]"],
        "the receive buffers are never emptied: three rounds on, a rank sums what a peer sent back then",
        gpus=2,
    ),
    Mutation(
        "all_reduce_norm_adds_the_residual_twice",
        "csrc/custom_all_reduce.cu",
        [
            (
                "sum[i].v[k] = Cvt<T>::from_f(Cvt<T>::to_f(sum[i].v[k]) + Cvt<T>::to_f(res[i].v[k]));",
                "sum[i].v[k] = Cvt<T>::from_f(Cvt<T>::to_f(sum[i].v[k]) + 2.0f * Cvt<T>::to_f(res[i].v[k]));",
            )
        ],
        ["tests/test_tensor_parallel_gpu.py::test_fused_all_reduce_norm_matches_float64[2]"],
        "the all-reduce fused with the norm adds the residual to the ranks' sum twice",
        gpus=2,
    ),
    Mutation(
        "all_reduce_norm_drops_the_last_rank",
        "csrc/custom_all_reduce.cu",
        [
            (
                "        for (int p = 0; p < WORLD; ++p) {  // rank order, as one_shot_kernel",
                "        for (int p = 0; p < WORLD - 1; ++p) {  // rank order, as one_shot_kernel",
            )
        ],
        ["tests/test_tensor_parallel_gpu.py::test_fused_all_reduce_norm_matches_float64[2]"],
        "the all-reduce fused with the norm sums every rank's partial rows but the last rank's",
        gpus=2,
    ),
    Mutation(
        "one_barrier_all_reduce_copies_into_one_half",
        "csrc/custom_all_reduce.cu",
        [
            (
                "  return end_barrier ? 0 : static_cast<int64_t>(round & 1u) * half_vecs;",
                "  return 0;",
            )
        ],
        ["tests/test_tensor_parallel_gpu.py::test_one_barrier_all_reduce_matches_the_sum_and_nccl[2]"],
        "the one-barrier all-reduce copies every round into the same half, so a rank a round ahead overwrites what its "
        "peer still sums (the test's calls with one rank late)",
        gpus=2,
    ),
    Mutation(
        "sent_all_reduce_takes_its_own_row_from_data",
        "csrc/custom_all_reduce.cu",
        [
            (
                "    if constexpr (SENT) return received_elements(",
                "    if constexpr (SENT) if (p != rank) return received_elements(",
            )
        ],
        ["tests/test_tensor_parallel_gpu.py::test_sending_gemv_feeds_the_fused_all_reduce[2]"],
        "after a sending GEMV, the fused all-reduce takes its own rank's row from its data (which the GEMV never "
        "wrote), not from the receive buffer the GEMV stored it in",
        gpus=2,
    ),
    Mutation(
        "sending_gemv_stores_into_the_last_rounds_buffer",
        "csrc/gemv.cu",
        [
            (
                "  const int b = static_cast<int>((*send.third + 1) % 3);",
                "  const int b = static_cast<int>(*send.third % 3);",
            )
        ],
        ["tests/test_tensor_parallel_gpu.py::test_sending_gemv_feeds_the_fused_all_reduce[2]"],
        "the sending GEMV stores into the receive buffer of the round before, which the all-reduce does not read "
        "(it waits for a row that never comes: the test's ranks run into their deadline)",
        gpus=2,
    ),
    Mutation(
        "tp_last_layer_down_not_all_reduced",
        "python/fastqwen/model/qwen3.py",
        [
            (
                "        hidden = self.parallel.all_reduce(hidden)  # the last layer's down",
                "        pass  # the last layer's down",
            )
        ],
        ["tests/test_tensor_parallel.py::test_tp2_matches_hf_and_one_rank"],
        "under tensor parallelism the last layer's down projection reaches the final norm as this rank's partial sum "
        "(the other ranks' shards left out)",
    ),
    Mutation(
        "last_layer_row_attends_one_key_short",
        "python/fastqwen/model/qwen3.py",
        [("kv_lens = (batch.positions[rows] + 1)", "kv_lens = (batch.positions[rows] + 0)")],
        ["tests/test_last_layer_rows.py::test_a_chunked_prompt_runs_the_last_layer_for_its_sampling_row_only"],
        "the last layer's sampling rows attend to their sequence's cache without their own key",
    ),
    Mutation(
        "last_layer_row_takes_the_sequence_before",
        "python/fastqwen/model/qwen3.py",
        [("rows, right=True)", "rows, right=False)")],
        ["tests/test_last_layer_rows.py::test_rows_of_a_mixed_batch_find_their_sequences"],
        "a sampling row that is its sequence's first in the batch (a decode row) attends to the sequence before's pages",
    ),
    Mutation(
        "last_layer_runs_every_row",
        "python/fastqwen/model/qwen3.py",
        [
            (
                "        if rows.shape[0] >= num_tokens:\n            return False",
                "        if True:\n            return False",
            )
        ],
        ["tests/test_last_layer_rows.py::test_a_chunked_prompt_runs_the_last_layer_for_its_sampling_row_only"],
        "the last layer computes attention, o_proj and the MLP for prefill rows whose output nothing reads",
    ),
    Mutation(
        "all_reduce_norm_composition_adds_the_residual_twice",
        "python/fastqwen/ops/collectives.py",
        [
            (
                "        summed = self.all_reduce(partial)\n",
                "        summed = self.all_reduce(partial).add_(residual)\n",
            )
        ],
        [
            "tests/test_all_reduce_add_rms_norm.py::test_the_op_is_the_ranks_sum_added_to_the_residual_then_normalized",
            "tests/test_tensor_parallel.py::test_tp2_matches_hf_and_one_rank",
        ],
        "the all-reduce followed by the residual add and norm (the composition, on every path but the fused kernel's) "
        "adds the residual to the ranks' sum twice",
    ),
    Mutation(
        "decref_keeps_freed_pages_off_the_free_list",
        ALLOCATOR,
        [
            (
                "  for (auto it = freed.rbegin(); it != freed.rend(); ++it) free_stack_.push_back(static_cast<int32_t>(*it));\n",
                "",
            )
        ],
        ["tests/test_allocator.py::test_incref_decref", "tests/test_allocator.py::test_randomized_against_model[0]"],
        "decref brings a page's count to 0 and returns it as freed, but never puts it back on the free list (leaked)",
    ),
    Mutation(
        "decref_refcount_off_by_one",
        ALLOCATOR,
        [("    if (count_[p] > refcount_[p]) {", "    if (count_[p] >= refcount_[p]) {")],
        ["tests/test_allocator.py::test_incref_decref", "tests/test_allocator.py::test_randomized_against_model[0]"],
        "decref refuses to take a page's last reference (a decref as many times as the refcount reads as a double free)",
    ),
]


def mutate(text: str, mutation: Mutation) -> str:
    for old, new in mutation.edits:
        if text.count(old) != 1:
            raise RuntimeError(f"{mutation.name}: the text to mutate occurs {text.count(old)} times in {mutation.path}")
        text = text.replace(old, new)
    return text


def installed_package() -> Path:
    out = subprocess.run(
        [sys.executable, "-c", "import fastqwen, os; print(os.path.dirname(fastqwen.__file__))"],
        capture_output=True,
        text=True,
        check=True,
        cwd="/",
    )
    return Path(out.stdout.strip())


def gpus_here() -> int:
    out = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
        capture_output=True,
        text=True,
        cwd="/",
    )
    return int(out.stdout.strip() or 0)


def build_commands(build_dir: Path, sources: tuple[str, ...]) -> tuple[dict[str, str], str, str]:
    """The build's compile command for each csrc/<source>, its link command, and the module's file name."""
    lines = subprocess.run(
        ["ninja", "-C", str(build_dir), "-t", "commands"], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    compiles = {
        source: next(
            line for line in lines if line.rstrip().endswith(f"/csrc/{source}") or f"/csrc/{source} -o" in line
        )
        for source in sources
    }
    link = next(line for line in reversed(lines) if " -shared " in line)
    module = link.split(" -o ", 1)[1].split()[0]
    return compiles, link, module


def prepare(mutation: Mutation, package: Path, work: Path, build_dir: Path | None) -> subprocess.Popen | None:
    """The mutant's package copy under work/; for a native mutation, the compiles and the link started (a Popen)."""
    if work.exists():
        shutil.rmtree(work)
    shutil.copytree(package, work / "fastqwen", ignore=shutil.ignore_patterns("__pycache__"))
    if not mutation.native:
        target = work / "fastqwen" / Path(mutation.path).relative_to("python/fastqwen")
        target.write_text(mutate(target.read_text(), mutation))
        return None
    assert build_dir is not None, "native mutations need --build-dir"
    shutil.copytree(REPO / "csrc", work / "csrc")  # quoted includes resolve next to the file: the mutated header too
    mutated = work / "csrc" / Path(mutation.path).name
    mutated.write_text(mutate(mutated.read_text(), mutation))
    build_dir = build_dir.resolve()
    compiles, link, module = build_commands(build_dir, mutation.sources)
    commands, in_library = [], []
    for source, compile_cmd in compiles.items():
        obj = compile_cmd.split(" -o ", 1)[1].split()[0]  # where the build puts the object (its target's folder)
        mine = str(work / f"{source}.o")
        compile_cmd = compile_cmd.replace(obj, mine)
        original = next(t for t in compile_cmd.split() if t.endswith(f"/csrc/{source}"))  # wherever the build read it
        commands.append(compile_cmd.replace(original, str(work / "csrc" / source)))
        if obj in link:  # an object linked into the module directly (the host code: bindings, page allocator)
            link = link.replace(obj, mine)
        else:
            in_library.append(mine)
    if in_library:  # objects of the kernels' static library (CMakeLists.txt): the mutated ones go first, so the
        # linker takes their symbols and never pulls the original members out of the library
        link = link.replace(f" {KERNEL_LIBRARY}", f" {' '.join(in_library)} {KERNEL_LIBRARY}", 1)
    out_module = work / "fastqwen" / Path(module).name
    for existing in (work / "fastqwen").glob("_C*.so"):
        existing.unlink()
    link = link.replace(f"{build_dir}/{module}", str(out_module)).replace(f" {module}", f" {out_module}")
    log = open(work / "build.log", "w")
    return subprocess.Popen(
        " && ".join(commands + [link]), shell=True, cwd=build_dir, stdout=log, stderr=subprocess.STDOUT
    )


def build(mutation: Mutation, package: Path, work: Path, build_dir: Path | None) -> bool:
    try:
        process = prepare(mutation, package, work, build_dir)
    except Exception as error:  # a missing build command, a drifted text: reported with the mutant
        work.mkdir(parents=True, exist_ok=True)
        (work / "build.log").write_text(f"{type(error).__name__}: {error}\n")
        return False
    return process is None or process.wait() == 0


def built(mutation: Mutation, work: Path) -> bool:
    if not (work / "fastqwen").exists():
        return False
    return not mutation.native or any((work / "fastqwen").glob("_C*.so"))


def run_tests(mutation: Mutation, work: Path) -> tuple[str, str]:
    env = dict(os.environ, PYTHONPATH=f"{work}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    where = subprocess.run(
        [sys.executable, "-c", "import fastqwen; print(fastqwen.__file__)"],
        env=env,
        cwd="/",
        capture_output=True,
        text=True,
    ).stdout.strip()
    if not where.startswith(str(work)):
        return "ERROR", f"the mutant is not what imports: {where}"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *mutation.tests],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    lines = (result.stdout + result.stderr).strip().splitlines()
    errors = [line for line in lines if line.startswith("E  ")][:12]  # the assertion that caught it
    tail = "\n".join(errors + lines[-3:])
    verdict = {0: "SURVIVED", 1: "CAUGHT"}.get(result.returncode, f"ERROR (pytest exit {result.returncode})")
    if result.returncode == 0 and lines and " passed" not in lines[-1]:
        verdict = "NOT CAUGHT (its tests were skipped)"  # neither caught nor a survivor: the tests did not run
    return verdict, tail


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build-dir", type=Path, default=None)
    p.add_argument("--only", choices=["gpu", "cpu"], default=None, help="only the mutants whose tests need a GPU / not")
    p.add_argument("--names", default=None, help="only these mutants (comma-separated names)")
    p.add_argument("--jobs", type=int, default=1, help="mutants tested at once (default 1)")
    p.add_argument("--work", type=Path, default=Path("/tmp/fastqwen-mutants"))
    p.add_argument("--out", type=Path, default=None, help="write mutations.log here")
    p.add_argument(
        "--phase",
        choices=["all", "build", "test"],
        default="all",
        help="build: only make the mutants (e.g. while other tests use the GPU); test: only test those made",
    )
    args = p.parse_args()
    chosen = [m for m in MUTATIONS if args.only is None or (m.gpus > 0) == (args.only == "gpu")]
    if args.names:
        names = set(args.names.split(","))
        unknown = names - {m.name for m in MUTATIONS}
        if unknown:
            p.error(f"no such mutants: {sorted(unknown)}")
        chosen = [m for m in chosen if m.name in names]
    gpus = gpus_here() if any(m.gpus > 1 for m in chosen) else 1
    not_run = {
        m.name: f"NOT RUN (its tests need {m.gpus} GPU{'s' if m.gpus > 1 else ''}, this machine has {gpus})"
        for m in chosen
        if m.gpus > gpus
    }
    if args.build_dir is None:
        for m in chosen:
            if m.native:
                not_run.setdefault(m.name, "NOT RUN (a native mutant: no --build-dir)")
    runnable = [m for m in chosen if m.name not in not_run]
    package = installed_package() if args.phase != "test" else None
    builds = ThreadPoolExecutor(max_workers=os.cpu_count() or 4)
    made = {
        m.name: builds.submit(build, m, package, args.work / m.name, args.build_dir) if args.phase != "test" else None
        for m in runnable
    }
    if args.phase == "build":
        failed = [name for name, future in made.items() if not future.result()]
        print(f"built {len(made) - len(failed)} of {len(made)} mutants" + (f"; failed: {failed}" if failed else ""))
        return 1 if failed else 0

    def verdict_of(mutation: Mutation) -> tuple[str, str]:
        if mutation.name in not_run:
            return not_run[mutation.name], ""
        work = args.work / mutation.name
        future = made[mutation.name]
        if not (future.result() if future is not None else built(mutation, work)):
            log = work / "build.log"
            return "ERROR (build failed)", log.read_text()[-2000:] if log.exists() else "not built"
        return run_tests(mutation, work)

    def report(mutation: Mutation) -> tuple[str, str]:
        verdict, tail = verdict_of(mutation)
        entry = (
            f"== {mutation.name}: {verdict}\n   bug: {mutation.why}\n   tests: {' '.join(mutation.tests)}\n"
            + "\n".join("   | " + t for t in tail.splitlines())
        )
        print(entry, flush=True)  # as each finishes; the log keeps MUTATIONS' order
        return verdict, entry

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as testers:
        results = list(testers.map(report, chosen))
    builds.shutdown()
    verdicts = [verdict for verdict, _ in results]
    lines = [entry for _, entry in results]
    caught = sum(v == "CAUGHT" for v in verdicts)
    ran = sum(not v.startswith("NOT RUN") for v in verdicts)
    summary = f"{caught} of {ran} mutants caught" + (f"; {len(chosen) - ran} not run" if ran < len(chosen) else "")
    print(summary)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "mutations.log").write_text("\n".join(lines + [summary]) + "\n")
    return 0 if caught == ran else 1


if __name__ == "__main__":
    sys.exit(main())
