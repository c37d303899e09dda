// What every kernel of the backend does as a grid: enter through programmatic dependent launch
// (enter_grid), and record a bad row in the device's error record (record_bad_row).
#pragma once

#include <cstdint>

#include "core/problem.h"

namespace deltastate::cuda_backend {

// Programmatic dependent launch (PDL, compute capability 9.0). Every kernel of the backend starts
// with enter_grid(): it waits until the grids this one depends on have completed and their memory
// is visible (launched without the PDL attribute, the wait returns at once: the stream already
// ordered the grids, so the kernels need no second variant; nothing before it may touch global
// memory). With `trigger_early` it then lets the next PDL-launched grid on the stream be scheduled
// at once (its CTAs wait in their own enter_grid); otherwise that happens as this grid's CTAs exit.
// Launchers trigger early only for grids that leave room on the GPU for the next one
// (pdl_trigger_early, tuning.h's pdl_trigger_fits): an early trigger slows a grid of a whole
// wave and speeds up a small one.
__device__ __forceinline__ void enter_grid(bool trigger_early) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  if (trigger_early) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// A kernel's report of a bad row (an out-of-range slot index, a ReplaySSM cursor outside its
// ring): the row is skipped (no state, ring or cursor access; its output is NaN) and the first
// bad row of any launch on the device since the last check_errors is recorded in the device's
// error record (src/cuda/errors.cu; ops.h check_errors). One thread per bad row calls it; the
// hot path pays one compare per row, this is the cold path.
__device__ __forceinline__ float bad_row_output() { return __int_as_float(0x7fc00000); }  // NaN
__device__ __forceinline__ void record_bad_row(detail::DeviceErrorRecord* e, int op, int kind,
                                               int64_t row, int64_t index, int64_t limit) {
  if (e == nullptr) return;
  if (atomicCAS(&e->flag, 0u, 1u) == 0u) {
    e->op = op;
    e->kind = kind;
    e->row = static_cast<long long>(row);
    e->index = static_cast<long long>(index);
    e->limit = static_cast<long long>(limit);
    __threadfence();
  }
}

}  // namespace deltastate::cuda_backend
