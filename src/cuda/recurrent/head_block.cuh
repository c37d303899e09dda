// The recurrent kernels' tiles: where tile t of a grid lies (HeadBlock), and a sequence's slot.
// Part of recurrent.cu's translation unit (and of verify.cu's, through recurrent/direct.cuh), in
// its anonymous namespace.
#pragma once

#include <cstdint>

#include "core/numeric.h"
#include "core/problem.h"
#include "cuda/grid.cuh"

namespace deltastate::cuda_backend {

using detail::RecurrentProblem;

namespace {

// Tile t of a grid that cuts every (sequence n, value head hv) into `blocks` row blocks: its
// sequence, value head, key head and row block. (32-bit division: tile counts are below 2^31,
// checked at launch; 64-bit division is a long software sequence on the GPU.)
struct HeadBlock {
  int head, n, hv, h, block;  // head = n*HV + hv
};
__device__ __forceinline__ HeadBlock head_block(const RecurrentProblem& p, int t, int blocks) {
  HeadBlock c;
  c.head = t / blocks;
  c.block = t - c.head * blocks;
  c.n = c.head / p.HV;
  c.hv = c.head - c.n * p.HV;
  c.h = c.hv / (p.HV / p.H);
  return c;
}

__device__ __forceinline__ int64_t slot_of(const RecurrentProblem& p, int64_t n) {
  return p.indices ? detail::index_at(p.indices, p.index_dtype, p.index_stride, n) : n;
}

// A row whose slot index is past the pool (only given indices can be): skipped like a padded
// row, its output NaN, recorded by `record` (one thread per row) in the device's error record.
__device__ __forceinline__ bool bad_slot(const RecurrentProblem& p, int64_t slot) {
  return p.indices && slot >= p.state.num_slots;
}
__device__ __forceinline__ void record_bad_slot(const RecurrentProblem& p, int64_t n, int64_t slot,
                                                bool record) {
  if (record)
    record_bad_row(p.errors, detail::kErrOpRecurrent, detail::kErrSlot, n, slot, p.state.num_slots);
}

}  // namespace
}  // namespace deltastate::cuda_backend
