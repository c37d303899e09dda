// causal_conv1d_update against causal-conv1d's causal_conv1d_update_ref semantics (fp64
// reference: shifted and circular windows, widths 2..4, state_len > width-1, seqlen > 1, both
// window layouts, padded rows, sentinel entries bit-untouched), T tokens in one call against T
// calls of one token (the conv part of a verify step), and the fused decode layer step against
// the unfused chain of the same library (causal_conv1d_update -> packed decode, bit for bit) and
// an fp64 gated RMSNorm (HF Qwen3NextRMSNormGated), with every error text of both contracts.
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>

#include "layer_step_util.h"
#include "quant_formats.h"
#include "reference/layer_reference.h"
#include "test_util.h"

namespace dstest {
namespace {

using deltastate::CausalConv1dUpdateArgs;
using deltastate::ErrorKind;
using deltastate::FusedDecodeStepArgs;

// ---- causal_conv1d_update against the reference --------------------------------------------
struct ConvCase {
  const char* name;
  DType dtype;
  int width;
  int extra_len;  // state_len = width - 1 + extra_len
  int T;          // 0: a 2-D x
  bool circular, dim_contiguous, bias, silu;
};
inline void PrintTo(const ConvCase& c, std::ostream* os) { *os << c.name; }

class ConvUpdateVsReference : public ::testing::TestWithParam<ConvCase> {};

TEST_P(ConvUpdateVsReference, PaddedIndexedRows) {
  const ConvCase& c = GetParam();
  Rng rng = test_rng();
  const int64_t dim = 40, entries = 7;
  const std::vector<int64_t> idx{5, -1, 0, 3, 2};
  const int64_t B = static_cast<int64_t>(idx.size());
  const int T = c.T == 0 ? 1 : c.T;
  const int L = c.width - 1 + c.extra_len;
  Tensor x = c.T == 0 ? Tensor::strided(c.dtype, {B, dim}, {dim + 3, 1})
                      : Tensor::strided(c.dtype, {B, dim, T}, {dim * T + 2, 1, dim});
  x.fill_all(kSentinel);
  x.fill_normal(rng, 1.0);
  Tensor st = make_window(c.dtype, entries, dim, L, c.dim_contiguous, 4);
  for (int64_t e : idx)
    if (e >= 0) fill_window(st, e, rng);
  Tensor w = Tensor::contiguous(c.dtype, {dim, c.width});
  w.fill_uniform(rng, -0.7, 0.7);
  Tensor bias = Tensor::contiguous(c.dtype, {dim});
  bias.fill_uniform(rng, -0.3, 0.3);
  Tensor cs = index_tensor({3, 0, 9, 1, 2});
  Tensor ind = index_tensor(idx);
  Tensor out =
      c.T == 0 ? Tensor::contiguous(c.dtype, {B, dim}) : Tensor::contiguous(c.dtype, {B, dim, T});
  out.fill_all(std::nan(""));

  // the reference on every live row
  std::vector<std::vector<double>> want_out(B), want_win(B);
  for (int64_t r = 0; r < B; ++r) {
    if (idx[r] < 0) continue;
    std::vector<double> win = window_values(st, idx[r]), xs, ws, bs;
    for (int64_t ch = 0; ch < dim; ++ch)
      for (int t = 0; t < T; ++t) xs.push_back(c.T == 0 ? x.get({r, ch}) : x.get({r, ch, t}));
    ws = w.values();
    if (c.bias) bs = bias.values();
    const int cache = c.circular ? static_cast<int>(index_values(cs)[r]) : -1;
    want_out[r] =
        ref::conv_update(win, xs, ws, bs, static_cast<int>(dim), L, T, c.width, c.silu, cache);
    want_win[r] = win;
  }

  Snapshot before;
  before.add(st).add(x).add(w);
  CausalConv1dUpdateArgs a;
  a.x = x.view();
  a.conv_state = st.view();
  a.weight = w.view();
  if (c.bias) a.bias = bias.view();
  a.silu = c.silu;
  if (c.circular) a.cache_seqlens = cs.view();
  a.conv_state_indices = ind.view();
  a.out = out.view();
  deltastate::causal_conv1d_update(a);

  std::vector<MemRange> written;
  for (int64_t r = 0; r < B; ++r) {
    std::vector<double> got;
    for (int64_t ch = 0; ch < dim; ++ch)
      for (int t = 0; t < T; ++t) got.push_back(c.T == 0 ? out.get({r, ch}) : out.get({r, ch, t}));
    if (idx[r] < 0) {
      EXPECT_TRUE(all_zero(got)) << "padded row " << r;
      continue;
    }
    EXPECT_TRUE(all_close(got, want_out[r], {1e-5, 1e-5}, c.dtype)) << "output of row " << r;
    EXPECT_EQ(window_values(st, idx[r]), want_win[r]) << "window of row " << r;
    written.push_back(range_of(st.view(), idx[r] * st.stride(0), st.stride(0) - 4));
  }
  EXPECT_TRUE(before.unchanged_except(written)) << "memory outside the live windows";
}

INSTANTIATE_TEST_SUITE_P(
    Conv, ConvUpdateVsReference,
    ::testing::Values(ConvCase{"f32_w4", f32, 4, 0, 0, false, false, true, true},
                      ConvCase{"bf16_w4", bf16, 4, 0, 0, false, false, true, true},
                      ConvCase{"f16_w3_nobias", f16, 3, 0, 0, false, false, false, true},
                      ConvCase{"f32_w2_noact", f32, 2, 0, 0, false, false, true, false},
                      ConvCase{"bf16_w4_vllm", bf16, 4, 0, 0, false, true, true, true},
                      ConvCase{"f32_w4_longstate", f32, 4, 3, 0, false, false, true, true},
                      ConvCase{"f32_w4_T3", f32, 4, 0, 3, false, false, true, true},
                      ConvCase{"bf16_w4_T5_longstate_vllm", bf16, 4, 2, 5, false, true, true, true},
                      ConvCase{"f32_w4_circular", f32, 4, 2, 0, true, false, true, true},
                      ConvCase{"f32_w3_circular_T2", f32, 3, 3, 2, true, false, false, true}),
    case_name<ConvCase>);

// T tokens in one call give the outputs and the window of T calls of one token, bit for bit.
TEST(ConvUpdate, TTokensEqualTSingleSteps) {
  Rng rng = test_rng();
  const int64_t B = 3, dim = 24, T = 3;
  for (DType dt : {f32, bf16}) {
    Tensor x = Tensor::contiguous(dt, {B, dim, T});
    x.fill_normal(rng, 1.0);
    Tensor st = make_window(dt, B, dim, 3, false, 0);
    for (int64_t e = 0; e < B; ++e) fill_window(st, e, rng);
    Tensor st1 = clone(st);
    Tensor w = Tensor::contiguous(dt, {dim, 4});
    w.fill_uniform(rng, -0.7, 0.7);
    Tensor out = Tensor::contiguous(dt, {B, dim, T});
    CausalConv1dUpdateArgs a;
    a.x = x.view();
    a.conv_state = st.view();
    a.weight = w.view();
    a.silu = true;
    a.out = out.view();
    deltastate::causal_conv1d_update(a);
    for (int64_t t = 0; t < T; ++t) {
      Tensor xt = x.alias(dt, {B, dim}, {dim * T, T}, t);
      Tensor ot = Tensor::contiguous(dt, {B, dim});
      CausalConv1dUpdateArgs s = a;
      s.x = xt.view();
      s.conv_state = st1.view();
      s.out = ot.view();
      deltastate::causal_conv1d_update(s);
      for (int64_t r = 0; r < B; ++r)
        for (int64_t ch = 0; ch < dim; ++ch)
          ASSERT_EQ(ot.get({r, ch}), out.get({r, ch, t})) << "token " << t;
    }
    EXPECT_EQ(st.bytes(), st1.bytes()) << "windows";
  }
}

// ---- the fused step against the unfused chain -------------------------------------------------
inline constexpr Shape kGdnSmall{"gdn_small", 2, 4, 32, 16};
inline constexpr Shape kKdaSmall{"kda_small", 3, 3, 32, 32};

// The fused step's outputs (b.out) against the chain's attention output o [B, 1, HV, V]: zeros on
// padded rows; without the norm o itself, bit for bit; with it the gated norm of o (the fp64
// reference, rounded where the chain rounds).
void expect_chain_outputs(const LayerBatch& b, const Tensor& o, const std::vector<int64_t>& idx,
                          const std::string& at) {
  const Shape& s = b.c.shape;
  for (int64_t r = 0; r < b.d.B; ++r) {
    for (int hv = 0; hv < s.HV; ++hv) {
      std::vector<double> got, oh, zh, wh;
      for (int v = 0; v < s.V; ++v) {
        got.push_back(b.out.get({r, hv, v}));
        oh.push_back(o.get({r, 0, hv, v}));
        zh.push_back(b.z.get({r, hv, v}));
        wh.push_back(b.norm_w.get({v}));
      }
      if (idx[r] < 0) {
        EXPECT_TRUE(all_zero(got)) << "padded row " << r << ", " << at;
        continue;
      }
      if (!b.c.norm) {
        EXPECT_EQ(got, oh) << "row " << r << " head " << hv << ", " << at << ": the chain's output";
        continue;
      }
      const DType act = b.c.act;
      const auto round_act = [act](double x) { return round_to(act, x); };
      const std::vector<double> want = ref::gated_rms_norm(oh, zh, wh, 1e-6, round_act, round_act);
      EXPECT_TRUE(all_close(got, want, {1e-5, 1e-5}, act, 4))
          << "row " << r << " head " << hv << ", " << at
          << ": the gated norm of the chain's output";
    }
  }
}

// The unfused chain's conv on copies: causal_conv1d_update of the row (per window part: one
// packed window, or the q, k, v windows) into a packed row y [B, conv_dim] (padded rows zero).
Tensor run_chain_conv(const LayerBatch& b, const std::vector<TensorView>& win) {
  const Shape& s = b.c.shape;
  const int64_t B = b.d.B;
  Tensor y = Tensor::contiguous(b.c.act, {B, b.conv_dim});
  y.fill_all(0.0);
  auto conv = [&](int64_t first, int64_t n, const TensorView& window) {
    CausalConv1dUpdateArgs a;
    a.x = b.d.x.alias(b.c.act, {B, n}, {b.d.x.stride(0), 1}, first).view();
    a.conv_state = window;
    a.weight = b.weight.alias(b.c.act, {n, b.c.width}, {b.c.width, 1}, first * b.c.width).view();
    if (b.c.bias) a.bias = b.bias.alias(b.c.act, {n}, {1}, first).view();
    a.silu = true;
    a.conv_state_indices = b.d.idx.view();
    a.out = y.alias(b.c.act, {B, n}, {b.conv_dim, 1}, first).view();
    deltastate::causal_conv1d_update(a);
  };
  if (b.c.split) {
    conv(0, b.HK, win[0]);
    conv(b.HK, b.HK, win[1]);
    conv(2 * b.HK, static_cast<int64_t>(s.HV) * s.V, win[2]);
  } else {
    conv(0, b.conv_dim, win[0]);
  }
  return y;
}
Tensor run_chain_conv(const LayerBatch& b, std::vector<Tensor>& win) {
  std::vector<TensorView> views;
  for (const Tensor& w : win) views.push_back(w.view());
  return run_chain_conv(b, views);
}

// The unfused chain on copies: the conv (run_chain_conv), packed decode of its row y; returns the
// attention output o [B, 1, HV, V].
Tensor run_chain(const LayerBatch& b, Tensor& state, std::vector<Tensor>& win) {
  const Shape& s = b.c.shape;
  const int64_t B = b.d.B;
  Tensor y = run_chain_conv(b, win);
  Tensor o = Tensor::contiguous(b.c.act, {B, 1, s.HV, s.V});
  deltastate::PackedDecodeArgs p;
  p.mixed_qkv = y.view();
  p.a = b.d.a.view();
  p.b = b.d.b.view();
  p.A_log = b.d.A_log.view();
  p.dt_bias = b.d.dt_bias.view();
  p.state = state.view();
  p.out = o.view();
  p.state_indices = b.d.idx.view();
  p.lower_bound = b.c.lower_bound;
  if (b.c.kda) deltastate::kda_packed_decode(p);
  else deltastate::gdn_packed_decode(p);
  return o;
}

class FusedStepVsChain : public ::testing::TestWithParam<LayerCase> {};

TEST_P(FusedStepVsChain, TwoSteps) {
  const LayerCase& c = GetParam();
  Rng rng = test_rng();
  const std::vector<int64_t> idx = pick_slots(rng, 5, 9, {1, 3});
  LayerBatch b = make_layer_batch(rng, c, idx, 9);
  Tensor state2 = clone(b.state);
  std::vector<Tensor> win2;
  for (const Tensor& w : b.win) win2.push_back(clone(w));
  for (int step = 0; step < 2; ++step) {
    if (step > 0) {
      b.d.randomize(rng);
      b.z.fill_normal(rng, 1.0);
      b.poison_out();
    }
    Snapshot inputs, pools;
    for (const Tensor* t : {&b.d.x, &b.d.a, &b.d.b, &b.weight, &b.bias, &b.z, &b.norm_w, &b.d.idx})
      inputs.add(*t);
    pools.add(b.state);
    for (const Tensor& w : b.win) pools.add(w);
    std::vector<MemRange> live;  // the live slots' state and windows: all the step may write
    for (int64_t sl : idx) {
      if (sl < 0) continue;
      live.push_back(slot_range(b.state.view(), sl));
      for (const Tensor& w : b.win)
        live.push_back(range_of(w.view(), sl * w.stride(0), w.size(1) * w.size(2)));
    }
    b.run_fused(b.args(host_view));
    const Tensor o = run_chain(b, state2, win2);
    EXPECT_TRUE(inputs.unchanged()) << "inputs, step " << step;
    EXPECT_TRUE(pools.unchanged_except(live)) << "unused slots and gaps, step " << step;
    // the state and the windows: bit for bit the chain's (sentinels included)
    EXPECT_EQ(b.state.bytes(), state2.bytes()) << "state pool, step " << step;
    for (size_t j = 0; j < b.win.size(); ++j)
      EXPECT_EQ(b.win[j].bytes(), win2[j].bytes()) << "window " << j << ", step " << step;
    expect_chain_outputs(b, o, idx, "step " + std::to_string(step));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Layer, FusedStepVsChain,
    ::testing::Values(
        LayerCase{{"gdn_f32", kGdnSmall, false, kNoLb, f32, f32}, f32},
        LayerCase{{"gdn_bf16state_bf16", kGdnSmall, false, kNoLb, bf16, bf16}, bf16},
        LayerCase{{"gdn_f32state_bf16_vllm", kGdnSmall, false, kNoLb, f32, bf16}, bf16, 4, true},
        LayerCase{{"gdn_f16_w3_nobias_nonorm", kGdnSmall, false, kNoLb, f16, f16},
                  f16,
                  3,
                  false,
                  false,
                  false,
                  false},
        LayerCase{{"gdn_f32_nonorm_pad", kGdnSmall, false, kNoLb, f32, f32},
                  f32,
                  4,
                  false,
                  false,
                  true,
                  false,
                  40},
        LayerCase{{"qwen3next_bf16", kQwen3Next, false, kNoLb, bf16, bf16}, bf16},
        LayerCase{{"kda_f32_split", kKdaSmall, true, kNoLb, f32, f32}, f32, 4, false, true},
        LayerCase{
            {"kda_bf16_lb_split_vllm", kKdaSmall, true, kLb, bf16, bf16}, bf16, 4, true, true},
        LayerCase{{"kda_f32_packed_nonorm", kKdaSmall, true, kNoLb, f32, f32},
                  f32,
                  2,
                  false,
                  false,
                  true,
                  false}),
    case_name<LayerCase>);

// A StatePool's conv windows and envelope layer states as the fused step's views.
// Random values in the live slots (idx >= 0) of a pool layer's state and fp32 conv windows; the
// rest keeps its sentinel.
void fill_live_slots(Rng& rng, const TensorView& st, const TensorView& win,
                     const std::vector<int64_t>& idx) {
  for (int64_t sl : idx) {
    if (sl < 0) continue;
    fill_slot(st, sl, rng);
    for (int64_t ch = 0; ch < win.shape[1]; ++ch)
      for (int64_t i = 0; i < win.shape[2]; ++i)
        store_value(win.data, f32, sl * win.stride[0] + ch * win.stride[1] + i * win.stride[2],
                    rng.uniform(-1, 1));
  }
}

TEST(FusedStep, StatePoolEnvelopeViews) {
  Rng rng = test_rng();
  const Shape s = kGdnSmall;
  deltastate::StatePoolConfig cfg = envelope_config(s, 3, 6, f32, 64);
  cfg.conv_dim = s.width();
  cfg.conv_dtype = f32;
  deltastate::StatePool pool(cfg);
  fill_sentinel(pool.data(), pool.total_bytes(), f32);
  LayerCase c{{"pool", s, false, kNoLb, f32, f32}, f32};
  const std::vector<int64_t> idx{4, -1, 0, 2};
  LayerBatch b = make_layer_batch(rng, c, idx, 6);
  const TensorView st = pool.layer_state(1), win = pool.conv_state(1);
  fill_live_slots(rng, st, win, idx);
  // the same values in test tensors for the chain
  for (int64_t sl : idx) {
    if (sl < 0) continue;
    set_slot_values(b.state.view(), sl, slot_values(st, sl));
    for (int64_t ch = 0; ch < win.shape[1]; ++ch)
      for (int64_t i = 0; i < win.shape[2]; ++i)
        b.win[0].set(
            {sl, ch, i},
            load_value(win.data, f32, sl * win.stride[0] + ch * win.stride[1] + i * win.stride[2]));
  }
  Snapshot before;
  before.add(pool.data(), pool.total_bytes());
  FusedDecodeStepArgs a = b.args(host_view);
  a.state = st;
  a.conv_state = win;
  b.run_fused(a);
  const Tensor o = run_chain(b, b.state, b.win);
  std::vector<MemRange> written;
  for (int64_t sl : idx) {
    if (sl < 0) continue;
    written.push_back(slot_range(st, sl));
    written.push_back(range_of(win, sl * win.stride[0], win.shape[1] * win.shape[2]));
    EXPECT_EQ(slot_values(st, sl), slot_values(b.state.view(), sl)) << "slot " << sl;
    for (int64_t ch = 0; ch < win.shape[1]; ++ch)
      for (int64_t i = 0; i < win.shape[2]; ++i)
        ASSERT_EQ(
            load_value(win.data, f32, sl * win.stride[0] + ch * win.stride[1] + i * win.stride[2]),
            b.win[0].get({sl, ch, i}));
  }
  EXPECT_TRUE(before.unchanged_except(written)) << "pool memory outside the live slots' layer 1";
}

// ---- the ReplaySSM fused step against the unfused chain --------------------------------------
// A ReplaySSM case: the layer case, the ring length, the rings' dtypes, the in-kernel cursor
// advance.
struct ReplayLayerCase {
  LayerCase layer;
  int L = 4;
  DType d_dtype = DType::f32, k_dtype = DType::f32;
  bool advance = false;
};
inline void PrintTo(const ReplayLayerCase& c, std::ostream* os) { *os << c.layer.name; }

// Random ring records at every position of a live slot's rings (so any cursor reads defined
// records): d and k small, g a log decay in [-0.5, 0].
void fill_ring_slot(Rings& r, int64_t slot, Rng& rng) {
  auto fill = [&](Tensor& t, double lo, double hi) {
    int64_t per = 1;
    for (int i = 1; i < t.ndim(); ++i) per *= t.size(i);
    for (int64_t e = 0; e < per; ++e) t.set_linear(slot * per + e, rng.uniform(lo, hi));
  };
  fill(r.d, -0.2, 0.2);
  fill(r.k, -0.3, 0.3);
  fill(r.g, -0.5, 0.0);
}
Rings clone_rings(const Rings& r) { return Rings{r.L, clone(r.d), clone(r.k), clone(r.g)}; }

// The unfused ReplaySSM chain on views: causal_conv1d_update of each window part into a packed
// row y, replayssm_decode of y (with a contiguous copy of `a`, its contract's form) on the
// checkpoint pool `state` in its format `fmt`; returns the attention output o [B, 1, HV, V].
Tensor run_replay_chain(const LayerBatch& b, const TensorView& state,
                        const deltastate::StateFormatArgs& fmt, const std::vector<TensorView>& win,
                        const TensorView& d, const TensorView& k, const TensorView& g, Tensor& wp,
                        const Tensor* ff, bool advance, Tensor* cache_base = nullptr) {
  const Shape& s = b.c.shape;
  const int64_t B = b.d.B;
  Tensor y = run_chain_conv(b, win);
  const int64_t gw = b.c.kda ? static_cast<int64_t>(s.HV) * s.K : s.HV;
  Tensor a = Tensor::contiguous(b.c.act, {B, gw});
  for (int64_t r = 0; r < B; ++r)
    for (int64_t i = 0; i < gw; ++i) a.set({r, i}, b.d.a.get({r, i}));
  Tensor o = Tensor::contiguous(b.c.act, {B, 1, s.HV, s.V});
  deltastate::ReplayDecodeArgs p;
  p.mixed_qkv = y.view();
  p.a = a.view();
  p.b = b.d.b.view();
  p.A_log = b.d.A_log.view();
  p.dt_bias = b.d.dt_bias.view();
  p.state = state;
  p.state_format = fmt;
  p.d_cache = d;
  p.k_cache = k;
  p.g_cache = g;
  p.out = o.view();
  p.state_indices = b.d.idx.view();
  p.write_pos = wp.view();
  if (ff) p.force_flush = ff->view();
  p.is_kda = b.c.kda;
  p.lower_bound = b.c.lower_bound;
  p.advance_write_pos = advance;
  if (cache_base) {  // SGLang's circular ring
    p.cache_base = cache_base->view();
    p.circular_replay = true;
  }
  deltastate::replayssm_decode(p);
  return o;
}
// The same on test tensors (a float checkpoint pool rounded to nearest).
Tensor run_replay_chain(const LayerBatch& b, Tensor& state, std::vector<Tensor>& win, Rings& rings,
                        Tensor& wp, const Tensor* ff, bool advance) {
  std::vector<TensorView> views;
  for (const Tensor& w : win) views.push_back(w.view());
  return run_replay_chain(b, state.view(), {}, views, rings.d.view(), rings.k.view(),
                          rings.g.view(), wp, ff, advance);
}

class FusedReplayVsChain : public ::testing::TestWithParam<ReplayLayerCase> {};

// Several steps from random cursors, rows flushing at L-1 and on force_flush: outputs (without
// the norm), checkpoints, rings, cursors and windows bit for bit the chain's; the norm against
// the fp64 gated norm of the chain's output; unused slots and padded rows bit-untouched.
TEST_P(FusedReplayVsChain, Steps) {
  const ReplayLayerCase& rc = GetParam();
  const LayerCase& c = rc.layer;
  Rng rng = test_rng();
  const Shape& s = c.shape;
  const int64_t slots = 9;
  const std::vector<int64_t> idx = pick_slots(rng, 5, slots, {1, 3});
  LayerBatch b = make_layer_batch(rng, c, idx, slots);
  Rings rings = make_rings(s, c.kda, slots, rc.L, rc.d_dtype, rc.k_dtype);
  for (int64_t sl : idx)
    if (sl >= 0) fill_ring_slot(rings, sl, rng);
  Tensor state2 = clone(b.state);
  std::vector<Tensor> win2;
  for (const Tensor& w : b.win) win2.push_back(clone(w));
  Rings rings2 = clone_rings(rings);
  std::vector<int64_t> cursors;
  for (int64_t r = 0; r < b.d.B; ++r) cursors.push_back(rng.integer(0, rc.L - 1));
  cursors[1] = 7;  // a padded row's cursor: never read, never advanced
  int flushes_natural = 0, flushes_forced = 0, appends = 0;
  for (int step = 0; step < 2 * rc.L + 1; ++step) {
    if (step > 0) {
      b.d.randomize(rng);
      b.z.fill_normal(rng, 1.0);
      b.poison_out();
    }
    Tensor wp = index_tensor(cursors), wp2 = index_tensor(cursors);
    std::vector<int64_t> force;
    for (int64_t r = 0; r < b.d.B; ++r) force.push_back(rng.uniform(0, 1) < 0.2 ? 1 : 0);
    const Tensor ff = index_tensor(force);
    for (int64_t r = 0; r < b.d.B; ++r) {
      if (idx[r] < 0) continue;
      if (cursors[r] == rc.L - 1) ++flushes_natural;
      else if (force[r]) ++flushes_forced;
      else ++appends;
    }
    Snapshot pools;
    pools.add(b.state).add(rings.d).add(rings.k).add(rings.g);
    for (const Tensor& w : b.win) pools.add(w);
    std::vector<MemRange> live;
    for (int64_t sl : idx) {
      if (sl < 0) continue;
      live.push_back(slot_range(b.state.view(), sl));
      for (const Tensor& w : b.win)
        live.push_back(range_of(w.view(), sl * w.stride(0), w.size(1) * w.size(2)));
      for (const Tensor* t : {&rings.d, &rings.k, &rings.g})
        live.push_back(range_of(t->view(), sl * t->stride(0), t->stride(0)));
    }
    FusedDecodeStepArgs a = b.args(host_view);
    add_replay(a, host_view, rings, wp, &ff, rc.advance);
    b.run_fused(a);
    const Tensor o = run_replay_chain(b, state2, win2, rings2, wp2, &ff, rc.advance);
    EXPECT_TRUE(pools.unchanged_except(live)) << "unused slots and gaps, step " << step;
    EXPECT_EQ(b.state.bytes(), state2.bytes()) << "checkpoints, step " << step;
    EXPECT_EQ(rings.d.bytes(), rings2.d.bytes()) << "d ring, step " << step;
    EXPECT_EQ(rings.k.bytes(), rings2.k.bytes()) << "k ring, step " << step;
    EXPECT_EQ(rings.g.bytes(), rings2.g.bytes()) << "g ring, step " << step;
    EXPECT_EQ(index_values(wp), index_values(wp2)) << "cursors, step " << step;
    for (size_t j = 0; j < b.win.size(); ++j)
      EXPECT_EQ(b.win[j].bytes(), win2[j].bytes()) << "window " << j << ", step " << step;
    expect_chain_outputs(b, o, idx, "step " + std::to_string(step));
    // the cursors of the next step
    const std::vector<int64_t> moved = index_values(wp);
    for (int64_t r = 0; r < b.d.B; ++r) {
      const bool flushed = cursors[r] == rc.L - 1 || force[r] != 0;
      const int64_t want = idx[r] < 0 ? cursors[r] : flushed ? 0 : cursors[r] + 1;
      if (rc.advance) EXPECT_EQ(moved[r], want) << "advanced cursor of row " << r;
      else EXPECT_EQ(moved[r], cursors[r]) << "cursor of row " << r << " left as given";
      cursors[r] = want;
    }
  }
  EXPECT_GT(flushes_natural, 0) << "no row flushed at L-1";
  EXPECT_GT(flushes_forced, 0) << "no forced flush";
  EXPECT_GT(appends, 0) << "no appending step";
}

INSTANTIATE_TEST_SUITE_P(
    Layer, FusedReplayVsChain,
    ::testing::Values(
        ReplayLayerCase{LayerCase{{"gdn_f32", kGdnSmall, false, kNoLb, f32, f32}, f32}, 4},
        ReplayLayerCase{LayerCase{{"gdn_f32_nonorm_pad_advance", kGdnSmall, false, kNoLb, f32, f32},
                                  f32,
                                  4,
                                  false,
                                  false,
                                  true,
                                  false,
                                  40},
                        5, f32, f32, true},
        ReplayLayerCase{
            LayerCase{{"gdn_bf16state_bf16rings_vllm", kGdnSmall, false, kNoLb, bf16, bf16},
                      bf16,
                      4,
                      true},
            4, bf16, bf16},
        ReplayLayerCase{
            LayerCase{{"gdn_f32state_bf16_kring_bf16_nonorm", kGdnSmall, false, kNoLb, f32, bf16},
                      bf16,
                      3,
                      false,
                      false,
                      true,
                      false},
            3, f32, bf16, true},
        ReplayLayerCase{LayerCase{{"kda_f32_split_nonorm", kKdaSmall, true, kNoLb, f32, f32},
                                  f32,
                                  4,
                                  false,
                                  true,
                                  true,
                                  false,
                                  24},
                        4, f32, f32, true},
        ReplayLayerCase{
            LayerCase{
                {"kda_bf16_lb_split", kKdaSmall, true, kLb, bf16, bf16}, bf16, 4, false, true},
            6, bf16, f32},
        ReplayLayerCase{
            LayerCase{
                {"kda_f32state_bf16_packed_f16dring", kKdaSmall, true, kNoLb, f32, bf16}, bf16, 2},
            3, DType::f16, bf16}),
    [](const ::testing::TestParamInfo<ReplayLayerCase>& i) {
      return std::string(i.param.layer.name);
    });

// A StatePool envelope pool (layer states with the slot stride of the whole envelope) as the
// checkpoint pool, with its conv windows, against the chain on the same pool views.
TEST(FusedReplay, StatePoolEnvelopeViews) {
  Rng rng = test_rng();
  const Shape s = kGdnSmall;
  deltastate::StatePoolConfig cfg = envelope_config(s, 2, 6, f32, 64);
  cfg.conv_dim = s.width();
  cfg.conv_dtype = f32;
  deltastate::StatePool pool(cfg), pool2(cfg);
  fill_sentinel(pool.data(), pool.total_bytes(), f32);
  const LayerCase c{{"pool", s, false, kNoLb, f32, f32}, f32, 4, false, false, true, false};
  const std::vector<int64_t> idx{4, -1, 0, 2};
  LayerBatch b = make_layer_batch(rng, c, idx, 6);
  const TensorView st = pool.layer_state(1), win = pool.conv_state(1);
  fill_live_slots(rng, st, win, idx);
  std::memcpy(pool2.data(), pool.data(), static_cast<size_t>(pool.total_bytes()));
  Rings rings = make_rings(s, false, 6, 4, f32, f32);
  for (int64_t sl : idx)
    if (sl >= 0) fill_ring_slot(rings, sl, rng);
  Rings rings2 = clone_rings(rings);
  for (int step = 0; step < 5; ++step) {
    if (step > 0) b.d.randomize(rng);
    Tensor wp = index_tensor({step % 4, 0, (step + 1) % 4, 3}), wp2 = clone(wp);
    FusedDecodeStepArgs a = b.args(host_view);
    a.state = st;
    a.conv_state = win;
    add_replay(a, host_view, rings, wp, nullptr, false);
    b.run_fused(a);
    // the chain on the second pool's views
    const TensorView st_b = pool2.layer_state(1), win_b = pool2.conv_state(1);
    Tensor o = Tensor::contiguous(f32, {b.d.B, 1, s.HV, s.V});
    {
      Tensor y = Tensor::contiguous(f32, {b.d.B, b.conv_dim});
      CausalConv1dUpdateArgs ca;
      ca.x = b.d.x.view();
      ca.conv_state = win_b;
      ca.weight = b.weight.view();
      ca.bias = b.bias.view();
      ca.silu = true;
      ca.conv_state_indices = b.d.idx.view();
      ca.out = y.view();
      deltastate::causal_conv1d_update(ca);
      Tensor ac = Tensor::contiguous(f32, {b.d.B, s.HV});
      for (int64_t r = 0; r < b.d.B; ++r)
        for (int64_t i = 0; i < s.HV; ++i) ac.set({r, i}, b.d.a.get({r, i}));
      deltastate::ReplayDecodeArgs p;
      p.mixed_qkv = y.view();
      p.a = ac.view();
      p.b = b.d.b.view();
      p.A_log = b.d.A_log.view();
      p.dt_bias = b.d.dt_bias.view();
      p.state = st_b;
      p.d_cache = rings2.d.view();
      p.k_cache = rings2.k.view();
      p.g_cache = rings2.g.view();
      p.out = o.view();
      p.state_indices = b.d.idx.view();
      p.write_pos = wp2.view();
      deltastate::replayssm_decode(p);
    }
    EXPECT_EQ(std::memcmp(pool.data(), pool2.data(), static_cast<size_t>(pool.total_bytes())), 0)
        << "the envelope pool (checkpoints, windows, sentinels), step " << step;
    EXPECT_EQ(rings.d.bytes(), rings2.d.bytes()) << "d ring, step " << step;
    EXPECT_EQ(rings.k.bytes(), rings2.k.bytes()) << "k ring, step " << step;
    EXPECT_EQ(rings.g.bytes(), rings2.g.bytes()) << "g ring, step " << step;
    for (int64_t r = 0; r < b.d.B; ++r)
      for (int hv = 0; hv < s.HV; ++hv)
        for (int v = 0; v < s.V; ++v)
          ASSERT_EQ(b.out.get({r, hv, v}), idx[r] < 0 ? 0.0 : o.get({r, 0, hv, v}))
              << "row " << r << " head " << hv << ", step " << step;
  }
}

// ---- the ReplaySSM fused step on a quantized / stochastically rounded pool ---------------------
// The fused step in ReplaySSM mode on a StatePool in its storage format (float8 / int8 codes with
// row scales, or stochastically rounded bf16) against the unfused chain (causal_conv1d_update,
// then replayssm_decode with the same format keywords) on a byte copy of the pool: the CPU runs
// the same code for the checkpoint's loads and stores, so every byte of the two pools (codes,
// scales, windows, rings, step counters, sentinels) is equal, and the outputs too (with the norm:
// the fp64 gated norm of the chain's output).
struct FusedReplayFmtCase {
  const char* name;
  bool kda;
  DType dtype;
  deltastate::StateRounding rounding;
  deltastate::PoolLayout layout;
  bool norm = true;
  bool split = false;       // KDA's separate q, k, v windows
  int32_t cache_base = -1;  // >= 0: SGLang's circular ring, rows starting at this base
};
inline void PrintTo(const FusedReplayFmtCase& c, std::ostream* os) { *os << c.name; }

// Two layers, 7 slots, ReplaySSM rings of length L, fp32 conv windows (split: three).
deltastate::StatePoolConfig fmt_replay_config(const FusedReplayFmtCase& c, const Shape& s, int L) {
  deltastate::StatePoolConfig cfg;
  cfg.layers = 2;
  cfg.slots = 7;
  cfg.H = s.H;
  cfg.HV = s.HV;
  cfg.V = s.V;
  cfg.K = s.K;
  cfg.state_dtype = c.dtype;
  cfg.state_rounding = c.rounding;
  cfg.rounding_seed = kSeed;
  cfg.layout = c.layout;
  cfg.envelope_extra_bytes = c.layout == deltastate::PoolLayout::envelope ? 40 : 0;
  cfg.replay_len = L;
  cfg.kda = c.kda;
  cfg.conv_dim = s.width();
  cfg.conv_dtype = f32;
  cfg.conv_split_qkv = c.split;
  return cfg;
}

// What a step may write in `layer`: the live slots' checkpoints (codes and scales), windows and
// rings, and the layer's step counter.
std::vector<MemRange> fmt_replay_written(const deltastate::StatePool& pool, int64_t layer,
                                         const std::vector<int64_t>& idx) {
  const deltastate::StatePoolConfig& cfg = pool.config();
  std::vector<MemRange> w;
  auto slot_of = [&](const TensorView& v, int64_t sl) {
    int64_t per = 1;
    for (int d = 1; d < v.ndim; ++d) per *= v.shape[d];
    w.push_back(range_of(v, sl * v.stride[0], per));
  };
  for (int64_t sl : idx) {
    if (sl < 0) continue;
    slot_of(pool.layer_state(layer), sl);
    if (cfg.state_dtype == DType::f8e4m3 || cfg.state_dtype == DType::i8)
      slot_of(pool.layer_scales(layer), sl);
    for (const TensorView& win : pool_windows(pool, layer)) slot_of(win, sl);
    slot_of(pool.d_cache(layer), sl);
    slot_of(pool.k_cache(layer), sl);
    slot_of(pool.g_cache(layer), sl);
  }
  if (cfg.stochastic_rounding()) w.push_back(range_of(pool.rounding_step(layer), 0, 1));
  return w;
}

class FusedReplayFmt : public ::testing::TestWithParam<FusedReplayFmtCase> {};

// 2L + 1 steps from random cursors (appends, natural and forced flushes; circular: history
// checkpoints), cursors advanced by the op: both pools equal byte for byte after every step,
// outputs equal (a padded row's zeros), the step counter one on per call, the other layer, the
// unused slots and every sentinel scale untouched, and the flushed rows' scales rewritten.
TEST_P(FusedReplayFmt, MatchesUnfusedChain) {
  const FusedReplayFmtCase& fc = GetParam();
  const Shape s = fc.kda ? kKdaSmall : kGdnSmall;
  const int L = 3;
  const int64_t layer = 1;
  Rng rng = test_rng();
  const std::vector<int64_t> idx{4, -1, 0, 6, 2};
  const LayerCase c{
      {fc.name, s, fc.kda, fc.kda ? kLb : kNoLb, f32, f32}, f32, 4, false, fc.split, true, fc.norm};
  LayerBatch b = make_layer_batch(rng, c, idx, 7);  // its own state and windows stay unused
  const deltastate::StatePoolConfig cfg = fmt_replay_config(fc, s, L);
  deltastate::StatePool pool(cfg), twin(cfg);
  fill_formatted_pool(pool, {layer}, idx, rng);
  std::memcpy(twin.data(), pool.data(), static_cast<size_t>(pool.total_bytes()));
  Snapshot start;
  start.add(pool.data(), pool.total_bytes());
  const std::vector<MemRange> written = fmt_replay_written(pool, layer, idx);
  const bool circular = fc.cache_base >= 0;
  std::vector<int64_t> cursors, bases;
  for (size_t r = 0; r < idx.size(); ++r) {
    cursors.push_back(rng.integer(0, L - 1));
    bases.push_back(circular ? (fc.cache_base + static_cast<int32_t>(r)) % L : 0);
  }
  const bool quantized = fc.dtype == DType::f8e4m3 || fc.dtype == DType::i8;
  int flushes = 0;
  for (int step = 0; step < 2 * L + 1; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    if (step > 0) {
      b.d.randomize(rng);
      b.z.fill_normal(rng, 1.0);
    }
    b.poison_out();
    std::vector<int64_t> force;
    for (size_t r = 0; r < idx.size(); ++r) force.push_back(step % 3 == 1 && r == 2 ? 1 : 0);
    Tensor wp = index_tensor(cursors), wp2 = index_tensor(cursors), ff = index_tensor(force);
    Tensor base = index_tensor(bases), base2 = index_tensor(bases);
    std::vector<int64_t> flushed;
    for (size_t r = 0; r < idx.size(); ++r)
      if (idx[r] >= 0 && (cursors[r] == L - 1 || force[r] != 0)) flushed.push_back(idx[r]);
    flushes += static_cast<int>(flushed.size());
    FusedDecodeStepArgs a = b.args(host_view);
    const std::vector<TensorView> win = pool_windows(pool, layer);
    a.conv_state = win[0];
    if (fc.split) {
      a.conv_state_k = win[1];
      a.conv_state_v = win[2];
    }
    a.state = pool.layer_state(layer);
    a.state_format = format_of(pool, layer, fc.rounding);
    a.d_cache = pool.d_cache(layer);
    a.k_cache = pool.k_cache(layer);
    a.g_cache = pool.g_cache(layer);
    a.write_pos = wp.view();
    a.force_flush = ff.view();
    a.advance_write_pos = true;
    if (circular) {
      a.cache_base = base.view();
      a.circular_replay = true;
    }
    b.run_fused(a);
    const Tensor o =
        run_replay_chain(b, twin.layer_state(layer), format_of(twin, layer, fc.rounding),
                         pool_windows(twin, layer), twin.d_cache(layer), twin.k_cache(layer),
                         twin.g_cache(layer), wp2, &ff, true, circular ? &base2 : nullptr);
    EXPECT_EQ(std::memcmp(pool.data(), twin.data(), static_cast<size_t>(pool.total_bytes())), 0)
        << "the pools (checkpoints, scales, windows, rings, step counters, sentinels)";
    EXPECT_EQ(index_values(wp), index_values(wp2)) << "cursors";
    EXPECT_EQ(index_values(base), index_values(base2)) << "cache_base";
    expect_chain_outputs(b, o, idx, "step " + std::to_string(step));
    EXPECT_TRUE(start.unchanged_except(written)) << "outside the live slots of the layer";
    if (cfg.stochastic_rounding()) {
      EXPECT_EQ(*static_cast<const int64_t*>(pool.rounding_step(layer).data), kStep0 + step + 1);
      EXPECT_EQ(*static_cast<const int64_t*>(pool.rounding_step(0).data), kStep0);
    }
    if (quantized) {  // a flushed row stores fresh scales (finite, never the sentinel)
      const TensorView sc = pool.layer_scales(layer);
      for (int64_t sl : flushed)
        for (int64_t r = 0; r < cfg.HV * cfg.V; ++r) {
          const float v = static_cast<const float*>(sc.data)[sl * sc.stride[0] + r];
          ASSERT_TRUE(std::isfinite(v) && v < 1e29f) << "slot " << sl << " row " << r;
        }
    }
    const std::vector<int64_t> moved = index_values(wp), moved_base = index_values(base);
    for (size_t r = 0; r < idx.size(); ++r) {
      cursors[r] = moved[r];
      bases[r] = moved_base[r];
    }
  }
  EXPECT_GE(flushes, 4) << "too few flushes";
}

INSTANTIATE_TEST_SUITE_P(
    Fmt, FusedReplayFmt,
    ::testing::Values(FusedReplayFmtCase{"gdn_fp8_sr", false, DType::f8e4m3,
                                         deltastate::StateRounding::format_default,
                                         deltastate::PoolLayout::per_layer},
                      FusedReplayFmtCase{"gdn_int8_rn_envelope_nonorm", false, DType::i8,
                                         deltastate::StateRounding::nearest,
                                         deltastate::PoolLayout::envelope, false},
                      FusedReplayFmtCase{"gdn_bf16_sr", false, DType::bf16,
                                         deltastate::StateRounding::stochastic,
                                         deltastate::PoolLayout::per_layer},
                      FusedReplayFmtCase{"gdn_int8_sr_circular", false, DType::i8,
                                         deltastate::StateRounding::stochastic,
                                         deltastate::PoolLayout::per_layer, true, false, 1},
                      FusedReplayFmtCase{"kda_fp8_rn_split_envelope", true, DType::f8e4m3,
                                         deltastate::StateRounding::nearest,
                                         deltastate::PoolLayout::envelope, true, true},
                      FusedReplayFmtCase{"kda_int8_sr_nonorm", true, DType::i8,
                                         deltastate::StateRounding::stochastic,
                                         deltastate::PoolLayout::per_layer, false},
                      FusedReplayFmtCase{"kda_bf16_sr_circular", true, DType::bf16,
                                         deltastate::StateRounding::stochastic,
                                         deltastate::PoolLayout::envelope, true, false, 2}),
    case_name<FusedReplayFmtCase>);

// ---- every error text ---------------------------------------------------------------------------
struct ConvErrorFixture {
  Tensor x = Tensor::contiguous(f32, {2, 8});
  Tensor st = Tensor::contiguous(f32, {4, 8, 3});
  Tensor w = Tensor::contiguous(f32, {8, 4});
  Tensor bias = Tensor::contiguous(f32, {8});
  Tensor idx = index_tensor({1, 2});
  Tensor out = Tensor::contiguous(f32, {2, 8});
  CausalConv1dUpdateArgs args() const { return conv_args(x, st, w, idx, out); }
};

TEST(ConvUpdateContract, EveryErrorText) {
  ConvErrorFixture f;
  auto run = [](CausalConv1dUpdateArgs a) { return [a] { deltastate::causal_conv1d_update(a); }; };
  CausalConv1dUpdateArgs a = f.args();
  Tensor x4 = Tensor::contiguous(f32, {2, 8, 1, 1});
  a.x = x4.view();
  expect_error(run(a),
               "`x` must have shape [batch, dim] or [batch, dim, seqlen] (got (2, 8, 1, 1)).");
  a = f.args();
  Tensor xi = Tensor::contiguous(DType::i32, {2, 8});
  a.x = xi.view();
  expect_error(run(a), "`x` must have dtype float32, bfloat16 or float16; got int32");
  a = f.args();
  Tensor st2 = Tensor::contiguous(f32, {4, 8});
  a.conv_state = st2.view();
  expect_error(run(a), "`conv_state` must be a 3D tensor [batch, dim, state_len] (got ndim=2).");
  a = f.args();
  Tensor stb = Tensor::contiguous(bf16, {4, 8, 3});
  a.conv_state = stb.view();
  expect_error(run(a), "`conv_state` must have the dtype of `x` (float32; got bfloat16).");
  a = f.args();
  Tensor w7 = Tensor::contiguous(f32, {7, 4});
  a.weight = w7.view();
  expect_error(run(a), "`weight` must have shape [dim, width] with dim=8 (got (7, 4)).");
  a = f.args();
  Tensor w5 = Tensor::contiguous(f32, {8, 5});
  a.weight = w5.view();
  expect_error(run(a), "causal_conv1d only supports width between 2 and 4");
  a = f.args();
  Tensor bb = Tensor::contiguous(bf16, {8});
  a.bias = bb.view();
  expect_error(run(a), "`bias` must have the dtype of `weight` (float32; got bfloat16).");
  a = f.args();
  Tensor b7 = Tensor::contiguous(f32, {7});
  a.bias = b7.view();
  expect_error(run(a), "`bias` must have shape [dim] with dim=8 (got (7,)).");
  a = f.args();
  Tensor st1 = Tensor::contiguous(f32, {4, 8, 2});
  a.conv_state = st1.view();
  expect_error(run(a), "`conv_state` must have state_len >= width - 1 = 3 (got 2).");
  a = f.args();
  Tensor i64 = index_tensor({1, 2}, DType::i64);
  a.conv_state_indices = i64.view();
  expect_error(run(a), "`conv_state_indices` must have dtype int32; got int64");
  a = f.args();
  Tensor i3 = index_tensor({1, 2, 3});
  a.conv_state_indices = i3.view();
  expect_error(run(a), "`conv_state_indices` must have shape [batch]=(2) (got (3,)).");
  a = f.args();
  Tensor iw = index_tensor({1, 0, 2, 0});
  a.conv_state_indices = iw.alias(DType::i32, {2}, {2}, 0).view();
  expect_error(run(a),
               "`conv_state_indices` must be contiguous. `conv_state_indices` has strides (2,) for "
               "shape (2,); expected (1,).");
  a = f.args();
  Tensor st9 = Tensor::contiguous(f32, {4, 9, 3});
  a.conv_state = st9.view();
  expect_error(
      run(a), "`conv_state` must have shape [entries, dim, state_len] with dim=8 (got (4, 9, 3)).");
  a = f.args();
  a.conv_state_indices.reset();
  expect_error(run(a),
               "`conv_state` must have shape [batch, dim, state_len]=(2, 8, 3) (got (4, 8, 3)).");
  a = f.args();
  Tensor csl = index_tensor({1, 2}, DType::i64);
  a.cache_seqlens = csl.view();
  expect_error(run(a), "`cache_seqlens` must have dtype int32; got int64");
  a = f.args();
  Tensor cs1 = index_tensor({1});
  a.cache_seqlens = cs1.view();
  expect_error(run(a), "`cache_seqlens` must have shape [batch]=(2) (got (1,)).");
  a = f.args();
  Tensor csw = index_tensor({1, 0, 2, 0});
  a.cache_seqlens = csw.alias(DType::i32, {2}, {2}, 0).view();
  expect_error(
      run(a),
      "`cache_seqlens` must be contiguous. `cache_seqlens` has strides (2,) for shape (2,); "
      "expected (1,).");
  a = f.args();
  Tensor ob = Tensor::contiguous(bf16, {2, 8});
  a.out = ob.view();
  expect_error(run(a),
               "`out` must have the shape (2, 8) and dtype float32 of `x` (got (2, 8), bfloat16).");
  a = f.args();
  a.out.device = Device::cuda(0);
  expect_error(run(a),
               "causal_conv1d_update: all tensors must be on the same device: `x` is on cpu, "
               "`out` is on cuda:0");
  a = f.args();
  Tensor bad = index_tensor({1, 4});
  a.conv_state_indices = bad.view();
  expect_error(
      run(a),
      "`conv_state_indices`[1]=4 is out of range for a state pool of 4 slots (valid: 0..3; "
      "< 0 marks a padded row)");
  Tensor dup = index_tensor({2, 2});
  a.conv_state_indices = dup.view();
  expect_error(
      run(a),
      "`conv_state_indices` uses slot 2 for rows 0 and 1; each live row needs its own slot");
}

TEST(FusedStepContract, EveryErrorText) {
  Rng rng = test_rng();
  const LayerCase c{{"err", kGdnSmall, false, kNoLb, f32, f32}, f32};
  LayerBatch b = make_layer_batch(rng, c, {1, 2}, 4);
  auto run = [&b](FusedDecodeStepArgs a) { return [&b, a] { b.run_fused(a); }; };
  const FusedDecodeStepArgs base = b.args(host_view);
  FusedDecodeStepArgs a = base;
  Tensor o4 = Tensor::contiguous(f32, {2, 1, 4, 16});
  a.out = o4.view();
  expect_error(run(a), "`out` must be a contiguous [B, HV, V] tensor (got shape (2, 1, 4, 16)).");
  a = base;
  Tensor ow = Tensor::contiguous(f32, {2, 4, 15});
  a.out = ow.view();
  expect_error(run(a), "`out` must have shape (2, 1, 4, 16) (got out.shape=(2, 1, 4, 15)).");
  a = base;
  Tensor w7 = Tensor::contiguous(f32, {7, 4});
  a.conv_weight = w7.view();
  expect_error(run(a), "`conv_weight` must have shape [dim, width] with dim=192 (got (7, 4)).");
  a = base;
  Tensor wb = Tensor::contiguous(f32, {192});
  a.conv_bias = wb.alias(f32, {100}, {1}, 0).view();
  expect_error(run(a), "`conv_bias` must have shape [dim] with dim=192 (got (100,)).");
  a = base;
  Tensor win9 = Tensor::contiguous(f32, {4, 191, 3});
  a.conv_state = win9.view();
  expect_error(run(a), "`conv_state` must have shape [slots, 192, state_len] (got (4, 191, 3)).");
  a = base;
  Tensor win5 = Tensor::contiguous(f32, {5, 192, 3});
  a.conv_state = win5.view();
  expect_error(run(a), "`conv_state` must have as many slots as `initial_state` (4; got 5).");
  a = base;
  Tensor win2 = Tensor::contiguous(f32, {4, 192, 2});
  a.conv_state = win2.view();
  expect_error(run(a), "`conv_state` must have state_len >= width - 1 = 3 (got 2).");
  a = base;
  Tensor wk = Tensor::contiguous(f32, {4, 64, 3});
  a.conv_state_k = wk.view();
  expect_error(run(a), "`conv_state_k` and `conv_state_v` go together (separate q, k, v windows).");
  Tensor wq = Tensor::contiguous(f32, {4, 64, 3}), wv = Tensor::contiguous(f32, {4, 63, 3});
  a.conv_state = wq.view();
  a.conv_state_v = wv.view();
  expect_error(run(a), "`conv_state_v` must have shape [slots, 64, state_len] (got (4, 63, 3)).");
  Tensor wk4 = Tensor::contiguous(f32, {4, 64, 4});
  a.conv_state_k = wk4.view();
  Tensor wv3 = Tensor::contiguous(f32, {4, 64, 3});
  a.conv_state_v = wv3.view();
  expect_error(run(a), "`conv_state`, `conv_state_k` and `conv_state_v` must have one state_len.");
  a = base;
  a.z.reset();
  expect_error(run(a),
               "`norm_weight` and `z` go together: both for the gated RMSNorm, or neither.");
  a = base;
  Tensor nw = Tensor::contiguous(f32, {15});
  a.norm_weight = nw.view();
  expect_error(run(a), "`norm_weight` must have shape [V]=(16) (got (15,)).");
  a = base;
  Tensor z3 = Tensor::contiguous(f32, {2, 3, 16});
  a.z = z3.view();
  expect_error(run(a), "`z` must have shape [B, HV, V]=(2, 4, 16) (got (2, 3, 16)).");
  a = base;
  Tensor zt = Tensor::contiguous(f32, {2, 16, 4});
  a.z = zt.alias(f32, {2, 4, 16}, {64, 1, 4}, 0).view();
  expect_error(
      run(a),
      "`z` must be contiguous in the last dim. `z` has strides (64, 1, 4); expected a last "
      "stride of 1.");
  a = base;
  a.norm_eps = -1.0;
  expect_error(run(a), "norm_eps must be finite and >= 0 (got -1)");
  a = base;
  a.z->device = Device::cuda(0);
  expect_error(run(a),
               "fused_decode_step: all tensors must be on the same device: `mixed_qkv` is on cpu, "
               "`z` is on cuda:0");
  a = base;
  Tensor bad = index_tensor({1, 4});
  a.state_indices = bad.view();
  expect_error(run(a),
               "`ssm_state_indices`[1]=4 is out of range for a state pool of 4 slots (valid: 0..3; "
               "< 0 marks a padded row)");
  // The CUDA kernel's limits, checked before any launch (views marked as CUDA tensors).
  auto on_cuda = [](const Tensor& t) {
    TensorView v = t.view();
    v.device = Device::cuda(0);
    return v;
  };
  const LayerCase wide{{"wide", Shape{"wide", 1, 4, 64, 128}, false, kNoLb, f32, f32}, f32};
  LayerBatch w = make_layer_batch(rng, wide, {0}, 2);
  expect_error([&] { w.run_fused(w.args(on_cuda)); },
               "fused_decode_step on CUDA supports K in {64, 128} and (HV/H)*V <= 256 (got K=64, "
               "(HV/H)*V=512)",
               ErrorKind::not_implemented);
  const LayerCase k128{{"k128", Shape{"k128", 1, 1, 128, 16}, false, kNoLb, f32, f32}, f32};
  LayerBatch u_batch = make_layer_batch(rng, k128, {0}, 4);
  FusedDecodeStepArgs u = u_batch.args(on_cuda);
  Tensor pool = make_pool(f32, 4, k128.shape, 1);
  u.state = on_cuda(pool);
  expect_error([&] { u_batch.run_fused(u); },
               "fused_decode_step on CUDA needs 16-byte aligned state rows (base address and slot "
               "stride)",
               ErrorKind::not_implemented);
}

// Every error of the ReplaySSM mode, and a rejected call leaves every tensor bit-unchanged.
TEST(FusedReplayContract, EveryErrorText) {
  Rng rng = test_rng();
  const LayerCase c{{"err", kGdnSmall, false, kNoLb, f32, f32}, f32};
  LayerBatch b = make_layer_batch(rng, c, {1, 2}, 4);
  Rings rings = make_rings(c.shape, false, 4, 4, f32, f32);
  Tensor wp = index_tensor({0, 3}), ff = index_tensor({0, 1});
  auto run = [&b](FusedDecodeStepArgs a) { return [&b, a] { b.run_fused(a); }; };
  FusedDecodeStepArgs base = b.args(host_view);
  add_replay(base, host_view, rings, wp, &ff, true);
  auto missing = [](const char* name) {
    return std::string("fused_decode_step (ReplaySSM): `") + name +
           "` is missing; `d_cache`, `k_cache`, `g_cache` and `write_pos` go together "
           "(force_flush, advance_write_pos and the ring modes need them).";
  };
  FusedDecodeStepArgs a = base;
  a.k_cache.reset();
  expect_error(run(a), missing("k_cache"));
  a = base;
  a.g_cache.reset();
  expect_error(run(a), missing("g_cache"));
  a = base;
  a.write_pos.reset();
  expect_error(run(a), missing("write_pos"));
  a = b.args(host_view);
  a.force_flush = ff.view();
  expect_error(run(a), missing("d_cache"));
  a = b.args(host_view);
  a.advance_write_pos = true;
  expect_error(run(a), missing("d_cache"));
  a = base;
  Tensor wp64 = index_tensor({0, 3}, DType::i64);
  a.write_pos = wp64.view();
  expect_error(run(a), "`write_pos` must be a contiguous 1D int32 tensor.");
  a = base;
  Tensor ff64 = index_tensor({0, 1}, DType::i64);
  a.force_flush = ff64.view();
  expect_error(run(a), "`force_flush` must be a contiguous 1D int32 tensor or None.");
  a = base;
  Tensor d2 = Tensor::contiguous(f32, {4, 4});
  a.d_cache = d2.view();
  expect_error(run(a), "`d_cache` shape must be (4, 4, L, 16) (got (4, 4)).");
  a = base;
  Tensor d0 = Tensor::contiguous(f32, {4, 4, 0, 16});
  a.d_cache = d0.view();
  expect_error(run(a), "ReplaySSM cache length must be at least 1.");
  a = base;
  a.d_cache = rings.d.alias(f32, {4, 4, 2, 16}, {256, 64, 32, 1}, 0).view();
  expect_error(
      run(a),
      "ReplaySSM ring caches must be contiguous. `d_cache` has strides (256, 64, 32, 1) for "
      "shape (4, 4, 2, 16); expected (128, 32, 16, 1).");
  a = base;
  Tensor d5 = Tensor::contiguous(f32, {4, 4, 4, 15});
  a.d_cache = d5.view();
  expect_error(run(a), "`d_cache` shape must be (4, 4, 4, 16) (got (4, 4, 4, 15)).");
  a = base;
  Tensor k5 = Tensor::contiguous(f32, {4, 2, 4, 31});
  a.k_cache = k5.view();
  expect_error(run(a), "`k_cache` shape must be (4, 2, 4, 32) (got (4, 2, 4, 31)).");
  a = base;
  Tensor g4 = Tensor::contiguous(f32, {4, 4, 4, 32});
  a.g_cache = g4.view();
  expect_error(run(a), "`g_cache` shape must be (4, 4, 4) (got (4, 4, 4, 32)).");
  a = base;
  Tensor gb = Tensor::contiguous(bf16, {4, 4, 4});
  a.g_cache = gb.view();
  expect_error(run(a), "`g_cache` must be float32 (got bfloat16).");
  a = base;
  Tensor i64 = index_tensor({1, 2}, DType::i64);
  a.state_indices = i64.view();
  expect_error(run(a), "`ssm_state_indices` must be a 1D int32 tensor.");
  a = base;
  Tensor wp3 = index_tensor({0, 1, 2});
  a.write_pos = wp3.view();
  expect_error(run(a), "`write_pos` and `ssm_state_indices` must both have length B=2 (got 3, 2).");
  a = base;
  Tensor ff3 = index_tensor({0, 1, 0});
  a.force_flush = ff3.view();
  expect_error(run(a), "`force_flush` must have length B=2.");
  a = base;
  Tensor di = Tensor::contiguous(DType::i32, {4, 4, 4, 16});
  a.d_cache = di.view();
  expect_error(run(a), "`d_cache` must have dtype float32, bfloat16 or float16; got int32");
  a = base;
  a.g_cache->device = Device::cuda(0);
  expect_error(run(a),
               "fused_decode_step: all tensors must be on the same device: `mixed_qkv` is on cpu, "
               "`g_cache` is on cuda:0");
  a = base;
  Tensor wp_bad = index_tensor({0, 4});
  a.write_pos = wp_bad.view();
  Snapshot before;
  before.add(b.state).add(rings.d).add(rings.k).add(rings.g).add(wp_bad).add(b.out);
  for (const Tensor& w : b.win) before.add(w);
  expect_error(run(a), "`write_pos`[1]=4 is outside the ring [0, L-1=3]");
  EXPECT_TRUE(before.unchanged()) << "a rejected call wrote memory";
  // The CUDA kernel's ring length limit, checked before any launch.
  auto on_cuda = [](const Tensor& t) {
    TensorView v = t.view();
    v.device = Device::cuda(0);
    return v;
  };
  Rings long_rings = make_rings(c.shape, false, 4, 4097, f32, f32);
  FusedDecodeStepArgs u = b.args(on_cuda);
  u.d_cache = on_cuda(long_rings.d);
  u.k_cache = on_cuda(long_rings.k);
  u.g_cache = on_cuda(long_rings.g);
  u.write_pos = on_cuda(wp);
  expect_error([&] { b.run_fused(u); },
               "fused_decode_step: ring length L=4097 is above the CUDA kernel's limit of 4096",
               ErrorKind::not_implemented);
}

// The workspace: a contiguous, 16-byte aligned 1-D tensor on the tensors' device. On the CPU the
// plan needs none (the query says 0) and a given one of any size is accepted and not used. The
// CUDA side (too small; a forced chain without one; the query where the cluster kernel runs) is
// in tests/gpu/test_fused_step_gpu.cpp.
TEST(FusedStepContract, Workspace) {
  Rng rng = test_rng();
  const LayerCase c{{"ws", kGdnSmall, false, kNoLb, f32, f32}, f32};
  LayerBatch b = make_layer_batch(rng, c, {1, -1, 2}, 4);
  auto run = [&b](FusedDecodeStepArgs a) { return [&b, a] { b.run_fused(a); }; };
  const FusedDecodeStepArgs base = b.args(host_view);
  EXPECT_EQ(deltastate::fused_decode_step_workspace_bytes(base), 0);
  Tensor ws = Tensor::contiguous(f32, {2, 8});
  FusedDecodeStepArgs a = base;
  a.workspace = ws.view();
  expect_error(run(a), "`workspace` must be a contiguous 1-D tensor (got shape (2, 8)).");
  Tensor flat = Tensor::contiguous(f32, {16});
  a.workspace = flat.alias(f32, {4}, {2}, 0).view();
  expect_error(run(a), "`workspace` must be a contiguous 1-D tensor (got shape (4,)).");
  a.workspace = flat.alias(f32, {4}, {1}, 1).view();
  expect_error(run(a),
               "`workspace` must be 16-byte aligned; its address is 4 bytes past a multiple of 16");
  a.workspace = flat.view();
  a.workspace->device = Device::cuda(0);
  expect_error(run(a),
               "fused_decode_step: all tensors must be on the same device: `mixed_qkv` is on cpu, "
               "`workspace` is on cuda:0");
  Tensor bad_x = Tensor::contiguous(f32, {3, 4, 5});
  a = base;
  a.mixed_qkv = bad_x.view();
  expect_error([&] { deltastate::fused_decode_step_workspace_bytes(a); },
               "fused_decode_step_workspace_bytes needs `mixed_qkv` [B, conv_dim] and "
               "`initial_state` [slots, HV, V, K] (got shapes (3, 4, 5) and (4, 4, 16, 32))");

  // A CPU workspace (here 4 bytes) changes nothing: the same bits as without one.
  LayerBatch with = b;
  with.state = clone(b.state);
  with.out = clone(b.out);
  with.win = {clone(b.win[0])};
  b.run_fused(base);
  Tensor tiny = Tensor::contiguous(f32, {1});
  FusedDecodeStepArgs w = with.args(host_view);
  w.workspace = tiny.view();
  with.run_fused(w);
  EXPECT_EQ(with.out.bytes(), b.out.bytes());
  EXPECT_EQ(with.state.bytes(), b.state.bytes());
  EXPECT_EQ(with.win[0].bytes(), b.win[0].bytes());
}

// A quantized or stochastically rounded pool on CUDA views (plain mode, and as the checkpoint pool
// of the ReplaySSM mode): the CUDA backend runs it through the chain plan (ReplaySSM: its chain),
// so without a workspace the call is a NotImplementedError naming it,
// raised by the validator before anything runs (every tensor, the pool's bytes and its step
// counter unchanged); the workspace query answers the chain's bytes whatever the batch (the
// plan reads no device property for it, so a CUDA build answers without a GPU), and without
// CUDA built it is the backend's not_implemented error.
TEST(FusedStepContract, FormattedPoolOnCuda) {
  Rng rng = test_rng();
  const LayerCase c{{"fmt", Shape{"fmt", 2, 4, 128, 64}, false, kNoLb, f32, bf16}, bf16};
  LayerBatch b = make_layer_batch(rng, c, {1, -1, 2}, 4);
  auto on_cuda = [](const Tensor& t) {
    TensorView v = t.view();
    v.device = Device::cuda(0);
    return v;
  };
  auto cuda_view = [](TensorView v) {
    v.device = Device::cuda(0);
    return v;
  };
  const struct {
    DType dtype;
    deltastate::StateRounding rounding;
    const char *message, *replay_message;
  } cases[] = {
      {DType::f8e4m3, deltastate::StateRounding::format_default,
       "gdn_fused_decode_step: float8_e4m3fn states on CUDA run the chain plan (the conv, packed "
       "decode, the norm), which needs a `workspace` of fused_decode_step_workspace_bytes bytes; "
       "none was given",
       "gdn_fused_decode_step: float8_e4m3fn states on CUDA run the ReplaySSM chain (the conv, "
       "replayssm_decode, the norm), which needs a `workspace` of "
       "fused_decode_step_workspace_bytes bytes; none was given"},
      {DType::i8, deltastate::StateRounding::nearest,
       "gdn_fused_decode_step: int8 states on CUDA run the chain plan (the conv, packed decode, "
       "the norm), which needs a `workspace` of fused_decode_step_workspace_bytes bytes; none "
       "was given",
       "gdn_fused_decode_step: int8 states on CUDA run the ReplaySSM chain (the conv, "
       "replayssm_decode, the norm), which needs a `workspace` of "
       "fused_decode_step_workspace_bytes bytes; none was given"},
      {DType::bf16, deltastate::StateRounding::stochastic,
       "gdn_fused_decode_step: bfloat16 states with stochastic rounding on CUDA run the chain "
       "plan (the conv, packed decode, the norm), which needs a `workspace` of "
       "fused_decode_step_workspace_bytes bytes; none was given",
       "gdn_fused_decode_step: bfloat16 states with stochastic rounding on CUDA run the "
       "ReplaySSM chain (the conv, replayssm_decode, the norm), which needs a `workspace` of "
       "fused_decode_step_workspace_bytes bytes; none was given"}};
  // ReplaySSM mode: the same pools as checkpoints, with rings and cursors
  Rings rings = make_rings(c.shape, false, 4, 4, f32, f32);
  Tensor wp = index_tensor({0, 0, 3});
  for (const auto& k : cases) {
    SCOPED_TRACE(dtype_name(k.dtype));
    deltastate::StatePoolConfig cfg;
    cfg.slots = 4;
    cfg.HV = c.shape.HV;
    cfg.V = c.shape.V;
    cfg.K = c.shape.K;
    cfg.state_dtype = k.dtype;
    cfg.state_rounding = k.rounding;
    deltastate::StatePool pool(cfg);
    std::memset(pool.data(), 0x5a, static_cast<size_t>(pool.total_bytes()));
    FusedDecodeStepArgs a = b.args(on_cuda);
    a.state = cuda_view(pool.layer_state(0));
    a.state_format.rounding = k.rounding;
    if (k.dtype != DType::bf16) a.state_format.scales = cuda_view(pool.layer_scales(0));
    if (pool.config().stochastic_rounding()) a.state_format.step = cuda_view(pool.rounding_step(0));
    Snapshot before;
    before.add(pool.data(), pool.total_bytes());
    for (const Tensor* t : {&b.d.x, &b.out, &b.z, &b.win[0]}) before.add(*t);
    FusedDecodeStepArgs r = a;
    add_replay(r, on_cuda, rings, wp, nullptr, true);
    for (const Tensor* t : {&rings.d, &rings.k, &rings.g, &wp}) before.add(*t);
    expect_error([&] { b.run_fused(a); }, k.message, ErrorKind::not_implemented);
    expect_error([&] { b.run_fused(r); }, k.replay_message, ErrorKind::not_implemented);
    EXPECT_TRUE(before.unchanged());
    for (const FusedDecodeStepArgs* q : {&a, &r}) {
      SCOPED_TRACE(q == &r ? "ReplaySSM" : "plain");
      if (!deltastate::cuda_built()) {
        const auto e = catch_error([q] { deltastate::fused_decode_step_workspace_bytes(*q); });
        ASSERT_TRUE(e.has_value());
        EXPECT_EQ(e->kind(), ErrorKind::not_implemented);
      } else {  // the chain's bf16 conv output for B = 3, under any DELTASTATE_CUDA_FUSED
        EXPECT_EQ(deltastate::fused_decode_step_workspace_bytes(*q),
                  (3 * b.conv_dim * 2 + 15) / 16 * 16);
      }
    }
  }
}

// The workspace query in ReplaySSM mode. On the CPU: 0, and a given workspace changes nothing.
// On CUDA views it asks the backend's plan as the plain mode does (ReplaySSM's plan reads no
// device property, so a CUDA build answers without a GPU): without CUDA built, the same
// not_implemented error as the plain mode's; with it, the ReplaySSM chain's B * conv_dim
// elements of mixed_qkv's dtype (by default and under DELTASTATE_CUDA_FUSED=chain), 0 where
// =cta or =cluster forces the one-launch kernel.
TEST(FusedReplayContract, WorkspaceQuery) {
  Rng rng = test_rng();
  const LayerCase c{{"ws", Shape{"ws", 2, 4, 128, 64}, false, kNoLb, f32, bf16}, bf16};
  LayerBatch b = make_layer_batch(rng, c, {1, -1, 2}, 4);
  Rings rings = make_rings(c.shape, false, 4, 4, f32, f32);
  Tensor wp = index_tensor({0, 0, 3});
  FusedDecodeStepArgs base = b.args(host_view);
  add_replay(base, host_view, rings, wp, nullptr, true);
  EXPECT_EQ(deltastate::fused_decode_step_workspace_bytes(base), 0) << "CPU, ReplaySSM";

  auto on_cuda = [](const Tensor& t) {
    TensorView v = t.view();
    v.device = Device::cuda(0);
    return v;
  };
  FusedDecodeStepArgs plain = b.args(on_cuda);
  FusedDecodeStepArgs replay = plain;
  replay.d_cache = on_cuda(rings.d);
  replay.k_cache = on_cuda(rings.k);
  replay.g_cache = on_cuda(rings.g);
  replay.write_pos = on_cuda(wp);
  if (!deltastate::cuda_built()) {
    for (const FusedDecodeStepArgs* a : {&plain, &replay}) {
      const auto e = catch_error([a] { deltastate::fused_decode_step_workspace_bytes(*a); });
      ASSERT_TRUE(e.has_value()) << (a == &replay ? "ReplaySSM" : "plain");
      EXPECT_EQ(e->kind(), ErrorKind::not_implemented);
    }
  } else {
    // the ReplaySSM chain by default and where forced; =cta or =cluster: the one-launch kernel
    const char* forced = std::getenv("DELTASTATE_CUDA_FUSED");
    const std::string plan = forced ? forced : "";
    const bool chain = plan.empty() || plan == "chain";
    const int64_t chain_bytes = (3 * b.conv_dim * 2 + 15) / 16 * 16;  // bf16 conv output, B = 3
    EXPECT_EQ(deltastate::fused_decode_step_workspace_bytes(replay), chain ? chain_bytes : 0);
  }

  // A CPU workspace in ReplaySSM mode changes nothing: the same bits as without one.
  const Tensor state0 = clone(b.state), out0 = clone(b.out), win0 = clone(b.win[0]);
  const Tensor d0 = clone(rings.d), k0 = clone(rings.k), g0 = clone(rings.g), wp0 = clone(wp);
  b.run_fused(base);
  const Tensor state1 = clone(b.state), out1 = clone(b.out), win1 = clone(b.win[0]);
  const Tensor d1 = clone(rings.d), k1 = clone(rings.k), g1 = clone(rings.g), wp1 = clone(wp);
  using Restore = std::pair<Tensor*, const Tensor*>;
  for (const Restore& r :
       {Restore{&b.state, &state0}, Restore{&b.out, &out0}, Restore{&b.win[0], &win0},
        Restore{&rings.d, &d0}, Restore{&rings.k, &k0}, Restore{&rings.g, &g0}, Restore{&wp, &wp0}})
    std::memcpy(r.first->alloc_base(), r.second->alloc_base(),
                static_cast<size_t>(r.second->alloc_bytes()));
  Tensor tiny = Tensor::contiguous(f32, {1});
  FusedDecodeStepArgs w = base;
  w.workspace = tiny.view();
  b.run_fused(w);
  EXPECT_EQ(b.out.bytes(), out1.bytes());
  EXPECT_EQ(b.state.bytes(), state1.bytes());
  EXPECT_EQ(b.win[0].bytes(), win1.bytes());
  EXPECT_EQ(rings.d.bytes(), d1.bytes());
  EXPECT_EQ(rings.k.bytes(), k1.bytes());
  EXPECT_EQ(rings.g.bytes(), g1.bytes());
  EXPECT_EQ(wp.bytes(), wp1.bytes());
}

}  // namespace
}  // namespace dstest
