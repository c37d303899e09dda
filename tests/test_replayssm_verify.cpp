// ReplaySSM speculative verify (replayssm_verify) and its cursor commit (replayssm_commit) on the
// CPU: against the fp64 reference (the committed records replayed onto the checkpoint, then the
// drafts through the delta rule, written plainly here on ref's gates and norms), and against
// the intermediate-state verify (verify + update_state_after_verify) over 200 random
// accept/reject steps with forced folds: bit for bit with fp32 checkpoints and rings, within
// tolerance with bf16 checkpoints or 16-bit rings. Every step checks that the verify writes
// nothing but the outputs, the drafts' ring records and (on a fold) the checkpoint: rejected
// drafts leave the committed records and the checkpoint bit-unchanged, sentinel-filled slots and
// envelope gaps stay untouched. Padded sequences, strided pools, circular rings with a random
// origin, varlen batches, and every error text.
#include <cmath>
#include <cstring>
#include <functional>
#include <string>

#include "float_format.h"
#include "test_util.h"
#include "view_edits.h"

namespace dstest {
namespace {

using deltastate::ErrorKind;
using deltastate::ReplayCommitArgs;
using deltastate::ReplayVerifyArgs;
using deltastate::StateRounding;

struct RvCase : OpCase {
  DType ring;  // d_cache and k_cache
  int L, T;    // ring length, most drafts per step
  bool varlen;
  int steps;
  bool exact() const { return state == DType::f32 && ring == DType::f32; }
};
void PrintTo(const RvCase& c, std::ostream* os) { *os << c.name; }

// The setup of a run: a strided checkpoint pool (sentinel outside the live slots), its twin for
// the intermediate-state verify, rings, slot-keyed cursors with random ring origins.
struct Sim {
  RvCase c;
  int64_t N = 0, S = 0;
  std::vector<int64_t> slots;
  Tensor ck, plain, idx, write_pos, cache_base, is_flush;
  Rings rings;
  // the cursors as the test expects them
  std::vector<int64_t> wp, base, flush;

