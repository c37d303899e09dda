// The CUDA-core fallback of chunked prefill: every problem the tensor-core kernel does not take
// (K != V, K or V other than 64/128, fp32 or mixed-dtype q/k/v, rows not 16-byte aligned, a
// device with too little shared memory). One CTA of 256 threads per (sequence, value head) runs
// the token-by-token recurrence of ops.h in fp32:
//   S <- S diag(alpha);  u = beta (v - S k);  S <- S + u k^T;  o = S q,
// with the state in shared memory when it fits (K * V <= kFallbackSmemStateElems), else in the
// caller's workspace (one [V, K] fp32 block per CTA). Each warp owns rows v = warp, warp + 8, ...;
// its lanes stride over the row's K elements (conflict-free in shared memory, coalesced in
// global), so the dot products S[v,:].k and S[v,:].q are warp reductions. Three barriers per
// token. Its results equal the CPU's chunked kernel to fp32 rounding (the two are exact
// rewritings of the same recurrence; tests/test_chunk_prefill.cpp measures the CPU pair at
// 6.6e-7); it is slow (~1 us per token and head) and meant for the shapes nobody runs in
// production. Part of chunk_prefill.cu's translation unit.
#pragma once

#include <cstdint>

#include "core/delta_math.h"
#include "cuda/chunk_prefill/sequence.cuh"
#include "cuda/grid.cuh"
#include "cuda/state_format.cuh"

