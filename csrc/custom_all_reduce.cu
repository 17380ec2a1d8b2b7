// The custom all-reduce: one-shot over peer buffers exchanged with CUDA IPC, for the small messages of decode
// (a few KB to a few MB) where NCCL's ring pays for its steps in latency.
//
// Synchronisation is by flags in each rank's signal area: block b of rank r stores the round number into
// signal[p].start[b][r] of every peer p (release, system scope) and waits for every peer's flag in its own area
// (acquire). Block b handles the same elements on every rank (same grid), so it only waits for its counterparts.
// The round number lives in the rank's own signal area and is bumped by the kernel itself, so the kernel can be
// captured in a CUDA graph and replayed. Every launch sets every block's counter (block 0 those of the blocks it did
// not launch), so all counters hold the number of launches so far and round k is the same number in every block (and
// so is its receive buffer, `third`, below).
//
// One barrier a round. Round k copies the input into half k % 2 of the rank's data area, so the copy of round k + 1
// cannot overwrite what a peer still reads of round k; and the copy of round k + 2 comes after this rank passed round
// k + 1's barrier, which every peer enters only once its round-k kernel has ended (kernels of a stream run in order).
// A peer can therefore be one round ahead at a barrier, never two, and a flag is waited on until it reaches the round
// (a later round's flag may already have replaced it). set_all_reduce_end_barrier(true) restores the second barrier
// at the end of each round, which the one-shot kernel had before (for comparison).
//
// Messages of up to lamport_bytes take no barrier at all (lamport_bytes = 0: never). Each rank's buffer then also has
// a receive area: three buffers (round k uses buffer k % 3), each with a slot per sender. A rank stores its input into
// its slot of every peer's buffer, then waits until the slots of its own buffer hold no empty word (all bits set,
// what the area is filled with) and sums them in rank order. An element whose bits are all ones (a NaN) is sent as
// another NaN, so no data word is empty. Round k empties buffer (k - 1) % 3 (as much as round k - 1 wrote, in any
// kernel); a peer writes into it again only in round k + 2, which needs this rank's round k + 1 stores (or flags),
// made after round k's kernel ended. The barrier rounds empty it too, so the two kinds of round mix: either kind of
// round k + 1 ends on a rank only once every peer has begun it, so has ended round k.
//
// A GEMV may send the message itself (gemv.h's kGemvSend, AllReduceSendTarget): each of its blocks stores its outputs
// into every rank's buffer of the coming round (the one after the rank's `third`) as it computes them, its own rank's
// slot included, and the fused all-reduce that follows (SENT) only waits for every slot and sums. The GEMV's blocks
// store 16-bit elements, so a 32-bit word may hold one block's element before the other's: SENT waits until no
// 16-bit element of a vector is empty. The rules above hold with the GEMV as the round's sending half: it runs after
// the rank's round before has ended (the kernels between wait for it), and its round's buffer was emptied then. A
// rank's own slot needs no emptying: the all-reduce reads it only after its wait for the GEMV, which has then stored
// the whole row there (whatever an earlier round left). Everything else it may do before that wait (the GEMV touches
// none of it): read the counters, empty the buffer before, and wait for the peers' rows, which then arrive while
// this rank's GEMV still runs.
//
// The fused variant (one_shot_add_rms_norm_kernel) keeps the same barrier, halves and round counters; it gives each
// block whole rows (tokens), so that after summing a row it can add the residual and normalize the row in the block.
// The two kernels share the counters (every counter counts every launch of either, on every rank alike).
//
// Both are launched with programmatic dependent launch (launch.cuh) and keep common.cuh's rule: they wait for the
// kernel before (the projection's GEMV that wrote the message) before touching anything, then let the next kernel
// start, so that the all-reduce's launch hides under the GEMV's end and the next projection's GEMV streams its
// first weights while the ranks exchange the message (under tensor parallelism a decode step at batch 1 is a chain
// of GEMV, all-reduce, GEMV: twice per layer).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "common.cuh"
#include "cuda_check.h"
#include "custom_all_reduce.h"
#include "launch.cuh"

