// Speculative verify and the state commit on a pool in its storage format (quantized float8_e4m3fn
// / int8 with per-row fp32 scales, or stochastically rounded 16-bit; docs/STATE_FORMATS.md), the
// CPU backend's rules (src/cpu/verify.cpp) on the GPU. Generic kernels, not the speed work:
//   verify_fmt_kernel  the recurrent op's formatted-state kernel (recurrent/direct.cuh: one warp
//                      per tile of a (sequence, value head), float register layout of a K tile of
//                      256) with verify's index conventions: the start state loaded dequantized,
//                      each token's state stored to the scratch (intermediate_states: a float
//                      one in the caller's dtype, rounded to nearest; a quantized one as a
//                      one-slot pool, fresh row scales, the key of scratch_key_slot(entry)) and
//                      to its per-token pool slot (quantized, the slot's key), tree tokens
//                      reloaded from the scratch (dequantized), the final state stored
//                      quantized; SGLang's cache_ring (float rings) recorded as the
//                      float kernels record it (record_ring_fmt). With FlashInfer's source
//                      pool (source_state, a float pool of any float dtype: the contract's
//                      rule) the start state and a tree token's initial state are read from it.
//   commit_fmt_kernel  each accepted scratch state requantized into its slot: one warp per state
//                      row, the row's amax a shuffle reduction, layer l's bits keyed by (seed,
//                      slot, layer0 + l, steps[l]); a quantized scratch entry of the state's
//                      dtype copied (codes and the row's scale), of the other dequantized first.
// The stores go through cuda/state_fmt.cuh, the recurrent op's; the step counters advance after
// the grid (advance_rounding_step), as on the CPU: verify's once per call whatever it stored, the
// commit's once per layer.
// Part of verify.cu's translation unit (included there only), in its anonymous namespace.
#pragma once

#include <cstdint>

#include "core/problem.h"
#include "core/state_format.h"
#include "cuda/grid.cuh"
#include "cuda/recurrent/direct.cuh"
#include "cuda/state_fmt.cuh"
#include "cuda/verify/commit.cuh"
#include "cuda/verify/multi_token.cuh"

namespace deltastate::cuda_backend {

namespace {

// The key of a slot's stochastic bits in this call (0 when rounding to nearest).
__device__ __forceinline__ uint64_t slot_key(const detail::StatePoolRef& st, uint64_t step,
                                             int64_t slot) {
  return st.stochastic ? detail::sr_key(st.seed, static_cast<uint64_t>(slot), st.layer, step) : 0;
}

// The warp's rows of `slot` stored in the pool's format (every lane takes part).
template <int G, int EPL, int R, int RG>
__device__ __forceinline__ void store_rows_fmt(const RecurrentProblem& p, const DirectTile& d,
                                               uint64_t step, int64_t slot,
                                               const float (&S)[R][EPL]) {
  const uint64_t key = slot_key(p.state, step, slot);
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int row = d.c.row0 + r * RG;
    store_state_fmt<G, EPL>(p.state, key, slot, d.c.hv, p.V, p.K, row, row < p.V, d.lane, d.kofs,
                            d.valid, S[r]);
  }
}

// The warp's rows of `slot` of pool `st` (the pool, or a float source pool) in fp32.
template <int EPL, int R, int RG>
__device__ __forceinline__ void load_rows_fmt(const RecurrentProblem& p,
                                              const detail::StatePoolRef& st, const DirectTile& d,
                                              int64_t slot, float (&S)[R][EPL]) {
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int row = d.c.row0 + r * RG;
    if (row < p.V) {
      load_state_fmt<EPL>(st, slot, d.c.hv, p.V, p.K, row, d.kofs, d.valid, S[r]);
    } else {
#pragma unroll
      for (int i = 0; i < EPL; ++i) S[r][i] = 0.0f;
    }
  }
}

// Element offset of the warp's first element of (scratch row, step) for value head hv.
__device__ __forceinline__ int64_t scratch_at(const VerifyProblem& vp, const DirectTile& d,
                                              int64_t row, int64_t step) {
  const int64_t head_elems = static_cast<int64_t>(vp.r.V) * vp.r.K;
  return row * vp.inter_row_stride + step * vp.inter_step_stride + d.c.hv * head_elems + d.kofs;
}