  Sim(Rng& rng, const RvCase& cs, int64_t n) : c(cs), N(n), S(n + 3) {
    ck = make_pool(c.state, S, c.shape, /*slot_pad=*/24, /*lead=*/8);
    plain = make_pool(c.state, S, c.shape);
    slots = pick_slots(rng, N, S, {N > 2 ? 1 : -1});
    for (int64_t s : slots)
      if (s >= 0) {
        fill_slot(ck.view(), s, rng);
        set_slot_values(plain.view(), s, slot_values(ck.view(), s));
      }
    idx = index_tensor(slots);
    rings = make_rings(c.shape, c.kda, S, c.L, c.ring, c.ring);
    wp.assign(S, 0);
    base.assign(S, 0);
    flush.assign(S, 0);
    for (int64_t s : slots)
      if (s >= 0) base[s] = rng.integer(0, c.L - 1);
    write_pos = index_tensor(wp);
    cache_base = index_tensor(base);
    is_flush = index_tensor(flush);
  }
  void push_cursors() {
    for (int64_t s = 0; s < S; ++s) {
      write_pos.set({s}, static_cast<double>(wp[s]));
      cache_base.set({s}, static_cast<double>(base[s]));
      is_flush.set({s}, static_cast<double>(flush[s]));
    }
  }
  RecurrentBatch batch(Rng& rng) const {
    std::vector<int64_t> lens;
    for (int64_t n = 0; n < N; ++n) lens.push_back(c.varlen ? rng.integer(1, c.T) : c.T);
    RecurrentSpec spec = recurrent_spec(c.shape, c.kda, c.act, c.varlen ? 1 : N, c.T,
                                        c.varlen ? lens : std::vector<int64_t>{});
    spec.lower_bound = c.lower_bound;
    return make_recurrent_batch(rng, spec);
  }
  ReplayVerifyArgs args(const RecurrentBatch& rb) const {
    return args(rb, ck, rings, write_pos, cache_base, is_flush);
  }
  // The same over other tensors of the run's shapes (copies of its checkpoint, rings, cursors).
  ReplayVerifyArgs args(const RecurrentBatch& rb, const Tensor& state, const Rings& r,
                        const Tensor& wp_t, const Tensor& base_t, const Tensor& flush_t) const {
    ReplayVerifyArgs a = replay_verify_inputs(rb.args(host_view), c.kda);
    a.state = state.view();
    a.state_indices = idx.view();
    a.d_cache = r.d.view();
    a.k_cache = r.k.view();
    a.g_cache = r.g.view();
    a.write_pos = wp_t.view();
    a.cache_base = base_t.view();
    a.is_flush = flush_t.view();
    return a;
  }
  int64_t pos(int64_t s, int64_t logical) const { return (base[s] + logical) % c.L; }
  // What a verify may write for sequence n with `len` drafts: their ring records, and the
  // checkpoint slot on a fold.
  void writable(int64_t n, int64_t len, std::vector<MemRange>& out) const {
    const int64_t s = slots[n];
    const Shape& sh = c.shape;
    const int gw = c.kda ? sh.K : 1;
    for (int64_t t = 0; t < len; ++t) {
      const int64_t p = pos(s, wp[s] + t);
      for (int hv = 0; hv < sh.HV; ++hv) {
        out.push_back(range_of(rings.d.view(), ((s * sh.HV + hv) * c.L + p) * sh.V, sh.V));
        out.push_back(range_of(rings.g.view(), ((s * sh.HV + hv) * c.L + p) * gw, gw));
      }
      for (int h = 0; h < sh.H; ++h)
        out.push_back(range_of(rings.k.view(), ((s * sh.H + h) * c.L + p) * sh.K, sh.K));
    }
    if (flush[s] && wp[s] > 0) out.push_back(slot_range(ck.view(), s));
  }
  // The cursor rule of the commit (ops.h ReplayCommitArgs).
  void commit_model(int64_t s, int64_t a) {
    if (flush[s]) {
      if (a > 0) base[s] = (base[s] + wp[s]) % c.L;
      wp[s] = a;
    } else {
      wp[s] += a;
    }
    flush[s] = wp[s] + 2 * c.T > c.L;
  }
};

// The fp64 reference of one sequence: the checkpoint, the m committed records replayed oldest
// first (S <- exp(g) S + d k^T per value head), the fold state, then each draft's step with its
// record (u, k, g).
struct RefRun {
  ref::State folded;
  std::vector<std::vector<double>> out, u, k, g;  // [t][HV*V], [t][HV*V], [t][H*K], [t][HV*gw]
};
RefRun reference_run(const ref::Config& cfg, ref::State S, const ref::Ring& ring, int64_t base,
                     int64_t m, const std::vector<ref::Token>& drafts) {
  const int HV = cfg.HV, H = cfg.H, K = cfg.K, V = cfg.V, L = ring.L, gw = cfg.gate_width();
  for (int64_t j = 0; j < m; ++j) {
    const int64_t p = (base + j) % L;
    for (int hv = 0; hv < HV; ++hv) {
      const int h = hv / cfg.group();
      for (int r = 0; r < V; ++r)
        for (int i = 0; i < K; ++i) {
          double& x = S[(static_cast<int64_t>(hv) * V + r) * K + i];
          const double g = ring.g[(static_cast<int64_t>(hv) * L + p) * gw + (cfg.kda ? i : 0)];
          x = std::exp(g) * x + ring.d[(static_cast<int64_t>(hv) * L + p) * V + r] *
                                    ring.k[(static_cast<int64_t>(h) * L + p) * K + i];
        }
    }
  }
  RefRun res;
  res.folded = S;
  for (const ref::Token& tok : drafts) {
    std::vector<double> o(static_cast<size_t>(HV) * V), u(o.size()), gs;
    std::vector<double> ks;
    for (int h = 0; h < H; ++h) {
      const std::vector<double> kh = ref::prepared_k(cfg, tok, h);
      ks.insert(ks.end(), kh.begin(), kh.end());
    }
    for (int hv = 0; hv < HV; ++hv) {
      const int h = hv / cfg.group();
      const std::vector<double> q = ref::prepared_q(cfg, tok, h);
      const std::vector<double> g = ref::log_decay(cfg, tok, hv);
      const double beta = ref::beta_of(cfg, tok, hv);
      for (int i = 0; i < gw; ++i) gs.push_back(g[i]);
      for (int r = 0; r < V; ++r) {
        double* row = &S[(static_cast<int64_t>(hv) * V + r) * K];
        double sk = 0;
        for (int i = 0; i < K; ++i) {
          row[i] *= std::exp(g[i]);
          sk += row[i] * ks[static_cast<size_t>(h) * K + i];
        }
        const double uu = beta * (tok.v[static_cast<size_t>(hv) * V + r] - sk);
        double sq = 0;
        for (int i = 0; i < K; ++i) {
          row[i] += uu * ks[static_cast<size_t>(h) * K + i];
          sq += row[i] * q[i];
        }
        u[static_cast<size_t>(hv) * V + r] = uu;
        o[static_cast<size_t>(hv) * V + r] = sq;
      }
    }
    res.out.push_back(o);
    res.u.push_back(u);
    res.k.push_back(ks);
    res.g.push_back(gs);
  }
  return res;
}

// Values of sequence n's record at ring position p: d [HV*V], k [H*K], g [HV*gw].
void record_at(const Sim& sim, int64_t s, int64_t p, std::vector<double>& d, std::vector<double>& k,
               std::vector<double>& g) {
  const ref::Ring r = ring_of_slot(sim.rings.d.view(), sim.rings.k.view(), sim.rings.g.view(), s);
  const Shape& sh = sim.c.shape;
  const int gw = sim.c.kda ? sh.K : 1, L = sim.c.L;
  d.clear();
  k.clear();
  g.clear();
  for (int hv = 0; hv < sh.HV; ++hv) {
    for (int i = 0; i < sh.V; ++i) d.push_back(r.d[(static_cast<int64_t>(hv) * L + p) * sh.V + i]);
    for (int i = 0; i < gw; ++i) g.push_back(r.g[(static_cast<int64_t>(hv) * L + p) * gw + i]);
  }
  for (int h = 0; h < sh.H; ++h)
    for (int i = 0; i < sh.K; ++i) k.push_back(r.k[(static_cast<int64_t>(h) * L + p) * sh.K + i]);
}

// Tolerances against the intermediate-state verify where the two round differently: a bf16
// checkpoint is rounded at every commit there and at folds only here; 16-bit rings round d and k.
Tol cross_tol(const RvCase& c) { return c.exact() ? Tol{0, 0} : Tol{3e-3, 3e-3}; }

class ReplayVerify : public ::testing::TestWithParam<RvCase> {};

// 200 random steps (fewer for the model shapes): forced folds, random accepted counts (zero
// included); the replay verify against the intermediate-state verify and its commit, every
// write checked, the cursors against the rule.
TEST_P(ReplayVerify, RandomStepsMatchIntermediateStateVerify) {
  const RvCase& c = GetParam();
  Rng rng = test_rng();
  const int64_t N = c.shape.K >= 128 ? 2 : 4;
  Sim sim(rng, c, N);
  const Shape& sh = c.shape;
  Tensor inter = Tensor::contiguous(c.state, {N, c.T, sh.HV, sh.V, sh.K});
  int folds = 0, wraps = 0;
  for (int step = 0; step < c.steps; ++step) {
    RecurrentBatch rb = sim.batch(rng);
    for (int64_t n = 0; n < N; ++n) {
      const int64_t s = sim.slots[n];
      if (s >= 0 && rng.chance(0.08)) sim.flush[s] = 1;  // a forced fold
    }
    sim.push_cursors();
    // 1. The replay verify: only the drafts' records and (on a fold) the checkpoint change.
    rb.poison_out();
    Snapshot before;
    before.add(sim.ck).add(sim.rings.d).add(sim.rings.k).add(sim.rings.g);
    before.add(sim.write_pos).add(sim.cache_base).add(sim.is_flush);
    deltastate::replayssm_verify(sim.args(rb));
    std::vector<MemRange> allowed;
    for (int64_t n = 0; n < N; ++n)
      if (sim.slots[n] >= 0) sim.writable(n, rb.seq_len(n), allowed);
    ASSERT_TRUE(before.unchanged_except(allowed)) << "step " << step;
    for (int64_t n = 0; n < N; ++n) {
      const int64_t s = sim.slots[n];
      if (s < 0 || !sim.flush[s]) continue;
      ++folds;
      // The fold: the checkpoint is now the committed state.
      ASSERT_TRUE(
          all_close(slot_values(sim.ck.view(), s), slot_values(sim.plain.view(), s), cross_tol(c)))
          << "folded checkpoint, step " << step << " seq " << n;
    }
    std::vector<std::vector<double>> got(N);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t t = 0; t < rb.seq_len(n); ++t) {
        const std::vector<double> o = rb.out_token(n, t);
        got[n].insert(got[n].end(), o.begin(), o.end());
      }
    // 2. The intermediate-state verify of the same tokens from the committed states.
    rb.poison_out();
    deltastate::VerifyArgs va = verify_inputs(rb.args(host_view), c.kda);
    va.state = sim.plain.view();
    va.state_indices = sim.idx.view();
    va.update_state = false;
    va.intermediate_states = inter.view();
    deltastate::verify(va);
    for (int64_t n = 0; n < N; ++n) {
      std::vector<double> want;
      for (int64_t t = 0; t < rb.seq_len(n); ++t) {
        const std::vector<double> o = rb.out_token(n, t);
        want.insert(want.end(), o.begin(), o.end());
      }
      if (sim.slots[n] < 0) {
        ASSERT_TRUE(all_zero(got[n])) << "padded sequence " << n;
        continue;
      }
      ASSERT_TRUE(all_close(got[n], want, cross_tol(c), c.act, c.exact() ? 0 : 2))
          << "outputs, step " << step << " seq " << n;
    }
    // With fp32 checkpoints and rings, also bit for bit the recurrent op (plain decode over the
    // drafts) from the committed states.
    if (c.exact()) {
      rb.poison_out();
      deltastate::RecurrentArgs ra = rb.args(host_view);
      ra.state = sim.plain.view();
      ra.state_indices = sim.idx.view();
      ra.update_state = false;
      ra.stride_contract = false;
      if (c.kda) deltastate::recurrent_kda(ra);
      else deltastate::recurrent_gdn(ra);
      for (int64_t n = 0; n < N; ++n) {
        if (sim.slots[n] < 0) continue;
        std::vector<double> want;
        for (int64_t t = 0; t < rb.seq_len(n); ++t) {
          const std::vector<double> o = rb.out_token(n, t);
          want.insert(want.end(), o.begin(), o.end());
        }
        ASSERT_EQ(got[n], want) << "recurrent op, step " << step << " seq " << n;
      }
    }
    // 3. Accept a random prefix (the bonus token included; sometimes none) and commit both.
    std::vector<int64_t> accepted(N, 0);
    for (int64_t n = 0; n < N; ++n)
      accepted[n] = rng.chance(0.05) ? 0 : rng.integer(1, rb.seq_len(n));
    Tensor acc = index_tensor(accepted, DType::i64);
    ReplayCommitArgs ca;
    ca.write_pos = sim.write_pos.view();
    ca.cache_base = sim.cache_base.view();
    ca.is_flush = sim.is_flush.view();
    ca.num_accepted = acc.view();
    ca.state_indices = sim.idx.view();
    ca.max_cache_len = c.L;
    ca.max_spec_len = c.T;
    deltastate::replayssm_commit(ca);
    deltastate::CommitArgs pc;
    pc.state = sim.plain.view();
    pc.intermediate_states = inter.view();
    pc.state_indices = sim.idx.view();
    pc.accepted = acc.view();
    deltastate::update_state_after_verify(pc);
    for (int64_t n = 0; n < N; ++n) {
      const int64_t s = sim.slots[n];
      if (s < 0) continue;
      const int64_t b0 = sim.base[s];
      sim.commit_model(s, accepted[n]);
      wraps += sim.base[s] < b0;
    }
    for (int64_t s = 0; s < sim.S; ++s) {
      ASSERT_EQ(sim.write_pos.get({s}), sim.wp[s]) << "write_pos " << s << " step " << step;
      ASSERT_EQ(sim.cache_base.get({s}), sim.base[s]) << "cache_base " << s;
      ASSERT_EQ(sim.is_flush.get({s}), sim.flush[s]) << "is_flush " << s;
    }
  }
  EXPECT_GT(folds, 0);
  EXPECT_GT(wraps, 0) << "no ring origin wrapped around";
}

// A few committed steps, then one verify against the fp64 reference: every draft's output (so
// every prefix), its ring record, and the folded checkpoint.
TEST_P(ReplayVerify, MatchesFp64Reference) {
  const RvCase& c = GetParam();
  Rng rng = test_rng();
  const int64_t N = 3;
  Sim sim(rng, c, N);
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.shape.K));
  const int warm = 1 + static_cast<int>(rng.integer(0, 3));
  for (int step = 0; step <= warm; ++step) {
    RecurrentBatch rb = sim.batch(rng);
    const bool last = step == warm;
    if (last)  // fold one sequence, append on the others
      for (int64_t n = 0; n < N; ++n)
        if (sim.slots[n] >= 0) sim.flush[sim.slots[n]] = n == 0;
    sim.push_cursors();
    std::vector<RefRun> want(N);
    std::vector<ref::State> ck_before(N);
    for (int64_t n = 0; n < N; ++n) {
      const int64_t s = sim.slots[n];
      if (s < 0) continue;
      std::vector<ref::Token> drafts;
      for (int64_t t = 0; t < rb.seq_len(n); ++t) drafts.push_back(rb.token(n, t));
      ck_before[n] = slot_values(sim.ck.view(), s);
      want[n] =
          reference_run(rb.config(scale), ck_before[n],
                        ring_of_slot(sim.rings.d.view(), sim.rings.k.view(), sim.rings.g.view(), s),
                        sim.base[s], sim.wp[s], drafts);
    }
    rb.poison_out();
    deltastate::replayssm_verify(sim.args(rb));
    for (int64_t n = 0; n < N; ++n) {
      const int64_t s = sim.slots[n];
      if (s < 0) continue;
      // Records hold fp32 values rounded to the ring's dtype; outputs, as the recurrent test.
      const Tol rec_tol = c.ring == DType::f32 ? Tol{1e-5, 1e-4} : Tol{1e-3, 1e-2};
      for (int64_t t = 0; t < rb.seq_len(n); ++t) {
        ASSERT_TRUE(all_close(rb.out_token(n, t), want[n].out[t],
                              c.exact() ? kOutTol : Tol{2e-3, 1e-2}, c.act))
            << "step " << step << " seq " << n << " token " << t;
        std::vector<double> d, k, g;
        record_at(sim, s, sim.pos(s, sim.wp[s] + t), d, k, g);
        EXPECT_TRUE(all_close(d, want[n].u[t], rec_tol, c.ring)) << "record d " << t;
        EXPECT_TRUE(all_close(k, want[n].k[t], rec_tol, c.ring)) << "record k " << t;
        EXPECT_TRUE(all_close(g, want[n].g[t], Tol{1e-5, 1e-4})) << "record g " << t;
      }
      const std::vector<double> now = slot_values(sim.ck.view(), s);
      if (sim.flush[s] && sim.wp[s] > 0)
        EXPECT_TRUE(all_close(now, want[n].folded, state_tol(c.state))) << "folded seq " << n;
      else EXPECT_EQ(now, ck_before[n]) << "an appending step writes no checkpoint";
    }
    for (int64_t n = 0; n < N; ++n)
      if (sim.slots[n] >= 0) sim.commit_model(sim.slots[n], rng.integer(1, rb.seq_len(n)));
  }
}

