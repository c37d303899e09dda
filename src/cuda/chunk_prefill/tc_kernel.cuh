// The tensor-core kernel of chunked prefill (GDN and KDA), K = V = D in {64, 128}, q/k/v all
// bf16 or all fp16. Part of chunk_prefill.cu's translation unit.
//
// ---- design ------------------------------------------------------------------------------------
// One CTA per (sequence, value head), D/16 warps (8 at D = 128), walking the sequence's chunks
// of C = 64 tokens in order (src/cpu/chunk_prefill.cpp derives the chunk algebra; the names
// below are its names). The [V, K] fp32 state S never leaves the chip between the sequence's
// first and last chunk: warp w holds rows v in [16w, 16w + 16) of S, all K columns, as the fp32
// accumulators of mma.m16n8k16 (D/2 registers per lane); it is read from the pool once and
// written once (plus checkpoints), each store rounded to its destination's dtype as decode does.
//
// Everything that involves S is computed transposed, with the value dimension as the MMA's M
// (each warp its own 16 rows), so that S enters every product as an A operand straight from the
// accumulator registers (mma.cuh: two C tiles form one A fragment) and neither S nor the
// products' results go through shared memory, except the output, staged for coalesced stores:
//   (S K^T)[v][t], (S Q^T)[v][t]           A = bf16(S) (registers), B = raw k, q rows (smem)
//   Y^T = V^T - diag-scale (S K^T)          fp32 epilogue, v from smem (ldmatrix.trans)
//   v'^T = Y^T Tb^T                         A = Y^T, B = Tb, both split hi + lo (3 products)
//   o^T = O1^T + v'^T P^T                   A = bf16(v'^T) (registers), B = P (smem)
//   S = S e^{G_L} + (v' d)^T K              A = bf16(v'^T d) (registers), B = k (smem, .trans)
// with, for GDN, every per-token factor applied to the fp32 results instead of the operands:
//   Y_t = v_t - rk_t e^{G_t} (S k_t)          (K^ = diag(rk) K: rk = 1/|k_t| when normalizing)
//   O1_t = rq_t e^{G_t} (S q_t)               (rq includes the scale)
//   d_s = rk_s e^{G_L - G_s}                  (folded into v' before its bf16 rounding)
//   Tb = T diag(beta),  T = (I + A)^{-1},  A_ts = beta_t rk_t rk_s e^{G_t - G_s} (k_t . k_s), s < t
//   P_ts = rq_t rk_s e^{G_t - G_s} (q_t . k_s), s <= t
// so the raw bf16 inputs are exact MMA operands (no rounding of normalized or decayed q/k) and
// every exponent is a later cumulative decay minus an earlier one (<= 0: nothing overflows).
// The token x token products K K^T and Q K^T are MMAs on the raw inputs too (warp j: the 16-row
// strip j % 4 of K K^T or Q K^T, lower triangle only); T is found in fp32 on CUDA cores in shared
// memory: the four 16x16 diagonal blocks by forward substitution (one warp each, a lane per
// column), then the off-diagonal blocks by two levels of block products, 16 -> 32 -> 64
// (T21 = -T22 A21 T11 at each level). O1 waits in the fp32 output staging (registers are full).
// KDA's decays are per channel and cannot be scaled out of the products, so: K K^T and Q K^T
// pairwise on CUDA cores in fp32 (the simple path: exp(G_t[c] - G_s[c]) per pair and channel,
// as the CPU kernel does, factored within 4x4 tiles so that no factor exceeds 1; MUFU-bound,
// ~2-3x the rest of the chunk; the next step is FLA's sub-chunk factorization on tensor
// cores), and the decays folded into the other operands, rounded once: q^ e^{G} and k^ e^{G}
// for S Q^T and S K^T, k^ e^{G_L - G} for the state update, whose decay e^{G_L} is then per
// column.
//
// Precision. The carried state, every accumulation and T are fp32. The tensor-core operands that
// are not raw inputs are rounded to the input dtype (a relative 2^-9 per element for bf16): S (as
// FLA and FlashInfer do), v' (twice: for o and, times d, for the state), P, and for KDA its
// decayed q, k; Y and Tb are split into hi + lo bf16 pairs and multiplied as hi*hi + hi*lo + lo*hi
// (that product is small, and the two roundings were a third of the error). Emulated with bf16
// rounding at the same points against an fp64 recurrence (tests/gpu/emulate_tc_kernel.py, which
// also checks this file's fragment indexing lane by lane), GDN measured ~2.2-2.5e-3 relative norm
// error on the outputs and ~1.8e-3 on the states (FLA and FlashInfer: 3.6e-3 / 2.9e-3 on the
// same kind of inputs), KDA 2.4-3.4e-3; tests/gpu/test_chunk_prefill_gpu.cpp has the bounds.
//
// Per chunk: the next chunk's q, k, v go into the second of two shared-memory buffers with
// cp.async while this one computes (GDN; KDA has room for one buffer, whose next loads start
// once the chunk's last raw read is done); per-token g and beta are prefetched into registers a
// chunk ahead (KDA's per-channel g is loaded when the chunk starts); ten CTA barriers. Outputs
// are staged through shared memory (fp32) and written as 16-byte (fp32) or 8-byte rows.
//
// Occupancy (D = 128): GDN 186 KB of shared memory and 256 threads per CTA (KDA 216.5 KB), so
// one CTA (8 warps) per SM; ptxas: 255 registers (KDA 239), no spills. The grid is B * HV CTAs
// (Qwen3-Next 8 x 1024: 256 CTAs, two waves on 132 SMs; 1 x 8192: 32 CTAs, a quarter of the GPU:
// split.cuh's kernels are the path for few long sequences: GDN and KDA take them where this
// grid would fill less than half of the GPU, chunk_prefill.cu). D = 64: 122 KB, 128 threads, one
// CTA per SM.
#pragma once

#include <cstdint>
#include <type_traits>

