// ReplaySSM speculative verify and its cursor commit on the GPU (ops.h ReplayVerifyArgs,
// ReplayCommitArgs). Part of replayssm_verify.cu's translation unit (included there only).
//
// Verify. A CTA owns one or two blocks of state rows of one (sequence n, value head hv): kRvWarps
// warps, each holding its rows of a block in registers in the register kernels' lane layout
// (rows.cuh RowLayout: a row over G lanes, EPL consecutive elements each, R rows per thread). The
// per-head work is done once per CTA, by all its threads, into shared memory, and every warp's
// rows then run from there:
//  0. The vector kernel first copies each thread's checkpoint rows of every block into shared
//     memory (cp.async, one copy group per block), so they are in flight without holding
//     registers during phases 1 and 2; the generic kernel loads its one block into registers.
//  1. The committed records, rv_rec_chunk at a time (ring positions (base + c) % L): k and
//     alpha = e^g over the K tile (GDN's scalar alpha broadcast over it), and d of the CTA's rows,
//     converted to fp32.
//  2. The first kRvTokChunk draft tokens, one warp per token, in the same phase: q and k
//     normalized (q scaled), k.q, the gate (log decay and alpha) and beta, with the CTA's rows of
//     v; the token's g and k records are written to the ring from here (the head's first row
//     block writes g, and of it the key head's first value head k).
//  3. (The replay kernel.) After one barrier, each warp replays the records onto its rows with
//     the recurrent step's two operations per element (s = fma(d, k, s * alpha), the CPU twin's
//     order), stores them into the checkpoint on a fold, then runs the drafts through the
//     delta-rule step (delta_step_rows: decay, dots, one transposed reduction, u, rank-1 update),
//     writing each output row and the draft's d record (the lanes holding sk). A second block then
//     takes its rows from its copies and repeats phase 3 on the same shared memory (or, when the
//     records or drafts took more than one round, stages its rounds again).
//  3f. The factored kernel (FACTOR, the default; docs/REPLAYSSM.md) never updates the rows for a
//     draft. After the first barrier each warp walks from record j = warp - 1 (-1: the rows)
//     forward over the records and drafts, summing their log decays; at draft t it has the
//     exponent of A_jt (a sum of g) and stores E_t = A_{-1,t} (over the drafts' alpha, unused
//     here) or the pair's coefficients ck[j][t] = (A_jt*k_j).k_t, cq[j][t] = (A_jt*k_j).q_t.
//     After a second barrier each draft's row dots S.(E_t*k_t), S.(E_t*q_t), plus the factored
//     committed records' d_j*ck, d_j*cq, finish in one transposed reduction per draft; the lanes
//     holding sk then add the earlier drafts' terms in order and form u_t, the lanes holding sq
//     take u_t by shuffle for o_t. The rows are the checkpoint on an appending step whose records
//     fit one staging round (those records factored); on a fold or with more records they are
//     replayed first, exactly as in 3. More drafts than one preparation round take 3's loop.
// The replay is element-wise, so the rebuilt and folded rows do not depend on the lane layout.
// With the hi/lo residual ring (rawv, rawk without beta_ring; the generic kernel only) each
// record written also writes its residual, value minus value rounded to the d/k ring's dtype, into
// rawv / rawk at the same place, by the lanes that store the record (out of line,
// rv_store_residual; the factored drafts' d residuals after their loop).
// A checkpoint in its storage format runs on the generic float replay kernel, its rows loaded
// dequantized; its folds are the fold launch's (fold.cuh replay_exact_fold_kernel, before this
// kernel: history_folded).
// A bad slot or cursor is recorded (record_bad_row) and its rows get NaN outputs. The cursors are
// read only; the commit kernel moves them, one thread per batch row.
#pragma once

#include <cstdint>

#include "core/delta_math.h"
#include "core/numeric.h"
#include "core/problem.h"
#include "cuda/grid.cuh"
#include "cuda/loads.cuh"
#include "cuda/reduce.cuh"
#include "cuda/replayssm/factor.cuh"
#include "cuda/rows.cuh"
#include "cuda/state_fmt.cuh"
#include "cuda/token.cuh"
#include "cuda/tuning.h"

