// The lossless invariant on the CUDA backend (python/tests/test_lossless.py is the CPU twin, bit
// for bit there): 1,000 verify -> commit steps with random acceptance, all-rejected rows
// included, for each speculative scheme on the GPU, against the CPU backend's plain verify +
// commit of the same tokens (which CI proves equal to plain decode of the accepted tokens, bit for
// bit). Per step, the accepted tokens' outputs and the committed state are compared:
//   * plain verify + commit (verify with intermediate states, update_state_after_verify);
//   * ReplaySSM verify + cursor commit (replayssm_verify, replayssm_commit; forced folds beside
//     the commit's own), fp32 rings and bf16 d/k rings, the latter also with the exact-raw ring
//     (the exact fold launch): the checkpoint at every fold;
//   * fold-every-commit: the CUDA verify writes the raw ring (ring_v/k/g/beta, its generic
//     kernel), replayssm_fold_commit folds the accepted prefix into the GPU checkpoint: after
//     every commit the checkpoint against the CPU's committed state.
// Bounds (fp32 checkpoints): fp32 rings, outputs within 1e-4 + 1e-3 |x| (plus one unit of the
// output's dtype where the two backends' roundings straddle a boundary) and states within 1e-4 +
// 1e-3 |x| over the whole run (the kernels' own reduction orders; no drift); bf16 d/k rings,
// outputs within 5e-3 and states within 2e-2 absolute (the CPU backend with bf16 rings stays
// within 7e-4 and 8e-3 over the same kind of run: python/tests/test_lossless.py's shapes); bf16
// d/k rings with the exact-raw ring, states within fp32's bound (the fold is exact).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>

#include "gpu/gpu_util.h"
#include "test_util.h"

