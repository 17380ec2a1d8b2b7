// The element types the kernels take, as one integer code per type, and the one dispatch from a code to a C++
// type. The codes are exported to Python from here (fastqwen._C.DTYPE_CODES); nothing else spells them.
//
// The host part (codes, names, checks) needs no CUDA headers, so the CPU-only build exports the same codes. The
// dispatch (FASTQWEN_DISPATCH_DTYPE) is compiled by nvcc only.
#pragma once

#include <stdexcept>
#include <string>

namespace fastqwen {

enum DType : int { kF32 = 0, kF16 = 1, kBF16 = 2, kFP8E4M3 = 3 };
constexpr int kLastDType = kFP8E4M3;

// Sets of codes a kernel accepts, as bit masks of (1 << code).
constexpr unsigned dtype_bit(int code) { return 1u << code; }
constexpr unsigned kHalfTypes = dtype_bit(kF16) | dtype_bit(kBF16);
constexpr unsigned kFloatTypes = dtype_bit(kF32) | kHalfTypes;
// What a KV cache may hold: the model's own 16-bit type, or FP8 e4m3 with a per-tensor scale (csrc/kv_fp8.cuh).
constexpr unsigned kKVCacheTypes = kHalfTypes | dtype_bit(kFP8E4M3);

inline const char* dtype_name(int code) {
  switch (code) {
    case kF32: return "float32";
    case kF16: return "float16";
    case kBF16: return "bfloat16";
    case kFP8E4M3: return "float8_e4m3fn";  // torch's name: e4m3 with no infinities (max 448)
    default: return nullptr;
  }
}

inline bool dtype_allowed(int code, unsigned allowed) {
  return code >= kF32 && code <= kLastDType && (allowed & dtype_bit(code)) != 0;
}

[[noreturn]] inline void throw_bad_dtype(const std::string& op, int code, unsigned allowed) {
  std::string names;
  for (int c = kF32; c <= kLastDType; ++c) {
    if (allowed & dtype_bit(c)) names += std::string(names.empty() ? "" : ", ") + dtype_name(c);
  }
  throw std::invalid_argument(op + "dtype code " + std::to_string(code) + " is not one of " + names);
}

// Throws std::invalid_argument (prefixed by op) unless code is in `allowed`, naming the accepted types.
inline void check_dtype(const std::string& op, int code, unsigned allowed) {
  if (!dtype_allowed(code, allowed)) throw_bad_dtype(op, code, allowed);
}

// A KV cache of kv_dtype next to q of dtype: the same type, or fp8 e4m3 with positive finite per-tensor scales.
inline void check_kv_cache(const std::string& op, int dtype, int kv_dtype, double k_scale, double v_scale) {
  if (kv_dtype != dtype && kv_dtype != kFP8E4M3) {
    throw std::invalid_argument(op + "the KV cache must hold the query's dtype or float8_e4m3fn, got dtype code " +
                                std::to_string(kv_dtype));
  }
  const bool ok = k_scale > 0.0 && v_scale > 0.0 && k_scale < 1e30 && v_scale < 1e30;  // false for NaN too
  if (!ok) throw std::invalid_argument(op + "k_scale and v_scale must be positive and finite");
}

}  // namespace fastqwen

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace fastqwen {

template <typename T>
struct DTypeTag {
  using type = T;
};

// Calls f(DTypeTag<T>{}) for the type of `code`, after check_dtype; types outside `Allowed` are never instantiated.
template <unsigned Allowed, typename F>
void dispatch_dtype(const char* op, int code, F&& f) {
  if (!dtype_allowed(code, Allowed)) throw_bad_dtype(op, code, Allowed);
  if constexpr ((Allowed & dtype_bit(kF32)) != 0) {
    if (code == kF32) return f(DTypeTag<float>{});
  }
  if constexpr ((Allowed & dtype_bit(kF16)) != 0) {
    if (code == kF16) return f(DTypeTag<__half>{});
  }
  if constexpr ((Allowed & dtype_bit(kBF16)) != 0) {
    if (code == kBF16) return f(DTypeTag<__nv_bfloat16>{});
  }
}

}  // namespace fastqwen

// FASTQWEN_DISPATCH_DTYPE(op, code, allowed, T, body...): runs body with T the C++ type of `code` (float, __half or
// __nv_bfloat16), one of the set `allowed` (kHalfTypes, kFloatTypes, ...); std::invalid_argument otherwise.
#define FASTQWEN_DISPATCH_DTYPE(OP, CODE, ALLOWED, T, ...)                     \
  ::fastqwen::dispatch_dtype<(ALLOWED)>((OP), (CODE), [&](auto fastqwen_tag_) { \
    using T = typename decltype(fastqwen_tag_)::type;                          \
    __VA_ARGS__;                                                               \
  })
#endif