const RvCase kCases[] = {
    {{"gdn_odd_f32", kOdd, false, kNoLb, f32, f32}, f32, 16, 4, true, 200},
    {{"kda_odd_f32_lb", kOdd, true, kLb, f32, f32}, f32, 16, 4, true, 200},
    {{"gdn_KgtV_bf16ckpt", kKgtV, false, kNoLb, bf16, bf16}, f32, 16, 3, false, 200},
    {{"kda_KltV_bf16ring", kKltV, true, kNoLb, f32, bf16}, bf16, 8, 4, true, 200},
    {{"gdn_qwen3next_f32", kQwen3Next, false, kNoLb, f32, bf16}, f32, 16, 4, false, 24},
    {{"kda_kimi_bf16ckpt", kKimi, true, kNoLb, bf16, bf16}, f32, 16, 4, true, 12},
};
INSTANTIATE_TEST_SUITE_P(Cases, ReplayVerify, ::testing::ValuesIn(kCases), case_name<RvCase>);

// ---- errors ---------------------------------------------------------------------------------
std::string error_of(const std::function<void()>& f) {
  auto e = catch_error(f);
  return e ? std::string(e->what()) : std::string();
}

TEST(ReplayVerifyErrors, EveryText) {
  Rng rng = test_rng();
  const RvCase c{{"err", kOdd, false, kNoLb, f32, f32}, f32, 16, 4, false, 0};
  Sim sim(rng, c, 3);
  RecurrentBatch rb = sim.batch(rng);
  sim.push_cursors();
  const int64_t s0 = sim.slots[0];
  auto expect = [&](
                    const std::function<void(ReplayVerifyArgs&)>& mutate, const std::string& text,
                    const std::function<void()>& undo = [] {}) {
    ReplayVerifyArgs a = sim.args(rb);
    mutate(a);
    Snapshot snap;
    snap.add(sim.ck).add(sim.rings.d).add(sim.rings.k).add(sim.rings.g);
    const std::string what = error_of([&] { deltastate::replayssm_verify(a); });
    EXPECT_NE(what.find(text), std::string::npos) << "got: " << what << "\nwant: " << text;
    EXPECT_TRUE(snap.unchanged()) << text;
    undo();
  };
  const Shape& sh = c.shape;
  Tensor d3 = Tensor::contiguous(f32, {sim.S, sh.HV, 16});
  Tensor d0 = Tensor::contiguous(f32, {sim.S, sh.HV, 0, sh.V});
  Tensor dbad = Tensor::contiguous(f32, {sim.S, sh.HV, 16, sh.V + 1});
  Tensor kbad = Tensor::contiguous(f32, {sim.S, sh.H, 8, sh.K});
  Tensor gbad = Tensor::contiguous(f32, {sim.S, sh.HV, 16, sh.K});
  Tensor g16 = Tensor::contiguous(bf16, {sim.S, sh.HV, 16});
  Tensor dint = Tensor::contiguous(DType::i32, {sim.S, sh.HV, 16, sh.V});
  Tensor dstrided =
      Tensor::strided(f32, {sim.S, sh.HV, 16, sh.V}, {sh.HV * 16 * sh.V * 2, 16 * sh.V, sh.V, 1});
  Tensor wp64 = Tensor::contiguous(DType::i64, {sim.S});
  Tensor wpshort = Tensor::contiguous(DType::i32, {sim.S - 1});
  const std::string S = std::to_string(sim.S);
  Tensor d2 = Tensor::contiguous(f32, {sim.S, sh.HV});
  expect([&](auto& a) { a.null_block_id = -2; },
         "`null_block_id` must be >= -1 (got -2): slots at or below it are padding");
  expect([&](auto& a) { a.d_cache = d2.view(); },
         "`d_cache` shape must be (" + S + ", 6, L, 48) (got (" + S + ", 6)).");
  expect([&](auto& a) { a.d_cache = d3.view(); },
         "`d_cache` shape must be (" + S + ", 6, 16, 48) (got (" + S + ", 6, 16)).");
  expect([&](auto& a) { a.d_cache = d0.view(); }, "ReplaySSM cache length must be at least 1.");
  expect([&](auto& a) { a.d_cache = dstrided.view(); },
         "ReplaySSM ring caches must be contiguous.");
  expect([&](auto& a) { a.d_cache = dbad.view(); },
         "`d_cache` shape must be (" + S + ", 6, 16, 48) (got (" + S + ", 6, 16, 49)).");
  expect([&](auto& a) { a.k_cache = kbad.view(); },
         "`k_cache` shape must be (" + S + ", 3, 16, 32) (got (" + S + ", 3, 8, 32)).");
  expect([&](auto& a) { a.g_cache = gbad.view(); },
         "`g_cache` shape must be (" + S + ", 6, 16) (got (" + S + ", 6, 16, 32)).");
  expect([&](auto& a) { a.g_cache = g16.view(); }, "`g_cache` must be float32 (got bfloat16).");
  expect([&](auto& a) { a.d_cache = dint.view(); },
         "ReplaySSM ring caches must be floating point (got int32).");
  expect([&](auto& a) { a.write_pos = wp64.view(); },
         "`write_pos` must be a contiguous 1D int32 tensor.");
  expect([&](auto& a) { a.cache_base = wpshort.view(); },
         "`cache_base` must have one entry per slot (" + S + "); got " + std::to_string(sim.S - 1));
  expect([&](auto& a) { a.is_flush = wp64.view(); },
         "`is_flush` must be a contiguous 1D int32 or int8 tensor.");
  // The verify op's own checks run first (one sample; test_verify covers them).
  expect([&](auto& a) { a.state = d3.view(); }, "`state` must be a 4D tensor");
  // Slots and cursors.
  Tensor bad_idx = index_tensor({sim.S, -1, -1});
  expect([&](auto& a) { a.state_indices = bad_idx.view(); },
         "`state_indices`[0]=" + S + " is out of range for a pool of " + S + " slots");
  Tensor dup_idx = index_tensor({s0, -1, s0});
  expect([&](auto& a) { a.state_indices = dup_idx.view(); },
         "`state_indices`[2]=" + std::to_string(s0) + " repeats a live slot of this batch");
  auto with_cursor = [&](Tensor& t, double v) { return [&t, v, s0] { t.set({s0}, v); }; };
  with_cursor(sim.write_pos, 17)();
  expect([](auto&) {}, "`write_pos`[" + std::to_string(s0) + "]=17 is outside the ring [0, L=16]",
         with_cursor(sim.write_pos, 0));
  with_cursor(sim.cache_base, 16)();
  expect([](auto&) {},
         "`cache_base`[" + std::to_string(s0) + "]=16 is outside the ring [0, L-1=15]",
         with_cursor(sim.cache_base, 0));
  // Replay rows (rings and cursors keyed apart from the checkpoint slots).
  Tensor ridx_big = index_tensor({sim.S, -1, -1}), ridx_dup = index_tensor({s0, 0, s0});
  Tensor ridx_short = index_tensor({0, 1});
  expect([&](auto& a) { a.replay_indices = ridx_big.view(); },
         "`replay_indices`[0]=" + S + " is out of range for rings of " + S + " rows");
  expect([&](auto& a) { a.replay_indices = ridx_short.view(); },
         "`replay_indices` must have shape [B]=(3,); got (2,)");
  if (sim.slots[2] >= 0)
    expect([&](auto& a) { a.replay_indices = ridx_dup.view(); },
           "`replay_indices`[2]=" + std::to_string(s0) + " repeats a live row of this batch");
  // The raw rings.
  Tensor rawv = Tensor::contiguous(f32, {sim.S, sh.HV, 16, sh.V});
  Tensor rawk = Tensor::contiguous(f32, {sim.S, sh.H, 16, sh.K});
  Tensor beta_bad = Tensor::contiguous(f32, {sim.S, sh.HV, 8});
  Tensor beta16 = Tensor::contiguous(bf16, {sim.S, sh.HV, 16});
  expect([&](auto& a) { a.rawv_cache = rawv.view(); }, "`rawv_cache` and `rawk_cache` go together");
  expect([&](auto& a) { a.beta_cache = beta16.view(); }, "`beta_cache` needs both");
  expect(
      [&](auto& a) {
        a.rawv_cache = rawv.view();
        a.rawk_cache = rawk.view();
        a.beta_cache = beta_bad.view();
      },
      "`beta_cache` must be a contiguous tensor of shape (" + S + ", 6, 16) (got (" + S +
          ", 6, 8)).");
  expect(
      [&](auto& a) {
        a.rawv_cache = rawv.view();
        a.rawk_cache = rawk.view();
        a.beta_cache = beta16.view();
      },
      "`beta_cache` must be float32 (got bfloat16).");
  expect(
      [&](auto& a) {
        a.rawv_cache = rawk.view();
        a.rawk_cache = rawk.view();
      },
      "`rawv_cache` must be a contiguous tensor of shape (" + S + ", 6, 16, 48)");
  expect([&](auto& a) { a.rows = static_cast<deltastate::ReplayRows>(3); },
         "replayssm_verify: rows must be 0 (all), 1 (append) or 2 (fold) (got 3)");
  // null_block_id: the slot at or below it is padding (no cursor check, zero output).
  with_cursor(sim.write_pos, 17)();
  {
    Tensor null_idx = index_tensor({0, -1, -1});
    Tensor wp = Tensor::contiguous(DType::i32, {sim.S});
    wp.fill_all(99);
    ReplayVerifyArgs a = sim.args(rb);
    a.state_indices = null_idx.view();
    a.write_pos = wp.view();
    a.null_block_id = 0;
    rb.poison_out();
    deltastate::replayssm_verify(a);
    for (int64_t n = 0; n < 3; ++n)
      for (int64_t t = 0; t < c.T; ++t) EXPECT_TRUE(all_zero(rb.out_token(n, t)));
  }
  with_cursor(sim.write_pos, 0)();
}

