// The multi-token kernel: speculative verify, and the recurrent op's multi-token sequences (T > 1,
// varlen). Each CTA owns kMultiWarps (or, two tiles per warp, 2 kMultiWarps) tiles of one
// (sequence, value head); the state rows stay in registers across all the sequence's tokens
// (RowLayout, as the decode kernel: a row over G lanes, K reduced in the row's lanes), so the
// state is read once and written once, plus the optional per-token stores (a scratch row's step,
// a per-token pool slot, 16-byte streaming stores).
// A token is a serial chain per row (decay and dots, the shuffle reduction, u, the rank-1 update)
// and a CTA's load phase carries no compute, so a CTA has state bytes in flight only until its
// first token: the shapes (MultiShape) put more of them in flight per CTA, a second tile copied
// into shared memory while the first one's tokens run, or the first tile copied there while the
// first chunk is prepared, which then holds no registers.
// The tokens' preparation (q and k normalized, k.q, the gate's alpha, beta) is done once per CTA,
// kMultiChunk tokens at a time, by the warps together into shared memory, with the chunk's v
// values of the CTA's rows; each warp then runs the chunk's tokens from shared memory. Every index
// the sequence follows is checked before anything is written: a bad one skips the sequence (NaN
// outputs, recorded in the device's error record), as the other kernels skip a bad row.
// Part of verify.cu's translation unit (included there only), in its anonymous namespace.
#pragma once

#include <cstdint>
#include <type_traits>

#include "core/delta_math.h"
#include "core/problem.h"
#include "cuda/grid.cuh"
#include "cuda/loads.cuh"
#include "cuda/rows.cuh"
#include "cuda/token.cuh"
#include "cuda/tuning.h"

