// The prep kernel of the Hopper KDA prefill (K = V = 128, q/k/v all bf16 or all fp16): everything
// of a chunk that does not involve the state, in parallel over chunk slots and value heads, into
// the workspace blocks the scan kernel (hopper_scan.cuh, KDA) loads with TMA. Part of
// chunk_prefill_hopper.cu's translation unit.
//
// KDA's decay is per key channel c: G_t[c] = the chunk's cumulative log decay up to token t, so
// the token pairs' products carry e^{G_t[c] - G_s[c]} inside the sum over c and no per-token
// factor can be pulled out of them (GDN's prep, hopper_prep.cuh, scales whole products). With
// k^ = rk k, q^ = rq q (the norms; rq with the scale):
//   A_ts = beta_t sum_c k^_t k^_s e^{G_t - G_s} (s < t),
//   P_ts = sum_c q^_t k^_s e^{G_t - G_s} (s <= t)
// The blocks of 16 tokens below the diagonal go on tensor cores by sub-chunk factorization (FLA's
// chunk_intra): block i of the rows against block j < i of the columns, with the reference
// r = 16 i (block i's first token),
//   A_ij = beta_t (k^_t e^{G_t - G_r}) . (k^_s e^{G_r - G_s}),  P_ij = (q^_t e^{G_t - G_r}) . (..)
// both exponents <= 0 for t >= r > s whatever the gate (G does not increase), so nothing
// overflows and a factor that underflows belongs to a product below fp32's range. The factors are
// rounded to fp16 (|k^|, |q^| <= 1 and the decays <= 1: fp16's range holds them, and its mantissa
// makes the factorization cost nothing against exact fp32 pairs: tests/gpu/emulate_hopper_kda.py).
// Inside the four diagonal blocks the same holds for the 8 x 8 piece below each block's own
// diagonal (rows 16 i + 8.. against columns 16 i.., reference r = 16 i + 8), which goes on tensor
// cores too; the eight 8 x 8 sub-blocks on the diagonal, where a reference inside would put an
// exponent above zero, are exact: pairwise in fp32 on CUDA cores. Then T =
// (I + A)^{-1} on tensor cores (tc_inverse.cuh) and the operands of the scan, each rounded to the
// input dtype once: q^ e^{G}, k^ e^{G} (S Q^T and S K^T) and k^ e^{G_L - G} (the update), with
// gamma = e^{G_L} per channel.
//
// A CTA (grid (chunk slot j, value head), 8 warps, two CTAs an SM: the raw k and q, G [C][D]
// fp32 in log2 units, the column keys): every thread computes gates of (token, channel) from
// coalesced loads and a thread a channel takes their prefix; all eight warps make the diagonal
// sub-blocks' pairs from the raw k and q, 2 x 2 pairs a tile of 16 lanes, and the 8 x 8 pieces
// below them on tensor cores; then each thread writes the fp16 factors over its own words of k
// and q, and warps 0-3 run the factored blocks' products (12 blocks of 16 x 16, A's and P's,
// three a warp); then warps 0-3 invert and store Tb while warps 4-7 store P. Block b = hv *
// slots + j (hopper_scan.cuh Blocks): Tb = T diag(beta) and P in the input dtype [t][s]; the
// scalars' rows 2 and 3 gamma [D]; the decayed q, k, and the update's keys [C][D]. Tokens past
// the sequence's end have beta = rk = rq = 0: their rows and columns of Tb and P and their rows
// of the decayed operands are zeros.
#pragma once

#include <cstdint>

#include "cuda/chunk_prefill/hopper_prep.cuh"
#include "cuda/reduce.cuh"

