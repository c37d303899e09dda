// The fused decode layer step's ReplaySSM kernel: the CTA kernel's structure (kernel.cuh: one CTA
// per (row n, key head h), which owns the conv of the key head's q/k channels and of its group's
// v channels) with replayssm_decode's step (replayssm/decode.cuh, docs/REPLAYSSM.md) in place of
// the plain delta rule. Part of fused_decode_step.cu's translation unit (included there only), in
// its anonymous namespace. The dispatcher sends every ReplaySSM call here (no cluster variant).
//
// The checkpoint S0 is read every step and written only on a flush (write_pos == L-1 or
// force_flush); an appending step takes its output from dots of S0 and of the ring records with
// the token and appends the record (d, k, g) at position m = write_pos. The k ring is per key
// head and the d and g rings per value head, so the CTA owns all the records its rows use, and
// none is shared with another CTA.
//
// Order inside the CTA:
//   1. the slot, the cursor and the forced flush (a padded row: zeros; a bad slot or cursor: NaN
//      outputs, recorded, nothing read or written); every warp issues the loads of its checkpoint
//      tiles into registers (RowLayout);
//   2. meanwhile the CTA's threads run the conv update of the 2K + group*V owned channels into
//      shared memory (as kernel.cuh) and stage the m ring records (k of the key head; d and g of
//      each value head of the group) into shared memory as floats; barrier;
//   3. the token once per CTA: warp 0 normalizes q and k (q scaled) and takes k.q; per value head
//      one warp computes the gate (g, alpha) and beta; all published to shared memory; the CTA
//      counts itself for the cursor advance; barrier;
//   4. per value head, its records spread over the warps (replayssm/decode.cuh's per-record
//      pass): Gtot and the prefix sums G_j, W_j = exp(Gtot - G_j), and for an appending step the
//      coefficients ck_j, cq_j, for a flush kw_j (KDA) and w_j; e = exp(Gtot); barrier (only with
//      records);
//   5. per tile: a flush rebuilds S = e*S0 + sum_j d_j w_j kw_j in registers and runs the plain
//      delta step on it (delta_step_rows), storing the checkpoint; an appending step adds the
//      ring terms d_j*ck_j, d_j*cq_j of lane l's records l, l + G, .. to its rows' partial dots,
//      one transposed reduction, the output, and stores the record's d; outputs (rounded to out's
//      dtype) into shared memory; the appended k and g records; barrier;
//   6. optional gated RMSNorm per value head (one warp per head), then the stores of out.
// Shared memory (floats): the conv outputs and the outputs (fused_smem_floats), the token, and
// per record about K + group*(V + 1 + gw + 3) floats plus group*K for KDA's kw; the launcher
// opts in beyond 48 KB and rejects a ring the GPU's per-block maximum does not hold.
#pragma once

#include <cstdint>

#include "core/delta_math.h"
#include "core/layer_math.h"
#include "core/problem.h"
#include "cuda/fused_decode_step/kernel.cuh"
#include "cuda/grid.cuh"
#include "cuda/loads.cuh"
#include "cuda/reduce.cuh"
#include "cuda/replayssm/ring.cuh"
#include "cuda/rows.cuh"
#include "cuda/token.cuh"