// SGLang's cache_ring (VerifyProblem::ring_*; the rings stay float, whatever the pool's format):
// token t's raw inputs at ring position t of the sequence's slot `home`, as the float kernels
// record them (multi_token.cuh prepare_token, the CPU's src/cpu/verify.cpp): raw v of the warp's
// rows; by the head's first tile, raw k (the first value head of each key head), the log decay g
// (token_gate, the step's own) and beta. Read again from the inputs, not run_tokens' registers.
template <int G, int EPL, int R, int RG>
__device__ __forceinline__ void record_ring_fmt(const VerifyProblem& vp, const DirectTile& d,
                                                const GateConsts<EPL>& gc, int64_t home,
                                                int64_t t) {
  const RecurrentProblem& p = vp.r;
  const int64_t tok = d.tok0 + t, L = vp.ring_len;
  const int64_t ring_at = (home * p.HV + d.c.hv) * L + t;  // [home, hv, t]
  if (d.lane % G == 0) {
    const int64_t v_off = head_offset(p.v, d.seq, tok, d.c.hv);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int row = d.c.row0 + r * RG;
      if (row < p.V)
        detail::store_float(vp.ring_v, vp.ring_v_dtype, ring_at * p.V + row,
                            detail::load_float(p.v.ptr, p.v.dtype, v_off + row));
    }
  }
  if (d.c.row0 >= RG || d.lane >= G) return;  // k, g, beta: the head's first tile, one row group
  if (d.c.hv % (p.HV / p.H) == 0) {
    const int64_t k_off = head_offset(p.k, d.seq, tok, d.c.h) + d.kofs;
    const int64_t at = ((home * p.H + d.c.h) * L + t) * p.K + d.kofs;
#pragma unroll
    for (int i = 0; i < EPL; ++i)
      if (i < d.valid)
        detail::store_float(vp.ring_k, vp.ring_k_dtype, at + i,
                            detail::load_float(p.k.ptr, p.k.dtype, k_off + i));
  }
  const int64_t g_off = head_offset(p.g, d.seq, tok, d.c.hv);
  float graw[EPL], g[EPL], alpha[EPL];
#pragma unroll
  for (int i = 0; i < EPL; ++i)
    graw[i] = (p.gate.kda ? i < d.valid : i == 0)
                  ? detail::load_float(p.g.ptr, p.g.dtype, g_off + (p.gate.kda ? d.kofs + i : 0))
                  : 0.0f;
  token_gate(p.gate, gc, graw, g, alpha);
  if (p.gate.kda) {
#pragma unroll
    for (int i = 0; i < EPL; ++i)
      if (i < d.valid) vp.ring_g[ring_at * p.K + d.kofs + i] = g[i];
  } else if (d.lane == 0) {
    vp.ring_g[ring_at] = g[0];
  }
  if (d.lane == 0)
    vp.ring_beta[ring_at] = detail::beta_value(
        detail::load_float(p.beta.ptr, p.beta.dtype, head_offset(p.beta, d.seq, tok, d.c.hv)),
        p.beta_is_logit, p.round_beta, p.beta.dtype);
}

