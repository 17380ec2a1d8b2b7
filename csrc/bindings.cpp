// pybind11 module fastqwen._C. No libtorch: kernels take raw pointers and a
// stream handle; the Python ops validate tensors before calling in.
//
// The contracts between the two languages are defined once, in the headers, and exported from here in every build
// (the CPU-only one too): dtype codes, which dtypes and head sizes each kernel takes, the sampler row's layout and
// the argument structs of the long kernels. Python reads them; it writes no layout of its own.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include <cstddef>

#include "activation.h"
#include "attention.h"
#include "custom_all_reduce.h"
#include "dtype.h"
#include "fp8_quant.h"
#include "gemv.h"
#include "host_gate.h"
#include "ngram_draft.h"
#include "verify_chain.h"
#include "norm.h"
#include "page_allocator.h"
#include "rope_kv.h"
#include "sampling.h"

namespace py = pybind11;
using fastqwen::PageAllocator;

namespace {
// Python ints for pointers/streams may exceed int64 (pointers are unsigned);
// take them as py::int_ and convert checking the range.
uintptr_t to_uintptr(const py::int_& v, const char* name) {
  try {
    return static_cast<uintptr_t>(v.cast<uint64_t>());
  } catch (const py::cast_error&) {
    throw std::invalid_argument(std::string(name) + " must be a non-negative integer that fits in 64 bits");
  }
}

py::tuple codes(unsigned allowed) {
  py::list out;
  for (int c = fastqwen::kF32; c <= fastqwen::kLastDType; ++c) {
    if (fastqwen::dtype_allowed(c, allowed)) out.append(c);
  }
  return py::tuple(out);
}

// SamplerRow's fields: name -> (word offset, kind), kind "f" float32, "i" int32, "u" uint32.
py::dict sampler_row_fields() {
  using fastqwen::SamplerRow;
  py::dict f;
  auto add = [&](const char* name, size_t offset, const char* kind) { f[name] = py::make_tuple(offset / 4, kind); };
  add("temperature", offsetof(SamplerRow, temperature), "f");
  add("top_k", offsetof(SamplerRow, top_k), "i");
  add("top_p", offsetof(SamplerRow, top_p), "f");
  add("min_p", offsetof(SamplerRow, min_p), "f");
  add("seed_lo", offsetof(SamplerRow, seed_lo), "u");
  add("seed_hi", offsetof(SamplerRow, seed_hi), "u");
  add("step_lo", offsetof(SamplerRow, step_lo), "u");
  add("step_hi", offsetof(SamplerRow, step_hi), "u");
  add("slot", offsetof(SamplerRow, slot), "i");
  add("repetition", offsetof(SamplerRow, repetition), "f");
  add("presence", offsetof(SamplerRow, presence), "f");
  add("frequency", offsetof(SamplerRow, frequency), "f");
  add("num_blocked", offsetof(SamplerRow, num_blocked), "i");
  add("top_n", offsetof(SamplerRow, top_n), "i");
  add("masked", offsetof(SamplerRow, masked), "i");
  return f;
}

void export_contracts(py::module_& m) {
  namespace fq = fastqwen;
  m.attr("DTYPE_F32") = static_cast<int>(fq::kF32);
  m.attr("DTYPE_F16") = static_cast<int>(fq::kF16);
  m.attr("DTYPE_BF16") = static_cast<int>(fq::kBF16);
  py::dict dtype_codes;
  for (int c = fq::kF32; c <= fq::kLastDType; ++c) dtype_codes[fq::dtype_name(c)] = c;
  m.attr("DTYPE_CODES") = dtype_codes;
  // The dtype codes each kernel takes (on anything else the Python op runs its reference).
  py::dict kernel_dtypes;
  kernel_dtypes["silu_and_mul"] = codes(fq::kFloatTypes);
  kernel_dtypes["rms_norm"] = codes(fq::kHalfTypes);
  kernel_dtypes["qk_norm_rope_store_kv"] = codes(fq::kHalfTypes);
  kernel_dtypes["paged_attention"] = codes(fq::kHalfTypes);
  // What the KV caches of those two kernels may hold: q's own type, or FP8 e4m3 (with per-tensor scales).
  kernel_dtypes["kv_cache"] = codes(fq::kKVCacheTypes);
  kernel_dtypes["sample"] = codes(fq::kSamplerLogitTypes);
  kernel_dtypes["gemv"] = codes(fq::kHalfTypes);
  kernel_dtypes["quantize_fp8_tokens"] = codes(fq::kHalfTypes);
  kernel_dtypes["all_reduce_add_rms_norm"] = codes(fq::kHalfTypes);
  m.attr("KERNEL_DTYPES") = kernel_dtypes;
  m.attr("ATTENTION_HEAD_DIM") = fq::kAttentionHeadDim;
  py::list rope_dims;
  for (int d : fq::kRopeKVHeadDims) rope_dims.append(d);
  m.attr("ROPE_KV_HEAD_DIMS") = py::tuple(rope_dims);
  m.attr("DECODE_MAX_SPLITS") = fq::kDecodeMaxSplits;
  m.def("decode_plan_ints", &fq::decode_plan_ints, py::arg("max_batch"),
        "int32 entries of a split-KV decode plan for up to max_batch sequences: the chunk offsets, then each chunk's "
        "record (csrc/attention.h).");
  m.attr("PREFILL_HOPPER_VARIANTS") = fq::kPrefillHopperVariants;
  m.attr("GEMV_MAX_TOKENS") = fq::kGemvMaxTokens;
  m.attr("GEMV_FP8_BLOCK") = fq::kGemvFp8Block;
  m.attr("GEMV_TENSOR_CORE_TOKENS") = py::make_tuple(fq::kGemvTcMinTokens, fq::kGemvTcMaxTokens);
  m.attr("SAMPLER_ROW_WORDS") = static_cast<int>(sizeof(fq::SamplerRow) / 4);
  m.attr("SAMPLER_ROW_FIELDS") = sampler_row_fields();
  m.attr("SAMPLER_MAX_TOP_N") = fq::kSamplerMaxTopN;
  m.attr("COUNT_MASK") = fq::kCountMask;
  m.attr("PROMPT_BIT") = fq::kPromptBit;
  m.attr("ALL_REDUCE_MAX_RANKS") = fq::kAllReduceMaxRanks;
  m.attr("ALL_REDUCE_MAX_BLOCKS") = fq::kAllReduceMaxBlocks;
  m.attr("ALL_REDUCE_ALIGN") = fq::kAllReduceAlign;
  m.attr("ALL_REDUCE_NORM_MAX_HIDDEN") = fq::kAllReduceNormMaxHidden;
  m.attr("ALL_REDUCE_SEND_TARGET_BYTES") = fq::kAllReduceSendTargetBytes;

  py::class_<fq::RopeKVArgs>(m, "RopeKVArgs", "Arguments of qk_norm_rope_store_kv (csrc/rope_kv.h).")
      .def(py::init<>())
      .def_readwrite("qkv", &fq::RopeKVArgs::qkv)
      .def_readwrite("q_weight", &fq::RopeKVArgs::q_weight)
      .def_readwrite("k_weight", &fq::RopeKVArgs::k_weight)
      .def_readwrite("cos_sin", &fq::RopeKVArgs::cos_sin)
      .def_readwrite("positions", &fq::RopeKVArgs::positions)
      .def_readwrite("k_cache", &fq::RopeKVArgs::k_cache)
      .def_readwrite("v_cache", &fq::RopeKVArgs::v_cache)
      .def_readwrite("out_slots", &fq::RopeKVArgs::out_slots)
      .def_readwrite("q_out", &fq::RopeKVArgs::q_out)
      .def_readwrite("num_tokens", &fq::RopeKVArgs::num_tokens)
      .def_readwrite("num_heads", &fq::RopeKVArgs::num_heads)
      .def_readwrite("num_kv_heads", &fq::RopeKVArgs::num_kv_heads)
      .def_readwrite("head_dim", &fq::RopeKVArgs::head_dim)
      .def_readwrite("max_pos", &fq::RopeKVArgs::max_pos)
      .def_readwrite("num_slots", &fq::RopeKVArgs::num_slots)
      .def_readwrite("eps", &fq::RopeKVArgs::eps)
      .def_readwrite("dtype", &fq::RopeKVArgs::dtype)
      .def_readwrite("kv_dtype", &fq::RopeKVArgs::kv_dtype)
      .def_readwrite("k_scale", &fq::RopeKVArgs::k_scale)
      .def_readwrite("v_scale", &fq::RopeKVArgs::v_scale)
      .def_readwrite("stream", &fq::RopeKVArgs::stream);
  py::class_<fq::VerifyChainArgs>(m, "VerifyChainArgs", "Arguments of verify_chain (csrc/verify_chain.h).")
      .def(py::init<>())
      .def_readwrite("tokens", &fq::VerifyChainArgs::tokens)
      .def_readwrite("input_ids", &fq::VerifyChainArgs::input_ids)
      .def_readwrite("positions", &fq::VerifyChainArgs::positions)
      .def_readwrite("out_slots", &fq::VerifyChainArgs::out_slots)
      .def_readwrite("kv_lens", &fq::VerifyChainArgs::kv_lens)
      .def_readwrite("page_table", &fq::VerifyChainArgs::page_table)
      .def_readwrite("rows", &fq::VerifyChainArgs::rows)
      .def_readwrite("history", &fq::VerifyChainArgs::history)
      .def_readwrite("lens", &fq::VerifyChainArgs::lens)
      .def_readwrite("credit", &fq::VerifyChainArgs::credit)
      .def_readwrite("report", &fq::VerifyChainArgs::report)
      .def_readwrite("batch", &fq::VerifyChainArgs::batch)
      .def_readwrite("q", &fq::VerifyChainArgs::q)
      .def_readwrite("width", &fq::VerifyChainArgs::width)
      .def_readwrite("stride", &fq::VerifyChainArgs::stride)
      .def_readwrite("page_size", &fq::VerifyChainArgs::page_size)
      .def_readwrite("row_words", &fq::VerifyChainArgs::row_words)
      .def_readwrite("step_lo", &fq::VerifyChainArgs::step_lo)
      .def_readwrite("step_hi", &fq::VerifyChainArgs::step_hi)
      .def_readwrite("n_min", &fq::VerifyChainArgs::n_min)
      .def_readwrite("n_max", &fq::VerifyChainArgs::n_max)
      .def_readwrite("synthetic", &fq::VerifyChainArgs::synthetic)
      .def_readwrite("stream", &fq::VerifyChainArgs::stream);
  py::class_<fq::NgramDraftArgs>(m, "NgramDraftArgs", "Arguments of ngram_draft (csrc/ngram_draft.h).")
      .def(py::init<>())
      .def_readwrite("history", &fq::NgramDraftArgs::history)
      .def_readwrite("lens", &fq::NgramDraftArgs::lens)
      .def_readwrite("drafts", &fq::NgramDraftArgs::drafts)
      .def_readwrite("counts", &fq::NgramDraftArgs::counts)
      .def_readwrite("batch", &fq::NgramDraftArgs::batch)
      .def_readwrite("stride", &fq::NgramDraftArgs::stride)
      .def_readwrite("n_min", &fq::NgramDraftArgs::n_min)
      .def_readwrite("n_max", &fq::NgramDraftArgs::n_max)
      .def_readwrite("k", &fq::NgramDraftArgs::k)
      .def_readwrite("stream", &fq::NgramDraftArgs::stream);
  m.attr("NGRAM_DRAFT_MAX_N") = fq::kNgramDraftMaxN;
  m.attr("NGRAM_DRAFT_MAX_K") = fq::kNgramDraftMaxK;
  py::class_<fq::PagedAttentionArgs>(m, "PagedAttentionArgs", "What both attention kernels take (csrc/attention.h).")
      .def_readwrite("q", &fq::PagedAttentionArgs::q)
      .def_readwrite("out", &fq::PagedAttentionArgs::out)
      .def_readwrite("k_cache", &fq::PagedAttentionArgs::k_cache)
      .def_readwrite("v_cache", &fq::PagedAttentionArgs::v_cache)
      .def_readwrite("page_table", &fq::PagedAttentionArgs::page_table)
      .def_readwrite("kv_lens", &fq::PagedAttentionArgs::kv_lens)
      .def_readwrite("batch", &fq::PagedAttentionArgs::batch)
      .def_readwrite("num_heads", &fq::PagedAttentionArgs::num_heads)
      .def_readwrite("num_kv_heads", &fq::PagedAttentionArgs::num_kv_heads)
      .def_readwrite("head_dim", &fq::PagedAttentionArgs::head_dim)
      .def_readwrite("page_size", &fq::PagedAttentionArgs::page_size)
      .def_readwrite("max_pages", &fq::PagedAttentionArgs::max_pages)
      .def_readwrite("num_pages", &fq::PagedAttentionArgs::num_pages)
      .def_readwrite("scale", &fq::PagedAttentionArgs::scale)
      .def_readwrite("dtype", &fq::PagedAttentionArgs::dtype)
      .def_readwrite("kv_dtype", &fq::PagedAttentionArgs::kv_dtype)
      .def_readwrite("k_scale", &fq::PagedAttentionArgs::k_scale)
      .def_readwrite("v_scale", &fq::PagedAttentionArgs::v_scale)
      .def_readwrite("stream", &fq::PagedAttentionArgs::stream);
  py::class_<fq::DecodeArgs, fq::PagedAttentionArgs>(m, "DecodeArgs", "Arguments of paged_attention_decode.")
      .def(py::init<>())
      .def_readwrite("split_offsets", &fq::DecodeArgs::split_offsets)
      .def_readwrite("part_out", &fq::DecodeArgs::part_out)
      .def_readwrite("part_lse", &fq::DecodeArgs::part_lse)
      .def_readwrite("workspace_rows", &fq::DecodeArgs::workspace_rows)
      .def_readwrite("plan_fresh", &fq::DecodeArgs::plan_fresh);
  py::class_<fq::PrefillArgs, fq::PagedAttentionArgs>(m, "PrefillArgs", "Arguments of paged_attention_prefill.")
      .def(py::init<>())
      .def_readwrite("query_start", &fq::PrefillArgs::query_start)
      .def_readwrite("max_query_len", &fq::PrefillArgs::max_query_len)
      .def_readwrite("num_tokens", &fq::PrefillArgs::num_tokens);
  py::enum_<fq::GemvEpilogue>(m, "GemvEpilogue", "What a GEMV does besides x @ W^T (csrc/gemv.h).")
      .value("PLAIN", fq::kGemvPlain)
      .value("ADD_RESIDUAL", fq::kGemvAddResidual)
      .value("NORM_X", fq::kGemvNormX)
      .value("NORM_X_FOLDED", fq::kGemvNormXFolded)
      .value("SEND", fq::kGemvSend);
  py::class_<fq::GemvArgs>(m, "GemvArgs", "Arguments of gemv and gemv_norm (csrc/gemv.h).")
      .def(py::init<>())
      .def_readwrite("out", &fq::GemvArgs::out)
      .def_readwrite("x", &fq::GemvArgs::x)
      .def_readwrite("w", &fq::GemvArgs::w)
      .def_readwrite("scale", &fq::GemvArgs::scale)
      .def_readwrite("bias", &fq::GemvArgs::bias)
      .def_readwrite("m", &fq::GemvArgs::m)
      .def_readwrite("n", &fq::GemvArgs::n)
      .def_readwrite("k", &fq::GemvArgs::k)
      .def_readwrite("dtype", &fq::GemvArgs::dtype)
      .def_readwrite("fp8", &fq::GemvArgs::fp8)
      .def_readwrite("silu_gate_up", &fq::GemvArgs::silu_gate_up)
      .def_readwrite("epilogue", &fq::GemvArgs::epilogue)
      .def_readwrite("norm_weight", &fq::GemvArgs::norm_weight)
      .def_readwrite("eps", &fq::GemvArgs::eps)
      .def_readwrite("send", &fq::GemvArgs::send)
      .def_readwrite("send_capacity", &fq::GemvArgs::send_capacity)
      .def_readwrite("stream", &fq::GemvArgs::stream);
  py::class_<fq::AllReduceArgs>(m, "AllReduceArgs", "Arguments of custom_all_reduce (csrc/custom_all_reduce.h).")
      .def(py::init<>())
      .def_property(
          "buffers",
          [](const fq::AllReduceArgs& a) {
            py::list out;
            for (int p = 0; p < a.world && p < fq::kAllReduceMaxRanks; ++p) out.append(a.buffers[p]);
            return out;
          },
          [](fq::AllReduceArgs& a, const std::vector<uint64_t>& ptrs) {
            if (ptrs.size() > static_cast<size_t>(fq::kAllReduceMaxRanks)) {
              throw std::invalid_argument("AllReduceArgs.buffers: at most ALL_REDUCE_MAX_RANKS buffers");
            }
            for (int p = 0; p < fq::kAllReduceMaxRanks; ++p) a.buffers[p] = p < static_cast<int>(ptrs.size()) ? ptrs[p] : 0;
          })
      .def_readwrite("rank", &fq::AllReduceArgs::rank)
      .def_readwrite("world", &fq::AllReduceArgs::world)
      .def_readwrite("data", &fq::AllReduceArgs::data)
      .def_readwrite("numel", &fq::AllReduceArgs::numel)
      .def_readwrite("capacity_bytes", &fq::AllReduceArgs::capacity_bytes)
      .def_readwrite("lamport_bytes", &fq::AllReduceArgs::lamport_bytes)
      .def_readwrite("dtype", &fq::AllReduceArgs::dtype)
      .def_readwrite("max_blocks", &fq::AllReduceArgs::max_blocks)
      .def_readwrite("stream", &fq::AllReduceArgs::stream)
      .def_readwrite("residual", &fq::AllReduceArgs::residual)
      .def_readwrite("weight", &fq::AllReduceArgs::weight)
      .def_readwrite("hidden", &fq::AllReduceArgs::hidden)
      .def_readwrite("eps", &fq::AllReduceArgs::eps)
      .def_readwrite("sent", &fq::AllReduceArgs::sent);
  py::class_<fq::SampleArgs>(m, "SampleArgs", "Arguments of sample (csrc/sampling.h).")
      .def(py::init<>())
      .def_readwrite("logits", &fq::SampleArgs::logits)
      .def_readwrite("dtype", &fq::SampleArgs::dtype)
      .def_readwrite("rows", &fq::SampleArgs::rows)
      .def_readwrite("vocab", &fq::SampleArgs::vocab)
      .def_readwrite("params", &fq::SampleArgs::params)
      .def_readwrite("tokens", &fq::SampleArgs::tokens)
      .def_readwrite("logprobs", &fq::SampleArgs::logprobs)
      .def_readwrite("top_ids", &fq::SampleArgs::top_ids)
      .def_readwrite("top_logprobs", &fq::SampleArgs::top_logprobs)
      .def_readwrite("top_width", &fq::SampleArgs::top_width)
      .def_readwrite("counts", &fq::SampleArgs::counts)
      .def_readwrite("counts_rows", &fq::SampleArgs::counts_rows)
      .def_readwrite("blocked", &fq::SampleArgs::blocked)
      .def_readwrite("blocked_width", &fq::SampleArgs::blocked_width)
      .def_readwrite("bias", &fq::SampleArgs::bias)
      .def_readwrite("mask", &fq::SampleArgs::mask)
      .def_readwrite("mask_words", &fq::SampleArgs::mask_words)
      .def_readwrite("workspace", &fq::SampleArgs::workspace)
      .def_readwrite("workspace_bytes", &fq::SampleArgs::workspace_bytes)
      .def_readwrite("stream", &fq::SampleArgs::stream);
}
}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "fastqwen native extension: C++ page allocator and CUDA kernels";

