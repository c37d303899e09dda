// ReplaySSM decode with a bf16 checkpoint on one warp a CTA: bf16 inputs, K = 128, L <= 16; GDN
// at every B, KDA from kReplayWarpKdaWaves waves (replayssm_decode.cu; tuning.h has the
// measurements). Its shape is SGLang's Triton kernel's (two one-warp programs a head, no
// barriers), which was ahead of the 8-warp kernels, whose per-head chain of loads and barriers
// runs serially, from B = 8. Part of replayssm_decode.cu's translation unit (after decode.cuh),
// in its anonymous namespace.
//
// A CTA is one warp over WR = 16 * MT rows of one (row n, value head hv): every piece of the
// per-head work is its own (the slot, the cursor, the token, the ring), so no CTA barrier orders
// it, and a head's CTAs run independently. The rows are decode_tc.cuh's tensor-core tiles: m-tile
// mt holds rows 16 mt .. 16 mt + 15, lane (g, t) its 16-byte chunks of rows g and g + 8 at
// columns 32c + 8t (c = 0..3), staged by cp.async. An appending step's dots are one HMMA product
// a m-tile with a B operand split into three bf16 parts (split_bf16x3; decode_tc.cuh's layout):
//  - GDN (scalar decays): B is the token's kn and qn, which serves two products: the checkpoint's
//    dots, scaled by e * alpha afterwards (e = exp(Gtot)), and the records' coefficients, the k
//    ring (A: 16 records as stored, rows past m unused) times (kn, qn) in 8 HMMA, c_j = W_j *
//    alpha * (k_j . kn) and likewise for q (decode.cuh's coefficients without the record pass or
//    its barrier); lane t takes records t, t + 4, ..., each from the quad holding it.
//  - KDA (per-column decays): B is the decayed token e*(alpha*kn), e*(alpha*qn); the
//    coefficients (W_j k_j).(alpha kn) on CUDA cores over the lane's columns kofs .. kofs + 3,
//    summed over the warp by one transposed butterfly (warp_transpose_sum).
// A flush rebuilds each m-tile's rows in the lane's chunks, S = e*S0 + sum_j (d_j W_j) k_j (GDN:
// the records' terms as one HMMA product, A = d_j W_j in three bf16 parts; KDA: alpha W_j k_j per
// column in shared memory and one rank-1 update per record, the decay moved into both terms),
// then the plain delta-rule step on them (decay, the dots, u, S <- S + u k), and stores them as
// bf16 from the chunks.
// Shared memory (bytes, WarpSmem): the tile [MT][2][4][32] 16-byte chunks; kn, qn and KDA's
// e * alpha [128] fp32; the B operand (kTcBBytes) and the k ring, 16 records at kWarpKPitch,
// which a KDA flush overwrites with its alpha W_j k_j records; the warp's rows of the d ring, 16
// records at kDPitch.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

#include "core/delta_math.h"
#include "cuda/replayssm/decode_tc.cuh"
#include "cuda/replayssm/ring.cuh"
#include "cuda/rows.cuh"
#include "cuda/tuning.h"

