// Speculative verify, its commit, and the recurrent op's multi-token sequences on the CUDA
// backend (the multi-token kernel) against the CPU backend on the same inputs; a CUDA graph of a
// verify + commit loop replaying bit-equal to eager; a bad index skipped and recorded. Tolerances
// as tests/gpu/test_cuda_ops.cpp (outputs 1e-4/1e-4, fp32 states 1e-5/1e-4, bf16 states SGLang's
// 2e-3, one storage ulp for the two roundings); memory neither backend writes is compared exactly.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>

#include "gpu/gpu_util.h"
#include "test_util.h"

namespace dstest {
namespace {

using deltastate::CommitArgs;
using deltastate::VerifyArgs;

// source_*: FlashInfer's initial_state_source, the start states from a read-only source pool
// (one sequence padded by a source row < 0): per-token slots (its speculative decode), or a tree
// over scratch rows with the final state stored in place at state_indices.
enum class Mode {
  scratch_rows,
  tree,
  batch_rows_in_place,
  per_token_accepted,
  output_slots,
  source_per_token,
  source_tree_in_place
};

struct GpuVerifyCase : OpCase {
  int64_t B, T;
  std::vector<int64_t> seqlens;
  Mode mode;
  bool keep_padded = false;  // keep_padded_outputs: the outputs start at 42, not NaN
};
void PrintTo(const GpuVerifyCase& c, std::ostream* os) { *os << c.name; }

// Everything one verify call touches, built once; `run` calls the op on CPU or CUDA views.
struct VerifyInputs {
  RecurrentBatch rb;
  Tensor pool, inter, idx, rows, parents, table, accepted, out_idx, source, source_rows;
  int64_t N = 0;
};

VerifyInputs make_inputs(Rng& rng, const GpuVerifyCase& c) {
  VerifyInputs in;
  RecurrentSpec spec = recurrent_spec(c.shape, c.kda, c.act, c.B, c.T, c.seqlens);
  spec.lower_bound = c.lower_bound;
  in.rb = make_recurrent_batch(rng, spec);
  const int64_t N = in.N = in.rb.N;
  int64_t tmax = 1;
  for (int64_t n = 0; n < N; ++n) tmax = std::max(tmax, in.rb.seq_len(n));
  const Shape& s = c.shape;
  const int64_t slots = N * (tmax + 2) + 4, he = s.state_elems();
  in.pool = make_pool(c.state, slots, s, c.shape.K == 128 ? 64 : 4, c.shape.K == 128 ? 32 : 2);
  std::vector<int64_t> live = pick_slots(rng, N, slots, {N > 2 ? 1 : -1});
  for (int64_t sl = 0; sl < slots; ++sl) fill_slot(in.pool.view(), sl, rng);
  in.idx = index_tensor(live);
  in.inter = Tensor::strided(c.state, {N + 1, tmax + 1, s.HV, s.V, s.K},
                             {(tmax + 1) * he + 64, he, s.V * s.K, s.K, 1}, 32);
  in.inter.fill_all(kSentinel);
  std::vector<int64_t> rows;
  for (int64_t n = 0; n < N; ++n) rows.push_back(n == 0 ? -1 : N - n);
  in.rows = index_tensor(rows, DType::i64);
  in.parents = Tensor::contiguous(DType::i32, {N, tmax});
  for (int64_t n = 0; n < N; ++n)
    for (int64_t t = 0; t < tmax; ++t) in.parents.set({n, t}, t == 0 ? -1 : rng.integer(-1, t - 1));
  in.table = Tensor::contiguous(DType::i32, {N, tmax + 1});
  in.accepted = Tensor::contiguous(DType::i32, {N});
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t t = 0; t <= tmax; ++t) in.table.set({n, t}, n * (tmax + 1) + t);
    in.accepted.set({n}, rng.integer(1, tmax + 1));
  }
  if (N > 2) in.table.set({1, static_cast<int64_t>(in.accepted.get({1})) - 1}, -1);  // padded
  std::vector<int64_t> dst;
  for (int64_t n = 0; n < N; ++n) dst.push_back(n == 0 ? -1 : slots - 1 - n);
  in.out_idx = index_tensor(dst);
  // The source pool: its own slot stride, every row filled, sequence N - 1 padded (row < 0).
  in.source = make_pool(c.state, N + 2, s, c.shape.K == 128 ? 32 : 6, c.shape.K == 128 ? 64 : 2);
  for (int64_t r = 0; r < N + 2; ++r) fill_slot(in.source.view(), r, rng);
  in.source_rows = index_tensor(pick_slots(rng, N, N + 2, {N - 1}), DType::i64);
  return in;
}

