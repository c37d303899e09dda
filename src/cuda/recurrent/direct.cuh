// The direct kernel of the recurrent op: any number of tokens per sequence, each thread's rows
// in registers across the sequence.
// Part of recurrent.cu's translation unit, in its anonymous namespace; verify.cu includes it too
// (verify/fmt.cuh runs its tile, prologue and token loop).
#pragma once

#include <cstdint>
#include <type_traits>

#include "core/delta_math.h"
#include "core/problem.h"
#include "core/state_format.h"
#include "cuda/grid.cuh"
#include "cuda/launch.h"
#include "cuda/loads.cuh"
#include "cuda/recurrent/head_block.cuh"
#include "cuda/rows.cuh"
#include "cuda/state_fmt.cuh"
#include "cuda/token.cuh"
#include "cuda/tuning.h"

namespace deltastate::cuda_backend {

using detail::RecurrentProblem;

namespace {

// The launch of a direct-layout kernel over `tiles` warps (one tile each): warps per CTA
// (tuning.h direct_cta_warps), CTAs, and resident CTAs per SM (the launch bound's 4-warp CTAs
// times `ctas_per_sm`, in warps). `too_many`: the error text past 2^31 - 1 tiles.
struct DirectGrid {
  int warps;
  int64_t ctas;
  int resident;
};
inline DirectGrid direct_grid(int64_t tiles, int device, const char* too_many,
                              int ctas_per_sm = kDirectCtasPerSm) {
  if (tiles > 0x7fffffffLL) throw Error(ErrorKind::value, too_many);
  DirectGrid g;
  g.warps = direct_cta_warps(tiles, num_sms(device));
  g.ctas = (tiles + g.warps - 1) / g.warps;
  g.resident = ctas_per_sm * 4 / g.warps;
  return g;
}

// A direct-kernel tile: sequence n, value head hv (head = n*HV + hv), this thread's first row.
// (n and head widened once here: deriving them from HeadBlock's ints where they are used spills
// in the 16-bit-state direct kernels.)
struct TileCoords {
  int64_t n, head;
  int hv, h, row0;
};
__device__ __forceinline__ TileCoords tile_coords(const RecurrentProblem& p, int64_t w,
                                                  int warps_per_head, int rows_per_warp, int lane,
                                                  int G) {
  const HeadBlock b = head_block(p, static_cast<int>(w), warps_per_head);
  TileCoords c;
  c.n = b.n;
  c.head = b.head;
  c.hv = b.hv;
  c.h = b.h;
  c.row0 = b.block * rows_per_warp + lane / G;
  return c;
}

// The tile's rows of the dense final state [N, HV, V, K] (optional output): value(r, i) is
// element i of the thread's row r.
template <int EPL, int R, int RG, class Value>
__device__ __forceinline__ void store_final_state(const RecurrentProblem& p, const TileCoords& c,
                                                  int kofs, int valid, Value value) {
  const int64_t head_elems = static_cast<int64_t>(p.V) * p.K;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int row = c.row0 + r * RG;
    if (row < p.V)
#pragma unroll
      for (int i = 0; i < EPL; ++i)
        if (i < valid)
          detail::store_float(p.final_state, p.final_dtype,
                              c.head * head_elems + static_cast<int64_t>(row) * p.K + kofs + i,
                              value(r, i));
  }
}

// Output rows (and final state) of a padded sequence, `fill`: zeros (padded, index < 0) or NaN
// (a bad index, bad_slot); its state is never touched.
template <int EPL, int R, int RG, int G>
__device__ void write_padded(const RecurrentProblem& p, const TileCoords& c, int64_t seq,
                             int64_t tok0, int64_t len, int lane, int kofs, int valid, float fill) {
  if (lane % G == 0) {
    for (int64_t t = 0; t < len; ++t)
      zero_output_rows<R>(p.out, p.V, head_offset(p.out, seq, tok0 + t, c.hv), c.row0, RG, fill);
  }
  if (p.final_state)
    store_final_state<EPL, R, RG>(p, c, kofs, valid, [fill](int, int) { return fill; });
}

// A direct-kernel warp's tile, its sequence's tokens and slot.
struct DirectTile {
  TileCoords c;
  int lane, kofs, valid;  // valid: the lane's elements below K
  int64_t seq, tok0, len, slot;
};

// The warp's tile, its sequence's tokens and slot (state_indices, else n). False: past the grid.
template <int G, int EPL, int R, int RG, bool VEC>
__device__ __forceinline__ bool direct_tile(const RecurrentProblem& p, int warps_per_head,
                                            DirectTile& d) {
  d.lane = threadIdx.x & 31;
  const int64_t w = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (w >= p.num_heads_total() * warps_per_head) return false;
  d.c = tile_coords(p, w, warps_per_head, RG * R, d.lane, G);
  d.kofs = (d.lane % G) * EPL;
  d.valid = VEC ? EPL : max(0, min(EPL, p.K - d.kofs));
  d.seq = p.cu_seqlens ? 0 : d.c.n;
  d.tok0 = p.cu_seqlens ? detail::load_index(p.cu_seqlens, p.cu_dtype, d.c.n) : 0;
  d.len = p.cu_seqlens ? detail::load_index(p.cu_seqlens, p.cu_dtype, d.c.n + 1) - d.tok0 : p.T;
  d.slot = slot_of(p, d.c.n);
  return true;
}

// What every direct kernel does first: direct_tile, token 0's inputs into `x` (they do not depend
// on the slot: issued first) and the gate's constants into `gc`. False: the warp has nothing more
// to do (past the grid; a padded sequence, or a bad slot, recorded, whose outputs it wrote here).
template <class In, int G, int EPL, int R, int RG, bool VEC>
__device__ __forceinline__ bool direct_prologue(const RecurrentProblem& p, int warps_per_head,
                                                DirectTile& d, TokenInputs<EPL, R>& x,
                                                GateConsts<EPL>& gc) {
  if (!direct_tile<G, EPL, R, RG, VEC>(p, warps_per_head, d)) return false;
  if (d.len > 0)
    load_token<In>(p, p.g, p.beta, d.seq, d.tok0, d.c.h, d.c.hv, d.kofs, d.valid, d.c.row0, RG, x);
  load_gate_consts(p.gate, d.c.hv, p.K, d.kofs, d.valid, gc);
  if (p.indices && d.slot < 0) {
    write_padded<EPL, R, RG, G>(p, d.c, d.seq, d.tok0, d.len, d.lane, d.kofs, d.valid, 0.0f);
    return false;
  }
  // a bad slot: as padded, but NaN out and recorded (lane 0 of the row's first tile)
  if (bad_slot(p, d.slot)) {
    record_bad_slot(p, d.c.n, d.slot, d.lane == 0 && d.c.hv == 0 && d.c.row0 == 0);
    write_padded<EPL, R, RG, G>(p, d.c, d.seq, d.tok0, d.len, d.lane, d.kofs, d.valid,
                                bad_row_output());
    return false;
  }
  return true;
}

// What run_tokens calls around each token t: before(t, S) ahead of its step (verify's tree
// tokens reload S there), after(t, S) once S holds the state after it (verify's per-token
// stores). The recurrent op's kernels pass none.
struct NoTokenHooks {
  template <class S>
  __device__ __forceinline__ void before(int64_t, S&) const {}
  template <class S>
  __device__ __forceinline__ void after(int64_t, const S&) const {}
};

// All tokens of a tile on the state rows S (registers); `x` holds token 0's inputs on entry.
template <class In, int G, int EPL, int R, int RG, class Hooks = NoTokenHooks>
__device__ __forceinline__ void run_tokens(const RecurrentProblem& p, const TileCoords& c,
                                           int64_t seq, int64_t tok0, int64_t len, int lane,
                                           int kofs, int valid, float (&S)[R][EPL],
                                           TokenInputs<EPL, R>& x, const GateConsts<EPL>& gc,
                                           const Hooks& hooks = {}) {
  for (int64_t t = 0; t < len; ++t) {
    hooks.before(t, S);
    const float kq = prepare_qk<EPL, G>(x.q, x.k, p.l2norm, p.scale, lane);
    float g[EPL], alpha[EPL];
    token_gate(p.gate, gc, x.g, g, alpha);
    const float beta = detail::beta_value(x.b, p.beta_is_logit, p.round_beta, p.beta.dtype);
    float dots[2 * R];
#pragma unroll
    for (int r = 0; r < R; ++r)
      detail::decay_and_dots(S[r], alpha, x.k, x.q, std::integral_constant<int, EPL>{}, dots[r],
                             dots[R + r]);
    float u[R], o;
    const int mine = finish_rows<G, R>(dots, x.v, beta, kq, lane, u, o);
#pragma unroll
    for (int r = 0; r < R; ++r)
      detail::rank1_update(S[r], x.k, std::integral_constant<int, EPL>{}, u[r]);
    const int64_t tok = tok0 + t;
    const int orow = c.row0 + mine * RG;
    if (mine >= 0 && orow < p.V)
      detail::store_float(p.out.ptr, p.out.dtype, head_offset(p.out, seq, tok, c.hv) + orow, o);
    hooks.after(t, S);
    if (t + 1 < len)
      load_token<In>(p, p.g, p.beta, seq, tok + 1, c.h, c.hv, kofs, valid, c.row0, RG, x);
  }
}

template <class StateT, int EPL, int R, int RG, bool VEC>
__device__ __forceinline__ void write_state(const RecurrentProblem& p, const TileCoords& c,
                                            StateT* state_head, int64_t len, int kofs, int valid,
                                            const float (&S)[R][EPL]) {
  if (state_head && p.update_state && len > 0) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int row = c.row0 + r * RG;
      if (row < p.V)
        store_state<StateT, EPL, VEC>(state_head + static_cast<int64_t>(row) * p.K + kofs, valid,
                                      S[r]);
    }
  }
  if (p.final_state)
    store_final_state<EPL, R, RG>(p, c, kofs, valid, [&S](int r, int i) { return S[r][i]; });
}

