// The kernel of ReplaySSM buffered decode (SGLang's fused_recurrent_linear_replayssm_decode in its
// basic mode: no circular ring, no predecayed keys), GDN and KDA; replayssm_decode.cu launches it.
// Part of replayssm_decode.cu's translation unit (included there only), in its anonymous namespace.
//
// The math (docs/REPLAYSSM.md, the same factorization as the CPU kernel): with the checkpoint S0
// and the m live ring records (d_j, k_j, g_j), the state before this token is
// S = e*S0 + sum_j d_j w_j kw_j with e = exp(Gtot), G_j the prefix sums of g, W_j =
// exp(Gtot - G_j) (KDA: per K column, folded into kw_j = W_j*k_j, w_j = 1; GDN: the scalar
// w_j = W_j, kw_j = k_j). The output needs two dot products per row with that S:
//   sk = S0.(e*alpha*k) + sum_j d_j ck_j,   ck_j = w_j kw_j.(alpha*k)
//   sq = S0.(e*alpha*q) + sum_j d_j cq_j,   cq_j = w_j kw_j.(alpha*q)
// so an appending step reads the checkpoint, never builds S, and writes only the record; a flush
// rebuilds S in registers, folds the token in (S0 <- alpha*S + d*k) and writes the checkpoint.
//
// Work layout. A CTA of NW warps owns a block of rows of one (row n, value head hv); each warp
// holds its rows of S0 in registers (the lane layout of rows.cuh: a row over G lanes, EPL
// elements each, R rows per thread). The per-head ring work is done once per CTA, not per warp:
//  1. Every thread reads the slot and the cursor m itself (no barrier); thread 0 issues bulk
//     copies of the m ring records (k, the block's rows of d, KDA's g) into shared memory on an
//     mbarrier (warp 0 copies GDN's scalar g with cp.async; the generic path stages with plain
//     loads), then every thread issues its checkpoint rows' loads; the token is prepared in
//     registers meanwhile (norms, gate, beta; warp 0 publishes alpha*k and alpha*q). The grid is
//     (B, HV, V-blocks), so a CTA finds its row and head without divisions.
//  2. Records are spread over the warps (record j on warp j mod NW): G_j and Gtot over the lane's
//     columns, kw_j, and the two coefficients ck_j, cq_j (one shuffle reduction per record).
//  3. Each row's two partial dots over the lane's K slice take the ring terms too: lane l of a
//     row group adds d_j*ck_j and d_j*cq_j for record j = l (and l + G, ...), so one transposed
//     reduction finishes sk and sq for all of the thread's rows.
// Barriers: two (after the staging; after the records and warp 0's decayed token e*alpha*k,
// e*alpha*q, which every appending step has, the ring empty or not); one on a flush of an empty
// ring.
//
// Cursor advance (advance_write_pos): each CTA, after its barrier (all its threads have read the
// cursor), adds 1 << 16 to write_pos[n]; the low 16 bits stay the cursor and the high bits count
// the CTAs that have read it. The CTA that sees itself last stores the new cursor. No extra launch
// or scratch buffer.
#pragma once

#include <cstdint>
#include <cstdio>
#include <type_traits>

#include "core/delta_math.h"
#include "core/numeric.h"
#include "core/problem.h"
#include "cuda/async_copy.cuh"
#include "cuda/grid.cuh"
#include "cuda/loads.cuh"
#include "cuda/reduce.cuh"
#include "cuda/replayssm/decode_tc.cuh"
#include "cuda/replayssm/ring.cuh"
#include "cuda/rows.cuh"
#include "cuda/state_fmt.cuh"
#include "cuda/token.cuh"
#include "cuda/tuning.h"

