// The commit of the conv windows after a verify (update_conv_state_after_verify) on the CPU
// against a plainly written reference (tests/conv_windows.h): random windows in SGLang's
// window-contiguous and vLLM's dim-contiguous layouts, page-major envelope pools filled with 1e30
// sentinels (every byte outside the committed windows checked bit-untouched), dense, padded and
// SGLang's overlapping deduplicated scratch, padding rows (slot -1, nothing accepted, row -1),
// accepted lengths and SGLang's steps, strided int32 / int64 index vectors; which calls take the
// one-copy (flat) path; and every error text, with nothing written by a rejected call.
#include <functional>
#include <string>
#include <vector>

#include "contracts/validate.h"
#include "conv_windows.h"
#include "test_util.h"
#include "view_edits.h"

namespace dstest {
namespace {

using deltastate::ConvCommitArgs;

struct ConvCommitSetup {
  ConvDims d;
  ConvBatch batch;
  Tensor pool, scratch, slots, rows, accepted;
  std::vector<int64_t> acc;
};

ConvCommitSetup make_setup(Rng& rng, const ConvCommitCase& c) {
  ConvCommitSetup su;
  Tensor pool = conv_pool(c.dtype, su.d, c.pool);
  Tensor scratch = conv_scratch(c.dtype, su.d, c.scratch, rng);
  su.pool = c.layered ? pool : first_layer(pool);
  su.scratch = c.layered ? scratch : first_layer(scratch);
  su.acc = accepted_of(su.batch, c.is_step);
  su.slots = strided_index(su.batch.slots, DType::i32, 3);  // SGLang: a view of a wider table
  su.rows = strided_index(su.batch.rows, DType::i64, 2);
  su.accepted = index_tensor(su.acc, DType::i64);
  return su;
}

ConvCommitArgs args_of(const ConvCommitSetup& su, const ConvCommitCase& c) {
  ConvCommitArgs a;
  a.conv_state = su.pool.view();
  a.intermediate_conv_window = su.scratch.view();
  a.state_indices = su.slots.view();
  a.accepted = su.accepted.view();
  if (c.with_rows) a.intermediate_state_indices = su.rows.view();
  a.accepted_is_step = c.is_step;
  return a;
}

class ConvCommitVsReference : public ::testing::TestWithParam<ConvCommitCase> {};

TEST_P(ConvCommitVsReference, WindowsOfAcceptedSteps) {
  const ConvCommitCase& c = GetParam();
  Rng rng = test_rng();
  ConvCommitSetup su = make_setup(rng, c);
  const std::vector<uint8_t> before = su.pool.bytes();
  const std::vector<uint8_t> want =
      reference_commit(su.pool, su.scratch, c.layered, su.batch.slots,
                       c.with_rows ? &su.batch.rows : nullptr, su.acc, c.is_step);
  ASSERT_NE(want, before) << "the case commits nothing";
  Snapshot scratch_before;
  scratch_before.add(su.scratch);
  deltastate::update_conv_state_after_verify(args_of(su, c));
  EXPECT_TRUE(su.pool.bytes() == want) << "committed windows or untouched memory differ";
  EXPECT_TRUE(scratch_before.unchanged()) << "the scratch buffer was written";
  // Committing the same steps again changes nothing (the copy reads only the scratch).
  deltastate::update_conv_state_after_verify(args_of(su, c));
  EXPECT_TRUE(su.pool.bytes() == want);
}

const ConvCommitCase kCases[] = {
    {"sglang_dense_f32_layers_rows", f32, Win::sglang, Scratch::dense_sglang, true, true, false},
    {"sglang_dedup_bf16_layers_steps", bf16, Win::sglang, Scratch::dedup, true, false, true},
    {"sglang_dedup_f32_one_layer_rows", f32, Win::sglang, Scratch::dedup, false, true, false},
    {"vllm_dense_bf16_layers_rows", bf16, Win::vllm, Scratch::dense_vllm, true, true, false},
    {"vllm_dedup_f16_one_layer_steps", f16, Win::vllm, Scratch::dedup, false, true, true},
    {"sglang_from_vllm_scratch_f32_one_layer", f32, Win::sglang, Scratch::dense_vllm, false, false,
     false},
    {"vllm_from_sglang_scratch_f32_layers_steps", f32, Win::vllm, Scratch::dense_sglang, true,
     false, true},
    {"sglang_padded_rows_f16_one_layer_rows", f16, Win::sglang, Scratch::padded_rows, false, true,
     false},
};
INSTANTIATE_TEST_SUITE_P(Cases, ConvCommitVsReference, ::testing::ValuesIn(kCases),
                         [](const auto& info) { return std::string(info.param.name); });

// The one-copy path is taken exactly where both windows are the same dense range: identical
// dense layouts (gaps between scratch rows or pool slots do not matter); never for an
// overlapping view or for two different window layouts. The state commit is always flat.
TEST(ConvCommit, FlatOnlyForTheSameDenseWindows) {
  Rng rng = test_rng();
  const struct {
    Win pool;
    Scratch scratch;
    bool flat;
  } cases[] = {
      {Win::sglang, Scratch::dense_sglang, true}, {Win::sglang, Scratch::padded_rows, true},
      {Win::vllm, Scratch::dense_vllm, true},     {Win::sglang, Scratch::dense_vllm, false},
      {Win::vllm, Scratch::dense_sglang, false},  {Win::sglang, Scratch::dedup, false},
      {Win::vllm, Scratch::dedup, false},
  };
  for (const auto& k : cases) {
    for (bool layered : {true, false}) {
      const ConvCommitCase c{"c", f32, k.pool, k.scratch, layered, true, false};
      SCOPED_TRACE(std::to_string(static_cast<int>(k.pool)) + "/" +
                   std::to_string(static_cast<int>(k.scratch)) + (layered ? " layered" : ""));
      ConvCommitSetup su = make_setup(rng, c);
      const deltastate::detail::CommitProblem p =
          deltastate::detail::validate_conv_commit(args_of(su, c));
      EXPECT_EQ(p.flat, k.flat);
      EXPECT_EQ(p.head_elems, su.d.dim * su.d.W1);
    }
  }
  // A window of one channel is one row: the two tensors' dim strides differ (W1 and 1) and do
  // not matter; the copy is flat and right.
  ConvDims one;
  one.dim = 1;
  Tensor pool = conv_pool(f32, one, Win::sglang);
  Tensor scratch = conv_scratch(f32, one, Scratch::dense_vllm, rng);
  ASSERT_NE(pool.stride(2), scratch.stride(3));
  Tensor idx = index_tensor({4, 0}), acc = index_tensor({2, 1});
  ConvCommitArgs a;
  a.conv_state = pool.view();
  a.intermediate_conv_window = scratch.view();
  a.state_indices = idx.view();
  a.accepted = acc.view();
  EXPECT_TRUE(deltastate::detail::validate_conv_commit(a).flat);
  const std::vector<uint8_t> want =
      reference_commit(pool, scratch, true, {4, 0}, nullptr, {2, 1}, false);
  deltastate::update_conv_state_after_verify(a);
  EXPECT_TRUE(pool.bytes() == want);
}

TEST(ConvCommitContract, EveryErrorText) {
  Rng rng = test_rng();
  ConvDims d;
  d.slots = 4;
  d.rows = 3;
  d.steps = 2;
  Tensor pool = first_layer(conv_pool(f32, d, Win::sglang));
  Tensor scratch = first_layer(conv_scratch(f32, d, Scratch::dense_sglang, rng));
  Tensor scratch16 = first_layer(conv_scratch(bf16, d, Scratch::dense_sglang, rng));
  Tensor layered_pool = conv_pool(f32, d, Win::sglang);
  ConvDims d3 = d;
  d3.layers = 3;
  Tensor layered_scratch = conv_scratch(f32, d3, Scratch::dedup, rng);
  ConvDims dw = d;
  dw.W1 = 2;
  Tensor narrow = first_layer(conv_scratch(f32, dw, Scratch::dense_sglang, rng));
  Tensor ipool = first_layer(conv_pool(DType::i32, d, Win::sglang));
  Tensor idx = index_tensor({0, 1, 2}), idx_big = index_tensor({0, 9, 2}),
         idx_dup = index_tensor({1, 1, 2}), idx4 = index_tensor({0, 1, 2, 3});
  Tensor acc = index_tensor({1, 2, 0}), acc_big = index_tensor({1, 3, 0}),
         short_idx = index_tensor({0}), acc4 = index_tensor({1, 1, 1, 1});
  Tensor rows_big = index_tensor({0, 1, 5});
  Tensor table = Tensor::contiguous(DType::i32, {3, 2});
  Tensor facc = Tensor::contiguous(f32, {3});
  struct E {
    const char* what;
    std::function<void(ConvCommitArgs&)> mutate;
    std::string text;
  };
  const std::vector<E> cases = {
      {"state ndim", [&](ConvCommitArgs& a) { a.conv_state = with_ndim(a.conv_state, 2); },
       "`conv_state` must be [layers, slots, dim, W1] or [slots, dim, W1] (got ndim=2)."},
      {"buffer ndim", [&](ConvCommitArgs& a) { a.intermediate_conv_window = pool.view(); },
       "`intermediate_conv_window` must be [N_scr, T_alloc, dim, W1] (got ndim=3)."},
      {"layered buffer ndim",
       [&](ConvCommitArgs& a) {
         a.conv_state = layered_pool.view();
         a.intermediate_conv_window = scratch.view();
       },
       "`intermediate_conv_window` must be [layers, N_scr, T_alloc, dim, W1] (got ndim=4)."},
      {"windows", [&](ConvCommitArgs& a) { a.intermediate_conv_window = narrow.view(); },
       "`intermediate_conv_window` must have windows [dim, W1]=(5, 3), those of `conv_state`; "
       "got (3, 2, 5, 2)"},
      {"layers",
       [&](ConvCommitArgs& a) {
         a.conv_state = layered_pool.view();
         a.intermediate_conv_window = layered_scratch.view();
       },
       "`intermediate_conv_window` has 3 layers and `conv_state` 2; they must match"},
      {"state dtype", [&](ConvCommitArgs& a) { a.conv_state = ipool.view(); },
       "`conv_state` must have dtype float32, bfloat16 or float16; got int32"},
      {"buffer dtype",
       [&](ConvCommitArgs& a) {
         a.intermediate_conv_window = with_dtype(a.intermediate_conv_window, DType::i64);
       },
       "`intermediate_conv_window` must have dtype float32, bfloat16 or float16; got int64"},
      {"dtypes differ", [&](ConvCommitArgs& a) { a.intermediate_conv_window = scratch16.view(); },
       "`intermediate_conv_window` must have the dtype of `conv_state` (float32); got bfloat16"},
      {"indices ndim", [&](ConvCommitArgs& a) { a.state_indices = table.view(); },
       "`state_indices` must be 1D [B] (got ndim=2)."},
      {"indices dtype", [&](ConvCommitArgs& a) { a.state_indices = facc.view(); },
       "`state_indices` must have dtype int32 or int64; got float32"},
      {"accepted shape", [&](ConvCommitArgs& a) { a.accepted = short_idx.view(); },
       "`accepted` must have shape [N]=(3,); got (1,)"},
      {"accepted dtype", [&](ConvCommitArgs& a) { a.accepted = facc.view(); },
       "`accepted` must have dtype int32 or int64; got float32"},
      {"rows shape", [&](ConvCommitArgs& a) { a.intermediate_state_indices = short_idx.view(); },
       "`intermediate_state_indices` must have shape [N]=(3,); got (1,)"},
      {"accepted on another device", [&](ConvCommitArgs& a) { a.accepted = on_cuda(a.accepted); },
       "All inputs must be on the same device: `conv_state` is on cpu, `accepted` is on cuda:0"},
      {"slot range", [&](ConvCommitArgs& a) { a.state_indices = idx_big.view(); },
       "`state_indices`[1]=9 is out of range for a state pool of 4 slots (valid: 0..3; < 0 marks a "
       "padded row)"},
      {"row range",
       [&](ConvCommitArgs& a) {
         a.intermediate_state_indices = rows_big.view();
         a.accepted = idx.view();
       },
       "`intermediate_state_indices`[2]=5 is out of range for an intermediate conv-window buffer "
       "of 3 rows (valid: 0..2; < 0 marks a padded row)"},
      {"row b past the buffer",
       [&](ConvCommitArgs& a) {
         a.state_indices = idx4.view();
         a.accepted = acc4.view();
       },
       "`intermediate_conv_window`[3]=3 is out of range for an intermediate conv-window buffer of "
       "3 rows (valid: 0..2; < 0 marks a padded row)"},
      {"step range", [&](ConvCommitArgs& a) { a.accepted = acc_big.view(); },
       "`accepted`[1]=3 needs step 2 but `intermediate_conv_window` holds 2 steps per row"},
      {"step range, steps",
       [&](ConvCommitArgs& a) {
         a.accepted = acc.view();
         a.accepted_is_step = true;
       },
       "`accepted`[1]=2 needs step 2 but `intermediate_conv_window` holds 2 steps per row"},
      {"duplicate", [&](ConvCommitArgs& a) { a.state_indices = idx_dup.view(); },
       "`state_indices` uses slot 1 for rows 0 and 1; each live row needs its own slot"},
  };
  for (const E& e : cases) {
    SCOPED_TRACE(e.what);
    ConvCommitArgs a;
    a.conv_state = pool.view();
    a.intermediate_conv_window = scratch.view();
    a.state_indices = idx.view();
    a.accepted = acc.view();
    e.mutate(a);
    Snapshot before;
    before.add(pool).add(layered_pool);
    const auto err = catch_error([&] { deltastate::update_conv_state_after_verify(a); });
    ASSERT_TRUE(err.has_value());
    EXPECT_EQ(err->kind(), deltastate::ErrorKind::value);
    EXPECT_EQ(std::string(err->what()), e.text);
    EXPECT_TRUE(before.unchanged());
  }
  // The base call itself is valid (so each error above is its mutation's).
  ConvCommitArgs ok;
  ok.conv_state = pool.view();
  ok.intermediate_conv_window = scratch.view();
  ok.state_indices = idx.view();
  ok.accepted = acc.view();
  EXPECT_NO_THROW(deltastate::update_conv_state_after_verify(ok));
}

// An empty batch and zero-channel windows are accepted and write nothing.
TEST(ConvCommit, EmptyBatchAndEmptyWindows) {
  Rng rng = test_rng();
  ConvDims d;
  Tensor pool = conv_pool(bf16, d, Win::sglang);
  Tensor scratch = conv_scratch(bf16, d, Scratch::dedup, rng);
  Tensor none = index_tensor({});
  ConvCommitArgs a;
  a.conv_state = pool.view();
  a.intermediate_conv_window = scratch.view();
  a.state_indices = none.view();
  a.accepted = none.view();
  Snapshot before;
  before.add(pool);
  deltastate::update_conv_state_after_verify(a);
  EXPECT_TRUE(before.unchanged());
  ConvDims z = d;
  z.dim = 0;
  Tensor zpool = conv_pool(f32, z, Win::sglang),
         zscratch = conv_scratch(f32, z, Scratch::dense_sglang, rng);
  Tensor idx = index_tensor({1}), acc = index_tensor({1});
  a.conv_state = zpool.view();
  a.intermediate_conv_window = zscratch.view();
  a.state_indices = idx.view();
  a.accepted = acc.view();
  Snapshot zbefore;
  zbefore.add(zpool);
  deltastate::update_conv_state_after_verify(a);
  EXPECT_TRUE(zbefore.unchanged());
}

}  // namespace
}  // namespace dstest
