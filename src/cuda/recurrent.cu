// CUDA kernels of the pooled varlen recurrent op, GDN and KDA; packed decode is its T = 1 case.
//
// Decode is memory-bound: every state element is read once and written once. Three kernels, one
// math (core/delta_math.h), chosen per call by `dispatch` at the end of this file:
//  * recurrent_decode_kernel: one token per sequence, one warp per tile of rows held in
//    registers, small register footprint; the default for decode.
//  * recurrent_stream_kernel: one token per sequence, state tiles through shared memory with bulk
//    copies, the token's preparation done once per tile by a producer warp; the default for
//    16-bit states at large batch, where the register kernels run out of instruction issue.
//  * recurrent_direct_kernel: any number of tokens per sequence (varlen), dense final states,
//    no state, read-only pools; each thread keeps its rows' slices in registers for the whole
//    sequence; fast instantiations for K = 64/128 with typed inputs, a generic one for any
//    K <= 256 and any input dtypes.
// Dot products over K are shuffle reductions inside the G lanes of a row (one transposed
// reduction for all of a thread's rows). No allocation, no host synchronization: graph-capturable.
// Measurements behind the choices: docs/PERFORMANCE.md.
#include <cstdlib>
#include <cstring>
#include <string>

#include "api/backend.h"
#include "cuda/async_copy.cuh"
#include "cuda/grid.cuh"
#include "cuda/launch.h"
#include "cuda/loads.cuh"
#include "cuda/rows.cuh"
#include "cuda/stream_trace.h"
#include "cuda/token.cuh"
#include "cuda/tuning.h"

namespace deltastate::cuda_backend {

using detail::RecurrentProblem;

namespace {

// Tile t of a grid that cuts every (sequence n, value head hv) into `blocks` row blocks: its
// sequence, value head, key head and row block. (32-bit division: tile counts are below 2^31,
// checked at launch; 64-bit division is a long software sequence on the GPU.)
struct HeadBlock {
  int head, n, hv, h, block;  // head = n*HV + hv
};
__device__ __forceinline__ HeadBlock head_block(const RecurrentProblem& p, int t, int blocks) {
  HeadBlock c;
  c.head = t / blocks;
  c.block = t - c.head * blocks;
  c.n = c.head / p.HV;
  c.hv = c.head - c.n * p.HV;
  c.h = c.hv / (p.HV / p.H);
  return c;
}

// A direct-kernel tile: sequence n, value head hv (head = n*HV + hv), this thread's first row.
// (n and head widened once here: deriving TileCoords from HeadBlock's ints instead measured
// 8-16 B of spills in the 16-bit-state direct kernels (ptxas).)
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

__device__ __forceinline__ int64_t slot_of(const RecurrentProblem& p, int64_t n) {
  return p.indices ? detail::load_index(p.indices, p.index_dtype, n) : n;
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

// Output rows (and final state) of a padded sequence: zeros; its state is never touched.
template <int EPL, int R, int RG, int G>
__device__ void write_padded(const RecurrentProblem& p, const TileCoords& c, int64_t seq,
                             int64_t tok0, int64_t len, int lane, int kofs, int valid) {
  if (lane % G == 0) {
    for (int64_t t = 0; t < len; ++t)
      zero_output_rows<R>(p.out, p.V, head_offset(p.out, seq, tok0 + t, c.hv), c.row0, RG);
  }
  if (p.final_state) store_final_state<EPL, R, RG>(p, c, kofs, valid, [](int, int) { return 0.0f; });
}

// All tokens of a tile on the state rows S (registers); `x` holds token 0's inputs on entry.
template <class In, int G, int EPL, int R, int RG>
__device__ __forceinline__ void run_tokens(const RecurrentProblem& p, const TileCoords& c,
                                           int64_t seq, int64_t tok0, int64_t len, int lane,
                                           int kofs, int valid, float (&S)[R][EPL],
                                           TokenInputs<EPL, R>& x, const GateConsts<EPL>& gc) {
  for (int64_t t = 0; t < len; ++t) {
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
        store_state<StateT, EPL, VEC>(state_head + static_cast<int64_t>(row) * p.K + kofs, valid, S[r]);
    }
  }
  if (p.final_state)
    store_final_state<EPL, R, RG>(p, c, kofs, valid, [&S](int r, int i) { return S[r][i]; });
}

// ---- direct kernel: one tile per warp, state loaded straight into registers ----------------------

template <class StateT, int KT, bool VEC, class In>
__global__ void __launch_bounds__(128, kDirectCtasPerSm) recurrent_direct_kernel(
    const RecurrentProblem p, int warps_per_head) {
  enter_grid(p.pdl_trigger_early);
  using Lay = RowLayout<StateT, KT>;
  constexpr int G = Lay::G, EPL = Lay::EPL, RG = Lay::RG, R = Lay::ROWS;
  const int lane = threadIdx.x & 31;
  const int64_t w = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (w >= p.num_heads_total() * warps_per_head) return;
  const TileCoords c = tile_coords(p, w, warps_per_head, RG * R, lane, G);
  const int kofs = (lane % G) * EPL;
  const int valid = VEC ? EPL : max(0, min(EPL, p.K - kofs));
  const int64_t seq = p.cu_seqlens ? 0 : c.n;
  const int64_t tok0 = p.cu_seqlens ? detail::load_index(p.cu_seqlens, p.cu_dtype, c.n) : 0;
  const int64_t len =
      p.cu_seqlens ? detail::load_index(p.cu_seqlens, p.cu_dtype, c.n + 1) - tok0 : p.T;
  const int64_t slot = slot_of(p, c.n);

  TokenInputs<EPL, R> x;  // token 0's inputs do not depend on the slot: issue them first
  if (len > 0) load_token<In>(p, p.g, p.beta, seq, tok0, c.h, c.hv, kofs, valid, c.row0, RG, x);
  GateConsts<EPL> gc;
  load_gate_consts(p.gate, c.hv, p.K, kofs, valid, gc);
  if (p.indices && slot < 0) {
    write_padded<EPL, R, RG, G>(p, c, seq, tok0, len, lane, kofs, valid);
    return;
  }
  if (p.check_indices && slot >= p.state.num_slots)
    trap_bad_slot("recurrent", c.n, slot, p.state.num_slots);

  const int64_t head_elems = static_cast<int64_t>(p.V) * p.K;
  StateT* state_head = p.state.ptr ? static_cast<StateT*>(p.state.ptr) + slot * p.state.slot_stride +
                                         c.hv * head_elems
                                   : nullptr;
  float S[R][EPL];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int row = c.row0 + r * RG;
    if (state_head && row < p.V) {
      load_state<StateT, EPL, VEC>(state_head + static_cast<int64_t>(row) * p.K + kofs, valid, S[r]);
    } else {
#pragma unroll
      for (int i = 0; i < EPL; ++i) S[r][i] = 0.0f;
    }
  }
  run_tokens<In, G, EPL, R, RG>(p, c, seq, tok0, len, lane, kofs, valid, S, x, gc);
  write_state<StateT, EPL, R, RG, VEC>(p, c, state_head, len, kofs, valid, S);
}

// ---- register decode kernel: one token, lean ---------------------------------------------------
//
// Decode (T = 1, no cu_seqlens, in place on the pool, no dense final-state copy): one warp per
// TPW consecutive tiles of RG*ROWS rows of one head (RowLayout: 32 state values per thread),
// state loaded straight into registers. Written for a small register footprint (at most 80 per
// thread: 24 resident warps per SM keep enough loads in flight; the multi-token direct kernel
// needs 128 and reaches 79% of copy bandwidth where this one reaches 89%; a 64-register cap
// spills and measured slower): no token loop, v loaded only by the lanes that compute u for a
// row, the reduced dots reused for u and o.
// With TPW = 2 the warp's second tile is copied into its shared memory (stage_rows_async: each
// lane its own words, so no barrier) while the first is computed from registers: the slot, the
// token and its preparation are shared by both tiles, and each warp has two tiles of state in
// flight from its start. (4 tiles per warp spilled and measured slower: fifth session, run 2.)
// Its CTAs: kDecodeCtaWarps warps, kDecodeCtasPerSm resident per SM (tuning.h).
constexpr int kDecodeWarpsPerSm = kDecodeCtaWarps * kDecodeCtasPerSm;
// Bytes of one tile (the shared memory each warp stages its second tile in, with TPW = 2).
template <class StateT, int K>
constexpr int kDecodeTileBytes =
    RowLayout<StateT, K>::RG * RowLayout<StateT, K>::ROWS * K * static_cast<int>(sizeof(StateT));

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
  const int idx = reduced_index<G, 2 * R>(lane);  // the value this lane holds after the reduction

