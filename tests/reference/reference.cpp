#include "reference/reference.h"

#include <cmath>

namespace ref {

double softplus(double x) { return x <= 20.0 ? std::log1p(std::exp(x)) : x; }
double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

std::vector<double> l2_normalize(const double* x, int n) {
  double ss = 0.0;
  for (int i = 0; i < n; ++i) ss += x[i] * x[i];
  const double den = std::sqrt(ss + 1e-6);
  std::vector<double> y(x, x + n);
  for (double& e : y) e /= den;
  return y;
}

std::vector<double> log_decay(const Config& c, const Token& t, int hv) {
  const int w = c.gate_width();
  std::vector<double> g(c.K);
  for (int i = 0; i < w; ++i) {
    const double in = t.g[static_cast<size_t>(hv) * w + i];
    const double dt = c.dt_bias.empty() ? 0.0 : c.dt_bias[static_cast<size_t>(hv) * w + i];
    const double x = in + dt;
    switch (c.gate) {
      case Gate::log_decay:
        g[i] = in;
        break;
      case Gate::standard:
        g[i] = -std::exp(c.A_log[hv]) * softplus(x);
        break;
      case Gate::safe:
        g[i] = c.lower_bound * sigmoid(std::exp(c.A_log[hv]) * x);
        break;
    }
  }
  if (!c.kda)
    for (int i = 1; i < c.K; ++i) g[i] = g[0];
  return g;
}

double beta_of(const Config& c, const Token& t, int hv) {
  double beta = c.beta_is_logit ? sigmoid(t.beta[hv]) : t.beta[hv];
  if (c.round_beta) beta = c.round_beta(beta);
  return beta;
}

std::vector<double> prepared_q(const Config& c, const Token& t, int h) {
  const double* raw = t.q.data() + static_cast<size_t>(h) * c.K;
  std::vector<double> q = c.l2norm ? l2_normalize(raw, c.K) : std::vector<double>(raw, raw + c.K);
  for (double& e : q) e *= c.scale;
  return q;
}

std::vector<double> prepared_k(const Config& c, const Token& t, int h) {
  const double* raw = t.k.data() + static_cast<size_t>(h) * c.K;
  return c.l2norm ? l2_normalize(raw, c.K) : std::vector<double>(raw, raw + c.K);
}

std::vector<double> step(const Config& c, const Token& t, State& S) {
  const int K = c.K, V = c.V;
  std::vector<double> out(static_cast<size_t>(c.HV) * V);
  for (int hv = 0; hv < c.HV; ++hv) {
    const int h = hv / c.group();
    const std::vector<double> q = prepared_q(c, t, h);
    const std::vector<double> k = prepared_k(c, t, h);
    const std::vector<double> g = log_decay(c, t, hv);
    const double beta = beta_of(c, t, hv);
    for (int v = 0; v < V; ++v) {
      double* s = S.data() + (static_cast<size_t>(hv) * V + v) * K;
      // 1. S <- S * alpha (per column k for KDA)
      for (int i = 0; i < K; ++i) s[i] *= std::exp(g[i]);
      // 2. u = v - S k
      double sk = 0.0;
      for (int i = 0; i < K; ++i) sk += s[i] * k[i];
      double u = t.v[static_cast<size_t>(hv) * V + v] - sk;
      // 3. u <- beta * u
      u *= beta;
      // 4. S <- S + u k^T
      for (int i = 0; i < K; ++i) s[i] += u * k[i];
      // 5. o = S q
      double o = 0.0;
      for (int i = 0; i < K; ++i) o += s[i] * q[i];
      out[static_cast<size_t>(hv) * V + v] = o;
    }
  }
  return out;
}

ReplayResult replay_step(const Config& c, const Token& t, const State& S0, const Ring& ring, int m,
                         bool force_flush) {
  const int K = c.K, V = c.V, HV = c.HV, H = c.H, L = ring.L, w = c.gate_width();
  ReplayResult r;
  r.flushed = (m == L - 1) || force_flush;
  r.out.assign(static_cast<size_t>(HV) * V, 0.0);
  r.checkpoint = S0;
  if (!r.flushed) {
    r.d.assign(static_cast<size_t>(HV) * V, 0.0);
    r.k.assign(static_cast<size_t>(H) * K, 0.0);
    r.g.assign(static_cast<size_t>(HV) * w, 0.0);
  }
  for (int hv = 0; hv < HV; ++hv) {
    const int h = hv / c.group();
    // Ring records j < m: G_j inclusive prefix sums (per K for KDA), Gtot = G_{m-1}.
    std::vector<std::vector<double>> G(m, std::vector<double>(K, 0.0));
    std::vector<double> Gtot(K, 0.0);
    for (int j = 0; j < m; ++j) {
      for (int i = 0; i < K; ++i) {
        const double gj = ring.g[(static_cast<size_t>(hv) * L + j) * w + (c.kda ? i : 0)];
        G[j][i] = (j ? G[j - 1][i] : 0.0) + gj;
      }
    }
    if (m > 0) Gtot = G[m - 1];
    // S = exp(Gtot) * S0 + sum_j d_j (W_j * k_j)^T,  W_j = exp(Gtot - G_j)
    State S(static_cast<size_t>(V) * K);
    for (int v = 0; v < V; ++v)
      for (int i = 0; i < K; ++i) {
        const size_t e = (static_cast<size_t>(hv) * V + v) * K + i;
        double s = std::exp(Gtot[i]) * S0[e];
        for (int j = 0; j < m; ++j) {
          const double d = ring.d[(static_cast<size_t>(hv) * L + j) * V + v];
          const double kj = ring.k[(static_cast<size_t>(h) * L + j) * K + i];
          s += d * std::exp(Gtot[i] - G[j][i]) * kj;
        }
        S[static_cast<size_t>(v) * K + i] = s;
      }
    // The current token.
    const std::vector<double> q = prepared_q(c, t, h);
    const std::vector<double> k = prepared_k(c, t, h);
    const std::vector<double> g = log_decay(c, t, hv);
    const double beta = beta_of(c, t, hv);
    double kq = 0.0;
    for (int i = 0; i < K; ++i) kq += k[i] * q[i];
    for (int v = 0; v < V; ++v) {
      const double* s = S.data() + static_cast<size_t>(v) * K;
      double sq = 0.0, sk = 0.0;
      for (int i = 0; i < K; ++i) {
        const double a = std::exp(g[i]);
        sq += s[i] * a * q[i];
        sk += s[i] * a * k[i];
      }
      const double d = beta * (t.v[static_cast<size_t>(hv) * V + v] - sk);
      r.out[static_cast<size_t>(hv) * V + v] = sq + d * kq;
      if (r.flushed) {  // S0 <- S * a + d k^T
        for (int i = 0; i < K; ++i)
          r.checkpoint[(static_cast<size_t>(hv) * V + v) * K + i] =
              s[i] * std::exp(g[i]) + d * k[i];
      } else {
        r.d[static_cast<size_t>(hv) * V + v] = d;
      }
    }
    if (!r.flushed) {
      for (int i = 0; i < w; ++i) r.g[static_cast<size_t>(hv) * w + i] = g[i];
      if (hv % c.group() == 0)
        for (int i = 0; i < K; ++i) r.k[static_cast<size_t>(h) * K + i] = k[i];
    }
  }
  return r;
}

}  // namespace ref
