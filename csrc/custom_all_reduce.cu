// The custom all-reduce: one-shot over peer buffers exchanged with CUDA IPC, for the small messages of decode
// (a few KB to a few MB) where NCCL's ring pays for its steps in latency.
//
// Synchronisation is by flags in each rank's signal area: block b of rank r stores the round number into
// signal[p].start[b][r] of every peer p (release, system scope) and waits for every peer's flag in its own area
// (acquire). Block b handles the same elements on every rank (same grid), so it only waits for its counterparts.
// The round number lives in the rank's own signal area and is bumped by the kernel itself, so the kernel can be
// captured in a CUDA graph and replayed. A second barrier ("end") keeps a rank from overwriting its buffer in the
// next round while a peer may still read it. The flags of round k are only compared for equality: no peer can be a
// whole round ahead, because each round ends with that barrier.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstring>
#include <stdexcept>
#include <string>

#include "common.cuh"
#include "cuda_check.h"
#include "custom_all_reduce.h"

namespace fastqwen {
namespace {

struct Signal {
  uint32_t start[kAllReduceMaxBlocks][kAllReduceMaxRanks];
  uint32_t end[kAllReduceMaxBlocks][kAllReduceMaxRanks];
  uint32_t round[kAllReduceMaxBlocks];
};
static_assert(sizeof(Signal) <= kAllReduceSignalBytes, "the signal area is too small");

struct Peers {
  Signal* signal[kAllReduceMaxRanks];
  const uint4* data[kAllReduceMaxRanks];
};

__device__ __forceinline__ void store_release(uint32_t* addr, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(addr), "r"(v) : "memory");
}

__device__ __forceinline__ uint32_t load_acquire(const uint32_t* addr) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(addr) : "memory");
  return v;
}

// Every thread of the block must reach it. Threads 0..world-1 each signal one peer and wait for that peer.
template <int WORLD>
__device__ __forceinline__ void barrier(const Peers& peers, int rank, bool at_end, uint32_t round) {
  __syncthreads();  // the block's writes are done (and, through release cumulativity, published below)
  const int b = blockIdx.x;
  if (threadIdx.x < WORLD) {
    const int p = threadIdx.x;
    uint32_t* theirs = at_end ? &peers.signal[p]->end[b][rank] : &peers.signal[p]->start[b][rank];
    const uint32_t* mine = at_end ? &peers.signal[rank]->end[b][p] : &peers.signal[rank]->start[b][p];
    store_release(theirs, round);
    while (load_acquire(mine) != round) {
    }
  }
  __syncthreads();
}

template <typename T, int WORLD>
__global__ void __launch_bounds__(512) one_shot_kernel(Peers peers, int rank, uint4* data, int64_t nvec) {
  constexpr int kPer = 16 / sizeof(T);
  Signal* self = peers.signal[rank];
  const uint32_t round = self->round[blockIdx.x] + 1;
  uint4* mine = const_cast<uint4*>(peers.data[rank]);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t i = first; i < nvec; i += stride) mine[i] = data[i];
  barrier<WORLD>(peers, rank, false, round);
  for (int64_t i = first; i < nvec; i += stride) {
    float acc[kPer];
#pragma unroll
    for (int k = 0; k < kPer; ++k) acc[k] = 0.0f;
#pragma unroll
    for (int p = 0; p < WORLD; ++p) {  // rank order on every rank: bitwise the same sum everywhere
      uint4 v = peers.data[p][i];
      const T* x = reinterpret_cast<const T*>(&v);
#pragma unroll
      for (int k = 0; k < kPer; ++k) acc[k] += Cvt<T>::to_f(x[k]);
    }
    uint4 out;
    T* o = reinterpret_cast<T*>(&out);
#pragma unroll
    for (int k = 0; k < kPer; ++k) o[k] = Cvt<T>::from_f(acc[k]);
    data[i] = out;
  }
  barrier<WORLD>(peers, rank, true, round);
  if (threadIdx.x == 0) self->round[blockIdx.x] = round;
}

template <typename T, int WORLD>
void launch(const Peers& peers, const AllReduceArgs& a, int64_t nvec) {
  constexpr int kThreads = 512;
  int64_t blocks = (nvec + kThreads - 1) / kThreads;
  if (blocks > a.max_blocks) blocks = a.max_blocks;
  if (blocks < 1) blocks = 1;
  one_shot_kernel<T, WORLD><<<static_cast<int>(blocks), kThreads, 0, reinterpret_cast<cudaStream_t>(a.stream)>>>(
      peers, a.rank, reinterpret_cast<uint4*>(a.data), nvec);
  cuda_check_launch("custom_all_reduce");
}