namespace deltastate::cuda_backend {

namespace {

// Float offsets of the ReplaySSM fused kernel's shared memory (kernel and launcher agree on it):
// xq, xk [K] and xv [group*V] the conv outputs, os [group*V] the outputs; the token: kn, qn [K],
// scalars (k.q), per value head of the group alpha, gcur (its log decay) [K] each, beta, e =
// exp(Gtot) [K]; the staged records k [L][K], per value head d [L][d_pitch] (the pitch odd, so
// that lanes reading consecutive records hit different banks) and g [L][gw]; per value head and
// record ck, cq, w; KDA's kw [group][L][K] (flush).
struct FusedReplaySmem {
  int xq, xk, xv, os, kn, qn, scalars, alpha, gcur, beta, e, k, d, g, ck, cq, w, kw, d_pitch, gw;
  int floats;
  __host__ __device__ FusedReplaySmem(int K, int group, int V, int L, bool kda) {
    const int rows = group * V;
    gw = kda ? K : 1;
    d_pitch = V + 1;
    xq = 0;
    xk = xq + K;
    xv = xk + K;
    os = xv + rows;
    kn = os + rows;
    qn = kn + K;
    scalars = qn + K;
    alpha = scalars + 4;
    gcur = alpha + group * K;
    beta = gcur + group * K;
    e = beta + group;
    k = e + group * K;
    d = k + L * K;
    g = d + group * L * d_pitch;
    ck = g + group * L * gw;
    cq = ck + group * L;
    w = cq + group * L;
    kw = w + group * L;
    floats = kw + (kda ? group * L * K : 0);
  }
};
__host__ __device__ inline FusedReplaySmem fused_replay_smem(const FusedStepProblem& p) {
  return FusedReplaySmem(p.K, p.HV / p.H, p.V, p.replay.L, p.gate.kda);
}

template <class StateT, int K, int TPW>
__global__ void __launch_bounds__(kFusedMaxWarps * 32, 1)
    fused_replay_step_kernel(const FusedStepProblem p) {
  enter_grid(p.pdl_trigger_early);
  using Lay = RowLayout<StateT, K>;
  constexpr int G = Lay::G, EPL = Lay::EPL, RG = Lay::RG, R = Lay::ROWS;
  constexpr int RPW = RG * R;  // rows per tile
  constexpr int CPL = K / 32;  // columns per lane in the per-record pass
  const int n = static_cast<int>(blockIdx.x), h = static_cast<int>(blockIdx.y);
  const int warp = static_cast<int>(threadIdx.x >> 5), lane = static_cast<int>(threadIdx.x & 31);
  const int warps = static_cast<int>(blockDim.x >> 5);
  const int group = p.HV / p.H, V = p.V, L = p.replay.L;
  const bool kda = p.gate.kda;
  const int tiles_per_head = (V + RPW - 1) / RPW;
  const int tiles = group * tiles_per_head;
  const int rows = group * V;  // this CTA's output rows (value heads h*group ..)
  const int64_t o_base = detail::head_offset(p.out, n, 0, h * group);

  // 1. The slot, the cursor (read at L2: the CTAs of this row count themselves in it) and the
  //    forced flush, each issued where it stands.
  const auto* indices = static_cast<const int32_t*>(p.indices);
  const int64_t slot = load_int_now(indices + n * p.index_stride);
  const int cursor = load_int_now_cg(p.replay.write_pos + n);
  const bool forced = p.replay.force_flush && load_int_now(p.replay.force_flush + n) != 0;
  if (slot < 0) {  // padding: zeros; no window, state, ring or cursor access
    for (int i = static_cast<int>(threadIdx.x); i < rows; i += static_cast<int>(blockDim.x))
      detail::store_float(p.out.ptr, p.out.dtype, o_base + i, 0.0f);
    return;
  }
  // A bad row (a slot past the pool, a cursor outside the ring): as padded, its output NaN,
  // recorded by one thread of the row. Every CTA of the row reads the same low 16 bits of the
  // cursor (until the row's last CTA stores the new one, which a skipped row never reaches), so
  // all of them skip it.
  const int m = replay_cursor(cursor, p.replay.advance_write_pos);
  if (bad_replay_row(slot, p.state.num_slots, cursor, m, L)) {
    if (threadIdx.x == 0 && h == 0)
      record_bad_replay_row(p.errors, detail::kErrOpFusedStep, n, slot, p.state.num_slots, cursor,
                            m, L);
    for (int i = static_cast<int>(threadIdx.x); i < rows; i += static_cast<int>(blockDim.x))
      detail::store_float(p.out.ptr, p.out.dtype, o_base + i, bad_row_output());
    return;
  }
  const bool flush = detail::replay_flushes(m, L, forced);

  // The checkpoint tiles of this warp into registers.
  const int kofs = (lane % G) * EPL;
  StateT* const pool = static_cast<StateT*>(p.state.ptr) + slot * p.state.slot_stride;
  auto tile_rows = [&](int t) {  // (head in group, first row of this lane) of tile t, or -1
    const int ti = warp + t * warps;
    if (ti >= tiles) return int2{-1, 0};
    const int hl = ti / tiles_per_head;
    return int2{hl, (ti - hl * tiles_per_head) * RPW + lane / G};
  };
  auto row_ptr = [&](int hl, int row) {
    return pool + (static_cast<int64_t>(h * group + hl) * V + row) * K + kofs;
  };
  float S[TPW][R][EPL];
#pragma unroll
  for (int t = 0; t < TPW; ++t) {
    const int2 tr = tile_rows(t);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (tr.x >= 0 && tr.y + r * RG < V) {
        load_state<StateT, EPL, true>(row_ptr(tr.x, tr.y + r * RG), EPL, S[t][r]);
      } else {
#pragma unroll
        for (int i = 0; i < EPL; ++i) S[t][r][i] = 0.0f;
      }
    }
  }

