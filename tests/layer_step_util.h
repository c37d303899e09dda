// Inputs of the fused decode layer step and of its unfused chain (causal_conv1d_update -> packed
// decode), built once for the CPU tests (tests/test_fused_step.cpp) and the GPU tests
// (tests/gpu/test_fused_step_gpu.cpp).
#pragma once

#include <cstring>
#include <vector>

#include "test_util.h"

namespace dstest {

// A layer-step case: OpCase's fields, then the conv window's dtype, width and layout (vLLM's
// dim-contiguous or SGLang's), separate q/k/v windows (Kimi-Linear), conv bias, the gated norm,
// and a slot pad of the state pool and the windows (envelope-like gaps).
struct LayerCase : OpCase {
  DType conv = DType::f32;
  int width = 4;
  bool dim_contiguous = false;
  bool split = false;
  bool bias = true;
  bool norm = true;
  int64_t slot_pad = 0;
};
inline void PrintTo(const LayerCase& c, std::ostream* os) { *os << c.name; }

// A conv window tensor [slots, dim, W-1] (SGLang's or vLLM's layout, slot stride dim*(W-1) + pad),
// every element the sentinel; live slots filled with fill_window.
inline Tensor make_window(DType dtype, int64_t slots, int64_t dim, int L, bool dim_contiguous,
                          int64_t pad) {
  const int64_t ss = dim * L + pad;
  Tensor t = dim_contiguous ? Tensor::strided(dtype, {slots, dim, L}, {ss, 1, dim}, 0, slots * ss)
                            : Tensor::strided(dtype, {slots, dim, L}, {ss, L, 1}, 0, slots * ss);
  t.fill_all(kSentinel);
  return t;
}
inline void fill_window(Tensor& w, int64_t slot, Rng& rng) {
  for (int64_t c = 0; c < w.size(1); ++c)
    for (int64_t i = 0; i < w.size(2); ++i) w.set({slot, c, i}, rng.uniform(-1.0, 1.0));
}
inline std::vector<double> window_values(const Tensor& w, int64_t slot) {
  std::vector<double> v;
  for (int64_t c = 0; c < w.size(1); ++c)
    for (int64_t i = 0; i < w.size(2); ++i) v.push_back(w.get({slot, c, i}));
  return v;
}
// An independent copy of a tensor (same layout, same bytes).
inline Tensor clone(const Tensor& t) {
  Tensor c = t.empty_like();
  std::memcpy(c.alloc_base(), t.alloc_base(), static_cast<size_t>(t.alloc_bytes()));
  return c;
}

// causal_conv1d_update's arguments over host test tensors: x, the windows, the weight, each row's
// window index, out (the error-text fixtures start from these).
inline deltastate::CausalConv1dUpdateArgs conv_args(const Tensor& x, const Tensor& st,
                                                    const Tensor& w, const Tensor& idx,
                                                    const Tensor& out) {
  deltastate::CausalConv1dUpdateArgs a;
  a.x = x.view();
  a.conv_state = st.view();
  a.weight = w.view();
  a.conv_state_indices = idx.view();
  a.out = out.view();
  return a;
}

// An EAGLE tree over T draft tokens (causal_conv1d_update's speculative options): a random one in
// token order (parent < child; parent[0] = 0), and its first-child / next-sibling tables.
inline std::vector<int> random_parents(Rng& rng, int T) {
  std::vector<int> p(T, 0);
  for (int t = 1; t < T; ++t) p[t] = static_cast<int>(rng.integer(0, t - 1));
  return p;
}
struct TreeTables {
  Tensor next, sibling;  // [B, cols] int32, -1 where a token has no child / next sibling
};
// Row b holds the tree of parents[b] (an empty row: no tree, all -1).
inline TreeTables tree_tables(int64_t cols, const std::vector<std::vector<int>>& parents) {
  const int64_t B = static_cast<int64_t>(parents.size());
  TreeTables t{Tensor::contiguous(DType::i32, {B, cols}),
               Tensor::contiguous(DType::i32, {B, cols})};
  t.next.fill_all(-1);
  t.sibling.fill_all(-1);
  for (int64_t b = 0; b < B; ++b) {
    const std::vector<int>& parent = parents[static_cast<size_t>(b)];
    const int T = static_cast<int>(parent.size());
    for (int p = 0; p < T; ++p) {
      int prev = -1;
      for (int c = 1; c < T; ++c) {
        if (parent[c] != p) continue;
        if (prev < 0) t.next.set({b, p}, c);
        else t.sibling.set({b, prev}, c);
        prev = c;
      }
    }
  }
  return t;
}

struct LayerBatch {
  LayerCase c;
  DecodeBatch d;  // x = the projected row before the conv; a, b, A_log, dt_bias, idx
  int64_t slots = 0, conv_dim = 0, HK = 0;
  Tensor weight, bias, z, norm_w, out;  // out [B, HV, V]
  Tensor state;
  std::vector<Tensor> win;  // packed: one [slots, conv_dim, W-1]; split: q, k, v