#include "core/delta_math.h"
#include "cuda/chunk_prefill/mma.cuh"
#include "cuda/chunk_prefill/sequence.cuh"
#include "cuda/grid.cuh"
#include "cuda/loads.cuh"
#include "cuda/state_format.cuh"

namespace deltastate::cuda_backend::prefill {

template <int D, bool KDA>
struct TcLayout {
  static constexpr int C = detail::ChunkPrefillProblem::kChunk;  // 64
  static constexpr int NW = D / 16;                              // warps: 16 state rows each
  static constexpr int THREADS = NW * 32;
  static constexpr int NJ = D / 8;   // n-tiles of a warp's state rows
  static constexpr int NK = D / 16;  // k-steps over K
  static constexpr int BUFS = KDA ? 1 : 2;
  // Row strides (elements), padded so that the 8 row addresses of an ldmatrix (and the fp32
  // accesses of the epilogues and the inverse) fall in distinct banks.
  static constexpr int LDI = D + 8;  // 16-bit [C][LDI]: q, k, v, KDA's decayed k
  static constexpr int LDT = C + 4;  // fp32 [C][LDT]: A, then T
  static constexpr int LDB = C + 8;  // 16-bit [C][LDB]: Tb, P
  static constexpr int LDO = D + 4;  // fp32 [C][LDO]: output staging
  static constexpr int LDX = 36;     // fp32 [32][LDX]: the inverse's scratch
  static constexpr int LDG = C + 1;  // fp32 [D][LDG]: KDA's transposed G, k^, q^
  static constexpr int IN_TILE = C * LDI * 2;
  static constexpr int OFF_IN = 0;
  static constexpr int OFF_KD = OFF_IN + BUFS * 3 * IN_TILE;
  static constexpr int OFF_GT = OFF_KD + (KDA ? IN_TILE : 0);
  static constexpr int GT_BYTES = KDA ? D * LDG * 4 : 0;
  static constexpr int OFF_R = OFF_GT + GT_BYTES;  // KDA's k^T, q^T | output staging, scratch
  static constexpr int OS_BYTES = C * LDO * 4;
  static constexpr int KQT_BYTES = KDA ? 2 * D * LDG * 4 : 0;
  static constexpr int R_BYTES = OS_BYTES > KQT_BYTES ? OS_BYTES : KQT_BYTES;
  static constexpr int OFF_TF = OFF_R + R_BYTES;
  static constexpr int OFF_TB = OFF_TF + C * LDT * 4;
  static constexpr int OFF_TL = OFF_TB + C * LDB * 2;  // Tb's low part (x - bf16(x))
  static constexpr int OFF_PB = OFF_TL + C * LDB * 2;
  static constexpr int OFF_X = OFF_PB + C * LDB * 2;
  static constexpr int OFF_SC = OFF_X + 32 * LDX * 4;  // per-token scalars [8][C] fp32
  static constexpr int OFF_DL = OFF_SC + 8 * C * 4;    // e^{G_L}: [D] (KDA) or [1]
  static constexpr int SMEM = OFF_DL + D * 4;
  static_assert(D == 64 || D == 128, "the tensor-core kernel covers K = V = 64 and 128");
  static_assert(OFF_KD % 16 == 0 && OFF_GT % 16 == 0 && OFF_R % 16 == 0 && OFF_TF % 16 == 0 &&
                    OFF_TB % 16 == 0 && OFF_TL % 16 == 0 && OFF_PB % 16 == 0 && OFF_X % 16 == 0 &&
                    OFF_SC % 16 == 0,
                "16-byte aligned regions");
};

// ---- small helpers

// KDA: channel c's cumulative log decay over a chunk, cv tokens from c0 (g = 0 past the sequence,
// so G_63 = G_{cv-1}), sequentially in the CPU's order into store(t, G_t); the raw values are
// loaded first, so that the loads are in flight together. dt: dt_bias[hv * K + c]. Returns G_L.
template <class Store>
__device__ __forceinline__ float kda_channel_decay(const ChunkPrefillProblem& p, const Seq& s,
                                                   int64_t c0, int cv, float dt, float A_log, int c,
                                                   Store&& store) {
  constexpr int C = ChunkPrefillProblem::kChunk;
  uint32_t raw[C];
#pragma unroll
  for (int t = 0; t < C; ++t) {
    const int64_t tok = s.tok0 + c0 + (t < cv ? t : 0);
    raw[t] =
        t < cv ? load_float_bits(p.g.ptr, p.g.dtype, head_offset(p.g, s.seq, tok, s.hv) + c) : 0u;
  }
  float run = 0.0f;
#pragma unroll
  for (int t = 0; t < C; ++t) {
    if (t < cv)
      run += detail::gate_value(p.gate.mode, float_of_bits(raw[t], p.g.dtype), dt, A_log,
                                p.gate.lower_bound);
    store(t, run);
  }
  return run;
}
// -------------------------------------------------------------------------------

template <class In>
__device__ __forceinline__ float in_to_float(In x) {
  return to_float(x);
}

// N consecutive 16-bit elements at p (4 * N-byte aligned) as floats.
template <class In, int N>
__device__ __forceinline__ void load_row_part(const In* p, float (&x)[N]) {
  static_assert(N == 2 || N == 4, "2 or 4 elements");
  if constexpr (N == 4) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    const float2 a = Mma<In>::unpack(u.x), b = Mma<In>::unpack(u.y);
    x[0] = a.x, x[1] = a.y, x[2] = b.x, x[3] = b.y;
  } else {
    const float2 a = Mma<In>::unpack(*reinterpret_cast<const uint32_t*>(p));
    x[0] = a.x, x[1] = a.y;
  }
}