namespace deltastate::cuda_backend {

using detail::RecurrentProblem;
using detail::VerifyProblem;

namespace {

template <class StateT, int KT>
struct MultiLayout {
  using Lay = RowLayout<StateT, KT>;
  static constexpr int G = Lay::G, EPL = Lay::EPL, RG = Lay::RG, R = Lay::ROWS;
  static constexpr int RPW = RG * R;             // rows per warp
  static constexpr int RPC = RPW * kMultiWarps;  // rows per CTA
  static constexpr int PE = KT / 32;             // K elements per lane in the preparation
};

template <int KT, int RPC>
struct alignas(16) MultiSmem {  // 16-byte rows: a lane's slice of q, k, alpha in vector loads
  float q[kMultiChunk][KT], k[kMultiChunk][KT], alpha[kMultiChunk][KT];
  float v[kMultiChunk][RPC];
  float beta[kMultiChunk], kq[kMultiChunk];
};

// The sequence's first bad index, if any (kind, value, limit): every index it would follow.
struct BadIndex {
  int kind = 0;
  int64_t value = 0, limit = 0;
};
// `source`: the start row is of the read-only source pool (vp.source; the generic kernel only),
// and `home` (the sequence's slot, the kernel's) then only receives the final state.
__device__ __forceinline__ BadIndex find_bad_index(const VerifyProblem& vp, int64_t n, int64_t len,
                                                   int64_t start, int64_t row, bool source,
                                                   int64_t home) {
  const RecurrentProblem& p = vp.r;
  const int64_t slots = p.state.num_slots;
  if (vp.num_accepted.ptr) {
    const int64_t a = vp.num_accepted.at(n, 0);
    if (a < 1 || a > vp.token_slots.cols) return {detail::kErrStep, a, vp.token_slots.cols};
  }
  const int64_t start_limit = source ? vp.source.num_slots : slots;  // start's own pool
  if (start >= start_limit) return {detail::kErrSlot, start, start_limit};
  if (start < 0) return {};
  if (vp.output_indices.ptr) {
    const int64_t o = vp.output_indices.at(n, 0);
    if (o >= slots) return {detail::kErrSlot, o, slots};
  } else if (source && p.update_state && !vp.token_slots.ptr && p.indices) {
    if (home >= slots) return {detail::kErrSlot, home, slots};
  }
  if (vp.token_slots.ptr) {
    if (len > vp.token_slots.cols) return {detail::kErrStep, len, vp.token_slots.cols};
    for (int64_t t = 0; t < len; ++t) {
      const int64_t s = vp.token_slots.at(n, t);
      if (s >= slots) return {detail::kErrSlot, s, slots};
    }
  }
  if (vp.inter) {
    if (row >= vp.inter_rows) return {detail::kErrRow, row, vp.inter_rows};
    if (row >= 0 && len > vp.inter_steps) return {detail::kErrStep, len, vp.inter_steps};
  }
  if (vp.parents.ptr && row >= 0) {
    if (len > vp.parents.cols) return {detail::kErrStep, len, vp.parents.cols};
    for (int64_t t = 1; t < len; ++t)
      if (vp.parents.at(n, t) >= t) return {detail::kErrStep, vp.parents.at(n, t), t};
  }
  return {};
}

template <class StateT, int EPL, int R, int RG, bool VEC>
__device__ __forceinline__ void load_rows(const StateT* head, int row0, int V, int K, int kofs,
                                          int valid, float (&S)[R][EPL]) {
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int row = row0 + r * RG;
    if (row < V) {
      load_state<StateT, EPL, VEC>(head + static_cast<int64_t>(row) * K + kofs, valid, S[r]);
    } else {
#pragma unroll
      for (int i = 0; i < EPL; ++i) S[r][i] = 0.0f;
    }
  }
}

// One token's preparation by one warp into the shared memory, as token j of the chunk: q and k
// normalized (the lane's K slice, PE elements from lane * PE), k.q, the gate's alpha, beta.
// With `ring` (SGLang's cache_ring, the generic kernel only) it also records the token's raw k
// (the first value head of its key head), its log decay and beta at ring position `rt` of `rs`.
struct RingRef {
  const detail::VerifyProblem* vp = nullptr;  // null: no ring
  int64_t slot = 0, t = 0;
  bool k_writer = false;
};
template <int KT, int RPC>
__device__ __forceinline__ void prepare_token(const RecurrentProblem& p, float A_log, int64_t seq,
                                              int64_t tok, int h, int hv, int lane, int j,
                                              MultiSmem<KT, RPC>& sm, RingRef ring = {}) {
  constexpr int PE = KT / 32;
  const detail::GateParams& gp = p.gate;
  const int K = p.K, e0 = lane * PE;
  float q[PE], k[PE], alpha[PE];
  const int64_t q_off = head_offset(p.q, seq, tok, h) + e0;
  const int64_t k_off = head_offset(p.k, seq, tok, h) + e0;
  const int64_t g_off = head_offset(p.g, seq, tok, hv);
#pragma unroll
  for (int i = 0; i < PE; ++i) {
    const bool in = e0 + i < K;
    q[i] = in ? detail::load_float(p.q.ptr, p.q.dtype, q_off + i) : 0.0f;
    k[i] = in ? detail::load_float(p.k.ptr, p.k.dtype, k_off + i) : 0.0f;
  }
  const detail::VerifyProblem* rv = ring.vp;
  const int64_t ring_at = rv ? (ring.slot * p.HV + hv) * rv->ring_len + ring.t : 0;
  if (rv && ring.k_writer) {
    const int64_t at = ((ring.slot * p.H + h) * rv->ring_len + ring.t) * K + e0;
#pragma unroll
    for (int i = 0; i < PE; ++i)
      if (e0 + i < K) detail::store_float(rv->ring_k, rv->ring_k_dtype, at + i, k[i]);
  }
  const float kq = prepare_qk<PE, 32>(q, k, p.l2norm, p.scale, lane);
  if (gp.kda) {
#pragma unroll
    for (int i = 0; i < PE; ++i) {
      const bool in = e0 + i < K;
      const float dt = gp.dt_bias && in ? detail::load_float(gp.dt_bias, gp.dt_bias_dtype,
                                                             static_cast<int64_t>(hv) * K + e0 + i)
                                        : 0.0f;
      const float x = in ? detail::load_float(p.g.ptr, p.g.dtype, g_off + e0 + i) : 0.0f;
      const float g = detail::gate_value(gp.mode, x, dt, A_log, gp.lower_bound);
      if (rv && in) rv->ring_g[ring_at * K + e0 + i] = g;
      alpha[i] = expf(g);
    }
  } else {
    const float dt = gp.dt_bias ? detail::load_float(gp.dt_bias, gp.dt_bias_dtype, hv) : 0.0f;
    const float g0 = detail::gate_value(gp.mode, detail::load_float(p.g.ptr, p.g.dtype, g_off), dt,
                                        A_log, gp.lower_bound);
    if (rv && lane == 0) rv->ring_g[ring_at] = g0;
    const float a0 = expf(g0);
#pragma unroll
    for (int i = 0; i < PE; ++i) alpha[i] = a0;
  }
#pragma unroll
  for (int i = 0; i < PE; ++i) {
    sm.q[j][e0 + i] = q[i];
    sm.k[j][e0 + i] = k[i];
    sm.alpha[j][e0 + i] = alpha[i];
  }
  if (lane == 0) {
    sm.kq[j] = kq;
    sm.beta[j] = detail::beta_value(
        detail::load_float(p.beta.ptr, p.beta.dtype, head_offset(p.beta, seq, tok, hv)),
        p.beta_is_logit, p.round_beta, p.beta.dtype);
    if (rv) rv->ring_beta[ring_at] = sm.beta[j];
  }
}

// The kernel's shape, one instantiation per variant (tuning.h, MultiVariant). TPW tiles per warp:
// the tiles after the first are copied into shared memory by cp.async at the start, so their
// state loads overlap the first tile's tokens, and a sequence of one chunk is prepared once for
// all of them. STAGE0: the first tile is staged too, instead of loaded into registers: its bytes
// are in flight without holding registers, and the first chunk's preparation (its input loads
// and math) runs while they arrive. CTAS: resident CTAs per SM, the register cap (8: 64 registers,
// 6: 80; two tiles fit without spills from 5, 96 registers, where a CTA has twice the bytes in
// flight).
template <int TPW_, bool STAGE0_, int CTAS_, bool RING_ = false>
struct MultiShape {
  static constexpr int TPW = TPW_, CTAS = CTAS_;
  static constexpr bool stage0 = STAGE0_;
  // SGLang's cache_ring (VerifyProblem::ring_*): its own instantiation of the generic kernel, so
  // the ring code costs the other kernels no registers.
  static constexpr bool ring = RING_;
  static constexpr int kStaged = TPW_ - 1 + (STAGE0_ ? 1 : 0);  // tiles copied by cp.async
};
using MultiBase = MultiShape<1, false, kMultiBaseCtasPerSm>;
using MultiRing = MultiShape<1, false, kMultiCtasPerSm, true>;

template <class StateT, int KT, int NSTAGED>
struct MultiStage {  // staged tiles' rows, lane-interleaved: word (r*W + c)*32 + lane of a warp
  using Lay = RowLayout<StateT, KT>;
  static constexpr int W = Lay::EPL * static_cast<int>(sizeof(StateT)) / 16;
  static constexpr int kWords = Lay::ROWS * W * 32;
  uint4 words[NSTAGED > 0 ? NSTAGED : 1][kMultiWarps][NSTAGED > 0 ? kWords : 1];
};

// A staged tile's rows into registers once at most `PENDING` later copy groups are in flight
// (rows at or past V read as zeros). Each lane reads back only what it copied: no barrier.
template <class StateT, int EPL, int R, int PENDING>
__device__ __forceinline__ void read_staged(const uint4* src, int row, int rg, int V,
                                            float (&S)[R][EPL]) {
  constexpr int W = EPL * static_cast<int>(sizeof(StateT)) / 16;
  constexpr int kPer16 = 16 / static_cast<int>(sizeof(StateT));
  cp_async_wait<PENDING>();
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int c = 0; c < W; ++c) {
      const uint4 u = src[(r * W + c) * 32];
      const StateT* e = reinterpret_cast<const StateT*>(&u);
#pragma unroll
      for (int i = 0; i < kPer16; ++i)
        S[r][c * kPer16 + i] = row + r * rg < V ? to_float(e[i]) : 0.0f;
    }
  }
}

