// The split design of tensor-core chunked prefill (GDN and KDA), K = V = D in {64, 128}, q/k/v
// all bf16 or all fp16: three kernels, of which only the middle one walks a sequence's chunks in
// order. Part of chunk_prefill.cu's translation unit; the math helpers are tc_kernel.cuh's.
//
// ---- design ------------------------------------------------------------------------------------
// The fused kernel (tc_kernel.cuh) runs one CTA per (sequence, value head) through every chunk,
// so few long sequences leave most SMs idle. Here the work that does not involve the state runs
// in parallel over (chunk, value head), and the sequential pass keeps only two products per chunk
// (the chunk algebra and its names are src/cpu/chunk_prefill.cpp's and tc_kernel.cuh's):
//  1. chunk_prefill_split_intra_kernel, grid (chunk slot, value head), D/16 warps: G, rk, the
//     strictly lower A (K K^T on tensor cores as in the fused kernel), T = (I + A)^{-1} (the fused
//     kernel's blocked inverse), then the WY factors
//       U^T = V^T (T diag(beta))^T      [D, C] fp32   (v as the MMA's M, as the fused v'^T)
//       W   = T diag(beta kf) K         [C, D] hi + lo 16-bit pairs   (kf = rk e^{G})
//     with T diag(beta) and T diag(beta kf) split into hi + lo pairs (two products each against
//     the raw, exact inputs), so U and W are as exact as fp32; and the per-token G, rk,
//     d = rk e^{G_L - G} and e^{G_L}.
//  2. chunk_prefill_split_state_kernel, grid (sequence, value head, row tile of kSplitRows state
//     rows), two warps: the fp32 state rows on chip across the chunks, as in the fused kernel;
//     per chunk
//       S_c = bf16(S) (the chunk-start state, 16-bit: the output's product rounds S to the input
//             dtype there, as the fused kernel's S Q^T does, so 16 bits lose nothing more)
//       v'^T = U^T - S_c W^T            (W hi + lo: the fused kernel's Y^T Tb^T to fp32)
//       S = S e^{G_L} + (v' d)^T K      (the fused kernel's update, same operands and rounding)
//     storing S_c and bf16(v'^T) to the workspace; checkpoints and final states as the fused
//     kernel (sequence.cuh), and the skip of padded or bad-slot sequences (the outputs' zeros or
//     NaN are written here; a status word per sequence tells kernel 3 to leave them).
//  3. chunk_prefill_split_output_kernel, grid (chunk slot, value head), D/16 warps:
//       o^T = diag(qf) (S_c Q^T) + bf16(v'^T) P^T,  qf = rq e^{G},
//       P_ts = rq_t rk_s e^{G_t - G_s} (q_t . k_s), s <= t  (bf16, the fused kernel's strips)
//     staged through shared memory and stored in the output dtype.
// Every rounding point is the fused kernel's, so its error bounds apply unchanged.
//
// KDA (template parameter KDA; tc_kernel.cuh's KDA paragraph has the formulas): per-channel G
// [C][D] (fp32, the fused kernel's sequential scan per channel), and
//  1. A_ts = beta_t sum_c k^_t k^_s e^{G_t - G_s} and P_ts = sum_c q^_t k^_s e^{G_t - G_s}
//     pairwise on CUDA cores (the fused kernel's kda_pairs: factored 4x4 tiles, no factor above
//     1), T as for GDN, U^T as for GDN, W = T diag(beta) (k^ e^{G}) (A = T diag(beta) hi + lo,
//     B = bf16(k^ e^{G}), the fused kernel's S K^T operand); stored besides: bf16(k^ e^{G_L - G})
//     and bf16(q^ e^{G}) [C][D] (rounded once, as the fused kernel rounds them), bf16(P) [C][C]
//     and e^{G_L} [D]. P is made here, not in kernel 3: kda_pairs computes each pair's
//     exponentials once for both A and P (the exponentials bound it), and kernel 3 then needs
//     neither G nor the transposed k^, q^ (three fp32 [D][C] arrays in shared memory).
//  2. S = S diag(e^{G_L}) + bf16(v')^T bf16(k^ e^{G_L - G}) (d = 1; the decay per column).
//  3. o^T = S_c bf16(q^ e^{G})^T + bf16(v'^T) P^T (qf = 1).
// Kernel 1 holds q, k, v and the transposed G, k^, q^: one CTA per SM at D = 128.
//
// Chunk slots. A sequence's chunks occupy consecutive slots from off(n) = cu_seqlens[n] / C + n
// (without cu_seqlens: n * ceil(T / C)); off(n+1) - off(n) >= ceil(len_n / C), so the slots
// [0, T / C + N) hold every chunk, a few of them holes (their CTAs return at once). Kernels 1 and
// 3 find their sequence by a binary search of off() over cu_seqlens on the device; no index data
// is read on the host. Workspace (split_bytes, chunk_prefill.cu): a status word per sequence,
// then one block per (chunk slot, value head) of Wh, Wl, U^T, v'^T, S_c and the scalars (KDA:
// and the decayed keys and queries, and P).
#pragma once

#include <cstdint>

#include "cuda/chunk_prefill/tc_kernel.cuh"