namespace fastqwen {
namespace {

struct Signal {
  uint32_t start[kAllReduceMaxBlocks][kAllReduceMaxRanks];
  uint32_t end[kAllReduceMaxBlocks][kAllReduceMaxRanks];
  uint32_t round[kAllReduceMaxBlocks];
  uint32_t third[kAllReduceMaxBlocks];  // the receive buffer of the last round (0, 1, 2): round % 3 without the wrap
  uint32_t received[3];  // 16-byte vectors each sender stored into receive buffer b in the last round that used it
};
static_assert(sizeof(Signal) <= kAllReduceSignalBytes, "the signal area is too small");

struct Peers {
  Signal* signal[kAllReduceMaxRanks];
  const uint4* data[kAllReduceMaxRanks];
  uint4* receive[kAllReduceMaxRanks];  // the receive areas (nullptr without lamport_bytes)
};

constexpr uint32_t kEmptyWord = 0xFFFFFFFFu;  // what an empty receive slot holds (the area is memset to 0xFF)

__device__ __forceinline__ void store_release(uint32_t* addr, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(addr), "r"(v) : "memory");
}

__device__ __forceinline__ uint32_t load_acquire(const uint32_t* addr) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(addr) : "memory");
  return v;
}

// Every thread of the block must reach it. Threads 0..world-1 each signal one peer and wait for that peer's flag to
// reach the round (the difference as a signed number: the counters may wrap).
template <int WORLD>
__device__ __forceinline__ void barrier(const Peers& peers, int rank, bool at_end, uint32_t round) {
  __syncthreads();  // the block's writes are done (and, through release cumulativity, published below)
  const int b = blockIdx.x;
  if (threadIdx.x < WORLD) {
    const int p = threadIdx.x;
    uint32_t* theirs = at_end ? &peers.signal[p]->end[b][rank] : &peers.signal[p]->start[b][rank];
    const uint32_t* mine = at_end ? &peers.signal[rank]->end[b][p] : &peers.signal[rank]->start[b][p];
    store_release(theirs, round);
    while (static_cast<int32_t>(load_acquire(mine) - round) < 0) {
    }
  }
  __syncthreads();
}

// The receive buffer of this round: the next of 0, 1, 2 (a uint32 round counter wraps at a number 3 does not divide).
__device__ __forceinline__ int next_third(const Signal* self) {
  return static_cast<int>((self->third[blockIdx.x] + 1) % 3);
}

// The end of a round: the block's counters, and block 0 those of the blocks this launch did not have.
__device__ __forceinline__ void end_round(Signal* self, uint32_t round, int third) {
  if (threadIdx.x == 0) {
    self->round[blockIdx.x] = round;
    self->third[blockIdx.x] = third;
  }
  if (blockIdx.x == 0) {
    for (int b = gridDim.x + threadIdx.x; b < kAllReduceMaxBlocks; b += blockDim.x) {
      self->round[b] = round;
      self->third[b] = third;
    }
  }
}

// The first 16-byte vector of round's half of a data area of two halves of half_vecs vectors (the first half with
// the end barrier).
__device__ __forceinline__ int64_t half_offset(uint32_t round, int64_t half_vecs, bool end_barrier) {
  return end_barrier ? 0 : static_cast<int64_t>(round & 1u) * half_vecs;
}

__device__ __forceinline__ void store_volatile(uint4* addr, uint4 v) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

__device__ __forceinline__ uint4 load_volatile(const uint4* addr) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(addr)
               : "memory");
  return v;
}

// A 16-byte vector as it is sent to the receive buffers: elements whose bits are all ones (NaNs) become another NaN
// (the last bit cleared), so that no word of data is kEmptyWord. Every rank sums the vectors as sent, its own too.
template <typename T>
__device__ __forceinline__ uint4 as_sent(uint4 v) {
  uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (sizeof(T) == 2) {
      if ((w[i] & 0xFFFFu) == 0xFFFFu) w[i] &= ~1u;
      if ((w[i] >> 16) == 0xFFFFu) w[i] &= ~0x10000u;
    } else {
      if (w[i] == kEmptyWord) w[i] &= ~1u;
    }
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// Sender p's vector i of receive buffer b on this rank, once it has arrived.
__device__ __forceinline__ uint4 received_vector(const uint4* slot) {
  uint4 v;
  do {
    v = load_volatile(slot);
  } while (v.x == kEmptyWord || v.y == kEmptyWord || v.z == kEmptyWord || v.w == kEmptyWord);
  return v;
}

// The same where the senders store 16-bit elements (SENT): until no element is empty.
__device__ __forceinline__ bool has_empty_element(uint4 v) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  bool empty = false;
#pragma unroll
  for (int i = 0; i < 4; ++i) empty |= (w[i] & 0xFFFFu) == 0xFFFFu || (w[i] >> 16) == 0xFFFFu;
  return empty;
}

