// The CUDA backend against the CPU backend of the same library, on the same inputs (plain C++ over
// the CUDA runtime API). Every test skips when no CUDA device is present.
//
// Tolerances (those of SGLang's kernel tests): each op's GPU result is compared with the CPU
// result of the same call. Both backends compute in fp32 and round on store, so a value stored in
// bf16/fp16 may differ by one ulp where the two fp32 results straddle a rounding boundary: the
// comparisons add one ulp of the storage dtype (all_close(..., rounded = 2)) to the fp32
// tolerances (outputs 1e-4/1e-4, states 1e-5/1e-4). ReplaySSM runs 42 independent steps on each
// backend and uses SGLang's ReplaySSM-vs-ReplaySSM (Helion vs Triton) tolerances (outputs
// 5e-4/1e-2, checkpoint 4e-3/1e-2, d/k rings 2e-3/1e-2, g ring 1e-5/1e-4); its cursors, flush
// decisions and untouched memory must agree exactly.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <stdexcept>

#include "gpu/gpu_errors.h"
#include "gpu/gpu_util.h"
#include "test_util.h"

namespace dstest {
namespace {

using deltastate::PackedDecodeArgs;
using deltastate::RecurrentArgs;
using deltastate::ReplayDecodeArgs;

std::vector<MemRange> live_slot_ranges(const TensorView& pool, const std::vector<int64_t>& slots) {
  std::vector<MemRange> r;
  for (int64_t s : slots)
    if (s >= 0) r.push_back(slot_range(pool, s));
  return r;
}

// Outputs [B, 1, HV, V] row by row: padded rows exactly zero, live rows close to the CPU's.
void expect_rows_match(const DecodeBatch& cpu, const Tensor& gpu_out,
                       const std::vector<int64_t>& slots, Tol tol) {
  for (int64_t r = 0; r < cpu.B; ++r) {
    std::vector<double> g;
    for (int64_t hv = 0; hv < cpu.s.HV; ++hv)
      for (int64_t v = 0; v < cpu.s.V; ++v) g.push_back(gpu_out.get({r, 0, hv, v}));
    if (slots[r] < 0) {
      EXPECT_TRUE(all_zero(g)) << "padded row " << r;
    } else {
      EXPECT_TRUE(close_vs_cpu(g, cpu.out_row(r), tol, cpu.act)) << "output row " << r;
    }
  }
}

// Shapes beyond the model ones: HV=24, K=V=64, K != V both ways, K=96 (the masked generic kernel).
constexpr Shape kHV24{"hv24", 8, 24, 128, 128};
constexpr Shape kK64{"k64", 4, 8, 64, 64};
constexpr Shape kK128V64{"k128v64", 4, 8, 128, 64};
constexpr Shape kK64V128{"k64v128", 4, 8, 64, 128};
constexpr Shape kK96{"k96", 2, 4, 96, 80};
// V not a multiple of the streaming kernel's tile rows (32 fp32 / 64 bf16 at K=128, 64 / 128 at
// K=64): its last row block is partial and must be copied, computed and stored as such.
constexpr Shape kK128V80{"k128v80", 2, 4, 128, 80};
constexpr Shape kK64V40{"k64v40", 2, 2, 64, 40};
// ReplaySSM CTA shapes: a partial last row block (200 = 3*64 + 8 fp32 rows), 6-warp CTAs (V=48).
constexpr Shape kK128V200{"k128v200", 2, 4, 128, 200};
constexpr Shape kK128V48{"k128v48", 2, 4, 128, 48};
// K = 64 with two full 128-row blocks (fp32: 16 rows per warp): the two-block CTA at K = 64.
constexpr Shape kK64V256{"k64v256", 2, 4, 64, 256};

// ==== packed decode ============================================================================
struct PackedCase : OpCase {
  int64_t B;
  std::vector<int64_t> padded;
  int64_t slot_pad = 0, lead = 0;
};
void PrintTo(const PackedCase& c, std::ostream* os) { *os << c.name; }

class GpuPackedDecode : public GpuParamTest<PackedCase> {};

TEST_P(GpuPackedDecode, MatchesCpu) {
  const PackedCase& c = GetParam();
  Rng rng = test_rng();
  const int64_t num_slots = c.B + 4;
  Tensor pool = make_pool(c.state, num_slots, c.shape, c.slot_pad, c.lead);
  const std::vector<int64_t> slots = pick_slots(rng, c.B, num_slots, c.padded);
  fill_live_slots(pool.view(), slots, rng);
  DecodeBatch batch =
      make_decode_batch(rng, c.shape, c.kda, slots, c.act, 0, c.B % 2 ? DType::i64 : DType::i32);
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.shape.K));
  Mirror dev;
  for (int step = 0; step < 2; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    if (step) batch.randomize(rng);
    batch.poison_out();
    // Both backends start the call from the same pool (the CPU's).
    dev.upload_all(pool, batch.x, batch.a, batch.b, batch.A_log, batch.dt_bias, batch.idx,
                   batch.out);
    const Tensor before = dev.download(pool);

    PackedDecodeArgs cpu_args = batch.packed_args(host_view, pool.view(), scale, c.lower_bound);
    PackedDecodeArgs gpu_args =
        batch.packed_args(dev.views(), dev.view(pool), scale, c.lower_bound);
    if (c.kda) {
      deltastate::kda_packed_decode(cpu_args);
      deltastate::kda_packed_decode(gpu_args);
    } else {
      deltastate::gdn_packed_decode(cpu_args);
      deltastate::gdn_packed_decode(gpu_args);
    }
    sync();
    const Tensor out = dev.download(batch.out);
    const Tensor after = dev.download(pool);
    expect_rows_match(batch, out, slots, kOutTol);
    for (int64_t s : slots) {
      if (s < 0) continue;
      EXPECT_TRUE(close_vs_cpu(slot_values(after.view(), s), slot_values(pool.view(), s),
                               kFp32StateTol, c.state))
          << "state of slot " << s;
    }
    EXPECT_TRUE(Snapshot::equal_except(after.alloc_base(), before.alloc_base(), after.alloc_bytes(),
                                       live_slot_ranges(after.view(), slots)))
        << "GPU pool outside the live slots (sentinels, envelope gaps)";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cuda, GpuPackedDecode,
    ::testing::Values(
        PackedCase{"gdn_qwen_f32state_bf16act_B8", kQwen3Next, false, kNoLb, f32, bf16, 8, {3, 6}},
        PackedCase{"gdn_qwen_bf16state_bf16act_B1", kQwen3Next, false, kNoLb, bf16, bf16, 1, {}},
        PackedCase{"gdn_qwen_f16state_f16act_envelope",
                   kQwen3Next,
                   false,
                   kNoLb,
                   f16,
                   f16,
                   6,
                   {0},
                   8192,
                   512},
        PackedCase{
            "gdn_qwen_f32_unaligned_envelope", kQwen3Next, false, kNoLb, f32, f32, 5, {4}, 3, 1},
        PackedCase{
            "gdn_qwen_f32state_bf16act_B64", kQwen3Next, false, kNoLb, f32, bf16, 64, {0, 17, 63}},
        PackedCase{"kda_kimi_f32_lb_B8", kKimi, true, kLb, f32, f32, 8, {1}},
        PackedCase{"kda_kimi_bf16state_bf16act_B3", kKimi, true, kNoLb, bf16, bf16, 3, {2}},
        PackedCase{
            "kda_kimi_f32state_bf16act_envelope", kKimi, true, kNoLb, f32, bf16, 4, {}, 1024, 64},
        PackedCase{"gdn_hv24_f32state_bf16act", kHV24, false, kNoLb, f32, bf16, 6, {5}},
        PackedCase{"kda_k64_f32", kK64, true, kNoLb, f32, f32, 5, {2}},
        PackedCase{"gdn_k64_bf16state_unaligned", kK64, false, kNoLb, bf16, bf16, 4, {}, 5, 3},
        PackedCase{"gdn_k128v64_bf16state", kK128V64, false, kNoLb, bf16, bf16, 6, {0}},
        PackedCase{"kda_k64v128_f16state_lb", kK64V128, true, kLb, f16, bf16, 6, {3}},
        PackedCase{"gdn_k128v80_f32_partial_tile", kK128V80, false, kNoLb, f32, bf16, 7, {2}},
        PackedCase{"kda_k128v80_bf16state_partial_tile", kK128V80, true, kLb, bf16, bf16, 5, {0}},
        PackedCase{"gdn_k64v40_f32_partial_tile", kK64V40, false, kNoLb, f32, f32, 6, {5}},
        PackedCase{"gdn_k96_generic_f32", kK96, false, kNoLb, f32, f32, 5, {1}},
        PackedCase{"kda_k96_generic_bf16state_lb", kK96, true, kLb, bf16, f16, 4, {0}, 32, 16},
        PackedCase{"kda_odd_bf16state", kOdd, true, kNoLb, bf16, bf16, 6, {4}},
        PackedCase{"gdn_odd_f32", kOdd, false, kNoLb, f32, f32, 6, {1, 2}}),
    case_name<PackedCase>);

// ==== recurrent ================================================================================
enum class StateMode { pool, per_sequence, none };

struct RecCase {
  const char* name;
  RecurrentSpec spec;
  StateMode mode;
  DType state;
  std::vector<int64_t> padded;
  bool final_state = true;
  bool update_state = true;
  int64_t slot_pad = 0, lead = 0;
};
void PrintTo(const RecCase& c, std::ostream* os) { *os << c.name; }

class GpuRecurrent : public GpuParamTest<RecCase> {};

TEST_P(GpuRecurrent, MatchesCpu) {
  const RecCase& c = GetParam();
  Rng rng = test_rng();
  RecurrentBatch rb = make_recurrent_batch(rng, c.spec);
  const Shape& s = c.spec.s;
  const int64_t N = rb.N;
  Tensor pool, idx, final_state;
  std::vector<int64_t> slots;
  if (c.mode == StateMode::pool) {
    pool = make_pool(c.state, N + 3, s, c.slot_pad, c.lead);
    slots = pick_slots(rng, N, N + 3, c.padded);
    idx = index_tensor(slots, c.spec.index_dtype);
  } else if (c.mode == StateMode::per_sequence) {
    pool = make_pool(c.state, N, s, c.slot_pad, c.lead);
    for (int64_t n = 0; n < N; ++n) slots.push_back(n);
  }
  fill_live_slots(pool.view(), slots, rng);
  if (c.final_state) {
    final_state = Tensor::contiguous(c.state, {N, s.HV, s.V, s.K});
    final_state.fill_all(std::nan(""));
  }

  Mirror dev;
  dev.upload_all(rb.q, rb.k, rb.v, rb.g, rb.beta, rb.out, rb.A_log, rb.dt_bias);
  if (!c.spec.seqlens.empty()) dev.upload(rb.cu);
  auto build = [&](auto&& view_of, bool on_gpu) {
    RecurrentArgs a = rb.args(view_of);
    if (c.mode != StateMode::none) a.state = on_gpu ? dev.view(pool) : pool.view();
    if (c.mode == StateMode::pool) a.state_indices = view_of(idx);
    if (c.final_state) a.final_state = view_of(final_state);
    a.update_state = c.update_state && c.mode != StateMode::none;
    return a;
  };
  if (c.mode != StateMode::none) dev.upload(pool);
  if (c.mode == StateMode::pool) dev.upload(idx);
  if (c.final_state) dev.upload(final_state);
  const Tensor before = c.mode != StateMode::none ? dev.download(pool) : Tensor();

  RecurrentArgs cpu_args = build(host_view, false);
  RecurrentArgs gpu_args = build(dev.views(), true);
  if (c.spec.kda) {
    deltastate::recurrent_kda(cpu_args);
    deltastate::recurrent_kda(gpu_args);
  } else {
    deltastate::recurrent_gdn(cpu_args);
    deltastate::recurrent_gdn(gpu_args);
  }
  sync();

  const Tensor out = dev.download(rb.out);
  for (int64_t n = 0; n < N; ++n) {
    SCOPED_TRACE("sequence " + std::to_string(n));
    const bool padded = c.mode == StateMode::pool && slots[n] < 0;
    for (int64_t t = 0; t < rb.seq_len(n); ++t) {
      const auto [b, tok] = rb.coord(n, t);
      std::vector<double> g;
      for (int64_t hv = 0; hv < s.HV; ++hv)
        for (int64_t v = 0; v < s.V; ++v) g.push_back(out.get({b, tok, hv, v}));
      if (padded) {
        EXPECT_TRUE(all_zero(g)) << "token " << t;
      } else {
        EXPECT_TRUE(close_vs_cpu(g, rb.out_token(n, t), kOutTol, c.spec.act)) << "token " << t;
      }
    }
  }
  if (c.final_state) {
    const Tensor fs = dev.download(final_state);
    EXPECT_TRUE(close_vs_cpu(fs.values(), final_state.values(), kFp32StateTol, c.state))
        << "final_state";
  }
  if (c.mode != StateMode::none) {
    const Tensor after = dev.download(pool);
    for (int64_t sl : slots) {
      if (sl < 0) continue;
      EXPECT_TRUE(close_vs_cpu(slot_values(after.view(), sl), slot_values(pool.view(), sl),
                               kFp32StateTol, c.state))
          << "state of slot " << sl;
    }
    const std::vector<MemRange> may_change =
        cpu_args.update_state ? live_slot_ranges(after.view(), slots) : std::vector<MemRange>{};
    EXPECT_TRUE(Snapshot::equal_except(after.alloc_base(), before.alloc_base(), after.alloc_bytes(),
                                       may_change))
        << "GPU pool outside the written slots";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cuda, GpuRecurrent,
    ::testing::Values(RecCase{"gdn_qwen_varlen_packedqkv_bf16act",
                              with(recurrent_spec(kQwen3Next, false, bf16, 1, 1, {3, 0, 5, 1, 2}),
                                   [](RecurrentSpec& r) { r.packed_qkv = true; }),
                              StateMode::pool,
                              f32,
                              {1}},
                      RecCase{"kda_kimi_varlen_lb_bf16state_envelope",
                              with(recurrent_spec(kKimi, true, bf16, 1, 1, {2, 4, 1}),
                                   [](RecurrentSpec& r) { r.lower_bound = -5.0; }),
                              StateMode::pool,
                              bf16,
                              {},
                              true,
                              true,
                              64,
                              32},
                      RecCase{"gdn_hv24_per_sequence_T3_f16state",
                              recurrent_spec(kHV24, false, f16, 3, 3),
                              StateMode::per_sequence,
                              f16,
                              {}},
                      RecCase{"kda_k64v128_no_state",
                              recurrent_spec(kK64V128, true, bf16, 2, 4),
                              StateMode::none,
                              bf16,
                              {},
                              true,
                              false},
                      RecCase{"gdn_k96_logg_betaprob_T4",
                              with(recurrent_spec(kK96, false, f32, 3, 4),
                                   [](RecurrentSpec& r) {
                                     r.gate_in_kernel = false;
                                     r.beta_is_logit = false;
                                   }),
                              StateMode::pool,
                              f32,
                              {2}},
                      RecCase{"kda_k128v64_i64_T2",
                              with(recurrent_spec(kK128V64, true, f32, 4, 2),
                                   [](RecurrentSpec& r) { r.index_dtype = DType::i64; }),
                              StateMode::pool,
                              f32,
                              {0}},
                      RecCase{"gdn_k64_no_update",
                              recurrent_spec(kK64, false, f32, 3, 3),
                              StateMode::pool,
                              bf16,
                              {},
                              true,
                              false},
                      RecCase{"kda_odd_varlen_dt2d",
                              with(recurrent_spec(kOdd, true, f16, 1, 1, {1, 3, 2}),
                                   [](RecurrentSpec& r) { r.dt_bias_2d = true; }),
                              StateMode::pool,
                              f32,
                              {1},
                              true,
                              true,
                              16,
                              8}),
    case_name<RecCase>);

// ==== ReplaySSM ================================================================================

class GpuReplay : public GpuParamTest<ReplayCase> {};

// 42 steps on each backend from the same start: mixed flush / non-flush rows (staggered cursors,
// random forced flushes), a padded row, advance_write_pos on the device.
TEST_P(GpuReplay, FortyTwoStepsMatchCpu) {
  const ReplayCase& c = GetParam();
  Rng rng = test_rng();
  const int64_t B = 6, num_slots = 9;
  const std::vector<int64_t> slots = pick_slots(rng, B, num_slots, {2});
  Tensor pool = make_pool(c.state, num_slots, c.shape, c.slot_pad, c.lead);
  fill_live_slots(pool.view(), slots, rng);
  Rings rings = make_rings(c.shape, c.kda, num_slots, c.L, c.state, c.act);
  DecodeBatch batch = make_decode_batch(rng, c.shape, c.kda, slots, c.act);
  std::vector<int64_t> cursor(B, 0);
  cursor[2] = c.L > 1 ? 1 : 0;  // the padded row's cursor never moves
  Tensor wp = index_tensor(cursor, DType::i32);
  Tensor ff = index_tensor(std::vector<int64_t>(B, 0), DType::i32);
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.shape.K));