template <class ViewOf>
VerifyArgs verify_args(const VerifyInputs& in, Mode mode, ViewOf&& view_of) {
  VerifyArgs a = verify_inputs(in.rb.args(view_of), in.rb.spec.kda);
  a.state = view_of(in.pool);
  switch (mode) {
    case Mode::tree:
      a.parent_tokens = view_of(in.parents);
      [[fallthrough]];
    case Mode::scratch_rows:
      a.state_indices = view_of(in.idx);
      a.update_state = false;
      a.intermediate_states = view_of(in.inter);
      a.intermediate_state_indices = view_of(in.rows);
      break;
    case Mode::batch_rows_in_place:
      a.state_indices = view_of(in.idx);
      a.intermediate_states = view_of(in.inter);
      break;
    case Mode::per_token_accepted:
      a.token_state_indices = view_of(in.table);
      a.num_accepted_tokens = view_of(in.accepted);
      break;
    case Mode::output_slots:
      a.state_indices = view_of(in.idx);
      a.output_state_indices = view_of(in.out_idx);
      break;
    case Mode::source_per_token:
      a.token_state_indices = view_of(in.table);
      a.source_state = view_of(in.source);
      a.source_state_indices = view_of(in.source_rows);
      break;
    case Mode::source_tree_in_place:
      a.state_indices = view_of(in.idx);
      a.intermediate_states = view_of(in.inter);
      a.intermediate_state_indices = view_of(in.rows);
      a.parent_tokens = view_of(in.parents);
      a.source_state = view_of(in.source);
      a.source_state_indices = view_of(in.source_rows);
      break;
  }
  return a;
}

Tol state_tol_gpu(DType t) { return t == DType::f32 ? kFp32StateTol : state_tol(t); }

class VerifyGpuVsCpu : public GpuParamTest<GpuVerifyCase> {};

TEST_P(VerifyGpuVsCpu, Run) {
  const GpuVerifyCase& c = GetParam();
  Rng rng = test_rng();
  VerifyInputs in = make_inputs(rng, c);
  if (c.keep_padded) in.rb.out.fill_all(42.0);
  else in.rb.poison_out();
  Mirror dev;
  dev.upload_all(in.rb.q, in.rb.k, in.rb.v, in.rb.g, in.rb.beta, in.rb.out, in.rb.A_log,
                 in.rb.dt_bias, in.rb.cu, in.pool, in.inter, in.idx, in.rows, in.parents, in.table,
                 in.accepted, in.out_idx, in.source, in.source_rows);
  const std::vector<double> source_before = in.source.values();
  VerifyArgs gpu_args = verify_args(in, c.mode, dev.views()),
             cpu_args = verify_args(in, c.mode, host_view);
  gpu_args.keep_padded_outputs = cpu_args.keep_padded_outputs = c.keep_padded;
  deltastate::verify(gpu_args);
  sync();
  deltastate::check_errors();
  deltastate::verify(cpu_args);
  const std::vector<double> gpu_out = dev.download(in.rb.out).values();
  EXPECT_TRUE(close_vs_cpu(gpu_out, in.rb.out.values(), kOutTol, c.act)) << "outputs";
  if (c.keep_padded)  // sequence 1 is padded (make_inputs): its rows keep the 42s
    EXPECT_GT(std::count(gpu_out.begin(), gpu_out.end(), 42.0), 0) << "padded rows kept";
  EXPECT_TRUE(close_vs_cpu(dev.download(in.pool).values(), in.pool.values(), state_tol_gpu(c.state),
                           c.state))
      << "pool";
  EXPECT_TRUE(close_vs_cpu(dev.download(in.inter).values(), in.inter.values(),
                           state_tol_gpu(c.state), c.state))
      << "intermediate states";
  EXPECT_EQ(dev.download(in.source).values(), source_before) << "the read-only source pool";
}