__device__ __forceinline__ uint4 received_elements(const uint4* slot) {
  uint4 v;
  do {
    v = load_volatile(slot);
  } while (has_empty_element(v));
  return v;
}

// Slot of sender p in receive buffer b of an area with slots of slot_vecs vectors.
template <int WORLD>
__device__ __forceinline__ uint4* receive_slot(uint4* area, int b, int p, int64_t slot_vecs) {
  return area + (static_cast<int64_t>(b) * WORLD + p) * slot_vecs;
}

// Every round, both kinds: empty what the round before stored into this rank's receive buffer (the one before b),
// and (block 0, at the end) record how much this round stores into buffer b (sent_vecs; 0 for a barrier round).
template <int WORLD>
__device__ __forceinline__ void empty_previous_buffer(const Peers& peers, int rank, int b, int64_t slot_vecs) {
  if (slot_vecs == 0) return;
  const int previous = (b + 2) % 3;
  const int64_t n = peers.signal[rank]->received[previous];
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const uint4 empty = make_uint4(kEmptyWord, kEmptyWord, kEmptyWord, kEmptyWord);
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < n * WORLD; j += stride) {
    const int p = static_cast<int>(j / n);
    if (p != rank) receive_slot<WORLD>(peers.receive[rank], previous, p, slot_vecs)[j % n] = empty;
  }
}

__device__ __forceinline__ void record_sent(Signal* self, int b, int64_t slot_vecs, int64_t sent_vecs) {
  if (slot_vecs != 0 && blockIdx.x == 0 && threadIdx.x == 0) self->received[b] = static_cast<uint32_t>(sent_vecs);
}

// A round as every kernel opens and closes it, of either kind: its number and receive buffer from the block's
// counters, the buffer the round before filled emptied (begin_round); then what it stored recorded and every block's
// counters set (finish_round).
struct Round {
  Signal* self;
  uint32_t number;
  int buffer;
};

template <int WORLD>
__device__ __forceinline__ Round begin_round(const Peers& peers, int rank, int64_t slot_vecs) {
  Signal* self = peers.signal[rank];
  const Round round{self, self->round[blockIdx.x] + 1, next_third(self)};
  empty_previous_buffer<WORLD>(peers, rank, round.buffer, slot_vecs);
  return round;
}

__device__ __forceinline__ void finish_round(const Round& round, int64_t slot_vecs, int64_t sent_vecs) {
  record_sent(round.self, round.buffer, slot_vecs, sent_vecs);
  end_round(round.self, round.number, round.buffer);
}

// The sum of every rank's 16-byte vector in rank order (fp32, one rounding to T); vector_of(p) is rank p's. Every rank
// adds the same vectors in the same order, so all of them get bitwise the same result, whichever kernel sums.
template <typename T, int WORLD, typename VectorOf>
__device__ __forceinline__ uint4 sum_in_rank_order(VectorOf vector_of) {
  constexpr int kPer = 16 / sizeof(T);
  float acc[kPer];
#pragma unroll
  for (int k = 0; k < kPer; ++k) acc[k] = 0.0f;
#pragma unroll
  for (int p = 0; p < WORLD; ++p) {  // rank order on every rank: bitwise the same sum everywhere
    const uint4 v = vector_of(p);
    const T* x = reinterpret_cast<const T*>(&v);
#pragma unroll
    for (int k = 0; k < kPer; ++k) acc[k] += Cvt<T>::to_f(x[k]);
  }
  uint4 out;
  T* o = reinterpret_cast<T*>(&out);
#pragma unroll
  for (int k = 0; k < kPer; ++k) o[k] = Cvt<T>::from_f(acc[k]);
  return out;
}

