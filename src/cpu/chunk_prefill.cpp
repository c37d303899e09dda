// CPU kernel of chunked prefill (GDN and KDA): the chunk-level oracle of the CUDA kernel and a
// usable CPU prefill. One task per (sequence, value head); each task walks its sequence 64
// tokens at a time, carrying the state in fp32, and stores states (final, checkpoints) rounded
// to their destination's dtype.
//
// The chunked form of the delta rule. Per value head the state S is [V, K] (row v, column c).
// Token t applies (ops.h; q_t scaled, q_t and k_t normalized):
//   S_t = S_{t-1} diag(alpha_t) + u_t k_t^T,  u_t = beta_t (v_t - S_{t-1} diag(alpha_t) k_t),
//   o_t = S_t q_t,
// with alpha_t = e^{g_t} (a K-vector for KDA, one scalar for GDN). A chunk covers tokens
// 0..C-1 (C <= 64) and starts from S_0, the state before its first token. With the chunk-local
// cumulative log decay G_t = g_0 + ... + g_t (fp32), induction on t gives
//   S_t = S_0 diag(e^{G_t}) + sum_{s<=t} u_s (k_s * e^{G_t - G_s})^T                        (1)
// (* elementwise). Putting (1) at t-1, times diag(alpha_t), into u_t:
//   u_t = beta_t v_t - beta_t S_0 (k_t * e^{G_t}) - sum_{s<t} A_ts u_s,
//   A_ts = beta_t sum_c k_t[c] k_s[c] e^{G_t[c] - G_s[c]}   (s < t: A is strictly lower),
// a unit lower-triangular system (I + A) U = diag(beta) V - diag(beta) (K * e^G) S_0^T for the
// rows u_t of U (the values the state actually absorbs). With T = (I + A)^{-1}, found by forward
// substitution,
//   w = T (beta * K * e^G)  [C, K],   u = T (beta * V)  [C, V],   v' = U = u - w S_0^T.
// (1) applied to q_t gives the outputs, and (1) at the last token L = C-1 the next state:
//   o_t = S_0 (q_t * e^{G_t}) + sum_{s<=t} P_ts v'_s,  P_ts = sum_c q_t[c] k_s[c] e^{G_t[c]-G_s[c]}
//   S  <- S_0 diag(e^{G_L}) + v'^T (K * e^{G_L - G}).
// Every exponent is a later cumulative decay minus an earlier one (G_t - G_s with s <= t, G_t,
// G_L - G_s), so for decays g <= 0 every factor is at most 1 and nothing is formed that could
// overflow; a factor that underflows to 0 belongs to a product below fp32's range anyway. This
// matters for KDA: a chunk decays a channel by up to 64 * lower_bound (-320 at -5; e^88
// overflows fp32), so its pairwise factors are e^{G_t - G_s} per (t, s, channel), never
// (q_t * e^{G_t}) . (k_s * e^{-G_s}); FLA's KDA kernels keep the same rule with sub-chunk
// references. GDN's decay is one scalar per token, so its pairwise factor scales a plain dot.
// Checkpoints fall on chunk ends (checkpoint_every_n_tokens is a multiple of 64).
//
// The task holds S transposed, S^T [K, V], so that every product with S (w S^T, the outputs'
// S (q * e^G), the state update) is a blocked product C += A B along contiguous rows of length V
// (simd.h's gemm_acc: one fused multiply-add chain per element, in increasing inner index), and
// K K^T, Q K^T are blocked dot products (simd.h's dots); it is transposed on load and store.
// Every element's arithmetic is thus fixed by the problem alone, whatever the thread count.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

#include "core/delta_math.h"
#include "cpu/kernels.h"
#include "cpu/row_io.h"
#include "cpu/simd.h"
#include "cpu/state_io.h"
#include "cpu/thread_pool.h"