// One CTA: kMultiWarps warps over TPW tiles of RPC rows, rows [block*TPW*RPC, (block+1)*TPW*RPC)
// of head (n, hv); a warp's tile i is the tile of rows (block*TPW + i)*RPC + the warp's rows.
template <class StateT, int KT, bool VEC, class Shape>
__global__ void __launch_bounds__(kMultiWarps * 32, VEC ? Shape::CTAS : kMultiGenericCtasPerSm)
    multi_token_kernel(const VerifyProblem vp, int ctas_per_head) {
  enter_grid(vp.r.pdl_trigger_early);
  using M = MultiLayout<StateT, KT>;
  constexpr int G = M::G, EPL = M::EPL, RG = M::RG, R = M::R, RPW = M::RPW, RPC = M::RPC;
  constexpr int TPW = Shape::TPW, NST = Shape::kStaged, CROWS = RPC * TPW;  // rows per CTA
  constexpr int kThreads = kMultiWarps * 32;
  static_assert(NST == 0 || VEC, "staged tiles are 16-byte copies");
  __shared__ MultiSmem<KT, CROWS> sm;
  __shared__ MultiStage<StateT, KT, NST> stage;
  const RecurrentProblem& p = vp.r;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int head = static_cast<int>(blockIdx.x) / ctas_per_head;
  const int block = static_cast<int>(blockIdx.x) - head * ctas_per_head;
  const int n = head / p.HV, hv = head - n * p.HV, h = hv / (p.HV / p.H);
  const int K = p.K, V = p.V;
  const int kofs = (lane % G) * EPL;
  const int valid = VEC ? EPL : max(0, min(EPL, K - kofs));
  const int local0 = warp * RPW + lane / G;  // this lane's first row within a tile's rows
  const int cta_row0 = block * CROWS;
  const int64_t seq = p.cu_seqlens ? 0 : n;
  const int64_t tok0 = p.cu_seqlens ? detail::load_index(p.cu_seqlens, p.cu_dtype, n) : 0;
  const int64_t len =
      p.cu_seqlens ? detail::load_index(p.cu_seqlens, p.cu_dtype, n + 1) - tok0 : p.T;

  // home: the sequence's slot; start: the row its state starts from, of the read-only source
  // pool when one is given (home then only receives the final state).
  const int64_t home =
      p.indices ? detail::index_at(p.indices, p.index_dtype, p.index_stride, n) : n;
  // A source pool runs on the generic kernel only (vector_rows): the vector kernels, at their
  // register caps, compile without its code.
  const bool source = !VEC && vp.source.ptr != nullptr;
  int64_t start;
  if (source) {
    start = vp.source_indices.at(n, 0);
  } else if (vp.num_accepted.ptr) {
    const int64_t a = vp.num_accepted.at(n, 0);
    start = a >= 1 && a <= vp.token_slots.cols ? vp.token_slots.at(n, a - 1) : 0;
  } else {
    start = home;
  }
  // The state rows are loaded (or their copies issued) as soon as the slot is known to lie in the
  // pool, ahead of the other index checks (a verify's table reads), which they then overlap; a bad
  // row discards them.
  const int64_t head_elems = static_cast<int64_t>(V) * K;
  StateT* pool = static_cast<StateT*>(p.state.ptr) + static_cast<int64_t>(hv) * head_elems;
  StateT* inter = static_cast<StateT*>(vp.inter);
  float S[R][EPL];
  const detail::StatePoolRef& init_pool = source ? vp.source : p.state;
  const StateT* init_head =
      static_cast<const StateT*>(init_pool.ptr) + static_cast<int64_t>(hv) * head_elems;
  const bool in_pool = start >= 0 && start < init_pool.num_slots;
  const StateT* init = init_head + (in_pool ? start : 0) * init_pool.slot_stride;
  const int v_pool = in_pool ? V : 0;
  if constexpr (!Shape::stage0)
    load_rows<StateT, EPL, R, RG, VEC>(init, cta_row0 + local0, v_pool, K, kofs, valid, S);
  if constexpr (NST > 0) {  // one copy group per staged tile, oldest first
#pragma unroll
    for (int s = 0; s < NST; ++s) {
      const int tile = Shape::stage0 ? s : s + 1;
      stage_rows_async<StateT, EPL, R>(
          &stage.words[s][warp][lane], 32, cta_row0 + tile * RPC + local0, RG, v_pool,
          [&](int, int rr) { return init + static_cast<int64_t>(rr) * K + kofs; });
    }
  }
  const int64_t row = vp.inter ? (vp.inter_indices.ptr ? vp.inter_indices.at(n, 0) : n) : -1;
  const BadIndex bad = find_bad_index(vp, n, len, start, row, source, home);
  if (start < 0 || bad.kind) {  // padded: zero (or kept) outputs; a bad index: NaN, recorded
    if (bad.kind && hv == 0 && block == 0 && threadIdx.x == 0)
      record_bad_row(p.errors, vp.err_op, bad.kind, n, bad.value, bad.limit);
    const float fill = bad.kind ? bad_row_output() : 0.0f;
    if (lane % G == 0 && (bad.kind || !vp.keep_padded_outputs))
      for (int tile = 0; tile < TPW; ++tile)
        for (int64_t t = 0; t < len; ++t)
          zero_output_rows<R>(p.out, V, head_offset(p.out, seq, tok0 + t, hv),
                              cta_row0 + tile * RPC + local0, RG, fill);
    if constexpr (NST > 0) cp_async_wait<0>();
    return;
  }

  const float A_log =
      p.gate.A_log ? detail::load_float(p.gate.A_log, p.gate.A_log_dtype, hv) : 0.0f;
  const bool final_store = p.update_state && !vp.token_slots.ptr;
  const int64_t final_slot =
      final_store ? (vp.output_indices.ptr ? vp.output_indices.at(n, 0) : (source ? home : start))
                  : -1;
  const int idx = reduced_index<G, 2 * R>(lane);  // the dot this lane holds after the reduction
  // A sequence of one chunk is prepared once for all the tiles; a longer one once per tile.
  const bool prepare_once = len <= kMultiChunk;

#pragma unroll 1
  for (int tile = 0; tile < TPW; ++tile) {
    const int row0 = cta_row0 + tile * RPC + local0;
    if constexpr (TPW > 1) {
      // The second tile's copies: the last group (the first tile's, if staged, is done).
      if (tile > 0)
        read_staged<StateT, EPL, R, 0>(&stage.words[NST - 1][warp][lane], row0, RG, V, S);
    }
    for (int64_t c0 = 0; c0 < len; c0 += kMultiChunk) {
      const int cn = static_cast<int>(len - c0 < kMultiChunk ? len - c0 : kMultiChunk);
      if (tile == 0 || !prepare_once) {
        __syncthreads();  // the previous chunk's tokens are done with the shared memory
        for (int j = warp; j < cn; j += kMultiWarps) {  // token c0 + j, one warp per token
          if constexpr (Shape::ring) {  // SGLang's cache_ring: MultiRing (the generic kernel)
            if (vp.ring_v && home >= 0 && c0 + j < vp.ring_len) {
              RingRef ring{&vp, home, c0 + j, block == 0 && hv % (p.HV / p.H) == 0};
              if (block != 0) ring.vp = nullptr;  // one CTA per head writes k, g and beta
              prepare_token<KT, CROWS>(p, A_log, seq, tok0 + c0 + j, h, hv, lane, j, sm, ring);
              continue;
            }
          }
          prepare_token<KT, CROWS>(p, A_log, seq, tok0 + c0 + j, h, hv, lane, j, sm);
        }
        for (int i = threadIdx.x; i < cn * CROWS; i += kThreads) {
          const int j = i / CROWS, lr = i - j * CROWS, vrow = cta_row0 + lr;
          sm.v[j][lr] = vrow < V
                            ? detail::load_float(p.v.ptr, p.v.dtype,
                                                 head_offset(p.v, seq, tok0 + c0 + j, hv) + vrow)
                            : 0.0f;
          if constexpr (Shape::ring) {  // the raw v of the CTA's rows
            if (vp.ring_v && home >= 0 && c0 + j < vp.ring_len && vrow < V)
              detail::store_float(vp.ring_v, vp.ring_v_dtype,
                                  ((home * p.HV + hv) * vp.ring_len + c0 + j) * V + vrow,
                                  sm.v[j][lr]);
          }
        }
        __syncthreads();
      }
      if constexpr (Shape::stage0) {  // the first tile's copies, after the first preparation
        if (tile == 0 && c0 == 0)
          read_staged<StateT, EPL, R, NST - 1>(&stage.words[0][warp][lane], row0, RG, V, S);
      }

      for (int j = 0; j < cn; ++j) {
        const int64_t t = c0 + j;
        // A tree token starts from its parent's state (the initial one for a parent < 0); the
        // previous token's is already in registers. Each lane reads back only what it stored.
        if (vp.parents.ptr && row >= 0 && t > 0) {
          const int64_t parent = vp.parents.at(n, t);
          if (parent != t - 1) {
            // the start row (init); the vector kernels recompute it from the pool (never a
            // source there) rather than keep a pointer live across the tokens
            const StateT* start_row = VEC ? pool + start * p.state.slot_stride : init;
            const StateT* src = parent < 0 ? start_row
                                           : inter + row * vp.inter_row_stride +
                                                 parent * vp.inter_step_stride +
                                                 static_cast<int64_t>(hv) * head_elems;
            load_rows<StateT, EPL, R, RG, VEC>(src, row0, V, K, kofs, valid, S);
          }
        }
        float q[EPL], k[EPL], alpha[EPL];
        if constexpr (VEC && EPL % 4 == 0) {  // the lane's slice in 16-byte shared loads
#pragma unroll
          for (int i = 0; i < EPL; i += 4) {
            const float4 a = *reinterpret_cast<const float4*>(&sm.q[j][kofs + i]);
            const float4 b = *reinterpret_cast<const float4*>(&sm.k[j][kofs + i]);
            const float4 c = *reinterpret_cast<const float4*>(&sm.alpha[j][kofs + i]);
            q[i] = a.x, q[i + 1] = a.y, q[i + 2] = a.z, q[i + 3] = a.w;
            k[i] = b.x, k[i + 1] = b.y, k[i + 2] = b.z, k[i + 3] = b.w;
            alpha[i] = c.x, alpha[i + 1] = c.y, alpha[i + 2] = c.z, alpha[i + 3] = c.w;
          }
        } else {
#pragma unroll
          for (int i = 0; i < EPL; ++i) {
            const int e = min(kofs + i, KT - 1);
            q[i] = sm.q[j][e];
            k[i] = sm.k[j][e];
            alpha[i] = sm.alpha[j][e];
          }
        }
        const int vl = tile * RPC + local0 + (idx < R ? idx : 0) * RG;
        const float v_here = idx < R ? sm.v[j][vl] : 0.0f;
        StateT* step_dst = row >= 0 ? inter + row * vp.inter_row_stride + t * vp.inter_step_stride +
                                          static_cast<int64_t>(hv) * head_elems
                                    : nullptr;
        const int64_t tslot = vp.token_slots.ptr ? vp.token_slots.at(n, t) : -1;
        StateT* slot_dst = tslot >= 0 ? pool + tslot * p.state.slot_stride
                           : (t == len - 1 && final_slot >= 0)
                               ? pool + final_slot * p.state.slot_stride
                               : nullptr;
        float u_here;
        const float red =
            delta_step_rows<G, R>(S, alpha, k, q, v_here, sm.beta[j], lane, u_here, [&](int r) {
              const int rr = row0 + r * RG;
              if (rr >= V) return;
              const int64_t off = static_cast<int64_t>(rr) * K + kofs;
              if (step_dst) store_state<StateT, EPL, VEC>(step_dst + off, valid, S[r]);
              if (slot_dst) store_state<StateT, EPL, VEC>(slot_dst + off, valid, S[r]);
            });
        store_output_rows<G, R>(p.out, head_offset(p.out, seq, tok0 + t, hv), V, row0, RG, lane,
                                red, u_here, sm.kq[j]);
      }
    }
  }
}

}  // namespace
}  // namespace deltastate::cuda_backend