namespace deltastate::cuda_backend::prefill {

constexpr int kFallbackThreads = 256;
// States up to this many elements (K = V = 128) live in shared memory (64 KB, which every
// device of compute capability 7.0 and up can give a CTA); larger ones in the workspace.
constexpr int64_t kFallbackSmemStateElems = 16384;

// Dynamic shared memory of the fallback kernel: the state (when it fits) and one token's q, k,
// decay (K each), v (V) and the reductions.
inline int64_t fallback_smem_bytes(int K, int V) {
  const int64_t state =
      static_cast<int64_t>(K) * V <= kFallbackSmemStateElems ? static_cast<int64_t>(K) * V : 0;
  return 4 * (state + 3LL * K + V + 8);
}

__global__ void __launch_bounds__(kFallbackThreads)
    chunk_prefill_fallback_kernel(const ChunkPrefillProblem p, bool trigger_early) {
  enter_grid(trigger_early);
  extern __shared__ float4 fallback_smem4[];
  float* const smem = reinterpret_cast<float*>(fallback_smem4);
  constexpr int NW = kFallbackThreads / 32;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int K = p.K, V = p.V;
  const int64_t E = head_elems(p);
  const int64_t task = blockIdx.x;
  const Seq s = resolve_sequence(p, task);
  if (skip_sequence(p, s, tid, kFallbackThreads)) return;
  const bool in_smem = E <= kFallbackSmemStateElems;
  float* const S = in_smem ? smem : static_cast<float*>(p.workspace) + task * E;
  float* const q = smem + (in_smem ? E : 0);
  float* const k = q + K;
  float* const alpha = k + K;  // [K] (GDN: alpha[0])
  float* const v = alpha + K;  // [V]
  float* const red = v + V;    // [0] q norm factor, [1] k norm factor, [2] beta

  const detail::GateParams& gate = p.gate;
  const float A_log = gate.A_log ? detail::load_float(gate.A_log, gate.A_log_dtype, s.hv) : 0.0f;
  if (s.reads_state && p.state.formatted()) {
    const fmt::HeadRows h = fmt::head_rows(p.state, s.slot, s.hv, V, K);
    for (int64_t i = tid; i < E; i += kFallbackThreads)
      S[i] = fmt::load_elem(p.state.ptr, p.state.dtype, h, static_cast<int>(i / K), i);
  } else {
    for (int64_t i = tid; i < E; i += kFallbackThreads)
      S[i] = s.reads_state ? detail::load_float(p.state.ptr, p.state.dtype,
                                                s.slot * p.state.slot_stride + s.hv * E + i)
                           : 0.0f;
  }

  // A pool slot in the pool's format: each warp its rows of the update (a row's amax over its
  // lanes), after a barrier (a sequence without tokens stores what the load's mapping wrote;
  // every thread takes this branch alike).
  auto store = [&](void* base, DType dtype, int64_t off, int64_t slot) {
    if (slot < 0 || !p.state.formatted()) {
      for (int64_t i = tid; i < E; i += kFallbackThreads)
        detail::store_float(base, dtype, off + i, S[i]);
      return;
    }
    __syncthreads();
    const fmt::HeadRows h = fmt::head_rows(p.state, slot, s.hv, V, K);
    const bool quant = fmt::quantized(p.state.dtype);
    for (int r = warp; r < V; r += NW) {
      const float* row = S + static_cast<int64_t>(r) * K;
      float scale = 1.0f;
      if (quant) {
        float amax = 0.0f;
        for (int c = lane; c < K; c += 32) amax = detail::amax_step(amax, row[c]);
#pragma unroll
        for (int d = 16; d > 0; d >>= 1)
          amax = detail::amax_step(amax, __shfl_xor_sync(0xffffffffu, amax, d));
        scale = fmt::fresh_scale(p.state.dtype, amax);
        if (lane == 0) h.scales[r] = scale;
      }
      for (int c = lane; c < K; c += 32)
        fmt::store_elem(p.state.ptr, p.state.dtype, h, static_cast<int64_t>(r) * K + c, row[c],
                        scale);
    }
  };

  for (int64_t t = 0; t < s.len; ++t) {
    const int64_t tok = s.tok0 + t;
    // The token's inputs (the previous token's barrier ordered their reuse).
    const int64_t q_off = head_offset(p.q, s.seq, tok, s.h),
                  k_off = head_offset(p.k, s.seq, tok, s.h);
    const int64_t g_off = head_offset(p.g, s.seq, tok, s.hv);
    for (int c = tid; c < K; c += kFallbackThreads) {
      q[c] = detail::load_float(p.q.ptr, p.q.dtype, q_off + c);
      k[c] = detail::load_float(p.k.ptr, p.k.dtype, k_off + c);
      if (gate.kda) {
        const float dt = gate.dt_bias ? detail::load_float(gate.dt_bias, gate.dt_bias_dtype,
                                                           static_cast<int64_t>(s.hv) * K + c)
                                      : 0.0f;
        alpha[c] =
            expf(detail::gate_value(gate.mode, detail::load_float(p.g.ptr, p.g.dtype, g_off + c),
                                    dt, A_log, gate.lower_bound));
      }
    }
    const int64_t v_off = head_offset(p.v, s.seq, tok, s.hv);
    for (int e = tid; e < V; e += kFallbackThreads)
      v[e] = detail::load_float(p.v.ptr, p.v.dtype, v_off + e);
    if (tid == 0) {
      if (!gate.kda) {
        const float dt =
            gate.dt_bias ? detail::load_float(gate.dt_bias, gate.dt_bias_dtype, s.hv) : 0.0f;
        alpha[0] = expf(detail::gate_value(gate.mode, detail::load_float(p.g.ptr, p.g.dtype, g_off),
                                           dt, A_log, gate.lower_bound));
      }
      red[2] = detail::beta_value(
          detail::load_float(p.beta.ptr, p.beta.dtype, head_offset(p.beta, s.seq, tok, s.hv)),
          p.beta_is_logit, false, p.beta.dtype);
    }
    __syncthreads();
    // The L2 norms (the CPU's division form, then the scale).
    if (warp == 0) {
      float qq = 0.0f, kk = 0.0f;
      for (int c = lane; c < K; c += 32) {
        qq += q[c] * q[c];
        kk += k[c] * k[c];
      }
      qq = warp_sum(qq);
      kk = warp_sum(kk);
      if (lane == 0) {
        red[0] = p.l2norm ? detail::l2norm_denominator(qq) : 1.0f;
        red[1] = p.l2norm ? detail::l2norm_denominator(kk) : 1.0f;
      }
    }
    __syncthreads();
    const float qd = red[0], kd = red[1], beta = red[2];
    for (int c = tid; c < K; c += kFallbackThreads) {
      q[c] = q[c] / qd * p.scale;
      k[c] = k[c] / kd;
    }
    __syncthreads();
    // Each warp's rows: decay and S k, then the update and S q.
    for (int r = warp; r < V; r += NW) {
      float* row = S + static_cast<int64_t>(r) * K;
      float sk = 0.0f;
      for (int c = lane; c < K; c += 32) {
        const float x = row[c] * (gate.kda ? alpha[c] : alpha[0]);
        row[c] = x;
        sk += x * k[c];
      }
      const float u = detail::delta_u(v[r], warp_sum(sk), beta);
      float sq = 0.0f;
      for (int c = lane; c < K; c += 32) {
        const float x = row[c] + u * k[c];
        row[c] = x;
        sq += x * q[c];
      }
      sq = warp_sum(sq);
      if (lane == 0)
        detail::store_float(p.out.ptr, p.out.dtype, head_offset(p.out, s.seq, tok, s.hv) + r, sq);
    }
    __syncthreads();
    if (checkpoint_at(p, t + 1)) store_checkpoint(p, s, (t + 1) / p.checkpoint_every - 1, store);
  }
  store_final_states(p, s, store);
}

}  // namespace deltastate::cuda_backend::prefill
