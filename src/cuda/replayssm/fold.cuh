// CUDA kernel of the fold-every-commit commit (ops.h ReplayFoldArgs; SGLang's
// commit_gdn_replayssm_fold_all_layers / commit_kda_replayssm_spec[_all_layers]). Part of
// replayssm_verify.cu's translation unit (included there only).
//
// One CTA per (row b, layer * HV + value head, block of kFoldRows state rows); each warp holds
// kFoldRowsPerWarp rows in registers, a lane kFoldEpl = 8 elements of each (K <= 256). Per
// accepted record t: the CTA stages the raw key, the decay and its rows' raw v in shared memory
// (fold_stage_record); every warp L2-normalizes the key itself (one shuffle reduction), then per
// row the recurrent step s *= e^g; u = beta (v - s.k); s += u k (one shuffle reduction per row;
// fold_step_rows). The state after step steps_to_track[b] also goes to the track slot; the final
// state back to the checkpoint. The math is delta_math.h's, in its own reduction order (not
// bitwise the CPU twin's). The exact-raw fold of replayssm_verify runs the same record loop; the
// circular commit shares the row loads and stores (fold_load_rows, fold_store_rows).
#pragma once

#include <cstdint>

#include "core/delta_math.h"
#include "core/numeric.h"
#include "core/problem.h"
#include "cuda/grid.cuh"
#include "cuda/state_format.cuh"

