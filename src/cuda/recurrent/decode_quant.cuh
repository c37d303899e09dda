// The quantized decode kernel of the recurrent op: one token per sequence on a float8_e4m3fn or
// int8 pool (one fp32 scale per row, K = 128 or 64), with the rows' dot products on tensor cores.
// Part of recurrent.cu's translation unit (included there only), in its anonymous namespace.
//
// Why tensor cores. On CUDA cores the quantized step is issue-bound, not byte-bound: ~52
// instructions a state element against ~15 of element work (docs/PERFORMANCE.md, the fp8 row of
// Open gaps), much of it the dots' FMAs and their cross-lane reduction, and the token's
// preparation redone by every 8-row warp. Here a warp owns a 16-row tile and computes its 32 dots
// (S.k and S.q of 16 rows) with K / 16 mma.sync.m16n8k16 in f16: the codes are exact in f16 (e4m3's
// values, and int8's), and the token's vectors are split into two f16 parts, hi + lo, so the
// products carry ~22 bits of each vector entry, and accumulate in fp32.
//
//   S_dec[v, j] = (c[v, j] s_v) alpha_j                   (codes c, row scale s_v, the decay)
//   sk_v = sum_j S_dec[v, j] k_j = s_v (C . (alpha k))_v,  sq_v = s_v (C . (alpha q))_v
//
// Lane layout (g = lane / 4, t = lane % 4): the lane holds rows g and g + 8 of the tile, and of
// each row two runs of R = K / 8 codes, at [R t, R t + R) and [K / 2 + R t, K / 2 + R t + R) (K =
// 128: two 16-byte loads a row, each load instruction covering 64 contiguous bytes of 8 rows; K =
// 64: two 8-byte loads). mma's A fragment of k-block j (PTX "Matrix fragments for
// mma.m16n8k16", chunk_prefill/mma.cuh) asks the lane for columns 2t, 2t + 1, 2t + 8, 2t + 9 of
// rows g and g + 8: they are taken to be the lane's codes 4j .. 4j + 3, the lane's j-th 4-byte
// word of each row. A dot product is the same in any order of K as long as the B operand
// follows it, and B's fragment asks the lane for the same columns (of B column g):
// the lane's B registers are the vector entries at its own K positions. The B columns are the
// four vectors (alpha k)_hi, (alpha k)_lo, (alpha q)_hi, (alpha q)_lo (columns 4-7 zero); the
// accumulator gives lane t = 0 the two halves of sk of rows g and g + 8, lane t = 1 those of sq.
//
// The token is prepared once per warp as in the register decode kernel (K / 32 entries a lane, the
// norms by one transposed reduction, the gate), then shared through the warp's shared memory:
// the four f16 vectors (row-padded against bank conflicts), k and the decay in fp32 for the
// update. The vectors are scaled by a power of two first, so that their largest entry lies in
// [2^14, 2^15) and the lo parts stay normal in f16; the dots are scaled back exactly.
//
// The update then runs in fp32 element by element on the lane's K / 2 elements of a tile: S_new =
// S_dec + u_v k_j (GDN: the row's scale and decay as one factor), the row's amax (max.NaN, over
// its 4 lanes: two shuffles), the fresh scale, and the codes through state_format.cuh's rules,
// each row's K / 4 codes in two stores. y = x / s' is delta_math.h's divide_by (one
// reciprocal a row, three instructions an element, bit for bit the division) where s' >= 2^-40,
// which makes every element whose residual could underflow (|x| < 2^-100) quantize to zero
// either way; smaller scales divide.
//
// A warp takes TPW tiles (1 or 2) of one head, every tile's codes loaded at its start: two tiles
// share one token preparation and have twice the bytes in flight, at 123-126 registers against
// 85-112 at K = 128 (ptxas), so 16 warps an SM where one tile allows 16-20.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "core/delta_math.h"
#include "core/problem.h"
#include "cuda/chunk_prefill/mma.cuh"
#include "cuda/grid.cuh"
#include "cuda/loads.cuh"
#include "cuda/recurrent/head_block.cuh"
#include "cuda/state_fmt.cuh"
#include "cuda/token.cuh"
#include "cuda/tuning.h"

