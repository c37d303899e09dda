// The math of gated delta-rule decode, defined once for the CPU and CUDA backends: gates, beta,
// the QK L2 norm, one token of the delta rule on a row of S, and the ReplaySSM pieces.
//
// The row functions work on the slice of one state row S[v, :] that the caller holds (the whole
// row on the CPU; a few registers per lane on the GPU). `reduce` completes a partial dot product
// over the threads that share the row: the identity on the CPU, a shuffle butterfly on the GPU.
// `n` is an int (CPU) or a std::integral_constant (GPU: fully unrolled, stays in registers).
#pragma once

#include <cmath>

#include "core/numeric.h"
#include "core/problem.h"

#if defined(__CUDACC__)
#define DS_UNROLL _Pragma("unroll")
#else
#define DS_UNROLL
#endif

namespace deltastate::detail {

constexpr float kSoftplusThreshold = 20.0f;
constexpr float kL2NormEps = 1e-6f;

// softplus with beta = 1 and threshold 20: log(1 + e^x) for x <= 20, else x.
DS_HD float softplus(float x) { return x <= kSoftplusThreshold ? log1pf(expf(x)) : x; }
DS_HD float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// Log-space decay g for one element. `x` is g itself (log_decay) or the raw gate input a.
DS_HD float gate_value(GateMode mode, float x, float dt_bias, float A_log, float lower_bound) {
  switch (mode) {
    case GateMode::softplus: return -expf(A_log) * softplus(x + dt_bias);
    case GateMode::safe: return lower_bound * sigmoid(expf(A_log) * (x + dt_bias));
    default: return x;
  }
}

// beta from its input: sigmoid of a logit, or the probability itself; optionally rounded to the
// input dtype (what the ReplaySSM reference does).
DS_HD float beta_value(float b, bool is_logit, bool round, DType b_dtype) {
  float beta = is_logit ? sigmoid(b) : b;
  return round ? round_to(b_dtype, beta) : beta;
}

// Denominator of the QK L2 norm: x_hat = x / l2norm_denominator(sum x^2) (division form, eps
// inside the square root).
DS_HD float l2norm_denominator(float sum_sq) { return sqrtf(sum_sq + kL2NormEps); }

// One token of the delta rule (spec §0) on one row of S, in this exact order:
//   S <- S*alpha;  u = beta*(v - S.k);  S <- S + u*k;  returns o = S.q
template <class Len, class Reduce>
DS_HD float delta_rule_row(float* s, const float* alpha, const float* k, const float* q, Len n,
                           float v, float beta, Reduce&& reduce) {
  float sk = 0.0f;
  DS_UNROLL
  for (int i = 0; i < n; ++i) {
    s[i] *= alpha[i];
    sk += s[i] * k[i];
  }
  sk = reduce(sk);
  const float u = beta * (v - sk);
  float sq = 0.0f;
  DS_UNROLL
  for (int i = 0; i < n; ++i) {
    s[i] += u * k[i];
    sq += s[i] * q[i];
  }
  return reduce(sq);
}

// ReplaySSM (spec §5).
// Rebuild: S = exp(Gtot) * S0 + sum_j d_j (W_j * k_j)^T with G_j the inclusive prefix sum of the
// ring's g, Gtot = G_{m-1} and W_j = exp(Gtot - G_j). The backends accumulate
// `replay_accumulate_row` once per ring record.
template <class Len>
DS_HD void replay_accumulate_row(float* s, const float* kw, Len n, float d) {
  DS_UNROLL
  for (int i = 0; i < n; ++i) s[i] += d * kw[i];
}

// The current token on a rebuilt row S (before its decay):
//   sq = S.(alpha*q);  sk = S.(alpha*k);  d = beta*(v - sk);  o = sq + d*(k.q)
// q is scaled, k normalized; kq = k.q over the whole K.
template <class Len, class Reduce>
DS_HD void replay_token_row(const float* s, const float* alpha, const float* k, const float* q,
                            Len n, float v, float beta, float kq, Reduce&& reduce, float& d,
                            float& o) {
  float sq = 0.0f, sk = 0.0f;
  DS_UNROLL
  for (int i = 0; i < n; ++i) {
    const float sa = s[i] * alpha[i];
    sq += sa * q[i];
    sk += sa * k[i];
  }
  sq = reduce(sq);
  sk = reduce(sk);
  d = beta * (v - sk);
  o = sq + d * kq;
}

// Flush: the new checkpoint row S0 = S*alpha + d*k.
template <class Len>
DS_HD void replay_flush_row(float* s, const float* alpha, const float* k, Len n, float d) {
  DS_UNROLL
  for (int i = 0; i < n; ++i) s[i] = s[i] * alpha[i] + d * k[i];
}

}  // namespace deltastate::detail