// Verify's work around each token (run_tokens' hooks): the token's cache_ring records (RING), a
// tree token's start state, and the state after each token into the scratch row's step and its
// per-token pool slot.
template <int G, int EPL, int R, int RG, bool RING>
struct VerifyFmtHooks {
  const VerifyProblem& vp;
  const DirectTile& d;
  const GateConsts<EPL>& gc;
  int64_t start, row;  // the start slot; the scratch row (< 0: none)
  uint64_t step;       // the rounding key's step, read once per call
  __device__ __forceinline__ void before(int64_t t, float (&S)[R][EPL]) const {
    if constexpr (RING) {
      if (d.slot >= 0 && t < vp.ring_len) record_ring_fmt<G, EPL, R, RG>(vp, d, gc, d.slot, t);
    }
    if (!vp.parents.ptr || row < 0 || t == 0) return;
    const int64_t parent = vp.parents.at(d.c.n, t);
    if (parent == t - 1) return;  // its state is the one in registers
    if (parent < 0) {
      // the start slot, which a per-token store of this warp may have rewritten: its row scales
      // were written by one lane each, so order the warp's accesses first
      __syncwarp();
      return load_rows_fmt<EPL, R, RG>(vp.r, vp.source.ptr ? vp.source : vp.r.state, d, start, S);
    }
    if (quantized_state(vp.inter_dtype)) {
      // the entry's row scales were stored by one lane each (after()): order the warp first
      __syncwarp();
      const detail::StatePoolRef e = vp.inter_entry(row, parent);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int rr = d.c.row0 + r * RG;
        if (rr < vp.r.V) {
          load_state_fmt<EPL>(e, 0, d.c.hv, vp.r.V, vp.r.K, rr, d.kofs, d.valid, S[r]);
        } else {
#pragma unroll
          for (int i = 0; i < EPL; ++i) S[r][i] = 0.0f;
        }
      }
      return;
    }
    const int64_t at = scratch_at(vp, d, row, parent);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int rr = d.c.row0 + r * RG;
#pragma unroll
      for (int i = 0; i < EPL; ++i)
        S[r][i] = rr < vp.r.V && i < d.valid
                      ? detail::load_float(vp.inter, vp.inter_dtype,
                                           at + static_cast<int64_t>(rr) * vp.r.K + i)
                      : 0.0f;
    }
  }
  __device__ __forceinline__ void after(int64_t t, const float (&S)[R][EPL]) const {
    if (row >= 0 && quantized_state(vp.inter_dtype)) {
      // a quantized scratch: the entry as a one-slot pool, every lane in each row's reduction
      const detail::StatePoolRef e = vp.inter_entry(row, t);
      const uint64_t key =
          vp.r.state.stochastic
              ? detail::sr_key(vp.r.state.seed,
                               detail::scratch_key_slot(vp.inter_entry_index(row, t)),
                               vp.r.state.layer, step)
              : 0;
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int rr = d.c.row0 + r * RG;
        store_state_fmt<G, EPL>(e, key, 0, d.c.hv, vp.r.V, vp.r.K, rr, rr < vp.r.V, d.lane, d.kofs,
                                d.valid, S[r]);
      }
    } else if (row >= 0) {
      const int64_t at = scratch_at(vp, d, row, t);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int rr = d.c.row0 + r * RG;
        if (rr >= vp.r.V) continue;
#pragma unroll
        for (int i = 0; i < EPL; ++i)
          if (i < d.valid)
            detail::store_float(vp.inter, vp.inter_dtype,
                                at + static_cast<int64_t>(rr) * vp.r.K + i, S[r][i]);
      }
    }
    if (vp.token_slots.ptr) {
      const int64_t slot = vp.token_slots.at(d.c.n, t);
      if (slot >= 0) store_rows_fmt<G, EPL, R, RG>(vp.r, d, step, slot, S);
    }
  }
};

// RING: SGLang's cache_ring recorded (its own instantiation, as the float kernels' MultiRing).
template <int KT, bool RING>
__global__ void __launch_bounds__(128, kVerifyFmtCtasPerSm)
    verify_fmt_kernel(const VerifyProblem vp, int warps_per_head) {
  const RecurrentProblem& p = vp.r;
  enter_grid(p.pdl_trigger_early);
  using Lay = RowLayout<float, KT>;
  constexpr int G = Lay::G, EPL = Lay::EPL, RG = Lay::RG, R = Lay::ROWS;
  DirectTile d;
  if (!direct_tile<G, EPL, R, RG, false>(p, warps_per_head, d)) return;
  // home (d.slot): the sequence's slot; start: the slot its state starts from, or with a source
  // pool its row there (home then only receives the final state)
  const int64_t n = d.c.n, home = d.slot;
  const bool source = vp.source.ptr != nullptr;
  int64_t start = home;
  if (source) {
    start = vp.source_indices.at(n, 0);
  } else if (vp.num_accepted.ptr) {
    const int64_t a = vp.num_accepted.at(n, 0);
    start = a >= 1 && a <= vp.token_slots.cols ? vp.token_slots.at(n, a - 1) : 0;
  }
  const int64_t row = vp.inter ? (vp.inter_indices.ptr ? vp.inter_indices.at(n, 0) : n) : -1;
  const BadIndex bad = find_bad_index(vp, n, d.len, start, row, source, home);
  if (start < 0 || bad.kind) {  // padded: zero (or kept) outputs; a bad index: NaN, recorded
    if (bad.kind && d.c.hv == 0 && d.c.row0 == 0 && d.lane == 0)
      record_bad_row(p.errors, vp.err_op, bad.kind, n, bad.value, bad.limit);
    if (bad.kind || !vp.keep_padded_outputs)
      write_padded<EPL, R, RG, G>(p, d.c, d.seq, d.tok0, d.len, d.lane, d.kofs, d.valid,
                                  bad.kind ? bad_row_output() : 0.0f);
    return;
  }
  TokenInputs<EPL, R> x;
  if (d.len > 0)
    load_token<AnyInput>(p, p.g, p.beta, d.seq, d.tok0, d.c.h, d.c.hv, d.kofs, d.valid, d.c.row0,
                         RG, x);
  GateConsts<EPL> gc;
  load_gate_consts(p.gate, d.c.hv, p.K, d.kofs, d.valid, gc);
  float S[R][EPL];
  load_rows_fmt<EPL, R, RG>(p, source ? vp.source : p.state, d, start, S);
  const uint64_t step = p.state.stochastic ? static_cast<uint64_t>(*p.state.step) : 0;
  const VerifyFmtHooks<G, EPL, R, RG, RING> hooks{vp, d, gc, start, row, step};
  run_tokens<AnyInput, G, EPL, R, RG>(p, d.c, d.seq, d.tok0, d.len, d.lane, d.kofs, d.valid, S, x,
                                      gc, hooks);
  if (p.update_state && !vp.token_slots.ptr && d.len > 0) {
    const int64_t dst = vp.output_indices.ptr ? vp.output_indices.at(n, 0) : home;
    if (dst >= 0) store_rows_fmt<G, EPL, R, RG>(p, d, step, dst, S);
  }
}