// The formatted-state twin of the direct kernel (float register layout of a KT = 256 tile, any
// inputs): a pool updated in place, no final_state (the contract's rule). The key's step is read
// here; advance_rounding_step adds 1 after the grid, in stream order.
template <int KT>
__global__ void __launch_bounds__(128, kDirectCtasPerSm)
    recurrent_direct_fmt_kernel(const RecurrentProblem p, int warps_per_head) {
  enter_grid(p.pdl_trigger_early);
  using Lay = RowLayout<float, KT>;
  constexpr int G = Lay::G, EPL = Lay::EPL, RG = Lay::RG, R = Lay::ROWS;
  DirectTile d;
  TokenInputs<EPL, R> x;
  GateConsts<EPL> gc;
  if (!direct_prologue<AnyInput, G, EPL, R, RG, false>(p, warps_per_head, d, x, gc)) return;
  float S[R][EPL];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int row = d.c.row0 + r * RG;
    if (row < p.V) {
      load_state_fmt<EPL>(p.state, d.slot, d.c.hv, p.V, p.K, row, d.kofs, d.valid, S[r]);
    } else {
#pragma unroll
      for (int i = 0; i < EPL; ++i) S[r][i] = 0.0f;
    }
  }
  run_tokens<AnyInput, G, EPL, R, RG>(p, d.c, d.seq, d.tok0, d.len, d.lane, d.kofs, d.valid, S, x,
                                      gc);
  if (!p.update_state || d.len <= 0) return;
  const uint64_t key = p.state.stochastic
                           ? detail::sr_key(p.state.seed, static_cast<uint64_t>(d.slot),
                                            p.state.layer, static_cast<uint64_t>(*p.state.step))
                           : 0;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int row = d.c.row0 + r * RG;
    store_state_fmt<G, EPL>(p.state, key, d.slot, d.c.hv, p.V, p.K, row, row < p.V, d.lane, d.kofs,
                            d.valid, S[r]);
  }
}