  Mirror dev;
  dev.upload_all(pool, rings.d, rings.k, rings.g, wp, batch.A_log, batch.dt_bias, batch.idx);
  int flushes = 0, appends = 0;
  int64_t max_cursor = 0;
  for (int step = 0; step < c.steps; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    if (step) batch.randomize(rng);
    batch.poison_out();
    for (int64_t r = 0; r < B; ++r)
      ff.set_linear(r, c.L > 1 && (step < r || rng.chance(forced_flush_rate(c.L))) ? 1 : 0);
    dev.upload_all(batch.x, batch.a, batch.b, batch.out, ff);
    const Tensor ckpt_before = dev.download(pool);
    const std::vector<int64_t> cursors_before = index_values(wp);

    ReplayDecodeArgs cpu_args =
        replay_args(host_view, batch, pool.view(), rings.d.view(), rings.k.view(), rings.g.view(),
                    wp, &ff, scale, c.lower_bound);
    ReplayDecodeArgs gpu_args =
        replay_args(dev.views(), batch, dev.view(pool), dev.view(rings.d), dev.view(rings.k),
                    dev.view(rings.g), wp, &ff, scale, c.lower_bound);
    cpu_args.advance_write_pos = gpu_args.advance_write_pos = true;
    deltastate::replayssm_decode(cpu_args);
    deltastate::replayssm_decode(gpu_args);
    sync();

    expect_rows_match(batch, dev.download(batch.out), slots, {5e-4, 1e-2});
    // Cursors: the device advanced them exactly like the CPU, by the caller's rule.
    const std::vector<int64_t> gpu_wp = index_values(dev.download(wp));
    EXPECT_EQ(gpu_wp, index_values(wp)) << "write_pos after the step (GPU vs CPU)";
    std::vector<MemRange> flushed;
    const Tensor ckpt = dev.download(pool);
    for (int64_t r = 0; r < B; ++r) {
      const int64_t m = cursors_before[r];
      if (slots[r] >= 0) max_cursor = std::max(max_cursor, m);
      const bool flush = m == c.L - 1 || ff.get_linear(r) != 0;
      const int64_t expected = slots[r] < 0 ? m : (flush ? 0 : m + 1);
      EXPECT_EQ(gpu_wp[r], expected) << "row " << r;
      if (slots[r] < 0) continue;
      (flush ? flushes : appends)++;
      if (flush) flushed.push_back(slot_range(ckpt.view(), slots[r]));
    }
    // The checkpoint changes only in the slots of flushing rows (bit-unchanged otherwise).
    EXPECT_TRUE(Snapshot::equal_except(ckpt.alloc_base(), ckpt_before.alloc_base(),
                                       ckpt.alloc_bytes(), flushed))
        << "GPU checkpoint pool outside the flushed slots";
    for (int64_t s : slots) {
      if (s < 0) continue;
      EXPECT_TRUE(close_vs_cpu(slot_values(ckpt.view(), s), slot_values(pool.view(), s),
                               {4e-3, 1e-2}, c.state))
          << "checkpoint of slot " << s;
    }
    EXPECT_TRUE(
        close_vs_cpu(dev.download(rings.d).values(), rings.d.values(), {2e-3, 1e-2}, c.state))
        << "d ring";
    EXPECT_TRUE(close_vs_cpu(dev.download(rings.k).values(), rings.k.values(), {2e-3, 1e-2}, c.act))
        << "k ring";
    EXPECT_TRUE(close_vs_cpu(dev.download(rings.g).values(), rings.g.values(), {1e-5, 1e-4}, f32))
        << "g ring";
    if (::testing::Test::HasFailure()) break;
  }
  EXPECT_GT(flushes, 0);
  if (c.L > 1) {
    EXPECT_GT(appends, 0);
  }
  if (c.L > 32) {
    EXPECT_GT(max_cursor, 32) << "no row read more than 32 ring records";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cuda, GpuReplay,
    ::testing::Values(
        ReplayCase{"gdn_qwen_f32_L1", kQwen3Next, false, kNoLb, f32, f32, 1},
        ReplayCase{"gdn_qwen_f32_bf16act_L4_envelope", kQwen3Next, false, kNoLb, f32, bf16, 4, 42,
                   4096, 256},
        ReplayCase{"gdn_qwen_bf16ckpt_bf16act_L8", kQwen3Next, false, kNoLb, bf16, bf16, 8},
        // the longest ring the one-warp kernel takes (its coefficients from 16 records)
        ReplayCase{"gdn_qwen_bf16ckpt_bf16act_L16", kQwen3Next, false, kNoLb, bf16, bf16, 16},
        ReplayCase{"gdn_qwen_f32_bf16act_L16", kQwen3Next, false, kNoLb, f32, bf16, 16},
        ReplayCase{"kda_kimi_f32_lb_L4", kKimi, true, kLb, f32, f32, 4},
        ReplayCase{"kda_kimi_bf16ckpt_bf16act_L16_envelope", kKimi, true, kNoLb, bf16, bf16, 16, 42,
                   1000, 24},
        ReplayCase{"kda_kimi_f32_bf16act_L8", kKimi, true, kNoLb, f32, bf16, 8},
        ReplayCase{"gdn_k96_generic_f32_L8", kK96, false, kNoLb, f32, f32, 8},
        ReplayCase{"kda_k64v128_bf16ckpt_L4_lb", kK64V128, true, kLb, bf16, bf16, 4},
        ReplayCase{"gdn_hv24_f32_bf16act_L16", kHV24, false, kNoLb, f32, bf16, 16, 42, 64, 16},
        ReplayCase{"kda_k128v64_f32_L1", kK128V64, true, kNoLb, f32, f16, 1},
        // more records than lanes per row (L > G, L > 32), a partial row block,
        // CTAs of 6 warps
        ReplayCase{"gdn_k128v200_f32_bf16act_L40", kK128V200, false, kNoLb, f32, bf16, 40},
        ReplayCase{"kda_k64v128_bf16ckpt_bf16act_L16", kK64V128, true, kNoLb, bf16, bf16, 16},
        ReplayCase{"kda_k128v48_f32_L8", kK128V48, true, kLb, f32, f32, 8},
        ReplayCase{"gdn_k64v256_f32_bf16act_L8", kK64V256, false, kNoLb, f32, bf16, 8}),
    case_name<ReplayCase>);

// ==== ReplaySSM ring modes (SGLang's circular / prefix-gate / pre-decayed rings) ===============
// The generic modes kernel (src/cuda/replayssm/modes.cuh) against the CPU backend over 3L + 4
// steps: rows at different cache_base values, history checkpoints at natural flushes, forced
// folds, a padded row; the caller advances write_pos and cache_base (SGLang's protocol) and
// uploads them to both backends.
struct ReplayModeCase {
  const char* name;
  Shape shape;
  bool kda;
  std::optional<double> lower_bound;
  DType state, act, ring;
  int L;
  bool circular, prefix, predecay;
};
inline void PrintTo(const ReplayModeCase& c, std::ostream* os) { *os << c.name; }

class GpuReplayModes : public GpuParamTest<ReplayModeCase> {};

TEST_P(GpuReplayModes, StepsMatchCpu) {
  const ReplayModeCase& c = GetParam();
  Rng rng = test_rng();
  const int64_t B = 5, num_slots = 8;
  const std::vector<int64_t> slots = pick_slots(rng, B, num_slots, {2});
  Tensor pool = make_pool(c.state, num_slots, c.shape);
  fill_live_slots(pool.view(), slots, rng);
  Rings rings = make_rings(c.shape, c.kda, num_slots, c.L, c.ring, c.ring);
  DecodeBatch batch = make_decode_batch(rng, c.shape, c.kda, slots, c.act);
  std::vector<int64_t> wp(B, 0), base(B, 0);
  for (int64_t r = 0; r < B; ++r) base[r] = c.circular ? (r * 3) % c.L : 0;
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.shape.K));
  Mirror dev;
  dev.upload_all(pool, rings.d, rings.k, rings.g, batch.A_log, batch.dt_bias, batch.idx);
  int histories = 0;
  for (int step = 0; step < 3 * c.L + 4; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    if (step) batch.randomize(rng);
    batch.poison_out();
    std::vector<int64_t> force(B, 0);
    for (int64_t r = 0; r < B; ++r) force[r] = rng.chance(0.1) ? 1 : 0;
    Tensor wpt = index_tensor(wp, DType::i32), ff = index_tensor(force, DType::i32);
    Tensor cb = index_tensor(base, DType::i32);
    dev.upload_all(batch.x, batch.a, batch.b, batch.out, wpt, ff, cb);
    ReplayDecodeArgs cpu_args =
        replay_args(host_view, batch, pool.view(), rings.d.view(), rings.k.view(), rings.g.view(),
                    wpt, &ff, scale, c.lower_bound);
    ReplayDecodeArgs gpu_args =
        replay_args(dev.views(), batch, dev.view(pool), dev.view(rings.d), dev.view(rings.k),
                    dev.view(rings.g), wpt, &ff, scale, c.lower_bound);
    cpu_args.cache_base = cb.view();
    gpu_args.cache_base = dev.view(cb);
    const bool advance = step % 2 == 1;  // the device cursor advance on every other step
    for (ReplayDecodeArgs* a : {&cpu_args, &gpu_args}) {
      a->circular_replay = c.circular;
      a->prefix_gate_cache = c.prefix;
      a->predecayed_k_cache = c.predecay;
      a->advance_write_pos = advance;
    }
    deltastate::replayssm_decode(cpu_args);
    deltastate::replayssm_decode(gpu_args);
    sync();
    deltastate::check_errors();
    expect_rows_match(batch, dev.download(batch.out), slots, {5e-4, 1e-2});
    const Tensor ckpt = dev.download(pool);
    for (int64_t s : slots) {
      if (s < 0) continue;
      EXPECT_TRUE(close_vs_cpu(slot_values(ckpt.view(), s), slot_values(pool.view(), s),
                               {4e-3, 1e-2}, c.state))
          << "checkpoint of slot " << s;
    }
    EXPECT_TRUE(
        close_vs_cpu(dev.download(rings.d).values(), rings.d.values(), {2e-3, 1e-2}, c.ring))
        << "d ring";
    EXPECT_TRUE(
        close_vs_cpu(dev.download(rings.k).values(), rings.k.values(), {2e-3, 1e-2}, c.ring))
        << "k ring";
    EXPECT_TRUE(close_vs_cpu(dev.download(rings.g).values(), rings.g.values(), {1e-5, 1e-4}, f32))
        << "g ring";
    // The caller's protocol; without the advance the kernels move no cursor.
    const std::vector<int64_t> gpu_wp = index_values(dev.download(wpt)),
                               gpu_base = index_values(dev.download(cb));
    if (!advance) {
      EXPECT_EQ(gpu_wp, wp);
      EXPECT_EQ(gpu_base, base);
    }
    for (int64_t r = 0; r < B; ++r) {
      if (slots[r] < 0) continue;
      const bool natural = wp[r] == c.L - 1;
      if (c.circular && force[r]) {
        wp[r] = base[r] = 0;
      } else if (c.circular && natural && c.L > 1) {
        base[r] = (base[r] + wp[r]) % c.L;
        wp[r] = 1;
        ++histories;
      } else {
        wp[r] = (natural || force[r]) ? 0 : wp[r] + 1;
      }
    }
    if (advance) {  // the device moved them by the same rule as the CPU backend
      EXPECT_EQ(gpu_wp, wp);
      EXPECT_EQ(index_values(wpt), wp);
      EXPECT_EQ(gpu_base, base);
      EXPECT_EQ(index_values(cb), base);
    }
    if (::testing::Test::HasFailure()) break;
  }
  if (c.circular && c.L > 1) {
    EXPECT_GT(histories, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cuda, GpuReplayModes,
    ::testing::Values(ReplayModeCase{"gdn_qwen_circular_f32_L8", kQwen3Next, false, kNoLb, f32,
                                     bf16, f32, 8, true, false, false},
                      ReplayModeCase{"gdn_qwen_circular_bf16ckpt_L4", kQwen3Next, false, kNoLb,
                                     bf16, bf16, bf16, 4, true, false, false},
                      ReplayModeCase{"kda_kimi_prefix_f32_L4", kKimi, true, kLb, f32, f32, f32, 4,
                                     false, true, false},
                      ReplayModeCase{"kda_kimi_circular_prefix_L5", kKimi, true, kNoLb, f32, bf16,
                                     f32, 5, true, true, false},
                      ReplayModeCase{"kda_kimi_predecay_bf16ring_L16", kKimi, true, kLb, f32, bf16,
                                     bf16, 16, true, true, true}),
    [](const ::testing::TestParamInfo<ReplayModeCase>& i) { return std::string(i.param.name); });

// ==== a pool of more than 4096 slots ===========================================================
// 4100 fp32 Qwen3-Next slots (2 MiB each, 8.6 GB): slot * slot_stride passes 2^31 elements at slot
// 4096, so 32-bit offsets would wrap. Live rows use slots at the end of the pool (and one below
// 4096); the CPU runs the same rows on a small pool of just those slots. Everything else in the
// big pool is a 0x7f byte pattern that must survive every op.
TEST_F(GpuTest, PoolOfMoreThan4096Slots) {
  const Shape s = kQwen3Next;
  const int64_t slots = 4100;
  const int64_t elems = s.state_elems();
  const PatternedDevicePool pool(slots, static_cast<size_t>(elems * 4));
  if (!pool.ok()) GTEST_SKIP() << "needs ~" << (pool.bytes() >> 20) << " MiB of device memory";
  void* const big = pool.slot(0);
  const TensorView big_pool =
      TensorView::contiguous(big, f32, {slots, s.HV, s.V, s.K}, Device::cuda(0));

  Rng rng = test_rng();
  const std::vector<int64_t> big_slots{4099, -1, 4096, 4097, 2049, 4095};
  std::vector<int64_t> small_slots;  // the same rows on a small CPU pool
  for (size_t r = 0; r < big_slots.size(); ++r)
    small_slots.push_back(big_slots[r] < 0 ? -1 : static_cast<int64_t>(r));
  Tensor small = make_pool(f32, static_cast<int64_t>(big_slots.size()), s);
  fill_live_slots(small.view(), small_slots, rng);
  auto push_states = [&] {  // CPU states -> their big-pool slots
    for (size_t r = 0; r < big_slots.size(); ++r)
      if (big_slots[r] >= 0)
        CUDA_CHECK(
            cudaMemcpy(static_cast<float*>(big) + big_slots[r] * elems,
                       static_cast<const char*>(small.view().data) + small_slots[r] * elems * 4,
                       static_cast<size_t>(elems * 4), cudaMemcpyHostToDevice));
  };
  auto expect_states_match = [&](Tol tol, const char* what) {
    std::vector<float> host(static_cast<size_t>(elems));
    for (size_t r = 0; r < big_slots.size(); ++r) {
      if (big_slots[r] < 0) continue;
      CUDA_CHECK(cudaMemcpy(host.data(), static_cast<float*>(big) + big_slots[r] * elems,
                            static_cast<size_t>(elems * 4), cudaMemcpyDeviceToHost));
      EXPECT_TRUE(close_vs_cpu(std::vector<double>(host.begin(), host.end()),
                               slot_values(small.view(), small_slots[r]), tol, f32))
          << what << ": slot " << big_slots[r];
    }
  };

  Mirror dev;
  // Packed decode, GDN and KDA.
  for (bool kda : {false, true}) {
    SCOPED_TRACE(kda ? "kda_packed_decode" : "gdn_packed_decode");
    DecodeBatch cpu = make_decode_batch(rng, s, kda, small_slots, bf16);
    DecodeBatch gpu = cpu;  // shares cpu's input tensors; only the indices differ (big-pool slots)
    gpu.idx = index_tensor(big_slots);
    push_states();
    dev.upload_all(cpu.x, cpu.a, cpu.b, cpu.A_log, cpu.dt_bias, cpu.out, gpu.idx);
    PackedDecodeArgs ca = cpu.packed_args(host_view, small.view(), 0.0883883);
    PackedDecodeArgs ga = gpu.packed_args(dev.views(), big_pool, 0.0883883);
    if (kda) {
      deltastate::kda_packed_decode(ca);
      deltastate::kda_packed_decode(ga);
    } else {
      deltastate::gdn_packed_decode(ca);
      deltastate::gdn_packed_decode(ga);
    }
    sync();
    expect_rows_match(cpu, dev.download(cpu.out), small_slots, kOutTol);
    expect_states_match(kFp32StateTol, "packed decode");
  }
  // Recurrent, varlen, both gates.
  for (bool kda : {false, true}) {
    SCOPED_TRACE(kda ? "recurrent_kda" : "recurrent_gdn");
    RecurrentBatch rb =
        make_recurrent_batch(rng, recurrent_spec(s, kda, bf16, 1, 1, {2, 1, 3, 1, 2, 1}));
    Tensor cidx = index_tensor(small_slots), gidx = index_tensor(big_slots);
    push_states();
    dev.upload_all(rb.q, rb.k, rb.v, rb.g, rb.beta, rb.out, rb.A_log, rb.dt_bias, rb.cu, gidx);
    RecurrentArgs ca = rb.args(host_view), ga = rb.args(dev.views());
    ca.state = small.view();
    ca.state_indices = cidx.view();
    ga.state = big_pool;
    ga.state_indices = dev.view(gidx);
    if (kda) {
      deltastate::recurrent_kda(ca);
      deltastate::recurrent_kda(ga);
    } else {
      deltastate::recurrent_gdn(ca);
      deltastate::recurrent_gdn(ga);
    }
    sync();
    const Tensor out = dev.download(rb.out);
    EXPECT_TRUE(close_vs_cpu(out.values(), rb.out.values(), kOutTol, bf16)) << "outputs";
    expect_states_match(kFp32StateTol, "recurrent");
  }
  // ReplaySSM: rings of 4100 slots too, 6 steps with a forced flush and natural flushes (L = 4).
  {
    SCOPED_TRACE("replayssm_decode");
    const int L = 4;
    Rings small_rings = make_rings(s, false, static_cast<int64_t>(big_slots.size()), L, f32, bf16);
    Rings big_rings = make_rings(s, false, slots, L, f32, bf16);
    DecodeBatch cpu = make_decode_batch(rng, s, false, small_slots, bf16);
    DecodeBatch gpu = cpu;
    gpu.idx = index_tensor(big_slots);
    Tensor wp_c = index_tensor(std::vector<int64_t>(big_slots.size(), 0));
    Tensor wp_g = index_tensor(std::vector<int64_t>(big_slots.size(), 0));
    Tensor ff = index_tensor(std::vector<int64_t>(big_slots.size(), 0));
    push_states();
    dev.upload_all(big_rings.d, big_rings.k, big_rings.g, wp_g, cpu.A_log, cpu.dt_bias, gpu.idx);
    for (int step = 0; step < 6; ++step) {
      SCOPED_TRACE("step " + std::to_string(step));
      if (step) cpu.randomize(rng);
      ff.set_linear(0, step == 1);
      dev.upload_all(cpu.x, cpu.a, cpu.b, ff);
      ReplayDecodeArgs ca =
          replay_args(host_view, cpu, small.view(), small_rings.d.view(), small_rings.k.view(),
                      small_rings.g.view(), wp_c, &ff, 0.0883883);
      ReplayDecodeArgs ga =
          replay_args(dev.views(), gpu, big_pool, dev.view(big_rings.d), dev.view(big_rings.k),
                      dev.view(big_rings.g), wp_g, &ff, 0.0883883);
      ca.advance_write_pos = ga.advance_write_pos = true;
      deltastate::replayssm_decode(ca);
      deltastate::replayssm_decode(ga);
      sync();
      expect_rows_match(cpu, dev.download(cpu.out), small_slots, {5e-4, 1e-2});
      EXPECT_EQ(index_values(dev.download(wp_g)), index_values(wp_c)) << "cursors";
      expect_states_match({4e-3, 1e-2}, "replayssm checkpoint");
    }
  }
  // Every byte outside the live slots still holds the pattern.
  EXPECT_EQ(pool.changed_words(big_slots), 0)
      << "8-byte words outside the live slots of the 4100-slot pool changed";
}

// ==== StatePool on the device ==================================================================
// A CUDA StatePool (envelope, rings) mirrors a CPU StatePool byte for byte through allocate (device
// zeroing), cursors, fork (2-D device copies) and free; then packed decode on an envelope layer and
// ReplaySSM on its rings, with the pool's own per-slot cursors as write_pos (rows = slots 0..4),
// advanced on the device.
TEST_F(GpuTest, StatePoolOnDevice) {
  deltastate::StatePoolConfig cfg = envelope_config(kOdd, 2, 5, f32, 300);
  cfg.replay_len = 4;
  cfg.ring_k_dtype = bf16;
  deltastate::StatePool host(cfg);
  cfg.device = Device::cuda(0);
  deltastate::StatePool dev_pool(cfg);
  const int64_t bytes = dev_pool.total_bytes();
  ASSERT_EQ(bytes, host.total_bytes());
  auto device_bytes = [&] {
    std::vector<uint8_t> b(static_cast<size_t>(bytes));
    CUDA_CHECK(cudaMemcpy(b.data(), dev_pool.data(), b.size(), cudaMemcpyDeviceToHost));
    return b;
  };
  auto expect_same_memory = [&](const char* what) {
    EXPECT_EQ(std::memcmp(device_bytes().data(), host.data(), static_cast<size_t>(bytes)), 0)
        << what;
  };
  expect_same_memory("a new pool is zeroed");

  Rng rng = test_rng();
  fill_sentinel(host.data(), bytes, f32);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(host.allocate(), i);
    EXPECT_EQ(dev_pool.allocate(), i);
  }
  for (int64_t l = 0; l < 2; ++l) {
    for (int64_t sl = 0; sl < 5; ++sl) fill_slot(host.layer_state(l), sl, rng);
    // slot 3's ring records (its cursor is 2 below: two pending records for the fork to rebuild;
    // sentinel records would rebuild NaNs)
    fill_slot(host.d_cache(l), 3, rng);
    fill_slot(host.k_cache(l), 3, rng);
    fill_slot(host.g_cache(l), 3, rng, -0.5, 0.0);
  }
  CUDA_CHECK(
      cudaMemcpy(dev_pool.data(), host.data(), static_cast<size_t>(bytes), cudaMemcpyHostToDevice));
  for (int64_t sl = 0; sl < 4; ++sl) {
    host.set_cursor(sl, 0);
    dev_pool.set_cursor(sl, 0);
  }
  dev_pool.set_cursor(3, 2);
  host.set_cursor(3, 2);
  EXPECT_EQ(dev_pool.cursor(3), 2);
  // fork from an unflushed source: its two pending records rebuilt into dst on both backends
  // (the rebuild's fp32 sums in other orders: dst's states within fp32 tolerance, every other
  // byte equal); then the device takes the host's bytes, and a fork of a flushed source is a
  // device copy of every layer.
  host.fork(3, 1);
  dev_pool.fork(3, 1);
  sync();
  {
    const std::vector<uint8_t> d = device_bytes();
    std::vector<MemRange> dst_rows;
    for (int64_t l = 0; l < 2; ++l) {
      const TensorView h = host.layer_state(l);
      TensorView g = h;
      g.data = const_cast<uint8_t*>(d.data()) +
               (static_cast<const char*>(h.data) - static_cast<const char*>(host.data()));
      EXPECT_TRUE(close_vs_cpu(slot_values(g, 1), slot_values(h, 1), kFp32StateTol, f32))
          << "fork of an unflushed source, layer " << l;
      dst_rows.push_back(slot_range(g, 1));
    }
    EXPECT_TRUE(Snapshot::equal_except(d.data(), host.data(), bytes, dst_rows));
    EXPECT_EQ(dev_pool.cursor(1), host.cursor(1));
  }
  CUDA_CHECK(
      cudaMemcpy(dev_pool.data(), host.data(), static_cast<size_t>(bytes), cudaMemcpyHostToDevice));
  host.fork(0, 2);
  dev_pool.fork(0, 2);
  sync();
  expect_same_memory("after fork");
  // free + allocate zeroes the slot's entry on the device.
  host.free(1);
  dev_pool.free(1);
  EXPECT_EQ(host.allocate(), 1);
  EXPECT_EQ(dev_pool.allocate(), 1);
  sync();
  expect_same_memory("after re-allocating slot 1");
  EXPECT_EQ(dev_pool.cursor(1), 0);
  EXPECT_TRUE(all_zero(slot_values(host.layer_state(0), 1)));

  // Packed decode on layer 1 (rows: slots 2, padded, 0).
  {
    DecodeBatch batch = make_decode_batch(rng, kOdd, false, {2, -1, 0}, bf16);
    Mirror m;
    m.upload_all(batch.x, batch.a, batch.b, batch.A_log, batch.dt_bias, batch.idx, batch.out);
    deltastate::gdn_packed_decode(batch.packed_args(host_view, host.layer_state(1), 0.2));
    deltastate::gdn_packed_decode(batch.packed_args(m.views(), dev_pool.layer_state(1), 0.2));
    sync();
    expect_rows_match(batch, m.download(batch.out), {2, -1, 0}, kOutTol);
    const std::vector<uint8_t> d = device_bytes();
    const TensorView dev_layer = TensorView::strided(
        const_cast<uint8_t*>(d.data()) + (static_cast<const char*>(dev_pool.layer_state(1).data) -
                                          static_cast<const char*>(dev_pool.data())),
        f32, {5, kOdd.HV, kOdd.V, kOdd.K},
        {host.layer_state(1).stride[0], kOdd.V * kOdd.K, kOdd.K, 1});
    for (int64_t sl : {2, 0})
      EXPECT_TRUE(close_vs_cpu(slot_values(dev_layer, sl), slot_values(host.layer_state(1), sl),
                               kFp32StateTol, f32))
          << "slot " << sl;
    EXPECT_TRUE(
        Snapshot::equal_except(d.data(), host.data(), bytes, live_slot_ranges(dev_layer, {2, 0})))
        << "device pool outside the live slots";
    CUDA_CHECK(cudaMemcpy(dev_pool.data(), host.data(), static_cast<size_t>(bytes),
                          cudaMemcpyHostToDevice));
  }
  // ReplaySSM on layer 0 with the pool's rings and cursors (all 5 slots; slot 4 is never
  // allocated, which the op does not care about).
  for (int64_t sl = 0; sl < 5; ++sl) {
    host.set_cursor(sl, 0);
    dev_pool.set_cursor(sl, 0);
  }
  DecodeBatch batch = make_decode_batch(rng, kOdd, false, {0, 1, 2, 3, 4}, bf16);
  Tensor ff = index_tensor({0, 0, 0, 0, 0});
  Mirror m;
  m.upload_all(batch.A_log, batch.dt_bias, batch.idx);
  for (int step = 0; step < 7; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    if (step) batch.randomize(rng);
    ff.set_linear(1, step == 2);
    m.upload_all(batch.x, batch.a, batch.b, batch.out, ff);
    ReplayDecodeArgs ha, da;
    auto fill = [&](ReplayDecodeArgs& a, const deltastate::StatePool& p, auto&& view_of) {
      a.mixed_qkv = view_of(batch.x);
      a.a = view_of(batch.a);
      a.b = view_of(batch.b);
      a.A_log = view_of(batch.A_log);
      a.dt_bias = view_of(batch.dt_bias);
      a.scale = 0.2;
      a.state = p.layer_state(0);
      a.d_cache = p.d_cache(0);
      a.k_cache = p.k_cache(0);
      a.g_cache = p.g_cache(0);
      a.out = view_of(batch.out);
      a.state_indices = view_of(batch.idx);
      a.write_pos = p.write_pos();
      a.force_flush = view_of(ff);
      a.advance_write_pos = true;
    };
    fill(ha, host, host_view);
    fill(da, dev_pool, m.views());
    deltastate::replayssm_decode(ha);
    deltastate::replayssm_decode(da);
    sync();
    expect_rows_match(batch, m.download(batch.out), {0, 1, 2, 3, 4}, {5e-4, 1e-2});
    for (int64_t sl = 0; sl < 5; ++sl)
      EXPECT_EQ(dev_pool.cursor(sl), host.cursor(sl)) << "slot " << sl;
    EXPECT_EQ(host.cursor(0), (step + 1) % 4);
  }
}