namespace deltastate::cuda_backend::prefill::hopper {

struct PrepKdaLayout {
  static constexpr int C = kC, D = kD;
  static constexpr int NW = 8, THREADS = NW * 32;
  static constexpr int LDI = D + 8;  // 16-bit rows [.][LDI]: k, q, the fp16 factors
  static constexpr int LDG = D + 4;  // fp32 G [C][LDG]
  static constexpr int LDB = TcInverse::LDH;
  // the factored blocks' column keys: block i's rows against every earlier token s < 16 i,
  // k^_s e^{G_{16 i} - G_s}, rows 8 i (i - 1) .. (i = 1, 2, 3: 16 + 32 + 48)
  static constexpr int KB_ROWS = 96;
  // k and q, then (each thread over its own words) the fp16 factors Ka and Qa
  static constexpr int OFF_K = 0, OFF_Q = OFF_K + C * LDI * 2, OFF_G = OFF_Q + C * LDI * 2,
                       OFF_KB = OFF_G + C * LDG * 4, OFF_SC = OFF_KB + KB_ROWS * LDI * 2;
  // once the products are in registers, the factors' space (Ka, Qa) holds A's fp16 blocks below
  // the diagonal, T's fp16 blocks and P (16-bit)
  static constexpr int OFF_AH = OFF_K, OFF_TH = OFF_AH + TcInverse::H_BYTES,
                       OFF_P = OFF_TH + TcInverse::H_BYTES;
  // after beta, rk, rq: the diagonal blocks' pairs, written while k and q are still read: A
  // (fp32, the inversion's input as it is) and P (fp32, into P's blocks once the factors' space
  // is free)
  static constexpr int OFF_AD = OFF_SC + 3 * C * 4, OFF_PD = OFF_AD + TcInverse::AD_BYTES;
  static constexpr int SMEM = OFF_PD + TcInverse::AD_BYTES;
  static_assert(OFF_P + C * LDB * 2 <= OFF_G, "A, T and P in the factors' space");
  static_assert(OFF_G % 16 == 0 && OFF_KB % 16 == 0 && OFF_SC % 16 == 0 && OFF_AD % 16 == 0 &&
                    OFF_PD % 16 == 0 && OFF_TH % 16 == 0 && OFF_P % 16 == 0,
                "16-byte aligned regions");
  static_assert(ctas_fit_smem(2, SMEM), "two CTAs an SM");
};

// Factored block `item` of a warp (0..11): A's blocks (i, j), j < i, then P's.
struct KdaBlock {
  bool p;
  int i, j;
};
__device__ __forceinline__ KdaBlock kda_block(int item) {
  const int a = item % 6;
  const int i = a == 0 ? 1 : a < 3 ? 2 : 3;
  const int j = a - (i == 1 ? 0 : i == 2 ? 1 : 3);
  return {item >= 6, i, j};
}
// Tile `w` (0..9) of the lower triangle of an 8 x 8 sub-block's 4 x 4 tiles of 2 x 2 pairs, row
// by row: (row a, column b <= a).
struct TriTile {
  int a, b;
};
__device__ __forceinline__ TriTile tri_tile(int w) {
  const int a = (w >= 1) + (w >= 3) + (w >= 6);
  return {a, w - a * (a + 1) / 2};
}
constexpr float kLn2 = 0.6931471805599453f;
// 2^x in one MUFU.EX2 (expf adds a multiply and a subnormal fix-up around it). A result below
// 2^-126 flushes to zero: each decay here multiplies terms of magnitude <= 1, and the gates
// below select or divide past an overflow to infinity.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
// detail::gate_value's two kernel gates (core/delta_math.h) on the MUFU unit, about 14 and 6
// instructions where expf, log1pf and the division take about 35 and 20, given rate = e^{A_log}:
//   softplus: -rate log(1 + e^z), z = x + dt, as ln 2 log2(1 + e^z), or below e^z = 2^-5 as the
//     series e - e^2/2 + e^3/3 - e^4/4 (where 1 + e would drop e's low bits and log2's absolute
//     error would show), z itself above 20; relative error <= 1e-5 (largest at the switch);
//   safe: lower_bound sigmoid(rate z) as one approximate division (2 ulp).
// Both are far below the 2^-8 of a bf16 gate input and the outputs' tolerances; the GPU tests
// hold them to the CPU's gate_value through every output.
__device__ __forceinline__ float softplus_gate(float x, float dt, float rate) {
  const float z = x + dt;
  const float e = exp2_ftz(z * kLog2e);
  float lg;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(lg) : "f"(1.0f + e));
  const float series = e * fmaf(-e, fmaf(-e, fmaf(-e, 0.25f, 1.0f / 3.0f), 0.5f), 1.0f);
  const float sp = z > detail::kSoftplusThreshold ? z : e < 0.03125f ? series : lg * kLn2;
  return -rate * sp;
}
__device__ __forceinline__ float safe_gate(float x, float dt, float rate, float lower_bound) {
  return __fdividef(lower_bound, 1.0f + exp2_ftz(-(rate * (x + dt)) * kLog2e));
}
// The first row of block i's column keys in Kb.
__device__ __forceinline__ int kb_row0(int i) { return 8 * i * (i - 1); }