namespace deltastate::cuda_backend::prefill {

// State rows per state-pass CTA (two warps): D / kSplitRows CTAs per (sequence, value head).
constexpr int kSplitRows = 32;

template <int D, bool KDA = false>
struct SplitLayout {
  static constexpr int C = detail::ChunkPrefillProblem::kChunk;  // 64
  static constexpr int NW = D / 16;                              // warps of kernels 1 and 3
  static constexpr int THREADS = NW * 32;
  static constexpr int NJ = D / 8, NK = D / 16;
  static constexpr int LDI = D + 8, LDT = C + 4, LDB = C + 8, LDO = D + 4, LDX = 36, LDG = C + 1;
  // ---- workspace block of one (chunk slot, value head), bytes
  static constexpr int64_t WS_W = int64_t{C} * D * 2;   // Wh, Wl: [C][D] 16-bit each
  static constexpr int64_t WS_U = int64_t{D} * C * 4;   // U^T [D][C] fp32
  static constexpr int64_t WS_VN = int64_t{D} * C * 2;  // v'^T [D][C] 16-bit
  static constexpr int64_t WS_S = int64_t{D} * D * 2;   // S_c [D][D] 16-bit
  // fp32 [4][C]: G, rk, d, e^{G_L} (GDN); KDA: e^{G_L} [D] from row 2 (D <= 2C)
  static constexpr int64_t WS_SC = 4 * C * 4;
  static constexpr int64_t B_WH = 0, B_WL = WS_W, B_U = 2 * WS_W, B_VN = B_U + WS_U,
                           B_S = B_VN + WS_VN, B_SC = B_S + WS_S, GDN_BLOCK = B_SC + WS_SC;
  // KDA: the decayed keys of the update k^ e^{G_L - G} and queries q^ e^{G} [C][D], P [C][C],
  // all 16-bit
  static constexpr int64_t B_KD = GDN_BLOCK, B_QG = B_KD + WS_W, B_P = B_QG + WS_W,
                           BLOCK = KDA ? B_P + int64_t{C} * C * 2 : GDN_BLOCK;
  static_assert(BLOCK % 16 == 0 && GDN_BLOCK % 16 == 0, "16-byte aligned blocks");
  static_assert(D <= 2 * C, "KDA's e^{G_L} fits rows 2 and 3 of the scalars");
  // ---- kernel 1 shared memory (KDA: Pb in GDN's Tkh, and q, the transposed G, k^, q^ after the
  // per-token scalars)
  struct Intra {
    static constexpr int LDT = SplitLayout::LDT, LDX = SplitLayout::LDX, LDB = SplitLayout::LDB,
                         LDG = SplitLayout::LDG, NJ = SplitLayout::NJ,
                         THREADS = SplitLayout::THREADS;  // invert_unit_lower's, kda_pairs' names
    static constexpr int OFF_K = 0, OFF_V = OFF_K + C * LDI * 2, OFF_TF = OFF_V + C * LDI * 2,
                         OFF_X = OFF_TF + C * LDT * 4, OFF_TB = OFF_X + 32 * LDX * 4,
                         OFF_TL = OFF_TB + C * LDB * 2, OFF_TKH = OFF_TL + C * LDB * 2,
                         OFF_TKL = OFF_TKH + C * LDB * 2, OFF_SC = OFF_TKL + C * LDB * 2,
                         OFF_Q = OFF_SC + (KDA ? 10 : 8) * C * 4,
                         OFF_GT = OFF_Q + (KDA ? C * LDI * 2 : 0),
                         SMEM = OFF_GT + (KDA ? 3 * D * LDG * 4 : 0);
    static_assert(OFF_Q % 16 == 0 && OFF_GT % 16 == 0, "16-byte aligned regions");
  };
  // ---- kernel 2 shared memory (two buffers of: Wh, Wl, k (KDA: k^ e^{G_L - G}) [C][LDI] 16-bit;
  // U^T rows [R][LDU] fp32; d and e^{G_L} [2][C] fp32 (KDA: e^{G_L} [D]))
  struct State {
    static constexpr int R = kSplitRows, SW = R / 16, THREADS = SW * 32, LDU = C + 4;
    static constexpr int OFF_WH = 0, OFF_WL = C * LDI * 2, OFF_K = 2 * C * LDI * 2,
                         OFF_U = 3 * C * LDI * 2, OFF_D = OFF_U + R * LDU * 4,
                         BUF = OFF_D + 2 * C * 4, SMEM = 2 * BUF;
    static_assert(BUF % 16 == 0 && OFF_U % 16 == 0, "16-byte aligned regions");
  };
  // ---- kernel 3 shared memory: q (KDA: q^ e^{G}), k [C][LDI]; P [C][LDB]; output staging
  // [C][LDO] fp32; G, rk, rq, qf [C]
  struct Out {
    static constexpr int OFF_Q = 0, OFF_K = C * LDI * 2, OFF_P = 2 * C * LDI * 2,
                         OFF_O = OFF_P + C * LDB * 2, OFF_SC = OFF_O + C * LDO * 4,
                         SMEM = OFF_SC + 4 * C * 4;
  };
  static_assert(Intra::OFF_TF % 16 == 0 && Intra::OFF_TB % 16 == 0 && Intra::OFF_TKH % 16 == 0 &&
                    Out::OFF_P % 16 == 0 && Out::OFF_O % 16 == 0,
                "16-byte aligned regions");
};

// Bytes of the status words in front of the blocks (16-byte aligned).
__host__ __device__ constexpr int64_t split_status_bytes(int64_t N) {
  return (N * 4 + 255) / 256 * 256;
}

// The chunk slots of a problem (host: sizes only).
__host__ __device__ inline int64_t split_chunk_slots(const ChunkPrefillProblem& p) {
  constexpr int64_t C = ChunkPrefillProblem::kChunk;
  return p.cu_seqlens ? p.T / C + p.N : p.N * ((p.T + C - 1) / C);
}

// The first chunk slot of sequence n.
__device__ __forceinline__ int64_t split_chunk_offset(const ChunkPrefillProblem& p, int64_t n) {
  constexpr int64_t C = ChunkPrefillProblem::kChunk;
  return p.cu_seqlens ? load_index(p.cu_seqlens, p.cu_dtype, n) / C + n : n * ((p.T + C - 1) / C);
}

// Chunk slot j: its sequence n and chunk ci within it, or n < 0 for a hole.
struct SplitChunk {
  int64_t n, ci;
};
__device__ __forceinline__ SplitChunk split_locate(const ChunkPrefillProblem& p, int64_t j) {
  constexpr int64_t C = ChunkPrefillProblem::kChunk;
  int64_t n;
  if (p.cu_seqlens) {  // the last n with off(n) <= j (off(0) = 0, off is non-decreasing)
    int64_t lo = 0, hi = p.N - 1;
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) >> 1;
      if (split_chunk_offset(p, mid) <= j) lo = mid;
      else hi = mid - 1;
    }
    n = lo;
  } else {
    n = j / ((p.T + C - 1) / C);
  }
  const int64_t ci = j - split_chunk_offset(p, n);
  const int64_t len = p.cu_seqlens ? load_index(p.cu_seqlens, p.cu_dtype, n + 1) -
                                         load_index(p.cu_seqlens, p.cu_dtype, n)
                                   : p.T;
  if (n >= p.N || ci * C >= len) return {-1, 0};
  return {n, ci};
}

