// RMSNorm and residual-add + RMSNorm: one block per row, the row held in
// registers as 16-byte packs, fp32 sum of squares reduced over the block, one
// read and one write of each tensor (a two-pass kernel covers any other size or
// alignment). Numerics follow HF's Qwen3RMSNorm.
#include <stdexcept>
#include <string>

#include "common.cuh"
#include "cuda_check.h"
#include "dtype.h"
#include "launch.cuh"
#include "norm.h"

namespace fastqwen {
namespace {

// VEC elements per 16-byte pack (other sizes and alignments take the two-pass kernel below),
// VPT packs per thread. FUSED: x + residual first, residual updated in place.
constexpr int kMaxThreads = 512;

template <typename T, int VEC, int VPT, bool FUSED>
__global__ void __launch_bounds__(kMaxThreads) rms_norm_kernel(T* out, const T* x,  // out == x in the fused form
                                                        T* __restrict__ residual, const T* __restrict__ weight,
                                                        int hidden, float eps) {
  using P = Pack<T, VEC>;
  const int64_t row = blockIdx.x;
  const int nvec = hidden / VEC;
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
    if (v < nvec) {
      P o;
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float normed = round_to<T>(Cvt<T>::to_f(vals[i].v[k]) * inv_rms);
        o.v[k] = Cvt<T>::from_f(Cvt<T>::to_f(wv[i].v[k]) * normed);
      }
      orow[v] = o;
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
template <typename T, bool FUSED>
bool launch_packed(T* out, const T* x, T* residual, const T* weight, int64_t rows, int hidden, float eps,
                   cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const int nvec = hidden / kVec;
  int threads = (nvec + 31) / 32 * 32;
  threads = threads > kMaxThreads ? kMaxThreads : threads;
  const int per_thread = (nvec + threads - 1) / threads;
  if (per_thread > 8) return false;
  const dim3 grid(static_cast<unsigned>(rows));
  constexpr const char* kWhat = FUSED ? "fused_add_rms_norm kernel launch" : "rms_norm kernel launch";
  if (per_thread <= 1) {
    launch_programmatic(rms_norm_kernel<T, kVec, 1, FUSED>, grid, threads, 0, stream, kWhat, out, x, residual, weight,
                        hidden, eps);
  } else if (per_thread <= 2) {
    launch_programmatic(rms_norm_kernel<T, kVec, 2, FUSED>, grid, threads, 0, stream, kWhat, out, x, residual, weight,
                        hidden, eps);
  } else if (per_thread <= 4) {
    launch_programmatic(rms_norm_kernel<T, kVec, 4, FUSED>, grid, threads, 0, stream, kWhat, out, x, residual, weight,
                        hidden, eps);
  } else {
    launch_programmatic(rms_norm_kernel<T, kVec, 8, FUSED>, grid, threads, 0, stream, kWhat, out, x, residual, weight,
                        hidden, eps);
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

}  // namespace fastqwen