  // 2. The conv update of the owned channels [q_h | k_h | v of the group] into shared memory,
  //    and the ring records staged as floats.
  extern __shared__ __align__(16) float replay_smem[];
  const FusedReplaySmem sm = fused_replay_smem(p);
  const float* const xq = replay_smem + sm.xq;
  const float* const xk = replay_smem + sm.xk;
  const float* const xv = replay_smem + sm.xv;
  float* const os = replay_smem + sm.os;
  float* const s_kn = replay_smem + sm.kn;
  float* const s_qn = replay_smem + sm.qn;
  float* const s_scalars = replay_smem + sm.scalars;
  float* const s_alpha = replay_smem + sm.alpha;
  float* const s_gcur = replay_smem + sm.gcur;
  float* const s_beta = replay_smem + sm.beta;
  float* const s_e = replay_smem + sm.e;
  float* const s_k = replay_smem + sm.k;
  float* const s_d = replay_smem + sm.d;
  float* const s_g = replay_smem + sm.g;
  float* const s_ck = replay_smem + sm.ck;
  float* const s_cq = replay_smem + sm.cq;
  float* const s_w = replay_smem + sm.w;
  float* const s_kw = replay_smem + sm.kw;
  const int gw = sm.gw;
  fused_conv_owned<K>(p, n, h, slot, replay_smem + sm.xq);
  const int64_t k_ring = (slot * p.H + h) * static_cast<int64_t>(L) * K;  // k_cache[slot, h, 0]
  auto d_ring = [&](int hl) {  // d_cache[slot, hv, 0, 0] (elements)
    return (slot * p.HV + h * group + hl) * static_cast<int64_t>(L) * V;
  };
  auto g_ring = [&](int hl) {  // g_cache[slot, hv, 0(, 0)]
    return p.replay.g_cache + (slot * p.HV + h * group + hl) * static_cast<int64_t>(L) * gw;
  };
  if (m > 0) {
    stage_rows_float(s_k, K, p.replay.k_cache, p.replay.k_dtype, k_ring, K, m, K);
    for (int hl = 0; hl < group; ++hl) {
      stage_rows_float(s_d + hl * L * sm.d_pitch, sm.d_pitch, p.replay.d_cache, p.replay.d_dtype,
                       d_ring(hl), V, m, V);
      stage_rows_float(s_g + hl * L * gw, 0, g_ring(hl), DType::f32, 0, 0, 1, m * gw);
    }
  }
  __syncthreads();  // conv outputs and records staged; every thread has read the cursor

  // 3. The token: q, k on warp 0; the gate and beta of value head hl on warp (hl + 1) % warps.
  if (p.replay.advance_write_pos && threadIdx.x == 0)
    advance_row_cursor(p.replay.write_pos, n, static_cast<int>(gridDim.y), m, flush);
  if (warp == 0) {
    float q[EPL], k[EPL];
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      q[i] = xq[kofs + i];
      k[i] = xk[kofs + i];
    }
    const float kq = prepare_qk<EPL, G>(q, k, p.l2norm, p.scale, lane);
    if (lane < G) {
#pragma unroll
      for (int i = 0; i < EPL; ++i) {
        s_kn[kofs + i] = k[i];
        s_qn[kofs + i] = q[i];
      }
    }
    if (lane == 0) s_scalars[0] = kq;
  }
  for (int hl = 0; hl < group; ++hl) {
    if ((hl + 1) % warps != warp) continue;  // warp-uniform
    const int hv = h * group + hl;
    GateConsts<EPL> gc;
    load_gate_consts(p.gate, hv, K, kofs, EPL, gc);
    float graw[EPL], g[EPL], alpha[EPL];
    const int64_t a_off = detail::head_offset(p.a, n, 0, hv);
#pragma unroll
    for (int i = 0; i < EPL; ++i)
      graw[i] = kda ? detail::load_float(p.a.ptr, p.a.dtype, a_off + kofs + i)
                    : (i == 0 ? detail::load_float(p.a.ptr, p.a.dtype, a_off) : 0.0f);
    token_gate(p.gate, gc, graw, g, alpha);
    if (lane < G) {
#pragma unroll
      for (int i = 0; i < EPL; ++i) {
        s_alpha[hl * K + kofs + i] = alpha[i];
        s_gcur[hl * K + kofs + i] = g[i];
      }
    }
    if (lane == 0)
      s_beta[hl] = detail::beta_value(
          detail::load_float(p.b.ptr, p.b.dtype, detail::head_offset(p.b, n, 0, hv)), true,
          p.round_beta, p.b.dtype);
  }
  __syncthreads();  // the token published