// Messages of up to lamport_bytes: no barrier (see the top of the file). Same sums as one_shot_kernel.
template <typename T, int WORLD>
__global__ void __launch_bounds__(512) lamport_kernel(Peers peers, int rank, uint4* data, int64_t nvec, int64_t slot_vecs) {
  griddep_wait();               // data comes from the kernel before (see common.cuh)
  griddep_launch_dependents();  // the next projection's GEMV may start streaming its weights
  const Round round = begin_round<WORLD>(peers, rank, slot_vecs);
  const int b = round.buffer;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t i = first; i < nvec; i += stride) {
    const uint4 v = as_sent<T>(data[i]);
#pragma unroll
    for (int p = 0; p < WORLD; ++p) {
      if (p != rank) store_volatile(receive_slot<WORLD>(peers.receive[p], b, rank, slot_vecs) + i, v);
    }
  }
  for (int64_t i = first; i < nvec; i += stride) {
    data[i] = sum_in_rank_order<T, WORLD>([&](int p) {
      return p == rank ? as_sent<T>(data[i])
                       : received_vector(receive_slot<WORLD>(peers.receive[rank], b, p, slot_vecs) + i);
    });
  }
  finish_round(round, slot_vecs, nvec);
}

template <typename T, int WORLD>
__global__ void __launch_bounds__(512)
    one_shot_kernel(Peers peers, int rank, uint4* data, int64_t nvec, int64_t half_vecs, bool end_barrier,
                    int64_t slot_vecs) {
  griddep_wait();               // data comes from the kernel before (see common.cuh)
  griddep_launch_dependents();  // the next projection's GEMV may start streaming its weights
  const Round round = begin_round<WORLD>(peers, rank, slot_vecs);
  const int b = round.buffer;
  const int64_t half = half_offset(round.number, half_vecs, end_barrier);
  uint4* mine = const_cast<uint4*>(peers.data[rank]) + half;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t i = first; i < nvec; i += stride) mine[i] = data[i];
  barrier<WORLD>(peers, rank, false, round.number);
  for (int64_t i = first; i < nvec; i += stride) {
    data[i] = sum_in_rank_order<T, WORLD>([&](int p) { return peers.data[p][half + i]; });
  }
  if (end_barrier) barrier<WORLD>(peers, rank, true, round.number);
  finish_round(round, slot_vecs, 0);
}

