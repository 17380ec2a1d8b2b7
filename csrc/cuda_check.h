// Turns CUDA errors into C++ exceptions (pybind11 maps std::runtime_error to
// Python RuntimeError). Never aborts the process.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace fastqwen {

inline void cuda_check(cudaError_t err, const char* op) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("fastqwen: CUDA error in ") + op + ": " + cudaGetErrorName(err) + ": " +
                             cudaGetErrorString(err));
  }
}

// Call right after a kernel launch: reports launch-configuration errors (and
// any earlier asynchronous error seen by this runtime).
inline void cuda_check_launch(const char* op) { cuda_check(cudaGetLastError(), op); }

}  // namespace fastqwen

#define FASTQWEN_CUDA_CHECK(expr) ::fastqwen::cuda_check((expr), #expr)