  // The token's inputs and v (lanes holding sk_r compute u_r: they need v_r, of every tile) do
  // not depend on the slot: issued first, kept in their own type, converted after the state loads
  // have left. (Converted as loaded, each conversion made the warp wait for its load before the
  // next: index -> v -> token -> state, three round trips before the state loads; ncu, sixth
  // session. fp32 states: B=1 4.20 -> 3.98 us; 16-bit states, seventh session, run 7: GDN bf16
  // B=1 4.68 -> 4.30 us, B=8 9.05 -> 8.64, KDA bf16 B=1 6.43 -> 6.04, for 8-20 B more spill
  // stores.) The index's load has dtype branches, so it comes after them. 16-bit inputs are held
  // in their own 32-bit registers (a PRMT packing two of them waits for both loads) and v is read
  // from a clamped row, zeroed where used (ninth session, run 1, against the packed inputs and a
  // predicated v in the same call: GDN bf16 B=1 4.32 -> 4.21 us, B=8 8.76 -> 8.25, fp32 B=1-64
  // 0.5-2.8% faster; KDA bf16 B=1 unchanged).
  using InT = typename In::wide_type;
  TokenHeadInputs<EPL, InT> x_in;
  load_token_head<In>(p, p.g, p.beta, n, 0, h, hv, kofs, EPL, x_in);
  const detail::GateParams& gp = p.gate;
  InT v_in[TPW];
  const int64_t v_off = head_offset(p.v, n, 0, hv);
#pragma unroll
  for (int t = 0; t < TPW; ++t) {
    // Unconditional, from a clamped row (zeroing after a predicated load waits for it); the
    // lanes without a row of their own, or past V, zero it where it is used.
    const int vrow = row0 + t * RPW + (idx < R ? idx : 0) * RG;
    v_in[t] = load_input<In, InT>(p.v.ptr, p.v.dtype, v_off + min(vrow, p.V - 1));
  }
  const int64_t slot = slot_of(p, n);
  const int64_t o_off = head_offset(p.out, n, 0, hv);

