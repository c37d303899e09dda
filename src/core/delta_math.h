// The math of gated delta-rule decode, defined once for the CPU and CUDA backends: gates, beta,
// the QK L2 norm, one token of the delta rule on a row of S, and the ReplaySSM pieces.
//
// The row functions work on the slice of one state row S[v, :] that the caller holds (the whole
// row on the CPU; a few registers per lane on the GPU, which then completes the partial dot
// products across lanes). `n` is an int (CPU) or a std::integral_constant (GPU: fully unrolled,
// stays in registers).
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
    case GateMode::softplus:
      return -expf(A_log) * softplus(x + dt_bias);
    case GateMode::safe:
      return lower_bound * sigmoid(expf(A_log) * (x + dt_bias));
    default:
      return x;
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

// x / d for many x that share one denominator d, given r = 1.0f / d (one IEEE division per
// vector): the product q = x*r corrected by one Newton step on its exact residual,
// q + r*(x - q*d), with fused multiply-adds (Markstein's theorem: r correctly rounded and q
// within one ulp make the result the correctly rounded quotient, while the residual does not
// underflow). Bit for bit the IEEE division x / d for |x| >= 2^-100 and zeros (their signs
// included) when d is a finite normal float, as the L2 norm's denominator is (>= 1e-3); for
// smaller |x| the residual can underflow and the result differ by one ulp. Three instructions
// on the GPU instead of a division's ~10: the CUDA kernels normalize q and k with it, the CPU
// reference divides (tests/test_numeric.cpp checks the two agree).
DS_HD float divide_by(float x, float d, float r) {
  const float q = x * r;
  const float e = -fmaf(q, d, -x);  // x - q*d, exact; written so that x = -0 gives -0
  return fmaf(e, r, q);
}

// One token of the delta rule on one row S[v, :], in two phases so that a backend can
// complete the dot products of many rows at once between them:
//   phase 1  decay_and_dots:  S <- S*alpha;  sk = S.k;  sq = S.q        (partial over n elements)
//   phase 2  u = delta_u(v, sk, beta) = beta*(v - sk);  rank1_update: S <- S + u*k;
//            o = delta_output(sq, u, kq) = sq + u*(k.q)
// This is the reference's order for the state (decay, u = beta*(v - S.k), rank-1 update), which
// every SGLang kernel keeps, and its equivalent for the output, o = S_new.q = (alpha*S).q +
// u*(k.q), which needs no second pass over S. ReplaySSM is the same computation: its
// sq = S.(alpha*q), sk = S.(alpha*k), d = u, and its flush S0 <- S*alpha + d*k is phase 2's
// update.
template <class Len>
DS_HD void decay_and_dots(float* s, const float* alpha, const float* k, const float* q, Len n,
                          float& sk, float& sq) {
  sk = 0.0f;
  sq = 0.0f;
  DS_UNROLL
  for (int i = 0; i < n; ++i) {
    s[i] *= alpha[i];
    sk += s[i] * k[i];
    sq += s[i] * q[i];
  }
}

DS_HD float delta_u(float v, float sk, float beta) { return beta * (v - sk); }

// s <- s * f elementwise (the decay alpha, or ReplaySSM's exp(Gtot)).
template <class Len>
DS_HD void scale_row(float* s, const float* f, Len n) {
  DS_UNROLL
  for (int i = 0; i < n; ++i) s[i] *= f[i];
}

template <class Len>
DS_HD void rank1_update(float* s, const float* k, Len n, float u) {
  DS_UNROLL
  for (int i = 0; i < n; ++i) s[i] += u * k[i];
}

DS_HD float delta_output(float sq, float u, float kq) { return sq + u * kq; }

// One element of a ReplaySSM record replayed onto a row, s <- s*alpha + d*k: phase 2's update
// after the decay, the product and sum fused as every backend's replay does (the CPU's simd.h
// scale then fma), so a rebuilt row equals the recurrence's bit for bit.
DS_HD float replay_element(float s, float alpha, float d, float k) { return fmaf(d, k, s * alpha); }

// ReplaySSM (SGLang's basic mode). A row with cursor m (records 0..m-1 in its ring of L) flushes
// this step when its ring is full or a flush is forced; the cursor then becomes 0, else m + 1.
DS_HD bool replay_flushes(int m, int L, bool forced) { return m >= L - 1 || forced; }
// SGLang's circular mode: a natural flush (ring full, not forced, L > 1) is a history checkpoint
// (S0 <- the state before the token, and the token's record is still appended); a forced flush,
// or any flush at L = 1, folds the token in and appends nothing. In the basic mode every flush
// folds. Record j of a circular ring lies at (base + j) mod L (base in [0, L-1], j < L).
DS_HD bool replay_history_flush(int m, int L, bool forced, bool circular) {
  return circular && m >= L - 1 && !forced && L > 1;
}
DS_HD bool replay_full_flush(int m, int L, bool forced, bool circular) {
  return circular ? (forced || L == 1) : replay_flushes(m, L, forced);
}
DS_HD int replay_position(int base, int j, int L) {
  const int q = base + j;
  return q >= L ? q - L : q;
}
// The caller's cursor rule after a step of a row with cursor m and base `base` (SGLang's
// _advance_replayssm_predecay_cursor; the basic ring keeps base 0): a forced flush -> (0, 0) in
// circular mode; a history checkpoint -> (1, (base + m) mod L); any other fold -> (0, base);
// otherwise (m + 1, base).
DS_HD void replay_advance(int m, int L, bool forced, bool circular, int& wp, int& base) {
  if (circular && forced) {
    wp = 0;
    base = 0;
  } else if (replay_history_flush(m, L, forced, circular)) {
    wp = 1;
    base = replay_position(base, m, L);
  } else {
    wp = replay_full_flush(m, L, forced, circular) ? 0 : m + 1;
  }
}
// The state before the token, on a flush: S = exp(Gtot) * S0 + sum_j d_j (W_j * k_j)^T with G_j
// the inclusive prefix sums of the ring's g, Gtot = G_{m-1}, W_j = exp(Gtot - G_j): scale_row by
// exp(Gtot), then one rank1_update per record (kw = W_j * k_j for KDA; GDN folds its scalar W_j
// into d_j). The token then folds in as S0 <- alpha*S + d*k: scale_row, rank1_update.

}  // namespace deltastate::detail