template <class In>
__global__ void __launch_bounds__(PrepKdaLayout::THREADS, 2)
    chunk_prefill_hopper_prep_kda_kernel(const ChunkPrefillProblem p, int64_t slots) {
  using L = PrepKdaLayout;
  using M = Mma<In>;
  using H = Mma<__half>;
  constexpr int C = L::C, D = L::D, NT = L::THREADS, LDI = L::LDI, LDG = L::LDG, LDB = L::LDB;
  enter_grid(false);
  const SplitChunk ch = split_locate(p, blockIdx.x);
  if (ch.n < 0) return;
  const int hv = static_cast<int>(blockIdx.y);
  const Seq s = resolve_sequence(p, ch.n * p.HV + hv);
  if (s.padded) return;  // the scan kernel writes its zeros; nothing reads its blocks
  extern __shared__ __align__(16) unsigned char smem[];
  In* const Ks = reinterpret_cast<In*>(smem + L::OFF_K);
  In* const Qs = reinterpret_cast<In*>(smem + L::OFF_Q);
  float* const Gs = reinterpret_cast<float*>(smem + L::OFF_G);
  __half* const Ka = reinterpret_cast<__half*>(smem + L::OFF_K);  // over Ks, Qs
  __half* const Qa = reinterpret_cast<__half*>(smem + L::OFF_Q);
  __half* const Kb = reinterpret_cast<__half*>(smem + L::OFF_KB);
  __half* const Ah = reinterpret_cast<__half*>(smem + L::OFF_AH);
  float* const Ad = reinterpret_cast<float*>(smem + L::OFF_AD);
  float* const Pd = reinterpret_cast<float*>(smem + L::OFF_PD);
  __half* const Th = reinterpret_cast<__half*>(smem + L::OFF_TH);
  In* const Pb = reinterpret_cast<In*>(smem + L::OFF_P);
  float* const sBeta = reinterpret_cast<float*>(smem + L::OFF_SC);
  float* const sRk = sBeta + C;
  float* const sRq = sRk + C;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t c0 = ch.ci * C;
  const int cv = static_cast<int>(s.len - c0 < C ? s.len - c0 : C);
  const BlockPtrs out = block_ptrs(p.workspace, slots * p.HV, int64_t{hv} * slots + blockIdx.x);

  split_load_rows<D>(Ks, p.k, static_cast<const In*>(p.k.ptr), s, s.h, c0, cv, tid, NT);
  split_load_rows<D>(Qs, p.q, static_cast<const In*>(p.q.ptr), s, s.h, c0, cv, tid, NT);
  cp_async_commit_group();
  const detail::GateParams& gate = p.gate;
  const float A_log = gate.A_log ? detail::load_float(gate.A_log, gate.A_log_dtype, s.hv) : 0.0f;
  if (warp == 0) chunk_beta_and_decay<true>(p, s, c0, cv, A_log, lane, sBeta, nullptr, nullptr);
  {  // the gates g[t][c] by every thread (token t0 + 2 j, channel tid % D: coalesced loads, all
     // in flight before the first is used), in place into G
    const int c = tid % D, t0 = tid / D;
    const float dt = gate.dt_bias ? detail::load_float(gate.dt_bias, gate.dt_bias_dtype,
                                                       static_cast<int64_t>(s.hv) * D + c)
                                  : 0.0f;
    constexpr int kRows = C / (NT / D);
    // the thread's tokens tok0 + c0 + t0 + 2 j, one dtype branch outside the loads (a branch per
    // load made this phase 2,437 SASS instructions)
    const int64_t g0 = head_offset(p.g, s.seq, s.tok0 + c0 + t0, s.hv) + c;
    const int64_t gstep = 2 * p.g.tok_stride;
    if (p.g.dtype == DType::f32) {
      const float* gp = static_cast<const float*>(p.g.ptr) + g0;
      float raw[kRows];
#pragma unroll
      for (int j = 0; j < kRows; ++j) raw[j] = t0 + 2 * j < cv ? __ldg(gp + j * gstep) : 0.0f;
#pragma unroll
      for (int j = 0; j < kRows; ++j) Gs[(t0 + 2 * j) * LDG + c] = raw[j];
    } else {
      const uint16_t* gp = static_cast<const uint16_t*>(p.g.ptr) + g0;
      uint32_t raw[kRows];
#pragma unroll
      for (int j = 0; j < kRows; ++j) raw[j] = t0 + 2 * j < cv ? load_u16_wide(gp + j * gstep) : 0u;
      if (p.g.dtype == DType::bf16) {
#pragma unroll
        for (int j = 0; j < kRows; ++j)
          Gs[(t0 + 2 * j) * LDG + c] = to_float(Wide<__nv_bfloat16>{raw[j]});
      } else {
#pragma unroll
        for (int j = 0; j < kRows; ++j) Gs[(t0 + 2 * j) * LDG + c] = to_float(Wide<__half>{raw[j]});
      }
    }
    const float rate = expf(A_log);
    if (gate.mode == detail::GateMode::softplus) {
#pragma unroll 4
      for (int t = t0; t < cv; t += 2) Gs[t * LDG + c] = softplus_gate(Gs[t * LDG + c], dt, rate);
    } else if (gate.mode == detail::GateMode::safe) {
#pragma unroll 4
      for (int t = t0; t < cv; t += 2)
        Gs[t * LDG + c] = safe_gate(Gs[t * LDG + c], dt, rate, gate.lower_bound);
    }
  }
  cp_async_wait_group<0>();
  __syncthreads();  // the gates, k and q are in
  if (tid < D) {    // channel c's prefix over the chunk, in the CPU's order (g = 0 past the end),
                    // kept in log2 units: each exponential below is one exp2
    const int c = tid;
    float run = 0.0f;
#pragma unroll 8
    for (int t = 0; t < C; ++t) {
      run += Gs[t * LDG + c];
      Gs[t * LDG + c] = run * kLog2e;
    }
    out.scal[2 * C + c] = expf(run);                  // gamma: the scalars' rows 2 and 3
    if (c < C) out.scal[c] = out.scal[C + c] = 0.0f;  // rows 0 and 1: unused
  } else {  // warps 4-7 meanwhile: the norms, a thread a row (about as long as the prefix)
    prep_norms<In, NT - D>(p, Ks, Qs, cv, tid - D, sRk, sRq);
  }
  __syncthreads();

  // The diagonal blocks' lower-left 8 x 8 pieces' factors through r = 16 i + 8, in fp16, into
  // Kb's space (free until the factors below): Rk = k^_t e^{G_t - G_r}, Rq = q^_t e^{G_t - G_r}
  // (t = r..r + 7) at rows 8 i and 32 + 8 i, Kc = k^_s e^{G_r - G_s} (s = 16 i..r - 1) at rows
  // 64 + 8 i; Rk and Rq share their exponentials.
  for (int it = tid; it < 64 * (D / 8); it += NT) {
    const int rw = it / (D / 8), c8 = 8 * (it % (D / 8)), i = (rw % 32) / 8;
    const bool col = rw >= 32;
    const int t = 16 * i + (col ? 0 : 8) + rw % 8, r = 16 * i + 8;
    const uint4 kw = *reinterpret_cast<const uint4*>(Ks + t * LDI + c8);
    const uint4 qw = *reinterpret_cast<const uint4*>(Qs + t * LDI + c8);
    const uint32_t ku[4] = {kw.x, kw.y, kw.z, kw.w}, qu[4] = {qw.x, qw.y, qw.z, qw.w};
    const float rk = sRk[t], rq = sRq[t];
    uint32_t fk[4], fq[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 kx = M::unpack(ku[e]), qx = M::unpack(qu[e]);
      const float2 gt = *reinterpret_cast<const float2*>(Gs + t * LDG + c8 + 2 * e);
      const float2 gr = *reinterpret_cast<const float2*>(Gs + r * LDG + c8 + 2 * e);
      const float x0 = exp2_ftz(col ? gr.x - gt.x : gt.x - gr.x),
                  x1 = exp2_ftz(col ? gr.y - gt.y : gt.y - gr.y);
      fk[e] = H::pack(kx.x * rk * x0, kx.y * rk * x1);
      fq[e] = H::pack(qx.x * rq * x0, qx.y * rq * x1);
    }
    const int row = col ? 64 + 8 * i + rw % 8 : 8 * i + rw % 8;
    *reinterpret_cast<uint4*>(Kb + row * LDI + c8) = make_uint4(fk[0], fk[1], fk[2], fk[3]);
    if (!col)
      *reinterpret_cast<uint4*>(Kb + (row + 32) * LDI + c8) =
          make_uint4(fq[0], fq[1], fq[2], fq[3]);
  }
  __syncthreads();

  // Warp w: block i = w % 4's lower-left piece of A (w < 4) or P, Rk or Rq against Kc on tensor
  // cores (a 16 x 8 product of which rows 0-7 are the piece), into Ad or Pd with zeros in the
  // piece above the block's diagonal (rows 16 i.., columns 16 i + 8..).
  {
    const int i = warp % 4;
    const bool wp = warp >= 4;
    float z[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int kk = 0; kk < D / 32; ++kk) {  // two k-steps: Kc's 8 rows, 32 columns
      uint32_t a0[4], a1[4], b[4];
      ldsm_x4(a0, Kb + a_tile(lane, (wp ? 32 : 0) + 8 * i, 32 * kk, LDI));
      ldsm_x4(a1, Kb + a_tile(lane, (wp ? 32 : 0) + 8 * i, 32 * kk + 16, LDI));
      ldsm_x4(b, Kb + (64 + 8 * i + (lane & 7)) * LDI + 32 * kk + 8 * (lane >> 3));
      H::mma(z, a0, b[0], b[1]);
      H::mma(z, a1, b[2], b[3]);
    }
    const int g8 = lane >> 2, q4 = lane & 3, t = 16 * i + 8 + g8, sl = 2 * q4;
    const float f = wp ? 1.0f : sBeta[t];
    float* const dst = wp ? Pd : Ad;
    *reinterpret_cast<float2*>(dst + t * TcInverse::LDD + sl) = make_float2(f * z[0], f * z[1]);
    *reinterpret_cast<float2*>(dst + (t - 8) * TcInverse::LDD + 8 + sl) = make_float2(0.0f, 0.0f);
  }

  // The 8 x 8 sub-blocks on the diagonal, exactly in fp32, from the raw k and q: tiles of 2 x 2
  // pairs (rows t0, t0 + 1 against columns s0, s0 + 1), 10 a sub-block on or below its diagonal,
  // 80 in all, five rounds of 16 tiles; 16 lanes a tile, lane l the channels 4 l .. and
  // 64 + 4 l .. (a tile's four pairs share its six rows of k and q and four of G). The lanes'
  // sums meet by reduce.cuh's transpose_reduce<16, 8>: lane l ends with value (l >> 1) & 7 of
  // A's four pairs then P's, and the even lanes store the tile, the odd ones the mirrored zeros
  // of the tile above the diagonal, into Ad and Pd (outside the factors' space, which k and q
  // still hold).
  {
    const int l16 = lane & 15, grp = tid >> 4;
    const int idx = reduced_index<16, 8>(l16), dt = (idx >> 1) & 1, ds = idx & 1;
    const bool is_p = idx >= 4;
    float* const dst = is_p ? Pd : Ad;
#pragma unroll 1
    for (int m = 0; m < 5; ++m) {
      const int u = grp + 16 * m;
      const TriTile tt = tri_tile(u % 10);
      const int t0 = 8 * (u / 10) + 2 * tt.a, s0 = 8 * (u / 10) + 2 * tt.b;
      float v[8];  // A (t0, s0), (t0, s0 + 1), (t0 + 1, s0), (t0 + 1, s0 + 1), then P's
#pragma unroll
      for (int e = 0; e < 8; ++e) v[e] = 0.0f;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int c = 64 * h + 4 * l16;
        float kt[2][4], qt[2][4], ks[2][4], gt[2][4], gs[2][4];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const uint2 kw = *reinterpret_cast<const uint2*>(Ks + (t0 + r) * LDI + c);
          const uint2 qw = *reinterpret_cast<const uint2*>(Qs + (t0 + r) * LDI + c);
          const uint2 sw = *reinterpret_cast<const uint2*>(Ks + (s0 + r) * LDI + c);
          const float4 g1 = *reinterpret_cast<const float4*>(Gs + (t0 + r) * LDG + c);
          const float4 g2 = *reinterpret_cast<const float4*>(Gs + (s0 + r) * LDG + c);
          const float2 k0 = M::unpack(kw.x), k1 = M::unpack(kw.y), q0 = M::unpack(qw.x),
                       q1 = M::unpack(qw.y), x0 = M::unpack(sw.x), x1 = M::unpack(sw.y);
          kt[r][0] = k0.x, kt[r][1] = k0.y, kt[r][2] = k1.x, kt[r][3] = k1.y;
          qt[r][0] = q0.x, qt[r][1] = q0.y, qt[r][2] = q1.x, qt[r][3] = q1.y;
          ks[r][0] = x0.x, ks[r][1] = x0.y, ks[r][2] = x1.x, ks[r][3] = x1.y;
          gt[r][0] = g1.x, gt[r][1] = g1.y, gt[r][2] = g1.z, gt[r][3] = g1.w;
          gs[r][0] = g2.x, gs[r][1] = g2.y, gs[r][2] = g2.z, gs[r][3] = g2.w;
        }
#pragma unroll
        for (int e = 0; e < 4; ++e)
#pragma unroll
          for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int j = 0; j < 2; ++j) {
              // (t0, s0 + 1) of a tile on the diagonal lies above it: its exponent may be > 0,
              // and its sums are not stored
              const float w = ks[j][e] * exp2_ftz(gt[i][e] - gs[j][e]);
              v[2 * i + j] = fmaf(kt[i][e], w, v[2 * i + j]);
              v[4 + 2 * i + j] = fmaf(qt[i][e], w, v[4 + 2 * i + j]);
            }
      }
      const float x = transpose_reduce<16, 8>(v, l16);
      const int t = t0 + dt, sj = s0 + ds;
      if (!(l16 & 1)) {
        const bool keep = is_p ? sj <= t : sj < t;
        dst[t * TcInverse::LDD + sj % 16] =
            keep ? (is_p ? sRq[t] : sBeta[t] * sRk[t]) * sRk[sj] * x : 0.0f;
      } else if (tt.a > tt.b) {
        dst[sj * TcInverse::LDD + t % 16] = 0.0f;  // the mirrored pair, above the diagonal
      }
    }
  }
  __syncthreads();  // the pairs have read k and q

  // The factors and the scan's operands, 8 channels of a row at a time (row 16 i + tid / 16 in
  // round i, so the block, and with it which factors the row has, is known at compile time): Ka,
  // Qa over the thread's own words of k and q (reference 16 i; the blocks below the diagonal
  // start at block 1) and the column keys of every later block, in fp16; q^ e^{G}, k^ e^{G},
  // k^ e^{G_L - G} in the input dtype to the workspace.
  static_assert(C * (D / 8) == 4 * NT, "four rounds of a row block");
  const auto load8 = [&](int row, int c8, float(&g)[8]) {
    const float4 a = *reinterpret_cast<const float4*>(Gs + row * LDG + c8);
    const float4 b = *reinterpret_cast<const float4*>(Gs + row * LDG + c8 + 4);
    g[0] = a.x, g[1] = a.y, g[2] = a.z, g[3] = a.w, g[4] = b.x, g[5] = b.y, g[6] = b.z, g[7] = b.w;
  };
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int t = 16 * i + tid / (D / 8), c8 = 8 * (tid % (D / 8));
    const uint4 kw = *reinterpret_cast<const uint4*>(Ks + t * LDI + c8);
    const uint4 qw = *reinterpret_cast<const uint4*>(Qs + t * LDI + c8);
    const uint32_t ku[4] = {kw.x, kw.y, kw.z, kw.w}, qu[4] = {qw.x, qw.y, qw.z, qw.w};
    const float rk = sRk[t], rq = sRq[t];
    float G[8], GL[8];
    load8(t, c8, G);
    load8(C - 1, c8, GL);
    float k[8], q[8];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 kx = M::unpack(ku[e]), qx = M::unpack(qu[e]);
      k[2 * e] = kx.x * rk, k[2 * e + 1] = kx.y * rk, q[2 * e] = qx.x * rq,
            q[2 * e + 1] = qx.y * rq;
    }
    uint32_t w0[4], w1[4], w2[4];
    if (i > 0) {  // Ka, Qa through reference 16 i
      float Gr[8];
      load8(16 * i, c8, Gr);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float e0 = exp2_ftz(G[2 * e] - Gr[2 * e]),
                    e1 = exp2_ftz(G[2 * e + 1] - Gr[2 * e + 1]);
        w0[e] = H::pack(k[2 * e] * e0, k[2 * e + 1] * e1);
        w1[e] = H::pack(q[2 * e] * e0, q[2 * e + 1] * e1);
      }
      *reinterpret_cast<uint4*>(Ka + t * LDI + c8) = make_uint4(w0[0], w0[1], w0[2], w0[3]);
      *reinterpret_cast<uint4*>(Qa + t * LDI + c8) = make_uint4(w1[0], w1[1], w1[2], w1[3]);
    }
