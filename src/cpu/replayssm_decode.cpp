// CPU kernel of ReplaySSM buffered decode (SGLang's fused_recurrent_linear_replayssm_decode with
// its ring modes: basic, circular, prefix gates, pre-decayed keys): one task per (row, value
// head, block of state rows); every block prepares the token and the ring the same way, so a row's
// result does not depend on the blocking or the thread count. The same math as the CUDA kernel
// (src/cuda/replayssm_decode.cu, docs/REPLAYSSM.md): an appending step takes the output from dot
// products of the checkpoint and the ring records with the token's vectors and appends the record
// (d, k, g); a flush rebuilds the state and runs the plain delta-rule step on it, writing the
// checkpoint. Cursors advance after every task of the step has read them.
#include <vector>

#include "core/delta_math.h"
#include "cpu/kernels.h"
#include "cpu/row_io.h"
#include "cpu/simd.h"
#include "cpu/state_io.h"
#include "cpu/thread_pool.h"

namespace deltastate::cpu {

using namespace deltastate::detail;

namespace {
struct Scratch {
  std::vector<float> S, q, k, v, g, alpha, d, o, e, G, ak, aq, ek, eq, nd, kw, dj, w, ck, cq;
  template <class Vec>
  static void grow(Vec& x, int64_t n) {
    if (x.size() < static_cast<size_t>(n)) x.resize(static_cast<size_t>(n));
  }
  void resize(int K, int rows, int L) {  // grows once per thread, then stays
    grow(S, static_cast<int64_t>(K) * rows);
    for (auto* x : {&q, &k, &g, &alpha, &e, &G, &ak, &aq, &ek, &eq, &nd}) grow(*x, K);
    for (auto* x : {&v, &d, &o}) grow(*x, rows);
    grow(kw, static_cast<int64_t>(L) * K);
    grow(dj, static_cast<int64_t>(L) * rows);
    for (auto* x : {&w, &ck, &cq}) grow(*x, L);
  }
};

// The ring of one (slot, value head) with m records from position `base` (record j at
// replay_position(base, j, L)), for state rows r0..r0+rows: G (K) holds Gtot (the sum of the
// records' g, or with prefix gates the last record's), e = exp(Gtot), kw_j = W_j*k_j with W_j =
// exp(Gtot - G_j) (KDA; pre-decayed keys k_j/exp(G_j) need only e: kw_j = e*k_ring_j; GDN keeps
// the scalar W_j in w[j] and kw_j = k_j), dj this block's columns of the d records. Uses eq as
// scratch. Shared by the decode step and the pool's materialization, so both rebuild a state
// with the same operations.
void prepare_ring(const ReplayProblem& p, Scratch& sc, int64_t slot, int hv, int m, int base,
                  int r0, int rows) {
  const int K = p.K, V = p.V, HV = p.HV, H = p.H, L = p.L;
  const int h = hv / (HV / H);
  const int g_width = p.gate.kda ? K : 1;
  const bool prefix = p.modes.prefix_gates, predecay = p.modes.predecayed_k;
  auto at = [&](int j) { return static_cast<int64_t>(replay_position(base, j, L)); };
  const int64_t d_base = ((slot * HV + hv) * L) * V;        // d_cache[slot, hv, 0, 0]
  const int64_t k_base = ((slot * H + h) * L) * K;          // k_cache[slot, h, 0, 0]
  const int64_t g_base = ((slot * HV + hv) * L) * g_width;  // g_cache[slot, hv, 0(, 0)]
  float* gtot = sc.G.data();
  std::fill_n(gtot, K, 0.0f);
  if (prefix) {
    if (m > 0)
      for (int i = 0; i < K; ++i) gtot[i] = p.g_cache[g_base + at(m - 1) * g_width + i];
  } else {
    for (int j = 0; j < m; ++j)
      for (int i = 0; i < g_width; ++i) gtot[i] += p.g_cache[g_base + at(j) * g_width + i];
    if (!p.gate.kda) std::fill_n(gtot + 1, K - 1, gtot[0]);
  }
  for (int i = 0; i < K; ++i) sc.e[i] = expf(gtot[i]);
  float* prefix_j = sc.eq.data();  // G_j
  std::fill_n(prefix_j, K, 0.0f);
  for (int j = 0; j < m; ++j) {
    float* kw = sc.kw.data() + static_cast<int64_t>(j) * K;
    const float* gj = p.g_cache + g_base + at(j) * g_width;
    if (prefix) std::copy_n(gj, K, prefix_j);
    else
      for (int i = 0; i < g_width; ++i) prefix_j[i] += gj[i];
    load_row(p.k_cache, p.k_dtype, k_base + at(j) * K, K, kw);
    load_row(p.d_cache, p.d_dtype, d_base + at(j) * V + r0, rows,
             sc.dj.data() + static_cast<int64_t>(j) * rows);
    sc.w[j] = 1.0f;
    if (predecay) {
      for (int i = 0; i < K; ++i) kw[i] *= sc.e[i];
    } else if (p.gate.kda) {
      for (int i = 0; i < K; ++i) kw[i] *= expf(gtot[i] - prefix_j[i]);
    } else {
      sc.w[j] = expf(gtot[0] - prefix_j[0]);
    }
  }
}

// The state before the token from the checkpoint rows S and the prepared ring: S = e*S0 +
// sum_j d_j w_j kw_j (exact fp32 multiply-adds, in place).
void rebuild_rows(float* S, int rows, int K, int m, const Scratch& sc, const simd::Kernels& vk) {
  for (int r = 0; r < rows; ++r) {
    float* row = S + static_cast<int64_t>(r) * K;
    vk.mul(row, sc.e.data(), K);
    for (int j = 0; j < m; ++j)
      vk.axpy(row, sc.dj[static_cast<int64_t>(j) * rows + r] * sc.w[j],
              sc.kw.data() + static_cast<int64_t>(j) * K, K);
  }
}
}  // namespace

void run_replayssm_decode(const ReplayProblem& p) {
  const int K = p.K, V = p.V, HV = p.HV, H = p.H, L = p.L;
  const int group = HV / H;
  const int64_t head_elems = static_cast<int64_t>(V) * K;
  const int g_width = p.gate.kda ? K : 1;  // floats per g ring record
  const int blocks = row_blocks(static_cast<int64_t>(p.B) * HV, V);
  const int block_rows = (V + blocks - 1) / blocks;
  const simd::Kernels& vk = simd::kernels();
  const bool in_place = p.state.dtype == DType::f32;  // fp32 checkpoints: worked on where they lie
  // A quantized or stochastically rounded checkpoint: loaded and stored (on a flush) through
  // state_io.h, the step of the rounding key read once per call.
  const bool formatted = p.state.formatted();
  const StoreRounding rnd = store_rounding(p.state);

  parallel_for(static_cast<int64_t>(p.B) * HV * blocks, [&](int64_t task) {
    thread_local Scratch sc;
    const int64_t head = task / blocks;
    const int r0 = static_cast<int>(task % blocks) * block_rows;
    const int rows = std::min(block_rows, V - r0);
    if (rows <= 0) return;
    const bool first_block = r0 == 0;  // writes the head's g (and k) ring record
    sc.resize(K, rows, L);
    const int64_t n = head / HV;
    const int hv = static_cast<int>(head % HV);
    const int h = hv / group;
    const int64_t slot = p.indices[n * p.index_stride];
    if (slot < 0) {  // padded row: zero output, no state or ring access
      std::fill_n(sc.o.data(), rows, 0.0f);
      store_row(p.out.ptr, p.out.dtype, head_offset(p.out, n, 0, hv) + r0, rows, sc.o.data());
      return;
    }
    const int m = p.write_pos[n];
    const bool forced = p.force_flush && p.force_flush[n] != 0;
    const bool circular = p.modes.circular;
    const int base = circular ? p.modes.cache_base[n] : 0;
    const bool full = replay_full_flush(m, L, forced, circular);        // fold the token in
    const bool history = replay_history_flush(m, L, forced, circular);  // S0 <- S, then append
    const bool prefix = p.modes.prefix_gates;    // g ring: cumulative gates (KDA)
    const bool predecay = p.modes.predecayed_k;  // k ring: k / exp(G_j) (KDA)
    auto at = [&](int j) { return static_cast<int64_t>(replay_position(base, j, L)); };
    const int64_t d_base = ((slot * HV + hv) * L) * V;        // d_cache[slot, hv, 0, 0]
    const int64_t k_base = ((slot * H + h) * L) * K;          // k_cache[slot, h, 0, 0]
    const int64_t g_base = ((slot * HV + hv) * L) * g_width;  // g_cache[slot, hv, 0(, 0)]
    const int64_t state_off = slot * p.state.slot_stride + hv * head_elems + int64_t{r0} * K;
    float* S = in_place ? static_cast<float*>(p.state.ptr) + state_off : sc.S.data();
    if (formatted) load_state_rows(p.state, slot, hv, V, K, r0, rows, S);
    else if (!in_place) load_row(p.state.ptr, p.state.dtype, state_off, rows * K, S);

    // 1. The token: q, k normalized (q scaled), gate alpha = exp(g), beta (fp32, or rounded to
    //    b's dtype with round_beta; always fp32 with pre-decayed keys, as SGLang).
    load_row(p.q.ptr, p.q.dtype, head_offset(p.q, n, 0, h), K, sc.q.data());
    load_row(p.k.ptr, p.k.dtype, head_offset(p.k, n, 0, h), K, sc.k.data());
    load_row(p.v.ptr, p.v.dtype, head_offset(p.v, n, 0, hv) + r0, rows, sc.v.data());
    prepare_qk(sc.q.data(), K, p.l2norm, p.scale);
    prepare_qk(sc.k.data(), K, p.l2norm, 1.0f);
    const float kq = dot(sc.k.data(), sc.q.data(), K);
    gate_row(p.gate, p.a.ptr, p.a.dtype, head_offset(p.a, n, 0, hv), hv, K, sc.g.data(),
             sc.alpha.data());
    for (int i = 0; i < K; ++i) {
      sc.ak[i] = sc.alpha[i] * sc.k[i];
      sc.aq[i] = sc.alpha[i] * sc.q[i];
    }
    const float beta = beta_value(load_float(p.b.ptr, p.b.dtype, head_offset(p.b, n, 0, hv)),
                                  /*is_logit=*/true, p.round_beta && !predecay, p.b.dtype);

    // 2. The ring (m records from position `base`): e, kw, w, dj; G holds Gtot.
    prepare_ring(p, sc, slot, hv, m, base, r0, rows);
    const float* gtot = sc.G.data();

    // 3f. Rebuild the state before this token, S = e*S0 + sum_j d_j w_j kw_j.
    if (full || history) rebuild_rows(S, rows, K, m, sc, vk);
    if (full) {
      // A fold: the plain delta-rule step on S (decay, dots, u, output, S0 <- alpha*S + u*k).
      vk.delta_rows(S, rows, K, sc.alpha.data(), sc.k.data(), sc.q.data(), sc.v.data(), beta, kq,
                    sc.o.data());
      store_row(p.out.ptr, p.out.dtype, head_offset(p.out, n, 0, hv) + r0, rows, sc.o.data());
      if (formatted) store_state_rows(p.state, rnd, rnd.key_of(slot), slot, hv, V, K, r0, rows, S);
      else if (!in_place) store_row(p.state.ptr, p.state.dtype, state_off, rows * K, S);
      return;
    }
    if (history) {
      // A history checkpoint (circular mode): S0 <- S (stored as a fold stores it), and the token
      // runs as an appending step on the new checkpoint with an empty ring (e = 1, no records).
      if (formatted) store_state_rows(p.state, rnd, rnd.key_of(slot), slot, hv, V, K, r0, rows, S);
      else if (!in_place) store_row(p.state.ptr, p.state.dtype, state_off, rows * K, S);
    }
    const int records = history ? 0 : m;
    float* new_decay = sc.nd.data();  // exp of the cumulative gate through this token (KDA)
    for (int i = 0; i < K; ++i) new_decay[i] = history ? sc.alpha[i] : sc.e[i] * sc.alpha[i];

    // 3a. An appending step: the state before this token is never built. Per record the
    //     coefficients ck_j = w_j kw_j.(alpha*k), cq_j = w_j kw_j.(alpha*q); per row sk =
    //     S0.(e*alpha*k) + sum_j d_j ck_j, sq likewise with q; d = beta*(v - sk), o = sq + d*(k.q).
    //     After a history checkpoint S0 is S and e = 1.
    for (int j = 0; j < records; ++j) {
      const float* kw = sc.kw.data() + static_cast<int64_t>(j) * K;
      sc.ck[j] = sc.w[j] * dot(kw, sc.ak.data(), K);
      sc.cq[j] = sc.w[j] * dot(kw, sc.aq.data(), K);
    }
    const float* ek = sc.ak.data();
    const float* eq = sc.aq.data();
    if (!history) {
      for (int i = 0; i < K; ++i) {
        sc.ek[i] = sc.e[i] * sc.ak[i];
        sc.eq[i] = sc.e[i] * sc.aq[i];
      }
      ek = sc.ek.data();
      eq = sc.eq.data();
    }
    for (int r = 0; r < rows; ++r) {
      const float* s0 = S + static_cast<int64_t>(r) * K;
      float sk = dot(s0, ek, K), sq = dot(s0, eq, K);
      for (int j = 0; j < records; ++j) {
        const float dj = sc.dj[static_cast<int64_t>(j) * rows + r];
        sk += dj * sc.ck[j];
        sq += dj * sc.cq[j];
      }
      sc.d[r] = delta_u(sc.v[r], sk, beta);
      sc.o[r] = delta_output(sq, sc.d[r], kq);
    }
    store_row(p.out.ptr, p.out.dtype, head_offset(p.out, n, 0, hv) + r0, rows, sc.o.data());
    // Append the record (d, k, g) at position at(m): this block's columns of d; g and k once per
    // head. Prefix gates store the cumulative gate (restarting after a history checkpoint);
    // pre-decayed keys store k / exp(that cumulative gate), as SGLang forms it (a product of the
    // exps).
    const int64_t pos = at(m);
    store_row(p.d_cache, p.d_dtype, d_base + pos * V + r0, rows, sc.d.data());
    if (first_block) {
      float* gout = p.g_cache + g_base + pos * g_width;
      for (int i = 0; i < g_width; ++i) gout[i] = prefix && !history ? gtot[i] + sc.g[i] : sc.g[i];
      if (hv % group == 0) {  // one writer per key head
        if (predecay)
          for (int i = 0; i < K; ++i) sc.k[i] = sc.k[i] / new_decay[i];
        store_row(p.k_cache, p.k_dtype, k_base + pos * K, K, sc.k.data());
      }
    }
  });

  advance_step(p.state);
  if (p.advance_write_pos) {  // the caller's rule (replay_advance), cache_base too when circular
    for (int64_t n = 0; n < p.B; ++n) {
      if (p.indices[n * p.index_stride] < 0) continue;
      const bool forced = p.force_flush && p.force_flush[n] != 0;
      int wp = 0, base = p.modes.circular ? p.modes.cache_base[n] : 0;
      replay_advance(p.write_pos[n], p.L, forced, p.modes.circular, wp, base);
      p.write_pos[n] = wp;
      if (p.modes.circular) p.modes.cache_base[n] = base;
    }
  }
}

void run_replay_materialize(const ReplayProblem& p, int64_t src, int64_t dst, int m, int base) {
  const int K = p.K, V = p.V, HV = p.HV, L = p.L;
  const int64_t head_elems = static_cast<int64_t>(V) * K;
  const int blocks = row_blocks(HV, V);
  const int block_rows = (V + blocks - 1) / blocks;
  const simd::Kernels& vk = simd::kernels();
  const bool in_place = p.state.dtype == DType::f32;
  // A checkpoint in its storage format: dst's copy loaded dequantized and the rebuilt rows stored
  // with fresh row scales, rounded with src's key at the counter's step (not advanced), which is
  // what a history checkpoint of src at this step stores (the decode's store_state_rows with
  // key_of(src)): the fork equals src's flush copied to dst.
  const bool formatted = p.state.formatted();
  const StoreRounding rnd = store_rounding(p.state);
  parallel_for(static_cast<int64_t>(HV) * blocks, [&](int64_t task) {
    thread_local Scratch sc;
    const int hv = static_cast<int>(task / blocks);
    const int r0 = static_cast<int>(task % blocks) * block_rows;
    const int rows = std::min(block_rows, V - r0);
    if (rows <= 0) return;
    sc.resize(K, rows, L);
    const int64_t off = dst * p.state.slot_stride + hv * head_elems + int64_t{r0} * K;
    float* S = in_place ? static_cast<float*>(p.state.ptr) + off : sc.S.data();
    if (formatted) load_state_rows(p.state, dst, hv, V, K, r0, rows, S);
    else if (!in_place) load_row(p.state.ptr, p.state.dtype, off, rows * K, S);
    prepare_ring(p, sc, src, hv, m, base, r0, rows);
    rebuild_rows(S, rows, K, m, sc, vk);
    if (formatted) store_state_rows(p.state, rnd, rnd.key_of(src), dst, hv, V, K, r0, rows, S);
    else if (!in_place) store_row(p.state.ptr, p.state.dtype, off, rows * K, S);
  });
}

}  // namespace deltastate::cpu
