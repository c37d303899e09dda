// chunk_prefill on CUDA against the CPU backend's chunk_prefill on the same inputs (the CPU
// kernel is the chunk-level oracle; tests/test_chunk_prefill.cpp holds it to an fp64 recurrence):
// Qwen3-Next, Kimi-Linear (with and without lower_bound), a small GVA shape and K = V = 64 on the
// tensor-core kernel; K != V, K*V beyond the fallback's shared memory and fp32 inputs on the
// CUDA-core fallback. Varlen batches mixing 1, 63, 64, 65, 1000 and 8192 tokens, padded
// sequences, has_initial_state 0, final states in place or to output_state_indices, envelope
// pools with sentinel gaps, checkpoints in pool slots and dense, dense initial states, no state,
// fp32 / bf16 / fp16 states, bf16 and fp16 inputs, log-space gates and beta probabilities.
// Outputs, final states and dense checkpoints are NaN-poisoned before the call; the pool outside
// the slots the call writes, the spare checkpoint rows and the inputs are compared byte for byte.
// Every test skips without a CUDA device.
//
// Tolerances: relative norm error over a sequence's outputs, or over one state (all heads), after
// granting each element half ulps of a 16-bit destination (tests/test_chunk_prefill.cpp
// rel_close): one for the tensor-core kernel, whose result is then compared as one stored
// rounding against the CPU's fp32 (as the peers' numbers below are: their bf16 outputs against an
// fp32 recurrence); two for the fallback, whose fp32 results equal the CPU's and whose stores
// differ only where the two straddle a rounding boundary. fp32 states and outputs get none. The
// plain error of the stored values is printed too (DSTEST_PRINT_ERRORS).
//  * Tensor-core kernel, GDN: 3e-3. Its MMA operands that are not raw inputs are rounded to
//    bf16 (the state, v', P; Y and T diag(beta) carry a second bf16 of their rounding error), a
//    relative 2^-9 each; an emulation of the kernel's arithmetic (tests/gpu/emulate_tc_kernel.py:
//    bf16 rounding at the same points, the distributions below) measured 2.1-2.5e-3 on the
//    outputs and 1.7-1.9e-3 on the states against an fp64 recurrence (1.8-1.9e-3 on bf16 outputs
//    measured as here), below FLA's and FlashInfer's 3.6e-3 / 2.9e-3 on the same kind of inputs.
//  * Tensor-core kernel, KDA: 5e-3. Its per-channel decays are folded into q, k operands that
//    are rounded too (k e^G, q e^G, k e^{G_L - G}, as in FLA): the emulation measured 2.4-3.4e-3
//    (the upper end with the softplus gate's strong decays; 2.7e-3 on bf16 outputs as here).
//  * Hopper GDN kernels (chunk_prefill_hopper.cu, K = V = 128 on compute capability 9.0, taken
//    by default there): 4e-3. Their operands are rounded as FlashInfer's SM90 kernel rounds them
//    (the state, a X1, v', v' d, T diag(beta), P; no hi + lo pairs): the emulation
//    (tests/gpu/emulate_hopper_prefill.py) measured 2.4-2.9e-3 on the outputs and 2.0-2.6e-3 on
//    the states against an fp64 recurrence, as FlashInfer's 2.9e-3 and below FLA's 3.6-4.4e-3.
//  * Hopper KDA kernels (the same, hopper_prep_kda.cuh): 5e-3, as the tensor-core kernel's KDA
//    bound. Besides GDN's roundings, the decayed q, k and update keys are rounded once (as in the
//    tensor-core kernel), and the blocks below the diagonal of A and P come from fp16 sub-chunk
//    factors: the emulation (tests/gpu/emulate_hopper_kda.py) measured up to 4.4e-3 on outputs
//    and 3.8e-3 on states over 2048 tokens (log-space gates), 4.6e-3 at worst over 30 short
//    draws (the safe gate's state: T diag(beta)'s one rounding of beta), per head.
//  * Fallback (fp32 token recurrence): 2e-5, as the CPU chunked-vs-recurrent bound.
// Cases that can run on either kernel use the tensor-core bound (DELTASTATE_CUDA_PREFILL=fallback
// runs them all on the fallback; builds without DELTASTATE_CUDA_ALL_KERNELS run K = 64 and fp16
// inputs there). DSTEST_PRINT_ERRORS=1 prints every measured error.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iostream>
#include <map>
#include <numeric>
#include <stdexcept>

#include "gpu/gpu_errors.h"
#include "gpu/gpu_util.h"
#include "test_util.h"

namespace dstest {
namespace {

using deltastate::ChunkPrefillArgs;

using PrefillGpuTest = GpuTest;

// ---- tolerances (the file comment) ------------------------------------------------------------
constexpr double kTensorCoreTol = 3e-3;
constexpr double kTensorCoreKdaTol = 5e-3;
constexpr double kHopperTol = 4e-3;
constexpr double kHopperKdaTol = 5e-3;
constexpr double kFallbackTol = 2e-5;

void report(const std::string& what, double rel) {
  static const bool on = std::getenv("DSTEST_PRINT_ERRORS") != nullptr;
  if (on) std::cout << "  rel error " << what << ": " << rel << "\n";
}

// ||max(|got - want| - slack, 0)|| / ||want||, slack = `rounded` half ulps of `stored_as`.
::testing::AssertionResult rel_close(const std::vector<double>& got,
                                     const std::vector<double>& want, double tol, DType stored_as,
                                     const std::string& what, int rounded = 2) {
  if (got.size() != want.size())
    return ::testing::AssertionFailure()
           << what << ": " << got.size() << " values, want " << want.size();
  double err2 = 0.0, ref2 = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i]))
      return ::testing::AssertionFailure() << what << ": element " << i << " is " << got[i];
    const double slack =
        stored_as == DType::f32
            ? 0.0
            : rounded * half_ulp(stored_as, std::max(std::abs(got[i]), std::abs(want[i])));
    const double d = std::abs(got[i] - want[i]) - slack;
    if (d > 0) err2 += d * d;
    ref2 += want[i] * want[i];
  }
  const double rel = std::sqrt(err2) / std::max(std::sqrt(ref2), 1e-30);
  report(what, rel);
  if (rel <= tol) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": relative error " << rel << " > " << tol;
}

// ---- inputs (as tests/test_chunk_prefill.cpp) -------------------------------------------------
void vary_decay(RecurrentBatch& rb, Rng& rng) {
  const Shape& s = rb.spec.s;
  if (rb.spec.gate_in_kernel) {
    for (int64_t hv = 0; hv < s.HV; ++hv) rb.A_log.set_linear(hv, rng.uniform(-8.0, 0.5));
    return;
  }
  std::vector<double> rate(static_cast<size_t>(s.HV));
  for (double& r : rate) r = std::pow(10.0, rng.uniform(-2.5, 0.5));
  const int64_t width = rb.spec.kda ? s.K : 1;
  for (int64_t i = 0; i < rb.g.numel(); ++i)
    rb.g.set_linear(i, -rate[(i / width) % s.HV] * rng.uniform(0.0, 1.0));
}

