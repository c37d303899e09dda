// ReplaySSM buffered decode (SGLang's fused_recurrent_linear_replayssm_decode, basic mode), GDN
// and KDA:
//  * every step against the fp64 reference (rebuild from checkpoint + ring, flush / record rules),
//    with the checkpoint bit-unchanged on non-flush steps and only the record at the cursor
//    written on the rings;
//  * 40 steps against plain packed decode for L in {1, 4, 8, 16} (SGLang's test tolerances), with
//    forced flushes, rows at different cursors, padded rows and advance_write_pos;
//  * a StatePool envelope pool with its rings and per-slot cursors (the caller protocol).
#include <cmath>

#include "test_util.h"

namespace dstest {
namespace {

using deltastate::ReplayDecodeArgs;

// The checkpoint pool and rings of one layer (host memory), and all memory they live in.
struct ReplayViews {
  TensorView state, d, k, g;
  std::vector<MemRange> memory;
};

Snapshot snapshot_of(const std::vector<MemRange>& memory) {
  Snapshot s;
  for (const MemRange& m : memory) s.add(m.begin, m.end - m.begin);
  return s;
}

MemRange whole(const Tensor& t) {
  const auto* b = static_cast<const char*>(t.alloc_base());
  return {b, b + t.alloc_bytes()};
}

// The caller's cursor rule (the kernel never moves cursors itself): wp = flushed ? 0 : wp + 1.
int32_t next_cursor(int32_t m, int L, bool forced) { return (m == L - 1 || forced) ? 0 : m + 1; }

// Runs one ReplaySSM step and checks it against the reference. `cursors` are the rows' cursors
// (the write_pos snapshot); on return they hold the caller's rule for live rows. With `advance`
// the op advances write_pos itself and the result must equal that rule (padded rows keep theirs);
// without, write_pos must come back unchanged.
void checked_replay_step(DecodeBatch& batch, const ReplayViews& m, std::vector<int32_t>& cursors,
                         const std::vector<int32_t>& force, bool advance,
                         std::optional<double> lower_bound) {
  const Shape& s = batch.s;
  const int L = static_cast<int>(m.d.shape[2]);
  const int gw = batch.kda ? s.K : 1;
  const double scale = 1.0 / std::sqrt(static_cast<double>(s.K));
  const ref::Config cfg = batch.config(lower_bound, scale, /*round_beta=*/true);
  const std::vector<int64_t> slots = index_values(batch.idx);
  const int64_t B = batch.B;

  std::vector<ref::ReplayResult> want(B);
  for (int64_t r = 0; r < B; ++r) {
    if (slots[r] < 0) continue;
    want[r] = ref::replay_step(cfg, batch.token(r), slot_values(m.state, slots[r]),
                               ring_of_slot(m.d, m.k, m.g, slots[r]), cursors[r], force[r] != 0);
  }

  Tensor wp = index_tensor(std::vector<int64_t>(cursors.begin(), cursors.end()), DType::i32);
  Tensor ff = index_tensor(std::vector<int64_t>(force.begin(), force.end()), DType::i32);
  batch.poison_out();
  const Snapshot before = snapshot_of(m.memory);
  Snapshot inputs_before;
  for (const Tensor* t : {&batch.x, &batch.a, &batch.b, &batch.A_log, &batch.dt_bias, &batch.idx, &ff})
    inputs_before.add(*t);

  ReplayDecodeArgs args =
      replay_args(host_view, batch, m.state, m.d, m.k, m.g, wp, &ff, scale, lower_bound);
  args.advance_write_pos = advance;
  deltastate::replayssm_decode(args);

  std::vector<MemRange> written;
  for (int64_t r = 0; r < B; ++r) {
    SCOPED_TRACE("row " + std::to_string(r) + ", cursor " + std::to_string(cursors[r]));
    const int64_t slot = slots[r];
    const std::vector<double> out = batch.out_row(r);
    if (slot < 0) {
      EXPECT_TRUE(all_zero(out)) << "padded row output";
      EXPECT_EQ(wp.ptr<int32_t>()[r], cursors[r]) << "a padded row's cursor must not move";
      continue;
    }
    EXPECT_TRUE(all_close(out, want[r].out, kOutTol, batch.act)) << "output";
    const int mc = cursors[r];
    if (want[r].flushed) {
      EXPECT_TRUE(all_close(slot_values(m.state, slot), want[r].checkpoint, state_tol(m.state.dtype)))
          << "flushed checkpoint";
      written.push_back(slot_range(m.state, slot));
    } else {
      // Only the record at the cursor is written; the checkpoint stays bit-unchanged. Record
      // `head` of a ring [slots, heads, L, width] against its slice of the reference.
      auto check_record = [&](const TensorView& ring, int heads, int head, int64_t width,
                              const std::vector<double>& want_all, Tol tol, const char* what) {
        const int64_t off = ((slot * heads + head) * L + mc) * width;
        EXPECT_TRUE(all_close(view_values(ring, off, width), slice(want_all, head * width, width),
                              tol, ring.dtype))
            << what << " record of head " << head;
        written.push_back(range_of(ring, off, width));
      };
      for (int hv = 0; hv < s.HV; ++hv) {
        check_record(m.d, s.HV, hv, s.V, want[r].d, kOutTol, "d");
        check_record(m.g, s.HV, hv, gw, want[r].g, {1e-5, 1e-4}, "g");
      }
      for (int h = 0; h < s.H; ++h) check_record(m.k, s.H, h, s.K, want[r].k, kOutTol, "k (key head)");
    }
    const int32_t expected = next_cursor(mc, L, force[r] != 0);
    EXPECT_EQ(wp.ptr<int32_t>()[r], advance ? expected : mc) << "write_pos after the step";
    cursors[r] = expected;
  }
  EXPECT_TRUE(before.unchanged_except(written)) << "checkpoint pool / rings outside the written parts";
  EXPECT_TRUE(inputs_before.unchanged()) << "inputs";
}

// Forced flushes for a step: the first steps stagger the rows (row r is forced while step < r, so
// the rows run at different cursors), then each row is forced with probability p. Any nonzero
// value forces.
std::vector<int32_t> force_flags(Rng& rng, int step, int64_t B, double p = 0.1) {
  std::vector<int32_t> f(B);
  for (int64_t r = 0; r < B; ++r) f[r] = (step < r) || rng.chance(p) ? (rng.chance(0.5) ? 1 : 7) : 0;
  return f;
}

class ReplayVsReference : public ::testing::TestWithParam<ReplayCase> {};

TEST_P(ReplayVsReference, Steps) {
  const ReplayCase& c = GetParam();
  Rng rng = test_rng();
  const int64_t B = 4, num_slots = 7;
  const std::vector<int64_t> slots = pick_slots(rng, B, num_slots, {2});
  Tensor pool = make_pool(c.state, num_slots, c.shape, c.slot_pad, c.lead);
  fill_live_slots(pool.view(), slots, rng);
  Rings rings = make_rings(c.shape, c.kda, num_slots, c.L, c.state, c.act);
  const ReplayViews views{pool.view(), rings.d.view(), rings.k.view(), rings.g.view(),
                          {whole(pool), whole(rings.d), whole(rings.k), whole(rings.g)}};
  DecodeBatch batch = make_decode_batch(rng, c.shape, c.kda, slots, c.act);
  std::vector<int32_t> cursors(B, 0);
  cursors[2] = c.L - 1;  // the padded row's cursor: never read, never moved
  int max_cursor = 0;
  for (int step = 0; step < c.steps; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    if (step) batch.randomize(rng);
    for (int64_t r = 0; r < B; ++r)
      if (slots[r] >= 0) max_cursor = std::max(max_cursor, cursors[r]);
    checked_replay_step(batch, views, cursors, force_flags(rng, step, B, forced_flush_rate(c.L)),
                        /*advance=*/step % 2 == 0, c.lower_bound);
    if (::testing::Test::HasFailure()) break;
  }
  if (c.L > 32) {
    EXPECT_GT(max_cursor, 32) << "no row read more than 32 ring records";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Ops, ReplayVsReference,
    ::testing::Values(
        ReplayCase{"gdn_qwen_L4_f32", kQwen3Next, false, kNoLb, f32, f32, 4, 10},
        ReplayCase{"gdn_qwen_L16_f32state_bf16act_envelope", kQwen3Next, false, kNoLb, f32, bf16, 16, 20, 4096 + 256, 64},
        ReplayCase{"kda_kimi_L8_f32_lb", kKimi, true, kLb, f32, f32, 8, 12},
        ReplayCase{"kda_kimi_L4_bf16state_bf16act", kKimi, true, kNoLb, bf16, bf16, 4, 8},
        ReplayCase{"gdn_odd_L8_f16", kOdd, false, kNoLb, f16, f16, 8, 14, 40, 8},
        ReplayCase{"gdn_odd_L1_bf16", kOdd, false, kNoLb, bf16, bf16, 1, 4},
        ReplayCase{"kda_odd_L4_bf16state_f32act_lb", kOdd, true, kLb, bf16, f32, 4, 10},
        ReplayCase{"kda_odd_L16_f32_bf16act", kOdd, true, kNoLb, f32, bf16, 16, 20},
        ReplayCase{"gdn_KgtV_L2_f32", kKgtV, false, kNoLb, f32, f32, 2, 8},
        ReplayCase{"kda_KltV_L8_f16state_bf16act_envelope", kKltV, true, kLb, f16, bf16, 8, 12, 64, 32},
        ReplayCase{"kda_KgtV_L1_f32", kKgtV, true, kNoLb, f32, f32, 1, 3},
        // a ring longer than a warp (the CUDA kernel's lanes loop over records; its GPU test
        // compares with this backend)
        ReplayCase{"gdn_odd_L40_f32_bf16act", kOdd, false, kNoLb, f32, bf16, 40, 44},
        ReplayCase{"kda_KltV_L40_f32_lb", kKltV, true, kLb, f32, f32, 40, 44}),
    case_name<ReplayCase>);

// ---- ReplaySSM == plain packed decode over 40 steps --------------------------------------------
struct EquivCase {
  const char* name;
  Shape shape;
  bool kda;
  std::optional<double> lower_bound;
  DType dtype;  // activations, states and rings
  int L;
};

class ReplayMatchesPackedDecode : public ::testing::TestWithParam<EquivCase> {};

// SGLang's test tolerances for ReplaySSM vs packed decode.
Tol equiv_out_tol(int L, DType t) {
  if (t != DType::f32) return {1e-3, 1e-2};
  return L == 1 ? Tol{2e-6, 1e-5} : Tol{1e-4, 1e-3};
}
Tol equiv_state_tol(int L, DType t) {
  if (t != DType::f32) return {3e-3, 1e-2};
  return L == 1 ? Tol{2e-6, 1e-5} : Tol{1.5e-3, 1e-3};
}

TEST_P(ReplayMatchesPackedDecode, FortySteps) {
  const EquivCase& c = GetParam();
  Rng rng = test_rng();
  const int64_t B = 5, num_slots = 8;
  const int64_t padded_row = 3;
  const std::vector<int64_t> slots = pick_slots(rng, B, num_slots, {padded_row});
  Tensor replay_pool = make_pool(c.dtype, num_slots, c.shape);
  Tensor plain_pool = make_pool(c.dtype, num_slots, c.shape);
  for (int64_t sl : slots) {
    if (sl < 0) continue;
    fill_slot(replay_pool.view(), sl, rng);
    set_slot_values(plain_pool.view(), sl, slot_values(replay_pool.view(), sl));
  }
  Rings rings = make_rings(c.shape, c.kda, num_slots, c.L, c.dtype, c.dtype);
  DecodeBatch batch = make_decode_batch(rng, c.shape, c.kda, slots, c.dtype);
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.shape.K));