namespace deltastate::cuda_backend {
namespace {

constexpr int kWarpRingRecords = 16;  // the most records a ring holds here (L <= 16)
constexpr int kWarpMTiles = 4;        // 16-row m-tiles a CTA: 64 rows
// Bytes per staged k record: 256 and a 64-byte pad, so that a quarter warp's 16-byte reads of
// records g and g + 1 (their chunks at 32c + 8t) cover the banks once (as kTcColPitch).
constexpr int kWarpKPitch = 128 * 2 + 64;
// A flush replays at most L - 1 records (its cursor is below L).
constexpr int kWarpFlushRecords = kWarpRingRecords - 1;
template <int MT>
struct WarpSmem {
  static constexpr int kRows = 16 * MT;
  // Bytes per staged d record (the warp's rows): a 16-byte pad, so that the four lanes of a quad
  // (records t, t + 4, ...) read different banks.
  static constexpr int kDPitch = kRows * 2 + 16;
  static constexpr int tile = 0;
  static constexpr int kn = tile + MT * 8 * 32 * 16;
  static constexpr int qn = kn + 128 * 4;
  static constexpr int ea = qn + 128 * 4;  // KDA's flush: e * alpha per column
  static constexpr int bop = ea + 128 * 4;
  static constexpr int kring = bop + kTcBBytes;
  // KDA's flush: the records' alpha * W_j * k_j [records][128] fp32 over the B operand and the k
  // ring (read into registers first), which an appending step uses and a flush does not.
  static constexpr int kw = bop;
  static constexpr int kw_end = kw + kWarpFlushRecords * 128 * 4;
  static constexpr int kring_end = kring + kWarpRingRecords * kWarpKPitch;
  static constexpr int dring = kring_end > kw_end ? kring_end : kw_end;
  static constexpr int bytes = dring + kWarpRingRecords * kDPitch;
};

static_assert(ctas_fit_smem(kReplayWarpCtasPerSm, WarpSmem<kWarpMTiles>::bytes),
              "the one-warp kernel's shared memory no longer fits its CTAs an SM");

// The sum over the warp of 32 values a lane: lane l returns the total of part[l] (a transposed
// butterfly, 31 shuffles; at step S a lane keeps the half its bit S selects). S is a template
// argument so that every index is a constant (part stays in registers).
template <int S>
__device__ __forceinline__ float warp_transpose_sum(float (&part)[32], int lane) {
  const bool upper = (lane & S) != 0;
#pragma unroll
  for (int i = 0; i < S; ++i) {
    const float lo = part[i], hi = part[i + S];
    part[i] = (upper ? hi : lo) + __shfl_xor_sync(0xffffffffu, upper ? lo : hi, S);
  }
  if constexpr (S > 1) return warp_transpose_sum<S / 2>(part, lane);
  else return part[0];
}

// The lane's chunk (m-tile mt, row g + 8 hh, chunk c) in the staged tile.
__device__ __forceinline__ int warp_tile_chunk(int mt, int hh, int c, int lane) {
  return ((mt * 2 + hh) * 4 + c) * 32 + lane;
}

template <class In, int MT, bool KDA>
__global__ void __launch_bounds__(32, kReplayWarpCtasPerSm)
    replay_warp_kernel(const ReplayProblem p, const detail::SmallDivider group_div) {
  constexpr int K = 128, EPL = K / 32, WR = 16 * MT;
  using Sm = WarpSmem<MT>;
  using InT = typename In::wide_type;
  extern __shared__ __align__(16) unsigned char smem[];
  enter_grid(p.pdl_trigger_early);
  const int n = static_cast<int>(blockIdx.x), hv = static_cast<int>(blockIdx.y);
  const int h = group_div.divide(hv);
  const int lane = static_cast<int>(threadIdx.x), g = lane >> 2, t = lane & 3;
  const int V = p.V, L = p.L;
  const int row_base = static_cast<int>(blockIdx.z) * WR;
  const int kofs = lane * EPL;

  // The slot, the cursor and every input that does not depend on them first.
  const int64_t slot = load_int_now(p.indices + n * p.index_stride);
  const int cursor = load_int_now_cg(p.write_pos + n);
  const bool forced_flush = p.force_flush && load_int_now(p.force_flush + n) != 0;
  const int64_t v_off = head_offset(p.v, n, 0, hv) + row_base + g;
  InT v_in[MT][2];  // v of the lane's rows g, g + 8 of each m-tile
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh)
      v_in[mt][hh] = load_input<In, InT>(p.v.ptr, p.v.dtype, v_off + 16 * mt + 8 * hh);
  TokenHeadInputs<EPL, InT> x_in;
  load_token_head<In>(p, p.a, p.b, n, 0, h, hv, kofs, EPL, x_in);
  GateConsts<EPL> gc;
  load_gate_consts(p.gate, hv, K, kofs, EPL, gc);