namespace deltastate::cuda_backend {

constexpr int kFoldWarps = 4, kFoldRowsPerWarp = 4;
constexpr int kFoldRows = kFoldWarps * kFoldRowsPerWarp;
constexpr int kFoldMaxK = 256;

namespace {

constexpr int kFoldEpl = kFoldMaxK / 32;  // elements of a row per lane (lane + 32 i)
using FoldRows = float[kFoldRowsPerWarp][kFoldEpl];

__device__ __forceinline__ float fold_warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// A warp's kFoldRowsPerWarp state rows from row wrow0 in registers, element (row, c) from
// load(row, c), zero past V and K.
template <class Load>
__device__ __forceinline__ void fold_load_rows_by(FoldRows& S, int wrow0, int lane, int K, int V,
                                                  Load&& load) {
#pragma unroll
  for (int r = 0; r < kFoldRowsPerWarp; ++r) {
    const int row = wrow0 + r;
#pragma unroll
    for (int i = 0; i < kFoldEpl; ++i) {
      const int c = lane + 32 * i;
      S[r][i] = row < V && c < K ? load(row, c) : 0.0f;
    }
  }
}
// The rows of a float [V, K] block at element `at`; and back.
__device__ __forceinline__ void fold_load_rows(FoldRows& S, const void* state, DType dtype,
                                               int64_t at, int wrow0, int lane, int K, int V) {
  fold_load_rows_by(S, wrow0, lane, K, V, [&](int row, int c) {
    return detail::load_float(state, dtype, at + int64_t{row} * K + c);
  });
}
__device__ __forceinline__ void fold_store_rows(const FoldRows& S, void* state, DType dtype,
                                                int64_t at, int wrow0, int lane, int K, int V) {
#pragma unroll
  for (int r = 0; r < kFoldRowsPerWarp; ++r) {
    const int row = wrow0 + r;
#pragma unroll
    for (int i = 0; i < kFoldEpl; ++i) {
      const int c = lane + 32 * i;
      if (row < V && c < K) detail::store_float(state, dtype, at + int64_t{row} * K + c, S[r][i]);
    }
  }
}

// The same for a checkpoint in its storage format (replayssm_verify's fold launch): the
// rows of value head hv of `slot` loaded dequantized, and stored with each row's fresh scale (its
// amax a shuffle reduction over the warp, which holds the whole row; the scale written by lane 0)
// and the slot's stochastic key, through state_format.cuh's element rules.
__device__ __forceinline__ void fold_load_rows_fmt(FoldRows& S, const detail::StatePoolRef& st,
                                                   int64_t slot, int hv, int wrow0, int lane, int K,
                                                   int V) {
  const fmt::HeadRows hr = fmt::head_rows(st, slot, hv, V, K);
  fold_load_rows_by(S, wrow0, lane, K, V, [&](int row, int c) {
    return fmt::load_elem(st.ptr, st.dtype, hr, row, int64_t{row} * K + c);
  });
}
__device__ __forceinline__ void fold_store_rows_fmt(const FoldRows& S,
                                                    const detail::StatePoolRef& st, int64_t slot,
                                                    int hv, int wrow0, int lane, int K, int V) {
  const fmt::HeadRows hr = fmt::head_rows(st, slot, hv, V, K);
#pragma unroll
  for (int r = 0; r < kFoldRowsPerWarp; ++r) {
    const int row = wrow0 + r;
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < kFoldEpl; ++i)
      if (lane + 32 * i < K) amax = detail::amax_step(amax, S[r][i]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
      amax = detail::amax_step(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if (row >= V) continue;
    const float sc = hr.scales ? fmt::fresh_scale(st.dtype, amax) : 1.0f;
#pragma unroll
    for (int i = 0; i < kFoldEpl; ++i) {
      const int c = lane + 32 * i;
      if (c < K) fmt::store_elem(st.ptr, st.dtype, hr, int64_t{row} * K + c, S[r][i], sc);
    }
    if (hr.scales && lane == 0) hr.scales[row] = sc;
  }
}

// One raw record of the fold, staged by the CTA: the raw key (elements k_at + c of k), alpha =
// e^g (KDA: per element of g; GDN: g[0]), the CTA's rows of raw v (elements v_at + row0 + x),
// beta. (A d/k record of the basic ring: its k, alpha and the rows' d in the same places, no
// beta.)
struct FoldRecord {
  float k[kFoldMaxK], alpha[kFoldMaxK], v[kFoldRows];
  float beta;
};
__device__ __forceinline__ void fold_stage_record(FoldRecord& sm, const void* k, DType k_dtype,
                                                  int64_t k_at, const float* g, bool kda,
                                                  const void* v, DType v_dtype, int64_t v_at,
                                                  const float* beta, int row0, int K, int V) {
  __syncthreads();  // the previous record's shared values are read
  for (int c = threadIdx.x; c < K; c += blockDim.x) {
    sm.k[c] = detail::load_float(k, k_dtype, k_at + c);
    sm.alpha[c] = expf(g[kda ? c : 0]);
  }
  for (int x = threadIdx.x; x < kFoldRows; x += blockDim.x)
    sm.v[x] = row0 + x < V ? detail::load_float(v, v_dtype, v_at + row0 + x) : 0.0f;
  if (threadIdx.x == 0) sm.beta = beta ? *beta : 0.0f;  // (none: a d/k record)
  __syncthreads();
}

// The recurrent step of the staged record on the warp's rows (wrow: the first one's place in the
// CTA's block): every warp L2-normalizes the key itself (one shuffle reduction), then per row
// s *= alpha; u = beta (v - s.k); s += u k (one shuffle reduction per row).
__device__ __forceinline__ void fold_step_rows(FoldRows& S, const FoldRecord& sm, bool l2norm,
                                               int wrow, int lane, int K) {
  float k[kFoldEpl], al[kFoldEpl];
  float ss = 0.0f;
#pragma unroll
  for (int i = 0; i < kFoldEpl; ++i) {
    const int c = lane + 32 * i;
    k[i] = c < K ? sm.k[c] : 0.0f;
    al[i] = c < K ? sm.alpha[c] : 1.0f;
    ss += k[i] * k[i];
  }
  if (l2norm) {
    const float den = detail::l2norm_denominator(fold_warp_sum(ss));
#pragma unroll
    for (int i = 0; i < kFoldEpl; ++i) k[i] = k[i] / den;
  }
  const float beta = sm.beta;
#pragma unroll
  for (int r = 0; r < kFoldRowsPerWarp; ++r) {
    float dot = 0.0f;
#pragma unroll
    for (int i = 0; i < kFoldEpl; ++i) {
      S[r][i] *= al[i];
      dot += S[r][i] * k[i];
    }
    dot = fold_warp_sum(dot);
    const float u = detail::delta_u(sm.v[wrow + r], dot, beta);
#pragma unroll
    for (int i = 0; i < kFoldEpl; ++i) S[r][i] = fmaf(u, k[i], S[r][i]);
  }
}

// A staged d/k record of the basic ring on the warp's rows (a formatted checkpoint's fold):
// s = fma(d, k, s * alpha) per element, the replay kernel's and the CPU's two operations.
__device__ __forceinline__ void fold_replay_rows(FoldRows& S, const FoldRecord& sm, int wrow,
                                                 int lane, int K) {
#pragma unroll
  for (int r = 0; r < kFoldRowsPerWarp; ++r) {
    const float d = sm.v[wrow + r];
#pragma unroll
    for (int i = 0; i < kFoldEpl; ++i) {
      const int c = lane + 32 * i;
      if (c < K) S[r][i] = detail::replay_element(S[r][i], sm.alpha[c], d, sm.k[c]);
    }
  }
}

__global__ void __launch_bounds__(kFoldWarps * 32)
    replay_fold_kernel(const detail::ReplayFoldProblem p) {
  __shared__ FoldRecord sm;
  enter_grid(false);
  const int64_t b = blockIdx.x;
  const int hvl = static_cast<int>(blockIdx.y);
  const int64_t layer = hvl / p.HV;
  const int hv = hvl % p.HV, h = hv / (p.HV / p.H);
  const int row0 = static_cast<int>(blockIdx.z) * kFoldRows;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int wrow = warp * kFoldRowsPerWarp;
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
                     bad_slot  ? detail::kErrSlot
                     : bad_len ? detail::kErrStep
                               : detail::kErrTrackSlot,
                     b,
                     bad_slot  ? slot
                     : bad_len ? a
                               : track,
                     bad_len ? L + 1 : p.num_slots);
    }
    return;
  }
  const int64_t head_off = static_cast<int64_t>(hv) * V * K;
  const int64_t state_at = layer * p.state_layer_stride + slot * p.state_slot_stride + head_off;
  const int64_t v_base = p.rawv.at(layer, slot) + static_cast<int64_t>(hv) * L * V;
  const int64_t k_base = p.rawk.at(layer, slot) + static_cast<int64_t>(h) * L * K;
  const int64_t g_base = p.g.at(layer, slot) + static_cast<int64_t>(hv) * L * gw;
  const int64_t b_base = p.beta.at(layer, slot) + static_cast<int64_t>(hv) * L;
  const int wrow0 = row0 + wrow;
  FoldRows S;  // this warp's rows in registers
  fold_load_rows(S, p.state, p.state_dtype, state_at, wrow0, lane, K, V);
  for (int64_t t = 0; t < a; ++t) {
    fold_stage_record(sm, p.rawk.ptr, p.rawk.dtype, k_base + t * K, p.g.f32() + g_base + t * gw,
                      p.kda, p.rawv.ptr, p.rawv.dtype, v_base + t * V, p.beta.f32() + b_base + t,
                      row0, K, V);
    fold_step_rows(S, sm, p.l2norm, wrow, lane, K);
    if (tracking && t == step)
      fold_store_rows(S, p.state, p.state_dtype,
                      layer * p.state_layer_stride + track * p.state_slot_stride + head_off, wrow0,
                      lane, K, V);
  }
  fold_store_rows(S, p.state, p.state_dtype, state_at, wrow0, lane, K, V);
}

