// The commit after a verify: a copy of each accepted request's intermediate state into its pool
// slot, every layer in one launch. CTA (chunk, request, layer) copies kCommitThreads *
// kCommitUnitsPerThread units (16-byte words where every address allows, else 2-byte ones) of
// one state. A request with nothing accepted, or padded, copies nothing; a bad index is skipped
// and recorded (the first CTA of the request's first layer records it).
// Part of verify.cu's translation unit (included there only), in its anonymous namespace.
#pragma once

#include <cstdint>

#include "core/problem.h"
#include "cuda/grid.cuh"

namespace deltastate::cuda_backend {

constexpr int kCommitThreads = 256, kCommitUnitsPerThread = 4;

namespace {

template <class Unit>
__global__ void __launch_bounds__(kCommitThreads) commit_kernel(const detail::CommitProblem p) {
  enter_grid(false);
  const int64_t b = blockIdx.y, layer = blockIdx.z;
  const int64_t step = p.accepted.at(b, 0) - (p.accepted_is_step ? 0 : 1);
  const int64_t slot = p.slots.at(b, 0);
  const int64_t row = p.rows.ptr ? p.rows.at(b, 0) : b;
  if (step < 0 || slot < 0 || row < 0) return;  // nothing accepted, or padding
  int kind = 0;
  int64_t value = 0, limit = 0;
  if (slot >= p.num_slots) kind = detail::kErrSlot, value = slot, limit = p.num_slots;
  else if (row >= p.inter_rows) kind = detail::kErrRow, value = row, limit = p.inter_rows;
  else if (step >= p.inter_steps) kind = detail::kErrStep, value = step, limit = p.inter_steps;
  if (kind) {
    if (blockIdx.x == 0 && layer == 0 && threadIdx.x == 0)
      record_bad_row(p.errors, detail::kErrOpCommit, kind, b, value, limit);
    return;
  }
  const int64_t es = dtype_size(p.dtype);
  const Unit* src = reinterpret_cast<const Unit*>(
      static_cast<const char*>(p.inter) +
      (layer * p.inter_layer_stride + row * p.inter_row_stride + step * p.inter_step_stride) * es);
  Unit* dst =
      reinterpret_cast<Unit*>(static_cast<char*>(p.state) +
                              (layer * p.state_layer_stride + slot * p.state_slot_stride) * es);
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

}  // namespace
}  // namespace deltastate::cuda_backend