template <typename T>
void dispatch_world(const Peers& peers, const AllReduceArgs& a, int64_t nvec) {
  switch (a.world) {
    case 2: return launch<T, 2>(peers, a, nvec);
    case 4: return launch<T, 4>(peers, a, nvec);
    case 8: return launch<T, 8>(peers, a, nvec);
    default: throw std::invalid_argument("custom_all_reduce: world must be 2, 4 or 8");
  }
}

}  // namespace

uintptr_t all_reduce_buffer_alloc(int64_t data_bytes) {
  if (data_bytes <= 0 || data_bytes % kAllReduceAlign) {
    throw std::invalid_argument("all_reduce_buffer_alloc: data_bytes must be a positive multiple of 16");
  }
  void* ptr = nullptr;
  FASTQWEN_CUDA_CHECK(cudaMalloc(&ptr, kAllReduceSignalBytes + data_bytes));
  FASTQWEN_CUDA_CHECK(cudaMemset(ptr, 0, kAllReduceSignalBytes));
  FASTQWEN_CUDA_CHECK(cudaDeviceSynchronize());  // zeroed before any peer can open it
  return reinterpret_cast<uintptr_t>(ptr);
}

void all_reduce_buffer_free(uintptr_t ptr) { FASTQWEN_CUDA_CHECK(cudaFree(reinterpret_cast<void*>(ptr))); }

std::string all_reduce_ipc_handle(uintptr_t ptr) {
  cudaIpcMemHandle_t handle;
  FASTQWEN_CUDA_CHECK(cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(ptr)));
  return std::string(reinterpret_cast<const char*>(&handle), sizeof(handle));
}

uintptr_t all_reduce_ipc_open(const std::string& bytes) {
  cudaIpcMemHandle_t handle;
  if (bytes.size() != sizeof(handle)) throw std::invalid_argument("all_reduce_ipc_open: not a CUDA IPC handle");
  std::memcpy(&handle, bytes.data(), sizeof(handle));
  void* ptr = nullptr;
  FASTQWEN_CUDA_CHECK(cudaIpcOpenMemHandle(&ptr, handle, cudaIpcMemLazyEnablePeerAccess));
  return reinterpret_cast<uintptr_t>(ptr);
}

void all_reduce_ipc_close(uintptr_t ptr) { FASTQWEN_CUDA_CHECK(cudaIpcCloseMemHandle(reinterpret_cast<void*>(ptr))); }

void custom_all_reduce(const AllReduceArgs& a) {
  if (a.world < 2 || a.world > kAllReduceMaxRanks || a.rank < 0 || a.rank >= a.world) {
    throw std::invalid_argument("custom_all_reduce: rank must be in [0, world) with world in [2, 8]");
  }
  if (a.max_blocks < 1 || a.max_blocks > kAllReduceMaxBlocks) {
    throw std::invalid_argument("custom_all_reduce: max_blocks must be in [1, 64]");
  }
  if (a.numel <= 0) return;
  const int64_t element = a.dtype == kF32 ? 4 : 2;
  const int64_t bytes = a.numel * element;
  if (bytes % kAllReduceAlign || a.data % kAllReduceAlign) {
    throw std::invalid_argument("custom_all_reduce: the message must be 16-byte aligned and a multiple of 16 bytes");
  }
  if (bytes > a.capacity_bytes) throw std::invalid_argument("custom_all_reduce: the message exceeds the buffers");
  Peers peers;
  for (int p = 0; p < kAllReduceMaxRanks; ++p) {
    const uintptr_t base = p < a.world ? a.buffers[p] : 0;
    if (p < a.world && base == 0) throw std::invalid_argument("custom_all_reduce: a peer buffer is missing");
    peers.signal[p] = reinterpret_cast<Signal*>(base);
    peers.data[p] = base ? reinterpret_cast<const uint4*>(base + kAllReduceSignalBytes) : nullptr;
  }
  const int64_t nvec = bytes / 16;
  FASTQWEN_DISPATCH_DTYPE("custom_all_reduce: ", a.dtype, kFloatTypes, T, dispatch_world<T>(peers, a, nvec));
}

}  // namespace fastqwen
