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
      record_bad_row(p.errors, detail::kErrOpReplayFold,
                     bad_len ? detail::kErrStep : detail::kErrSlot, b,
                     bad_slot  ? slot
                     : bad_len ? a
                               : track,
                     bad_len ? L + 1 : p.num_slots);
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
      s_v[r] =
          row0 + r < V ? detail::load_float(p.rawv, p.rawv_dtype, v_base + t * V + row0 + r) : 0.0f;
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
      const int64_t track_at =
          layer * p.state_layer_stride + track * p.state_slot_stride + head_off;
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

// The compact circular commit (ops.h ReplayCircularCommitArgs), same CTA shape: the prefix sums
// of g staged once per CTA, then per record the key (+ residual) and the CTA's rows of d (+
// residual) in shared memory; each warp accumulates the fold and the track state of its rows in
// registers from the old checkpoint rows (acc = e^{G} old, then acc += e^{G - G_j} u_j k_j per
// record), stores the track state, then the fold. The cursors move in a second launch.
constexpr int kCircMaxL = 1024;

__device__ __forceinline__ bool circ_row_ok(const detail::ReplayCircularProblem& p, int64_t b,
                                            int64_t& slot, int64_t& r) {
  slot = p.slots.at(b, 0);
  if (slot <= p.null_block_id) return false;
  r = p.rows.at(b, 0);
  if (slot >= p.num_slots || r < 0 || r >= p.ring_rows) return false;
  const int n = p.write_pos[r], base = p.cache_base[r];
  return n >= 0 && n <= p.L && base >= 0 && base < p.L;
}