template <int D, bool KDA>
__device__ __forceinline__ unsigned char* split_block(const ChunkPrefillProblem& p, int64_t j,
                                                      int hv) {
  return static_cast<unsigned char*>(p.workspace) + split_status_bytes(p.N) +
         (j * p.HV + hv) * SplitLayout<D, KDA>::BLOCK;
}

// The 16-row strip r of X K^T (X = k or q, Ks = k, both [C][LDI]), lower triangle only (column
// tiles 0 .. 2r + 1), into the accumulators of mma.m16n8k16: acc[j] is n-tile j (columns
// 8j .. 8j + 7) of rows 16r .. 16r + 15.
template <class Lay, class In>
__device__ __forceinline__ void strip_products(const In* X, const In* Ks, int r, int lane,
                                               float (&acc)[8][4]) {
  using M = Mma<In>;
  constexpr int NK = Lay::NK, LDI = Lay::LDI;
#pragma unroll
  for (int j = 0; j < 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
#pragma unroll
  for (int kk = 0; kk < NK; ++kk) {
    uint32_t a[4];
    ldsm_x4(a, X + a_tile(lane, 16 * r, 16 * kk, LDI));
#pragma unroll
    for (int jp = 0; jp < 4; ++jp) {
      if (jp <= r) {
        uint32_t b[4];
        ldsm_x4(b, Ks + b_pair(lane, 16 * jp, 16 * kk, LDI));
        M::mma(acc[2 * jp], a, b[0], b[1]);
        M::mma(acc[2 * jp + 1], a, b[2], b[3]);
      }
    }
  }
}

// Element (t, s) of strip r's products scaled by the per-token factors of tc_kernel.cuh:
// A_ts = beta_t rk_t rk_s e^{G_t - G_s} (k_t . k_s), s < t (P = false, sF = beta);
// P_ts = rq_t rk_s e^{G_t - G_s} (q_t . k_s), s <= t (P = true, sF = rq); zeros elsewhere.
template <bool P>
__device__ __forceinline__ float strip_value(float x, int t, int s, const float* sG,
                                             const float* sRk, const float* sF) {
  const bool lower = P ? s <= t : s < t;
  const float f = P ? sF[t] * sRk[s] : sF[t] * sRk[t] * sRk[s];
  return lower ? f * expf(sG[t] - sG[s]) * x : 0.0f;
}

// Strip r's accumulators scaled by strip_value into Tf (P = false, fp32, [C][LDT]) or Pb
// (P = true, 16-bit, [C][LDB]); the strip's columns past its diagonal block get zeros.
template <class Lay, class In, bool P>
__device__ __forceinline__ void strip_store(const float (&acc)[8][4], int r, const float* sG,
                                            const float* sRk, const float* sF, float* Tf, In* Pb,
                                            int lane) {
  constexpr int LDT = Lay::LDT, LDB = Lay::LDB;
  const int g8 = lane >> 2, q4 = lane & 3;
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int t = 16 * r + g8 + 8 * h;
      const int sc = 8 * j + 2 * q4;
      float out[2];
#pragma unroll
      for (int e = 0; e < 2; ++e)
        out[e] = j < 2 * (r + 1) ? strip_value<P>(acc[j][2 * h + e], t, sc + e, sG, sRk, sF) : 0.0f;
      if constexpr (P) {
        *reinterpret_cast<uint32_t*>(Pb + t * LDB + sc) = Mma<In>::pack(out[0], out[1]);
      } else {
        *reinterpret_cast<float2*>(Tf + t * LDT + sc) = make_float2(out[0], out[1]);
      }
    }
}

// The 16-row strip r of K K^T (P = false: A into Tf, fp32) or Q K^T (P = true: P into Pb,
// 16-bit), lower triangle only, scaled by strip_value; zeros elsewhere in the strip.
template <class Lay, class In, bool P>
__device__ __forceinline__ void split_strip(const In* X, const In* Ks, int r, const float* sG,
                                            const float* sRk, const float* sF, float* Tf, In* Pb,
                                            int lane) {
  float acc[8][4];
  strip_products<Lay, In>(X, Ks, r, lane, acc);
  strip_store<Lay, In, P>(acc, r, sG, sRk, sF, Tf, Pb, lane);
}

// Rows of chunk ci of a per-token [.., D] input into dst [C][LDI] (rows past the sequence:
// zeros), 16-byte cp.async pieces over `nt` threads; no commit.
template <int D, class In, class Head>
__device__ __forceinline__ void split_load_rows(In* dst, const Head& t, const In* base,
                                                const Seq& s, int head, int64_t c0, int64_t cv,
                                                int tid, int nt) {
  constexpr int CH = D / 8, C = ChunkPrefillProblem::kChunk, LDI = D + 8;
  for (int i = tid; i < C * CH; i += nt) {
    const int r = i / CH, ch = i - r * CH;
    const bool valid = r < cv;
    const int64_t tok = s.tok0 + c0 + (valid ? r : 0);
    cp_async16_zfill(dst + r * LDI + ch * 8, base + head_offset(t, s.seq, tok, head) + ch * 8,
                     valid);
  }
}

// A [rows][cols] 16-bit matrix stored contiguously at src (global) into dst [rows][ld] (shared),
// 16-byte cp.async pieces over `nt` threads; no commit.
template <int ROWS, int COLS, int LD>
__device__ __forceinline__ void split_copy_matrix(void* dst, const void* src, int tid, int nt) {
  constexpr int CH = COLS / 8;
  for (int i = tid; i < ROWS * CH; i += nt) {
    const int r = i / CH, c = i - r * CH;
    cp_async16_zfill(static_cast<unsigned char*>(dst) + (r * LD + c * 8) * 2,
                     static_cast<const unsigned char*>(src) + (r * COLS + c * 8) * 2, true);
  }
}