namespace deltastate::cuda_backend {

constexpr int kRvWarps = kReplayVerifyWarps;
constexpr int kRvCommitThreads = 256;
// Records staged per round: every record of an L <= 16 ring in one round for K <= 128; the
// generic kernel (K tile 256) stages half as many, to stay within 48 KB of static shared memory.
template <int KT>
constexpr int rv_rec_chunk() {
  return KT <= 128 ? 16 : 8;
}
constexpr int kRvTokChunk = 8;  // draft tokens prepared per round
// Combined records of the factored kernel: the committed ones of one staging round, then the
// drafts of one preparation round.
template <int KT>
constexpr int rv_factor_records() {
  return rv_rec_chunk<KT>() + kRvTokChunk;
}

namespace {

template <class StateT, int KT>
struct RvLayout {
  using Lay = RowLayout<StateT, KT>;
  static constexpr int G = Lay::G, EPL = Lay::EPL, RG = Lay::RG, R = Lay::ROWS;
  static constexpr int RPW = RG * R;           // rows per warp
  static constexpr int ROWS = RPW * kRvWarps;  // rows per CTA
  static constexpr int PE = KT / 32;           // K elements per lane in the token preparation
  static constexpr int RC = rv_rec_chunk<KT>();
};

template <int KT, int ROWS, int RC>
struct alignas(16) RvSmem {      // 16-byte rows: a lane's slice of a K row in vector loads
  float rk[RC][KT], ra[RC][KT];  // record k, alpha = e^g (zero k, unit alpha past K)
  float rd[RC][ROWS];            // record d of the CTA's rows
  float tq[kRvTokChunk][KT], tk[kRvTokChunk][KT], ta[kRvTokChunk][KT];  // token q, k, alpha
  float tv[kRvTokChunk][ROWS];
  float tbeta[kRvTokChunk], tkq[kRvTokChunk];
};

// The factored kernel's own shared memory (dynamic, after the checkpoint copies): the drafts' log
// decays and the coefficients of every (record j, draft t) pair, ck[j][t] = (A_jt*k_j).k_t and
// cq[j][t] = (A_jt*k_j).q_t (A_jt the decay from after record j through draft t's own).
template <int KT>
struct alignas(16) RvFactorSmem {
  float tg[kRvTokChunk][KT];  // draft g (zero past K)
  float ck[rv_factor_records<KT>()][kRvTokChunk], cq[rv_factor_records<KT>()][kRvTokChunk];
};

// The lane's EPL floats of a shared K row (16-byte loads where EPL allows).
template <int EPL>
__device__ __forceinline__ void smem_slice(const float* row, int kofs, float (&x)[EPL]) {
  if constexpr (EPL % 4 == 0) {
#pragma unroll
    for (int i = 0; i < EPL; i += 4) {
      const float4 a = *reinterpret_cast<const float4*>(row + kofs + i);
      x[i] = a.x, x[i + 1] = a.y, x[i + 2] = a.z, x[i + 3] = a.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < EPL; ++i) x[i] = row[kofs + i];
  }
}

// The hi/lo residual ring (rawv, rawk without beta_ring): the generic kernel only (the dispatch
// routes it there), so the vector kernels' register budgets stay untouched.
template <bool VEC>
__device__ __forceinline__ bool rv_residual(const detail::ReplayVerifyProblem& p) {
  return !VEC && p.rawv && !p.beta_ring;
}
// A record's residual x - round(x to hi_dtype), stored to `ring` (out of line: off the draft
// loops' register budget).
__device__ __noinline__ void rv_store_residual(void* ring, DType dtype, DType hi_dtype, int64_t at,
                                               float x) {
  detail::store_float(ring, dtype, at, x - detail::round_to(hi_dtype, x));
}

// The drafts' outputs of the CTA's rows for a padded (0) or bad (NaN) sequence.
template <int ROWS>
__device__ __forceinline__ void rv_fill_outputs(const detail::RecurrentProblem& r, int64_t seq,
                                                int64_t tok0, int64_t len, int hv, int row_base,
                                                float value) {
  for (int64_t i = threadIdx.x; i < len * ROWS; i += blockDim.x) {
    const int64_t t = i / ROWS;
    const int row = row_base + static_cast<int>(i - t * ROWS);
    if (row < r.V)
      detail::store_float(r.out.ptr, r.out.dtype,
                          detail::head_offset(r.out, seq, tok0 + t, hv) + row, value);
  }
}

// The slot's and ring row's checks and the ring's cursor (write_pos m, cache_base base): kind 0,
// or the error's kind with the bad value and its limit, for the caller to record.
struct RvCursor {
  int m = 0, base = 0, kind = 0;
  int64_t bad = 0, limit = 0;
};
__device__ __forceinline__ RvCursor rv_cursor(const detail::ReplayVerifyProblem& p, int64_t slot,
                                              int64_t rr) {
  RvCursor c;
  const int L = p.L;
  if (slot >= p.r.state.num_slots) {
    c.kind = detail::kErrSlot, c.bad = slot, c.limit = p.r.state.num_slots;
  } else if (rr < 0 || rr >= p.ring_rows) {
    c.kind = detail::kErrSlot, c.bad = rr, c.limit = p.ring_rows;
  } else {
    c.m = p.write_pos[rr];
    c.base = p.cache_base[rr];
    if (c.m < 0 || c.m > L || c.base < 0 || c.base >= L)
      c.kind = detail::kErrRing, c.bad = c.m < 0 || c.m > L ? c.m : c.base, c.limit = L;
  }
  return c;
}

// Draft token j of the round (token tok) by one warp into shared memory: the lane's PE elements
// from lane * PE; its g and k records written to ring position pos by the head's writers.
template <int KT, int ROWS, int RC>
__device__ __forceinline__ void rv_prepare_token(const detail::ReplayVerifyProblem& p, int64_t seq,
                                                 int64_t tok, int h, int hv, int lane, int j,
                                                 int64_t g_rec, int64_t k_rec, bool g_writer,
                                                 bool k_writer, bool k_res,
                                                 RvSmem<KT, ROWS, RC>& sm, float* tg) {
  constexpr int PE = KT / 32;
  const detail::RecurrentProblem& r = p.r;
  const int e0 = lane * PE, valid = max(0, min(PE, r.K - e0));
  GateConsts<PE> gc;  // loaded here, not held across the record replay
  load_gate_consts(r.gate, hv, r.K, e0, valid, gc);
  TokenHeadInputs<PE> x;
  load_token_head<AnyInput>(r, r.g, r.beta, seq, tok, h, hv, e0, valid, x);
  const float kq = prepare_qk<PE, 32>(x.q, x.k, r.l2norm, r.scale, lane);
  float g[PE], alpha[PE];
  token_gate(r.gate, gc, x.g, g, alpha);
#pragma unroll
  for (int i = 0; i < PE; ++i) {
    const bool in = i < valid;
    sm.tq[j][e0 + i] = in ? x.q[i] : 0.0f;
    sm.tk[j][e0 + i] = in ? x.k[i] : 0.0f;
    sm.ta[j][e0 + i] = in ? alpha[i] : 1.0f;
    if (tg) tg[e0 + i] = in ? g[i] : 0.0f;
    if (in && g_writer && r.gate.kda) p.g_cache[g_rec + e0 + i] = g[i];
    if (in && k_writer) {
      detail::store_float(p.k_cache, p.k_dtype, k_rec + e0 + i, x.k[i]);
      if (k_res) rv_store_residual(p.rawk, p.rawk_dtype, p.k_dtype, k_rec + e0 + i, x.k[i]);
    }
  }
  if (lane == 0) {
    if (g_writer && !r.gate.kda) p.g_cache[g_rec] = g[0];
    sm.tkq[j] = kq;
    sm.tbeta[j] = detail::beta_value(x.b, r.beta_is_logit, r.round_beta, r.beta.dtype);
  }
}

// The factored kernels' per-head pass (phase 3f): the pair coefficients of the mf factored
// records and tn drafts, and the drafts' checkpoint decays E_t into sm.ta.
template <int KT, int CROWS, int RC>
__device__ __forceinline__ void rv_factor_pass(int mf, int tn, RvSmem<KT, CROWS, RC>& sm,
                                               RvFactorSmem<KT>& fac) {
  constexpr int CPL = KT / 32;  // columns per lane
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int col0 = lane * CPL, nrec = mf + tn;
  // Warp w walks from record j = w - 1 (j = -1: the checkpoint) forward, summing the log
  // decays of the records after j; at draft t's own it has the exponent of A_jt, a sum of g
  // (never a difference of prefix sums: no cancellation, and <= 0 for decaying gates).
  for (int j = warp - 1; j < nrec - 1; j += kRvWarps) {
    float kj[CPL], s[CPL];
    const float* krow = j < 0 ? nullptr : j < mf ? sm.rk[j] : sm.tk[j - mf];
#pragma unroll
    for (int c = 0; c < CPL; ++c) {
      kj[c] = j < 0 ? 0.0f : krow[col0 + c];
      s[c] = 0.0f;
    }
    for (int rr = j + 1; rr < nrec; ++rr) {
      const float* grow = rr < mf ? sm.ra[rr] : fac.tg[rr - mf];
#pragma unroll
      for (int c = 0; c < CPL; ++c) s[c] += grow[col0 + c];
      if (rr < mf) continue;
      const int t = rr - mf;
      if (j < 0) {  // E_t, the checkpoint's decay up to draft t's (alpha over its place)
#pragma unroll
        for (int c = 0; c < CPL; ++c) sm.ta[t][col0 + c] = expf(s[c]);
      } else {
        float part[2] = {0.0f, 0.0f};
#pragma unroll
        for (int c = 0; c < CPL; ++c) {
          const float w = expf(s[c]) * kj[c];
          part[0] += w * sm.tk[t][col0 + c];
          part[1] += w * sm.tq[t][col0 + c];
        }
        store_factor_pair(part, lane, 1.0f, &fac.ck[j][t], &fac.cq[j][t]);
      }
    }
  }
}

// Dynamic shared memory of the vector kernel: the CTA's checkpoint rows, block by block, each
// thread's R*W 16-byte words of a block at (r*W + c)*threads + thread (rows.cuh
// stage_rows_async).
template <class StateT, int KT>
constexpr int rv_stage_words() {
  using M = RvLayout<StateT, KT>;
  return kRvWarps * 32 * M::R * (M::EPL * static_cast<int>(sizeof(StateT)) / 16);
}
template <class StateT, int KT, int BPC>
constexpr int rv_stage_bytes() {
  return BPC * rv_stage_words<StateT, KT>() * 16;
}
// All of a CTA's dynamic shared memory: the vector kernel's checkpoint copies, then the factored
// kernel's RvFactorSmem.
template <class StateT, int KT, bool VEC, int BPC, bool FACTOR>
constexpr int rv_dynamic_bytes() {
  return (VEC ? rv_stage_bytes<StateT, KT, BPC>() : 0) +
         (FACTOR ? static_cast<int>(sizeof(RvFactorSmem<KT>)) : 0);
}
template <class StateT, int KT, bool VEC, int BPC, bool FACTOR>
constexpr int rv_cta_smem_bytes() {
  using M = RvLayout<StateT, KT>;
  return static_cast<int>(sizeof(RvSmem<KT, BPC * M::ROWS, M::RC>)) +
         rv_dynamic_bytes<StateT, KT, VEC, BPC, FACTOR>();
}

// CTAS: resident CTAs per SM, the register cap (tuning.h). BPC: row blocks per CTA (vector kernel
// only; V a multiple of BPC blocks' rows): the records and the drafts are staged once for all of
// them, and the later blocks' checkpoint rows are copied into shared memory while the first one
// runs.
template <class StateT, int KT, bool VEC, int CTAS, int BPC, bool FACTOR>
__global__ void __launch_bounds__(kRvWarps * 32, CTAS)
    replay_verify_kernel(const detail::ReplayVerifyProblem p) {
  using M = RvLayout<StateT, KT>;
  constexpr int G = M::G, EPL = M::EPL, RG = M::RG, R = M::R, RPW = M::RPW, ROWS = M::ROWS;
  constexpr int RC = M::RC, kThreads = kRvWarps * 32, CROWS = BPC * ROWS;  // rows per CTA
  static_assert(BPC == 1 || VEC, "several row blocks per CTA: vector kernel only");
  static_assert(sizeof(RvSmem<KT, CROWS, RC>) <= 48 * 1024, "static shared memory within 48 KB");
  static_assert(ctas_fit_smem(CTAS, rv_cta_smem_bytes<StateT, KT, VEC, BPC, FACTOR>()),
                "CTAS resident CTAs within an SM's shared memory");
  static_assert(2 * R <= G, "a row group holds the 2R dots of a draft after its reduction");
  __shared__ RvSmem<KT, CROWS, RC> sm;
  extern __shared__ __align__(16) unsigned char rv_dynamic[];
  RvFactorSmem<KT>* const fac = reinterpret_cast<RvFactorSmem<KT>*>(
      rv_dynamic + (VEC ? rv_stage_bytes<StateT, KT, BPC>() : 0));
  const detail::RecurrentProblem& r = p.r;
  enter_grid(r.pdl_trigger_early);
  const int n = blockIdx.x, hv = blockIdx.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int cta_row0 = blockIdx.z * CROWS;
  const int local0 = warp * RPW + lane / G;  // this lane's row 0 within a block's rows
  const int group = r.HV / r.H, h = hv / group;
  const int K = VEC ? KT : r.K, V = r.V, L = p.L;
  const int kofs = (lane % G) * EPL;
  const int valid = VEC ? EPL : max(0, min(EPL, K - kofs));
  const int64_t seq = r.cu_seqlens ? 0 : n;
  const int64_t tok0 = r.cu_seqlens ? detail::load_index(r.cu_seqlens, r.cu_dtype, n) : 0;
  const int64_t len =
      r.cu_seqlens ? detail::load_index(r.cu_seqlens, r.cu_dtype, n + 1) - tok0 : r.T;
  const int64_t slot = detail::index_at(r.indices, r.index_dtype, r.index_stride, n);
  if (slot <= p.null_block_id) {  // padded: zero outputs, nothing else read or written
    if (p.rows != 2) rv_fill_outputs<CROWS>(r, seq, tok0, len, hv, cta_row0, 0.0f);
    return;
  }
  // The ring and cursor row: the replay row, or the checkpoint slot.
  const int64_t rr =
      p.replay ? detail::index_at(p.replay, p.replay_dtype, p.replay_stride, n) : slot;
  const RvCursor cur = rv_cursor(p, slot, rr);
  const int m = cur.m, base = cur.base;
  if (cur.kind) {
    if (hv == 0 && blockIdx.z == 0 && threadIdx.x == 0)
      record_bad_row(r.errors, detail::kErrOpReplayVerify, cur.kind, n, cur.bad, cur.limit);
    rv_fill_outputs<CROWS>(r, seq, tok0, len, hv, cta_row0, bad_row_output());
    return;
  }
  const bool fold = detail::flag_at(p.is_flush, p.flush_dtype, rr);
  if ((p.rows == 1 && fold) || (p.rows == 2 && !fold)) return;  // another call's rows
  // The records replayed here: none on a fold the exact-raw launch already made (its checkpoint
  // is then the committed state); the drafts' positions still follow all m records.
  const int mh = fold && p.history_folded ? 0 : m;
  // The factored kernel: drafts of one preparation round factored on the rows in registers, which
  // hold the checkpoint (appending steps with one staging round of records: those records are
  // factored too) or the state rebuilt by the replay (folds, longer rings).
  const bool fdrafts = FACTOR && len <= kRvTokChunk;
  const bool frecs = fdrafts && !fold && m <= RC;
  const int mf = frecs ? m : 0;  // committed records factored
  const int gw = r.gate.kda ? K : 1;
  const int64_t d_base = (rr * r.HV + hv) * L * V;
  const int64_t k_base = (rr * r.H + h) * L * K;
  const int64_t g_base = (rr * r.HV + hv) * L * gw;
  StateT* ck = static_cast<StateT*>(r.state.ptr) + slot * r.state.slot_stride +
               static_cast<int64_t>(hv) * V * K;
  // A checkpoint in its storage format (quantized, or rounded stochastically) runs on the generic
  // float instantiation of the replay kernel (the launcher's choice), its rows loaded dequantized
  // through state_fmt.cuh: a run-time path, no kernel of its own. Its folds are the fold launch's
  // (replayssm/fold.cuh), which stores them through the format before this kernel runs
  // (history_folded), so nothing here stores it.
  constexpr bool kFmtCapable = !VEC && !FACTOR && std::is_same_v<StateT, float>;
  const bool fmt_rows = kFmtCapable && r.state.formatted();

  // The checkpoint rows first. The vector kernel copies them into shared memory (cp.async, each
  // thread its own words: no barrier; one copy group per block), so their bytes are in flight
  // without holding registers while the records are staged and the first drafts prepared; the
  // generic kernel loads them into registers (every load in flight at once).
  float S[R][EPL];
  const uint4* stage_mine = reinterpret_cast<const uint4*>(rv_dynamic) + threadIdx.x;
  if constexpr (VEC) {
#pragma unroll
    for (int b = 0; b < BPC; ++b)
      stage_rows_async<StateT, EPL, R>(
          reinterpret_cast<uint4*>(rv_dynamic) + b * rv_stage_words<StateT, KT>() + threadIdx.x,
          kThreads, cta_row0 + b * ROWS + local0, RG, V,
          [&](int, int row) { return ck + static_cast<int64_t>(row) * K + kofs; });
  } else {
#pragma unroll
    for (int j = 0; j < R; ++j) {
      const int row = cta_row0 + local0 + j * RG;
      if (row < V) {
        if (kFmtCapable && fmt_rows)
          load_state_fmt<EPL>(r.state, slot, hv, V, K, row, kofs, valid, S[j]);
        else load_state<StateT, EPL, VEC>(ck + static_cast<int64_t>(row) * K + kofs, valid, S[j]);
      } else {
#pragma unroll
        for (int i = 0; i < EPL; ++i) S[j][i] = 0.0f;
      }
    }
  }
  const bool g_writer = blockIdx.z == 0, k_writer = g_writer && hv % group == 0;
  const bool residual = rv_residual<VEC>(p);  // the hi/lo residual ring (generic kernel)

  // One round of records [c0, c0 + cn) into shared memory: k, alpha, d of the CTA's rows.
  auto stage_records = [&](int c0, int cn) {
    for (int i = threadIdx.x; i < cn * KT; i += kThreads) {
      const int j = i / KT, c = i - j * KT;
      const int64_t pos = (base + c0 + j) % L;
      const bool in = c < K;
      sm.rk[j][c] = in ? detail::load_float(p.k_cache, p.k_dtype, k_base + pos * K + c) : 0.0f;
      // factored records keep g itself (their decays are exponentiated per pair), replayed ones
      // alpha = e^g
      const float g = in ? p.g_cache[g_base + pos * gw + (r.gate.kda ? c : 0)] : 0.0f;
      sm.ra[j][c] = frecs ? g : in ? expf(g) : 1.0f;
    }
    for (int i = threadIdx.x; i < cn * CROWS; i += kThreads) {
      const int j = i / CROWS, lr = i - j * CROWS;
      const int64_t pos = (base + c0 + j) % L;
      sm.rd[j][lr] = cta_row0 + lr < V ? detail::load_float(p.d_cache, p.d_dtype,
                                                            d_base + pos * V + cta_row0 + lr)
                                       : 0.0f;
    }
  };
  // One round of draft tokens [t0, t0 + tn) into shared memory, one warp per token, with v of the
  // CTA's rows.
  auto prepare_tokens = [&](int64_t t0, int tn) {
    for (int j = warp; j < tn; j += kRvWarps) {
      const int64_t pos = (base + m + t0 + j) % L;
      const bool in_ring = m + t0 + j < L;  // records past the ring are dropped
      rv_prepare_token<KT, CROWS, RC>(p, seq, tok0 + t0 + j, h, hv, lane, j, g_base + pos * gw,
                                      k_base + pos * K, g_writer && in_ring, k_writer && in_ring,
                                      residual, sm, fdrafts ? fac->tg[j] : nullptr);
    }
    for (int i = threadIdx.x; i < tn * CROWS; i += kThreads) {
      const int j = i / CROWS, lr = i - j * CROWS, vrow = cta_row0 + lr;
      sm.tv[j][lr] =
          vrow < V ? detail::load_float(r.v.ptr, r.v.dtype,
                                        detail::head_offset(r.v, seq, tok0 + t0 + j, hv) + vrow)
                   : 0.0f;
    }
  };
  const int tn0 = static_cast<int>(len < kRvTokChunk ? len : kRvTokChunk);
  // Every record and draft staged in one round each: the later blocks reuse the shared memory as
  // the first one left it; else each block stages its rounds again.
  const bool one_round = mh <= RC && len <= kRvTokChunk;
  const int idx = reduced_index<G, 2 * R>(lane);  // the dot this lane holds after the reduction
  const bool first_copy = (lane & (G / (2 * R) - 1)) == 0;
  // Record j's d of this lane's R rows from lrow0 (one row per lane group: the thread's rows are
  // then consecutive from a multiple of R).
  auto record_d = [&](int j, int lrow0, float(&dj)[R]) {
    if constexpr (RG == 1 && R % 4 == 0) {
#pragma unroll
      for (int rr = 0; rr < R; rr += 4) {
        const float4 d4 = *reinterpret_cast<const float4*>(&sm.rd[j][lrow0 + rr]);
        dj[rr] = d4.x, dj[rr + 1] = d4.y, dj[rr + 2] = d4.z, dj[rr + 3] = d4.w;
      }
    } else {
#pragma unroll
      for (int rr = 0; rr < R; ++rr) dj[rr] = sm.rd[j][lrow0 + rr * RG];
    }
  };
  // The factored kernel's per-head pass (phase 3f below).
  auto factor_pass = [&](int tn) { rv_factor_pass<KT, CROWS, RC>(mf, tn, sm, *fac); };

#pragma unroll 1
  for (int b = 0; b < BPC; ++b) {
    const int lrow0 = b * ROWS + local0;  // this lane's row 0 within the CTA's rows
    const int row0 = cta_row0 + lrow0;    // rows row0 + r * RG
    const bool stage = b == 0 || !one_round;

    // 1. The committed records, oldest first (the recurrent step's two operations per element);
    //    the first round of drafts is prepared alongside the first round of records.
    for (int c0 = 0; c0 < mh || c0 == 0; c0 += RC) {
      const int cn = mh - c0 < RC ? mh - c0 : RC;
      if (stage) {
        if (c0 > 0 || b > 0) __syncthreads();  // the shared memory's last readers are done
        stage_records(c0, cn);
        if (c0 == 0) prepare_tokens(0, tn0);
        __syncthreads();
      }
      if constexpr (VEC) {
        if (c0 == 0) {  // this block's checkpoint rows (its copy group and the earlier ones)
          const uint4* src = stage_mine + b * rv_stage_words<StateT, KT>();
          if (b + 1 < BPC) load_staged_rows<StateT, EPL, R, true, 1>(src, kThreads, row0, RG, V, S);
          else load_staged_rows<StateT, EPL, R, true, 0>(src, kThreads, row0, RG, V, S);
        }
      }
      const int cr = frecs ? 0 : cn;  // factored records are not replayed
      for (int j = 0; j < cr; ++j) {
        float kj[EPL], aj[EPL];
        smem_slice<EPL>(sm.rk[j], kofs, kj);
        smem_slice<EPL>(sm.ra[j], kofs, aj);
        float dj[R];
        record_d(j, lrow0, dj);
#pragma unroll
        for (int rr = 0; rr < R; ++rr)
#pragma unroll
          for (int i = 0; i < EPL; ++i)
            S[rr][i] = detail::replay_element(S[rr][i], aj[i], dj[rr], kj[i]);
      }
    }
    // 2. The fold: the rebuilt state becomes the checkpoint. (A formatted one was folded by the
    //    fold launch: mh = 0 here, the rows already the checkpoint as stored.)
    if (fold && mh > 0) {
#pragma unroll
      for (int j = 0; j < R; ++j) {
        const int row = row0 + j * RG;
        if (row < V)
          store_state<StateT, EPL, VEC>(ck + static_cast<int64_t>(row) * K + kofs, valid, S[j]);
      }
    }

    const int vl = lrow0 + (idx < R ? idx : 0) * RG;  // the row whose sk this lane holds
    const int vrow = cta_row0 + vl;
    if (fdrafts) {
      // 3f. The factored drafts (tn = len <= kRvTokChunk, all prepared in round 0): the rows in
      //     registers (S0, or the rebuilt state) are never updated. Per draft t and row:
      //       sk_t = S.(E_t*k_t) + sum_{j < mf} d_j ck[j][t] + sum_{i < t} u_i ck[mf + i][t]
      //       sq_t = S.(E_t*q_t) + sum_{j < mf} d_j cq[j][t] + sum_{i < t} u_i cq[mf + i][t]
      //       u_t = beta_t (v_t - sk_t),   o_t = sq_t + u_t (k_t.q_t)
      //     The S and committed-record terms of every draft first (lane l of a row group adds
      //     records l, l + G, ..., as decode does; one transposed reduction per draft), then the
      //     drafts' own terms in order on the lanes holding sk, u_t broadcast to those holding sq.
      const int tn = static_cast<int>(len);
      if (stage) {
        factor_pass(tn);
        __syncthreads();  // the coefficients and E_t are published
      }
      float red[kRvTokChunk];
#pragma unroll
      for (int t = 0; t < kRvTokChunk; ++t) {
        red[t] = 0.0f;
        if (t < tn) {
          float e[EPL], ek[EPL], eq[EPL];
          smem_slice<EPL>(sm.ta[t], kofs, e);
          smem_slice<EPL>(sm.tk[t], kofs, ek);
          smem_slice<EPL>(sm.tq[t], kofs, eq);
#pragma unroll
          for (int i = 0; i < EPL; ++i) {
            ek[i] *= e[i];
            eq[i] *= e[i];
          }
          float dots[2 * R];
          factor_row_dots(S, ek, eq, dots);
          for (int j = lane % G; j < mf; j += G) {
            const float ckj = fac->ck[j][t], cqj = fac->cq[j][t];
            float dj[R];
            record_d(j, lrow0, dj);
#pragma unroll
            for (int rr = 0; rr < R; ++rr) {
              dots[rr] += dj[rr] * ckj;
              dots[R + rr] += dj[rr] * cqj;
            }
          }
          red[t] = transpose_reduce<G, 2 * R>(dots, lane);
        }
      }
      // u_t on the lanes holding sk (the others compute a value they do not use).
      float u[kRvTokChunk];
#pragma unroll
      for (int t = 0; t < kRvTokChunk; ++t) {
        u[t] = 0.0f;
        if (t < tn) {
          float sk = red[t];
#pragma unroll
          for (int i = 0; i < t; ++i) sk += u[i] * fac->ck[mf + i][t];
          u[t] = detail::delta_u(idx < R ? sm.tv[t][vl] : 0.0f, sk, sm.tbeta[t]);
        }
      }
      // The outputs on the lanes holding sq (u of their row from its sk holder), the d records
      // on those holding sk.
      const int sq_r = idx - R;  // this lane's row, if it holds sq
      const int u_src = holder_lane<G, 2 * R>(sq_r < 0 ? 0 : sq_r);
      const int orow = row0 + (sq_r < 0 ? 0 : sq_r) * RG;
      float uo[kRvTokChunk];
#pragma unroll
      for (int t = 0; t < kRvTokChunk; ++t) {
        uo[t] = 0.0f;
        if (t < tn) {
          uo[t] = __shfl_sync(0xffffffffu, u[t], u_src, G);
          float sq = red[t];
#pragma unroll
          for (int i = 0; i < t; ++i) sq += uo[i] * fac->cq[mf + i][t];
          if (sq_r >= 0 && first_copy && orow < V)
            detail::store_float(r.out.ptr, r.out.dtype,
                                detail::head_offset(r.out, seq, tok0 + t, hv) + orow,
                                detail::delta_output(sq, uo[t], sm.tkq[t]));
          if (idx < R && first_copy && vrow < V && m + t < L) {
            const int64_t pos = (base + m + t) % L;
            detail::store_float(p.d_cache, p.d_dtype, d_base + pos * V + vrow, u[t]);
          }
        }
      }
      if (residual && idx < R && first_copy && vrow < V) {
#pragma unroll
        for (int t = 0; t < kRvTokChunk; ++t)
          if (t < tn && m + t < L)
            rv_store_residual(p.rawv, p.rawv_dtype, p.d_dtype,
                              d_base + (base + m + t) % L * V + vrow, u[t]);
      }
      continue;
    }

    // 3. The drafts: the delta-rule step on the rebuilt rows, each draft's output and d record.
    for (int64_t t0 = 0; t0 < len; t0 += kRvTokChunk) {
      const int tn = static_cast<int>(len - t0 < kRvTokChunk ? len - t0 : kRvTokChunk);
      if (t0 > 0) {
        __syncthreads();  // the previous round's tokens are done with the shared memory
        prepare_tokens(t0, tn);
        __syncthreads();
      }
      for (int j = 0; j < tn; ++j) {
        const int64_t t = t0 + j;
        float q[EPL], k[EPL], alpha[EPL];
        smem_slice<EPL>(sm.tq[j], kofs, q);
        smem_slice<EPL>(sm.tk[j], kofs, k);
        smem_slice<EPL>(sm.ta[j], kofs, alpha);
        const float v_here = idx < R ? sm.tv[j][vl] : 0.0f;
        float u_here;
        const float red =
            delta_step_rows<G, R>(S, alpha, k, q, v_here, sm.tbeta[j], lane, u_here, [](int) {});
        store_output_rows<G, R>(r.out, detail::head_offset(r.out, seq, tok0 + t, hv), V, row0, RG,
                                lane, red, u_here, sm.tkq[j]);
        if (idx < R && first_copy && vrow < V && m + t < L) {
          const int64_t pos = (base + m + t) % L;
          detail::store_float(p.d_cache, p.d_dtype, d_base + pos * V + vrow, u_here);
          if (residual)
            rv_store_residual(p.rawv, p.rawv_dtype, p.d_dtype, d_base + pos * V + vrow, u_here);
        }
      }
    }
  }
}

// The cursor commit, one thread per batch row (a slot appears in one row of a step).
__global__ void __launch_bounds__(kRvCommitThreads)
    replay_commit_kernel(const detail::ReplayCommitProblem p) {
  enter_grid(false);
  const int64_t b = static_cast<int64_t>(blockIdx.x) * kRvCommitThreads + threadIdx.x;
  if (b >= p.B) return;
  const int64_t slot = p.slots.at(b, 0);
  if (slot <= p.null_block_id) return;
  const int64_t a = p.accepted.at(b, 0);
  if (slot >= p.num_slots || a < 0 || a > p.max_spec_len) {
    const bool bad_slot = slot >= p.num_slots;
    record_bad_row(p.errors, detail::kErrOpReplayCommit,
                   bad_slot ? detail::kErrSlot : detail::kErrStep, b, bad_slot ? slot : a,
                   bad_slot ? p.num_slots : p.max_spec_len + 1);
    return;
  }
  int wp = p.write_pos[slot];
  if (detail::flag_at(p.is_flush, p.flush_dtype, slot)) {
    if (a > 0) p.cache_base[slot] = (p.cache_base[slot] + wp) % p.buf_len;
    wp = static_cast<int>(a);
  } else {
    wp += static_cast<int>(a);
  }
  p.write_pos[slot] = wp;
  detail::set_flag(p.is_flush, p.flush_dtype, slot,
                   p.fold_every_commit ? wp > 0 : wp + 2 * p.max_spec_len > p.L);
}

// The cursor reset, one thread per batch row (a slot appears in one row of a step).
__global__ void __launch_bounds__(kRvCommitThreads)
    replay_reset_kernel(const detail::ReplayResetProblem p) {
  enter_grid(false);
  const int64_t b = static_cast<int64_t>(blockIdx.x) * kRvCommitThreads + threadIdx.x;
  if (b >= p.B) return;
  const int64_t slot = p.slots.at(b, 0);
  if (slot <= p.null_block_id || !detail::reset_row(p, b)) return;
  if (slot >= p.num_slots) {
    record_bad_row(p.errors, detail::kErrOpReplayReset, detail::kErrSlot, b, slot, p.num_slots);
    return;
  }
  detail::reset_cursors(p, slot);
}

}  // namespace
}  // namespace deltastate::cuda_backend