namespace deltastate::cuda_backend {

using detail::ReplayProblem;

namespace {

// The element types the ring records are staged in: the vector path copies raw bytes (k in the
// input dtype, d in the state dtype); the generic path converts to float while staging.
template <class StateT, bool VEC, class In>
struct Staged {
  using K = std::conditional_t<VEC, typename In::type, float>;
  using D = std::conditional_t<VEC, StateT, float>;
};

// Shared memory, byte offsets (every section 16-byte aligned). First the sections whose size does
// not depend on L (so that, with KT and the CTA's rows known at compile time, their offsets are
// constants): an mbarrier; the token, prepared once per CTA [KT floats each]: k (normalized), q
// (normalized, scaled), alpha, its log decay g; its scalars k.q and beta; the decay e = exp(Gtot)
// [KT] and the decayed token e*alpha*k, e*alpha*q [KT each]; with two row blocks per CTA, the
// second block's checkpoint rows, each thread's own 16-byte
// words (stage_rows_async: word [r][c] of thread i at (r*words + c)*threads + i). Then the ring:
// per record ck, cq, w [L]; the staged records g [L][gw] fp32, k [L][KT], d [L][d_pitch] (the
// CTA's rows; the pitch padded by 16 bytes so that lanes reading consecutive records hit
// different banks); kw [L][KT] fp32 (flush only).
struct SmemLayout {
  int bar, kn, qn, alpha, gcur, scalars, e, ek, eq, ckpt, ck, cq, w, g, k, d, kw, d_pitch, bytes;
  __host__ __device__ SmemLayout(int L, int KT, int gw, int k_size, int d_size, int rows_cta,
                                 int ckpt_bytes) {
    auto up16 = [](int x) { return (x + 15) & ~15; };
    d_pitch = up16(rows_cta * d_size) + 16;
    bar = 0;  // the mbarrier of the vector path's bulk copies
    kn = bar + 16;
    qn = kn + KT * 4;
    alpha = qn + KT * 4;
    gcur = alpha + KT * 4;
    scalars = gcur + KT * 4;
    e = scalars + 16;
    ek = e + KT * 4;
    eq = ek + KT * 4;
    ckpt = eq + KT * 4;
    ck = ckpt + ckpt_bytes;
    cq = ck + up16(L * 4);
    w = cq + up16(L * 4);
    g = w + up16(L * 4);
    k = g + up16(L * gw * 4);
    d = k + up16(L * KT * k_size);
    kw = d + L * d_pitch;
    bytes = kw + L * KT * 4;
  }
};
// The layout of a CTA of `blocks` row blocks of rows_blk rows (kernel and launcher agree on it):
// d staged for all its rows, the checkpoint rows of every block after the first.
template <class StateT, int KT, bool VEC, class In>
__host__ __device__ SmemLayout smem_layout(const ReplayProblem& p, int rows_blk, int blocks) {
  using S = Staged<StateT, VEC, In>;
  return SmemLayout(p.L, KT, p.gate.kda ? p.K : 1, sizeof(typename S::K), sizeof(typename S::D),
                    blocks * rows_blk,
                    (blocks - 1) * rows_blk * KT * static_cast<int>(sizeof(StateT)));
}

// The tensor-core kernel's layout (replay_tc_kernel: bf16 checkpoint, K = 128, 128 rows a CTA):
// its `ckpt` section holds the B operand (decode_tc.cuh), then the CTA's checkpoint rows, each
// thread's 8 chunks (tc_tile_word).
template <class In>
__host__ __device__ SmemLayout tc_smem_layout(const ReplayProblem& p) {
  return SmemLayout(p.L, 128, p.gate.kda ? p.K : 1, sizeof(typename In::type),
                    sizeof(__nv_bfloat16), kReplayWarps * kTcTileRows, kTcBBytes + kTcTileBytes);
}

// Element e (a compile-time index after unrolling) of values of type T packed in 16-byte words.
template <class T, int N>
__device__ __forceinline__ float element_of(const uint4 (&u)[N], int e) {
  constexpr int kPerWord = 4 / static_cast<int>(sizeof(T));
  const int w = e / kPerWord;
  const uint4& q = u[w / 4];
  const uint32_t word = w % 4 == 0 ? q.x : w % 4 == 1 ? q.y : w % 4 == 2 ? q.z : q.w;
  if constexpr (std::is_same_v<T, float>) {
    return __uint_as_float(word);
  } else {
    const auto half = static_cast<unsigned short>(e % 2 ? word >> 16 : word & 0xffffu);
    if constexpr (std::is_same_v<T, __nv_bfloat16>)
      return __bfloat162float(__ushort_as_bfloat16(half));
    else return __half2float(__ushort_as_half(half));
  }
}

// The token is prepared once per CTA by two warps at once (their lanes of the first row group
// publish their K slices): the norm warp normalizes q and k (q scaled) and takes k.q; the gate
// warp computes the gate (log decay g, alpha = exp(g)) and beta. (One warp, one after the other,
// makes every other warp wait at the first barrier.)
template <int G, int EPL>
__device__ __forceinline__ void publish_qk(const ReplayProblem& p, TokenHeadInputs<EPL>& x,
                                           int kofs, int valid, int lane, unsigned char* smem,
                                           const SmemLayout& sm) {
  const float kq = prepare_qk<EPL, G>(x.q, x.k, p.l2norm, p.scale, lane);
  if (lane < G) {
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      if (i < valid) {
        reinterpret_cast<float*>(smem + sm.kn)[kofs + i] = x.k[i];
        reinterpret_cast<float*>(smem + sm.qn)[kofs + i] = x.q[i];
      }
    }
  }
  if (lane == 0) reinterpret_cast<float*>(smem + sm.scalars)[0] = kq;
}
template <int G, int EPL>
__device__ __forceinline__ void publish_gate(const ReplayProblem& p, const TokenHeadInputs<EPL>& x,
                                             const GateConsts<EPL>& gc, int kofs, int valid,
                                             int lane, unsigned char* smem, const SmemLayout& sm) {
  float g[EPL], alpha[EPL];
  token_gate(p.gate, gc, x.g, g, alpha);
  if (lane < G) {
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      if (i < valid) {
        reinterpret_cast<float*>(smem + sm.alpha)[kofs + i] = alpha[i];
        reinterpret_cast<float*>(smem + sm.gcur)[kofs + i] = g[i];
      }
    }
  }
  if (lane == 0)
    reinterpret_cast<float*>(smem + sm.scalars)[1] =
        detail::beta_value(x.b, true, p.round_beta, p.b.dtype);
}
template <int G, int EPL>
__device__ __forceinline__ void prepare_token(const ReplayProblem& p, TokenHeadInputs<EPL>& x,
                                              const GateConsts<EPL>& gc, int kofs, int valid,
                                              int lane, int warp, int gate_warp,
                                              unsigned char* smem, const SmemLayout& sm) {
  if (warp == 0) publish_qk<G>(p, x, kofs, valid, lane, smem, sm);
  if (warp == gate_warp) publish_gate<G>(p, x, gc, kofs, valid, lane, smem, sm);
}

template <class T>
__device__ __forceinline__ float smem_float(const unsigned char* base, int i) {
  return to_float(reinterpret_cast<const T*>(base)[i]);
}

// The most warps per CTA: kReplayWarps (tuning.h). The two-block kernel (BPC = 2) runs only on
// whole heads of two such row blocks (the launcher's rule: V a multiple of 2 * 8 warps' rows), so
// its CTA size, row counts and row bounds are compile-time: no row checks, and its addresses are
// base + constant offsets (the bounds checks and per-row 64-bit address arithmetic are ~40% of
// the instructions of a kernel that has them).