const GpuVerifyCase kGpuCases[] = {
    {{"gdn_qwen3next_f32_scratch", kQwen3Next, false, kNoLb, f32, bf16},
     9,
     4,
     {},
     Mode::scratch_rows},
    {{"gdn_qwen3next_bf16_tree", kQwen3Next, false, kNoLb, bf16, bf16}, 5, 6, {}, Mode::tree},
    {{"gdn_f16_state_in_place", kQwen3Next, false, kNoLb, f16, f32},
     3,
     3,
     {},
     Mode::batch_rows_in_place},
    {{"kda_kimi_f32_per_token", kKimi, true, kNoLb, f32, bf16}, 4, 4, {}, Mode::per_token_accepted},
    {{"kda_safe_gate_tree_varlen", kKimi, true, kLb, f32, f32}, 1, 0, {3, 9, 1, 0, 5}, Mode::tree},
    {{"gdn_odd_varlen_generic", kOdd, false, kNoLb, f32, f32},
     1,
     0,
     {4, 2, 11},
     Mode::scratch_rows},
    {{"kda_odd_output_slots", kOdd, true, kNoLb, bf16, f32}, 4, 5, {}, Mode::output_slots},
    {{"gdn_KgtV_T8_in_place", kKgtV, false, kNoLb, f32, f16}, 6, 8, {}, Mode::batch_rows_in_place},
    {{"kda_kimi_bf16_source_per_token", kKimi, true, kNoLb, bf16, bf16},
     5,
     4,
     {},
     Mode::source_per_token},
    {{"gdn_qwen3next_f32_source_tree", kQwen3Next, false, kNoLb, f32, bf16},
     4,
     5,
     {},
     Mode::source_tree_in_place},
    {{"kda_odd_varlen_source_tree", kOdd, true, kNoLb, f32, f32},
     1,
     0,
     {3, 1, 6},
     Mode::source_tree_in_place},
    {{"gdn_qwen3next_f32_keep_padded", kQwen3Next, false, kNoLb, f32, bf16},
     5,
     4,
     {},
     Mode::scratch_rows,
     true},
    {{"gdn_odd_varlen_keep_padded", kOdd, false, kNoLb, f32, f32},
     1,
     0,
     {4, 2, 11},
     Mode::scratch_rows,
     true},
};
INSTANTIATE_TEST_SUITE_P(Cases, VerifyGpuVsCpu, ::testing::ValuesIn(kGpuCases),
                         case_name<GpuVerifyCase>);

// The recurrent op's multi-token sequences (in place on an envelope-like pool, mixed lengths
// through cu_seqlens, T > kMultiChunk included) run on the multi-token kernel: CUDA against CPU.
struct MultiCase : OpCase {
  int64_t B, T;
  std::vector<int64_t> seqlens;
};
class RecurrentMultiTokenGpu : public GpuParamTest<MultiCase> {};
TEST_P(RecurrentMultiTokenGpu, MatchesCpu) {
  const MultiCase& c = GetParam();
  Rng rng = test_rng();
  RecurrentBatch rb =
      make_recurrent_batch(rng, recurrent_spec(c.shape, c.kda, c.act, c.B, c.T, c.seqlens));
  const int64_t N = rb.N;
  Tensor pool = make_pool(c.state, N + 4, c.shape, 64, 32);
  const std::vector<int64_t> slots = pick_slots(rng, N, N + 4, {N > 1 ? 1 : -1});
  fill_live_slots(pool.view(), slots, rng);
  Tensor idx = index_tensor(slots);
  rb.poison_out();
  Mirror dev;
  dev.upload_all(rb.q, rb.k, rb.v, rb.g, rb.beta, rb.out, rb.A_log, rb.dt_bias, rb.cu, pool, idx);
  auto run = [&](auto&& view_of, const TensorView& state) {
    deltastate::RecurrentArgs a = rb.args(view_of);
    a.state = state;
    a.state_indices = view_of(idx);
    a.stride_contract = false;
    if (c.kda) deltastate::recurrent_kda(a);
    else deltastate::recurrent_gdn(a);
  };
  run(dev.views(), dev.view(pool));
  sync();
  deltastate::check_errors();
  run(host_view, pool.view());
  EXPECT_TRUE(close_vs_cpu(dev.download(rb.out).values(), rb.out.values(), kOutTol, c.act));
  EXPECT_TRUE(
      close_vs_cpu(dev.download(pool).values(), pool.values(), state_tol_gpu(c.state), c.state));
}
const MultiCase kMultiCases[] = {
    {{"gdn_f32_T4", kQwen3Next, false, kNoLb, f32, bf16}, 17, 4, {}},
    {{"gdn_bf16_T2", kQwen3Next, false, kNoLb, bf16, bf16}, 9, 2, {}},
    {{"kda_f32_varlen", kKimi, true, kNoLb, f32, bf16}, 1, 0, {4, 0, 13, 1, 8, 2}},
    {{"kda_bf16_T8_safe", kKimi, true, kLb, bf16, f32}, 3, 8, {}},
    {{"gdn_K64_varlen", kKgtV, false, kNoLb, f32, f32}, 1, 0, {2, 17, 3}},
};
INSTANTIATE_TEST_SUITE_P(Cases, RecurrentMultiTokenGpu, ::testing::ValuesIn(kMultiCases),
                         case_name<MultiCase>);

