// RMSNorm and residual-add + RMSNorm: one block per row, the row held in
// registers as 16-byte packs, fp32 sum of squares reduced over the block, one
// read and one write of each tensor (a two-pass kernel covers any other size or
// alignment). Numerics follow HF's Qwen3RMSNorm.
#include <stdexcept>
#include <string>
#include <type_traits>

#include "common.cuh"
#include "cuda_check.h"
#include "dtype.h"
#include "fp8_quant.cuh"
#include "launch.cuh"
#include "norm.h"

namespace fastqwen {
namespace {

// VEC elements per 16-byte pack (other sizes and alignments take the two-pass kernel below),
// VPT packs per thread. FUSED: x + residual first, residual updated in place. QUANT (FUSED, 16-bit T, hidden a multiple
// of 128): the normalized rows are not written to out but quantized for the FP8 GEMM into fp8 (the quantizer's
// arithmetic, fp8_quant.cuh, on the values out would hold); the grid then covers fp8.padded rows.
constexpr int kMaxThreads = 512;

template <typename T, int VEC, int VPT, bool FUSED, bool QUANT = false>
__global__ void __launch_bounds__(kMaxThreads) rms_norm_kernel(T* out, const T* x,  // out == x in the fused form
                                                        T* __restrict__ residual, const T* __restrict__ weight,
                                                        int hidden, float eps, Fp8Rows fp8) {
  using P = Pack<T, VEC>;
  const int64_t row = blockIdx.x;
  const int nvec = hidden / VEC;
  static_assert(!QUANT || (FUSED && VEC == 8), "the quantized output: 16-bit rows, 16 packs a group of 128 columns");
  const P* xrow = reinterpret_cast<const P*>(x + row * hidden);
  P* rrow = reinterpret_cast<P*>(residual + row * hidden);
  // The weight is loaded first, so its latency hides under the row's instead of following the reduction.
  const P* w = reinterpret_cast<const P*>(weight);
  P wv[VPT];
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int v = threadIdx.x + i * blockDim.x;
    if (v < nvec) wv[i] = w[v];
  }
  // The next projection's GEMV may start streaming its weights now, before this kernel's own wait: the one exception
  // to common.cuh's rule, safe because the kernels that follow a norm (the GEMVs, or kernels launched the ordinary
  // way) read nothing before their wait but the weights. Measured on the H100, batch-1 Qwen3-8B: bf16 5.504 ->
  // 5.481 ms at a 128-token prompt, FP8 3.297 -> 3.290 (git show 1274b3f:bench/results/2026-11-23-h100-gemv-norm-epilogue).
  griddep_launch_dependents();
  griddep_wait();  // x (and the residual) come from the kernels before (see common.cuh)
  if constexpr (QUANT) {
    if (row >= fp8.rows) {  // a padding row of the GEMM's input: zeros, scale 1
#pragma unroll
      for (int i = 0; i < VPT; ++i) {
        const int v = threadIdx.x + i * blockDim.x;
        if (v < nvec) {
          *reinterpret_cast<uint2*>(fp8.q + row * hidden + v * VEC) = make_uint2(0u, 0u);
          if (v % 16 == 0) fp8.scale_t[static_cast<int64_t>(v / 16) * fp8.padded + row] = 1.0f;
        }
      }
      return;
    }
  }
  // All loads first: with the residual stores interleaved, the compiler would have to assume a store may alias
  // the next load and serialize them.
  P vals[VPT];
  P res[VPT];
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int v = threadIdx.x + i * blockDim.x;
    if (v < nvec) {
      vals[i] = xrow[v];
      if constexpr (FUSED) res[i] = rrow[v];
    }
  }
  float sum_sq = 0.0f;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int v = threadIdx.x + i * blockDim.x;
    if (v < nvec) {
      if constexpr (FUSED) {
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          vals[i].v[k] = Cvt<T>::from_f(Cvt<T>::to_f(vals[i].v[k]) + Cvt<T>::to_f(res[i].v[k]));
        }
        rrow[v] = vals[i];
      }
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float f = Cvt<T>::to_f(vals[i].v[k]);
        sum_sq += f * f;
      }
    }
  }
  const float inv_rms = rsqrtf(block_sum(sum_sq) / static_cast<float>(hidden) + eps);
  P* orow = reinterpret_cast<P*>(out + row * hidden);
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int v = threadIdx.x + i * blockDim.x;
    P o;
    if (v < nvec) {
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float normed = round_to<T>(Cvt<T>::to_f(vals[i].v[k]) * inv_rms);
        o.v[k] = Cvt<T>::from_f(Cvt<T>::to_f(wv[i].v[k]) * normed);
      }
      if constexpr (!QUANT) orow[v] = o;
    }
    if constexpr (QUANT) {
      // A group of 128 columns is 16 packs, held by 16 neighbouring lanes (the block's threads are a multiple of 32,
      // so pack v's group is v / 16 whatever i). Every lane takes part in the shuffles; those past the row hold none.
      float amax = 0.0f;
      if (v < nvec) {
#pragma unroll
        for (int k = 0; k < VEC; ++k) amax = fmaxf(amax, fabsf(Cvt<T>::to_f(o.v[k])));
      }
#pragma unroll
      for (int off = 8; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
      if (v < nvec) {
        const float scale = group_scale(amax);
        uint32_t words[2] = {0u, 0u};
#pragma unroll
        for (int k = 0; k < VEC; k += 2) {
          words[k / 4] |= to_e4m3x2(Cvt<T>::to_f(o.v[k]), Cvt<T>::to_f(o.v[k + 1]), scale) << (8 * (k % 4));
        }
        *reinterpret_cast<uint2*>(fp8.q + row * hidden + v * VEC) = make_uint2(words[0], words[1]);
        if (v % 16 == 0) fp8.scale_t[static_cast<int64_t>(v / 16) * fp8.padded + row] = scale;
      }
    }
  }
}