// Warp 0's share of a chunk's per-token scalars, tokens 2 lane and 2 lane + 1 of the cv tokens
// from c0: beta into sBeta[C]; for GDN the inclusive scan of the decay g into sG[C] and its last
// value into sGL[0] (g = 0 past the sequence: G_63 = G_{cv-1}). KDA's decays are per channel
// and scanned elsewhere.
template <bool KDA>
__device__ __forceinline__ void chunk_beta_and_decay(const ChunkPrefillProblem& p, const Seq& s,
                                                     int64_t c0, int cv, float A_log, int lane,
                                                     float* sBeta, float* sG, float* sGL) {
  const detail::GateParams& gate = p.gate;
  const float dt =
      !KDA && gate.dt_bias ? detail::load_float(gate.dt_bias, gate.dt_bias_dtype, s.hv) : 0.0f;
  float g2[2], b2[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int t = 2 * lane + e;
    const bool valid = t < cv;
    const int64_t tok = s.tok0 + c0 + (valid ? t : 0);
    b2[e] = valid ? detail::beta_value(detail::load_float(p.beta.ptr, p.beta.dtype,
                                                          head_offset(p.beta, s.seq, tok, s.hv)),
                                       p.beta_is_logit, false, p.beta.dtype)
                  : 0.0f;
    g2[e] = !KDA && valid
                ? detail::gate_value(
                      gate.mode,
                      detail::load_float(p.g.ptr, p.g.dtype, head_offset(p.g, s.seq, tok, s.hv)),
                      dt, A_log, gate.lower_bound)
                : 0.0f;
  }
  sBeta[2 * lane] = b2[0];
  sBeta[2 * lane + 1] = b2[1];
  if constexpr (!KDA) {
    const float2 G = warp_pair_scan(g2[0], g2[1], lane);
    sG[2 * lane] = G.x;
    sG[2 * lane + 1] = G.y;
    if (lane == 31) sGL[0] = G.y;
  }
}

