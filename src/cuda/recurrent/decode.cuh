// The register decode kernel of the recurrent op: one token per sequence, a lean warp per tile.
// Part of recurrent.cu's translation unit (included there only), in its anonymous namespace.
#pragma once

#include <cstdint>
#include <type_traits>

#include "core/delta_math.h"
#include "core/problem.h"
#include "cuda/grid.cuh"
#include "cuda/loads.cuh"
#include "cuda/recurrent/head_block.cuh"
#include "cuda/rows.cuh"
#include "cuda/token.cuh"
#include "cuda/tuning.h"

namespace deltastate::cuda_backend {

using detail::RecurrentProblem;

namespace {

// Decode (T = 1, no cu_seqlens, in place on the pool, no dense final-state copy): one warp per
// TPW consecutive tiles of RG*ROWS rows of one head (RowLayout: 32 state values per thread),
// state loaded straight into registers. Written for a small register footprint (at most 80 per
// thread, so that 24 resident warps per SM keep enough loads in flight; the multi-token direct
// kernel needs 128 and reaches a smaller share of copy bandwidth): no token loop, v loaded only
// by the lanes that compute u for a row, the reduced dots reused for u and o.
// With TPW = 2 the warp's second tile is copied into its shared memory (stage_rows_async: each
// lane its own words, so no barrier) while the first is computed from registers: the slot, the
// token and its preparation are shared by both tiles, and each warp has two tiles of state in
// flight from its start. (More tiles per warp spill.)
// Its CTAs: kDecodeCtaWarps warps, kDecodeCtasPerSm resident per SM (tuning.h).
constexpr int kDecodeWarpsPerSm = kDecodeCtaWarps * kDecodeCtasPerSm;
// Bytes of one tile (the shared memory each warp stages its second tile in, with TPW = 2).
template <class StateT, int K>
constexpr int kDecodeTileBytes =
    RowLayout<StateT, K>::RG* RowLayout<StateT, K>::ROWS* K* static_cast<int>(sizeof(StateT));

template <class StateT, int K, class In, int TPW>
__global__ void __launch_bounds__(kDecodeCtaWarps * 32, kDecodeCtasPerSm)
    recurrent_decode_kernel(const RecurrentProblem p, int warps_per_head) {
  static_assert(TPW == 1 || TPW == 2, "one or two tiles per warp");
  enter_grid(p.pdl_trigger_early);
  using Lay = RowLayout<StateT, K>;
  constexpr int G = Lay::G, EPL = Lay::EPL, RG = Lay::RG, R = Lay::ROWS;
  constexpr int RPW = RG * R;  // rows per tile
  const int lane = threadIdx.x & 31;
  const int w = static_cast<int>(blockIdx.x) * kDecodeCtaWarps + static_cast<int>(threadIdx.x >> 5);
  if (w >= static_cast<int>(p.num_heads_total()) * warps_per_head) return;
  const HeadBlock c = head_block(p, w, warps_per_head);
  const int n = c.n, hv = c.hv, h = c.h;
  const int kofs = (lane % G) * EPL;
  const int row0 = c.block * TPW * RPW + lane / G;  // this lane's first row of tile 0
  const int idx = reduced_index<G, 2 * R>(lane);    // the value this lane holds after the reduction

  // The token's inputs and v (lanes holding sk_r compute u_r: they need v_r, of every tile) do
  // not depend on the slot: issued first, kept in their own type, converted after the state loads
  // have left. (Converted as loaded, each conversion makes the warp wait for its load before the
  // next: index -> v -> token -> state, three round trips before the state loads.) 16-bit inputs
  // are held in their own 32-bit registers (a PRMT packing two of them waits for both loads) and v
  // is read from a clamped row, zeroed where used (zeroing after a predicated load waits for the
  // load). The index's load has dtype branches, so it comes after them, except in the 16-bit-state
  // kernels of one tile per warp (kIndexFirst): there the early loads cost spills, and a spill
  // store of a token input waits for its load, so with the index after them its load left a
  // round trip late; there the index leaves first (load_index_now). In the fp32 and two-tile
  // kernels that order is slower (docs/PERFORMANCE.md, the B = 1 decode row).
  constexpr bool kIndexFirst = sizeof(StateT) == 2 && TPW == 1;
  IndexNow slot_bits;
  if (kIndexFirst && p.indices)
    slot_bits = load_index_now(p.indices, p.index_dtype, n * p.index_stride);
  using InT = typename In::wide_type;
  TokenHeadInputs<EPL, InT> x_in;
  load_token_head<In>(p, p.g, p.beta, n, 0, h, hv, kofs, EPL, x_in);
  InT v_in[TPW];
  const int64_t v_off = head_offset(p.v, n, 0, hv);
#pragma unroll
  for (int t = 0; t < TPW; ++t) {
    // Unconditional, from a clamped row (zeroing after a predicated load waits for it); the
    // lanes without a row of their own, or past V, zero it where it is used.
    const int vrow = row0 + t * RPW + (idx < R ? idx : 0) * RG;
    v_in[t] = load_input<In, InT>(p.v.ptr, p.v.dtype, v_off + min(vrow, p.V - 1));
  }
  const int64_t slot =
      kIndexFirst ? (p.indices ? index_now(slot_bits, p.index_dtype) : n) : slot_of(p, n);
  const int64_t o_off = head_offset(p.out, n, 0, hv);

  const bool bad = bad_slot(p, slot);
  if (slot < 0 || bad) {  // padding: zero output, state untouched; a bad index: the same, NaN out
    if (bad) record_bad_slot(p, n, slot, lane == 0 && hv == 0 && c.block == 0);
    const float fill = bad ? bad_row_output() : 0.0f;
    if (lane % G == 0)
#pragma unroll
      for (int t = 0; t < TPW; ++t)
        zero_output_rows<R>(p.out, p.V, o_off, row0 + t * RPW, RG, fill);
    return;
  }
  StateT* st = static_cast<StateT*>(p.state.ptr) + slot * p.state.slot_stride +
               static_cast<int64_t>(hv) * p.V * K + static_cast<int64_t>(row0) * K + kofs;
  float S[R][EPL];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    if (row0 + r * RG < p.V) {
      load_state<StateT, EPL, true>(st + r * RG * K, EPL, S[r]);
    } else {
#pragma unroll
      for (int i = 0; i < EPL; ++i) S[r][i] = 0.0f;
    }
  }
  // Tile 1 into this warp's shared memory (one tile: RPW rows of K elements).
  extern __shared__ uint4 decode_smem[];
  uint4* mine = decode_smem + (threadIdx.x >> 5) * (kDecodeTileBytes<StateT, K> / 16) + lane;
  if constexpr (TPW == 2)
    stage_rows_async<StateT, EPL, R>(mine, 32, row0 + RPW, RG, p.V,
                                     [&](int r, int) { return st + (RPW + r * RG) * K; });

