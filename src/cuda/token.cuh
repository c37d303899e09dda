// One token in a lane's K slice: the loads of its inputs (q, k, the gate input, beta; v of the
// lane's rows), the head's gate constants, and the token's preparation: the gate (token_gate) and
// q, k normalized with k.q (prepare_qk), from the shared math in core/delta_math.h.
#pragma once

#include <cstdint>
#include <type_traits>

#include "core/delta_math.h"
#include "core/problem.h"
#include "cuda/loads.cuh"
#include "cuda/reduce.cuh"

namespace deltastate::cuda_backend {

using detail::head_offset;

// One token's inputs for one lane: its K slice of q and k, the gate input (its K slice for KDA,
// one scalar for GDN) and beta's input (TokenHeadInputs), plus its rows' v (TokenInputs). T: float
// (converted as loaded), or the input's own type (loaded raw; widen() converts).
template <int EPL, class T = float>
struct TokenHeadInputs {
  T q[EPL], k[EPL], g[EPL], b;
};
template <int EPL, class T>
__device__ __forceinline__ TokenHeadInputs<EPL> widen(const TokenHeadInputs<EPL, T>& r) {
  TokenHeadInputs<EPL> x;
#pragma unroll
  for (int i = 0; i < EPL; ++i) {
    x.q[i] = to_float(r.q[i]);
    x.k[i] = to_float(r.k[i]);
    x.g[i] = to_float(r.g[i]);
  }
  x.b = to_float(r.b);
  return x;
}
template <int EPL, int R>
struct TokenInputs : TokenHeadInputs<EPL> {
  float v[R];
};

template <class In, int EPL, class T, class Problem>
__device__ __forceinline__ void load_token_head(const Problem& p, const detail::HeadInput& gate_in,
                                                const detail::HeadInput& beta_in, int64_t seq,
                                                int64_t tok, int h, int hv, int kofs, int valid,
                                                TokenHeadInputs<EPL, T>& x) {
  auto ld = [](const void* ptr, DType dt, int64_t i) { return load_input<In, T>(ptr, dt, i); };
  const int64_t q_off = head_offset(p.q, seq, tok, h) + kofs;
  const int64_t k_off = head_offset(p.k, seq, tok, h) + kofs;
  const int64_t g_off = head_offset(gate_in, seq, tok, hv);
#pragma unroll
  for (int i = 0; i < EPL; ++i) {
    x.q[i] = i < valid ? ld(p.q.ptr, p.q.dtype, q_off + i) : T{};
    x.k[i] = i < valid ? ld(p.k.ptr, p.k.dtype, k_off + i) : T{};
  }
  if (p.gate.kda) {
#pragma unroll
    for (int i = 0; i < EPL; ++i)
      x.g[i] = i < valid ? ld(gate_in.ptr, gate_in.dtype, g_off + kofs + i) : T{};
  } else {
    x.g[0] = ld(gate_in.ptr, gate_in.dtype, g_off);
    if constexpr (!std::is_same_v<T, float>)  // defined values for widen()
#pragma unroll
      for (int i = 1; i < EPL; ++i) x.g[i] = T{};
  }
  x.b = ld(beta_in.ptr, beta_in.dtype, head_offset(beta_in, seq, tok, hv));
}

template <class In, int EPL, int R, class Problem>
__device__ __forceinline__ void load_token(const Problem& p, const detail::HeadInput& gate_in,
                                           const detail::HeadInput& beta_in, int64_t seq,
                                           int64_t tok, int h, int hv, int kofs, int valid,
                                           int row0, int rg, TokenInputs<EPL, R>& x) {
  const int64_t v_off = head_offset(p.v, seq, tok, hv);
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int row = row0 + r * rg;
    x.v[r] = row < p.V ? In::load(p.v.ptr, p.v.dtype, v_off + row) : 0.0f;
  }
  load_token_head<In>(p, gate_in, beta_in, seq, tok, h, hv, kofs, valid, x);
}

