// Chunked prefill (FLA's chunk_gated_delta_rule / chunk_kda, FlashInfer's state checkpoints)
// against the fp64 token-by-token recurrence (reference/prefill_reference.h) and against the
// recurrent op on the same inputs: varlen batches mixing lengths 0, 1, 63, 64, 65, 1000 and 8192,
// padded sequences, has_initial_state 0, final states in place or to output_state_indices,
// envelope pools with sentinel gaps, checkpoints into pool slots or a dense buffer, dense initial
// and final states, fp32 / bf16 / fp16 states and activations, K != V, GVA, GDN and KDA (softplus
// and safe gates, log-space gates), beta as logit or probability. Outputs, final states,
// checkpoints and the workspace are poisoned with NaN before every call; memory the op must not
// write (pool gaps, unused and read-only slots, spare checkpoint rows, inputs) is compared byte
// for byte.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <numeric>

#include "reference/prefill_reference.h"
#include "test_util.h"

namespace dstest {
namespace {

using deltastate::ChunkPrefillArgs;

// ---- tolerances -------------------------------------------------------------------------------
// The kernel computes in fp32 what the reference computes in fp64 one token at a time; the two
// differ by fp32 rounding in another order of operations (the chunk's matrices, the triangular
// solve, the chunk-to-chunk state recurrence). The error is measured over a whole sequence (all
// its output rows, or one state over all heads) as a norm relative to the reference's norm,
// after granting each element the half ulp that storing it in a narrower dtype costs (bf16 and
// fp16 outputs and states are rounded once on store, the reference is not; the inputs are
// rounded to their dtype before either side reads them, so they add nothing). Measured on these
// cases: at most 4.3e-7 for the outputs and 1.1e-6 for states (the 8192-token GDN sequence's
// checkpoints: the fp32 error grows with the number of chunks the state crosses); the bound
// leaves a margin of ~9x.
constexpr double kRelTol = 1e-5;
// Chunked against recurrent, both fp32 on the CPU: each differs from the exact result by the
// above, and each rounded its stored values on its own (two half ulps). Measured: at most 6.6e-7.
constexpr double kRelTolVsRecurrent = 2e-5;

// Prints every measured error when DSTEST_PRINT_ERRORS is set (to recalibrate the bounds).
void report(const std::string& what, double rel) {
  static const bool on = std::getenv("DSTEST_PRINT_ERRORS") != nullptr;
  if (on) std::cout << "  rel error " << what << ": " << rel << "\n";
}

// ||max(|got - want| - slack, 0)|| / ||want||, slack = `rounded` half ulps of `stored_as`.
::testing::AssertionResult rel_close(const std::vector<double>& got,
                                     const std::vector<double>& want, double tol, DType stored_as,
                                     const std::string& what, int rounded = 1) {
  if (got.size() != want.size())
    return ::testing::AssertionFailure()
           << what << ": " << got.size() << " values, want " << want.size();
  double err2 = 0.0, ref2 = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i]))
      return ::testing::AssertionFailure() << what << ": element " << i << " is " << got[i];
    const double slack =
        stored_as == DType::f32
            ? 0.0
            : rounded * half_ulp(stored_as, std::max(std::abs(got[i]), std::abs(want[i])));
    const double d = std::abs(got[i] - want[i]) - slack;
    if (d > 0) err2 += d * d;
    ref2 += want[i] * want[i];
  }
  const double rel = std::sqrt(err2) / std::max(std::sqrt(ref2), 1e-30);
  report(what, rel);
  if (rel <= tol) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": relative error " << rel << " > " << tol;
}

std::vector<double> concat(const std::vector<std::vector<double>>& rows) {
  std::vector<double> all;
  for (const auto& r : rows) all.insert(all.end(), r.begin(), r.end());
  return all;
}