// One block per row at a time (rows b, b + grid, ...), the row's 16-byte packs spread over the threads, VPT packs a
// thread held in registers between the sum and the normalization. The arithmetic is one_shot_kernel's followed by
// norm.cu's rms_norm_kernel<FUSED>, rounding where they round (and with their thread layout, so the sum of squares
// is reduced in the same order). SENT (with LAMPORT): every rank's row, this rank's too, is in the receive buffer
// already (a GEMV sent it), and data is only the output.
template <typename T, int WORLD, int VPT, bool LAMPORT, bool SENT = false>
__global__ void __launch_bounds__(512)
    one_shot_add_rms_norm_kernel(Peers peers, int rank, uint4* data, uint4* residual, const uint4* __restrict__ weight,
                                 int64_t rows, int row_vecs, float eps, int64_t half_vecs, bool end_barrier,
                                 int64_t slot_vecs) {
  using P = Pack<T, 16 / sizeof(T)>;
  constexpr int kPer = 16 / sizeof(T);
  P w[VPT];  // the norm's weight (the weights may be read before the wait); its loads complete under the barrier
  auto load_weight = [&] {
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int v = threadIdx.x + i * blockDim.x;
      if (v < row_vecs) w[i] = reinterpret_cast<const P*>(weight)[v];
    }
  };
  if constexpr (!SENT) load_weight();  // (SENT: after its wait for the peers' rows, which holds fewer registers)
  static_assert(LAMPORT || !SENT, "a sent message is in the receive buffers");
  if constexpr (!SENT) {
    griddep_wait();               // data (and the residual) come from the kernels before (see common.cuh)
    griddep_launch_dependents();  // the next projection's GEMV may start streaming its weights
  }
  // (SENT reads these before its wait: the kernel before is the sending GEMV, which touches neither; the all-reduce
  // that last set the counters and read the previous buffer came before it, so has ended: common.cuh)
  const Round round = begin_round<WORLD>(peers, rank, slot_vecs);
  const int b = round.buffer;
  const int64_t half = half_offset(round.number, half_vecs, end_barrier);
  if constexpr (SENT) {
    // The peers' rows arrive while this rank's GEMV may still run: wait for them before the wait for the GEMV (which
    // stores this rank's row), so that little is left after it. (Their loads below then find them.)
    for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
      for (int v = threadIdx.x; v < row_vecs; v += blockDim.x) {
#pragma unroll
        for (int p = 0; p < WORLD; ++p) {
          if (p != rank) received_elements(receive_slot<WORLD>(peers.receive[rank], b, p, slot_vecs) + row * row_vecs + v);
        }
      }
    }
    load_weight();
    griddep_wait();               // this rank's row, from the GEMV before; the residual (see common.cuh)
    griddep_launch_dependents();  // the next projection's GEMV may start streaming its weights
  }
  if constexpr (LAMPORT && !SENT) {  // (no barrier: see the top of the file)
    for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
      for (int v = threadIdx.x; v < row_vecs; v += blockDim.x) {
        const uint4 sent = as_sent<T>(data[row * row_vecs + v]);
#pragma unroll
        for (int p = 0; p < WORLD; ++p) {
          if (p != rank) store_volatile(receive_slot<WORLD>(peers.receive[p], b, rank, slot_vecs) + row * row_vecs + v, sent);
        }
      }
    }
  } else if constexpr (!LAMPORT) {
    uint4* mine = const_cast<uint4*>(peers.data[rank]) + half;
    for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
      for (int v = threadIdx.x; v < row_vecs; v += blockDim.x) mine[row * row_vecs + v] = data[row * row_vecs + v];
    }
    barrier<WORLD>(peers, rank, false, round.number);
  }
  // Rank p's 16-byte vector at index idx of the message: as sent to the receive buffers, or from p's data half.
  auto peer_vector = [&](int p, int64_t idx) -> uint4 {
    if constexpr (!LAMPORT) return peers.data[p][half + idx];
    if constexpr (SENT) return received_elements(receive_slot<WORLD>(peers.receive[rank], b, p, slot_vecs) + idx);
    if (p == rank) return as_sent<T>(data[idx]);
    return received_vector(receive_slot<WORLD>(peers.receive[rank], b, p, slot_vecs) + idx);
  };
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t base = row * row_vecs;
    // Every load of the row before any store (a store to the residual could alias a later load for the compiler).
    P sum[VPT];
    P res[VPT];
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int v = threadIdx.x + i * blockDim.x;
      if (v < row_vecs) {
        res[i] = reinterpret_cast<const P*>(residual)[base + v];
        float acc[kPer];
#pragma unroll
        for (int k = 0; k < kPer; ++k) acc[k] = 0.0f;
#pragma unroll
        for (int p = 0; p < WORLD; ++p) {  // rank order, as one_shot_kernel: every rank gets the same bits
          const uint4 bits = peer_vector(p, base + v);
          const P x = *reinterpret_cast<const P*>(&bits);
#pragma unroll
          for (int k = 0; k < kPer; ++k) acc[k] += Cvt<T>::to_f(x.v[k]);
        }
#pragma unroll
        for (int k = 0; k < kPer; ++k) sum[i].v[k] = Cvt<T>::from_f(acc[k]);  // the all-reduce's output
      }
    }
    float sum_sq = 0.0f;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int v = threadIdx.x + i * blockDim.x;
      if (v < row_vecs) {
#pragma unroll
        for (int k = 0; k < kPer; ++k) {
          sum[i].v[k] = Cvt<T>::from_f(Cvt<T>::to_f(sum[i].v[k]) + Cvt<T>::to_f(res[i].v[k]));  // the new residual
        }
        reinterpret_cast<P*>(residual)[base + v] = sum[i];
#pragma unroll
        for (int k = 0; k < kPer; ++k) {
          const float f = Cvt<T>::to_f(sum[i].v[k]);
          sum_sq += f * f;
        }
      }
    }
    __syncthreads();  // block_sum's scratch still holds the previous row's partial sums until every warp has read them
    const float inv_rms = rsqrtf(block_sum(sum_sq) / static_cast<float>(row_vecs * kPer) + eps);
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int v = threadIdx.x + i * blockDim.x;
      if (v < row_vecs) {
        P o;
#pragma unroll
        for (int k = 0; k < kPer; ++k) {
          const float normed = round_to<T>(Cvt<T>::to_f(sum[i].v[k]) * inv_rms);
          o.v[k] = Cvt<T>::from_f(Cvt<T>::to_f(w[i].v[k]) * normed);
        }
        reinterpret_cast<P*>(data)[base + v] = o;
      }
    }
  }
  if (end_barrier && !LAMPORT) barrier<WORLD>(peers, rank, true, round.number);
  finish_round(round, slot_vecs, LAMPORT ? rows * row_vecs : 0);
}