// Per-head gate constants: A_log[hv] and the lane's dt_bias (its K slice for KDA; for GDN the
// head's scalar in every entry, each entry its own cached load: loading it once and copying it
// costs register pressure, and spills, in the 16-bit-state kernels).
// T = uint32_t: their bits as stored (load_float_bits), for a kernel loading ahead; widen()
// converts.
template <int EPL, class T = float>
struct GateConsts {
  T A_log, dt[EPL];
};
template <int EPL, class T>
__device__ __forceinline__ void load_gate_consts(const detail::GateParams& gate, int hv, int K,
                                                 int kofs, int valid, GateConsts<EPL, T>& c) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, uint32_t>, "floats or their bits");
  if constexpr (std::is_same_v<T, float>) {
    c.A_log = gate.A_log ? detail::load_float(gate.A_log, gate.A_log_dtype, hv) : 0.0f;
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      const int64_t idx = gate.kda ? static_cast<int64_t>(hv) * K + kofs + i : hv;
      c.dt[i] = gate.dt_bias && (!gate.kda || i < valid)
                    ? detail::load_float(gate.dt_bias, gate.dt_bias_dtype, idx)
                    : 0.0f;
    }
  } else {  // every load unconditional: an absent tensor or element reads kZeroWord
    c.A_log = load_float_bits(gate.A_log ? gate.A_log : &kZeroWord, gate.A_log_dtype,
                              gate.A_log ? hv : 0);
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      const bool here = gate.dt_bias && (!gate.kda || i < valid);
      const int64_t idx = gate.kda ? static_cast<int64_t>(hv) * K + kofs + i : hv;
      c.dt[i] =
          load_float_bits(here ? gate.dt_bias : &kZeroWord, gate.dt_bias_dtype, here ? idx : 0);
    }
  }
}
template <int EPL>
__device__ __forceinline__ GateConsts<EPL> widen(const detail::GateParams& gate,
                                                 const GateConsts<EPL, uint32_t>& r) {
  GateConsts<EPL> c;
  c.A_log = float_of_bits(r.A_log, gate.A_log_dtype);
#pragma unroll
  for (int i = 0; i < EPL; ++i) c.dt[i] = float_of_bits(r.dt[i], gate.dt_bias_dtype);
  return c;
}

// alpha = exp(g) of one token for the lane's EPL K entries from kofs (GDN: the head's one value
// in every entry), the gate constants loaded here (the decode kernels: GDN loads dt_bias once,
// where load_gate_consts + token_gate cost the 16-bit-state register decode kernels 4 more bytes
// of spills).
template <int EPL>
__device__ __forceinline__ void decode_alpha(const detail::GateParams& gp, const float (&graw)[EPL],
                                             int hv, int K, int kofs, float (&alpha)[EPL]) {
  const float A_log = gp.A_log ? detail::load_float(gp.A_log, gp.A_log_dtype, hv) : 0.0f;
  if (gp.kda) {
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      const float dt = gp.dt_bias ? detail::load_float(gp.dt_bias, gp.dt_bias_dtype,
                                                       static_cast<int64_t>(hv) * K + kofs + i)
                                  : 0.0f;
      alpha[i] = expf(detail::gate_value(gp.mode, graw[i], dt, A_log, gp.lower_bound));
    }
  } else {
    const float dt = gp.dt_bias ? detail::load_float(gp.dt_bias, gp.dt_bias_dtype, hv) : 0.0f;
    const float a0 = expf(detail::gate_value(gp.mode, graw[0], dt, A_log, gp.lower_bound));
#pragma unroll
    for (int i = 0; i < EPL; ++i) alpha[i] = a0;
  }
}

// The gate of one token: log decay g and alpha = exp(g) for the lane's K slice (GDN: broadcast).
template <int EPL>
__device__ __forceinline__ void token_gate(const detail::GateParams& gate, const GateConsts<EPL>& c,
                                           const float (&graw)[EPL], float (&g)[EPL],
                                           float (&alpha)[EPL]) {
  if (gate.kda) {
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      g[i] = detail::gate_value(gate.mode, graw[i], c.dt[i], c.A_log, gate.lower_bound);
      alpha[i] = expf(g[i]);
    }
  } else {
    const float g0 = detail::gate_value(gate.mode, graw[0], c.dt[0], c.A_log, gate.lower_bound);
    const float a0 = expf(g0);
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      g[i] = g0;
      alpha[i] = a0;
    }
  }
}

// Normalizes q and k (optionally), scales q, and returns kq = k.q over the whole K, with one
// 4-value transposed reduction for |q|^2, |k|^2 and q.k.
template <int EPL, int G>
__device__ __forceinline__ float prepare_qk(float (&q)[EPL], float (&k)[EPL], bool l2norm,
                                            float scale, int lane) {
  float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int i = 0; i < EPL; ++i) {
    part[0] += q[i] * q[i];
    part[1] += k[i] * k[i];
    part[2] += q[i] * k[i];
  }
  const float red = transpose_reduce<G, 4>(part, lane);
  const float qq = __shfl_sync(0xffffffffu, red, holder_lane<G, 4>(0), G);
  const float kk = __shfl_sync(0xffffffffu, red, holder_lane<G, 4>(1), G);
  const float qk = __shfl_sync(0xffffffffu, red, holder_lane<G, 4>(2), G);
  if (!l2norm) {
#pragma unroll
    for (int i = 0; i < EPL; ++i) q[i] *= scale;
    return qk * scale;
  }
  // The division form x / den, as divide_by: one IEEE division per vector, not per element
  // (per-element divisions would be ~14% of the decode kernel's instructions).
  const float qd = detail::l2norm_denominator(qq);
  const float kd = detail::l2norm_denominator(kk);
  const float qr = 1.0f / qd, kr = 1.0f / kd;
#pragma unroll
  for (int i = 0; i < EPL; ++i) {
    q[i] = detail::divide_by(q[i], qd, qr) * scale;
    k[i] = detail::divide_by(k[i], kd, kr);
  }
  return detail::divide_by(detail::divide_by(qk, qd, qr), kd, kr) * scale;
}

}  // namespace deltastate::cuda_backend
