// The prep kernel of the Hopper GDN prefill (K = V = 128, q/k/v all bf16 or all fp16): everything
// of a chunk that does not involve the state, in parallel over (chunk slot, value head), into the
// workspace blocks the scan kernel (hopper_scan.cuh) loads with TMA. Part of
// chunk_prefill_hopper.cu's translation unit.
//
// Per chunk (grid (chunk slot j, value head hv), 8 warps; chunk slots as split.cuh's; four CTAs
// an SM at 64 registers and no spills: the kernel is latency-bound, and a fourth CTA hides more
// of its latency than three at 75 registers, docs/PERFORMANCE.md): beta, the cumulative log decay
// G, the norms rk, rq (rq with the scale), then on tensor cores the strictly lower A_ts = beta_t
// rk_t rk_s e^{G_t - G_s} (k_t . k_s) (warps 0-3) and P_ts = rq_t rk_s e^{G_t - G_s} (q_t . k_s), s
// <= t (warps 4-7) in pieces of equal work (StripPiece), each decay one exp2; warps 4-7 store P and
// the factors while warps 0-3 find T = (I + A)^{-1} on tensor cores (tc_inverse.cuh) and store Tb.
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

namespace deltastate::cuda_backend::prefill::hopper {

struct PrepLayout {
  static constexpr int C = kC, D = kD;
  static constexpr int NW = 8, THREADS = NW * 32;
  static constexpr int NK = D / 16;  // k-steps of K K^T, Q K^T (strip_products)
  static constexpr int LDI = D + 8, LDB = TcInverse::LDH, LDT = 0;
  // k and q [C][LDI]; once the strips' products are in registers their space holds A (fp16),
  // T's fp16 blocks, P (16-bit) and A's fp32 diagonal blocks; then Tb [C][LDB] (16-bit) and the
  // per-token scalars [9][C] fp32.
  static constexpr int OFF_K = 0, OFF_Q = OFF_K + C * LDI * 2, OFF_TB = OFF_Q + C * LDI * 2,
                       OFF_SC = OFF_TB + C * LDB * 2, SMEM = OFF_SC + 9 * C * 4;
  static constexpr int OFF_AH = 0, OFF_TH = OFF_AH + TcInverse::H_BYTES,
                       OFF_P = OFF_TH + TcInverse::H_BYTES, OFF_AD = OFF_P + C * LDB * 2;
  static_assert(OFF_AD + TcInverse::AD_BYTES <= OFF_TB, "A, T, P in the space of k and q");
  static_assert(OFF_TB % 16 == 0 && OFF_SC % 16 == 0 && OFF_P % 16 == 0 && OFF_AD % 16 == 0,
                "16-byte aligned regions");
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

template <class In>
__global__ void __launch_bounds__(PrepLayout::THREADS, 4)
    chunk_prefill_hopper_prep_kernel(const ChunkPrefillProblem p, int64_t slots) {
  using L = PrepLayout;
  using M = Mma<In>;
  constexpr int C = L::C, D = L::D, NT = L::THREADS, LDI = L::LDI, LDB = L::LDB;
  enter_grid(false);
  const SplitChunk ch = split_locate(p, blockIdx.x);
  if (ch.n < 0) return;
  const int hv = static_cast<int>(blockIdx.y);
  const Seq s = resolve_sequence(p, ch.n * p.HV + hv);
  if (s.padded) return;  // the scan kernel writes its zeros; nothing reads its blocks
  extern __shared__ __align__(16) unsigned char smem[];
  In* const Ks = reinterpret_cast<In*>(smem + L::OFF_K);
  In* const Qs = reinterpret_cast<In*>(smem + L::OFF_Q);
  __half* const Ah = reinterpret_cast<__half*>(smem + L::OFF_AH);
  __half* const Th = reinterpret_cast<__half*>(smem + L::OFF_TH);
  In* const Pb = reinterpret_cast<In*>(smem + L::OFF_P);
  float* const Ad = reinterpret_cast<float*>(smem + L::OFF_AD);
  In* const Tb = reinterpret_cast<In*>(smem + L::OFF_TB);
  float* const sG = reinterpret_cast<float*>(smem + L::OFF_SC);
  float* const sBeta = sG + C;
  float* const sRk = sG + 2 * C;
  float* const sRq = sG + 3 * C;
  float* const sA = sG + 4 * C;  // a_t = rk_t e^{G_t}
  float* const sB = sG + 5 * C;  // b_t = rq_t e^{G_t}
  float* const sD = sG + 6 * C;  // d_s = rk_s e^{G_L - G_s}
  float* const sGL = sG + 7 * C;
  float* const sG2 = sG + 8 * C;  // G log2(e): the pairwise decays as one exp2 each
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t c0 = ch.ci * C;
  const int cv = static_cast<int>(s.len - c0 < C ? s.len - c0 : C);

  split_load_rows<D>(Ks, p.k, static_cast<const In*>(p.k.ptr), s, s.h, c0, cv, tid, NT);
  split_load_rows<D>(Qs, p.q, static_cast<const In*>(p.q.ptr), s, s.h, c0, cv, tid, NT);
  cp_async_commit_group();
  if (warp == 0) {  // beta and the decay's scan over the chunk
    const float A_log =
        p.gate.A_log ? detail::load_float(p.gate.A_log, p.gate.A_log_dtype, s.hv) : 0.0f;
    chunk_beta_and_decay<false>(p, s, c0, cv, A_log, lane, sBeta, sG, sGL);
  }
  cp_async_wait_group<0>();
  __syncthreads();
  {  // rk (threads 0-127) and rq (128-255): two threads a row, 64 elements each, joined by one
    // shuffle (a warp a token would wait on five shuffles per norm, 16 tokens in turn). The two
    // halves start 64 bytes apart in the bank cycle, so the pair's loads do not conflict.
    const bool is_q = tid >= NT / 2;
    const int r = (tid % (NT / 2)) / 2, half = tid % 2;
    const In* row = (is_q ? Qs : Ks) + r * LDI + (D / 2) * half;
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < D / 16; ++j) {
      const int jj = (j + 4 * half) % (D / 16);
      const uint4 w = *reinterpret_cast<const uint4*>(row + 8 * jj);
      const uint32_t u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 x = M::unpack(u[e]);
        sum = fmaf(x.x, x.x, sum);
        sum = fmaf(x.y, x.y, sum);
      }
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    if (half == 0) (is_q ? sRq : sRk)[r] = qk_factor(p, sum, r < cv, is_q ? p.scale : 1.0f);
  }
  __syncthreads();
  if (tid < C) {  // the per-token factors
    const int t = tid;
    const float e = expf(sG[t]);
    sA[t] = sRk[t] * e;
    sB[t] = sRq[t] * e;
    sD[t] = sRk[t] * expf(sGL[0] - sG[t]);
    sG2[t] = sG[t] * 1.4426950408889634f;
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
  {  // scaled: A_ts = beta_t rk_t rk_s e^{G_t - G_s} x (s < t): blocks below the diagonal in
    // fp16 (Ah), the diagonal block in fp32 (Ad); P_ts = rq_t rk_s e^{G_t - G_s} x (s <= t) in the
    // input dtype. Blocks above the diagonal are never written (their stores write zeros).
    const int g8 = lane >> 2, q4 = lane & 3;
#pragma unroll
    for (int i = 0; i < 3; ++i) {
      if (i < nslots) {
        const bool first = i < pc.n0;
        const int r = first ? pc.r0 : pc.r1, blk = first ? pc.b0 + i : pc.b1 + i - pc.n0;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int t = 16 * r + g8 + 8 * h;
          const float ft = is_p ? sRq[t] : sBeta[t] * sRk[t], gt = sG2[t];
#pragma unroll
          for (int n = 0; n < 2; ++n) {
            const int sc = 16 * blk + 8 * n + 2 * q4;
            float x[2];
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int sj = sc + e;
              const bool keep = is_p ? sj <= t : sj < t;
              x[e] = keep ? ft * sRk[sj] * exp2f(gt - sG2[sj]) * acc[i][n][2 * h + e] : 0.0f;
            }
            if (is_p) {
              *reinterpret_cast<uint32_t*>(Pb + t * LDB + sc) = M::pack(x[0], x[1]);
            } else if (blk < r) {
              *reinterpret_cast<uint32_t*>(Ah + t * LDB + sc) = Mma<__half>::pack(x[0], x[1]);
            } else {
              // Ad [4][16][LDD]: block r's row t - 16 r is row t of the whole
              *reinterpret_cast<float2*>(Ad + t * TcInverse::LDD + sc - 16 * r) =
                  make_float2(x[0], x[1]);
            }
          }
        }
      }
    }
  }
  __syncthreads();