bool g_end_barrier = false;  // set_all_reduce_end_barrier()

int64_t half_vecs_of(const AllReduceArgs& a) { return a.capacity_bytes / kAllReduceAlign; }
int64_t slot_vecs_of(const AllReduceArgs& a) { return a.lamport_bytes / kAllReduceAlign; }

// Whether a message of nvec 16-byte vectors takes the barrier-free kernels.
bool takes_lamport(const AllReduceArgs& a, int64_t nvec) {
  return !g_end_barrier && nvec <= slot_vecs_of(a);
}

template <typename T, int WORLD>
void launch(const Peers& peers, const AllReduceArgs& a, int64_t nvec) {
  constexpr int kThreads = 512;
  int64_t blocks = (nvec + kThreads - 1) / kThreads;
  if (blocks > a.max_blocks) blocks = a.max_blocks;
  if (blocks < 1) blocks = 1;
  const auto stream = reinterpret_cast<cudaStream_t>(a.stream);
  auto* data = reinterpret_cast<uint4*>(a.data);
  if (takes_lamport(a, nvec)) {
    launch_programmatic(lamport_kernel<T, WORLD>, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), 0, stream,
                        "custom_all_reduce", peers, a.rank, data, nvec, slot_vecs_of(a));
    return;
  }
  launch_programmatic(one_shot_kernel<T, WORLD>, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), 0, stream,
                      "custom_all_reduce", peers, a.rank, data, nvec, half_vecs_of(a), g_end_barrier,
                      slot_vecs_of(a));
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

// The thread layout of norm.cu's launch_packed: one pack a thread up to 512 threads, then 2 or 4 packs a thread.
template <typename T, int WORLD>
void launch_add_rms_norm(const Peers& peers, const AllReduceArgs& a) {
  constexpr int kPer = 16 / sizeof(T);
  const int row_vecs = static_cast<int>(a.hidden / kPer);
  const int64_t rows = a.numel / a.hidden;
  int threads = (row_vecs + 31) / 32 * 32;
  threads = threads > 512 ? 512 : threads;
  const int per_thread = (row_vecs + threads - 1) / threads;
  const int blocks = static_cast<int>(rows < a.max_blocks ? rows : a.max_blocks);
  auto stream = reinterpret_cast<cudaStream_t>(a.stream);
  auto* data = reinterpret_cast<uint4*>(a.data);
  auto* residual = reinterpret_cast<uint4*>(a.residual);
  const auto* weight = reinterpret_cast<const uint4*>(a.weight);
  const float eps = static_cast<float>(a.eps);
  // (the barrier-free path is a template argument: as a runtime flag it cost the barrier kernels registers)
  auto launch_with = [&](auto lamport, auto sent) {
    constexpr bool LAMPORT = decltype(lamport)::value, SENT = decltype(sent)::value;
    auto kernel = per_thread <= 1   ? one_shot_add_rms_norm_kernel<T, WORLD, 1, LAMPORT, SENT>
                  : per_thread <= 2 ? one_shot_add_rms_norm_kernel<T, WORLD, 2, LAMPORT, SENT>
                                    : one_shot_add_rms_norm_kernel<T, WORLD, 4, LAMPORT, SENT>;
    launch_programmatic(kernel, dim3(static_cast<unsigned>(blocks)), dim3(static_cast<unsigned>(threads)), 0, stream,
                        "custom_all_reduce_add_rms_norm", peers, a.rank, data, residual, weight, rows, row_vecs, eps,
                        half_vecs_of(a), g_end_barrier, slot_vecs_of(a));
  };
  const bool lamport = takes_lamport(a, rows * row_vecs);
  if (a.sent) {
    if (!lamport) {
      throw std::invalid_argument("custom_all_reduce_add_rms_norm: a sent message needs the barrier-free path "
                                  "(lamport_bytes covering it, no end barrier)");
    }
    return launch_with(std::true_type{}, std::true_type{});
  }
  if (lamport) return launch_with(std::true_type{}, std::false_type{});
  launch_with(std::false_type{}, std::false_type{});
}