namespace dstest {
namespace {

using deltastate::ReplayCommitArgs;
using deltastate::ReplayVerifyArgs;

enum Scheme { kPlain, kReplay, kFold };

struct LosslessCase : OpCase {
  Scheme scheme;
  DType ring;
  int L, T, steps;
  bool raw = false;  // ReplaySSM with the exact-raw ring (the fold replays raw v, k, beta)
};
void PrintTo(const LosslessCase& c, std::ostream* os) { *os << c.name; }

class LosslessGpu : public GpuParamTest<LosslessCase> {};

TEST_P(LosslessGpu, AcceptedTokensEqualPlainDecode) {
  const LosslessCase& c = GetParam();
  const Shape& sh = c.shape;
  Rng rng = test_rng();
  const int64_t N = 3, S = N + 3;
  const bool exact_rings = c.ring == DType::f32;
  const Tol out_tol = exact_rings ? Tol{1e-4, 1e-3} : Tol{5e-3, 0.0};
  // The exact-raw ring makes every fold the recurrent step's own: fp32's bound for any d/k ring.
  const Tol state_tol = exact_rings || c.raw ? Tol{1e-4, 1e-3} : Tol{2e-2, 0.0};
  std::vector<int64_t> slots = pick_slots(rng, N, S, {1});  // sequence 1 padded
  Tensor plain = make_pool(c.state, S, sh);                 // the CPU reference pool
  Tensor ck = make_pool(c.state, S, sh);                    // the scheme's pool (on the GPU)
  for (int64_t s : slots)
    if (s >= 0) {
      fill_slot(plain.view(), s, rng);
      set_slot_values(ck.view(), s, slot_values(plain.view(), s));
    }
  Tensor idx = index_tensor(slots);
  Tensor inter = Tensor::contiguous(c.state, {N, c.T, sh.HV, sh.V, sh.K});
  Tensor ginter = Tensor::contiguous(c.state, {N, c.T, sh.HV, sh.V, sh.K});
  Rings rings = make_rings(sh, c.kda, S, c.L, c.ring, c.ring);
  Tensor wp = index_tensor(std::vector<int64_t>(S, 0)),
         base = index_tensor(std::vector<int64_t>(S, 0));
  Tensor flush = index_tensor(std::vector<int64_t>(S, 0));
  // The raw ring of fold-every-commit: [S, HV, T, V], [S, H, T, K], g, beta.
  Tensor rv = Tensor::contiguous(c.act, {S, sh.HV, c.T, sh.V});
  Tensor rk = Tensor::contiguous(c.act, {S, sh.H, c.T, sh.K});
  Tensor rg = c.kda ? Tensor::contiguous(f32, {S, sh.HV, c.T, sh.K})
                    : Tensor::contiguous(f32, {S, sh.HV, c.T});
  Tensor rb = Tensor::contiguous(f32, {S, sh.HV, c.T});
  // The exact-raw ring of ReplaySSM: [S, HV, L, V], [S, H, L, K], beta [S, HV, L].
  Tensor xv = Tensor::contiguous(c.act, {S, sh.HV, c.L, sh.V});
  Tensor xk = Tensor::contiguous(c.act, {S, sh.H, c.L, sh.K});
  Tensor xb = Tensor::contiguous(f32, {S, sh.HV, c.L});
  Mirror dev;
  dev.upload_all(ck, idx, rings.d, rings.k, rings.g, wp, base, flush, ginter, xv, xk, xb);
  int folds = 0, rejected = 0;
  double worst_out = 0, worst_state = 0;
  for (int step = 0; step < c.steps; ++step) {
    RecurrentSpec spec = recurrent_spec(sh, c.kda, c.act, N, c.T);
    spec.lower_bound = c.lower_bound;
    RecurrentBatch rb_ = make_recurrent_batch(rng, spec);
    rb_.poison_out();
    dev.upload_all(rb_.q, rb_.k, rb_.v, rb_.g, rb_.beta, rb_.out, rb_.A_log, rb_.dt_bias);
    // The CPU reference: plain verify from the committed pool.
    deltastate::VerifyArgs va = verify_inputs(rb_.args(host_view), c.kda);
    va.state = plain.view();
    va.state_indices = idx.view();
    va.update_state = false;
    va.intermediate_states = inter.view();
    deltastate::verify(va);
    // The scheme on the GPU.
    std::vector<int64_t> folding(N, 0);
    if (c.scheme == kReplay) {
      // The cursors as the last commit left them (on the device), plus forced folds.
      Tensor fl_now = dev.download(flush), wp_now = dev.download(wp);
      for (int64_t s = 0; s < S; ++s) flush.set({s}, fl_now.get({s}));
      for (int64_t n = 0; n < N; ++n)
        if (slots[n] >= 0 && rng.chance(0.05)) flush.set({slots[n]}, 1);
      dev.upload(flush);
      for (int64_t n = 0; n < N; ++n)
        folding[n] = slots[n] >= 0 && flush.get({slots[n]}) != 0 && wp_now.get({slots[n]}) > 0;
      ReplayVerifyArgs a = replay_verify_inputs(rb_.args(dev.views()), c.kda);
      a.state = dev.view(ck);
      a.state_indices = dev.view(idx);
      a.d_cache = dev.view(rings.d);
      a.k_cache = dev.view(rings.k);
      a.g_cache = dev.view(rings.g);
      a.write_pos = dev.view(wp);
      a.cache_base = dev.view(base);
      a.is_flush = dev.view(flush);
      if (c.raw) {
        a.rawv_cache = dev.view(xv);
        a.rawk_cache = dev.view(xk);
        a.beta_cache = dev.view(xb);
      }
      deltastate::replayssm_verify(a);
    } else {
      deltastate::VerifyArgs ga = verify_inputs(rb_.args(dev.views()), c.kda);
      ga.state = dev.view(ck);
      ga.state_indices = dev.view(idx);
      ga.update_state = false;
      if (c.scheme == kPlain) ga.intermediate_states = dev.view(ginter);
      if (c.scheme == kFold) {  // the raw ring, written by the CUDA verify
        ga.ring_v = dev.view(rv);
        ga.ring_k = dev.view(rk);
        ga.ring_g = dev.view(rg);
        ga.ring_beta = dev.view(rb);
      }
      deltastate::verify(ga);
    }
    sync();
    deltastate::check_errors();
    // Folds: the checkpoint is the committed state.
    const Tensor gck = dev.download(ck);
    for (int64_t n = 0; n < N; ++n) {
      if (!folding[n]) continue;
      ++folds;
      const std::vector<double> got = slot_values(gck.view(), slots[n]);
      const std::vector<double> want = slot_values(plain.view(), slots[n]);
      ASSERT_TRUE(all_close(got, want, state_tol)) << c.name << " fold, step " << step;
      for (size_t i = 0; i < got.size(); ++i)
        worst_state = std::max(worst_state, std::fabs(got[i] - want[i]));
    }
    // Accept: none (20%) or 1..T; the accepted outputs.
    std::vector<int64_t> accepted(N, 0);
    for (int64_t n = 0; n < N; ++n) {
      accepted[n] = rng.chance(0.2) ? 0 : rng.integer(1, c.T);
      rejected += slots[n] >= 0 && accepted[n] == 0;
    }
    const Tensor gout = dev.download(rb_.out);
    for (int64_t n = 0; n < N; ++n) {
      if (slots[n] < 0) continue;
      for (int64_t t = 0; t < accepted[n]; ++t)
        for (int hv = 0; hv < sh.HV; ++hv)
          for (int i = 0; i < sh.V; ++i) {
            // each backend rounded its own fp32 output to the output's dtype (close_vs_cpu's
            // rule): a rounding boundary between them moves the stored value by one unit
            const double g = gout.get({n, t, hv, i}), w = rb_.out.get({n, t, hv, i});
            const double base = out_tol.atol + out_tol.rtol * std::fabs(w);
            ASSERT_LE(std::fabs(g - w), base + 2 * half_ulp(c.act, std::fabs(w) + base))
                << c.name << " output, step " << step << " seq " << n << " token " << t;
            worst_out = std::max(worst_out, std::fabs(g - w));
          }
    }
    Tensor acc = index_tensor(accepted, DType::i64);
    dev.upload(acc);
    // The commits: CPU reference, then the scheme's on the GPU.
    deltastate::CommitArgs pc;
    pc.state = plain.view();
    pc.intermediate_states = inter.view();
    pc.state_indices = idx.view();
    pc.accepted = acc.view();
    deltastate::update_state_after_verify(pc);
    if (c.scheme == kPlain) {
      deltastate::CommitArgs gc;
      gc.state = dev.view(ck);
      gc.intermediate_states = dev.view(ginter);
      gc.state_indices = dev.view(idx);
      gc.accepted = dev.view(acc);
      deltastate::update_state_after_verify(gc);
    } else if (c.scheme == kReplay) {
      ReplayCommitArgs ca;
      ca.write_pos = dev.view(wp);
      ca.cache_base = dev.view(base);
      ca.is_flush = dev.view(flush);
      ca.num_accepted = dev.view(acc);
      ca.state_indices = dev.view(idx);
      ca.max_cache_len = c.L;
      ca.max_spec_len = c.T;
      deltastate::replayssm_commit(ca);
    } else {
      deltastate::ReplayFoldArgs fa;
      fa.state = dev.view(ck);
      fa.rawv = dev.view(rv);
      fa.rawk = dev.view(rk);
      fa.g = dev.view(rg);
      fa.beta = dev.view(rb);
      fa.state_indices = dev.view(idx);
      fa.accept_lens = dev.view(acc);
      fa.is_kda = c.kda;
      deltastate::replayssm_fold_commit(fa);
    }
    sync();
    deltastate::check_errors();
    if (c.scheme != kReplay) {  // the committed state after every commit
      const Tensor now = dev.download(ck);
      for (int64_t s : slots) {
        if (s < 0) continue;
        const std::vector<double> got = slot_values(now.view(), s);
        const std::vector<double> want = slot_values(plain.view(), s);
        ASSERT_TRUE(all_close(got, want, state_tol)) << c.name << " state, step " << step;
        for (size_t i = 0; i < got.size(); ++i)
          worst_state = std::max(worst_state, std::fabs(got[i] - want[i]));
      }
    }
  }
  EXPECT_GT(rejected, c.steps / 10);
  if (c.scheme == kReplay) {
    EXPECT_GT(folds, c.steps / 10);
  }
  std::printf("%s: worst |output - plain| %.3g, worst |state - plain| %.3g over %d steps\n", c.name,
              worst_out, worst_state, c.steps);
}

const LosslessCase kLosslessCases[] = {
    {{"plain_gdn_qwen3next", kQwen3Next, false, kNoLb, f32, bf16}, kPlain, f32, 8, 4, 1000},
    {{"plain_kda_odd", kOdd, true, kLb, f32, f32}, kPlain, f32, 8, 4, 1000},
    {{"replay_gdn_qwen3next_f32ring", kQwen3Next, false, kNoLb, f32, bf16},
     kReplay,
     f32,
     8,
     3,
     1000},
    {{"replay_gdn_qwen3next_bf16ring", kQwen3Next, false, kNoLb, f32, bf16},
     kReplay,
     bf16,
     16,
     4,
     1000},
    {{"replay_kda_odd_bf16ring", kOdd, true, kNoLb, f32, f32}, kReplay, bf16, 8, 4, 1000},
    {{"replay_gdn_qwen3next_bf16ring_raw", kQwen3Next, false, kNoLb, f32, bf16},
     kReplay,
     bf16,
     16,
     4,
     1000,
     true},
    {{"replay_kda_odd_bf16ring_raw", kOdd, true, kLb, f32, f32}, kReplay, bf16, 8, 4, 1000, true},
    {{"fold_gdn_qwen3next", kQwen3Next, false, kNoLb, f32, bf16}, kFold, f32, 8, 4, 1000},
    {{"fold_kda_odd", kOdd, true, kLb, f32, f32}, kFold, f32, 8, 4, 1000},
};
INSTANTIATE_TEST_SUITE_P(Cases, LosslessGpu, ::testing::ValuesIn(kLosslessCases),
                         case_name<LosslessCase>);

}  // namespace
}  // namespace dstest