// One warp per state row of an accepted entry (grid: (row chunk, request, layer)).
constexpr int kCommitFmtWarps = kCommitThreads / 32;
template <int KT>
__global__ void __launch_bounds__(kCommitThreads) commit_fmt_kernel(const detail::CommitProblem p) {
  enter_grid(false);
  using Lay = RowLayout<float, KT>;
  constexpr int G = Lay::G, EPL = Lay::EPL;
  static_assert(G == 32, "a row over one warp");
  const int64_t b = blockIdx.y, layer = blockIdx.z;
  int64_t src_at, dst_at, scale_at;
  if (!commit_entry(p, b, layer, src_at, dst_at, &scale_at)) return;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kCommitFmtWarps + (threadIdx.x >> 5);
  if (row >= p.head_elems / p.K) return;  // uniform over the warp
  const int lane = threadIdx.x & 31;
  const int kofs = lane * EPL, valid = max(0, min(EPL, p.K - kofs));
  float x[EPL];
  if (quantized_state(p.inter_dtype)) {  // a quantized scratch (1-byte codes: elements are bytes)
    const uint8_t* c = static_cast<const uint8_t*>(p.inter) + src_at + row * p.K + kofs;
    const float scale = p.inter_scales[scale_at + row];
    if (p.inter_dtype == p.dtype) {  // the pool's format already: the codes and the scale
      uint8_t* dst = static_cast<uint8_t*>(p.state) + dst_at + row * p.K + kofs;
#pragma unroll
      for (int i = 0; i < EPL; ++i)
        if (i < valid) dst[i] = c[i];
      const int64_t slot = p.slots.at(b, 0);
      if (lane == 0)
        p.scales[layer * p.scales_layer_stride + slot * p.scales_slot_stride + row] = scale;
      return;
    }
#pragma unroll
    for (int i = 0; i < EPL; ++i)
      x[i] = i < valid ? fmt::code_value(c[i], p.inter_dtype) * scale : 0.0f;
  } else {
#pragma unroll
    for (int i = 0; i < EPL; ++i)
      x[i] = i < valid ? detail::load_float(p.inter, p.inter_dtype, src_at + row * p.K + kofs + i)
                       : 0.0f;
  }
  // the layer's pool as a one-layer ref: its codes and scales, its key's layer and step
  detail::StatePoolRef st;
  st.ptr = static_cast<char*>(p.state) + layer * p.state_layer_stride;  // 1-byte codes
  st.dtype = p.dtype;
  st.slot_stride = p.state_slot_stride;
  st.scales = p.scales + layer * p.scales_layer_stride;
  st.scale_slot_stride = p.scales_slot_stride;
  st.stochastic = p.stochastic;
  st.seed = p.seed;
  st.layer = p.layer0 + static_cast<uint64_t>(layer);
  const int64_t slot = p.slots.at(b, 0);
  const uint64_t key = slot_key(st, p.stochastic ? static_cast<uint64_t>(p.steps[layer]) : 0, slot);
  store_state_fmt<G, EPL>(st, key, slot, 0, 0, p.K, static_cast<int>(row), true, lane, kofs, valid,
                          x);
}

}  // namespace
}  // namespace deltastate::cuda_backend