  // 4. Per value head, record j on warp j mod warps (lane columns col0 .. col0 + CPL): Gtot and
  //    G_j summed in record order, as the CPU sums them; e by warp 0.
  if (m > 0) {
    const int col0 = lane * CPL;
    for (int hl = 0; hl < group; ++hl) {
      const float* g_h = s_g + hl * L * gw;
      const float* al = s_alpha + hl * K;
      auto finish = [&](int j, const float(&kw)[CPL], float wj) {
        const int rec = hl * L + j;
        if (flush) {
          if (kda)
#pragma unroll
            for (int c = 0; c < CPL; ++c) s_kw[rec * K + col0 + c] = kw[c];
          if (lane == 0) s_w[rec] = wj;
        } else {
          record_coefficients<CPL>(kw, col0, K, al, s_kn, s_qn, wj, lane, s_ck + rec, s_cq + rec);
        }
      };
      if (kda) {
        float gtot[CPL], prefix[CPL];
#pragma unroll
        for (int c = 0; c < CPL; ++c) gtot[c] = prefix[c] = 0.0f;
        for (int i = 0; i < m; ++i) {
#pragma unroll
          for (int c = 0; c < CPL; ++c) gtot[c] += g_h[i * K + col0 + c];
        }
        if (warp == 0) {
#pragma unroll
          for (int c = 0; c < CPL; ++c) s_e[hl * K + col0 + c] = expf(gtot[c]);
        }
        int i = 0;
        for (int j = warp; j < m; j += warps) {
          for (; i <= j; ++i) {
#pragma unroll
            for (int c = 0; c < CPL; ++c) prefix[c] += g_h[i * K + col0 + c];
          }
          float kw[CPL];
#pragma unroll
          for (int c = 0; c < CPL; ++c) kw[c] = s_k[j * K + col0 + c] * expf(gtot[c] - prefix[c]);
          finish(j, kw, 1.0f);
        }
      } else {
        float gtot = 0.0f, prefix = 0.0f;
        for (int i = 0; i < m; ++i) gtot += g_h[i];
        if (warp == 0) {
          const float e = expf(gtot);
#pragma unroll
          for (int c = 0; c < CPL; ++c) s_e[hl * K + col0 + c] = e;
        }
        int i = 0;
        for (int j = warp; j < m; j += warps) {
          for (; i <= j; ++i) prefix += g_h[i];
          float kr[CPL];
#pragma unroll
          for (int c = 0; c < CPL; ++c) kr[c] = s_k[j * K + col0 + c];
          finish(j, kr, expf(gtot - prefix));
        }
      }
    }
    __syncthreads();  // the records' coefficients
  }

