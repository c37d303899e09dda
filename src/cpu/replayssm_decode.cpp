// CPU kernel of ReplaySSM buffered decode (SGLang's fused_recurrent_linear_replayssm_decode in its
// basic mode: no circular ring, no predecayed keys): one task per (row, value head).
// The same math as the CUDA kernel (src/cuda/replayssm_decode.cu, docs/REPLAYSSM.md): an
// appending step takes the output from dot products of the checkpoint and the ring records with
// the token's vectors and appends the record (d, k, g); a flush rebuilds the state and runs the
// plain delta-rule step on it, writing the checkpoint. Cursors advance after every task of the
// step has read them.
#include <vector>

#include "core/delta_math.h"
#include "cpu/kernels.h"
#include "cpu/row_io.h"
#include "cpu/thread_pool.h"

namespace deltastate::cpu {

using namespace deltastate::detail;

namespace {
struct Scratch {
  std::vector<float> S, q, k, v, g, alpha, d, o, e, G, ak, aq, ek, eq, kw, dj, w, ck, cq;
  void resize(int K, int V, int L) {
    S.resize(static_cast<size_t>(K) * V);
    for (auto* x : {&q, &k, &g, &alpha, &e, &G, &ak, &aq, &ek, &eq}) x->resize(K);
    for (auto* x : {&v, &d, &o}) x->resize(V);
    kw.resize(static_cast<size_t>(L) * K);
    dj.resize(static_cast<size_t>(L) * V);
    for (auto* x : {&w, &ck, &cq}) x->resize(L);
  }
};

bool row_flushes(const ReplayProblem& p, int64_t n) {
  return replay_flushes(p.write_pos[n], p.L, p.force_flush && p.force_flush[n] != 0);
}
}  // namespace

void run_replayssm_decode(const ReplayProblem& p) {
  const int K = p.K, V = p.V, HV = p.HV, H = p.H, L = p.L;
  const int group = HV / H;
  const int64_t head_elems = static_cast<int64_t>(V) * K;
  const int g_width = p.gate.kda ? K : 1;  // floats per g ring record

  parallel_for(static_cast<int64_t>(p.B) * HV, [&](int64_t task) {
    thread_local Scratch sc;
    sc.resize(K, V, L);
    const int64_t n = task / HV;
    const int hv = static_cast<int>(task % HV);
    const int h = hv / group;
    const int64_t slot = p.indices[n * p.index_stride];
    if (slot < 0) {  // padded row: zero output, no state or ring access
      std::fill(sc.o.begin(), sc.o.end(), 0.0f);
      store_row(p.out.ptr, p.out.dtype, head_offset(p.out, n, 0, hv), V, sc.o.data());
      return;
    }
    const int m = p.write_pos[n];
    const bool flush = row_flushes(p, n);
    const int64_t d_base = ((slot * HV + hv) * L) * V;        // d_cache[slot, hv, 0, 0]
    const int64_t k_base = ((slot * H + h) * L) * K;          // k_cache[slot, h, 0, 0]
    const int64_t g_base = ((slot * HV + hv) * L) * g_width;  // g_cache[slot, hv, 0(, 0)]
    const int64_t state_off = slot * p.state.slot_stride + hv * head_elems;
    load_row(p.state.ptr, p.state.dtype, state_off, static_cast<int>(head_elems), sc.S.data());

    // 1. The token: q, k normalized (q scaled), gate alpha = exp(g), beta (fp32, or rounded to
    //    b's dtype with round_beta).
    load_row(p.q.ptr, p.q.dtype, head_offset(p.q, n, 0, h), K, sc.q.data());
    load_row(p.k.ptr, p.k.dtype, head_offset(p.k, n, 0, h), K, sc.k.data());
    load_row(p.v.ptr, p.v.dtype, head_offset(p.v, n, 0, hv), V, sc.v.data());
    prepare_qk(sc.q.data(), K, p.l2norm, p.scale);
    prepare_qk(sc.k.data(), K, p.l2norm, 1.0f);
    const float kq = dot(sc.k.data(), sc.q.data(), K);
    gate_row(p.gate, p.a.ptr, p.a.dtype, head_offset(p.a, n, 0, hv), hv, K, sc.g.data());
    for (int i = 0; i < K; ++i) {
      sc.alpha[i] = expf(sc.g[i]);
      sc.ak[i] = sc.alpha[i] * sc.k[i];
      sc.aq[i] = sc.alpha[i] * sc.q[i];
    }
    const float beta = beta_value(load_float(p.b.ptr, p.b.dtype, head_offset(p.b, n, 0, hv)),
                                  /*is_logit=*/true, p.round_beta, p.b.dtype);

    // 2. The ring (m records): e = exp(Gtot), kw_j = W_j*k_j (KDA; GDN keeps the scalar W_j in
    //    w[j] and kw_j = k_j).
    std::fill(sc.e.begin(), sc.e.end(), 0.0f);  // Gtot, then e
    for (int j = 0; j < m; ++j)
      for (int i = 0; i < g_width; ++i) sc.e[i] += p.g_cache[g_base + j * g_width + i];
    if (!p.gate.kda) std::fill(sc.e.begin() + 1, sc.e.end(), sc.e[0]);
    std::vector<float>& prefix = sc.G;  // G_j
    std::fill(prefix.begin(), prefix.end(), 0.0f);
    for (int j = 0; j < m; ++j) {
      float* kw = sc.kw.data() + static_cast<int64_t>(j) * K;
      for (int i = 0; i < g_width; ++i) prefix[i] += p.g_cache[g_base + j * g_width + i];
      load_row(p.k_cache, p.k_dtype, k_base + static_cast<int64_t>(j) * K, K, kw);
      load_row(p.d_cache, p.d_dtype, d_base + static_cast<int64_t>(j) * V, V,
               sc.dj.data() + static_cast<int64_t>(j) * V);
      if (p.gate.kda) {
        for (int i = 0; i < K; ++i) kw[i] *= expf(sc.e[i] - prefix[i]);
        sc.w[j] = 1.0f;
      } else {
        sc.w[j] = expf(sc.e[0] - prefix[0]);
      }
    }
    for (int i = 0; i < K; ++i) sc.e[i] = expf(sc.e[i]);

    if (flush) {
      // 3f. Flush: rebuild the state before this token, S = e*S0 + sum_j d_j w_j kw_j, then the
      //     plain delta-rule step on it (decay, dots, u, output, S0 <- alpha*S + u*k).
      for (int vi = 0; vi < V; ++vi) {
        float* row = sc.S.data() + static_cast<int64_t>(vi) * K;
        scale_row(row, sc.e.data(), K);
        for (int j = 0; j < m; ++j)
          rank1_update(row, sc.kw.data() + static_cast<int64_t>(j) * K, K,
                       sc.dj[static_cast<int64_t>(j) * V + vi] * sc.w[j]);
        float sk, sq;
        decay_and_dots(row, sc.alpha.data(), sc.k.data(), sc.q.data(), K, sk, sq);
        const float u = delta_u(sc.v[vi], sk, beta);
        sc.o[vi] = delta_output(sq, u, kq);
        rank1_update(row, sc.k.data(), K, u);
      }
      store_row(p.out.ptr, p.out.dtype, head_offset(p.out, n, 0, hv), V, sc.o.data());
      store_row(p.state.ptr, p.state.dtype, state_off, static_cast<int>(head_elems), sc.S.data());
      return;
    }

    // 3a. An appending step: the state before this token is never built. Per record the
    //     coefficients ck_j = w_j kw_j.(alpha*k), cq_j = w_j kw_j.(alpha*q); per row sk =
    //     S0.(e*alpha*k) + sum_j d_j ck_j, sq likewise with q; d = beta*(v - sk), o = sq + d*(k.q).
    for (int j = 0; j < m; ++j) {
      const float* kw = sc.kw.data() + static_cast<int64_t>(j) * K;
      sc.ck[j] = sc.w[j] * dot(kw, sc.ak.data(), K);
      sc.cq[j] = sc.w[j] * dot(kw, sc.aq.data(), K);
    }
    for (int i = 0; i < K; ++i) {
      sc.ek[i] = sc.e[i] * sc.ak[i];
      sc.eq[i] = sc.e[i] * sc.aq[i];
    }
    for (int vi = 0; vi < V; ++vi) {
      const float* s0 = sc.S.data() + static_cast<int64_t>(vi) * K;
      float sk = dot(s0, sc.ek.data(), K), sq = dot(s0, sc.eq.data(), K);
      for (int j = 0; j < m; ++j) {
        const float dj = sc.dj[static_cast<int64_t>(j) * V + vi];
        sk += dj * sc.ck[j];
        sq += dj * sc.cq[j];
      }
      sc.d[vi] = delta_u(sc.v[vi], sk, beta);
      sc.o[vi] = delta_output(sq, sc.d[vi], kq);
    }
    store_row(p.out.ptr, p.out.dtype, head_offset(p.out, n, 0, hv), V, sc.o.data());
    // Append the record (d, k, g) at position m.
    store_row(p.d_cache, p.d_dtype, d_base + static_cast<int64_t>(m) * V, V, sc.d.data());
    for (int i = 0; i < g_width; ++i) p.g_cache[g_base + m * g_width + i] = sc.g[i];
    if (hv % group == 0)  // one writer per key head
      store_row(p.k_cache, p.k_dtype, k_base + static_cast<int64_t>(m) * K, K, sc.k.data());
  });

  if (p.advance_write_pos) {
    for (int64_t n = 0; n < p.B; ++n) {
      if (p.indices[n * p.index_stride] < 0) continue;
      p.write_pos[n] = row_flushes(p, n) ? 0 : p.write_pos[n] + 1;
    }
  }
}

}  // namespace deltastate::cpu