// ---- direct kernel: one tile per warp, state loaded straight into registers
// ----------------------

template <class StateT, int KT, bool VEC, class In>
__global__ void __launch_bounds__(128, kDirectCtasPerSm)
    recurrent_direct_kernel(const RecurrentProblem p, int warps_per_head) {
  enter_grid(p.pdl_trigger_early);
  using Lay = RowLayout<StateT, KT>;
  constexpr int G = Lay::G, EPL = Lay::EPL, RG = Lay::RG, R = Lay::ROWS;
  DirectTile d;
  TokenInputs<EPL, R> x;
  GateConsts<EPL> gc;
  if (!direct_prologue<In, G, EPL, R, RG, VEC>(p, warps_per_head, d, x, gc)) return;

  const int64_t head_elems = static_cast<int64_t>(p.V) * p.K;
  StateT* state_head = p.state.ptr ? static_cast<StateT*>(p.state.ptr) +
                                         d.slot * p.state.slot_stride + d.c.hv * head_elems
                                   : nullptr;
  float S[R][EPL];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int row = d.c.row0 + r * RG;
    if (state_head && row < p.V) {
      load_state<StateT, EPL, VEC>(state_head + static_cast<int64_t>(row) * p.K + d.kofs, d.valid,
                                   S[r]);
    } else {
#pragma unroll
      for (int i = 0; i < EPL; ++i) S[r][i] = 0.0f;
    }
  }
  run_tokens<In, G, EPL, R, RG>(p, d.c, d.seq, d.tok0, d.len, d.lane, d.kofs, d.valid, S, x, gc);
  write_state<StateT, EPL, R, RG, VEC>(p, d.c, state_head, d.len, d.kofs, d.valid, S);
}

}  // namespace
}  // namespace deltastate::cuda_backend