  // 5. Per tile: the ReplaySSM step of its rows.
  const float kq = s_scalars[0];
  const int idx = reduced_index<G, 2 * R>(lane);  // the value this lane holds after the reduction
  const bool first_copy = (lane & (G / (2 * R) - 1)) == 0;
#pragma unroll
  for (int t = 0; t < TPW; ++t) {
    const int2 tr = tile_rows(t);
    if (tr.x < 0) break;  // warp-uniform
    const int hl = tr.x, row0 = tr.y;
    const float beta = s_beta[hl];
    const float* al = s_alpha + hl * K;
    const float* d_h = s_d + hl * L * sm.d_pitch;
    const bool v_here = idx < R && row0 + idx * RG < V;
    const float v = v_here ? xv[hl * V + row0 + idx * RG] : 0.0f;
    auto record_d = [&](int j, float(&dj)[R]) {  // record j's d of this lane's rows
#pragma unroll
      for (int r = 0; r < R; ++r)
        dj[r] = row0 + r * RG < V ? d_h[j * sm.d_pitch + row0 + r * RG] : 0.0f;
    };
    auto to_os = [&](int row, float o) { os[hl * V + row] = detail::round_to(p.out.dtype, o); };
    if (flush) {
      // Rebuild S = e*S0 + sum_j d_j w_j kw_j, then the plain delta-rule step on it.
      if (m > 0) {
        float e[EPL];
#pragma unroll
        for (int i = 0; i < EPL; ++i) e[i] = s_e[hl * K + kofs + i];
#pragma unroll
        for (int r = 0; r < R; ++r)
          detail::scale_row(S[t][r], e, std::integral_constant<int, EPL>{});
        const float* kw_h = kda ? s_kw + hl * L * K : s_k;
        for (int j = 0; j < m; ++j) {
          float kw[EPL], dj[R];
#pragma unroll
          for (int i = 0; i < EPL; ++i) kw[i] = kw_h[j * K + kofs + i];
          record_d(j, dj);
          const float wj = s_w[hl * L + j];
#pragma unroll
          for (int r = 0; r < R; ++r)
            detail::rank1_update(S[t][r], kw, std::integral_constant<int, EPL>{}, dj[r] * wj);
        }
      }
      float alpha[EPL], kn[EPL], qn[EPL];
#pragma unroll
      for (int i = 0; i < EPL; ++i) {
        alpha[i] = al[kofs + i];
        kn[i] = s_kn[kofs + i];
        qn[i] = s_qn[kofs + i];
      }
      float u_here;  // meaningful on the lanes holding sk
      const float red =
          delta_step_rows<G, R>(S[t], alpha, kn, qn, v, beta, lane, u_here, [&](int r) {
            if (row0 + r * RG < V)
              store_state<StateT, EPL, true>(row_ptr(hl, row0 + r * RG), EPL, S[t][r]);
          });
      finish_output_rows<G, R>(V, row0, RG, lane, red, u_here, kq, to_os);
      continue;
    }
    // An appending step: S0's dots plus the ring terms of lane l's records l, l + G, ..; one
    // transposed reduction; the output and the record's d (by the lanes holding sk).
    float dots[2 * R];
    checkpoint_dots<R, EPL>(S[t], m > 0, s_e + hl * K, al, s_kn, s_qn, kofs, EPL, dots);
    for (int j = lane % G; j < m; j += G) {
      const float ckj = s_ck[hl * L + j], cqj = s_cq[hl * L + j];
      float dj[R];
      record_d(j, dj);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        dots[r] += dj[r] * ckj;
        dots[R + r] += dj[r] * cqj;
      }
    }
    const float red = transpose_reduce<G, 2 * R>(dots, lane);
    const float u_here = detail::delta_u(v, red, beta);  // meaningful on the lanes holding sk
    finish_output_rows<G, R>(V, row0, RG, lane, red, u_here, kq, to_os);
    if (v_here && first_copy)
      detail::store_float(p.replay.d_cache, p.replay.d_dtype,
                          d_ring(hl) + static_cast<int64_t>(m) * V + row0 + idx * RG, u_here);
  }
  // The appended record's k (this CTA owns the key head) and each value head's g, on warp 0.
  if (!flush && warp == 0 && lane < G) {
#pragma unroll
    for (int i = 0; i < EPL; ++i)
      detail::store_float(p.replay.k_cache, p.replay.k_dtype,
                          k_ring + static_cast<int64_t>(m) * K + kofs + i, s_kn[kofs + i]);
    for (int hl = 0; hl < group; ++hl) {
      float* g_out = g_ring(hl) + static_cast<int64_t>(m) * gw;
      if (kda) {
#pragma unroll
        for (int i = 0; i < EPL; ++i) g_out[kofs + i] = s_gcur[hl * K + kofs + i];
      } else if (lane == 0) {
        g_out[0] = s_gcur[hl * K];
      }
    }
  }
  __syncthreads();  // the outputs

  // 6. The gated RMSNorm (one warp per value head) or the plain output.
  fused_store_outputs(p, os, n, h, o_base);
}

}  // namespace
}  // namespace deltastate::cuda_backend
