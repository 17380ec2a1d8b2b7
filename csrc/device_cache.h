// A value worked out once per CUDA device (kernel attributes, occupancy, SM counts) and reused on every launch. Per
// device, not per process: one process may drive several GPUs (tensor parallelism), and both the opt-in to large
// shared memory and occupancy belong to a device.
#pragma once

#include <cuda_runtime.h>

#include <mutex>
#include <stdexcept>
#include <string>

#include "cuda_check.h"

namespace fastqwen {

template <typename T>
class PerDevice {
 public:
  // The value for the current device, made by init(device) on its first use there (thread-safe; retried if init
  // throws).
  template <typename Init>
  const T& get(Init&& init) {
    int device = 0;
    cuda_check(cudaGetDevice(&device), "cudaGetDevice");
    if (device < 0 || device >= kMaxDevices) {
      throw std::runtime_error("fastqwen: CUDA device " + std::to_string(device) + " beyond the kernels' caches");
    }
    std::call_once(once_[device], [&] { values_[device] = init(device); });
    return values_[device];
  }

 private:
  static constexpr int kMaxDevices = 64;
  std::once_flag once_[kMaxDevices];
  T values_[kMaxDevices] = {};
};

// The current device's SM count (what persistent grids are sized by), looked up once per device.
inline int sm_count() {
  static PerDevice<int> sms;
  return sms.get([](int device) {
    int count = 0;
    cuda_check(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device), "SM count");
    return count;
  });
}

}  // namespace fastqwen