// The constants of one CTA of replay_kernel (its coordinates, its lane's place in the row layout,
// its shared-memory sections), as the kernel computes them at its start, for the phases that are
// functions below. The kernel fills it (an aggregate) from its own locals. Phases 2, 3f and 3a,
// the cursor check and record_d stay in the kernel body: nvcc optimizes a function before it
// inlines it, and as functions they (or a constructor here) compile to different SASS.
template <class StateT, int KT, bool VEC, class In, int BPC, bool TC = false>
struct ReplayCta {
  using Lay = RowLayout<StateT, KT>;
  static constexpr int G = Lay::G, EPL = Lay::EPL, RG = Lay::RG, R = Lay::ROWS;
  static constexpr int CPL = KT / 32;  // columns per lane in the per-record pass
  using KS = typename Staged<StateT, VEC, In>::K;
  using DS = typename Staged<StateT, VEC, In>::D;
  using InT = typename In::wide_type;      // the inputs as loaded (16-bit: in their own registers)
  static constexpr bool kFull = BPC == 2;  // whole 8-warp blocks, every row below V

  unsigned char* smem;
  int n, hv, h, lane, warp, nwarps, nthreads, L, V, K;
  bool kda;
  int gw, kofs, valid, rows_blk, row_base, rows_here, wrow, local0, row0, idx;
  bool first_copy;
  SmemLayout sm;
  const float *s_kn, *s_qn, *s_alpha, *s_gcur, *s_scalars;
  float *s_e, *s_ek, *s_eq, *s_ck, *s_cq, *s_w;
  const float* s_g;
  float* s_kw;
  uint64_t* bar;  // thread 0's bulk copies

  __device__ __forceinline__ bool row_ok(int row) const { return kFull || row < V; }

  // v of the row whose sk this lane will hold, of each block: loaded unconditionally from a
  // clamped row and kept in its own type (v_of converts and zeroes it where it is used).
  __device__ __forceinline__ void load_v(const ReplayProblem& p, InT (&v_in)[BPC]) const {
#pragma unroll
    for (int b = 0; b < BPC; ++b) {
      const int vrow = row0 + b * rows_blk + (idx < R ? idx : 0) * RG;
      v_in[b] =
          load_input<In, InT>(p.v.ptr, p.v.dtype, head_offset(p.v, n, 0, hv) + min(vrow, V - 1));
    }
  }
  // v of block b where it is used: the lanes holding sk of a row below V.
  __device__ __forceinline__ float v_of(const InT (&v_in)[BPC], int b) const {
    return idx < R && row_ok(row0 + b * rows_blk + idx * RG) ? to_float(v_in[b]) : 0.0f;
  }

  // A padded row: zero output; no state or ring access, the cursor left as it is.
  __device__ __forceinline__ void zero_output(const ReplayProblem& p, float fill = 0.0f) const {
    if (lane % G == 0)
#pragma unroll
      for (int b = 0; b < BPC; ++b)
        zero_output_rows<R>(p.out, V, head_offset(p.out, n, 0, hv), row0 + b * rows_blk, RG, fill);
  }

  // The vector path's ring-record copies (phase 1, issued first). Thread 0 alone issues bulk
  // copies on `bar` (the copy engine moves the bytes) of the k records, each record's block of d
  // rows and KDA's g records; warp 0's lanes copy GDN's scalar g records (m * 4 bytes, not whole
  // 16-byte units) with 4-byte cp.async. (16-byte cp.async by every thread costs each warp ~250
  // instructions per CTA of index arithmetic.)
  __device__ __forceinline__ void copy_ring(const ReplayProblem& p, int m, float* g_ring,
                                            int64_t k_ring, int64_t d_ring) const {
    if (m > 0) {
      if (threadIdx.x == 0) {
        constexpr uint32_t kb = sizeof(KS), db = sizeof(DS);
        const uint32_t k_bytes = m * K * kb, d_bytes = rows_here * db,
                       g_bytes = kda ? m * K * 4 : 0;
        mbar_init(bar, 1);
        mbar_init_fence();
        fence_proxy_async();  // the initialized barrier, before this thread's bulk copies use it
        mbar_expect_tx(bar, k_bytes + m * d_bytes + g_bytes);
        bulk_load(smem + sm.k, static_cast<const unsigned char*>(p.k_cache) + k_ring * kb, k_bytes,
                  bar);
        if (kda) bulk_load(smem + sm.g, g_ring, g_bytes, bar);
        const unsigned char* d_src =
            static_cast<const unsigned char*>(p.d_cache) + (d_ring + row_base) * db;
        for (int j = 0; j < m; ++j)
          bulk_load(smem + sm.d + j * sm.d_pitch, d_src + static_cast<int64_t>(j) * V * db, d_bytes,
                    bar);
        mbar_arrive(bar);
      }
      if (!kda && warp == 0) {
        for (int j = lane; j < m; j += 32) cp_async4(smem + sm.g + j * 4, g_ring + j);
        cp_async_commit();
      }
    }
  }

  // The token, on its two warps (prepare_token).
  __device__ __forceinline__ void prepare(const ReplayProblem& p,
                                          const TokenHeadInputs<EPL, InT>& x_in,
                                          const GateConsts<EPL>& gc, int gate_warp) const {
    TokenHeadInputs<EPL> x = widen(x_in);
    prepare_token<G>(p, x, gc, kofs, valid, lane, warp, gate_warp, smem, sm);
  }

