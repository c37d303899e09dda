// causal_conv1d_update's speculative-verify options (SGLang's intermediate_conv_window,
// num_accept_tokens and EAGLE tree tables) against an fp64 reference written from their
// semantics (tests/reference/layer_reference.cpp conv_verify): chains and trees, widths 2..4,
// both window layouts, padded rows, rows without a scratch row, sentinel memory bit-untouched;
// a chain's stored windows against single-token steps bit for bit; every error text, before any
// write.
#include <cmath>
#include <cstring>

#include "layer_step_util.h"
#include "reference/layer_reference.h"
#include "test_util.h"

namespace dstest {
namespace {

using deltastate::CausalConv1dUpdateArgs;
using deltastate::ErrorKind;

struct ConvVerifyCase {
  const char* name;
  DType dtype;
  int width;
  bool tree, accept, dim_contiguous, silu;
};
inline void PrintTo(const ConvVerifyCase& c, std::ostream* os) { *os << c.name; }

class ConvVerifyVsReference : public ::testing::TestWithParam<ConvVerifyCase> {};

TEST_P(ConvVerifyVsReference, PaddedRowsAndSentinels) {
  const ConvVerifyCase& c = GetParam();
  Rng rng = test_rng();
  const int64_t dim = 20, entries = 7, N_scr = 6;
  const int T = 4, W1 = c.width - 1;
  const std::vector<int64_t> idx{5, -1, 0, 3, 2}, rows{4, 2, -1, 0, 5};
  const int64_t B = static_cast<int64_t>(idx.size());
  const int L = c.accept ? W1 - 1 + T + 1 : W1;  // with accept: one entry the scheme never uses
  Tensor x = Tensor::strided(c.dtype, {B, dim, T}, {dim * T + 2, 1, dim});
  x.fill_all(kSentinel);
  x.fill_normal(rng, 1.0);
  Tensor st = make_window(c.dtype, entries, dim, L, c.dim_contiguous, 4);
  for (int64_t e : idx)
    if (e >= 0) fill_window(st, e, rng);
  Tensor w = Tensor::contiguous(c.dtype, {dim, c.width});
  w.fill_uniform(rng, -0.7, 0.7);
  Tensor bias = Tensor::contiguous(c.dtype, {dim});
  bias.fill_uniform(rng, -0.3, 0.3);
  Tensor ind = index_tensor(idx), rind = index_tensor(rows, DType::i64);
  std::vector<int64_t> acc(B);
  for (int64_t b = 0; b < B; ++b) acc[b] = rng.integer(1, L - W1 + 1);
  Tensor accept = index_tensor(acc, DType::i64);
  Tensor inter = Tensor::contiguous(c.dtype, {N_scr, T + 1, dim, W1});
  inter.fill_all(kSentinel);
  Tensor parents = Tensor::contiguous(DType::i64, {B, T + 1});
  parents.fill_all(-7);
  std::vector<std::vector<int>> tree(B);
  if (c.tree)
    for (auto& row : tree) row = random_parents(rng, T);
  const TreeTables tables = tree_tables(T + 1, tree);  // one column more than T: never read
  const Tensor &next = tables.next, &sib = tables.sibling;
  Tensor out = Tensor::contiguous(c.dtype, {B, dim, T});
  out.fill_all(std::nan(""));

  std::vector<std::vector<double>> want_out(B), want_win(B), want_inter(B);
  for (int64_t b = 0; b < B; ++b) {
    if (idx[b] < 0) continue;
    std::vector<double> win = window_values(st, idx[b]), xs;
    for (int64_t ch = 0; ch < dim; ++ch)
      for (int t = 0; t < T; ++t) xs.push_back(x.get({b, ch, t}));
    want_out[b] =
        ref::conv_verify(win, xs, w.values(), bias.values(), static_cast<int>(dim), L, T, c.width,
                         c.silu, c.accept ? static_cast<int>(acc[b]) : 0, tree[b], want_inter[b]);
    want_win[b] = win;
  }

  Snapshot before;
  before.add(st).add(x).add(w).add(inter).add(parents).add(next).add(sib);
  CausalConv1dUpdateArgs a;
  a.x = x.view();
  a.conv_state = st.view();
  a.weight = w.view();
  a.bias = bias.view();
  a.silu = c.silu;
  a.conv_state_indices = ind.view();
  if (c.accept) a.num_accept_tokens = accept.view();
  a.intermediate_conv_window = inter.view();
  a.intermediate_state_indices = rind.view();
  if (c.tree) {
    a.retrieve_next_token = next.view();
    a.retrieve_next_sibling = sib.view();
    a.retrieve_parent_token = parents.view();
  }
  a.out = out.view();
  deltastate::causal_conv1d_update(a);

  std::vector<MemRange> written;
  const int64_t step_elems = dim * W1;
  for (int64_t b = 0; b < B; ++b) {
    std::vector<double> got;
    for (int64_t ch = 0; ch < dim; ++ch)
      for (int t = 0; t < T; ++t) got.push_back(out.get({b, ch, t}));
    if (idx[b] < 0) {
      EXPECT_TRUE(all_zero(got)) << "padded row " << b;
      continue;
    }
    EXPECT_TRUE(all_close(got, want_out[b], {1e-5, 1e-5}, c.dtype)) << "output of row " << b;
    EXPECT_EQ(window_values(st, idx[b]), want_win[b]) << "window of row " << b;
    written.push_back(range_of(st.view(), idx[b] * st.stride(0), st.stride(0) - 4));
    if (rows[b] >= 0) {
      std::vector<double> stored;
      for (int t = 0; t < T; ++t)
        for (int64_t ch = 0; ch < dim; ++ch)
          for (int i = 0; i < W1; ++i) stored.push_back(inter.get({rows[b], t, ch, i}));
      EXPECT_EQ(stored, want_inter[b]) << "intermediate windows of row " << b;
      written.push_back(range_of(inter.view(), rows[b] * inter.stride(0), T * step_elems));
    }
    if (c.tree) {
      for (int t = 0; t < T; ++t) EXPECT_EQ(parents.get({b, t}), tree[b][t]) << b << ", " << t;
      written.push_back(range_of(parents.view(), b * parents.stride(0), T));
    }
  }
  EXPECT_TRUE(before.unchanged_except(written)) << "memory outside what the live rows write";
}

INSTANTIATE_TEST_SUITE_P(
    Conv, ConvVerifyVsReference,
    ::testing::Values(ConvVerifyCase{"f32_w4_chain", f32, 4, false, false, false, true},
                      ConvVerifyCase{"bf16_w4_tree", bf16, 4, true, false, false, true},
                      ConvVerifyCase{"f32_w3_tree_vllm", f32, 3, true, false, true, false},
                      ConvVerifyCase{"f16_w2_tree", f16, 2, true, false, false, true},
                      ConvVerifyCase{"f32_w4_accept", f32, 4, false, true, false, true},
                      ConvVerifyCase{"bf16_w3_accept_vllm", bf16, 3, false, true, true, true},
                      ConvVerifyCase{"f32_w4_accept_tree", f32, 4, true, true, false, false},
                      ConvVerifyCase{"f32_w2_accept", f32, 2, false, true, false, true}),
    case_name<ConvVerifyCase>);

// A chain's windows are those of single-token steps, and its outputs and rolled windows those of
// the plain multi-token call, bit for bit.
TEST(ConvVerify, ChainWindowsEqualSingleSteps) {
  Rng rng = test_rng();
  const int64_t B = 3, dim = 24, T = 5;
  for (DType dt : {f32, bf16}) {
    Tensor x = Tensor::contiguous(dt, {B, dim, T});
    x.fill_normal(rng, 1.0);
    Tensor st = make_window(dt, B, dim, 3, false, 0);
    for (int64_t e = 0; e < B; ++e) fill_window(st, e, rng);
    Tensor plain_st = clone(st), step_st = clone(st);
    Tensor w = Tensor::contiguous(dt, {dim, 4});
    w.fill_uniform(rng, -0.7, 0.7);
    Tensor out = Tensor::contiguous(dt, {B, dim, T}), plain_out = out.empty_like();
    Tensor inter = Tensor::contiguous(dt, {B, T, dim, 3});
    CausalConv1dUpdateArgs a;
    a.x = x.view();
    a.conv_state = plain_st.view();
    a.weight = w.view();
    a.silu = true;
    a.out = plain_out.view();
    deltastate::causal_conv1d_update(a);
    CausalConv1dUpdateArgs v = a;
    v.conv_state = st.view();
    v.intermediate_conv_window = inter.view();
    v.out = out.view();
    deltastate::causal_conv1d_update(v);
    EXPECT_EQ(out.bytes(), plain_out.bytes()) << "outputs";
    EXPECT_EQ(st.bytes(), plain_st.bytes()) << "rolled windows";
    for (int64_t t = 0; t < T; ++t) {
      Tensor xt = x.alias(dt, {B, dim}, {dim * T, T}, t);
      Tensor ot = Tensor::contiguous(dt, {B, dim});
      CausalConv1dUpdateArgs s = a;
      s.x = xt.view();
      s.conv_state = step_st.view();
      s.out = ot.view();
      deltastate::causal_conv1d_update(s);
      for (int64_t b = 0; b < B; ++b)
        for (int64_t ch = 0; ch < dim; ++ch)
          for (int64_t i = 0; i < 3; ++i)
            ASSERT_EQ(inter.get({b, t, ch, i}), step_st.get({b, ch, i}))
                << "token " << t << " row " << b << " channel " << ch;
    }
  }
}

// ---- every error text -------------------------------------------------------------------------
struct VerifyErrorFixture {
  Tensor x = Tensor::contiguous(f32, {2, 8, 3});
  Tensor st = Tensor::contiguous(f32, {4, 8, 5});
  Tensor w = Tensor::contiguous(f32, {8, 4});
  Tensor idx = index_tensor({1, 2});
  Tensor out = Tensor::contiguous(f32, {2, 8, 3});
  Tensor inter = Tensor::contiguous(f32, {2, 3, 8, 3});
  Tensor tab = Tensor::contiguous(DType::i32, {2, 3});
  CausalConv1dUpdateArgs args() const { return conv_args(x, st, w, idx, out); }
};

TEST(ConvVerifyContract, EveryErrorText) {
  VerifyErrorFixture f;
  f.tab.fill_all(-1);
  auto run = [](CausalConv1dUpdateArgs a) { return [a] { deltastate::causal_conv1d_update(a); }; };
  Snapshot before;
  before.add(f.st).add(f.out).add(f.inter).add(f.tab);
  CausalConv1dUpdateArgs a = f.args();
  Tensor cs = index_tensor({0, 0}), ones = index_tensor({1, 1});
  a.cache_seqlens = cs.view();
  a.intermediate_conv_window = f.inter.view();
  expect_error(run(a),
               "`cache_seqlens` (a circular window) cannot be combined with `num_accept_tokens`, "
               "`intermediate_conv_window` or the `retrieve_*` tree tables.");
  a = f.args();
  Tensor three = index_tensor({1, 1, 1});
  a.num_accept_tokens = three.view();
  expect_error(run(a), "`num_accept_tokens` must have shape [batch]=(2) (got (3,)).");
  a = f.args();
  Tensor fl = Tensor::contiguous(f32, {2});
  a.num_accept_tokens = fl.view();
  expect_error(run(a), "`num_accept_tokens` must have dtype int32 or int64; got float32");
  a = f.args();
  Tensor st3 = Tensor::contiguous(f32, {4, 8, 4});
  a.conv_state = st3.view();
  a.num_accept_tokens = ones.view();
  expect_error(run(a),
               "`conv_state` must have state_len >= width - 2 + seqlen = 5 with "
               "`num_accept_tokens` (got 4).");
  a = f.args();
  a.intermediate_state_indices = ones.view();
  expect_error(run(a), "`intermediate_state_indices` needs `intermediate_conv_window`.");
  a = f.args();
  Tensor short_inter = Tensor::contiguous(f32, {2, 2, 8, 3});
  a.intermediate_conv_window = short_inter.view();
  expect_error(run(a),
               "`intermediate_conv_window` must have shape [N_scr, >= seqlen, dim, width - 1]="
               "(N_scr, >= 3, 8, 3) (got (2, 2, 8, 3)).");
  a = f.args();
  Tensor bf_inter = Tensor::contiguous(bf16, {2, 3, 8, 3});
  a.intermediate_conv_window = bf_inter.view();
  expect_error(run(a),
               "`intermediate_conv_window` must have the dtype of `conv_state` (float32; got "
               "bfloat16).");
  a = f.args();
  a.intermediate_conv_window = f.inter.view();
  a.intermediate_state_indices = three.view();
  expect_error(run(a), "`intermediate_state_indices` must have shape [batch]=(2) (got (3,)).");
  a = f.args();
  a.retrieve_next_token = f.tab.view();
  expect_error(run(a),
               "`retrieve_next_token`, `retrieve_next_sibling` and `retrieve_parent_token` go "
               "together (the EAGLE tree's child and sibling tables and the parents the op "
               "writes).");
  a = f.args();
  Tensor narrow = Tensor::contiguous(DType::i32, {2, 2});
  a.retrieve_next_token = f.tab.view();
  a.retrieve_next_sibling = narrow.view();
  a.retrieve_parent_token = f.tab.view();
  expect_error(run(a),
               "`retrieve_next_sibling` must have shape [batch, >= seqlen]=(2, >= 3) (got (2, "
               "2)).");
  a = f.args();
  Tensor x65 = Tensor::contiguous(f32, {2, 8, 65}), o65 = x65.empty_like();
  Tensor t65 = Tensor::contiguous(DType::i32, {2, 65});
  a.x = x65.view();
  a.out = o65.view();
  a.retrieve_next_token = t65.view();
  a.retrieve_next_sibling = t65.view();
  a.retrieve_parent_token = t65.view();
  expect_error(run(a),
               "causal_conv1d_update supports trees of up to 64 draft tokens (got seqlen=65)",
               ErrorKind::not_implemented);

  // the host checks of the entries (CPU tensors), before any write
  a = f.args();
  Tensor acc0 = index_tensor({1, 0});
  a.num_accept_tokens = acc0.view();
  expect_error(run(a),
               "`num_accept_tokens`[1]=0 is outside [1, 3] (the window's first entry is "
               "num_accept_tokens - 1 of a conv_state of 5 entries)");
  Tensor acc4 = index_tensor({4, 1}, DType::i64);
  a.num_accept_tokens = acc4.view();
  expect_error(run(a),
               "`num_accept_tokens`[0]=4 is outside [1, 3] (the window's first entry is "
               "num_accept_tokens - 1 of a conv_state of 5 entries)");
  a = f.args();
  Tensor rows = index_tensor({0, 2});
  a.intermediate_conv_window = f.inter.view();
  a.intermediate_state_indices = rows.view();
  expect_error(run(a),
               "`intermediate_state_indices`[1]=2 is out of range for an intermediate_conv_window "
               "of 2 rows (valid: 0..1; < 0 stores no window)");
  a = f.args();
  Tensor next = index_tensor({1, -1, -1, 0, -1, -1}), sib = index_tensor({-1, 2, -1, -1, 3, -1});
  Tensor next2 = next.alias(DType::i32, {2, 3}, {3, 1}, 0);
  Tensor sib2 = sib.alias(DType::i32, {2, 3}, {3, 1}, 0);
  a.retrieve_next_token = next2.view();
  a.retrieve_next_sibling = f.tab.view();
  a.retrieve_parent_token = f.tab.view();
  expect_error(run(a),
               "`retrieve_next_token`[1, 0]=0 must name a later draft token (1..2) or be -1");
  next.ptr<int32_t>()[3] = 1;
  a.retrieve_next_sibling = sib2.view();
  expect_error(run(a),
               "`retrieve_next_sibling`[1, 1]=3 must name a later draft token (2..2) or be -1");
  EXPECT_TRUE(before.unchanged()) << "no caller memory changed by a rejected call";

  // a padded row's entries are not checked: nothing of it is read
  a = f.args();
  Tensor pad = index_tensor({-1, 2});
  a.conv_state_indices = pad.view();
  Tensor acc_pad = index_tensor({0, 1});
  a.num_accept_tokens = acc_pad.view();
  EXPECT_NO_THROW(deltastate::causal_conv1d_update(a));
}

}  // namespace
}  // namespace dstest