TEST(ReplayVerifyErrors, KdaGateRing) {
  Rng rng = test_rng();
  const RvCase c{{"err_kda", kOdd, true, kNoLb, f32, f32}, f32, 16, 4, false, 0};
  Sim sim(rng, c, 2);
  RecurrentBatch rb = sim.batch(rng);
  sim.push_cursors();
  Tensor g3 = Tensor::contiguous(f32, {sim.S, c.shape.HV, 16});
  ReplayVerifyArgs a = sim.args(rb);
  a.g_cache = g3.view();
  const std::string S = std::to_string(sim.S);
  const std::string what = error_of([&] { deltastate::replayssm_verify(a); });
  EXPECT_EQ(what, "`g_cache` shape must be (" + S + ", 6, 16, 32) (got (" + S + ", 6, 16)).");
}

TEST(ReplayCommitErrors, EveryText) {
  Tensor wp = Tensor::contiguous(DType::i32, {4}), base = Tensor::contiguous(DType::i32, {4}),
         fl = Tensor::contiguous(DType::i32, {4});
  Tensor idx = index_tensor({2, -1}), acc = index_tensor({1, 3});
  auto args = [&] {
    ReplayCommitArgs a;
    a.write_pos = wp.view();
    a.cache_base = base.view();
    a.is_flush = fl.view();
    a.num_accepted = acc.view();
    a.state_indices = idx.view();
    a.max_cache_len = 16;
    a.max_spec_len = 4;
    return a;
  };
  auto expect = [&](const std::function<void(ReplayCommitArgs&)>& mutate, const std::string& text) {
    ReplayCommitArgs a = args();
    mutate(a);
    Snapshot snap;
    snap.add(wp).add(base).add(fl);
    const std::string what = error_of([&] { deltastate::replayssm_commit(a); });
    EXPECT_NE(what.find(text), std::string::npos) << "got: " << what << "\nwant: " << text;
    EXPECT_TRUE(snap.unchanged());
  };
  Tensor wp2 = Tensor::contiguous(DType::i32, {4, 1}), f5 = Tensor::contiguous(DType::i32, {5});
  Tensor fidx = Tensor::contiguous(DType::f32, {2}), idx3 = index_tensor({1, 2, 3});
  Tensor big = index_tensor({4, -1}), acc5 = index_tensor({5, 0}), accneg = index_tensor({-1, 0});
  expect([&](auto& a) { a.null_block_id = -3; },
         "`null_block_id` must be >= -1 (got -3): slots at or below it are padding");
  expect([&](auto& a) { a.write_pos = wp2.view(); },
         "`write_pos` must be a contiguous 1D int32 tensor.");
  expect([&](auto& a) { a.is_flush = f5.view(); },
         "`is_flush` must have one entry per slot (4); got 5");
  expect([&](auto& a) { a.state_indices = fidx.view(); },
         "`state_indices` must be int32 or int64 (got float32)");
  expect([&](auto& a) { a.num_accepted = idx3.view(); },
         "`num_accepted` must have shape [B]=(2,); got (3,)");
  expect([&](auto& a) { a.max_cache_len = 0; }, "max_cache_len must be in [1, 2^30] (got 0)");
  expect([&](auto& a) { a.max_spec_len = 9; },
         "max_spec_len must be >= 1 with 2 * max_spec_len <= max_cache_len=16 (got 9)");
  for (int64_t buf : {8, 24})
    expect([&](auto& a) { a.cache_buf_len = buf; },
           "cache_buf_len must be a power of two >= max_cache_len=16 (got " + std::to_string(buf) +
               ")");
  expect([&](auto& a) { a.state_indices = big.view(); },
         "`state_indices`[0]=4 is out of range for a pool of 4 slots");
  expect([&](auto& a) { a.num_accepted = acc5.view(); },
         "`num_accepted`[0]=5 is outside [0, max_spec_len=4]");
  expect([&](auto& a) { a.num_accepted = accneg.view(); },
         "`num_accepted`[0]=-1 is outside [0, max_spec_len=4]");
}

