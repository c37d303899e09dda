// The multi-token kernel: speculative verify, and the recurrent op's multi-token sequences (T > 1,
// varlen). Each CTA owns kMultiWarps tiles of one (sequence, value head); the state rows stay in
// registers across all the sequence's tokens (RowLayout, as the decode kernel: a row over G lanes,
// K reduced in the row's lanes), so the state is read once and written once, plus the optional
// per-token stores (a scratch row's step, a per-token pool slot).
// The tokens' preparation (q and k normalized, k.q, the gate's alpha, beta) is done once per CTA,
// kMultiChunk tokens at a time, by the warps together into shared memory, with the chunk's v
// values of the CTA's rows; each warp then runs the chunk's tokens from shared memory. Every index
// the sequence follows is checked before anything is written: a bad one skips the sequence (NaN
// outputs, recorded in the device's error record), as the other kernels skip a bad row.
// Part of verify.cu's translation unit (included there only), in its anonymous namespace.
#pragma once

#include <cstdint>
#include <type_traits>

#include "core/delta_math.h"
#include "core/problem.h"
#include "cuda/grid.cuh"
#include "cuda/loads.cuh"
#include "cuda/rows.cuh"
#include "cuda/token.cuh"
#include "cuda/tuning.h"

namespace deltastate::cuda_backend {

using detail::RecurrentProblem;
using detail::VerifyProblem;

namespace {

template <class StateT, int KT>
struct MultiLayout {
  using Lay = RowLayout<StateT, KT>;
  static constexpr int G = Lay::G, EPL = Lay::EPL, RG = Lay::RG, R = Lay::ROWS;
  static constexpr int RPW = RG * R;             // rows per warp
  static constexpr int RPC = RPW * kMultiWarps;  // rows per CTA
  static constexpr int PE = KT / 32;             // K elements per lane in the preparation
};

template <int KT, int RPC>
struct alignas(16) MultiSmem {  // 16-byte rows: a lane's slice of q, k, alpha in vector loads
  float q[kMultiChunk][KT], k[kMultiChunk][KT], alpha[kMultiChunk][KT];
  float v[kMultiChunk][RPC];
  float beta[kMultiChunk], kq[kMultiChunk];
};

// The sequence's first bad index, if any (kind, value, limit): every index it would follow.
struct BadIndex {
  int kind = 0;
  int64_t value = 0, limit = 0;
};
__device__ __forceinline__ BadIndex find_bad_index(const VerifyProblem& vp, int64_t n, int64_t len,
                                                   int64_t start, int64_t row) {
  const RecurrentProblem& p = vp.r;
  const int64_t slots = p.state.num_slots;
  if (vp.num_accepted.ptr) {
    const int64_t a = vp.num_accepted.at(n, 0);
    if (a < 1 || a > vp.token_slots.cols) return {detail::kErrStep, a, vp.token_slots.cols};
  }
  if (start >= slots) return {detail::kErrSlot, start, slots};
  if (start < 0) return {};
  if (vp.output_indices.ptr) {
    const int64_t o = vp.output_indices.at(n, 0);
    if (o >= slots) return {detail::kErrSlot, o, slots};
  }
  if (vp.token_slots.ptr) {
    if (len > vp.token_slots.cols) return {detail::kErrStep, len, vp.token_slots.cols};
    for (int64_t t = 0; t < len; ++t) {
      const int64_t s = vp.token_slots.at(n, t);
      if (s >= slots) return {detail::kErrSlot, s, slots};
    }
  }
  if (vp.inter) {
    if (row >= vp.inter_rows) return {detail::kErrRow, row, vp.inter_rows};
    if (row >= 0 && len > vp.inter_steps) return {detail::kErrStep, len, vp.inter_steps};
  }
  if (vp.parents.ptr && row >= 0) {
    if (len > vp.parents.cols) return {detail::kErrStep, len, vp.parents.cols};
    for (int64_t t = 1; t < len; ++t)
      if (vp.parents.at(n, t) >= t) return {detail::kErrStep, vp.parents.at(n, t), t};
  }
  return {};
}

template <class StateT, int EPL, int R, int RG, bool VEC>
__device__ __forceinline__ void load_rows(const StateT* head, int row0, int V, int K, int kofs,
                                          int valid, float (&S)[R][EPL]) {
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int row = row0 + r * RG;
    if (row < V) {
      load_state<StateT, EPL, VEC>(head + static_cast<int64_t>(row) * K + kofs, valid, S[r]);
    } else {
#pragma unroll
      for (int i = 0; i < EPL; ++i) S[r][i] = 0.0f;
    }
  }
}

// One CTA: kMultiWarps warps over rows [block*RPC, (block+1)*RPC) of head (n, hv).
template <bool VEC>
constexpr int kMultiResident = VEC ? kMultiCtasPerSm : kMultiGenericCtasPerSm;

template <class StateT, int KT, bool VEC>
__global__ void __launch_bounds__(kMultiWarps * 32, kMultiResident<VEC>)
    multi_token_kernel(const VerifyProblem vp, int ctas_per_head) {
  enter_grid(vp.r.pdl_trigger_early);
  using M = MultiLayout<StateT, KT>;
  constexpr int G = M::G, EPL = M::EPL, RG = M::RG, R = M::R, RPW = M::RPW, RPC = M::RPC;
  constexpr int PE = M::PE;
  __shared__ MultiSmem<KT, RPC> sm;
  const RecurrentProblem& p = vp.r;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int head = static_cast<int>(blockIdx.x) / ctas_per_head;
  const int block = static_cast<int>(blockIdx.x) - head * ctas_per_head;
  const int n = head / p.HV, hv = head - n * p.HV, h = hv / (p.HV / p.H);
  const int K = p.K, V = p.V;
  const int kofs = (lane % G) * EPL;
  const int valid = VEC ? EPL : max(0, min(EPL, K - kofs));
  const int local0 = warp * RPW + lane / G;  // this lane's first row within the CTA's rows
  const int row0 = block * RPC + local0;
  const int64_t seq = p.cu_seqlens ? 0 : n;
  const int64_t tok0 = p.cu_seqlens ? detail::load_index(p.cu_seqlens, p.cu_dtype, n) : 0;
  const int64_t len =
      p.cu_seqlens ? detail::load_index(p.cu_seqlens, p.cu_dtype, n + 1) - tok0 : p.T;

  int64_t start;
  if (vp.num_accepted.ptr) {
    const int64_t a = vp.num_accepted.at(n, 0);
    start = a >= 1 && a <= vp.token_slots.cols ? vp.token_slots.at(n, a - 1) : 0;
  } else {
    start = p.indices ? detail::index_at(p.indices, p.index_dtype, p.index_stride, n) : n;
  }
  // The state rows are loaded as soon as the slot is known to lie in the pool, ahead of the other
  // index checks (a verify's table reads), which they then overlap; a bad row discards them.
  const int64_t head_elems = static_cast<int64_t>(V) * K;
  StateT* pool = static_cast<StateT*>(p.state.ptr) + static_cast<int64_t>(hv) * head_elems;
  StateT* inter = static_cast<StateT*>(vp.inter);
  float S[R][EPL];
  const bool in_pool = start >= 0 && start < p.state.num_slots;
  load_rows<StateT, EPL, R, RG, VEC>(pool + (in_pool ? start : 0) * p.state.slot_stride, row0,
                                     in_pool ? V : 0, K, kofs, valid, S);
  const int64_t row = vp.inter ? (vp.inter_indices.ptr ? vp.inter_indices.at(n, 0) : n) : -1;
  const BadIndex bad = find_bad_index(vp, n, len, start, row);
  if (start < 0 || bad.kind) {  // padded: zero outputs; a bad index: NaN outputs, recorded
    if (bad.kind && hv == 0 && block == 0 && threadIdx.x == 0)
      record_bad_row(p.errors, vp.err_op, bad.kind, n, bad.value, bad.limit);
    const float fill = bad.kind ? bad_row_output() : 0.0f;
    if (lane % G == 0)
      for (int64_t t = 0; t < len; ++t)
        zero_output_rows<R>(p.out, V, head_offset(p.out, seq, tok0 + t, hv), row0, RG, fill);
    return;
  }

  const detail::GateParams& gp = p.gate;
  const float A_log = gp.A_log ? detail::load_float(gp.A_log, gp.A_log_dtype, hv) : 0.0f;
  const bool final_store = p.update_state && !vp.token_slots.ptr;
  const int64_t final_slot =
      final_store ? (vp.output_indices.ptr ? vp.output_indices.at(n, 0) : start) : -1;
  const int idx = reduced_index<G, 2 * R>(lane);  // the dot this lane holds after the reduction

  for (int64_t c0 = 0; c0 < len; c0 += kMultiChunk) {
    const int cn = static_cast<int>(len - c0 < kMultiChunk ? len - c0 : kMultiChunk);
    __syncthreads();  // the previous chunk's tokens are done with the shared memory
    for (int j = warp; j < cn; j += kMultiWarps) {  // prepare token c0 + j (one warp per token)
      const int64_t tok = tok0 + c0 + j;
      const int e0 = lane * PE;
      float q[PE], k[PE], alpha[PE];
      const int64_t q_off = head_offset(p.q, seq, tok, h) + e0;
      const int64_t k_off = head_offset(p.k, seq, tok, h) + e0;
      const int64_t g_off = head_offset(p.g, seq, tok, hv);
#pragma unroll
      for (int i = 0; i < PE; ++i) {
        const bool in = e0 + i < K;
        q[i] = in ? detail::load_float(p.q.ptr, p.q.dtype, q_off + i) : 0.0f;
        k[i] = in ? detail::load_float(p.k.ptr, p.k.dtype, k_off + i) : 0.0f;
      }
      const float kq = prepare_qk<PE, 32>(q, k, p.l2norm, p.scale, lane);
      if (gp.kda) {
#pragma unroll
        for (int i = 0; i < PE; ++i) {
          const bool in = e0 + i < K;
          const float dt = gp.dt_bias && in
                               ? detail::load_float(gp.dt_bias, gp.dt_bias_dtype,
                                                    static_cast<int64_t>(hv) * K + e0 + i)
                               : 0.0f;
          const float x = in ? detail::load_float(p.g.ptr, p.g.dtype, g_off + e0 + i) : 0.0f;
          alpha[i] = expf(detail::gate_value(gp.mode, x, dt, A_log, gp.lower_bound));
        }
      } else {
        const float dt = gp.dt_bias ? detail::load_float(gp.dt_bias, gp.dt_bias_dtype, hv) : 0.0f;
        const float a0 = expf(detail::gate_value(
            gp.mode, detail::load_float(p.g.ptr, p.g.dtype, g_off), dt, A_log, gp.lower_bound));
#pragma unroll
        for (int i = 0; i < PE; ++i) alpha[i] = a0;
      }
#pragma unroll
      for (int i = 0; i < PE; ++i) {
        sm.q[j][e0 + i] = q[i];
        sm.k[j][e0 + i] = k[i];
        sm.alpha[j][e0 + i] = alpha[i];
      }
      if (lane == 0) {
        sm.kq[j] = kq;
        sm.beta[j] = detail::beta_value(
            detail::load_float(p.beta.ptr, p.beta.dtype, head_offset(p.beta, seq, tok, hv)),
            p.beta_is_logit, p.round_beta, p.beta.dtype);
      }
    }
    for (int i = threadIdx.x; i < cn * RPC; i += kMultiWarps * 32) {
      const int j = i / RPC, lr = i - j * RPC, vrow = block * RPC + lr;
      sm.v[j][lr] = vrow < V ? detail::load_float(p.v.ptr, p.v.dtype,
                                                  head_offset(p.v, seq, tok0 + c0 + j, hv) + vrow)
                             : 0.0f;
    }
    __syncthreads();

    for (int j = 0; j < cn; ++j) {
      const int64_t t = c0 + j;
      // A tree token starts from its parent's state (the initial one for a parent < 0); the
      // previous token's is already in registers. Each lane reads back only what it stored.
      if (vp.parents.ptr && row >= 0 && t > 0) {
        const int64_t parent = vp.parents.at(n, t);
        if (parent != t - 1) {
          const StateT* src = parent < 0 ? pool + start * p.state.slot_stride
                                         : inter + row * vp.inter_row_stride +
                                               parent * vp.inter_step_stride +
                                               static_cast<int64_t>(hv) * head_elems;
          load_rows<StateT, EPL, R, RG, VEC>(src, row0, V, K, kofs, valid, S);
        }
      }
      float q[EPL], k[EPL], alpha[EPL];
#pragma unroll
      for (int i = 0; i < EPL; ++i) {
        const int e = min(kofs + i, KT - 1);
        q[i] = sm.q[j][e];
        k[i] = sm.k[j][e];
        alpha[i] = sm.alpha[j][e];
      }
      const int vl = local0 + (idx < R ? idx : 0) * RG;
      const float v_here = idx < R ? sm.v[j][vl] : 0.0f;
      StateT* step_dst = row >= 0 ? inter + row * vp.inter_row_stride + t * vp.inter_step_stride +
                                        static_cast<int64_t>(hv) * head_elems
                                  : nullptr;
      const int64_t tslot = vp.token_slots.ptr ? vp.token_slots.at(n, t) : -1;
      StateT* slot_dst = tslot >= 0 ? pool + tslot * p.state.slot_stride
                         : (t == len - 1 && final_slot >= 0)
                             ? pool + final_slot * p.state.slot_stride
                             : nullptr;
      float u_here;
      const float red =
          delta_step_rows<G, R>(S, alpha, k, q, v_here, sm.beta[j], lane, u_here, [&](int r) {
            const int rr = row0 + r * RG;
            if (rr >= V) return;
            const int64_t off = static_cast<int64_t>(rr) * K + kofs;
            if (step_dst) store_state<StateT, EPL, VEC>(step_dst + off, valid, S[r]);
            if (slot_dst) store_state<StateT, EPL, VEC>(slot_dst + off, valid, S[r]);
          });
      store_output_rows<G, R>(p.out, head_offset(p.out, seq, tok0 + t, hv), V, row0, RG, lane, red,
                              u_here, sm.kq[j]);
    }
  }
}

}  // namespace
}  // namespace deltastate::cuda_backend