  if (slot < 0) {  // padding: zero output, state untouched
    if (lane % G == 0)
#pragma unroll
      for (int t = 0; t < TPW; ++t) zero_output_rows<R>(p.out, p.V, o_off, row0 + t * RPW, RG);
    return;
  }
  if (p.check_indices && slot >= p.state.num_slots) trap_bad_slot("recurrent", n, slot, p.state.num_slots);
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
  // The gate inline rather than load_gate_consts + token_gate: GDN loads dt_bias once here, and
  // the shared pair costs the 16-bit-state instantiations 4 more bytes of spills (ptxas).
  const float A_log = gp.A_log ? detail::load_float(gp.A_log, gp.A_log_dtype, hv) : 0.0f;
  float alpha[EPL];
  if (gp.kda) {
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      const float dt = gp.dt_bias ? detail::load_float(gp.dt_bias, gp.dt_bias_dtype, static_cast<int64_t>(hv) * K + kofs + i) : 0.0f;
      alpha[i] = expf(detail::gate_value(gp.mode, x.g[i], dt, A_log, gp.lower_bound));
    }
  } else {
    const float dt = gp.dt_bias ? detail::load_float(gp.dt_bias, gp.dt_bias_dtype, hv) : 0.0f;
    const float a0 = expf(detail::gate_value(gp.mode, x.g[0], dt, A_log, gp.lower_bound));
#pragma unroll
    for (int i = 0; i < EPL; ++i) alpha[i] = a0;
  }
  const float beta = detail::beta_value(x.b, p.beta_is_logit, p.round_beta, p.beta.dtype);

  // The delta-rule step per tile: decay and dots, one transposed reduction of all 2R dots, u_r by
  // the lane holding sk_r, broadcast; o_r = sq_r + u_r*kq by the lane holding sq_r.
#pragma unroll
  for (int t = 0; t < TPW; ++t) {
    const int rowt = row0 + t * RPW;
    if (t > 0) {
      if (rowt - lane / G >= p.V) break;  // past the head's last row (warp-uniform)
      load_staged_rows<StateT, EPL, R>(mine, 32, rowt, RG, p.V, S);
    }
    StateT* stt = st + t * RPW * K;
    float u_here;  // meaningful on the sk lanes
    const bool v_here = idx < R && rowt + idx * RG < p.V;
    const float red = delta_step_rows<G, R>(S, alpha, x.k, x.q, v_here ? to_float(v_in[t]) : 0.0f, beta, lane, u_here, [&](int r) {
      if (rowt + r * RG < p.V) store_state<StateT, EPL, true>(stt + r * RG * K, EPL, S[r]);
    });
    store_output_rows<G, R>(p.out, o_off, p.V, rowt, RG, lane, red, u_here, kq);
  }
}

// Tiles per warp of the decode kernel (tuning.h: decode_two_tiles, the override).
int decode_tiles_per_warp(const RecurrentProblem& p, int tiles_per_head) {
  if (const int forced = forced_decode_tiles_per_warp()) return forced;
  const int64_t w1 = p.num_heads_total() * tiles_per_head;
  const int64_t cap = static_cast<int64_t>(kDecodeWarpsPerSm) * num_sms(p.device.index);
  return decode_two_tiles(w1, cap) ? 2 : 1;
}

template <class StateT, int K>
int warps_per_head_of(const RecurrentProblem& p) {  // one tile (RG*ROWS rows) per warp
  using Lay = RowLayout<StateT, K>;
  const int rows_per_warp = Lay::RG * Lay::ROWS;
  return (p.V + rows_per_warp - 1) / rows_per_warp;
}

template <class StateT, int K, class In, int TPW>
void launch_decode_tpw(const RecurrentProblem& p, int tiles, cudaStream_t stream) {
  const int wph = (tiles + TPW - 1) / TPW;
  const int64_t warps = p.num_heads_total() * wph;
  if (warps > 0x7fffffffLL) throw Error(ErrorKind::value, "recurrent: too many tiles for one launch");
  if (warps == 0) return;
  constexpr int smem = TPW == 2 ? kDecodeCtaWarps * kDecodeTileBytes<StateT, K> : 0;
  const auto ctas = static_cast<unsigned>((warps + kDecodeCtaWarps - 1) / kDecodeCtaWarps);
  launch_kernel(recurrent_decode_kernel<StateT, K, In, TPW>, ctas, kDecodeCtaWarps * 32, smem, stream,
                p.pdl, with_pdl_trigger(p, ctas, kDecodeCtasPerSm), wph);
}

template <class StateT, int K, class In>
void launch_decode(const RecurrentProblem& p, cudaStream_t stream) {
  const int tiles = warps_per_head_of<StateT, K>(p);
  if (decode_tiles_per_warp(p, tiles) == 2) return launch_decode_tpw<StateT, K, In, 2>(p, tiles, stream);
  launch_decode_tpw<StateT, K, In, 1>(p, tiles, stream);
}

