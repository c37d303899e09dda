// CPU kernel of the pooled varlen recurrent op (and of packed decode, its T = 1 case): one task
// per (sequence, value head, block of state rows), so that a single sequence still spreads over
// every thread. A row's arithmetic depends only on that row and the token's vectors, which every
// block prepares the same way, so the result is the same for any blocking, thread count or batch
// composition. The block's rows are held in fp32 for the whole sequence and stored once, rounded
// to the pool's dtype, in the pool's layout (V-first, or FLA's K-first); an fp32 V-first pool
// updated in place is worked on where it lies.
#include "cpu/kernels.h"
#include "cpu/row_io.h"
#include "cpu/state_io.h"

#include <algorithm>
#include <vector>

#include "core/delta_math.h"
#include "cpu/simd.h"
#include "cpu/thread_pool.h"

namespace deltastate::cpu {

using namespace deltastate::detail;

namespace {

// Rows [r0, r0 + rows) of one head's state [V, K] (row v = S[v, :]) from / to memory holding it
// V-first (v*K + k) or K-first (k*V + v, FLA's layout). `col` is a scratch column of `rows`.
void load_rows(const void* base, DType dtype, int64_t off, int K, int V, bool k_first, int r0,
               int rows, float* S, float* col) {
  if (!k_first) {
    load_row(base, dtype, off + static_cast<int64_t>(r0) * K, rows * K, S);
    return;
  }
  for (int k = 0; k < K; ++k) {
    load_row(base, dtype, off + static_cast<int64_t>(k) * V + r0, rows, col);
    for (int r = 0; r < rows; ++r) S[static_cast<int64_t>(r) * K + k] = col[r];
  }
}

void store_rows(void* base, DType dtype, int64_t off, int K, int V, bool k_first, int r0, int rows,
                const float* S, float* col) {
  if (!k_first) {
    store_row(base, dtype, off + static_cast<int64_t>(r0) * K, rows * K, S);
    return;
  }
  for (int k = 0; k < K; ++k) {
    for (int r = 0; r < rows; ++r) col[r] = S[static_cast<int64_t>(r) * K + k];
    store_row(base, dtype, off + static_cast<int64_t>(k) * V + r0, rows, col);
  }
}

struct Scratch {
  std::vector<float> S, q, k, v, alpha, o, col;
  void resize(int K, int rows) {  // grows once per thread, then stays
    if (S.size() < static_cast<size_t>(K) * rows) S.resize(static_cast<size_t>(K) * rows);
    for (auto* x : {&q, &k, &alpha})
      if (x->size() < static_cast<size_t>(K)) x->resize(K);
    for (auto* x : {&v, &o, &col})
      if (x->size() < static_cast<size_t>(rows)) x->resize(rows);
  }
};

}  // namespace

void run_recurrent(const RecurrentProblem& p) {
  const int K = p.K, V = p.V, HV = p.HV;
  const int group = p.HV / p.H;
  const int64_t head_elems = static_cast<int64_t>(V) * K;
  const bool k_first = p.state.k_first;  // state and final_state [.., K, V]
  const int blocks = row_blocks(p.num_heads_total(), V);
  const int block_rows = (V + blocks - 1) / blocks;
  const simd::Kernels& vk = simd::kernels();
  // An fp32 V-first pool updated in place with no final_state copy: the rows are worked on in
  // the pool itself (the same arithmetic, without the two copies).
  const bool in_place =
      p.state.ptr && p.update_state && !p.final_state && !k_first && p.state.dtype == DType::f32;
  // The pool in its storage format (quantized, or stochastically rounded), V-first: loaded and
  // stored through state_io.h; the random bits' step is read once for the whole call.
  const bool formatted = p.state.formatted();
  const StoreRounding rnd = store_rounding(p.state);
  parallel_for(p.num_heads_total() * blocks, [&](int64_t task) {
    thread_local Scratch sc;
    const int64_t head = task / blocks;
    const int r0 = static_cast<int>(task % blocks) * block_rows;
    const int rows = std::min(block_rows, V - r0);
    if (rows <= 0) return;
    sc.resize(K, rows);
    const int64_t n = head / HV;
    const int hv = static_cast<int>(head % HV);
    const int h = hv / group;
    const int64_t slot = p.indices ? index_at(p.indices, p.index_dtype, p.index_stride, n) : n;
    const int64_t seq = p.cu_seqlens ? 0 : n;
    const int64_t tok0 = p.cu_seqlens ? load_index(p.cu_seqlens, p.cu_dtype, n) : 0;
    const int64_t len = p.cu_seqlens ? load_index(p.cu_seqlens, p.cu_dtype, n + 1) - tok0 : p.T;
    const bool padded = p.indices && slot < 0;
    const int64_t final_off = (n * HV + hv) * head_elems;

    if (padded) {  // output rows zeroed, state never read or written
      std::fill_n(sc.o.data(), rows, 0.0f);
      for (int64_t t = 0; t < len; ++t)
        store_row(p.out.ptr, p.out.dtype, head_offset(p.out, seq, tok0 + t, hv) + r0, rows,
                  sc.o.data());
      if (p.final_state) {
        std::fill_n(sc.S.data(), static_cast<int64_t>(rows) * K, 0.0f);
        store_rows(p.final_state, p.final_dtype, final_off, K, V, k_first, r0, rows, sc.S.data(),
                   sc.col.data());
      }
      return;
    }

    const int64_t state_off = slot * p.state.slot_stride + hv * head_elems;
    float* S = in_place
                   ? static_cast<float*>(p.state.ptr) + state_off + static_cast<int64_t>(r0) * K
                   : sc.S.data();
    if (in_place) {
    } else if (p.state.ptr && formatted) {
      load_state_rows(p.state, slot, hv, V, K, r0, rows, S);
    } else if (p.state.ptr) {
      load_rows(p.state.ptr, p.state.dtype, state_off, K, V, k_first, r0, rows, S, sc.col.data());
    } else {
      std::fill_n(S, static_cast<int64_t>(rows) * K, 0.0f);
    }

    for (int64_t t = 0; t < len; ++t) {
      const int64_t tok = tok0 + t;
      if (t + 1 < len) {  // the next token's rows, while this one computes
        prefetch_row(p.q.ptr, p.q.dtype, head_offset(p.q, seq, tok + 1, h), K);
        prefetch_row(p.k.ptr, p.k.dtype, head_offset(p.k, seq, tok + 1, h), K);
        prefetch_row(p.v.ptr, p.v.dtype, head_offset(p.v, seq, tok + 1, hv) + r0, rows);
      }
      load_row(p.q.ptr, p.q.dtype, head_offset(p.q, seq, tok, h), K, sc.q.data());
      load_row(p.k.ptr, p.k.dtype, head_offset(p.k, seq, tok, h), K, sc.k.data());
      load_row(p.v.ptr, p.v.dtype, head_offset(p.v, seq, tok, hv) + r0, rows, sc.v.data());
      prepare_qk(sc.q.data(), K, p.l2norm, p.scale);
      prepare_qk(sc.k.data(), K, p.l2norm, 1.0f);

      gate_row(p.gate, p.g.ptr, p.g.dtype, head_offset(p.g, seq, tok, hv), hv, K, nullptr,
               sc.alpha.data());
      const float beta =
          beta_value(load_float(p.beta.ptr, p.beta.dtype, head_offset(p.beta, seq, tok, hv)),
                     p.beta_is_logit, p.round_beta, p.beta.dtype);

      const float kq = dot(sc.k.data(), sc.q.data(), K);
      vk.delta_rows(S, rows, K, sc.alpha.data(), sc.k.data(), sc.q.data(), sc.v.data(), beta, kq,
                    sc.o.data());
      store_row(p.out.ptr, p.out.dtype, head_offset(p.out, seq, tok, hv) + r0, rows, sc.o.data());
    }
    // A sequence of no tokens leaves its slot as it was: a formatted store would requantize it
    // (fresh scales and rounding bits), and the CUDA kernels do not touch it either.
    if (len == 0) {
    } else if (p.state.ptr && p.update_state && formatted)
      store_state_rows(p.state, rnd, rnd.key_of(slot), slot, hv, V, K, r0, rows, S);
    else if (p.state.ptr && p.update_state && !in_place)
      store_rows(p.state.ptr, p.state.dtype, state_off, K, V, k_first, r0, rows, S, sc.col.data());
    if (p.final_state)
      store_rows(p.final_state, p.final_dtype, final_off, K, V, k_first, r0, rows, S,
                 sc.col.data());
  });
  if (p.state.ptr && p.update_state) advance_step(p.state);
}

}  // namespace deltastate::cpu
