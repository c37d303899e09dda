// CPU kernel of the fused decode layer step (the readable oracle of the CUDA kernel): one task
// per (row, key head), which owns the conv channels of its q and k heads and of the v heads of
// its group, so every window is rolled by exactly one task. Per task: the conv update of those
// channels (rounded to mixed_qkv's dtype, as the unfused chain stores the conv output), q and k
// prepared once, then per value head of the group the gate, beta, the delta rule on the state
// and the output (rounded to out's dtype), optionally through the gated RMSNorm. All formulas
// come from core/delta_math.h and core/layer_math.h.
#include <algorithm>
#include <vector>

#include "core/delta_math.h"
#include "core/layer_math.h"
#include "cpu/kernels.h"
#include "cpu/row_io.h"
#include "cpu/simd.h"
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

}  // namespace

void run_fused_decode_step(const FusedStepProblem& p) {
  const int K = p.K, V = p.V, H = p.H, HV = p.HV;
  const int group = HV / H;
  const int64_t HK = static_cast<int64_t>(H) * K;
  const int64_t head_elems = static_cast<int64_t>(V) * K;
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
      const int64_t state_off = slot * p.state.slot_stride + hv * head_elems;
      load_row(p.state.ptr, p.state.dtype, state_off, K * V, sc.S.data());
      // the packed decode's token step (the recurrent kernel's), bit for bit
      simd::kernels().delta_rows(sc.S.data(), V, K, sc.alpha.data(), sc.k.data(), sc.q.data(),
                                 sc.v.data(), beta, kq, sc.o.data());
      for (int vi = 0; vi < V; ++vi) sc.o[vi] = round_to(p.out.dtype, sc.o[vi]);
      store_row(p.state.ptr, p.state.dtype, state_off, K * V, sc.S.data());
      if (p.z) {
        float ss = 0.0f;
        for (int vi = 0; vi < V; ++vi) ss += sc.o[vi] * sc.o[vi];
        const float inv = rms_inverse(ss, V, p.norm_eps);
        const int64_t z_off = n * p.z_row_stride + hv * p.z_head_stride;
        const bool round_product = p.norm_weight_dtype == p.out.dtype;
        for (int vi = 0; vi < V; ++vi)
          sc.o[vi] = gated_norm(sc.o[vi], inv, load_float(p.norm_weight, p.norm_weight_dtype, vi),
                                load_float(p.z, p.z_dtype, z_off + vi), p.out.dtype, round_product);
      }
      store_row(p.out.ptr, p.out.dtype, head_offset(p.out, n, 0, hv), V, sc.o.data());
    }
  });
}

}  // namespace deltastate::cpu
