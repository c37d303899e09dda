// CUDA kernel of the fold-every-commit commit (ops.h ReplayFoldArgs; SGLang's
// commit_gdn_replayssm_fold_all_layers / commit_kda_replayssm_spec[_all_layers]). Part of
// replayssm_verify.cu's translation unit (included there only).
//
// One CTA per (row b, layer * HV + value head, block of kFoldRows state rows); each warp holds
// kFoldRowsPerWarp rows in registers, a lane EPL = K/32 elements of each (K <= 256). Per accepted
// record t: the CTA stages the raw key, the decay and its rows' raw v in shared memory; every warp
// L2-normalizes the key itself (one shuffle reduction), then per row the recurrent step s *= e^g;
// u = beta (v - s.k); s += u k (one shuffle reduction per row). The state after step
// steps_to_track[b] also goes to the track slot; the final state back to the checkpoint. The math
// is delta_math.h's, in its own reduction order (not bitwise the CPU twin's).
#pragma once

#include <cstdint>

#include "core/delta_math.h"
#include "core/numeric.h"
#include "core/problem.h"
#include "cuda/grid.cuh"

namespace deltastate::cuda_backend {

constexpr int kFoldWarps = 4, kFoldRowsPerWarp = 4;
constexpr int kFoldRows = kFoldWarps * kFoldRowsPerWarp;
constexpr int kFoldMaxK = 256;

namespace {

__device__ __forceinline__ float fold_warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

__global__ void __launch_bounds__(kFoldWarps * 32)
    replay_fold_kernel(const detail::ReplayFoldProblem p) {
  constexpr int EPL = kFoldMaxK / 32;
  __shared__ float s_k[kFoldMaxK], s_alpha[kFoldMaxK], s_v[kFoldRows];
  __shared__ float s_beta;
  enter_grid(false);
  const int64_t b = blockIdx.x;
  const int hvl = static_cast<int>(blockIdx.y);
  const int64_t layer = hvl / p.HV;
  const int hv = hvl % p.HV, h = hv / (p.HV / p.H);
  const int row0 = static_cast<int>(blockIdx.z) * kFoldRows;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int K = p.K, V = p.V, L = p.L, gw = p.kda ? K : 1;
  const int64_t slot = p.slots.at(b, 0);
  const int64_t a = p.accepted.at(b, 0);
  if (slot <= p.null_block_id || a <= 0) return;
  const int64_t track = p.track.ptr ? p.track.at(b, 0) : p.null_block_id;
  const int64_t step = p.track.ptr ? p.steps.at(b, 0) : -1;
  const bool tracking = track > p.null_block_id && step >= 0 && step < a;
  if (slot >= p.num_slots || a > L || (tracking && track >= p.num_slots)) {
    if (hvl == 0 && blockIdx.z == 0 && threadIdx.x == 0) {
      const bool bad_slot = slot >= p.num_slots;
      const bool bad_len = !bad_slot && a > L;
      record_bad_row(p.errors, detail::kErrOpReplayFold, bad_len ? detail::kErrStep : detail::kErrSlot,
                     b, bad_slot ? slot : bad_len ? a : track, bad_len ? L + 1 : p.num_slots);
    }
    return;
  }
  const int64_t head_off = static_cast<int64_t>(hv) * V * K;
  const int64_t state_at = layer * p.state_layer_stride + slot * p.state_slot_stride + head_off;
  const int64_t v_base =
      layer * p.rawv_layer_stride + slot * p.rawv_slot_stride + static_cast<int64_t>(hv) * L * V;
  const int64_t k_base =
      layer * p.rawk_layer_stride + slot * p.rawk_slot_stride + static_cast<int64_t>(h) * L * K;
  const int64_t g_base =
      layer * p.g_layer_stride + slot * p.g_slot_stride + static_cast<int64_t>(hv) * L * gw;
  const int64_t b_base =
      layer * p.beta_layer_stride + slot * p.beta_slot_stride + static_cast<int64_t>(hv) * L;

  // This warp's rows in registers (lane holds elements lane + 32 i).
  float S[kFoldRowsPerWarp][EPL];
#pragma unroll
  for (int r = 0; r < kFoldRowsPerWarp; ++r) {
    const int row = row0 + warp * kFoldRowsPerWarp + r;
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      const int c = lane + 32 * i;
      S[r][i] = row < V && c < K
                    ? detail::load_float(p.state, p.state_dtype, state_at + int64_t{row} * K + c)
                    : 0.0f;
    }
  }
  for (int64_t t = 0; t < a; ++t) {
    __syncthreads();  // the previous record's shared values are read
    for (int c = threadIdx.x; c < K; c += blockDim.x) {
      s_k[c] = detail::load_float(p.rawk, p.rawk_dtype, k_base + t * K + c);
      s_alpha[c] = expf(p.g[g_base + t * gw + (p.kda ? c : 0)]);
    }
    for (int r = threadIdx.x; r < kFoldRows; r += blockDim.x)
      s_v[r] = row0 + r < V ? detail::load_float(p.rawv, p.rawv_dtype, v_base + t * V + row0 + r)
                            : 0.0f;
    if (threadIdx.x == 0) s_beta = p.beta[b_base + t];
    __syncthreads();
    float k[EPL], al[EPL];
    float ss = 0.0f;
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      const int c = lane + 32 * i;
      k[i] = c < K ? s_k[c] : 0.0f;
      al[i] = c < K ? s_alpha[c] : 1.0f;
      ss += k[i] * k[i];
    }
    if (p.l2norm) {
      const float den = detail::l2norm_denominator(fold_warp_sum(ss));
#pragma unroll
      for (int i = 0; i < EPL; ++i) k[i] = k[i] / den;
    }
    const float beta = s_beta;
#pragma unroll
    for (int r = 0; r < kFoldRowsPerWarp; ++r) {
      float dot = 0.0f;
#pragma unroll
      for (int i = 0; i < EPL; ++i) {
        S[r][i] *= al[i];
        dot += S[r][i] * k[i];
      }
      dot = fold_warp_sum(dot);
      const float u = detail::delta_u(s_v[warp * kFoldRowsPerWarp + r], dot, beta);
#pragma unroll
      for (int i = 0; i < EPL; ++i) S[r][i] = fmaf(u, k[i], S[r][i]);
    }
    if (tracking && t == step) {
      const int64_t track_at = layer * p.state_layer_stride + track * p.state_slot_stride + head_off;
#pragma unroll
      for (int r = 0; r < kFoldRowsPerWarp; ++r) {
        const int row = row0 + warp * kFoldRowsPerWarp + r;
#pragma unroll
        for (int i = 0; i < EPL; ++i) {
          const int c = lane + 32 * i;
          if (row < V && c < K)
            detail::store_float(p.state, p.state_dtype, track_at + int64_t{row} * K + c, S[r][i]);
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kFoldRowsPerWarp; ++r) {
    const int row = row0 + warp * kFoldRowsPerWarp + r;
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      const int c = lane + 32 * i;
      if (row < V && c < K)
        detail::store_float(p.state, p.state_dtype, state_at + int64_t{row} * K + c, S[r][i]);
    }
  }
}

}  // namespace
}  // namespace deltastate::cuda_backend