  const BlockPtrs out = block_ptrs(p.workspace, slots * p.HV, int64_t{hv} * slots + blockIdx.x);
  if (warp >= 4) {  // P and the factors, while warps 0-3 invert
    const int pt = tid - NT / 2;
    for (int i = pt; i < C * (C / 8); i += NT / 2) {  // 16-byte pieces: row t, columns 8 c8 ..
      const int t = i / (C / 8), c8 = 8 * (i % (C / 8));
      reinterpret_cast<uint4*>(out.p)[i] = c8 / 16 <= t / 16
                                               ? *reinterpret_cast<const uint4*>(Pb + t * LDB + c8)
                                               : make_uint4(0, 0, 0, 0);  // above the diagonal
    }
    for (int i = pt; i < 4 * C; i += NT / 2) {
      const int r = i / C, t = i % C;
      out.scal[i] = r == 0   ? sA[t]
                    : r == 1 ? sB[t]
                    : r == 2 ? sD[t]
                             : (t == 0 ? expf(sGL[0]) : 0.0f);
    }
    return;
  }
  // T = (I + A)^{-1} (warps 0-3); Tb = T diag(beta) in the input dtype
  const PrepInverseSync sync;
  invert_unit_lower_tc(Ah, Ad, Th, warp, lane, sync, [&](int t, int s0, float x0, float x1) {
    *reinterpret_cast<uint32_t*>(Tb + t * LDB + s0) = M::pack(x0 * sBeta[s0], x1 * sBeta[s0 + 1]);
  });
  sync();
  for (int i = tid; i < C * (C / 8); i += NT / 2) {  // blocks above the diagonal: zeros
    const int t = i / (C / 8), c8 = 8 * (i % (C / 8));
    reinterpret_cast<uint4*>(out.t)[i] = c8 / 16 <= t / 16
                                             ? *reinterpret_cast<const uint4*>(Tb + t * LDB + c8)
                                             : make_uint4(0, 0, 0, 0);
  }
}

}  // namespace deltastate::cuda_backend::prefill::hopper