// ---- inputs -----------------------------------------------------------------------------------
// Decay rates spread over three decades per value head, so that some heads carry their state
// across many chunks and others decay by hundreds within one chunk (underflow, and the overflow
// hazard of KDA's per-channel factors). Log gates: g = -rate_hv * U(0, 1) per element; raw gates:
// A_log ~ U(-8, 0.5) (the safe gate stays in (lower_bound, 0) whatever A_log is).
void vary_decay(RecurrentBatch& rb, Rng& rng) {
  const Shape& s = rb.spec.s;
  if (rb.spec.gate_in_kernel) {
    for (int64_t hv = 0; hv < s.HV; ++hv) rb.A_log.set_linear(hv, rng.uniform(-8.0, 0.5));
    return;
  }
  std::vector<double> rate(static_cast<size_t>(s.HV));
  for (double& r : rate) r = std::pow(10.0, rng.uniform(-2.5, 0.5));
  const int64_t width = rb.spec.kda ? s.K : 1;
  for (int64_t i = 0; i < rb.g.numel(); ++i)
    rb.g.set_linear(i, -rate[(i / width) % s.HV] * rng.uniform(0.0, 1.0));
}

// Without the in-kernel L2 norm, q and k of norm ~1 keep the recurrence contractive.
void unit_scale_qk(RecurrentBatch& rb, Rng& rng) {
  const double sd = 1.0 / std::sqrt(static_cast<double>(rb.spec.s.K));
  rb.q.fill_normal(rng, sd);
  rb.k.fill_normal(rng, sd);
}

ChunkPrefillArgs prefill_args(const RecurrentBatch& rb) {
  ChunkPrefillArgs a;
  a.q = rb.q.view();
  a.k = rb.k.view();
  a.v = rb.v.view();
  a.g = rb.g.view();
  a.beta = rb.beta.view();
  a.out = rb.out.view();
  a.is_kda = rb.spec.kda;
  a.gate_in_kernel = rb.spec.gate_in_kernel;
  if (rb.spec.gate_in_kernel) {
    a.A_log = rb.A_log.view();
    a.dt_bias = rb.dt_bias.view();
    a.lower_bound = rb.spec.lower_bound;
  }
  a.beta_is_logit = rb.spec.beta_is_logit;
  if (!rb.spec.seqlens.empty()) a.cu_seqlens = rb.cu.view();
  return a;
}

// A workspace of the size the op asks for, poisoned with NaN (its contents must not matter).
Tensor make_workspace(const ChunkPrefillArgs& a) {
  const int64_t bytes = deltastate::chunk_prefill_workspace_bytes(a);
  Tensor w = Tensor::contiguous(DType::f32, {std::max<int64_t>(1, (bytes + 3) / 4)});
  w.fill_all(std::nan(""));
  return w;
}

std::vector<ref::Token> tokens_of(const RecurrentBatch& rb, int64_t n) {
  std::vector<ref::Token> t;
  for (int64_t i = 0; i < rb.seq_len(n); ++i) t.push_back(rb.token(n, i));
  return t;
}

std::vector<double> out_rows(const RecurrentBatch& rb, int64_t n) {
  std::vector<double> o;
  for (int64_t t = 0; t < rb.seq_len(n); ++t) {
    const std::vector<double> r = rb.out_token(n, t);
    o.insert(o.end(), r.begin(), r.end());
  }
  return o;
}

// ---- against the fp64 reference -----------------------------------------------------------------
enum class StateMode {
  pool,   // [slots, HV, V, K] with initial_state_indices
  dense,  // [N, HV, V, K] initial_state, read only
  none,   // every sequence starts from S = 0
};
enum class Ckpt { none, slots, dense };

struct PrefillCase {
  const char* name;
  RecurrentSpec spec;
  StateMode mode = StateMode::pool;
  DType state = f32;            // pool / dense initial state, final_state and checkpoint dtype
  std::vector<int64_t> padded;  // pool: sequences with index -1
  std::vector<int64_t> fresh;   // has_initial_state = 0
  bool redirect = false;        // pool: output_state_indices (the first live sequence's: -1)
  bool final_state = false;
  Ckpt ckpt = Ckpt::none;
  int64_t every = 64;
  int64_t slot_pad = 0, lead = 0;
  bool l2norm = true;
  double scale = 0.0;  // 0: the default K^-0.5 (not passed)
};
inline void PrintTo(const PrefillCase& c, std::ostream* os) { *os << c.name; }