  const int64_t o_off = head_offset(p.out, n, 0, hv);
  auto fill_output = [&](float value) {  // the warp's rows: lane, lane + 32, ...
    zero_output_rows<WR / 32>(p.out, V, o_off, row_base + lane, 32, value);
  };
  if (slot < 0) {  // padded: zero output; no state or ring access, the cursor left as it is
    fill_output(0.0f);
    return;
  }
  const int m = replay_cursor(cursor, p.advance_write_pos);
  if (bad_replay_row(slot, p.state.num_slots, cursor, m, L)) {  // as replay_step
    if (lane == 0 && hv == 0 && blockIdx.z == 0)
      record_bad_replay_row(p.errors, p.err_op, n, slot, p.state.num_slots, cursor, m, L);
    fill_output(bad_row_output());
    return;
  }
  const bool flush = detail::replay_flushes(m, L, forced_flush);

  // The tile, then the ring's k records and the warp's rows of its d records, by cp.async.
  __nv_bfloat16* const s0 = static_cast<__nv_bfloat16*>(p.state.ptr) + slot * p.state.slot_stride +
                            static_cast<int64_t>(hv) * V * K;
  uint4* const tile = reinterpret_cast<uint4*>(smem + Sm::tile);
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh)
#pragma unroll
      for (int c = 0; c < 4; ++c)
        cp_async16(tile + warp_tile_chunk(mt, hh, c, lane),
                   s0 + static_cast<int64_t>(row_base + 16 * mt + g + 8 * hh) * K + 32 * c + 8 * t);
  constexpr int GW = KDA ? K : 1;  // g values a record
  float* const g_ring = p.g_cache + (slot * p.HV + hv) * static_cast<int64_t>(L) * GW;
  const int64_t k_ring = (slot * p.H + h) * static_cast<int64_t>(L) * K;  // elements
  const int64_t d_ring = (slot * p.HV + hv) * static_cast<int64_t>(L) * V;
  const auto* k_src = static_cast<const __nv_bfloat16*>(p.k_cache) + k_ring;
  const auto* d_src = static_cast<const __nv_bfloat16*>(p.d_cache) + d_ring + row_base;
  for (int i = lane; i < m * 16; i += 32)  // 16 chunks a k record
    cp_async16(smem + Sm::kring + (i >> 4) * kWarpKPitch + (i & 15) * 16, k_src + i * 8);
  constexpr int kDChunks = WR / 8;  // 16-byte chunks of a d record's WR rows
  for (int i = lane; i < m * kDChunks; i += 32) {
    const int j = i / kDChunks, q = i - j * kDChunks;
    cp_async16(smem + Sm::dring + j * Sm::kDPitch + q * 16,
               d_src + static_cast<int64_t>(j) * V + q * 8);
  }
  cp_async_commit();
  // GDN's g records: lane j holds g_j; an inclusive scan gives G_j, the last Gtot (the CPU sums
  // them in order; the scan's order rounds within a few ulps of it). KDA's: the lane's columns
  // of each record (kofs .. kofs + 3), in registers until the token's B operand or the flush's
  // records are formed; Gtot summed in the CPU's order.
  float w_lane = 0.0f, e = 1.0f;
  float4 g_rec[kWarpFlushRecords];
  float gtot4[EPL] = {0.0f, 0.0f, 0.0f, 0.0f};
  if constexpr (KDA) {
#pragma unroll
    for (int j = 0; j < kWarpFlushRecords; ++j)
      g_rec[j] = j < m ? *reinterpret_cast<const float4*>(g_ring + j * K + kofs)
                       : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (int j = 0; j < kWarpFlushRecords; ++j) {
      gtot4[0] += g_rec[j].x;
      gtot4[1] += g_rec[j].y;
      gtot4[2] += g_rec[j].z;
      gtot4[3] += g_rec[j].w;
    }
  } else {
    float prefix = lane < m ? g_ring[lane] : 0.0f;
#pragma unroll
    for (int o = 1; o < kWarpRingRecords; o <<= 1) {
      const float below = __shfl_up_sync(0xffffffffu, prefix, o);
      if (lane >= o) prefix += below;
    }
    const float gtot = __shfl_sync(0xffffffffu, prefix, m > 0 ? m - 1 : 0);
    w_lane = lane < m ? expf(gtot - prefix) : 0.0f;  // W_j of record j = lane
    e = m > 0 ? expf(gtot) : 1.0f;
  }