// A verify + commit loop captured into a CUDA graph replays bit-equal to the same calls eager.
TEST_F(GpuTest, VerifyCommitGraphReplaysEager) {
  Rng rng = test_rng();
  const GpuVerifyCase c{{"g", kQwen3Next, false, kNoLb, f32, bf16}, 6, 4, {}, Mode::scratch_rows};
  VerifyInputs in = make_inputs(rng, c);
  std::vector<int64_t> acc;
  for (int64_t n = 0; n < in.N; ++n) acc.push_back(n % 5);
  Tensor accepted = index_tensor(acc);
  Mirror eager, graph;
  for (Mirror* m : {&eager, &graph})
    m->upload_all(in.rb.q, in.rb.k, in.rb.v, in.rb.g, in.rb.beta, in.rb.out, in.rb.A_log,
                  in.rb.dt_bias, in.pool, in.inter, in.idx, in.rows, accepted);
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreate(&stream));
  auto step = [&](Mirror& m) {
    VerifyArgs a = verify_args(in, Mode::scratch_rows, m.views());
    a.stream = stream;
    deltastate::verify(a);
    CommitArgs ca;
    ca.state = m.view(in.pool);
    ca.intermediate_states = m.view(in.inter);
    ca.state_indices = m.view(in.idx);
    ca.accepted = m.view(accepted);
    ca.intermediate_state_indices = m.view(in.rows);
    ca.stream = stream;
    ca.pdl = true;
    deltastate::update_state_after_verify(ca);
  };
  run_eager_and_graph(step, eager, graph, stream, 3);
  for (const Tensor* t : {&in.rb.out, &in.pool, &in.inter}) {
    const Tensor a = eager.download(*t), b = graph.download(*t);
    EXPECT_EQ(std::memcmp(a.alloc_base(), b.alloc_base(), static_cast<size_t>(a.alloc_bytes())), 0);
  }
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

// A scratch row past the buffer: the sequence is skipped (NaN outputs, nothing written) and
// check_errors names it; the commit's bad slot likewise.
TEST_F(GpuTest, VerifyAndCommitGuard) {
  Rng rng = test_rng();
  const GpuVerifyCase c{{"g", kOdd, false, kNoLb, f32, f32}, 3, 3, {}, Mode::scratch_rows};
  VerifyInputs in = make_inputs(rng, c);
  Tensor rows = index_tensor({0, 1, 77}, DType::i64);
  Mirror dev;
  dev.upload_all(in.rb.q, in.rb.k, in.rb.v, in.rb.g, in.rb.beta, in.rb.out, in.rb.A_log,
                 in.rb.dt_bias, in.pool, in.inter, in.idx, rows);
  VerifyArgs a = verify_args(in, Mode::scratch_rows, dev.views());
  a.intermediate_state_indices = dev.view(rows);
  const Tensor pool_before = dev.download(in.pool);
  deltastate::verify(a);
  sync();
  const auto err = catch_error([] { deltastate::check_errors(); });
  ASSERT_TRUE(err.has_value());
  EXPECT_NE(std::string(err->what()).find("verify: row 2: scratch row 77"), std::string::npos)
      << err->what();
  const Tensor out = dev.download(in.rb.out);
  for (int64_t t = 0; t < 3; ++t)
    for (int64_t hv = 0; hv < c.shape.HV; ++hv)
      for (int64_t v = 0; v < c.shape.V; ++v)
        ASSERT_TRUE(std::isnan(out.get({2, t, hv, v}))) << "the skipped sequence's outputs";
  const Tensor pool_after = dev.download(in.pool);
  EXPECT_EQ(std::memcmp(pool_before.alloc_base(), pool_after.alloc_base(),
                        static_cast<size_t>(pool_after.alloc_bytes())),
            0);
  Tensor bad_slots = index_tensor({0, 999, 1}), accepted = index_tensor({1, 1, 0});
  dev.upload_all(bad_slots, accepted);
  CommitArgs ca;
  ca.state = dev.view(in.pool);
  ca.intermediate_states = dev.view(in.inter);
  ca.state_indices = dev.view(bad_slots);
  ca.accepted = dev.view(accepted);
  deltastate::update_state_after_verify(ca);
  sync();
  const auto err2 = catch_error([] { deltastate::check_errors(); });
  ASSERT_TRUE(err2.has_value());
  EXPECT_NE(std::string(err2->what()).find("update_state_after_verify"), std::string::npos)
      << err2->what();
}

}  // namespace
}  // namespace dstest
