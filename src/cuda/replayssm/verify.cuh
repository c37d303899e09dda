// ReplaySSM speculative verify and its cursor commit on the GPU (ops.h ReplayVerifyArgs,
// ReplayCommitArgs). Verify: CTA (sequence, value head, block of kRvRows state rows); each warp
// holds kRvRowsPerWarp rows in registers, lane l holding elements l, l + 32, ... of a row (KP of
// them, K <= 32 KP). A warp replays the committed records onto its rows (s = fma(d, k, s * e^g)),
// stores them into the checkpoint on a fold, then runs the drafts through the delta rule on them,
// writing each output row and the draft's d record; the CTA of the head's first row block writes
// the draft's g record, and that of the key head's first value head its k record. Every warp
// prepares the token itself (norms and gate: warp reductions), so the CTA needs no shared memory
// and no barrier. A bad slot or cursor is recorded (record_bad_row) and its rows get NaN outputs.
// The cursors are read only; the commit kernel moves them, one thread per batch row.
// Part of replayssm_verify.cu's translation unit (included there only).
#pragma once

#include <cstdint>

#include "core/delta_math.h"
#include "core/numeric.h"
#include "core/problem.h"
#include "cuda/grid.cuh"

namespace deltastate::cuda_backend {

constexpr int kRvWarps = 4, kRvRowsPerWarp = 4, kRvRows = kRvWarps * kRvRowsPerWarp;
constexpr int kRvCommitThreads = 256;

namespace {

__device__ __forceinline__ float rv_warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// The drafts' outputs of this warp's rows for a padded (0) or bad (NaN) sequence.
__device__ __forceinline__ void rv_fill_outputs(const detail::RecurrentProblem& r, int64_t seq,
                                                int64_t tok0, int64_t len, int hv, int row0,
                                                int lane, float value) {
  if (lane >= kRvRowsPerWarp) return;
  const int row = row0 + lane;
  if (row >= r.V) return;
  for (int64_t t = 0; t < len; ++t)
    detail::store_float(r.out.ptr, r.out.dtype, detail::head_offset(r.out, seq, tok0 + t, hv) + row,
                        value);
}

template <int KP>
__global__ void __launch_bounds__(kRvWarps * 32)
    replay_verify_kernel(const detail::ReplayVerifyProblem p) {
  const detail::RecurrentProblem& r = p.r;
  enter_grid(r.pdl_trigger_early);
  const int n = blockIdx.x, hv = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row0 = blockIdx.z * kRvRows + warp * kRvRowsPerWarp;
  const int group = r.HV / r.H, h = hv / group;
  const int K = r.K, V = r.V, L = p.L;
  const int64_t seq = r.cu_seqlens ? 0 : n;
  const int64_t tok0 = r.cu_seqlens ? detail::load_index(r.cu_seqlens, r.cu_dtype, n) : 0;
  const int64_t len =
      r.cu_seqlens ? detail::load_index(r.cu_seqlens, r.cu_dtype, n + 1) - tok0 : r.T;
  const int64_t slot = detail::index_at(r.indices, r.index_dtype, r.index_stride, n);
  if (slot <= p.null_block_id) {  // padded: zero outputs, nothing else read or written
    rv_fill_outputs(r, seq, tok0, len, hv, row0, lane, 0.0f);
    return;
  }
  int kind = 0;
  int64_t bad = 0, limit = 0;
  int m = 0, base = 0;
  if (slot >= r.state.num_slots) {
    kind = detail::kErrSlot, bad = slot, limit = r.state.num_slots;
  } else {
    m = p.write_pos[slot];
    base = p.cache_base[slot];
    if (m < 0 || base < 0 || base >= L || m + len > L)
      kind = detail::kErrRing, bad = static_cast<int64_t>(m) + len, limit = L;
  }
  if (kind) {
    if (hv == 0 && blockIdx.z == 0 && threadIdx.x == 0)
      record_bad_row(r.errors, detail::kErrOpReplayVerify, kind, n, bad, limit);
    rv_fill_outputs(r, seq, tok0, len, hv, row0, lane, bad_row_output());
    return;
  }
  const bool fold = p.is_flush[slot] != 0;
  const int g_width = r.gate.kda ? K : 1;
  const int64_t d_base = (slot * r.HV + hv) * L * V;
  const int64_t k_base = (slot * r.H + h) * L * K;
  const int64_t g_base = (slot * r.HV + hv) * L * g_width;
  const int64_t head_off = slot * r.state.slot_stride + static_cast<int64_t>(hv) * V * K;

  float s[kRvRowsPerWarp][KP];
#pragma unroll
  for (int j = 0; j < kRvRowsPerWarp; ++j)
#pragma unroll
    for (int e = 0; e < KP; ++e) {
      const int row = row0 + j, i = lane + 32 * e;
      s[j][e] = row < V && i < K ? detail::load_float(r.state.ptr, r.state.dtype,
                                                      head_off + static_cast<int64_t>(row) * K + i)
                                 : 0.0f;
    }

  // 1. The committed records, oldest first (the recurrent step's two operations per element).
  for (int c = 0; c < m; ++c) {
    const int pos = (base + c) % L;
    float kj[KP], aj[KP];
#pragma unroll
    for (int e = 0; e < KP; ++e) {
      const int i = lane + 32 * e;
      kj[e] = i < K ? detail::load_float(p.k_cache, p.k_dtype, k_base + int64_t{pos} * K + i) : 0.f;
      aj[e] = expf(p.g_cache[g_base + int64_t{pos} * g_width + (r.gate.kda && i < K ? i : 0)]);
    }
#pragma unroll
    for (int j = 0; j < kRvRowsPerWarp; ++j) {
      const int row = row0 + j;
      if (row >= V) continue;
      const float dj = detail::load_float(p.d_cache, p.d_dtype, d_base + int64_t{pos} * V + row);
#pragma unroll
      for (int e = 0; e < KP; ++e) s[j][e] = fmaf(dj, kj[e], s[j][e] * aj[e]);
    }
  }
  // 2. The fold: the rebuilt state becomes the checkpoint.
  if (fold && m > 0) {
#pragma unroll
    for (int j = 0; j < kRvRowsPerWarp; ++j)
#pragma unroll
      for (int e = 0; e < KP; ++e) {
        const int row = row0 + j, i = lane + 32 * e;
        if (row < V && i < K)
          detail::store_float(r.state.ptr, r.state.dtype,
                              head_off + static_cast<int64_t>(row) * K + i, s[j][e]);
      }
  }

  // 3. The drafts.
  const float A_log = r.gate.A_log ? detail::load_float(r.gate.A_log, r.gate.A_log_dtype, hv) : 0.f;
  const bool head_writer = blockIdx.z == 0 && warp == 0;
  for (int64_t t = 0; t < len; ++t) {
    const int64_t tok = tok0 + t;
    const int64_t qk_off = detail::head_offset(r.q, seq, tok, h);
    const int64_t kk_off = detail::head_offset(r.k, seq, tok, h);
    float q[KP], k[KP], alpha[KP], g[KP];
    float qq = 0.f, kk = 0.f;
#pragma unroll
    for (int e = 0; e < KP; ++e) {
      const int i = lane + 32 * e;
      q[e] = i < K ? detail::load_float(r.q.ptr, r.q.dtype, qk_off + i) : 0.f;
      k[e] = i < K ? detail::load_float(r.k.ptr, r.k.dtype, kk_off + i) : 0.f;
      qq = fmaf(q[e], q[e], qq);
      kk = fmaf(k[e], k[e], kk);
    }
    if (r.l2norm) {
      const float dq = detail::l2norm_denominator(rv_warp_sum(qq));
      const float dk = detail::l2norm_denominator(rv_warp_sum(kk));
#pragma unroll
      for (int e = 0; e < KP; ++e) q[e] = q[e] / dq, k[e] = k[e] / dk;
    }
    float kq = 0.f;
#pragma unroll
    for (int e = 0; e < KP; ++e) {
      q[e] *= r.scale;
      kq = fmaf(k[e], q[e], kq);
    }
    kq = rv_warp_sum(kq);
    const int64_t g_off = detail::head_offset(r.g, seq, tok, hv);
#pragma unroll
    for (int e = 0; e < KP; ++e) {
      const int i = lane + 32 * e;
      const int gi = r.gate.kda ? (i < K ? i : 0) : 0;
      const float dt = r.gate.dt_bias ? detail::load_float(r.gate.dt_bias, r.gate.dt_bias_dtype,
                                                           r.gate.kda ? int64_t{hv} * K + gi : hv)
                                      : 0.f;
      g[e] = detail::gate_value(r.gate.mode, detail::load_float(r.g.ptr, r.g.dtype, g_off + gi), dt,
                                A_log, r.gate.lower_bound);
      alpha[e] = expf(g[e]);
    }
    const float beta = detail::beta_value(
        detail::load_float(r.beta.ptr, r.beta.dtype, detail::head_offset(r.beta, seq, tok, hv)),
        r.beta_is_logit, r.round_beta, r.beta.dtype);
    const int pos = static_cast<int>((base + m + t) % L);
    const int64_t out_off = detail::head_offset(r.out, seq, tok, hv);
    const int64_t v_off = detail::head_offset(r.v, seq, tok, hv);
#pragma unroll
    for (int j = 0; j < kRvRowsPerWarp; ++j) {
      const int row = row0 + j;
      if (row >= V) continue;  // warp-uniform
      float sk = 0.f, sq = 0.f;
#pragma unroll
      for (int e = 0; e < KP; ++e) {
        s[j][e] *= alpha[e];
        sk = fmaf(s[j][e], k[e], sk);
        sq = fmaf(s[j][e], q[e], sq);
      }
      sk = rv_warp_sum(sk);
      sq = rv_warp_sum(sq);
      const float u =
          detail::delta_u(detail::load_float(r.v.ptr, r.v.dtype, v_off + row), sk, beta);
#pragma unroll
      for (int e = 0; e < KP; ++e) s[j][e] = fmaf(u, k[e], s[j][e]);
      if (lane == 0) {
        detail::store_float(r.out.ptr, r.out.dtype, out_off + row, detail::delta_output(sq, u, kq));
        detail::store_float(p.d_cache, p.d_dtype, d_base + int64_t{pos} * V + row, u);
      }
    }
    if (head_writer) {
#pragma unroll
      for (int e = 0; e < KP; ++e) {
        const int i = lane + 32 * e;
        if (i < g_width) p.g_cache[g_base + int64_t{pos} * g_width + i] = g[e];
        if (hv % group == 0 && i < K)
          detail::store_float(p.k_cache, p.k_dtype, k_base + int64_t{pos} * K + i, k[e]);
      }
    }
  }
}

// The cursor commit, one thread per batch row (a slot appears in one row of a step).
__global__ void __launch_bounds__(kRvCommitThreads)
    replay_commit_kernel(const detail::ReplayCommitProblem p) {
  enter_grid(false);
  const int64_t b = static_cast<int64_t>(blockIdx.x) * kRvCommitThreads + threadIdx.x;
  if (b >= p.B) return;
  const int64_t slot = p.slots.at(b, 0);
  if (slot <= p.null_block_id) return;
  const int64_t a = p.accepted.at(b, 0);
  if (slot >= p.num_slots || a < 0 || a > p.max_spec_len) {
    const bool bad_slot = slot >= p.num_slots;
    record_bad_row(p.errors, detail::kErrOpReplayCommit,
                   bad_slot ? detail::kErrSlot : detail::kErrStep, b, bad_slot ? slot : a,
                   bad_slot ? p.num_slots : p.max_spec_len + 1);
    return;
  }
  int wp = p.write_pos[slot];
  if (p.is_flush[slot] != 0) {
    if (a > 0) p.cache_base[slot] = (p.cache_base[slot] + wp) % p.L;
    wp = static_cast<int>(a);
  } else {
    wp += static_cast<int>(a);
  }
  p.write_pos[slot] = wp;
  p.is_flush[slot] = wp + 2 * p.max_spec_len > p.L ? 1 : 0;
}

}  // namespace
}  // namespace deltastate::cuda_backend