// ==== CUDA graphs ==============================================================================
// A non-blocking stream for the scope.
struct ScopedStream {
  cudaStream_t s = nullptr;
  ScopedStream() { CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); }
  ~ScopedStream() { EXPECT_EQ(cudaStreamDestroy(s), cudaSuccess); }
  ScopedStream(const ScopedStream&) = delete;
  ScopedStream& operator=(const ScopedStream&) = delete;
};

// What `record` launches on `stream`, captured into an instantiated graph, for the scope.
class CapturedGraph {
 public:
  template <class Record>
  CapturedGraph(cudaStream_t stream, Record&& record) {
    CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    record();
    CUDA_CHECK(cudaStreamEndCapture(stream, &graph_));
    CUDA_CHECK(cudaGraphInstantiate(&exec_, graph_, 0));
  }
  ~CapturedGraph() {
    EXPECT_EQ(cudaGraphExecDestroy(exec_), cudaSuccess);
    EXPECT_EQ(cudaGraphDestroy(graph_), cudaSuccess);
  }
  CapturedGraph(const CapturedGraph&) = delete;
  CapturedGraph& operator=(const CapturedGraph&) = delete;
  void launch(cudaStream_t stream) { CUDA_CHECK(cudaGraphLaunch(exec_, stream)); }

