// Host-side declarations of the custom all-reduce (no CUDA headers needed): the small-message sum across the GPUs
// of one host, over buffers each rank shares with the others through CUDA IPC. No NVLink multicast objects.
#pragma once

#include <cstdint>
#include <string>

#include "dtype.h"

namespace fastqwen {

constexpr int kAllReduceMaxRanks = 8;
constexpr int kAllReduceMaxBlocks = 64;  // all blocks must be resident at once: they wait for their peers
// Each rank's shared buffer: a signal area (flags of the two barriers, per block and per peer, and the block's
// own round counter), then the data area the rank's input is copied into.
constexpr int64_t kAllReduceSignalBytes = 64 * 1024;
constexpr int64_t kAllReduceAlign = 16;  // messages must be a whole number of 16-byte vectors

// Device memory for one rank's shared buffer (signal area zeroed), data_bytes of data after the signal area.
uintptr_t all_reduce_buffer_alloc(int64_t data_bytes);
void all_reduce_buffer_free(uintptr_t ptr);
// The CUDA IPC handle of a buffer (cudaIpcMemHandle_t's bytes), and a peer's buffer opened from its handle.
std::string all_reduce_ipc_handle(uintptr_t ptr);
uintptr_t all_reduce_ipc_open(const std::string& handle);
void all_reduce_ipc_close(uintptr_t ptr);

struct AllReduceArgs {
  uintptr_t buffers[kAllReduceMaxRanks] = {};  // every rank's shared buffer, in rank order, as mapped here
  int rank = 0;
  int world = 0;
  uintptr_t data = 0;  // in and out: numel elements of dtype, summed in place
  int64_t numel = 0;
  int64_t capacity_bytes = 0;  // data area of each buffer
  int dtype = kBF16;
  int max_blocks = 36;
  uintptr_t stream = 0;
};

// One-shot all-reduce: each rank copies its input into its buffer, a barrier across ranks, then each rank sums every
// rank's buffer in rank order (so every rank gets bitwise the same result), a second barrier before the buffers may
// be reused. Every rank must call it with the same numel, dtype and max_blocks, in the same order.
void custom_all_reduce(const AllReduceArgs& args);

}  // namespace fastqwen