// The compact circular commit (ops.h ReplayCircularCommitArgs), same CTA shape: the prefix sums
// of g staged once per CTA, then per record the key (+ residual) and the CTA's rows of d (+
// residual) in shared memory; each warp accumulates the fold and the track state of its rows in
// registers from the old checkpoint rows (acc = e^{G} old, then acc += e^{G - G_j} u_j k_j per
// record), stores the track state, then the fold. The cursors move in a second launch.
constexpr int kCircMaxL = detail::kReplayCircularMaxL;

// Row b's slot and replay row; 0 for a live row the commit serves, -1 for a padded one, else the
// DeviceErrorKind of its first bad entry in the CPU validator's order (the slot, the replay row,
// a cursor, the track slot), with the bad value and its limit: the row is skipped whole (no
// checkpoint, track slot or cursor written) and recorded.
__device__ __forceinline__ int circ_row_check(const detail::ReplayCircularProblem& p, int64_t b,
                                              int64_t& slot, int64_t& r, int64_t& bad,
                                              int64_t& limit) {
  slot = p.slots.at(b, 0);
  if (slot <= p.null_block_id) return -1;
  r = p.rows.at(b, 0);
  if (slot >= p.num_slots) {
    bad = slot;
    limit = p.num_slots;
    return detail::kErrSlot;
  }
  if (r < 0 || r >= p.ring_rows) {
    bad = r;
    limit = p.ring_rows;
    return detail::kErrReplayRow;
  }
  const int n = p.write_pos[r], base = p.cache_base[r];
  if (n < 0 || n > p.L || base < 0 || base >= p.L) {
    bad = n < 0 || n > p.L ? n : base;
    limit = p.L;
    return detail::kErrRing;
  }
  const int64_t track = p.track.ptr ? p.track.at(b, 0) : p.null_block_id;
  const int64_t step = p.track.ptr ? p.steps.at(b, 0) : -1;
  if (track > p.null_block_id && step >= 0 && track >= p.num_slots) {
    bad = track;
    limit = p.num_slots;
    return detail::kErrTrackSlot;
  }
  return 0;
}

