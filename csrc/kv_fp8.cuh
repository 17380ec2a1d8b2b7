// FP8 (e4m3) KV cache entries on the device: the storage type, the write (scale, round to nearest even, saturate to
// +-448 as torch's reference does after its clamp) and the read (two e4m3 values to an fp16 pair, exact: every e4m3
// value is an fp16 value). The attention kernels fold the scales into the softmax scale (k) and the output (v).
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

namespace fastqwen {

// One e4m3 byte as the caches store it (a type of its own, so a template can tell it from the 16-bit types).
struct Fp8E4M3 {
  uint8_t bits;
};
static_assert(sizeof(Fp8E4M3) == 1, "one byte per cached element");

template <typename C>
constexpr bool kIsFp8 = std::is_same<C, Fp8E4M3>::value;

constexpr float kFp8Max = 448.0f;  // the largest finite e4m3 value

__device__ __forceinline__ Fp8E4M3 fp8_from_float(float x) {
  return Fp8E4M3{static_cast<uint8_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3))};
}

// The two e4m3 bytes of v (low byte first) as an fp16 pair (low half first): cvt.rn.f16x2.e4m3x2 on sm_89+.
__device__ __forceinline__ unsigned fp8x2_to_half2(unsigned v) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(v & 0xffffu), __NV_E4M3);
  return static_cast<unsigned>(h.x) | (static_cast<unsigned>(h.y) << 16);
}

}  // namespace fastqwen