// The sum of squares of a token's D-element row (16-bit, in shared memory), over the warp: lane
// l adds its D/32 consecutive elements; every lane gets the sum.
template <class In, int D>
__device__ __forceinline__ float row_sum_squares(const In* row, int lane) {
  constexpr int EPL = D / 32;
  float x[EPL];
  load_row_part<In, EPL>(row + lane * EPL, x);
  float s = 0.0f;
#pragma unroll
  for (int e = 0; e < EPL; ++e) s = fmaf(x[e], x[e], s);
  return warp_sum(s);
}

// A token's factor of k (scale 1) or q (the op's scale) from its row's sum of squares: `scale`
// over the L2 norm's denominator with l2norm, else `scale`; 0 for a token past the sequence.
__device__ __forceinline__ float qk_factor(const ChunkPrefillProblem& p, float sum_squares,
                                           bool valid, float scale) {
  return !valid ? 0.0f : p.l2norm ? scale / detail::l2norm_denominator(sum_squares) : scale;
}

// A pair of fp32 values as two operand registers: hi = (x, y) rounded to In, lo = the rounding
// errors rounded to In (hi + lo carries ~16 mantissa bits; three products hi*hi + hi*lo + lo*hi
// make a product of two split operands about as exact as fp32 for a third of the fp32 cost).
template <class In>
__device__ __forceinline__ void split_pack(float x, float y, uint32_t& hi, uint32_t& lo) {
  hi = Mma<In>::pack(x, y);
  const float2 h = Mma<In>::unpack(hi);
  lo = Mma<In>::pack(x - h.x, y - h.y);
}

// Four fp32 values to four consecutive elements of a float tensor at element offset `off`
// (aligned to four elements: the dispatcher checks).
__device__ __forceinline__ void store4(void* base, DType dtype, int64_t off, float4 v) {
  if (dtype == DType::f32) {
    *reinterpret_cast<float4*>(static_cast<float*>(base) + off) = v;
  } else if (dtype == DType::bf16) {
    uint2 u;
    u.x = Mma<__nv_bfloat16>::pack(v.x, v.y);
    u.y = Mma<__nv_bfloat16>::pack(v.z, v.w);
    *reinterpret_cast<uint2*>(static_cast<uint16_t*>(base) + off) = u;
  } else {
    uint2 u;
    u.x = Mma<__half>::pack(v.x, v.y);
    u.y = Mma<__half>::pack(v.z, v.w);
    *reinterpret_cast<uint2*>(static_cast<uint16_t*>(base) + off) = u;
  }
}

// A warp's 16 state rows (V0 .. V0+15) in the accumulator layout, from or to the head at element
// offset `off` of a [.., V, K] tensor (row stride K): lane (g, q) holds, for n-tile j, the
// elements (V0 + g (+8), 8j + 2q (+1)).
template <int NJ>
__device__ __forceinline__ void load_state_rows(const void* base, DType dtype, int64_t off, int K,
                                                int V0, int lane, float (&S)[NJ][4]) {
  const int g = lane >> 2, q = lane & 3;
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t e = off + static_cast<int64_t>(V0 + g + 8 * h) * K + 8 * j + 2 * q;
      S[j][2 * h] = detail::load_float(base, dtype, e);
      S[j][2 * h + 1] = detail::load_float(base, dtype, e + 1);
    }
}
template <int NJ>
__device__ __forceinline__ void store_state_rows(void* base, DType dtype, int64_t off, int K,
                                                 int V0, int lane, const float (&S)[NJ][4]) {
  const int g = lane >> 2, q = lane & 3;
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t e = off + static_cast<int64_t>(V0 + g + 8 * h) * K + 8 * j + 2 * q;
      detail::store_float(base, dtype, e, S[j][2 * h]);
      detail::store_float(base, dtype, e + 1, S[j][2 * h + 1]);
    }
}

// The same rows of value head hv of pool slot `slot` in the pool's storage format
// (cuda/state_format.cuh): a row's 2 NJ values per lane times the 4 lanes of a quad (q) hold all
// its K = 8 NJ columns, so its amax is the lane's maximum and two quad shuffles. Every lane of
// the warp takes part.
template <int NJ>
__device__ __forceinline__ void load_state_rows_fmt(const detail::StatePoolRef& st, int64_t slot,
                                                    int hv, int V0, int lane, float (&S)[NJ][4]) {
  constexpr int K = 8 * NJ;
  const int g = lane >> 2, q = lane & 3;
  const fmt::HeadRows h = fmt::head_rows(st, slot, hv, K, K);
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = V0 + g + 8 * r;
      const int64_t e = static_cast<int64_t>(row) * K + 8 * j + 2 * q;
      S[j][2 * r] = fmt::load_elem(st.ptr, st.dtype, h, row, e);
      S[j][2 * r + 1] = fmt::load_elem(st.ptr, st.dtype, h, row, e + 1);
    }
}
template <int NJ>
__device__ __forceinline__ void store_state_rows_fmt(const detail::StatePoolRef& st, int64_t slot,
                                                     int hv, int V0, int lane,
                                                     const float (&S)[NJ][4]) {
  constexpr int K = 8 * NJ;
  const int g = lane >> 2, q = lane & 3;
  const fmt::HeadRows h = fmt::head_rows(st, slot, hv, K, K);
  float scale[2] = {1.0f, 1.0f};
  if (fmt::quantized(st.dtype)) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float amax = 0.0f;
#pragma unroll
      for (int j = 0; j < NJ; ++j)
        amax = detail::amax_step(detail::amax_step(amax, S[j][2 * r]), S[j][2 * r + 1]);
      amax = detail::amax_step(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
      amax = detail::amax_step(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
      scale[r] = fmt::fresh_scale(st.dtype, amax);
      if (q == 0) h.scales[V0 + g + 8 * r] = scale[r];
    }
  }
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t e = static_cast<int64_t>(V0 + g + 8 * r) * K + 8 * j + 2 * q;
      fmt::store_elem(st.ptr, st.dtype, h, e, S[j][2 * r], scale[r]);
      fmt::store_elem(st.ptr, st.dtype, h, e + 1, S[j][2 * r + 1], scale[r]);
    }
}

