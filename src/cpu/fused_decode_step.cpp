// CPU kernel of the fused decode layer step (the readable oracle of the CUDA kernel): one task
// per (row, key head), which owns the conv channels of its q and k heads and of the v heads of
// its group, so every window is rolled by exactly one task. Per task: the conv update of those
// channels (rounded to mixed_qkv's dtype, as the unfused chain stores the conv output), q and k
// prepared once, then per value head of the group the gate, beta, the delta rule on the state
// and the output (rounded to out's dtype), optionally through the gated RMSNorm. All formulas
// come from core/delta_math.h and core/layer_math.h. In ReplaySSM mode the step is the unfused
// chain run in three passes (run_replay_fused): the conv, replayssm_decode's kernel, the norm.
#include <algorithm>
#include <vector>

#include "core/delta_math.h"
#include "core/layer_math.h"
#include "cpu/kernels.h"
#include "cpu/row_io.h"
#include "cpu/simd.h"
#include "cpu/state_io.h"
#include "cpu/thread_pool.h"

namespace deltastate::cpu {

using namespace deltastate::detail;

namespace {

struct FusedScratch {
  std::vector<float> S, q, k, v, alpha, o;
  void resize(int K, int V) {
    S.resize(static_cast<size_t>(K) * V);
    q.resize(K);
    k.resize(K);
    alpha.resize(K);
    v.resize(V);
    o.resize(V);
  }
};

// The conv update of `n` channels of one part (q, k or v) starting at channel `first` of the
// row's [q | k | v] (part-local channel `local`), into dst[0..n) rounded to x's dtype.
void conv_part(const FusedStepProblem& p, int part, int64_t slot, int64_t row, int64_t first,
               int64_t local, int n, float* dst) {
  for (int i = 0; i < n; ++i) {
    const int64_t c = first + i;
    conv_channel_update(
        channel_window(p.window[part], slot, local + i), p.window[part].state_len, 1, false, 0,
        conv_taps(p.conv, c), p.conv.width, p.conv.silu,
        [&](int) { return load_float(p.x, p.x_dtype, row * p.x_row_stride + c); },
        [&](int, float y) { dst[i] = round_to(p.x_dtype, y); });
  }
}

// The gated RMSNorm of one value head's attention output o[0..V) (already rounded to out's
// dtype, as the unfused chain stores it), in place.
void gated_norm_row(const FusedStepProblem& p, int64_t n, int hv, float* o) {
  const int V = p.V;
  float ss = 0.0f;
  for (int vi = 0; vi < V; ++vi) ss += o[vi] * o[vi];
  const float inv = rms_inverse(ss, V, p.norm_eps);
  const int64_t z_off = n * p.z_row_stride + hv * p.z_head_stride;
  const bool round_product = p.norm_weight_dtype == p.out.dtype;
  for (int vi = 0; vi < V; ++vi)
    o[vi] = gated_norm(o[vi], inv, load_float(p.norm_weight, p.norm_weight_dtype, vi),
                       load_float(p.z, p.z_dtype, z_off + vi), p.out.dtype, round_product);
}

// ReplaySSM mode: the unfused chain itself, in three passes over the batch. The conv update of
// every live row into a packed fp32 row (each value rounded to mixed_qkv's dtype, so the ReplaySSM
// step reads exactly what the chain's conv output holds); replayssm_decode's CPU kernel on it,
// with the fused step's gate, beta, rings and cursors; the gated norm of its outputs in place.
void run_replay_fused(const FusedStepProblem& p) {
  const int K = p.K, V = p.V, H = p.H, HV = p.HV;
  const int group = HV / H;
  const int64_t HK = static_cast<int64_t>(H) * K;
  const int64_t conv_dim = p.conv_dim();
  const auto* indices = static_cast<const int32_t*>(p.indices);  // int32 (the validator's rule)
  std::vector<float> y(static_cast<size_t>(p.B) * conv_dim, 0.0f);
  parallel_for(static_cast<int64_t>(p.B) * H, [&](int64_t task) {
    const int64_t n = task / H;
    const int h = static_cast<int>(task % H);
    const int64_t slot = indices[n * p.index_stride];
    if (slot < 0) return;  // padded: the window untouched (replayssm_decode zeros the output)
    float* row = y.data() + n * conv_dim;
    const int64_t hk = static_cast<int64_t>(h) * K, hvv = static_cast<int64_t>(h) * group * V;
    conv_part(p, 0, slot, n, hk, hk, K, row + hk);
    conv_part(p, 1, slot, n, HK + hk, hk, K, row + HK + hk);
    conv_part(p, 2, slot, n, 2 * HK + hvv, hvv, group * V, row + 2 * HK + hvv);
  });

  run_replayssm_decode(fused_replay_problem(p, y.data(), DType::f32));

  if (!p.z) return;
  parallel_for(static_cast<int64_t>(p.B) * HV, [&](int64_t task) {
    thread_local std::vector<float> o;
    o.resize(V);
    const int64_t n = task / HV;
    const int hv = static_cast<int>(task % HV);
    if (indices[n * p.index_stride] < 0) return;  // padded: zeros, as the plain step
    const int64_t off = head_offset(p.out, n, 0, hv);
    load_row(p.out.ptr, p.out.dtype, off, V, o.data());
    gated_norm_row(p, n, hv, o.data());
    store_row(p.out.ptr, p.out.dtype, off, V, o.data());
  });
}

}  // namespace

void run_fused_decode_step(const FusedStepProblem& p) {
  if (p.is_replay()) return run_replay_fused(p);
  const int K = p.K, V = p.V, H = p.H, HV = p.HV;
  const int group = HV / H;
  const int64_t HK = static_cast<int64_t>(H) * K;
  const StoreRounding rnd = store_rounding(p.state);  // the step, read once per call
  parallel_for(static_cast<int64_t>(p.B) * H, [&](int64_t task) {
    thread_local FusedScratch sc;
    sc.resize(K, V);
    const int64_t n = task / H;
    const int h = static_cast<int>(task % H);
    const int64_t slot = index_at(p.indices, p.index_dtype, p.index_stride, n);
    if (slot < 0) {  // padded: output zeros, nothing read or written
      std::fill(sc.o.begin(), sc.o.end(), 0.0f);
      for (int j = 0; j < group; ++j)
        store_row(p.out.ptr, p.out.dtype, head_offset(p.out, n, 0, h * group + j), V, sc.o.data());
      return;
    }
    conv_part(p, 0, slot, n, static_cast<int64_t>(h) * K, static_cast<int64_t>(h) * K, K,
              sc.q.data());
    conv_part(p, 1, slot, n, HK + static_cast<int64_t>(h) * K, static_cast<int64_t>(h) * K, K,
              sc.k.data());
    prepare_qk(sc.q.data(), K, p.l2norm, p.scale);
    prepare_qk(sc.k.data(), K, p.l2norm, 1.0f);
    const float kq = dot(sc.k.data(), sc.q.data(), K);

    for (int j = 0; j < group; ++j) {
      const int hv = h * group + j;
      conv_part(p, 2, slot, n, 2 * HK + static_cast<int64_t>(hv) * V, static_cast<int64_t>(hv) * V,
                V, sc.v.data());
      gate_row(p.gate, p.a.ptr, p.a.dtype, head_offset(p.a, n, 0, hv), hv, K, nullptr,
               sc.alpha.data());
      const float beta = beta_value(load_float(p.b.ptr, p.b.dtype, head_offset(p.b, n, 0, hv)),
                                    true, p.round_beta, p.b.dtype);
      load_state_rows(p.state, slot, hv, V, K, 0, V, sc.S.data());
      // the packed decode's token step (the recurrent kernel's), bit for bit
      simd::kernels().delta_rows(sc.S.data(), V, K, sc.alpha.data(), sc.k.data(), sc.q.data(),
                                 sc.v.data(), beta, kq, sc.o.data());
      for (int vi = 0; vi < V; ++vi) sc.o[vi] = round_to(p.out.dtype, sc.o[vi]);
      store_state_rows(p.state, rnd, rnd.key_of(slot), slot, hv, V, K, 0, V, sc.S.data());
      if (p.z) gated_norm_row(p, n, hv, sc.o.data());
      store_row(p.out.ptr, p.out.dtype, head_offset(p.out, n, 0, hv), V, sc.o.data());
    }
  });
  advance_step(p.state);
}

}  // namespace deltastate::cpu