// Any hidden size and alignment: two passes over the row (the second re-reads it, from L1/L2).
template <typename T, bool FUSED>
__global__ void __launch_bounds__(kMaxThreads) rms_norm_generic_kernel(T* out, const T* x, T* residual,
                                                                       const T* __restrict__ weight, int hidden,
                                                                       float eps) {
  griddep_launch_dependents();  // (first, as in rms_norm_kernel)
  griddep_wait();
  const int64_t base = static_cast<int64_t>(blockIdx.x) * hidden;
  const T* src = FUSED ? residual : x;
  float sum_sq = 0.0f;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    float v = Cvt<T>::to_f(x[base + i]);
    if constexpr (FUSED) {
      const T sum = Cvt<T>::from_f(v + Cvt<T>::to_f(residual[base + i]));
      residual[base + i] = sum;
      v = Cvt<T>::to_f(sum);
    }
    sum_sq += v * v;
  }
  const float inv_rms = rsqrtf(block_sum(sum_sq) / static_cast<float>(hidden) + eps);
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    const float normed = round_to<T>(Cvt<T>::to_f(src[base + i]) * inv_rms);
    out[base + i] = Cvt<T>::from_f(Cvt<T>::to_f(weight[i]) * normed);
  }
}

// Rows of 16-byte packs held in registers: one pack per thread up to 512 threads (measured on H200 against 2 and 4
// packs per thread: the most loads in flight wins at every token count), more packs per thread beyond, at most 8.
// QUANT: the grid covers fp8.padded rows (the rows past `rows` only write the padding).
template <typename T, bool FUSED, bool QUANT = false>
bool launch_packed(T* out, const T* x, T* residual, const T* weight, int64_t rows, int hidden, float eps,
                   cudaStream_t stream, Fp8Rows fp8 = {}) {
  constexpr int kVec = 16 / sizeof(T);
  const int nvec = hidden / kVec;
  int threads = (nvec + 31) / 32 * 32;
  threads = threads > kMaxThreads ? kMaxThreads : threads;
  const int per_thread = (nvec + threads - 1) / threads;
  if (per_thread > 8) return false;
  const dim3 grid(static_cast<unsigned>(QUANT ? fp8.padded : rows));
  constexpr const char* kWhat = FUSED ? "fused_add_rms_norm kernel launch" : "rms_norm kernel launch";
  auto run = [&](auto packs) {
    launch_programmatic(rms_norm_kernel<T, kVec, decltype(packs)::value, FUSED, QUANT>, grid, threads, 0, stream,
                        kWhat, out, x, residual, weight, hidden, eps, fp8);
  };
  if (per_thread <= 1) {
    run(std::integral_constant<int, 1>{});
  } else if (per_thread <= 2) {
    run(std::integral_constant<int, 2>{});
  } else if (per_thread <= 4) {
    run(std::integral_constant<int, 4>{});
  } else {
    run(std::integral_constant<int, 8>{});
  }
  return true;
}

template <typename T, bool FUSED>
void launch(uintptr_t out, uintptr_t x, uintptr_t residual, uintptr_t weight, int64_t rows, int64_t hidden, float eps,
            cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const bool packed_ok = hidden % kVec == 0 && aligned16(out) && aligned16(x) && aligned16(weight) &&
                         (!FUSED || aligned16(residual));
  auto* o = reinterpret_cast<T*>(out);
  auto* xp = reinterpret_cast<const T*>(x);
  auto* r = reinterpret_cast<T*>(residual);
  auto* w = reinterpret_cast<const T*>(weight);
  const int h = static_cast<int>(hidden);
  constexpr const char* kWhat = FUSED ? "fused_add_rms_norm kernel launch" : "rms_norm kernel launch";
  if (!(packed_ok && launch_packed<T, FUSED>(o, xp, r, w, rows, h, eps, stream))) {
    launch_programmatic(rms_norm_generic_kernel<T, FUSED>, dim3(static_cast<unsigned>(rows)), dim3(kMaxThreads), 0,
                        stream, kWhat, o, xp, r, w, h, eps);
  }
}

