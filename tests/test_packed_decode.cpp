// GDN and KDA packed decode (SGLang's fused_recurrent_{gated_delta_rule,kda}_packed_decode)
// against the fp64 reference: model shapes and odd ones,
// every state and activation dtype, padded rows, sentinel-filled unused slots and envelope gaps
// (bit-untouched), NaN-poisoned outputs, strided pools and inputs, StatePool envelope layers.
#include <cmath>
#include <functional>

#include "test_util.h"

namespace dstest {
namespace {

using deltastate::PackedDecodeArgs;

// Options of one checked call beyond the batch and the pool.
struct PackedOptions {
  std::optional<double> lower_bound;
  double scale = 0.0;  // 0: K^-0.5
  bool round_beta = false;
  bool l2norm = true;
};

// Runs one packed-decode step on `state` (host memory inside `pool_mem`) and checks it against
// the reference: outputs of live rows, zeros for padded rows, the new state of every live slot,
// and that nothing else in the pool memory or in the inputs changed.
void checked_packed_step(DecodeBatch& batch, const TensorView& state, MemRange pool_mem,
                         const PackedOptions& opt) {
  const Shape& s = batch.s;
  const double scale = opt.scale > 0 ? opt.scale : 1.0 / std::sqrt(static_cast<double>(s.K));
  ref::Config cfg = batch.config(opt.lower_bound, scale, opt.round_beta);
  cfg.l2norm = opt.l2norm;
  const std::vector<int64_t> slots = index_values(batch.idx);

  std::vector<std::vector<double>> want_out(slots.size()), want_state(slots.size());
  for (size_t r = 0; r < slots.size(); ++r) {
    if (slots[r] < 0) continue;
    ref::State S = slot_values(state, slots[r]);
    want_out[r] = ref::step(cfg, batch.token(static_cast<int64_t>(r)), S);
    want_state[r] = std::move(S);
  }

  batch.poison_out();
  Snapshot pool_before, inputs_before;
  pool_before.add(pool_mem.begin, pool_mem.end - pool_mem.begin);
  for (const Tensor* t : {&batch.x, &batch.a, &batch.b, &batch.A_log, &batch.dt_bias, &batch.idx})
    inputs_before.add(*t);

  PackedDecodeArgs args = batch.packed_args(host_view, state, scale, opt.lower_bound);
  args.round_beta_to_input = opt.round_beta;
  args.use_qk_l2norm = opt.l2norm;
  if (batch.kda) deltastate::kda_packed_decode(args);
  else deltastate::gdn_packed_decode(args);

  std::vector<MemRange> written;
  for (size_t r = 0; r < slots.size(); ++r) {
    const std::vector<double> got = batch.out_row(static_cast<int64_t>(r));
    if (slots[r] < 0) {
      EXPECT_TRUE(all_zero(got)) << "padded row " << r;
      continue;
    }
    EXPECT_TRUE(all_close(got, want_out[r], kOutTol, batch.act)) << "output of row " << r;
    EXPECT_TRUE(all_close(slot_values(state, slots[r]), want_state[r], state_tol(state.dtype)))
        << "state of row " << r << " (slot " << slots[r] << ")";
    written.push_back(slot_range(state, slots[r]));
  }
  EXPECT_TRUE(pool_before.unchanged_except(written)) << "pool memory outside the live slots";
  EXPECT_TRUE(inputs_before.unchanged()) << "inputs";
}

struct PackedCase : OpCase {
  int64_t slot_pad = 0, lead = 0;  // a strided (envelope-like) pool view
  int64_t row_pad = 0;             // mixed_qkv / a / b row strides beyond their widths
  DType index = DType::i32;
};

class PackedDecodeVsReference : public ::testing::TestWithParam<PackedCase> {};

TEST_P(PackedDecodeVsReference, TwoSteps) {
  const PackedCase& c = GetParam();
  Rng rng = test_rng();
  const bool big = c.shape.K * c.shape.V * c.shape.HV >= 32 * 128 * 128;
  const int64_t B = big ? 4 : 6;
  const std::vector<int64_t> padded = big ? std::vector<int64_t>{2} : std::vector<int64_t>{1, 4};
  const int64_t num_slots = B + 3;  // some slots stay unused (sentinel)
  Tensor pool = make_pool(c.state, num_slots, c.shape, c.slot_pad, c.lead);
  const std::vector<int64_t> slots = pick_slots(rng, B, num_slots, padded);
  fill_live_slots(pool.view(), slots, rng);
  DecodeBatch batch = make_decode_batch(rng, c.shape, c.kda, slots, c.act, c.row_pad, c.index);
  const MemRange mem{static_cast<const char*>(pool.alloc_base()),
                     static_cast<const char*>(pool.alloc_base()) + pool.alloc_bytes()};
  for (int step = 0; step < 2; ++step) {  // the second step reads the state the first one wrote
    SCOPED_TRACE("step " + std::to_string(step));
    if (step) batch.randomize(rng);
    checked_packed_step(batch, pool.view(), mem, {c.lower_bound});
  }
}

INSTANTIATE_TEST_SUITE_P(
    Ops, PackedDecodeVsReference,
    ::testing::Values(
        // GDN, Qwen3-Next (H=16, HV=32, K=V=128)
        PackedCase{"gdn_qwen_f32state_f32act", kQwen3Next, false, kNoLb, f32, f32},
        PackedCase{"gdn_qwen_f32state_bf16act_envelope", kQwen3Next, false, kNoLb, f32, bf16, 4096 + 64, 512, 24},
        PackedCase{"gdn_qwen_bf16state_bf16act", kQwen3Next, false, kNoLb, bf16, bf16},
        PackedCase{"gdn_qwen_f16state_f16act_i64idx", kQwen3Next, false, kNoLb, f16, f16, 0, 0, 0, DType::i64},
        // KDA, Kimi-Linear (H=HV=32, K=V=128), standard and safe gate
        PackedCase{"kda_kimi_f32state_f32act", kKimi, true, kNoLb, f32, f32},
        PackedCase{"kda_kimi_f32state_bf16act_lb", kKimi, true, kLb, f32, bf16},
        PackedCase{"kda_kimi_bf16state_bf16act_envelope", kKimi, true, kNoLb, bf16, bf16, 1024, 256, 8},
        PackedCase{"kda_kimi_f16state_f32act_lb", kKimi, true, kLb, f16, f32},
        // odd shapes (H=3, HV=6, K=32, V=48), K > V, K < V
        PackedCase{"gdn_odd_f32state_f32act", kOdd, false, kNoLb, f32, f32, 48, 16, 5},
        PackedCase{"gdn_odd_bf16state_f16act", kOdd, false, kNoLb, bf16, f16},
        PackedCase{"kda_odd_f32state_bf16act_lb", kOdd, true, kLb, f32, bf16, 16, 0, 3},
        PackedCase{"kda_odd_f16state_f16act", kOdd, true, kNoLb, f16, f16},
        PackedCase{"gdn_KgtV_f32state_bf16act", kKgtV, false, kNoLb, f32, bf16, 32, 32},
        PackedCase{"gdn_KltV_bf16state_f32act", kKltV, false, kNoLb, bf16, f32},
        PackedCase{"kda_KgtV_bf16state_bf16act_lb", kKgtV, true, kLb, bf16, bf16},
        PackedCase{"kda_KltV_f32state_f32act_envelope", kKltV, true, kNoLb, f32, f32, 100, 7, 1, DType::i64}),
    case_name<PackedCase>);

// Every op accepts a StatePool envelope layer view (slot stride = the whole entry, far larger than
// HV*V*K): the other layers, the envelope's extra bytes and the unused slots stay bit-untouched.
TEST(PackedDecode, StatePoolEnvelopeLayer) {
  for (bool kda : {false, true}) {
    SCOPED_TRACE(kda ? "kda" : "gdn");
    Rng rng = test_rng(kda);
    deltastate::StatePool pool(envelope_config(kOdd, 3, 7, DType::f32, 1000));
    fill_sentinel(pool.data(), pool.total_bytes(), DType::f32);
    const TensorView layer = pool.layer_state(1);
    ASSERT_GT(layer.stride[0], kOdd.state_elems());
    const std::vector<int64_t> slots{5, -1, 0, 3};
    fill_live_slots(layer, slots, rng);
    DecodeBatch batch = make_decode_batch(rng, kOdd, kda, slots, DType::bf16);
    const auto* base = static_cast<const char*>(pool.data());
    for (int step = 0; step < 2; ++step) {
      if (step) batch.randomize(rng);
      checked_packed_step(batch, layer, {base, base + pool.total_bytes()},
                          {kda ? kLb : kNoLb});
    }
  }
}

// Gate inputs far past the softplus threshold (a + dt_bias up to 1000: exp would overflow in fp32)
// and around it (19.5..20.5) stay finite and match the reference.
TEST(PackedDecode, SoftplusThresholdAndLargeGateInputs) {
  Rng rng = test_rng();
  const Shape s{"small", 2, 4, 32, 16};
  const std::vector<int64_t> slots{0, 1, 2};
  Tensor pool = make_pool(DType::f32, 3, s);
  for (int64_t sl : slots) fill_slot(pool.view(), sl, rng);
  for (bool kda : {false, true}) {
    SCOPED_TRACE(kda ? "kda" : "gdn");
    DecodeBatch batch = make_decode_batch(rng, s, kda, slots, DType::f32);
    // A_log small so that the decay stays moderate even with softplus(x) = x = 1000.
    for (int64_t hv = 0; hv < s.HV; ++hv) batch.A_log.set({hv}, -7.0);
    const double xs[] = {19.5, 19.999, 20.0, 20.001, 20.5, 30.0, 88.0, 100.0, 1000.0};
    int i = 0;
    for (int64_t r = 0; r < batch.B; ++r)
      for (int64_t j = 0; j < batch.a.size(1); ++j) {
        const double dt = batch.dt_bias.get({j});
        batch.a.set({r, j}, xs[i++ % 9] - dt);
      }
    const MemRange mem{static_cast<const char*>(pool.alloc_base()),
                       static_cast<const char*>(pool.alloc_base()) + pool.alloc_bytes()};
    checked_packed_step(batch, pool.view(), mem, {});
  }
}

// round_beta_to_input rounds sigmoid(b) to b's dtype (parity with ReplaySSM, which rounds beta,
// and with the SGLang packed-decode versions that did); the reference rounds likewise. Also an
// explicit scale.
TEST(PackedDecode, RoundBetaToInputDtype) {
  for (DType act : {DType::bf16, DType::f16}) {
    SCOPED_TRACE(dtype_short_name(act));
    Rng rng = test_rng(static_cast<uint64_t>(act));
    const std::vector<int64_t> slots{2, 0, -1, 1};
    Tensor pool = make_pool(DType::f32, 4, kOdd);
    fill_live_slots(pool.view(), slots, rng);
    const MemRange mem{static_cast<const char*>(pool.alloc_base()),
                       static_cast<const char*>(pool.alloc_base()) + pool.alloc_bytes()};
    for (bool kda : {false, true}) {
      DecodeBatch batch = make_decode_batch(rng, kOdd, kda, slots, act);
      PackedOptions opt;
      opt.round_beta = true;
      opt.scale = 0.3;
      checked_packed_step(batch, pool.view(), mem, opt);
    }
  }
}

// use_qk_l2norm = false: q and k are used as given (q still scaled).
TEST(PackedDecode, WithoutQkL2Norm) {
  Rng rng = test_rng();
  const std::vector<int64_t> slots{1, 0};
  Tensor pool = make_pool(DType::f32, 2, kKgtV);
  for (int64_t sl : slots) fill_slot(pool.view(), sl, rng);
  const MemRange mem{static_cast<const char*>(pool.alloc_base()),
                     static_cast<const char*>(pool.alloc_base()) + pool.alloc_bytes()};
  for (bool kda : {false, true}) {
    DecodeBatch batch = make_decode_batch(rng, kKgtV, kda, slots, DType::f32);
    // Keys of norm ~0.8 keep the un-normalized update stable.
    const int64_t HK = static_cast<int64_t>(kKgtV.H) * kKgtV.K;
    for (int64_t r = 0; r < batch.B; ++r)
      for (int64_t i = HK; i < 2 * HK; ++i) batch.x.set({r, i}, rng.normal(0.1));
    PackedOptions opt;
    opt.l2norm = false;
    checked_packed_step(batch, pool.view(), mem, opt);
  }
}

// An empty batch is accepted and touches nothing.
TEST(PackedDecode, EmptyBatch) {
  Rng rng = test_rng();
  Tensor pool = make_pool(DType::f32, 2, kKgtV);
  DecodeBatch batch = make_decode_batch(rng, kKgtV, false, {}, DType::f32);
  Snapshot before;
  before.add(pool);
  deltastate::gdn_packed_decode(batch.packed_args(host_view, pool.view(), 0.125));
  EXPECT_TRUE(before.unchanged());
}

}  // namespace
}  // namespace dstest
