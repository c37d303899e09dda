// Quantized state pools (float8_e4m3fn, int8 with fp32 scales) and stochastic rounding on the
// CUDA backend (packed decode, on the quantized decode kernels; the recurrent op, on the direct
// kernel's formatted-state twin; verify, its commit and ReplaySSM decode, on their formatted-
// state kernels; the chunked prefill, through src/cuda/state_format.cuh) against the CPU backend,
// the oracle.
// Every test skips when no CUDA device is present.
//
// Tolerances come from the format's resolution: both backends compute the step in fp32 (to 1e-5
// relative of each other) and round with the same rules and random bits (core/state_format.h),
// so a stored code may differ by one quantum where the two fp32 values straddle a rounding
// boundary (or, stochastically, the uniform threshold): every dequantized element must agree
// within one quantum of its row (int8: the scale; e4m3: 2^-3 of the value, 2^-9 of the scale in
// the subnormal range) plus the fp32 tolerance, and the scales (amax / qmax) to 1e-4 relative.
// Most codes agree exactly: at most 2% may differ.
//
// The chunked prefill's fp32 states differ from the CPU's by its kernels' own error (bf16 tensor-
// core operands: tests/gpu/test_chunk_prefill_gpu.cpp, 3e-3 to 5e-3 of a state's norm), so there
// each dequantized element must agree within one quantum of its row plus 2e-2 of the row's amax,
// the scales to 2e-2 relative, the outputs to 8e-3 of their norm (bf16 outputs).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "gpu/gpu_errors.h"
#include "gpu/gpu_util.h"
#include "gpu/quant_pools.h"
#include "test_util.h"

