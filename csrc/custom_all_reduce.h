// Host-side declarations of the custom all-reduce (no CUDA headers needed): the small-message sum across the GPUs
// of one host, over buffers each rank shares with the others through CUDA IPC. No NVLink multicast objects.
#pragma once

#include <cstdint>
#include <string>

#include "dtype.h"

namespace fastqwen {

constexpr int kAllReduceMaxRanks = 8;
constexpr int kAllReduceMaxBlocks = 64;  // all blocks must be resident at once: they wait for their peers
// Each rank's shared buffer: a signal area (flags of the barriers, per block and per peer, and the block's own round
// counter), then the data area the rank's input is copied into: two halves of capacity_bytes, alternate rounds in
// alternate halves.
constexpr int64_t kAllReduceSignalBytes = 64 * 1024;
constexpr int64_t kAllReduceAlign = 16;  // messages must be a whole number of 16-byte vectors
// custom_all_reduce_add_rms_norm holds a row in registers: at most 4 16-byte packs for each of 512 threads.
constexpr int kAllReduceNormMaxHidden = 16384;

// Device memory for one rank's shared buffer, for messages of up to capacity_bytes: the signal area (zeroed), the data
// area of two halves of capacity_bytes, then (lamport_bytes > 0) the receive area of three buffers of `world` slots of
// lamport_bytes (every word all ones: empty). Every rank allocates with the same arguments.
uintptr_t all_reduce_buffer_alloc(int64_t capacity_bytes, int64_t lamport_bytes, int world);
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
  int64_t capacity_bytes = 0;  // the largest message: half of each buffer's data area
  int64_t lamport_bytes = 0;   // messages up to this size take no barrier (the buffers' receive areas); 0: none
  int dtype = kBF16;
  int max_blocks = 36;
  uintptr_t stream = 0;
  // custom_all_reduce_add_rms_norm only: data is [numel / hidden, hidden] rows.
  uintptr_t residual = 0;  // in and out, the same shape and dtype as data
  uintptr_t weight = 0;    // [hidden], the same dtype
  int64_t hidden = 0;
  double eps = 0.0;
  // custom_all_reduce_add_rms_norm only: this rank's message is in the receive buffers already, stored there by the
  // GEMV that computed it (gemv.h's kGemvSend), and data is only where the normalized rows go.
  bool sent = false;
};

// Where a GEMV whose output is the next all-reduce's message stores it (gemv.h's kGemvSend): straight into its slot of
// every rank's receive buffer of the coming round, this rank's own included, so that the all-reduce that follows
// (custom_all_reduce_add_rms_norm with `sent`) has nothing left to send and only waits for the peers' rows. 16-bit
// elements, each stored as it is computed; an element whose bits are all ones (a NaN) is stored as another NaN, so
// that no element of a message reads as empty. Kept in device memory (all_reduce_send_target writes it).
struct AllReduceSendTarget {
  uint16_t* receive[kAllReduceMaxRanks];  // each rank's receive area as mapped here (buffer 0, slot 0)
  const uint32_t* third;                   // this rank's record of the last round's receive buffer (0, 1, 2)
  int rank;
  int world;
  int64_t slot_elems;  // 16-bit elements in a slot
};
constexpr int64_t kAllReduceSendTargetBytes = sizeof(AllReduceSendTarget);

// Writes the AllReduceSendTarget of args' buffers (which need receive areas: lamport_bytes > 0) to device memory at
// dst (kAllReduceSendTargetBytes, 8-byte aligned). Synchronous; once, before any GEMV sends.
void all_reduce_send_target(const AllReduceArgs& args, uintptr_t dst);

// One-shot all-reduce: each rank copies its input into its buffer (the round's half), a barrier across ranks, then
// each rank sums every rank's buffer in rank order (so every rank gets bitwise the same result). Every rank must call
// it with the same numel, dtype and max_blocks, in the same order.
void custom_all_reduce(const AllReduceArgs& args);

// true: a second barrier at the end of each round, as before the halves (for comparison). Read at launch (a CUDA graph
// keeps what was set when it was captured), so set it before the first all-reduce, the same on every rank: a call
// with the barrier copies into the first half whatever the round, which a peer may still read of the call before if
// that one ran without it. Returns the previous setting.
bool set_all_reduce_end_barrier(bool enabled);

// The all-reduce fused with the residual add and RMSNorm that follow it in a decoder layer: the same numbers as
// custom_all_reduce followed by norm.h's fused_add_rms_norm, in one kernel. In place, per row r of data:
//   residual[r] = round(residual[r] + round(sum over ranks of data[r]))   (the sum in rank order, in fp32)
//   data[r]     = weight * round(residual[r] * rsqrt(mean(residual[r]^2) + eps))
// float16 or bfloat16; hidden a whole number of 16-byte packs, at most kAllReduceNormMaxHidden; residual and weight
// 16-byte aligned. Every rank must call it with the same shapes, in the same order as its other all-reduces (they
// share the round counters), and the same residual (replicated across ranks in tensor parallelism). With `sent`, every
// rank's message is a row the GEMV before stored into the receive buffers (kGemvSend), which needs the barrier-free
// path (lamport_bytes covering the message, no end barrier); data is then only the output.
void custom_all_reduce_add_rms_norm(const AllReduceArgs& args);

}  // namespace fastqwen
