// CPU kernel of ReplaySSM buffered decode (spec §5, basic mode): one task per (row, value head).
// Rebuild S from the checkpoint and the ring, run the current token, then either fold it into the
// checkpoint (flush) or append its record (d, k, g) to the ring. Cursors advance after every task
// of the step has read them.
#include <vector>

#include "core/delta_math.h"
#include "cpu/kernels.h"
#include "cpu/row_io.h"
#include "cpu/thread_pool.h"

namespace deltastate::cpu {

using namespace deltastate::detail;

namespace {
struct Scratch {
  std::vector<float> S, q, k, v, g, alpha, d, o, G, kw;
  void resize(int K, int V) {
    S.resize(static_cast<size_t>(K) * V);
    for (auto* x : {&q, &k, &g, &alpha, &G, &kw}) x->resize(K);
    for (auto* x : {&v, &d, &o}) x->resize(V);
  }
};

bool row_flushes(const ReplayProblem& p, int64_t n) {
  return p.write_pos[n] >= p.L - 1 || (p.force_flush && p.force_flush[n] != 0);
}
}  // namespace

void run_replayssm_decode(const ReplayProblem& p) {
  const int K = p.K, V = p.V, HV = p.HV, H = p.H, L = p.L;
  const int group = HV / H;
  const int64_t head_elems = static_cast<int64_t>(V) * K;
  const int g_width = p.gate.kda ? K : 1;  // floats per g ring record

  parallel_for(static_cast<int64_t>(p.B) * HV, [&](int64_t task) {
    thread_local Scratch sc;
    sc.resize(K, V);
    const int64_t n = task / HV;
    const int hv = static_cast<int>(task % HV);
    const int h = hv / group;
    const int64_t slot = p.indices[n];
    if (slot < 0) {  // padded row: zero output, no state or ring access
      std::fill(sc.o.begin(), sc.o.end(), 0.0f);
      store_row(p.out.ptr, p.out.dtype, head_offset(p.out, n, 0, hv), V, sc.o.data());
      return;
    }
    const int m = p.write_pos[n];
    const bool flush = row_flushes(p, n);

    // Ring bases of this (slot, head).
    const int64_t d_base = ((slot * HV + hv) * L) * V;      // d_cache[slot, hv, 0, 0]
    const int64_t k_base = ((slot * H + h) * L) * K;        // k_cache[slot, h, 0, 0]
    const int64_t g_base = ((slot * HV + hv) * L) * g_width;  // g_cache[slot, hv, 0(, 0)]

    // 1. S = exp(Gtot) * S0 + sum_j d_j (W_j * k_j)^T over the m records in the ring.
    const int64_t state_off = slot * p.state.slot_stride + hv * head_elems;
    load_row(p.state.ptr, p.state.dtype, state_off, static_cast<int>(head_elems), sc.S.data());
    if (m > 0) {
      std::fill(sc.G.begin(), sc.G.end(), 0.0f);  // Gtot
      for (int j = 0; j < m; ++j)
        for (int i = 0; i < g_width; ++i) sc.G[i] += p.g_cache[g_base + j * g_width + i];
      if (!p.gate.kda) std::fill(sc.G.begin() + 1, sc.G.end(), sc.G[0]);
      for (int i = 0; i < K; ++i) sc.kw[i] = expf(sc.G[i]);  // exp(Gtot)
      for (int vi = 0; vi < V; ++vi)
        for (int i = 0; i < K; ++i) sc.S[static_cast<int64_t>(vi) * K + i] *= sc.kw[i];
      std::vector<float>& prefix = sc.alpha;  // G_j, reused as scratch here
      std::fill(prefix.begin(), prefix.end(), 0.0f);
      for (int j = 0; j < m; ++j) {
        for (int i = 0; i < g_width; ++i) prefix[i] += p.g_cache[g_base + j * g_width + i];
        load_row(p.k_cache, p.k_dtype, k_base + static_cast<int64_t>(j) * K, K, sc.kw.data());
        load_row(p.d_cache, p.d_dtype, d_base + static_cast<int64_t>(j) * V, V, sc.d.data());
        if (p.gate.kda) {  // KDA folds W_j into k_j
          for (int i = 0; i < K; ++i) sc.kw[i] *= expf(sc.G[i] - prefix[i]);
        } else {  // GDN folds the scalar W_j into d_j
          const float w = expf(sc.G[0] - prefix[0]);
          for (int vi = 0; vi < V; ++vi) sc.d[vi] *= w;
        }
        for (int vi = 0; vi < V; ++vi)
          replay_accumulate_row(sc.S.data() + static_cast<int64_t>(vi) * K, sc.kw.data(), K, sc.d[vi]);
      }
    }

    // 2. The current token.
    load_row(p.q.ptr, p.q.dtype, head_offset(p.q, n, 0, h), K, sc.q.data());
    load_row(p.k.ptr, p.k.dtype, head_offset(p.k, n, 0, h), K, sc.k.data());
    load_row(p.v.ptr, p.v.dtype, head_offset(p.v, n, 0, hv), V, sc.v.data());
    prepare_qk(sc.q.data(), K, p.l2norm, p.scale);
    prepare_qk(sc.k.data(), K, p.l2norm, 1.0f);
    float kq = 0.0f;
    for (int i = 0; i < K; ++i) kq += sc.k[i] * sc.q[i];
    gate_row(p.gate, p.a.ptr, p.a.dtype, head_offset(p.a, n, 0, hv), hv, K, sc.g.data());
    for (int i = 0; i < K; ++i) sc.alpha[i] = expf(sc.g[i]);
    const float beta = beta_value(load_float(p.b.ptr, p.b.dtype, head_offset(p.b, n, 0, hv)),
                                  /*is_logit=*/true, /*round=*/true, p.b.dtype);
    for (int vi = 0; vi < V; ++vi) {
      replay_token_row(sc.S.data() + static_cast<int64_t>(vi) * K, sc.alpha.data(), sc.k.data(),
                       sc.q.data(), K, sc.v[vi], beta, kq, [](float x) { return x; }, sc.d[vi],
                       sc.o[vi]);
    }
    store_row(p.out.ptr, p.out.dtype, head_offset(p.out, n, 0, hv), V, sc.o.data());

    // 3. Flush into the checkpoint, or append the record at position m.
    if (flush) {
      for (int vi = 0; vi < V; ++vi)
        replay_flush_row(sc.S.data() + static_cast<int64_t>(vi) * K, sc.alpha.data(), sc.k.data(),
                         K, sc.d[vi]);
      store_row(p.state.ptr, p.state.dtype, state_off, static_cast<int>(head_elems), sc.S.data());
    } else {
      store_row(p.d_cache, p.d_dtype, d_base + static_cast<int64_t>(m) * V, V, sc.d.data());
      for (int i = 0; i < g_width; ++i) p.g_cache[g_base + m * g_width + i] = sc.g[i];
      if (hv % group == 0)  // one writer per key head
        store_row(p.k_cache, p.k_dtype, k_base + static_cast<int64_t>(m) * K, K, sc.k.data());
    }
  });

  if (p.advance_write_pos) {
    for (int64_t n = 0; n < p.B; ++n) {
      if (p.indices[n] < 0) continue;
      p.write_pos[n] = row_flushes(p, n) ? 0 : p.write_pos[n] + 1;
    }
  }
}

}  // namespace deltastate::cpu