template <typename T>
void dispatch_world_add_rms_norm(const Peers& peers, const AllReduceArgs& a) {
  switch (a.world) {
    case 2: return launch_add_rms_norm<T, 2>(peers, a);
    case 4: return launch_add_rms_norm<T, 4>(peers, a);
    case 8: return launch_add_rms_norm<T, 8>(peers, a);
    default: throw std::invalid_argument("custom_all_reduce_add_rms_norm: world must be 2, 4 or 8");
  }
}

// What both entry points check first: ranks and blocks.
void check_ranks(const AllReduceArgs& a, const std::string& op) {
  if (a.world < 2 || a.world > kAllReduceMaxRanks || a.rank < 0 || a.rank >= a.world) {
    throw std::invalid_argument(op + ": rank must be in [0, world) with world in [2, 8]");
  }
  if (a.max_blocks < 1 || a.max_blocks > kAllReduceMaxBlocks) {
    throw std::invalid_argument(op + ": max_blocks must be in [1, 64]");
  }
  if (a.lamport_bytes < 0 || a.lamport_bytes % kAllReduceAlign || a.lamport_bytes > a.capacity_bytes ||
      a.lamport_bytes / kAllReduceAlign > UINT32_MAX) {
    throw std::invalid_argument(op + ": lamport_bytes must be a multiple of 16 from 0 to capacity_bytes");
  }
}

// Then, for a message of at least one element: its size and alignment; the peers' buffers as mapped here.
Peers checked_peers(const AllReduceArgs& a, const std::string& op) {
  const int64_t element = a.dtype == kF32 ? 4 : 2;
  const int64_t bytes = a.numel * element;
  if (bytes % kAllReduceAlign || a.data % kAllReduceAlign) {
    throw std::invalid_argument(op + ": the message must be 16-byte aligned and a multiple of 16 bytes");
  }
  if (bytes > a.capacity_bytes) throw std::invalid_argument(op + ": the message exceeds the buffers");
  Peers peers;
  for (int p = 0; p < kAllReduceMaxRanks; ++p) {
    const uintptr_t base = p < a.world ? a.buffers[p] : 0;
    if (p < a.world && base == 0) throw std::invalid_argument(op + ": a peer buffer is missing");
    peers.signal[p] = reinterpret_cast<Signal*>(base);
    peers.data[p] = base ? reinterpret_cast<const uint4*>(base + kAllReduceSignalBytes) : nullptr;
    peers.receive[p] = base && a.lamport_bytes ? reinterpret_cast<uint4*>(base + kAllReduceSignalBytes +
                                                                          2 * a.capacity_bytes)
                                               : nullptr;
  }
  return peers;
}

}  // namespace

bool set_all_reduce_end_barrier(bool enabled) {
  const bool before = g_end_barrier;
  g_end_barrier = enabled;
  return before;
}