// ---- streaming kernel: state tiles through shared memory with bulk copies ----------------------
//
// Decode (one token per sequence, T = 1 without cu_seqlens) at large batch. A persistent grid;
// CTA b walks tiles b, b + gridDim.x, ... (tile = TILE_ROWS rows of one (sequence, value head))
// through a ring of STAGES shared-memory stages.
//
//  * The producer warp, per tile: resolves the slot, issues one bulk load of the tile (global ->
//    shared, completing on the stage's `full` mbarrier), and meanwhile prepares the token for the
//    consumers into the stage's prep record: q normalized and scaled, k normalized, alpha (per K
//    element for KDA), v of the tile's rows, beta, k.q. It issues the bulk store (shared ->
//    global) of each tile its consumers have finished, in order, and refills a stage once that
//    store has read it. Its input loads run two tiles ahead, unconditional and unconverted (no
//    instruction waits for them before the tile that uses them).
//  * NW consumer warps compute the tile in place: the delta-rule step on their rows from the prep
//    record, the output, the new state back into the stage; then they arrive on `done`.
//
// So the bytes in flight come from the copy engine rather than from resident warps holding tiles
// in registers, and the per-token work (norms, gates, divisions, input loads and their address
// arithmetic) runs once per 16 KB tile in one warp instead of in every warp that touches the head.
// That makes it the faster kernel for 16-bit states at large batch (2 KB per register-kernel
// warp-tile there); for fp32 the register decode kernel measured faster (docs/PERFORMANCE.md).
//
// Consumer lanes: G = K/16 lanes per row, each holding 16 elements of the row in 16-byte chunks
// (chunk c of lane l starts at element c*G*CE + l*CE), so a quarter warp reads 128 contiguous
// bytes of shared memory and a row's dot products need log2(G) shuffle stages.
template <class StateT, int K>
struct StreamLayout {
  static constexpr int kEsize = static_cast<int>(sizeof(StateT));
  static constexpr int CE = 16 / kEsize;  // elements per 16-byte chunk
  static constexpr int EPL = 16;          // elements per lane
  static constexpr int CH = EPL / CE;     // chunks per lane
  static constexpr int G = K / EPL;       // lanes per row
  static constexpr int RPP = 32 / G;      // rows per warp per pass
  static constexpr int R = (kEsize == 4 || G < 8) ? 2 : 4;  // passes (rows per thread)
  static constexpr int NW = kStreamConsumerWarps;
  static constexpr int THREADS = (NW + 1) * 32;
  static constexpr int TILE_ROWS = NW * RPP * R;
  static constexpr int TILE_BYTES = TILE_ROWS * K * kEsize;  // 16 KB (8 KB for bf16, K = 64)
  static constexpr int STAGES = kStreamStageBytes / TILE_BYTES;
  static constexpr int KPL = K / 32;                  // producer lanes: K elements per lane
  static constexpr int VPL = TILE_ROWS / 32;          // producer lanes: v rows per lane
  // The prep record of a stage: q[K], k[K], alpha[K] (KDA), v[TILE_ROWS] floats, then scalars.
  static constexpr int PREP_FLOATS = 3 * K + TILE_ROWS;
  static constexpr int PREP_BYTES = PREP_FLOATS * 4 + 32;
  static constexpr int PREP_OFS = STAGES * TILE_BYTES;
  static constexpr int BAR_OFS = PREP_OFS + STAGES * PREP_BYTES;
  static constexpr int SMEM_BYTES = BAR_OFS + STAGES * (8 + 8 + 8);  // full, done, store pointer
  static_assert(G >= 2 && G <= 32 && 2 * R <= G, "K must be 64 or 128");
  static_assert(STAGES >= 2 && STAGES <= 8, "tile size");
  static_assert(PREP_BYTES % 16 == 0 && VPL >= 1, "prep record layout");
  __device__ static int elem(int lane, int c, int e) { return c * (G * CE) + (lane % G) * CE + e; }
};

// The scalars of a prep record (after its float arrays).
struct StagePrep {
  int64_t slot;     // the pool slot, or kStagePadded
  int64_t out_off;  // element offset of the token's output row of this head
  float kq, beta, alpha0;
  int vb;           // the tile's row block
};
constexpr int64_t kStagePadded = -1;

// One tile's inputs in the producer's lanes (lane l: K elements l*KPL.., rows l*VPL.. of the
// tile), loaded two tiles ahead of their use: where it lives, its slot, the token, the gate
// constants. All as loaded (InT: the inputs' wide type; the index and the gate constants as bits),
// converted by stream_prepare: a conversion where the load stands waits for it (ncu, eighth
// session: the producer stalled at the index's sign extension and the token's conversions).
template <class InT, int KPL, int VPL>
struct StreamInputs {
  HeadBlock c;
  uint64_t slot_bits;  // the index as loaded (index_of_bits); unused without indices
  TokenHeadInputs<KPL, InT> tok;
  InT v[VPL];  // rows past V: row V-1's (a load from a clamped row, so no zeroing waits for it)
  GateConsts<KPL, uint32_t> gc;
};
template <class In, int KPL, int VPL, int TILE_ROWS, class InT>
__device__ __forceinline__ void stream_load(const RecurrentProblem& p, int t, int vblocks, int lane,
                                            StreamInputs<InT, KPL, VPL>& x) {
  // Every load unconditional (loads.cuh, kZeroWord): no indices read kZeroWord (stream_slot
  // uses the sequence), GDN's scalar gate input is read by every lane's KPL entries (only the
  // first is used), rows past V read row V-1 (stream_prepare zeroes them).
  x.c = head_block(p, t, vblocks);
  const int n = x.c.n, kofs = lane * KPL;
  x.slot_bits = load_index_bits(p.indices ? p.indices : &kZeroWord, p.index_dtype, p.indices ? n : 0);
  auto ld = [](const void* ptr, DType dt, int64_t i) { return load_input<In, InT>(ptr, dt, i); };
  const int64_t q_off = head_offset(p.q, n, 0, x.c.h) + kofs;
  const int64_t k_off = head_offset(p.k, n, 0, x.c.h) + kofs;
  const int64_t g_off = head_offset(p.g, n, 0, x.c.hv);
#pragma unroll
  for (int i = 0; i < KPL; ++i) {
    x.tok.q[i] = ld(p.q.ptr, p.q.dtype, q_off + i);
    x.tok.k[i] = ld(p.k.ptr, p.k.dtype, k_off + i);
    x.tok.g[i] = ld(p.g.ptr, p.g.dtype, g_off + (p.gate.kda ? kofs + i : 0));
  }
  x.tok.b = ld(p.beta.ptr, p.beta.dtype, head_offset(p.beta, n, 0, x.c.hv));
  const int64_t v_off = head_offset(p.v, n, 0, x.c.hv);
  const int row0 = x.c.block * TILE_ROWS + lane * VPL;
#pragma unroll
  for (int r = 0; r < VPL; ++r) x.v[r] = ld(p.v.ptr, p.v.dtype, v_off + min(row0 + r, p.V - 1));
  load_gate_consts(p.gate, x.c.hv, p.K, kofs, KPL, x.gc);
}
template <class InT, int KPL, int VPL>
__device__ __forceinline__ int64_t stream_slot(const RecurrentProblem& p, const StreamInputs<InT, KPL, VPL>& x) {
  return p.indices ? index_of_bits(x.slot_bits, p.index_dtype) : x.c.n;
}