namespace deltastate::cpu {

using namespace deltastate::detail;

namespace {

constexpr int kC = ChunkPrefillProblem::kChunk;
constexpr int64_t kBlockAlign = 64;  // bytes; each thread's scratch block starts on a cache line

// One thread's scratch, carved from its block of the caller's workspace. Rows are tokens of
// the chunk (kC rows; a partial chunk uses the first C).
struct Scratch {
  float* St;    // [K, V] the state transposed, fp32 for the whole sequence
  float* q;     // [kC, K] normalized, scaled
  float* k;     // [kC, K] normalized
  float* v;     // [kC, V]
  float* G;     // [kC, Kg] cumulative log decay within the chunk (Kg = K for KDA, 1 for GDN)
  float* beta;  // [kC]
  float* A;     // [kC, kC] strictly lower: beta_t (k_t . k_s) decayed
  float* P;     // [kC, kC] lower with diagonal: (q_t . k_s) decayed
  float* Tm;    // [kC, kC] (I + A)^{-1}
  float* kb;    // [kC, K] beta_s k_s e^{G_s}
  float* w;     // [kC, K]
  float* u;     // [kC, V]
  float* vn;    // [kC, V] v' = u - w S^T
  float* o;     // [kC, V]
  float* qe;    // [kC, K] q_t e^{G_t}
  float* ke;    // [kC, K] k_s e^{G_L - G_s}
  float* grow;  // [K] one token's gate row
  float* row;   // [K] one state row S[v, :] on its way to or from memory
};

int64_t scratch_floats(int K, int V, bool kda) {
  const int64_t Kg = kda ? K : 1;
  return static_cast<int64_t>(V) * K + kC * (6LL * K + 4LL * V + Kg + 1 + 3LL * kC) + 2LL * K;
}

int64_t block_bytes(int K, int V, bool kda) {
  const int64_t bytes = scratch_floats(K, V, kda) * static_cast<int64_t>(sizeof(float));
  return (bytes + kBlockAlign - 1) / kBlockAlign * kBlockAlign;
}

Scratch carve(void* block, int K, int V, bool kda) {
  float* f = static_cast<float*>(block);
  auto take = [&f](int64_t n) {
    float* r = f;
    f += n;
    return r;
  };
  const int64_t Kg = kda ? K : 1;
  Scratch s;
  s.St = take(static_cast<int64_t>(V) * K);
  s.q = take(kC * K);
  s.k = take(kC * K);
  s.v = take(kC * V);
  s.G = take(kC * Kg);
  s.beta = take(kC);
  s.A = take(kC * kC);
  s.P = take(kC * kC);
  s.Tm = take(kC * kC);
  s.kb = take(kC * K);
  s.w = take(kC * K);
  s.u = take(kC * V);
  s.vn = take(kC * V);
  s.o = take(kC * V);
  s.qe = take(kC * K);
  s.ke = take(kC * K);
  s.grow = take(K);
  s.row = take(K);
  return s;
}

// Where one task's sequence lives and what it reads and writes.
struct Task {
  int64_t n, seq, tok0, len;
  int hv, h;
  bool padded, reads_state;
  int64_t slot;       // the initial state's pool slot (or dense row)
  int64_t state_off;  // element offset of the initial state head, when read
};

Task make_task(const ChunkPrefillProblem& p, int64_t index) {
  Task t;
  t.n = index / p.HV;
  t.hv = static_cast<int>(index % p.HV);
  t.h = t.hv / (p.HV / p.H);
  t.seq = p.cu_seqlens ? 0 : t.n;
  t.tok0 = p.cu_seqlens ? load_index(p.cu_seqlens, p.cu_dtype, t.n) : 0;
  t.len = p.cu_seqlens ? load_index(p.cu_seqlens, p.cu_dtype, t.n + 1) - t.tok0 : p.T;
  const int64_t slot = p.pooled() ? load_index(p.initial_indices, p.initial_index_dtype, t.n) : t.n;
  t.padded = p.pooled() && slot < 0;
  const bool has = !p.has_initial || load_index(p.has_initial, p.has_initial_dtype, t.n) != 0;
  t.reads_state = p.state.ptr && !t.padded && has;
  t.slot = slot;
  t.state_off = slot * p.state.slot_stride + static_cast<int64_t>(t.hv) * p.V * p.K;
  return t;
}

// ---- the steps of one chunk -------------------------------------------------------------------

// Tokens c0..c0+C-1 of the task: q, k normalized (q scaled), v, beta, and the cumulative log
// decay G from the chunk's start.
void load_chunk(const ChunkPrefillProblem& p, const Task& t, int64_t c0, int C, const Scratch& s) {
  const int K = p.K, V = p.V, Kg = p.gate.kda ? p.K : 1;
  for (int i = 0; i < C; ++i) {
    const int64_t tok = t.tok0 + c0 + i;
    float* q = s.q + i * K;
    float* k = s.k + i * K;
    load_row(p.q.ptr, p.q.dtype, head_offset(p.q, t.seq, tok, t.h), K, q);
    load_row(p.k.ptr, p.k.dtype, head_offset(p.k, t.seq, tok, t.h), K, k);
    prepare_qk(q, K, p.l2norm, p.scale);
    prepare_qk(k, K, p.l2norm, 1.0f);
    load_row(p.v.ptr, p.v.dtype, head_offset(p.v, t.seq, tok, t.hv), V, s.v + i * V);
    s.beta[i] =
        beta_value(load_float(p.beta.ptr, p.beta.dtype, head_offset(p.beta, t.seq, tok, t.hv)),
                   p.beta_is_logit, false, p.beta.dtype);
    gate_row(p.gate, p.g.ptr, p.g.dtype, head_offset(p.g, t.seq, tok, t.hv), t.hv, K, s.grow);
    for (int c = 0; c < Kg; ++c) s.G[i * Kg + c] = (i ? s.G[(i - 1) * Kg + c] : 0.0f) + s.grow[c];
  }
}

// Token `i` of the task's sequence: its q, k and v rows into L2 ahead of use (chunk_output asks
// for the next chunk's rows one token at a time, spread over its work; always_inline, as
// prefetch_row).
[[gnu::always_inline]] inline void prefetch_token(const ChunkPrefillProblem& p, const Task& t,
                                                  int64_t i) {
  if (i >= t.len) return;
  const int64_t tok = t.tok0 + i;
  prefetch_row(p.q.ptr, p.q.dtype, head_offset(p.q, t.seq, tok, t.h), p.K);
  prefetch_row(p.k.ptr, p.k.dtype, head_offset(p.k, t.seq, tok, t.h), p.K);
  prefetch_row(p.v.ptr, p.v.dtype, head_offset(p.v, t.seq, tok, t.hv), p.V);
}

// out[c] = a x[c] e^{G1[c] - G0[c]} over K channels (G0 null: 0). GDN's decay is one value per
// token (its G rows are one wide), so its factor is one expf; KDA's are simd.h's vector exp.
void decayed(const float* x, float a, const float* G1, const float* G0, bool kda, int K,
             float* out) {
  if (!kda) {
    const float f = a * expf(G1[0] - (G0 ? G0[0] : 0.0f));
    for (int c = 0; c < K; ++c) out[c] = f * x[c];
    return;
  }
  simd::kernels().decayed_row(x, a, G1, G0, K, out);
}

// KDA's rows per reference block in chunk_matrices (see there).
constexpr int kRefRows = 8;

// A (strictly lower) and P (lower with diagonal): the decayed k_t.k_s and q_t.k_s of every pair
// s <= t, zero above. GDN: blocked dot products K K^T and Q K^T, each scaled by its pair's one
// factor e^{G_t - G_s}. KDA splits the rows into blocks of kRefRows with first row r: a pair s < r
// factors through r, e^{G_t - G_s} = e^{G_t - G_r} e^{G_r - G_s}, both at most 1 for decays
// g <= 0 (as the file's header requires), so the block's products are plain blocked dots of
// (k_t, q_t) * e^{G_t - G_r} against k_s * e^{G_r - G_s}; the pairs within a block (r <= s <= t)
// keep the pairwise factor (through r it would be above 1). A 64-token chunk then takes 624
// K-vectors of exps (k_s factors 224, block rows 112, in-block pairs 288) instead of 2080.
void chunk_matrices(const ChunkPrefillProblem& p, int C, const Scratch& s) {
  const simd::Kernels& vk = simd::kernels();
  const int K = p.K;
  if (!p.gate.kda) {
    vk.dots(s.k, K, s.k, K, C, C, K, s.A, kC, /*lower=*/true);
    vk.dots(s.q, K, s.k, K, C, C, K, s.P, kC, /*lower=*/true);
  } else {
    // Free until wy_terms / chunk_output / advance_state: ke holds the factored k_s, qe the
    // block's factored k_t (rows 0..7) and q_t (rows 8..15).
    float* F = s.ke;
    float* Rk = s.qe;
    float* Rq = s.qe + kRefRows * K;
    for (int r = 0; r < C; r += kRefRows) {
      if (r == 0) continue;  // the first block's pairs are all in-block
      const int nb = std::min(kRefRows, C - r);
      const float* Gr = s.G + r * K;
      for (int j = 0; j < nb; ++j) {
        vk.decayed_row(s.k + (r + j) * K, 1.0f, s.G + (r + j) * K, Gr, K, Rk + j * K);
        vk.decayed_row(s.q + (r + j) * K, 1.0f, s.G + (r + j) * K, Gr, K, Rq + j * K);
      }
      for (int j = 0; j < r; ++j) vk.decayed_row(s.k + j * K, 1.0f, Gr, s.G + j * K, K, F + j * K);
      vk.dots(Rk, K, F, K, nb, r, K, s.A + r * kC, kC, /*lower=*/false);
      vk.dots(Rq, K, F, K, nb, r, K, s.P + r * kC, kC, /*lower=*/false);
    }
  }
  for (int t = 0; t < C; ++t) {
    float* At = s.A + t * kC;
    float* Pt = s.P + t * kC;
    const int r = t / kRefRows * kRefRows;  // KDA: pairs before r are done above
    for (int j = 0; j <= t; ++j) {
      float kk, qk;
      if (!p.gate.kda) {
        const float e = expf(s.G[t] - s.G[j]);
        kk = e * At[j];
        qk = e * Pt[j];
      } else if (j < r) {
        kk = At[j];
        qk = Pt[j];
      } else {
        vk.decayed_dots(s.k + t * K, s.q + t * K, s.k + j * K, s.G + t * K, s.G + j * K, K, &kk,
                        &qk);
      }
      At[j] = j < t ? s.beta[t] * kk : 0.0f;
      Pt[j] = qk;
    }
    std::fill(At + t + 1, At + kC, 0.0f);
    std::fill(Pt + t + 1, Pt + kC, 0.0f);
  }
}

// T = (I + A)^{-1} for strictly lower A, by forward substitution on (I + A) T = I: row t is
// e_t - sum_{j<t} A_tj T_j (unit lower triangular, zero above the diagonal), one blocked
// vector-matrix product per row with A's row negated in place (nothing reads A afterwards).
void invert_unit_lower(int C, const Scratch& s) {
  const simd::Kernels& vk = simd::kernels();
  std::fill(s.Tm, s.Tm + kC * kC, 0.0f);
  for (int t = 0; t < C; ++t) {
    float* Tt = s.Tm + t * kC;
    float* At = s.A + t * kC;
    for (int j = 0; j < t; ++j) At[j] = -At[j];
    // Whole vectors of columns: those from t on stay +0 (rows j < t of T are zero past j).
    const int cols = std::min(kC, (t + 15) / 16 * 16);
    vk.gemm_acc(Tt, kC, At, 0, 1, s.Tm, kC, 1, cols, t, /*lower=*/false);
    Tt[t] = 1.0f;
  }
}

// w = T (beta * K * e^G) and u = T (beta * V): the WY form of the chunk's updates, as blocked
// products with the lower triangular T (u's coefficients T_tj beta_j replace A, no longer used).
void wy_terms(const ChunkPrefillProblem& p, int C, const Scratch& s) {
  const simd::Kernels& vk = simd::kernels();
  const int K = p.K, V = p.V;
  const int Kg = p.gate.kda ? K : 1;
  for (int j = 0; j < C; ++j)
    decayed(s.k + j * K, s.beta[j], s.G + j * Kg, nullptr, p.gate.kda, K, s.kb + j * K);
  for (int t = 0; t < C; ++t)
    for (int j = 0; j < C; ++j) s.A[t * kC + j] = s.Tm[t * kC + j] * s.beta[j];
  std::fill(s.w, s.w + C * K, 0.0f);
  std::fill(s.u, s.u + C * V, 0.0f);
  vk.gemm_acc(s.w, K, s.Tm, kC, 1, s.kb, K, C, K, C, /*lower=*/true);
  vk.gemm_acc(s.u, V, s.A, kC, 1, s.v, V, C, V, C, /*lower=*/true);
}

// v' = u - w S^T: the values the state absorbs, with the chunk's initial state accounted for
// (w is negated in place; nothing reads it afterwards).
void new_values(const ChunkPrefillProblem& p, int C, const Scratch& s) {
  const int K = p.K, V = p.V;
  std::copy_n(s.u, C * V, s.vn);
  for (int i = 0; i < C * K; ++i) s.w[i] = -s.w[i];
  simd::kernels().gemm_acc(s.vn, V, s.w, K, 1, s.St, V, C, V, K, /*lower=*/false);
}

// o_t = S (q_t * e^{G_t}) + sum_{j<=t} P_tj v'_j, stored row by row in the output dtype.
void chunk_output(const ChunkPrefillProblem& p, const Task& tk, int64_t c0, int C,
                  const Scratch& s) {
  const simd::Kernels& vk = simd::kernels();
  const int K = p.K, V = p.V, Kg = p.gate.kda ? K : 1;
  for (int t = 0; t < C; ++t)
    decayed(s.q + t * K, 1.0f, s.G + t * Kg, nullptr, p.gate.kda, K, s.qe + t * K);
  std::fill(s.o, s.o + C * V, 0.0f);
  vk.gemm_acc(s.o, V, s.qe, K, 1, s.St, V, C, V, K, /*lower=*/false);
  vk.gemm_acc(s.o, V, s.P, kC, 1, s.vn, V, C, V, C, /*lower=*/true);
  for (int t = 0; t < C; ++t) {
    store_row(p.out.ptr, p.out.dtype, head_offset(p.out, tk.seq, tk.tok0 + c0 + t, tk.hv), V,
              s.o + t * V);
    prefetch_token(p, tk, c0 + kC + t);
  }
}

// S <- S diag(e^{G_L}) + v'^T (K * e^{G_L - G}), L the chunk's last token; in S^T's rows:
// S^T[c] <- e^{G_L[c]} S^T[c] + sum_j k_j[c] e^{G_L[c] - G_j[c]} v'_j (a blocked product with
// the transposed ke).
void advance_state(const ChunkPrefillProblem& p, int C, const Scratch& s) {
  const int K = p.K, V = p.V;
  const bool kda = p.gate.kda;
  const int Kg = kda ? K : 1;
  const float* GL = s.G + (C - 1) * Kg;
  for (int j = 0; j < C; ++j) decayed(s.k + j * K, 1.0f, GL, s.G + j * Kg, kda, K, s.ke + j * K);
  const float gdn_total = expf(GL[0]);
  for (int c = 0; c < K; ++c) {
    float* row = s.St + static_cast<int64_t>(c) * V;
    const float total = kda ? expf(GL[c]) : gdn_total;
    for (int e = 0; e < V; ++e) row[e] *= total;
  }
  simd::kernels().gemm_acc(s.St, V, s.ke, 1, K, s.vn, V, K, V, C, /*lower=*/false);
}

// ---- one task ---------------------------------------------------------------------------------

// One head's state [V, K] at element offset `off` of `base` into S^T, and back.
void load_state(const void* base, DType dtype, int64_t off, const ChunkPrefillProblem& p,
                const Scratch& s) {
  for (int e = 0; e < p.V; ++e) {
    load_row(base, dtype, off + static_cast<int64_t>(e) * p.K, p.K, s.row);
    for (int c = 0; c < p.K; ++c) s.St[static_cast<int64_t>(c) * p.V + e] = s.row[c];
  }
}
void store_state(void* base, DType dtype, int64_t off, const ChunkPrefillProblem& p,
                 const Scratch& s) {
  for (int e = 0; e < p.V; ++e) {
    for (int c = 0; c < p.K; ++c) s.row[c] = s.St[static_cast<int64_t>(c) * p.V + e];
    store_row(base, dtype, off + static_cast<int64_t>(e) * p.K, p.K, s.row);
  }
}

int64_t head_elems(const ChunkPrefillProblem& p) { return static_cast<int64_t>(p.V) * p.K; }

// Dense [*, HV, V, K] destinations (final_state, state_checkpoints): row `row`, this head.
void store_dense(void* base, DType dtype, const ChunkPrefillProblem& p, int64_t row, int hv,
                 const Scratch& s) {
  store_state(base, dtype, (row * p.HV + hv) * head_elems(p), p, s);
}
void store_slot(const ChunkPrefillProblem& p, int64_t slot, int hv, const Scratch& s,
                const StoreRounding& rnd) {
  if (!p.state.formatted())
    return store_state(p.state.ptr, p.state.dtype, slot * p.state.slot_stride + hv * head_elems(p),
                       p, s);
  const uint64_t key = rnd.key_of(slot);
  for (int e = 0; e < p.V; ++e) {
    for (int c = 0; c < p.K; ++c) s.row[c] = s.St[static_cast<int64_t>(c) * p.V + e];
    store_state_rows(p.state, rnd, key, slot, hv, p.V, p.K, e, 1, s.row);
  }
}
void load_slot(const ChunkPrefillProblem& p, const Task& t, const Scratch& s) {
  if (!p.state.formatted()) return load_state(p.state.ptr, p.state.dtype, t.state_off, p, s);
  for (int e = 0; e < p.V; ++e) {
    load_state_rows(p.state, t.slot, t.hv, p.V, p.K, e, 1, s.row);
    for (int c = 0; c < p.K; ++c) s.St[static_cast<int64_t>(c) * p.V + e] = s.row[c];
  }
}

// Checkpoint j of the task's sequence: the state after (j+1) * checkpoint_every tokens.
void store_checkpoint(const ChunkPrefillProblem& p, const Task& t, int64_t j, const Scratch& s,
                      const StoreRounding& rnd) {
  const int64_t pos = load_index(p.checkpoint_cu_starts, p.checkpoint_cu_dtype, t.n) + j;
  if (p.checkpoints) {
    store_dense(p.checkpoints, p.checkpoint_dtype, p, pos, t.hv, s);
  } else {
    const int64_t slot = load_index(p.checkpoint_slots, p.checkpoint_slot_dtype, pos);
    if (slot >= 0) store_slot(p, slot, t.hv, s, rnd);
  }
}

// A padded sequence: output rows zero, dense outputs (final state, checkpoint rows) zero, the
// pool untouched.
void run_padded(const ChunkPrefillProblem& p, const Task& t, const Scratch& s,
                const StoreRounding& rnd) {
  std::fill(s.o, s.o + p.V, 0.0f);
  for (int64_t i = 0; i < t.len; ++i)
    store_row(p.out.ptr, p.out.dtype, head_offset(p.out, t.seq, t.tok0 + i, t.hv), p.V, s.o);
  std::fill(s.St, s.St + head_elems(p), 0.0f);
  if (p.final_state) store_dense(p.final_state, p.final_dtype, p, t.n, t.hv, s);
  if (p.checkpoints) {
    const int64_t n_ckpt = t.len / p.checkpoint_every;
    for (int64_t j = 0; j < n_ckpt; ++j) store_checkpoint(p, t, j, s, rnd);
  }
}

void run_task(const ChunkPrefillProblem& p, int64_t index, const Scratch& s,
              const StoreRounding& rnd) {
  const Task t = make_task(p, index);
  if (t.padded) return run_padded(p, t, s, rnd);

  if (t.reads_state) load_slot(p, t, s);
  else std::fill(s.St, s.St + head_elems(p), 0.0f);

  for (int64_t c0 = 0; c0 < t.len; c0 += kC) {
    const int C = static_cast<int>(std::min<int64_t>(kC, t.len - c0));
    load_chunk(p, t, c0, C, s);
    chunk_matrices(p, C, s);
    invert_unit_lower(C, s);
    wy_terms(p, C, s);
    new_values(p, C, s);
    chunk_output(p, t, c0, C, s);
    advance_state(p, C, s);
    const int64_t end = c0 + C;
    if (p.checkpoint_every > 0 && end % p.checkpoint_every == 0)
      store_checkpoint(p, t, end / p.checkpoint_every - 1, s, rnd);
  }

  if (p.pooled()) {
    const int64_t in_slot = load_index(p.initial_indices, p.initial_index_dtype, t.n);
    const int64_t out_slot =
        p.output_indices ? load_index(p.output_indices, p.output_index_dtype, t.n) : in_slot;
    if (out_slot >= 0) store_slot(p, out_slot, t.hv, s, rnd);
  }
  if (p.final_state) store_dense(p.final_state, p.final_dtype, p, t.n, t.hv, s);
}

}  // namespace

int64_t chunk_prefill_workspace_bytes(int K, int V, bool kda) {
  return num_threads() * block_bytes(K, V, kda);
}

// Denormal arithmetic costs x86 cores a microcode assist (~100 cycles) per operation. The
// chunked form makes such values routinely (e^{G_t} deep into a strongly decaying chunk and its
// products; the recurrence, which decays one token at a time, does not), and they made the
// kernel 3x (GDN) to 9x (KDA) slower at the Qwen3-Next / Kimi shapes. Workers flush them to zero
// (MXCSR FTZ and DAZ) while they run a task, which changes results only below FLT_MIN
// (1.2e-38), far under the resolution of the values they are added to.
class FlushDenormals {
 public:
#if defined(__SSE__)
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8040u); }
  ~FlushDenormals() { _mm_setcsr(saved_); }

 private:
  unsigned saved_;
#endif
};

// Each of up to num_threads() workers owns one scratch block and pulls tasks from a shared
// counter, so the workspace needs one block per thread whatever the number of tasks.
void run_chunk_prefill(const ChunkPrefillProblem& p) {
  const int64_t tasks = p.num_heads_total();
  const int64_t workers = std::min<int64_t>(num_threads(), tasks);
  const int64_t block = block_bytes(p.K, p.V, p.gate.kda);
  std::atomic<int64_t> next{0};
  const StoreRounding rnd = store_rounding(p.state);  // the step, read once per call
  parallel_for(workers, [&](int64_t w) {
    const FlushDenormals ftz;
    const Scratch s = carve(static_cast<char*>(p.workspace) + w * block, p.K, p.V, p.gate.kda);
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < tasks;
         i = next.fetch_add(1, std::memory_order_relaxed))
      run_task(p, i, s, rnd);
  });
  advance_step(p.state);
}

}  // namespace deltastate::cpu