void unit_scale_qk(RecurrentBatch& rb, Rng& rng) {
  const double sd = 1.0 / std::sqrt(static_cast<double>(rb.spec.s.K));
  rb.q.fill_normal(rng, sd);
  rb.k.fill_normal(rng, sd);
}

template <class ViewOf>
ChunkPrefillArgs prefill_args(const RecurrentBatch& rb, ViewOf&& view_of) {
  ChunkPrefillArgs a;
  a.q = view_of(rb.q);
  a.k = view_of(rb.k);
  a.v = view_of(rb.v);
  a.g = view_of(rb.g);
  a.beta = view_of(rb.beta);
  a.out = view_of(rb.out);
  a.is_kda = rb.spec.kda;
  a.gate_in_kernel = rb.spec.gate_in_kernel;
  if (rb.spec.gate_in_kernel) {
    a.A_log = view_of(rb.A_log);
    a.dt_bias = view_of(rb.dt_bias);
    a.lower_bound = rb.spec.lower_bound;
  }
  a.beta_is_logit = rb.spec.beta_is_logit;
  if (!rb.spec.seqlens.empty()) a.cu_seqlens = view_of(rb.cu);
  return a;
}

// A workspace tensor of the size the call asks for (at least one element), NaN-poisoned.
Tensor workspace_for(const ChunkPrefillArgs& a) {
  const int64_t bytes = deltastate::chunk_prefill_workspace_bytes(a);
  Tensor w = Tensor::contiguous(DType::f32, {std::max<int64_t>(1, (bytes + 3) / 4)});
  w.fill_all(std::nan(""));
  return w;
}

std::vector<double> out_rows(const Tensor& out, const RecurrentBatch& rb, int64_t n) {
  std::vector<double> o;
  for (int64_t t = 0; t < rb.seq_len(n); ++t) {
    const auto [b, tok] = rb.coord(n, t);
    for (int64_t hv = 0; hv < rb.spec.s.HV; ++hv)
      for (int64_t v = 0; v < rb.spec.s.V; ++v) o.push_back(out.get({b, tok, hv, v}));
  }
  return o;
}