// The producer warp's token preparation into a stage's prep record (token.cuh / delta_math.h
// for the norm, the gate and beta).
template <int K, int KPL, int VPL, int TILE_ROWS, class InT>
__device__ __forceinline__ void stream_prepare(const RecurrentProblem& p,
                                               const StreamInputs<InT, KPL, VPL>& x, int64_t slot,
                                               int lane, float* rec, StagePrep* sc) {
  const TokenHeadInputs<KPL> tok = widen(x.tok);
  const GateConsts<KPL> gc = widen(p.gate, x.gc);
  float qn[KPL], kn[KPL], glog[KPL], al[KPL];
#pragma unroll
  for (int e = 0; e < KPL; ++e) {
    qn[e] = tok.q[e];
    kn[e] = tok.k[e];
  }
  const float kq = prepare_qk<KPL, 32>(qn, kn, p.l2norm, p.scale, lane);
  token_gate(p.gate, gc, tok.g, glog, al);
  static_assert(KPL == 2 || KPL == 4, "K must be 64 or 128");
  using VecK = std::conditional_t<KPL == 4, float4, float2>;
  *reinterpret_cast<VecK*>(rec + lane * KPL) = *reinterpret_cast<const VecK*>(qn);
  *reinterpret_cast<VecK*>(rec + K + lane * KPL) = *reinterpret_cast<const VecK*>(kn);
  if (p.gate.kda) *reinterpret_cast<VecK*>(rec + 2 * K + lane * KPL) = *reinterpret_cast<const VecK*>(al);
#pragma unroll
  for (int r = 0; r < VPL; ++r)
    rec[3 * K + lane * VPL + r] = x.c.block * TILE_ROWS + lane * VPL + r < p.V ? to_float(x.v[r]) : 0.0f;
  if (lane == 0) {
    sc->slot = slot < 0 ? kStagePadded : slot;
    sc->out_off = head_offset(p.out, x.c.n, 0, x.c.hv);
    sc->kq = kq;
    sc->beta = detail::beta_value(tok.b, p.beta_is_logit, p.round_beta, p.beta.dtype);
    sc->alpha0 = al[0];  // GDN's alpha (KDA reads its per-element record)
    sc->vb = x.c.block;
  }
}

// CE consecutive floats of a prep array at element `kidx` (16-byte aligned).
template <int CE>
__device__ __forceinline__ void load_prep(const float* a, int kidx, float (&x)[CE]) {
#pragma unroll
  for (int j = 0; j < CE; j += 4) {
    const float4 v = *reinterpret_cast<const float4*>(a + kidx + j);
    x[j] = v.x; x[j + 1] = v.y; x[j + 2] = v.z; x[j + 3] = v.w;
  }
}

#if DELTASTATE_CUDA_STREAM_TRACE
static_assert(StreamLayout<__nv_bfloat16, 128>::STAGES == kStreamTraceStages,
              "bench/stream_trace reads the stage cycle with the kernel's stage count");
// Trace builds only (CMake DELTASTATE_CUDA_STREAM_TRACE; bench/stream_trace.cpp reads it): the
// SM clock at each point of the pipeline (StreamTracePoint) for the first tiles of the first
// CTAs of the last streaming launch. Lane 0 of the producer and of consumer warp 0 write it.
__device__ long long g_stream_trace[kStreamTraceCtas][kStreamTraceTiles][kStreamTracePoints];
#define DS_STREAM_STAMP(tile, point)                                                  \
  do {                                                                                \
    if ((tile) < kStreamTraceTiles && static_cast<int>(blockIdx.x) < kStreamTraceCtas) \
      g_stream_trace[blockIdx.x][tile][static_cast<int>(StreamTracePoint::point)] = clock64(); \
  } while (0)
#else
#define DS_STREAM_STAMP(tile, point) \
  do {                               \
  } while (0)
#endif