// ---- T = (I + A)^{-1} ------------------------------------------------------------------------
// A (strictly lower, fp32, zeros above the diagonal) in Tf [64][LDT] becomes T in place; X is a
// [32][LDX] fp32 scratch. Blocks of 16: D_b = (I + A_bb)^{-1} by forward substitution (warp b,
// lane j % 16 solves column j), then T10 = -D1 A10 D0 and T32 = -D3 A32 D2 (the two 32x32
// diagonal blocks), then T_lower = -T_hi A_lower T_lo (rows 32..63, columns 0..31). Ends with a
// barrier.
template <class L>
__device__ __forceinline__ void invert_unit_lower(float* Tf, float* X, int warp, int lane,
                                                  int tid) {
  constexpr int LDT = L::LDT, LDX = L::LDX, NT = L::THREADS;
  if (warp < 4) {
    const int b = warp, j = lane & 15;
    float x[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const float* row = Tf + (16 * b + i) * LDT + 16 * b;
      float acc = i == j ? 1.0f : 0.0f;
#pragma unroll
      for (int l = 0; l < i; ++l) acc = fmaf(-row[l], x[l], acc);
      x[i] = acc;
    }
    __syncwarp();
    if (lane < 16)
#pragma unroll
      for (int i = 0; i < 16; ++i) Tf[(16 * b + i) * LDT + 16 * b + j] = x[i];
  }
  __syncthreads();
  // Level 1a: X[0:16] = A10 D0, X[16:32] = A32 D2. Item: block, row, four columns.
  for (int it = tid; it < 128; it += NT) {
    const int blk = it >> 6, r = (it >> 2) & 15, c = (it & 3) * 4;
    const float* a = Tf + (16 + 32 * blk + r) * LDT + 32 * blk;
    const float* d = Tf + (32 * blk) * LDT + 32 * blk + c;
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (int l = 0; l < 16; ++l) {
      const float al = a[l];
      const float4 dl = *reinterpret_cast<const float4*>(d + l * LDT);
      acc.x = fmaf(al, dl.x, acc.x);
      acc.y = fmaf(al, dl.y, acc.y);
      acc.z = fmaf(al, dl.z, acc.z);
      acc.w = fmaf(al, dl.w, acc.w);
    }
    *reinterpret_cast<float4*>(X + (16 * blk + r) * LDX + c) = acc;
  }
  __syncthreads();
  // Level 1b: T10 = -D1 X[0:16] (rows 16..31, columns 0..15), T32 = -D3 X[16:32] (rows 48..63,
  // columns 32..47).
  for (int it = tid; it < 128; it += NT) {
    const int blk = it >> 6, r = (it >> 2) & 15, c = (it & 3) * 4;
    const float* d = Tf + (16 + 32 * blk + r) * LDT + 16 + 32 * blk;
    const float* x = X + (16 * blk) * LDX + c;
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (int l = 0; l < 16; ++l) {
      const float dl = d[l];
      const float4 xl = *reinterpret_cast<const float4*>(x + l * LDX);
      acc.x = fmaf(dl, xl.x, acc.x);
      acc.y = fmaf(dl, xl.y, acc.y);
      acc.z = fmaf(dl, xl.z, acc.z);
      acc.w = fmaf(dl, xl.w, acc.w);
    }
    *reinterpret_cast<float4*>(Tf + (16 + 32 * blk + r) * LDT + 32 * blk + c) =
        make_float4(-acc.x, -acc.y, -acc.z, -acc.w);
  }
  __syncthreads();
  // Level 2a: X = A_lower T_lo (A rows 32..63, columns 0..31; T_lo = T[0:32, 0:32]).
  for (int it = tid; it < 256; it += NT) {
    const int r = it >> 3, c = (it & 7) * 4;
    const float* a = Tf + (32 + r) * LDT;
    const float* d = Tf + c;
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 8
    for (int l = 0; l < 32; ++l) {
      const float al = a[l];
      const float4 dl = *reinterpret_cast<const float4*>(d + l * LDT);
      acc.x = fmaf(al, dl.x, acc.x);
      acc.y = fmaf(al, dl.y, acc.y);
      acc.z = fmaf(al, dl.z, acc.z);
      acc.w = fmaf(al, dl.w, acc.w);
    }
    *reinterpret_cast<float4*>(X + r * LDX + c) = acc;
  }
  __syncthreads();
  // Level 2b: T[32:64, 0:32] = -T_hi X (T_hi = T[32:64, 32:64]).
  for (int it = tid; it < 256; it += NT) {
    const int r = it >> 3, c = (it & 7) * 4;
    const float* d = Tf + (32 + r) * LDT + 32;
    const float* x = X + c;
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 8
    for (int l = 0; l < 32; ++l) {
      const float dl = d[l];
      const float4 xl = *reinterpret_cast<const float4*>(x + l * LDX);
      acc.x = fmaf(dl, xl.x, acc.x);
      acc.y = fmaf(dl, xl.y, acc.y);
      acc.z = fmaf(dl, xl.z, acc.z);
      acc.w = fmaf(dl, xl.w, acc.w);
    }
    *reinterpret_cast<float4*>(Tf + (32 + r) * LDT + c) =
        make_float4(-acc.x, -acc.y, -acc.z, -acc.w);
  }
  __syncthreads();
}