bool contains(const std::vector<int64_t>& v, int64_t x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

class ChunkPrefillVsReference : public ::testing::TestWithParam<PrefillCase> {};

TEST_P(ChunkPrefillVsReference, Run) {
  const PrefillCase& c = GetParam();
  Rng rng = test_rng();
  RecurrentBatch rb = make_recurrent_batch(rng, c.spec);
  vary_decay(rb, rng);
  if (!c.l2norm) unit_scale_qk(rb, rng);
  const Shape& s = c.spec.s;
  const int64_t N = rb.N, E = s.state_elems();
  const int64_t every = c.ckpt == Ckpt::none ? 0 : c.every;
  const bool pooled = c.mode == StateMode::pool;
  auto padded = [&](int64_t n) { return pooled && contains(c.padded, n); };

  // Checkpoint positions: sequence n's checkpoints start at cu_starts[n].
  std::vector<int64_t> cu_starts{0};
  for (int64_t n = 0; n < N; ++n)
    cu_starts.push_back(cu_starts.back() + (every ? rb.seq_len(n) / every : 0));
  const int64_t total = cu_starts.back();

  // States: slots drawn at random from one shuffled pool for initial, output and checkpoint slots.
  Tensor pool, idx, out_idx, ck_idx, has_initial, final_state, ckpts, cu_starts_t;
  std::vector<int64_t> in_slot(N, -1), out_slot(N, -1), ck_slot(total, -1);
  if (pooled) {
    const int64_t slots = 2 * N + total + 3;
    pool = make_pool(c.state, slots, s, c.slot_pad, c.lead);
    std::vector<int64_t> perm(slots);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng.engine());
    size_t next = 0;
    for (int64_t n = 0; n < N; ++n) in_slot[n] = padded(n) ? -1 : perm[next++];
    // Fresh sequences' slots too: they must not be read.
    fill_live_slots(pool.view(), in_slot, rng);
    bool first_live = true;
    for (int64_t n = 0; n < N; ++n) {
      out_slot[n] = in_slot[n];
      if (c.redirect && !padded(n)) {
        out_slot[n] = first_live ? -1 : perm[next++];
        first_live = false;
      }
    }
    for (int64_t i = 0; i < total; ++i) ck_slot[i] = i % 3 == 2 ? -1 : perm[next++];
    idx = index_tensor(in_slot, c.spec.index_dtype);
    if (c.redirect) out_idx = index_tensor(out_slot, c.spec.index_dtype);
    if (c.ckpt == Ckpt::slots) ck_idx = index_tensor(ck_slot, c.spec.index_dtype);
  } else if (c.mode == StateMode::dense) {
    pool = make_pool(c.state, N, s, c.slot_pad, c.lead);
    for (int64_t n = 0; n < N; ++n) fill_slot(pool.view(), n, rng);
  }
  if (!c.fresh.empty()) {
    std::vector<int64_t> has(N, 1);
    for (int64_t n : c.fresh) has[n] = 0;
    has_initial = index_tensor(has, c.spec.index_dtype);
  }
  if (c.final_state) {
    final_state = Tensor::contiguous(c.state, {N, s.HV, s.V, s.K});
    final_state.fill_all(std::nan(""));
  }
  if (every) cu_starts_t = index_tensor(cu_starts, c.spec.index_dtype);
  if (c.ckpt == Ckpt::dense) {
    ckpts = Tensor::contiguous(c.state, {total + 2, s.HV, s.V, s.K});  // two spare rows
    ckpts.fill_all(std::nan(""));
  }

  // The reference, from each sequence's initial state.
  const double scale = c.scale > 0 ? c.scale : 1.0 / std::sqrt(static_cast<double>(s.K));
  ref::Config cfg = rb.config(scale);
  cfg.l2norm = c.l2norm;
  std::vector<ref::PrefillResult> want(N);
  for (int64_t n = 0; n < N; ++n) {
    if (padded(n)) continue;
    ref::State S0(static_cast<size_t>(E), 0.0);
    if (!contains(c.fresh, n) && c.mode != StateMode::none)
      S0 = slot_values(pool.view(), pooled ? in_slot[n] : n);
    want[n] = ref::prefill(cfg, tokens_of(rb, n), S0, every);
  }

  ChunkPrefillArgs args = prefill_args(rb);
  args.use_qk_l2norm = c.l2norm;
  if (c.scale > 0) args.scale = c.scale;
  if (c.mode != StateMode::none) args.initial_state = pool.view();
  if (pooled) args.initial_state_indices = idx.view();
  if (c.redirect) args.output_state_indices = out_idx.view();
  if (!c.fresh.empty()) args.has_initial_state = has_initial.view();
  if (c.final_state) args.final_state = final_state.view();
  if (every) {
    args.checkpoint_every_n_tokens = every;
    args.checkpoint_cu_starts = cu_starts_t.view();
    if (c.ckpt == Ckpt::dense) args.state_checkpoints = ckpts.view();
    else args.checkpoint_slot_indices = ck_idx.view();
  }
  const Tensor ws = make_workspace(args);
  args.workspace = ws.view();

  Snapshot state_before, ckpts_before, inputs_before;
  if (c.mode != StateMode::none) state_before.add(pool);
  if (c.ckpt == Ckpt::dense) ckpts_before.add(ckpts);
  for (const Tensor* t : {&rb.q, &rb.k, &rb.v, &rb.g, &rb.beta, &rb.A_log, &rb.dt_bias})
    inputs_before.add(*t);
  for (const Tensor* t : {&rb.cu, &idx, &out_idx, &ck_idx, &has_initial, &cu_starts_t})
    if (t->alloc_base()) inputs_before.add(*t);

  deltastate::chunk_prefill(args);

  const DType act = c.spec.act;
  std::vector<MemRange> pool_written, ckpt_written;
  for (int64_t n = 0; n < N; ++n) {
    SCOPED_TRACE("sequence " + std::to_string(n) + " of " + std::to_string(rb.seq_len(n)) +
                 " tokens");
    const std::string tag = "seq " + std::to_string(n);
    const int64_t n_ckpt = every ? rb.seq_len(n) / every : 0;
    if (padded(n)) {
      EXPECT_TRUE(all_zero(out_rows(rb, n))) << "outputs";
      if (c.final_state) {
        EXPECT_TRUE(all_zero(view_values(final_state.view(), n * E, E))) << "final_state";
      }
      for (int64_t j = 0; j < n_ckpt && c.ckpt == Ckpt::dense; ++j) {
        EXPECT_TRUE(all_zero(view_values(ckpts.view(), (cu_starts[n] + j) * E, E)))
            << "checkpoint " << j;
        ckpt_written.push_back(range_of(ckpts.view(), (cu_starts[n] + j) * E, E));
      }
      continue;
    }
    const ref::PrefillResult& w = want[n];
    EXPECT_TRUE(rel_close(out_rows(rb, n), concat(w.out), kRelTol, act, tag + " out"));
    if (c.final_state) {
      EXPECT_TRUE(rel_close(view_values(final_state.view(), n * E, E), w.final_state, kRelTol,
                            c.state, tag + " final_state"));
    }
    if (pooled && out_slot[n] >= 0) {
      EXPECT_TRUE(rel_close(slot_values(pool.view(), out_slot[n]), w.final_state, kRelTol, c.state,
                            tag + " pool final"));
      pool_written.push_back(slot_range(pool.view(), out_slot[n]));
    }
    ASSERT_EQ(static_cast<int64_t>(w.checkpoints.size()), n_ckpt);
    for (int64_t j = 0; j < n_ckpt; ++j) {
      const std::string ctag = tag + " checkpoint " + std::to_string(j);
      const int64_t pos = cu_starts[n] + j;
      if (c.ckpt == Ckpt::dense) {
        EXPECT_TRUE(rel_close(view_values(ckpts.view(), pos * E, E), w.checkpoints[j], kRelTol,
                              c.state, ctag));
        ckpt_written.push_back(range_of(ckpts.view(), pos * E, E));
      } else if (ck_slot[pos] >= 0) {
        EXPECT_TRUE(rel_close(slot_values(pool.view(), ck_slot[pos]), w.checkpoints[j], kRelTol,
                              c.state, ctag));
        pool_written.push_back(slot_range(pool.view(), ck_slot[pos]));
      }
    }
  }
  if (c.mode == StateMode::pool) {
    EXPECT_TRUE(state_before.unchanged_except(pool_written))
        << "pool memory outside the written slots";
  } else if (c.mode == StateMode::dense) {
    EXPECT_TRUE(state_before.unchanged()) << "the dense initial_state is read only";
  }
  if (c.ckpt == Ckpt::dense) {
    EXPECT_TRUE(ckpts_before.unchanged_except(ckpt_written)) << "spare checkpoint rows";
  }
  EXPECT_TRUE(inputs_before.unchanged()) << "inputs";
}