  // The token: q, k normalized (q scaled) and k.q; the gate; beta. kn, qn and their B operand.
  TokenHeadInputs<EPL> x = widen(x_in);
  const float kq = prepare_qk<EPL, 32>(x.q, x.k, p.l2norm, p.scale, lane);
  float gcur[EPL], alpha[EPL];
  token_gate(p.gate, gc, x.g, gcur, alpha);
  const float a = alpha[0];  // GDN: one decay a head
  float e4[EPL];             // KDA: the lane's columns' ring decay exp(Gtot)
#pragma unroll
  for (int i = 0; i < EPL; ++i) e4[i] = m > 0 ? expf(gtot4[i]) : 1.0f;
  const float beta = detail::beta_value(x.b, true, p.round_beta, p.b.dtype);
  float* const s_kn = reinterpret_cast<float*>(smem + Sm::kn);
  float* const s_qn = reinterpret_cast<float*>(smem + Sm::qn);
  *reinterpret_cast<float4*>(s_kn + kofs) = make_float4(x.k[0], x.k[1], x.k[2], x.k[3]);
  *reinterpret_cast<float4*>(s_qn + kofs) = make_float4(x.q[0], x.q[1], x.q[2], x.q[3]);
  unsigned char* const bop = smem + Sm::bop;
  if constexpr (KDA) {  // the decayed token e*(alpha*k), e*(alpha*q) (a flush does not read it)
    float ek[EPL], eq[EPL];
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      ek[i] = decayed_token_entry(e4[i], alpha[i], x.k[i]);
      eq[i] = decayed_token_entry(e4[i], alpha[i], x.q[i]);
    }
    store_tc_b_operand<EPL>(ek, eq, kofs, bop);
  } else {
    store_tc_b_operand<EPL>(x.k, x.q, kofs, bop);
  }
  cp_async_wait<0>();
  __syncwarp();  // the staged tile and ring, kn, qn and the B operand, warp-wide
  if (p.advance_write_pos && lane == 0)  // every lane has read the cursor
    advance_row_cursor(p.write_pos, n, p.HV * static_cast<int>(gridDim.z), m, flush);
  auto d_at = [&](int j, int r) {  // record j's d of the warp's row r
    return reinterpret_cast<const __nv_bfloat16*>(smem + Sm::dring + j * Sm::kDPitch)[r];
  };

  if (!flush) {
    float ck[4], cq[4];  // records t, t + 4, t + 8, t + 12 (zero past m)
    if constexpr (KDA) {
      // The records' coefficients on CUDA cores: over the lane's columns, W_j*k_j . (alpha*kn)
      // and (alpha*qn) (record_coefficients' products), summed over the warp at once.
      float part[32];
      float prefix[EPL] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        part[j] = part[16 + j] = 0.0f;
        if (j < kWarpFlushRecords && j < m) {
          const float gj[EPL] = {g_rec[j].x, g_rec[j].y, g_rec[j].z, g_rec[j].w};
          float kr[EPL];
          unpack_bf16x4(
              *reinterpret_cast<const uint2*>(smem + Sm::kring + j * kWarpKPitch + kofs * 2), kr);
#pragma unroll
          for (int i = 0; i < EPL; ++i) {
            prefix[i] += gj[i];
            const float kw = kr[i] * expf(gtot4[i] - prefix[i]);
            part[j] += kw * (alpha[i] * x.k[i]);
            part[16 + j] += kw * (alpha[i] * x.q[i]);
          }
        }
      }
      const float total = warp_transpose_sum<16>(part, lane);  // lane j: ck_j; lane 16 + j: cq_j
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int j = t + 4 * i;
        const float k0 = __shfl_sync(0xffffffffu, total, j);
        const float q0 = __shfl_sync(0xffffffffu, total, 16 + j);
        ck[i] = j < m ? k0 : 0.0f;
        cq[i] = j < m ? q0 : 0.0f;
      }
    } else {
      // The records' dots with kn and qn: records g and g + 8 of the quad's rows (rows past m
      // hold stale bytes; their results are never read).
      uint4 A[2][4];
#pragma unroll
      for (int hh = 0; hh < 2; ++hh)
#pragma unroll
        for (int c = 0; c < 4; ++c)
          A[hh][c] = *reinterpret_cast<const uint4*>(smem + Sm::kring + (g + 8 * hh) * kWarpKPitch +
                                                     (32 * c + 8 * t) * 2);
      float rc[4];
      tc_tile_dots(A, bop, lane, rc);
#pragma unroll
      for (int i = 0; i < 4; ++i) rc[i] = quad_sum(rc[i]);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int j = t + 4 * i, src = 4 * (j & 7);
        const float k0 = __shfl_sync(0xffffffffu, rc[0], src);
        const float q0 = __shfl_sync(0xffffffffu, rc[1], src);
        const float k1 = __shfl_sync(0xffffffffu, rc[2], src);
        const float q1 = __shfl_sync(0xffffffffu, rc[3], src);
        const float wj = __shfl_sync(0xffffffffu, w_lane, j);
        ck[i] = j < m ? wj * (a * (j < 8 ? k0 : k1)) : 0.0f;
        cq[i] = j < m ? wj * (a * (j < 8 ? q0 : q1)) : 0.0f;
      }
    }
    // The checkpoint's dots, m-tile by m-tile: e*alpha*(S0.kn, S0.qn) (KDA: the decayed token's
    // dots) plus the records' terms; lanes 0 / 1 store the outputs of rows g / g + 8, lanes 2 / 3
    // their d records.
    const float ea = e * a;  // GDN
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      uint4 At[2][4];
#pragma unroll
      for (int hh = 0; hh < 2; ++hh)