namespace deltastate::cuda_backend {

using detail::RecurrentProblem;

namespace {

constexpr int kQuantTileRows = 16;  // rows of a warp's tile (mma's M)
constexpr int kQuantWarpsPerCta = kQuantDecodeCtaWarps;

// The lane layout for K (64 or 128): lane t of a row's four holds two runs of RUN = K / 8 codes,
// at K = [RUN t, RUN t + RUN) and [K / 2 + RUN t, K / 2 + RUN t + RUN): CODES a row, WORDS 4-byte
// words (one mma k-block each). The token: EPL = K / 32 entries a lane.
template <int K>
struct QuantLayout {
  static_assert(K == 64 || K == 128, "K = 64 or 128");
  static constexpr int RUN = K / 8, CODES = 2 * RUN, WORDS = CODES / 4, EPL = K / 32;
  // The warp's shared memory: the four f16 vectors (rows of K halves, padded so that the B
  // fragments' 16-byte reads of 8 lanes (rows g and g + 1, t = 0..3) hit distinct banks), then k
  // and the decay in fp32.
  static constexpr int VEC_ROW = K + (K == 128 ? 8 : 32);
  struct alignas(16) Smem {  // (its vector reads and writes are 16-byte)
    __half vec[4][VEC_ROW];
    float k[K];
    float alpha[K];
  };
  static_assert(sizeof(Smem) % 16 == 0, "16-byte aligned rows");
};

// A lane's run of RUN codes (16 or 8 bytes) as RUN / 4 words, loaded or stored at once.
template <int RUN>
__device__ __forceinline__ void load_run(const uint8_t* p, uint32_t* w) {
  if constexpr (RUN == 16) {
    const uint4 u = __ldcs(reinterpret_cast<const uint4*>(p));
    w[0] = u.x, w[1] = u.y, w[2] = u.z, w[3] = u.w;
  } else {
    const uint2 u = __ldcs(reinterpret_cast<const uint2*>(p));
    w[0] = u.x, w[1] = u.y;
  }
}
template <int RUN>
__device__ __forceinline__ void store_run(uint8_t* p, const uint32_t* w) {
  if constexpr (RUN == 16) __stcs(reinterpret_cast<uint4*>(p), make_uint4(w[0], w[1], w[2], w[3]));
  else __stcs(reinterpret_cast<uint2*>(p), make_uint2(w[0], w[1]));
}

// The lane's K position of its code i (0 .. CODES - 1) of a row: two runs of K / 8.
template <int K>
__device__ __forceinline__ int quant_lane_k(int t, int i) {
  constexpr int RUN = K / 8;
  return (i < RUN ? RUN * t : K / 2 + RUN * t - RUN) + i;
}

// |x| folded into a running amax that keeps a NaN (max.NaN: one FMNMX with the |.| modifier,
// where amax_step takes a compare and a select): the same amax as amax_step's.
__device__ __forceinline__ float amax_nan(float m, float x) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(m), "f"(fabsf(x)));
  return r;
}