RecurrentSpec spec(
    const Shape& s, bool kda, DType act, std::vector<int64_t> seqlens,
    void (*f)(RecurrentSpec&) = [](RecurrentSpec&) {}) {
  return with(recurrent_spec(s, kda, act, 1, 1, std::move(seqlens)), f);
}
void log_gates(RecurrentSpec& r) { r.gate_in_kernel = false; }
void log_gates_beta_prob(RecurrentSpec& r) {
  r.gate_in_kernel = false;
  r.beta_is_logit = false;
}
void safe_gate(RecurrentSpec& r) { r.lower_bound = -5.0; }
void safe_gate_i64(RecurrentSpec& r) {
  r.lower_bound = -5.0;
  r.index_dtype = DType::i64;
}

// K = V = 128 with GVA, and K != V: shapes small enough in heads for the fp64 reference.
constexpr Shape kGva128{"gva128", 1, 2, 128, 128};
constexpr Shape kKda128x64{"kda128x64", 2, 2, 128, 64};
constexpr Shape kTiny{"tiny", 1, 2, 16, 24};

// The varlen mix: lengths 1, 63, 64, 65, 1000 around an empty sequence and a 130-token one.
const std::vector<int64_t> kMix{1, 63, 64, 0, 65, 1000, 130};

INSTANTIATE_TEST_SUITE_P(
    Ops, ChunkPrefillVsReference,
    ::testing::Values(
        // index 3 (empty) and 6 padded; 2 starts fresh; final states to other slots, the first
        // live one's not stored; checkpoints into slots (every third skipped); envelope pool
        PrefillCase{"gdn_mix_f32_slots_redirect_envelope",
                    spec(kOdd, false, f32, kMix),
                    StateMode::pool,
                    f32,
                    {3, 6},
                    {2},
                    true,
                    true,
                    Ckpt::slots,
                    64,
                    40,
                    8},
        PrefillCase{"kda_mix_lb_bf16_dense_ckpt128",
                    spec(kOdd, true, bf16, kMix, safe_gate),
                    StateMode::pool,
                    bf16,
                    {1},
                    {4},
                    false,
                    true,
                    Ckpt::dense,
                    128,
                    24,
                    0},
        PrefillCase{"kda_mix_softplus_bf16act_f32state_slots",
                    spec(kOdd, true, bf16, kMix),
                    StateMode::pool,
                    f32,
                    {0},
                    {},
                    true,
                    false,
                    Ckpt::slots,
                    64,
                    8,
                    16},
        PrefillCase{"kda_logg_betaprob_f32_slots",
                    spec(kOdd, true, f32, {200, 64, 5}, log_gates_beta_prob),
                    StateMode::pool,
                    f32,
                    {},
                    {1},
                    false,
                    true,
                    Ckpt::slots,
                    64,
                    32,
                    8},
        PrefillCase{"gdn_logg_bf16state_dense_ckpt",
                    spec(kOdd, false, bf16, {129, 300, 1}, log_gates),
                    StateMode::pool,
                    bf16,
                    {},
                    {0},
                    true,
                    false,
                    Ckpt::dense,
                    64},
        PrefillCase{"gdn_logg_betaprob_f16",
                    spec(kOdd, false, f16, {70, 192}, log_gates_beta_prob),
                    StateMode::pool,
                    f16,
                    {},
                    {},
                    false,
                    true,
                    Ckpt::dense,
                    192},
        PrefillCase{"gdn_dense_initial_final_bf16",
                    spec(kOdd, false, bf16, {65, 0, 140}),
                    StateMode::dense,
                    f32,
                    {},
                    {1},
                    false,
                    true,
                    Ckpt::dense,
                    64,
                    16,
                    4},
        PrefillCase{"kda_dense_initial_lb_i64",
                    spec(kKltV, true, f32, {64, 3, 128}, safe_gate_i64),
                    StateMode::dense,
                    bf16,
                    {},
                    {},
                    false,
                    true,
                    Ckpt::none},
        PrefillCase{"kda_no_state_final_bf16",
                    spec(kKgtV, true, f32, {100, 64}),
                    StateMode::none,
                    bf16,
                    {},
                    {},
                    false,
                    true,
                    Ckpt::dense,
                    64},
        PrefillCase{"gdn_no_state_logg_final",
                    spec(kKltV, false, bf16, {1, 129}, log_gates),
                    StateMode::none,
                    f32,
                    {},
                    {},
                    false,
                    true},
        PrefillCase{"gdn_gva128_bf16_slots",
                    spec(kGva128, false, bf16, {1, 63, 64, 65, 200}),
                    StateMode::pool,
                    f32,
                    {},
                    {},
                    false,
                    true,
                    Ckpt::slots,
                    64},
        PrefillCase{"kda_128x64_softplus_dense_ckpt",
                    spec(kKda128x64, true, bf16, {65, 300}),
                    StateMode::pool,
                    bf16,
                    {},
                    {},
                    false,
                    true,
                    Ckpt::dense,
                    64,
                    64,
                    32},
        PrefillCase{"gdn_batched_T130_pool",
                    recurrent_spec(kOdd, false, f32, 3, 130),
                    StateMode::pool,
                    f32,
                    {1},
                    {},
                    false,
                    true,
                    Ckpt::slots,
                    64},
        PrefillCase{"kda_batched_T64_logg",
                    with(recurrent_spec(kKgtV, true, bf16, 2, 64), log_gates),
                    StateMode::pool,
                    bf16,
                    {},
                    {0},
                    true,
                    true,
                    Ckpt::dense,
                    64},
        PrefillCase{"gdn_no_l2norm_scale",
                    spec(kTiny, false, f32, {90, 20}),
                    StateMode::pool,
                    f32,
                    {},
                    {},
                    false,
                    true,
                    Ckpt::none,
                    64,
                    0,
                    0,
                    false,
                    0.3},
        PrefillCase{"kda_no_l2norm_logg",
                    spec(kTiny, true, f32, {130}, log_gates),
                    StateMode::pool,
                    f32,
                    {},
                    {},
                    false,
                    true,
                    Ckpt::slots,
                    64,
                    0,
                    0,
                    false},
        // one long sequence: 8192 tokens, a checkpoint every 1024
        PrefillCase{"gdn_8192_f32_slots",
                    spec(kTiny, false, f32, {8192}),
                    StateMode::pool,
                    f32,
                    {},
                    {},
                    false,
                    true,
                    Ckpt::slots,
                    1024,
                    8,
                    8},
        PrefillCase{"kda_8192_lb_bf16_dense",
                    spec(kTiny, true, bf16, {8192}, safe_gate),
                    StateMode::pool,
                    bf16,
                    {},
                    {},
                    false,
                    true,
                    Ckpt::dense,
                    1024}),
    case_name<PrefillCase>);

