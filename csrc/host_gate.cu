// The host gate: a step queued on the GPU before the host knows its inputs (speculative decoding's verify step,
// whose drafts come from the tokens of the step still running). The step's CUDA graph, its uploads and its read-back
// are queued behind this kernel while the GPU runs the step before; once the host has the tokens it writes the next
// inputs into pinned memory and raises a flag, and the GPU starts within a few microseconds, without the host's
// launch calls (tens of microseconds each) between the two steps.
//
// The kernel spins on the flag (a pinned host word, read over the bus with acquire semantics, so the buffer loads
// that follow see what the host wrote before raising it), then copies the buffers with loads that bypass the caches.
// A cancelled gate, or one the host leaves closed past timeout_ns, copies device-resident fallbacks (padding inputs)
// instead: the step then runs on inputs that write nothing anyone reads, and the status word tells the host so. How
// long the GPU waited for the host (from the kernel's start, right after the step before it, to the flag) goes to an
// optional pinned word: the idle time between two verify steps, measured where it happens.
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "cuda_check.h"
#include "host_gate.h"

namespace fastqwen {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ uint32_t load_acquire_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

struct Copy {
  const uint4* src;  // device view of the pinned host buffer
  uint4* dst;
  const uint4* fallback;
  int64_t vecs;
};

__device__ __forceinline__ void fill(const Copy& c, bool from_host) {
  const uint4* from = from_host ? c.src : c.fallback;
  for (int64_t i = threadIdx.x; i < c.vecs; i += blockDim.x) c.dst[i] = from_host ? __ldcv(from + i) : from[i];
}

__global__ void __launch_bounds__(kThreads) host_gate_kernel(const uint32_t* flag, volatile uint32_t* status,
                                                             volatile uint64_t* waited_ns, uint32_t expect, Copy a,
                                                             Copy b, uint64_t timeout_ns) {
  __shared__ bool from_host;
  if (threadIdx.x == 0) {
    const uint64_t start = global_ns();
    bool open = false;
    for (;;) {
      const uint32_t v = load_acquire_sys(flag);
      if (v == expect) {
        open = true;
        break;
      }
      if (v == (expect | kHostGateCancel) || global_ns() - start > timeout_ns) break;
      __nanosleep(100);
    }
    from_host = open;
    if (waited_ns != nullptr) *waited_ns = global_ns() - start;
  }
  __syncthreads();
  fill(a, from_host);
  fill(b, from_host);
  if (threadIdx.x == 0) *status = from_host ? expect : 0u;
}

// The device's view of a pinned host pointer (the same address under unified addressing; asked, not assumed).
uintptr_t device_view(uintptr_t host, const char* what) {
  void* dev = nullptr;
  const cudaError_t err = cudaHostGetDevicePointer(&dev, reinterpret_cast<void*>(host), 0);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    throw std::invalid_argument(std::string("host_gate: ") + what + " is not pinned host memory (" +
                                cudaGetErrorString(err) + ")");
  }
  return reinterpret_cast<uintptr_t>(dev);
}

Copy to_copy(const HostGateCopy& c, const char* what) {
  if (c.bytes < 0 || c.bytes % 16 != 0) {
    throw std::invalid_argument(std::string("host_gate: ") + what + ".bytes must be a non-negative multiple of 16");
  }
  if (c.bytes == 0) return Copy{nullptr, nullptr, nullptr, 0};
  if (c.src == 0 || c.dst == 0 || c.fallback == 0 || (c.src | c.dst | c.fallback) % 16 != 0) {
    throw std::invalid_argument(std::string("host_gate: ") + what + "'s src, dst and fallback must be 16-byte aligned");
  }
  return Copy{reinterpret_cast<const uint4*>(device_view(c.src, what)), reinterpret_cast<uint4*>(c.dst),
              reinterpret_cast<const uint4*>(c.fallback), c.bytes / 16};
}

}  // namespace

void host_gate(uintptr_t flag, uintptr_t status, uint32_t expect, const HostGateCopy& a, const HostGateCopy& b,
               uint64_t timeout_ns, uintptr_t stream, uintptr_t waited_ns) {
  if (expect == 0 || (expect & kHostGateCancel) != 0) {
    throw std::invalid_argument("host_gate: expect must be in [1, 2^31)");
  }
  if (flag == 0 || status == 0 || flag % 4 != 0 || status % 4 != 0) {
    throw std::invalid_argument("host_gate: flag and status must be 4-byte aligned pinned host words");
  }
  if (waited_ns % 8 != 0) throw std::invalid_argument("host_gate: waited_ns must be an 8-byte aligned pinned host word");
  const Copy ca = to_copy(a, "a"), cb = to_copy(b, "b");
  const auto* dev_flag = reinterpret_cast<const uint32_t*>(device_view(flag, "flag"));
  auto* dev_status = reinterpret_cast<uint32_t*>(device_view(status, "status"));
  auto* dev_waited = waited_ns == 0 ? nullptr : reinterpret_cast<uint64_t*>(device_view(waited_ns, "waited_ns"));
  host_gate_kernel<<<1, kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(dev_flag, dev_status, dev_waited, expect,
                                                                              ca, cb, timeout_ns);
  cuda_check_launch("host_gate");
}

}  // namespace fastqwen