  // The checkpoint rows of block 0 into registers (every load in flight at once); `my_rows` is
  // this lane's row 0.
  __device__ __forceinline__ void load_checkpoint(const StateT* my_rows, float (&S)[R][EPL]) const {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (row_ok(row0 + r * RG)) {
        load_state<StateT, EPL, VEC>(my_rows + r * RG * K, valid, S[r]);
      } else {
#pragma unroll
        for (int i = 0; i < EPL; ++i) S[r][i] = 0.0f;
      }
    }
  }

  // The generic path's staging of the ring records (plain loads, after the rows' loads).
  __device__ __forceinline__ void stage_ring(const ReplayProblem& p, int m, const float* g_ring,
                                             int64_t k_ring, int64_t d_ring) const {
    if (m > 0) {
      stage_rows_float(reinterpret_cast<float*>(smem + sm.g), 0, g_ring, DType::f32, 0, 0, 1,
                       m * gw);
      stage_rows_float(reinterpret_cast<float*>(smem + sm.k), KT, p.k_cache, p.k_dtype, k_ring, K,
                       m, K);
      stage_rows_float(reinterpret_cast<float*>(smem + sm.d), sm.d_pitch / 4, p.d_cache, p.d_dtype,
                       d_ring + row_base, V, m, rows_here);
    }
  }

  // Every thread of this CTA has read the cursor (its value decided the staging, before the
  // barrier); now this CTA counts itself, and the last one stores the new cursor.
  __device__ __forceinline__ void advance_cursor(const ReplayProblem& p, int m, bool flush) const {
    if (p.advance_write_pos && threadIdx.x == 0)
      advance_row_cursor(p.write_pos, n, p.HV * static_cast<int>(gridDim.z), m, flush);
  }

  // One record's contribution: kw = W*k (KDA, per column) or k (GDN, W = w_j scalar); for a
  // flush kw_j and w_j themselves, for an appending step the coefficients ck_j, cq_j.
  __device__ __forceinline__ void finish_record(int j, int col0, bool flush, const float (&kw)[CPL],
                                                float wj) const {
    if (flush) {
#pragma unroll
      for (int c = 0; c < CPL; ++c)
        if (col0 + c < K) s_kw[j * KT + col0 + c] = kw[c];
      if (lane == 0) s_w[j] = wj;
    } else {
      record_coefficients<CPL>(kw, col0, K, s_alpha, s_kn, s_qn, wj, lane, s_ck + j, s_cq + j);
    }
  }
  __device__ __forceinline__ void record_k(int j, int col0, float (&kr)[CPL]) const {
#pragma unroll
    for (int c = 0; c < CPL; ++c)
      kr[c] = col0 + c < K ? smem_float<KS>(smem + sm.k, j * KT + col0 + c) : 0.0f;
  }

  // 3a's dots of S0 with e*alpha*k and e*alpha*q over the lane's slice.
  __device__ __forceinline__ void checkpoint_dots(const float (&S)[R][EPL],
                                                  float (&dots)[2 * R]) const {
    cuda_backend::prepared_checkpoint_dots<R, EPL>(S, s_ek, s_eq, kofs, valid, dots);
  }
  // Warp 0's decayed token for 3a (store_decayed_token), from the columns' decays e.
  // TC: as the tensor cores' B operand (store_decayed_token_tc), in the `ckpt` section.
  __device__ __forceinline__ void decayed_token(const float (&e)[CPL], int col0) const {
    if constexpr (TC) store_decayed_token_tc<CPL>(e, col0, s_alpha, s_kn, s_qn, smem + sm.ckpt);
    else store_decayed_token<CPL>(e, col0, K, s_alpha, s_kn, s_qn, s_ek, s_eq);
  }
  // Warp 0's part of phase 2 with records: the columns' decays e (3f's rebuild) and, on an
  // appending step, the decayed token.
  __device__ __forceinline__ void publish_decay(const float (&e)[CPL], int col0, bool flush) const {
#pragma unroll
    for (int c = 0; c < CPL; ++c)
      if (col0 + c < K) s_e[col0 + c] = e[c];
    if (!flush) decayed_token(e, col0);
  }
  // 3f's token slices: alpha, k and q of the lane's K slice.
  __device__ __forceinline__ void token_slice(float (&alpha)[EPL], float (&kn)[EPL],
                                              float (&qn)[EPL]) const {
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      alpha[i] = i < valid ? s_alpha[kofs + i] : 1.0f;
      kn[i] = i < valid ? s_kn[kofs + i] : 0.0f;
      qn[i] = i < valid ? s_qn[kofs + i] : 0.0f;
    }
  }
};