uintptr_t all_reduce_buffer_alloc(int64_t capacity_bytes, int64_t lamport_bytes, int world) {
  if (capacity_bytes <= 0 || capacity_bytes % kAllReduceAlign) {
    throw std::invalid_argument("all_reduce_buffer_alloc: capacity_bytes must be a positive multiple of 16");
  }
  if (lamport_bytes < 0 || lamport_bytes % kAllReduceAlign || lamport_bytes > capacity_bytes) {
    throw std::invalid_argument("all_reduce_buffer_alloc: lamport_bytes must be a multiple of 16 up to capacity_bytes");
  }
  if (world < 2 || world > kAllReduceMaxRanks) throw std::invalid_argument("all_reduce_buffer_alloc: world in [2, 8]");
  const int64_t data_bytes = 2 * capacity_bytes;        // the two halves
  const int64_t receive_bytes = 3 * world * lamport_bytes;  // three buffers of a slot per sender
  void* ptr = nullptr;
  FASTQWEN_CUDA_CHECK(cudaMalloc(&ptr, kAllReduceSignalBytes + data_bytes + receive_bytes));
  FASTQWEN_CUDA_CHECK(cudaMemset(ptr, 0, kAllReduceSignalBytes));
  if (receive_bytes) {  // every receive slot empty (kEmptyWord)
    FASTQWEN_CUDA_CHECK(cudaMemset(static_cast<char*>(ptr) + kAllReduceSignalBytes + data_bytes, 0xFF, receive_bytes));
  }
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
  check_ranks(a, "custom_all_reduce");
  if (a.sent) throw std::invalid_argument("custom_all_reduce: only custom_all_reduce_add_rms_norm takes a sent message");
  if (a.numel <= 0) return;
  const Peers peers = checked_peers(a, "custom_all_reduce");
  const int64_t nvec = a.numel * (a.dtype == kF32 ? 4 : 2) / 16;
  FASTQWEN_DISPATCH_DTYPE("custom_all_reduce: ", a.dtype, kFloatTypes, T, dispatch_world<T>(peers, a, nvec));
}

void custom_all_reduce_add_rms_norm(const AllReduceArgs& a) {
  const std::string op = "custom_all_reduce_add_rms_norm";
  check_ranks(a, op);
  check_dtype(op + ": ", a.dtype, kHalfTypes);
  if (a.numel <= 0) return;
  const Peers peers = checked_peers(a, op);
  const int64_t per_pack = kAllReduceAlign / 2;
  if (a.hidden < per_pack || a.hidden % per_pack || a.hidden > kAllReduceNormMaxHidden) {
    throw std::invalid_argument(op + ": hidden must be a multiple of " + std::to_string(per_pack) + " up to " +
                                std::to_string(kAllReduceNormMaxHidden) + ", got " + std::to_string(a.hidden));
  }
  if (a.numel % a.hidden) throw std::invalid_argument(op + ": numel must be a whole number of rows of hidden");
  if (!a.residual || !a.weight || a.residual % kAllReduceAlign || a.weight % kAllReduceAlign) {
    throw std::invalid_argument(op + ": residual and weight must be non-null and 16-byte aligned");
  }
  if (a.residual == a.data) throw std::invalid_argument(op + ": residual and data must be different buffers");
  FASTQWEN_DISPATCH_DTYPE("custom_all_reduce_add_rms_norm: ", a.dtype, kHalfTypes, T,
                          dispatch_world_add_rms_norm<T>(peers, a));
}

void all_reduce_send_target(const AllReduceArgs& a, uintptr_t dst) {
  const std::string op = "all_reduce_send_target";
  check_ranks(a, op);
  if (a.lamport_bytes == 0) throw std::invalid_argument(op + ": the buffers have no receive areas (lamport_bytes 0)");
  if (dst == 0 || dst % 8) throw std::invalid_argument(op + ": dst must be non-null and 8-byte aligned");
  AllReduceSendTarget target{};
  for (int p = 0; p < a.world; ++p) {
    if (a.buffers[p] == 0) throw std::invalid_argument(op + ": a peer buffer is missing");
    target.receive[p] = reinterpret_cast<uint16_t*>(a.buffers[p] + kAllReduceSignalBytes + 2 * a.capacity_bytes);
  }
  target.third = &reinterpret_cast<const Signal*>(a.buffers[a.rank])->third[0];
  target.rank = a.rank;
  target.world = a.world;
  target.slot_elems = a.lamport_bytes / 2;
  cuda_check(cudaMemcpy(reinterpret_cast<void*>(dst), &target, sizeof(target), cudaMemcpyHostToDevice),
             "all_reduce_send_target: cudaMemcpy");
}

}  // namespace fastqwen
