// Device helpers shared by the kernels: dtype conversion with the rounding
// PyTorch uses, packed pairs and e4m3 pairs to wider types, 16-byte packs, and warp/block sums.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace fastqwen {

template <typename T>
struct Cvt;
template <>
struct Cvt<float> {
  static __device__ __forceinline__ float to_f(float v) { return v; }
  static __device__ __forceinline__ float from_f(float v) { return v; }
};
template <>
struct Cvt<__half> {
  static __device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
  static __device__ __forceinline__ __half from_f(float v) { return __float2half_rn(v); }
};
template <>
struct Cvt<__nv_bfloat16> {
  static __device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
  static __device__ __forceinline__ __nv_bfloat16 from_f(float v) { return __float2bfloat16_rn(v); }
};

// Round a float to T and back: what PyTorch does after every elementwise op on T tensors.
template <typename T>
__device__ __forceinline__ float round_to(float v) {
  return Cvt<T>::to_f(Cvt<T>::from_f(v));
}

// The Qwen3 MLP activation of one element: silu(g) * u in fp32, one rounding (silu_and_mul, and the GEMV that
// computes the gate and up projections together, so that both give the same bits).
template <typename T>
__device__ __forceinline__ T silu_mul(T g, T u) {
  const float gf = Cvt<T>::to_f(g);
  const float uf = Cvt<T>::to_f(u);
  return Cvt<T>::from_f(gf / (1.0f + expf(-gf)) * uf);
}

template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Programmatic dependent launch (sm_90 and later; no-ops below; launch.cuh launches). A kernel launched with
// programmatic stream serialization may start while the kernel before it on the stream still runs, once every block
// of that kernel has called griddep_launch_dependents() (or ended). The rule every kernel of a decode step keeps:
//   - griddep_wait() before reading anything the kernel right before it wrote (or writing anything that kernel
//     reads): it waits for that kernel's completion and memory;
//   - griddep_launch_dependents() only after its own griddep_wait() (a kernel launched the ordinary way has waited
//     by the time it starts). One exception: the RMSNorm kernels (norm.cu) launch their dependents first, so the
//     kernel after a norm may start while the kernel before the norm still runs. It must read nothing but the
//     weights before its wait; the projections' GEMVs keep to that, and a PDL kernel added after a norm must too.
// So when a kernel starts, the kernel before it has passed its wait, and every kernel before that one has completed:
// what they wrote (the step's inputs, the decode plan, the weights) may be read before griddep_wait().
__device__ __forceinline__ void griddep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void griddep_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Sum over the block; every thread gets the result. blockDim.x must be a multiple of 32.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float partial[32];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  v = warp_sum(v);
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  const int num_warps = blockDim.x >> 5;
  v = lane < num_warps ? partial[lane] : 0.0f;
  v = warp_sum(v);
  return v;
}

// A packed pair of 16-bit values (the low one first) as floats.
__device__ __forceinline__ float2 to_float2(uint32_t bits, __nv_bfloat16) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&bits));
}
__device__ __forceinline__ float2 to_float2(uint32_t bits, __half) {
  return __half22float2(*reinterpret_cast<const __half2*>(&bits));
}

// The two e4m3 values in the low (hi: high) 16 bits of `bits` as f16x2, by the hardware conversion (sm_89+; every
// e4m3 value is exact in f16). Taking the high half directly spares the shift. (kv_fp8.cuh's fp8x2_to_half2 is the
// low half through the CUDA intrinsic; the two compile differently, so each kernel keeps the form it was measured
// with.)
__device__ __forceinline__ uint32_t e4m3x2_lo(uint32_t bits) {
  uint32_t out;
  asm("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, %1; cvt.rn.f16x2.e4m3x2 %0, lo; }" : "=r"(out) : "r"(bits));
  return out;
}
__device__ __forceinline__ uint32_t e4m3x2_hi(uint32_t bits) {
  uint32_t out;
  asm("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, %1; cvt.rn.f16x2.e4m3x2 %0, hi; }" : "=r"(out) : "r"(bits));
  return out;
}

// The same two e4m3 values as bf16x2, without a conversion instruction (sm_90 converts e4m3 to f16 only): each byte's
// sign goes to bit 15 and its exponent and mantissa to bits 4..10, which a bf16 reads as the value times 2^-120 (an
// e4m3 subnormal as a bf16 subnormal), and one exact multiply by 2^120 restores it. Every finite e4m3 comes out
// exact; the NaN bytes (0x7f, 0xff) come out as +-480, which quantize_fp8 never writes.
__device__ __forceinline__ uint32_t e4m3x2_bf16(uint32_t bits, uint32_t selector) {
  const uint32_t t = __byte_perm(bits, 0u, selector);  // the two bytes in bits 8..15 and 24..31
  const uint32_t placed = ((t >> 4) & 0x07f007f0u) | (t & 0x80008000u);
  uint32_t out;
  // (fma with -0 rather than mul: the form every bf16-capable arch has; the product is exact, so is the sum)
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(out) : "r"(placed), "r"(0x7b807b80u), "r"(0x80008000u));
  return out;
}
__device__ __forceinline__ uint32_t e4m3x2_lo_bf16(uint32_t bits) { return e4m3x2_bf16(bits, 0x1404u); }
__device__ __forceinline__ uint32_t e4m3x2_hi_bf16(uint32_t bits) { return e4m3x2_bf16(bits, 0x3424u); }

// 16 bytes of a weight, not kept in L1 (streamed once; the activations are what L1 should hold).
__device__ __forceinline__ uint4 load_stream(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

inline bool aligned16(uintptr_t p) { return (p & 15u) == 0; }

}  // namespace fastqwen