#pragma unroll
    for (int b = i + 1; b < 4; ++b) {  // column keys of block b (reference 16 b)
      float Gr[8];
      load8(16 * b, c8, Gr);
#pragma unroll
      for (int e = 0; e < 4; ++e)
        w0[e] = H::pack(k[2 * e] * exp2_ftz(Gr[2 * e] - G[2 * e]),
                        k[2 * e + 1] * exp2_ftz(Gr[2 * e + 1] - G[2 * e + 1]));
      *reinterpret_cast<uint4*>(Kb + (kb_row0(b) + t) * LDI + c8) =
          make_uint4(w0[0], w0[1], w0[2], w0[3]);
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float e0 = exp2_ftz(G[2 * e]), e1 = exp2_ftz(G[2 * e + 1]);
      w0[e] = M::pack(q[2 * e] * e0, q[2 * e + 1] * e1);
      w1[e] = M::pack(k[2 * e] * e0, k[2 * e + 1] * e1);
      w2[e] = M::pack(k[2 * e] * exp2_ftz(GL[2 * e] - G[2 * e]),
                      k[2 * e + 1] * exp2_ftz(GL[2 * e + 1] - G[2 * e + 1]));
    }
    const int64_t o = int64_t{t} * D + c8;
    reinterpret_cast<uint4*>(static_cast<In*>(out.qg) + o)[0] =
        make_uint4(w0[0], w0[1], w0[2], w0[3]);
    reinterpret_cast<uint4*>(static_cast<In*>(out.kg) + o)[0] =
        make_uint4(w1[0], w1[1], w1[2], w1[3]);
    reinterpret_cast<uint4*>(static_cast<In*>(out.kd) + o)[0] =
        make_uint4(w2[0], w2[1], w2[2], w2[3]);
  }
  __syncthreads();

  // warps 0-3: three factored blocks each (A's or P's block (i, j): rows 16 i.., columns 16 j..)
  // on tensor cores, in registers until the factors' space is free
  const bool is_mma = warp < 4;
  float acc[3][2][4];
  if (is_mma) {
#pragma unroll
    for (int m = 0; m < 3; ++m) {
      const KdaBlock bk = kda_block(warp + 4 * m);
      const __half* X = bk.p ? Qa : Ka;
#pragma unroll
      for (int n = 0; n < 2; ++n) acc[m][n][0] = acc[m][n][1] = acc[m][n][2] = acc[m][n][3] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t a[4], b[4];
        ldsm_x4(a, X + a_tile(lane, 16 * bk.i, 16 * kk, LDI));
        ldsm_x4(b, Kb + b_pair(lane, kb_row0(bk.i) + 16 * bk.j, 16 * kk, LDI));
        H::mma(acc[m][0], a, b[0], b[1]);
        H::mma(acc[m][1], a, b[2], b[3]);
      }
    }
  }
  __syncthreads();  // the factors are read: their space takes A, T and P

  if (is_mma) {  // the factored blocks, scaled (A: beta_t), into Ah and Pb
    const int g8 = lane >> 2, q4 = lane & 3;
#pragma unroll
    for (int m = 0; m < 3; ++m) {
      const KdaBlock bk = kda_block(warp + 4 * m);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int t = 16 * bk.i + g8 + 8 * h;
        const float f = bk.p ? 1.0f : sBeta[t];
#pragma unroll
        for (int n = 0; n < 2; ++n) {
          const int sc0 = 16 * bk.j + 8 * n + 2 * q4;
          const float x0 = f * acc[m][n][2 * h], x1 = f * acc[m][n][2 * h + 1];
          if (bk.p) *reinterpret_cast<uint32_t*>(Pb + t * LDB + sc0) = M::pack(x0, x1);
          else *reinterpret_cast<uint32_t*>(Ah + t * LDB + sc0) = H::pack(x0, x1);
        }
      }
    }
  }
  // P's diagonal blocks from Pd, two entries a thread
  for (int i = tid; i < C * 8; i += NT) {
    const int t = i / 8, si = 2 * (i % 8);
    const float2 x = *reinterpret_cast<const float2*>(Pd + t * TcInverse::LDD + si);
    *reinterpret_cast<uint32_t*>(Pb + t * LDB + 16 * (t / 16) + si) = M::pack(x.x, x.y);
  }
  __syncthreads();

  if (!is_mma) {  // warps 4-7: P (zeros above the diagonal blocks) while warps 0-3 invert
    store_p_block(out.p, Pb, tid - NT / 2, NT / 2);
    return;
  }
  // warps 0-3: T = (I + A)^{-1}, Tb = T diag(beta) in the input dtype from the inversion's pairs,
  // the blocks above the diagonal as zeros (hopper_prep.cuh's stores)
  In* const tb = static_cast<In*>(out.t);
  invert_unit_lower_tc(
      Ah, Ad, Th, warp, lane, PrepInverseSync{}, [&](int t, int s0, float x0, float x1) {
        *reinterpret_cast<uint32_t*>(tb + t * C + s0) = M::pack(x0 * sBeta[s0], x1 * sBeta[s0 + 1]);
      });
  store_tb_upper_zeros(tb, tid);
}

}  // namespace deltastate::cuda_backend::prefill::hopper