  void poison_out() { out.fill_all(std::nan("")); }

  template <class ViewOf>
  deltastate::FusedDecodeStepArgs args(ViewOf&& view_of) {
    deltastate::FusedDecodeStepArgs a;
    a.mixed_qkv = view_of(d.x);
    a.conv_weight = view_of(weight);
    if (c.bias) a.conv_bias = view_of(bias);
    a.conv_state = view_of(win[0]);
    if (c.split) {
      a.conv_state_k = view_of(win[1]);
      a.conv_state_v = view_of(win[2]);
    }
    a.a = view_of(d.a);
    a.b = view_of(d.b);
    a.A_log = view_of(d.A_log);
    a.dt_bias = view_of(d.dt_bias);
    a.state = view_of(state);
    a.state_indices = view_of(d.idx);
    if (c.norm) {
      a.norm_weight = view_of(norm_w);
      a.z = view_of(z);
    }
    a.out = view_of(out);
    a.lower_bound = c.lower_bound;
    return a;
  }
  void run_fused(deltastate::FusedDecodeStepArgs a) const {
    if (c.kda) deltastate::kda_fused_decode_step(a);
    else deltastate::gdn_fused_decode_step(a);
  }
};

// Random inputs for `idx` (-1: padded), a state pool of `slots` slots and windows with the
// sentinel in every slot no row uses.
inline LayerBatch make_layer_batch(Rng& rng, const LayerCase& c, const std::vector<int64_t>& idx,
                                   int64_t slots) {
  LayerBatch b;
  b.c = c;
  b.slots = slots;
  const Shape& s = c.shape;
  b.d = make_decode_batch(rng, s, c.kda, idx, c.act, /*row_pad=*/3);
  b.conv_dim = s.width();
  b.HK = static_cast<int64_t>(s.H) * s.K;
  b.weight = Tensor::contiguous(c.act, {b.conv_dim, c.width});
  b.weight.fill_uniform(rng, -0.6, 0.6);
  b.bias = Tensor::contiguous(c.act, {b.conv_dim});
  b.bias.fill_uniform(rng, -0.2, 0.2);
  b.z = Tensor::strided(c.act, {b.d.B, s.HV, s.V}, {s.HV * s.V + 5, s.V, 1});
  b.z.fill_all(kSentinel);
  b.z.fill_normal(rng, 1.0);
  b.norm_w = Tensor::contiguous(c.act, {s.V});
  b.norm_w.fill_uniform(rng, 0.5, 1.5);
  b.out = Tensor::contiguous(c.act, {b.d.B, s.HV, s.V});
  b.state = make_pool(c.state, slots, s, c.slot_pad);
  const int L = c.width - 1;
  if (c.split) {
    for (int64_t dim : {b.HK, b.HK, static_cast<int64_t>(s.HV) * s.V})
      b.win.push_back(make_window(c.conv, slots, dim, L, c.dim_contiguous, c.slot_pad));
  } else {
    b.win.push_back(make_window(c.conv, slots, b.conv_dim, L, c.dim_contiguous, c.slot_pad));
  }
  for (int64_t sl : idx) {
    if (sl < 0) continue;
    fill_slot(b.state.view(), sl, rng);
    for (Tensor& w : b.win) fill_window(w, sl, rng);
  }
  b.poison_out();
  return b;
}

// The fused step's ReplaySSM arguments on `a` through `view_of`: the rings, the cursors `wp`,
// force_flush `ff` (null: none) and advance_write_pos.
template <class ViewOf>
void add_replay(deltastate::FusedDecodeStepArgs& a, ViewOf&& view_of, const Rings& r,
                const Tensor& wp, const Tensor* ff, bool advance) {
  a.d_cache = view_of(r.d);
  a.k_cache = view_of(r.k);
  a.g_cache = view_of(r.g);
  a.write_pos = view_of(wp);
  if (ff) a.force_flush = view_of(*ff);
  a.advance_write_pos = advance;
}

}  // namespace dstest
