// ReplaySSM speculative verify with the checkpoint's products on tensor cores (ops.h
// ReplayVerifyArgs; issue #37's tensor-core design, docs/REPLAYSSM.md). Part of
// replayssm_verify.cu's translation unit (included there only, after verify.cuh).
//
// The factored algebra of verify.cuh's phase 3f, with the per-row dots S.(E_t*k_t) and
// S.(E_t*q_t) of every draft taken as one [16 rows, 128] x [128, 2T] product per warp on
// mma.sync.m16n8k8 (tf32) instead of element by element on CUDA cores. Shape: an fp32
// checkpoint, K = 128, V a multiple of 128, at most kRvTokChunk drafts a sequence (no cu_seqlens),
// a ring of at most rv_rec_chunk<128>() records, no hi/lo residual ring (the dispatch's rule).
// A CTA of kRvWarps warps owns 128 rows (warp w rows 16w .. 16w + 15) of one (sequence, value
// head). Its time is a chain of load latencies (Nsight Compute: docs/PERFORMANCE.md), so:
//  1. Every load that does not need the ring's cursor goes first: the slot and ring row, the
//     drafts (one warp each: verify.cuh's rv_prepare_token into shared memory, no ring writes
//     yet) and v of the rows. Then the cursor; the checkpoint rows by cp.async, each 16-byte
//     chunk straight to where its warp's mma reads it (below); every committed record's k, g and
//     d entries of the thread loaded at once, then stored to shared memory.
//  2. After one barrier: the drafts' k and g ring records; on a fold the records replayed onto
//     the staged rows element by element (each thread its own chunks, the replay kernel's
//     operations and order) and the rows stored as the checkpoint; the pair coefficients and the
//     drafts' decays E_t (rv_factor_pass; an appending step factors its records).
//  3. After a second barrier each warp forms its tile's dots with the drafts' 2T decayed
//     vectors, adds the factored records' d_j * ck / cq, then runs the drafts in order: the lane
//     holding a draft's dots forms u_t, shares it with its quad, and every lane folds it into its
//     later drafts' dots; the holder stores the output and the d record.
//
// Fragments (PTX ISA, "Matrix fragments for mma.m16n8k8" with .tf32; g = lane / 4, t = lane % 4):
// A 16x8: a0 = A[g][t], a1 = A[g+8][t], a2 = A[g][t+4], a3 = A[g+8][t+4]; B 8x8: b0 = B[t][g],
// b1 = B[t+4][g]; C 16x8: c0 = C[g][2t], c1 = C[g][2t+1], c2 = C[g+8][2t], c3 = C[g+8][2t+1].
// The dot runs over K in any order, so the kernel permutes it: k-steps 2p and 2p + 1 take the
// 16 columns [16p, 16p + 16), lane t's logical columns t and t + 4 of step 2p being physical
// columns 16p + 4t and 16p + 4t + 1, of step 2p + 1 physical 16p + 4t + 2 and + 3. A lane's
// operands for a pair of steps are then one 16-byte chunk per row (chunk 4p + t of rows g and
// g + 8) and one of each B column g. The staged tile keeps each chunk where its reader's lane reads
// it: float4 index P = ((warp * 8 + p) * 2 + h) * 32 + g * 4 + t holds chunk 4p + t of the warp's
// row 8h + g, so a warp's fragment reads are 512 contiguous bytes; thread i copies (and on a fold
// replays) the chunks P = i + 256 j, so its shared-memory writes are contiguous too.
// B column n of n-tile nt is draft 4 nt + n / 2's E_t * k_t (n even) or E_t * q_t (n odd); so C's
// c0 / c1 are sk / sq of draft 4 nt + t for row g, c2 / c3 for row g + 8.
//
// Precision (3xTF32): each operand x splits as hi = x with its low 13 bits cleared and lo = (x -
// hi) likewise, and a product is hi*hi + hi*lo + lo*hi (the lo*lo term and lo's own truncation are
// below 2^-20 of |x y|), accumulated in fp32: a dot's error is of the order of an fp32 dot's.
#pragma once

#include <cstdint>

#include "cuda/async_copy.cuh"