// ---- kernel 1: per chunk, G, rk, A, T and the WY factors ---------------------------------------
// KDA (tc_kernel.cuh's KDA paragraph): G per channel, A and P pairwise on CUDA cores (kda_pairs,
// which shares each pair's exponentials between A and P: that is why P is made here, not in
// kernel 3), and the decayed operands rounded once as the fused kernel rounds them: k^ e^{G} (W's
// B operand, in place of k), k^ e^{G_L - G} and q^ e^{G} (to the workspace).
template <int D, class In, bool KDA>
__global__ void __launch_bounds__(D / 16 * 32, KDA ? 1 : 2)
    chunk_prefill_split_intra_kernel(const ChunkPrefillProblem p) {
  using Lay = SplitLayout<D, KDA>;
  using Ly = typename Lay::Intra;
  using M = Mma<In>;
  constexpr int C = Lay::C, NW = Lay::NW, NT = Lay::THREADS, LDI = Lay::LDI, LDT = Lay::LDT,
                LDB = Lay::LDB, LDG = Lay::LDG;
  enter_grid(false);
  const SplitChunk ch = split_locate(p, blockIdx.x);
  if (ch.n < 0) return;
  const int hv = static_cast<int>(blockIdx.y);
  const Seq s = resolve_sequence(p, ch.n * p.HV + hv);
  if (s.padded) return;  // kernel 2 writes its zeros; nothing reads its blocks
  extern __shared__ __align__(16) unsigned char smem[];
  In* const Ks = reinterpret_cast<In*>(smem + Ly::OFF_K);
  In* const Vs = reinterpret_cast<In*>(smem + Ly::OFF_V);
  float* const Tf = reinterpret_cast<float*>(smem + Ly::OFF_TF);
  float* const Xs = reinterpret_cast<float*>(smem + Ly::OFF_X);
  In* const Tb = reinterpret_cast<In*>(smem + Ly::OFF_TB);
  In* const Tl = reinterpret_cast<In*>(smem + Ly::OFF_TL);
  In* const Tkh = reinterpret_cast<In*>(smem + Ly::OFF_TKH);
  In* const Tkl = reinterpret_cast<In*>(smem + Ly::OFF_TKL);
  In* const Pb = Tkh;  // KDA: P (GDN's T diag(beta kf) is not made)
  In* const Qs = reinterpret_cast<In*>(smem + Ly::OFF_Q);         // KDA
  float* const GT = reinterpret_cast<float*>(smem + Ly::OFF_GT);  // KDA: [D][LDG] G, k^, q^
  float* const KT = GT + D * LDG;
  float* const QT = KT + D * LDG;
  float* const sG = reinterpret_cast<float*>(smem + Ly::OFF_SC);
  float* const sBeta = sG + C;
  float* const sRk = sG + 2 * C;
  float* const sKf = sG + 3 * C;  // rk_t e^{G_t}
  float* const sDf = sG + 4 * C;  // rk_s e^{G_L - G_s}
  float* const sDecL = sG + 5 * C;
  float* const sRq = sG + 6 * C;  // KDA
  float* const sEL = sG + 8 * C;  // KDA: e^{G_L} [D]
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g8 = lane >> 2, q4 = lane & 3;
  const int64_t c0 = ch.ci * C;
  const int cv = static_cast<int>(s.len - c0 < C ? s.len - c0 : C);

  split_load_rows<D>(Ks, p.k, static_cast<const In*>(p.k.ptr), s, s.h, c0, cv, tid, NT);
  split_load_rows<D>(Vs, p.v, static_cast<const In*>(p.v.ptr), s, s.hv, c0, cv, tid, NT);
  if constexpr (KDA)
    split_load_rows<D>(Qs, p.q, static_cast<const In*>(p.q.ptr), s, s.h, c0, cv, tid, NT);
  cp_async_commit_group();
  const detail::GateParams& gate = p.gate;
  const float A_log = gate.A_log ? detail::load_float(gate.A_log, gate.A_log_dtype, s.hv) : 0.0f;
  if (warp == 0) chunk_beta_and_decay<KDA>(p, s, c0, cv, A_log, lane, sBeta, sG, sDecL);
  if constexpr (KDA) {
    if (tid < D) {  // channel c = tid: G[t][c] for the chunk (the fused kernel's)
      const int c = tid;
      const float dt = gate.dt_bias ? detail::load_float(gate.dt_bias, gate.dt_bias_dtype,
                                                         static_cast<int64_t>(s.hv) * D + c)
                                    : 0.0f;
      const float GL = kda_channel_decay(p, s, c0, cv, dt, A_log, c,
                                         [&](int t, float G) { GT[c * LDG + t] = G; });
      sEL[c] = expf(GL);
    }
  }
  cp_async_wait_group<0>();
  __syncthreads();
  {  // rk (KDA: and rq) and the per-token factors (a warp per token)
    for (int t = warp; t < C; t += NW) {
      const float rk = qk_factor(p, row_sum_squares<In, D>(Ks + t * LDI, lane), t < cv, 1.0f);
      if constexpr (KDA) {
        const float rq = qk_factor(p, row_sum_squares<In, D>(Qs + t * LDI, lane), t < cv, p.scale);
        if (lane == 0) {
          sRk[t] = rk;
          sRq[t] = rq;
        }
      } else {
        const float GL = sDecL[0];
        if (lane == 0) {
          sRk[t] = rk;
          sKf[t] = rk * expf(sG[t]);
          sDf[t] = rk * expf(GL - sG[t]);
        }
      }
    }
  }
  __syncthreads();
  unsigned char* const blk = split_block<D, KDA>(p, blockIdx.x, hv);
  if constexpr (KDA) {
    // k^, q^ transposed for the pairwise products
    for (int i = tid; i < C * D; i += NT) {
      const int t = i / D, c = i - t * D;
      KT[c * LDG + t] = in_to_float(Ks[t * LDI + c]) * sRk[t];
      QT[c * LDG + t] = in_to_float(Qs[t * LDI + c]) * sRq[t];
    }
    __syncthreads();
    kda_pairs<Ly, In>(GT, KT, QT, sBeta, Tf, Pb, tid);
    // the decayed operands (as the fused kernel makes them): k^ e^{G} in place (W's operand),
    // k^ e^{G_L - G} and q^ e^{G} to the workspace
    In* const Kdg = reinterpret_cast<In*>(blk + Lay::B_KD);
    In* const Qgg = reinterpret_cast<In*>(blk + Lay::B_QG);
    for (int i = tid; i < C * D; i += NT) {
      const int t = i / D, c = i - t * D;
      const float gt = GT[c * LDG + t], gl = GT[c * LDG + C - 1];
      const float k = in_to_float(Ks[t * LDI + c]) * sRk[t];
      const float q = in_to_float(Qs[t * LDI + c]) * sRq[t];
      // (__expf: these operands are rounded to 16 bits next; its ~1e-6 error does not show)
      Ks[t * LDI + c] = from_float<In>(k * __expf(gt));
      Kdg[t * D + c] = from_float<In>(k * __expf(gl - gt));
      Qgg[t * D + c] = from_float<In>(q * __expf(gt));
    }
    __syncthreads();  // A (Tf) and P complete
    uint4* const Pg = reinterpret_cast<uint4*>(blk + Lay::B_P);
    for (int i = tid; i < C * (C / 8); i += NT) {
      const int t = i / (C / 8), c = i - t * (C / 8);
      Pg[i] = *reinterpret_cast<const uint4*>(Pb + t * LDB + 8 * c);
    }
  } else {
    if (warp < 4) split_strip<Lay, In, false>(Ks, Ks, warp, sG, sRk, sBeta, Tf, nullptr, lane);
    __syncthreads();
  }
  invert_unit_lower<Ly>(Tf, Xs, warp, lane, tid);
  for (int i = tid; i < C * C; i += NT) {
    const int t = i >> 6, sj = i & 63;
    const float x = sj <= t ? Tf[t * LDT + sj] * sBeta[sj] : 0.0f;
    const In xh = from_float<In>(x);
    Tb[t * LDB + sj] = xh;
    Tl[t * LDB + sj] = from_float<In>(x - in_to_float(xh));
    if constexpr (!KDA) {
      const float y = x * sKf[sj];
      const In yh = from_float<In>(y);
      Tkh[t * LDB + sj] = yh;
      Tkl[t * LDB + sj] = from_float<In>(y - in_to_float(yh));
    }
  }
  __syncthreads();

  {  // U^T rows 16 warp.. (v as M): A = V^T from v (ldmatrix.trans), B = Tb hi, lo
    const int V0 = 16 * warp;
    float* const Ug = reinterpret_cast<float*>(blk + Lay::B_U);
    uint32_t va[4][4];
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) ldsm_x4_trans(va[kk], Vs + c_pair_trans(lane, 16 * kk, V0, LDI));
#pragma unroll
    for (int jp = 0; jp < 4; ++jp) {
      float au[2][4];
#pragma unroll
      for (int n = 0; n < 2; ++n) au[n][0] = au[n][1] = au[n][2] = au[n][3] = 0.0f;
#pragma unroll
      for (int kk = 0; kk <= jp; ++kk) {  // Tb[t][s] = 0 for s > t
        uint32_t bh[4], bl[4];
        ldsm_x4(bh, Tb + b_pair(lane, 16 * jp, 16 * kk, LDB));
        ldsm_x4(bl, Tl + b_pair(lane, 16 * jp, 16 * kk, LDB));
#pragma unroll
        for (int n = 0; n < 2; ++n) {
          M::mma(au[n], va[kk], bh[2 * n], bh[2 * n + 1]);
          M::mma(au[n], va[kk], bl[2 * n], bl[2 * n + 1]);
        }
      }
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        const int t = 8 * (2 * jp + n) + 2 * q4;
        *reinterpret_cast<float2*>(Ug + (V0 + g8) * C + t) = make_float2(au[n][0], au[n][1]);
        *reinterpret_cast<float2*>(Ug + (V0 + g8 + 8) * C + t) = make_float2(au[n][2], au[n][3]);
      }
    }
  }
  {  // W (t as M): warp = token strip r (4) x 64 channels; A = T diag(beta kf) hi, lo, B = k
    // (KDA: A = T diag(beta) hi, lo, B = k^ e^{G})
    const int r = warp & 3, cb = 64 * (warp >> 2);
    const In* const Ah = KDA ? Tb : Tkh;
    const In* const Al = KDA ? Tl : Tkl;
    uint32_t* const Wh = reinterpret_cast<uint32_t*>(blk + Lay::B_WH);
    uint32_t* const Wl = reinterpret_cast<uint32_t*>(blk + Lay::B_WL);
    float acc[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      if (kk <= r) {  // T diag(.)[t][s] = 0 for s > t
        uint32_t ah[4], al[4];
        ldsm_x4(ah, Ah + a_tile(lane, 16 * r, 16 * kk, LDB));
        ldsm_x4(al, Al + a_tile(lane, 16 * r, 16 * kk, LDB));
#pragma unroll
        for (int np = 0; np < 4; ++np) {
          uint32_t b[4];
          ldsm_x4_trans(b, Ks + b_pair_trans(lane, 16 * kk, cb + 16 * np, LDI));
          M::mma(acc[2 * np], ah, b[0], b[1]);
          M::mma(acc[2 * np + 1], ah, b[2], b[3]);
          M::mma(acc[2 * np], al, b[0], b[1]);
          M::mma(acc[2 * np + 1], al, b[2], b[3]);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int t = 16 * r + g8 + 8 * h, c = cb + 8 * j + 2 * q4;
        uint32_t hi, lo;
        split_pack<In>(acc[j][2 * h], acc[j][2 * h + 1], hi, lo);
        Wh[(t * D + c) / 2] = hi;
        Wl[(t * D + c) / 2] = lo;
      }
  }
  {  // G, rk, d, e^{G_L} (KDA: e^{G_L} [D] from row 2, where kernel 2 reads d and e^{G_L})
    float* const sc = reinterpret_cast<float*>(blk + Lay::B_SC);
    if constexpr (KDA) {
      for (int c = tid; c < D; c += NT) sc[2 * C + c] = sEL[c];
    } else {
      for (int i = tid; i < 3 * C; i += NT) {
        const int row = i / C, t = i - row * C;
        sc[i] = row == 0 ? sG[t] : row == 1 ? sRk[t] : sDf[t];
      }
      if (tid == 0) sc[3 * C] = expf(sDecL[0]);
    }
  }
}

// ---- kernel 2: the sequential state pass ------------------------------------------------------
// KDA: the update's keys are kernel 1's k^ e^{G_L - G} (d = 1) and the decay e^{G_L} is per
// column (the fused kernel's KDA update).
template <int D, class In, bool KDA>
__global__ void __launch_bounds__(kSplitRows / 16 * 32, 1)
    chunk_prefill_split_state_kernel(const ChunkPrefillProblem p) {
  using Lay = SplitLayout<D, KDA>;
  using Ly = typename Lay::State;
  using M = Mma<In>;
  constexpr int C = Lay::C, NT = Ly::THREADS, NJ = Lay::NJ, NK = Lay::NK, LDI = Lay::LDI,
                LDU = Ly::LDU, R = Ly::R, TILES = D / R;
  enter_grid(false);
  const int tile = static_cast<int>(blockIdx.x % TILES);
  const int64_t task = blockIdx.x / TILES;  // n * HV + hv
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g8 = lane >> 2, q4 = lane & 3;
  const Seq s = resolve_sequence(p, task);
  const bool skip = skip_sequence(p, s, tid, NT);
  if (tile == 0 && s.hv == 0 && tid == 0)
    reinterpret_cast<int*>(p.workspace)[s.n] = skip ? 1 : 0;  // kernel 3 leaves skipped ones
  if (skip) return;
  extern __shared__ __align__(16) unsigned char smem[];
  const int V0 = R * tile + 16 * warp;  // this warp's first state row
  const int64_t E = static_cast<int64_t>(D) * D;

  float S[NJ][4];
  if (s.reads_state && p.state.formatted()) {
    load_state_rows_fmt<NJ>(p.state, s.slot, s.hv, V0, lane, S);
  } else if (s.reads_state) {
    load_state_rows<NJ>(p.state.ptr, p.state.dtype, s.slot * p.state.slot_stride + s.hv * E, D, V0,
                        lane, S);
  } else {
#pragma unroll
    for (int j = 0; j < NJ; ++j) S[j][0] = S[j][1] = S[j][2] = S[j][3] = 0.0f;
  }
  const int64_t nchunks = (s.len + C - 1) / C;
  const int64_t j0 = split_chunk_offset(p, s.n);
  const In* const kg = static_cast<const In*>(p.k.ptr);

  // chunk ci's W, k (KDA: k^ e^{G_L - G}), U^T rows, d, e^{G_L} into buffer b, one group
  auto issue_loads = [&](int64_t ci, int b) {
    unsigned char* const buf = smem + b * Ly::BUF;
    const unsigned char* const blk = split_block<D, KDA>(p, j0 + ci, s.hv);
    const int64_t c0 = ci * C;
    const int64_t cv = s.len - c0 < C ? s.len - c0 : C;
    constexpr int CH = D / 8;
    for (int i = tid; i < 2 * C * CH; i += NT) {
      const int m = i / (C * CH), rem = i - m * (C * CH), t = rem / CH, c = rem - t * CH;
      cp_async16_zfill(buf + (m ? Ly::OFF_WL : Ly::OFF_WH) + (t * LDI + c * 8) * 2,
                       blk + (m ? Lay::B_WL : Lay::B_WH) + (t * D + c * 8) * 2, true);
    }
    if constexpr (KDA) split_copy_matrix<C, D, LDI>(buf + Ly::OFF_K, blk + Lay::B_KD, tid, NT);
    else
      split_load_rows<D>(reinterpret_cast<In*>(buf + Ly::OFF_K), p.k, kg, s, s.h, c0, cv, tid, NT);
    for (int i = tid; i < R * (C / 4); i += NT) {
      const int v = i / (C / 4), c = i - v * (C / 4);
      cp_async16_zfill(buf + Ly::OFF_U + (v * LDU + c * 4) * 4,
                       blk + Lay::B_U + ((R * tile + v) * C + c * 4) * 4, true);
    }
    // rows 2 (d) and 3 (e^{G_L}) of the scalars (KDA: e^{G_L} [D])
    for (int i = tid; i < 2 * (C / 4); i += NT)
      cp_async16_zfill(buf + Ly::OFF_D + i * 16, blk + Lay::B_SC + (2 * C) * 4 + i * 16, true);
    cp_async_commit_group();
  };
  auto store_state = [&](void* base, DType dtype, int64_t off, int64_t slot) {
    if (slot >= 0 && p.state.formatted())
      store_state_rows_fmt<NJ>(p.state, slot, s.hv, V0, lane, S);
    else store_state_rows<NJ>(base, dtype, off, D, V0, lane, S);
  };

  if (nchunks > 0) issue_loads(0, 0);
  for (int64_t ci = 0; ci < nchunks; ++ci) {
    const int b = static_cast<int>(ci & 1);
    unsigned char* const buf = smem + b * Ly::BUF;
    const In* const Wh = reinterpret_cast<const In*>(buf + Ly::OFF_WH);
    const In* const Wl = reinterpret_cast<const In*>(buf + Ly::OFF_WL);
    const In* const Ks = reinterpret_cast<const In*>(buf + Ly::OFF_K);
    const float* const Us = reinterpret_cast<const float*>(buf + Ly::OFF_U);
    const float* const sD = reinterpret_cast<const float*>(buf + Ly::OFF_D);
    if (ci + 1 < nchunks) {
      issue_loads(ci + 1, b ^ 1);
      cp_async_wait_group<1>();
    } else {
      cp_async_wait_group<0>();
    }
    __syncthreads();  // this chunk's operands are in

    unsigned char* const blk = split_block<D, KDA>(p, j0 + ci, s.hv);
    uint32_t Sa[NK][4];  // S_c = bf16(S), stored for kernel 3
    {
      uint32_t* const Sg = reinterpret_cast<uint32_t*>(blk + Lay::B_S);
#pragma unroll
      for (int kk = 0; kk < NK; ++kk) {
        Sa[kk][0] = M::pack(S[2 * kk][0], S[2 * kk][1]);
        Sa[kk][1] = M::pack(S[2 * kk][2], S[2 * kk][3]);
        Sa[kk][2] = M::pack(S[2 * kk + 1][0], S[2 * kk + 1][1]);
        Sa[kk][3] = M::pack(S[2 * kk + 1][2], S[2 * kk + 1][3]);
        const int c = 16 * kk + 2 * q4;
        Sg[((V0 + g8) * D + c) / 2] = Sa[kk][0];
        Sg[((V0 + g8 + 8) * D + c) / 2] = Sa[kk][1];
        Sg[((V0 + g8) * D + c + 8) / 2] = Sa[kk][2];
        Sg[((V0 + g8 + 8) * D + c + 8) / 2] = Sa[kk][3];
      }
    }
    // v'^T = U^T - S_c W^T, block by block of 16 tokens: its two tiles become k-step jp of
    // bf16(v') (stored) and bf16(v' d) (the update's A operand)
    uint32_t Ud[4][4];
    {
      uint32_t* const VNg = reinterpret_cast<uint32_t*>(blk + Lay::B_VN);
      const int vl = 16 * warp + g8;  // row within the tile
#pragma unroll
      for (int jp = 0; jp < 4; ++jp) {
        float ak[2][4];
#pragma unroll
        for (int n = 0; n < 2; ++n) ak[n][0] = ak[n][1] = ak[n][2] = ak[n][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < NK; ++kk) {
          uint32_t bh[4], bl[4];
          ldsm_x4(bh, Wh + b_pair(lane, 16 * jp, 16 * kk, LDI));
          ldsm_x4(bl, Wl + b_pair(lane, 16 * jp, 16 * kk, LDI));
          M::mma(ak[0], Sa[kk], bh[0], bh[1]);
          M::mma(ak[1], Sa[kk], bh[2], bh[3]);
          M::mma(ak[0], Sa[kk], bl[0], bl[1]);
          M::mma(ak[1], Sa[kk], bl[2], bl[3]);
        }
#pragma unroll
        for (int jj = 0; jj < 2; ++jj) {
          const int t = 8 * (2 * jp + jj) + 2 * q4;
          const float2 u0 = *reinterpret_cast<const float2*>(Us + vl * LDU + t);
          const float2 u1 = *reinterpret_cast<const float2*>(Us + (vl + 8) * LDU + t);
          const float x0 = u0.x - ak[jj][0], x1 = u0.y - ak[jj][1];
          const float y0 = u1.x - ak[jj][2], y1 = u1.y - ak[jj][3];
          VNg[((V0 + g8) * C + t) / 2] = M::pack(x0, x1);
          VNg[((V0 + g8 + 8) * C + t) / 2] = M::pack(y0, y1);
          if constexpr (KDA) {  // bf16(v'), as the fused kernel's KDA update
            Ud[jp][2 * jj] = M::pack(x0, x1);
            Ud[jp][2 * jj + 1] = M::pack(y0, y1);
          } else {
            const float d0 = sD[t], d1 = sD[t + 1];
            Ud[jp][2 * jj] = M::pack(x0 * d0, x1 * d1);
            Ud[jp][2 * jj + 1] = M::pack(y0 * d0, y1 * d1);
          }
        }
      }
    }
    {  // S = S e^{G_L} + (v' d)^T K (KDA: S diag(e^{G_L}) + v'^T (k^ e^{G_L - G}))
      if constexpr (KDA) {
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
          const int c = 8 * j + 2 * q4;
          const float d0 = sD[c], d1 = sD[c + 1];
          S[j][0] *= d0;
          S[j][1] *= d1;
          S[j][2] *= d0;
          S[j][3] *= d1;
        }
      } else {
        const float dec = sD[C];
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
          S[j][0] *= dec;
          S[j][1] *= dec;
          S[j][2] *= dec;
          S[j][3] *= dec;
        }
      }
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int np = 0; np < NK; ++np) {
          uint32_t bk[4];
          ldsm_x4_trans(bk, Ks + b_pair_trans(lane, 16 * kk, 16 * np, LDI));
          M::mma(S[2 * np], Ud[kk], bk[0], bk[1]);
          M::mma(S[2 * np + 1], Ud[kk], bk[2], bk[3]);
        }
    }
    const int64_t c0 = ci * C;
    const int64_t end = c0 + (s.len - c0 < C ? s.len - c0 : C);
    if (checkpoint_at(p, end)) store_checkpoint(p, s, end / p.checkpoint_every - 1, store_state);
    __syncthreads();  // every read of this buffer is done before the next chunk's loads refill it
  }
  store_final_states(p, s, store_state);
}

