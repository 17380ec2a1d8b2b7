// The residual add + RMSNorm of one row, as the packed kernel of norm.cu computes it, for a block of another kernel:
// the one-token GEMV's last block normalizes the row its grid has just written (gemv.cu), so that a batch-1 decode
// step runs no norm kernel between its projections. Both give the same bits: the squares are summed in the same
// order.
#pragma once

#include "common.cuh"

namespace fastqwen {

// The packed RMSNorm kernel's block for a row of nvec 16-byte packs: `threads` threads (a multiple of 32, at most
// 512), thread t holding packs t, t + threads, ... (per_thread of them; the kernel takes at most 8).
struct NormRowLayout {
  int threads;
  int per_thread;
};

__host__ __device__ constexpr NormRowLayout norm_row_layout(int nvec) {
  const int threads = (nvec + 31) / 32 * 32 < 512 ? (nvec + 31) / 32 * 32 : 512;
  return {threads, (nvec + threads - 1) / threads};
}

// The packs one thread of a block of block_threads threads holds in add_rms_norm_row for a row of nvec packs (the
// caller instantiates it for at least that many; 0 if the norm kernel itself would not take the row).
__host__ __device__ constexpr int norm_row_packs(int nvec, int block_threads) {
  const NormRowLayout lay = norm_row_layout(nvec);
  const int played_warps = lay.threads / 32, warps = block_threads / 32;
  return nvec > 0 && lay.per_thread <= 8 ? (played_warps + warps - 1) / warps * lay.per_thread : 0;
}

// residual <- y + residual, then y <- RMSNorm(residual) * weight, for one row of nvec packs of T; y may have been
// written by other blocks of the same grid (the caller fences): it is read through L2. Any block of a multiple of 32
// threads runs it, with kPacks >= norm_row_packs(nvec, blockDim.x) (in registers); its warps play the norm kernel's
// warps in turn (warp w plays w, w + warps, ...), each lane the same thread, so every thread's sum, every warp's
// butterfly and the sum over warps (block_sum) are those of the kernel.
template <typename T, int kPacks>
__device__ __noinline__ void add_rms_norm_row(T* y, T* residual, const T* __restrict__ weight, int nvec, float eps) {
  constexpr int VEC = 16 / sizeof(T);
  using P = Pack<T, VEC>;
  const NormRowLayout lay = norm_row_layout(nvec);
  const int warps = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int played_warps = lay.threads / 32;
  P* yp = reinterpret_cast<P*>(y);
  P* rp = reinterpret_cast<P*>(residual);
  const P* wp = reinterpret_cast<const P*>(weight);
  // Slot s: the played warp warp + (s / per_thread) * warps, its pack s % per_thread. All loads first.
  P vals[kPacks];
  P res[kPacks];
#pragma unroll
  for (int s = 0; s < kPacks; ++s) {
    const int pw = warp + (s / lay.per_thread) * warps;
    const int v = pw * 32 + lane + (s % lay.per_thread) * lay.threads;
    if (pw < played_warps && v < nvec) {
      const uint4 a = __ldcg(reinterpret_cast<const uint4*>(yp + v));
      const uint4 b = __ldcg(reinterpret_cast<const uint4*>(rp + v));
      vals[s] = *reinterpret_cast<const P*>(&a);
      res[s] = *reinterpret_cast<const P*>(&b);
    }
  }
  __shared__ float warp_sums[16];
  float sum_sq = 0.0f;
#pragma unroll
  for (int s = 0; s < kPacks; ++s) {
    const int pw = warp + (s / lay.per_thread) * warps;
    const int v = pw * 32 + lane + (s % lay.per_thread) * lay.threads;
    if (pw >= played_warps) break;  // uniform across the warp
    if (v < nvec) {
#pragma unroll
      for (int k = 0; k < VEC; ++k) vals[s].v[k] = Cvt<T>::from_f(Cvt<T>::to_f(vals[s].v[k]) + Cvt<T>::to_f(res[s].v[k]));
      rp[v] = vals[s];
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float f = Cvt<T>::to_f(vals[s].v[k]);
        sum_sq += f * f;
      }
    }
    if (s % lay.per_thread == lay.per_thread - 1) {  // the played thread's last pack: its warp's sum
      const float warp_total = warp_sum(sum_sq);
      if (lane == 0) warp_sums[pw] = warp_total;
      sum_sq = 0.0f;
    }
  }
  __syncthreads();
  const float total = warp_sum(lane < played_warps ? warp_sums[lane] : 0.0f);
  const float inv_rms = rsqrtf(total / static_cast<float>(nvec * VEC) + eps);
#pragma unroll
  for (int s = 0; s < kPacks; ++s) {
    const int pw = warp + (s / lay.per_thread) * warps;
    const int v = pw * 32 + lane + (s % lay.per_thread) * lay.threads;
    if (pw >= played_warps) break;
    if (v < nvec) {
      const P wv = wp[v];
      P o;
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float normed = round_to<T>(Cvt<T>::to_f(vals[s].v[k]) * inv_rms);
        o.v[k] = Cvt<T>::from_f(Cvt<T>::to_f(wv.v[k]) * normed);
      }
      yp[v] = o;
    }
  }
}

}  // namespace fastqwen
