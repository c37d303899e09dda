// ReplaySSM speculative verify and its cursor commit on the CUDA backend against the CPU backend:
// the same random verify -> commit steps (forced folds, varlen drafts, a padded sequence, a
// strided checkpoint pool, circular rings with random origins) run on both, and after every step
// the outputs, the checkpoint pool, the rings and the cursors are compared (cursors exactly;
// values at the tolerances of tests/gpu/test_cuda_ops.cpp, the ring's d records as outputs);
// a verify + commit loop in a CUDA graph replays bit-equal to eager; a bad slot and a cursor
// outside the ring are skipped, NaN, and recorded for check_errors; SGLang's launch modes,
// request-keyed rings, int8 flags and records past the ring against the CPU backend; the hi/lo
// residual ring against the CPU backend; the circular commit's track slot past the pool: its row
// skipped whole and recorded.
#include <array>
#include <cmath>
#include <cstring>
#include <functional>
#include <string>

#include "gpu/gpu_errors.h"
#include "gpu/gpu_util.h"
#include "test_util.h"

namespace dstest {
namespace {

using deltastate::ReplayCommitArgs;
using deltastate::ReplayVerifyArgs;

struct GpuRvCase : OpCase {
  DType ring;
  int L, T, steps;
};
void PrintTo(const GpuRvCase& c, std::ostream* os) { *os << c.name; }

struct RvState {
  Tensor ck, idx, wp, base, flush;
  Rings rings;
  std::vector<int64_t> slots;
};

RvState make_state(Rng& rng, const GpuRvCase& c, int64_t N) {
  RvState st;
  const int64_t S = N + 3;
  st.ck = make_pool(c.state, S, c.shape, /*slot_pad=*/c.shape.K == 128 ? 64 : 8, /*lead=*/32);
  st.slots = pick_slots(rng, N, S, {N > 2 ? 1 : -1});
  fill_live_slots(st.ck.view(), st.slots, rng);
  st.idx = index_tensor(st.slots);
  st.rings = make_rings(c.shape, c.kda, S, c.L, c.ring, c.ring);
  std::vector<int64_t> base(S, 0);
  for (int64_t s : st.slots)
    if (s >= 0) base[s] = rng.integer(0, c.L - 1);
  st.wp = index_tensor(std::vector<int64_t>(S, 0));
  st.base = index_tensor(base);
  st.flush = index_tensor(std::vector<int64_t>(S, 0));
  return st;
}

template <class ViewOf>
ReplayVerifyArgs rv_args(const RecurrentBatch& rb, const RvState& st, bool kda, ViewOf&& view_of) {
  ReplayVerifyArgs a = replay_verify_inputs(rb.args(view_of), kda);
  a.state = view_of(st.ck);
  a.state_indices = view_of(st.idx);
  a.d_cache = view_of(st.rings.d);
  a.k_cache = view_of(st.rings.k);
  a.g_cache = view_of(st.rings.g);
  a.write_pos = view_of(st.wp);
  a.cache_base = view_of(st.base);
  a.is_flush = view_of(st.flush);
  return a;
}

template <class ViewOf>
ReplayCommitArgs commit_args(const RvState& st, const Tensor& acc, const GpuRvCase& c,
                             ViewOf&& view_of) {
  ReplayCommitArgs a;
  a.write_pos = view_of(st.wp);
  a.cache_base = view_of(st.base);
  a.is_flush = view_of(st.flush);
  a.num_accepted = view_of(acc);
  a.state_indices = view_of(st.idx);
  a.max_cache_len = c.L;
  a.max_spec_len = c.T;
  return a;
}

Tol gpu_state_tol(DType t) { return t == DType::f32 ? Tol{1e-4, 1e-3} : state_tol(t); }

class ReplayVerifyGpu : public GpuParamTest<GpuRvCase> {};

TEST_P(ReplayVerifyGpu, StepsMatchCpu) {
  const GpuRvCase& c = GetParam();
  Rng rng = test_rng();
  const int64_t N = 4;
  RvState st = make_state(rng, c, N);
  Mirror dev;
  dev.upload_all(st.ck, st.idx, st.rings.d, st.rings.k, st.rings.g, st.wp, st.base, st.flush);
  for (int step = 0; step < c.steps; ++step) {
    // Even steps: sequences of 1..T drafts (cu_seqlens); odd steps: T each in the [N, T] layout
    // (the only one the tensor-core kernel takes: the host knows every sequence's length).
    const bool varlen = step % 2 == 0;
    std::vector<int64_t> lens;
    for (int64_t n = 0; n < N; ++n) lens.push_back(varlen ? rng.integer(1, c.T) : c.T);
    RecurrentSpec spec = varlen ? recurrent_spec(c.shape, c.kda, c.act, 1, c.T, lens)
                                : recurrent_spec(c.shape, c.kda, c.act, N, c.T);
    spec.lower_bound = c.lower_bound;
    RecurrentBatch rb = make_recurrent_batch(rng, spec);
    // Forced folds: the same flags on both backends (the cursors agree after every commit).
    for (int64_t s : st.slots)
      if (s >= 0 && rng.chance(0.1)) st.flush.set({s}, 1);
    dev.upload(st.flush);
    rb.poison_out();
    dev.upload_all(rb.q, rb.k, rb.v, rb.g, rb.beta, rb.out, rb.A_log, rb.dt_bias);
    if (varlen) dev.upload(rb.cu);
    deltastate::replayssm_verify(rv_args(rb, st, c.kda, host_view));
    deltastate::replayssm_verify(rv_args(rb, st, c.kda, dev.views()));
    sync();
    deltastate::check_errors();
    ASSERT_TRUE(close_vs_cpu(dev.download(rb.out).values(), rb.out.values(), kOutTol, c.act))
        << "outputs, step " << step;
    ASSERT_TRUE(
        close_vs_cpu(dev.download(st.ck).values(), st.ck.values(), gpu_state_tol(c.state), c.state))
        << "checkpoint pool, step " << step;
    ASSERT_TRUE(
        close_vs_cpu(dev.download(st.rings.d).values(), st.rings.d.values(), kOutTol, c.ring))
        << "d ring, step " << step;
    ASSERT_TRUE(close_vs_cpu(dev.download(st.rings.k).values(), st.rings.k.values(),
                             Tol{1e-6, 1e-5}, c.ring))
        << "k ring, step " << step;
    ASSERT_TRUE(close_vs_cpu(dev.download(st.rings.g).values(), st.rings.g.values(),
                             Tol{1e-6, 1e-5}, DType::f32))
        << "g ring, step " << step;
    // Both backends now fold and replay the CPU's records: a 16-bit record that the two rounded
    // to neighbouring values (a rounding boundary between their fp32 results) would otherwise
    // move the next fold by up to a unit of the ring's dtype times |k|, past fp32's bound.
    dev.upload_all(st.rings.d, st.rings.k, st.rings.g);
    std::vector<int64_t> accepted;
    for (int64_t n = 0; n < N; ++n)
      accepted.push_back(rng.integer(rng.chance(0.05) ? 0 : 1, lens[n]));
    Tensor acc = index_tensor(accepted);
    dev.upload(acc);
    deltastate::replayssm_commit(commit_args(st, acc, c, host_view));
    deltastate::replayssm_commit(commit_args(st, acc, c, dev.views()));
    sync();
    deltastate::check_errors();
    for (const Tensor* t : {&st.wp, &st.base, &st.flush})
      ASSERT_EQ(dev.download(*t).values(), t->values()) << "cursors, step " << step;
  }
}

const GpuRvCase kGpuCases[] = {
    {{"gdn_qwen3next_f32", kQwen3Next, false, kNoLb, f32, bf16}, f32, 16, 4, 40},
    {{"gdn_qwen3next_bf16", kQwen3Next, false, kNoLb, bf16, bf16}, f32, 16, 4, 40},
    {{"kda_kimi_f32_lb", kKimi, true, kLb, f32, bf16}, f32, 16, 4, 30},
    {{"gdn_odd_bf16ring", kOdd, false, kNoLb, f32, f32}, bf16, 8, 4, 60},
    {{"kda_KgtV_f32", kKgtV, true, kNoLb, f32, f32}, f32, 32, 8, 60},
    // The tensor-core kernel's second n-tile (drafts 4..7), part and whole.
    {{"gdn_qwen3next_t7", kQwen3Next, false, kNoLb, f32, bf16}, bf16, 16, 7, 30},
    {{"kda_kimi_t8", kKimi, true, kLb, f32, bf16}, f32, 16, 8, 24},
    // More drafts than one preparation round and more records than one staging round.
    {{"gdn_qwen3next_long", kQwen3Next, false, kNoLb, f32, bf16}, f32, 40, 12, 20},
    {{"kda_kimi_bf16_long", kKimi, true, kLb, bf16, bf16}, f32, 40, 10, 20},
};
INSTANTIATE_TEST_SUITE_P(Cases, ReplayVerifyGpu, ::testing::ValuesIn(kGpuCases),
                         case_name<GpuRvCase>);

// A verify + commit loop captured into a CUDA graph replays bit-equal to the same calls eager:
// the cursors move on the device, so every replay verifies from the cursors the last one left
// (folds included: L = 8 with 3 drafts folds every other step).
TEST_F(GpuTest, ReplayVerifyCommitGraphReplaysEager) {
  Rng rng = test_rng();
  const GpuRvCase c{{"graph", kQwen3Next, false, kNoLb, f32, bf16}, f32, 8, 3, 1};
  RvState st = make_state(rng, c, 4);
  RecurrentBatch rb = make_recurrent_batch(rng, recurrent_spec(c.shape, false, bf16, 4, c.T));
  Tensor acc = index_tensor({3, 1, 2, 3});
  Mirror eager, graph;
  for (Mirror* m : {&eager, &graph}) {
    m->upload_all(rb.q, rb.k, rb.v, rb.g, rb.beta, rb.out, rb.A_log, rb.dt_bias, acc);
    m->upload_all(st.ck, st.idx, st.rings.d, st.rings.k, st.rings.g, st.wp, st.base, st.flush);
  }
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreate(&stream));
  auto step = [&](Mirror& m) {
    ReplayVerifyArgs a = rv_args(rb, st, false, m.views());
    a.stream = stream;
    a.pdl = true;
    deltastate::replayssm_verify(a);
    ReplayCommitArgs ca = commit_args(st, acc, c, m.views());
    ca.stream = stream;
    ca.pdl = true;
    deltastate::replayssm_commit(ca);
  };
  run_eager_and_graph(step, eager, graph, stream, 5);
  for (const Tensor* t :
       {&rb.out, &st.ck, &st.rings.d, &st.rings.k, &st.rings.g, &st.wp, &st.base, &st.flush}) {
    const Tensor a = eager.download(*t), b = graph.download(*t);
    EXPECT_EQ(std::memcmp(a.alloc_base(), b.alloc_base(), static_cast<size_t>(a.alloc_bytes())), 0);
  }
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

// SGLang's launch modes, request-keyed rings, int8 flags, records past the ring and the exact-raw
// ring (a fold replays it: the exact-fold launch before the verify kernel): random
// cursors each step (write_pos up to L, so the last drafts' records fall past the ring and are
// dropped; random folds), rings keyed by a permutation of the slots (replay_indices), int8
// is_flush; the CUDA backend runs the step as two calls (rows = append, then fold) and the CPU
// backend as one (rows = all): outputs, checkpoint pool and rings agree.
TEST_F(GpuTest, ReplayVerifyModesAndReplayRowsMatchCpu) {
  Rng rng = test_rng();
  for (const GpuRvCase& c : {GpuRvCase{{"gdn", kQwen3Next, false, kNoLb, f32, bf16}, f32, 8, 4, 8},
                             GpuRvCase{{"kda", kOdd, true, kLb, f32, f32}, bf16, 8, 4, 8}}) {
    const int64_t N = 4;
    RvState st = make_state(rng, c, N);
    const int64_t S = st.ck.size(0);
    std::vector<int64_t> rows(static_cast<size_t>(N));
    for (int64_t n = 0; n < N; ++n) rows[n] = (st.slots[n] >= 0 ? st.slots[n] + 1 : 0) % S;
    Tensor ridx = index_tensor(rows, DType::i64);
    Tensor flags = Tensor::contiguous(DType::i8, {S});
    for (Tensor* t : {&st.rings.d, &st.rings.k}) t->fill_normal(rng, 0.3);
    st.rings.g.fill_uniform(rng, -0.5, -0.01);
    // The exact-raw ring (the fold call replays it on the GPU: the exact-fold launch).
    const Shape& sh = c.shape;
    Tensor xv = Tensor::contiguous(c.act, {S, sh.HV, c.L, sh.V});
    Tensor xk = Tensor::contiguous(c.act, {S, sh.H, c.L, sh.K});
    Tensor xb = Tensor::contiguous(f32, {S, sh.HV, c.L});
    xv.fill_normal(rng, 1.0);
    xk.fill_normal(rng, 1.0);
    xb.fill_uniform(rng, 0.05, 0.95);
    Mirror dev;
    dev.upload_all(st.ck, st.idx, st.rings.d, st.rings.k, st.rings.g, st.base, ridx, xv, xk, xb);
    for (int step = 0; step < c.steps; ++step) {
      for (int64_t r = 0; r < S; ++r) {
        st.wp.set({r}, static_cast<double>(rng.integer(0, c.L)));
        st.base.set({r}, static_cast<double>(rng.integer(0, c.L - 1)));
        flags.set({r}, rng.chance(0.3) ? 1 : 0);
      }
      dev.upload_all(st.wp, st.base, flags);
      std::vector<int64_t> lens;
      for (int64_t n = 0; n < N; ++n) lens.push_back(rng.integer(1, c.T));
      RecurrentSpec spec = recurrent_spec(c.shape, c.kda, c.act, 1, c.T, lens);
      spec.lower_bound = c.lower_bound;
      RecurrentBatch rb = make_recurrent_batch(rng, spec);
      rb.poison_out();
      dev.upload_all(rb.q, rb.k, rb.v, rb.g, rb.beta, rb.out, rb.A_log, rb.dt_bias, rb.cu);
      ReplayVerifyArgs cpu = rv_args(rb, st, c.kda, host_view);
      cpu.replay_indices = ridx.view();
      cpu.is_flush = flags.view();
      cpu.rawv_cache = xv.view();
      cpu.rawk_cache = xk.view();
      cpu.beta_cache = xb.view();
      deltastate::replayssm_verify(cpu);
      for (auto mode : {deltastate::ReplayRows::append, deltastate::ReplayRows::fold}) {
        ReplayVerifyArgs a = rv_args(rb, st, c.kda, dev.views());
        a.replay_indices = dev.view(ridx);
        a.is_flush = dev.view(flags);
        a.rawv_cache = dev.view(xv);
        a.rawk_cache = dev.view(xk);
        a.beta_cache = dev.view(xb);
        a.rows = mode;
        deltastate::replayssm_verify(a);
      }
      sync();
      deltastate::check_errors();
      ASSERT_TRUE(close_vs_cpu(dev.download(rb.out).values(), rb.out.values(), kOutTol, c.act))
          << c.name << " outputs, step " << step;
      ASSERT_TRUE(close_vs_cpu(dev.download(st.ck).values(), st.ck.values(), gpu_state_tol(c.state),
                               c.state))
          << c.name << " checkpoint pool, step " << step;
      ASSERT_TRUE(
          close_vs_cpu(dev.download(st.rings.d).values(), st.rings.d.values(), kOutTol, c.ring))
          << c.name << " d ring, step " << step;
      ASSERT_TRUE(close_vs_cpu(dev.download(st.rings.k).values(), st.rings.k.values(),
                               Tol{1e-6, 1e-5}, c.ring))
          << c.name << " k ring, step " << step;
      ASSERT_TRUE(close_vs_cpu(dev.download(st.rings.g).values(), st.rings.g.values(),
                               Tol{1e-6, 1e-5}, DType::f32))
          << c.name << " g ring, step " << step;
      ASSERT_EQ(dev.download(xv).values(), xv.values()) << c.name << " raw v, step " << step;
      ASSERT_EQ(dev.download(xk).values(), xk.values()) << c.name << " raw k, step " << step;
      ASSERT_TRUE(close_vs_cpu(dev.download(xb).values(), xb.values(), Tol{1e-6, 1e-5}, f32))
          << c.name << " beta ring, step " << step;
    }
    // The commit with int8 flags, cache_buf_len and fold_every_commit: cursors equal.
    Tensor acc = index_tensor({1, 2, 0, 3});
    dev.upload_all(acc);
    for (bool every : {false, true}) {
      ReplayCommitArgs h = commit_args(st, acc, c, host_view),
                       g = commit_args(st, acc, c, dev.views());
      h.is_flush = flags.view();
      g.is_flush = dev.view(flags);
      h.state_indices = ridx.view();
      g.state_indices = dev.view(ridx);
      h.cache_buf_len = g.cache_buf_len = 2 * c.L;
      h.fold_every_commit = g.fold_every_commit = every;
      deltastate::replayssm_commit(h);
      deltastate::replayssm_commit(g);
      sync();
      deltastate::check_errors();
      for (const Tensor* t : {&st.wp, &st.base, &flags})
        ASSERT_EQ(dev.download(*t).values(), t->values()) << c.name << " cursors";
    }
  }
}

// The hi/lo residual ring (rawv, rawk without beta_cache) against the CPU backend: verify ->
// commit steps with bf16 d/k rings and bf16 residual rings filled with sentinels, forced folds, a
// padded sequence and NaN-poisoned outputs, on the generic kernel the residual ring runs on (K =
// 128 included), T = 12 with more drafts than one preparation round (run it with
// DELTASTATE_CUDA_REPLAY_VERIFY_KERNEL=factor too, for the factored drafts' residuals; T <= 8
// there): outputs, checkpoint pool and rings as in
// StepsMatchCpu; each record's hi + lo (d + its residual, k + its residual) as the CPU's within
// the outputs' tolerance; every residual element the CPU leaves a sentinel is one on the GPU.
TEST_F(GpuTest, ReplayVerifyResidualRingMatchesCpu) {
  Rng rng = test_rng();
  for (const GpuRvCase& c :
       {GpuRvCase{{"gdn", kQwen3Next, false, kNoLb, f32, bf16}, bf16, 16, 4, 12},
        GpuRvCase{{"kda_odd", kOdd, true, kLb, f32, f32}, bf16, 8, 4, 12},
        GpuRvCase{{"gdn_bf16_long", kQwen3Next, false, kNoLb, bf16, bf16}, bf16, 40, 12, 8}}) {
    const int64_t N = 4;
    RvState st = make_state(rng, c, N);
    const int64_t S = st.ck.size(0);
    const Shape& sh = c.shape;
    Tensor dres = Tensor::contiguous(bf16, {S, sh.HV, c.L, sh.V});
    Tensor kres = Tensor::contiguous(bf16, {S, sh.H, c.L, sh.K});
    dres.fill_all(kSentinel);
    kres.fill_all(kSentinel);
    const double sentinel = dres.values()[0];  // as stored
    Mirror dev;
    dev.upload_all(st.ck, st.idx, st.rings.d, st.rings.k, st.rings.g, st.wp, st.base, st.flush,
                   dres, kres);
    auto hi_lo = [](const std::vector<double>& hi, const std::vector<double>& lo) {
      std::vector<double> x(hi.size());
      for (size_t i = 0; i < x.size(); ++i) x[i] = hi[i] + lo[i];
      return x;
    };
    for (int step = 0; step < c.steps; ++step) {
      std::vector<int64_t> lens;
      for (int64_t n = 0; n < N; ++n) lens.push_back(rng.integer(1, c.T));
      RecurrentSpec spec = recurrent_spec(c.shape, c.kda, c.act, 1, c.T, lens);
      spec.lower_bound = c.lower_bound;
      RecurrentBatch rb = make_recurrent_batch(rng, spec);
      for (int64_t s : st.slots)
        if (s >= 0 && rng.chance(0.2)) st.flush.set({s}, 1);
      dev.upload(st.flush);
      rb.poison_out();
      dev.upload_all(rb.q, rb.k, rb.v, rb.g, rb.beta, rb.out, rb.A_log, rb.dt_bias, rb.cu);
      ReplayVerifyArgs cpu = rv_args(rb, st, c.kda, host_view);
      cpu.rawv_cache = dres.view();
      cpu.rawk_cache = kres.view();
      deltastate::replayssm_verify(cpu);
      ReplayVerifyArgs gpu = rv_args(rb, st, c.kda, dev.views());
      gpu.rawv_cache = dev.view(dres);
      gpu.rawk_cache = dev.view(kres);
      deltastate::replayssm_verify(gpu);
      sync();
      deltastate::check_errors();
      ASSERT_TRUE(close_vs_cpu(dev.download(rb.out).values(), rb.out.values(), kOutTol, c.act))
          << c.name << " outputs, step " << step;
      ASSERT_TRUE(close_vs_cpu(dev.download(st.ck).values(), st.ck.values(), gpu_state_tol(c.state),
                               c.state))
          << c.name << " checkpoint pool, step " << step;
      const std::vector<double> d = dev.download(st.rings.d).values(),
                                k = dev.download(st.rings.k).values(),
                                dr = dev.download(dres).values(), kr = dev.download(kres).values();
      const std::vector<double> cd = st.rings.d.values(), ck = st.rings.k.values(),
                                cdr = dres.values(), ckr = kres.values();
      ASSERT_TRUE(close_vs_cpu(d, cd, kOutTol, c.ring)) << c.name << " d ring, step " << step;
      ASSERT_TRUE(close_vs_cpu(k, ck, Tol{1e-6, 1e-5}, c.ring))
          << c.name << " k ring, step " << step;
      ASSERT_TRUE(close_vs_cpu(dev.download(st.rings.g).values(), st.rings.g.values(),
                               Tol{1e-6, 1e-5}, DType::f32))
          << c.name << " g ring, step " << step;
      ASSERT_TRUE(close_vs_cpu(hi_lo(d, dr), hi_lo(cd, cdr), kOutTol, DType::f32))
          << c.name << " d + d residual, step " << step;
      ASSERT_TRUE(close_vs_cpu(hi_lo(k, kr), hi_lo(ck, ckr), Tol{1e-5, 1e-4}, DType::f32))
          << c.name << " k + k residual, step " << step;
      for (size_t i = 0; i < cdr.size(); ++i) {
        if (cdr[i] == sentinel) {
          ASSERT_EQ(dr[i], sentinel) << c.name << " d residual " << i;
        }
      }
      for (size_t i = 0; i < ckr.size(); ++i) {
        if (ckr[i] == sentinel) {
          ASSERT_EQ(kr[i], sentinel) << c.name << " k residual " << i;
        }
      }
      std::vector<int64_t> accepted;
      for (int64_t n = 0; n < N; ++n)
        accepted.push_back(rng.integer(rng.chance(0.05) ? 0 : 1, lens[n]));
      Tensor acc = index_tensor(accepted);
      dev.upload(acc);
      deltastate::replayssm_commit(commit_args(st, acc, c, host_view));
      deltastate::replayssm_commit(commit_args(st, acc, c, dev.views()));
      sync();
      deltastate::check_errors();
      for (const Tensor* t : {&st.wp, &st.base, &st.flush})
        ASSERT_EQ(dev.download(*t).values(), t->values()) << c.name << " cursors, step " << step;
    }
  }
}

// SGLang's cache_ring on the CUDA verify (the generic kernel) against the CPU backend's: the raw
// v and k as given, g and beta as the step computes them, at positions t < L of each sequence's
// slot; the outputs unchanged by it; padded sequences write nothing.
TEST_F(GpuTest, VerifyCacheRingMatchesCpu) {
  Rng rng = test_rng();
  for (bool kda : {false, true}) {
    const Shape sh = kda ? kOdd : kQwen3Next;
    const int64_t N = 3, S = 5, L = 3, T = 4;  // T > L: the last draft records nothing
    Tensor pool = make_pool(f32, S, sh);
    std::vector<int64_t> slots = {3, -1, 1};
    fill_live_slots(pool.view(), slots, rng);
    Tensor idx = index_tensor(slots);
    RecurrentSpec spec = recurrent_spec(sh, kda, bf16, N, T);
    spec.lower_bound = kda ? kLb : kNoLb;
    RecurrentBatch rb = make_recurrent_batch(rng, spec);
    Tensor rv = Tensor::contiguous(bf16, {S, sh.HV, L, sh.V});
    Tensor rk = Tensor::contiguous(bf16, {S, sh.H, L, sh.K});
    Tensor rg =
        kda ? Tensor::contiguous(f32, {S, sh.HV, L, sh.K}) : Tensor::contiguous(f32, {S, sh.HV, L});
    Tensor rbt = Tensor::contiguous(f32, {S, sh.HV, L});
    for (Tensor* t : {&rv, &rk, &rg, &rbt}) t->fill_all(kSentinel);
    Mirror dev;
    dev.upload_all(pool, idx, rv, rk, rg, rbt, rb.q, rb.k, rb.v, rb.g, rb.beta, rb.out, rb.A_log,
                   rb.dt_bias);
    auto args = [&](auto&& view_of) {
      deltastate::VerifyArgs a = verify_inputs(rb.args(view_of), kda);
      a.state = view_of(pool);
      a.state_indices = view_of(idx);
      a.update_state = false;
      a.ring_v = view_of(rv);
      a.ring_k = view_of(rk);
      a.ring_g = view_of(rg);
      a.ring_beta = view_of(rbt);
      return a;
    };
    rb.poison_out();
    deltastate::verify(args(host_view));
    deltastate::verify(args(dev.views()));
    sync();
    deltastate::check_errors();
    ASSERT_TRUE(close_vs_cpu(dev.download(rb.out).values(), rb.out.values(), kOutTol, bf16));
    EXPECT_EQ(dev.download(rv).values(), rv.values()) << "raw v";
    EXPECT_EQ(dev.download(rk).values(), rk.values()) << "raw k";
    ASSERT_TRUE(close_vs_cpu(dev.download(rg).values(), rg.values(), Tol{1e-6, 1e-5}, f32));
    ASSERT_TRUE(close_vs_cpu(dev.download(rbt).values(), rbt.values(), Tol{1e-6, 1e-5}, f32));
  }
}

// Fold-every-commit's commit (replayssm_fold_commit) against the CPU backend: every layer of an
// envelope-strided pool, random raw rings (GDN and KDA), accepted counts from 0 to L, a padded
// row, track slots at random steps (one past the pool, not reached): the folded and tracked
// states within the GPU tolerance, every other byte of the pool bit-untouched; a row accepting
// more than L records is skipped and recorded for check_errors.
TEST_F(GpuTest, ReplayFoldCommitMatchesCpu) {
  Rng rng = test_rng();
  for (bool kda : {false, true}) {
    const Shape sh = kda ? kOdd : kQwen3Next;
    const int64_t layers = 3, S = 7, L = 4;
    const int64_t inner = sh.state_elems(), entry = layers * inner + 64;
    Tensor pool =
        Tensor::strided(f32, {layers, S, sh.HV, sh.V, sh.K},
                        {inner, entry, int64_t{sh.V} * sh.K, sh.K, 1}, 32, S * entry + 64);
    pool.fill_all(kSentinel);
    std::vector<int64_t> slots = {4, -1, 1, 6, 2}, acc = {4, 3, 0, 1, 2};
    std::vector<int64_t> track = {0, 3, 5, 9, -1}, steps = {1, 0, 0, 1, 0};
    for (int64_t l = 0; l < layers; ++l)
      for (int64_t s :
           {int64_t{4}, int64_t{1}, int64_t{6}, int64_t{2}, int64_t{0}, int64_t{3}, int64_t{5}})
        for (int hv = 0; hv < sh.HV; ++hv)
          for (int v = 0; v < sh.V; ++v)
            for (int k = 0; k < sh.K; ++k) pool.set({l, s, hv, v, k}, rng.normal(0.5));
    Tensor rv = Tensor::contiguous(bf16, {layers, S, sh.HV, L, sh.V});
    Tensor rk = Tensor::contiguous(bf16, {layers, S, sh.H, L, sh.K});
    Tensor rg = kda ? Tensor::contiguous(f32, {layers, S, sh.HV, L, sh.K})
                    : Tensor::contiguous(f32, {layers, S, sh.HV, L});
    Tensor rb = Tensor::contiguous(f32, {layers, S, sh.HV, L});
    rv.fill_normal(rng, 1.0);
    rk.fill_normal(rng, 1.0);
    rg.fill_uniform(rng, -0.6, -0.01);
    rb.fill_uniform(rng, 0.05, 0.95);
    Tensor idx = index_tensor(slots), a = index_tensor(acc, DType::i64);
    Tensor ti = index_tensor(track), ts = index_tensor(steps);
    Mirror dev;
    dev.upload_all(pool, rv, rk, rg, rb, idx, a, ti, ts);
    auto args = [&](auto&& view_of) {
      deltastate::ReplayFoldArgs f;
      f.state = view_of(pool);
      f.rawv = view_of(rv);
      f.rawk = view_of(rk);
      f.g = view_of(rg);
      f.beta = view_of(rb);
      f.state_indices = view_of(idx);
      f.accept_lens = view_of(a);
      f.track_indices = view_of(ti);
      f.steps_to_track = view_of(ts);
      f.is_kda = kda;
      return f;
    };
    const Tensor before = pool.empty_like();
    std::memcpy(before.alloc_base(), pool.alloc_base(), static_cast<size_t>(pool.alloc_bytes()));
    deltastate::replayssm_fold_commit(args(host_view));
    deltastate::replayssm_fold_commit(args(dev.views()));
    sync();
    deltastate::check_errors();
    const Tensor got = dev.download(pool);
    ASSERT_TRUE(close_vs_cpu(got.values(), pool.values(), Tol{1e-4, 1e-3}, f32))
        << (kda ? "kda" : "gdn");
    // Untouched bytes: compare the GPU result with the pre-call pool outside the written states.
    const float* g0 = static_cast<const float*>(got.alloc_base());
    const float* b0 = static_cast<const float*>(before.alloc_base());
    const float* c0 = static_cast<const float*>(pool.alloc_base());
    for (int64_t e = 0; e < pool.alloc_bytes() / 4; ++e)
      if (std::memcmp(&c0[e], &b0[e], 4) == 0) {  // the CPU left it: so must the GPU
        ASSERT_EQ(std::memcmp(&g0[e], &b0[e], 4), 0) << "element " << e;
      }
    // Too many accepted records: skipped and recorded.
    Tensor bad = index_tensor({5, 1, 1, 1, 1}, DType::i64);
    dev.upload(bad);
    auto fa = args(dev.views());
    fa.accept_lens = dev.view(bad);
    const Tensor pre = dev.download(pool);
    deltastate::replayssm_fold_commit(fa);
    sync();
    const auto err = catch_error([] { deltastate::check_errors(); });
    ASSERT_TRUE(err);
    EXPECT_NE(std::string(err->what()).find("replayssm_fold_commit"), std::string::npos)
        << err->what();
    const Tensor post = dev.download(pool);
    for (int64_t l = 0; l < layers; ++l)
      for (int hv = 0; hv < sh.HV; ++hv)
        for (int v = 0; v < sh.V; ++v)
          for (int k = 0; k < sh.K; ++k)
            ASSERT_EQ(post.get({l, 4, hv, v, k}), pre.get({l, 4, hv, v, k})) << "skipped row";
  }
}

// The compact circular commit (replayssm_circular_commit) against the CPU backend: every layer,
// rings keyed by replay row with fewer cursor entries than ring rows, capacity rows and track rows
// at random origins, residual rings, int8 flags: the states within the GPU tolerance, the cursors
// equal, every other byte of the pool bit-untouched.
TEST_F(GpuTest, ReplayCircularCommitMatchesCpu) {
  Rng rng = test_rng();
  const Shape sh = kQwen3Next;
  const int64_t layers = 2, S = 6, R = 6, C = 4, L = 16;
  const int64_t inner = sh.state_elems(), entry = layers * inner + 64;
  Tensor pool = Tensor::strided(f32, {layers, S, sh.HV, sh.V, sh.K},
                                {inner, entry, int64_t{sh.V} * sh.K, sh.K, 1}, 32, S * entry + 64);
  pool.fill_all(kSentinel);
  for (int64_t l = 0; l < layers; ++l)
    for (int64_t s = 0; s < S; ++s)
      for (int hv = 0; hv < sh.HV; ++hv)
        for (int v = 0; v < sh.V; ++v)
          for (int k = 0; k < sh.K; ++k) pool.set({l, s, hv, v, k}, rng.normal(0.5));
  Tensor d = Tensor::contiguous(bf16, {layers, R, sh.HV, L, sh.V});
  Tensor k = Tensor::contiguous(bf16, {layers, R, sh.H, L, sh.K});
  Tensor g = Tensor::contiguous(f32, {layers, R, sh.HV, L});
  Tensor dr = Tensor::contiguous(bf16, {layers, R, sh.HV, L, sh.V});
  Tensor kr = Tensor::contiguous(bf16, {layers, R, sh.H, L, sh.K});
  d.fill_normal(rng, 0.3);
  k.fill_normal(rng, 0.1);
  g.fill_uniform(rng, -0.3, -0.01);
  dr.fill_normal(rng, 1e-3);
  kr.fill_normal(rng, 1e-3);
  Tensor slots = index_tensor({2, -1, 5, 1}), rows = index_tensor({3, 0, 1, 0});
  Tensor wp = index_tensor({7, 5, 0, 16}), base = index_tensor({3, 15, 0, 9});
  Tensor fl = Tensor::contiguous(DType::i8, {C});
  for (int64_t i = 0; i < C; ++i) fl.set({i}, i == 3 || i == 1 ? 1 : 0);
  Tensor acc = index_tensor({2, 1, 3, 2}), ti = index_tensor({4, -1, 0, -1}),
         ts = index_tensor({1, 0, 0, 0});
  Mirror dev;
  dev.upload_all(pool, d, k, g, dr, kr, slots, rows, wp, base, fl, acc, ti, ts);
  auto args = [&](auto&& view_of) {
    deltastate::ReplayCircularCommitArgs a;
    a.state = view_of(pool);
    a.d_cache = view_of(d);
    a.k_cache = view_of(k);
    a.g_cache = view_of(g);
    a.d_residual = view_of(dr);
    a.k_residual = view_of(kr);
    a.state_indices = view_of(slots);
    a.replay_indices = view_of(rows);
    a.write_pos = view_of(wp);
    a.cache_base = view_of(base);
    a.is_flush = view_of(fl);
    a.accept_lens = view_of(acc);
    a.track_indices = view_of(ti);
    a.steps_to_track = view_of(ts);
    return a;
  };
  const Tensor before = pool.empty_like();
  std::memcpy(before.alloc_base(), pool.alloc_base(), static_cast<size_t>(pool.alloc_bytes()));
  deltastate::replayssm_circular_commit(args(host_view));
  deltastate::replayssm_circular_commit(args(dev.views()));
  sync();
  deltastate::check_errors();
  const Tensor got = dev.download(pool);
  ASSERT_TRUE(close_vs_cpu(got.values(), pool.values(), Tol{1e-4, 1e-3}, f32));
  const float* g0 = static_cast<const float*>(got.alloc_base());
  const float* b0 = static_cast<const float*>(before.alloc_base());
  const float* c0 = static_cast<const float*>(pool.alloc_base());
  for (int64_t e = 0; e < pool.alloc_bytes() / 4; ++e)
    if (std::memcmp(&c0[e], &b0[e], 4) == 0) {
      ASSERT_EQ(std::memcmp(&g0[e], &b0[e], 4), 0) << "element " << e;
    }
  for (const Tensor* t : {&wp, &base, &fl})
    ASSERT_EQ(dev.download(*t).values(), t->values()) << "cursors";
}

// A slot past the pool and a cursor outside the ring: the rows are skipped (NaN outputs,
// nothing written) and the first is recorded for check_errors; the commit's bad count likewise.
class ReplayVerifyGpuErrors : public GpuTest {};

TEST_F(ReplayVerifyGpuErrors, BadRowsRecorded) {
  Rng rng = test_rng();
  const GpuRvCase c{{"err", kOdd, false, kNoLb, f32, f32}, f32, 16, 4, 1};
  RvState st = make_state(rng, c, 3);
  const int64_t S = st.ck.size(0);
  st.idx = index_tensor({S + 2, -1, st.slots[2]});
  st.wp.set({st.slots[2]}, 17);  // past the ring of 16
  RecurrentBatch rb = make_recurrent_batch(rng, recurrent_spec(c.shape, false, f32, 3, c.T));
  rb.poison_out();
  Mirror dev;
  dev.upload_all(st.ck, st.idx, st.rings.d, st.rings.k, st.rings.g, st.wp, st.base, st.flush);
  dev.upload_all(rb.q, rb.k, rb.v, rb.g, rb.beta, rb.out, rb.A_log, rb.dt_bias);
  const Tensor ck0 = dev.download(st.ck), d0 = dev.download(st.rings.d);
  deltastate::replayssm_verify(rv_args(rb, st, false, dev.views()));
  sync();
  const auto err = catch_error([] { deltastate::check_errors(); });
  ASSERT_TRUE(err);
  EXPECT_NE(std::string(err->what()).find("replayssm_verify"), std::string::npos) << err->what();
  const Tensor out = dev.download(rb.out);
  for (int64_t t = 0; t < c.T; ++t) {
    for (int64_t n : {int64_t{0}, int64_t{2}})
      for (int hv = 0; hv < c.shape.HV; ++hv)
        for (int i = 0; i < c.shape.V; ++i) EXPECT_TRUE(std::isnan(out.get({n, t, hv, i})));
    for (int hv = 0; hv < c.shape.HV; ++hv)
      for (int i = 0; i < c.shape.V; ++i) EXPECT_EQ(out.get({1, t, hv, i}), 0.0);
  }
  EXPECT_EQ(dev.download(st.ck).bytes(), ck0.bytes());
  EXPECT_EQ(dev.download(st.rings.d).bytes(), d0.bytes());
  Tensor acc = index_tensor({9, 1, 1});  // 9 > max_spec_len, on a live row
  Tensor good = index_tensor({st.slots[0] >= 0 ? st.slots[0] : 0, -1, st.slots[2]});
  dev.upload_all(acc, good);
  ReplayCommitArgs ca = commit_args(st, acc, c, dev.views());
  ca.state_indices = dev.view(good);
  deltastate::replayssm_commit(ca);
  sync();
  const auto err2 = catch_error([] { deltastate::check_errors(); });
  ASSERT_TRUE(err2);
  EXPECT_NE(std::string(err2->what()).find("replayssm_commit"), std::string::npos) << err2->what();
}

// The cursor reset on CUDA: the CPU backend's cursors for the same rows (int8 flags at a
// stride, a null-block row, a padded row, an unflagged row), then a flagged slot past the pool
// recorded for check_errors with no cursor written.
TEST_F(ReplayVerifyGpuErrors, ResetCursorsMatchCpuAndRecordBadSlot) {
  clear_device_errors();
  const int64_t S = 9;
  auto cursors = [&] {
    std::array<Tensor, 3> c{Tensor::contiguous(DType::i32, {S}),
                            Tensor::contiguous(DType::i32, {S}),
                            Tensor::contiguous(DType::i8, {S})};
    for (int64_t s = 0; s < S; ++s) {
      c[0].set({s}, 3 + s);
      c[1].set({s}, 1 + s);
      c[2].set({s}, s % 2);
    }
    return c;
  };
  std::array<Tensor, 3> host = cursors(), gpu = cursors();
  Tensor idx = index_tensor({4, 0, 7, 2, -1, 5});
  Tensor flags = Tensor::strided(DType::i8, {6}, {3});
  const std::vector<double> f = {1, 1, 1, 0, 1, 3};
  for (int64_t b = 0; b < 6; ++b) flags.set({b}, f[b]);
  auto args = [&](auto&& view_of, std::array<Tensor, 3>& c, const Tensor& rows) {
    deltastate::ReplayResetArgs a;
    a.write_pos = view_of(c[0]);
    a.cache_base = view_of(c[1]);
    a.is_flush = view_of(c[2]);
    a.do_reset = view_of(flags);
    a.state_indices = view_of(rows);
    a.max_cache_len = 6;  // 2 * max_spec_len > max_cache_len: the reset rows start folding
    a.max_spec_len = 4;
    a.null_block_id = 0;  // SGLang's null block: the row on slot 0 is padding
    return a;
  };
  deltastate::replayssm_reset_cursors(args([](const Tensor& t) { return t.view(); }, host, idx));
  Mirror dev;
  dev.upload_all(gpu[0], gpu[1], gpu[2], idx, flags);
  deltastate::replayssm_reset_cursors(args(dev.views(), gpu, idx));
  sync();
  deltastate::check_errors();  // nothing recorded (it throws otherwise)
  for (int i = 0; i < 3; ++i) EXPECT_EQ(dev.download(gpu[i]).values(), host[i].values()) << i;
  Tensor bad = index_tensor({S + 1, 1, 1, 1, 1, 1});  // row 0 flagged, slot past the pool
  Tensor quiet = Tensor::contiguous(DType::i8, {6});
  quiet.set({0}, 1);
  dev.upload_all(bad, quiet);
  const Tensor before = dev.download(gpu[0]);
  deltastate::ReplayResetArgs a = args(dev.views(), gpu, bad);
  a.do_reset = dev.view(quiet);
  deltastate::replayssm_reset_cursors(a);
  sync();
  const auto err = catch_error([] { deltastate::check_errors(); });
  ASSERT_TRUE(err);
  EXPECT_NE(std::string(err->what()).find("replayssm_reset_cursors"), std::string::npos)
      << err->what();
  EXPECT_EQ(dev.download(gpu[0]).values(), before.values());
}

// The circular commit with a track slot past the pool (the CPU validator raises): on CUDA that
// row is skipped whole (no checkpoint, track slot or cursor written) and recorded with the CPU's
// text; the other row commits as the CPU backend commits it with the bad row padded, and every
// element the CPU leaves (the skipped row's checkpoint, the 1e30 sentinels around the slots) is
// bit-untouched.
TEST_F(ReplayVerifyGpuErrors, CircularTrackPastPoolRecorded) {
  clear_device_errors();
  Rng rng = test_rng();
  const Shape sh = kQwen3Next;
  const int64_t layers = 2, S = 5, R = 4, L = 8;
  const int64_t inner = sh.state_elems(), entry = layers * inner + 64;
  Tensor pool = Tensor::strided(f32, {layers, S, sh.HV, sh.V, sh.K},
                                {inner, entry, int64_t{sh.V} * sh.K, sh.K, 1}, 32, S * entry + 64);
  pool.fill_all(kSentinel);
  for (int64_t l = 0; l < layers; ++l)
    for (int64_t s : {int64_t{1}, int64_t{3}})  // the checkpoints; track slot 4 stays sentinel
      for (int hv = 0; hv < sh.HV; ++hv)
        for (int v = 0; v < sh.V; ++v)
          for (int k = 0; k < sh.K; ++k) pool.set({l, s, hv, v, k}, rng.normal(0.5));
  Tensor d = Tensor::contiguous(f32, {layers, R, sh.HV, L, sh.V});
  Tensor k = Tensor::contiguous(f32, {layers, R, sh.H, L, sh.K});
  Tensor g = Tensor::contiguous(f32, {layers, R, sh.HV, L});
  d.fill_normal(rng, 0.3);
  k.fill_normal(rng, 0.1);
  g.fill_uniform(rng, -0.3, -0.01);
  // Row 0 (slot 1, ring row 2: write_pos 3, cache_base 6, is_flush 1) would fold the 3 records at
  // ring positions 6, 7, 0 and track into slot S, past the pool. Row 1 (slot 3, ring row 0:
  // write_pos 5, cache_base 0, is_flush 1) folds the 5 records at ring positions 0..4 into slot 3
  // and tracks m = write_pos - accept_lens + steps_to_track + 1 = 5 - 2 + 1 + 1 = 5 records (the
  // folded state) into slot 4; its cursors become write_pos 0, cache_base 5, is_flush 0.
  Tensor slots = index_tensor({1, 3}), rows = index_tensor({2, 0});
  Tensor wp = index_tensor({5, 0, 3, 0}), base = index_tensor({0, 0, 6, 0}),
         fl = index_tensor({1, 0, 1, 0});
  Tensor acc = index_tensor({2, 2}), ti = index_tensor({S, 4}), ts = index_tensor({0, 1});
  Mirror dev;
  dev.upload_all(pool, d, k, g, slots, rows, wp, base, fl, acc, ti, ts);
  auto args = [&](auto&& view_of) {
    deltastate::ReplayCircularCommitArgs a;
    a.state = view_of(pool);
    a.d_cache = view_of(d);
    a.k_cache = view_of(k);
    a.g_cache = view_of(g);
    a.state_indices = view_of(slots);
    a.replay_indices = view_of(rows);
    a.write_pos = view_of(wp);
    a.cache_base = view_of(base);
    a.is_flush = view_of(fl);
    a.accept_lens = view_of(acc);
    a.track_indices = view_of(ti);
    a.steps_to_track = view_of(ts);
    return a;
  };
  // The CPU backend's validator raises; the CUDA record says the same, with the op's name and
  // what was skipped around it.
  const std::string cpu_text = "`mamba_track_indices`[0]=" + std::to_string(S) +
                               " is out of range for a pool of " + std::to_string(S) + " slots";
  expect_error([&] { deltastate::replayssm_circular_commit(args(host_view)); }, cpu_text);
  const std::string text =
      "commit_gdn_replayssm_circular: " + cpu_text +
      "; the row was skipped (state, rings and cursor untouched) and its output is NaN";
  const Tensor before = pool.empty_like();
  std::memcpy(before.alloc_base(), pool.alloc_base(), static_cast<size_t>(pool.alloc_bytes()));
  const std::vector<double> cursors0[] = {wp.values(), base.values(), fl.values()};
  deltastate::replayssm_circular_commit(args(dev.views()));
  sync();
  expect_reported(nullptr, {text});
  // The CPU reference: the bad row padded.
  slots.set({0}, -1.0);
  deltastate::replayssm_circular_commit(args(host_view));
  const Tensor got = dev.download(pool);
  ASSERT_TRUE(close_vs_cpu(got.values(), pool.values(), Tol{1e-4, 1e-3}, f32));
  const float* g0 = static_cast<const float*>(got.alloc_base());
  const float* b0 = static_cast<const float*>(before.alloc_base());
  const float* c0 = static_cast<const float*>(pool.alloc_base());
  int64_t sentinels = 0;
  for (int64_t e = 0; e < pool.alloc_bytes() / 4; ++e) {
    if (std::memcmp(&c0[e], &b0[e], 4) == 0) {  // the CPU left it: so must the GPU
      ASSERT_EQ(std::memcmp(&g0[e], &b0[e], 4), 0) << "element " << e;
    }
    if (b0[e] == static_cast<float>(kSentinel) && c0[e] == b0[e]) ++sentinels;
  }
  EXPECT_GT(sentinels, 0);
  for (int64_t l = 0; l < layers; ++l)  // the skipped row's checkpoint, bit for bit
    for (int hv = 0; hv < sh.HV; ++hv)
      for (int v = 0; v < sh.V; ++v)
        for (int i = 0; i < sh.K; ++i)
          ASSERT_EQ(got.get({l, 1, hv, v, i}), before.get({l, 1, hv, v, i})) << "skipped row";
  // The good row folded its 5 records: on the CPU slot 3 moved off its checkpoint by far more
  // than 5% of its norm (the records' decay alone, e^{G_4} with G_4 the sum of 5 log decays drawn
  // from [-0.3, -0.01], takes off about half), and the GPU's track slot 4 is written whole (no
  // sentinel left).
  for (int64_t l = 0; l < layers; ++l) {
    SCOPED_TRACE("layer " + std::to_string(l));
    double moved2 = 0.0, old2 = 0.0;
    int64_t track_sentinels = 0;
    for (int hv = 0; hv < sh.HV; ++hv)
      for (int v = 0; v < sh.V; ++v)
        for (int i = 0; i < sh.K; ++i) {
          const double o = before.get({l, 3, hv, v, i}), f = pool.get({l, 3, hv, v, i});
          moved2 += (f - o) * (f - o);
          old2 += o * o;
          if (got.get({l, 4, hv, v, i}) == static_cast<double>(static_cast<float>(kSentinel)))
            ++track_sentinels;
        }
    EXPECT_GT(std::sqrt(moved2 / old2), 0.05) << "the good row's fold into slot 3 (CPU)";
    EXPECT_EQ(track_sentinels, 0) << "the good row's track slot 4 (GPU)";
  }
  // Cursors: the good row's ring row 0 moved (by its 5 folded records) as on the CPU; the skipped
  // row's ring row 2 not.
  const Tensor* cur[] = {&wp, &base, &fl};
  const double folded[] = {0, 5, 0};  // ring row 0's write_pos, cache_base, is_flush after
  for (int i = 0; i < 3; ++i) {
    const std::vector<double> gpu = dev.download(*cur[i]).values();
    EXPECT_EQ(gpu, cur[i]->values()) << "cursor table " << i;
    EXPECT_EQ(gpu[0], folded[i]) << "cursor table " << i << ", the good row";
    EXPECT_EQ(gpu[2], cursors0[i][2]) << "cursor table " << i << ", skipped row";
  }
}

}  // namespace
}  // namespace dstest