#if FASTQWEN_WITH_CUDA
  m.attr("built_with_cuda") = true;
#else
  m.attr("built_with_cuda") = false;
#endif
  export_contracts(m);
  m.attr("HOST_GATE_CANCEL") = fastqwen::kHostGateCancel;  // (csrc/host_gate.h)

  py::class_<PageAllocator>(m, "PageAllocator",
                            "KV-cache page ids 0..num_pages-1 with a free list and a refcount per page.")
      .def(py::init<int64_t>(), py::arg("num_pages"))
      .def("alloc", &PageAllocator::alloc, py::arg("n"),
           "n distinct free pages (refcount 1 each), or None (no change) if fewer than n are free.")
      .def("free", &PageAllocator::free, py::arg("pages"),
           "Release pages whose refcount is exactly 1. Validates all pages before changing anything.")
      .def("incref", &PageAllocator::incref, py::arg("pages"),
           "Add a reference to each page (duplicates count twice); pages must be referenced.")
      .def("decref", &PageAllocator::decref, py::arg("pages"),
           "Drop a reference from each page (duplicates count twice); returns the pages that became free.")
      .def("refcount", &PageAllocator::refcount, py::arg("page"))
      .def("num_free", &PageAllocator::num_free)
      .def("num_total", &PageAllocator::num_total)
      .def("num_used", &PageAllocator::num_used)
      .def("check", &PageAllocator::check, "Verify the invariant; RuntimeError describing any violation.")
      .def("refcount_mismatches", &PageAllocator::refcount_mismatches, py::arg("owners"),
           "The pages (ascending) whose refcount differs from how often owners lists them; IndexError on a bad id.")
      .def("reset", &PageAllocator::reset, "Free every page.")
      .def("__repr__", &PageAllocator::repr);