__global__ void __launch_bounds__(kFoldWarps * 32)
    replay_circular_kernel(const detail::ReplayCircularProblem p) {
  __shared__ float s_k[kFoldMaxK], s_u[kFoldRows], s_G[kCircMaxL];
  enter_grid(false);
  const int64_t b = blockIdx.x;
  const int hvl = static_cast<int>(blockIdx.y);
  const int64_t layer = hvl / p.HV;
  const int hv = hvl % p.HV, h = hv / (p.HV / p.H);
  const int row0 = static_cast<int>(blockIdx.z) * kFoldRows;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int K = p.K, V = p.V, L = p.L;
  int64_t slot = 0, r = 0, bad = 0, limit = 0;
  if (const int kind = circ_row_check(p, b, slot, r, bad, limit)) {
    if (kind > 0 && hvl == 0 && blockIdx.z == 0 && threadIdx.x == 0)
      record_bad_row(p.errors, detail::kErrOpReplayCircular, kind, b, bad, limit);
    return;
  }
  const int n = p.write_pos[r];
  const bool fold = detail::flag_at(p.is_flush, p.flush_dtype, r);
  const int64_t track = p.track.ptr ? p.track.at(b, 0) : p.null_block_id;
  const int64_t step = p.track.ptr ? p.steps.at(b, 0) : -1;
  const bool tracking = track > p.null_block_id && step >= 0;  // track < slots: checked
  if (!fold && !tracking) return;
  const int64_t tlen = tracking ? n - p.accepted.at(b, 0) + step + 1 : 0;
  const int mt = static_cast<int>(tlen < 0 ? 0 : tlen > L ? L : tlen);
  const int need = max(fold ? n : 0, mt);
  const int base = p.cache_base[r];
  if (threadIdx.x == 0) {  // the prefix sums of g, in order (fp32)
    float acc = 0.0f;
    for (int j = 0; j < need; ++j) {
      acc += p.g.f32()[p.g.at(layer, r) + static_cast<int64_t>(hv) * L + (base + j) % L];
      s_G[j] = acc;
    }
  }
  __syncthreads();
  const float tot_f = fold && n > 0 ? s_G[n - 1] : 0.0f;
  const float tot_t = mt > 0 ? s_G[mt - 1] : 0.0f;
  const int64_t head_off = static_cast<int64_t>(hv) * V * K;
  const int64_t state_at = layer * p.state_layer_stride + slot * p.state_slot_stride + head_off;
  const int wrow0 = row0 + warp * kFoldRowsPerWarp;
  FoldRows F, Tr;  // the fold and the track state of the warp's rows, from the old rows
  fold_load_rows(F, p.state, p.state_dtype, state_at, wrow0, lane, K, V);
  {
    const float kf = expf(tot_f), kt = expf(tot_t);
#pragma unroll
    for (int rr = 0; rr < kFoldRowsPerWarp; ++rr)
#pragma unroll
      for (int i = 0; i < kFoldEpl; ++i) {
        Tr[rr][i] = F[rr][i] * kt;
        F[rr][i] *= kf;
      }
  }
  for (int j = 0; j < need; ++j) {
    __syncthreads();  // the previous record's shared values are read
    const int64_t pos = (base + j) % L;
    const int64_t k_at = (static_cast<int64_t>(h) * L + pos) * K;
    for (int c = threadIdx.x; c < K; c += blockDim.x)
      s_k[c] = detail::load_float(p.k.ptr, p.k.dtype, p.k.at(layer, r) + k_at + c) +
               (p.k_res.ptr ? detail::load_float(p.k_res.ptr, p.k_res.dtype,
                                                 p.k_res.at(layer, r) + k_at + c)
                            : 0.0f);
    const int64_t d_at = (static_cast<int64_t>(hv) * L + pos) * V;
    for (int x = threadIdx.x; x < kFoldRows; x += blockDim.x) {
      const int row = row0 + x;
      s_u[x] = row < V ? detail::load_float(p.d.ptr, p.d.dtype, p.d.at(layer, r) + d_at + row) +
                             (p.d_res.ptr ? detail::load_float(p.d_res.ptr, p.d_res.dtype,
                                                               p.d_res.at(layer, r) + d_at + row)
                                          : 0.0f)
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
      for (int i = 0; i < kFoldEpl; ++i) {
        const int c = lane + 32 * i;
        const float k = c < K ? s_k[c] : 0.0f;
        if (fold && j < n) F[rr][i] = fmaf(cf, k, F[rr][i]);
        if (j < mt) Tr[rr][i] = fmaf(ct, k, Tr[rr][i]);
      }
    }
  }
  // The track state first, the fold last (a track slot equal to the checkpoint's ends as the
  // fold, as on the CPU).
  if (tracking)
    fold_store_rows(Tr, p.state, p.state_dtype,
                    layer * p.state_layer_stride + track * p.state_slot_stride + head_off, wrow0,
                    lane, K, V);
  if (fold) fold_store_rows(F, p.state, p.state_dtype, state_at, wrow0, lane, K, V);
}

