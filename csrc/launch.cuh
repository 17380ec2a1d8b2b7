// Kernel launches with programmatic dependent launch (PDL), for the kernels of a decode step. A kernel launched this
// way may start while the kernel before it on the stream still runs, and hide its launch and its first loads under
// that kernel's end. It must keep the rule of common.cuh's griddep_wait() / griddep_launch_dependents().
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "cuda_check.h"
#include "device_cache.h"

namespace fastqwen {

// set_programmatic_launch(); FASTQWEN_PDL=0 turns it off at import. One switch for the process (inline: one object
// across the translation units).
inline bool g_programmatic_launch = true;

// Whether the current device takes programmatic stream serialization (compute capability 9.0 and later).
inline bool programmatic_launch_supported() {
  static PerDevice<int> supported;
  return supported.get([](int device) {
    int major = 0;
    cuda_check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device),
               "programmatic launch: cudaDeviceGetAttribute");
    return major >= 9 ? 1 : 0;
  }) != 0;
}

// kernel<<<grid, block, smem, stream>>>(args...), with programmatic stream serialization when it is on and the
// device takes it; an ordinary launch otherwise (the kernel's griddep calls are then no-ops).
template <typename... Params, typename... Args>
void launch_programmatic(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                         const char* what, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = g_programmatic_launch && programmatic_launch_supported() ? 1 : 0;
  cuda_check(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...), what);
}

}  // namespace fastqwen