// TPW tiles a warp (consecutive row blocks of one head): every tile's codes are loaded at the
// start, and the token's preparation and B fragments serve them all.
template <DType T, int K, class In, int TPW>
__global__ void __launch_bounds__(kQuantWarpsPerCta * 32, kQuantDecodeCtasPerSm)
    quant_decode_kernel(const RecurrentProblem p, int warps_per_head) {
  static_assert(TPW == 1 || TPW == 2, "one or two tiles a warp");
  using Lay = QuantLayout<K>;
  constexpr int RUN = Lay::RUN, CODES = Lay::CODES, WORDS = Lay::WORDS, EPL = Lay::EPL;
  enter_grid(p.pdl_trigger_early);
  __shared__ typename Lay::Smem smem_all[kQuantWarpsPerCta];
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int w =
      static_cast<int>(blockIdx.x) * kQuantWarpsPerCta + static_cast<int>(threadIdx.x >> 5);
  if (w >= static_cast<int>(p.num_heads_total()) * warps_per_head) return;
  typename Lay::Smem& sm = smem_all[threadIdx.x >> 5];
  const HeadBlock c = head_block(p, w, warps_per_head);
  const int n = c.n, hv = c.hv, h = c.h, V = p.V;
  int rows[TPW][2];  // this lane's rows of each tile
#pragma unroll
  for (int tt = 0; tt < TPW; ++tt) {
    rows[tt][0] = (c.block * TPW + tt) * kQuantTileRows + g;
    rows[tt][1] = rows[tt][0] + 8;
  }

  // The token's inputs (EPL K entries a lane, as the register decode kernel loads them) and v of
  // the lane's rows, issued before the slot's index; converted after the state loads have left.
  using InT = typename In::wide_type;
  TokenHeadInputs<EPL, InT> x_in;
  load_token_head<In>(p, p.g, p.beta, n, 0, h, hv, EPL * lane, EPL, x_in);
  const int64_t v_off = head_offset(p.v, n, 0, hv);
  InT v_in[TPW][2];
#pragma unroll
  for (int tt = 0; tt < TPW; ++tt)
#pragma unroll
    for (int r = 0; r < 2; ++r)  // from a clamped row; rows past V are never used
      v_in[tt][r] = load_input<In, InT>(p.v.ptr, p.v.dtype, v_off + min(rows[tt][r], V - 1));
  const int64_t slot = slot_of(p, n);
  const int64_t o_off = head_offset(p.out, n, 0, hv);

  const bool bad = bad_slot(p, slot);
  if (slot < 0 || bad) {  // padding: zero output, state untouched; a bad index: the same, NaN out
    if (bad) record_bad_slot(p, n, slot, lane == 0 && hv == 0 && c.block == 0);
    const float fill = bad ? bad_row_output() : 0.0f;
    if (t == 1)
#pragma unroll
      for (int tt = 0; tt < TPW; ++tt)
#pragma unroll
        for (int r = 0; r < 2; ++r)
          if (rows[tt][r] < V)
            detail::store_float(p.out.ptr, p.out.dtype, o_off + rows[tt][r], fill);
    return;
  }

  // The lane's codes: per tile 2 rows x 2 runs (words 0 .. WORDS / 2 - 1 the first run), rows
  // past V as zeros; their scales.
  uint8_t* codes = static_cast<uint8_t*>(p.state.ptr) + slot * p.state.slot_stride +
                   static_cast<int64_t>(hv) * V * K;
  float* scales = p.state.scales + slot * p.state.scale_slot_stride + static_cast<int64_t>(hv) * V;
  uint32_t cw[TPW][2][WORDS];
  float s[TPW][2];
#pragma unroll
  for (int tt = 0; tt < TPW; ++tt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const bool in = rows[tt][r] < V;
#pragma unroll
      for (int run = 0; run < 2; ++run) {
        uint32_t* wr = &cw[tt][r][run * WORDS / 2];
        if (in) {
          load_run<RUN>(codes + static_cast<int64_t>(rows[tt][r]) * K + run * (K / 2) + RUN * t,
                        wr);
        } else {
#pragma unroll
          for (int i = 0; i < WORDS / 2; ++i) wr[i] = 0u;
        }
      }
      s[tt][r] = in ? scales[rows[tt][r]] : 0.0f;
    }

  // q, k normalized (q scaled), k.q; the decay; beta (core/delta_math.h), as in decode.cuh.
  TokenHeadInputs<EPL> x = widen(x_in);
  const float kq = prepare_qk<EPL, 32>(x.q, x.k, p.l2norm, p.scale, lane);
  const bool kda = p.gate.kda;
  float alpha[EPL];
  decode_alpha<EPL>(p.gate, x.g, hv, K, EPL * lane, alpha);
  const float beta = detail::beta_value(x.b, p.beta_is_logit, p.round_beta, p.beta.dtype);
  uint64_t key = 0;  // stochastic rounding: the slot's key (the call's step, read here)
  if (p.state.stochastic)
    key = detail::sr_key(p.state.seed, static_cast<uint64_t>(slot), p.state.layer,
                         static_cast<uint64_t>(*p.state.step));

  // The B vectors alpha k and alpha q, scaled by 2^e so that the warp's largest entry lies in
  // [2^14, 2^15) (e >= -114 for any bits, <= 126 so that 2^e and 2^-e stay normal: a zero or
  // tiny vector keeps its zeros; a non-finite entry makes the dots NaN, where the CPU's are
  // infinite or NaN), split hi + lo in f16, into shared memory with k and alpha in fp32.
  float ak[EPL], aq[EPL];
  uint32_t m = 0u;
#pragma unroll
  for (int i = 0; i < EPL; ++i) {
    ak[i] = alpha[i] * x.k[i];
    aq[i] = alpha[i] * x.q[i];
    m = max(m, max(__float_as_uint(ak[i]) & 0x7fffffffu, __float_as_uint(aq[i]) & 0x7fffffffu));
  }
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, d));
  const int e = min(141 - static_cast<int>(m >> 23), 126);
  const float up = __uint_as_float(static_cast<uint32_t>(127 + e) << 23);
  const float down = __uint_as_float(static_cast<uint32_t>(127 - e) << 23);
  {
    uint32_t parts[4][EPL / 2];  // (vector, pair): f16x2 of the lane's entries 2i, 2i + 1
#pragma unroll
    for (int i2 = 0; i2 < EPL / 2; ++i2) {
      __half hh[4][2];
#pragma unroll
      for (int e2 = 0; e2 < 2; ++e2) {
        const float a = ak[2 * i2 + e2] * up, b = aq[2 * i2 + e2] * up;
        hh[0][e2] = __float2half_rn(a);
        hh[1][e2] = __float2half_rn(a - __half2float(hh[0][e2]));
        hh[2][e2] = __float2half_rn(b);
        hh[3][e2] = __float2half_rn(b - __half2float(hh[2][e2]));
      }
#pragma unroll
      for (int v = 0; v < 4; ++v)
        parts[v][i2] = static_cast<uint32_t>(__half_as_ushort(hh[v][0])) |
                       (static_cast<uint32_t>(__half_as_ushort(hh[v][1])) << 16);
    }
#pragma unroll
    for (int v = 0; v < 4; ++v) {
      if constexpr (EPL == 4)
        *reinterpret_cast<uint2*>(&sm.vec[v][EPL * lane]) = make_uint2(parts[v][0], parts[v][1]);
      else *reinterpret_cast<uint32_t*>(&sm.vec[v][EPL * lane]) = parts[v][0];
    }
    if constexpr (EPL == 4) {  // one 16-byte store each (scalar ones conflict 4-way)
      *reinterpret_cast<float4*>(&sm.k[4 * lane]) = make_float4(x.k[0], x.k[1], x.k[2], x.k[3]);
      *reinterpret_cast<float4*>(&sm.alpha[4 * lane]) =
          make_float4(alpha[0], alpha[1], alpha[2], alpha[3]);
    } else {
      *reinterpret_cast<float2*>(&sm.k[2 * lane]) = make_float2(x.k[0], x.k[1]);
      *reinterpret_cast<float2*>(&sm.alpha[2 * lane]) = make_float2(alpha[0], alpha[1]);
    }
  }
  __syncwarp();

  // The dots: B column g (lanes g < 4; the others zero) at the lane's CODES K positions, two
  // registers a k-block (run r's words from bf[r * WORDS]).
  uint32_t bf[2 * WORDS];
