// The commits after a verify: a copy of each accepted request's intermediate entry (a state, a
// conv window) into its pool slot, every layer in one launch. Two kernels over one grid shape
// (chunk, request, layer):
//   commit_kernel          flat entries (a state; a window both tensors hold as the same dense
//                          range): CTA copies kCommitThreads * kCommitUnitsPerThread units
//                          (16-byte words where every address allows, else 2-byte ones).
//   commit_strided_kernel  any other window: one element per thread, (row, col) from the element
//                          index, int64 offsets through both tensors' strides (overlapping
//                          scratch views included: it only reads them).
// A request with nothing accepted, or padded, copies nothing; a bad index is skipped and recorded
// under p.err_op (the first CTA of the request's first layer records it).
// Part of verify.cu's translation unit (included there only), in its anonymous namespace.
#pragma once

#include <cstdint>

#include "core/problem.h"
#include "cuda/grid.cuh"

namespace deltastate::cuda_backend {

constexpr int kCommitThreads = 256, kCommitUnitsPerThread = 4;

namespace {

// The entry request b copies in `layer`: element offsets of its source and destination (and,
// `scale_at` given, of a quantized scratch entry's first row scale). False: nothing to copy
// (nothing accepted, padding, or a bad index, recorded here).
__device__ __forceinline__ bool commit_entry(const detail::CommitProblem& p, int64_t b,
                                             int64_t layer, int64_t& src, int64_t& dst,
                                             int64_t* scale_at = nullptr) {
  const int64_t step = p.accepted.at(b, 0) - (p.accepted_is_step ? 0 : 1);
  const int64_t slot = p.slots.at(b, 0);
  const int64_t row = p.rows.ptr ? p.rows.at(b, 0) : b;
  if (step < 0 || slot < 0 || row < 0) return false;  // nothing accepted, or padding
  int kind = 0;
  int64_t value = 0, limit = 0;
  if (slot >= p.num_slots) kind = detail::kErrSlot, value = slot, limit = p.num_slots;
  else if (row >= p.inter_rows) kind = detail::kErrRow, value = row, limit = p.inter_rows;
  else if (step >= p.inter_steps) kind = detail::kErrStep, value = step, limit = p.inter_steps;
  if (kind) {
    if (blockIdx.x == 0 && layer == 0 && threadIdx.x == 0)
      record_bad_row(p.errors, p.err_op, kind, b, value, limit);
    return false;
  }
  src = layer * p.inter_layer_stride + row * p.inter_row_stride + step * p.inter_step_stride;
  dst = layer * p.state_layer_stride + slot * p.state_slot_stride;
  if (scale_at)
    *scale_at = layer * p.inter_scale_layer_stride + row * p.inter_scale_row_stride +
                step * p.inter_scale_step_stride;
  return true;
}

template <class Unit>
__global__ void __launch_bounds__(kCommitThreads) commit_kernel(const detail::CommitProblem p) {
  enter_grid(false);
  const int64_t b = blockIdx.y, layer = blockIdx.z;
  int64_t src_at, dst_at;
  if (!commit_entry(p, b, layer, src_at, dst_at)) return;
  const int64_t es = dtype_size(p.dtype);
  const Unit* src = reinterpret_cast<const Unit*>(static_cast<const char*>(p.inter) + src_at * es);
  Unit* dst = reinterpret_cast<Unit*>(static_cast<char*>(p.state) + dst_at * es);
  const int64_t units = p.head_elems * es / static_cast<int64_t>(sizeof(Unit));
  const int64_t first =
      static_cast<int64_t>(blockIdx.x) * kCommitThreads * kCommitUnitsPerThread + threadIdx.x;
  Unit v[kCommitUnitsPerThread];
#pragma unroll
  for (int i = 0; i < kCommitUnitsPerThread; ++i) {
    const int64_t u = first + static_cast<int64_t>(i) * kCommitThreads;
    if (u < units) v[i] = src[u];
  }
#pragma unroll
  for (int i = 0; i < kCommitUnitsPerThread; ++i) {
    const int64_t u = first + static_cast<int64_t>(i) * kCommitThreads;
    if (u < units) dst[u] = v[i];
  }
}

// Elem: the dtype's bits (uint32_t for fp32, uint16_t for the 16-bit dtypes).
template <class Elem>
__global__ void __launch_bounds__(kCommitThreads)
    commit_strided_kernel(const detail::CommitProblem p) {
  enter_grid(false);
  const int64_t b = blockIdx.y, layer = blockIdx.z;
  int64_t src_at, dst_at;
  if (!commit_entry(p, b, layer, src_at, dst_at)) return;
  const int64_t e = static_cast<int64_t>(blockIdx.x) * kCommitThreads + threadIdx.x;
  if (e >= p.head_elems) return;
  const int64_t r = e / p.inner_cols, c = e - r * p.inner_cols;
  const Elem* src = static_cast<const Elem*>(p.inter);
  Elem* dst = static_cast<Elem*>(p.state);
  dst[dst_at + r * p.state_inner_row_stride + c * p.state_inner_col_stride] =
      src[src_at + r * p.inter_inner_row_stride + c * p.inter_inner_col_stride];
}

}  // namespace
}  // namespace deltastate::cuda_backend
