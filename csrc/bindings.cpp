// pybind11 module fastqwen._C. No libtorch: kernels take raw pointers and a
// stream handle; the Python ops validate tensors before calling in.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "page_allocator.h"
#if FASTQWEN_WITH_CUDA
#include "activation.h"
#include "attention.h"
#include "norm.h"
#include "rope_kv.h"
#include "sampling.h"
#endif

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
}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "fastqwen native extension: C++ page allocator and CUDA kernels";

#if FASTQWEN_WITH_CUDA
  m.attr("built_with_cuda") = true;
#else
  m.attr("built_with_cuda") = false;
#endif
  m.attr("DTYPE_F32") = 0;
  m.attr("DTYPE_F16") = 1;
  m.attr("DTYPE_BF16") = 2;

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
      .def("reset", &PageAllocator::reset, "Free every page.")
      .def("__repr__", &PageAllocator::repr);

#if FASTQWEN_WITH_CUDA
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
      "qk_norm_rope_store_kv",
      [](const py::int_& qkv, const py::int_& q_weight, const py::int_& k_weight, const py::int_& cos_sin,
         const py::int_& positions, const py::int_& k_cache, const py::int_& v_cache, const py::int_& out_slots,
         const py::int_& q_out, int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
         int64_t max_pos, int64_t num_slots, double eps, int dtype, const py::int_& stream) {
        fastqwen::qk_norm_rope_store_kv(
            to_uintptr(qkv, "qkv"), to_uintptr(q_weight, "q_weight"), to_uintptr(k_weight, "k_weight"),
            to_uintptr(cos_sin, "cos_sin"), to_uintptr(positions, "positions"), to_uintptr(k_cache, "k_cache"),
            to_uintptr(v_cache, "v_cache"), to_uintptr(out_slots, "out_slots"), to_uintptr(q_out, "q_out"),
            num_tokens, num_heads, num_kv_heads, head_dim, max_pos, num_slots, eps, dtype,
            to_uintptr(stream, "stream"));
      },
      py::arg("qkv"), py::arg("q_weight"), py::arg("k_weight"), py::arg("cos_sin"), py::arg("positions"),
      py::arg("k_cache"), py::arg("v_cache"), py::arg("out_slots"), py::arg("q_out"), py::arg("num_tokens"),
      py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("max_pos"), py::arg("num_slots"),
      py::arg("eps"), py::arg("dtype"), py::arg("stream"),
      "Per-head RMSNorm of q and k, NeoX RoPE, q to q_out, k and v to their cache slots (-1 = skip).");
  m.attr("DECODE_MAX_SPLITS") = fastqwen::kDecodeMaxSplits;
  m.def(
      "paged_attention_decode_plan",
      [](const py::int_& kv_lens, const py::int_& split_offsets, int64_t batch, const py::int_& stream) {
        fastqwen::paged_attention_decode_plan(to_uintptr(kv_lens, "kv_lens"), to_uintptr(split_offsets, "split_offsets"),
                                              batch, to_uintptr(stream, "stream"));
      },
      py::arg("kv_lens"), py::arg("split_offsets"), py::arg("batch"), py::arg("stream"),
      "Plans split-KV decode: the chunk offsets of each sequence, from kv_lens, on the device.");
  m.def(
      "paged_attention_decode",
      [](const py::int_& q, const py::int_& k_cache, const py::int_& v_cache, const py::int_& page_table,
         const py::int_& kv_lens, const py::int_& split_offsets, const py::int_& out, const py::int_& part_out,
         const py::int_& part_lse, int64_t workspace_rows, int64_t batch, int64_t num_heads, int64_t num_kv_heads,
         int64_t head_dim, int64_t page_size, int64_t max_pages, int64_t num_pages, double scale, int dtype,
         const py::int_& stream) {
        fastqwen::paged_attention_decode(
            to_uintptr(q, "q"), to_uintptr(k_cache, "k_cache"), to_uintptr(v_cache, "v_cache"),
            to_uintptr(page_table, "page_table"), to_uintptr(kv_lens, "kv_lens"),
            to_uintptr(split_offsets, "split_offsets"), to_uintptr(out, "out"), to_uintptr(part_out, "part_out"),
            to_uintptr(part_lse, "part_lse"), workspace_rows, batch, num_heads, num_kv_heads, head_dim, page_size,
            max_pages, num_pages, scale, dtype, to_uintptr(stream, "stream"));
      },
      py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("page_table"), py::arg("kv_lens"),
      py::arg("split_offsets"), py::arg("out"), py::arg("part_out"), py::arg("part_lse"), py::arg("workspace_rows"),
      py::arg("batch"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("page_size"),
      py::arg("max_pages"), py::arg("num_pages"), py::arg("scale"), py::arg("dtype"), py::arg("stream"),
      "Decode attention of one query token per sequence over its pages, split as paged_attention_decode_plan said.");
  m.def(
      "paged_attention_prefill",
      [](const py::int_& q, const py::int_& k_cache, const py::int_& v_cache, const py::int_& query_start,
         const py::int_& page_table, const py::int_& kv_lens, const py::int_& out, int64_t batch, int64_t max_query_len,
         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t page_size, int64_t max_pages,
         int64_t num_pages, double scale, int dtype, const py::int_& stream) {
        fastqwen::paged_attention_prefill(
            to_uintptr(q, "q"), to_uintptr(k_cache, "k_cache"), to_uintptr(v_cache, "v_cache"),
            to_uintptr(query_start, "query_start"), to_uintptr(page_table, "page_table"),
            to_uintptr(kv_lens, "kv_lens"), to_uintptr(out, "out"), batch, max_query_len, num_heads, num_kv_heads,
            head_dim, page_size, max_pages, num_pages, scale, dtype, to_uintptr(stream, "stream"));
      },
      py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("query_start"), py::arg("page_table"),
      py::arg("kv_lens"), py::arg("out"), py::arg("batch"), py::arg("max_query_len"), py::arg("num_heads"),
      py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("page_size"), py::arg("max_pages"), py::arg("num_pages"),
      py::arg("scale"), py::arg("dtype"), py::arg("stream"),
      "Causal attention of several query tokens per sequence (varlen) over its pages, on tensor cores.");
  m.def(
      "sampler_workspace_bytes", &fastqwen::sampler_workspace_bytes, py::arg("max_rows"), py::arg("vocab"),
      "Bytes of scratch memory sample() needs for up to max_rows rows.");
  m.def(
      "sample",
      [](const py::int_& logits, int dtype, int64_t rows, int64_t vocab, const py::int_& params,
         const py::int_& tokens, const py::int_& logprobs, const py::int_& top_ids, const py::int_& top_logprobs,
         int64_t top_width, const py::int_& counts, int64_t counts_rows, const py::int_& blocked,
         int64_t blocked_width, const py::int_& workspace, int64_t workspace_bytes, const py::int_& stream) {
        fastqwen::sample(to_uintptr(logits, "logits"), dtype, rows, vocab, to_uintptr(params, "params"),
                         to_uintptr(tokens, "tokens"), to_uintptr(logprobs, "logprobs"),
                         to_uintptr(top_ids, "top_ids"), to_uintptr(top_logprobs, "top_logprobs"), top_width,
                         to_uintptr(counts, "counts"), counts_rows, to_uintptr(blocked, "blocked"), blocked_width,
                         to_uintptr(workspace, "workspace"), workspace_bytes, to_uintptr(stream, "stream"));
      },
      py::arg("logits"), py::arg("dtype"), py::arg("rows"), py::arg("vocab"), py::arg("params"), py::arg("tokens"),
      py::arg("logprobs"), py::arg("top_ids"), py::arg("top_logprobs"), py::arg("top_width"), py::arg("counts"),
      py::arg("counts_rows"), py::arg("blocked"), py::arg("blocked_width"), py::arg("workspace"),
      py::arg("workspace_bytes"), py::arg("stream"),
      "One token per row with per-row penalties, temperature, top-k/top-p/min-p and seeds (csrc/sampling.h).");
#endif
}
