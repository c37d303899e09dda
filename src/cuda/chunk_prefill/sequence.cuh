// What both chunked-prefill kernels do per (sequence, value head) besides the math: find the
// sequence's tokens and slots, write a padded sequence's zeros, and send a finished state to
// every destination the problem names (pool slot, dense final state, checkpoints), each store
// rounded to its destination's dtype as the CPU backend rounds it (core/numeric.h).
//
// Index arrays (cu_seqlens, slot indices, checkpoint counts) are read here, on the device: the
// CUDA validator reads no device data (no host synchronization). Every slot a sequence names
// (initial, final, checkpoints) is checked once per CTA before any store: a sequence with one at
// or past the pool's end is skipped like a padded one (no pool access) with NaN outputs, and the
// first such slot is recorded in the device's error record (grid.cuh record_bad_row, read by
// check_errors). cu_seqlens and the checkpoint counts are trusted, as by the recurrent op and
// FlashInfer.
#pragma once

#include <cstdint>

#include "core/numeric.h"
#include "core/problem.h"
#include "cuda/grid.cuh"

namespace deltastate::cuda_backend::prefill {

using detail::ChunkPrefillProblem;
using detail::head_offset;
using detail::load_index;

struct Seq {
  int64_t n, seq, tok0, len;
  int64_t slot;  // the initial state's slot (pooled; < 0: padded) or n (dense)
  int hv, h;
  bool padded, reads_state;
};

// The sum of x over the warp, in every lane.
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) x += __shfl_xor_sync(0xffffffffu, x, d);
  return x;
}

// The inclusive prefix sums over a warp's 64 values taken in order (x0, x1) of lane 0, then of
// lane 1, ...: this lane's two sums (a chunk's cumulative decay, two tokens a lane).
__device__ __forceinline__ float2 warp_pair_scan(float x0, float x1, int lane) {
  const float pair = x0 + x1;
  float incl = pair;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const float y = __shfl_up_sync(0xffffffffu, incl, d);
    if (lane >= d) incl += y;
  }
  const float first = (incl - pair) + x0;
  return make_float2(first, first + x1);
}

// Task `task` = n * HV + hv.
__device__ __forceinline__ Seq resolve_sequence(const ChunkPrefillProblem& p, int64_t task) {
  Seq s;
  s.n = task / p.HV;
  s.hv = static_cast<int>(task - s.n * p.HV);
  s.h = s.hv / (p.HV / p.H);
  s.seq = p.cu_seqlens ? 0 : s.n;
  s.tok0 = p.cu_seqlens ? load_index(p.cu_seqlens, p.cu_dtype, s.n) : 0;
  const int64_t len = p.cu_seqlens ? load_index(p.cu_seqlens, p.cu_dtype, s.n + 1) - s.tok0 : p.T;
  s.len = len > 0 ? len : 0;
  s.slot = p.pooled() ? load_index(p.initial_indices, p.initial_index_dtype, s.n) : s.n;
  s.padded = p.pooled() && s.slot < 0;
  const bool has = !p.has_initial || load_index(p.has_initial, p.has_initial_dtype, s.n) != 0;
  s.reads_state = p.state.ptr && !s.padded && has;
  return s;
}

__device__ __forceinline__ int64_t head_elems(const ChunkPrefillProblem& p) {
  return static_cast<int64_t>(p.V) * p.K;
}

// A skipped sequence: its output rows and dense outputs (final state, checkpoint rows) are
// `fill` (0 padded, NaN for a bad slot), the pool is untouched. All `nthreads` threads of the
// CTA take part.
__device__ inline void write_padded(const ChunkPrefillProblem& p, const Seq& s, int tid,
                                    int nthreads, float fill) {
  const int64_t V = p.V, E = head_elems(p);
  for (int64_t i = tid; i < s.len * V; i += nthreads) {
    const int64_t t = i / V, v = i - t * V;
    detail::store_float(p.out.ptr, p.out.dtype, head_offset(p.out, s.seq, s.tok0 + t, s.hv) + v,
                        fill);
  }
  if (p.final_state)
    for (int64_t i = tid; i < E; i += nthreads)
      detail::store_float(p.final_state, p.final_dtype, (s.n * p.HV + s.hv) * E + i, fill);
  if (p.checkpoints && p.checkpoint_every > 0) {
    const int64_t count = s.len / p.checkpoint_every;
    const int64_t first = load_index(p.checkpoint_cu_starts, p.checkpoint_cu_dtype, s.n);
    for (int64_t j = 0; j < count; ++j)
      for (int64_t i = tid; i < E; i += nthreads)
        detail::store_float(p.checkpoints, p.checkpoint_dtype, ((first + j) * p.HV + s.hv) * E + i,
                            fill);
  }
}

// The final state's pool slot (output_state_indices, else in place; < 0: not stored).
__device__ __forceinline__ int64_t output_slot(const ChunkPrefillProblem& p, const Seq& s) {
  return p.output_indices ? load_index(p.output_indices, p.output_index_dtype, s.n) : s.slot;
}