// The reset of rows that start decoding (SGLang's reset_gdn_replayssm_spec_cursors): a live row
// with a nonzero flag gets write_pos = cache_base = 0 and is_flush = 2 * max_spec_len >
// max_cache_len; rows at or below null_block_id, rows whose flag is 0 and every other slot keep
// their cursors, whatever the flags' dtype and stride.
TEST(ReplayResetCursors, RowsWithTheirFlagOnly) {
  for (const DType flag_dtype : {DType::i8, DType::i32, DType::i64})
    for (const int64_t L : {16, 6}) {  // L = 6, T = 4: the reset rows start folding
      const int64_t S = 7, T = 4;
      Tensor wp = Tensor::contiguous(DType::i32, {S}), base = Tensor::contiguous(DType::i32, {S});
      Tensor fl = Tensor::contiguous(DType::i8, {S});
      for (int64_t s = 0; s < S; ++s) {
        wp.set({s}, 5 + s);
        base.set({s}, 2 + s);
        fl.set({s}, s % 2);
      }
      Tensor wp0 = wp.empty_like(), base0 = base.empty_like(), fl0 = fl.empty_like();
      for (int64_t s = 0; s < S; ++s) {
        wp0.set({s}, wp.get({s}));
        base0.set({s}, base.get({s}));
        fl0.set({s}, fl.get({s}));
      }
      // rows: slot 3 reset, slot 0 (the null block) flagged, slot 5 reset, slot 2 not flagged, a
      // padded row flagged; the flags every other element of a strided tensor
      const std::vector<int64_t> rows = {3, 0, 5, 2, -1}, flags = {1, 1, 7, 0, 1};
      Tensor idx = index_tensor(rows, DType::i64);
      Tensor reset = Tensor::strided(flag_dtype, {5}, {2});
      for (int64_t b = 0; b < 5; ++b) reset.set({b}, static_cast<double>(flags[b]));
      deltastate::ReplayResetArgs a;
      a.write_pos = wp.view();
      a.cache_base = base.view();
      a.is_flush = fl.view();
      a.do_reset = reset.view();
      a.state_indices = idx.view();
      a.max_cache_len = L;
      a.max_spec_len = T;
      a.null_block_id = 0;  // SGLang's null block: slot 0 is padding
      deltastate::replayssm_reset_cursors(a);
      for (int64_t s = 0; s < S; ++s) {
        const bool r = s == 3 || s == 5;
        EXPECT_EQ(wp.get({s}), r ? 0 : wp0.get({s})) << s;
        EXPECT_EQ(base.get({s}), r ? 0 : base0.get({s})) << s;
        EXPECT_EQ(fl.get({s}), r ? (2 * T > L ? 1 : 0) : fl0.get({s})) << s;
      }
    }
}

