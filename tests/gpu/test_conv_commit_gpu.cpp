// The commit of the conv windows after a verify (update_conv_state_after_verify) on the CUDA
// backend against the CPU backend on the same inputs, byte for byte over the whole pool
// allocation (a copy: no tolerance): the flat kernel (the same dense windows in both tensors,
// 16-byte and 2-byte units) and the strided one (SGLang's overlapping deduplicated scratch, mixed
// window layouts), one layer and several; bad slots, scratch rows and steps skipped and recorded
// for check_errors with their texts, and check_indices raising after the launch.
#include <string>
#include <vector>

#include "conv_windows.h"
#include "gpu/gpu_errors.h"
#include "gpu/gpu_util.h"
#include "test_util.h"

namespace dstest {
namespace {

using deltastate::ConvCommitArgs;

struct ConvInputs {
  Tensor pool, scratch, slots, rows, accepted;
};

ConvInputs make_inputs(Rng& rng, const ConvCommitCase& c, const ConvDims& d,
                       const ConvBatch& batch) {
  ConvInputs in;
  Tensor pool = conv_pool(c.dtype, d, c.pool);
  Tensor scratch = conv_scratch(c.dtype, d, c.scratch, rng);
  in.pool = c.layered ? pool : first_layer(pool);
  in.scratch = c.layered ? scratch : first_layer(scratch);
  in.slots = strided_index(batch.slots, DType::i32, 3);
  in.rows = strided_index(batch.rows, DType::i64, 2);
  in.accepted = index_tensor(accepted_of(batch, c.is_step), DType::i64);
  return in;
}

template <class ViewOf>
ConvCommitArgs args_of(const ConvInputs& in, const ConvCommitCase& c, ViewOf&& view_of) {
  ConvCommitArgs a;
  a.conv_state = view_of(in.pool);
  a.intermediate_conv_window = view_of(in.scratch);
  a.state_indices = view_of(in.slots);
  a.accepted = view_of(in.accepted);
  if (c.with_rows) a.intermediate_state_indices = view_of(in.rows);
  a.accepted_is_step = c.is_step;
  return a;
}

class ConvCommitGpuVsCpu : public GpuParamTest<ConvCommitCase> {};

TEST_P(ConvCommitGpuVsCpu, SameBytes) {
  const ConvCommitCase& c = GetParam();
  Rng rng = test_rng();
  const ConvDims d;
  const ConvBatch batch;
  ConvInputs in = make_inputs(rng, c, d, batch);
  const std::vector<uint8_t> before = in.pool.bytes();
  Mirror dev;
  dev.upload_all(in.pool, in.scratch, in.slots, in.rows, in.accepted);
  deltastate::update_conv_state_after_verify(args_of(in, c, dev.views()));
  sync();
  deltastate::check_errors();
  deltastate::update_conv_state_after_verify(args_of(in, c, host_view));
  ASSERT_NE(in.pool.bytes(), before) << "the case commits nothing";
  EXPECT_TRUE(bytes_equal(dev.download(in.pool), in.pool));
  EXPECT_TRUE(bytes_equal(dev.download(in.scratch), in.scratch)) << "the scratch was written";
}

const ConvCommitCase kGpuCases[] = {
    {"flat_sglang_dense_bf16_layers_rows", bf16, Win::sglang, Scratch::dense_sglang, true, true,
     false},
    {"flat_vllm_dense_f32_one_layer_steps", f32, Win::vllm, Scratch::dense_vllm, false, false,
     true},
    {"flat_padded_rows_f16_layers", f16, Win::sglang, Scratch::padded_rows, true, true, true},
    {"strided_sglang_dedup_bf16_layers_steps", bf16, Win::sglang, Scratch::dedup, true, false,
     true},
    {"strided_vllm_dedup_f32_one_layer_rows", f32, Win::vllm, Scratch::dedup, false, true, false},
    {"strided_sglang_from_vllm_f16_layers", f16, Win::sglang, Scratch::dense_vllm, true, true,
     false},
};
INSTANTIATE_TEST_SUITE_P(Cases, ConvCommitGpuVsCpu, ::testing::ValuesIn(kGpuCases),
                         [](const auto& info) { return std::string(info.param.name); });

// The flat kernel's 16-byte units: a contiguous pool and scratch (16-byte aligned windows), each
// window (fp32 [2000, 4], 32000 bytes) more than one CTA's chunk.
TEST_F(GpuTest, ConvCommitFlatWideUnits) {
  Rng rng = test_rng();
  const int64_t L = 3, slots = 9, N = 4, T = 3, dim = 2000, W1 = 4;
  Tensor pool = Tensor::contiguous(f32, {L, slots, dim, W1});
  pool.fill_all(kSentinel);
  Tensor scratch = Tensor::contiguous(f32, {L, N, T, dim, W1});
  scratch.fill_uniform(rng, -1, 1);
  Tensor idx = index_tensor({8, 0, -1, 5}), acc = index_tensor({3, 1, 2, 0});
  Mirror dev;
  dev.upload_all(pool, scratch, idx, acc);
  auto run = [&](auto&& view_of) {
    ConvCommitArgs a;
    a.conv_state = view_of(pool);
    a.intermediate_conv_window = view_of(scratch);
    a.state_indices = view_of(idx);
    a.accepted = view_of(acc);
    deltastate::update_conv_state_after_verify(a);
  };
  run(dev.views());
  sync();
  deltastate::check_errors();
  run(host_view);
  EXPECT_TRUE(bytes_equal(dev.download(pool), pool));
}

// Bad entries on CUDA: skipped (nothing written for them, the good rows committed) and recorded;
// check_errors names the first; with check_indices the op raises after its launch.
TEST_F(GpuTest, ConvCommitGuard) {
  clear_device_errors();
  Rng rng = test_rng();
  const ConvDims d;
  const std::string tail =
      "; the row was skipped (state, rings and cursor untouched) and its output is NaN";
  struct Bad {
    const char* what;
    Scratch scratch;
    ConvBatch batch;
    std::string text;
  };
  ConvBatch slot_bad, row_bad, step_bad;
  slot_bad.slots[0] = 999;
  row_bad.rows[4] = 77;
  step_bad.lengths[0] = 9;
  const std::vector<Bad> cases = {
      {"slot, strided kernel", Scratch::dedup, slot_bad,
       "update_conv_state_after_verify: `state_indices`[0]=999 is out of range for a state pool "
       "of 7 slots (valid: 0..6; < 0 marks a padded row)" +
           tail},
      {"row, flat kernel", Scratch::dense_sglang, row_bad,
       "update_conv_state_after_verify: row 4: scratch row 77 is out of range for an "
       "intermediate-state buffer of 6 rows" +
           tail},
      {"step, strided kernel", Scratch::dedup, step_bad,
       "update_conv_state_after_verify: row 0: a step, length, accepted count or parent (8) is "
       "outside its buffer or table (limit 4)" +
           tail},
  };
  for (const Bad& b : cases) {
    SCOPED_TRACE(b.what);
    const ConvCommitCase c{"c", bf16, Win::sglang, b.scratch, true, true, false};
    ConvInputs in = make_inputs(rng, c, d, b.batch);
    // The good rows only, on the CPU: what the device must hold after skipping the bad one.
    ConvBatch good = b.batch;
    for (size_t i = 0; i < good.slots.size(); ++i)
      if (good.slots[i] >= d.slots || good.rows[i] >= d.rows || good.lengths[i] > d.steps)
        good.slots[i] = -1;
    const std::vector<uint8_t> want =
        reference_commit(in.pool, in.scratch, true, good.slots, &good.rows, good.lengths, false);
    Mirror dev;
    dev.upload_all(in.pool, in.scratch, in.slots, in.rows, in.accepted);
    deltastate::update_conv_state_after_verify(args_of(in, c, dev.views()));
    sync();
    expect_reported(nullptr, {b.text});
    EXPECT_TRUE(dev.download(in.pool).bytes() == want);
    ConvCommitArgs a = args_of(in, c, dev.views());
    a.check_indices = true;
    const auto err = catch_error([&] { deltastate::update_conv_state_after_verify(a); });
    ASSERT_TRUE(err.has_value());
    EXPECT_EQ(std::string(err->what()), b.text);
    EXPECT_NO_THROW(deltastate::check_errors()) << "check_indices left the record set";
  }
}

}  // namespace
}  // namespace dstest
