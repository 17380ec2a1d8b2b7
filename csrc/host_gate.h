// Host-side declaration of the host gate (no CUDA headers needed).
#pragma once

#include <cstdint>

namespace fastqwen {

// One buffer the gate fills: `bytes` from host memory `src` (pinned: read over the bus when the gate opens), or from
// device memory `fallback` when it is cancelled or times out, into device memory `dst`. Pointers 16-byte aligned,
// bytes a multiple of 16; a copy of 0 bytes is skipped.
struct HostGateCopy {
  uintptr_t src = 0, dst = 0, fallback = 0;
  int64_t bytes = 0;
};

// Queue on `stream` a one-block kernel that waits until the pinned host word `flag` holds `expect` (open: each copy
// from its src) or `expect | kHostGateCancel` (cancelled: from its fallback), or until `timeout_ns` have passed on the
// GPU's clock (as cancelled), then fills the copies' dst and writes to the pinned host word `status` `expect` if it
// copied the host's buffers and 0 otherwise. The work queued after it on the stream reads what the host wrote after
// the launch. With `waited_ns` (a pinned host uint64, or 0 for none) it also writes there the nanoseconds it waited
// on the GPU's clock. expect must not have kHostGateCancel's bit. Throws std::invalid_argument for bad arguments.
constexpr uint32_t kHostGateCancel = 0x80000000u;
void host_gate(uintptr_t flag, uintptr_t status, uint32_t expect, const HostGateCopy& a, const HostGateCopy& b,
               uint64_t timeout_ns, uintptr_t stream, uintptr_t waited_ns = 0);

}  // namespace fastqwen