// ---- kernel 3: the outputs --------------------------------------------------------------------
// KDA: o^T = S_c (q^ e^{G})^T + bf16(v'^T) P^T with kernel 1's decayed queries and P (qf = 1).
template <int D, class In, bool KDA>
__global__ void __launch_bounds__(D / 16 * 32, 2)
    chunk_prefill_split_output_kernel(const ChunkPrefillProblem p, bool trigger_early) {
  using Lay = SplitLayout<D, KDA>;
  using Ly = typename Lay::Out;
  using M = Mma<In>;
  constexpr int C = Lay::C, NW = Lay::NW, NT = Lay::THREADS, NK = Lay::NK, LDI = Lay::LDI,
                LDB = Lay::LDB, LDO = Lay::LDO;
  enter_grid(trigger_early);
  const SplitChunk ch = split_locate(p, blockIdx.x);
  if (ch.n < 0) return;
  if (reinterpret_cast<const int*>(p.workspace)[ch.n] != 0) return;  // kernel 2 wrote its rows
  const int hv = static_cast<int>(blockIdx.y);
  const Seq s = resolve_sequence(p, ch.n * p.HV + hv);
  extern __shared__ __align__(16) unsigned char smem[];
  In* const Qs = reinterpret_cast<In*>(smem + Ly::OFF_Q);
  In* const Ks = reinterpret_cast<In*>(smem + Ly::OFF_K);
  In* const Pb = reinterpret_cast<In*>(smem + Ly::OFF_P);
  float* const Os = reinterpret_cast<float*>(smem + Ly::OFF_O);
  float* const sG = reinterpret_cast<float*>(smem + Ly::OFF_SC);
  float* const sRk = sG + C;
  float* const sRq = sG + 2 * C;
  float* const sQf = sG + 3 * C;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g8 = lane >> 2, q4 = lane & 3;
  const int64_t c0 = ch.ci * C;
  const int cv = static_cast<int>(s.len - c0 < C ? s.len - c0 : C);
  const unsigned char* const blk = split_block<D, KDA>(p, blockIdx.x, hv);

  if constexpr (KDA) {
    split_copy_matrix<C, D, LDI>(Qs, blk + Lay::B_QG, tid, NT);
    split_copy_matrix<C, C, LDB>(Pb, blk + Lay::B_P, tid, NT);
    cp_async_commit_group();
    cp_async_wait_group<0>();
    __syncthreads();
  } else {
    split_load_rows<D>(Qs, p.q, static_cast<const In*>(p.q.ptr), s, s.h, c0, cv, tid, NT);
    split_load_rows<D>(Ks, p.k, static_cast<const In*>(p.k.ptr), s, s.h, c0, cv, tid, NT);
    cp_async_commit_group();
    {
      const float* const sc = reinterpret_cast<const float*>(blk + Lay::B_SC);
      for (int i = tid; i < 2 * C; i += NT) sG[i] = sc[i];  // G, rk
    }
    cp_async_wait_group<0>();
    __syncthreads();
    // rq, qf = rq e^{G} (a warp per token)
    for (int t = warp; t < C; t += NW) {
      const float rq = qk_factor(p, row_sum_squares<In, D>(Qs + t * LDI, lane), t < cv, p.scale);
      if (lane == 0) {
        sRq[t] = rq;
        sQf[t] = rq * expf(sG[t]);
      }
    }
    __syncthreads();
    if (warp < 4) split_strip<Lay, In, true>(Qs, Ks, warp, sG, sRk, sRq, nullptr, Pb, lane);
  }
  // O1^T = S_c Q^T (A = S_c rows from the workspace), scaled by qf per column (KDA: qf = 1, the
  // decay is in q^ e^{G})
  const int V0 = 16 * warp;
  float ao[8][4];
  {
    const uint32_t* const Sg = reinterpret_cast<const uint32_t*>(blk + Lay::B_S);
    uint32_t Sa[NK][4];
#pragma unroll
    for (int kk = 0; kk < NK; ++kk) {
      const int c = 16 * kk + 2 * q4;
      Sa[kk][0] = Sg[((V0 + g8) * D + c) / 2];
      Sa[kk][1] = Sg[((V0 + g8 + 8) * D + c) / 2];
      Sa[kk][2] = Sg[((V0 + g8) * D + c + 8) / 2];
      Sa[kk][3] = Sg[((V0 + g8 + 8) * D + c + 8) / 2];
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) ao[j][0] = ao[j][1] = ao[j][2] = ao[j][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < NK; ++kk)
#pragma unroll
      for (int jp = 0; jp < 4; ++jp) {
        uint32_t b[4];
        ldsm_x4(b, Qs + b_pair(lane, 16 * jp, 16 * kk, LDI));
        M::mma(ao[2 * jp], Sa[kk], b[0], b[1]);
        M::mma(ao[2 * jp + 1], Sa[kk], b[2], b[3]);
      }
    if constexpr (!KDA) {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int t = 8 * j + 2 * q4;
        const float f0 = sQf[t], f1 = sQf[t + 1];
        ao[j][0] *= f0;
        ao[j][1] *= f1;
        ao[j][2] *= f0;
        ao[j][3] *= f1;
      }
    }
  }
  {  // o^T += bf16(v'^T) P^T (A = v'^T rows from the workspace)
    const uint32_t* const VNg = reinterpret_cast<const uint32_t*>(blk + Lay::B_VN);
    uint32_t Ua[4][4];
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      const int t = 16 * kk + 2 * q4;
      Ua[kk][0] = VNg[((V0 + g8) * C + t) / 2];
      Ua[kk][1] = VNg[((V0 + g8 + 8) * C + t) / 2];
      Ua[kk][2] = VNg[((V0 + g8) * C + t + 8) / 2];
      Ua[kk][3] = VNg[((V0 + g8 + 8) * C + t + 8) / 2];
    }
    __syncthreads();  // P complete
#pragma unroll
    for (int jp = 0; jp < 4; ++jp)
#pragma unroll
      for (int kk = 0; kk <= jp; ++kk) {  // P[t][s] = 0 for s > t
        uint32_t b[4];
        ldsm_x4(b, Pb + b_pair(lane, 16 * jp, 16 * kk, LDB));
        M::mma(ao[2 * jp], Ua[kk], b[0], b[1]);
        M::mma(ao[2 * jp + 1], Ua[kk], b[2], b[3]);
      }
  }
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int t = 8 * j + 2 * q4 + e;
      Os[t * LDO + V0 + g8] = ao[j][e];
      Os[t * LDO + V0 + g8 + 8] = ao[j][2 + e];
    }
  __syncthreads();
  for (int i = tid; i < cv * (D / 4); i += NT) {
    const int t = i / (D / 4), c = (i - t * (D / 4)) * 4;
    store4(p.out.ptr, p.out.dtype, head_offset(p.out, s.seq, s.tok0 + c0 + t, s.hv) + c,
           *reinterpret_cast<const float4*>(Os + t * LDO + c));
  }
}

}  // namespace deltastate::cuda_backend::prefill