void check_args(const char* op, uintptr_t a, uintptr_t b, uintptr_t weight, int64_t rows, int64_t hidden, double eps,
                int dtype) {
  const std::string name(op);
  if (rows < 0) throw std::invalid_argument(name + ": num_rows must be >= 0, got " + std::to_string(rows));
  if (hidden < 1) throw std::invalid_argument(name + ": hidden must be >= 1, got " + std::to_string(hidden));
  if (hidden > (int64_t{1} << 30)) throw std::invalid_argument(name + ": hidden too large: " + std::to_string(hidden));
  if (!(eps >= 0.0)) throw std::invalid_argument(name + ": eps must be >= 0");
  check_dtype(name + ": ", dtype, kHalfTypes);
  if (rows > 0 && (a == 0 || b == 0 || weight == 0)) throw std::invalid_argument(name + ": null data pointer");
  if (rows > 2147483647) throw std::invalid_argument(name + ": too many rows");
}

template <bool FUSED>
void dispatch(uintptr_t out, uintptr_t x, uintptr_t residual, uintptr_t weight, int64_t rows, int64_t hidden,
              double eps, int dtype, uintptr_t stream) {
  if (rows == 0) return;
  auto s = reinterpret_cast<cudaStream_t>(stream);
  FASTQWEN_DISPATCH_DTYPE(FUSED ? "fused_add_rms_norm: " : "rms_norm: ", dtype, kHalfTypes, T,
                          launch<T, FUSED>(out, x, residual, weight, rows, hidden, static_cast<float>(eps), s));
}

}  // namespace

void rms_norm(uintptr_t out, uintptr_t x, uintptr_t weight, int64_t num_rows, int64_t hidden, double eps, int dtype,
              uintptr_t stream) {
  check_args("rms_norm", out, x, weight, num_rows, hidden, eps, dtype);
  dispatch<false>(out, x, 0, weight, num_rows, hidden, eps, dtype, stream);
}

void fused_add_rms_norm(uintptr_t x, uintptr_t residual, uintptr_t weight, int64_t num_rows, int64_t hidden, double eps,
                        int dtype, uintptr_t stream) {
  check_args("fused_add_rms_norm", x, residual, weight, num_rows, hidden, eps, dtype);
  dispatch<true>(x, x, residual, weight, num_rows, hidden, eps, dtype, stream);
}

void fused_add_rms_norm_fp8(uintptr_t x, uintptr_t residual, uintptr_t weight, int64_t num_rows, int64_t hidden,
                            double eps, int dtype, uintptr_t q, uintptr_t scale_t, int64_t padded_rows,
                            uintptr_t stream) {
  const std::string op = "fused_add_rms_norm_fp8: ";
  check_args("fused_add_rms_norm_fp8", x, residual, weight, num_rows, hidden, eps, dtype);
  if (num_rows < 1 || padded_rows < num_rows || padded_rows > 65535) {
    throw std::invalid_argument(op + "needs 1 <= num_rows <= padded_rows <= 65535, got " + std::to_string(num_rows) +
                                " and " + std::to_string(padded_rows));
  }
  if (hidden % kFp8QuantGroup != 0) {
    throw std::invalid_argument(op + "hidden must be a multiple of " + std::to_string(kFp8QuantGroup));
  }
  if (q == 0 || scale_t == 0 || q % 8 != 0 || scale_t % 4 != 0) {
    throw std::invalid_argument(op + "q (8-byte aligned) and scale_t (float32) must be given");
  }
  if (!aligned16(x) || !aligned16(residual) || !aligned16(weight)) {
    throw std::invalid_argument(op + "x, residual and weight must be 16-byte aligned");
  }
  const Fp8Rows fp8{reinterpret_cast<uint8_t*>(q), reinterpret_cast<float*>(scale_t), static_cast<int>(num_rows),
                    static_cast<int>(padded_rows)};
  auto s = reinterpret_cast<cudaStream_t>(stream);
  FASTQWEN_DISPATCH_DTYPE(op.c_str(), dtype, kHalfTypes, T, {
    auto* xp = reinterpret_cast<T*>(x);
    if (!launch_packed<T, true, true>(xp, xp, reinterpret_cast<T*>(residual), reinterpret_cast<const T*>(weight),
                                      num_rows, static_cast<int>(hidden), static_cast<float>(eps), s, fp8)) {
      throw std::invalid_argument(op + "hidden beyond 8 packs a thread: " + std::to_string(hidden));
    }
  });
}

}  // namespace fastqwen