 private:
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

// One dependent decode step on a mirror's copies of a batch, its pool and rings: GDN or KDA
// packed decode, or a ReplaySSM step with the cursor advanced on the device; on stream `st`,
// launched with or without PDL (the graph and PDL tests below).
struct MirroredStep {
  const DecodeBatch& batch;
  const Tensor& pool;
  const Rings& rings;
  const Tensor& wp;
  const Tensor* ff;  // ReplaySSM's force_flush, or null
  double scale;
  bool replay, kda;
  void operator()(Mirror& m, cudaStream_t st, bool pdl = false) const {
    if (replay) {
      ReplayDecodeArgs a = replay_args(m.views(), batch, m.view(pool), m.view(rings.d),
                                       m.view(rings.k), m.view(rings.g), wp, ff, scale);
      a.advance_write_pos = true;
      a.stream = st;
      a.pdl = pdl;
      deltastate::replayssm_decode(a);
    } else {
      PackedDecodeArgs a = batch.packed_args(m.views(), m.view(pool), scale);
      a.stream = st;
      a.pdl = pdl;
      if (kda) deltastate::kda_packed_decode(a);
      else deltastate::gdn_packed_decode(a);
    }
  }
};

// One packed-decode step and one ReplaySSM step (cursor advance on the device) are captured on a
// non-default stream, then replayed with new inputs copied into the captured buffers; each replay
// must give bit-identical results to the same op run eagerly on a second copy of the buffers.
TEST_F(GpuTest, CudaGraphReplayMatchesEager) {
  const Shape s = kQwen3Next;
  Rng rng = test_rng();
  const std::vector<int64_t> slots{5, 0, -1, 7, 2, 9, 4, 1};
  Tensor pool = make_pool(f32, 10, s, 256, 64);
  fill_live_slots(pool.view(), slots, rng);
  const double scale = 1.0 / std::sqrt(128.0);
  const ScopedStream scoped_stream;
  cudaStream_t stream = scoped_stream.s;

  for (int which = 0; which < 2; ++which) {
    const bool replay = which == 1;
    SCOPED_TRACE(replay ? "replayssm_decode" : "gdn_packed_decode");
    DecodeBatch batch = make_decode_batch(rng, s, false, slots, bf16);
    Rings rings = make_rings(s, false, 10, 8, f32, bf16);
    Tensor wp = index_tensor(std::vector<int64_t>(slots.size(), 0));
    Tensor ff = index_tensor({0, 0, 0, 1, 0, 0, 0, 0});
    Mirror graph_mem, eager_mem, warm_mem;
    for (Mirror* m : {&graph_mem, &eager_mem, &warm_mem})
      m->upload_all(pool, rings.d, rings.k, rings.g, wp, ff, batch.x, batch.a, batch.b, batch.A_log,
                    batch.dt_bias, batch.idx, batch.out);
    const MirroredStep run{batch, pool, rings, wp, &ff, scale, replay, false};
    run(warm_mem, nullptr);  // warm-up outside the capture, as serving engines do
    sync();

    CapturedGraph graph(stream, [&] { run(graph_mem, stream); });
    // Capturing ran nothing.
    EXPECT_EQ(graph_mem.download(pool).bytes(), pool.bytes());

    for (int iter = 0; iter < 6; ++iter) {
      SCOPED_TRACE("replay " + std::to_string(iter));
      batch.randomize(rng);
      for (Mirror* m : {&graph_mem, &eager_mem}) m->upload_all(batch.x, batch.a, batch.b);
      graph.launch(stream);
      CUDA_CHECK(cudaStreamSynchronize(stream));
      run(eager_mem, nullptr);
      sync();
      for (const Tensor* t : {&batch.out, &pool, &rings.d, &rings.k, &rings.g, &wp}) {
        const Tensor g = graph_mem.download(*t), e = eager_mem.download(*t);
        EXPECT_EQ(std::memcmp(g.alloc_base(), e.alloc_base(), static_cast<size_t>(g.alloc_bytes())),
                  0)
            << "graph and eager results differ";
      }
      const Tensor out = graph_mem.download(batch.out);
      EXPECT_TRUE(all_zero(slice(out.values(), 2 * s.HV * s.V, s.HV * s.V))) << "padded row";
      EXPECT_FALSE(std::isnan(out.get({0, 0, 0, 0})));
      if (replay) {  // the captured cursor advance keeps going on every replay
        const std::vector<int64_t> c = index_values(graph_mem.download(wp));
        EXPECT_EQ(c[0], (iter + 1) % 8);
        EXPECT_EQ(c[3], 0) << "a forced row flushes every step";
        EXPECT_EQ(c[2], 0) << "padded row";
      }
    }
  }
}

// ==== programmatic dependent launch ============================================================
// Six dependent steps on the same slots (each step reads the state, ring and cursor the previous
// one wrote), launched back to back with pdl = true, eagerly on a stream and from a captured
// graph, must match the same steps launched plainly, bit for bit: the kernels may be scheduled
// before their predecessor ends, so a global access before their griddepcontrol.wait would read
// stale state here.
TEST_F(GpuTest, PdlLaunchesMatchPlainLaunches) {
  Rng rng = test_rng();
  const std::vector<int64_t> slots{5, 0, -1, 7, 2, 9, 4, 1};
  const double scale = 1.0 / std::sqrt(128.0);
  constexpr int kSteps = 6;
  const ScopedStream scoped_stream;
  cudaStream_t stream = scoped_stream.s;

  for (int which = 0; which < 3; ++which) {
    const bool replay = which == 2, kda = which == 1;
    SCOPED_TRACE(replay ? "replayssm_decode" : kda ? "kda_packed_decode" : "gdn_packed_decode");
    const Shape sh = kda ? kKimi : kQwen3Next;
    Tensor pool_w = make_pool(f32, 10, sh, 256, 64);
    fill_live_slots(pool_w.view(), slots, rng);
    DecodeBatch batch = make_decode_batch(rng, sh, kda, slots, bf16);
    Rings rings = make_rings(sh, kda, 10, 4, f32, bf16);
    Tensor wp = index_tensor(std::vector<int64_t>(slots.size(), 0));
    Mirror plain_mem, pdl_mem, graph_mem;
    for (Mirror* m : {&plain_mem, &pdl_mem, &graph_mem})
      m->upload_all(pool_w, rings.d, rings.k, rings.g, wp, batch.x, batch.a, batch.b, batch.A_log,
                    batch.dt_bias, batch.idx, batch.out);
    const MirroredStep step{batch, pool_w, rings, wp, nullptr, scale, replay, kda};
    for (int i = 0; i < kSteps; ++i) step(plain_mem, stream, false);
    for (int i = 0; i < kSteps; ++i) step(pdl_mem, stream, true);
    CUDA_CHECK(cudaStreamSynchronize(stream));

    CapturedGraph graph(stream, [&] {
      for (int i = 0; i < kSteps; ++i) step(graph_mem, stream, true);
    });
    graph.launch(stream);
    CUDA_CHECK(cudaStreamSynchronize(stream));

    for (const Tensor* t : {&batch.out, &pool_w, &rings.d, &rings.k, &rings.g, &wp}) {
      const Tensor p0 = plain_mem.download(*t);
      for (Mirror* m : {&pdl_mem, &graph_mem}) {
        const Tensor x = m->download(*t);
        EXPECT_EQ(
            std::memcmp(p0.alloc_base(), x.alloc_base(), static_cast<size_t>(p0.alloc_bytes())), 0)
            << (m == &pdl_mem ? "eager PDL" : "graph PDL") << " launches differ from plain ones";
      }
    }
    if (replay) {  // six steps of a ring of 4: the cursor went 0,1,2,3(flush)->0,1,2
      const std::vector<int64_t> c = index_values(plain_mem.download(wp));
      EXPECT_EQ(c[0], kSteps % 4);
    }
  }
}

// ==== the out-of-range guard ===================================================================
// Every CUDA kernel checks each row's index on the device: a row whose slot is >= the pool's
// slots (or, for ReplaySSM, whose cursor is outside the ring) is skipped like a padded row (no
// state, ring or cursor access) with an all-NaN output, and the first one is recorded for
// check_errors. Each case runs a batch with such rows (one just past the pool, one far past it)
// among good rows, and the same batch with those rows padded, on two copies of the same memory:
// the good rows' outputs and every byte of the pools and rings must agree bit for bit. The pool
// views cover kGuardSlots slots of a buffer of kGuardSlots + 2 (sentinel-filled), so an index of
// kGuardSlots would land in the sentinel memory past the view's end, which must stay untouched.
// The fixtures are named *Packed* / *Graph* so that scripts/device.sh's forced-kernel phases
// (DELTASTATE_CUDA_DECODE=direct|decode|stream) run them on every decode kernel.
constexpr int64_t kGuardSlots = 10;

std::string out_of_range_text(const char* op, int64_t row, int64_t index) {
  return std::string(op) + ": `ssm_state_indices`[" + std::to_string(row) +
         "]=" + std::to_string(index) + " is out of range for a state pool of " +
         std::to_string(kGuardSlots) + " slots (valid: 0.." + std::to_string(kGuardSlots - 1) +
         "; < 0 marks a padded row); the row was skipped (state, rings and cursor untouched) and "
         "its output is NaN";
}

// The bytes of a [slots, ...] buffer past its first kGuardSlots slots are as in `host`.
::testing::AssertionResult tail_unchanged(const Tensor& now, const Tensor& host) {
  const int64_t off = (host.offset() + kGuardSlots * host.stride(0)) * host.itemsize();
  const int64_t n = host.alloc_bytes() - off;
  if (n <= 0) return ::testing::AssertionFailure() << "no memory past the view's slots";
  if (std::memcmp(static_cast<const char*>(now.alloc_base()) + off,
                  static_cast<const char*>(host.alloc_base()) + off, static_cast<size_t>(n)) != 0)
    return ::testing::AssertionFailure() << "written";
  return ::testing::AssertionSuccess();
}

// A view of the first kGuardSlots slots of a pool (or ring) buffer that holds more.
TensorView first_slots(TensorView v) {
  v.shape[0] = kGuardSlots;
  return v;
}

// Decode rows [B, 1, HV, V]: bad rows all NaN, the others bit-identical to the reference run.
void expect_rows_guarded(const Tensor& out, const Tensor& ref_out, int64_t B, int64_t row_elems,
                         const std::vector<int64_t>& bad_rows) {
  const std::vector<double> o = out.values(), r = ref_out.values();
  for (int64_t row = 0; row < B; ++row) {
    const std::vector<double> got = slice(o, row * row_elems, row_elems);
    if (std::find(bad_rows.begin(), bad_rows.end(), row) != bad_rows.end())
      EXPECT_TRUE(all_nan(got)) << "bad row " << row;
    else EXPECT_TRUE(same_bits(got, slice(r, row * row_elems, row_elems))) << "row " << row;
  }
}

class GpuPackedGuard : public GpuParamTest<GuardCase> {};

// Packed decode (the decode kernels: register, staged, streaming, as forced by
// DELTASTATE_CUDA_DECODE, else the one the dispatch picks).
TEST_P(GpuPackedGuard, BadRowsAreSkippedAndReported) {
  const GuardCase& c = GetParam();
  clear_device_errors();
  Rng rng = test_rng();
  const int64_t B = 6;
  const std::vector<int64_t> good = pick_slots(rng, B, kGuardSlots, {3});
  Tensor pool = make_pool(c.state, kGuardSlots + 2, c.shape);
  fill_live_slots(pool.view(), good, rng);
  DecodeBatch batch = make_decode_batch(rng, c.shape, c.kda, good, c.act, 0, c.index);
  const int64_t far = far_index(c.index);
  std::vector<int64_t> bad = good, padded = good, one_bad = good;
  bad[1] = kGuardSlots;
  bad[4] = far;
  padded[1] = padded[4] = -1;
  one_bad[1] = kGuardSlots;
  const Tensor idx_bad = index_tensor(bad, c.index), idx_ref = index_tensor(padded, c.index),
               idx_one = index_tensor(one_bad, c.index);
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.shape.K));
  batch.poison_out();

  Mirror bad_mem, ref_mem;
  for (Mirror* m : {&bad_mem, &ref_mem})
    m->upload_all(pool, batch.x, batch.a, batch.b, batch.A_log, batch.dt_bias, batch.out);
  bad_mem.upload_all(idx_bad, idx_one);
  ref_mem.upload(idx_ref);
  auto run = [&](Mirror& m, const Tensor& idx) {
    PackedDecodeArgs a =
        batch.packed_args(m.views(), first_slots(m.view(pool)), scale, std::optional<double>{});
    a.state_indices = m.view(idx);
    if (c.kda) deltastate::kda_packed_decode(a);
    else deltastate::gdn_packed_decode(a);
  };
  run(bad_mem, idx_bad);  // the launch itself reports nothing
  run(ref_mem, idx_ref);
  sync();

  expect_rows_guarded(bad_mem.download(batch.out), ref_mem.download(batch.out), B,
                      int64_t{c.shape.HV} * c.shape.V, {1, 4});
  const Tensor after = bad_mem.download(pool);
  EXPECT_TRUE(bytes_equal(after, ref_mem.download(pool))) << "pool (bad rows vs padded rows)";
  EXPECT_TRUE(Snapshot::equal_except(after.alloc_base(), pool.alloc_base(), after.alloc_bytes(),
                                     live_slot_ranges(after.view(), padded)))
      << "pool outside the good rows' slots (the sentinel slots past the view included)";
  expect_reported(nullptr, {out_of_range_text("recurrent", 1, kGuardSlots),
                            out_of_range_text("recurrent", 4, far)});

  // One bad row: the exact text.
  run(bad_mem, idx_one);
  expect_reported(nullptr, {"recurrent: `ssm_state_indices`[1]=10 is out of range for a state pool "
                            "of 10 slots (valid: 0..9; < 0 marks a padded row); the row was "
                            "skipped (state, rings and cursor untouched) and its output is NaN"});
}

