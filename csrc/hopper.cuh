// Hopper (sm_90a) building blocks of the FlashAttention-3-class prefill kernel: mbarriers, bulk tensor copies (TMA)
// that complete on them, warpgroup matrix multiplies (wgmma) with their shared-memory descriptors, named barriers and
// register reallocation. Only code compiled for sm_90a may call these (the kernel checks __CUDA_ARCH_FEAT_SM90_ALL).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace fastqwen {
namespace hopper {

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

// --- mbarriers (64-bit, in shared memory) ---
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
// Make the initialized barriers visible to the copy engine (async proxy) before any copy signals them.
__device__ __forceinline__ void mbar_fence_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(bar) : "memory");
}
// Arrive and announce `bytes` more of copies that will complete on this barrier's current phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.expect_tx.shared::cta.b64 state, [%0], %1;\n}\n" ::"r"(bar),
               "r"(bytes)
               : "memory");
}
// Wait until the phase of the given parity has completed (a fresh barrier counts its "previous" phase, parity 1, as
// complete, so a producer's first wait on an empty slot passes).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\nwait_again:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_again;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// --- bulk tensor copy: a 3-D box of the tensor map at coordinates (c0 innermost, c1, c2) into shared memory ---
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const void* tensor_map, uint32_t bar, int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
      "[%5];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(tensor_map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}
__device__ __forceinline__ void prefetch_tensor_map(const void* tensor_map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(tensor_map)) : "memory");
}

// Ordinary shared-memory stores that wgmma (the async proxy) reads next must be fenced by each writing thread.
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// A barrier among `threads` threads (a multiple of 32) of the block, id 1..15 (0 is __syncthreads').
__device__ __forceinline__ void named_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

template <int kRegs>
__device__ __forceinline__ void regs_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void regs_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

// --- wgmma ---
// A shared-memory matrix descriptor for the 128-byte swizzle (rows of 64 16-bit elements, 8-row atoms of 1,024
// bytes whose 16-byte chunk c of row r sits at c ^ r, the layout TMA's 128-byte swizzle writes). K-major operands
// use only sbo (bytes between 8-row groups); MN-major ones also lbo (bytes between 64-element column blocks).
// Addresses of atoms must be 1,024-aligned (base offset 0); a start inside an atom (a k16 slice: +32 bytes) is fine.
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  uint64_t d = (addr & 0x3FFFFu) >> 4;
  d |= static_cast<uint64_t>((lbo & 0x3FFFFu) >> 4) << 16;
  d |= static_cast<uint64_t>((sbo & 0x3FFFFu) >> 4) << 32;
  d |= uint64_t{1} << 62;  // 128-byte swizzle
  return d;
}

// The descriptor of k16 step kk is the step's base descriptor plus the step's byte offset / 16 (the start-address
// field; shared addresses stay below 2^18, so the field never carries). The base passes through an opaque move so
// that the compiler builds it where it is used instead of keeping every step's descriptor of every stage live.
__device__ __forceinline__ uint64_t desc_at(uint64_t base_desc) {
  asm volatile("mov.b64 %0, %0;\n" : "+l"(base_desc));
  return base_desc;
}

