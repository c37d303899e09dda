// A state pool in its storage format (docs/STATE_FORMATS.md) in the register kernels' lanes:
// quantized states (float8_e4m3fn, int8 with a fp32 scale per row) and stochastically rounded
// 16-bit states, a row's EPL elements a lane, each through state_format.cuh's element rules (the
// CPU backend's, src/cpu/state_io.h). Used by the recurrent op's formatted-state kernel
// (recurrent/direct.cuh), verify's and the commit's (verify/fmt.cuh). Included in a translation
// unit's anonymous namespace.
#pragma once

#include <cstdint>

#include "core/numeric.h"
#include "core/problem.h"
#include "core/state_format.h"
#include "cuda/grid.cuh"
#include "cuda/loads.cuh"
#include "cuda/reduce.cuh"
#include "cuda/rows.cuh"
#include "cuda/state_format.cuh"

namespace deltastate::cuda_backend {

// A quantized pool's state type in the recurrent op's dispatch (decode_shaped's row alignment,
// the quantized decode kernel's code dtype): 1-byte codes of dtype T (f8e4m3 or i8).
template <DType T>
struct QuantCode {
  uint8_t bits;
  static constexpr DType dtype = T;
};

namespace {

__device__ __forceinline__ bool quantized_state(DType t) { return fmt::quantized(t); }

// A row's EPL elements from the lane's K offset kofs (valid: those below K): loaded dequantized,
// stored with the row's fresh scale, the amax a shuffle reduction over the row's G lanes (every
// lane takes part, rows past V included). Row `row` of value head hv is row hv * V + row of the
// slot's [HV * V] rows (a commit passes hv = 0 and the row's index there).

template <int EPL>
__device__ __forceinline__ void load_state_fmt(const detail::StatePoolRef& st, int64_t slot, int hv,
                                               int V, int K, int row, int kofs, int valid,
                                               float (&x)[EPL]) {
  const int64_t row_idx = static_cast<int64_t>(hv) * V + row;
  const int64_t off = slot * st.slot_stride + row_idx * K + kofs;
  if (quantized_state(st.dtype)) {
    const float scale = st.scales[slot * st.scale_slot_stride + row_idx];
    const uint8_t* c = static_cast<const uint8_t*>(st.ptr) + off;
#pragma unroll
    for (int i = 0; i < EPL; ++i) {  // lanes past the row's end read nothing (the last slot's
      // last row ends at the pool tensor's end)
      const uint8_t code = i < valid ? c[i] : uint8_t{0};
      x[i] = i < valid ? fmt::code_value(code, st.dtype) * scale : 0.0f;
    }
  } else {
#pragma unroll
    for (int i = 0; i < EPL; ++i)
      x[i] = i < valid ? detail::load_float(st.ptr, st.dtype, off + i) : 0.0f;
  }
}

// `in_rows`: the row is below V (uniform over the row's lanes); the reduction runs regardless.
template <int G, int EPL>
__device__ __forceinline__ void store_state_fmt(const detail::StatePoolRef& st, uint64_t key,
                                                int64_t slot, int hv, int V, int K, int row,
                                                bool in_rows, int lane, int kofs, int valid,
                                                const float (&x)[EPL]) {
  const int64_t row_idx = static_cast<int64_t>(hv) * V + row;
  const int64_t off = slot * st.slot_stride + row_idx * K + kofs;
  const uint64_t index0 = static_cast<uint64_t>(row_idx * K + kofs);
  if (quantized_state(st.dtype)) {
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < EPL; ++i)
      if (i < valid) amax = detail::amax_step(amax, x[i]);
#pragma unroll
    for (int d = G / 2; d > 0; d >>= 1)
      amax = detail::amax_step(amax, __shfl_xor_sync(0xffffffffu, amax, d));
    if (!in_rows) return;
    const float s = fmt::fresh_scale(st.dtype, amax);
    uint8_t* c = static_cast<uint8_t*>(st.ptr) + off;
#pragma unroll
    for (int i = 0; i < EPL; ++i)
      if (i < valid) c[i] = fmt::encode_code(st.dtype, x[i] / s, st.stochastic, key, index0 + i);
    if (lane % G == 0) st.scales[slot * st.scale_slot_stride + row_idx] = s;
    return;
  }
  if (!in_rows) return;
  uint16_t* h = static_cast<uint16_t*>(st.ptr) + off;  // bf16 / fp16, stochastic
#pragma unroll
  for (int i = 0; i < EPL; ++i)
    if (i < valid) h[i] = fmt::round16_sr(st.dtype, x[i], key, index0 + i);
}

// The stochastic-rounding step counters of a call (n: one per layer), after its grid, in stream
// order (so a replayed CUDA graph advances them).
__global__ void advance_rounding_step(int64_t* step, int n) {
  enter_grid(false);
  for (int i = threadIdx.x; i < n; i += blockDim.x) step[i] += 1;
}

}  // namespace
}  // namespace deltastate::cuda_backend