// check_indices=true on CUDA: the debug mode, the op synchronizes and raises itself.
TEST_P(GpuPackedGuard, CheckIndicesRaisesAfterTheLaunch) {
  const GuardCase& c = GetParam();
  clear_device_errors();
  Rng rng = test_rng();
  const std::vector<int64_t> good = pick_slots(rng, 4, kGuardSlots, {});
  Tensor pool = make_pool(c.state, kGuardSlots + 2, c.shape);
  fill_live_slots(pool.view(), good, rng);
  DecodeBatch batch = make_decode_batch(rng, c.shape, c.kda, good, c.act, 0, c.index);
  std::vector<int64_t> bad = good;
  bad[2] = kGuardSlots + 1;
  const Tensor idx_bad = index_tensor(bad, c.index);
  Mirror m;
  m.upload_all(pool, batch.x, batch.a, batch.b, batch.A_log, batch.dt_bias, batch.out, idx_bad);
  PackedDecodeArgs a =
      batch.packed_args(m.views(), first_slots(m.view(pool)),
                        1.0 / std::sqrt(static_cast<double>(c.shape.K)), std::optional<double>{});
  a.state_indices = m.view(idx_bad);
  a.check_indices = true;
  const auto e = catch_error([&] {
    if (c.kda) deltastate::kda_packed_decode(a);
    else deltastate::gdn_packed_decode(a);
  });
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(std::string(e->what()), out_of_range_text("recurrent", 2, kGuardSlots + 1));
  EXPECT_NO_THROW(deltastate::check_errors(nullptr));
  // Good indices: no error.
  const Tensor idx_good = index_tensor(good, c.index);
  m.upload(idx_good);
  a.state_indices = m.view(idx_good);
  EXPECT_NO_THROW(c.kda ? deltastate::kda_packed_decode(a) : deltastate::gdn_packed_decode(a));
}