#pragma unroll
        for (int c = 0; c < 4; ++c) At[hh][c] = tile[warp_tile_chunk(mt, hh, c, lane)];
      float acc[4];
      tc_tile_dots(At, bop, lane, acc);
      if constexpr (!KDA)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[i] *= ea;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int j = t + 4 * i;
        if (j < m) {
          const float d0 = __bfloat162float(d_at(j, 16 * mt + g));
          const float d1 = __bfloat162float(d_at(j, 16 * mt + g + 8));
          acc[0] = fmaf(d0, ck[i], acc[0]);
          acc[1] = fmaf(d0, cq[i], acc[1]);
          acc[2] = fmaf(d1, ck[i], acc[2]);
          acc[3] = fmaf(d1, cq[i], acc[3]);
        }
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[i] = quad_sum(acc[i]);
      const int hh = t & 1;
      const int row = row_base + 16 * mt + g + 8 * hh;
      const float u =
          detail::delta_u(to_float(hh ? v_in[mt][1] : v_in[mt][0]), hh ? acc[2] : acc[0], beta);
      if (t < 2)
        detail::store_float(p.out.ptr, p.out.dtype, o_off + row,
                            detail::delta_output(hh ? acc[3] : acc[1], u, kq));
      else detail::store_float(p.d_cache, p.d_dtype, d_ring + static_cast<int64_t>(m) * V + row, u);
    }
    // The appended record's k (the key head's first value head) and g: one writer per head.
    if (blockIdx.z == 0) {
      if (hv == 0 || group_div.divide(hv - 1) != h)
#pragma unroll
        for (int i = 0; i < EPL; ++i)
          detail::store_float(p.k_cache, p.k_dtype, k_ring + static_cast<int64_t>(m) * K + kofs + i,
                              x.k[i]);
      if constexpr (KDA)
        *reinterpret_cast<float4*>(g_ring + m * K + kofs) =
            make_float4(gcur[0], gcur[1], gcur[2], gcur[3]);
      else if (lane == 0) g_ring[m] = gcur[0];
    }
    return;
  }

  // KDA's flush: alpha * W_j * k_j of every record over the B operand and the k ring (each
  // lane's k values read first), and e * alpha, per column (the lane's columns kofs ..); the
  // rebuild below then takes S = (e*alpha) S0 + sum_j d_j (alpha W_j k_j), the CPU's
  // alpha * (e S0 + sum_j d_j W_j k_j) with the decay moved into both terms.
  float* const s_kw = reinterpret_cast<float*>(smem + Sm::kw);
  float* const s_ea = reinterpret_cast<float*>(smem + Sm::ea);
  if constexpr (KDA) {
    uint2 kraw[kWarpFlushRecords];
#pragma unroll
    for (int j = 0; j < kWarpFlushRecords; ++j)
      if (j < m)
        kraw[j] = *reinterpret_cast<const uint2*>(smem + Sm::kring + j * kWarpKPitch + kofs * 2);
    __syncwarp();  // every lane's k values read before the kw records overwrite them
    float prefix[EPL] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int j = 0; j < kWarpFlushRecords; ++j) {
      if (j < m) {
        const float gj[EPL] = {g_rec[j].x, g_rec[j].y, g_rec[j].z, g_rec[j].w};
        float kr[EPL], kw[EPL];
        unpack_bf16x4(kraw[j], kr);
#pragma unroll
        for (int i = 0; i < EPL; ++i) {
          prefix[i] += gj[i];
          kw[i] = alpha[i] * (kr[i] * expf(gtot4[i] - prefix[i]));
        }
        *reinterpret_cast<float4*>(s_kw + j * K + kofs) = make_float4(kw[0], kw[1], kw[2], kw[3]);
      }
    }
    *reinterpret_cast<float4*>(s_ea + kofs) =
        make_float4(e4[0] * alpha[0], e4[1] * alpha[1], e4[2] * alpha[2], e4[3] * alpha[3]);
    __syncwarp();  // the kw records and e * alpha, warp-wide
  }

  // A flush, m-tile by m-tile: the lane's rows g, g + 8, columns 32c + 8t + i (its chunks).
  float kn[32], qn[32], alpha32[32];  // the lane's columns; GDN's decay in each (KDA: in S)
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    alpha32[i] = KDA ? 1.0f : a;
    kn[i] = s_kn[32 * (i >> 3) + 8 * t + (i & 7)];
    qn[i] = s_qn[32 * (i >> 3) + 8 * t + (i & 7)];
  }
  // GDN: the records' terms on tensor cores, sum_j (d_j W_j) k_j as one [16, 16] x [16, 128]
  // product a m-tile (records the k dimension). B is the k ring, exact in bf16 and the same for
  // every m-tile, in registers: n-tile n = 4c + q's column jc is physical column 32c + 8 (jc / 2) +
  // 2q + jc % 2, so that C's (row g, columns 2t, 2t + 1) of n-tile n are S[.][8c + 2q], [8c + 2q +
  // 1], the lane's own chunk elements. Records at and past m are zero in A and B (stale bytes).
  uint32_t kb[16][2];
  float w_rec[4];  // GDN: W_j of records 2t, 2t + 1, 2t + 8, 2t + 9 (A's k columns)
  if constexpr (!KDA) {
    const uint16_t* const kr = reinterpret_cast<const uint16_t*>(smem + Sm::kring);
    auto k_at = [&](int j, int col) -> uint32_t {
      return j < m ? kr[j * (kWarpKPitch / 2) + col] : 0u;
    };
#pragma unroll
    for (int n = 0; n < 16; ++n) {
      const int col = 32 * (n >> 2) + 8 * (g >> 1) + 2 * (n & 3) + (g & 1);
      kb[n][0] = k_at(2 * t, col) | (k_at(2 * t + 1, col) << 16);
      kb[n][1] = k_at(2 * t + 8, col) | (k_at(2 * t + 9, col) << 16);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i)
      w_rec[i] = __shfl_sync(0xffffffffu, w_lane, 2 * t + (i & 1) + 8 * (i >> 1));
  }