namespace deltastate::cuda_backend {

constexpr int kRvTcRows = 16 * kRvWarps;  // rows per CTA
constexpr int kRvTcK = 128;
constexpr int kRvTcTileBytes = kRvTcRows * kRvTcK * 4;  // the staged checkpoint rows
constexpr int kRvTcSmemDynamic = kRvTcTileBytes + static_cast<int>(sizeof(RvFactorSmem<kRvTcK>));

namespace {

// x = hi + lo, both with the low 13 bits clear (tf32 operands).
__device__ __forceinline__ void split_tf32(float x, uint32_t& hi, uint32_t& lo) {
  hi = __float_as_uint(x) & 0xffffe000u;
  lo = __float_as_uint(x - __uint_as_float(hi)) & 0xffffe000u;
}

// d += a * b on mma.sync.m16n8k8 with tf32 operands.
__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The CTA row (0..127) and 16-byte chunk (0..31) that the staged tile's float4 P holds.
__device__ __forceinline__ void rv_tc_tile_place(int P, int& row, int& chunk) {
  row = (P >> 9) * 16 + ((P >> 5) & 1) * 8 + ((P >> 2) & 7);
  chunk = ((P >> 6) & 7) * 4 + (P & 3);
}

template <int CTAS>
__global__ void __launch_bounds__(kRvWarps * 32, CTAS)
    replay_verify_tc_kernel(const detail::ReplayVerifyProblem p) {
  constexpr int KT = kRvTcK, CROWS = kRvTcRows, RC = rv_rec_chunk<KT>();
  constexpr int kThreads = kRvWarps * 32, kChunks = CROWS * KT / 4 / kThreads;  // per thread
  constexpr int kRecPerThread = RC * KT / kThreads;  // record k (and d) entries per thread
  static_assert(
      ctas_fit_smem(CTAS, static_cast<int>(sizeof(RvSmem<KT, CROWS, RC>)) + kRvTcSmemDynamic),
      "CTAS resident CTAs within an SM's shared memory");
  static_assert(CROWS == KT, "a record's k and d entries share one thread map");
  __shared__ RvSmem<KT, CROWS, RC> sm;
  extern __shared__ __align__(16) unsigned char rv_dynamic[];
  float4* const tile = reinterpret_cast<float4*>(rv_dynamic);
  RvFactorSmem<KT>& fac = *reinterpret_cast<RvFactorSmem<KT>*>(rv_dynamic + kRvTcTileBytes);
  const detail::RecurrentProblem& r = p.r;
  enter_grid(r.pdl_trigger_early);
  const int n = blockIdx.x, hv = blockIdx.y, cta_row0 = blockIdx.z * CROWS;
  const int group = r.HV / r.H, h = hv / group;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  const int V = r.V, L = p.L, tn = static_cast<int>(r.T);  // no cu_seqlens, T <= kRvTokChunk

  // The CTA's time is a chain of load latencies, so every load that does not need the cursor
  // goes first: the slot and ring row, then the drafts (one warp each: q, k normalized, the
  // gate, beta; v of the rows) into shared memory while those are in flight. The drafts' ring
  // records are written once the cursor is known.
  const int64_t slot = detail::index_at(r.indices, r.index_dtype, r.index_stride, n);
  const int64_t rr =
      p.replay ? detail::index_at(p.replay, p.replay_dtype, p.replay_stride, n) : slot;
  for (int j = warp; j < tn; j += kRvWarps)
    rv_prepare_token<KT, CROWS, RC>(p, n, j, h, hv, lane, j, 0, 0, false, false, false, sm,
                                    fac.tg[j]);
  for (int i = threadIdx.x; i < tn * CROWS; i += kThreads) {
    const int j = i / CROWS, lr = i - j * CROWS;
    sm.tv[j][lr] =
        detail::load_float(r.v.ptr, r.v.dtype, detail::head_offset(r.v, n, j, hv) + cta_row0 + lr);
  }
  if (slot <= p.null_block_id) {  // padded: zero outputs, nothing else read or written
    if (p.rows != 2) rv_fill_outputs<CROWS>(r, n, 0, tn, hv, cta_row0, 0.0f);
    return;
  }
  const RvCursor cur = rv_cursor(p, slot, rr);
  const int m = cur.m, base = cur.base;
  if (cur.kind) {
    if (hv == 0 && blockIdx.z == 0 && threadIdx.x == 0)
      record_bad_row(r.errors, detail::kErrOpReplayVerify, cur.kind, n, cur.bad, cur.limit);
    rv_fill_outputs<CROWS>(r, n, 0, tn, hv, cta_row0, bad_row_output());
    return;
  }
  const bool fold = detail::flag_at(p.is_flush, p.flush_dtype, rr);
  if ((p.rows == 1 && fold) || (p.rows == 2 && !fold)) return;  // another call's rows
  float* const ck = static_cast<float*>(r.state.ptr) + slot * r.state.slot_stride +
                    static_cast<int64_t>(hv) * V * KT;
  // The checkpoint rows into the tile (a warp's copy reads 64 bytes of each of 8 rows).
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int P = static_cast<int>(threadIdx.x) + i * kThreads;
    int row, chunk;
    rv_tc_tile_place(P, row, chunk);
    cp_async16(tile + P, ck + static_cast<int64_t>(cta_row0 + row) * KT + 4 * chunk);
  }
  cp_async_commit();
  // The records replayed (a fold) or factored (an appending step): none replayed on a fold the
  // exact-raw launch already made; the drafts' positions still follow all m records.
  const int mh = fold && p.history_folded ? 0 : m, mf = fold ? 0 : m;
  const int gw = r.gate.kda ? KT : 1;
  const int64_t d_base = (rr * r.HV + hv) * L * V, k_base = (rr * r.H + h) * L * KT;
  const int64_t g_base = (rr * r.HV + hv) * L * gw;
  {  // every record entry of the thread in flight at once: entry e = thread + 256 i is k, g
     // and d of record e / 128 at column (and row) e % 128
    float rk[kRecPerThread], rd[kRecPerThread], rg[kRecPerThread];
#pragma unroll
    for (int i = 0; i < kRecPerThread; ++i) {
      const int e = static_cast<int>(threadIdx.x) + i * kThreads, j = e / KT, c = e % KT;
      const int64_t pos = (base + j) % L;
      const bool in = j < mh;
      rk[i] = in ? detail::load_float(p.k_cache, p.k_dtype, k_base + pos * KT + c) : 0.0f;
      rd[i] = in ? detail::load_float(p.d_cache, p.d_dtype, d_base + pos * V + cta_row0 + c) : 0.0f;
      rg[i] = in ? p.g_cache[g_base + pos * gw + (r.gate.kda ? c : 0)] : 0.0f;
    }
#pragma unroll
    for (int i = 0; i < kRecPerThread; ++i) {
      const int e = static_cast<int>(threadIdx.x) + i * kThreads, j = e / KT, c = e % KT;
      if (j < mh) {
        sm.rk[j][c] = rk[i];
        sm.rd[j][c] = rd[i];
        // factored records keep g itself (their decays are exponentiated per pair), replayed
        // ones alpha = e^g
        sm.ra[j][c] = fold ? expf(rg[i]) : rg[i];
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();

  // The drafts' ring records (k by the key head's first value head, g by every value head),
  // dropped past the ring; a fold replays the records onto the thread's own chunks of the tile
  // and stores them as the checkpoint; an appending step factors them.
  if (blockIdx.z == 0) {
    const bool k_writer = hv % group == 0;
    for (int i = threadIdx.x; i < tn * KT; i += kThreads) {
      const int j = i / KT, c = i % KT;
      if (m + j >= L) continue;
      const int64_t pos = (base + m + j) % L;
      if (k_writer) detail::store_float(p.k_cache, p.k_dtype, k_base + pos * KT + c, sm.tk[j][c]);
      if (r.gate.kda) p.g_cache[g_base + pos * KT + c] = fac.tg[j][c];
      else if (c == 0) p.g_cache[g_base + pos] = fac.tg[j][0];
    }
  }
  if (fold && mh > 0) {
#pragma unroll 1
    for (int i = 0; i < kChunks; ++i) {
      const int P = static_cast<int>(threadIdx.x) + i * kThreads;
      int row, chunk;
      rv_tc_tile_place(P, row, chunk);
      float4 x = tile[P];
      for (int j = 0; j < mh; ++j) {
        const float d = sm.rd[j][row];
        const float4 k = *reinterpret_cast<const float4*>(&sm.rk[j][4 * chunk]);
        const float4 a = *reinterpret_cast<const float4*>(&sm.ra[j][4 * chunk]);
        x.x = detail::replay_element(x.x, a.x, d, k.x);
        x.y = detail::replay_element(x.y, a.y, d, k.y);
        x.z = detail::replay_element(x.z, a.z, d, k.z);
        x.w = detail::replay_element(x.w, a.w, d, k.w);
      }
      tile[P] = x;
      *reinterpret_cast<float4*>(ck + static_cast<int64_t>(cta_row0 + row) * KT + 4 * chunk) = x;
    }
  }
  rv_factor_pass<KT, CROWS, RC>(mf, tn, sm, fac);
  __syncthreads();  // the replayed tile, the coefficients and E_t are published

  // The warp's dots: acc[nt] = C of n-tile nt (drafts 4 nt .. 4 nt + 3).
  float acc[2][4];
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[nt][i] = 0.0f;
  const float4* const mine = tile + warp * 8 * 2 * 32 + lane;
#pragma unroll
  for (int pp = 0; pp < 8; ++pp) {
    const float4 x0 = mine[(pp * 2 + 0) * 32], x1 = mine[(pp * 2 + 1) * 32];  // rows g, g + 8
    uint32_t ah[2][4], al[2][4];  // the A fragments of steps 2pp and 2pp + 1, hi and lo
    split_tf32(x0.x, ah[0][0], al[0][0]);
    split_tf32(x1.x, ah[0][1], al[0][1]);
    split_tf32(x0.y, ah[0][2], al[0][2]);
    split_tf32(x1.y, ah[0][3], al[0][3]);
    split_tf32(x0.z, ah[1][0], al[1][0]);
    split_tf32(x1.z, ah[1][1], al[1][1]);
    split_tf32(x0.w, ah[1][2], al[1][2]);
    split_tf32(x1.w, ah[1][3], al[1][3]);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      if (4 * nt >= tn) continue;
      const int t = 4 * nt + (g >> 1);  // B column g's draft
      float4 b = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      if (t < tn) {
        const float4 e = *reinterpret_cast<const float4*>(&sm.ta[t][16 * pp + 4 * t4]);
        const float4 v = *reinterpret_cast<const float4*>((g & 1) ? &sm.tq[t][16 * pp + 4 * t4]
                                                                  : &sm.tk[t][16 * pp + 4 * t4]);
        b = make_float4(e.x * v.x, e.y * v.y, e.z * v.z, e.w * v.w);
      }
      uint32_t bh[4], bl[4];
      split_tf32(b.x, bh[0], bl[0]);
      split_tf32(b.y, bh[1], bl[1]);
      split_tf32(b.z, bh[2], bl[2]);
      split_tf32(b.w, bh[3], bl[3]);
#pragma unroll
      for (int st = 0; st < 2; ++st) {  // the small terms first
        mma_tf32(acc[nt], al[st], bh[2 * st], bh[2 * st + 1]);
        mma_tf32(acc[nt], ah[st], bl[2 * st], bl[2 * st + 1]);
        mma_tf32(acc[nt], ah[st], bh[2 * st], bh[2 * st + 1]);
      }
    }
  }

  // The factored records' terms (appending steps): d_j of rows g, g + 8 times ck / cq of the
  // lane's drafts t and t + 4.
  const int lrow = warp * 16 + g;  // the lane's rows lrow and lrow + 8 within the CTA's
  for (int j = 0; j < mf; ++j) {
    const float d0 = sm.rd[j][lrow], d1 = sm.rd[j][lrow + 8];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const int t = 4 * nt + t4;
      if (t >= tn) continue;
      const float ckj = fac.ck[j][t], cqj = fac.cq[j][t];
      acc[nt][0] = fmaf(d0, ckj, acc[nt][0]);
      acc[nt][1] = fmaf(d0, cqj, acc[nt][1]);
      acc[nt][2] = fmaf(d1, ckj, acc[nt][2]);
      acc[nt][3] = fmaf(d1, cqj, acc[nt][3]);
    }
  }

  // The drafts in order (one copy of the loop: the holder's dots picked by select). Draft t's
  // dots are on lane t % 4 of each quad (n-tile t / 4): it forms u_t of rows g and g + 8, the
  // quad takes them by shuffle and adds u_t's terms to its later drafts' dots; the holder
  // stores o_t and the d record.
  const int row0 = cta_row0 + lrow;  // global rows row0, row0 + 8
  const int quad0 = lane & ~3;
#pragma unroll 1
  for (int t = 0; t < tn; ++t) {
    const bool hi = t >= 4;
    float u[2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const float sk = hi ? acc[1][2 * hh] : acc[0][2 * hh];
      u[hh] = __shfl_sync(0xffffffffu, detail::delta_u(sm.tv[t][lrow + 8 * hh], sk, sm.tbeta[t]),
                          quad0 | (t & 3));
    }
    if (t4 == (t & 3)) {
      const int64_t o_off = detail::head_offset(r.out, n, t, hv);
      const float kq = sm.tkq[t];
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const float sq = hi ? acc[1][2 * hh + 1] : acc[0][2 * hh + 1];
        detail::store_float(r.out.ptr, r.out.dtype, o_off + row0 + 8 * hh,
                            detail::delta_output(sq, u[hh], kq));
        if (m + t < L)
          detail::store_float(p.d_cache, p.d_dtype, d_base + (base + m + t) % L * V + row0 + 8 * hh,
                              u[hh]);
      }
    }
    // u_t's terms in the lane's later drafts (t' = 4 nt' + t4 > t)
#pragma unroll
    for (int nt2 = 0; nt2 < 2; ++nt2) {
      const int t2 = 4 * nt2 + t4;
      if (t2 > t && t2 < tn) {
        const float ckt = fac.ck[mf + t][t2], cqt = fac.cq[mf + t][t2];
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          acc[nt2][2 * hh] = fmaf(u[hh], ckt, acc[nt2][2 * hh]);
          acc[nt2][2 * hh + 1] = fmaf(u[hh], cqt, acc[nt2][2 * hh + 1]);
        }
      }
    }
  }
}

}  // namespace
}  // namespace deltastate::cuda_backend