template <class StateT, int K, class In>
__global__ void __launch_bounds__(StreamLayout<StateT, K>::THREADS, kStreamCtasPerSm) recurrent_stream_kernel(
    const RecurrentProblem p, int vblocks, int ntiles) {
  using Lay = StreamLayout<StateT, K>;
  constexpr int NW = Lay::NW, STAGES = Lay::STAGES, G = Lay::G, RPP = Lay::RPP, R = Lay::R;
  constexpr int CE = Lay::CE, CH = Lay::CH, KPL = Lay::KPL, VPL = Lay::VPL;
  constexpr int TILE_ROWS = Lay::TILE_ROWS;
  extern __shared__ __align__(128) unsigned char smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + Lay::BAR_OFS);
  uint64_t* done = full + STAGES;
  StateT** stage_ptr = reinterpret_cast<StateT**>(done + STAGES);
  auto tile_smem = [&](int s) { return smem + s * Lay::TILE_BYTES; };
  auto prep_rec = [&](int s) { return reinterpret_cast<float*>(smem + Lay::PREP_OFS + s * Lay::PREP_BYTES); };
  auto prep_sc = [&](int s) { return reinterpret_cast<StagePrep*>(prep_rec(s) + Lay::PREP_FLOATS); };

  enter_grid(p.pdl_trigger_early);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int n_local = (ntiles - static_cast<int>(blockIdx.x) + static_cast<int>(gridDim.x) - 1) /
                      static_cast<int>(gridDim.x);
  auto tile_id = [&](int i) { return static_cast<int>(blockIdx.x) + i * static_cast<int>(gridDim.x); };
  // Bytes of row block vb (the last one of a head may be partial).
  auto tile_bytes = [&](int vb) {
    return static_cast<uint32_t>(min(TILE_ROWS, p.V - vb * TILE_ROWS)) * K * Lay::kEsize;
  };

  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&full[s], 32);  // the producer warp's lanes (prep record written) + the tile's bytes
      mbar_init(&done[s], NW * 32);
    }
    mbar_init_fence();
  }
  __syncthreads();

  if (warp == NW) {  // ---- producer warp ----
    // Tiles in order: tile ld is loaded once the stores its consumers have finished are issued
    // and a stage is free, at most STAGES - 1 ahead of `st` (the next tile to store, in order,
    // once its consumers are done). Lane 0 issues every bulk copy; each stored tile commits one
    // bulk group (empty for padding), so tile j's store is the (st-1-j)-th most recent group, and
    // a stage is refilled once its last store has read it. Loading only STAGES - 1 ahead keeps
    // the stage being refilled one store older than the newest: refilling the stage just stored
    // would wait for that store's read (measured: ~4 us per tile per CTA, whatever the tile's
    // bytes). The inputs go two tiles ahead, in two sets of registers (a and b) that the loop
    // alternates, so that neither the tile's bulk load (its slot) nor its preparation (its token)
    // waits for a load issued just before.
    const int64_t head_elems = static_cast<int64_t>(p.V) * K;
    int st = 0;
    auto store_tile = [&] {  // lane 0: the store of tile st (its consumers are done)
      const int s = st % STAGES;
      const StagePrep* sc = prep_sc(s);
      if (sc->slot >= 0) bulk_store(stage_ptr[s], tile_smem(s), tile_bytes(sc->vb));
      bulk_commit();
      DS_STREAM_STAMP(st, store_issued);
    };
    auto store_ready = [&] {  // stores of the tiles whose consumers are done, without waiting
      for (;;) {
        int stored = 0;
        if (lane == 0 && mbar_test(&done[st % STAGES], (st / STAGES) & 1)) {
          store_tile();
          stored = 1;
        }
        if (!__shfl_sync(0xffffffffu, stored, 0)) return;
        ++st;
      }
    };
    auto store_waiting = [&] {  // the store of tile st, waiting for its consumers
      if (lane == 0) {
        mbar_wait(&done[st % STAGES], (st / STAGES) & 1);
        store_tile();
      }
      __syncwarp();
      ++st;
    };
    using InT = typename In::wide_type;
    auto load_tile = [&](int ld, StreamInputs<InT, KPL, VPL>& x) {
      if (lane == 0) DS_STREAM_STAMP(ld, producer_enter);
      if (st < ld) store_ready();
      while (ld >= st + STAGES - 1) store_waiting();  // all stages busy
      const int s = ld % STAGES;
      const int64_t slot = stream_slot(p, x);
      if (lane == 0) {
        if (ld >= STAGES) bulk_wait_read_n(st - 1 - (ld - STAGES));
        DS_STREAM_STAMP(ld, stage_free);
        if (slot >= 0) {
          if (p.check_indices && slot >= p.state.num_slots)
            trap_bad_slot("recurrent", x.c.n, slot, p.state.num_slots);
          StateT* g = static_cast<StateT*>(p.state.ptr) + slot * p.state.slot_stride +
                      x.c.hv * head_elems + static_cast<int64_t>(x.c.block) * TILE_ROWS * K;
          const uint32_t bytes = tile_bytes(x.c.block);
          stage_ptr[s] = g;
          mbar_expect_tx(&full[s], bytes);
          bulk_load(tile_smem(s), g, bytes, &full[s]);
        }
      }
      __syncwarp();  // the stage's previous prep record has been read (its store has been issued)
      stream_prepare<K, KPL, VPL, TILE_ROWS>(p, x, slot, lane, prep_rec(s), prep_sc(s));
      mbar_arrive(&full[s]);
      if (lane == 0) DS_STREAM_STAMP(ld, prepared);
      // Tile ld + 2's input loads go out after the arrive: an arrive is a release, which would
      // wait for loads still in flight before it.
      if (ld + 2 < n_local) stream_load<In, KPL, VPL, TILE_ROWS>(p, tile_id(ld + 2), vblocks, lane, x);
    };
    StreamInputs<InT, KPL, VPL> a, b;
    if (n_local > 0) stream_load<In, KPL, VPL, TILE_ROWS>(p, tile_id(0), vblocks, lane, a);
    if (n_local > 1) stream_load<In, KPL, VPL, TILE_ROWS>(p, tile_id(1), vblocks, lane, b);
    for (int ld = 0; ld < n_local; ld += 2) {
      load_tile(ld, a);
      if (ld + 1 < n_local) load_tile(ld + 1, b);
    }
    while (st < n_local) store_waiting();
    if (lane == 0) bulk_wait_all();
    return;
  }

  // ---- consumer warps ----
  const int lrow0 = warp * RPP * R + lane / G;  // tile-local row of pass 0
  for (int i = 0; i < n_local; ++i) {
    const int s = i % STAGES;
    if (threadIdx.x == 0) DS_STREAM_STAMP(i, consumer_wait);
    mbar_wait(&full[s], (i / STAGES) & 1);
    if (threadIdx.x == 0) DS_STREAM_STAMP(i, consumer_full);
    const float* rec = prep_rec(s);
    const StagePrep sc = *prep_sc(s);
    const int row0 = sc.vb * TILE_ROWS + lrow0;
    if (sc.slot < 0) {  // padding: zero output rows, no state
      mbar_arrive(&done[s]);
      if (lane % G == 0) zero_output_rows<R>(p.out, p.V, sc.out_off, row0, RPP);
      continue;
    }
    StateT* tile = reinterpret_cast<StateT*>(tile_smem(s));
    float S[R][Lay::EPL];
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
      for (int ch = 0; ch < CH; ++ch) {
        const uint4 u = *reinterpret_cast<const uint4*>(tile + (lrow0 + r * RPP) * K + Lay::elem(lane, ch, 0));
        const StateT* e = reinterpret_cast<const StateT*>(&u);
#pragma unroll
        for (int j = 0; j < CE; ++j) S[r][ch * CE + j] = to_float(e[j]);
      }
    }
    float v[R];