#pragma unroll 1
  for (int mt = 0; mt < MT; ++mt) {
    float S[2][32];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        float v8[8];
        unpack_bf16x8(tile[warp_tile_chunk(mt, hh, c, lane)], v8);
        if constexpr (KDA) {
          const float4 ea0 = *reinterpret_cast<const float4*>(s_ea + 32 * c + 8 * t);
          const float4 ea1 = *reinterpret_cast<const float4*>(s_ea + 32 * c + 8 * t + 4);
          const float ea8[8] = {ea0.x, ea0.y, ea0.z, ea0.w, ea1.x, ea1.y, ea1.z, ea1.w};
#pragma unroll
          for (int i = 0; i < 8; ++i) S[hh][8 * c + i] = v8[i] * ea8[i];
        } else {
#pragma unroll
          for (int i = 0; i < 8; ++i) S[hh][8 * c + i] = v8[i] * e;  // (scale_row by e)
        }
      }
    if constexpr (KDA) {
      for (int j = 0; j < m; ++j) {
        const float d0 = __bfloat162float(d_at(j, 16 * mt + g));
        const float d1 = __bfloat162float(d_at(j, 16 * mt + g + 8));
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const float4 w0 = *reinterpret_cast<const float4*>(s_kw + j * K + 32 * c + 8 * t);
          const float4 w1 = *reinterpret_cast<const float4*>(s_kw + j * K + 32 * c + 8 * t + 4);
          const float kw8[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
          detail::rank1_update(S[0] + 8 * c, kw8, std::integral_constant<int, 8>{}, d0);
          detail::rank1_update(S[1] + 8 * c, kw8, std::integral_constant<int, 8>{}, d1);
        }
      }
    } else if (m > 0) {
      // A: d_j W_j of rows g, g + 8 and records 2t, 2t + 1 (a0, a1), 2t + 8, 2t + 9 (a2, a3),
      // each split into three bf16 parts (exact products, as the appending step's B).
      uint32_t apart[3][4];
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int hh = r & 1, j0 = 2 * t + 8 * (r >> 1);
        __nv_bfloat16 lo[3], hi[3];
        const float x0 =
            j0 < m ? __bfloat162float(d_at(j0, 16 * mt + g + 8 * hh)) * w_rec[2 * (r >> 1)] : 0.0f;
        const float x1 = j0 + 1 < m ? __bfloat162float(d_at(j0 + 1, 16 * mt + g + 8 * hh)) *
                                          w_rec[2 * (r >> 1) + 1]
                                    : 0.0f;
        split_bf16x3(x0, lo);
        split_bf16x3(x1, hi);
#pragma unroll
        for (int sp = 0; sp < 3; ++sp)
          apart[sp][r] = static_cast<uint32_t>(__bfloat16_as_ushort(lo[sp])) |
                         (static_cast<uint32_t>(__bfloat16_as_ushort(hi[sp])) << 16);
      }
