// The prep kernel of the Hopper GDN prefill (K = V = 128, q/k/v all bf16 or all fp16): everything
// of a chunk that does not involve the state, in parallel over chunk slots and value heads, into
// the workspace blocks the scan kernel (hopper_scan.cuh) loads with TMA. Part of
// chunk_prefill_hopper.cu's translation unit.
//
// A CTA (grid (chunk slot j, value-head pair), 8 warps, four CTAs an SM at 64 registers) makes
// the blocks of the NV = 2 value heads that share a key head (GVA, HV / H even; one where it is
// odd): k and q are loaded, normed and multiplied once for both (with one value head a CTA this
// was half of the kernel's time: the loads' latency, their address math and the strips). Per
// value head: beta, the cumulative log decay G, the norms rk, rq (rq with the scale, shared), then
// on tensor cores the strictly lower A_ts = beta_t rk_t rk_s e^{G_t - G_s} (k_t . k_s) (warps 0-3
// multiply, scale both heads' A) and P_ts = rq_t rk_s e^{G_t - G_s} (q_t . k_s), s <= t (warps
// 4-7) in pieces of equal work (StripPiece), each decay one exp2; warps 4-7 store each head's P
// and factors in turn while warps 0-3 find each head's T = (I + A)^{-1} on tensor cores
// (tc_inverse.cuh) and store Tb from the inversion's registers.
// Block b = hv * slots + j (hopper_scan.cuh Blocks):
//   Tb = T diag(beta) and P, rounded to the input dtype, [t][s];
//   a_t = rk_t e^{G_t}, b_t = rq_t e^{G_t}, d_s = rk_s e^{G_L - G_s}, gamma = e^{G_L} (fp32).
// Tokens past the sequence's end have beta = rk = rq = 0, so their rows and columns of Tb and P
// and their factors are zeros (the scan kernel relies on it).
#pragma once

#include <cstdint>

#include "cuda/chunk_prefill/hopper_scan.cuh"
#include "cuda/chunk_prefill/split.cuh"
#include "cuda/chunk_prefill/tc_inverse.cuh"
#include "cuda/tuning.h"

