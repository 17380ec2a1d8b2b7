// silu_and_mul: the Qwen3 MLP activation, act(gate) * up, with gate = x[..., :d]
// and up = x[..., d:]. Memory-bound: 16-byte vector loads/stores when d and the
// pointers allow it, a scalar path otherwise. Math in fp32, one rounding.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "activation.h"
#include "common.cuh"
#include "cuda_check.h"
#include "launch.cuh"

namespace fastqwen {
namespace {

// Grid: x over column chunks of VEC elements, y over rows (strided when there
// are more rows than gridDim.y). VEC == 1 is the scalar path.
template <typename T, int VEC>
__global__ void silu_and_mul_kernel(const T* __restrict__ x, T* __restrict__ out, int64_t num_rows, int64_t d) {
  griddep_wait();               // x comes from the kernel before (see common.cuh)
  griddep_launch_dependents();  // the down projection's GEMV may start streaming its weights
  using P = Pack<T, VEC>;
  const int64_t nvec = d / VEC;
  const int64_t col = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (col >= nvec) return;
  for (int64_t row = blockIdx.y; row < num_rows; row += gridDim.y) {
    const P* gate = reinterpret_cast<const P*>(x + row * 2 * d);
    const P* up = reinterpret_cast<const P*>(x + row * 2 * d + d);
    P* o = reinterpret_cast<P*>(out + row * d);
    const P g = gate[col];
    const P u = up[col];
    P r;
#pragma unroll
    for (int k = 0; k < VEC; ++k) r.v[k] = silu_mul(g.v[k], u.v[k]);
    o[col] = r;
  }
}

constexpr int kThreads = 256;
constexpr int64_t kMaxGridY = 65535;
constexpr int64_t kMaxGridX = 2147483647;

template <typename T>
void launch(uintptr_t x, uintptr_t out, int64_t num_rows, int64_t d, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const bool vec_ok = (d % kVec == 0) && (x % 16 == 0) && (out % 16 == 0);
  const int64_t nvec = vec_ok ? d / kVec : d;
  // Small rows: shrink the block (to a warp multiple) instead of idling threads.
  const int threads = static_cast<int>(nvec >= kThreads ? kThreads : ((nvec + 31) / 32) * 32);
  const int64_t gx = (nvec + threads - 1) / threads;
  if (gx > kMaxGridX) throw std::invalid_argument("silu_and_mul: d too large: " + std::to_string(d));
  const dim3 grid(static_cast<unsigned>(gx), static_cast<unsigned>(num_rows < kMaxGridY ? num_rows : kMaxGridY));
  const T* xp = reinterpret_cast<const T*>(x);
  T* op = reinterpret_cast<T*>(out);
  constexpr const char* kWhat = "silu_and_mul kernel launch";
  if (vec_ok) {
    launch_programmatic(silu_and_mul_kernel<T, kVec>, grid, dim3(threads), 0, stream, kWhat, xp, op, num_rows, d);
  } else {
    launch_programmatic(silu_and_mul_kernel<T, 1>, grid, dim3(threads), 0, stream, kWhat, xp, op, num_rows, d);
  }
}

}  // namespace

void silu_and_mul(uintptr_t x, uintptr_t out, int64_t num_rows, int64_t d, int dtype, uintptr_t stream) {
  if (num_rows < 0) throw std::invalid_argument("silu_and_mul: num_rows must be >= 0, got " + std::to_string(num_rows));
  if (d < 0) throw std::invalid_argument("silu_and_mul: d must be >= 0, got " + std::to_string(d));
  check_dtype("silu_and_mul: ", dtype, kFloatTypes);
  if (num_rows == 0 || d == 0) return;
  if (x == 0 || out == 0) throw std::invalid_argument("silu_and_mul: null data pointer");
  if (d > (INT64_MAX / 2) / num_rows) throw std::invalid_argument("silu_and_mul: num_rows * 2 * d overflows");
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  FASTQWEN_DISPATCH_DTYPE("silu_and_mul: ", dtype, kFloatTypes, T, launch<T>(x, out, num_rows, d, s));
}

}  // namespace fastqwen