// ---- KDA: A and P pairwise on CUDA cores ------------------------------------------------------
// From the transposed fp32 GT[c][t] (cumulative log decay), KT[c][t] = k^_t[c], QT[c][t] =
// q^_t[c]: A[t][s] = beta_t sum_c k^_t k^_s e^{G_t - G_s} (s < t) into Tf, P[t][s] = sum_c
// q^_t k^_s e^{G_t - G_s} (s <= t) into Pb, zeros elsewhere. A thread takes a 4x4 tile of (t, s)
// pairs of the lower triangle and writes the mirrored upper tile's zeros. The exponentials bound
// the loop (MUFU): in an off-diagonal tile (rows t0.., columns s0..s3, s3 < t0) the decay factors
// as e^{G_t - G_t0} e^{G_t0 - G_s3} e^{G_s3 - G_s}, each <= 1 (no overflow; a factor that
// underflows belongs to a product below fp32's range), 7 exponentials per channel for 16 pairs;
// a diagonal tile takes its 10 pairs s <= t directly. Off-diagonal tiles are threads 0..119 and
// diagonal ones 128..143, so that no warp mixes the two.
template <class L>
__device__ __forceinline__ void kda_tile_sums(const float* GT, const float* KT, const float* QT,
                                              int t0, int s0, bool diagonal, float (&kk)[4][4],
                                              float (&qk)[4][4]) {
  constexpr int D = L::NJ * 8, LDG = L::LDG;
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) kk[i][j] = qk[i][j] = 0.0f;
#pragma unroll 2
  for (int c = 0; c < D; ++c) {
    const float* g = GT + c * LDG;
    const float* kr = KT + c * LDG;
    const float* qr = QT + c * LDG;
    float gt[4], kt[4], qt[4], gs[4], ks[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      gt[i] = g[t0 + i];
      kt[i] = kr[t0 + i];
      qt[i] = qr[t0 + i];
      gs[i] = g[s0 + i];
      ks[i] = kr[s0 + i];
    }
    float e[4][4];
    if (diagonal) {
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) e[i][j] = j <= i ? __expf(gt[i] - gs[j]) : 0.0f;
    } else {
      float ea[4], eb[4];
      ea[0] = 1.0f;
      eb[3] = __expf(gt[0] - gs[3]);
#pragma unroll
      for (int i = 1; i < 4; ++i) ea[i] = __expf(gt[i] - gt[0]);
#pragma unroll
      for (int j = 0; j < 3; ++j) eb[j] = eb[3] * __expf(gs[3] - gs[j]);
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) e[i][j] = ea[i] * eb[j];
    }
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float ke = ks[j] * e[i][j];
        kk[i][j] = fmaf(kt[i], ke, kk[i][j]);
        qk[i][j] = fmaf(qt[i], ke, qk[i][j]);
      }
  }
}

template <class L, class In>
__device__ __forceinline__ void kda_tile(const float* GT, const float* KT, const float* QT,
                                         const float* beta, float* Tf, In* Pb, int item) {
  constexpr int LDT = L::LDT, LDB = L::LDB;
  const bool diagonal = item >= 120;
  int tb, sb;
  if (diagonal) {
    tb = sb = item - 120;
  } else {  // off-diagonal tile `item` = tb (tb - 1) / 2 + sb, sb < tb
    tb = 1;
    while ((tb + 1) * tb / 2 <= item) ++tb;
    sb = item - tb * (tb - 1) / 2;
  }
  const int t0 = 4 * tb, s0 = 4 * sb;
  float kk[4][4], qk[4][4];
  kda_tile_sums<L>(GT, KT, QT, t0, s0, diagonal, kk, qk);
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int t = t0 + i, s = s0 + j;
      Tf[t * LDT + s] = s < t ? beta[t] * kk[i][j] : 0.0f;
      Pb[t * LDB + s] = from_float<In>(s <= t ? qk[i][j] : 0.0f);
      if (!diagonal) {
        Tf[s * LDT + t] = 0.0f;
        Pb[s * LDB + t] = from_float<In>(0.0f);
      }
    }
}

template <class L, class In>
__device__ __forceinline__ void kda_pairs(const float* GT, const float* KT, const float* QT,
                                          const float* beta, float* Tf, In* Pb, int tid) {
  if constexpr (L::THREADS >= 256) {
    if (tid < 120) kda_tile<L, In>(GT, KT, QT, beta, Tf, Pb, tid);
    else if (tid >= 128 && tid < 144) kda_tile<L, In>(GT, KT, QT, beta, Tf, Pb, 120 + tid - 128);
  } else {
    for (int item = tid; item < 136; item += L::THREADS)
      kda_tile<L, In>(GT, KT, QT, beta, Tf, Pb, item);
  }
}

// ---- the kernel ------------------------------------------------------------------------------