namespace deltastate::cuda_backend::prefill::hopper {

constexpr float kLog2e = 1.4426950408889634f;  // the preps keep G in log2 units for exp2

struct PrepLayout {
  static constexpr int C = kC, D = kD;
  static constexpr int NW = 8, THREADS = NW * 32;
  static constexpr int NV = 2;       // value heads a CTA (a GVA pair)
  static constexpr int NK = D / 16;  // k-steps of K K^T, Q K^T (the strips)
  static constexpr int LDI = D + 8, LDB = TcInverse::LDH;
  // k and q [C][LDI]; once the strips' products are in registers the region holds both heads'
  // A (fp16 blocks below the diagonal, fp32 diagonal blocks), T's fp16 blocks and P (16-bit) of
  // the head in turn. Then the shared norms rk, rq [2][C] and each head's scalars [7][C] fp32.
  static constexpr int OFF_K = 0, OFF_Q = OFF_K + C * LDI * 2;
  static constexpr int A_BYTES = TcInverse::H_BYTES + TcInverse::AD_BYTES;  // one head's A
  static constexpr int OFF_AH = 0, OFF_AD = OFF_AH + TcInverse::H_BYTES;    // head v: + v A_BYTES
  static constexpr int OFF_TH = NV * A_BYTES, OFF_P = OFF_TH + TcInverse::H_BYTES,
                       REGION = OFF_P + C * LDB * 2 > 2 * C *LDI * 2 ? OFF_P + C *LDB * 2
                                                                     : 2 * C *LDI * 2;
  static constexpr int OFF_SC = REGION, SCALARS = 7;  // per head: beta G a b d GL G2
  static constexpr int SMEM = OFF_SC + (2 + NV * SCALARS) * C * 4;
  static_assert(OFF_TH % 16 == 0 && OFF_P % 16 == 0 && OFF_SC % 16 == 0 && A_BYTES % 16 == 0,
                "16-byte aligned regions");
  static_assert(ctas_fit_smem(4, SMEM), "four CTAs an SM");
};

// The strips of K K^T (warps 0-3) and Q K^T (warps 4-7) in pieces of equal work: a strip r
// (rows 16r ..) has r + 1 blocks of 16 columns on or below the diagonal, 10 in all, so each warp
// takes at most 3 (one or two runs of blocks: strip r, first block b, count n) instead of strip
// 3's 4 against strip 0's 1 (the barrier after the strips waits for the slowest warp).
struct StripPiece {
  int r0, b0, n0, r1, b1, n1;
};
__device__ __forceinline__ StripPiece strip_piece(int w) {
  switch (w) {
    case 0:
      return {0, 0, 1, 3, 0, 1};
    case 1:
      return {3, 1, 3, 0, 0, 0};
    case 2:
      return {1, 0, 2, 2, 0, 1};
    default:
      return {2, 1, 2, 0, 0, 0};
  }
}

// The inversion's barrier: warps 0-3 only (warps 4-7 store P meanwhile).
struct PrepInverseSync {
  __device__ __forceinline__ void operator()() const { bar_sync(1, 128); }
};

// Warps 4-7's barrier while warps 0-3 invert.
__device__ __forceinline__ void prep_p_sync() { bar_sync(2, 128); }

// rk (the first half of the NT threads) and rq (the second) of the chunk's k and q rows
// [C][D + 8] in shared memory, at NT = 256 two threads a row, 64 elements each, joined by one
// shuffle (a warp a token would wait on five shuffles per norm, 16 tokens in turn); the two halves
// start 64 bytes apart in the bank cycle, so the pair's loads do not conflict. At NT = 128 a
// thread a row (consecutive rows are 272 bytes apart: a quarter-warp's 16-byte loads hit distinct
// banks). Rows at or past cv get 0.
template <class In, int NT = 256>
__device__ __forceinline__ void prep_norms(const ChunkPrefillProblem& p, const In* Ks, const In* Qs,
                                           int cv, int tid, float* sRk, float* sRq) {
  constexpr int D = kD, LDI = D + 8, LANES = NT / 128, PIECES = D / 8 / LANES;
  static_assert(LANES == 1 || LANES == 2, "one or two threads a row");
  const bool is_q = tid >= NT / 2;
  const int r = (tid % (NT / 2)) / LANES, half = tid % LANES;
  const In* row = (is_q ? Qs : Ks) + r * LDI + (D / LANES) * half;
  float sum = 0.0f;
#pragma unroll
  for (int j = 0; j < PIECES; ++j) {
    const int jj = (j + (PIECES / 2) * half) % PIECES;
    const uint4 w = *reinterpret_cast<const uint4*>(row + 8 * jj);
    const uint32_t u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 x = Mma<In>::unpack(u[e]);
      sum = fmaf(x.x, x.x, sum);
      sum = fmaf(x.y, x.y, sum);
    }
  }
  if constexpr (LANES == 2) sum += __shfl_xor_sync(0xffffffffu, sum, 1);
  if (half == 0) (is_q ? sRq : sRk)[r] = qk_factor(p, sum, r < cv, is_q ? p.scale : 1.0f);
}

// A block's P from Pb [C][LDB] (16-bit) to `dst` [C][C], zeros above the diagonal blocks, by the
// `nt` threads of index i0 = 0.. (16-byte pieces).
template <class In>
__device__ __forceinline__ void store_p_block(void* dst, const In* Pb, int i0, int nt) {
  constexpr int C = kC, LDB = TcInverse::LDH;
  for (int i = i0; i < C * (C / 8); i += nt) {  // row t, columns 8 c8 ..
    const int t = i / (C / 8), c8 = 8 * (i % (C / 8));
    reinterpret_cast<uint4*>(dst)[i] = c8 / 16 <= t / 16
                                           ? *reinterpret_cast<const uint4*>(Pb + t * LDB + c8)
                                           : make_uint4(0, 0, 0, 0);
  }
}

// T diag(beta)'s blocks above the diagonal in `tb` [C][C] (16-bit) as zeros, by 128 threads:
// the rows of block strip r have 16 (3 - r) columns there, 12 + 8 + 4 pieces of 8.
template <class In>
__device__ __forceinline__ void store_tb_upper_zeros(In* tb, int tid) {
  constexpr int C = kC;
  for (int i = tid; i < 16 * 12; i += 128) {
    const int r = i < 16 * 6 ? 0 : i < 16 * 10 ? 1 : 2;
    const int j = i - (r == 0 ? 0 : r == 1 ? 16 * 6 : 16 * 10), per = 2 * (3 - r);
    const int t = 16 * r + j / per, c8 = 16 * (r + 1) + 8 * (j % per);
    *reinterpret_cast<uint4*>(tb + t * C + c8) = make_uint4(0, 0, 0, 0);
  }
}

