// The pieces of a ReplaySSM decode step that do not depend on a kernel's work layout, shared by
// replayssm_decode's kernel (replayssm/decode.cuh) and the fused decode layer step's ReplaySSM
// kernel (fused_decode_step/replay.cuh): the generic staging of ring records into shared memory,
// the cursor of a row and its in-kernel advance, a record's two coefficients and the dots of the
// checkpoint rows with the token. Part of the translation unit of each kernel that includes it,
// in its anonymous namespace. The math: docs/REPLAYSSM.md.
#pragma once

#include <cstdint>

#include "core/numeric.h"
#include "core/problem.h"
#include "cuda/grid.cuh"
#include "cuda/loads.cuh"
#include "cuda/reduce.cuh"
#include "cuda/replayssm/factor.cuh"

namespace deltastate::cuda_backend {

namespace {

// `rows` rows of `cols` elements (source pitch src_pitch elements) into dst (pitch
// dst_pitch_floats), converted to float by the CTA's threads with plain loads (any dtypes, any
// alignment).
__device__ __forceinline__ void stage_rows_float(float* dst, int dst_pitch_floats, const void* src,
                                                 DType dtype, int64_t src_off, int64_t src_pitch,
                                                 int rows, int cols) {
  for (int i = threadIdx.x; i < rows * cols; i += blockDim.x) {
    const int r = i / cols, c = i - r * cols;
    dst[r * dst_pitch_floats + c] = detail::load_float(src, dtype, src_off + r * src_pitch + c);
  }
}

// A row's cursor m as a CTA reads it: with the device advance, the high 16 bits count the CTAs
// of this launch that have already read it (advance_row_cursor), the low 16 bits are the cursor.
__device__ __forceinline__ int replay_cursor(int cursor, bool advance) {
  return advance ? (cursor & 0xffff) : cursor;
}

// The device advance of row n's cursor, by one thread of each of the row's `ctas_per_row` CTAs
// once every thread of its CTA has read the cursor: each CTA counts itself in the high bits, and
// the last one stores the new cursor (0 after a flush, else m + 1). No scratch memory, no extra
// launch.
__device__ __forceinline__ void advance_row_cursor(int32_t* write_pos, int n, int ctas_per_row,
                                                   int m, bool flush) {
  const int old = atomicAdd(write_pos + n, 1 << 16);
  if ((old >> 16) == ctas_per_row - 1) write_pos[n] = flush ? 0 : m + 1;
}

// A row the step skips (its outputs NaN, nothing else touched): a slot past the pool or a cursor
// m outside the ring [0, L). record_bad_replay_row records which, by one thread of the row.
__device__ __forceinline__ bool bad_replay_row(int64_t slot, int64_t num_slots, int cursor, int m,
                                               int L) {
  return slot >= num_slots || cursor < 0 || m >= L;
}
__device__ __forceinline__ void record_bad_replay_row(detail::DeviceErrorRecord* errors, int op,
                                                      int n, int64_t slot, int64_t num_slots,
                                                      int cursor, int m, int L) {
  const bool bad_slot = slot >= num_slots;
  record_bad_row(errors, op, bad_slot ? detail::kErrSlot : detail::kErrCursor, n,
                 bad_slot ? slot : static_cast<int64_t>(cursor < 0 ? cursor : m),
                 bad_slot ? num_slots : static_cast<int64_t>(L));
}

// An appending step's coefficients of record j, on one warp (lane columns col0 .. col0 + CPL):
// ck_j = w_j kw_j.(alpha*k), cq_j = w_j kw_j.(alpha*q), with alpha*k and alpha*q formed as the CPU
// forms them; one shuffle reduction for both, stored by the lanes that hold them.
template <int CPL>
__device__ __forceinline__ void record_coefficients(const float (&kw)[CPL], int col0, int K,
                                                    const float* s_alpha, const float* s_kn,
                                                    const float* s_qn, float wj, int lane,
                                                    float* ck, float* cq) {
  float part[2] = {0.0f, 0.0f};
#pragma unroll
  for (int c = 0; c < CPL; ++c) {
    if (col0 + c < K) {
      const float alpha = s_alpha[col0 + c];
      part[0] += kw[c] * (alpha * s_kn[col0 + c]);
      part[1] += kw[c] * (alpha * s_qn[col0 + c]);
    }
  }
  store_factor_pair(part, lane, wj, ck, cq);
}

// One entry of an appending step's decayed token, e*(alpha*x) (x = k or q), formed as the CPU
// forms it: every kernel's dots with the checkpoint take this product.
__device__ __forceinline__ float decayed_token_entry(float e, float alpha, float x) {
  return e * (alpha * x);
}

// The decayed token vectors of an appending step over columns col0 .. col0 + CPL, once per CTA
// (replayssm/decode.cuh's warp 0, into shared memory): ek = e*(alpha*k), eq = e*(alpha*q), e the
// columns' decay of the ring (1 without records), alpha*k and alpha*q formed as the CPU forms them.
template <int CPL>
__device__ __forceinline__ void store_decayed_token(const float (&e)[CPL], int col0, int K,
                                                    const float* s_alpha, const float* s_kn,
                                                    const float* s_qn, float* s_ek, float* s_eq) {
#pragma unroll
  for (int c = 0; c < CPL; ++c) {
    if (col0 + c < K) {
      const float alpha = s_alpha[col0 + c];
      s_ek[col0 + c] = decayed_token_entry(e[c], alpha, s_kn[col0 + c]);
      s_eq[col0 + c] = decayed_token_entry(e[c], alpha, s_qn[col0 + c]);
    }
  }
}

// An appending step's partial dots of a lane's R checkpoint rows (its K slice from kofs, `valid`
// elements) with e*alpha*k and e*alpha*q formed from the shared token and decay (the fused
// step's ReplaySSM kernel); e = 1 without ring records (have_e false).
template <int R, int EPL>
__device__ __forceinline__ void checkpoint_dots(const float (&S)[R][EPL], bool have_e,
                                                const float* s_e, const float* s_alpha,
                                                const float* s_kn, const float* s_qn, int kofs,
                                                int valid, float (&dots)[2 * R]) {
  float ek[EPL], eq[EPL];
#pragma unroll
  for (int i = 0; i < EPL; ++i) {
    const float e = have_e && i < valid ? s_e[kofs + i] : 1.0f;
    ek[i] = i < valid ? decayed_token_entry(e, s_alpha[kofs + i], s_kn[kofs + i]) : 0.0f;
    eq[i] = i < valid ? decayed_token_entry(e, s_alpha[kofs + i], s_qn[kofs + i]) : 0.0f;
  }
  factor_row_dots(S, ek, eq, dots);
}
// The same dots with ek and eq as store_decayed_token left them (replayssm/decode.cuh).
template <int R, int EPL>
__device__ __forceinline__ void prepared_checkpoint_dots(const float (&S)[R][EPL],
                                                         const float* s_ek, const float* s_eq,
                                                         int kofs, int valid,
                                                         float (&dots)[2 * R]) {
  float ek[EPL], eq[EPL];
#pragma unroll
  for (int i = 0; i < EPL; ++i) {
    ek[i] = i < valid ? s_ek[kofs + i] : 0.0f;
    eq[i] = i < valid ? s_eq[kofs + i] : 0.0f;
  }
  factor_row_dots(S, ek, eq, dots);
}

}  // namespace
}  // namespace deltastate::cuda_backend