__global__ void __launch_bounds__(kFoldWarps * 32)
    replay_circular_kernel(const detail::ReplayCircularProblem p) {
  constexpr int EPL = kFoldMaxK / 32;
  __shared__ float s_k[kFoldMaxK], s_u[kFoldRows], s_G[kCircMaxL];
  enter_grid(false);
  const int64_t b = blockIdx.x;
  const int hvl = static_cast<int>(blockIdx.y);
  const int64_t layer = hvl / p.HV;
  const int hv = hvl % p.HV, h = hv / (p.HV / p.H);
  const int row0 = static_cast<int>(blockIdx.z) * kFoldRows;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int K = p.K, V = p.V, L = p.L;
  int64_t slot = 0, r = 0;
  if (!circ_row_ok(p, b, slot, r)) {
    if (slot > p.null_block_id && hvl == 0 && blockIdx.z == 0 && threadIdx.x == 0)
      record_bad_row(
          p.errors, detail::kErrOpReplayCircular,
          slot >= p.num_slots || r < 0 || r >= p.ring_rows ? detail::kErrSlot : detail::kErrRing, b,
          slot >= p.num_slots ? slot : r, slot >= p.num_slots ? p.num_slots : p.ring_rows);
    return;
  }
  const int n = p.write_pos[r];
  const bool fold = detail::flag_at(p.is_flush, p.flush_dtype, r);
  const int64_t track = p.track.ptr ? p.track.at(b, 0) : p.null_block_id;
  const int64_t step = p.track.ptr ? p.steps.at(b, 0) : -1;
  const bool tracking = track > p.null_block_id && step >= 0 && track < p.num_slots;
  if (!fold && !tracking) return;
  const int64_t tlen = tracking ? n - p.accepted.at(b, 0) + step + 1 : 0;
  const int mt = static_cast<int>(tlen < 0 ? 0 : tlen > L ? L : tlen);
  const int need = max(fold ? n : 0, mt);
  const int base = p.cache_base[r];
  if (threadIdx.x == 0) {  // the prefix sums of g, in order (fp32)
    float acc = 0.0f;
    for (int j = 0; j < need; ++j) {
      acc += p.g[layer * p.g_layer_stride + r * p.g_row_stride + static_cast<int64_t>(hv) * L +
                 (base + j) % L];
      s_G[j] = acc;
    }
  }
  __syncthreads();
  const float tot_f = fold && n > 0 ? s_G[n - 1] : 0.0f;
  const float tot_t = mt > 0 ? s_G[mt - 1] : 0.0f;
  const int64_t head_off = static_cast<int64_t>(hv) * V * K;
  const int64_t state_at = layer * p.state_layer_stride + slot * p.state_slot_stride + head_off;
  float F[kFoldRowsPerWarp][EPL], Tr[kFoldRowsPerWarp][EPL];
  {
    const float kf = expf(tot_f), kt = expf(tot_t);
#pragma unroll
    for (int rr = 0; rr < kFoldRowsPerWarp; ++rr) {
      const int row = row0 + warp * kFoldRowsPerWarp + rr;
#pragma unroll
      for (int i = 0; i < EPL; ++i) {
        const int c = lane + 32 * i;
        const float o = row < V && c < K ? detail::load_float(p.state, p.state_dtype,
                                                              state_at + int64_t{row} * K + c)
                                         : 0.0f;
        F[rr][i] = o * kf;
        Tr[rr][i] = o * kt;
      }
    }
  }
  for (int j = 0; j < need; ++j) {
    __syncthreads();  // the previous record's shared values are read
    const int64_t pos = (base + j) % L;
    const int64_t k_at =
        layer * p.k_layer_stride + r * p.k_row_stride + (static_cast<int64_t>(h) * L + pos) * K;
    const int64_t kr_at = layer * p.k_res_layer_stride + r * p.k_res_row_stride +
                          (static_cast<int64_t>(h) * L + pos) * K;
    for (int c = threadIdx.x; c < K; c += blockDim.x)
      s_k[c] = detail::load_float(p.k, p.k_dtype, k_at + c) +
               (p.k_res ? detail::load_float(p.k_res, p.k_res_dtype, kr_at + c) : 0.0f);
    const int64_t d_at =
        layer * p.d_layer_stride + r * p.d_row_stride + (static_cast<int64_t>(hv) * L + pos) * V;
    const int64_t dr_at = layer * p.d_res_layer_stride + r * p.d_res_row_stride +
                          (static_cast<int64_t>(hv) * L + pos) * V;
    for (int x = threadIdx.x; x < kFoldRows; x += blockDim.x) {
      const int row = row0 + x;
      s_u[x] = row < V
                   ? detail::load_float(p.d, p.d_dtype, d_at + row) +
                         (p.d_res ? detail::load_float(p.d_res, p.d_res_dtype, dr_at + row) : 0.0f)
                   : 0.0f;
    }
    __syncthreads();
    const float wf = fold && j < n ? expf(tot_f - s_G[j]) : 0.0f;
    const float wt = j < mt ? expf(tot_t - s_G[j]) : 0.0f;
#pragma unroll
    for (int rr = 0; rr < kFoldRowsPerWarp; ++rr) {
      const float u = s_u[warp * kFoldRowsPerWarp + rr];
      const float cf = wf * u, ct = wt * u;
#pragma unroll
      for (int i = 0; i < EPL; ++i) {
        const int c = lane + 32 * i;
        const float k = c < K ? s_k[c] : 0.0f;
        if (fold && j < n) F[rr][i] = fmaf(cf, k, F[rr][i]);
        if (j < mt) Tr[rr][i] = fmaf(ct, k, Tr[rr][i]);
      }
    }
  }
  const int64_t track_at = layer * p.state_layer_stride + track * p.state_slot_stride + head_off;
#pragma unroll
  for (int rr = 0; rr < kFoldRowsPerWarp; ++rr) {
    const int row = row0 + warp * kFoldRowsPerWarp + rr;
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      const int c = lane + 32 * i;
      if (row >= V || c >= K) continue;
      if (tracking)
        detail::store_float(p.state, p.state_dtype, track_at + int64_t{row} * K + c, Tr[rr][i]);
      if (fold)
        detail::store_float(p.state, p.state_dtype, state_at + int64_t{row} * K + c, F[rr][i]);
    }
  }
}

// The folded rows' cursors, one thread per batch row, after replay_circular_kernel.
__global__ void __launch_bounds__(256)
    replay_circular_cursor_kernel(const detail::ReplayCircularProblem p) {
  enter_grid(false);
  const int64_t b = static_cast<int64_t>(blockIdx.x) * 256 + threadIdx.x;
  if (b >= p.B) return;
  int64_t slot = 0, r = 0;
  if (!circ_row_ok(p, b, slot, r)) return;
  if (!detail::flag_at(p.is_flush, p.flush_dtype, r)) return;
  p.cache_base[r] = (p.cache_base[r] + p.write_pos[r]) % p.L;
  p.write_pos[r] = 0;
  detail::set_flag(p.is_flush, p.flush_dtype, r, false);
}

}  // namespace
}  // namespace deltastate::cuda_backend