template <int D, class In, bool KDA>
__global__ void __launch_bounds__(D / 16 * 32, 1)
    chunk_prefill_tc_kernel(const ChunkPrefillProblem p, bool trigger_early) {
  using L = TcLayout<D, KDA>;
  using M = Mma<In>;
  constexpr int C = L::C, NW = L::NW, NT = L::THREADS, NJ = L::NJ, NK = L::NK;
  constexpr int LDI = L::LDI, LDT = L::LDT, LDB = L::LDB, LDO = L::LDO, LDG = L::LDG;
  enter_grid(trigger_early);
  extern __shared__ __align__(16) unsigned char smem[];
  In* const in_base = reinterpret_cast<In*>(smem + L::OFF_IN);
  In* const Kd = reinterpret_cast<In*>(smem + L::OFF_KD);  // KDA: k^ e^{G_L - G}
  float* const GT = reinterpret_cast<float*>(smem + L::OFF_GT);
  float* const KT = reinterpret_cast<float*>(smem + L::OFF_R);
  float* const QT = KT + D * LDG;
  float* const Os = reinterpret_cast<float*>(smem + L::OFF_R);
  float* const Xs = reinterpret_cast<float*>(smem + L::OFF_X);
  float* const Tf = reinterpret_cast<float*>(smem + L::OFF_TF);
  In* const Tb = reinterpret_cast<In*>(smem + L::OFF_TB);
  In* const Tl = reinterpret_cast<In*>(smem + L::OFF_TL);
  In* const Pb = reinterpret_cast<In*>(smem + L::OFF_PB);
  float* const sG = reinterpret_cast<float*>(smem + L::OFF_SC);
  float* const sBeta = sG + C;
  float* const sRk = sG + 2 * C;
  float* const sRq = sG + 3 * C;
  float* const sKf = sG + 4 * C;  // GDN: rk_t e^{G_t}
  float* const sQf = sG + 5 * C;  // GDN: rq_t e^{G_t}
  float* const sDf = sG + 6 * C;  // GDN: rk_s e^{G_L - G_s}
  float* const sDecL = reinterpret_cast<float*>(smem + L::OFF_DL);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g8 = lane >> 2, q4 = lane & 3;
  const Seq s = resolve_sequence(p, blockIdx.x);
  if (skip_sequence(p, s, tid, NT)) return;
  const int V0 = 16 * warp;
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
  const detail::GateParams& gate = p.gate;
  const float A_log = gate.A_log ? detail::load_float(gate.A_log, gate.A_log_dtype, s.hv) : 0.0f;
  float dt = 0.0f;  // GDN: dt_bias[hv]; KDA: thread c < D's dt_bias[hv * K + c]
  if (gate.dt_bias) {
    if (!KDA) dt = detail::load_float(gate.dt_bias, gate.dt_bias_dtype, s.hv);
    else if (tid < D)
      dt = detail::load_float(gate.dt_bias, gate.dt_bias_dtype,
                              static_cast<int64_t>(s.hv) * D + tid);
  }
  const In* const qg = static_cast<const In*>(p.q.ptr);
  const In* const kg = static_cast<const In*>(p.k.ptr);
  const In* const vg = static_cast<const In*>(p.v.ptr);
  const int64_t nchunks = (s.len + C - 1) / C;

  // q, k, v of chunk `ci` into input buffer `b` (rows past the sequence: zeros), one group.
  auto issue_loads = [&](int64_t ci, int b) {
    In* const dst = in_base + b * 3 * C * LDI;
    const int64_t c0 = ci * C;
    const int64_t cv = s.len - c0 < C ? s.len - c0 : C;
    constexpr int CH = D / 8;  // 16-byte pieces per row
    for (int i = tid; i < 3 * C * CH; i += NT) {
      const int m = i / (C * CH), rem = i - m * (C * CH), t = rem / CH, ch = rem - t * CH;
      const bool valid = t < cv;
      const int64_t tok = s.tok0 + c0 + (valid ? t : 0);
      const In* src = m == 0   ? qg + head_offset(p.q, s.seq, tok, s.h)
                      : m == 1 ? kg + head_offset(p.k, s.seq, tok, s.h)
                               : vg + head_offset(p.v, s.seq, tok, s.hv);
      cp_async16_zfill(dst + (m * C + t) * LDI + ch * 8, src + ch * 8, valid);
    }
    cp_async_commit_group();
  };
  // Raw bits of g (GDN) and beta for tokens 2*lane, 2*lane + 1 of chunk ci (every warp loads
  // them: each scans the chunk's decays itself).
  auto load_scalars = [&](int64_t ci, uint32_t(&gb)[2], uint32_t(&bb)[2]) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int64_t t = ci * C + 2 * lane + e;
      const bool valid = t < s.len;
      const int64_t tok = s.tok0 + (valid ? t : 0);
      gb[e] = !KDA && valid
                  ? load_float_bits(p.g.ptr, p.g.dtype, head_offset(p.g, s.seq, tok, s.hv))
                  : 0u;
      bb[e] = valid
                  ? load_float_bits(p.beta.ptr, p.beta.dtype, head_offset(p.beta, s.seq, tok, s.hv))
                  : 0u;
    }
  };
  auto store_state = [&](void* base, DType dtype, int64_t off, int64_t slot) {
    if (slot >= 0 && p.state.formatted())
      store_state_rows_fmt<NJ>(p.state, slot, s.hv, V0, lane, S);
    else store_state_rows<NJ>(base, dtype, off, D, V0, lane, S);
  };

  uint32_t gb[2] = {0u, 0u}, bb[2] = {0u, 0u};
  if (nchunks > 0) {
    issue_loads(0, 0);
    load_scalars(0, gb, bb);
  }

  for (int64_t ci = 0; ci < nchunks; ++ci) {
    const int64_t c0 = ci * C;
    const int cv = static_cast<int>(s.len - c0 < C ? s.len - c0 : C);
    const int buf = KDA ? 0 : static_cast<int>(ci & 1);
    In* const Qs = in_base + buf * 3 * C * LDI;
    In* const Ks = Qs + C * LDI;
    In* const Vs = Ks + C * LDI;
    if (!KDA && ci + 1 < nchunks) {
      issue_loads(ci + 1, buf ^ 1);
      cp_async_wait_group<1>();
    } else {
      cp_async_wait_group<0>();
    }
    const uint32_t gcur[2] = {gb[0], gb[1]}, bcur[2] = {bb[0], bb[1]};
    if (ci + 1 < nchunks) load_scalars(ci + 1, gb, bb);
    __syncthreads();  // this chunk's inputs are in; the previous chunk's reads are done

    // ---- per-token scalars: beta, G (GDN: every warp scans; KDA: per channel), norms -----------
    float beta2[2], G2[2] = {0.0f, 0.0f}, GL = 0.0f;
    {
      float g2[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const bool valid = 2 * lane + e < cv;
        beta2[e] = valid ? detail::beta_value(float_of_bits(bcur[e], p.beta.dtype), p.beta_is_logit,
                                              false, p.beta.dtype)
                         : 0.0f;
        g2[e] = !KDA && valid ? detail::gate_value(gate.mode, float_of_bits(gcur[e], p.g.dtype), dt,
                                                   A_log, gate.lower_bound)
                              : 0.0f;
      }
      if constexpr (!KDA) {
        const float2 G = warp_pair_scan(g2[0], g2[1], lane);
        G2[0] = G.x;
        G2[1] = G.y;
        GL = __shfl_sync(0xffffffffu, G2[1], 31);  // g = 0 past the sequence: G_63 = G_{cv-1}
      }
      if (warp == 0) {
        sBeta[2 * lane] = beta2[0];
        sBeta[2 * lane + 1] = beta2[1];
        if (!KDA) {
          sG[2 * lane] = G2[0];
          sG[2 * lane + 1] = G2[1];
          if (lane == 0) sDecL[0] = expf(GL);
        }
      }
    }
    if constexpr (KDA) {
      if (tid < D) {  // channel c = tid: G[t][c] for the chunk
        const int c = tid;
        const float GL = kda_channel_decay(p, s, c0, cv, dt, A_log, c,
                                           [&](int t, float G) { GT[c * LDG + t] = G; });
        sDecL[c] = expf(GL);
      }
    }
    {
#pragma unroll 2
      for (int i = 0; i < C / NW; ++i) {
        const int t = warp + NW * i;
        const float sq = row_sum_squares<In, D>(Qs + t * LDI, lane);
        const float sk = row_sum_squares<In, D>(Ks + t * LDI, lane);
        const bool valid = t < cv;
        const float rk = qk_factor(p, sk, valid, 1.0f);
        const float rq = qk_factor(p, sq, valid, p.scale);
        if (lane == 0) {
          sRk[t] = rk;
          sRq[t] = rq;
        }
        if constexpr (!KDA) {
          const float Gt = __shfl_sync(0xffffffffu, (t & 1) ? G2[1] : G2[0], t >> 1);
          if (lane == 0) {
            sKf[t] = rk * expf(Gt);
            sQf[t] = rq * expf(Gt);
            sDf[t] = rk * expf(GL - Gt);
          }
        }
      }
    }
    __syncthreads();

    // ---- A (-> Tf, fp32) and P (-> Pb) ---------------------------------------------------------
    if constexpr (!KDA) {
      for (int job = warp; job < 8; job += NW) {  // strip r of K K^T (job < 4) or Q K^T
        const bool is_p = job >= 4;
        const int r = job & 3;
        const In* X = is_p ? Qs : Ks;
        float acc[8][4];
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
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int t = 16 * r + g8 + 8 * h;
            const int sc = 8 * j + 2 * q4;
            float out[2];
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int sj = sc + e;
              const bool lower = is_p ? sj <= t : sj < t;
              const float f = is_p ? sRq[t] * sRk[sj] : sBeta[t] * sRk[t] * sRk[sj];
              out[e] =
                  lower && j < 2 * (r + 1) ? f * expf(sG[t] - sG[sj]) * acc[j][2 * h + e] : 0.0f;
            }
            if (is_p) {
              *reinterpret_cast<uint32_t*>(Pb + t * LDB + sc) = M::pack(out[0], out[1]);
            } else {
              *reinterpret_cast<float2*>(Tf + t * LDT + sc) = make_float2(out[0], out[1]);
            }
          }
      }
    } else {
      // k^, q^ transposed for the pairwise products
      for (int i = tid; i < C * D; i += NT) {
        const int t = i / D, c = i - t * D;
        KT[c * LDG + t] = in_to_float(Ks[t * LDI + c]) * sRk[t];
        QT[c * LDG + t] = in_to_float(Qs[t * LDI + c]) * sRq[t];
      }
      __syncthreads();
      kda_pairs<L, In>(GT, KT, QT, sBeta, Tf, Pb, tid);
      // the decayed operands: k^ e^{G} and q^ e^{G} in place, k^ e^{G_L - G} into Kd
      for (int i = tid; i < C * D; i += NT) {
        const int t = i / D, c = i - t * D;
        const float gt = GT[c * LDG + t], gl = GT[c * LDG + C - 1];
        const float k = in_to_float(Ks[t * LDI + c]) * sRk[t];
        const float q = in_to_float(Qs[t * LDI + c]) * sRq[t];
        // (__expf: these operands are rounded to 16 bits next; its ~1e-6 error does not show)
        Ks[t * LDI + c] = from_float<In>(k * __expf(gt));
        Kd[t * LDI + c] = from_float<In>(k * __expf(gl - gt));
        Qs[t * LDI + c] = from_float<In>(q * __expf(gt));
      }
      __syncthreads();
    }

    // ---- (S K^T) -> Y^T (hi + lo A fragments), (S Q^T) -> O1 (fp32, into the output staging) --
    uint32_t Yh[4][4], Yl[4][4];
    {
      uint32_t Sa[NK][4];
#pragma unroll
      for (int kk = 0; kk < NK; ++kk) {
        Sa[kk][0] = M::pack(S[2 * kk][0], S[2 * kk][1]);
        Sa[kk][1] = M::pack(S[2 * kk][2], S[2 * kk][3]);
        Sa[kk][2] = M::pack(S[2 * kk + 1][0], S[2 * kk + 1][1]);
        Sa[kk][3] = M::pack(S[2 * kk + 1][2], S[2 * kk + 1][3]);
      }
      // one 16-token block of columns at a time: its two accumulator tiles become Y's k-step jp
#pragma unroll
      for (int jp = 0; jp < 4; ++jp) {
        float ak[2][4];
#pragma unroll
        for (int n = 0; n < 2; ++n) ak[n][0] = ak[n][1] = ak[n][2] = ak[n][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < NK; ++kk) {
          uint32_t b[4];
          ldsm_x4(b, Ks + b_pair(lane, 16 * jp, 16 * kk, LDI));
          M::mma(ak[0], Sa[kk], b[0], b[1]);
          M::mma(ak[1], Sa[kk], b[2], b[3]);
        }
        uint32_t vv[4];  // v in the C layout of tiles 2jp, 2jp+1 of Y^T
        ldsm_x4_trans(vv, Vs + c_pair_trans(lane, 16 * jp, V0, LDI));
#pragma unroll
        for (int jj = 0; jj < 2; ++jj) {
          const int t = 8 * (2 * jp + jj) + 2 * q4;
          const float kf0 = KDA ? 1.0f : sKf[t], kf1 = KDA ? 1.0f : sKf[t + 1];
          const float2 lo = M::unpack(vv[2 * jj]), hi = M::unpack(vv[2 * jj + 1]);
          split_pack<In>(fmaf(-kf0, ak[jj][0], lo.x), fmaf(-kf1, ak[jj][1], lo.y), Yh[jp][2 * jj],
                         Yl[jp][2 * jj]);
          split_pack<In>(fmaf(-kf0, ak[jj][2], hi.x), fmaf(-kf1, ak[jj][3], hi.y),
                         Yh[jp][2 * jj + 1], Yl[jp][2 * jj + 1]);
        }
      }
      float ao[8][4];
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
        // O1^T, transposed into the staging rows [t][v] (the same thread adds v'^T P^T later)
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int t = 8 * j + 2 * q4 + e;
          const float qf = KDA ? 1.0f : sQf[t];
          Os[t * LDO + V0 + g8] = qf * ao[j][e];
          Os[t * LDO + V0 + g8 + 8] = qf * ao[j][2 + e];
        }
    }
    __syncthreads();  // A, P complete; KDA: every read of this chunk's raw inputs done
    if (KDA && ci + 1 < nchunks) issue_loads(ci + 1, 0);

    // ---- T = (I + A)^{-1}, Tb = T diag(beta) ----------------------------------------------------
    invert_unit_lower<L>(Tf, Xs, warp, lane, tid);
    for (int i = tid; i < C * C; i += NT) {
      const int t = i >> 6, sj = i & 63;
      const float x = sj <= t ? Tf[t * LDT + sj] * sBeta[sj] : 0.0f;
      const In hi = from_float<In>(x);
      Tb[t * LDB + sj] = hi;
      Tl[t * LDB + sj] = from_float<In>(x - in_to_float(hi));
    }
    __syncthreads();

    // ---- v'^T = Y^T Tb^T; o^T = O1^T + v'^T P^T; S = S e^{G_L} + (v' d)^T K ---------------------
    {
      // v'^T block by block of 16 tokens: its two tiles become k-step jp of v' and v' d
      uint32_t Ua[4][4], Ud[4][4];
      float ao[8][4];
#pragma unroll
      for (int j = 0; j < 8; ++j) ao[j][0] = ao[j][1] = ao[j][2] = ao[j][3] = 0.0f;
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
          for (int n = 0; n < 2; ++n) {  // hi*hi + hi*lo + lo*hi
            M::mma(au[n], Yh[kk], bh[2 * n], bh[2 * n + 1]);
            M::mma(au[n], Yh[kk], bl[2 * n], bl[2 * n + 1]);
            M::mma(au[n], Yl[kk], bh[2 * n], bh[2 * n + 1]);
          }
        }