#pragma unroll
      for (int n = 0; n < 16; ++n) {
        const int e0 = 8 * (n >> 2) + 2 * (n & 3);
        float acc[4] = {S[0][e0], S[0][e0 + 1], S[1][e0], S[1][e0 + 1]};
#pragma unroll
        for (int sp = 0; sp < 3; ++sp)
          prefill::Mma<__nv_bfloat16>::mma(acc, apart[sp], kb[n][0], kb[n][1]);
        S[0][e0] = acc[0];
        S[0][e0 + 1] = acc[1];
        S[1][e0] = acc[2];
        S[1][e0 + 1] = acc[3];
      }
    }
    float dots[4];  // sk, sq of row g; of row g + 8 (the plain step's decay and dots)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh)
      detail::decay_and_dots(S[hh], alpha32, kn, qn, std::integral_constant<int, 32>{},
                             dots[2 * hh], dots[2 * hh + 1]);
#pragma unroll
    for (int i = 0; i < 4; ++i) dots[i] = quad_sum(dots[i]);
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int row = row_base + 16 * mt + g + 8 * hh;
      // (v reloaded: v_in indexed by this loop's mt would live in local memory)
      const float v = to_float(load_input<In, InT>(p.v.ptr, p.v.dtype, v_off + 16 * mt + 8 * hh));
      const float u = detail::delta_u(v, dots[2 * hh], beta);
      if (t == hh)
        detail::store_float(p.out.ptr, p.out.dtype, o_off + row,
                            detail::delta_output(dots[2 * hh + 1], u, kq));
      detail::rank1_update(S[hh], kn, std::integral_constant<int, 32>{}, u);
      __nv_bfloat16* const dst = s0 + static_cast<int64_t>(row) * K + 8 * t;
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        uint32_t w[4];
#pragma unroll
        for (int i = 0; i < 4; ++i)
          w[i] = prefill::Mma<__nv_bfloat16>::pack(S[hh][8 * c + 2 * i], S[hh][8 * c + 2 * i + 1]);
        *reinterpret_cast<uint4*>(dst + 32 * c) = make_uint4(w[0], w[1], w[2], w[3]);
      }
    }
  }
}

}  // namespace
}  // namespace deltastate::cuda_backend
