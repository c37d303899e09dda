// State rows in the register kernels' lanes: the lane layout, vector loads and stores of a lane's
// slice of a row, a tile's rows staged through shared memory, and the delta-rule step on a
// thread's rows with its output.
//
// Lane layout. A state row S[v, 0:K] is held by a group of G lanes, each holding EPL consecutive
// elements (EPL = 16 bytes of state, so every lane does one 16-byte load per row). A warp holds
// RG = 32/G rows at once; a thread keeps ROWS such rows in registers (register blocking: 32 state
// floats per thread), so a warp owns RG*ROWS rows. KT is the K tile: K == KT on the vector path, K
// <= KT (masked, element loads) on the generic path.
#pragma once

#include <cstdint>
#include <type_traits>

#include "core/delta_math.h"
#include "core/problem.h"
#include "cuda/async_copy.cuh"
#include "cuda/loads.cuh"
#include "cuda/reduce.cuh"

namespace deltastate::cuda_backend {

// The bytes of a row a lane loads at once: one 16-byte word.
inline constexpr int kLaneWordBytes = 16;

template <class StateT, int KT>
struct RowLayout {
  static constexpr int kElemBytes = static_cast<int>(sizeof(StateT));
  static constexpr int kWord = kLaneWordBytes;
  static constexpr int G = (KT * kElemBytes / kWord) < 32 ? (KT * kElemBytes / kWord) : 32;
  static constexpr int EPL = KT / G;     // elements per lane
  static constexpr int RG = 32 / G;      // rows per warp per pass
  static constexpr int ROWS = 32 / EPL;  // rows per thread: 32 state floats in registers
  static_assert(G >= 1 && (G & (G - 1)) == 0, "lanes per row must be a power of two");
  static_assert(EPL * G == KT, "K tile must split evenly over the lanes");
};

// Load / store EPL consecutive state elements at `p` (the lane's first element). VEC: one or more
// 16-byte accesses (p 16-byte aligned, all elements valid); else element accesses, masked by
// `valid` (elements at or past K).
template <class StateT, int EPL, bool VEC>
__device__ __forceinline__ void load_state(const StateT* p, int valid, float (&x)[EPL]) {
  if constexpr (VEC) {
    constexpr int kPer16 = 16 / static_cast<int>(sizeof(StateT));
#pragma unroll
    for (int c = 0; c < EPL / kPer16; ++c) {
      const uint4 u = __ldcs(reinterpret_cast<const uint4*>(p) + c);
      const StateT* e = reinterpret_cast<const StateT*>(&u);
#pragma unroll
      for (int i = 0; i < kPer16; ++i) x[c * kPer16 + i] = to_float(e[i]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < EPL; ++i) x[i] = i < valid ? to_float(p[i]) : 0.0f;
  }
}

template <class StateT, int EPL, bool VEC>
__device__ __forceinline__ void store_state(StateT* p, int valid, const float (&x)[EPL]) {
  if constexpr (VEC) {
    constexpr int kPer16 = 16 / static_cast<int>(sizeof(StateT));
#pragma unroll
    for (int c = 0; c < EPL / kPer16; ++c) {
      uint4 u;
      StateT* e = reinterpret_cast<StateT*>(&u);
#pragma unroll
      for (int i = 0; i < kPer16; ++i) e[i] = from_float<StateT>(x[c * kPer16 + i]);
      __stcs(reinterpret_cast<uint4*>(p) + c, u);
    }
  } else {
#pragma unroll
    for (int i = 0; i < EPL; ++i)
      if (i < valid) p[i] = from_float<StateT>(x[i]);
  }
}

// Zeros the output of a padded tile's rows row0, row0 + step, ... (R of them, those below V);
// o_off is the element offset of the token's output vector for the head.
template <int R>
__device__ __forceinline__ void zero_output_rows(const detail::HeadOutput& out, int V,
                                                 int64_t o_off, int row0, int step,
                                                 float value = 0.0f) {
#pragma unroll
  for (int r = 0; r < R; ++r)
    if (row0 + r * step < V)
      detail::store_float(out.ptr, out.dtype, o_off + row0 + r * step, value);
}

// Completes one token on R rows from the partial dots [sk_0.., sq_0..] (each partial over the
// lane's K slice): one transposed reduction; every lane gets u_r = beta*(v_r - sk_r) for all its
// rows; the lane holding sq_r (first of its copies) gets o_r = sq_r + u_r*kq and returns r, the
// others return -1.
template <int G, int R>
__device__ __forceinline__ int finish_rows(float (&dots)[2 * R], const float (&v)[R], float beta,
                                           float kq, int lane, float (&u)[R], float& o) {
  static_assert(2 * R <= G, "a row group must hold all 2R partial dots");
  const int idx = reduced_index<G, 2 * R>(lane);
  const float red = transpose_reduce<G, 2 * R>(dots, lane);
#pragma unroll
  for (int r = 0; r < R; ++r)
    u[r] = detail::delta_u(v[r], __shfl_sync(0xffffffffu, red, holder_lane<G, 2 * R>(r), G), beta);
  const bool first_copy = (lane & (G / (2 * R) - 1)) == 0;
  int mine = -1;
  float u_mine = 0.0f;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    if (idx == R + r) {
      mine = r;
      u_mine = u[r];
    }
  }
  o = detail::delta_output(red, u_mine, kq);
  return first_copy ? mine : -1;
}

// One token's delta-rule step on R state rows held in registers (the register decode kernels):
// decay and the 2R dots, one transposed reduction; the lane holding sk_r computes u_r = beta*(v -
// sk_r) from the v it was given (that row's), broadcasts it for the rank-1 update of row r, and
// `store_row(r)` runs once row r is final. Returns this lane's reduced value; its u in `u_here`.
template <int G, int R, int EPL, class StoreRow>
__device__ __forceinline__ float delta_step_rows(float (&S)[R][EPL], const float (&alpha)[EPL],
                                                 const float (&k)[EPL], const float (&q)[EPL],
                                                 float v, float beta, int lane, float& u_here,
                                                 StoreRow store_row) {
  float dots[2 * R];
#pragma unroll
  for (int r = 0; r < R; ++r)
    detail::decay_and_dots(S[r], alpha, k, q, std::integral_constant<int, EPL>{}, dots[r],
                           dots[R + r]);
  const float red = transpose_reduce<G, 2 * R>(dots, lane);
  u_here = detail::delta_u(v, red, beta);
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const float u = __shfl_sync(0xffffffffu, u_here, holder_lane<G, 2 * R>(r), G);
    detail::rank1_update(S[r], k, std::integral_constant<int, EPL>{}, u);
    store_row(r);
  }
  return red;
}