// ---- against the recurrent op ------------------------------------------------------------------
// The same inputs and pool through recurrent_gdn / recurrent_kda and chunk_prefill: outputs and
// final states agree within both ops' fp32 error. The Qwen3-Next case is the measurement
// (three sequences of 300, 64 and 1000 tokens, bf16 q/k/v, fp32 state).
struct VsRecurrentCase {
  const char* name;
  RecurrentSpec spec;
  DType state;
};
inline void PrintTo(const VsRecurrentCase& c, std::ostream* os) { *os << c.name; }

class ChunkPrefillVsRecurrent : public ::testing::TestWithParam<VsRecurrentCase> {};

TEST_P(ChunkPrefillVsRecurrent, Run) {
  const VsRecurrentCase& c = GetParam();
  Rng rng = test_rng();
  RecurrentBatch rb = make_recurrent_batch(rng, c.spec);
  vary_decay(rb, rng);
  const Shape& s = c.spec.s;
  const int64_t N = rb.N;
  Tensor pool = make_pool(c.state, N + 2, s);
  const std::vector<int64_t> slots = pick_slots(rng, N, N + 2, {});
  fill_live_slots(pool.view(), slots, rng);
  Tensor pool_rec = pool.empty_like();
  std::memcpy(pool_rec.alloc_base(), pool.alloc_base(), static_cast<size_t>(pool.alloc_bytes()));
  const Tensor idx = index_tensor(slots);

  ChunkPrefillArgs args = prefill_args(rb);
  args.initial_state = pool.view();
  args.initial_state_indices = idx.view();
  const Tensor ws = make_workspace(args);
  args.workspace = ws.view();
  deltastate::chunk_prefill(args);
  std::vector<std::vector<double>> chunk_out(N);
  for (int64_t n = 0; n < N; ++n) chunk_out[n] = out_rows(rb, n);

  rb.poison_out();
  deltastate::RecurrentArgs rec = rb.args(host_view);
  rec.state = pool_rec.view();
  rec.state_indices = idx.view();
  if (c.spec.kda) deltastate::recurrent_kda(rec);
  else deltastate::recurrent_gdn(rec);

  for (int64_t n = 0; n < N; ++n) {
    const std::string tag = "seq " + std::to_string(n);
    // The measure (the plain norm error of the stored outputs), reported only.
    (void)rel_close(chunk_out[n], out_rows(rb, n), 1.0, DType::f32, tag + " out as stored");
    EXPECT_TRUE(
        rel_close(chunk_out[n], out_rows(rb, n), kRelTolVsRecurrent, c.spec.act, tag + " out", 2));
    EXPECT_TRUE(rel_close(slot_values(pool.view(), slots[n]),
                          slot_values(pool_rec.view(), slots[n]), kRelTolVsRecurrent, c.state,
                          tag + " state", 2));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Ops, ChunkPrefillVsRecurrent,
    ::testing::Values(
        VsRecurrentCase{"gdn_qwen3next_300_64_1000_bf16",
                        spec(kQwen3Next, false, bf16, {300, 64, 1000}), f32},
        VsRecurrentCase{"kda_kimi_lb_65_200_bf16", spec(kKimi, true, bf16, {65, 200}, safe_gate),
                        f32},
        VsRecurrentCase{"kda_odd_mix_logg_bf16state", spec(kOdd, true, f32, kMix, log_gates), bf16},
        VsRecurrentCase{"gdn_odd_mix_softplus_f16", spec(kOdd, false, f16, kMix), f16}),
    case_name<VsRecurrentCase>);

// N = 0 sequences (cu_seqlens [1]) is a no-op, with or without a workspace.
TEST(ChunkPrefill, NoSequences) {
  Rng rng = test_rng();
  RecurrentBatch rb = make_recurrent_batch(rng, recurrent_spec(kOdd, false, f32, 1, 1, {0}));
  rb.cu = index_tensor({0});
  ChunkPrefillArgs args = prefill_args(rb);
  args.cu_seqlens = rb.cu.view();
  const Tensor ws = make_workspace(args);
  args.workspace = ws.view();
  Snapshot before;
  before.add(rb.out);
  EXPECT_NO_THROW(deltastate::chunk_prefill(args));
  EXPECT_TRUE(before.unchanged());
}

// The workspace size is num_threads() identical blocks: it does not depend on N or T, and grows
// with K and V.
TEST(ChunkPrefill, WorkspaceBytes) {
  Rng rng = test_rng();
  const RecurrentBatch a =
      make_recurrent_batch(rng, recurrent_spec(kOdd, true, f32, 1, 1, {3, 70}));
  const RecurrentBatch b = make_recurrent_batch(rng, recurrent_spec(kOdd, true, f32, 2, 9));
  const RecurrentBatch k = make_recurrent_batch(rng, recurrent_spec(kKgtV, true, f32, 2, 9));
  const int64_t wa = deltastate::chunk_prefill_workspace_bytes(prefill_args(a));
  EXPECT_GT(wa, 0);
  EXPECT_EQ(wa, deltastate::chunk_prefill_workspace_bytes(prefill_args(b)));
  EXPECT_NE(wa, deltastate::chunk_prefill_workspace_bytes(prefill_args(k)));
  EXPECT_EQ(wa % 64, 0);
}

}  // namespace
}  // namespace dstest