// base_desc with `add` (a byte offset / 16) added to its start-address field, in the low word alone: a 64-bit add
// would cost the carry's instructions at every k16 step, on the path of each matrix multiply's issue.
__device__ __forceinline__ uint64_t desc_plus(uint64_t base_desc, uint32_t add) {
  uint32_t lo, hi;
  asm("mov.b64 {%0, %1}, %2;\n" : "=r"(lo), "=r"(hi) : "l"(base_desc));
  uint64_t d;
  asm("mov.b64 %0, {%1, %2};\n" : "=l"(d) : "r"(lo + add), "r"(hi));
  return d;
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keeps the compiler from moving reads or writes of the accumulators across a wgmma wait.
__device__ __forceinline__ void fence_regs(float (&d)[64]) {
#pragma unroll
  for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// m64n128k16 with fp32 accumulators: 64 per thread, in the layout of 16 mma.sync m16n8 C fragments (thread t of warp
// w of the warpgroup holds rows 16 w + t / 4 and + 8; n8 block i's columns 8 i + 2 (t % 4) and + 1 in d[4 i .. 4 i + 3]).
// The bf16 and fp16 instructions differ only in their type name: one macro writes the three wrappers for each.
//   ss_first: D = A B (the accumulators' old values are not read, so they need not be live);
//   ss: D (+)= A B, A and B from shared memory (descriptors), both K-major;
//   rs: D += A B, A from registers (the m64k16 fragment layout of mma.sync's A), B from shared memory MN-major.
#define FASTQWEN_WGMMA_D_REGS "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
// The 64 accumulators as asm operands with constraint C ("=f" written, "+f" read and written).
#define FASTQWEN_WGMMA_D(C) \
    C(d[0]), C(d[1]), C(d[2]), C(d[3]), C(d[4]), C(d[5]), C(d[6]), C(d[7]), \
    C(d[8]), C(d[9]), C(d[10]), C(d[11]), C(d[12]), C(d[13]), C(d[14]), C(d[15]), \
    C(d[16]), C(d[17]), C(d[18]), C(d[19]), C(d[20]), C(d[21]), C(d[22]), C(d[23]), \
    C(d[24]), C(d[25]), C(d[26]), C(d[27]), C(d[28]), C(d[29]), C(d[30]), C(d[31]), \
    C(d[32]), C(d[33]), C(d[34]), C(d[35]), C(d[36]), C(d[37]), C(d[38]), C(d[39]), \
    C(d[40]), C(d[41]), C(d[42]), C(d[43]), C(d[44]), C(d[45]), C(d[46]), C(d[47]), \
    C(d[48]), C(d[49]), C(d[50]), C(d[51]), C(d[52]), C(d[53]), C(d[54]), C(d[55]), \
    C(d[56]), C(d[57]), C(d[58]), C(d[59]), C(d[60]), C(d[61]), C(d[62]), C(d[63])
#define FASTQWEN_WGMMA_M64N128K16(T, AB)                                                                             \
  template <>                                                                                                        \
  struct Wgmma<T> {                                                                                                  \
    static __device__ __forceinline__ void ss_first(float (&d)[64], uint64_t desc_a, uint64_t desc_b) {             \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                                     \
                   "wgmma.mma_async.sync.aligned.m64n128k16.f32." AB "." AB " " FASTQWEN_WGMMA_D_REGS              \
                   ", %64, %65, p, 1, 1, 0, 0;\n}\n"                                                               \
                   : FASTQWEN_WGMMA_D("=f")                                                                          \
                   : "l"(desc_a), "l"(desc_b), "r"(0));                                                              \
    }                                                                                                                \
    static __device__ __forceinline__ void ss(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int accumulate) {   \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                                     \
                   "wgmma.mma_async.sync.aligned.m64n128k16.f32." AB "." AB " " FASTQWEN_WGMMA_D_REGS              \
                   ", %64, %65, p, 1, 1, 0, 0;\n}\n"                                                               \
                   : FASTQWEN_WGMMA_D("+f")                                                                          \
                   : "l"(desc_a), "l"(desc_b), "r"(accumulate));                                                     \
    }                                                                                                                \
    static __device__ __forceinline__ void rs(float (&d)[64], const unsigned (&a)[4], uint64_t desc_b) {            \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                                     \
                   "wgmma.mma_async.sync.aligned.m64n128k16.f32." AB "." AB " " FASTQWEN_WGMMA_D_REGS              \
                   ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"                                                  \
                   : FASTQWEN_WGMMA_D("+f")                                                                          \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));                               \
    }                                                                                                                \
  };

template <typename T>
struct Wgmma;
FASTQWEN_WGMMA_M64N128K16(__nv_bfloat16, "bf16")
FASTQWEN_WGMMA_M64N128K16(__half, "f16")
#undef FASTQWEN_WGMMA_M64N128K16
#undef FASTQWEN_WGMMA_D
#undef FASTQWEN_WGMMA_D_REGS

}  // namespace hopper
}  // namespace fastqwen