#pragma unroll
        for (int jj = 0; jj < 2; ++jj) {
          const int t = 8 * (2 * jp + jj) + 2 * q4;
          Ua[jp][2 * jj] = M::pack(au[jj][0], au[jj][1]);
          Ua[jp][2 * jj + 1] = M::pack(au[jj][2], au[jj][3]);
          if (KDA) {
            Ud[jp][2 * jj] = Ua[jp][2 * jj];
            Ud[jp][2 * jj + 1] = Ua[jp][2 * jj + 1];
          } else {
            const float d0 = sDf[t], d1 = sDf[t + 1];
            Ud[jp][2 * jj] = M::pack(au[jj][0] * d0, au[jj][1] * d1);
            Ud[jp][2 * jj + 1] = M::pack(au[jj][2] * d0, au[jj][3] * d1);
          }
        }
      }
#pragma unroll
      for (int jp = 0; jp < 4; ++jp)
#pragma unroll
        for (int kk = 0; kk <= jp; ++kk) {  // P[t][s] = 0 for s > t
          uint32_t b[4];
          ldsm_x4(b, Pb + b_pair(lane, 16 * jp, 16 * kk, LDB));
          M::mma(ao[2 * jp], Ua[kk], b[0], b[1]);
          M::mma(ao[2 * jp + 1], Ua[kk], b[2], b[3]);
        }
        // o^T = O1^T + v'^T P^T, into the staging rows [t][v]
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int t = 8 * j + 2 * q4 + e;
          Os[t * LDO + V0 + g8] += ao[j][e];
          Os[t * LDO + V0 + g8 + 8] += ao[j][2 + e];
        }
      if constexpr (KDA) {
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
          const int c = 8 * j + 2 * q4;
          const float d0 = sDecL[c], d1 = sDecL[c + 1];
          S[j][0] *= d0;
          S[j][1] *= d1;
          S[j][2] *= d0;
          S[j][3] *= d1;
        }
      } else {
        const float dec = sDecL[0];
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
          S[j][0] *= dec;
          S[j][1] *= dec;
          S[j][2] *= dec;
          S[j][3] *= dec;
        }
      }
      const In* Kx = KDA ? Kd : Ks;
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int np = 0; np < NK; ++np) {
          uint32_t b[4];
          ldsm_x4_trans(b, Kx + b_pair_trans(lane, 16 * kk, 16 * np, LDI));
          M::mma(S[2 * np], Ud[kk], b[0], b[1]);
          M::mma(S[2 * np + 1], Ud[kk], b[2], b[3]);
        }
    }
    const int64_t end = c0 + cv;
    if (checkpoint_at(p, end)) store_checkpoint(p, s, end / p.checkpoint_every - 1, store_state);
    __syncthreads();
    for (int i = tid; i < cv * (D / 4); i += NT) {
      const int t = i / (D / 4), c = (i - t * (D / 4)) * 4;
      store4(p.out.ptr, p.out.dtype, head_offset(p.out, s.seq, s.tok0 + c0 + t, s.hv) + c,
             *reinterpret_cast<const float4*>(Os + t * LDO + c));
    }
  }
  store_final_states(p, s, store_state);
}

}  // namespace deltastate::cuda_backend::prefill
