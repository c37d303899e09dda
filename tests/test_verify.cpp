// Speculative verify and its commit (update_state_after_verify) on the CPU against the fp64
// reference (tests/reference/verify_reference.h): every token's output and intermediate state,
// chains and EAGLE trees, the three engines' conventions (SGLang scratch rows, FlashInfer batch
// rows / per-token slots / output slots, vLLM per-token slots with num_accepted), fp32 and bf16
// states, padded sequences, envelope pools, sentinel-filled memory left bit-untouched, outputs
// poisoned with NaN, the commit of accepted prefixes, and every error text.
#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <tuple>

#include "reference/verify_reference.h"
#include "test_util.h"

namespace dstest {
namespace {

using deltastate::CommitArgs;
using deltastate::VerifyArgs;

struct VerifyCase : OpCase {
  int64_t B, T;
  std::vector<int64_t> seqlens;  // non-empty: varlen (B ignored)
  bool tree = false;
};
void PrintTo(const VerifyCase& c, std::ostream* os) { *os << c.name; }

// A verify setup: inputs, a sentinel-filled envelope pool with live slots, a scratch buffer
// [N + 2, T_alloc, HV, V, K] (sentinel) with scratch rows in reverse order, padded sequences.
struct VerifySetup {
  RecurrentBatch rb;
  Tensor pool, inter, idx, rows, parents;
  std::vector<int64_t> slots, row_of;
  std::vector<std::vector<int>> parent_of;
  int64_t T_alloc = 0;
  double scale = 0;
};

VerifySetup make_setup(Rng& rng, const VerifyCase& c) {
  VerifySetup su;
  RecurrentSpec spec = recurrent_spec(c.shape, c.kda, c.act, c.B, c.T, c.seqlens);
  spec.lower_bound = c.lower_bound;
  su.rb = make_recurrent_batch(rng, spec);
  const int64_t N = su.rb.N;
  const Shape& s = c.shape;
  su.scale = 1.0 / std::sqrt(static_cast<double>(s.K));
  su.pool = make_pool(c.state, N + 3, s, /*slot_pad=*/24, /*lead=*/8);
  su.slots = pick_slots(rng, N, N + 3, {N > 2 ? 1 : -1});
  fill_live_slots(su.pool.view(), su.slots, rng);
  su.idx = index_tensor(su.slots);
  int64_t tmax = 1;
  for (int64_t n = 0; n < N; ++n) tmax = std::max(tmax, su.rb.seq_len(n));
  su.T_alloc = tmax + 1;
  const int64_t he = s.state_elems();
  su.inter = Tensor::strided(c.state, {N + 2, su.T_alloc, s.HV, s.V, s.K},
                             {su.T_alloc * he + 40, he, s.V * s.K, s.K, 1}, 16);
  su.inter.fill_all(kSentinel);
  for (int64_t n = 0; n < N; ++n) su.row_of.push_back(N + 1 - n);
  su.rows = index_tensor(su.row_of);
  su.parents = Tensor::contiguous(DType::i32, {N, tmax});
  su.parent_of.assign(N, std::vector<int>(tmax, -1));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t t = 0; t < tmax; ++t) {
      const int p = c.tree ? static_cast<int>(rng.integer(-1, t - 1)) : static_cast<int>(t) - 1;
      su.parent_of[n][t] = t == 0 ? -1 : p;
      su.parents.set({n, t}, su.parent_of[n][t]);
    }
  return su;
}

VerifyArgs base_args(const VerifySetup& su) {
  VerifyArgs a = verify_inputs(su.rb.args(host_view), su.rb.spec.kda);
  a.state = su.pool.view();
  return a;
}

ref::VerifyResult reference_of(const VerifySetup& su, int64_t n, const ref::State& S0, bool tree) {
  std::vector<ref::Token> tokens;
  for (int64_t t = 0; t < su.rb.seq_len(n); ++t) tokens.push_back(su.rb.token(n, t));
  std::vector<int> parents;
  if (tree) parents.assign(su.parent_of[n].begin(), su.parent_of[n].begin() + tokens.size());
  return ref::verify(su.rb.config(su.scale), tokens, S0, parents);
}

MemRange inter_range(const VerifySetup& su, int64_t row, int64_t step) {
  return range_of(su.inter.view(), row * su.inter.stride(0) + step * su.inter.stride(1),
                  su.rb.spec.s.state_elems());
}
std::vector<double> inter_values(const VerifySetup& su, int64_t row, int64_t step) {
  return view_values(su.inter.view(), row * su.inter.stride(0) + step * su.inter.stride(1),
                     su.rb.spec.s.state_elems());
}

class VerifyVsReference : public ::testing::TestWithParam<VerifyCase> {};
// Tests of chains only (no EAGLE tree), and of chains of one length (no varlen): each suite is
// instantiated with the cases it applies to (below), so that no case is registered to be skipped.
class VerifyChains : public VerifyVsReference {};
class VerifyUniformChains : public VerifyVsReference {};

// SGLang's target verify: scratch rows by index, no state update; then the commit.
TEST_P(VerifyVsReference, ScratchRowsThenCommit) {
  const VerifyCase& c = GetParam();
  Rng rng = test_rng();
  VerifySetup su = make_setup(rng, c);
  const int64_t N = su.rb.N;
  VerifyArgs a = base_args(su);
  a.state_indices = su.idx.view();
  a.update_state = false;
  a.intermediate_states = su.inter.view();
  a.intermediate_state_indices = su.rows.view();
  if (c.tree) a.parent_tokens = su.parents.view();
  std::vector<ref::VerifyResult> want(N);
  for (int64_t n = 0; n < N; ++n)
    if (su.slots[n] >= 0)
      want[n] = reference_of(su, n, slot_values(su.pool.view(), su.slots[n]), c.tree);

  su.rb.poison_out();
  Snapshot pool_before, inter_before;
  pool_before.add(su.pool);
  inter_before.add(su.inter);
  deltastate::verify(a);
  EXPECT_TRUE(pool_before.unchanged()) << "the committed pool";
  std::vector<MemRange> written;
  for (int64_t n = 0; n < N; ++n) {
    SCOPED_TRACE("sequence " + std::to_string(n));
    for (int64_t t = 0; t < su.rb.seq_len(n); ++t) {
      SCOPED_TRACE("token " + std::to_string(t));
      if (su.slots[n] < 0) {
        EXPECT_TRUE(all_zero(su.rb.out_token(n, t)));
        continue;
      }
      EXPECT_TRUE(all_close(su.rb.out_token(n, t), want[n].out[t], kOutTol, c.act));
      EXPECT_TRUE(
          all_close(inter_values(su, su.row_of[n], t), want[n].states[t], state_tol(c.state)));
      written.push_back(inter_range(su, su.row_of[n], t));
    }
  }
  EXPECT_TRUE(inter_before.unchanged_except(written)) << "scratch memory outside the written steps";

  // Commit: accepted lengths 0..len over two layers of one envelope (the pool twice, interleaved).
  std::vector<int64_t> accepted;
  for (int64_t n = 0; n < N; ++n) accepted.push_back(rng.integer(0, su.rb.seq_len(n)));
  Tensor acc = index_tensor(accepted, DType::i64);
  const Shape& s = c.shape;
  const TensorView pv = su.pool.view(), iv = su.inter.view();
  CommitArgs ca;
  ca.state = TensorView::strided(pv.data, pv.dtype, {1, pv.shape[0], s.HV, s.V, s.K},
                                 {0, pv.stride[0], pv.stride[1], pv.stride[2], 1});
  ca.intermediate_states =
      TensorView::strided(iv.data, iv.dtype, {1, iv.shape[0], iv.shape[1], s.HV, s.V, s.K},
                          {0, iv.stride[0], iv.stride[1], iv.stride[2], iv.stride[3], 1});
  ca.state_indices = su.idx.view();
  ca.accepted = acc.view();
  ca.intermediate_state_indices = su.rows.view();
  Snapshot committed_before, scratch_before;
  committed_before.add(su.pool);
  scratch_before.add(su.inter);
  deltastate::update_state_after_verify(ca);
  EXPECT_TRUE(scratch_before.unchanged());
  std::vector<MemRange> moved;
  for (int64_t n = 0; n < N; ++n) {
    if (su.slots[n] < 0 || accepted[n] == 0) continue;
    SCOPED_TRACE("commit of sequence " + std::to_string(n));
    EXPECT_EQ(slot_values(pv, su.slots[n]), inter_values(su, su.row_of[n], accepted[n] - 1));
    EXPECT_TRUE(all_close(slot_values(pv, su.slots[n]), want[n].states[accepted[n] - 1],
                          state_tol(c.state)));
    moved.push_back(slot_range(pv, su.slots[n]));
  }
  EXPECT_TRUE(committed_before.unchanged_except(moved)) << "rejected drafts changed the pool";
}

// Verify over T tokens is T plain decode steps (the recurrent op with T = 1), for every prefix:
// bit for bit with fp32 states (same math, same order), within tolerance with 16-bit ones (plain
// decode rounds the state between steps).
TEST_P(VerifyUniformChains, EqualsPlainDecodeSteps) {
  const VerifyCase& c = GetParam();
  ASSERT_TRUE(!c.tree && c.seqlens.empty()) << "instantiated with chains of uniform length only";
  Rng rng = test_rng();
  VerifySetup su = make_setup(rng, c);
  const int64_t N = su.rb.N, T = c.T;
  Tensor pool2 = make_pool(c.state, N + 3, c.shape, 24, 8);
  std::memcpy(pool2.alloc_base(), su.pool.alloc_base(), su.pool.alloc_bytes());
  VerifyArgs a = base_args(su);
  a.state_indices = su.idx.view();
  a.update_state = true;
  a.intermediate_states = su.inter.view();  // rows 0..N-1 (FlashInfer's batch rows)
  su.rb.poison_out();
  deltastate::verify(a);
  for (int64_t t = 0; t < T; ++t) {
    RecurrentSpec one = su.rb.spec;
    one.T = 1;
    RecurrentBatch step = make_recurrent_batch(rng, one);
    for (int64_t n = 0; n < N; ++n)
      for (const auto& [src, dst] : {std::pair{&su.rb.q, &step.q},
                                     {&su.rb.k, &step.k},
                                     {&su.rb.v, &step.v},
                                     {&su.rb.g, &step.g},
                                     {&su.rb.beta, &step.beta}}) {
        const int64_t per = src->numel() / (N * T);
        for (int64_t e = 0; e < per; ++e)
          dst->set_linear(n * per + e, src->get_linear((n * T + t) * per + e));
      }
    for (int64_t e = 0; e < su.rb.A_log.numel(); ++e)
      step.A_log.set_linear(e, su.rb.A_log.get_linear(e));
    for (int64_t e = 0; e < su.rb.dt_bias.numel(); ++e)
      step.dt_bias.set_linear(e, su.rb.dt_bias.get_linear(e));
    deltastate::RecurrentArgs ra = step.args(host_view);
    ra.state = pool2.view();
    ra.state_indices = su.idx.view();
    ra.stride_contract = false;  // the envelope's slot pad is not FlashInfer's multiple of 16
    if (c.kda) deltastate::recurrent_kda(ra);
    else deltastate::recurrent_gdn(ra);
    for (int64_t n = 0; n < N; ++n) {
      if (su.slots[n] < 0) continue;
      SCOPED_TRACE("sequence " + std::to_string(n) + " token " + std::to_string(t));
      const std::vector<double> got = su.rb.out_token(n, t), plain = step.out_token(n, 0);
      const std::vector<double> state = inter_values(su, n, t),
                                plain_state = slot_values(pool2.view(), su.slots[n]);
      if (c.state == DType::f32) {
        EXPECT_EQ(got, plain);
        EXPECT_EQ(state, plain_state);
      } else {
        EXPECT_TRUE(all_close(got, plain, kOutTol, c.act, 2));
        // Plain decode rounds its state to 16 bits after every step, verify only on store.
        const Tol tol{state_tol(c.state).atol * 2 * (t + 1), 1e-2};
        EXPECT_TRUE(all_close(state, plain_state, tol));
      }
    }
  }
  for (int64_t n = 0; n < N; ++n) {
    if (su.slots[n] >= 0) {
      EXPECT_EQ(slot_values(su.pool.view(), su.slots[n]), inter_values(su, n, T - 1))
          << "the final state stored in place is the last intermediate state";
    }
  }
}

// FlashInfer's per-token slots (ssm_state_indices [B, T]) and vLLM's (spec_state_indices
// [N, T + 1] read from column num_accepted - 1): each token's state in its own pool slot.
TEST_P(VerifyChains, PerTokenSlots) {
  const VerifyCase& c = GetParam();
  ASSERT_FALSE(c.tree) << "instantiated with chains only";
  Rng rng = test_rng();
  VerifySetup su = make_setup(rng, c);
  const int64_t N = su.rb.N, cols = su.T_alloc;
  const Shape& s = c.shape;
  Tensor pool = make_pool(c.state, N * (cols + 1) + 2, s, 8, 4);
  Tensor table = Tensor::contiguous(DType::i32, {N, cols});
  Tensor accepted = Tensor::contiguous(DType::i64, {N});
  std::vector<int64_t> start(N);
  for (int64_t n = 0; n < N; ++n) {
    const int64_t a = rng.integer(1, cols);
    accepted.set({n}, a);
    for (int64_t t = 0; t < cols; ++t) table.set({n, t}, n * cols + t);
    if (n == 1 && N > 2) table.set({n, a - 1}, -1);             // padded
    if (n == 0 && su.rb.seq_len(0) > 1) table.set({0, 0}, -1);  // a skipped token, if not the start
    start[n] = static_cast<int64_t>(table.get({n, a - 1}));
    if (start[n] >= 0) fill_slot(pool.view(), start[n], rng);
  }
  VerifyArgs a = base_args(su);
  a.state = pool.view();
  a.token_state_indices = table.view();
  a.num_accepted_tokens = accepted.view();
  std::vector<ref::VerifyResult> want(N);
  for (int64_t n = 0; n < N; ++n)
    if (start[n] >= 0) want[n] = reference_of(su, n, slot_values(pool.view(), start[n]), false);
  su.rb.poison_out();
  Snapshot before;
  before.add(pool);
  deltastate::verify(a);
  std::vector<MemRange> written;
  for (int64_t n = 0; n < N; ++n) {
    SCOPED_TRACE("sequence " + std::to_string(n));
    for (int64_t t = 0; t < su.rb.seq_len(n); ++t) {
      if (start[n] < 0) {
        EXPECT_TRUE(all_zero(su.rb.out_token(n, t)));
        continue;
      }
      EXPECT_TRUE(all_close(su.rb.out_token(n, t), want[n].out[t], kOutTol, c.act));
      const int64_t slot = static_cast<int64_t>(table.get({n, t}));
      if (slot < 0) continue;
      EXPECT_TRUE(all_close(slot_values(pool.view(), slot), want[n].states[t], state_tol(c.state)))
          << "token " << t;
      written.push_back(slot_range(pool.view(), slot));
    }
  }
  EXPECT_TRUE(before.unchanged_except(written));
}

// FlashInfer's output_state_indices: the final state goes to another slot, the source stays.
TEST_P(VerifyChains, OutputSlots) {
  const VerifyCase& c = GetParam();
  ASSERT_FALSE(c.tree) << "instantiated with chains only";
  Rng rng = test_rng();
  VerifySetup su = make_setup(rng, c);
  const int64_t N = su.rb.N;
  std::vector<int64_t> dst;
  for (int64_t n = 0; n < N; ++n) dst.push_back(su.slots[n] < 0 ? -1 : (n == 0 ? -1 : -2));
  // Destinations: the slots nobody starts from, and one sequence (0) storing nothing.
  std::vector<int64_t> free_slots;
  for (int64_t sl = 0; sl < N + 3; ++sl)
    if (std::find(su.slots.begin(), su.slots.end(), sl) == su.slots.end()) free_slots.push_back(sl);
  size_t next = 0;
  for (int64_t n = 0; n < N; ++n)
    if (dst[n] == -2) dst[n] = next < free_slots.size() ? free_slots[next++] : -1;
  Tensor out_idx = index_tensor(dst, DType::i64);
  VerifyArgs a = base_args(su);
  a.state_indices = su.idx.view();
  a.output_state_indices = out_idx.view();
  std::vector<ref::VerifyResult> want(N);
  for (int64_t n = 0; n < N; ++n)
    if (su.slots[n] >= 0)
      want[n] = reference_of(su, n, slot_values(su.pool.view(), su.slots[n]), false);
  su.rb.poison_out();
  Snapshot before;
  before.add(su.pool);
  deltastate::verify(a);
  std::vector<MemRange> written;
  for (int64_t n = 0; n < N; ++n) {
    if (su.slots[n] < 0 || dst[n] < 0 || su.rb.seq_len(n) == 0) continue;
    EXPECT_TRUE(
        all_close(slot_values(su.pool.view(), dst[n]), want[n].states.back(), state_tol(c.state)));
    written.push_back(slot_range(su.pool.view(), dst[n]));
  }
  EXPECT_TRUE(before.unchanged_except(written));
}

// FlashInfer's initial_state_source: a read-only source pool [N + 2, HV, V, K] (an envelope of
// sentinels, its own slot stride) with live rows in random order, one sequence padded by a row
// < 0, its row indices a strided int64 view (every other entry of a [N, 2] table).
struct SourceSetup {
  Tensor pool, table;
  std::vector<int64_t> row_of;
  std::vector<ref::State> rows;  // every row's values, for the reference
  TensorView indices() const {
    const TensorView t = table.view();
    return TensorView::strided(t.data, t.dtype, {t.shape[0]}, {t.stride[0]});
  }
};

SourceSetup make_source(Rng& rng, const VerifyCase& c, int64_t N) {
  SourceSetup src;
  src.pool = make_pool(c.state, N + 2, c.shape, /*slot_pad=*/40, /*lead=*/16);
  src.row_of = pick_slots(rng, N, N + 2, {N - 1});
  fill_live_slots(src.pool.view(), src.row_of, rng);
  src.table = Tensor::contiguous(DType::i64, {N, 2});
  for (int64_t n = 0; n < N; ++n) {
    src.table.set({n, 0}, src.row_of[n]);
    src.table.set({n, 1}, 1000 + n);  // never read
  }
  for (int64_t r = 0; r < N + 2; ++r) src.rows.push_back(slot_values(src.pool.view(), r));
  return src;
}

ref::VerifyResult reference_from(const VerifySetup& su, int64_t n, const SourceSetup& src,
                                 bool tree) {
  std::vector<ref::Token> tokens;
  for (int64_t t = 0; t < su.rb.seq_len(n); ++t) tokens.push_back(su.rb.token(n, t));
  std::vector<int> parents;
  if (tree) parents.assign(su.parent_of[n].begin(), su.parent_of[n].begin() + tokens.size());
  const DType stored = su.inter.view().dtype;  // a tree's parent states are read back as stored
  return ref::verify_from_pool(su.rb.config(su.scale), tokens, src.rows, src.row_of[n], parents,
                               [stored](double x) { return round_to(stored, x); });
}

// FlashInfer's speculative decode with initial_state_source: each sequence starts from its row
// of the read-only source pool (never from the pool, which holds only sentinels here), the state
// after token t goes to pool slot [n, t] (< 0: skipped); the source stays bit-untouched.
TEST_P(VerifyChains, SourcePoolPerTokenSlots) {
  const VerifyCase& c = GetParam();
  ASSERT_FALSE(c.tree) << "instantiated with chains only";
  Rng rng = test_rng();
  VerifySetup su = make_setup(rng, c);
  const int64_t N = su.rb.N, cols = su.T_alloc;
  Tensor pool = make_pool(c.state, N * cols + 2, c.shape, 8, 4);
  Tensor table = Tensor::contiguous(DType::i32, {N, cols});
  for (int64_t n = 0; n < N; ++n)
    for (int64_t t = 0; t < cols; ++t) table.set({n, t}, n * cols + t + 1);
  if (su.rb.seq_len(0) > 1) table.set({0, 1}, -1);  // a skipped token
  const SourceSetup src = make_source(rng, c, N);
  VerifyArgs a = base_args(su);
  a.state = pool.view();
  a.token_state_indices = table.view();
  a.source_state = src.pool.view();
  a.source_state_indices = src.indices();
  std::vector<ref::VerifyResult> want(N);
  for (int64_t n = 0; n < N; ++n) want[n] = reference_from(su, n, src, false);
  su.rb.poison_out();
  Snapshot before, source_before;
  before.add(pool);
  source_before.add(src.pool).add(src.table);
  deltastate::verify(a);
  EXPECT_TRUE(source_before.unchanged()) << "the read-only source pool";
  std::vector<MemRange> written;
  for (int64_t n = 0; n < N; ++n) {
    SCOPED_TRACE("sequence " + std::to_string(n));
    for (int64_t t = 0; t < su.rb.seq_len(n); ++t) {
      SCOPED_TRACE("token " + std::to_string(t));
      if (src.row_of[n] < 0) {
        EXPECT_TRUE(all_zero(su.rb.out_token(n, t)));
        continue;
      }
      EXPECT_TRUE(all_close(su.rb.out_token(n, t), want[n].out[t], kOutTol, c.act));
      const int64_t slot = static_cast<int64_t>(table.get({n, t}));
      if (slot < 0) continue;
      EXPECT_TRUE(all_close(slot_values(pool.view(), slot), want[n].states[t], state_tol(c.state)));
      written.push_back(slot_range(pool.view(), slot));
    }
  }
  EXPECT_TRUE(before.unchanged_except(written)) << "pool memory outside the per-token slots";
}

// A source pool with scratch rows (trees reload the initial state from the source for a parent
// < 0) and the final state stored in place at state_indices (FlashInfer's standard decode): the
// pool's live slots are never read (their values differ from the source's), a sequence whose
// state_indices entry is < 0 runs but stores no final state, one padded by its source row < 0
// stores nothing at all.
TEST_P(VerifyVsReference, SourcePoolScratchRowsAndHomeSlot) {
  const VerifyCase& c = GetParam();
  Rng rng = test_rng();
  VerifySetup su = make_setup(rng, c);
  const int64_t N = su.rb.N;
  const SourceSetup src = make_source(rng, c, N);
  VerifyArgs a = base_args(su);
  a.state_indices = su.idx.view();
  a.update_state = true;
  a.intermediate_states = su.inter.view();
  a.intermediate_state_indices = su.rows.view();
  if (c.tree) a.parent_tokens = su.parents.view();
  a.source_state = src.pool.view();
  a.source_state_indices = src.indices();
  std::vector<ref::VerifyResult> want(N);
  for (int64_t n = 0; n < N; ++n) want[n] = reference_from(su, n, src, c.tree);
  su.rb.poison_out();
  Snapshot pool_before, inter_before, source_before;
  pool_before.add(su.pool);
  inter_before.add(su.inter);
  source_before.add(src.pool).add(src.table);
  deltastate::verify(a);
  EXPECT_TRUE(source_before.unchanged()) << "the read-only source pool";
  std::vector<MemRange> steps, homes;
  for (int64_t n = 0; n < N; ++n) {
    SCOPED_TRACE("sequence " + std::to_string(n));
    const int64_t len = su.rb.seq_len(n);
    for (int64_t t = 0; t < len; ++t) {
      SCOPED_TRACE("token " + std::to_string(t));
      EXPECT_TRUE(all_close(su.rb.out_token(n, t), want[n].out[t], kOutTol, c.act));
      if (src.row_of[n] < 0) continue;
      EXPECT_TRUE(
          all_close(inter_values(su, su.row_of[n], t), want[n].states[t], state_tol(c.state)));
      steps.push_back(inter_range(su, su.row_of[n], t));
    }
    if (src.row_of[n] < 0 || su.slots[n] < 0 || len == 0) continue;
    EXPECT_TRUE(all_close(slot_values(su.pool.view(), su.slots[n]), want[n].states.back(),
                          state_tol(c.state)));
    homes.push_back(slot_range(su.pool.view(), su.slots[n]));
  }
  EXPECT_TRUE(inter_before.unchanged_except(steps)) << "scratch memory outside the written steps";
  EXPECT_TRUE(pool_before.unchanged_except(homes)) << "pool memory outside the final slots";
}

const VerifyCase kCases[] = {
    {{"gdn_qwen3next_f32", kQwen3Next, false, kNoLb, f32, bf16}, 3, 4, {}},
    {{"gdn_qwen3next_bf16_state", kQwen3Next, false, kNoLb, bf16, bf16}, 3, 4, {}},
    {{"gdn_tree_f32", kQwen3Next, false, kNoLb, f32, f32}, 3, 6, {}, true},
    {{"kda_kimi_f32", kKimi, true, kNoLb, f32, bf16}, 2, 3, {}},
    {{"kda_safe_gate_tree", kKimi, true, kLb, f32, f32}, 2, 5, {}, true},
    {{"gdn_odd_varlen", kOdd, false, kNoLb, f32, f32}, 1, 0, {3, 1, 0, 5, 2}},
    {{"kda_odd_varlen_tree_bf16", kOdd, true, kNoLb, bf16, f32}, 1, 0, {2, 4, 3}, true},
    {{"gdn_KgtV_T8", kKgtV, false, kNoLb, f32, f16}, 4, 8, {}},
};
INSTANTIATE_TEST_SUITE_P(Cases, VerifyVsReference, ::testing::ValuesIn(kCases),
                         case_name<VerifyCase>);

std::vector<VerifyCase> cases_where(bool (*keep)(const VerifyCase&)) {
  std::vector<VerifyCase> out;
  for (const VerifyCase& c : kCases)
    if (keep(c)) out.push_back(c);
  return out;
}
INSTANTIATE_TEST_SUITE_P(Cases, VerifyChains,
                         ::testing::ValuesIn(cases_where([](const VerifyCase& c) {
                           return !c.tree;
                         })),
                         case_name<VerifyCase>);
INSTANTIATE_TEST_SUITE_P(Cases, VerifyUniformChains,
                         ::testing::ValuesIn(cases_where([](const VerifyCase& c) {
                           return !c.tree && c.seqlens.empty();
                         })),
                         case_name<VerifyCase>);

// ---- errors
// --------------------------------------------------------------------------------------
struct ErrorCase {
  const char* what;
  std::function<void(VerifyArgs&, VerifySetup&)> mutate;
  std::string text;
};

TEST(VerifyContract, EveryErrorText) {
  Rng rng = test_rng();
  const VerifyCase c{{"gdn", kOdd, false, kNoLb, f32, f32}, 3, 4, {}};
  VerifySetup su = make_setup(rng, c);
  static Tensor t_bad2d = Tensor::contiguous(DType::i32, {3, 2});
  static Tensor t_short = Tensor::contiguous(DType::i32, {2});
  static Tensor t_float = Tensor::contiguous(DType::f32, {3});
  static Tensor t_big = index_tensor({0, 99, 1});
  static Tensor t_acc = index_tensor({1, 0, 1});
  static Tensor t_tbl = Tensor::contiguous(DType::i32, {3, 5});
  static Tensor t_par = Tensor::contiguous(DType::i32, {3, 4});
  static Tensor t_rows_big = index_tensor({0, 1, 7});
  static Tensor t_inter4 = Tensor::contiguous(DType::f32, {3, 6, 48, 32});
  static Tensor t_inter_short = Tensor::contiguous(DType::f32, {5, 3, 6, 48, 32});
  static Tensor t_inter16 = Tensor::contiguous(DType::bf16, {5, 5, 6, 48, 32});
  static Tensor t_inter_two = Tensor::contiguous(DType::f32, {2, 5, 6, 48, 32});
  static Tensor t_inter_strided =
      Tensor::strided(DType::f32, {5, 5, 6, 48, 32}, {5 * 9216, 9216, 1536, 1, 48});
  static Tensor t_src = Tensor::contiguous(DType::f32, {4, 6, 48, 32});
  static Tensor t_src16 = Tensor::contiguous(DType::bf16, {4, 6, 48, 32});
  static Tensor t_src_rows = index_tensor({2, -1, 0}, DType::i64);
  static Tensor t_src_all = index_tensor({0, 1, 2});
  for (int64_t t = 0; t < 5; ++t)
    for (int64_t n = 0; n < 3; ++n) t_tbl.set({n, t}, n * 5 + t);
  t_par.fill_all(0);
  t_par.set({2, 3}, 3);
  const std::vector<ErrorCase> cases = {
      {"GDN 4-D g",
       [](VerifyArgs& a, VerifySetup&) {
         a.g.ndim = 4;
         a.g.shape[3] = 32;
         a.g.stride[3] = 1;
       },
       "verify: a GDN gate has one value per value head: `g` must be [B, T, HV]"},
      {"state ndim", [](VerifyArgs& a, VerifySetup&) { a.state = t_inter_short.view(); },
       "`state` must be a 4D tensor [slots, HV, V, K] (got ndim=5)."},
      {"state inner dims",
       [](VerifyArgs& a, VerifySetup&) {
         a.state = t_inter4.view();
         a.state.ndim = 4;
         a.state.shape[3] = 48;
       },
       "`state` must have inner dims [HV, V, K]=(6, 48, 32); got (3, 6, 48, 48)"},
      {"state strides",
       [](VerifyArgs& a, VerifySetup&) { a.state = sub_view(t_inter_strided.view(), 0); },
       "`state` must be contiguous in its [HV, V, K] inner dimensions; got strides (9216, 1536, 1, "
       "48)"},
      {"indices shape", [](VerifyArgs& a, VerifySetup&) { a.state_indices = t_short.view(); },
       "`state_indices` must have shape [N]=(3,); got (2,)"},
      {"indices dtype", [](VerifyArgs& a, VerifySetup&) { a.state_indices = t_float.view(); },
       "`state_indices` must have dtype int32 or int64; got float32"},
      {"slot range", [](VerifyArgs& a, VerifySetup&) { a.state_indices = t_big.view(); },
       "`state_indices`[1]=99 is out of range for a state pool of 6 slots (valid: 0..5; < 0 marks "
       "a padded row)"},
      {"table shape", [](VerifyArgs& a, VerifySetup&) { a.token_state_indices = t_short.view(); },
       "`token_state_indices` must have shape [N, >= T]=(3, >= 1); got (2,)"},
      {"table columns", [](VerifyArgs& a, VerifySetup&) { a.token_state_indices = t_bad2d.view(); },
       "sequence 0 has 4 tokens but `token_state_indices` has 2 columns"},
      {"accepted without table",
       [](VerifyArgs& a, VerifySetup&) { a.num_accepted_tokens = t_acc.view(); },
       "`num_accepted_tokens` selects each sequence's starting slot from `token_state_indices`, "
       "which was not given"},
      {"accepted and indices",
       [](VerifyArgs& a, VerifySetup&) {
         a.num_accepted_tokens = t_acc.view();
         a.token_state_indices = t_tbl.view();
       },
       "`state_indices` and `num_accepted_tokens` both choose the starting slot; give one"},
      {"accepted range",
       [](VerifyArgs& a, VerifySetup&) {
         a.state_indices.reset();
         a.num_accepted_tokens = t_acc.view();
         a.token_state_indices = t_tbl.view();
       },
       "`num_accepted_tokens`[1]=0 must be within [1, 5] (the columns of `token_state_indices`)"},
      {"table slot range",
       [](VerifyArgs& a, VerifySetup&) {
         a.state_indices.reset();
         a.token_state_indices = t_tbl.view();
       },
       "`token_state_indices`[1, 1]=6 is out of range for a state pool of 6 slots (valid: 0..5; < "
       "0 marks a padded row)"},
      {"output and table",
       [](VerifyArgs& a, VerifySetup&) {
         a.output_state_indices = t_acc.view();
         a.token_state_indices = t_tbl.view();
       },
       "`output_state_indices` and `token_state_indices` both place states in the pool; with "
       "per-token slots the last token's slot holds the final state"},
      {"output range", [](VerifyArgs& a, VerifySetup&) { a.output_state_indices = t_big.view(); },
       "`output_state_indices`[1]=99 is out of range for a state pool of 6 slots (valid: 0..5; < 0 "
       "marks a padded row)"},
      {"output duplicate",
       [](VerifyArgs& a, VerifySetup&) { a.output_state_indices = t_acc.view(); },
       "`output_state_indices` uses slot 1 for rows 0 and 2; each live row needs its own slot"},
      {"rows without buffer",
       [](VerifyArgs& a, VerifySetup& su) {
         a.intermediate_states.reset();
         a.intermediate_state_indices = su.rows.view();
       },
       "`intermediate_state_indices` index an `intermediate_states` buffer, which was not given"},
      {"rows count",
       [](VerifyArgs& a, VerifySetup&) { a.intermediate_state_indices = t_short.view(); },
       "The number of intermediate state indices is expected to be equal to the number of input "
       "sequences, i.e., 3 != 2."},
      {"row range",
       [](VerifyArgs& a, VerifySetup&) { a.intermediate_state_indices = t_rows_big.view(); },
       "`intermediate_state_indices`[2]=7 is out of range for an intermediate-state buffer of 5 "
       "rows (valid: 0..4; < 0 marks a padded row)"},
      {"buffer ndim",
       [](VerifyArgs& a, VerifySetup&) {
         a.intermediate_states = t_inter4.view();
         a.intermediate_states->ndim = 4;
       },
       "`intermediate_states` must be a 5D tensor [N_scr, T_alloc, HV, V, K] (got ndim=4)."},
      {"buffer dtype",
       [](VerifyArgs& a, VerifySetup&) { a.intermediate_states = t_inter16.view(); },
       "`intermediate_states` must have the dtype of `state` (float32); got bfloat16"},
      {"buffer steps",
       [](VerifyArgs& a, VerifySetup&) { a.intermediate_states = t_inter_short.view(); },
       "sequence 0 has 4 tokens but `intermediate_states` holds 3 steps per row"},
      {"tree without buffer",
       [](VerifyArgs& a, VerifySetup& su) {
         a.intermediate_states.reset();
         a.intermediate_state_indices.reset();
         a.parent_tokens = su.parents.view();
       },
       "`parent_tokens` (an EAGLE tree) needs `intermediate_states`: each token reads its parent's "
       "state back from there"},
      {"parent columns", [](VerifyArgs& a, VerifySetup&) { a.parent_tokens = t_bad2d.view(); },
       "sequence 0 has 4 tokens but `parent_tokens` has 2 columns"},
      {"batch rows",
       [](VerifyArgs& a, VerifySetup&) {
         a.intermediate_state_indices.reset();
         a.intermediate_states = t_inter_two.view();
       },
       "`intermediate_states`[2]=2 is out of range for an intermediate-state buffer of 2 rows "
       "(valid: 0..1; < 0 marks a padded row)"},
      {"pool for slot n",
       [](VerifyArgs& a, VerifySetup&) {
         a.state_indices.reset();
         a.state = sub_view(t_inter_short.view(), 0);
         a.state.shape[0] = 2;
       },
       "without `state_indices` sequence n starts from slot n: the pool needs at least N=3 slots "
       "(got 2)"},
      {"parent order", [](VerifyArgs& a, VerifySetup&) { a.parent_tokens = t_par.view(); },
       "`parent_tokens`[2, 3]=3 must be an earlier token (< 3), or < 0 for the initial state"},
      {"source without its indices",
       [](VerifyArgs& a, VerifySetup&) { a.source_state = t_src.view(); },
       "`source_state` and `source_state_indices` must be given together: the start pool and "
       "each sequence's row in it"},
      {"source indices without the source",
       [](VerifyArgs& a, VerifySetup&) { a.source_state_indices = t_src_rows.view(); },
       "`source_state` and `source_state_indices` must be given together: the start pool and "
       "each sequence's row in it"},
      {"source and accepted",
       [](VerifyArgs& a, VerifySetup&) {
         a.state_indices.reset();
         a.num_accepted_tokens = t_acc.view();
         a.token_state_indices = t_tbl.view();
         a.source_state = t_src.view();
         a.source_state_indices = t_src_rows.view();
       },
       "`source_state_indices` and `num_accepted_tokens` both choose the starting state; give "
       "one"},
      {"source ndim",
       [](VerifyArgs& a, VerifySetup&) {
         a.source_state = t_inter_short.view();
         a.source_state_indices = t_src_rows.view();
       },
       "`source_state` must be a 4D tensor [N0, HV, V, K] (got ndim=5)."},
      {"source inner dims",
       [](VerifyArgs& a, VerifySetup&) {
         a.source_state = t_inter4.view();
         a.source_state->ndim = 4;
         a.source_state->shape[3] = 48;
         a.source_state_indices = t_src_rows.view();
       },
       "`source_state` must have inner dims [HV, V, K]=(6, 48, 32); got (3, 6, 48, 48)"},
      {"source strides",
       [](VerifyArgs& a, VerifySetup&) {
         a.source_state = sub_view(t_inter_strided.view(), 0);
         a.source_state_indices = t_src_rows.view();
       },
       "`source_state` must be contiguous in its [HV, V, K] inner dimensions; got strides (9216, "
       "1536, 1, 48)"},
      {"source dtype",
       [](VerifyArgs& a, VerifySetup&) {
         a.source_state = t_src16.view();
         a.source_state_indices = t_src_rows.view();
       },
       "`source_state` must have the dtype of `state` (float32); got bfloat16"},
      {"source indices shape",
       [](VerifyArgs& a, VerifySetup&) {
         a.source_state = t_src.view();
         a.source_state_indices = t_short.view();
       },
       "`source_state_indices` must have shape [N]=(3,); got (2,)"},
      {"source indices dtype",
       [](VerifyArgs& a, VerifySetup&) {
         a.source_state = t_src.view();
         a.source_state_indices = t_float.view();
       },
       "`source_state_indices` must have dtype int32 or int64; got float32"},
      {"source row range",
       [](VerifyArgs& a, VerifySetup&) {
         a.source_state = t_src.view();
         a.source_state_indices = t_big.view();
       },
       "`source_state_indices`[1]=99 is out of range for a source state pool of 4 rows (valid: "
       "0..3; < 0 marks a padded row)"},
      {"final slot range with a source",
       [](VerifyArgs& a, VerifySetup&) {
         a.source_state = t_src.view();
         a.source_state_indices = t_src_all.view();
         a.state_indices = t_big.view();
       },
       "`state_indices`[1]=99 is out of range for a state pool of 6 slots (valid: 0..5; < 0 marks "
       "a padded row)"},
      {"pool for slot n with a source",
       [](VerifyArgs& a, VerifySetup&) {
         a.state_indices.reset();
         a.state = sub_view(t_inter_short.view(), 0);
         a.state.shape[0] = 2;
         a.source_state = t_src.view();
         a.source_state_indices = t_src_rows.view();
       },
       "without `state_indices` sequence n stores its final state to slot n: the pool needs at "
       "least N=3 slots (got 2)"},
  };
  for (const ErrorCase& e : cases) {
    SCOPED_TRACE(e.what);
    VerifyArgs a = base_args(su);
    a.state_indices = su.idx.view();
    a.intermediate_states = su.inter.view();
    a.intermediate_state_indices = su.rows.view();
    e.mutate(a, su);
    Snapshot before;
    before.add(su.pool).add(su.inter).add(t_src);
    const auto err = catch_error([&] { deltastate::verify(a); });
    ASSERT_TRUE(err.has_value());
    EXPECT_EQ(std::string(err->what()), e.text);
    EXPECT_TRUE(before.unchanged());
  }
}

TEST(CommitContract, EveryErrorText) {
  const Shape s = kOdd;
  Tensor pool = make_pool(f32, 4, s);
  Tensor inter = Tensor::contiguous(f32, {3, 2, s.HV, s.V, s.K});
  Tensor inter16 = Tensor::contiguous(bf16, {3, 2, s.HV, s.V, s.K});
  Tensor layered_pool = Tensor::contiguous(f32, {2, 4, s.HV, s.V, s.K});
  Tensor layered_inter = Tensor::contiguous(f32, {3, 3, 2, s.HV, s.V, s.K});
  Tensor idx = index_tensor({0, 1, 2}), idx_big = index_tensor({0, 9, 2}),
         idx_dup = index_tensor({1, 1, 2});
  Tensor acc = index_tensor({1, 2, 0}), acc_big = index_tensor({1, 3, 0}),
         short_idx = index_tensor({0});
  Tensor rows_big = index_tensor({0, 1, 5});
  struct E {
    const char* what;
    std::function<void(CommitArgs&)> mutate;
    std::string text;
  };
  const std::vector<E> cases = {
      {"state ndim",
       [&](CommitArgs& a) {
         a.state = inter.view();
         a.state.ndim = 3;
       },
       "`state` must be [layers, slots, HV, V, K] or [slots, HV, V, K] (got ndim=3)."},
      {"indices ndim", [&](CommitArgs& a) { a.state_indices = inter.view(); },
       "`state_indices` must be 1D [B] (got ndim=5)."},
      {"buffer ndim", [&](CommitArgs& a) { a.intermediate_states = pool.view(); },
       "`intermediate_states` must be [N_scr, T_alloc, HV, V, K] (got ndim=4)."},
      {"layers",
       [&](CommitArgs& a) {
         a.state = layered_pool.view();
         a.intermediate_states = layered_inter.view();
       },
       "`intermediate_states` has 3 layers and `state` 2; they must match"},
      {"dtype", [&](CommitArgs& a) { a.intermediate_states = inter16.view(); },
       "`intermediate_states` must have the dtype of `state` (float32); got bfloat16"},
      {"accepted shape", [&](CommitArgs& a) { a.accepted = short_idx.view(); },
       "`accepted` must have shape [N]=(3,); got (1,)"},
      {"slot range", [&](CommitArgs& a) { a.state_indices = idx_big.view(); },
       "`state_indices`[1]=9 is out of range for a state pool of 4 slots (valid: 0..3; < 0 marks a "
       "padded row)"},
      {"row range",
       [&](CommitArgs& a) {
         a.intermediate_state_indices = rows_big.view();
         a.accepted = idx.view();
       },
       "`intermediate_state_indices`[2]=5 is out of range for an intermediate-state buffer of 3 "
       "rows (valid: 0..2; < 0 marks a padded row)"},
      {"step range", [&](CommitArgs& a) { a.accepted = acc_big.view(); },
       "`accepted`[1]=3 needs step 2 but `intermediate_states` holds 2 steps per row"},
      {"duplicate", [&](CommitArgs& a) { a.state_indices = idx_dup.view(); },
       "`state_indices` uses slot 1 for rows 0 and 1; each live row needs its own slot"},
  };
  for (const E& e : cases) {
    SCOPED_TRACE(e.what);
    CommitArgs a;
    a.state = pool.view();
    a.intermediate_states = inter.view();
    a.state_indices = idx.view();
    a.accepted = acc.view();
    e.mutate(a);
    Snapshot before;
    before.add(pool).add(layered_pool);
    const auto err = catch_error([&] { deltastate::update_state_after_verify(a); });
    ASSERT_TRUE(err.has_value());
    EXPECT_EQ(std::string(err->what()), e.text);
    EXPECT_TRUE(before.unchanged());
  }
}

// The commit over several layers of an envelope pool, SGLang's step convention, padding.
TEST(Commit, LayersOfAnEnvelopeWithSteps) {
  Rng rng = test_rng();
  const Shape s = kOdd;
  const int64_t layers = 3, slots = 5, he = s.state_elems();
  // Page-major: slot j of layer l at j*(layers*he + 32) + l*he + 8.
  const int64_t slot_stride = layers * he + 32;
  Tensor env = Tensor::strided(bf16, {layers, slots, s.HV, s.V, s.K},
                               {he, slot_stride, s.V * s.K, s.K, 1}, 8, slots * slot_stride + 8);
  env.fill_all(kSentinel);
  Tensor inter = Tensor::contiguous(bf16, {layers, 4, 3, s.HV, s.V, s.K});
  inter.fill_uniform(rng, -1, 1);
  Tensor idx = index_tensor({3, -1, 0, 4}), steps = index_tensor({2, 1, -1, 0});
  CommitArgs a;
  a.state = env.view();
  a.intermediate_states = inter.view();
  a.state_indices = idx.view();
  a.accepted = steps.view();
  a.accepted_is_step = true;
  Snapshot before;
  before.add(env);
  deltastate::update_state_after_verify(a);
  std::vector<MemRange> moved;
  for (int64_t l = 0; l < layers; ++l)
    for (const auto& [b, slot, step] : {std::tuple{0, 3, 2}, {3, 4, 0}}) {
      const int64_t off = l * he + slot * slot_stride;
      EXPECT_EQ(view_values(env.view(), off, he),
                view_values(inter.view(), (l * 4 + b) * 3 * he + step * he, he));
      moved.push_back(range_of(env.view(), off, he));
    }
  EXPECT_TRUE(before.unchanged_except(moved));
}

}  // namespace
}  // namespace dstest
