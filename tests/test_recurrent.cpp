// The pooled varlen recurrent op (SGLang's fused_sigmoid_gating_delta_rule_update; FlashInfer's
// recurrent_kda) against the fp64 reference:
// multi-token sequences, varlen cu_seqlens (empty sequences included), gate in the kernel or a
// precomputed log-space g, beta as logit or probability, pooled state with indices (padded
// sequences), initial_state without indices, no state, final_state, update_state off, strided q/k/v
// and strided / envelope pools.
#include <cmath>

#include "test_util.h"

namespace dstest {
namespace {

using deltastate::RecurrentArgs;

enum class StateMode {
  pool,          // [slots, HV, V, K] with state_indices (some sequences padded)
  per_sequence,  // [N, HV, V, K] without indices: sequence n reads and writes entry n
  none,          // no state: every sequence starts from S = 0
};

struct RecurrentCase {
  const char* name;
  RecurrentSpec spec;
  StateMode mode = StateMode::pool;
  DType state = DType::f32;
  std::vector<int64_t> padded;  // pool mode: sequences with index -1
  bool final_state = false;
  bool update_state = true;
  int64_t slot_pad = 0, lead = 0;
  double scale = 0.0;  // 0: the op's default K^-0.5 (not passed)
};

// Runs the op once and checks outputs, the pool (written slots, untouched rest), final_state and
// the inputs. `state` / `state_mem` describe the pool (host memory), if any.
void checked_recurrent_call(RecurrentBatch& rb, const RecurrentCase& c,
                            const std::optional<TensorView>& state, MemRange state_mem,
                            const std::vector<int64_t>& indices) {
  const Shape& s = rb.spec.s;
  const int64_t N = rb.N;
  const double scale = c.scale > 0 ? c.scale : 1.0 / std::sqrt(static_cast<double>(s.K));
  const ref::Config cfg = rb.config(scale);
  const bool pooled = c.mode == StateMode::pool;
  auto slot_of = [&](int64_t n) { return pooled ? indices[n] : n; };

  // Reference: each sequence from its initial state through its tokens.
  std::vector<std::vector<std::vector<double>>> want_out(N);
  std::vector<ref::State> want_final(N);
  for (int64_t n = 0; n < N; ++n) {
    if (pooled && indices[n] < 0) continue;
    ref::State S = state ? slot_values(*state, slot_of(n))
                         : ref::State(static_cast<size_t>(s.state_elems()), 0.0);
    for (int64_t t = 0; t < rb.seq_len(n); ++t) want_out[n].push_back(ref::step(cfg, rb.token(n, t), S));
    want_final[n] = std::move(S);
  }

  Tensor idx, final_state;
  RecurrentArgs args = rb.args(host_view);
  if (state) args.state = *state;
  if (pooled) {
    idx = index_tensor(indices, rb.spec.index_dtype);
    args.state_indices = idx.view();
  }
  if (c.final_state) {
    final_state = Tensor::contiguous(c.state, {N, s.HV, s.V, s.K});
    final_state.fill_all(std::nan(""));
    args.final_state = final_state.view();
  }
  args.update_state = c.update_state && state.has_value();
  if (c.scale > 0) args.scale = c.scale;

  rb.poison_out();
  Snapshot pool_before, inputs_before;
  if (state) pool_before.add(state_mem.begin, state_mem.end - state_mem.begin);
  for (const Tensor* t : {&rb.q, &rb.k, &rb.v, &rb.g, &rb.beta, &rb.A_log, &rb.dt_bias})
    inputs_before.add(*t);
  if (!rb.spec.seqlens.empty()) inputs_before.add(rb.cu);
  if (pooled) inputs_before.add(idx);

  if (rb.spec.kda) deltastate::recurrent_kda(args);
  else deltastate::recurrent_gdn(args);

  std::vector<MemRange> written;
  for (int64_t n = 0; n < N; ++n) {
    SCOPED_TRACE("sequence " + std::to_string(n));
    const bool padded = pooled && indices[n] < 0;
    for (int64_t t = 0; t < rb.seq_len(n); ++t) {
      const std::vector<double> got = rb.out_token(n, t);
      if (padded) {
        EXPECT_TRUE(all_zero(got)) << "token " << t;
      } else {
        EXPECT_TRUE(all_close(got, want_out[n][t], kOutTol, rb.spec.act)) << "token " << t;
      }
    }
    if (c.final_state) {
      const std::vector<double> got = view_values(final_state.view(), n * s.state_elems(), s.state_elems());
      if (padded) {
        EXPECT_TRUE(all_zero(got)) << "final_state";
      } else {
        EXPECT_TRUE(all_close(got, want_final[n], state_tol(c.state))) << "final_state";
      }
    }
    if (state && args.update_state && !padded) {
      EXPECT_TRUE(all_close(slot_values(*state, slot_of(n)), want_final[n], state_tol(state->dtype)))
          << "state";
      written.push_back(slot_range(*state, slot_of(n)));
    }
  }
  if (state) {
    EXPECT_TRUE(pool_before.unchanged_except(written)) << "pool memory outside the written slots";
  }
  EXPECT_TRUE(inputs_before.unchanged()) << "inputs";
}

class RecurrentVsReference : public ::testing::TestWithParam<RecurrentCase> {};

TEST_P(RecurrentVsReference, Run) {
  const RecurrentCase& c = GetParam();
  Rng rng = test_rng();
  RecurrentBatch rb = make_recurrent_batch(rng, c.spec);
  const int64_t N = rb.N;
  Tensor pool;
  std::vector<int64_t> indices;
  std::optional<TensorView> state;
  if (c.mode == StateMode::pool) {
    pool = make_pool(c.state, N + 3, c.spec.s, c.slot_pad, c.lead);
    indices = pick_slots(rng, N, N + 3, c.padded);
  } else if (c.mode == StateMode::per_sequence) {
    pool = make_pool(c.state, N, c.spec.s, c.slot_pad, c.lead);
    for (int64_t n = 0; n < N; ++n) indices.push_back(n);
  }
  if (c.mode != StateMode::none) {
    state = pool.view();
    fill_live_slots(*state, indices, rng);
  }
  const auto* base = static_cast<const char*>(pool.alloc_base());
  for (int call = 0; call < 2; ++call) {  // the second call continues from the first one's state
    SCOPED_TRACE("call " + std::to_string(call));
    if (call) rb.randomize(rng);
    checked_recurrent_call(rb, c, state, {base, base + pool.alloc_bytes()}, indices);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Ops, RecurrentVsReference,
    ::testing::Values(
        RecurrentCase{"gdn_qwen_batched_T3_pool_final", recurrent_spec(kQwen3Next, false, f32, 3, 3),
                      StateMode::pool, f32, {1}, true},
        RecurrentCase{"gdn_qwen_varlen_bf16_packedqkv",
                      with(recurrent_spec(kQwen3Next, false, bf16, 1, 1, {2, 0, 3, 1}),
                           [](RecurrentSpec& r) { r.packed_qkv = true; }),
                      StateMode::pool, bf16, {2}},
        RecurrentCase{"kda_kimi_varlen_lb_envelope_final",
                      with(recurrent_spec(kKimi, true, f32, 1, 1, {3, 1, 2}),
                           [](RecurrentSpec& r) { r.lower_bound = -5.0; }),
                      StateMode::pool, f32, {}, true, true, 64, 32},
        RecurrentCase{"kda_kimi_batched_logg_betaprob_f16state",
                      with(recurrent_spec(kKimi, true, bf16, 2, 2),
                           [](RecurrentSpec& r) {
                             r.gate_in_kernel = false;
                             r.beta_is_logit = false;
                           }),
                      StateMode::pool, f16, {0}},
        RecurrentCase{"gdn_odd_per_sequence_logg_betaprob_final",
                      with(recurrent_spec(kOdd, false, f32, 3, 4),
                           [](RecurrentSpec& r) {
                             r.gate_in_kernel = false;
                             r.beta_is_logit = false;
                           }),
                      StateMode::per_sequence, f32, {}, true, true, 8, 4, 0.2},
        RecurrentCase{"kda_odd_per_sequence_varlen_bf16state_dt2d_lb",
                      with(recurrent_spec(kOdd, true, bf16, 1, 1, {1, 4, 2}),
                           [](RecurrentSpec& r) {
                             r.dt_bias_2d = true;
                             r.lower_bound = -5.0;
                           }),
                      StateMode::per_sequence, bf16, {}, true, true, 32, 16},
        RecurrentCase{"gdn_KgtV_no_state_final", recurrent_spec(kKgtV, false, f32, 2, 5), StateMode::none, f32,
                      {}, true, false},
        RecurrentCase{"kda_KltV_no_state_varlen_final_bf16", recurrent_spec(kKltV, true, bf16, 1, 1, {2, 3}),
                      StateMode::none, bf16, {}, true, false},
        RecurrentCase{"gdn_KltV_pool_no_update_final", recurrent_spec(kKltV, false, f16, 3, 2),
                      StateMode::pool, f32, {2}, true, false},
        RecurrentCase{"kda_KgtV_varlen_i64_empty_seq_packedqkv",
                      with(recurrent_spec(kKgtV, true, f32, 1, 1, {3, 0, 2, 1}),
                           [](RecurrentSpec& r) {
                             r.index_dtype = DType::i64;
                             r.packed_qkv = true;
                           }),
                      StateMode::pool, f32, {3}, false, true, 16, 8},
        RecurrentCase{"gdn_odd_envelope_f16", recurrent_spec(kOdd, false, f16, 4, 2), StateMode::pool, f16,
                      {0, 3}, false, true, 1000, 24, 0.15},
        RecurrentCase{"kda_odd_batched_T1_decode_bf16state", recurrent_spec(kOdd, true, bf16, 5, 1),
                      StateMode::pool, bf16, {4}, true}),
    case_name<RecurrentCase>);

// recurrent_gdn / recurrent_kda on a StatePool envelope layer (slot stride = the entry) keep the
// other layers, the extra bytes and the unused slots bit-untouched.
TEST(Recurrent, StatePoolEnvelopeLayer) {
  for (bool kda : {false, true}) {
    SCOPED_TRACE(kda ? "kda" : "gdn");
    Rng rng = test_rng(kda);
    deltastate::StatePool pool(envelope_config(kOdd, 2, 6, DType::bf16, 777));
    fill_sentinel(pool.data(), pool.total_bytes(), DType::bf16);
    const TensorView layer = pool.layer_state(1);
    RecurrentCase c{"envelope", recurrent_spec(kOdd, kda, DType::bf16, 1, 1, {2, 1, 3}), StateMode::pool,
                    DType::bf16, {}, true};
    RecurrentBatch rb = make_recurrent_batch(rng, c.spec);
    const std::vector<int64_t> indices{4, -1, 1};
    fill_live_slots(layer, indices, rng);
    const auto* base = static_cast<const char*>(pool.data());
    checked_recurrent_call(rb, c, layer, {base, base + pool.total_bytes()}, indices);
  }
}

}  // namespace
}  // namespace dstest
