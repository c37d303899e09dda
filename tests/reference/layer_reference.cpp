#include "reference/layer_reference.h"

#include <algorithm>
#include <cmath>

namespace ref {

namespace {
double silu_of(double x) { return x / (1.0 + std::exp(-x)); }
}  // namespace

std::vector<double> conv_update(std::vector<double>& window, const std::vector<double>& x,
                                const std::vector<double>& weight, const std::vector<double>& bias,
                                int dim, int state_len, int T, int width, bool silu,
                                int cache_seqlen) {
  std::vector<double> out(static_cast<size_t>(dim) * T);
  for (int c = 0; c < dim; ++c) {
    const double* w = &window[static_cast<size_t>(c) * state_len];
    // the inputs of the conv: width-1 window entries, then x
    std::vector<double> seq;
    if (cache_seqlen < 0) {
      for (int i = 0; i < state_len; ++i) seq.push_back(w[i]);
    } else {
      for (int i = -(width - 1); i < 0; ++i) {
        const int j = ((cache_seqlen + i) % state_len + state_len) % state_len;
        seq.push_back(w[j]);
      }
    }
    for (int t = 0; t < T; ++t) seq.push_back(x[static_cast<size_t>(c) * T + t]);
    const int n = static_cast<int>(seq.size());
    for (int t = 0; t < T; ++t) {
      double acc = bias.empty() ? 0.0 : bias[c];
      const int end = n - T + t;  // seq[end] is token t
      for (int j = 0; j < width; ++j)
        acc += weight[static_cast<size_t>(c) * width + j] * seq[end - (width - 1) + j];
      out[static_cast<size_t>(c) * T + t] = silu ? silu_of(acc) : acc;
    }
    std::vector<double> nw(w, w + state_len);
    if (cache_seqlen < 0) {
      for (int i = 0; i < state_len; ++i) nw[i] = seq[n - state_len + i];
    } else {
      for (int t = 0; t < T; ++t)
        nw[(cache_seqlen + t) % state_len] = x[static_cast<size_t>(c) * T + t];
    }
    for (int i = 0; i < state_len; ++i) window[static_cast<size_t>(c) * state_len + i] = nw[i];
  }
  return out;
}

std::vector<double> conv_verify(std::vector<double>& window, const std::vector<double>& x,
                                const std::vector<double>& weight, const std::vector<double>& bias,
                                int dim, int state_len, int T, int width, bool silu, int accept,
                                const std::vector<int>& parent, std::vector<double>& windows) {
  const int W1 = width - 1;
  std::vector<double> out(static_cast<size_t>(dim) * T);
  windows.assign(static_cast<size_t>(T) * dim * W1, 0.0);
  for (int c = 0; c < dim; ++c) {
    double* w = &window[static_cast<size_t>(c) * state_len];
    const double* xc = &x[static_cast<size_t>(c) * T];
    const int first = accept >= 1 ? accept - 1 : state_len - W1;
    const std::vector<double> hist(w + first, w + first + W1);
    for (int t = 0; t < T; ++t) {
      std::vector<int> ancestors{t};  // t, its parent, ..., token 0
      while (ancestors.back() > 0)
        ancestors.push_back(parent.empty() ? ancestors.back() - 1 : parent[ancestors.back()]);
      std::vector<double> seq = hist;
      for (auto it = ancestors.rbegin(); it != ancestors.rend(); ++it) seq.push_back(xc[*it]);
      const size_t n = seq.size();
      double acc = bias.empty() ? 0.0 : bias[c];
      for (int j = 0; j < width; ++j)
        acc += weight[static_cast<size_t>(c) * width + j] * seq[n - width + j];
      out[static_cast<size_t>(c) * T + t] = silu ? silu_of(acc) : acc;
      for (int i = 0; i < W1; ++i)
        windows[(static_cast<size_t>(t) * dim + c) * W1 + i] = seq[n - W1 + i];
    }
    if (accept >= 1) {
      std::vector<double> nw(w, w + state_len);
      for (int i = 0; i + 1 < W1; ++i) nw[i] = w[accept + i];
      for (int t = 0; t < T; ++t) nw[W1 - 1 + t] = xc[t];
      std::copy(nw.begin(), nw.end(), w);
    } else {
      std::vector<double> all(w, w + state_len);
      all.insert(all.end(), xc, xc + T);
      std::copy(all.end() - state_len, all.end(), w);
    }
  }
  return out;
}

std::vector<double> gated_rms_norm(const std::vector<double>& x, const std::vector<double>& z,
                                   const std::vector<double>& weight, double eps,
                                   const std::function<double(double)>& round_act,
                                   const std::function<double(double)>& round_product) {
  const size_t n = x.size();
  double var = 0.0;
  for (double v : x) var += v * v;
  var /= static_cast<double>(n);
  const double inv = 1.0 / std::sqrt(var + eps);
  std::vector<double> out(n);
  for (size_t i = 0; i < n; ++i)
    out[i] = round_product(weight[i] * round_act(x[i] * inv)) * silu_of(z[i]);
  return out;
}

}  // namespace ref