#pragma unroll
  for (int run = 0; run < 2; ++run)
#pragma unroll
    for (int h2 = 0; h2 < RUN / 8; ++h2) {
      uint4 u = make_uint4(0u, 0u, 0u, 0u);
      if (g < 4) u = *reinterpret_cast<const uint4*>(&sm.vec[g][run * (K / 2) + RUN * t + 8 * h2]);
      uint32_t* b = &bf[run * WORDS + 4 * h2];
      b[0] = u.x, b[1] = u.y, b[2] = u.z, b[3] = u.w;
    }

#pragma unroll
  for (int tt = 0; tt < TPW; ++tt) {
    float acc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
    for (int j = 0; j < WORDS; ++j) {
      uint32_t a[4];
      fmt::code_halves4(cw[tt][0][j], T, a[0], a[2]);
      fmt::code_halves4(cw[tt][1][j], T, a[1], a[3]);
      prefill::Mma<__half>::mma(acc[j & 1], a, bf[2 * j], bf[2 * j + 1]);
    }
    // Lane t = 0: the hi and lo halves of sk of rows g, g + 8; lane t = 1: of sq.
    float u[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float dot =
          s[tt][r] *
          (((acc[0][2 * r] + acc[1][2 * r]) + (acc[0][2 * r + 1] + acc[1][2 * r + 1])) * down);
      const float uk = detail::delta_u(to_float(v_in[tt][r]), dot, beta);  // meaningful on t = 0
      u[r] = __shfl_sync(0xffffffffu, uk, lane & ~3);
      if (t == 1 && rows[tt][r] < V)
        detail::store_float(p.out.ptr, p.out.dtype, o_off + rows[tt][r],
                            detail::delta_output(dot, u[r], kq));
    }

    // The update, row by row: S_new = S_dec + u k in fp32 (GDN: the row's scale and decay as one
    // factor), the row's amax over its 4 lanes, the fresh scale, the codes (one store a run) and
    // the scale (lane t = 0).
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = rows[tt][r];
      const float sa = s[tt][r] * alpha[0];
      float xs[CODES];
      float am = 0.0f;
#pragma unroll
      for (int j = 0; j < WORDS; ++j) {
        float cv[4];
        fmt::code_values4(cw[tt][r][j], T, cv);
        const int k0 = quant_lane_k<K>(t, 4 * j);
        const float4 kk = *reinterpret_cast<const float4*>(&sm.k[k0]);
        const float kv[4] = {kk.x, kk.y, kk.z, kk.w};
        float sd[4];
        if (kda) {
          const float4 al = *reinterpret_cast<const float4*>(&sm.alpha[k0]);
          const float av[4] = {al.x, al.y, al.z, al.w};
#pragma unroll
          for (int i = 0; i < 4; ++i) sd[i] = (cv[i] * s[tt][r]) * av[i];
        } else {
#pragma unroll
          for (int i = 0; i < 4; ++i) sd[i] = cv[i] * sa;
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          xs[4 * j + i] = fmaf(u[r], kv[i], sd[i]);
          am = amax_nan(am, xs[4 * j + i]);
        }
      }
#pragma unroll
      for (int d = 1; d < 4; d <<= 1) am = amax_nan(am, __shfl_xor_sync(0xffffffffu, am, d));
      if (row >= V) continue;
      const float sn = fmt::fresh_scale(T, am);
      const uint64_t index0 = static_cast<uint64_t>((static_cast<int64_t>(hv) * V + row) * K);
      uint32_t out[WORDS];
      auto encode = [&](auto divide) {
        // Two tiles a warp: float8 nearest rounding as one row-uniform branch around the row's
        // words (H100, B = 256, f8n: GDN 185 -> 165-167 us, Kimi-Linear 240 -> 211-213); the
        // one-tile kernel keeps the branch per word (hoisted there: GDN 195-198 -> 201-204,
        // Kimi-Linear 257 -> 275; bench/results/decode-quant-hoist-h100.txt).
        if (TPW == 2 && T == DType::f8e4m3 && !p.state.stochastic) {
#pragma unroll
          for (int j = 0; j < WORDS; ++j) {
            float y[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) y[i] = divide(xs[4 * j + i]);
            out[j] = fmt::e4m3_codes4(y);
          }
          return;
        }
#pragma unroll
        for (int j = 0; j < WORDS; ++j) {
          float y[4];
#pragma unroll
          for (int i = 0; i < 4; ++i) y[i] = divide(xs[4 * j + i]);
          out[j] = fmt::encode_codes4(T, y, p.state.stochastic, key,
                                      index0 + static_cast<uint64_t>(quant_lane_k<K>(t, 4 * j)));
        }
      };
      if (sn < 0x1p-40f) {  // (row-uniform; a NaN scale takes divide_by: NaN either way)
        encode([&](float v) { return v / sn; });
      } else {
        const float rn = 1.0f / sn;
        encode([&](float v) { return detail::divide_by(v, sn, rn); });
      }
      uint8_t* row_codes = codes + static_cast<int64_t>(row) * K;
#pragma unroll
      for (int run = 0; run < 2; ++run)
        store_run<RUN>(row_codes + run * (K / 2) + RUN * t, &out[run * WORDS / 2]);
      if (t == 0) scales[row] = sn;
    }
  }
}

}  // namespace
}  // namespace deltastate::cuda_backend