TEST(ReplayResetCursors, EveryText) {
  Tensor wp = Tensor::contiguous(DType::i32, {4}), base = Tensor::contiguous(DType::i32, {4}),
         fl = Tensor::contiguous(DType::i32, {4});
  Tensor idx = index_tensor({2, -1}), reset = index_tensor({1, 1});
  auto args = [&] {
    deltastate::ReplayResetArgs a;
    a.write_pos = wp.view();
    a.cache_base = base.view();
    a.is_flush = fl.view();
    a.do_reset = reset.view();
    a.state_indices = idx.view();
    a.max_cache_len = 16;
    a.max_spec_len = 4;
    return a;
  };
  auto expect = [&](const std::function<void(deltastate::ReplayResetArgs&)>& mutate,
                    const std::string& text) {
    deltastate::ReplayResetArgs a = args();
    mutate(a);
    Snapshot snap;
    snap.add(wp).add(base).add(fl);
    const std::string what = error_of([&] { deltastate::replayssm_reset_cursors(a); });
    EXPECT_EQ(what, text);
    EXPECT_TRUE(snap.unchanged());
  };
  Tensor f5 = Tensor::contiguous(DType::i32, {5}), ff = Tensor::contiguous(DType::f32, {2});
  Tensor r3 = index_tensor({1, 1, 1}), big = index_tensor({4, -1}), off = index_tensor({0, 1});
  expect([&](auto& a) { a.null_block_id = -3; },
         "`null_block_id` must be >= -1 (got -3): slots at or below it are padding, and a "
         "negative slot must never be live");
  expect([&](auto& a) { a.cache_base = f5.view(); },
         "`cache_base` must have one entry per slot (4); got 5");
  expect([&](auto& a) { a.state_indices = ff.view(); },
         "`state_indices` must be int32 or int64 (got float32)");
  expect([&](auto& a) { a.do_reset = r3.view(); }, "`do_reset` must have shape [B]=(2,); got (3,)");
  expect([&](auto& a) { a.do_reset = ff.view(); },
         "`do_reset` must be bool, int8, int32 or int64 (got float32)");
  expect([&](auto& a) { a.max_cache_len = 0; }, "max_cache_len must be in [1, 2^30] (got 0)");
  expect([&](auto& a) { a.max_spec_len = 0; }, "max_spec_len must be in [1, 2^30] (got 0)");
  expect([&](auto& a) { a.state_indices = big.view(); },
         "`state_indices`[0]=4 is out of range for a pool of 4 slots");
  // a slot past the pool whose row is not reset is not read
  Tensor quiet = index_tensor({9, 1});
  deltastate::ReplayResetArgs a = args();
  a.state_indices = quiet.view();
  a.do_reset = off.view();
  deltastate::replayssm_reset_cursors(a);
}