// The other finish (register decode kernels): after transpose_reduce<G, 2R>, the lane holding
// sk_r has u_r = beta*(v_r - sk_r) in `u_here`; the lane holding sq_r (first of its copies)
// takes u_r from it and hands o_r = sq_r + u_r*kq to sink(row0 + r*rg) (rows below V).
template <int G, int R, class Sink>
__device__ __forceinline__ void finish_output_rows(int V, int row0, int rg, int lane, float red,
                                                   float u_here, float kq, Sink sink) {
  const int sq_r = reduced_index<G, 2 * R>(lane) - R;  // this lane's row, if it holds sq
  const float u_o = __shfl_sync(0xffffffffu, u_here, holder_lane<G, 2 * R>(sq_r < 0 ? 0 : sq_r), G);
  const bool first_copy = (lane & (G / (2 * R) - 1)) == 0;
  if (sq_r >= 0 && first_copy && row0 + sq_r * rg < V)
    sink(row0 + sq_r * rg, detail::delta_output(red, u_o, kq));
}
// finish_output_rows into out[o_off + row].
template <int G, int R>
__device__ __forceinline__ void store_output_rows(const detail::HeadOutput& out, int64_t o_off,
                                                  int V, int row0, int rg, int lane, float red,
                                                  float u_here, float kq) {
  finish_output_rows<G, R>(V, row0, rg, lane, red, u_here, kq, [&](int row, float o) {
    detail::store_float(out.ptr, out.dtype, o_off + row, o);
  });
}

// A lane's R rows of a state tile (rows row, row + rg, ...; `row_src(r, row + r*rg)` points at
// the lane's EPL elements of its row r), staged through shared memory by the lane alone:
// stage_rows_async copies them with 16-byte cp.async (one group) into the lane's words dst[(r*W +
// c)*stride] (W 16-byte words per row; stride = the lanes sharing the buffer, so consecutive lanes
// hit consecutive words), skipping rows at or past V; load_staged_rows waits for every group of
// this thread and converts them to floats (rows past V read as zeros). kCheckRows = false: the
// caller guarantees every row is below V (no checks). No barrier: each lane reads back only what it
// copied. The register kernels use this to have a second tile in flight while they compute the
// first.
template <class StateT, int EPL, int R, bool kCheckRows = true, class RowSrc>
__device__ __forceinline__ void stage_rows_async(uint4* dst, unsigned stride, int row, int rg,
                                                 int V, RowSrc row_src) {
  constexpr int W = EPL * static_cast<int>(sizeof(StateT)) / 16;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int row_r = row + r * rg;
    if (!kCheckRows || row_r < V)
#pragma unroll
      for (int c = 0; c < W; ++c)
        cp_async16(dst + (r * W + c) * stride,
                   reinterpret_cast<const uint4*>(row_src(r, row_r)) + c);
  }
  cp_async_commit();
}
// kPending: copy groups of this thread issued after this tile's that may still be in flight.
template <class StateT, int EPL, int R, bool kCheckRows = true, int kPending = 0>
__device__ __forceinline__ void load_staged_rows(const uint4* src, unsigned stride, int row, int rg,
                                                 int V, float (&S)[R][EPL]) {
  constexpr int W = EPL * static_cast<int>(sizeof(StateT)) / 16;
  constexpr int kPer16 = 16 / static_cast<int>(sizeof(StateT));
  cp_async_wait<kPending>();
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int c = 0; c < W; ++c) {
      const uint4 u = src[(r * W + c) * stride];
      const StateT* e = reinterpret_cast<const StateT*>(&u);
#pragma unroll
      for (int i = 0; i < kPer16; ++i)
        S[r][c * kPer16 + i] = !kCheckRows || row + r * rg < V ? to_float(e[i]) : 0.0f;
    }
  }
}

// Whether every state row of the pool starts on a 16-byte boundary (the vector-load kernels).
template <class StateT>
bool state_rows_aligned(const detail::StatePoolRef& s) {
  return reinterpret_cast<uintptr_t>(s.ptr) % 16 == 0 &&
         (s.slot_stride * static_cast<int64_t>(sizeof(StateT))) % 16 == 0;
}

}  // namespace deltastate::cuda_backend