INSTANTIATE_TEST_SUITE_P(
    Cuda, GpuPackedGuard,
    ::testing::Values(
        GuardCase{"gdn_qwen_f32state_bf16act_i32", kQwen3Next, false, f32, bf16, DType::i32},
        GuardCase{"gdn_qwen_f32_i64", kQwen3Next, false, f32, f32, DType::i64},
        GuardCase{"gdn_qwen_bf16state_bf16act_i64", kQwen3Next, false, bf16, bf16, DType::i64},
        GuardCase{"kda_kimi_f32state_bf16act_i64", kKimi, true, f32, bf16, DType::i64},
        GuardCase{"kda_kimi_f32_i32", kKimi, true, f32, f32, DType::i32},
        GuardCase{"gdn_k64_f32_i64", kK64, false, f32, f32, DType::i64},
        GuardCase{"gdn_k96_generic_f32_i64", kK96, false, f32, f32, DType::i64}),
    case_name<GuardCase>);

// The recurrent op on the direct kernel: varlen (cu_seqlens) and T > 1, with final_state.
class GpuRecurrentGuard : public GpuParamTest<GuardCase> {};

TEST_P(GpuRecurrentGuard, BadSequencesAreSkippedAndReported) {
  const GuardCase& c = GetParam();
  clear_device_errors();
  Rng rng = test_rng();
  const bool varlen = !c.kda;  // GDN varlen, KDA [B, T]
  RecurrentSpec spec = varlen ? recurrent_spec(c.shape, false, c.act, 1, 1, {2, 3, 1, 4, 2})
                              : recurrent_spec(c.shape, true, c.act, 5, 3);
  spec.index_dtype = c.index;
  RecurrentBatch rb = make_recurrent_batch(rng, spec);
  const int64_t N = rb.N;
  const Shape& s = c.shape;
  const std::vector<int64_t> good = pick_slots(rng, N, kGuardSlots, {2});
  Tensor pool = make_pool(c.state, kGuardSlots + 2, s);
  fill_live_slots(pool.view(), good, rng);
  Tensor final_state = Tensor::contiguous(c.state, {N, s.HV, s.V, s.K});
  final_state.fill_all(std::nan(""));
  const int64_t far = far_index(c.index);
  std::vector<int64_t> bad = good, padded = good;
  bad[0] = kGuardSlots;
  bad[3] = far;
  padded[0] = padded[3] = -1;
  const Tensor idx_bad = index_tensor(bad, c.index), idx_ref = index_tensor(padded, c.index);
  rb.poison_out();

  Mirror bad_mem, ref_mem;
  for (Mirror* m : {&bad_mem, &ref_mem}) {
    m->upload_all(rb.q, rb.k, rb.v, rb.g, rb.beta, rb.out, rb.A_log, rb.dt_bias, pool, final_state);
    if (varlen) m->upload(rb.cu);
  }
  bad_mem.upload(idx_bad);
  ref_mem.upload(idx_ref);
  auto run = [&](Mirror& m, const Tensor& idx) {
    RecurrentArgs a = rb.args(m.views());
    a.state = first_slots(m.view(pool));
    a.state_indices = m.view(idx);
    a.final_state = m.view(final_state);
    a.update_state = true;
    if (c.kda) deltastate::recurrent_kda(a);
    else deltastate::recurrent_gdn(a);
  };
  run(bad_mem, idx_bad);
  run(ref_mem, idx_ref);
  sync();

  const Tensor out = bad_mem.download(rb.out), ref_out = ref_mem.download(rb.out);
  const Tensor fs = bad_mem.download(final_state), ref_fs = ref_mem.download(final_state);
  const int64_t head = int64_t{s.HV} * s.V * s.K;
  for (int64_t n = 0; n < N; ++n) {
    SCOPED_TRACE("sequence " + std::to_string(n));
    const bool is_bad = n == 0 || n == 3;
    for (int64_t t = 0; t < rb.seq_len(n); ++t) {
      const auto [b, tok] = rb.coord(n, t);
      std::vector<double> g, r;
      for (int64_t hv = 0; hv < s.HV; ++hv)
        for (int64_t v = 0; v < s.V; ++v) {
          g.push_back(out.get({b, tok, hv, v}));
          r.push_back(ref_out.get({b, tok, hv, v}));
        }
      if (is_bad) EXPECT_TRUE(all_nan(g)) << "token " << t;
      else EXPECT_TRUE(same_bits(g, r)) << "token " << t;
    }
    const std::vector<double> f = slice(fs.values(), n * head, head);
    if (is_bad) EXPECT_TRUE(all_nan(f)) << "final_state";
    else EXPECT_TRUE(same_bits(f, slice(ref_fs.values(), n * head, head))) << "final_state";
  }
  const Tensor after = bad_mem.download(pool);
  EXPECT_TRUE(bytes_equal(after, ref_mem.download(pool))) << "pool (bad rows vs padded rows)";
  EXPECT_TRUE(Snapshot::equal_except(after.alloc_base(), pool.alloc_base(), after.alloc_bytes(),
                                     live_slot_ranges(after.view(), padded)))
      << "pool outside the good sequences' slots (the sentinel slots past the view included)";
  expect_reported(nullptr, {out_of_range_text("recurrent", 0, kGuardSlots),
                            out_of_range_text("recurrent", 3, far)});
}