  std::vector<int32_t> cursors(B, 0);
  cursors[padded_row] = c.L > 1 ? 1 : 0;
  Tensor wp = index_tensor(std::vector<int64_t>(cursors.begin(), cursors.end()), DType::i32);
  int flushes = 0, natural_flushes = 0, appends = 0;
  for (int step = 0; step < 40; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    if (step) batch.randomize(rng);
    // Rare forced flushes at L = 16, so that rows also reach the end of their ring.
    const std::vector<int32_t> force =
        c.L > 1 ? force_flags(rng, step, B, forced_flush_rate(c.L)) : std::vector<int32_t>(B, 0);
    Tensor ff = index_tensor(std::vector<int64_t>(force.begin(), force.end()), DType::i32);
    const Snapshot checkpoint_before = Snapshot().add(replay_pool);

    batch.poison_out();
    ReplayDecodeArgs rargs = replay_args(host_view, batch, replay_pool.view(), rings.d.view(),
                                         rings.k.view(), rings.g.view(), wp, &ff, scale,
                                         c.lower_bound);
    rargs.advance_write_pos = true;
    deltastate::replayssm_decode(rargs);
    std::vector<std::vector<double>> replay_out(B);
    for (int64_t r = 0; r < B; ++r) replay_out[r] = batch.out_row(r);

    batch.poison_out();
    deltastate::PackedDecodeArgs pargs =
        batch.packed_args(host_view, plain_pool.view(), scale, c.lower_bound);
    pargs.round_beta_to_input = true;  // ReplaySSM rounds beta to b's dtype
    if (c.kda) deltastate::kda_packed_decode(pargs);
    else deltastate::gdn_packed_decode(pargs);

    std::vector<MemRange> flushed_slots;
    for (int64_t r = 0; r < B; ++r) {
      SCOPED_TRACE("row " + std::to_string(r) + ", cursor " + std::to_string(cursors[r]));
      if (slots[r] < 0) {
        EXPECT_TRUE(all_zero(replay_out[r]));
        EXPECT_EQ(wp.ptr<int32_t>()[r], cursors[r]) << "a padded row's cursor must not move";
        continue;
      }
      EXPECT_TRUE(all_close(replay_out[r], batch.out_row(r), equiv_out_tol(c.L, c.dtype))) << "output";
      const bool flush = cursors[r] == c.L - 1 || force[r] != 0;
      if (flush) {
        ++flushes;
        natural_flushes += cursors[r] == c.L - 1 && force[r] == 0;
        EXPECT_TRUE(all_close(slot_values(replay_pool.view(), slots[r]),
                              slot_values(plain_pool.view(), slots[r]), equiv_state_tol(c.L, c.dtype)))
            << "checkpoint at a flush";
        flushed_slots.push_back(slot_range(replay_pool.view(), slots[r]));
      } else {
        ++appends;
      }
      cursors[r] = next_cursor(cursors[r], c.L, force[r] != 0);
      EXPECT_EQ(wp.ptr<int32_t>()[r], cursors[r]) << "advance_write_pos";
    }
    EXPECT_TRUE(checkpoint_before.unchanged_except(flushed_slots))
        << "the checkpoint changed outside the slots of flushing rows";
    if (::testing::Test::HasFailure()) break;
  }
  EXPECT_GT(flushes, 0);
  if (c.L > 1) {
    EXPECT_GT(appends, 0);
    EXPECT_GT(natural_flushes, 0) << "no row reached the end of its ring";
  }
}

constexpr Shape kMid{"mid", 2, 4, 64, 64};

INSTANTIATE_TEST_SUITE_P(
    Ops, ReplayMatchesPackedDecode,
    ::testing::Values(EquivCase{"gdn_f32_L1", kMid, false, kNoLb, f32, 1},
                      EquivCase{"gdn_f32_L4", kMid, false, kNoLb, f32, 4},
                      EquivCase{"gdn_f32_L8", kMid, false, kNoLb, f32, 8},
                      EquivCase{"gdn_f32_L16", kMid, false, kNoLb, f32, 16},
                      EquivCase{"gdn_bf16_L1", kMid, false, kNoLb, bf16, 1},
                      EquivCase{"gdn_bf16_L4", kMid, false, kNoLb, bf16, 4},
                      EquivCase{"gdn_bf16_L8", kMid, false, kNoLb, bf16, 8},
                      EquivCase{"gdn_bf16_L16", kMid, false, kNoLb, bf16, 16},
                      EquivCase{"kda_f32_L1", kMid, true, kNoLb, f32, 1},
                      EquivCase{"kda_f32_L4_lb", kMid, true, kLb, f32, 4},
                      EquivCase{"kda_f32_L8", kMid, true, kNoLb, f32, 8},
                      EquivCase{"kda_f32_L16_lb", kMid, true, kLb, f32, 16},
                      EquivCase{"kda_bf16_L1_lb", kMid, true, kLb, bf16, 1},
                      EquivCase{"kda_bf16_L4", kMid, true, kNoLb, bf16, 4},
                      EquivCase{"kda_bf16_L8_lb", kMid, true, kLb, bf16, 8},
                      EquivCase{"kda_bf16_L16", kMid, true, kNoLb, bf16, 16},
                      EquivCase{"gdn_qwen_f32_L16", kQwen3Next, false, kNoLb, f32, 16},
                      EquivCase{"kda_kimi_bf16_L8", kKimi, true, kNoLb, bf16, 8}),
    case_name<EquivCase>);

// ---- StatePool: envelope checkpoint pool, its rings and per-slot cursors ------------------------
// The caller protocol (as SGLang's MambaPool): gather the slots' cursors into the rows'
// write_pos, run the step, scatter the advanced cursors back (StatePool::set_cursor).
TEST(ReplaySSM, StatePoolEnvelopeWithRings) {
  for (bool kda : {false, true}) {
    SCOPED_TRACE(kda ? "kda" : "gdn");
    Rng rng = test_rng(kda);
    deltastate::StatePoolConfig cfg = envelope_config(kOdd, 2, 6, DType::f32, 300);
    cfg.replay_len = 4;
    cfg.ring_k_dtype = DType::bf16;
    cfg.kda = kda;
    deltastate::StatePool pool(cfg);
    fill_sentinel(pool.data(), pool.total_bytes(), DType::f32);
    const auto* base = static_cast<const char*>(pool.data());
    std::vector<int64_t> slots;
    for (int i = 0; i < 3; ++i) slots.push_back(pool.allocate(/*clear=*/false));  // cursors reset
    slots.insert(slots.begin() + 1, -1);
    const int layer = 1;
    const ReplayViews views{pool.layer_state(layer), pool.d_cache(layer), pool.k_cache(layer),
                            pool.g_cache(layer), {{base, base + pool.total_bytes()}}};
    ASSERT_GT(views.state.stride[0], kOdd.state_elems());
    fill_live_slots(views.state, slots, rng);
    DecodeBatch batch = make_decode_batch(rng, kOdd, kda, slots, DType::bf16);
    for (int step = 0; step < 9; ++step) {
      SCOPED_TRACE("step " + std::to_string(step));
      if (step) batch.randomize(rng);
      std::vector<int32_t> cursors;
      for (int64_t sl : slots) cursors.push_back(sl >= 0 ? pool.cursor(sl) : 0);
      checked_replay_step(batch, views, cursors, force_flags(rng, step, batch.B), false,
                          kda ? kLb : kNoLb);
      for (size_t r = 0; r < slots.size(); ++r)
        if (slots[r] >= 0) pool.set_cursor(slots[r], cursors[r]);
      if (::testing::Test::HasFailure()) break;
    }
  }
}

}  // namespace
}  // namespace dstest