#if FASTQWEN_WITH_CUDA
  m.def("gemv", &fastqwen::gemv, py::arg("args"),
        "out [m, n] = x [m, k] @ W^T (+ bias), m <= GEMV_MAX_TOKENS; W dense of dtype, or e4m3 with float32 128x128 "
        "block scales (fp8); fp32 accumulation. silu_gate_up: W = [gate; up], out [m, n / 2] = silu(gate) * up.");
  m.def("gemv_norm", &fastqwen::gemv_norm, py::arg("args"),
        "One token, the RMSNorm between two projections carried by their GEMVs (csrc/gemv.h): ADD_RESIDUAL, out (the "
        "residual) += x @ W^T; NORM_X, out = RMSNorm(x; norm_weight, eps) @ W^T, x the residual; NORM_X_FOLDED, the "
        "same with the norm weight already in W.");
  m.def("set_gemv_tensor_cores", &fastqwen::set_gemv_tensor_cores, py::arg("enabled"),
        "Whether gemv sends the calls of 2 to 8 tokens it can to its tensor-core kernel (default on); returns the "
        "previous setting. For tests and benchmarks.");
  m.def("set_gemv_rows_per_block", &fastqwen::set_gemv_rows_per_block, py::arg("rows"),
        "Weight rows a block of the one-token GEMV takes: 0 = the default rule (4, 5 or 6 by wave fill), 4, 5 or 6 "
        "for benchmarks (csrc/gemv.h). Returns the setting before.");
  m.def("set_gemv_five_rows", &fastqwen::set_gemv_five_rows, py::arg("enabled"),
        "Whether the default rule of set_gemv_rows_per_block may choose 5 rows (default on); returns the setting "
        "before. For comparisons.");
  m.def("set_gemv_tc_fp8_variant", &fastqwen::set_gemv_tc_fp8_variant, py::arg("variant"),
        "Pipeline of the tensor-core GEMV's FP8 kernel (0: two steps in flight per warp, 3 blocks per SM; 1: four, 2 "
        "blocks; 2: three, 2 blocks; 3 (the default), 4: two and three at 2 blocks with x staged four tokens at a time; "
        "5, 6: 3 and 0 with blocks that take tiles in turn, x staged once per block), for benchmarks and tests; returns "
        "the previous one.");
  m.attr("GEMV_TC_FP8_PIPELINES") = fastqwen::gemv_tc_fp8_pipelines();
  m.def("gemv_uses_tensor_cores", &fastqwen::gemv_uses_tensor_cores, py::arg("m"), py::arg("k"), py::arg("fp8"),
        "Whether gemv runs m tokens of row length k on its tensor-core kernel (2 to 8 tokens, rows a multiple of 128 "
        "bytes, FP8 x within its shared memory; and the kernel switched on).");
  m.def("set_programmatic_launch", &fastqwen::set_programmatic_launch, py::arg("enabled"),
        "Whether the decode step's kernels may start while the kernel before them finishes (programmatic dependent "
        "launch, sm_90+).");
  m.def(
      "quantize_fp8_tokens",
      [](const py::int_& q, const py::int_& scale_t, const py::int_& x, int64_t m, int64_t padded_m, int64_t k,
         int dtype, const py::int_& stream, bool silu_gate_up) {
        fastqwen::quantize_fp8_tokens(to_uintptr(q, "q"), to_uintptr(scale_t, "scale_t"), to_uintptr(x, "x"), m,
                                      padded_m, k, dtype, to_uintptr(stream, "stream"), silu_gate_up);
      },
      py::arg("q"), py::arg("scale_t"), py::arg("x"), py::arg("m"), py::arg("padded_m"), py::arg("k"),
      py::arg("dtype"), py::arg("stream"), py::arg("silu_gate_up") = false,
      "Per-token e4m3 quantization of x [m, k] in groups of 128 columns: q [padded_m, k], scale_t float32 "
      "[k / 128, padded_m] (rows past m: zeros, scale 1). silu_gate_up: x is [m, 2k] (gate, up) and what is "
      "quantized is silu_and_mul(x), never written out.");
  m.def(
      "silu_and_mul",
      [](const py::int_& x_ptr, const py::int_& out_ptr, int64_t num_rows, int64_t d, int dtype,
         const py::int_& stream) {
        fastqwen::silu_and_mul(to_uintptr(x_ptr, "x_ptr"), to_uintptr(out_ptr, "out_ptr"), num_rows, d, dtype,
                               to_uintptr(stream, "stream"));
      },
      py::arg("x_ptr"), py::arg("out_ptr"), py::arg("num_rows"), py::arg("d"), py::arg("dtype"), py::arg("stream"),
      "out[r, i] = silu(x[r, i]) * x[r, d + i]; x [num_rows, 2d] and out [num_rows, d] contiguous device "
      "buffers of the given dtype code; stream is a cudaStream_t as int.");
  m.def(
      "host_gate",
      [](const py::int_& flag, const py::int_& status, uint32_t expect, const py::tuple& a, const py::tuple& b,
         uint64_t timeout_ns, const py::int_& stream, const py::int_& waited_ns) {
        auto copy = [](const py::tuple& t, const char* name) {
          if (t.size() != 4) throw std::invalid_argument(std::string("host_gate: ") + name + " is (src, dst, fallback, bytes)");
          fastqwen::HostGateCopy c;
          c.src = to_uintptr(t[0].cast<py::int_>(), "src");
          c.dst = to_uintptr(t[1].cast<py::int_>(), "dst");
          c.fallback = to_uintptr(t[2].cast<py::int_>(), "fallback");
          c.bytes = t[3].cast<int64_t>();
          return c;
        };
        fastqwen::host_gate(to_uintptr(flag, "flag"), to_uintptr(status, "status"), expect, copy(a, "a"),
                            copy(b, "b"), timeout_ns, to_uintptr(stream, "stream"), to_uintptr(waited_ns, "waited_ns"));
      },
      py::arg("flag"), py::arg("status"), py::arg("expect"), py::arg("a"), py::arg("b"), py::arg("timeout_ns"),
      py::arg("stream"), py::arg("waited_ns") = 0,
      "Queue a kernel that waits for the pinned host word flag to hold expect (then copies each (src, dst, fallback, "
      "bytes) from pinned src) or expect | HOST_GATE_CANCEL or a timeout (then from the device fallback), and writes "
      "expect (or 0) to the pinned word status, and the nanoseconds it waited to the pinned uint64 waited_ns unless 0 "
      "(csrc/host_gate.h).");
  m.def(
      "rms_norm",
      [](const py::int_& out, const py::int_& x, const py::int_& weight, int64_t num_rows, int64_t hidden, double eps,
         int dtype, const py::int_& stream) {
        fastqwen::rms_norm(to_uintptr(out, "out"), to_uintptr(x, "x"), to_uintptr(weight, "weight"), num_rows, hidden,
                           eps, dtype, to_uintptr(stream, "stream"));
      },
      py::arg("out"), py::arg("x"), py::arg("weight"), py::arg("num_rows"), py::arg("hidden"), py::arg("eps"),
      py::arg("dtype"), py::arg("stream"), "out = weight * RMSNorm(x) per row (HF Qwen3 rounding).");
  m.def(
      "fused_add_rms_norm",
      [](const py::int_& x, const py::int_& residual, const py::int_& weight, int64_t num_rows, int64_t hidden,
         double eps, int dtype, const py::int_& stream) {
        fastqwen::fused_add_rms_norm(to_uintptr(x, "x"), to_uintptr(residual, "residual"),
                                     to_uintptr(weight, "weight"), num_rows, hidden, eps, dtype,
                                     to_uintptr(stream, "stream"));
      },
      py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("num_rows"), py::arg("hidden"), py::arg("eps"),
      py::arg("dtype"), py::arg("stream"), "In place: residual += x; x = weight * RMSNorm(residual).");
  m.def(
      "fused_add_rms_norm_fp8",
      [](const py::int_& x, const py::int_& residual, const py::int_& weight, int64_t num_rows, int64_t hidden,
         double eps, int dtype, const py::int_& q, const py::int_& scale_t, int64_t padded_rows,
         const py::int_& stream) {
        fastqwen::fused_add_rms_norm_fp8(to_uintptr(x, "x"), to_uintptr(residual, "residual"),
                                         to_uintptr(weight, "weight"), num_rows, hidden, eps, dtype,
                                         to_uintptr(q, "q"), to_uintptr(scale_t, "scale_t"), padded_rows,
                                         to_uintptr(stream, "stream"));
      },
      py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("num_rows"), py::arg("hidden"), py::arg("eps"),
      py::arg("dtype"), py::arg("q"), py::arg("scale_t"), py::arg("padded_rows"), py::arg("stream"),
      "residual += x; weight * RMSNorm(residual) quantized per token and 128 columns into q / scale_t (norm.h).");
  m.def(
      "qk_norm_rope_store_kv", [](const fastqwen::RopeKVArgs& args) { fastqwen::qk_norm_rope_store_kv(args); },
      py::arg("args"), "Per-head RMSNorm of q and k, NeoX RoPE, q to q_out, k and v to their cache slots (-1 = skip).");
  m.def(
      "paged_attention_decode_plan",
      [](const py::int_& kv_lens, const py::int_& split_offsets, int64_t batch, bool kv_fp8, int64_t num_kv_heads,
         const py::int_& stream) {
        fastqwen::paged_attention_decode_plan(to_uintptr(kv_lens, "kv_lens"), to_uintptr(split_offsets, "split_offsets"),
                                              batch, kv_fp8, num_kv_heads, to_uintptr(stream, "stream"));
      },
      py::arg("kv_lens"), py::arg("split_offsets"), py::arg("batch"), py::arg("kv_fp8"), py::arg("num_kv_heads"),
      py::arg("stream"), "Plans split-KV decode: the chunk offsets of each sequence, from kv_lens, on the device.");
  m.def("set_paged_attention_decode_item_records", &fastqwen::set_paged_attention_decode_item_records,
        py::arg("item_records"),
        "The decode plan also writes each chunk's record, which the kernel copies into shared memory items ahead "
        "(default), or the kernel searches the chunk offsets for each item, for benchmarks and tests (set before "
        "planning).");
  m.def("paged_attention_decode_max_splits", &fastqwen::decode_max_splits, py::arg("num_kv_heads"),
        "The most chunks decode cuts a sequence into on the current GPU (SMs / num_kv_heads, at most "
        "DECODE_MAX_SPLITS, unless set_paged_attention_decode_max_splits set a number).");
  m.def("set_paged_attention_decode_max_splits", &fastqwen::set_paged_attention_decode_max_splits, py::arg("splits"),
        "The most chunks decode cuts a sequence into, for benchmarks (0: the rule; set before planning).");
  m.def("set_paged_attention_decode_min_chunk", &fastqwen::set_paged_attention_decode_min_chunk, py::arg("kv_fp8"),
        py::arg("tokens"), "The shortest split-KV decode chunk, for benchmarks (set before planning).");
  m.def("set_paged_attention_decode_prefetch_next", &fastqwen::set_paged_attention_decode_prefetch_next,
        py::arg("prefetch_next"),
        "Decode blocks load their next work item's first tiles while finishing one (default), or start each afresh, "
        "for benchmarks and tests.");
  m.def(
      "paged_attention_decode", [](const fastqwen::DecodeArgs& args) { fastqwen::paged_attention_decode(args); },
      py::arg("args"),
      "Decode attention of one query token per sequence over its pages, split as paged_attention_decode_plan said.");
  m.def(
      "paged_attention_prefill", [](const fastqwen::PrefillArgs& args) { fastqwen::paged_attention_prefill(args); },
      py::arg("args"), "Causal attention of several query tokens per sequence (varlen) over its pages, on tensor cores.");
  m.def(
      "paged_attention_prefill_hopper",
      [](const fastqwen::PrefillArgs& args) { fastqwen::paged_attention_prefill_hopper(args); }, py::arg("args"),
      "paged_attention_prefill on Hopper's TMA and wgmma (16-bit caches, pages of 16 or more tokens).");
  m.def("paged_attention_prefill_hopper_available", &fastqwen::paged_attention_prefill_hopper_available,
        py::arg("device"), "Whether paged_attention_prefill_hopper runs on this CUDA device (sm_90a build, CC 9.0).");
  m.def("set_paged_attention_prefill_hopper_persistent", &fastqwen::set_paged_attention_prefill_hopper_persistent,
        py::arg("persistent"), "Persistent grid (default) or one block per work item, for benchmarks.");
  m.def("set_paged_attention_prefill_hopper_variant", &fastqwen::set_paged_attention_prefill_hopper_variant,
        py::arg("variant"),
        "Pipeline of the Hopper prefill kernel (0..PREFILL_HOPPER_VARIANTS - 1: bit 0 overlap, bit 1 ping-pong, bit 2 "
        "three stages, bit 3 dynamic schedule, bit 4 Q copied by the producer), for benchmarks and tests; returns the "
        "previous one.");
  m.def(
      "sampler_workspace_bytes", &fastqwen::sampler_workspace_bytes, py::arg("max_rows"), py::arg("vocab"),
      "Bytes of scratch memory sample() needs for up to max_rows rows.");
  m.def(
      "sample", [](const fastqwen::SampleArgs& args) { fastqwen::sample(args); }, py::arg("args"),
      "One token per row with per-row penalties, temperature, top-k/top-p/min-p and seeds (csrc/sampling.h).");
  m.def("all_reduce_buffer_alloc", &fastqwen::all_reduce_buffer_alloc, py::arg("capacity_bytes"),
        py::arg("lamport_bytes"), py::arg("world"),
        "Device memory shared with the other ranks for messages of up to capacity_bytes (csrc/custom_all_reduce.h): "
        "a zeroed signal area, a data area of two halves of capacity_bytes, and with lamport_bytes the receive area "
        "of the barrier-free kernels.");
  m.def("all_reduce_buffer_free", [](const py::int_& ptr) { fastqwen::all_reduce_buffer_free(to_uintptr(ptr, "ptr")); },
        py::arg("ptr"));
  m.def(
      "all_reduce_ipc_handle",
      [](const py::int_& ptr) { return py::bytes(fastqwen::all_reduce_ipc_handle(to_uintptr(ptr, "ptr"))); },
      py::arg("ptr"), "The CUDA IPC handle of a buffer from all_reduce_buffer_alloc, as bytes.");
  m.def(
      "all_reduce_ipc_open", [](const py::bytes& handle) { return fastqwen::all_reduce_ipc_open(std::string(handle)); },
      py::arg("handle"), "A peer's buffer mapped into this process (peer access enabled).");
  m.def("all_reduce_ipc_close", [](const py::int_& ptr) { fastqwen::all_reduce_ipc_close(to_uintptr(ptr, "ptr")); },
        py::arg("ptr"));
  m.def(
      "all_reduce_send_target",
      [](const fastqwen::AllReduceArgs& args, const py::int_& dst) {
        fastqwen::all_reduce_send_target(args, to_uintptr(dst, "dst"));
      },
      py::arg("args"), py::arg("dst"),
      "Writes the AllReduceSendTarget of args' buffers (csrc/custom_all_reduce.h) to device memory at dst "
      "(ALL_REDUCE_SEND_TARGET_BYTES): where a GEMV with the SEND epilogue stores its output.");
  m.def("verify_chain", &fastqwen::verify_chain, py::arg("args"),
        "The next verify step's inputs made on the device from the draws of the one before: acceptance, history, "
        "prompt-lookup draft, positions, KV slots and sampler steps (csrc/verify_chain.h).");
  m.def("ngram_draft", &fastqwen::ngram_draft, py::arg("args"),
        "Prompt lookup for a batch of int32 token histories on the device: each row's draft of up to k tokens after "
        "the latest earlier occurrence of its longest matching tail (csrc/ngram_draft.h).");
  m.def(
      "custom_all_reduce",
      [](const fastqwen::AllReduceArgs& args) { fastqwen::custom_all_reduce(args); },
      py::arg("args"), "In-place one-shot sum of `data` across the ranks' shared buffers (csrc/custom_all_reduce.h).");
  m.def(
      "custom_all_reduce_add_rms_norm",
      [](const fastqwen::AllReduceArgs& args) { fastqwen::custom_all_reduce_add_rms_norm(args); }, py::arg("args"),
      "custom_all_reduce, then the residual add and RMSNorm of fused_add_rms_norm, in one kernel, in place "
      "(csrc/custom_all_reduce.h).");
  m.def("set_all_reduce_end_barrier", &fastqwen::set_all_reduce_end_barrier, py::arg("enabled"),
        "Whether the custom all-reduce waits at a second barrier at the end of each round (the design before its "
        "data areas had two halves; for comparison). Returns the previous setting.");
#endif
}