// The folded rows' cursors, one thread per batch row, after replay_circular_kernel.
__global__ void __launch_bounds__(256)
    replay_circular_cursor_kernel(const detail::ReplayCircularProblem p) {
  enter_grid(false);
  const int64_t b = static_cast<int64_t>(blockIdx.x) * 256 + threadIdx.x;
  if (b >= p.B) return;
  int64_t slot = 0, r = 0, bad = 0, limit = 0;
  if (circ_row_check(p, b, slot, r, bad, limit)) return;
  if (!detail::flag_at(p.is_flush, p.flush_dtype, r)) return;
  p.cache_base[r] = (p.cache_base[r] + p.write_pos[r]) % p.L;
  p.write_pos[r] = 0;
  detail::set_flag(p.is_flush, p.flush_dtype, r, false);
}

// The exact-raw ring of replayssm_verify, and a checkpoint in its storage format: a launch
// before the verify kernel (whose registers it leaves alone). The fold (SGLang's exact-fold
// launch; calls serving folding rows): for each folding row with m = write_pos > 0 committed
// records, the raw records (raw k L2-normalized, raw v, the decay, beta; ring positions
// (cache_base + t) % L) run through the recurrent step from the checkpoint into the checkpoint,
// or without the exact-raw ring the d/k records are replayed (fold_replay_rows); a formatted
// checkpoint is loaded dequantized and stored through its format (fold_*_rows_fmt). The verify
// kernel then reads that checkpoint with an empty history (ReplayVerifyProblem::history_folded),
// so a folding row's drafts run from the checkpoint as stored. Then, with the exact-raw ring, for
// every row the call serves, the drafts' raw records: raw v (the CTA's rows), raw k (one CTA per
// key head) and beta at positions (cache_base + m + t) % L, m + t < L (past the ring: dropped),
// none of which a fold reads. Same CTA shape as replay_fold_kernel; rows the verify kernel
// reports (a bad slot or cursor) are skipped.
__global__ void __launch_bounds__(kFoldWarps * 32)
    replay_exact_fold_kernel(const detail::ReplayVerifyProblem p) {
  __shared__ FoldRecord sm;
  enter_grid(false);
  const detail::RecurrentProblem& r = p.r;
  const int64_t n = blockIdx.x;
  const int hv = static_cast<int>(blockIdx.y), h = hv / (r.HV / r.H);
  const int row0 = static_cast<int>(blockIdx.z) * kFoldRows;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int K = r.K, V = r.V, L = p.L, gw = r.gate.kda ? K : 1;
  const int64_t slot = detail::index_at(r.indices, r.index_dtype, r.index_stride, n);
  if (slot <= p.null_block_id || slot >= r.state.num_slots) return;
  const int64_t rr =
      p.replay ? detail::index_at(p.replay, p.replay_dtype, p.replay_stride, n) : slot;
  if (rr < 0 || rr >= p.ring_rows) return;
  const int m = p.write_pos[rr], base = p.cache_base[rr];
  if (m < 0 || m > L || base < 0 || base >= L) return;
  const bool fold = detail::flag_at(p.is_flush, p.flush_dtype, rr);
  if ((p.rows == 1 && fold) || (p.rows == 2 && !fold)) return;  // another call's rows
  // The drafts' raw records.
  const int64_t seq = r.cu_seqlens ? 0 : n;
  const int64_t tok0 = r.cu_seqlens ? detail::load_index(r.cu_seqlens, r.cu_dtype, n) : 0;
  const int64_t len =
      r.cu_seqlens ? detail::load_index(r.cu_seqlens, r.cu_dtype, n + 1) - tok0 : r.T;
  if (p.beta_ring) {
    const int64_t vb = (rr * r.HV + hv) * L * V, kb = (rr * r.H + h) * L * K;
    for (int64_t t = 0; t < len && m + t < L; ++t) {
      const int64_t pos = (base + m + t) % L;
      for (int x = threadIdx.x; x < kFoldRows; x += blockDim.x)
        if (row0 + x < V)
          detail::store_float(
              p.rawv, p.rawv_dtype, vb + pos * V + row0 + x,
              detail::load_float(r.v.ptr, r.v.dtype,
                                 detail::head_offset(r.v, seq, tok0 + t, hv) + row0 + x));
      if (blockIdx.z != 0) continue;
      if (hv % (r.HV / r.H) == 0)
        for (int c = threadIdx.x; c < K; c += blockDim.x)
          detail::store_float(p.rawk, p.rawk_dtype, kb + pos * K + c,
                              detail::load_float(r.k.ptr, r.k.dtype,
                                                 detail::head_offset(r.k, seq, tok0 + t, h) + c));
      if (threadIdx.x == 0)
        p.beta_ring[(rr * r.HV + hv) * L + pos] =
            detail::beta_value(detail::load_float(r.beta.ptr, r.beta.dtype,
                                                  detail::head_offset(r.beta, seq, tok0 + t, hv)),
                               r.beta_is_logit, r.round_beta, r.beta.dtype);
    }
  }
  if (!fold || m == 0) return;
  const int64_t state_at = slot * r.state.slot_stride + static_cast<int64_t>(hv) * V * K;
  const int64_t v_base = (rr * r.HV + hv) * L * V;
  const int64_t k_base = (rr * r.H + h) * L * K;
  const int64_t g_base = (rr * r.HV + hv) * L * gw;
  const int64_t b_base = (rr * r.HV + hv) * L;
  const int wrow = warp * kFoldRowsPerWarp, wrow0 = row0 + wrow;
  FoldRows S;
  const bool formatted = r.state.formatted();  // stored through its format (fold_*_rows_fmt)
  if (formatted) fold_load_rows_fmt(S, r.state, slot, hv, wrow0, lane, K, V);
  else fold_load_rows(S, r.state.ptr, r.state.dtype, state_at, wrow0, lane, K, V);
  for (int t = 0; t < m; ++t) {
    const int64_t pos = (base + t) % L;
    if (p.beta_ring) {
      fold_stage_record(sm, p.rawk, p.rawk_dtype, k_base + pos * K, p.g_cache + g_base + pos * gw,
                        r.gate.kda, p.rawv, p.rawv_dtype, v_base + pos * V,
                        p.beta_ring + b_base + pos, row0, K, V);
      fold_step_rows(S, sm, r.l2norm, wrow, lane, K);
    } else {  // a d/k record (d_cache has the raw v ring's [R, HV, L, V] layout)
      fold_stage_record(sm, p.k_cache, p.k_dtype, k_base + pos * K, p.g_cache + g_base + pos * gw,
                        r.gate.kda, p.d_cache, p.d_dtype, v_base + pos * V, nullptr, row0, K, V);
      fold_replay_rows(S, sm, wrow, lane, K);
    }
  }
  if (formatted) fold_store_rows_fmt(S, r.state, slot, hv, wrow0, lane, K, V);
  else fold_store_rows(S, r.state.ptr, r.state.dtype, state_at, wrow0, lane, K, V);
}

}  // namespace
}  // namespace deltastate::cuda_backend