// The cold path of a bad sequence (one thread): records its first slot past the pool, in the
// validator's order (initial, final, checkpoints). It takes scalars, not the problem: a
// reference to the kernel parameter would give the parameter an address (a local copy of it).
__device__ inline __noinline__ void record_bad_sequence(detail::DeviceErrorRecord* errors, int op,
                                                        int64_t slots, int64_t n, int64_t slot,
                                                        int64_t out, const void* ck_slots,
                                                        DType ck_dtype, int64_t first,
                                                        int64_t count) {
  if (slot >= slots) {
    record_bad_row(errors, op, detail::kErrInitialSlot, n, slot, slots);
    return;
  }
  if (out >= slots) {
    record_bad_row(errors, op, detail::kErrOutputSlot, n, out, slots);
    return;
  }
  for (int64_t j = 0; j < count; ++j) {
    const int64_t c = load_index(ck_slots, ck_dtype, first + j);
    if (c >= slots) {
      record_bad_row(errors, op, detail::kErrCheckpointSlot, first + j, c, slots);
      return;
    }
  }
}

// Whether the CTA skips its sequence: padded (zero outputs), or naming a pool slot past the
// pool's end (NaN outputs, recorded by the CTA of value head 0). The check runs once per CTA
// before anything is stored: thread 0 reads the initial and final slots, all `nthreads` threads
// share the checkpoint slots, one barrier joins them (only pooled, live sequences name slots:
// the condition is uniform over the CTA).
__device__ __forceinline__ bool skip_sequence(const ChunkPrefillProblem& p, const Seq& s, int tid,
                                              int nthreads) {
  bool bad = false;
  if (p.pooled() && !s.padded) {
    const int64_t slots = p.state.num_slots;
    const bool ck = p.checkpoint_slots && p.checkpoint_every > 0;
    const int64_t first = ck ? load_index(p.checkpoint_cu_starts, p.checkpoint_cu_dtype, s.n) : 0;
    const int64_t count = ck ? s.len / p.checkpoint_every : 0;
    const int64_t out = output_slot(p, s);
    if (tid == 0) bad = s.slot >= slots || out >= slots;
    for (int64_t j = tid; j < count; j += nthreads)
      bad |= load_index(p.checkpoint_slots, p.checkpoint_slot_dtype, first + j) >= slots;
    bad = __syncthreads_or(bad) != 0;
    if (bad && tid == 0 && s.hv == 0)
      record_bad_sequence(p.errors, p.gate.kda ? detail::kErrOpChunkKda : detail::kErrOpChunkGdn,
                          slots, s.n, s.slot, out, p.checkpoint_slots, p.checkpoint_slot_dtype,
                          first, count);
  }
  if (!s.padded && !bad) return false;
  write_padded(p, s, tid, nthreads, bad ? bad_row_output() : 0.0f);
  return true;
}

// `store(base, dtype, element_offset, slot)` writes this thread's part of the state head at that
// offset; `slot` is the pool slot of a pool destination (stored in the pool's format,
// cuda/state_format.cuh), -1 for a dense one. The threads that hold the state call it together
// (a quantized store reduces each row's amax over them). The final state: to the pool
// (output_state_indices, else in place; < 0: not stored) when pooled, and to the dense
// final_state when given.
template <class Store>
__device__ __forceinline__ void store_final_states(const ChunkPrefillProblem& p, const Seq& s,
                                                   Store&& store) {
  const int64_t E = head_elems(p);
  if (p.pooled()) {
    const int64_t out = output_slot(p, s);
    if (out >= 0) store(p.state.ptr, p.state.dtype, out * p.state.slot_stride + s.hv * E, out);
  }
  if (p.final_state) store(p.final_state, p.final_dtype, (s.n * p.HV + s.hv) * E, int64_t{-1});
}

// Checkpoint j of the sequence (the state after (j+1) * checkpoint_every tokens).
template <class Store>
__device__ __forceinline__ void store_checkpoint(const ChunkPrefillProblem& p, const Seq& s,
                                                 int64_t j, Store&& store) {
  const int64_t E = head_elems(p);
  const int64_t pos = load_index(p.checkpoint_cu_starts, p.checkpoint_cu_dtype, s.n) + j;
  if (p.checkpoints) {
    store(p.checkpoints, p.checkpoint_dtype, (pos * p.HV + s.hv) * E, int64_t{-1});
  } else {
    const int64_t slot = load_index(p.checkpoint_slots, p.checkpoint_slot_dtype, pos);
    if (slot >= 0) store(p.state.ptr, p.state.dtype, slot * p.state.slot_stride + s.hv * E, slot);
  }
}

// Whether tokens [0, end) of the sequence end on a checkpoint.
__device__ __forceinline__ bool checkpoint_at(const ChunkPrefillProblem& p, int64_t end) {
  return p.checkpoint_every > 0 && end > 0 && end % p.checkpoint_every == 0;
}

}  // namespace deltastate::cuda_backend::prefill