// The value heads of blockIdx.y: `nv` (1 or 2) consecutive ones sharing a key head.
template <class In>
__global__ void __launch_bounds__(PrepLayout::THREADS, 4)
    chunk_prefill_hopper_prep_kernel(const ChunkPrefillProblem p, int64_t slots, int nv) {
  using L = PrepLayout;
  using M = Mma<In>;
  constexpr int C = L::C, D = L::D, NT = L::THREADS, LDI = L::LDI, LDB = L::LDB;
  enter_grid(false);
  const SplitChunk ch = split_locate(p, blockIdx.x);
  if (ch.n < 0) return;
  const int hv0 = static_cast<int>(blockIdx.y) * nv;
  const Seq s = resolve_sequence(p, ch.n * p.HV + hv0);  // s.h, the sequence: both heads'
  if (s.padded) return;  // the scan kernel writes its zeros; nothing reads its blocks
  extern __shared__ __align__(16) unsigned char smem[];
  In* const Ks = reinterpret_cast<In*>(smem + L::OFF_K);
  In* const Qs = reinterpret_cast<In*>(smem + L::OFF_Q);
  __half* const Th = reinterpret_cast<__half*>(smem + L::OFF_TH);
  In* const Pb = reinterpret_cast<In*>(smem + L::OFF_P);
  float* const sRk = reinterpret_cast<float*>(smem + L::OFF_SC);
  float* const sRq = sRk + C;
  // head v's A and scalars
  auto Ah = [&](int v) { return reinterpret_cast<__half*>(smem + L::OFF_AH + v * L::A_BYTES); };
  auto Ad = [&](int v) { return reinterpret_cast<float*>(smem + L::OFF_AD + v * L::A_BYTES); };
  auto sc = [&](int v, int r) { return sRk + (2 + v * L::SCALARS + r) * C; };
  enum { kBeta, kG, kA, kB, kD, kGL, kG2 };  // a_t = rk_t e^{G_t}, b_t, d_s, G_L, G log2(e)
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t c0 = ch.ci * C;
  const int cv = static_cast<int>(s.len - c0 < C ? s.len - c0 : C);

  split_load_rows<D>(Ks, p.k, static_cast<const In*>(p.k.ptr), s, s.h, c0, cv, tid, NT);
  split_load_rows<D>(Qs, p.q, static_cast<const In*>(p.q.ptr), s, s.h, c0, cv, tid, NT);
  cp_async_commit_group();
  if (warp < nv) {  // head `warp`: beta and the decay's scan over the chunk
    Seq sv = s;
    sv.hv = hv0 + warp;
    const float A_log =
        p.gate.A_log ? detail::load_float(p.gate.A_log, p.gate.A_log_dtype, sv.hv) : 0.0f;
    chunk_beta_and_decay<false>(p, sv, c0, cv, A_log, lane, sc(warp, kBeta), sc(warp, kG),
                                sc(warp, kGL));
  }
  cp_async_wait_group<0>();
  __syncthreads();
  prep_norms(p, Ks, Qs, cv, tid, sRk, sRq);
  __syncthreads();
  if (tid < nv * C) {  // head tid / C's per-token factors
    const int v = tid / C, t = tid % C;
    const float G = sc(v, kG)[t], e = expf(G);
    sc(v, kA)[t] = sRk[t] * e;
    sc(v, kB)[t] = sRq[t] * e;
    sc(v, kD)[t] = sRk[t] * expf(sc(v, kGL)[0] - G);
    sc(v, kG2)[t] = G * kLog2e;
  }
  // Piece warp % 4 of K K^T (warps 0-3) or Q K^T (4-7), up to 3 blocks of 16 columns (slot i:
  // of its first strip while i < n0); the factors are read after the barrier.
  const bool is_p = warp >= 4;
  const StripPiece pc = strip_piece(warp % 4);
  const int nslots = pc.n0 + pc.n1;
  const In* const X = is_p ? Qs : Ks;
  float acc[3][2][4];
#pragma unroll
  for (int i = 0; i < 3; ++i)
#pragma unroll
    for (int n = 0; n < 2; ++n) acc[i][n][0] = acc[i][n][1] = acc[i][n][2] = acc[i][n][3] = 0.0f;
#pragma unroll
  for (int kk = 0; kk < L::NK; ++kk) {
    uint32_t a0[4], a1[4];
    ldsm_x4(a0, X + a_tile(lane, 16 * pc.r0, 16 * kk, LDI));
    if (pc.n1 > 0) ldsm_x4(a1, X + a_tile(lane, 16 * pc.r1, 16 * kk, LDI));
#pragma unroll
    for (int i = 0; i < 3; ++i) {
      if (i < nslots) {
        const bool first = i < pc.n0;
        const int blk = first ? pc.b0 + i : pc.b1 + i - pc.n0;
        uint32_t a[4], b[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) a[e] = first ? a0[e] : a1[e];
        ldsm_x4(b, Ks + b_pair(lane, 16 * blk, 16 * kk, LDI));
        M::mma(acc[i][0], a, b[0], b[1]);
        M::mma(acc[i][1], a, b[2], b[3]);
      }
    }
  }
  __syncthreads();  // k and q are read: their space takes A, T and P

  // Head v's scaled products: A_ts = beta_t rk_t rk_s e^{G_t - G_s} x (s < t): blocks below the
  // diagonal in fp16 (Ah), the diagonal block in fp32 (Ad); P_ts = rq_t rk_s e^{G_t - G_s} x
  // (s <= t) in the input dtype (Pb). Blocks above the diagonal are never written (their stores
  // write zeros).
  auto scale = [&](int v) {
    const float* const beta = sc(v, kBeta);
    const float* const G2 = sc(v, kG2);
    __half* const ah = Ah(v);
    float* const ad = Ad(v);
    const int g8 = lane >> 2, q4 = lane & 3;
#pragma unroll
    for (int i = 0; i < 3; ++i) {
      if (i < nslots) {
        const bool first = i < pc.n0;
        const int r = first ? pc.r0 : pc.r1, blk = first ? pc.b0 + i : pc.b1 + i - pc.n0;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int t = 16 * r + g8 + 8 * h;
          const float ft = is_p ? sRq[t] : beta[t] * sRk[t], gt = G2[t];
#pragma unroll
          for (int n = 0; n < 2; ++n) {
            const int sc0 = 16 * blk + 8 * n + 2 * q4;
            float x[2];
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int sj = sc0 + e;
              const bool keep = is_p ? sj <= t : sj < t;
              x[e] = keep ? ft * sRk[sj] * exp2f(gt - G2[sj]) * acc[i][n][2 * h + e] : 0.0f;
            }
            if (is_p) {
              *reinterpret_cast<uint32_t*>(Pb + t * LDB + sc0) = M::pack(x[0], x[1]);
            } else if (blk < r) {
              *reinterpret_cast<uint32_t*>(ah + t * LDB + sc0) = Mma<__half>::pack(x[0], x[1]);
            } else {
              // Ad [4][16][LDD]: block r's row t - 16 r is row t of the whole
              *reinterpret_cast<float2*>(ad + t * TcInverse::LDD + sc0 - 16 * r) =
                  make_float2(x[0], x[1]);
            }
          }
        }
      }
    }
  };

  if (is_p) {  // warps 4-7: each head's P and factors in turn, while warps 0-3 invert
    const int pt = tid - NT / 2;
    for (int v = 0; v < nv; ++v) {
      if (v > 0) prep_p_sync();  // head v - 1's P is read
      scale(v);
      prep_p_sync();
      const BlockPtrs out =
          block_ptrs(p.workspace, slots * p.HV, int64_t{hv0 + v} * slots + blockIdx.x);
      store_p_block(out.p, Pb, pt, NT / 2);
      for (int i = pt; i < 4 * C; i += NT / 2) {
        const int r = i / C, t = i % C;
        out.scal[i] = r == 0   ? sc(v, kA)[t]
                      : r == 1 ? sc(v, kB)[t]
                      : r == 2 ? sc(v, kD)[t]
                               : (t == 0 ? expf(sc(v, kGL)[0]) : 0.0f);
      }
    }
    return;
  }
  // warps 0-3: both heads' A while the products are in registers; then per head T =
  // (I + A)^{-1} and Tb = T diag(beta) in the input dtype, stored from the inversion's pairs
  // (a row's 4-byte pairs: the L2 merges them), the blocks above the diagonal as zeros.
  for (int v = 0; v < nv; ++v) scale(v);
  const PrepInverseSync sync;
  sync();
  for (int v = 0; v < nv; ++v) {
    if (v > 0) sync();  // head v - 1's T blocks are read
    const float* const beta = sc(v, kBeta);
    In* const tb = static_cast<In*>(
        block_ptrs(p.workspace, slots * p.HV, int64_t{hv0 + v} * slots + blockIdx.x).t);
    invert_unit_lower_tc(
        Ah(v), Ad(v), Th, warp, lane, sync, [&](int t, int s0, float x0, float x1) {
          *reinterpret_cast<uint32_t*>(tb + t * C + s0) = M::pack(x0 * beta[s0], x1 * beta[s0 + 1]);
        });
    store_tb_upper_zeros(tb, tid);
  }
}

}  // namespace deltastate::cuda_backend::prefill::hopper