bool contains(const std::vector<int64_t>& v, int64_t x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

enum class StateMode { pool, dense, none };
enum class Ckpt { none, slots, dense };

struct GpuPrefillCase {
  const char* name;
  RecurrentSpec spec;
  StateMode mode = StateMode::pool;
  DType state = DType::f32;
  std::vector<int64_t> padded;  // pool: sequences with index -1
  std::vector<int64_t> fresh;   // has_initial_state = 0
  bool redirect = false;        // pool: output_state_indices (the first live one's: -1)
  bool final_state = false;
  Ckpt ckpt = Ckpt::none;
  int64_t every = 64;
  int64_t slot_pad = 0, lead = 0;
  bool fallback_only = false;  // no tensor-core kernel takes this case: the fallback's bound
  bool l2norm = true;
  double scale = 0.0;  // 0: the default K^-0.5
};
void PrintTo(const GpuPrefillCase& c, std::ostream* os) { *os << c.name; }

// Whether the dispatch sends the case to the Hopper GDN kernels (src/cuda/chunk_prefill.cu):
// a device of compute capability 9.0, GDN, K = V = 128, 16-bit inputs (fp16 in the full build),
// unless another kernel is forced.
bool hopper_device() {
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  return prop.major == 9 && prop.minor == 0;
}
bool hopper_runs(const GpuPrefillCase& c) {
  const char* forced = std::getenv("DELTASTATE_CUDA_PREFILL");
  if (forced && std::string(forced) != "hopper") return false;
  if (c.fallback_only || c.spec.s.K != 128 || c.spec.s.V != 128) return false;
#if DELTASTATE_TEST_ALL_KERNELS
  if (c.spec.act != DType::bf16 && c.spec.act != DType::f16) return false;
#else
  if (c.spec.act != DType::bf16) return false;
#endif
  return hopper_device();
}

double tolerance(const GpuPrefillCase& c) {
  if (c.fallback_only) return kFallbackTol;
  if (hopper_runs(c)) return c.spec.kda ? kHopperKdaTol : kHopperTol;
  return c.spec.kda ? kTensorCoreKdaTol : kTensorCoreTol;
}
int roundings(const GpuPrefillCase& c) { return c.fallback_only ? 2 : 1; }

// One call's host tensors: inputs, states, checkpoints, and both backends' runs of it.
struct PrefillRun {
  const GpuPrefillCase& c;
  RecurrentBatch rb;
  int64_t N = 0, E = 0, every = 0, total = 0;
  std::vector<int64_t> cu_starts{0}, in_slot, out_slot, ck_slot;
  Tensor pool, idx, out_idx, ck_idx, has_initial, final_state, ckpts, cu_starts_t;
  // The workspace of the CUDA calls, made at the size the first one asks for (calls with the
  // same arguments ask for the same size; each Mirror gives it its own device buffer).
  mutable Tensor cuda_ws;

  PrefillRun(const GpuPrefillCase& cs, Rng& rng) : c(cs), rb(make_recurrent_batch(rng, cs.spec)) {
    vary_decay(rb, rng);
    if (!c.l2norm) unit_scale_qk(rb, rng);
    const Shape& s = c.spec.s;
    N = rb.N;
    E = s.state_elems();
    every = c.ckpt == Ckpt::none ? 0 : c.every;
    for (int64_t n = 0; n < N; ++n)
      cu_starts.push_back(cu_starts.back() + (every ? rb.seq_len(n) / every : 0));
    total = cu_starts.back();
    in_slot.assign(N, -1);
    out_slot.assign(N, -1);
    ck_slot.assign(total, -1);
    if (c.mode == StateMode::pool) {
      const int64_t slots = 2 * N + total + 3;
      pool = make_pool(c.state, slots, s, c.slot_pad, c.lead);
      std::vector<int64_t> perm(slots);
      std::iota(perm.begin(), perm.end(), 0);
      std::shuffle(perm.begin(), perm.end(), rng.engine());
      size_t next = 0;
      for (int64_t n = 0; n < N; ++n) in_slot[n] = padded(n) ? -1 : perm[next++];
      fill_live_slots(pool.view(), in_slot, rng);
      bool first_live = true;
      for (int64_t n = 0; n < N; ++n) {
        out_slot[n] = in_slot[n];
        if (c.redirect && !padded(n)) {
          out_slot[n] = first_live ? -1 : perm[next++];
          first_live = false;
        }
      }
      for (int64_t i = 0; i < total; ++i) ck_slot[i] = i % 3 == 2 ? -1 : perm[next++];
      idx = index_tensor(in_slot, c.spec.index_dtype);
      if (c.redirect) out_idx = index_tensor(out_slot, c.spec.index_dtype);
      if (c.ckpt == Ckpt::slots) ck_idx = index_tensor(ck_slot, c.spec.index_dtype);
    } else if (c.mode == StateMode::dense) {
      pool = make_pool(c.state, N, s, c.slot_pad, c.lead);
      for (int64_t n = 0; n < N; ++n) fill_slot(pool.view(), n, rng);
    }
    if (!c.fresh.empty()) {
      std::vector<int64_t> has(N, 1);
      for (int64_t n : c.fresh) has[n] = 0;
      has_initial = index_tensor(has, c.spec.index_dtype);
    }
    if (c.final_state) {
      final_state = Tensor::contiguous(c.state, {N, s.HV, s.V, s.K});
      final_state.fill_all(std::nan(""));
    }
    if (every) cu_starts_t = index_tensor(cu_starts, c.spec.index_dtype);
    if (c.ckpt == Ckpt::dense) {
      ckpts = Tensor::contiguous(c.state, {total + 2, s.HV, s.V, s.K});  // two spare rows
      ckpts.fill_all(std::nan(""));
    }
  }
  bool padded(int64_t n) const { return c.mode == StateMode::pool && contains(c.padded, n); }

  template <class ViewOf>
  ChunkPrefillArgs args(ViewOf&& view_of) const {
    ChunkPrefillArgs a = prefill_args(rb, view_of);
    a.use_qk_l2norm = c.l2norm;
    if (c.scale > 0) a.scale = c.scale;
    if (c.mode != StateMode::none) a.initial_state = view_of(pool);
    if (c.mode == StateMode::pool) a.initial_state_indices = view_of(idx);
    if (c.redirect) a.output_state_indices = view_of(out_idx);
    if (!c.fresh.empty()) a.has_initial_state = view_of(has_initial);
    if (c.final_state) a.final_state = view_of(final_state);
    if (every) {
      a.checkpoint_every_n_tokens = every;
      a.checkpoint_cu_starts = view_of(cu_starts_t);
      if (c.ckpt == Ckpt::dense) a.state_checkpoints = view_of(ckpts);
      else a.checkpoint_slot_indices = view_of(ck_idx);
    }
    if (a.q.device.type == deltastate::DeviceType::cuda) {
      const int64_t bytes = deltastate::chunk_prefill_workspace_bytes(a);
      if (bytes > 0) {
        if (!cuda_ws.alloc_base()) cuda_ws = workspace_for(a);
        a.workspace = view_of(cuda_ws);
      }
    }
    return a;
  }
  // Every host tensor the call reads or writes, for the device mirror.
  std::vector<const Tensor*> tensors() const {
    return {&rb.q,     &rb.k,        &rb.v,        &rb.g,  &rb.beta,    &rb.out,
            &rb.A_log, &rb.dt_bias,  &rb.cu,       &pool,  &idx,        &out_idx,
            &ck_idx,   &has_initial, &final_state, &ckpts, &cu_starts_t};
  }
};

// The call on the device: every tensor of the run uploaded, the arguments changed by `edit`
// (given), and a NaN-poisoned workspace of the size the call then asks for.
void run_on_device(const PrefillRun& run, Mirror& dev,
                   const std::function<void(ChunkPrefillArgs&)>& edit = {}) {
  for (const Tensor* t : run.tensors()) dev.upload(*t);
  ChunkPrefillArgs a = run.args(dev.views());
  if (edit) edit(a);
  const Tensor ws = workspace_for(a);
  if (deltastate::chunk_prefill_workspace_bytes(a) > 0) {
    dev.upload(ws);
    a.workspace = dev.view(ws);
  }
  deltastate::chunk_prefill(a);
  sync();
}

class GpuChunkPrefill : public PrefillGpuTest,
                        public ::testing::WithParamInterface<GpuPrefillCase> {};

TEST_P(GpuChunkPrefill, MatchesCpu) {
  const GpuPrefillCase& c = GetParam();
  Rng rng = test_rng();
  PrefillRun run(c, rng);
  const Shape& s = c.spec.s;
  const int64_t N = run.N, E = run.E;
  const double tol = tolerance(c);
  const int rnd = roundings(c);

  // What the device holds before the call (the CPU call below changes the host copies).
  const std::vector<uint8_t> pool_before =
      c.mode != StateMode::none ? run.pool.bytes() : std::vector<uint8_t>{};
  const std::vector<uint8_t> ckpts_before =
      c.ckpt == Ckpt::dense ? run.ckpts.bytes() : std::vector<uint8_t>{};
  Mirror dev;
  run_on_device(run, dev);

  ChunkPrefillArgs cpu_args = run.args(host_view);
  const Tensor cpu_ws = workspace_for(cpu_args);
  cpu_args.workspace = cpu_ws.view();
  deltastate::chunk_prefill(cpu_args);

  const Tensor out = dev.download(run.rb.out);
  const Tensor pool = c.mode != StateMode::none ? dev.download(run.pool) : Tensor();
  const Tensor fs = c.final_state ? dev.download(run.final_state) : Tensor();
  const Tensor ck = c.ckpt == Ckpt::dense ? dev.download(run.ckpts) : Tensor();
  const DType act = c.spec.act;
  std::vector<MemRange> pool_written, ckpt_written;
  for (int64_t n = 0; n < N; ++n) {
    SCOPED_TRACE("sequence " + std::to_string(n) + " of " + std::to_string(run.rb.seq_len(n)) +
                 " tokens");
    const std::string tag = std::string(c.name) + " seq " + std::to_string(n);
    const int64_t n_ckpt = run.every ? run.rb.seq_len(n) / run.every : 0;
    if (run.padded(n)) {
      EXPECT_TRUE(all_zero(out_rows(out, run.rb, n))) << "outputs";
      if (c.final_state) {
        EXPECT_TRUE(all_zero(view_values(fs.view(), n * E, E))) << "final_state";
      }
      for (int64_t j = 0; j < n_ckpt && c.ckpt == Ckpt::dense; ++j) {
        EXPECT_TRUE(all_zero(view_values(ck.view(), (run.cu_starts[n] + j) * E, E)))
            << "checkpoint " << j;
        ckpt_written.push_back(range_of(ck.view(), (run.cu_starts[n] + j) * E, E));
      }
      continue;
    }
    (void)rel_close(out_rows(out, run.rb, n), out_rows(run.rb.out, run.rb, n), 1.0, DType::f32,
                    tag + " out as stored");  // reported only
    EXPECT_TRUE(rel_close(out_rows(out, run.rb, n), out_rows(run.rb.out, run.rb, n), tol, act,
                          tag + " out", rnd));
    if (c.final_state) {
      EXPECT_TRUE(rel_close(view_values(fs.view(), n * E, E),
                            view_values(run.final_state.view(), n * E, E), tol, c.state,
                            tag + " final_state", rnd));
    }
    if (c.mode == StateMode::pool && run.out_slot[n] >= 0) {
      EXPECT_TRUE(rel_close(slot_values(pool.view(), run.out_slot[n]),
                            slot_values(run.pool.view(), run.out_slot[n]), tol, c.state,
                            tag + " pool final", rnd));
      pool_written.push_back(slot_range(pool.view(), run.out_slot[n]));
    }
    for (int64_t j = 0; j < n_ckpt; ++j) {
      const std::string ctag = tag + " checkpoint " + std::to_string(j);
      const int64_t pos = run.cu_starts[n] + j;
      if (c.ckpt == Ckpt::dense) {
        EXPECT_TRUE(rel_close(view_values(ck.view(), pos * E, E),
                              view_values(run.ckpts.view(), pos * E, E), tol, c.state, ctag, rnd));
        ckpt_written.push_back(range_of(ck.view(), pos * E, E));
      } else if (run.ck_slot[pos] >= 0) {
        EXPECT_TRUE(rel_close(slot_values(pool.view(), run.ck_slot[pos]),
                              slot_values(run.pool.view(), run.ck_slot[pos]), tol, c.state, ctag,
                              rnd));
        pool_written.push_back(slot_range(pool.view(), run.ck_slot[pos]));
      }
    }
  }
  if (c.mode == StateMode::pool) {
    EXPECT_TRUE(Snapshot::equal_except(pool.alloc_base(), pool_before.data(), pool.alloc_bytes(),
                                       pool_written))
        << "GPU pool outside the written slots (sentinels, envelope gaps, read-only slots)";
  } else if (c.mode == StateMode::dense) {
    EXPECT_TRUE(
        Snapshot::equal_except(pool.alloc_base(), pool_before.data(), pool.alloc_bytes(), {}))
        << "the dense initial_state is read only";
  }
  if (c.ckpt == Ckpt::dense) {
    EXPECT_TRUE(Snapshot::equal_except(ck.alloc_base(), ckpts_before.data(), ck.alloc_bytes(),
                                       ckpt_written))
        << "spare checkpoint rows";
  }
  for (const Tensor* t : {&run.rb.q, &run.rb.k, &run.rb.v, &run.rb.g, &run.rb.beta}) {
    const Tensor d = dev.download(*t);
    EXPECT_EQ(std::memcmp(d.alloc_base(), t->alloc_base(), static_cast<size_t>(t->alloc_bytes())),
              0)
        << "an input changed on the device";
  }
  (void)s;
}

RecurrentSpec varlen(
    const Shape& s, bool kda, DType act, std::vector<int64_t> seqlens,
    void (*f)(RecurrentSpec&) = [](RecurrentSpec&) {}) {
  return with(recurrent_spec(s, kda, act, 1, 1, std::move(seqlens)), f);
}
void safe_gate(RecurrentSpec& r) { r.lower_bound = -5.0; }
void log_gates_beta_prob(RecurrentSpec& r) {
  r.gate_in_kernel = false;
  r.beta_is_logit = false;
}
void log_gates(RecurrentSpec& r) { r.gate_in_kernel = false; }
void f32_log_gates(RecurrentSpec& r) {
  r.gate_in_kernel = false;
  r.g_dtype = DType::f32;
}
void f16_safe_gate(RecurrentSpec& r) {
  r.lower_bound = -5.0;
  r.g_dtype = DType::f16;
}
void packed(RecurrentSpec& r) { r.packed_qkv = true; }
void i64(RecurrentSpec& r) { r.index_dtype = DType::i64; }

constexpr Shape kGva{"gva", 2, 6, 128, 128};
constexpr Shape kK64{"k64", 4, 8, 64, 64};
// Qwen3-Next at tensor parallelism 4: few heads, so one long sequence takes the Hopper prefill's
// context parallelism (chunk_prefill_hopper.cu cp_plan: segments of its chunks in parallel).
constexpr Shape kQwenTp4{"qwen_tp4", 4, 8, 128, 128};
constexpr Shape kK128V192{"k128v192", 1, 2, 128,
                          192};  // K*V > 16384: fallback states in the workspace

// The varlen mix around an empty sequence, and the same with one 8192-token sequence.
const std::vector<int64_t> kMix{1, 63, 64, 0, 65, 1000, 130};
const std::vector<int64_t> kMixLong{1, 63, 64, 65, 1000, 8192, 130, 0};

GpuPrefillCase C(const char* name, RecurrentSpec spec, void (*f)(GpuPrefillCase&)) {
  GpuPrefillCase c;
  c.name = name;
  c.spec = std::move(spec);
  f(c);
  return c;
}

INSTANTIATE_TEST_SUITE_P(
    Cuda, GpuChunkPrefill,
    ::testing::Values(
        // Qwen3-Next, the long mix: 8192 tokens, padded (index 6), fresh (2), checkpoints into
        // slots every 1024
        C("gdn_qwen_mixlong_bf16_f32pool_slots", varlen(kQwen3Next, false, DType::bf16, kMixLong),
          [](GpuPrefillCase& c) {
            c.padded = {6};
            c.fresh = {2};
            c.ckpt = Ckpt::slots;
            c.every = 1024;
          }),
        // the Hopper kernels' issue mix: partial, whole and long chunks, 9000 tokens, fresh and
        // padded sequences, checkpoints every 2048 into slots
        C("gdn_qwen_hopper_mix_bf16_f32pool",
          varlen(kQwen3Next, false, DType::bf16, {1, 63, 64, 65, 2047, 2048, 9000, 5}),
          [](GpuPrefillCase& c) {
            c.padded = {7};
            c.fresh = {3};
            c.ckpt = Ckpt::slots;
            c.every = 2048;
          }),
        // one long sequence at TP4: context parallelism (8 segments of 16 chunks on 132 SMs), a
        // partial last chunk, the final state in place and dense, checkpoints into slots across
        // segments
        C("gdn_tp4_one_long_cp", varlen(kQwenTp4, false, DType::bf16, {8150}),
          [](GpuPrefillCase& c) {
            c.final_state = true;
            c.ckpt = Ckpt::slots;
            c.every = 640;
          }),
        // the same without cu_seqlens: a fresh state, a bf16 pool, dense final state and
        // checkpoints, 5 segments with a short last one
        C("gdn_tp4_dense_cp_fresh", recurrent_spec(kQwenTp4, false, DType::bf16, 1, 2600),
          [](GpuPrefillCase& c) {
            c.state = DType::bf16;
            c.fresh = {0};
            c.final_state = true;
            c.ckpt = Ckpt::dense;
            c.every = 320;
          }),
        // one padded sequence (index -1): zero outputs, no state touched in any pass
        C("gdn_tp4_one_padded_cp", varlen(kQwenTp4, false, DType::bf16, {3000}),
          [](GpuPrefillCase& c) { c.padded = {0}; }),
        // N x HV past 65535 (2100 sequences of 32 tokens, 32 value heads; no state: the pool
        // of so many sequences would take gigabytes)
        C("gdn_qwen_many_short", recurrent_spec(kQwen3Next, false, DType::bf16, 2100, 32),
          [](GpuPrefillCase& c) { c.mode = StateMode::none; }),
        C("gdn_qwen_packedqkv_bf16state_dense_ckpt",
          varlen(kQwen3Next, false, DType::bf16, {300, 64, 129}, packed),
          [](GpuPrefillCase& c) {
            c.state = DType::bf16;
            c.final_state = true;
            c.ckpt = Ckpt::dense;
            c.every = 64;
          }),
        C("gdn_qwen_logg_betaprob_f16state",
          varlen(kQwen3Next, false, DType::bf16, {129, 300, 1}, log_gates_beta_prob),
          [](GpuPrefillCase& c) {
            c.state = DType::f16;
            c.fresh = {0};
            c.redirect = true;
            c.ckpt = Ckpt::slots;
          }),
        C("gdn_qwen_f16act_f32pool", varlen(kQwen3Next, false, DType::f16, {70, 192}),
          [](GpuPrefillCase& c) { c.final_state = true; }),
        C("gdn_qwen_dense_initial_final", varlen(kQwen3Next, false, DType::bf16, {65, 0, 140}),
          [](GpuPrefillCase& c) {
            c.mode = StateMode::dense;
            c.fresh = {1};
            c.final_state = true;
            c.ckpt = Ckpt::dense;
            c.slot_pad = 16;
            c.lead = 4;
          }),
        C("gdn_qwen_no_l2norm_scale", varlen(kQwen3Next, false, DType::bf16, {90, 20}, log_gates),
          [](GpuPrefillCase& c) {
            c.l2norm = false;
            c.scale = 0.3;
          }),
        C("gdn_qwen_batched_T130", recurrent_spec(kQwen3Next, false, DType::bf16, 3, 130),
          [](GpuPrefillCase& c) {
            c.padded = {1};
            c.ckpt = Ckpt::slots;
          }),
        // Kimi-Linear with the safe gate (lower_bound -5) and with the softplus gate
        C("kda_kimi_mix_lb_bf16_dense_ckpt",
          varlen(kKimi, true, DType::bf16, {1, 63, 64, 65, 1000, 300}, safe_gate),
          [](GpuPrefillCase& c) {
            c.padded = {3};
            c.redirect = true;
            c.final_state = true;
            c.ckpt = Ckpt::dense;
            c.every = 128;
          }),
        C("kda_kimi_softplus_bf16state_envelope",
          varlen(kKimi, true, DType::bf16, {65, 300, 64, 200}),
          [](GpuPrefillCase& c) {
            c.state = DType::bf16;
            c.fresh = {1};
            c.ckpt = Ckpt::slots;
            c.slot_pad = 64;
            c.lead = 32;
          }),
        C("kda_kimi_no_state_final", varlen(kKimi, true, DType::bf16, {100, 64}, log_gates),
          [](GpuPrefillCase& c) {
            c.mode = StateMode::none;
            c.state = DType::bf16;
            c.final_state = true;
            c.ckpt = Ckpt::dense;
          }),
        // log-space gates in fp32 beside bf16 q/k/v (what FLA's callers pass), and in fp16: the
        // Hopper prep's gate loads per dtype
        C("kda_kimi_f32_log_gates", varlen(kKimi, true, DType::bf16, {130, 64, 1}, f32_log_gates),
          [](GpuPrefillCase& c) { c.final_state = true; }),
        C("kda_kimi_f16_safe_gate", varlen(kKimi, true, DType::bf16, {70, 129}, f16_safe_gate),
          [](GpuPrefillCase& c) { c.ckpt = Ckpt::slots; }),
        // a small GVA shape (3 value heads per key head) on an envelope pool
        C("gdn_gva_mix_envelope_redirect", varlen(kGva, false, DType::bf16, kMix),
          [](GpuPrefillCase& c) {
            c.padded = {6};
            c.fresh = {2};
            c.redirect = true;
            c.final_state = true;
            c.ckpt = Ckpt::slots;
            c.slot_pad = 40;
            c.lead = 8;
          }),
        C("kda_gva_mix_lb_i64",
          varlen(kGva, true, DType::bf16, kMix,
                 [](RecurrentSpec& r) {
                   r.lower_bound = -5.0;
                   r.index_dtype = DType::i64;
                 }),
          [](GpuPrefillCase& c) {
            c.padded = {0};
            c.ckpt = Ckpt::dense;
            c.every = 192;
          }),
        // K = V = 64 (the tensor-core kernel in the full build)
        C("gdn_k64_bf16_i64", varlen(kK64, false, DType::bf16, {65, 200, 1}, i64),
          [](GpuPrefillCase& c) {
            c.final_state = true;
            c.ckpt = Ckpt::slots;
          }),
        C("kda_k64_f16act_bf16state", varlen(kK64, true, DType::f16, {65, 130}, safe_gate),
          [](GpuPrefillCase& c) { c.state = DType::bf16; }),
        // the fallback: K != V, fp32 inputs, a state beyond its shared memory
        C("fallback_gdn_odd_mix", varlen(kOdd, false, DType::bf16, kMix),
          [](GpuPrefillCase& c) {
            c.padded = {6};
            c.fresh = {2};
            c.redirect = true;
            c.ckpt = Ckpt::slots;
            c.slot_pad = 40;
            c.lead = 8;
            c.fallback_only = true;
          }),
        C("fallback_kda_kgtv_lb", varlen(kKgtV, true, DType::f32, {65, 130, 3}, safe_gate),
          [](GpuPrefillCase& c) {
            c.state = DType::bf16;
            c.final_state = true;
            c.ckpt = Ckpt::dense;
            c.fallback_only = true;
          }),
        C("fallback_gdn_qwen_f32act", varlen(kQwen3Next, false, DType::f32, {65, 130}),
          [](GpuPrefillCase& c) {
            c.final_state = true;
            c.fallback_only = true;
          }),
        C("fallback_gdn_k128v192_workspace", varlen(kK128V192, false, DType::bf16, {70, 64}),
          [](GpuPrefillCase& c) {
            c.final_state = true;
            c.ckpt = Ckpt::slots;
            c.fallback_only = true;
          })),
    case_name<GpuPrefillCase>);

// ---- a sequence's result does not depend on the batch -------------------------------------------
// The middle sequence of a varlen batch, run twice with every other sequence's inputs redrawn:
// its outputs and final state must be the same bits (the kernels read the neighbours' rows in
// a tail chunk's tiles, but multiply them by exact zeros).
TEST_F(PrefillGpuTest, SequenceResultIndependentOfBatch) {
  GpuPrefillCase c =
      C("gdn_qwen_batch_bits", varlen(kQwen3Next, false, DType::bf16, {130, 70, 200}),
        [](GpuPrefillCase&) {});
  Rng rng = test_rng();
  PrefillRun run(c, rng);
  const int64_t n = 1;
  auto run_gpu = [&](Tensor& out, std::vector<uint8_t>& slot) {
    Mirror dev;
    run_on_device(run, dev);
    out = dev.download(run.rb.out);
    const Tensor pool = dev.download(run.pool);
    const MemRange r = slot_range(pool.view(), run.out_slot[n]);
    slot.assign(r.begin, r.end);
  };
  Tensor out1, out2;
  std::vector<uint8_t> slot1, slot2;
  run_gpu(out1, slot1);
  for (int64_t m : {int64_t{0}, int64_t{2}})
    for (int64_t t = 0; t < run.rb.seq_len(m); ++t) {
      const auto [b, tok] = run.rb.coord(m, t);
      for (Tensor* x : {&run.rb.q, &run.rb.k})
        for (int64_t h = 0; h < c.spec.s.H; ++h)
          for (int64_t e = 0; e < c.spec.s.K; ++e) x->set({b, tok, h, e}, rng.uniform(-3.0, 3.0));
      for (int64_t hv = 0; hv < c.spec.s.HV; ++hv) {
        for (int64_t e = 0; e < c.spec.s.V; ++e)
          run.rb.v.set({b, tok, hv, e}, rng.uniform(-3.0, 3.0));
        run.rb.beta.set({b, tok, hv}, rng.uniform(-3.0, 3.0));
        run.rb.g.set({b, tok, hv}, rng.uniform(-3.0, 3.0));
      }
    }
  run_gpu(out2, slot2);
  const std::vector<double> o1 = out_rows(out1, run.rb, n), o2 = out_rows(out2, run.rb, n);
  ASSERT_EQ(o1.size(), o2.size());
  EXPECT_EQ(std::memcmp(o1.data(), o2.data(), o1.size() * sizeof(double)), 0) << "outputs";
  EXPECT_EQ(slot1, slot2) << "final state";
}

// ---- the slot guard ---------------------------------------------------------------------------
// Every slot a sequence names (initial_state_indices, output_state_indices, its
// checkpoint_slot_indices) is checked on the device before the sequence stores anything: a
// sequence with one >= the pool's slots is skipped like a padded one (no pool access) with NaN
// outputs (output rows, dense final state), the others run, and the first bad slot is recorded
// for check_errors with the validator's text. Each scenario runs a batch with bad slots and the
// same batch with those sequences padded, on two copies of the same memory: the good sequences'
// outputs and final states and every byte of the pool must agree bit for bit. The pool view
// covers all but the last two slots of its buffer, so the first bad index lands in real memory
// past the view, which must stay untouched (the padded run never writes there).
class GpuChunkPrefillGuard : public PrefillGpuTest,
                             public ::testing::WithParamInterface<GuardCase> {};

std::string prefill_range_text(bool kda, const char* name, int64_t row, int64_t index,
                               int64_t slots, const char* negative) {
  return std::string(kda ? "chunk_kda" : "chunk_gated_delta_rule") + ": `" + name + "`[" +
         std::to_string(row) + "]=" + std::to_string(index) +
         " is out of range for a state pool of " + std::to_string(slots) + " slots (valid: 0.." +
         std::to_string(slots - 1) + "; < 0 " + negative +
         "); its sequence was skipped (no pool slot written) and its outputs are NaN";
}

TEST_P(GpuChunkPrefillGuard, BadSlotsSkipTheirSequenceAndAreReported) {
  const GuardCase& gc = GetParam();
  clear_device_errors();
  GpuPrefillCase c;
  c.name = gc.name;
  c.spec = varlen(gc.shape, gc.kda, gc.act, {65, 130, 1, 200, 64});
  c.spec.index_dtype = gc.index;
  c.state = gc.state;
  c.padded = {2};
  c.final_state = true;
  c.ckpt = Ckpt::slots;
  Rng rng = test_rng();
  PrefillRun run(c, rng);
  const int64_t N = run.N, total = run.total;
  const int64_t buffer_slots = run.pool.shape()[0], slots = buffer_slots - 2;
  // Slots in order: initial n, final N + n, checkpoint i at 2N + i (every third skipped).
  std::vector<int64_t> in(N), out(N), ck(total);
  for (int64_t n = 0; n < N; ++n) {
    in[n] = run.padded(n) ? -1 : n;
    out[n] = N + n;
  }
  for (int64_t i = 0; i < total; ++i) ck[i] = i % 3 == 2 ? -1 : 2 * N + i;
  ASSERT_LT(2 * N + total, slots);
  fill_live_slots(run.pool.view(), in, rng);
  // Finite before the call, so that the NaN of a skipped sequence is a store (a padded one's 0).
  run.rb.out.fill_all(7.0);
  run.final_state.fill_all(7.0);
  const int64_t far = far_index(gc.index);
  // The sequence of checkpoint row 1 (sequence 0 has one checkpoint: it is sequence 1's first).
  ASSERT_EQ(run.cu_starts[1], 1);

  struct Scenario {
    const char* what;
    std::vector<int64_t> in, out, ck, bad;  // bad: the skipped sequences
    std::vector<std::string> texts;
  };
  auto with = [](std::vector<int64_t> v, int64_t i, int64_t x) {
    v[i] = x;
    return v;
  };
  const char* padded_row = "marks a padded row";
  const std::vector<Scenario> scenarios = {
      {"initial slots",
       with(with(in, 1, slots), 3, far),
       out,
       ck,
       {1, 3},
       {prefill_range_text(gc.kda, "initial_state_indices", 1, slots, slots, padded_row),
        prefill_range_text(gc.kda, "initial_state_indices", 3, far, slots, padded_row)}},
      {"output slot",
       in,
       with(out, 4, slots),
       ck,
       {4},
       {prefill_range_text(gc.kda, "output_state_indices", 4, slots, slots,
                           "stores no final state")}},
      {"checkpoint slot",
       in,
       out,
       with(ck, 1, far),
       {1},
       {prefill_range_text(gc.kda, "checkpoint_slot_indices", 1, far, slots,
                           "skips the checkpoint")}},
  };
  const int64_t E = run.E;
  for (const Scenario& sc : scenarios) {
    SCOPED_TRACE(sc.what);
    std::vector<int64_t> ref_in = sc.in;
    for (int64_t n : sc.bad) ref_in[n] = -1;
    const Tensor bad_in = index_tensor(sc.in, gc.index), bad_out = index_tensor(sc.out, gc.index),
                 bad_ck = index_tensor(sc.ck, gc.index), ref_in_t = index_tensor(ref_in, gc.index),
                 ref_out = index_tensor(out, gc.index), ref_ck = index_tensor(ck, gc.index);
    Mirror bad_mem, ref_mem;
    for (Mirror* m : {&bad_mem, &ref_mem})
      for (const Tensor* t : run.tensors()) m->upload(*t);
    bad_mem.upload_all(bad_in, bad_out, bad_ck);
    ref_mem.upload_all(ref_in_t, ref_out, ref_ck);
    auto args = [&](Mirror& m, const Tensor& i, const Tensor& o, const Tensor& k) {
      ChunkPrefillArgs a = run.args(m.views());
      a.initial_state->shape[0] = slots;
      a.initial_state_indices = m.view(i);
      a.output_state_indices = m.view(o);
      a.checkpoint_slot_indices = m.view(k);
      return a;
    };
    deltastate::chunk_prefill(args(bad_mem, bad_in, bad_out, bad_ck));  // reports nothing itself
    deltastate::chunk_prefill(args(ref_mem, ref_in_t, ref_out, ref_ck));
    sync();

    const Tensor o_bad = bad_mem.download(run.rb.out), o_ref = ref_mem.download(run.rb.out);
    const Tensor f_bad = bad_mem.download(run.final_state),
                 f_ref = ref_mem.download(run.final_state);
    for (int64_t n = 0; n < N; ++n) {
      SCOPED_TRACE("sequence " + std::to_string(n));
      const std::vector<double> fb = view_values(f_bad.view(), n * E, E),
                                fr = view_values(f_ref.view(), n * E, E);
      if (contains(sc.bad, n)) {
        EXPECT_TRUE(all_nan(out_rows(o_bad, run.rb, n))) << "outputs";
        EXPECT_TRUE(all_nan(fb)) << "final_state";
      } else {
        EXPECT_TRUE(same_bits(out_rows(o_bad, run.rb, n), out_rows(o_ref, run.rb, n))) << "outputs";
        EXPECT_TRUE(same_bits(fb, fr)) << "final_state";
      }
    }
    const Tensor pool = bad_mem.download(run.pool);
    EXPECT_TRUE(bytes_equal(pool, ref_mem.download(run.pool)))
        << "pool (bad slots vs padded sequences; the two slots past the view included)";
    EXPECT_FALSE(bytes_equal(pool, run.pool)) << "the good sequences wrote their slots";
    expect_reported(nullptr, sc.texts);
  }

  // check_indices=true on CUDA (the debug mode): the op synchronizes and raises itself.
  Mirror m;
  for (const Tensor* t : run.tensors()) m.upload(*t);
  const Tensor bad_in = index_tensor(with(in, 3, slots + 1), gc.index),
               out_t = index_tensor(out, gc.index), ck_t = index_tensor(ck, gc.index);
  m.upload_all(bad_in, out_t, ck_t);
  ChunkPrefillArgs a = run.args(m.views());
  a.initial_state->shape[0] = slots;
  a.initial_state_indices = m.view(bad_in);
  a.output_state_indices = m.view(out_t);
  a.checkpoint_slot_indices = m.view(ck_t);
  a.check_indices = true;
  const auto e = catch_error([&] { deltastate::chunk_prefill(a); });
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->kind(), deltastate::ErrorKind::value);
  EXPECT_EQ(std::string(e->what()),
            prefill_range_text(gc.kda, "initial_state_indices", 3, slots + 1, slots, padded_row));
  EXPECT_NO_THROW(deltastate::check_errors(nullptr));
  // Good slots: no error.
  const Tensor good_in = index_tensor(in, gc.index);
  m.upload(good_in);
  a.initial_state_indices = m.view(good_in);
  EXPECT_NO_THROW(deltastate::chunk_prefill(a));
}