// The CUDA-only limits of the fold and circular commits, refused by their validators: CUDA views
// of host tensors (nothing is launched, read or written on a device; CI has none).
TEST(ReplayCommitErrors, CudaLimits) {
  const int64_t S = 3, HV = 2, H = 1, V = 8;
  auto fold = [&](int64_t K) {
    Tensor st = Tensor::contiguous(DType::f32, {S, HV, V, K});
    Tensor rv = Tensor::contiguous(DType::f32, {S, HV, 4, V});
    Tensor rk = Tensor::contiguous(DType::f32, {S, H, 4, K});
    Tensor g = Tensor::contiguous(DType::f32, {S, HV, 4}),
           b = Tensor::contiguous(DType::f32, {S, HV, 4});
    Tensor idx = index_tensor({0, 1}), acc = index_tensor({1, 1});
    deltastate::ReplayFoldArgs a;
    a.state = on_cuda(st.view());
    a.rawv = on_cuda(rv.view());
    a.rawk = on_cuda(rk.view());
    a.g = on_cuda(g.view());
    a.beta = on_cuda(b.view());
    a.state_indices = on_cuda(idx.view());
    a.accept_lens = on_cuda(acc.view());
    return error_of([&] { deltastate::replayssm_fold_commit(a); });
  };
  auto circular = [&](int64_t K, int64_t L) {
    Tensor st = Tensor::contiguous(DType::f32, {S, HV, V, K});
    Tensor d = Tensor::contiguous(DType::f32, {S, HV, L, V});
    Tensor k = Tensor::contiguous(DType::f32, {S, H, L, K});
    Tensor g = Tensor::contiguous(DType::f32, {S, HV, L});
    Tensor wp = Tensor::contiguous(DType::i32, {S}), base = Tensor::contiguous(DType::i32, {S}),
           fl = Tensor::contiguous(DType::i32, {S});
    Tensor idx = index_tensor({0, 1}), rows = index_tensor({0, 1}), acc = index_tensor({1, 1});
    deltastate::ReplayCircularCommitArgs a;
    a.state = on_cuda(st.view());
    a.d_cache = on_cuda(d.view());
    a.k_cache = on_cuda(k.view());
    a.g_cache = on_cuda(g.view());
    a.state_indices = on_cuda(idx.view());
    a.replay_indices = on_cuda(rows.view());
    a.write_pos = on_cuda(wp.view());
    a.cache_base = on_cuda(base.view());
    a.is_flush = on_cuda(fl.view());
    a.accept_lens = on_cuda(acc.view());
    return error_of([&] { deltastate::replayssm_circular_commit(a); });
  };
  auto expect = [](const std::string& what, const std::string& text) {
    EXPECT_NE(what.find(text), std::string::npos) << "got: " << what << "\nwant: " << text;
  };
  expect(fold(257), "replayssm_fold_commit: K=257; CUDA tensors take K <= 256");
  expect(circular(257, 8), "commit_gdn_replayssm_circular: K=257; CUDA tensors take K <= 256");
  expect(circular(16, 1025),
         "commit_gdn_replayssm_circular: L=1025; CUDA tensors take a ring of at most 1024 records");
}

// ---- a checkpoint in its storage format -----------------------------------------------------
// The state format's texts name this op (the verify contract checks them for it).
TEST(ReplayVerifyErrors, StateFormatTexts) {
  Rng rng = test_rng();
  const RvCase c{{"fmt_err", kOdd, false, kNoLb, f32, f32}, f32, 16, 4, false, 0};
  Sim sim(rng, c, 3);
  RecurrentBatch rb = sim.batch(rng);
  sim.push_cursors();
  const Shape& sh = c.shape;
  Tensor q8 = make_pool(DType::i8, sim.S, sh), f8 = make_pool(DType::f8e4m3, sim.S, sh);
  Tensor scales = Tensor::contiguous(f32, {sim.S, sh.HV, sh.V});
  Tensor step = index_tensor({0}, DType::i64);
  auto expect = [&](const std::function<void(ReplayVerifyArgs&)>& mutate, const std::string& text,
                    ErrorKind kind = ErrorKind::value) {
    ReplayVerifyArgs a = sim.args(rb);
    mutate(a);
    Snapshot snap;
    snap.add(sim.ck).add(q8).add(f8).add(scales).add(step);
    snap.add(sim.rings.d).add(sim.rings.k).add(sim.rings.g);
    expect_error([&] { deltastate::replayssm_verify(a); }, text, kind);
    EXPECT_TRUE(snap.unchanged()) << text;
  };
  expect([&](auto& a) { a.state = q8.view(); },
         "replayssm_verify: `state_scales` is required for the int8 state `state`: its fp32 "
         "scales [slots, HV, V] (StatePool.layer_scales)");
  expect(
      [&](auto& a) {
        a.state = f8.view();
        a.state_format.scales = scales.view();
      },
      "replayssm_verify: stochastic rounding of the float8_e4m3fn state `state` needs "
      "`rounding_step`, an int64 [1] step counter on the state's device "
      "(StatePool.rounding_step)");
  expect([&](auto& a) { a.state_format.scales = scales.view(); },
         "replayssm_verify: `state_scales` applies to float8_e4m3fn and int8 states; `state` is "
         "float32");
  expect(
      [&](auto& a) {
        a.state_format.rounding = StateRounding::stochastic;
        a.state_format.step = step.view();
      },
      "replayssm_verify: stochastic rounding applies to bfloat16, float16, float8_e4m3fn and "
      "int8 states; `state` is float32 (stored exactly)");
  expect(
      [&](auto& a) {
        a.state = q8.view();
        a.state_format.scales = scales.view();
        a.state_format.rounding = StateRounding::stochastic;
        a.state_format.step = step.view();
        a.state_format.layer = -1;
      },
      "replayssm_verify: `rounding_layer` must be >= 0; got -1");
}

Tensor clone(const Tensor& t) {
  Tensor c = t.empty_like();
  std::memcpy(c.alloc_base(), t.alloc_base(), static_cast<size_t>(t.alloc_bytes()));
  return c;
}