// The kernel's body (replay_kernel, replay_fmt_kernel, replay_tc_kernel below). FMT: a checkpoint
// in its storage format (quantized, or rounded stochastically; docs/STATE_FORMATS.md) on the
// generic float layout: its rows loaded dequantized, stored on a flush through cuda/state_fmt.cuh
// (a fresh scale per row, the slot's key), as the CPU's. TC: a bf16 checkpoint, K = 128, 128 rows
// a CTA (the two-block CTA's rows), warp w holding rows 16w .. 16w + 15 as tensor-core fragments
// (decode_tc.cuh); only the row phase (3a, 3f) and the decayed token's form differ.
template <class StateT, int KT, bool VEC, class In, int BPC, bool FMT, bool TC = false>
__device__ __forceinline__ void replay_step(const ReplayProblem& p,
                                            const detail::SmallDivider& group_div) {
  static_assert(!FMT || (std::is_same_v<StateT, float> && !VEC && BPC == 1),
                "a formatted checkpoint: the generic float layout, one row block");
  static_assert(
      !TC || (std::is_same_v<StateT, __nv_bfloat16> && KT == 128 && VEC && BPC == 2 && !FMT),
      "the tensor-core rows: bf16 checkpoint, K = 128, whole two-block CTAs");
  using Lay = RowLayout<StateT, KT>;
  constexpr int G = Lay::G, EPL = Lay::EPL, RG = Lay::RG, R = Lay::ROWS;
  constexpr int RPW = RG * R;   // rows per warp
  constexpr int CPL = KT / 32;  // columns per lane in the per-record pass
  using KS = typename Staged<StateT, VEC, In>::K;
  using DS = typename Staged<StateT, VEC, In>::D;
  static_assert((RPW * sizeof(DS)) % 16 == 0,
                "a warp's d values of one record: whole 16-byte words");
  static_assert(BPC == 1 || (BPC == 2 && VEC), "two row blocks per CTA: vector path only");
  constexpr bool kFull = BPC == 2;  // whole 8-warp blocks, every row below V
  extern __shared__ __align__(16) unsigned char smem[];
  enter_grid(p.pdl_trigger_early);

  const int n = static_cast<int>(blockIdx.x);  // the grid is (B, HV, V-blocks): no divisions
  const int hv = static_cast<int>(blockIdx.y);
  const int h = group_div.divide(hv);  // hv / (HV / H)
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int nwarps = kFull ? kReplayWarps : static_cast<int>(blockDim.x >> 5);
  const int nthreads = nwarps * 32;
  const int L = p.L, V = p.V;
  const int K = VEC ? KT : p.K;  // compile-time on the vector path
  const bool kda = p.gate.kda;
  const int gw = kda ? K : 1;
  const int kofs = (lane % G) * EPL;
  const int valid = VEC ? EPL : max(0, min(EPL, K - kofs));
  const int rows_blk = nwarps * RPW;  // rows of one row block
  const int row_base = blockIdx.z * BPC * rows_blk;
  const int rows_here =
      kFull ? BPC * rows_blk : min(BPC * rows_blk, V - row_base);  // the CTA's rows
  const int wrow = warp * RPW;                                     // the warp's first local row
  const int local0 = wrow + lane / G;  // this lane's local row 0 (rows local0 + r*RG)
  const int row0 = row_base + local0;
  const int idx = reduced_index<G, 2 * R>(lane);  // the value this lane holds after the reduction
  const bool first_copy = (lane & (G / (2 * R) - 1)) == 0;
  const SmemLayout sm =
      TC ? tc_smem_layout<In>(p) : smem_layout<StateT, KT, VEC, In>(p, rows_blk, BPC);
  const float* s_kn = reinterpret_cast<const float*>(smem + sm.kn);
  const float* s_qn = reinterpret_cast<const float*>(smem + sm.qn);
  const float* s_alpha = reinterpret_cast<const float*>(smem + sm.alpha);
  const float* s_gcur = reinterpret_cast<const float*>(smem + sm.gcur);
  const float* s_scalars = reinterpret_cast<const float*>(smem + sm.scalars);
  float* s_e = reinterpret_cast<float*>(smem + sm.e);
  float* s_ek = reinterpret_cast<float*>(smem + sm.ek);
  float* s_eq = reinterpret_cast<float*>(smem + sm.eq);
  float* s_ck = reinterpret_cast<float*>(smem + sm.ck);
  float* s_cq = reinterpret_cast<float*>(smem + sm.cq);
  float* s_w = reinterpret_cast<float*>(smem + sm.w);
  const float* s_g = reinterpret_cast<const float*>(smem + sm.g);
  float* s_kw = reinterpret_cast<float*>(smem + sm.kw);
  uint64_t* bar = reinterpret_cast<uint64_t*>(smem + sm.bar);  // thread 0's bulk copies
  // The same values for the phase functions (ReplayCta says why they are copied, not computed
  // there).
  const ReplayCta<StateT, KT, VEC, In, BPC, TC> cta{
      smem, n,    hv,         h,    lane,  warp,     nwarps,   nthreads,  L,         V,
      K,    kda,  gw,         kofs, valid, rows_blk, row_base, rows_here, wrow,      local0,
      row0, idx,  first_copy, sm,   s_kn,  s_qn,     s_alpha,  s_gcur,    s_scalars, s_e,
      s_ek, s_eq, s_ck,       s_cq, s_w,   s_g,      s_kw,     bar};

  // Every load that does not depend on the slot leaves first, and none is waited for before the
  // checkpoint loads are issued: the slot, the cursor and the forced flush (issued in place,
  // load_int_now: the slot -> checkpoint chain is the CTA's longest); v of the row whose sk this
  // lane will hold and, on the two token warps, the token's q, k, gate and beta inputs, kept in
  // their own type until used (a conversion right after its load stalls the warp there); the
  // head's gate constants.
  const int64_t slot = load_int_now(p.indices + n * p.index_stride);
  const int cursor = load_int_now_cg(p.write_pos + n);
  const bool forced_flush = p.force_flush && load_int_now(p.force_flush + n) != 0;
  // 16-bit inputs in their own 32-bit registers and v loaded unconditionally from a clamped row,
  // zeroed where used (as the register decode kernel: a PRMT packing, or a zeroing after a
  // predicated load, waits for the load).
  using InT = typename In::wide_type;
  InT v_in[BPC];    // of each block; TC: of the lane's fragment rows g, g + 8
  InT v_rows[BPC];  // TC: of each block in the rows layout (for a flush)
  const int tg = lane >> 2, tt = lane & 3;  // TC: the lane's fragment row g and column group t
  if constexpr (TC) {
    const int64_t v0 = head_offset(p.v, n, 0, hv) + row_base + warp * kTcTileRows + tg;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) v_in[hh] = load_input<In, InT>(p.v.ptr, p.v.dtype, v0 + 8 * hh);
    cta.load_v(p, v_rows);
  } else {
    cta.load_v(p, v_in);
  }
  TokenHeadInputs<EPL, InT> x_in;
  GateConsts<EPL> gc;
  const int gate_warp = nwarps > 1 ? 1 : 0;
  if (warp == 0 || warp == gate_warp) {
    load_token_head<In>(p, p.a, p.b, n, 0, h, hv, kofs, valid, x_in);
    load_gate_consts(p.gate, hv, K, kofs, valid, gc);
  }

  if (slot < 0) {  // padded: zero output; no state or ring access, the cursor left as it is
    cta.zero_output(p);
    return;
  }
  // A bad row (a slot past the pool, a cursor outside the ring): as padded (no state, ring or
  // cursor access), its output NaN, recorded by one thread of the row. Every CTA of the row reads
  // the same low 16 bits of the cursor (the device advance changes only the high bits until the
  // row's last CTA, which is never reached for a skipped row), so all of them skip it.
  // With the device advance the high 16 bits count the CTAs of this launch that have read it.
  const int m = replay_cursor(cursor, p.advance_write_pos);
  if (bad_replay_row(slot, p.state.num_slots, cursor, m, L)) {
    if (threadIdx.x == 0 && hv == 0 && blockIdx.z == 0)
      record_bad_replay_row(p.errors, p.err_op, n, slot, p.state.num_slots, cursor, m, L);
    cta.zero_output(p, bad_row_output());
    return;
  }
  const bool flush = detail::replay_flushes(m, L, forced_flush);

  // 1. The vector path's ring-record copies (issued first: before the rows' registers are live
  //    and before the 16-bit kernels' token preparation), the checkpoint rows, then the generic
  //    path's staging (plain loads: after the rows' loads).
  float* g_ring = p.g_cache + (slot * p.HV + hv) * static_cast<int64_t>(L) * gw;
  const int64_t k_ring = (slot * p.H + h) * static_cast<int64_t>(L) * K;  // elements
  const int64_t d_ring = (slot * p.HV + hv) * static_cast<int64_t>(L) * V;
  if constexpr (VEC) cta.copy_ring(p, m, g_ring, k_ring, d_ring);
  // The token warps prepare it while their checkpoint loads and the ring copies are in flight
  // where the registers allow (EPL <= 4: fp32 states, K <= 128); with 8 elements per lane
  // (16-bit states, the generic kernel) holding the token's slices beside the rows spills, so
  // they prepare it before their rows' loads, but after the ring copies have left (before them,
  // the whole CTA's ring waits for the token's inputs and its preparation).
  constexpr bool kPrepFirst = EPL > 4;
  if (kPrepFirst) cta.prepare(p, x_in, gc, gate_warp);
  // The checkpoint rows (every load in flight at once).
  // (FMT: the codes are not StateT elements; the rows go through state_fmt.cuh instead)
  StateT* s0 = FMT ? nullptr
                   : static_cast<StateT*>(p.state.ptr) + slot * p.state.slot_stride +
                         static_cast<int64_t>(hv) * V * K;
  StateT* my_rows = FMT ? nullptr : s0 + static_cast<int64_t>(row0) * K + kofs;  // lane's row 0
  float S[R][EPL];
  StateT* const tc_rows =  // TC: the lane's row g at its column 8t
      TC ? s0 + static_cast<int64_t>(row_base + warp * kTcTileRows + tg) * K + 8 * tt : nullptr;
  uint4* const tc_mine =  // TC: this thread's chunks of the staged tile
      reinterpret_cast<uint4*>(smem + sm.ckpt + kTcBBytes) + threadIdx.x;
  if constexpr (TC) {
    stage_tc_tile(tc_rows, K, tc_mine);
  } else if constexpr (FMT) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (row0 + r * RG < V) {
        load_state_fmt<EPL>(p.state, slot, hv, V, K, row0 + r * RG, kofs, valid, S[r]);
      } else {
#pragma unroll
        for (int i = 0; i < EPL; ++i) S[r][i] = 0.0f;
      }
    }
  } else {
    cta.load_checkpoint(my_rows, S);
  }
  // The second block's rows: each thread copies its own words into shared memory (no barrier).
  uint4* ckpt_mine = reinterpret_cast<uint4*>(smem + sm.ckpt) + threadIdx.x;
  if constexpr (BPC == 2 && !TC)
    stage_rows_async<StateT, EPL, R, !kFull>(
        ckpt_mine, nthreads, row0 + rows_blk, RG, V,
        [&](int r, int) { return my_rows + (rows_blk + r * RG) * K; });
  if constexpr (!VEC) cta.stage_ring(p, m, g_ring, k_ring, d_ring);
  if (!kPrepFirst) cta.prepare(p, x_in, gc, gate_warp);
  // warp 0's cp.async of GDN's g records (the rows' staging, a later group, may wait)
  if constexpr (VEC) cp_async_wait<BPC - 1>();
  __syncthreads();  // the token and the records staged; every thread has read the cursor
  if (VEC && m > 0) mbar_wait(bar, 0);  // thread 0's bulk copies

  cta.advance_cursor(p, m, flush);

  // 2. Per record j (warp j mod NW; lane columns c = lane*CPL + i): Gtot and G_j summed as the
  //    CPU sums them, W_j = exp(Gtot - G_j), and for an appending step the coefficients ck_j,
  //    cq_j, for a flush kw_j and w_j themselves; e by the warp of record 0.
  if (m > 0) {
    const int col0 = lane * CPL;
    if (kda) {
      float gtot[CPL], prefix[CPL];
#pragma unroll
      for (int c = 0; c < CPL; ++c) gtot[c] = prefix[c] = 0.0f;
      for (int i = 0; i < m; ++i) {
#pragma unroll
        for (int c = 0; c < CPL; ++c) gtot[c] += col0 + c < K ? s_g[i * K + col0 + c] : 0.0f;
      }
      if (warp == 0) {
        float e[CPL];
#pragma unroll
        for (int c = 0; c < CPL; ++c) e[c] = expf(gtot[c]);
        cta.publish_decay(e, col0, flush);
      }
      int i = 0;
      for (int j = warp; j < m; j += nwarps) {
        for (; i <= j; ++i) {
#pragma unroll
          for (int c = 0; c < CPL; ++c) prefix[c] += col0 + c < K ? s_g[i * K + col0 + c] : 0.0f;
        }
        float kw[CPL];
        cta.record_k(j, col0, kw);
#pragma unroll
        for (int c = 0; c < CPL; ++c) kw[c] *= expf(gtot[c] - prefix[c]);
        cta.finish_record(j, col0, flush, kw, 1.0f);
      }
    } else {
      float gtot = 0.0f, prefix = 0.0f;
      for (int i = 0; i < m; ++i) gtot += s_g[i];
      if (warp == 0) {
        float e[CPL];
#pragma unroll
        for (int c = 0; c < CPL; ++c) e[c] = expf(gtot);
        cta.publish_decay(e, col0, flush);
      }
      int i = 0;
      for (int j = warp; j < m; j += nwarps) {
        for (; i <= j; ++i) prefix += s_g[i];
        float kr[CPL];
        cta.record_k(j, col0, kr);
        cta.finish_record(j, col0, flush, kr, expf(gtot - prefix));
      }
    }
    // TC: a flush reads the staged tile in the rows layout (other threads' words) after this
    // barrier
    if (TC && flush) cp_async_wait<0>();
    __syncthreads();
  } else if (!flush) {  // no records: e = 1
    if (warp == 0) {
      float e[CPL];
#pragma unroll
      for (int c = 0; c < CPL; ++c) e[c] = 1.0f;
      cta.decayed_token(e, lane * CPL);
    }
    __syncthreads();
  } else if (TC) {  // a flush without records: the staged tile CTA-wide (above)
    cp_async_wait<0>();
    __syncthreads();
  }

  const float kq = s_scalars[0], beta = s_scalars[1];
  const int64_t o_off = head_offset(p.out, n, 0, hv);
  // A record's d values of the warp's rows (RPW consecutive values, whole 16-byte words):
  // this lane's R rows, zero past the block's last row.
  auto record_d = [&](int j, int b, float(&dj)[R]) {
    constexpr int kDWords = static_cast<int>(RPW * sizeof(DS) / 16);
    uint4 raw[kDWords];
    const uint4* src = reinterpret_cast<const uint4*>(smem + sm.d + j * sm.d_pitch +
                                                      (b * rows_blk + wrow) * sizeof(DS));
#pragma unroll
    for (int c = 0; c < kDWords; ++c) raw[c] = src[c];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float d = 0.0f;
#pragma unroll
      for (int t = 0; t < RG; ++t)
        if (lane / G == t) d = element_of<DS>(raw, t + r * RG);
      dj[r] = kFull || b * rows_blk + local0 + r * RG < rows_here ? d : 0.0f;
    }
  };

  if constexpr (TC) {
    // 3a on the warp's tile (decode_tc.cuh): the lane's rows lrow, lrow + 8 of the CTA's, its
    // chunks at columns 32c + 8t. A flush takes the rows kernel's 3f below, its rows read from
    // the staged tile.
    const int lrow = warp * kTcTileRows + tg;
    cp_async_wait<0>();  // the thread's chunks of the tile (tc_tile_word)
    if (!flush) {
      // 3a: the tile's dots on tensor cores, lane t adding records t, t + 4, ... before the
      // quad's sum; lanes 0 / 1 store the output of rows lrow / lrow + 8, lanes 2 / 3 their d.
      uint4 A[2][4];  // the lane's chunks (rows lrow + 8h, columns 32c + 8t ..)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int c = 0; c < 4; ++c) A[h][c] = tc_mine[tc_tile_word(h, c)];
      float acc[4];
      tc_tile_dots(A, smem + sm.ckpt, lane, acc);
      for (int j = tt; j < m; j += 4) {
        const float ckj = s_ck[j], cqj = s_cq[j];
        const unsigned char* dj = smem + sm.d + j * sm.d_pitch;
        const float d0 = smem_float<DS>(dj, lrow), d1 = smem_float<DS>(dj, lrow + 8);
        acc[0] = fmaf(d0, ckj, acc[0]);
        acc[1] = fmaf(d0, cqj, acc[1]);
        acc[2] = fmaf(d1, ckj, acc[2]);
        acc[3] = fmaf(d1, cqj, acc[3]);
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[i] = quad_sum(acc[i]);
      const int hh = tt & 1;
      const int row = row_base + lrow + 8 * hh;
      const float u = detail::delta_u(to_float(hh ? v_in[1] : v_in[0]), hh ? acc[2] : acc[0], beta);
      if (tt < 2)
        detail::store_float(p.out.ptr, p.out.dtype, o_off + row,
                            detail::delta_output(hh ? acc[3] : acc[1], u, kq));
      else detail::store_float(p.d_cache, p.d_dtype, d_ring + static_cast<int64_t>(m) * V + row, u);
    }
  }
  // v of the rows whose sk the lane holds in block b (TC: the rows layout's, loaded for its flush)
  auto v_of_block = [&](int b) {
    if constexpr (TC) return cta.v_of(v_rows, b);
    else return cta.v_of(v_in, b);
  };
#pragma unroll
  for (int b = 0; b < BPC; ++b) {
    const int rowb = row0 + b * rows_blk;  // this lane's row 0 in block b
    if constexpr (TC) {  // a flush: the block's rows from the staged tile (tc_tile_word's map)
      if (!flush) break;
      load_tc_tile_rows<R, RG>(smem + sm.ckpt + kTcBBytes, b * rows_blk + local0, kofs, S);
    } else if (b > 0) {  // the second block's checkpoint rows from this thread's words
      if (!kFull && row_base + b * rows_blk >= V) break;  // past the head's last row (CTA-uniform)
      load_staged_rows<StateT, EPL, R, !kFull>(ckpt_mine, nthreads, rowb, RG, V, S);
    }
    if (flush) {
      // 3f. Rebuild the state, S = e*S0 + sum_j d_j w_j kw_j, then the plain delta-rule step on
      //     it (as plain decode): decay, dots, u, output, S0 <- alpha*S + u*k.
      if (m > 0) {
        float e[EPL];
#pragma unroll
        for (int i = 0; i < EPL; ++i) e[i] = i < valid ? s_e[kofs + i] : 1.0f;
#pragma unroll
        for (int r = 0; r < R; ++r) detail::scale_row(S[r], e, std::integral_constant<int, EPL>{});
        for (int j = 0; j < m; ++j) {
          float kw[EPL], dj[R];
#pragma unroll
          for (int i = 0; i < EPL; ++i) kw[i] = i < valid ? s_kw[j * KT + kofs + i] : 0.0f;
          record_d(j, b, dj);
          const float wj = s_w[j];
#pragma unroll
          for (int r = 0; r < R; ++r)
            detail::rank1_update(S[r], kw, std::integral_constant<int, EPL>{}, dj[r] * wj);
        }
      }
      float alpha[EPL], kn[EPL], qn[EPL];
      cta.token_slice(alpha, kn, qn);
      float u_here;  // meaningful on the lanes holding sk
      // FMT: the key of the slot's bits in this call (the counter advances after the grid)
      const uint64_t key = FMT && p.state.stochastic
                               ? detail::sr_key(p.state.seed, static_cast<uint64_t>(slot),
                                                p.state.layer, static_cast<uint64_t>(*p.state.step))
                               : 0;
      const float red =
          delta_step_rows<G, R>(S, alpha, kn, qn, v_of_block(b), beta, lane, u_here, [&](int r) {
            if constexpr (FMT)  // every lane: the row's amax is a shuffle reduction
              store_state_fmt<G, EPL>(p.state, key, slot, hv, V, K, rowb + r * RG,
                                      cta.row_ok(rowb + r * RG), lane, kofs, valid, S[r]);
            else if (cta.row_ok(rowb + r * RG))
              store_state<StateT, EPL, VEC>(my_rows + (b * rows_blk + r * RG) * K, valid, S[r]);
          });
      store_output_rows<G, R>(p.out, o_off, V, rowb, RG, lane, red, u_here, kq);
      continue;
    }

    // 3a. An appending step: sk, sq per row from S0 dotted with e*alpha*k and e*alpha*q over the
    //     lane's slice plus the ring terms of the lane's records (lane l of a row group: records
    //     l, l + G, ...), one transposed reduction; then the output and the record's d (by the
    //     lanes holding sk).
    float dots[2 * R];
    cta.checkpoint_dots(S, dots);
    for (int j = lane % G; j < m; j += G) {
      const float ckj = s_ck[j], cqj = s_cq[j];
      float dj[R];
      record_d(j, b, dj);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        dots[r] += dj[r] * ckj;
        dots[R + r] += dj[r] * cqj;
      }
    }
    const float red = transpose_reduce<G, 2 * R>(dots, lane);
    const float u_here =
        detail::delta_u(v_of_block(b), red, beta);  // meaningful on the lanes holding sk
    store_output_rows<G, R>(p.out, o_off, V, rowb, RG, lane, red, u_here, kq);
    const int vrow = rowb + idx * RG;
    if (idx < R && first_copy && cta.row_ok(vrow))
      detail::store_float(p.d_cache, p.d_dtype, d_ring + static_cast<int64_t>(m) * V + vrow,
                          u_here);
  }
  // The appended record's k and g: one writer per head.
  if (!flush && blockIdx.z == 0 && warp == 0 && lane < G) {
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      if (i < valid) {
        if (kda) g_ring[m * gw + kofs + i] = s_gcur[kofs + i];
        if (hv == 0 || group_div.divide(hv - 1) != h)  // the key head's first value head
          detail::store_float(p.k_cache, p.k_dtype, k_ring + static_cast<int64_t>(m) * K + kofs + i,
                              s_kn[kofs + i]);
      }
    }
    if (!kda && lane == 0) g_ring[m] = s_gcur[0];
  }
}