#pragma unroll
    for (int r = 0; r < R; ++r) v[r] = rec[3 * K + lrow0 + r * RPP];
    // The delta-rule step on the lane's R rows (core/delta_math.h), one 16-byte chunk of K at a
    // time; the dots are partial sums over the lane's chunks.
    const bool kda = p.gate.kda;
    float dots[2 * R];
#pragma unroll
    for (int j = 0; j < 2 * R; ++j) dots[j] = 0.0f;
#pragma unroll
    for (int ch = 0; ch < CH; ++ch) {
      const int kidx = Lay::elem(lane, ch, 0);
      float q[CE], k[CE], alpha[CE];
      load_prep<CE>(rec, kidx, q);
      load_prep<CE>(rec + K, kidx, k);
      if (kda) {
        load_prep<CE>(rec + 2 * K, kidx, alpha);
      } else {
#pragma unroll
        for (int j = 0; j < CE; ++j) alpha[j] = sc.alpha0;
      }
#pragma unroll
      for (int r = 0; r < R; ++r) {
        float sk, sq;
        detail::decay_and_dots(S[r] + ch * CE, alpha, k, q, std::integral_constant<int, CE>{}, sk, sq);
        dots[r] += sk;
        dots[R + r] += sq;
      }
    }
    float u[R], o;
    const int mine = finish_rows<G, R>(dots, v, sc.beta, sc.kq, lane, u, o);
#pragma unroll
    for (int ch = 0; ch < CH; ++ch) {
      float k[CE];
      load_prep<CE>(rec + K, Lay::elem(lane, ch, 0), k);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        detail::rank1_update(S[r] + ch * CE, k, std::integral_constant<int, CE>{}, u[r]);
        uint4 w;
        StateT* e = reinterpret_cast<StateT*>(&w);
#pragma unroll
        for (int j = 0; j < CE; ++j) e[j] = from_float<StateT>(S[r][ch * CE + j]);
        *reinterpret_cast<uint4*>(tile + (lrow0 + r * RPP) * K + Lay::elem(lane, ch, 0)) = w;
      }
    }
    fence_proxy_async();  // the new state is visible to the producer's bulk store
    mbar_arrive(&done[s]);
    if (threadIdx.x == 0) DS_STREAM_STAMP(i, consumer_done);
    // The output after the arrive (a release, which would wait for a store issued before it).
    if (mine >= 0 && row0 + mine * RPP < p.V)
      detail::store_float(p.out.ptr, p.out.dtype, sc.out_off + row0 + mine * RPP, o);
  }
}

// Resident CTAs per SM of a streaming instantiation (from its shared-memory footprint), once per
// device (the current one: the caller holds a DeviceGuard), after opting into its shared memory.
template <class StateT, int K, class In>
int stream_ctas_per_sm(int device) {
  using Lay = StreamLayout<StateT, K>;
  static PerDeviceOnce ctas;
  return ctas.get(device, [] {
    auto kernel = recurrent_stream_kernel<StateT, K, In>;
    DS_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Lay::SMEM_BYTES));
    DS_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                       cudaSharedmemCarveoutMaxShared));
    int n = 0;
    DS_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, Lay::THREADS, Lay::SMEM_BYTES));
    return n < 1 ? 1 : n;
  });
}

template <class StateT, int K, class In>
void launch_stream(const RecurrentProblem& p, cudaStream_t stream) {
  using Lay = StreamLayout<StateT, K>;
  const int vblocks = (p.V + Lay::TILE_ROWS - 1) / Lay::TILE_ROWS;
  const int64_t ntiles = p.num_heads_total() * vblocks;
  if (ntiles > 0x7fffffffLL) throw Error(ErrorKind::value, "recurrent: too many tiles for one launch");
  if (ntiles == 0) return;
  const int per_sm = stream_ctas_per_sm<StateT, K, In>(p.device.index);
  const int64_t max_ctas = static_cast<int64_t>(per_sm) * num_sms(p.device.index);
  const int ctas = static_cast<int>(ntiles < max_ctas ? ntiles : max_ctas);
  launch_kernel(recurrent_stream_kernel<StateT, K, In>, ctas, Lay::THREADS, Lay::SMEM_BYTES, stream,
                p.pdl, with_pdl_trigger(p, ctas, per_sm), vblocks, static_cast<int>(ntiles));
}

template <class StateT, int KT, bool VEC, class In>
void launch_direct(const RecurrentProblem& p, cudaStream_t stream) {
  const int wph = warps_per_head_of<StateT, KT>(p);
  const int64_t tiles = p.num_heads_total() * wph;
  const int warps = direct_cta_warps(tiles, num_sms(p.device.index));
  const int64_t ctas = (tiles + warps - 1) / warps;
  if (tiles > 0x7fffffffLL) throw Error(ErrorKind::value, "recurrent: too many tiles for one launch");
  const int resident_ctas = kDirectCtasPerSm * 4 / warps;  // the launch bound's 16 warps per SM
  launch_kernel(recurrent_direct_kernel<StateT, KT, VEC, In>, static_cast<unsigned>(ctas), warps * 32, 0,
                stream, p.pdl, with_pdl_trigger(p, ctas, resident_ctas), wph);
}

