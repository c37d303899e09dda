// The core rules behind the peers' call surfaces (issue 19), each against another form of the same
// computation, bit for bit on the CPU backend: a K-first state (FLA's layout) against the V-first
// one transposed; strided index tensors against contiguous ones; an unset scale against K^-0.5;
// a per-K decay through the GDN entry (FLA's gk) against the KDA entry; the safe gate without
// A_log against A_log = 0; the one beta option of ReplaySSM. And the errors: K-first on CUDA, the
// Helion twin's texts, marked dtype names.
#include <cmath>

#include "test_util.h"
#include "view_edits.h"

namespace dstest {
namespace {

using deltastate::DType;
using deltastate::ErrorKind;
using deltastate::RecurrentArgs;
using deltastate::StateLayout;

constexpr Shape kSmall{"small", 2, 4, 16, 8};

// [N, HV, V, K] values of `t` read as the K-first [N, HV, K, V] transpose of a V-first state.
Tensor transposed_state(const Tensor& t) {
  const int64_t N = t.size(0), HV = t.size(1), A = t.size(2), Bd = t.size(3);
  Tensor r = Tensor::contiguous(t.dtype(), {N, HV, Bd, A});
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < HV; ++h)
      for (int64_t i = 0; i < A; ++i)
        for (int64_t j = 0; j < Bd; ++j) r.set({n, h, j, i}, t.get({n, h, i, j}));
  return r;
}

bool same_values(const Tensor& a, const Tensor& b) { return a.values() == b.values(); }

TEST(DropIn, KFirstStateIsTheTransposedVFirstState) {
  for (bool kda : {false, true}) {
    SCOPED_TRACE(kda ? "kda" : "gdn");
    Rng rng = test_rng(kda);
    const Shape& s = kSmall;
    RecurrentBatch rb = make_recurrent_batch(rng, recurrent_spec(s, kda, DType::f32, 2, 3));
    Tensor vfirst = Tensor::contiguous(DType::f32, {2, s.HV, s.V, s.K});
    vfirst.fill_normal(rng, 0.3);
    Tensor kfirst = transposed_state(vfirst);
    Tensor fin_v = Tensor::contiguous(DType::f32, {2, s.HV, s.V, s.K});
    Tensor fin_k = Tensor::contiguous(DType::f32, {2, s.HV, s.K, s.V});
    std::vector<std::vector<double>> outs;
    for (bool k_first : {false, true}) {
      RecurrentArgs args = rb.args(host_view);
      args.state = (k_first ? kfirst : vfirst).view();
      args.update_state = true;  // in place, in the caller's layout
      args.final_state = (k_first ? fin_k : fin_v).view();
      args.state_layout = k_first ? StateLayout::k_first : StateLayout::v_first;
      rb.poison_out();
      if (kda) deltastate::recurrent_kda(args);
      else deltastate::recurrent_gdn(args);
      outs.push_back(rb.out.values());
    }
    EXPECT_EQ(outs[0], outs[1]);
    EXPECT_TRUE(same_values(transposed_state(vfirst), kfirst)) << "the updated state";
    EXPECT_TRUE(same_values(transposed_state(fin_v), fin_k)) << "the final state";
  }
}

TEST(DropIn, KFirstStateOnCudaIsNotImplemented) {
  Rng rng = test_rng();
  RecurrentBatch rb = make_recurrent_batch(rng, recurrent_spec(kSmall, false, DType::f32, 2, 1));
  Tensor st = Tensor::contiguous(DType::f32, {2, kSmall.HV, kSmall.K, kSmall.V});
  RecurrentArgs args = rb.args([](const Tensor& t) { return on_cuda(t.view()); });
  args.state = on_cuda(st.view());
  args.update_state = false;
  args.state_layout = StateLayout::k_first;
  auto e = catch_error([&] { deltastate::recurrent_gdn(args); });
  ASSERT_TRUE(e);
  EXPECT_EQ(e->kind(), ErrorKind::not_implemented);
  EXPECT_EQ(std::string(e->what()),
            "recurrent_gated_delta_rule: a K-first state [N, HV, K, V] (state_v_first=False) runs "
            "on the CPU backend only; on CUDA pass the state V-first [N, HV, V, K] with "
            "state_v_first=True (deltastate never transposes a state behind the caller's back)");
}

TEST(DropIn, StridedIndicesEqualContiguousOnes) {
  for (bool kda : {false, true}) {
    SCOPED_TRACE(kda ? "kda" : "gdn");
    Rng rng = test_rng(10 + kda);
    const Shape& s = kSmall;
    DecodeBatch batch = make_decode_batch(rng, s, kda, {3, -1, 0}, DType::f32);
    Tensor wide = index_tensor({3, 9, -1, 9, 0, 9});
    Tensor strided = wide.alias(DType::i32, {3}, {2}, 0);
    Tensor pools[2] = {make_pool(DType::f32, 5, s), make_pool(DType::f32, 5, s)};
    fill_live_slots(pools[0].view(), {0, 1, 2, 3, 4}, rng);
    pools[1] = pools[0].empty_like();
    for (int64_t i = 0; i < 5; ++i)
      set_slot_values(pools[1].view(), i, slot_values(pools[0].view(), i));
    std::vector<std::vector<double>> outs;
    for (int i = 0; i < 2; ++i) {
      auto args = batch.packed_args(host_view, pools[i].view(), 0.25);
      if (i == 1) args.state_indices = strided.view();
      batch.poison_out();
      if (kda) deltastate::kda_packed_decode(args);
      else deltastate::gdn_packed_decode(args);
      outs.push_back(batch.out.values());
    }
    EXPECT_EQ(outs[0], outs[1]);
    EXPECT_EQ(pools[0].values(), pools[1].values());
  }
}

TEST(DropIn, UnsetScaleIsKToTheMinusHalf) {
  Rng rng = test_rng(20);
  const Shape& s = kSmall;
  DecodeBatch batch = make_decode_batch(rng, s, false, {1, 0}, DType::f32);
  Tensor p0 = make_pool(DType::f32, 2, s);
  fill_live_slots(p0.view(), {0, 1}, rng);
  Tensor p1 = p0.empty_like();
  for (int64_t i = 0; i < 2; ++i) set_slot_values(p1.view(), i, slot_values(p0.view(), i));
  auto a0 = batch.packed_args(host_view, p0.view(), 1.0 / std::sqrt(16.0));
  deltastate::gdn_packed_decode(a0);
  const std::vector<double> out0 = batch.out.values();
  auto a1 = batch.packed_args(host_view, p1.view(), 1.0);
  a1.scale.reset();
  batch.poison_out();
  deltastate::gdn_packed_decode(a1);
  EXPECT_EQ(batch.out.values(), out0);
  EXPECT_EQ(p0.values(), p1.values());
}

TEST(DropIn, PerKDecayThroughTheGdnEntryIsKda) {
  Rng rng = test_rng(30);
  const Shape& s = kSmall;
  RecurrentSpec spec = recurrent_spec(s, true, DType::f32, 2, 3);
  spec.gate_in_kernel = false;
  spec.beta_is_logit = false;
  RecurrentBatch rb = make_recurrent_batch(rng, spec);
  std::vector<std::vector<double>> outs;
  for (bool through_gdn : {false, true}) {
    RecurrentArgs args = rb.args(host_view);
    args.update_state = false;
    rb.poison_out();
    if (through_gdn) deltastate::recurrent_gdn(args);
    else deltastate::recurrent_kda(args);
    outs.push_back(rb.out.values());
  }
  EXPECT_EQ(outs[0], outs[1]);
}

TEST(DropIn, SafeGateWithoutALogUsesTheFactorOne) {
  Rng rng = test_rng(40);
  const Shape& s = kSmall;
  RecurrentSpec spec = recurrent_spec(s, true, DType::f32, 2, 3);
  spec.lower_bound = -5.0;
  RecurrentBatch rb = make_recurrent_batch(rng, spec);
  std::vector<std::vector<double>> outs;
  for (bool zero_A_log : {true, false}) {
    RecurrentArgs args = rb.args(host_view);
    args.update_state = false;
    Tensor zeros = Tensor::contiguous(DType::f32, {s.HV});
    if (zero_A_log) args.A_log = zeros.view();
    else args.A_log.reset();
    rb.poison_out();
    deltastate::recurrent_kda(args);
    outs.push_back(rb.out.values());
  }
  EXPECT_EQ(outs[0], outs[1]);
  // The standard gate still needs A_log.
  RecurrentArgs args = rb.args(host_view);
  args.update_state = false;
  args.A_log.reset();
  args.lower_bound.reset();
  auto e = catch_error([&] { deltastate::recurrent_kda(args); });
  ASSERT_TRUE(e);
  EXPECT_EQ(std::string(e->what()),
            "recurrent_kda: the in-kernel gate (use_gate_in_kernel) needs `A_log`");
}

// ReplaySSM's texts under `helion` (SGLang's Helion KDA twin) and its default ones (SGLang's
// Triton function) for the same calls.
TEST(DropIn, ReplayTextsOfTheTwoSglangNames) {
  Rng rng = test_rng(50);
  const Shape& s = kSmall;
  DecodeBatch batch = make_decode_batch(rng, s, true, {1, -1, 0}, DType::f32);
  Tensor pool = make_pool(DType::f32, 3, s);
  Rings rings = make_rings(s, true, 3, 4, DType::f32, DType::f32);
  Tensor wp = index_tensor({0, 0, 0});
  struct Case {
    const char* what;
    void (*mutate)(deltastate::ReplayDecodeArgs&);
    const char* helion;
    const char* triton;
  };
  static Tensor bad_k = Tensor::contiguous(DType::f32, {3, 2, 3, 16});
  static Tensor bad_g = Tensor::contiguous(DType::f16, {3, 4, 4, 16});
  static Tensor short_wp = index_tensor({0, 0});
  const std::vector<Case> cases = {
      {"k ring", [](auto& a) { a.k_cache = bad_k.view(); },
       "`k_cache` must have shape [slots, H, L, K].",
       "`k_cache` shape must be (3, 2, 4, 16) (got (3, 2, 3, 16))."},
      {"g dtype", [](auto& a) { a.g_cache = bad_g.view(); }, "`g_cache` must have dtype float32.",
       "`g_cache` must be float32 (got float16)."},
      {"write_pos", [](auto& a) { a.write_pos = short_wp.view(); },
       "`write_pos` must have shape (3,).",
       "`write_pos` and `ssm_state_indices` must both have length B=3 (got 2, 3)."},
  };
  for (const Case& c : cases) {
    for (bool helion : {true, false}) {
      SCOPED_TRACE(std::string(c.what) + (helion ? " (helion)" : " (triton)"));
      auto args = replay_args(host_view, batch, pool.view(), rings.d.view(), rings.k.view(),
                              rings.g.view(), wp, nullptr, 0.25);
      args.helion = helion;
      c.mutate(args);
      auto e = catch_error([&] { deltastate::replayssm_decode(args); });
      ASSERT_TRUE(e);
      EXPECT_EQ(std::string(e->what()), helion ? c.helion : c.triton);
    }
  }
}

TEST(DropIn, DtypeNamesAreMarkedForBindings) {
  Rng rng = test_rng(60);
  const Shape& s = kSmall;
  DecodeBatch batch = make_decode_batch(rng, s, false, {1, 0}, DType::f32);
  Tensor pool = make_pool(DType::f32, 2, s);
  auto args = batch.packed_args(host_view, pool.view(), 0.25);
  Tensor idx = index_tensor({1, 0});
  args.state_indices = with_dtype(idx.view(), DType::f32);
  auto e = catch_error([&] { deltastate::gdn_packed_decode(args); });
  ASSERT_TRUE(e);
  EXPECT_EQ(std::string(e->what()),
            "`ssm_state_indices` must have dtype int32 or int64; got float32");
  const std::string m = "\x1f";
  EXPECT_EQ(e->marked(), "`ssm_state_indices` must have dtype " + m + "int32" + m + " or " + m +
                             "int64" + m + "; got " + m + "float32" + m);
}

}  // namespace
}  // namespace dstest