  // q, k normalized (q scaled), k.q; the gate; beta (core/delta_math.h).
  TokenHeadInputs<EPL> x = widen(x_in);
  const float kq = prepare_qk<EPL, G>(x.q, x.k, p.l2norm, p.scale, lane);
  float alpha[EPL];
  decode_alpha<EPL>(p.gate, x.g, hv, K, kofs, alpha);
  const float beta = detail::beta_value(x.b, p.beta_is_logit, p.round_beta, p.beta.dtype);

  // The delta-rule step per tile: decay and dots, one transposed reduction of all 2R dots, u_r by
  // the lane holding sk_r, broadcast; o_r = sq_r + u_r*kq by the lane holding sq_r.
#pragma unroll
  for (int t = 0; t < TPW; ++t) {
    const int rowt = row0 + t * RPW;
    if constexpr (TPW == 2) {
      if (t > 0) {
        if (rowt - lane / G >= p.V) break;  // past the head's last row (warp-uniform)
        load_staged_rows<StateT, EPL, R>(mine, 32, rowt, RG, p.V, S);
      }
    }
    StateT* stt = st + t * RPW * K;
    float u_here;  // meaningful on the sk lanes
    const bool v_here = idx < R && rowt + idx * RG < p.V;
    const float red = delta_step_rows<G, R>(
        S, alpha, x.k, x.q, v_here ? to_float(v_in[t]) : 0.0f, beta, lane, u_here, [&](int r) {
          if (rowt + r * RG < p.V) store_state<StateT, EPL, true>(stt + r * RG * K, EPL, S[r]);
        });
    store_output_rows<G, R>(p.out, o_off, p.V, rowt, RG, lane, red, u_here, kq);
  }
}

}  // namespace
}  // namespace deltastate::cuda_backend