INSTANTIATE_TEST_SUITE_P(
    Cuda, GpuRecurrentGuard,
    ::testing::Values(
        GuardCase{"gdn_qwen_varlen_f32_bf16act_i32", kQwen3Next, false, f32, bf16, DType::i32},
        GuardCase{"gdn_qwen_varlen_bf16state_i64", kQwen3Next, false, bf16, bf16, DType::i64},
        GuardCase{"kda_kimi_T3_f32_i64", kKimi, true, f32, f32, DType::i64},
        GuardCase{"kda_k96_T3_generic_f32_i32", kK96, true, f32, f32, DType::i32}),
    case_name<GuardCase>);

class GpuReplayGuard : public GpuParamTest<GuardCase> {};

// ReplaySSM: a bad slot writes no ring record, reads and writes no checkpoint and leaves its
// cursor; a cursor outside the ring (write_pos = L) is skipped the same way.
TEST_P(GpuReplayGuard, BadRowsAreSkippedAndReported) {
  const GuardCase& c = GetParam();
  clear_device_errors();
  Rng rng = test_rng();
  const int64_t B = 6;
  const int L = 4;
  const std::vector<int64_t> good = pick_slots(rng, B, kGuardSlots, {3});
  Tensor pool = make_pool(c.state, kGuardSlots + 2, c.shape);
  fill_live_slots(pool.view(), good, rng);
  Rings rings = make_rings(c.shape, c.kda, kGuardSlots + 2, L, c.state, c.act);
  // Records in every ring (the rows start mid-ring), the slots past the views' end included.
  rings.d.fill_uniform(rng, -0.3, 0.3);
  rings.k.fill_uniform(rng, -0.3, 0.3);
  rings.g.fill_uniform(rng, -0.2, -0.01);
  DecodeBatch batch = make_decode_batch(rng, c.shape, c.kda, good, c.act);
  Tensor wp = index_tensor({1, 2, 0, 1, 3, L});  // row 5: a cursor outside the ring
  Tensor ff = index_tensor({0, 0, 1, 0, 0, 0});
  const int64_t far = far_index(DType::i32);
  std::vector<int64_t> bad = good, padded = good;
  bad[1] = kGuardSlots;
  bad[4] = far;
  padded[1] = padded[4] = padded[5] = -1;
  const Tensor idx_bad = index_tensor(bad), idx_ref = index_tensor(padded);
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.shape.K));
  batch.poison_out();

  Mirror bad_mem, ref_mem;
  for (Mirror* m : {&bad_mem, &ref_mem})
    m->upload_all(pool, rings.d, rings.k, rings.g, wp, ff, batch.x, batch.a, batch.b, batch.A_log,
                  batch.dt_bias, batch.out);
  bad_mem.upload(idx_bad);
  ref_mem.upload(idx_ref);
  auto run = [&](Mirror& m, const Tensor& idx, bool advance) {
    ReplayDecodeArgs a =
        replay_args(m.views(), batch, first_slots(m.view(pool)), first_slots(m.view(rings.d)),
                    first_slots(m.view(rings.k)), first_slots(m.view(rings.g)), wp, &ff, scale,
                    std::optional<double>{});
    a.state_indices = m.view(idx);
    a.advance_write_pos = advance;
    deltastate::replayssm_decode(a);
  };
  for (const bool advance : {true, false}) {
    SCOPED_TRACE(advance ? "advance_write_pos" : "caller advances");
    run(bad_mem, idx_bad, advance);
    run(ref_mem, idx_ref, advance);
    sync();
    expect_rows_guarded(bad_mem.download(batch.out), ref_mem.download(batch.out), B,
                        int64_t{c.shape.HV} * c.shape.V, {1, 4, 5});
    for (const Tensor* t : {&pool, &rings.d, &rings.k, &rings.g, &wp})
      EXPECT_TRUE(bytes_equal(bad_mem.download(*t), ref_mem.download(*t)))
          << "pools, rings and cursors (bad rows vs padded rows)";
    const std::vector<int64_t> cursors = index_values(bad_mem.download(wp));
    EXPECT_EQ(cursors[1], 2);
    EXPECT_EQ(cursors[4], 3);
    EXPECT_EQ(cursors[5], L) << "the bad cursor is left as it was";
    for (const Tensor* t : {&rings.d, &rings.k, &rings.g})
      EXPECT_TRUE(tail_unchanged(bad_mem.download(*t), *t)) << "ring memory past the view's slots";
    expect_reported(nullptr, {out_of_range_text("replayssm_decode", 1, kGuardSlots),
                              out_of_range_text("replayssm_decode", 4, far),
                              "replayssm_decode: `write_pos`[5]=4 is outside the ring [0, L-1=3]; "
                              "the row was skipped (state, rings and cursor untouched) and its "
                              "output is NaN"});
  }
  // Padded rows are not errors; a bad cursor alone (row 5 with a good slot): the exact text.
  bad_mem.upload(idx_ref);
  run(bad_mem, idx_ref, false);
  sync();
  EXPECT_NO_THROW(deltastate::check_errors(nullptr)) << "padded rows are not errors";
  const Tensor idx_cursor = index_tensor(good);
  bad_mem.upload(idx_cursor);
  run(bad_mem, idx_cursor, false);
  expect_reported(nullptr, {"replayssm_decode: `write_pos`[5]=4 is outside the ring [0, L-1=3]; "
                            "the row was skipped (state, rings and cursor untouched) and its "
                            "output is NaN"});
}