// A bf16 checkpoint rounded stochastically, GDN and KDA, with the exact-raw ring and without:
// folds store each element as one of the two bf16 values around the fold's fp32 state (an fp32
// twin's fold-only call gives it; the bits themselves are the rule of test_state_format.cpp),
// not all to nearest, the same bits again when the call is repeated from the same bytes; the
// drafts of a folding row run from the checkpoint as stored (the twin, from that checkpoint with
// the row's cursors moved past its records: outputs and ring records bit for bit); an
// append-only call stores nothing and leaves the step counter, the others add one; every
// other byte of the pool (sentinels, gaps, other slots) untouched.
TEST(ReplayVerifyFormat, Bf16StochasticFold) {
  for (const bool kda : {false, true})
    for (const bool exact : {false, true}) {
      SCOPED_TRACE(std::string(kda ? "kda" : "gdn") + (exact ? " exact-raw" : ""));
      Rng rng = test_rng();
      const RvCase c{{"bf16_sr", kOdd, kda, kNoLb, bf16, f32}, f32, 16, 4, true, 0};
      Sim sim(rng, c, 4);
      const Shape& sh = c.shape;
      Tensor twin = make_pool(f32, sim.S, sh);
      for (int64_t s : sim.slots)
        if (s >= 0) set_slot_values(twin.view(), s, slot_values(sim.ck.view(), s));
      for (Tensor* t : {&sim.rings.d, &sim.rings.k}) t->fill_normal(rng, 0.3);
      sim.rings.g.fill_uniform(rng, -0.5, -0.01);
      Tensor rawv = Tensor::contiguous(f32, {sim.S, sh.HV, c.L, sh.V});
      Tensor rawk = Tensor::contiguous(f32, {sim.S, sh.H, c.L, sh.K});
      Tensor rawb = Tensor::contiguous(f32, {sim.S, sh.HV, c.L});
      rawv.fill_normal(rng, 1.0);
      rawk.fill_normal(rng, 1.0);
      rawb.fill_uniform(rng, 0.05, 0.95);
      std::vector<int64_t> folding;
      for (int64_t s : sim.slots) {
        if (s < 0) continue;
        sim.wp[s] = rng.integer(1, c.L - c.T);  // every draft's record fits the ring
        sim.flush[s] = folding.empty() || rng.chance(0.5) ? 1 : 0;
        if (sim.flush[s]) folding.push_back(s);
      }
      sim.push_cursors();
      RecurrentBatch rb = sim.batch(rng);
      Tensor step = index_tensor({41}, DType::i64);
      auto run = [&](const Tensor& ck, Rings& rings, Tensor& rv, Tensor& rk, Tensor& rbeta,
                     const Tensor& wp, const Tensor& base, const Tensor& flush,
                     deltastate::ReplayRows rows, bool formatted) {
        ReplayVerifyArgs a = sim.args(rb, ck, rings, wp, base, flush);
        if (exact) {
          a.rawv_cache = rv.view();
          a.rawk_cache = rk.view();
          a.beta_cache = rbeta.view();
        }
        a.rows = rows;
        if (formatted) {
          a.state_format.rounding = StateRounding::stochastic;
          a.state_format.step = step.view();
          a.state_format.seed = 77;
          a.state_format.layer = 2;
        }
        deltastate::replayssm_verify(a);
      };
      // an append-only call: no state stored, the counter left
      {
        Rings r{c.L, clone(sim.rings.d), clone(sim.rings.k), clone(sim.rings.g)};
        Tensor v2 = clone(rawv), k2 = clone(rawk), b2 = clone(rawb);
        Snapshot snap;
        snap.add(sim.ck).add(step);
        rb.poison_out();
        run(sim.ck, r, v2, k2, b2, sim.write_pos, sim.cache_base, sim.is_flush,
            deltastate::ReplayRows::append, true);
        EXPECT_TRUE(snap.unchanged()) << "an append-only call";
      }
      const Tensor ck0 = clone(sim.ck);
      Rings rings0{c.L, clone(sim.rings.d), clone(sim.rings.k), clone(sim.rings.g)};
      Tensor rawv0 = clone(rawv), rawk0 = clone(rawk), rawb0 = clone(rawb);
      Snapshot before;
      before.add(sim.ck);
      rb.poison_out();
      run(sim.ck, sim.rings, rawv, rawk, rawb, sim.write_pos, sim.cache_base, sim.is_flush,
          deltastate::ReplayRows::all, true);
      const Tensor out_fmt = clone(rb.out);
      EXPECT_EQ(step.get_linear(0), 42);
      std::vector<MemRange> folded_ranges;
      for (int64_t s : folding) folded_ranges.push_back(slot_range(sim.ck.view(), s));
      EXPECT_TRUE(before.unchanged_except(folded_ranges)) << "the pool outside the folded slots";
      {  // the same call from the same bytes stores the same bits
        Tensor ck2 = clone(ck0);
        Rings r{c.L, clone(rings0.d), clone(rings0.k), clone(rings0.g)};
        Tensor v2 = clone(rawv0), k2 = clone(rawk0), b2 = clone(rawb0);
        step.set_linear(0, 41);
        run(ck2, r, v2, k2, b2, sim.write_pos, sim.cache_base, sim.is_flush,
            deltastate::ReplayRows::all, true);
        EXPECT_EQ(std::memcmp(ck2.alloc_base(), sim.ck.alloc_base(),
                              static_cast<size_t>(ck2.alloc_bytes())),
                  0);
      }
      // the twin's fold: the fp32 state each folded element brackets
      {
        Rings r{c.L, clone(rings0.d), clone(rings0.k), clone(rings0.g)};
        Tensor v2 = clone(rawv0), k2 = clone(rawk0), b2 = clone(rawb0);
        run(twin, r, v2, k2, b2, sim.write_pos, sim.cache_base, sim.is_flush,
            deltastate::ReplayRows::fold, false);
      }
      int64_t off_nearest = 0, total = 0;
      for (int64_t s : folding) {
        const std::vector<double> x = slot_values(twin.view(), s);
        const std::vector<double> got = slot_values(sim.ck.view(), s);
        for (size_t e = 0; e < x.size(); ++e) {
          const uint16_t near = fmt::bf16_bits(x[e]);
          const double nv = fmt::bf16_value(near);
          // the other bf16 neighbour of x: one unit from the nearest, towards x
          const uint16_t other =
              static_cast<uint16_t>((nv < x[e]) == (nv >= 0) ? near + 1 : near - 1);
          const double ov = nv == x[e] ? nv : fmt::bf16_value(other);
          ASSERT_TRUE(got[e] == nv || got[e] == ov)
              << "slot " << s << " element " << e << ": " << got[e] << " for " << x[e];
          off_nearest += got[e] != nv;
          ++total;
        }
        set_slot_values(twin.view(), s, got);  // the twin continues from the stored checkpoint
      }
      EXPECT_GT(off_nearest, total / 20) << "stochastic rounding rounds some elements up";
      // the twin's step from the stored checkpoints, the folded rows past their records
      Tensor wp2 = clone(sim.write_pos), base2 = clone(sim.cache_base), fl2 = clone(sim.is_flush);
      for (int64_t s : folding) {
        base2.set({s}, static_cast<double>((sim.base[s] + sim.wp[s]) % c.L));
        wp2.set({s}, 0);
        fl2.set({s}, 0);
      }
      rb.poison_out();
      run(twin, rings0, rawv0, rawk0, rawb0, wp2, base2, fl2, deltastate::ReplayRows::all, false);
      EXPECT_EQ(std::memcmp(rb.out.alloc_base(), out_fmt.alloc_base(),
                            static_cast<size_t>(out_fmt.alloc_bytes())),
                0)
          << "outputs";
      for (const auto& [a, b] : {std::pair{&rings0.d, &sim.rings.d},
                                 {&rings0.k, &sim.rings.k},
                                 {&rings0.g, &sim.rings.g}})
        EXPECT_EQ(
            std::memcmp(a->alloc_base(), b->alloc_base(), static_cast<size_t>(a->alloc_bytes())), 0)
            << "rings";
      if (exact)
        for (const auto& [a, b] : {std::pair{&rawv0, &rawv}, {&rawk0, &rawk}, {&rawb0, &rawb}})
          EXPECT_EQ(
              std::memcmp(a->alloc_base(), b->alloc_base(), static_cast<size_t>(a->alloc_bytes())),
              0)
              << "raw rings";
    }
}

}  // namespace
}  // namespace dstest