INSTANTIATE_TEST_SUITE_P(
    Cuda, GpuChunkPrefillGuard,
    ::testing::Values(
        // the tensor-core kernel
        GuardCase{"gdn_qwen_bf16_f32pool_i32", kQwen3Next, false, f32, bf16, DType::i32},
        GuardCase{"kda_kimi_bf16_bf16pool_i64", kKimi, true, bf16, bf16, DType::i64},
        // the fallback (K != V; fp32 inputs)
        GuardCase{"fallback_gdn_odd_bf16_i64", kOdd, false, f32, bf16, DType::i64},
        GuardCase{"fallback_kda_qwen_f32_i32", kQwen3Next, true, f32, f32, DType::i32}),
    case_name<GuardCase>);

// ---- CUDA graphs ----------------------------------------------------------------------------
struct ScopedStream {
  cudaStream_t s = nullptr;
  ScopedStream() { CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); }
  ~ScopedStream() { EXPECT_EQ(cudaStreamDestroy(s), cudaSuccess); }
  ScopedStream(const ScopedStream&) = delete;
  ScopedStream& operator=(const ScopedStream&) = delete;
};

// One Qwen3-Next varlen call (pooled, in place, slot checkpoints) captured into a CUDA graph on
// a non-blocking stream: capturing runs nothing, and each replay (the pool advancing in place)
// equals the same call launched eagerly on a second copy of the buffers, bit for bit; so does a
// launch with programmatic dependent launch. KDA the same.
TEST_F(PrefillGpuTest, CudaGraphReplayMatchesEager) {
  for (const bool kda : {false, true}) {
    SCOPED_TRACE(kda ? "kda" : "gdn");
    GpuPrefillCase c;
    c.name = "graph";
    c.spec = varlen(kda ? kKimi : kQwen3Next, kda, DType::bf16, {65, 300, 1, 128});
    c.padded = {2};
    c.ckpt = Ckpt::slots;
    Rng rng = test_rng(kda);
    PrefillRun run(c, rng);
    const ScopedStream scoped;
    cudaStream_t stream = scoped.s;
    Mirror graph_mem, eager_mem, pdl_mem;
    for (Mirror* m : {&graph_mem, &eager_mem, &pdl_mem})
      for (const Tensor* t : run.tensors()) m->upload(*t);
    ChunkPrefillArgs warm = run.args(pdl_mem.views());  // outside the capture, as engines do
    deltastate::chunk_prefill(warm);
    sync();
    for (const Tensor* t : run.tensors()) pdl_mem.upload(*t);

    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    ChunkPrefillArgs ga = run.args(graph_mem.views());
    ga.stream = stream;
    CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    deltastate::chunk_prefill(ga);
    CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    EXPECT_EQ(graph_mem.download(run.pool).bytes(), run.pool.bytes()) << "capturing ran nothing";
    for (int rep = 0; rep < 2; ++rep) {
      SCOPED_TRACE("replay " + std::to_string(rep));
      CUDA_CHECK(cudaGraphLaunch(exec, stream));
      CUDA_CHECK(cudaStreamSynchronize(stream));
      deltastate::chunk_prefill(run.args(eager_mem.views()));
      ChunkPrefillArgs pa = run.args(pdl_mem.views());
      pa.pdl = true;
      pa.stream = stream;
      deltastate::chunk_prefill(pa);
      sync();
      for (const Tensor* t : {&run.rb.out, &run.pool}) {
        const Tensor g = graph_mem.download(*t), e = eager_mem.download(*t),
                     p = pdl_mem.download(*t);
        EXPECT_EQ(std::memcmp(g.alloc_base(), e.alloc_base(), static_cast<size_t>(g.alloc_bytes())),
                  0)
            << "graph replay and eager launch differ";
        EXPECT_EQ(std::memcmp(p.alloc_base(), e.alloc_base(), static_cast<size_t>(p.alloc_bytes())),
                  0)
            << "PDL launch and plain launch differ";
      }
      const Tensor out = graph_mem.download(run.rb.out);
      EXPECT_TRUE(all_zero(out_rows(out, run.rb, 2))) << "padded sequence";
      EXPECT_TRUE(std::isfinite(out.get({0, 0, 0, 0})));
    }
    EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
    EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  }
}