INSTANTIATE_TEST_SUITE_P(
    Cuda, GpuReplayGuard,
    ::testing::Values(GuardCase{"gdn_qwen_f32_bf16act", kQwen3Next, false, f32, bf16, DType::i32},
                      GuardCase{"gdn_qwen_bf16ckpt_bf16act", kQwen3Next, false, bf16, bf16,
                                DType::i32},
                      GuardCase{"kda_kimi_f32", kKimi, true, f32, f32, DType::i32},
                      GuardCase{"gdn_k96_generic_f32", kK96, false, f32, f32, DType::i32}),
    case_name<GuardCase>);

// A captured step with a bad index: capturing runs and reports nothing (check_indices=true skips
// its after-launch check while the stream is being captured); each replay skips the row and
// records it, and check_errors on the stream after the replay reports it.
TEST_F(GpuTest, GraphGuardReportsAfterReplay) {
  clear_device_errors();
  const Shape s = kQwen3Next;
  Rng rng = test_rng();
  const std::vector<int64_t> good{5, 0, -1, 7};
  Tensor pool = make_pool(f32, kGuardSlots + 2, s);
  fill_live_slots(pool.view(), good, rng);
  DecodeBatch batch = make_decode_batch(rng, s, false, good, bf16);
  const Tensor idx_bad = index_tensor({5, 0, -1, kGuardSlots});
  const ScopedStream scoped_stream;
  cudaStream_t stream = scoped_stream.s;
  Mirror m;
  m.upload_all(pool, batch.x, batch.a, batch.b, batch.A_log, batch.dt_bias, batch.out, idx_bad);
  PackedDecodeArgs a =
      batch.packed_args(m.views(), first_slots(m.view(pool)), 1.0 / std::sqrt(128.0));
  a.state_indices = m.view(idx_bad);
  a.stream = stream;
  a.check_indices = true;
  // Warm-up outside the capture, as serving engines do (good indices: no error).
  const Tensor idx_good = index_tensor(good);
  m.upload(idx_good);
  a.state_indices = m.view(idx_good);
  EXPECT_NO_THROW(deltastate::gdn_packed_decode(a));
  a.state_indices = m.view(idx_bad);
  std::optional<CapturedGraph> graph;
  EXPECT_NO_THROW(graph.emplace(stream, [&] { deltastate::gdn_packed_decode(a); }));
  ASSERT_TRUE(graph.has_value());
  EXPECT_NO_THROW(deltastate::check_errors(stream)) << "capturing ran nothing";
  for (int iter = 0; iter < 2; ++iter) {
    SCOPED_TRACE("replay " + std::to_string(iter));
    graph->launch(stream);
    expect_reported(stream, {out_of_range_text("recurrent", 3, kGuardSlots)});
    const Tensor out = m.download(batch.out);
    EXPECT_TRUE(all_nan(slice(out.values(), 3 * s.HV * s.V, s.HV * s.V))) << "bad row";
    EXPECT_TRUE(all_zero(slice(out.values(), 2 * s.HV * s.V, s.HV * s.V))) << "padded row";
    EXPECT_TRUE(tail_unchanged(m.download(pool), pool)) << "pool memory past the view's slots";
  }
}
}  // namespace
}  // namespace dstest
