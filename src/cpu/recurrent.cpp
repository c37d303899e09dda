// CPU kernel of the pooled varlen recurrent op (and of packed decode, its T = 1 case): one task
// per (sequence, value head); the state is held in fp32 for the whole sequence and stored once,
// rounded to the pool's dtype, in the pool's layout (V-first, or FLA's K-first).
#include "cpu/kernels.h"
#include "cpu/row_io.h"

#include <algorithm>
#include <vector>

#include "core/delta_math.h"
#include "cpu/thread_pool.h"

namespace deltastate::cpu {

using namespace deltastate::detail;

namespace {

// One head's state [V, K] (row v = S[v, :]) from / to memory holding it V-first (v*K + k) or
// K-first (k*V + v, FLA's layout).
void load_head(const void* base, DType dtype, int64_t off, int K, int V, bool k_first, float* S) {
  if (!k_first) {
    load_row(base, dtype, off, K * V, S);
    return;
  }
  for (int k = 0; k < K; ++k)
    for (int v = 0; v < V; ++v)
      S[static_cast<int64_t>(v) * K + k] =
          load_float(base, dtype, off + static_cast<int64_t>(k) * V + v);
}

void store_head(void* base, DType dtype, int64_t off, int K, int V, bool k_first, const float* S) {
  if (!k_first) {
    store_row(base, dtype, off, K * V, S);
    return;
  }
  for (int k = 0; k < K; ++k)
    for (int v = 0; v < V; ++v)
      store_float(base, dtype, off + static_cast<int64_t>(k) * V + v,
                  S[static_cast<int64_t>(v) * K + k]);
}

struct Scratch {
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

}  // namespace

void run_recurrent(const RecurrentProblem& p) {
  const int K = p.K, V = p.V, HV = p.HV;
  const int group = p.HV / p.H;
  const int64_t head_elems = static_cast<int64_t>(V) * K;
  const bool k_first = p.state.k_first;  // state and final_state [.., K, V]
  parallel_for(p.num_heads_total(), [&](int64_t task) {
    thread_local Scratch sc;
    sc.resize(K, V);
    const int64_t n = task / HV;
    const int hv = static_cast<int>(task % HV);
    const int h = hv / group;
    const int64_t slot = p.indices ? index_at(p.indices, p.index_dtype, p.index_stride, n) : n;
    const int64_t seq = p.cu_seqlens ? 0 : n;
    const int64_t tok0 = p.cu_seqlens ? load_index(p.cu_seqlens, p.cu_dtype, n) : 0;
    const int64_t len = p.cu_seqlens ? load_index(p.cu_seqlens, p.cu_dtype, n + 1) - tok0 : p.T;
    const bool padded = p.indices && slot < 0;

    if (padded) {  // output rows zeroed, state never read or written
      std::fill(sc.o.begin(), sc.o.end(), 0.0f);
      for (int64_t t = 0; t < len; ++t)
        store_row(p.out.ptr, p.out.dtype, head_offset(p.out, seq, tok0 + t, hv), V, sc.o.data());
      if (p.final_state) {
        std::fill(sc.S.begin(), sc.S.end(), 0.0f);
        store_head(p.final_state, p.final_dtype, (n * HV + hv) * head_elems, K, V, k_first,
                   sc.S.data());
      }
      return;
    }

    const int64_t state_off = slot * p.state.slot_stride + hv * head_elems;
    if (p.state.ptr) load_head(p.state.ptr, p.state.dtype, state_off, K, V, k_first, sc.S.data());
    else std::fill(sc.S.begin(), sc.S.end(), 0.0f);

    for (int64_t t = 0; t < len; ++t) {
      const int64_t tok = tok0 + t;
      load_row(p.q.ptr, p.q.dtype, head_offset(p.q, seq, tok, h), K, sc.q.data());
      load_row(p.k.ptr, p.k.dtype, head_offset(p.k, seq, tok, h), K, sc.k.data());
      load_row(p.v.ptr, p.v.dtype, head_offset(p.v, seq, tok, hv), V, sc.v.data());
      prepare_qk(sc.q.data(), K, p.l2norm, p.scale);
      prepare_qk(sc.k.data(), K, p.l2norm, 1.0f);

      gate_row(p.gate, p.g.ptr, p.g.dtype, head_offset(p.g, seq, tok, hv), hv, K, sc.alpha.data());
      for (float& x : sc.alpha) x = expf(x);
      const float beta =
          beta_value(load_float(p.beta.ptr, p.beta.dtype, head_offset(p.beta, seq, tok, hv)),
                     p.beta_is_logit, p.round_beta, p.beta.dtype);

      const float kq = dot(sc.k.data(), sc.q.data(), K);
      for (int vi = 0; vi < V; ++vi) {
        float* row = sc.S.data() + static_cast<int64_t>(vi) * K;
        float sk, sq;
        decay_and_dots(row, sc.alpha.data(), sc.k.data(), sc.q.data(), K, sk, sq);
        const float u = delta_u(sc.v[vi], sk, beta);
        rank1_update(row, sc.k.data(), K, u);
        sc.o[vi] = delta_output(sq, u, kq);
      }
      store_row(p.out.ptr, p.out.dtype, head_offset(p.out, seq, tok, hv), V, sc.o.data());
    }
    if (p.state.ptr && p.update_state)
      store_head(p.state.ptr, p.state.dtype, state_off, K, V, k_first, sc.S.data());
    if (p.final_state)
      store_head(p.final_state, p.final_dtype, (n * HV + hv) * head_elems, K, V, k_first,
                 sc.S.data());
  });
}

}  // namespace deltastate::cpu