namespace dstest {
namespace {

using deltastate::PackedDecodeArgs;
using deltastate::RecurrentArgs;
using deltastate::ReplayVerifyArgs;
using deltastate::StatePool;
using deltastate::StatePoolConfig;
using deltastate::StateRounding;

struct QuantCase {
  const char* name;
  bool kda;
  DType dtype;
  StateRounding rounding;
  deltastate::PoolLayout layout;
  int V = 0;  // value rows of the model's shape when not 0 (rows past a warp tile's end)
  int K = 0;  // key width of the model's shape when not 0
};
void PrintTo(const QuantCase& c, std::ostream* os) { *os << c.name; }

class GpuQuantizedPackedDecode : public GpuParamTest<QuantCase> {};

// Two steps of packed decode on a host pool and its device copy: outputs, scales, dequantized
// states, the step counter, and every byte outside the live slots' blocks (sentinels).
TEST_P(GpuQuantizedPackedDecode, MatchesCpu) {
  const QuantCase& c = GetParam();
  Shape s = c.kda ? kKimi : kQwen3Next;
  if (c.V) s.V = c.V;
  if (c.K) s.K = c.K;
  const int64_t layer = 1;
  Rng rng = test_rng();
  const std::vector<int64_t> slots{7, -1, 2, 5, 0};
  const QuantPools q =
      make_quant_pools(s, c.dtype, c.rounding, c.layout, 2, 9, blocks_of(layer, slots), rng);

  DecodeBatch batch = make_decode_batch(rng, s, c.kda, slots, bf16);
  const double scale = 1.0 / std::sqrt(static_cast<double>(s.K));
  Mirror m;
  for (int step = 0; step < 2; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    if (step) batch.randomize(rng);
    batch.poison_out();
    m.upload_all(batch.x, batch.a, batch.b, batch.A_log, batch.dt_bias, batch.idx, batch.out);
    auto run = [&](PackedDecodeArgs a, const StatePool& p) {
      a.state_format = format_of(p, layer, c.rounding);
      if (c.kda) deltastate::kda_packed_decode(a);
      else deltastate::gdn_packed_decode(a);
    };
    run(batch.packed_args(host_view, q.host->layer_state(layer), scale), *q.host);
    run(batch.packed_args(m.views(), q.dev->layer_state(layer), scale), *q.dev);
    sync();
    EXPECT_NO_THROW(deltastate::check_errors());  // no bad row recorded
    expect_decode_outputs(m, batch, slots);
    if (q.stochastic) {
      EXPECT_EQ(host_step(q, layer), kStep0 + step + 1);
    }
    expect_pools_match(q, c.dtype, blocks_of(layer, slots));
    q.push();  // the next step starts both backends from the CPU's pool
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cuda, GpuQuantizedPackedDecode,
    ::testing::Values(QuantCase{"gdn_fp8_sr", false, DType::f8e4m3, StateRounding::format_default,
                                deltastate::PoolLayout::per_layer},
                      QuantCase{"gdn_int8_rn_envelope", false, DType::i8,
                                StateRounding::format_default, deltastate::PoolLayout::envelope},
                      QuantCase{"kda_fp8_rn_envelope", true, DType::f8e4m3, StateRounding::nearest,
                                deltastate::PoolLayout::envelope},
                      QuantCase{"kda_int8_sr", true, DType::i8, StateRounding::stochastic,
                                deltastate::PoolLayout::per_layer},
                      // V = 40 ends inside a 16-row tile (the tensor-core kernel's rows past V),
                      // V = 200 inside the first of a warp's two tiles (forced: test-quant-decode)
                      QuantCase{"gdn_fp8_rn_v40", false, DType::f8e4m3, StateRounding::nearest,
                                deltastate::PoolLayout::per_layer, 40},
                      QuantCase{"kda_int8_sr_v200_envelope", true, DType::i8,
                                StateRounding::stochastic, deltastate::PoolLayout::envelope, 200},
                      // K = 64: the tensor-core kernel's runs of 8 codes (in builds with every
                      // kernel; else the direct kernel's formatted twin)
                      QuantCase{"gdn_fp8_sr_k64", false, DType::f8e4m3, StateRounding::stochastic,
                                deltastate::PoolLayout::per_layer, 64, 64},
                      QuantCase{"kda_int8_rn_k64_v40", true, DType::i8, StateRounding::nearest,
                                deltastate::PoolLayout::per_layer, 40, 64}),
    case_name<QuantCase>);

struct QuantRecurrentCase {
  const char* name;
  bool kda;
  DType dtype;
  StateRounding rounding;
  bool varlen;  // several sequences by cu_seqlens, else [B, T] with T > 1
};
void PrintTo(const QuantRecurrentCase& c, std::ostream* os) { *os << c.name; }

class GpuQuantizedRecurrent : public GpuParamTest<QuantRecurrentCase> {};

// The recurrent op's multi-token calls on a quantized pool updated in place (the state kept in
// fp32 through a sequence's tokens, stored once): two calls on a host pool and its device copy,
// each token's outputs (a padded sequence's zero), the live slots' codes and scales (a sequence
// of no tokens leaves its slot untouched), the step counter, every other byte (sentinels).
TEST_P(GpuQuantizedRecurrent, MultiTokenMatchesCpu) {
  const QuantRecurrentCase& c = GetParam();
  const Shape s = c.kda ? kKimi : kQwen3Next;
  const int64_t layer = 1;
  Rng rng = test_rng();
  const std::vector<int64_t> slots =
      c.varlen ? std::vector<int64_t>{3, 7, -1, 0, 5} : std::vector<int64_t>{6, -1, 2, 8};
  const QuantPools q = make_quant_pools(s, c.dtype, c.rounding, deltastate::PoolLayout::per_layer,
                                        2, 9, blocks_of(layer, slots), rng);
  const RecurrentSpec spec = c.varlen ? recurrent_spec(s, c.kda, bf16, 1, 1, {3, 0, 4, 2, 5})
                                      : recurrent_spec(s, c.kda, bf16, 4, 3);
  RecurrentBatch rb = make_recurrent_batch(rng, spec);
  ASSERT_EQ(rb.N, static_cast<int64_t>(slots.size()));
  const Tensor idx = index_tensor(slots);
  Mirror m;
  for (int call = 0; call < 2; ++call) {
    SCOPED_TRACE("call " + std::to_string(call));
    if (call) rb.randomize(rng);
    rb.poison_out();
    m.upload_all(rb.q, rb.k, rb.v, rb.g, rb.beta, rb.out, rb.A_log, rb.dt_bias, idx);
    if (c.varlen) m.upload(rb.cu);
    auto run = [&](RecurrentArgs a, const StatePool& p, const TensorView& indices) {
      a.state = p.layer_state(layer);
      a.state_indices = indices;
      a.state_format = format_of(p, layer, c.rounding);
      if (c.kda) deltastate::recurrent_kda(a);
      else deltastate::recurrent_gdn(a);
    };
    run(rb.args(host_view), *q.host, idx.view());
    run(rb.args(m.views()), *q.dev, m.view(idx));
    sync();
    EXPECT_NO_THROW(deltastate::check_errors());
    RecurrentBatch got = rb;
    got.out = m.download(rb.out);
    for (int64_t n = 0; n < rb.N; ++n)
      for (int64_t t = 0; t < rb.seq_len(n); ++t) {
        if (slots[n] < 0)
          EXPECT_TRUE(all_zero(got.out_token(n, t))) << "padded sequence " << n << " token " << t;
        else
          EXPECT_TRUE(close_vs_cpu(got.out_token(n, t), rb.out_token(n, t), kOutTol, bf16))
              << "sequence " << n << " token " << t;
      }
    if (q.stochastic) {
      EXPECT_EQ(host_step(q, layer), kStep0 + call + 1);
    }
    expect_pools_match(q, c.dtype, blocks_of(layer, slots));
    q.push();  // the next call starts both backends from the CPU's pool
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cuda, GpuQuantizedRecurrent,
    ::testing::Values(
        QuantRecurrentCase{"gdn_fp8_sr_T3", false, DType::f8e4m3, StateRounding::stochastic, false},
        QuantRecurrentCase{"gdn_fp8_sr_varlen", false, DType::f8e4m3, StateRounding::stochastic,
                           true},
        QuantRecurrentCase{"gdn_int8_rn_T3", false, DType::i8, StateRounding::nearest, false},
        QuantRecurrentCase{"gdn_int8_rn_varlen", false, DType::i8, StateRounding::nearest, true},
        QuantRecurrentCase{"gdn_bf16_sr_varlen", false, DType::bf16, StateRounding::stochastic,
                           true},
        QuantRecurrentCase{"kda_f16_sr_T3", true, DType::f16, StateRounding::stochastic, false},
        QuantRecurrentCase{"kda_fp8_sr_T3", true, DType::f8e4m3, StateRounding::stochastic, false},
        QuantRecurrentCase{"kda_fp8_sr_varlen", true, DType::f8e4m3, StateRounding::stochastic,
                           true},
        QuantRecurrentCase{"kda_int8_rn_T3", true, DType::i8, StateRounding::nearest, false},
        QuantRecurrentCase{"kda_int8_rn_varlen", true, DType::i8, StateRounding::nearest, true}),
    case_name<QuantRecurrentCase>);

// CUDA-graph replay advances the stochastic-rounding step on the device: a captured packed
// decode replayed three times leaves the counter at 3, as three eager calls on the CPU do.
TEST_F(GpuTest, QuantizedGraphReplayAdvancesTheStep) {
  const Shape s = kOdd;
  StatePoolConfig cfg;
  cfg.slots = 4;
  cfg.HV = s.HV;
  cfg.V = s.V;
  cfg.K = s.K;
  cfg.state_dtype = DType::f8e4m3;
  cfg.device = Device::cuda(0);
  StatePool dev(cfg);
  Rng rng = test_rng();
  DecodeBatch batch = make_decode_batch(rng, s, false, {1, 3}, f32);
  Mirror m;
  m.upload_all(batch.x, batch.a, batch.b, batch.A_log, batch.dt_bias, batch.idx, batch.out);
  cudaStream_t stream = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  PackedDecodeArgs a = batch.packed_args(m.views(), dev.layer_state(0), 0.2);
  a.state_format.scales = dev.layer_scales(0);
  a.state_format.step = dev.rounding_step(0);
  a.stream = stream;
  replay_graph(stream, 3, [&] { deltastate::gdn_packed_decode(a); });
  int64_t step = 0;
  CUDA_CHECK(cudaMemcpy(&step, dev.rounding_step(0).data, 8, cudaMemcpyDeviceToHost));
  EXPECT_EQ(step, 3);
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

// ---- verify and its commit on a quantized pool ------------------------------------------------
// Verify's conventions (ops.h VerifyArgs): SGLang's float scratch with a tree and no write-back,
// FlashInfer's scratch by batch row with the final state in place, vLLM's per-token slots with
// num_accepted_tokens, output slots; and a tree over per-token slots (the contract takes both:
// parent_tokens needs only intermediate_states), each token's state stored to its slot and its
// scratch step, a tree token reloading its parent's state after those stores.
enum class QMode {
  scratch_tree,
  scratch_in_place,
  per_token_accepted,
  output_slots,
  tree_per_token
};

struct QuantVerifyCase {
  const char* name;
  bool kda;
  DType dtype;
  StateRounding rounding;
  QMode mode;
  DType scratch;     // intermediate_states' dtype (the caller's float scratch)
  bool odd = false;  // kOdd (K = 32, V = 48, HV = 6 over H = 3), else the model's shape
};
void PrintTo(const QuantVerifyCase& c, std::ostream* os) { *os << c.name; }

// Four sequences of three tokens; sequence 1 padded (its start slot < 0). Starts: the live slots
// 5, 2, 9 (state_indices) or 10, 18, 21 (per-token table at num_accepted - 1); scratch rows 3, 0,
// -1 (none: a chain), 1 for the tree, n by batch row otherwise.
// The tree over per-token slots (num_accepted picks the start from the table) reloads after the
// stores: sequence 0 (start slot 10, token 0's slot) token 2 from parent 0's scratch step, the
// state token 0 also stored quantized over the start slot; sequence 2 has no scratch row (a
// chain: its parents unread; read, token 1 would restart from slot 18); sequence 3 (start slot
// 21) token 1 from parent -1, the start slot, after token 0's store to slot 20, then token 2
// from parent 0's scratch step after token 1's store over the start slot. No token reloads a
// slot this call stored: that state may differ by a quantum between the backends, which the
// reload would carry past the tolerances below.
constexpr int64_t kQvN = 4, kQvT = 3, kQvSlots = 24, kQvLayer = 1;
const std::vector<int64_t> kQvIdx{5, -1, 2, 9}, kQvRows{3, 0, -1, 1}, kQvOut{6, -1, 7, -1},
    kQvAccepted{1, 1, 3, 2};
const std::vector<std::vector<int64_t>> kQvParents{
    {-1, 0, 0}, {-1, 0, 1}, {-1, -1, 1}, {-1, -1, 0}};
const std::vector<std::vector<int64_t>> kQvTable{
    {10, 11, 12, 13}, {-1, 14, 15, 16}, {17, -1, 18, 19}, {20, 21, 22, 23}};

class GpuQuantizedVerify : public GpuParamTest<QuantVerifyCase> {};

// One verify call on a host pool and its device copy: every token's output (padding zero), the
// float scratch (written steps within the fp32 tolerance, the rest bit-untouched), the pool's
// written slots within one quantum and every other byte bit-identical, the step counter (+1).
TEST_P(GpuQuantizedVerify, MatchesCpu) {
  const QuantVerifyCase& c = GetParam();
  const Shape s = c.odd ? kOdd : c.kda ? kKimi : kQwen3Next;
  Rng rng = test_rng();
  const bool tree = c.mode == QMode::scratch_tree || c.mode == QMode::tree_per_token;
  const bool per_token = c.mode == QMode::per_token_accepted || c.mode == QMode::tree_per_token;
  const QuantPools q = make_quant_pools(s, c.dtype, c.rounding, deltastate::PoolLayout::envelope, 2,
                                        kQvSlots, blocks_of(kQvLayer, {5, 2, 9, 10, 18, 21}), rng);
  RecurrentBatch rb = make_recurrent_batch(rng, recurrent_spec(s, c.kda, bf16, kQvN, kQvT));
  Tensor idx = index_tensor(kQvIdx), rows = index_tensor(kQvRows, DType::i64),
         out_idx = index_tensor(kQvOut), accepted = index_tensor(kQvAccepted);
  Tensor parents = Tensor::contiguous(DType::i32, {kQvN, kQvT});
  Tensor table = Tensor::contiguous(DType::i64, {kQvN, kQvT + 1});
  for (int64_t n = 0; n < kQvN; ++n) {
    for (int64_t t = 0; t < kQvT; ++t) parents.set({n, t}, static_cast<double>(kQvParents[n][t]));
    for (int64_t t = 0; t <= kQvT; ++t) table.set({n, t}, static_cast<double>(kQvTable[n][t]));
  }
  const int64_t he = s.state_elems();
  Tensor inter = Tensor::contiguous(c.scratch, {kQvN, kQvT + 1, s.HV, s.V, s.K});
  inter.fill_all(kSentinel);
  Tensor inter0 = inter.empty_like();
  std::memcpy(inter0.alloc_base(), inter.alloc_base(), static_cast<size_t>(inter.alloc_bytes()));
  rb.poison_out();
  Mirror m;
  m.upload_all(rb.q, rb.k, rb.v, rb.g, rb.beta, rb.out, rb.A_log, rb.dt_bias, idx, rows, out_idx,
               accepted, parents, table, inter);
  auto run = [&](auto&& view_of, const StatePool& p) {
    deltastate::VerifyArgs a = verify_inputs(rb.args(view_of), c.kda);
    a.state = p.layer_state(kQvLayer);
    a.state_format = format_of(p, kQvLayer, c.rounding);
    switch (c.mode) {
      case QMode::scratch_tree:
        a.state_indices = view_of(idx);
        a.update_state = false;
        a.intermediate_states = view_of(inter);
        a.intermediate_state_indices = view_of(rows);
        a.parent_tokens = view_of(parents);
        break;
      case QMode::scratch_in_place:
        a.state_indices = view_of(idx);
        a.intermediate_states = view_of(inter);
        break;
      case QMode::per_token_accepted:
        a.token_state_indices = view_of(table);
        a.num_accepted_tokens = view_of(accepted);
        break;
      case QMode::output_slots:
        a.state_indices = view_of(idx);
        a.output_state_indices = view_of(out_idx);
        break;
      case QMode::tree_per_token:
        a.token_state_indices = view_of(table);
        a.num_accepted_tokens = view_of(accepted);
        a.intermediate_states = view_of(inter);
        a.intermediate_state_indices = view_of(rows);
        a.parent_tokens = view_of(parents);
        break;
    }
    deltastate::verify(a);
  };
  run(host_view, *q.host);
  run(m.views(), *q.dev);
  sync();
  EXPECT_NO_THROW(deltastate::check_errors());

  // what the call wrote: the pool's blocks, the scratch's (row, step) entries
  std::vector<Block> written;
  std::vector<std::pair<int64_t, int64_t>> steps_written;
  for (int64_t n = 0; n < kQvN; ++n) {
    const int64_t start = per_token ? kQvTable[n][kQvAccepted[n] - 1] : kQvIdx[n];
    if (start < 0) continue;
    if (c.mode == QMode::scratch_in_place) written.push_back({kQvLayer, kQvIdx[n]});
    if (c.mode == QMode::output_slots && kQvOut[n] >= 0) written.push_back({kQvLayer, kQvOut[n]});
    if (per_token)
      for (int64_t t = 0; t < kQvT; ++t)
        if (kQvTable[n][t] >= 0) written.push_back({kQvLayer, kQvTable[n][t]});
    const int64_t row = tree ? kQvRows[n] : c.mode == QMode::scratch_in_place ? n : -1;
    if (row >= 0)
      for (int64_t t = 0; t < kQvT; ++t) steps_written.push_back({row, t});
  }
  RecurrentBatch got = rb;
  got.out = m.download(rb.out);
  for (int64_t n = 0; n < kQvN; ++n)
    for (int64_t t = 0; t < kQvT; ++t) {
      if (n == 1) EXPECT_TRUE(all_zero(got.out_token(n, t))) << "padded sequence, token " << t;
      else
        EXPECT_TRUE(close_vs_cpu(got.out_token(n, t), rb.out_token(n, t), kOutTol, bf16))
            << "sequence " << n << " token " << t;
    }
  const Tensor dinter = m.download(inter);
  for (int64_t row = 0; row < kQvN; ++row)
    for (int64_t t = 0; t <= kQvT; ++t) {
      const int64_t at = (row * (kQvT + 1) + t) * he;
      const bool w = std::find(steps_written.begin(), steps_written.end(),
                               std::make_pair(row, t)) != steps_written.end();
      const TensorView dv = dinter.view(), hv = inter.view(), v0 = inter0.view();
      if (w)
        EXPECT_TRUE(close_vs_cpu(view_values(dv, at, he), view_values(hv, at, he), kFp32StateTol,
                                 c.scratch))
            << "scratch row " << row << " step " << t;
      else
        EXPECT_TRUE(Snapshot::equal_except(range_of(dv, at, he).begin, range_of(v0, at, he).begin,
                                           he * dtype_size(c.scratch), {}))
            << "untouched scratch row " << row << " step " << t;
    }
  if (q.stochastic) {
    EXPECT_EQ(host_step(q, kQvLayer), kStep0 + 1);
  }
  expect_pools_match(q, c.dtype, written);
}

INSTANTIATE_TEST_SUITE_P(
    Cuda, GpuQuantizedVerify,
    ::testing::Values(
        QuantVerifyCase{"gdn_fp8_sr_scratch_tree", false, DType::f8e4m3, StateRounding::stochastic,
                        QMode::scratch_tree, DType::f32},
        QuantVerifyCase{"gdn_int8_rn_in_place_bf16_scratch", false, DType::i8,
                        StateRounding::nearest, QMode::scratch_in_place, DType::bf16},
        QuantVerifyCase{"gdn_fp8_sr_per_token", false, DType::f8e4m3, StateRounding::stochastic,
                        QMode::per_token_accepted, DType::f32},
        QuantVerifyCase{"gdn_int8_rn_output_slots", false, DType::i8, StateRounding::nearest,
                        QMode::output_slots, DType::f32},
        QuantVerifyCase{"kda_int8_rn_scratch_tree", true, DType::i8, StateRounding::nearest,
                        QMode::scratch_tree, DType::f32},
        QuantVerifyCase{"kda_fp8_sr_in_place", true, DType::f8e4m3, StateRounding::stochastic,
                        QMode::scratch_in_place, DType::f32},
        QuantVerifyCase{"kda_int8_sr_per_token", true, DType::i8, StateRounding::stochastic,
                        QMode::per_token_accepted, DType::f32},
        QuantVerifyCase{"kda_fp8_rn_output_slots", true, DType::f8e4m3, StateRounding::nearest,
                        QMode::output_slots, DType::f32},
        QuantVerifyCase{"gdn_fp8_sr_tree_per_token", false, DType::f8e4m3,
                        StateRounding::stochastic, QMode::tree_per_token, DType::f32},
        QuantVerifyCase{"kda_int8_rn_tree_per_token", true, DType::i8, StateRounding::nearest,
                        QMode::tree_per_token, DType::f32},
        // the odd shape: K = 32 (one element per lane), V = 48, two value heads per key head
        QuantVerifyCase{"gdn_odd_fp8_sr_scratch_tree", false, DType::f8e4m3,
                        StateRounding::stochastic, QMode::scratch_tree, DType::f32, true},
        QuantVerifyCase{"gdn_odd_int8_rn_in_place_f16_scratch", false, DType::i8,
                        StateRounding::nearest, QMode::scratch_in_place, DType::f16, true},
        QuantVerifyCase{"kda_odd_int8_sr_per_token", true, DType::i8, StateRounding::stochastic,
                        QMode::per_token_accepted, DType::f32, true},
        QuantVerifyCase{"kda_odd_fp8_rn_output_slots", true, DType::f8e4m3, StateRounding::nearest,
                        QMode::output_slots, DType::f32, true},
        QuantVerifyCase{"gdn_odd_int8_sr_tree_per_token", false, DType::i8,
                        StateRounding::stochastic, QMode::tree_per_token, DType::f32, true},
        QuantVerifyCase{"kda_odd_fp8_rn_tree_per_token", true, DType::f8e4m3,
                        StateRounding::nearest, QMode::tree_per_token, DType::f32, true}),
    case_name<QuantVerifyCase>);

struct QuantCommitCase {
  const char* name;
  DType dtype;
  StateRounding rounding;
  DType scratch;
  bool odd = false;  // kOdd (K = 32: one element per lane, V = 48 state rows), else Qwen3-Next
};
void PrintTo(const QuantCommitCase& c, std::ostream* os) { *os << c.name; }

class GpuQuantizedCommit : public GpuParamTest<QuantCommitCase> {};

// The commit after a verify, every layer in one call: each accepted float scratch state
// requantized into its slot with fresh scales (the key: the slot, the layer, the layer's step),
// against the CPU: written slots within one quantum, every other byte bit-identical (rejected,
// padded and row-less requests write nothing), every layer's counter +1.
TEST_P(GpuQuantizedCommit, MatchesCpu) {
  const QuantCommitCase& c = GetParam();
  const Shape s = c.odd ? kOdd : kQwen3Next;
  const int64_t layers = 2, rows = 4, steps = 3;
  Rng rng = test_rng();
  std::vector<Block> live;
  for (int64_t l = 0; l < layers; ++l)
    for (int64_t slot : {4, 6, 8, 2}) live.push_back({l, slot});
  const QuantPools q = make_quant_pools(s, c.dtype, c.rounding, deltastate::PoolLayout::per_layer,
                                        layers, 9, live, rng);
  Tensor inter = Tensor::contiguous(c.scratch, {layers, rows, steps, s.HV, s.V, s.K});
  inter.fill_normal(rng, 0.5);
  // request: slot, accepted, scratch row (b1 padded, b2 nothing accepted, b3 no row)
  const Tensor idx = index_tensor({4, -1, 6, 8, 2}), acc = index_tensor({2, 3, 0, 1, 3}),
               rws = index_tensor({1, 0, 2, -1, 3}, DType::i64);
  Mirror m;
  m.upload_all(inter, idx, acc, rws);
  auto run = [&](auto&& view_of, const StatePool& p) {
    deltastate::CommitArgs a;
    a.state = p.states();
    a.intermediate_states = view_of(inter);
    a.state_indices = view_of(idx);
    a.accepted = view_of(acc);
    a.intermediate_state_indices = view_of(rws);
    a.state_format.scales = p.scales();
    a.state_format.rounding = c.rounding;
    if (p.config().stochastic_rounding()) {
      a.state_format.step = p.rounding_steps();
      a.state_format.seed = kSeed;
    }
    deltastate::update_state_after_verify(a);
  };
  run(host_view, *q.host);
  run(m.views(), *q.dev);
  sync();
  EXPECT_NO_THROW(deltastate::check_errors());
  if (q.stochastic) {
    for (int64_t l = 0; l < layers; ++l) {
      EXPECT_EQ(host_step(q, l), kStep0 + 1);
    }
  }
  std::vector<Block> written;
  for (int64_t l = 0; l < layers; ++l)
    for (int64_t slot : {4, 2}) written.push_back({l, slot});
  expect_pools_match(q, c.dtype, written);
}

INSTANTIATE_TEST_SUITE_P(
    Cuda, GpuQuantizedCommit,
    ::testing::Values(
        QuantCommitCase{"fp8_sr", DType::f8e4m3, StateRounding::stochastic, DType::f32},
        QuantCommitCase{"fp8_rn_bf16_scratch", DType::f8e4m3, StateRounding::nearest, DType::bf16},
        QuantCommitCase{"int8_rn", DType::i8, StateRounding::nearest, DType::f32},
        QuantCommitCase{"int8_sr_f16_scratch", DType::i8, StateRounding::stochastic, DType::f16},
        QuantCommitCase{"odd_fp8_sr_bf16_scratch", DType::f8e4m3, StateRounding::stochastic,
                        DType::bf16, true},
        QuantCommitCase{"odd_int8_rn", DType::i8, StateRounding::nearest, DType::f32, true}),
    case_name<QuantCommitCase>);

// A verify (float scratch, no write-back) and the commit of its accepted states captured in one
// CUDA graph and replayed three times, against three eager calls on a second device pool: the
// pools bit-identical (the same keys: each replay advanced the device's step counter, twice).
TEST_F(GpuTest, QuantizedVerifyCommitGraphReplay) {
  const Shape s = kOdd;
  const int64_t layer = 1;
  Rng rng = test_rng();
  const std::vector<int64_t> slots{2, -1, 0};
  const QuantPools q =
      make_quant_pools(s, DType::f8e4m3, StateRounding::format_default,
                       deltastate::PoolLayout::per_layer, 2, 4, blocks_of(layer, slots), rng);
  StatePoolConfig cfg = q.dev->config();
  StatePool eager(cfg);
  CUDA_CHECK(cudaMemcpy(eager.data(), q.dev->data(), static_cast<size_t>(q.bytes),
                        cudaMemcpyDeviceToDevice));
  RecurrentBatch rb = make_recurrent_batch(rng, recurrent_spec(s, false, f32, 3, 2));
  Tensor idx = index_tensor(slots), acc = index_tensor({2, 0, 1});
  Tensor inter = Tensor::contiguous(DType::f32, {3, 2, s.HV, s.V, s.K});
  Mirror m;
  m.upload_all(rb.q, rb.k, rb.v, rb.g, rb.beta, rb.out, rb.A_log, rb.dt_bias, idx, acc, inter);
  cudaStream_t stream = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto step = [&](const StatePool& p) {
    deltastate::VerifyArgs a = verify_inputs(rb.args(m.views()), false);
    a.state = p.layer_state(layer);
    a.state_format = format_of(p, layer, StateRounding::format_default);
    a.state_indices = m.view(idx);
    a.update_state = false;
    a.intermediate_states = m.view(inter);
    a.stream = stream;
    deltastate::verify(a);
    deltastate::CommitArgs ca;
    ca.state = p.layer_state(layer);
    ca.intermediate_states = m.view(inter);
    ca.state_indices = m.view(idx);
    ca.accepted = m.view(acc);
    ca.state_format = format_of(p, layer, StateRounding::format_default);
    ca.stream = stream;
    deltastate::update_state_after_verify(ca);
  };
  for (int i = 0; i < 3; ++i) step(eager);
  replay_graph(stream, 3, [&] { step(*q.dev); });
  int64_t got = 0;
  CUDA_CHECK(cudaMemcpy(&got, q.dev->rounding_step(layer).data, 8, cudaMemcpyDeviceToHost));
  EXPECT_EQ(got, kStep0 + 6);
  EXPECT_TRUE(same_device_bytes(q.dev->data(), eager.data(), q.bytes))
      << "graph replays against eager calls";
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

// ---- ReplaySSM decode's quantized checkpoint -------------------------------------------------
struct QuantReplayCase {
  const char* name;
  bool kda;
  DType dtype;
  StateRounding rounding;
  bool odd = false;  // kOdd (K = 32, V = 48, HV = 6 over H = 3), else the model's shape
};
void PrintTo(const QuantReplayCase& c, std::ostream* os) { *os << c.name; }

class GpuQuantizedReplay : public GpuParamTest<QuantReplayCase> {};

// ReplaySSM decode on a quantized checkpoint with the pool's float rings (L = 3), five steps with
// natural flushes and a forced one, the cursors advanced by the op: each step from the CPU's pool
// on both backends; outputs, cursors, the rings (fp32 tolerance), a flushed row's checkpoint
// within one quantum, every other checkpoint and byte untouched, the step counter (+1 per call).
TEST_P(GpuQuantizedReplay, CheckpointMatchesCpu) {
  const QuantReplayCase& c = GetParam();
  const Shape s = c.odd ? kOdd : c.kda ? kKimi : kQwen3Next;
  const int64_t layer = 1, L = 3;
  Rng rng = test_rng();
  const std::vector<int64_t> slots{7, -1, 2, 5};
  const QuantPools q = make_quant_pools(s, c.dtype, c.rounding, deltastate::PoolLayout::per_layer,
                                        2, 9, blocks_of(layer, slots), rng, L, c.kda);
  DecodeBatch batch = make_decode_batch(rng, s, c.kda, slots, bf16);
  const double scale = 1.0 / std::sqrt(static_cast<double>(s.K));
  std::vector<int64_t> cursor(slots.size(), 0);
  Tensor wp = index_tensor(cursor), ff = index_tensor({0, 0, 1, 0});
  const StatePool& host = *q.host;
  const std::vector<TensorView> rings = ring_views(host, layer);
  Mirror m;
  int flushes = 0;
  for (int step = 0; step < 5; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    if (step) batch.randomize(rng);
    batch.poison_out();
    for (size_t n = 0; n < slots.size(); ++n) wp.set_linear(static_cast<int64_t>(n), cursor[n]);
    ff.set_linear(2, step == 0 ? 1 : 0);
    std::vector<Block> flushed;
    for (size_t n = 0; n < slots.size(); ++n)
      if (slots[n] >= 0 && (cursor[n] == L - 1 || ff.get_linear(static_cast<int64_t>(n)) != 0))
        flushed.push_back({layer, slots[n]});
    flushes += static_cast<int>(flushed.size());
    m.upload_all(batch.x, batch.a, batch.b, batch.A_log, batch.dt_bias, batch.idx, batch.out, wp,
                 ff);
    auto run = [&](auto&& view_of, const StatePool& p) {
      deltastate::ReplayDecodeArgs a =
          replay_args(view_of, batch, p.layer_state(layer), p.d_cache(layer), p.k_cache(layer),
                      p.g_cache(layer), wp, &ff, scale);
      a.state_format = format_of(p, layer, c.rounding);
      a.advance_write_pos = true;
      deltastate::replayssm_decode(a);
    };
    run(host_view, host);
    run(m.views(), *q.dev);
    expect_replay_step_matches(m, batch, slots, q, c.dtype, wp, rings, flushed, layer, step);
    for (size_t n = 0; n < slots.size(); ++n)
      cursor[n] = static_cast<int64_t>(wp.get_linear(static_cast<int64_t>(n)));
  }
  EXPECT_GE(flushes, 4);
}

INSTANTIATE_TEST_SUITE_P(
    Cuda, GpuQuantizedReplay,
    ::testing::Values(
        QuantReplayCase{"gdn_fp8_sr", false, DType::f8e4m3, StateRounding::stochastic},
        QuantReplayCase{"gdn_int8_rn", false, DType::i8, StateRounding::nearest},
        QuantReplayCase{"kda_fp8_rn", true, DType::f8e4m3, StateRounding::nearest},
        QuantReplayCase{"kda_int8_sr", true, DType::i8, StateRounding::stochastic},
        // the odd shape: K = 32 (one element per lane), V = 48, two value heads per key head
        QuantReplayCase{"gdn_odd_int8_sr", false, DType::i8, StateRounding::stochastic, true},
        QuantReplayCase{"kda_odd_fp8_rn", true, DType::f8e4m3, StateRounding::nearest, true},
        QuantReplayCase{"gdn_odd_fp8_sr", false, DType::f8e4m3, StateRounding::stochastic, true}),
    case_name<QuantReplayCase>);

// ReplaySSM decode captured in a CUDA graph and replayed four times (L = 3: a flush on the third)
// against four eager calls on a second device pool with its own cursors: pools and cursors
// bit-identical, the device step counter advanced once per replay.
TEST_F(GpuTest, QuantizedReplayGraphReplay) {
  const Shape s = kOdd;
  const int64_t layer = 1, L = 3;
  Rng rng = test_rng();
  const std::vector<int64_t> slots{2, -1, 0};
  const QuantPools q =
      make_quant_pools(s, DType::i8, StateRounding::stochastic, deltastate::PoolLayout::per_layer,
                       2, 4, blocks_of(layer, slots), rng, L, false);
  StatePool eager(q.dev->config());
  CUDA_CHECK(cudaMemcpy(eager.data(), q.dev->data(), static_cast<size_t>(q.bytes),
                        cudaMemcpyDeviceToDevice));
  DecodeBatch batch = make_decode_batch(rng, s, false, slots, f32);
  Tensor wp_eager = index_tensor({0, 0, 0}), wp_graph = index_tensor({0, 0, 0});
  Mirror m;
  m.upload_all(batch.x, batch.a, batch.b, batch.A_log, batch.dt_bias, batch.idx, batch.out,
               wp_eager, wp_graph);
  cudaStream_t stream = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto step = [&](const StatePool& p, const Tensor& wp) {
    deltastate::ReplayDecodeArgs a =
        replay_args(m.views(), batch, p.layer_state(layer), p.d_cache(layer), p.k_cache(layer),
                    p.g_cache(layer), wp, nullptr, 0.3);
    a.state_format = format_of(p, layer, StateRounding::stochastic);
    a.advance_write_pos = true;
    a.stream = stream;
    deltastate::replayssm_decode(a);
  };
  for (int i = 0; i < 4; ++i) step(eager, wp_eager);
  replay_graph(stream, 4, [&] { step(*q.dev, wp_graph); });
  int64_t got = 0;
  CUDA_CHECK(cudaMemcpy(&got, q.dev->rounding_step(layer).data, 8, cudaMemcpyDeviceToHost));
  EXPECT_EQ(got, kStep0 + 4);
  EXPECT_EQ(m.download(wp_graph).values(), m.download(wp_eager).values()) << "cursors";
  EXPECT_EQ(m.download(wp_graph).values(), (std::vector<double>{1, 0, 1})) << "cursors";
  EXPECT_TRUE(same_device_bytes(q.dev->data(), eager.data(), q.bytes))
      << "graph replays against eager calls";
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

// ---- StatePool.fork of a source with pending ReplaySSM records --------------------------------
struct QuantForkCase {
  const char* name;
  bool kda;
  DType dtype;
  StateRounding rounding;
  deltastate::PoolLayout layout;
  int32_t cache_base;  // 0: the basic ring; else circular rings from this base
  bool odd = false;    // kOdd, else the model's shape
};
void PrintTo(const QuantForkCase& c, std::ostream* os) { *os << c.name; }

class GpuQuantizedFork : public GpuParamTest<QuantForkCase> {};

// The CUDA pool's fork (replay_materialize_kernel's formatted instance) against the CPU pool's on
// the same bytes: a source with m = 3 of L = 4 records pending, finite records in every ring
// position of the source; dst's checkpoint in both layers within one quantum, its scales, every
// other byte (the source, the rings, the step counters: fork does not advance them) equal.
TEST_P(GpuQuantizedFork, MatchesCpu) {
  const QuantForkCase& c = GetParam();
  const Shape s = c.odd ? kOdd : c.kda ? kKimi : kQwen3Next;
  const int64_t layers = 2, slots = 5, src = 1, dst = 3;
  const int L = 4, m = 3;
  Rng rng = test_rng();
  const QuantPools q = make_quant_pools(s, c.dtype, c.rounding, c.layout, layers, slots,
                                        blocks_in_layers(layers, {0, src, 2, dst}), rng, L, c.kda);
  StatePool& host = *q.host;
  for (int i = 0; i < 4; ++i) {  // slots 0..3 allocated on both pools, their bytes kept
    host.allocate(/*clear=*/false);
    q.dev->allocate(/*clear=*/false);
  }
  auto fill = [&](const TensorView& v, double lo, double hi) {
    int64_t per = 1;
    for (int d = 1; d < v.ndim; ++d) per *= v.shape[d];
    for (int64_t e = 0; e < per; ++e)
      store_value(v.data, v.dtype, src * v.stride[0] + e, rng.uniform(lo, hi));
  };
  for (int64_t l = 0; l < layers; ++l) {
    fill(host.d_cache(l), -0.2, 0.2);
    fill(host.k_cache(l), -0.1, 0.1);
    fill(host.g_cache(l), -0.5, 0.0);
  }
  for (int64_t sl = 0; sl < slots; ++sl) host.set_cursor(sl, 0);
  host.set_cursor(src, m);
  host.set_cursor(dst, 2);
  q.push();
  StatePool::ForkRing ring;
  ring.cache_base = c.cache_base;
  host.fork(src, dst, nullptr, ring);
  q.dev->fork(src, dst, nullptr, ring);
  sync();
  EXPECT_NO_THROW(deltastate::check_errors());
  EXPECT_EQ(q.dev->cursor(dst), 0);
  EXPECT_EQ(q.dev->cursor(src), m);
  if (q.stochastic) {
    EXPECT_EQ(host_step(q, 1), kStep0);
  }
  expect_pools_match(q, c.dtype, blocks_in_layers(layers, {dst}));
}

INSTANTIATE_TEST_SUITE_P(
    Cuda, GpuQuantizedFork,
    ::testing::Values(
        QuantForkCase{"gdn_fp8_sr", false, DType::f8e4m3, StateRounding::format_default,
                      deltastate::PoolLayout::per_layer, 0},
        QuantForkCase{"kda_int8_rn_envelope_circular", true, DType::i8, StateRounding::nearest,
                      deltastate::PoolLayout::envelope, 2},
        QuantForkCase{"gdn_bf16_sr_circular", false, DType::bf16, StateRounding::stochastic,
                      deltastate::PoolLayout::per_layer, 1},
        QuantForkCase{"kda_fp8_rn", true, DType::f8e4m3, StateRounding::nearest,
                      deltastate::PoolLayout::per_layer, 0},
        QuantForkCase{"gdn_odd_int8_sr_circular", false, DType::i8, StateRounding::stochastic,
                      deltastate::PoolLayout::envelope, 3, true}),
    case_name<QuantForkCase>);

// ---- the chunked prefill ----------------------------------------------------------------------
struct QuantPrefillCase {
  const char* name;
  Shape s;
  bool kda;
  DType dtype;
  StateRounding rounding;
  std::vector<int64_t> seqlens;  // sequence 1 (when there are several) is padded
  int64_t every;                 // checkpoint_every_n_tokens, into pool slots
  deltastate::PoolLayout layout;
};
void PrintTo(const QuantPrefillCase& c, std::ostream* os) { *os << c.name; }

class GpuQuantizedChunkPrefill : public GpuParamTest<QuantPrefillCase> {};

// Two chunked prefills (bf16 inputs, in place on the pool, checkpoints into pool slots, every
// third checkpoint slot -1, a padded sequence) on a host pool and its device copy, each from the
// CPU's pool of the call before: outputs, every written slot's scales and dequantized codes, the
// step counter (one advance per call), and every other byte of the pool (code sentinels 0x5a,
// scale sentinels 1e30) untouched.
TEST_P(GpuQuantizedChunkPrefill, MatchesCpu) {
  const QuantPrefillCase& c = GetParam();
  const Shape s = c.s;
  Rng rng = test_rng();
  RecurrentBatch rb =
      make_recurrent_batch(rng, recurrent_spec(s, c.kda, DType::bf16, 1, 0, c.seqlens));
  const int64_t N = rb.N;
  std::vector<int64_t> cu_starts{0};
  for (int64_t n = 0; n < N; ++n) cu_starts.push_back(cu_starts.back() + rb.seq_len(n) / c.every);
  const int64_t total = cu_starts.back();

  const int64_t layers = 2, num_slots = N + total + 3, layer = 1;
  const bool fp8 = c.dtype == DType::f8e4m3;
  const double qmax = fp8 ? 448.0 : 127.0;

  std::vector<int64_t> perm(static_cast<size_t>(num_slots));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng.engine());
  size_t next = 0;
  std::vector<int64_t> in_slot(N), ck_slot(total);
  for (int64_t n = 0; n < N; ++n) in_slot[n] = N > 1 && n == 1 ? -1 : perm[next++];
  for (int64_t i = 0; i < total; ++i) ck_slot[i] = i % 3 == 2 ? -1 : perm[next++];

  // sentinels everywhere (codes 0x5a, every scale 1e30), then random live initial states
  const QuantPools q = make_quant_pools(s, c.dtype, c.rounding, c.layout, layers, num_slots,
                                        blocks_of(layer, in_slot), rng, 0, false, ScaleFill::huge);
  const StatePool &host = *q.host, &dev = *q.dev;
  const int64_t bytes = q.bytes;
  const TensorView st = host.layer_state(layer), sc = host.layer_scales(layer);
  const int64_t rows = int64_t{s.HV} * s.V;
  const bool stochastic = q.stochastic;

  const Tensor idx = index_tensor(in_slot), ck_idx = index_tensor(ck_slot),
               cu_starts_t = index_tensor(cu_starts);
  Mirror m;
  Tensor ws;
  for (int call = 0; call < 2; ++call) {
    SCOPED_TRACE("call " + std::to_string(call));
    if (call) rb.randomize(rng);
    rb.poison_out();
    m.upload_all(rb.q, rb.k, rb.v, rb.g, rb.beta, rb.out, rb.A_log, rb.dt_bias, rb.cu, idx, ck_idx,
                 cu_starts_t);
    auto args = [&](auto&& view_of, const StatePool& p) {
      deltastate::ChunkPrefillArgs a;
      a.q = view_of(rb.q);
      a.k = view_of(rb.k);
      a.v = view_of(rb.v);
      a.g = view_of(rb.g);
      a.beta = view_of(rb.beta);
      a.out = view_of(rb.out);
      a.is_kda = c.kda;
      a.gate_in_kernel = true;
      a.A_log = view_of(rb.A_log);
      a.dt_bias = view_of(rb.dt_bias);
      a.beta_is_logit = rb.spec.beta_is_logit;
      a.cu_seqlens = view_of(rb.cu);
      a.use_qk_l2norm = true;
      a.initial_state = p.layer_state(layer);
      a.initial_state_indices = view_of(idx);
      a.checkpoint_every_n_tokens = c.every;
      a.checkpoint_cu_starts = view_of(cu_starts_t);
      a.checkpoint_slot_indices = view_of(ck_idx);
      a.state_format = format_of(p, layer, c.rounding);
      return a;
    };
    // the CPU oracle needs its own workspace (chunk_prefill_workspace_bytes on a host view)
    deltastate::ChunkPrefillArgs ha = args(host_view, host);
    const int64_t host_ws_bytes = deltastate::chunk_prefill_workspace_bytes(ha);
    Tensor host_ws;
    if (host_ws_bytes > 0) {
      host_ws = Tensor::contiguous(DType::f32, {(host_ws_bytes + 3) / 4});
      ha.workspace = host_ws.view();
    }
    deltastate::chunk_prefill(ha);
    deltastate::ChunkPrefillArgs da = args(m.views(), dev);
    const int64_t ws_bytes = deltastate::chunk_prefill_workspace_bytes(da);
    if (ws_bytes > 0) {
      if (!ws.alloc_base()) {
        ws = Tensor::contiguous(DType::f32, {(ws_bytes + 3) / 4});
        ws.fill_all(std::nan(""));
        m.upload(ws);
      }
      da.workspace = m.view(ws);
    }
    deltastate::chunk_prefill(da);
    sync();
    EXPECT_NO_THROW(deltastate::check_errors());  // no bad row recorded

    // outputs: each live sequence within 8e-3 of its norm, the padded one zero
    const Tensor out = m.download(rb.out);
    for (int64_t n = 0; n < N; ++n) {
      double err2 = 0.0, ref2 = 0.0;
      bool zero = true;
      for (int64_t t = 0; t < rb.seq_len(n); ++t) {
        const auto [b, tok] = rb.coord(n, t);
        for (int64_t hv = 0; hv < s.HV; ++hv)
          for (int64_t v = 0; v < s.V; ++v) {
            const double g = out.get({b, tok, hv, v}), w = rb.out.get({b, tok, hv, v});
            ASSERT_TRUE(std::isfinite(g)) << "sequence " << n << " token " << t;
            err2 += (g - w) * (g - w);
            ref2 += w * w;
            zero = zero && g == 0.0;
          }
      }
      if (in_slot[n] < 0) EXPECT_TRUE(zero) << "padded sequence " << n;
      else EXPECT_LE(std::sqrt(err2 / std::max(ref2, 1e-30)), 8e-3) << "outputs of sequence " << n;
    }

    // the written slots: final states in place, checkpoint slots
    std::vector<int64_t> written_slots;
    for (int64_t slot : in_slot)
      if (slot >= 0) written_slots.push_back(slot);
    for (int64_t n = 0; n < N; ++n)  // a padded sequence stores no checkpoint
      for (int64_t i = cu_starts[n]; i < cu_starts[n + 1]; ++i)
        if (in_slot[n] >= 0 && ck_slot[i] >= 0) written_slots.push_back(ck_slot[i]);
    std::vector<uint8_t> d(static_cast<size_t>(bytes));
    CUDA_CHECK(cudaMemcpy(d.data(), dev.data(), d.size(), cudaMemcpyDeviceToHost));
    const char* hbase = static_cast<const char*>(host.data());
    const char* dc0 = reinterpret_cast<const char*>(d.data());
    std::vector<MemRange> written;
    for (int64_t slot : written_slots) {
      SCOPED_TRACE("slot " + std::to_string(slot));
      const int64_t code_off = static_cast<const char*>(st.data) - hbase + slot * st.stride[0];
      const int64_t scale_off = static_cast<const char*>(sc.data) - hbase + slot * sc.stride[0] * 4;
      written.push_back({dc0 + code_off, dc0 + code_off + rows * s.K});
      written.push_back({dc0 + scale_off, dc0 + scale_off + rows * 4});
      double err2 = 0.0, ref2 = 0.0;
      for (int64_t row = 0; row < rows; ++row) {
        float hs, ds;
        std::memcpy(&hs, hbase + scale_off + row * 4, 4);
        std::memcpy(&ds, dc0 + scale_off + row * 4, 4);
        ASSERT_TRUE(std::isfinite(hs) && hs < 1e29f) << "the CPU did not write row " << row;
        ASSERT_NEAR(ds, hs, 2e-2 * hs) << "scale of row " << row;
        const double amax = hs * qmax;
        for (int64_t k = 0; k < s.K; ++k) {
          const uint8_t hc = static_cast<uint8_t>(hbase[code_off + row * s.K + k]);
          const uint8_t dc = d[static_cast<size_t>(code_off + row * s.K + k)];
          const double hv = (fp8 ? e4m3_value(hc) : static_cast<int8_t>(hc)) * hs;
          const double dv = (fp8 ? e4m3_value(dc) : static_cast<int8_t>(dc)) * ds;
          err2 += (dv - hv) * (dv - hv);
          ref2 += hv * hv;
          if (hc == dc) continue;
          ASSERT_FALSE(!fp8 && dc == 0x80) << "int8 -128 stored, row " << row << " k " << k;
          const double quantum =
              fp8 ? std::max(std::fabs(hv) * 0.125, hs * std::ldexp(1.0, -9)) : hs;
          ASSERT_LE(std::fabs(dv - hv), quantum * 1.0001 + 2e-2 * amax)
              << "row " << row << " k " << k;
        }
      }
      EXPECT_LE(std::sqrt(err2 / std::max(ref2, 1e-30)), 5e-2) << "dequantized state";
    }
    if (stochastic) {
      const int64_t want = kStep0 + call + 1;
      EXPECT_EQ(host_step(q, layer), want);
      int64_t got = 0;
      CUDA_CHECK(cudaMemcpy(&got, dev.rounding_step(layer).data, 8, cudaMemcpyDeviceToHost));
      EXPECT_EQ(got, want) << "the device's step counter: one advance per call";
      const int64_t off = static_cast<const char*>(dev.rounding_step(layer).data) -
                          static_cast<const char*>(dev.data());
      written.push_back({dc0 + off, dc0 + off + 8});
    }
    // everything else as the host pool holds it: the sentinels, the other layer, spare slots
    EXPECT_TRUE(Snapshot::equal_except(d.data(), host.data(), bytes, written))
        << "device pool outside the written slots' codes and scales";
    q.push();  // the next call starts both backends from the CPU's pool
  }
}

// GDN K = V = 128 with bf16 inputs takes the Hopper kernels on compute capability 9.0 (the tensor-
// core kernels elsewhere); the TP4 shape's one long sequence (64 chunks, 8 value heads) takes
// their context parallelism there (transfer, combine, segments); KDA the split kernels (2
// sequences) or the fused tensor-core kernel; K = 64 the fused tensor-core kernel in the full
// build, the fallback otherwise.
constexpr Shape kTp4{"tp4", 4, 8, 128, 128};
constexpr Shape kK64{"k64", 2, 4, 64, 64};
INSTANTIATE_TEST_SUITE_P(Cuda, GpuQuantizedChunkPrefill,
                         ::testing::Values(QuantPrefillCase{"gdn_fp8_sr",
                                                            kQwen3Next,
                                                            false,
                                                            DType::f8e4m3,
                                                            StateRounding::stochastic,
                                                            {130, 64, 1, 63, 300},
                                                            64,
                                                            deltastate::PoolLayout::per_layer},
                                           QuantPrefillCase{"gdn_int8_rn_envelope",
                                                            kQwen3Next,
                                                            false,
                                                            DType::i8,
                                                            StateRounding::nearest,
                                                            {130, 64, 1, 63, 300},
                                                            64,
                                                            deltastate::PoolLayout::envelope},
                                           QuantPrefillCase{"gdn_tp4_cp_fp8_sr",
                                                            kTp4,
                                                            false,
                                                            DType::f8e4m3,
                                                            StateRounding::stochastic,
                                                            {4096},
                                                            512,
                                                            deltastate::PoolLayout::per_layer},
                                           QuantPrefillCase{"gdn_tp4_cp_int8_rn",
                                                            kTp4,
                                                            false,
                                                            DType::i8,
                                                            StateRounding::nearest,
                                                            {4096},
                                                            512,
                                                            deltastate::PoolLayout::per_layer},
                                           QuantPrefillCase{"gdn_k64_fp8_sr",
                                                            kK64,
                                                            false,
                                                            DType::f8e4m3,
                                                            StateRounding::stochastic,
                                                            {200, 7, 64},
                                                            64,
                                                            deltastate::PoolLayout::per_layer},
                                           QuantPrefillCase{"gdn_k64_int8_rn",
                                                            kK64,
                                                            false,
                                                            DType::i8,
                                                            StateRounding::nearest,
                                                            {200, 7, 64},
                                                            64,
                                                            deltastate::PoolLayout::envelope},
                                           QuantPrefillCase{"kda_fp8_sr_split",
                                                            kKimi,
                                                            true,
                                                            DType::f8e4m3,
                                                            StateRounding::stochastic,
                                                            {150, 70},
                                                            64,
                                                            deltastate::PoolLayout::per_layer},
                                           QuantPrefillCase{"kda_int8_rn",
                                                            kKimi,
                                                            true,
                                                            DType::i8,
                                                            StateRounding::nearest,
                                                            {65, 64, 1, 128, 100},
                                                            64,
                                                            deltastate::PoolLayout::per_layer}),
                         case_name<QuantPrefillCase>);

// CUDA-graph replay of a chunked prefill on an fp8 pool (stochastic rounding; GDN K = 128, bf16:
// the Hopper kernels on compute capability 9.0): three replays of one captured call leave the
// device step counter at 3 and the pool bit-identical to three eager calls on a twin pool (the
// key's step read on the device, advanced by the graph's own kernel).
TEST_F(GpuTest, QuantizedPrefillGraphReplayMatchesEager) {
  const Shape s = kQwen3Next;
  StatePoolConfig cfg;
  cfg.slots = 4;
  cfg.HV = s.HV;
  cfg.V = s.V;
  cfg.K = s.K;
  cfg.state_dtype = DType::f8e4m3;
  cfg.device = Device::cuda(0);
  StatePool graph_pool(cfg), eager_pool(cfg);
  const int64_t bytes = graph_pool.total_bytes();
  for (const StatePool* p : {&graph_pool, &eager_pool})
    CUDA_CHECK(cudaMemset(p->data(), 0, static_cast<size_t>(bytes)));
  Rng rng = test_rng();
  RecurrentBatch rb =
      make_recurrent_batch(rng, recurrent_spec(s, false, DType::bf16, 1, 0, {130, 70}));
  const Tensor idx = index_tensor({2, 0});
  Mirror gm, em;
  for (Mirror* m : {&gm, &em})
    m->upload_all(rb.q, rb.k, rb.v, rb.g, rb.beta, rb.out, rb.A_log, rb.dt_bias, rb.cu, idx);
  Tensor gws, ews;
  auto args = [&](Mirror& m, const StatePool& p, Tensor& ws) {
    deltastate::ChunkPrefillArgs a;
    a.q = m.view(rb.q);
    a.k = m.view(rb.k);
    a.v = m.view(rb.v);
    a.g = m.view(rb.g);
    a.beta = m.view(rb.beta);
    a.out = m.view(rb.out);
    a.gate_in_kernel = true;
    a.A_log = m.view(rb.A_log);
    a.dt_bias = m.view(rb.dt_bias);
    a.cu_seqlens = m.view(rb.cu);
    a.use_qk_l2norm = true;
    a.initial_state = p.layer_state(0);
    a.initial_state_indices = m.view(idx);
    a.state_format.scales = p.layer_scales(0);
    a.state_format.step = p.rounding_step(0);
    const int64_t ws_bytes = deltastate::chunk_prefill_workspace_bytes(a);
    if (ws_bytes > 0) {
      if (!ws.alloc_base()) {
        ws = Tensor::contiguous(DType::f32, {(ws_bytes + 3) / 4});
        m.upload(ws);
      }
      a.workspace = m.view(ws);
    }
    return a;
  };
  for (int i = 0; i < 3; ++i) deltastate::chunk_prefill(args(em, eager_pool, ews));
  sync();
  cudaStream_t stream = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  deltastate::ChunkPrefillArgs ga = args(gm, graph_pool, gws);
  ga.stream = stream;
  EXPECT_NO_THROW(replay_graph(stream, 3, [&] { deltastate::chunk_prefill(ga); }));
  int64_t step = 0;
  CUDA_CHECK(cudaMemcpy(&step, graph_pool.rounding_step(0).data, 8, cudaMemcpyDeviceToHost));
  EXPECT_EQ(step, 3);
  EXPECT_TRUE(same_device_bytes(graph_pool.data(), eager_pool.data(), bytes))
      << "graph replays and eager calls differ";
  const Tensor go = gm.download(rb.out), eo = em.download(rb.out);
  EXPECT_EQ(std::memcmp(go.alloc_base(), eo.alloc_base(), static_cast<size_t>(go.alloc_bytes())), 0)
      << "outputs of the last call";
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

// ---- ReplaySSM speculative verify on a formatted checkpoint ----------------------------------
struct QuantRvCase {
  const char* name;
  bool kda;
  DType dtype;
  StateRounding rounding;
  bool odd = false;    // kOdd, else the model's shape
  bool exact = false;  // the exact-raw ring (its fold: the exact-fold launch)
};
void PrintTo(const QuantRvCase& c, std::ostream* os) { *os << c.name; }

class GpuQuantizedReplayVerify : public GpuParamTest<QuantRvCase> {};

// replayssm_verify's arguments `a` on layer `layer` of pool `p`: its checkpoint in its format
// (`rounding`), its d / k / g rings, the rows' slots and the cursor tables.
ReplayVerifyArgs rv_on_pool(ReplayVerifyArgs a, const StatePool& p, int64_t layer,
                            StateRounding rounding, TensorView idx, TensorView wp, TensorView base,
                            TensorView flush) {
  a.state = p.layer_state(layer);
  a.state_format = format_of(p, layer, rounding);
  a.state_indices = idx;
  a.d_cache = p.d_cache(layer);
  a.k_cache = p.k_cache(layer);
  a.g_cache = p.g_cache(layer);
  a.write_pos = wp;
  a.cache_base = base;
  a.is_flush = flush;
  return a;
}

// A verify's outputs [1, tokens, HV, V] against the CPU's: kOutTol and one bf16 rounding, a folded
// row's draft outputs also folded_draft_slack's output bound (expect_close_with_slack). A folded
// row's drafts run from the checkpoint each backend stored, which may sit one quantum apart (an
// H100: gdn_fp8_sr_exact, one output 1.5e-4 apart, over kOutTol's 1.3e-4).
void expect_verify_outputs(Mirror& m, const QuantPools& q, DType dtype, int64_t layer,
                           const Tensor& out, const std::vector<FoldDrafts>& drafts,
                           double q_norm) {
  const std::vector<double> want = out.values();
  std::vector<double> slack(want.size(), 0.0);
  folded_draft_slack(q, dtype, q.device_bytes(), layer, drafts, &slack, q_norm);
  expect_close_with_slack(m.download(out).values(), want, slack, kOutTol, DType::bf16, "outputs",
                          "output");
}

// Elements of `ring` (a view of the host pool, compact below its slot) of the live slots: random,
// stored in the ring's dtype (a 16-bit pool's d ring is 16-bit: written as floats, its slots got
// float halves, NaN among them, and the writes of the high slots ran past the ring).
void fill_ring_slots(const TensorView& ring, const std::vector<int64_t>& slots, Rng& rng, double lo,
                     double hi) {
  int64_t per = 1;
  for (int d = 1; d < ring.ndim; ++d) per *= ring.shape[d];
  for (int64_t s : slots)
    if (s >= 0)
      for (int64_t e = 0; e < per; ++e)
        store_value(ring.data, ring.dtype, s * ring.stride[0] + e, rng.uniform(lo, hi));
}

// replayssm_verify on a formatted checkpoint (the pool's rings, L = 8), four steps from
// random cursors with folds (one row folds every step), the CUDA backend's odd steps as two calls
// (rows append, then fold; the CPU's as one): each step from the CPU's pool on both backends;
// outputs, the rings (and the exact-raw ring) to fp32 tolerance (a folded row's draft records:
// plus what its two stored checkpoints' difference moves them by, folded_draft_slack), a folded
// row's checkpoint within one quantum, every other checkpoint and byte untouched (scales of unused
// slots 1e30), the step counter one on per step.
TEST_P(GpuQuantizedReplayVerify, MatchesCpu) {
  const QuantRvCase& c = GetParam();
  const Shape s = c.odd ? kOdd : c.kda ? kKimi : kQwen3Next;
  const int64_t layer = 1, L = 8, T = 3, S = 9;
  Rng rng = test_rng();
  const std::vector<int64_t> slots{7, -1, 2, 5};
  const QuantPools q =
      make_quant_pools(s, c.dtype, c.rounding, deltastate::PoolLayout::per_layer, 2, S,
                       blocks_of(layer, slots), rng, L, c.kda, ScaleFill::huge);
  const StatePool& host = *q.host;
  const std::vector<TensorView> rings = ring_views(host, layer);
  fill_ring_slots(rings[0], slots, rng, -0.3, 0.3);
  fill_ring_slots(rings[1], slots, rng, -0.3, 0.3);
  fill_ring_slots(rings[2], slots, rng, -0.5, -0.01);
  q.push();
  Tensor rawv = Tensor::contiguous(f32, {S, s.HV, L, s.V});
  Tensor rawk = Tensor::contiguous(f32, {S, s.H, L, s.K});
  Tensor rawb = Tensor::contiguous(f32, {S, s.HV, L});
  rawv.fill_normal(rng, 1.0);
  rawk.fill_normal(rng, 1.0);
  rawb.fill_uniform(rng, 0.05, 0.95);
  Tensor idx = index_tensor(slots);
  Tensor wp = index_tensor(std::vector<int64_t>(S, 0)), base = wp.empty_like(),
         flush = wp.empty_like();
  Mirror m;
  int folds = 0;
  for (int step = 0; step < 4; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    std::vector<Block> folded;
    std::vector<int64_t> fold_m0(slots.size(), -1);  // a folding row's committed records (m0 > 0)
    for (int64_t r = 0; r < S; ++r) {
      wp.set({r}, 0);
      base.set({r}, 0);
      flush.set({r}, 0);
    }
    for (size_t n = 0; n < slots.size(); ++n) {
      const int64_t sl = slots[n];
      if (sl < 0) continue;
      const int64_t m0 = rng.integer(n == 0 ? 1 : 0, L - T);  // every draft's record fits
      wp.set({sl}, static_cast<double>(m0));
      base.set({sl}, static_cast<double>(rng.integer(0, L - 1)));
      const bool f = n == 0 || rng.chance(0.5);
      flush.set({sl}, f ? 1 : 0);
      if (f && m0 > 0) {
        folded.push_back({layer, sl});
        fold_m0[n] = m0;
      }
    }
    folds += static_cast<int>(folded.size());
    std::vector<int64_t> lens;
    for (size_t n = 0; n < slots.size(); ++n) lens.push_back(rng.integer(1, T));
    // The folded rows' draft records (positions (base + m0 + t) % L; every one fits the ring).
    std::vector<FoldDrafts> drafts;
    for (size_t n = 0, tok0 = 0; n < slots.size(); tok0 += static_cast<size_t>(lens[n]), ++n) {
      if (fold_m0[n] < 0) continue;
      FoldDrafts fd{slots[n], {}, static_cast<int64_t>(tok0)};
      for (int64_t t = 0; t < lens[n]; ++t)
        fd.pos.push_back((static_cast<int64_t>(base.get({slots[n]})) + fold_m0[n] + t) % L);
      drafts.push_back(fd);
    }
    RecurrentBatch rb = make_recurrent_batch(rng, recurrent_spec(s, c.kda, bf16, 1, T, lens));
    rb.poison_out();
    m.upload_all(rb.q, rb.k, rb.v, rb.g, rb.beta, rb.out, rb.A_log, rb.dt_bias, rb.cu, idx, wp,
                 base, flush, rawv, rawk, rawb);
    auto run = [&](auto&& view_of, const StatePool& p, deltastate::ReplayRows rows) {
      ReplayVerifyArgs a =
          rv_on_pool(replay_verify_inputs(rb.args(view_of), c.kda), p, layer, c.rounding,
                     view_of(idx), view_of(wp), view_of(base), view_of(flush));
      if (c.exact) {
        a.rawv_cache = view_of(rawv);
        a.rawk_cache = view_of(rawk);
        a.beta_cache = view_of(rawb);
      }
      a.rows = rows;
      deltastate::replayssm_verify(a);
    };
    run(host_view, host, deltastate::ReplayRows::all);
    if (step % 2 == 1) {
      run(m.views(), *q.dev, deltastate::ReplayRows::append);
      run(m.views(), *q.dev, deltastate::ReplayRows::fold);
    } else {
      run(m.views(), *q.dev, deltastate::ReplayRows::all);
    }
    sync();
    EXPECT_NO_THROW(deltastate::check_errors());
    expect_verify_outputs(m, q, c.dtype, layer, rb.out, drafts, 1.0 / std::sqrt(double(s.K)));
    if (c.exact)
      for (const Tensor* t : {&rawv, &rawk, &rawb}) {
        EXPECT_TRUE(close_vs_cpu(m.download(*t).values(), t->values(), kFp32StateTol, f32))
            << "exact-raw ring";
      }
    expect_replay_pools_match(m, q, c.dtype, wp, rings, folded, layer, step, drafts);
  }
  EXPECT_GE(folds, 4);
}

INSTANTIATE_TEST_SUITE_P(
    Cuda, GpuQuantizedReplayVerify,
    ::testing::Values(
        QuantRvCase{"gdn_fp8_sr", false, DType::f8e4m3, StateRounding::stochastic},
        QuantRvCase{"gdn_int8_rn", false, DType::i8, StateRounding::nearest},
        QuantRvCase{"kda_fp8_rn", true, DType::f8e4m3, StateRounding::nearest},
        QuantRvCase{"kda_int8_sr", true, DType::i8, StateRounding::stochastic},
        QuantRvCase{"gdn_bf16_sr", false, DType::bf16, StateRounding::stochastic},
        QuantRvCase{"gdn_odd_fp8_sr", false, DType::f8e4m3, StateRounding::stochastic, true},
        QuantRvCase{"kda_odd_int8_rn", true, DType::i8, StateRounding::nearest, true},
        // the exact-raw ring: the fold is the exact-fold launch, stored through the format
        QuantRvCase{"gdn_fp8_sr_exact", false, DType::f8e4m3, StateRounding::stochastic, false,
                    true},
        QuantRvCase{"kda_int8_rn_exact", true, DType::i8, StateRounding::nearest, false, true},
        QuantRvCase{"gdn_odd_bf16_sr_exact", false, DType::bf16, StateRounding::stochastic, true,
                    true}),
    case_name<QuantRvCase>);

// A ReplaySSM verify + commit step on an fp8 (stochastic) checkpoint captured in a CUDA graph and
// replayed four times against four eager calls on a second device pool with its own cursors (L =
// 8, 3 drafts: slot 2 folds from the second step on): pools and cursors bit-identical, the device
// step counter one on per replay (the fold launch, the verify kernel and the counter's kernel in
// the graph).
TEST_F(GpuTest, QuantizedReplayVerifyGraphReplay) {
  const Shape s = kOdd;
  const int64_t layer = 1, L = 8, T = 3, S = 4;
  Rng rng = test_rng();
  const std::vector<int64_t> slots{2, -1, 0};
  const QuantPools q =
      make_quant_pools(s, DType::f8e4m3, StateRounding::stochastic,
                       deltastate::PoolLayout::per_layer, 2, S, blocks_of(layer, slots), rng, L);
  StatePool eager(q.dev->config());
  CUDA_CHECK(cudaMemcpy(eager.data(), q.dev->data(), static_cast<size_t>(q.bytes),
                        cudaMemcpyDeviceToDevice));
  RecurrentBatch rb = make_recurrent_batch(rng, recurrent_spec(s, false, f32, 3, T));
  Tensor idx = index_tensor(slots), acc = index_tensor({3, 0, 2});
  const std::vector<int64_t> zeros(S, 0);
  Tensor wp_e = index_tensor(zeros), base_e = index_tensor(zeros), fl_e = index_tensor(zeros);
  Tensor wp_g = index_tensor(zeros), base_g = index_tensor(zeros), fl_g = index_tensor(zeros);
  Mirror m;
  m.upload_all(rb.q, rb.k, rb.v, rb.g, rb.beta, rb.out, rb.A_log, rb.dt_bias, idx, acc, wp_e,
               base_e, fl_e, wp_g, base_g, fl_g);
  cudaStream_t stream = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto step = [&](const StatePool& p, const Tensor& wp, const Tensor& base, const Tensor& fl) {
    ReplayVerifyArgs a =
        rv_on_pool(replay_verify_inputs(rb.args(m.views()), false), p, layer,
                   StateRounding::stochastic, m.view(idx), m.view(wp), m.view(base), m.view(fl));
    a.stream = stream;
    deltastate::replayssm_verify(a);
    deltastate::ReplayCommitArgs ca;
    ca.write_pos = m.view(wp);
    ca.cache_base = m.view(base);
    ca.is_flush = m.view(fl);
    ca.num_accepted = m.view(acc);
    ca.state_indices = m.view(idx);
    ca.max_cache_len = L;
    ca.max_spec_len = T;
    ca.stream = stream;
    deltastate::replayssm_commit(ca);
  };
  for (int i = 0; i < 4; ++i) step(eager, wp_e, base_e, fl_e);
  replay_graph(stream, 4, [&] { step(*q.dev, wp_g, base_g, fl_g); });
  EXPECT_NO_THROW(deltastate::check_errors());
  int64_t got = 0;
  CUDA_CHECK(cudaMemcpy(&got, q.dev->rounding_step(layer).data, 8, cudaMemcpyDeviceToHost));
  EXPECT_EQ(got, kStep0 + 4);
  for (const auto& [g, e] : {std::pair{&wp_g, &wp_e}, {&base_g, &base_e}, {&fl_g, &fl_e}})
    EXPECT_EQ(m.download(*g).values(), m.download(*e).values()) << "cursors";
  // slot 2 accepted 3 every step: folded at steps 2, 3 and 4 (write_pos 3 after each)
  EXPECT_EQ(m.download(wp_g).get_linear(2), 3);
  EXPECT_TRUE(same_device_bytes(q.dev->data(), eager.data(), q.bytes))
      << "graph replays against eager calls";
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

// Verify with FlashInfer's read-only source pool (a float pool: fp32 or bf16) on a formatted
// pool: sequence n from source row src[n] (< 0: padded), its final state stored through the
// format at state_indices[n] (< 0: not stored). Outputs, the stored slots within one quantum,
// every other byte untouched, the source bit-untouched, the step counter one on.
TEST_F(GpuTest, QuantizedVerifySourceStateMatchesCpu) {
  for (const DType pool_dtype : {DType::f8e4m3, DType::i8, DType::bf16})
    for (const DType src_dtype : {DType::f32, DType::bf16}) {
      SCOPED_TRACE(std::string(dtype_name(pool_dtype)) + " pool, " + dtype_name(src_dtype) +
                   " source");
      const Shape s = kOdd;
      const int64_t layer = 0, N0 = 5;
      Rng rng = test_rng();
      const StateRounding rounding =
          pool_dtype == DType::i8 ? StateRounding::nearest : StateRounding::stochastic;
      const QuantPools q =
          make_quant_pools(s, pool_dtype, rounding, deltastate::PoolLayout::per_layer, 1, 6,
                           blocks_of(layer, {0, 2}), rng, 0, false, ScaleFill::huge);
      Tensor src = Tensor::contiguous(src_dtype, {N0, s.HV, s.V, s.K});
      src.fill_normal(rng, 0.5);
      Tensor src_idx = index_tensor({4, -1, 1, 3}), home = index_tensor({5, 1, 3, -1});
      RecurrentBatch rb = make_recurrent_batch(rng, recurrent_spec(s, false, bf16, 4, 3));
      rb.poison_out();
      Mirror m;
      m.upload_all(rb.q, rb.k, rb.v, rb.g, rb.beta, rb.out, rb.A_log, rb.dt_bias, src, src_idx,
                   home);
      auto run = [&](auto&& view_of, const StatePool& p) {
        deltastate::VerifyArgs a = verify_inputs(rb.args(view_of), false);
        a.state = p.layer_state(layer);
        a.state_format = format_of(p, layer, rounding);
        a.state_indices = view_of(home);
        a.source_state = view_of(src);
        a.source_state_indices = view_of(src_idx);
        deltastate::verify(a);
      };
      run(host_view, *q.host);
      run(m.views(), *q.dev);
      sync();
      EXPECT_NO_THROW(deltastate::check_errors());
      EXPECT_TRUE(close_vs_cpu(m.download(rb.out).values(), rb.out.values(), kOutTol, bf16))
          << "outputs";
      const Tensor dsrc = m.download(src);
      EXPECT_EQ(
          std::memcmp(dsrc.alloc_base(), src.alloc_base(), static_cast<size_t>(src.alloc_bytes())),
          0)
          << "the source pool";
      if (q.stochastic) {
        EXPECT_EQ(host_step(q, layer), kStep0 + 1);
      }
      expect_pools_match(q, pool_dtype, blocks_of(layer, {5, 3}));
    }
}

}  // namespace
}  // namespace dstest
