// An independent fp64 reference of gated delta-rule decode, written from the semantics of
// SGLang's kernels (fused_recurrent_gated_delta_rule_packed_decode,
// fused_recurrent_kda_packed_decode, fused_sigmoid_gating_delta_rule_update,
// fused_recurrent_linear_replayssm_decode in basic mode): the gates, the q/k L2 norm and the
// per-token delta-rule order. Plain loops over doubles; it shares no code with the library and
// knows nothing about its tensors, dtypes or kernels. Tests read the library's inputs back as
// doubles (after rounding them to their storage dtype), run this, and compare.
#pragma once

#include <functional>
#include <vector>

namespace ref {

enum class Gate {
  log_decay,  // the gate input is g itself (alpha = exp(g))
  standard,   // g = -exp(A_log) * softplus(a + dt_bias), softplus threshold 20
  safe,       // g = lower_bound * sigmoid(exp(A_log) * (a + dt_bias))
};

struct Config {
  int H = 0, HV = 0, K = 0, V = 0;
  bool kda = false;  // g is a K-vector per value head (else a scalar)
  Gate gate = Gate::standard;
  double lower_bound = 0.0;
  std::vector<double> A_log;    // [HV]
  std::vector<double> dt_bias;  // GDN [HV], KDA [HV*K]; empty = zeros
  bool beta_is_logit = true;
  // Optional storage rounding of beta after the sigmoid (ReplaySSM rounds beta to b's dtype).
  std::function<double(double)> round_beta;
  bool l2norm = true;
  double scale = 1.0;

  int group() const { return HV / H; }
  int gate_width() const { return kda ? K : 1; }
};

// One token of every head.
struct Token {
  std::vector<double> q, k;  // [H*K], raw (before the L2 norm)
  std::vector<double> v;     // [HV*V]
  std::vector<double> g;     // gate input: GDN [HV], KDA [HV*K] (log decay or raw a)
  std::vector<double> beta;  // [HV]: logit or probability (Config::beta_is_logit)
};

using State = std::vector<double>;  // [HV, V, K], K fastest

double softplus(double x);  // log(1+e^x) for x <= 20, else x
double sigmoid(double x);
// x / sqrt(sum x^2 + 1e-6)
std::vector<double> l2_normalize(const double* x, int n);

// The log-space decay of value head hv: K values (GDN: the scalar repeated).
std::vector<double> log_decay(const Config& c, const Token& t, int hv);
double beta_of(const Config& c, const Token& t, int hv);
// The prepared q (normalized, scaled) and k (normalized) of key head h.
std::vector<double> prepared_q(const Config& c, const Token& t, int h);
std::vector<double> prepared_k(const Config& c, const Token& t, int h);

// One token of the delta rule on S, in the reference order: decay S by alpha, u = beta (v - S k),
// S += u k^T, o = S q; returns o [HV*V].
std::vector<double> step(const Config& c, const Token& t, State& S);

// ---- ReplaySSM (fused_recurrent_linear_replayssm_decode, basic mode) ---------------------------
// The ring of one slot, as stored: d [HV][L][V], k [H][L][K] (normalized, unscaled keys),
// g [HV][L][gate_width] (log decay).
struct Ring {
  int L = 0;
  std::vector<double> d, k, g;
};

struct ReplayResult {
  std::vector<double> out;  // [HV*V]
  bool flushed = false;
  State checkpoint;         // the new checkpoint (the old one when not flushed)
  // The record appended at the cursor when not flushed: d [HV*V], k [H*K], g [HV*gate_width].
  std::vector<double> d, k, g;
};

// One ReplaySSM step of one row with cursor m (0 <= m < L): rebuild S from the checkpoint S0 and
// the first m ring records, run the current token, then flush (m == L-1 or force_flush) or record.
ReplayResult replay_step(const Config& c, const Token& t, const State& S0, const Ring& ring, int m,
                         bool force_flush);

}  // namespace ref