template <class StateT, int KT, bool VEC, class In, int BPC>
__global__ void __launch_bounds__(kReplayWarps * 32, kReplayCtasPerSm)
    replay_kernel(const ReplayProblem p, const detail::SmallDivider group_div) {
  replay_step<StateT, KT, VEC, In, BPC, false>(p, group_div);
}

// A bf16 checkpoint, K = 128, whole heads of 128 rows: the rows' dots on tensor cores
// (decode_tc.cuh; the launcher takes it from kReplayTcWaves waves, replayssm_decode.cu).
template <class In>
__global__ void __launch_bounds__(kReplayWarps * 32, kReplayCtasPerSm)
    replay_tc_kernel(const ReplayProblem p, const detail::SmallDivider group_div) {
  replay_step<__nv_bfloat16, 128, true, In, 2, false, true>(p, group_div);
}

// A checkpoint in its storage format: the generic instantiation's formatted twin (tuning.h
// kReplayFmtCtasPerSm: with its dequantizing loads and the rows' amax reductions it spills more
// at 3 per SM).
__global__ void __launch_bounds__(kReplayWarps * 32, kReplayFmtCtasPerSm)
    replay_fmt_kernel(const ReplayProblem p, const detail::SmallDivider group_div) {
  replay_step<float, 256, false, AnyInput, 1, true>(p, group_div);
}

}  // namespace
}  // namespace deltastate::cuda_backend