#if DELTASTATE_CUDA_ALL_KERNELS
// Inputs of one dtype (q, k, v, gate input, beta all of dtype t): the typed fast paths.
bool inputs_are(const RecurrentProblem& p, DType t) {
  return p.q.dtype == t && p.k.dtype == t && p.v.dtype == t && p.g.dtype == t && p.beta.dtype == t;
}
#endif

// Decode kernels: which one runs a decode-shaped problem (decode_shaped). By default the
// register decode kernel, and the streaming kernel for 16-bit states from kStreamMinHeads
// (sequence, head) pairs up (KDA: kStreamMinHeadsKda); DELTASTATE_CUDA_DECODE forces one
// (tuning.h).
// One token per sequence (T = 1, no cu_seqlens) in place on the pool (no dense final-state
// copy), 16-byte aligned rows, K = 64 or 128.
template <class StateT>
bool decode_shaped(const RecurrentProblem& p) {
  return p.T == 1 && !p.cu_seqlens && p.state.ptr && p.update_state && !p.final_state &&
         state_rows_aligned<StateT>(p.state) && (p.K == 64 || p.K == 128);
}

template <class StateT>
DecodeChoice decode_kernel_for(const RecurrentProblem& p) {
  if (!decode_shaped<StateT>(p)) return DecodeChoice::direct;
  const DecodeChoice f = forced_decode_kernel();
  if (f != DecodeChoice::automatic) return f;
  const int64_t min_heads = p.gate.kda ? kStreamMinHeadsKda : kStreamMinHeads;
  return sizeof(StateT) == 2 && p.num_heads_total() >= min_heads ? DecodeChoice::stream
                                                                 : DecodeChoice::decode;
}

template <class StateT, class In>
bool launch_decode_k(const RecurrentProblem& p, DecodeChoice c, cudaStream_t stream) {
  if (p.K == 128) {
    if (c == DecodeChoice::stream) return launch_stream<StateT, 128, In>(p, stream), true;
    return launch_decode<StateT, 128, In>(p, stream), true;
  }
#if DELTASTATE_CUDA_ALL_KERNELS
  if (p.K == 64) {
    if (c == DecodeChoice::stream) return launch_stream<StateT, 64, In>(p, stream), true;
    return launch_decode<StateT, 64, In>(p, stream), true;
  }
#endif
  return false;
}

#if DELTASTATE_CUDA_ALL_KERNELS
template <class StateT, class In>
bool launch_fast(const RecurrentProblem& p, cudaStream_t stream) {
  if (!state_rows_aligned<StateT>(p.state)) return false;
  if (p.K == 128) return launch_direct<StateT, 128, true, In>(p, stream), true;
  if (p.K == 64) return launch_direct<StateT, 64, true, In>(p, stream), true;
  return false;
}
#endif

// Kernel choice: for decode-shaped problems the register decode kernel or the streaming kernel
// (typed inputs: all bf16 or all fp32; CI builds compile only their fp32-state, K = 128,
// any-input instantiations); otherwise a direct register kernel (the multi-token path), fast when
// the inputs share one dtype, K is 64 or 128 and the rows are 16-byte aligned, else generic (any
// K <= 256, any input dtypes). DELTASTATE_CUDA_ALL_KERNELS=OFF (CI) compiles the generic ones.
template <class StateT>
void dispatch(const RecurrentProblem& p, cudaStream_t stream) {
  const DecodeChoice c = decode_kernel_for<StateT>(p);
  if (c != DecodeChoice::direct) {
#if DELTASTATE_CUDA_ALL_KERNELS
    if (inputs_are(p, DType::bf16) && launch_decode_k<StateT, TypedInput<__nv_bfloat16>>(p, c, stream)) return;
    if (inputs_are(p, DType::f32) && launch_decode_k<StateT, TypedInput<float>>(p, c, stream)) return;
#endif
    if (std::is_same_v<StateT, float> && launch_decode_k<float, AnyInput>(p, c, stream)) return;
  }
#if DELTASTATE_CUDA_ALL_KERNELS
  if (inputs_are(p, DType::bf16) && launch_fast<StateT, TypedInput<__nv_bfloat16>>(p, stream)) return;
  if (inputs_are(p, DType::f32) && launch_fast<StateT, TypedInput<float>>(p, stream)) return;
#endif
  launch_direct<StateT, 256, false, AnyInput>(p, stream);
}

}  // namespace

#if DELTASTATE_CUDA_STREAM_TRACE
void stream_trace_reset() {
  void* trace = nullptr;
  DS_CUDA_CHECK(cudaGetSymbolAddress(&trace, g_stream_trace));
  DS_CUDA_CHECK(cudaMemset(trace, 0, sizeof(g_stream_trace)));
}
std::vector<long long> stream_trace_read() {
  std::vector<long long> v(static_cast<size_t>(kStreamTraceCtas) * kStreamTraceTiles * kStreamTracePoints);
  DS_CUDA_CHECK(cudaMemcpyFromSymbol(v.data(), g_stream_trace, v.size() * sizeof(long long)));
  return v;
}
#endif

void run_recurrent(const RecurrentProblem& p, void* stream) {
  DeviceGuard guard(p.device.index);
  auto s = static_cast<cudaStream_t>(stream);
  // Without a state pool the kernel starts from zeros; the state dtype then only selects the
  // register layout, so use fp32.
  const DType sd = p.state.ptr ? p.state.dtype : DType::f32;
  switch (sd) {
    case DType::bf16: return dispatch<__nv_bfloat16>(p, s);
    case DType::f16: return dispatch<__half>(p, s);
    default: return dispatch<float>(p, s);
  }
}

}  // namespace deltastate::cuda_backend