// N = 0 (cu_seqlens [1]) launches nothing and writes nothing.
TEST_F(PrefillGpuTest, NoSequences) {
  Rng rng = test_rng();
  RecurrentBatch rb =
      make_recurrent_batch(rng, recurrent_spec(kQwen3Next, false, DType::bf16, 1, 1, {0}));
  rb.cu = index_tensor({0});
  Mirror dev;
  dev.upload_all(rb.q, rb.k, rb.v, rb.g, rb.beta, rb.out, rb.A_log, rb.dt_bias, rb.cu);
  ChunkPrefillArgs a = prefill_args(rb, dev.views());
  EXPECT_NO_THROW(deltastate::chunk_prefill(a));
  sync();
  EXPECT_EQ(dev.download(rb.out).bytes(), rb.out.bytes());
}

// A pool of 4100 fp32 Qwen3-Next slots (2 MiB each, 8.6 GB): slot * slot_stride passes 2^31
// elements at slot 4096, so 32-bit offsets would wrap (test_cuda_ops.cpp's PoolOfMoreThan4096Slots
// does the same for decode, the recurrent op and ReplaySSM). Sequences across chunk edges (one
// padded) start from and write back slots past it in place, on the Hopper kernels where they run;
// the CPU runs them on the run's small pool. Every other byte of the big pool is a 0x7f pattern
// that must survive the call.
TEST_F(PrefillGpuTest, PoolOfMoreThan4096Slots) {
  const GpuPrefillCase c =
      C("pool_past_2_31", varlen(kQwen3Next, false, DType::bf16, {70, 5, 130, 64, 200}),
        [](GpuPrefillCase& x) { x.padded = {1}; });
  const Shape& s = c.spec.s;
  const int64_t slots = 4100, E = s.state_elems();
  const PatternedDevicePool pool(slots, static_cast<size_t>(E * 4));
  if (!pool.ok()) GTEST_SKIP() << "needs ~" << (pool.bytes() >> 20) << " MiB of device memory";
  void* const big = pool.slot(0);
  const TensorView big_pool =
      TensorView::contiguous(big, DType::f32, {slots, s.HV, s.V, s.K}, Device::cuda(0));

  Rng rng = test_rng();
  PrefillRun run(c, rng);
  const std::vector<int64_t> big_slot{4099, -1, 4096, 2049, 4097};  // per sequence (1 padded)
  ASSERT_EQ(static_cast<int64_t>(big_slot.size()), run.N);
  for (int64_t n = 0; n < run.N; ++n) {
    ASSERT_EQ(big_slot[n] < 0, run.in_slot[n] < 0) << "sequence " << n;
    if (big_slot[n] < 0) continue;
    const std::vector<double> v = slot_values(run.pool.view(), run.in_slot[n]);  // fp32 values
    const std::vector<float> f(v.begin(), v.end());
    CUDA_CHECK(cudaMemcpy(static_cast<float*>(big) + big_slot[n] * E, f.data(),
                          static_cast<size_t>(E * 4), cudaMemcpyHostToDevice));
  }
  Mirror dev;
  const Tensor gidx = index_tensor(big_slot, c.spec.index_dtype);
  dev.upload(gidx);
  run_on_device(run, dev, [&](ChunkPrefillArgs& a) {
    a.initial_state = big_pool;
    a.initial_state_indices = dev.view(gidx);
  });
  EXPECT_NO_THROW(deltastate::check_errors());

  ChunkPrefillArgs cpu_args = run.args(host_view);
  const Tensor cpu_ws = workspace_for(cpu_args);
  cpu_args.workspace = cpu_ws.view();
  deltastate::chunk_prefill(cpu_args);

  const Tensor out = dev.download(run.rb.out);
  const double tol = tolerance(c);
  const int rnd = roundings(c);
  std::vector<float> state(static_cast<size_t>(E));
  for (int64_t n = 0; n < run.N; ++n) {
    const std::string tag = "sequence " + std::to_string(n);
    if (big_slot[n] < 0) {
      EXPECT_TRUE(all_zero(out_rows(out, run.rb, n))) << tag << " (padded): outputs";
      continue;
    }
    EXPECT_TRUE(rel_close(out_rows(out, run.rb, n), out_rows(run.rb.out, run.rb, n), tol,
                          c.spec.act, tag + " out", rnd));
    CUDA_CHECK(cudaMemcpy(state.data(), static_cast<const float*>(big) + big_slot[n] * E,
                          static_cast<size_t>(E * 4), cudaMemcpyDeviceToHost));
    EXPECT_TRUE(rel_close(std::vector<double>(state.begin(), state.end()),
                          slot_values(run.pool.view(), run.in_slot[n]), tol, c.state,
                          tag + " final state in slot " + std::to_string(big_slot[n]), rnd));
  }
  EXPECT_EQ(pool.changed_words(big_slot), 0)
      << "8-byte words outside the live slots of the 4100-slot pool changed";
}

}  // namespace
}  // namespace dstest
